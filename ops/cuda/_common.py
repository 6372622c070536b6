"""Shared pieces of the CUDA kernels (cupy). Imports no cupy at module level: kernel modules must
import on machines without it, so the ops table can list what the backend supports.

Two kinds of CUDA kernels live in ops/cuda/:

* Shared kernels: where an op is plain array code, the CUDA kernel *is* the CPU kernel, run over
  another array namespace. `shared(cpu_cls)` derives a class whose methods (and every ember.ops
  helper function they call, transitively) are copies of the CPU functions with the module
  global `np` bound to `XP`, a numpy-compatible namespace that dispatches to cupy: array
  creation (`np.asarray`, `np.zeros`, ...) makes device arrays, and any other function runs in
  cupy when one of its arguments is a device array and in numpy otherwise (shape arithmetic on
  tuples stays on the host). numpy ufuncs (`np.add` stored in class tables) dispatch to cupy by
  numpy's own `__array_ufunc__` protocol. The CPU source is never copied or edited.
* Native kernels: CUDA C through cupy.RawKernel / cupy.ElementwiseKernel. Every CUDA C source is
  a module-level string listed in its module's `CUDA_SOURCES` dict ({name: full source}) so
  tests/test_cuda_sources.py can compile all of them with NVRTC on machines without a GPU.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any

import numpy as np

from ember.runtime.backends import get_backend

FLOAT_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
# numpy dtype -> CUDA C type, for templated kernels
C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
           np.dtype(np.float16): "__half"}


def backend():
    """The CUDA backend instance (created by the session that placed this kernel)."""
    return get_backend("cuda")


def cupy():
    import cupy as cp
    return cp


def native_kernels() -> bool:
    """Whether CUDA C kernels can run: False under the test suite's numpy stand-in for cupy
    (tests/_fake_cupy.py) unless it emulates them; the shared array code runs instead."""
    cp = cupy()
    return not getattr(cp, "_EMBER_FAKE", False) or getattr(cp, "_EMBER_EMULATE_KERNELS", False)


def is_device(x) -> bool:
    return isinstance(x, cupy().ndarray)


# ------------------------------------------------------------------------------ namespace

# numpy functions that make arrays: in a shared kernel they make device arrays.
_CREATION = frozenset({
    "asarray", "array", "asanyarray", "ascontiguousarray", "zeros", "ones", "empty", "full",
    "zeros_like", "ones_like", "empty_like", "full_like", "arange", "linspace", "eye",
    "identity", "tri", "indices", "ogrid", "mgrid"})


def _has_device_array(args, kwargs) -> bool:
    nd = cupy().ndarray
    for a in (*args, *kwargs.values()):
        if isinstance(a, nd):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, nd) for b in a):
            return True
    return False


def _reduce_with_initial(cp_fn, np_fn, largest):
    """max/min with numpy's `initial=` (cupy has none): the identity of an empty reduction."""
    def fn(a, axis=None, out=None, keepdims=False, initial=None, **kw):
        if not isinstance(a, cupy().ndarray):
            return np_fn(a, axis=axis, keepdims=keepdims,
                         **({} if initial is None else {"initial": initial}), **kw)
        if initial is None:
            return cp_fn(a, axis=axis, keepdims=keepdims)
        if a.size == 0:
            axes = range(a.ndim) if axis is None else \
                ((axis,) if isinstance(axis, int) else tuple(axis))
            axes = {ax % a.ndim for ax in axes}
            shape = tuple((1 if keepdims else None) if i in axes else d
                          for i, d in enumerate(a.shape))
            return cupy().full(tuple(d for d in shape if d is not None), initial, a.dtype)
        r = cp_fn(a, axis=axis, keepdims=keepdims)
        bound = cupy().asarray(initial).astype(a.dtype)
        return cupy().maximum(r, bound) if largest else cupy().minimum(r, bound)
    return fn


class _Namespace(types.ModuleType):
    """numpy's names, dispatching array work to cupy (see the module docstring)."""

    def __init__(self, name: str, np_mod, cp_path: tuple[str, ...]):
        super().__init__(name)
        self._np_mod = np_mod
        self._cp_path = cp_path
        self._cache: dict[str, Any] = {}

    def _cp_mod(self):
        mod = cupy()
        for part in self._cp_path:
            mod = getattr(mod, part, None)
            if mod is None:
                return None
        return mod

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        cache = self.__dict__["_cache"]
        if name in cache:
            return cache[name]
        value = self._resolve(name)
        cache[name] = value
        return value

    def _resolve(self, name: str):
        np_attr = getattr(self._np_mod, name)
        cp_mod = self._cp_mod()
        cp_attr = getattr(cp_mod, name, None) if cp_mod is not None else None
        if isinstance(np_attr, types.ModuleType):
            return _Namespace(f"{self.__name__}.{name}", np_attr, self._cp_path + (name,))
        if name == "ndarray":
            return cp_attr
        if not self._cp_path and name in ("ogrid", "mgrid") and cp_attr is not None:
            return cp_attr
        if cp_attr is None or isinstance(np_attr, (np.ufunc, type, np.dtype)) \
                or not callable(np_attr):
            return np_attr  # ufuncs dispatch themselves; dtypes, scalar types, constants
        if not self._cp_path and name in ("max", "amax", "min", "amin"):
            return _reduce_with_initial(cp_attr, np_attr, name in ("max", "amax"))
        if not self._cp_path and name in _CREATION:
            return cp_attr
        if name == "as_strided":  # cupy's has no `writeable`/`subok` keywords
            def as_strided(x, shape=None, strides=None, subok=False, writeable=True):
                if isinstance(x, cupy().ndarray):
                    return cp_attr(x, shape, strides)
                return np_attr(x, shape, strides, subok=subok, writeable=writeable)
            return as_strided

        @functools.wraps(np_attr)
        def dispatch(*args, **kwargs):
            if _has_device_array(args, kwargs):
                return cp_attr(*args, **kwargs)
            return np_attr(*args, **kwargs)
        return dispatch


XP = _Namespace("ember_cuda_xp", np, ())


def reset_namespace() -> None:
    """Forget what XP resolved (for tests that swap the `cupy` module)."""
    XP.__dict__["_cache"].clear()
    for lazy in _LAZY:
        lazy.fn = None
    elementwise_kernel.cache_clear()
    raw_kernel.cache_clear()


# ---------------------------------------------------------------------------- rebinding

_rebound: dict[int, Any] = {}
_globals: dict[str, dict] = {}


def _is_ours(fn) -> bool:
    mod = getattr(fn, "__module__", "") or ""
    return isinstance(fn, types.FunctionType) and mod.startswith("ember.ops") \
        and mod != "ember.ops.registry" and not mod.startswith("ember.ops.cuda")


def _int_matmul_cuda(a, b):
    """linalg._int_matmul (exact small-integer products through float64 GEMM) without
    numpy's `ndarray.max(initial=)`, which cupy lacks."""
    cp = cupy()
    k = a.shape[-1] if a.ndim else 1
    bound = (float(cp.abs(a).max()) if a.size else 0.0) * \
        (float(cp.abs(b).max()) if b.size else 0.0)
    if bound * max(k, 1) < 2.0 ** 52:
        return cp.rint(cp.matmul(a.astype(cp.float64), b.astype(cp.float64))).astype(cp.int64)
    return cp.matmul(a.astype(cp.int64), b.astype(cp.int64))


# CPU helpers and constants replaced in the shared kernels: where the CPU code uses a numpy
# feature cupy lacks, and the block size of the CPU's cache-blocked loops (GELU, erf), which on
# a GPU would only multiply kernel launches: there one block is the array.
_WHOLE_ARRAY = 1 << 62
HELPER_OVERRIDES = {("ember.ops.linalg", "_int_matmul"): _int_matmul_cuda,
                    ("ember.ops.elementwise", "BLOCK"): _WHOLE_ARRAY}


def _module_globals(modname: str) -> dict:
    g = _globals.get(modname)
    if g is None:
        src = sys.modules[modname].__dict__
        g = _globals[modname] = dict(src)
        g["np"] = XP
        g["numpy"] = XP
        for key, value in src.items():
            if _is_ours(value):
                g[key] = _LazyFn(value)
            elif _is_numpy_function(value):  # `from numpy.lib.stride_tricks import as_strided`
                for path, mod in (((), np), (("lib", "stride_tricks"), np.lib.stride_tricks),
                                  (("linalg",), np.linalg)):
                    if getattr(mod, key, None) is value:
                        g[key] = _LazyXP(path, key)
                        break
        for (mod, key), value in HELPER_OVERRIDES.items():
            if mod == modname:
                g[key] = value
    return g


def _is_numpy_function(value) -> bool:
    return callable(value) and not isinstance(value, (np.ufunc, type)) \
        and (getattr(value, "__module__", None) or "").startswith("numpy")


_LAZY: list = []


class _LazyXP:
    """XP.<path>.<name>, looked up on first call (cupy is imported only then)."""

    def __init__(self, path, name):
        self.path, self.name, self.fn = path, name, None
        _LAZY.append(self)

    def __call__(self, *args, **kwargs):
        if self.fn is None:
            ns = XP
            for part in self.path:
                ns = getattr(ns, part)
            self.fn = getattr(ns, self.name)
        return self.fn(*args, **kwargs)


class _LazyFn:
    """A module-level helper of the CPU code, rebound on first call (helpers reference each
    other, so rebinding eagerly would recurse)."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return rebind(self.fn)(*args, **kwargs)


def rebind(fn, classes: dict | None = None):
    """A copy of CPU function `fn` whose `np` is the cupy-dispatching namespace, as are the
    helpers it calls and the functions in its closure. `classes` maps CPU classes to their
    shadows for a method's `__class__` cell (so its zero-argument super() stays shadowed)."""
    if not _is_ours(fn):
        return fn
    key = id(fn)
    if key in _rebound:
        return _rebound[key]
    closure = None
    if fn.__closure__:
        cells = []
        for c in fn.__closure__:
            v = c.cell_contents
            cells.append(types.CellType(classes[v] if classes and isinstance(v, type)
                                        and v in classes else _rebind_value(v)))
        closure = tuple(cells)
    new = types.FunctionType(fn.__code__, _module_globals(fn.__module__), fn.__name__,
                             fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__dict__.update(fn.__dict__)
    _rebound[key] = new
    return new


def _rebind_value(value, classes=None):
    if _is_ours(value):
        return rebind(value, classes)
    if isinstance(value, staticmethod) and _is_ours(value.__func__):
        return staticmethod(rebind(value.__func__, classes))
    if isinstance(value, classmethod) and _is_ours(value.__func__):
        return classmethod(rebind(value.__func__, classes))
    if isinstance(value, property):
        return property(*(rebind(f, classes) if f is not None else None
                          for f in (value.fget, value.fset, value.fdel)))
    return value


_shadows: dict[type, type] = {}


def _shadow(klass: type) -> type:
    """A class deriving from `klass` (and from the shadows of its bases, first in the MRO)
    whose own methods are `klass`'s, rebound; attributes other than functions are inherited."""
    from ember.ops.registry import OpImpl

    if klass in _shadows:
        return _shadows[klass]
    bases = tuple(_shadow(b) for b in klass.__bases__
                  if b is not OpImpl and issubclass(b, OpImpl)) + (klass,)
    shadow = type(f"{klass.__name__}CUDA", bases, {"__module__": __name__,
                                                    "__qualname__": f"{klass.__name__}CUDA"})
    _shadows[klass] = shadow
    for name, value in vars(klass).items():
        if name.startswith("__") or name == "setup":
            continue  # setup() runs once on host attributes: the CPU one stays
        new = _rebind_value(value, {klass: shadow})
        if new is not value:
            setattr(shadow, name, new)
    return shadow


def _host_only(x) -> bool:
    """A value a shared kernel cannot take: a host array of a dtype cupy lacks (strings,
    bfloat16, float8...), or a sequence."""
    if isinstance(x, list):
        return True
    return isinstance(x, np.ndarray) and not is_device(x) and x.dtype.kind not in "biufc"


# Errors by which cupy says it lacks something the CPU code uses (an unsupported dtype, keyword
# or function): the call then runs on the CPU, counted as a fallback. EMBER_CUDA_STRICT=1 makes
# them errors (for finding such ops in testing).
_UNSUPPORTED = (TypeError, NotImplementedError, AttributeError)


class SharedKernel:
    """Mixin of the registered shared classes: the run guard and a CPU fallback that runs the
    CPU class's own code (the rebound methods would make device arrays from host inputs)."""

    cpu_class: type = None  # type: ignore[assignment]

    def run(self, *inputs, **kwargs):
        target = self.__dict__.get("dtype")  # Cast's target type
        if any(_host_only(x) for x in inputs) or \
                (isinstance(target, np.dtype) and target.kind not in "biufc"):
            return self.run_on_cpu(*inputs, **kwargs)
        if _strict():
            return super().run(*inputs, **kwargs)
        try:
            return super().run(*inputs, **kwargs)
        except _UNSUPPORTED:
            return self.run_on_cpu(*inputs, **kwargs)

    def run_on_cpu(self, *inputs, **kwargs):
        be = backend()
        be.fallbacks += 1
        cpu_self = self.__dict__.get("_cpu_self")
        if cpu_self is None:
            cpu_self = object.__new__(self.cpu_class)
            cpu_self.__dict__ = self.__dict__  # the same attributes, the CPU methods
            self.__dict__["_cpu_self"] = cpu_self
        result = cpu_self.run(*[be.to_host(x) for x in inputs], **kwargs)
        if isinstance(result, tuple):
            return tuple(be.to_device(r) for r in result)
        return be.to_device(result)


def _strict() -> bool:
    import os
    return os.environ.get("EMBER_CUDA_STRICT", "") not in ("", "0")


def _uncached_weight(self, w, convert, *extra):
    """The conv family's weight cache keys on read-only numpy constants; device weights are
    converted per call (an on-device cast/reshape, usually a no-op)."""
    return convert(w)


def shared_class(cpu_cls: type, **extra) -> type:
    """A subclass of `cpu_cls` running its own code over cupy (not registered)."""
    if hasattr(cpu_cls, "cached_weight"):
        extra.setdefault("cached_weight", _uncached_weight)
    return type(f"{cpu_cls.__name__}CUDA", (SharedKernel, _shadow(cpu_cls)),
                {"__module__": __name__, "cpu_class": cpu_cls, **extra})


def register_shared(cpu_cls: type, **extra) -> type | None:
    """Register `cpu_cls`'s code over cupy for the cuda backend, for every version it is
    registered at on the CPU that no native CUDA kernel already claims."""
    from ember.ops.registry import register, versions_registered

    taken = set(versions_registered(cpu_cls.domain, cpu_cls.op_type, "cuda"))
    versions = [v for v in cpu_cls.versions if v not in taken]
    if not versions:
        return None
    cls = shared_class(cpu_cls, **extra)
    return register(cpu_cls.op_type, versions=versions, domain=cpu_cls.domain,
                    backend="cuda")(cls)


# ------------------------------------------------------------------------- native kernels

def elementwise_source(name: str, in_params: str, out_params: str, body: str,
                       preamble: str = "") -> str:
    """An ElementwiseKernel's body wrapped into a full __global__ function (flat, contiguous
    arrays of the declared types; `i` the element index), the form NVRTC compiles in the
    sources test. cupy builds its own wrapper from the same parts at run time."""
    params, bind = [], []
    for decl in (p.strip() for p in (in_params + "," + out_params).split(",") if p.strip()):
        ctype, pname = decl.rsplit(" ", 1)
        if ctype.startswith("raw "):
            ctype = ctype[4:]
        params.append(f"{ctype}* __restrict__ {pname}_ptr")
        bind.append(f"{ctype}& {pname} = {pname}_ptr[i];")
    return (f"{preamble}\nextern \"C\" __global__ void {name}({', '.join(params)}, "
            f"long long n) {{\n  for (long long i = blockIdx.x * (long long)blockDim.x + "
            f"threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {{\n    "
            + "\n    ".join(bind) + f"\n    {body}\n  }}\n}}\n")


@functools.lru_cache(maxsize=None)
def elementwise_kernel(in_params: str, out_params: str, body: str, name: str,
                       preamble: str = ""):
    return cupy().ElementwiseKernel(in_params, out_params, body, name, preamble=preamble)


@functools.lru_cache(maxsize=None)
def raw_kernel(source: str, name: str):
    return cupy().RawKernel(source, name, options=("--std=c++14",))


def launch(knl, n: int, *args, block: int = 256) -> None:
    """Run RawKernel `knl` over `n` threads (1-D grid)."""
    grid = max(1, min((int(n) + block - 1) // block, 65535 * 16))
    knl((grid,), (block,), args)
