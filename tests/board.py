"""The check the split kernels' tests share: a kernel's pieces put on the products' board
(where the pool's helpers take them without Python) give one thread's bits."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ember.ops.cpu import blas as _blas, engine, tuning


def pieces_on_the_board_give_one_threads_bits(compute, monkeypatch) -> None:
    """compute() run on one thread, then with its pieces on the board until a helper has
    taken some (10 s at most): the same bits each time."""
    if not _blas.enabled():
        pytest.skip("no board here (products stay with np.matmul)")
    taken = []
    run_pieces = _blas.run_pieces
    monkeypatch.setattr(_blas, "run_pieces", lambda piece, block, bounds: (
        taken.append((n := run_pieces(piece, block, bounds), len(bounds) - 1)), n)[1])
    engine.current().enter(2)
    try:
        monkeypatch.setattr(tuning, "MIN_PIECE_NS", 10 ** 12)   # one thread
        want = compute()
        assert not taken
        monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(n < of for n, of in taken):
            np.testing.assert_array_equal(compute(), want)
    finally:
        engine.current().leave()
    assert taken and any(n < of for n, of in taken)
