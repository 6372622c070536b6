"""Products on ember's kernel pool (ember.ops.cpu.blas): OpenBLAS's GEMM / GEMV called on pieces of
a product during runs. Checked against numpy's float64 product (the oracle; float32 results
within 1e-6 of sum_k |a_ik| |b_kj|, the scale any summation order's rounding is relative to),
for every layout the pieces address (transposed operands, batches, a matrix by a stack, one row
or one column, an `out` inside a larger array), and for the same bits whichever threads call."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ember.ops.cpu import blas as _blas, compiled as _compiled, engine

pytestmark = pytest.mark.skipif(not _blas.enabled(),
                                reason="products stay with np.matmul (no numba or OpenBLAS)")


def _transposed(x: np.ndarray) -> np.ndarray:
    """x's values with its last two axes' strides swapped (BLAS's transposed layout)."""
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)


SHAPES = [((128, 512), (512, 2048)),   # rows < columns: cut by columns
          ((196, 96), (96, 576)),      # rows < columns, small weights: cut by rows
          ((600, 96), (96, 80)),       # cut by rows
          ((1, 768), (768, 6000)),     # one row: GEMVs
          ((3000, 1500), (1500, 1)),   # one column: GEMVs
          ((4, 64, 300), (4, 300, 96)),  # a batch: cut by items
          ((3, 1, 64), (3, 64, 4096)),   # a batch of rows
          ((2, 3, 40, 200), (200, 500)),  # a stack by one matrix
          ((300, 900), (2, 900, 70))]     # one matrix by a stack


@pytest.fixture
def in_a_run():
    """The products split as in a run of two threads (BLAS on one thread meanwhile)."""
    engine.current().enter(2)
    yield
    engine.current().leave()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_products_match_float64(in_a_run, monkeypatch, shapes, dtype):
    rng = np.random.default_rng(sum(map(sum, shapes)))
    a = rng.standard_normal(shapes[0]).astype(dtype)
    b = rng.standard_normal(shapes[1]).astype(dtype)
    splits = []
    on_board = _blas._on_board
    monkeypatch.setattr(_blas, "_on_board", lambda product: (
        splits.append(product[_blas._PIECES - _blas._KIND]), on_board(product)))
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    scale = np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64))
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    for a_, b_ in [(a, b), (_transposed(a), b), (a, _transposed(b)),
                   (_transposed(a), _transposed(b))]:
        got = _blas.matmul(a_, b_)
        assert got.dtype == dtype and got.shape == want.shape
        assert np.all(np.abs(got - want) <= tolerance * scale)
    assert splits and all(pieces == 2 for pieces in splits)  # the pool took them


@pytest.mark.parametrize("a_shape, b_shape, axis", [
    ((196, 96), (96, 576), _blas._ROWS),        # small weights: rows stay with their thread
    ((128, 512), (512, 2048), _blas._COLUMNS),  # 4 MB of weights: each read once
    ((64, 128), (128, 1024), _blas._COLUMNS),   # too few rows (a recurrence's inputs)
    ((600, 96), (96, 80), _blas._ROWS)])        # the longer side
def test_how_a_product_is_cut(in_a_run, a_shape, b_shape, axis):
    a, b = np.ones(a_shape, np.float32), np.ones(b_shape, np.float32)
    fields = _blas.product_fields(a, b, np.empty((a_shape[0], b_shape[1]), np.float32))
    assert fields is not None and fields[_blas._AXIS - _blas._KIND] == axis


def test_out_inside_a_larger_array(in_a_run):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 300), dtype=np.float32)
    b = rng.standard_normal((300, 500), dtype=np.float32)
    big = np.full((256, 600), 7.0, np.float32)
    out = big[:, 50:550]  # rows 600 values apart
    assert _blas.matmul(a, b, out=out) is out
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert np.all(np.abs(out - a.astype(np.float64) @ b) <= 1e-6 * scale)
    assert np.all(big[:, :50] == 7) and np.all(big[:, 550:] == 7)  # nothing written beside


def test_an_out_that_overlaps_goes_to_numpy_though_its_geometry_was_planned(in_a_run,
                                                                            monkeypatch):
    """How a geometry is cut is decided once (_blas._plan), but whether `out` overlaps an
    operand is a matter of addresses: checked on every call."""
    rng = np.random.default_rng(4)
    buffer = rng.standard_normal((2, 256, 256), dtype=np.float32)
    a, b = buffer[0], rng.standard_normal((256, 256), dtype=np.float32)
    apart = np.empty((256, 256), np.float32)
    calls = []
    on_board = _blas._on_board
    monkeypatch.setattr(_blas, "_on_board", lambda product: (calls.append(1),
                                                             on_board(product))[1])
    _blas.matmul(a, b, out=apart)
    assert calls == [1]                      # planned and cut
    want, exact = np.matmul(a, b), a.astype(np.float64) @ b
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    _blas.matmul(a, b, out=buffer[0])        # the same geometry, out is a
    assert calls == [1]                      # numpy did it (it buffers an overlapping out)
    assert np.array_equal(buffer[0], want)   # numpy's bits
    assert np.all(np.abs(apart - exact) <= 1e-6 * scale)


def test_same_bits_from_concurrent_callers(in_a_run):
    """Pieces are cut by the shape and the thread count alone: four threads calling at once
    (each taking pieces, the pool's helper busy or not) get the bits of one call alone."""
    rng = np.random.default_rng(2)
    cases = [(rng.standard_normal(sa, dtype=np.float32), rng.standard_normal(sb, dtype=np.float32))
             for sa, sb in SHAPES]
    alone = [_blas.matmul(a, b) for a, b in cases]
    results: dict[int, list[np.ndarray]] = {}

    def call(worker: int) -> None:
        results[worker] = [_blas.matmul(a, b) for _ in range(3) for a, b in cases]

    workers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for got in results.values():
        for i, value in enumerate(got):
            assert np.array_equal(value, alone[i % len(cases)])


def test_outside_runs_numpy_does_the_product():
    """Outside a run OpenBLAS has its own threads: the product is numpy's, bit for bit."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((128, 512), dtype=np.float32)
    b = rng.standard_normal((512, 2048), dtype=np.float32)
    assert np.array_equal(_blas.matmul(a, b), np.matmul(a, b))


@pytest.mark.parametrize("a_shape, b_shape", [((2, 5, 6), (3, 6, 4)), ((5, 6), (6,)),
                                              ((0, 6), (6, 4)), ((96, 1, 64), (96, 64, 129)),
                                              ((1, 768), (768, 768))])
def test_what_it_does_not_take_goes_to_numpy(in_a_run, monkeypatch, a_shape, b_shape):
    """Broadcast batches, vectors, empty products, stacks of small matrices (a decoder
    step's attention) and small GEMVs: numpy's matmul, whole (or its error)."""
    monkeypatch.setattr(_blas, "_on_board", None)  # would raise if called
    a, b = np.ones(a_shape, np.float32), np.ones(b_shape, np.float32)
    try:
        want = np.matmul(a, b)
    except ValueError:
        with pytest.raises(ValueError):
            _blas.matmul(a, b)
        return
    assert np.array_equal(_blas.matmul(a, b), want)


def test_helpers_take_pieces_from_the_board(in_a_run, monkeypatch):
    """A helper waiting for jobs takes pieces of the products posted on the board (compiled
    code, no Python job): some product's pieces are not all run by the caller."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((256, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    taken_by_caller = []
    on_board = _blas._on_board
    monkeypatch.setattr(_blas, "_on_board", lambda product: (
        taken_by_caller.append(n := on_board(product)), n)[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(n < 2 for n in taken_by_caller):
        got = _blas.matmul(a, b)
    assert any(n < 2 for n in taken_by_caller)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert np.all(np.abs(got - a.astype(np.float64) @ b) <= 1e-6 * scale)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_has_a_board_of_its_own():
    """A child forked while a parent's helper counted itself among the board's users (here
    set by hand) still runs products: the board and its lock are new in the child."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    cpu = engine.current()
    cpu.enter(2)
    try:
        want = _blas.matmul(a, b)
        board = cpu.pool.board
        board[_blas._USERS] += 1
        pid = os.fork()
        if pid == 0:  # the child: exit 0 with the parent's bits, 1 otherwise
            ok = False
            try:
                ok = bool(np.array_equal(_blas.matmul(a, b), want))
            finally:
                os._exit(0 if ok else 1)
        board[_blas._USERS] -= 1
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        cpu.leave()


def _record_piece(block, row0, row1):  # pragma: no cover - compiled: a piece function
    """Appends row0 to the int64 log at the block's address (log[0] counts the entries)."""
    log = _compiled.array_at(block, (16,), np.int64)
    log[0] += 1
    log[log[0]] = row0


@pytest.mark.parametrize("claimed, caller, helper", [
    (0, [0, 1, 2, 3, 4], None),             # the caller alone: from the first piece on
    (0, None, [4, 3, 2, 1, 0]),             # a helper alone: from the last back
    (2 + (1 << 32), [2, 3], None),          # two taken from the front and one from the back
    (1 + (2 << 32), None, [2, 1]),          # what is left, from the back
    (3 + (2 << 32), [], []),                # all taken
])
def test_the_caller_takes_pieces_from_the_front_and_helpers_from_the_back(claimed, caller,
                                                                           helper):
    """The board's pieces are claimed from both ends of one count: the caller from the first
    on, helpers from the last back, each piece once, so that over a run the caller keeps to
    the first rows of every op and a helper to the last (the cache its core wrote)."""
    run_board = _compiled.jit(_blas._join_board)
    address = _compiled.piece_address(_record_piece)
    assert run_board is not None and address is not None
    for side, want in (("caller", caller), ("helper", helper)):
        if want is None:
            continue
        log = np.zeros(16, np.int64)
        board = _blas.new_board()
        board[_blas._KIND] = _blas._KERNEL
        board[_blas._PA] = address
        board[_blas._PB] = log.__array_interface__["data"][0]
        board[_blas._PIECES] = 5
        board[_blas._BOUNDS:_blas._BOUNDS + 6] = range(6)
        board[_blas._CLAIMS] = claimed
        if side == "caller":  # as _post_and_run takes them, on a board already claimed from
            _compiled.jit(_blas._run_board)(board, False)
        else:
            board[_blas._GEN] = 2  # a product posted, not yet seen by this helper
            run_board(board, 0)
        assert list(log[1:1 + log[0]]) == want


def test_helpers_sleep_soon_after_the_last_run_returns():
    """A helper lingers on the board after a run (LINGER_PAUSES, bounded by the pauses a wait
    takes at most), then sleeps: no core stays busy once runs are over."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    pool = _compiled._thread_pool()
    engine.current().enter(2)
    try:
        for _ in range(5):
            _blas.matmul(a, b)
    finally:
        engine.current().leave()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and pool.sleeping < len(pool.threads):
        time.sleep(0.001)
    assert pool.sleeping == len(pool.threads)
