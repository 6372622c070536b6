"""ai.ember::ElementwiseChain: a chain (a small DAG) of elementwise ops run as one node, made by
the simplifier's fuse_elementwise pass (simplifier/passes/fuse_elementwise.py).

    ai.ember::ElementwiseChain(X0, X1, ...) -> Y
        ops:    STRINGS  one op name a step, from OPS (the whitelist below)
        args:   INTS     each step's operands, OPS[name].arity of them in turn: slot k < n is
                         input Xk, slot n + i the result of step i (an earlier step)
        params: FLOATS   each step's constant parameters, OPS[name].params of them in turn
                         (LeakyRelu: alpha; HardSigmoid: alpha, beta; Clip: min, max)

Y is the last step's result. Inputs broadcast as ONNX's multidirectional broadcasting does (the
pass fuses only where each input broadcasts into Y's shape), and each step computes what the
ONNX op it stands for computes, with the same numpy operations in the portable kernel.

On the CPU with numba the program becomes one loop over Y's elements (`ChainKernels`): its
source is assembled from the per-op templates of OPS only (no name or string from a model
reaches it) and the parameters are the kernel's arguments, so one compiled kernel serves every
node with the same program, whatever its constants. Its arithmetic is float32 in the unfused
ops' order, so most steps give numpy's bits; exp, tanh and sigmoid use compiled.exp_float32 and
tanh_float32 (within 3 ulp of numpy's), sin, cos, log and pow the C library's float32 functions
(within 3 ulp). Where a formula cancels (a tanh-GELU's 1 + tanh(t) for t well below 0) those
ulps grow relative to a small result, as numpy's own do against the exact value.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from ember import config
from ember.ops import activations as _act, elementwise as _elementwise
from ember.ops._layout import as_run, memory_order, memory_span, moved
from ember.ops._lowering import compiled_rows
from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops.cpu.compiled import exp_float32, tanh_float32
from ember.ops.activations import sigmoid_float32
from ember.ops.elementwise import _ERF32_P, _ERF32_Q, erf
from ember.ops.fused import DOMAIN
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register

OP_TYPE = "ElementwiseChain"


class Step(NamedTuple):
    """One whitelisted op: `kinds`, per operand, the value kinds it takes ("f" float32, "b"
    bool, "i" an integer input), `result` the kind it makes; `template` its expression in the
    compiled loop ({0}, {1}, {2}: operands; {p0}, {p1}: parameters); `portable` the numpy
    form, fn(xp, operands, parameters)."""
    arity: int
    params: int
    kinds: tuple[str, ...]
    result: str
    template: str
    portable: Callable


def _quiet(fn):
    """fn run with numpy's floating-point warnings off, as the unfused kernels run it."""
    def run(xp, a, p):
        with np.errstate(all="ignore"):
            return fn(xp, a, p)
    return run


def _clip(xp, x, lo, hi):
    return xp.minimum(xp.maximum(x, np.float32(lo)), np.float32(hi))


_F, _FF, _B, _BB = ("f",), ("f", "f"), ("b",), ("b", "b")
# The whitelist: every op a chain may hold. The pass maps ONNX nodes onto these names; nothing
# else is ever compiled.
OPS: dict[str, Step] = {
    "Identity":    Step(1, 0, _F, "f", "{0}", lambda xp, a, p: a[0]),
    "Neg":         Step(1, 0, _F, "f", "-{0}", lambda xp, a, p: xp.negative(a[0])),
    "Abs":         Step(1, 0, _F, "f", "abs({0})", lambda xp, a, p: xp.abs(a[0])),
    "Relu":        Step(1, 0, _F, "f", "max_like_numpy({0}, ZERO)",
                        lambda xp, a, p: xp.maximum(a[0], xp.zeros((), a[0].dtype))),
    "Sigmoid":     Step(1, 0, _F, "f", "sigmoid_float32({0})",
                        lambda xp, a, p: _act.Sigmoid.fn(xp, a[0])),
    "Tanh":        Step(1, 0, _F, "f", "tanh_float32({0})",
                        _quiet(lambda xp, a, p: xp.tanh(a[0]))),
    "Exp":         Step(1, 0, _F, "f", "exp_float32({0})",
                        _quiet(lambda xp, a, p: xp.exp(a[0]))),
    "Log":         Step(1, 0, _F, "f", "np.log({0})", _quiet(lambda xp, a, p: xp.log(a[0]))),
    "Sqrt":        Step(1, 0, _F, "f", "np.sqrt({0})", _quiet(lambda xp, a, p: xp.sqrt(a[0]))),
    "Sin":         Step(1, 0, _F, "f", "np.sin({0})", _quiet(lambda xp, a, p: xp.sin(a[0]))),
    "Cos":         Step(1, 0, _F, "f", "np.cos({0})", _quiet(lambda xp, a, p: xp.cos(a[0]))),
    "Reciprocal":  Step(1, 0, _F, "f", "ONE / {0}",
                        _quiet(lambda xp, a, p: xp.reciprocal(a[0]))),
    "Floor":       Step(1, 0, _F, "f", "np.floor({0})", lambda xp, a, p: xp.floor(a[0])),
    "Ceil":        Step(1, 0, _F, "f", "np.ceil({0})", lambda xp, a, p: xp.ceil(a[0])),
    "Erf":         Step(1, 0, _F, "f", "erf_float32({0})", _quiet(lambda xp, a, p: erf(xp, a[0]))),
    "Gelu":        Step(1, 0, _F, "f", "gelu_erf_float32({0})",
                        _quiet(lambda xp, a, p: _act.gelu(xp, a[0]))),
    "GeluTanh":    Step(1, 0, _F, "f", "gelu_tanh_float32({0})",
                        _quiet(lambda xp, a, p: _act.gelu(xp, a[0], tanh=True))),
    "HardSwish":   Step(1, 0, _F, "f", "{0} * clip_like_numpy({0} / SIX + HALF, ZERO, ONE)",
                        lambda xp, a, p: _act.HardSwish.fn(xp, a[0])),
    "HardSigmoid": Step(1, 2, _F, "f", "clip_like_numpy({p0} * {0} + {p1}, ZERO, ONE)",
                        _quiet(lambda xp, a, p: xp.clip(p[0] * a[0] + p[1], 0, 1))),
    "LeakyRelu":   Step(1, 1, _F, "f", "({0} if {0} >= ZERO else {p0} * {0})",
                        _quiet(lambda xp, a, p: xp.where(a[0] >= 0, a[0], p[0] * a[0]))),
    "Clip":        Step(1, 2, _F, "f", "min_like_numpy(max_like_numpy({0}, {p0}), {p1})",
                        _quiet(lambda xp, a, p: _clip(xp, a[0], p[0], p[1]))),
    "Add":         Step(2, 0, _FF, "f", "{0} + {1}", lambda xp, a, p: xp.add(a[0], a[1])),
    "Sub":         Step(2, 0, _FF, "f", "{0} - {1}", lambda xp, a, p: xp.subtract(a[0], a[1])),
    "Mul":         Step(2, 0, _FF, "f", "{0} * {1}", lambda xp, a, p: xp.multiply(a[0], a[1])),
    "Div":         Step(2, 0, _FF, "f", "{0} / {1}",
                        _quiet(lambda xp, a, p: xp.divide(a[0], a[1]))),
    "Pow":         Step(2, 0, _FF, "f", "{0} ** {1}",
                        _quiet(lambda xp, a, p: xp.power(a[0], a[1]))),
    "Max":         Step(2, 0, _FF, "f", "max_like_numpy({0}, {1})",
                        lambda xp, a, p: xp.maximum(a[0], a[1])),
    "Min":         Step(2, 0, _FF, "f", "min_like_numpy({0}, {1})",
                        lambda xp, a, p: xp.minimum(a[0], a[1])),
    "Equal":       Step(2, 0, _FF, "b", "{0} == {1}", lambda xp, a, p: xp.equal(a[0], a[1])),
    "Greater":     Step(2, 0, _FF, "b", "{0} > {1}", lambda xp, a, p: xp.greater(a[0], a[1])),
    "Less":        Step(2, 0, _FF, "b", "{0} < {1}", lambda xp, a, p: xp.less(a[0], a[1])),
    "GreaterOrEqual": Step(2, 0, _FF, "b", "{0} >= {1}",
                           lambda xp, a, p: xp.greater_equal(a[0], a[1])),
    "LessOrEqual": Step(2, 0, _FF, "b", "{0} <= {1}",
                        lambda xp, a, p: xp.less_equal(a[0], a[1])),
    "Not":         Step(1, 0, _B, "b", "(not {0})", lambda xp, a, p: xp.logical_not(a[0])),
    "And":         Step(2, 0, _BB, "b", "({0} & {1})",
                        lambda xp, a, p: xp.logical_and(a[0], a[1])),
    "Or":          Step(2, 0, _BB, "b", "({0} | {1})", lambda xp, a, p: xp.logical_or(a[0], a[1])),
    "Xor":         Step(2, 0, _BB, "b", "({0} != {1})",
                        lambda xp, a, p: xp.logical_xor(a[0], a[1])),
    "Where":       Step(3, 0, ("b", "f", "f"), "f", "({1} if {0} else {2})",
                        lambda xp, a, p: xp.where(a[0], a[1], a[2])),
    # Cast to float32 (from float32, bool or an integer input) and to bool (from float32)
    "CastFloat":   Step(1, 0, ("fbi",), "f", "np.float32({0})",
                        lambda xp, a, p: a[0].astype(np.float32)),
    "CastBool":    Step(1, 0, _F, "b", "({0} != ZERO)", lambda xp, a, p: a[0].astype(bool)),
}

_KIND_OF_DTYPE = {np.dtype(np.float32): "f", np.dtype(bool): "b", np.dtype(np.int32): "i",
                  np.dtype(np.int64): "i"}


def kind_of(dtype) -> str | None:
    """The value kind of a chain input of `dtype` ("f", "b", "i"), or None if none."""
    return _KIND_OF_DTYPE.get(np.dtype(dtype)) if dtype is not None else None


def result_kinds(ops: list[str], args: list[int], input_kinds: list[str]) -> list[str] | None:
    """The kind of each step's result for inputs of `input_kinds`, or None where a step is
    given an operand of a kind it does not take (or an unknown op or slot)."""
    kinds = list(input_kinds)
    at = 0
    for name in ops:
        step = OPS.get(name)
        if step is None or at + step.arity > len(args):
            return None
        for slot, allowed in zip(args[at:at + step.arity], step.kinds):
            if not 0 <= slot < len(kinds) or kinds[slot] not in allowed:
                return None
        at += step.arity
        kinds.append(step.result)
    return kinds[len(input_kinds):] if at == len(args) else None


# ------------------------------------------------------------------ math for the compiled loop
# Written in float32 throughout (numba would widen a Python float or int constant to float64).
ZERO, HALF, ONE, SIX, FOUR = (np.float32(v) for v in (0, 0.5, 1, 6, 4))
_P = tuple(np.float32(c) for c in _ERF32_P)
_Q = tuple(np.float32(c) for c in _ERF32_Q)
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = _P
_Q0, _Q1, _Q2, _Q3, _Q4 = _Q


@_compiled.kernel_math
def max_like_numpy(a, b):
    """np.maximum of two float32s: NaN from either side, and `b` where they compare equal
    (np.maximum(-0.0, 0.0) is 0.0, np.maximum(0.0, -0.0) is -0.0)."""
    return a if a > b or a != a else b


@_compiled.kernel_math
def min_like_numpy(a, b):
    """np.minimum of two float32s, with np.maximum's rules for NaN and equal values."""
    return a if a < b or a != a else b


@_compiled.kernel_math
def clip_like_numpy(x, lo, hi):
    """np.clip of a float32 (x itself where within the bounds, NaN kept; hi where lo > hi)."""
    t = lo if x < lo else x
    return hi if t > hi else t


@_compiled.kernel_math
def erf_float32(x):
    """elementwise.erf_float32_block's operations for one float32, in its order: its bits."""
    z = -FOUR if x < -FOUR else (FOUR if x > FOUR else x)
    z2 = z * z
    num = ((((((_P0 * z2 + _P1) * z2 + _P2) * z2 + _P3) * z2 + _P4) * z2 + _P5) * z2
           + _P6) * z
    den = (((_Q0 * z2 + _Q1) * z2 + _Q2) * z2 + _Q3) * z2 + _Q4
    return num / den


# The names the generated source may use: these, and the variables it makes itself.
_KERNEL_GLOBALS = {
    "np": np, "ZERO": ZERO, "HALF": HALF, "ONE": ONE, "SIX": SIX,
    "max_like_numpy": max_like_numpy, "min_like_numpy": min_like_numpy,
    "clip_like_numpy": clip_like_numpy, "sigmoid_float32": sigmoid_float32,
    "erf_float32": erf_float32, "exp_float32": exp_float32, "tanh_float32": tanh_float32,
    "gelu_erf_float32": _act.gelu_erf_float32, "gelu_tanh_float32": _act.gelu_tanh_float32,
    "array_at": _compiled.array_at,
}

# An input's part of a row: "f" has Y's shape (Y's own elements), "v" varies along the
# innermost run (from its row offset), "c" is constant along it (one value a row). The row's
# parts are taken as slices before the loop over it: indexing the whole arrays from an offset
# inside the loop kept LLVM from vectorising it (3x slower).
_ROW = {"f": "x{k}[base:base + count]", "v": "x{k}[o{k} + lo:o{k} + lo + count]",
        "c": "x{k}[o{k}]"}


def kernel_source(ops: tuple[str, ...], args: tuple[int, ...], modes: tuple[str, ...]) -> str:
    """The Python source of the loop for a program and its inputs' read modes: assembled from
    OPS' templates and fixed text only, every variable name made here."""
    n = len(modes)
    inputs = ", ".join(f"x{k}" for k in range(n))
    offsets = [k for k, mode in enumerate(modes) if mode != "f"]
    n_params = sum(OPS[name].params for name in ops)
    lines = [f"def chain_kernel(out, inner, nsub, chunk, dims, strides, prm, {inputs}, "
             "row0, row1):"]
    lines += [f"    p{i} = prm[{i}]" for i in range(n_params)]
    lines += ["    for r in range(row0, row1):",
              "        ro = r // nsub",
              "        lo = (r - ro * nsub) * chunk",
              "        count = min(chunk, inner - lo)",
              "        base = ro * inner + lo"]
    if offsets:
        lines += [f"        o{k} = 0" for k in offsets]
        lines += ["        rem = ro",
                  "        for d in range(dims.shape[0] - 1, -1, -1):",
                  "            q = rem % dims[d]",
                  "            rem //= dims[d]"]
        lines += [f"            o{k} += q * strides[{k}, d]" for k in offsets]
    lines += [f"        r{k} = " + _ROW[mode].format(k=k) for k, mode in enumerate(modes)]
    lines += ["        row = out[base:base + count]",
              "        for j in range(count):"]
    lines += [f"            v{k} = r{k}" + ("" if mode == "c" else "[j]")
              for k, mode in enumerate(modes)]
    values = [f"v{k}" for k in range(n)]
    at = param = 0
    for i, name in enumerate(ops):
        step = OPS[name]
        operands = [values[s] for s in args[at:at + step.arity]]
        params = {f"p{j}": f"p{param + j}" for j in range(step.params)}
        lines.append(f"            t{i} = " + step.template.format(*operands, **params))
        values.append(f"t{i}")
        at += step.arity
        param += step.params
    lines.append(f"            row[j] = {values[-1]}")
    return "\n".join(lines) + "\n"


# The dtypes a piece function rebuilds its arrays as, by name in the generated source: the
# chain's input kinds' dtypes (_KIND_OF_DTYPE) and its results'.
_DTYPE_NAMES = {np.dtype(np.float32): "np.float32", np.dtype(bool): "np.bool_",
                np.dtype(np.int32): "np.int32", np.dtype(np.int64): "np.int64"}


def piece_source(dtypes: tuple[np.dtype, ...], result: np.dtype) -> str:
    """The source of `chain_piece(block, row0, row1)`, the loop's piece function (compiled.py's
    board runs it without Python): chain_kernel's arguments rebuilt from the block that
    compiled.piece_block packs of (out, inner, nsub, chunk, dims, strides, prm, x0, ...),
    each array 1-D but strides (2-D)."""
    n = len(dtypes)
    lines = ["def chain_piece(block, row0, row1):",
             f"    v = array_at(block, ({12 + 2 * n},), np.int64)",
             f"    out = array_at(v[0], (v[1],), {_DTYPE_NAMES[np.dtype(result)]})",
             "    dims = array_at(v[5], (v[6],), np.int64)",
             "    strides = array_at(v[7], (v[8], v[9]), np.int64)",
             "    prm = array_at(v[10], (v[11],), np.float32)"]
    lines += [f"    x{k} = array_at(v[{12 + 2 * k}], (v[{13 + 2 * k}],), "
              f"{_DTYPE_NAMES[np.dtype(d)]})" for k, d in enumerate(dtypes)]
    inputs = ", ".join(f"x{k}" for k in range(n))
    lines.append(f"    chain_kernel(out, v[2], v[3], v[4], dims, strides, prm, {inputs}, "
                 "row0, row1)")
    return "\n".join(lines) + "\n"


_SMALL = Lowering("numpy", "small tensors: numpy's operations one by one cost less than "
                  "the compiled loop's call")


def _small(inputs) -> bool:
    """Whether every input is below CHAIN_COMPILED_MIN values (a decoding step's vectors),
    where the compiled loop's fixed cost a call is more than numpy's passes."""
    least = tuning.CHAIN_COMPILED_MIN
    return all(getattr(x, "size", 1) < least for x in inputs)


class ChainKernels:
    """Compiled loops by (program, read modes): one compilation serves every node of the same
    program (a YOLO's 58 SiLUs share one), so the op class holds one of these for the process,
    as compiled.jit's memo is the process's. Thread-safe: sessions shared by threads may ask
    for a kernel at once.

    numba caches on disk only functions defined in a file, so each loop's source is written
    to ember's cache folder (config.cache_root()/chains), named by a hash of it and of the
    files whose functions it calls: a later process loads the compiled loop instead of
    compiling it again (~0.5 s a program). Where that folder cannot be written, the loop is
    compiled from memory."""

    def __init__(self):
        self._kernels: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._stamp: str | None = None   # the hash of the files the loops call into

    def get(self, ops: tuple[str, ...], args: tuple[int, ...], modes: tuple[str, ...],
            dtypes: tuple[np.dtype, ...], result: np.dtype) -> tuple[Any, Any]:
        """(the compiled kernel, its piece function for the board), or (None, None) without
        numba; the piece function None where its source could not be written to a file."""
        key = (ops, args, modes, dtypes, result)
        kernel = self._kernels.get(key)
        if kernel is None:
            with self._lock:
                if key not in self._kernels:
                    self._kernels[key] = self._compile(
                        kernel_source(ops, args, modes) + "\n\n" + piece_source(dtypes, result))
                kernel = self._kernels[key]
        return kernel

    def _compile(self, source: str) -> tuple[Any, Any]:
        numba = _compiled._numba() if _compiled.enabled() else None
        if numba is None:
            return None, None
        _compiled._register_math(numba)
        options = dict(nogil=True, boundscheck=False, error_model="numpy")
        module = self._from_file(source)
        if module is not None:
            # the piece function calls the module's chain_kernel by name: compiled, first
            module.chain_kernel = numba.njit(cache=True, **options)(module.chain_kernel)
            return module.chain_kernel, module.chain_piece
        namespace = dict(_KERNEL_GLOBALS)
        exec(compile(source, "<ember elementwise chain>", "exec"), namespace)
        return numba.njit(**options)(namespace["chain_kernel"]), None

    def _from_file(self, source: str) -> Any:
        """The module defined by `source` written to a file of the cache folder, or None where
        it cannot be written."""
        if self._stamp is None:
            digest = hashlib.sha256()
            for module in (_compiled, _act, _elementwise, sys.modules[__name__]):
                with open(module.__file__, "rb") as f:
                    digest.update(f.read())
            self._stamp = digest.hexdigest()
        name = "chain_" + hashlib.sha256((self._stamp + source).encode()).hexdigest()[:24]
        folder = os.path.join(config.cache_root(), "chains")
        path = os.path.join(folder, name + ".py")
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            try:
                with open(path) as f:
                    current = f.read()
            except FileNotFoundError:
                current = None
            if current != source:   # absent, or not what this hash names: written anew
                temporary = f"{path}.{os.getpid()}.{threading.get_ident()}"
                with open(temporary, "w") as f:
                    f.write(source)
                os.replace(temporary, path)
            module_name = "_ember_" + name
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            module.__dict__.update(_KERNEL_GLOBALS)
            spec.loader.exec_module(module)
        except (OSError, SyntaxError, ImportError):
            return None
        # numba's cached code finds its globals by importing the function's module by name
        sys.modules[module_name] = module
        return module


# Elements a row of the compiled loop covers at most: Y's innermost run is cut into rows of
# this many, so that even a flat Y is shared among the threads.
_CHUNK = 1 << 14
# The loop's time per element and step, roughly (split_rows' estimate; float32, one core).
_NS_PER_STEP = 0.4


class Layout(NamedTuple):
    """How the compiled loop walks Y for one set of input shapes."""
    shape: tuple[int, ...]       # Y's
    modes: tuple[str, ...]       # per input: "f", "v" or "c" (see _READ)
    inner: int                   # the innermost run's length
    dims: np.ndarray             # the outer dims (int64), outermost first
    strides: np.ndarray          # (inputs, outer dims): each input's element stride in them


def layout(shapes: list[tuple[int, ...]], element_strides: list | None = None
           ) -> Layout | None:
    """The loop's layout for inputs of `shapes`, or None where they do not broadcast (or a
    strided input's values along the innermost run are not contiguous).

    `element_strides`, per input, its strides in values along its own axes, or None for a
    C-ordered input (all of them without the list): a view read where it lies, a Split's
    channel slice of an image. Y's dims of size 1 are dropped and neighbouring dims where
    every input either follows Y or is broadcast alike, and each that follows runs on in
    memory from one to the next, are merged; the last merged dim is the innermost run, the
    others are walked row by row with per-input strides."""
    try:
        out = tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        return None
    rank = len(out)
    aligned = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    given = element_strides or [None] * len(shapes)
    steps = []   # per input, its stride in values along each of Y's axes (0: broadcast)
    for s, st in zip(aligned, given):
        if st is None:
            st, run = [], 1
            for d in reversed(s):
                st.append(run)
                run *= d
            st = st[::-1]
        else:
            st = [0] * (rank - len(st)) + list(st)
        steps.append([st[a] if s[a] != 1 else 0 for a in range(rank)])
    merged: list[list] = []   # [size, pattern, strides]: strides per input, the inner axis's
    for axis, size in enumerate(out):
        if size == 1:
            continue
        pattern = tuple(s[axis] != 1 for s in aligned)
        here = [st[axis] for st in steps]
        if merged and merged[-1][1] == pattern and all(
                prev == cur * size for prev, cur in zip(merged[-1][2], here)):
            merged[-1][0] *= size
            merged[-1][2] = here
        else:
            merged.append([size, pattern, here])
    if not merged:
        merged = [[1, tuple(False for _ in shapes), [0] * len(shapes)]]
    inner, last, inner_steps = merged[-1]
    outer = merged[:-1]
    dense = [1] * len(outer)   # Y's own strides over the outer dims
    for d in range(len(outer) - 2, -1, -1):
        dense[d] = dense[d + 1] * outer[d + 1][0]
    dense = [d * inner for d in dense]
    modes = []
    strides = np.zeros((len(shapes), len(outer)), np.int64)
    for k in range(len(shapes)):
        if last[k] and inner_steps[k] != 1:
            return None   # the innermost run not contiguous: the caller copies it
        follows = all(p[k] for _, p, _ in merged)
        if follows and all(st[k] == y for (_, _, st), y in zip(outer, dense)):
            modes.append("f")
            continue
        modes.append("v" if last[k] else "c")
        for d, (_, pattern, st) in enumerate(outer):
            strides[k, d] = st[k] if pattern[k] else 0
    return Layout(out, tuple(modes), inner,
                  np.array([size for size, _, _ in outer], np.int64), strides)


class _Route(NamedTuple):
    """The compiled loop's call for one set of input geometries (ElementwiseChain._route)."""
    order: tuple[int, ...] | None    # the inputs' axes in memory order (in_memory_order)
    back: tuple[int, ...] | None     # the transpose taking the result back
    shape: tuple[int, ...]           # the result's, in memory order
    out_dtype: np.dtype
    kernel: Any
    piece: Any
    rows: int                        # the loop's rows, split among the threads
    ns_per_row: float                # split_rows' estimate
    sizes: tuple                     # (inner, nsub, chunk, dims, strides): the loop's
    spans: tuple                     # per input: values from its first to its last, where it
    #                                  is read where it lies (a strided view); else None


@register(OP_TYPE, versions=[1], domain=DOMAIN)
class ElementwiseChain(OpImpl):
    defaults = {"ops": [], "args": [], "params": []}
    kernels = ChainKernels()   # the process's compiled loops (see ChainKernels)

    def setup(self):
        self.steps = [o.decode() if isinstance(o, bytes) else str(o) for o in (self.ops or ())]
        self.slots = [int(a) for a in (self.args or ())]
        self.constants = [float(p) for p in (self.params or ())]
        unknown = [name for name in self.steps if name not in OPS]
        if unknown or not self.steps:
            raise self.fail(f"unknown step(s) {unknown}" if unknown else "no steps")
        if sum(OPS[s].arity for s in self.steps) != len(self.slots) or \
                sum(OPS[s].params for s in self.steps) != len(self.constants):
            raise self.fail("args or params do not match the steps' operands")
        at, available = 0, self.n_inputs
        for name in self.steps:   # each operand an input or an earlier step's result
            arity = OPS[name].arity
            if not all(0 <= s < available for s in self.slots[at:at + arity]):
                raise self.fail(f"step {name} reads a slot not yet computed")
            at += arity
            available += 1
        self._program = (tuple(self.steps), tuple(self.slots))
        self._prm = np.array(self.constants, np.float32)

    def run(self, *inputs):
        small = _small(inputs)
        self._chosen = _SMALL if small else None   # what this run took, for sess.kernels
        if self.xp is np and not small:
            y = self._compiled(inputs)
            if y is not None:
                return y
        return self.portable(inputs)

    def portable(self, inputs):
        """The program step by step with the array namespace's operations."""
        xp = self.xp
        values = list(inputs)
        at = param = 0
        for name in self.steps:
            step = OPS[name]
            values.append(step.portable(xp, [values[s] for s in self.slots[at:at + step.arity]],
                                        self.constants[param:param + step.params]))
            at += step.arity
            param += step.params
        y = values[-1]
        return y.copy() if any(y is x for x in inputs) else y  # never an input itself

    def _compiled(self, inputs) -> np.ndarray | None:
        """The compiled loop's result, or None where it does not serve (no numba, input dtypes
        the program does not take, shapes that do not broadcast)."""
        signature = tuple((getattr(x, "shape", None), getattr(x, "strides", None),
                           getattr(x, "dtype", None)) for x in inputs) \
            + (_compiled.run_threads(),)
        last = self.__dict__.get("_last_route")
        if last is not None and last[0] == signature:
            route = last[1]
        else:
            route = self._route(inputs)
            if route is not None:   # one tuple, replaced whole: threads read old or new
                self._last_route = (signature, route)
        if route is None:
            return None
        order, back, shape, out_dtype, kernel, piece, rows, ns_per_row, sizes, spans = route
        out = _tiles.empty(shape, out_dtype)
        if out.size == 0:
            return out if back is None else out.transpose(back)
        flat = []
        for x, span in zip(inputs, spans):
            x = x if order is None else moved(x, order)
            flat.append(np.ascontiguousarray(x).reshape(-1) if span is None else
                        as_run(x, span))
        _compiled.split_rows(kernel, rows, out.reshape(-1), *sizes, self._prm, *flat,
                             ns_per_row=ns_per_row, piece=piece)
        return out if back is None else out.transpose(back)

    def _route(self, inputs) -> _Route | None:
        """The loop's call worked out for inputs like these (their shapes, strides and
        dtypes, and the run's thread count), or None where it does not serve."""
        kinds = [kind_of(getattr(x, "dtype", None)) for x in inputs]
        if None in kinds:
            return None
        result = result_kinds(self.steps, self.slots, kinds)
        if result is None:
            return None
        order = memory_order(inputs)
        back = None if order is None else tuple(int(axis) for axis in np.argsort(order))
        views = [x if order is None else moved(x, order) for x in inputs]
        shapes = [x.shape for x in views]
        spans = tuple(memory_span(x) for x in views)
        plan = layout(shapes, [None if span is None else
                               tuple(st // x.itemsize for st in x.strides)
                               for x, span in zip(views, spans)])
        if plan is None and any(spans):   # a view's innermost values apart: copied
            spans = (None,) * len(views)
            plan = layout(shapes)
        if plan is None:
            return None
        out_dtype = np.dtype(np.float32 if result[-1] == "f" else bool)
        kernel, piece = self.kernels.get(*self._program, plan.modes,
                                         tuple(x.dtype for x in inputs), out_dtype)
        if kernel is None:
            return None
        inner = plan.inner
        chunk = min(inner, _CHUNK) or 1
        nsub = -(-inner // chunk)
        rows = (math.prod(plan.shape) // inner if inner else 0) * nsub
        return _Route(order, back, plan.shape, out_dtype, kernel, piece, rows,
                      chunk * _NS_PER_STEP * len(self.steps),
                      (inner, nsub, chunk, plan.dims, plan.strides), spans)

    def lower(self, inputs):
        lowering = compiled_rows(f"{len(self.steps)} elementwise steps in one loop, split "
                                 "among the threads")
        if lowering is PORTABLE:
            return lowering
        if all(s is not None and s.static() for s in inputs) and all(
                math.prod(s.shape) < tuning.CHAIN_COMPILED_MIN for s in inputs):
            return _SMALL
        kinds = [None if s is None else kind_of(s.dtype) for s in inputs]
        if all(s is not None and s.dtype is not None for s in inputs) and \
                (None in kinds or result_kinds(self.steps, self.slots, kinds) is None):
            return PORTABLE._replace(why="input dtypes the compiled loop does not take")
        return lowering
