"""Compiled float32 GEMV by a constant weight: one row a (1, K) times B (K, N), a decoder
step's projections at batch 1.

    packed = pack(b)                       # once per constant weight (kept by the caller)
    y = product(compiled, a, packed, n)    # a @ b, (1, n)

Why: a GEMV is bound by reading its weight from memory, and OpenBLAS's sgemv on the row-major
weight, cut in column pieces (ops/cpu/blas.py), reached about half the memory's bandwidth.
Here B is packed once in blocks of LANES columns, (N / LANES, K, LANES) (ops/cpu/tiles.py's
`pack_columns`, the last block padded with zero columns), so that each block is one run of
memory read in order, and `columns_from_blocks` (ops/cpu/tiles.py's vector code) keeps
COLUMN_BLOCKS blocks of lane sums in registers along K. The blocks are split among the run's
threads; each output is the same sum in k order whoever computes it, so any thread count gives
the same bits.
"""
from __future__ import annotations

import numpy as np

from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops.cpu.tiles import LANES, columns_from_blocks


def pack(b: np.ndarray) -> np.ndarray:
    """B (K, N) float32 as column blocks (ceil(N / LANES), K, LANES), zero columns past N."""
    k, n = b.shape
    pad = -n % LANES
    if pad:
        b = np.concatenate([b, np.zeros((k, pad), np.float32)], axis=1)
    packed = _tiles.pack_columns(np.ascontiguousarray(b, np.float32))
    packed.setflags(write=False)
    return packed


def kernel():
    """`_gemv_blocks` compiled with the vector code registered, or None (no numba, or a CPU
    without AVX-512 or AVX2)."""
    return _tiles._with_vectors(_gemv_blocks)


def product(compiled, a: np.ndarray, packed: np.ndarray, n: int) -> np.ndarray:
    """a (M, K) float32 @ the weight `packed` holds (`pack`): (M, n) float32, by `compiled`
    (the `kernel()`), its column blocks split among the run's threads."""
    a = np.ascontiguousarray(a)
    blocks, k, _ = packed.shape
    out = np.empty((a.shape[0], blocks * LANES), np.float32)
    _compiled.split_rows(compiled, blocks, a, packed, out,
                         ns_per_row=tuning.GEMV_NS_PER_VALUE * LANES * k * a.shape[0],
                         piece=_gemv_piece)
    return out if n == out.shape[1] else np.ascontiguousarray(out[:, :n])


@_compiled.kernel_math  # its piece function calls it
def _gemv_blocks(a, packed, out, j0, j1):
    """out's column blocks [j0, j1) (LANES columns each) of a @ the packed weight."""
    columns_from_blocks(a, packed, out, j0 * LANES, j1 * LANES)


def _gemv_piece(block, j0, j1):  # pragma: no cover - numba
    """`_gemv_blocks`' piece function (ops/cpu/compiled.py: the helpers run its pieces without
    Python), its arguments rebuilt from the block `split_rows` made."""
    v = _compiled.array_at(block, (10,), np.int64)
    _gemv_blocks(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                 _compiled.array_at(v[3], (v[4], v[5], v[6]), np.float32),
                 _compiled.array_at(v[7], (v[8], v[9]), np.float32), j0, j1)
