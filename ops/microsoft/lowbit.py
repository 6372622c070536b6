"""Low-bit weight-only quantisation contrib ops (com.microsoft): MatMulNBits, GatherBlockQuantized.

Both hold weights block-quantised with one scale (and optional zero point) per block of
`block_size` consecutive elements along one axis, as onnxruntime's `MatMulNBitsQuantizer` writes
them. Semantics follow onnxruntime's contrib-op documentation and, where it is silent, its CPU
provider (1.32):

- MatMulNBits: `B` is uint8 of shape (N, k_blocks, blob_size), each block's `block_size` codes of
  `bits` (2, 4, 8) bits packed along K, lowest bits first; codes past K in the last block are
  padding. Zero points are packed uint8 (N, ceil(k_blocks * bits / 8), same packing) or floats of
  the scales' type (N, k_blocks); absent, they are 2^(bits-1). `g_idx` (deprecated) gives each k
  its block of scales and zero points. The reference is `A @ ((q - zp) * scale).T + bias` in
  float32, rounded once to A's type. A zero-sized B is an omitted projection: the bias, or zeros.
  accuracy_level 4 follows what onnxruntime's CPU provider does: for a constant B with packed or
  no zero points and no g_idx (and, for 2 bits, blocks of 32 to 128: its x86 kernels), A is
  quantised to int8 per sub-block of min(block_size, 256) along K (symmetric: scale max|a|/127,
  codes round-half-even of a * (127/max|a|)), exactly as there; onnxruntime then sums
  scale_a * scale_b * (integer dot product) per sub-block, ember multiplies the dequantised
  codes by the dequantised weight: the same sum up to float32 rounding. Everything else
  computes in float32.
- GatherBlockQuantized: `data` int4/uint4 (one element per code, default zero point 0), uint8
  (codes of `bits` bits packed along the last axis, which must be the quantize axis, gathered on
  axis 0; zero points packed the same way, default 2^(bits-1)), or float8 / float4 (no zero
  points; `block_size` 0 means one block per row; scales may broadcast with dimension 1). An
  out-of-range index gives zeros, as onnxruntime 1.32 documents and does.

MatMulNBits prepares its weight once per node and keeps it on the instance (a decoder multiplies
by the same constant weights once per token): one entry, keyed by the identity of the weight
inputs and made only for constant ones (initialisers, which plans freeze read-only); threads
sharing the instance wait for the one that makes it. It costs 4 bytes per weight (float32, what
the matmul needs); the dequantisation itself runs in row chunks, so its temporaries stay small.

On the CPU engine, 4-bit constant weights in float32 arithmetic (not accuracy_level 4, no g_idx)
take two routes, chosen per call by A's rows (`lower` names them): up to NBITS_GEMV_ROWS rows
(ops/cpu/tuning.py: a decoder step) a compiled GEMV that reads the packed codes themselves
(ops/cpu/lowbit.py), split by columns among the run's threads, which keeps no float32 copy of
the weight: only the zero points unpacked to float32 (4 bytes a block), the scales too where
they are not float32 already, and for blocks of 16 codes in odd number a copy of B padded to
whole chunks; more rows (a prefill) multiply the float32 copy above with BLAS, cut on the
pool's board during runs, made at the first such call. Each route gives the same bits on any
thread count.
"""
from __future__ import annotations

import math
import threading

import ml_dtypes
import numpy as np

from ember.ops import _xp
from ember.ops.cpu import blas as _blas, lowbit as _lowbit, tuning
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register

# Elements per chunk of host-side dequantisation / int8 block products, bounding temporaries.
_CHUNK_ELEMENTS = 1 << 22

_INT4 = frozenset(np.dtype(t) for t in (ml_dtypes.int4, ml_dtypes.uint4))
_FP_CODES = frozenset(np.dtype(getattr(ml_dtypes, n)) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn")
    if hasattr(ml_dtypes, n))
_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def _is_constant(xp, x) -> bool:
    """Whether `x` may be cached by identity: on the host a read-only array (plans freeze their
    initialisers so); device arrays have no such flag, and the ones that come back by identity
    call after call are the plan's uploaded initialisers."""
    if xp is np:
        return isinstance(x, np.ndarray) and not x.flags.writeable
    return True


def _unpack(xp, packed, bits: int):
    """uint8 codes of `bits` bits packed along the last axis (lowest bits first) -> one uint8 per
    code; the last axis grows by 8 // bits."""
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = xp.arange(0, 8, bits, dtype=np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def _float32(x):
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _is_pow2_at_least_16(v: int) -> bool:
    return v >= 16 and (v & (v - 1)) == 0


# --------------------------------------------------------------------------------------------
# MatMulNBits


@register("MatMulNBits", versions=[1], domain="com.microsoft")
class MatMulNBits(OpImpl):
    """Y = A @ dequantize(B).T + bias, B block-quantised along K."""

    defaults = {"bits": 4, "accuracy_level": 0, "weight_prepacked": 0}

    def setup(self):
        for name in ("K", "N", "block_size"):
            if getattr(self, name, None) is None:
                raise self.fail(f"lacks required attribute {name}")
        self.k, self.n = int(self.K), int(self.N)
        self.block, self.nbits = int(self.block_size), int(self.bits)
        if self.k <= 0 or self.n <= 0:
            raise self.fail(f"K and N must be positive, got K={self.k}, N={self.n}")
        if self.nbits not in (2, 4, 8):
            raise self.fail(f"bits must be 2, 4 or 8, got {self.nbits}")
        if not _is_pow2_at_least_16(self.block):
            raise self.fail(f"block_size must be a power of 2 and >= 16, got {self.block}")
        if self.nbits == 2 and self.block > 256:
            raise self.fail(f"2-bit weights need block_size <= 256, got {self.block}")
        if int(self.weight_prepacked or 0) != 0:
            raise self.fail(f"weight_prepacked={self.weight_prepacked} is an execution-provider "
                            "layout (CUDA fpA_intB); only 0 (not prepacked) is supported")
        self.k_blocks = -(-self.k // self.block)
        self.blob = self.block * self.nbits // 8
        # accuracy_level 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8. Only 4 changes the CPU
        # provider's numerics: it quantises A to int8 where it has int8 kernels (x86 MLAS:
        # every block size for 4 and 8 bits, 32 to 128 for 2 bits); the rest is float32.
        self.int8 = int(self.accuracy_level or 0) == 4 and \
            (self.nbits != 2 or 32 <= self.block <= 128)
        self.a_block = min(self.block, 256)
        self._lock = threading.Lock()
        self._cached = None  # (B, scales, zero_points, g_idx, dequantised weight)
        self._gemv_cached = None  # (B, scales, zero_points, (codes, scales, zero points))

    # -- plan ---------------------------------------------------------------------------------

    def _gemv_kind(self) -> bool:
        """Whether the compiled 4-bit GEMV can compute this node's products: 4 bits, float32
        arithmetic (accuracy_level 4 quantises A, which it does not), numba serving."""
        return self.nbits == 4 and not self.int8 and _lowbit.serves()

    def _gemv_kernel(self):
        """The compiled 4-bit GEMV for this node, or None where it cannot serve."""
        return _lowbit.kernel() if self.nbits == 4 and not self.int8 else None

    def lower(self, inputs):
        a, b = inputs[0], inputs[1]
        g_idx = inputs[4] if len(inputs) > 4 else None
        if not self._gemv_kind() or b is None or b.value is None or g_idx is not None:
            return PORTABLE
        if a is None or not a.static() or a.ndim < 1:
            return _NBITS_BY_ROWS
        rows = math.prod(a.shape[:-1])
        return _NBITS_GEMV if rows <= tuning.NBITS_GEMV_ROWS else _NBITS_BLAS

    # -- weights ------------------------------------------------------------------------------

    def _check_weights(self, b, scales, zero_points, g_idx):
        n, kb = self.n, self.k_blocks
        if b.dtype != np.uint8 or b.shape != (n, kb, self.blob):
            raise self.fail(f"B must be uint8 of shape {(n, kb, self.blob)}, got {b.dtype} "
                            f"{b.shape}")
        if scales.shape not in ((n, kb), (n * kb,)):
            raise self.fail(f"scales must have shape {(n, kb)}, got {scales.shape}")
        if zero_points is not None:
            if zero_points.dtype == np.uint8:
                zb = -(-kb * self.nbits // 8)
                if zero_points.shape not in ((n, zb), (n * zb,)):
                    raise self.fail(f"packed uint8 zero_points must have shape {(n, zb)}, got "
                                    f"{zero_points.shape}")
            else:
                if zero_points.dtype != scales.dtype:
                    raise self.fail(f"zero_points must be uint8 or the scales' type "
                                    f"{scales.dtype}, got {zero_points.dtype}")
                if zero_points.shape not in ((n, kb), (n * kb,)):
                    raise self.fail(f"zero_points must have shape {(n, kb)}, got "
                                    f"{zero_points.shape}")
        if g_idx is not None:
            if g_idx.shape not in ((self.k,), (kb * self.block,)):
                raise self.fail(f"g_idx must have shape ({self.k},) or ({kb * self.block},), "
                                f"got {g_idx.shape}")

    def _block_params(self, xp, scales, zero_points):
        """Float32 scales and zero points, both (N, k_blocks)."""
        n, kb = self.n, self.k_blocks
        sc = _float32(scales.reshape(n, kb))
        if zero_points is None:
            zp = None
        elif zero_points.dtype == np.uint8:
            zp = _unpack(xp, zero_points.reshape(n, -1), self.nbits)[:, :kb]
        else:
            zp = _float32(zero_points.reshape(n, kb))
        return sc, zp

    def _codes(self, xp, b, rows):
        """The integer codes of rows `rows` of B as uint8, (rows, k_blocks * block_size)."""
        return _unpack(xp, b[rows], self.nbits).reshape(-1, self.k_blocks * self.block)

    def _dequantized(self, xp, b, scales, zero_points, g_idx):
        """The float32 weight (N, K): (q - zp) * scale, the difference exact before the one
        rounding of the product (float zero points: rounded difference)."""
        n, k, kb, bs = self.n, self.k, self.k_blocks, self.block
        sc, zp = self._block_params(xp, scales, zero_points)
        default_zp = np.float32(1 << (self.nbits - 1))
        if g_idx is not None:
            group = g_idx.astype(np.int64)[:k]
            if group.size and (int(_xp.to_host(xp, xp.min(group))) < 0
                               or int(_xp.to_host(xp, xp.max(group))) >= kb):
                raise self.fail(f"g_idx values must lie in [0, {kb})")
        out = xp.empty((n, k), dtype=np.float32)
        step = n if xp is not np else max(1, _CHUNK_ELEMENTS // (kb * bs))
        for r0 in range(0, n, step):  # chunks of rows bound the temporaries
            rows = slice(r0, min(n, r0 + step))
            w = self._codes(xp, b, rows).astype(np.float32)  # (rows, k_blocks * block)
            if g_idx is None:  # one scale per block: work on (rows, k_blocks, block) views
                blocks = w.reshape(-1, kb, bs)
                blocks -= default_zp if zp is None else zp[rows, :, None]
                blocks *= sc[rows, :, None]
                out[rows] = w[:, :k]
            else:
                w = w[:, :k]
                w -= default_zp if zp is None else xp.take(zp[rows], group, axis=1)
                w *= xp.take(sc[rows], group, axis=1)
                out[rows] = w
        return out

    def _weight(self, xp, b, scales, zero_points, g_idx):
        """The dequantised weight, from the cache when its inputs are the cached constants."""
        entry = self._cached
        if entry is not None and entry[0] is b and entry[1] is scales \
                and entry[2] is zero_points and entry[3] is g_idx:
            return entry[4]
        if not all(x is None or _is_constant(xp, x) for x in (b, scales, zero_points, g_idx)):
            self._check_weights(b, scales, zero_points, g_idx)
            return self._dequantized(xp, b, scales, zero_points, g_idx)
        with self._lock:  # one thread dequantises; the others wait for its result
            entry = self._cached
            if entry is not None and entry[0] is b and entry[1] is scales \
                    and entry[2] is zero_points and entry[3] is g_idx:
                return entry[4]
            self._check_weights(b, scales, zero_points, g_idx)
            self._cached = None  # release the old weight before making the new one
            weight = self._dequantized(xp, b, scales, zero_points, g_idx)
            self._cached = (b, scales, zero_points, g_idx, weight)
            return weight

    def _gemv_weights(self, b, scales, zero_points):
        """The 4-bit GEMV's operands, kept while the inputs are the same constants: B's rows
        as whole chunks (a view, or a padded copy for odd 16-code blocks), and float32 (N,
        k_blocks) scales and zero points (2^(bits-1) where absent)."""
        entry = self._gemv_cached
        if entry is not None and entry[0] is b and entry[1] is scales \
                and entry[2] is zero_points:
            return entry[3]
        with self._lock:  # one thread prepares them; the others wait for its result
            entry = self._gemv_cached
            if entry is not None and entry[0] is b and entry[1] is scales \
                    and entry[2] is zero_points:
                return entry[3]
            self._check_weights(b, scales, zero_points, None)
            sc, zp = self._block_params(np, scales, zero_points)
            if zp is None:
                zp = np.full(sc.shape, 1 << (self.nbits - 1), np.float32)
            prepared = (_lowbit.chunked_codes(b), np.ascontiguousarray(sc, np.float32),
                        np.ascontiguousarray(zp, np.float32))
            self._gemv_cached = (b, scales, zero_points, prepared)
            return prepared

    def _compiled_product(self, a2, b, scales, zero_points, g_idx, bias):
        """a2 @ W.T (+ bias) on the CPU engine where it serves, else None: few rows by the
        compiled 4-bit GEMV, more rows by BLAS on the dequantised copy (cut on the pool's
        board during runs). Records the kernel the call took, for `sess.kernels`."""
        compiled = self._gemv_kernel() if self.xp is np and g_idx is None else None
        if compiled is None or not (_is_constant(np, b) and _is_constant(np, scales) and (
                zero_points is None or _is_constant(np, zero_points))):
            self._chosen = PORTABLE
            return None
        if a2.shape[0] > tuning.NBITS_GEMV_ROWS:
            self._chosen = _NBITS_BLAS
            y = _blas.matmul(a2, self._weight(np, b, scales, zero_points, None).T)
            if bias is not None:
                y += _float32(bias)
            return y
        self._chosen = _NBITS_GEMV
        codes, sc, zp = self._gemv_weights(b, scales, zero_points)
        return _lowbit.gemv(compiled, np.ascontiguousarray(a2), codes, sc, zp, self.block,
                            None if bias is None else np.ascontiguousarray(_float32(bias)))

    # -- products -----------------------------------------------------------------------------

    def _int8_activations(self, xp, a):
        """a (M, K) float32 quantised to int8 per sub-block of min(block_size, 256) along K and
        dequantised again: scale max|a|/127, codes round-half-even of a * (127/max|a|), as
        onnxruntime's int8 kernels quantise A. Multiplied by the dequantised weight this is
        the sum over sub-blocks of scale_a * scale_b * (integer dot product) that those kernels
        compute, up to float32 rounding (measured <= 6e-7 relative)."""
        m, k, sub = a.shape[0], self.k, self.a_block
        n_sub = -(-k // sub)
        blocks = xp.zeros((m, n_sub * sub), dtype=np.float32)
        blocks[:, :k] = a
        blocks = blocks.reshape(m, n_sub, sub)
        amax = xp.max(xp.abs(blocks), axis=-1, keepdims=True)  # (M, sub-blocks, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = xp.where(amax != 0, np.float32(127) / amax, np.float32(0))
            codes = xp.rint(blocks * inv)  # |codes| <= 127
            codes *= amax / np.float32(127)
        return codes.reshape(m, n_sub * sub)[:, :k]

    def run(self, a, b, scales, zero_points=None, g_idx=None, bias=None):
        xp = self.xp
        if a.dtype not in _FLOATS:
            raise self.fail(f"A must be float, float16 or bfloat16, got {a.dtype}")
        if a.ndim < 1 or a.shape[-1] != self.k:
            raise self.fail(f"A's last dimension must be K={self.k}, got shape {a.shape}")
        if bias is not None and bias.shape != (self.n,):
            raise self.fail(f"bias must have shape ({self.n},), got {bias.shape}")
        out_dtype = a.dtype
        lead = a.shape[:-1]
        a2 = _float32(a.reshape(-1, self.k))
        if b.size == 0 or a2.shape[0] == 0:
            # an omitted projection (a zero-sized B): zeros, or the broadcast bias
            y = xp.zeros((a2.shape[0], self.n), dtype=np.float32)
        elif (y := self._compiled_product(a2, b, scales, zero_points, g_idx, bias)) is not None:
            return y.reshape(lead + (self.n,)).astype(out_dtype, copy=False)
        else:
            if self.int8 and g_idx is None and _is_constant(xp, b) and \
                    (zero_points is None or zero_points.dtype == np.uint8):
                a2 = self._int8_activations(xp, a2)
            y = xp.matmul(a2, self._weight(xp, b, scales, zero_points, g_idx).T)
        if bias is not None:
            y += _float32(bias)
        return y.reshape(lead + (self.n,)).astype(out_dtype, copy=False)


_NBITS_GEMV = Lowering("cpu.nbits-gemv", "few rows by constant 4-bit weights: a compiled GEMV "
                      "reading the packed codes, split by columns among the threads")
_NBITS_BLAS = Lowering("cpu.board-gemm", "many rows: BLAS on the weight dequantised once to "
                       "float32, cut in pieces on the pool's board")
_NBITS_BY_ROWS = Lowering("by geometry", "the compiled 4-bit GEMV for few rows, else BLAS on "
                          "the dequantised weight: the rows are known in the run")


# --------------------------------------------------------------------------------------------
# GatherBlockQuantized


@register("GatherBlockQuantized", versions=[1], domain="com.microsoft")
class GatherBlockQuantized(OpImpl):
    """Gather on block-quantised data, dequantising the gathered elements."""

    defaults = {"gather_axis": 0, "quantize_axis": 1, "block_size": 128, "bits": 4}

    def setup(self):
        self.g_axis, self.q_axis = int(self.gather_axis), int(self.quantize_axis)
        self.block, self.nbits = int(self.block_size), int(self.bits)
        if self.block != 0 and not _is_pow2_at_least_16(self.block):
            raise self.fail(f"block_size must be a power of 2 and >= 16 (or 0 for float8/float4 "
                            f"data), got {self.block}")

    def _axes(self, rank: int) -> tuple[int, int]:
        axes = []
        for name, axis in (("gather_axis", self.g_axis), ("quantize_axis", self.q_axis)):
            if not -rank <= axis < rank:
                raise self.fail(f"{name} {axis} is out of range for data of rank {rank}")
            axes.append(axis % rank)
        return axes[0], axes[1]

    def run(self, data, indices, scales, zero_points=None):
        xp = self.xp
        dt = data.dtype
        if dt in _INT4:
            kind = "int4"
        elif dt == np.uint8:
            kind = "uint8"
        elif dt in _FP_CODES:
            kind = "fp"
        else:
            raise self.fail(f"data must be int4, uint4, uint8, float8 or float4, got {dt}")
        if scales.dtype not in _FLOATS:
            raise self.fail(f"scales must be float, float16 or bfloat16, got {scales.dtype}")
        if indices.dtype not in (np.int32, np.int64):
            raise self.fail(f"indices must be int32 or int64, got {indices.dtype}")
        rank = data.ndim
        if rank < 1:
            raise self.fail("data must have rank >= 1")
        g, q = self._axes(rank)
        bits = self.nbits
        if kind == "int4" and bits != 4:
            raise self.fail(f"int4/uint4 data needs bits=4, got {bits}")
        if kind == "uint8":
            if bits not in (2, 4, 8):
                raise self.fail(f"uint8 data needs bits 2, 4 or 8, got {bits}")
            if g != 0 or q != rank - 1 or g == q:
                raise self.fail("uint8 data needs gather_axis 0 and quantize_axis the last "
                                "axis (and rank >= 2)")
        if kind == "fp":
            if zero_points is not None:
                raise self.fail("zero_points must not be given for float8/float4 data")
        elif self.block == 0:
            raise self.fail("block_size 0 is only valid for float8/float4 data")
        comps = 8 // bits if kind == "uint8" else 1
        shape = list(data.shape)
        shape[-1] *= comps  # uint8: codes per byte along the (quantize) last axis
        qdim = shape[q]
        block = self.block if self.block else max(qdim, 1)
        n_blocks = -(-qdim // block)

        if scales.ndim != rank:
            raise self.fail(f"scales must have rank {rank}, got shape {scales.shape}")
        for i in range(rank):
            want = n_blocks if i == q else shape[i]
            if scales.shape[i] != want and not (kind == "fp" and i != q and scales.shape[i] == 1):
                raise self.fail(f"scales of shape {scales.shape} do not match data of logical "
                                f"shape {tuple(shape)} with block_size {block} on axis {q}")
        if zero_points is not None:
            if zero_points.dtype != dt:
                raise self.fail(f"zero_points must have data's type {dt}, got "
                                f"{zero_points.dtype}")
            want = list(scales.shape)
            want[q] = -(-want[q] // comps)
            if list(zero_points.shape) != want:
                raise self.fail(f"zero_points must have shape {tuple(want)}, got "
                                f"{zero_points.shape}")

        # indices: normalised; out-of-range ones read row 0 and are zeroed afterwards
        size = data.shape[g]
        idx = indices.astype(np.int64)
        bad = (idx < -size) | (idx >= size)
        idx = xp.where(idx < 0, idx + size, idx)
        idx = xp.where(bad, 0, idx)
        ni = idx.ndim

        codes = xp.take(data, idx, axis=g)
        if kind == "uint8":
            codes = _unpack(xp, codes, bits)
        values = codes.astype(np.float32)
        qo = q if q < g else q + ni - 1  # where the quantize axis lands in the output

        def spread(p):
            """A per-block parameter (scales' layout) laid out like the output."""
            if q == g:  # the gathered index picks the block too
                return xp.take(p, idx // block, axis=g)
            if p.shape[g] == 1 and size != 1:  # broadcast scale (float8/float4 only)
                p = p.reshape(p.shape[:g] + (1,) * ni + p.shape[g + 1:])
            else:
                p = xp.take(p, idx, axis=g)
            if p.shape[qo] == 1 and n_blocks == 1:
                return p
            p = xp.repeat(p, block, axis=qo)
            return p[(slice(None),) * qo + (slice(0, qdim),)]

        if zero_points is not None:
            zp = zero_points
            if kind == "uint8":
                zp = _unpack(xp, zp, bits)[..., :n_blocks]
            values -= spread(zp.astype(np.float32))
        elif kind == "uint8":
            values -= np.float32(1 << (bits - 1))
        values *= spread(_float32(scales))
        mask = bad.reshape((1,) * g + idx.shape + (1,) * (values.ndim - g - ni))
        values = xp.where(mask, np.float32(0), values)
        return values.astype(scales.dtype, copy=False)
