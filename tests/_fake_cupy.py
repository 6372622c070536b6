"""A numpy stand-in for cupy, for checking the CUDA backend's array code on machines without a
GPU (tests/devices/test_cuda_backend.py installs it as `cupy` when real cupy cannot run).

Device arrays are `ndarray`, a numpy subclass, so computing works; what it checks is residency:
like cupy, its ufuncs and functions refuse a host numpy array mixed with device arrays (cupy
raises TypeError "Unsupported type <class 'numpy.ndarray'>"), results are device arrays (0-d
arrays where numpy gives scalars, as cupy does), and `asnumpy`/`.get()` move to the host.
CUDA C kernels cannot run here: RawKernel/ElementwiseKernel raise, and ops/cuda/_common.py's
`native_kernels()` is False so kernels take their shared array-code path.
"""
from __future__ import annotations

import sys
import types

import numpy as np

_EMBER_FAKE = True
__version__ = "0.0-fake"


def _load_real():
    """The real cupy package if installed (it imports without a GPU): the stand-in then offers
    only the functions, ufuncs, keywords and ndarray attributes real cupy has."""
    mod = sys.modules.get("cupy")
    if mod is not None:
        return None if getattr(mod, "_EMBER_FAKE", False) else mod
    try:
        import cupy
    except Exception:
        return None
    return cupy


_REAL = _load_real() if __name__ != "cupy" else None
_REAL_NDARRAY_ATTRS = frozenset(dir(_REAL.ndarray)) if _REAL is not None else None


def _real_attr(path, name):
    """The real cupy object at cupy.<path>.<name>, or None (True when real cupy is absent)."""
    if _REAL is None:
        return True
    mod = _REAL
    for part in path:
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return getattr(mod, name, None)


def _check_keywords(real, name, kwargs):
    import inspect

    if real is True or not kwargs:
        return
    try:
        params = inspect.signature(real).parameters
    except (TypeError, ValueError):
        return  # a Cython function without a signature: not checked
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise TypeError(f"cupy.{name}() got unexpected keyword argument(s) {unknown}")


class ndarray(np.ndarray):  # noqa: N801 - cupy's name
    def __getattribute__(self, name):
        if _REAL_NDARRAY_ATTRS is not None and not name.startswith("_") \
                and name not in _REAL_NDARRAY_ATTRS and name != "get":
            raise AttributeError(f"cupy.ndarray has no attribute {name!r}")
        return super().__getattribute__(name)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        real = _real_attr((), ufunc.__name__)
        if real is None or (real is not True and method != "__call__"
                            and not hasattr(real, method)):
            raise TypeError(f"cupy has no ufunc {ufunc.__name__}.{method}")
        args = _unwrap(inputs, ufunc.__name__)
        if "out" in kwargs:
            kwargs["out"] = tuple(_base(o) for o in kwargs["out"])
        result = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        path = tuple(p for p in func.__module__.split(".")[1:] if not p.startswith("_"))
        real = _real_attr(path, func.__name__) if path in ((), ("linalg",), ("fft",)) \
            else _real_attr((), func.__name__)
        if real is None:  # cupy's __array_function__ gives NotImplemented: numpy raises
            raise TypeError(f"no implementation found for numpy.{func.__name__} on cupy arrays")
        _check_keywords(real, func.__name__, kwargs)
        result = func(*_unwrap(args, func.__name__),
                      **{k: _unwrap_one(v, func.__name__) for k, v in kwargs.items()})
        return _wrap(result)

    def get(self):
        return np.array(self.view(np.ndarray))

    # cupy's ndarray lacks these numpy features: the stand-in refuses them too
    @property
    def flags(self):
        f = self.view(np.ndarray).flags
        return _Flags(f.c_contiguous, f.f_contiguous, f.owndata)

    def max(self, axis=None, out=None, keepdims=False, **unsupported):
        if unsupported:
            raise TypeError(f"cupy's ndarray.max takes no {sorted(unsupported)}")
        return _wrap(self.view(np.ndarray).max(axis=axis, keepdims=keepdims))

    def min(self, axis=None, out=None, keepdims=False, **unsupported):
        if unsupported:
            raise TypeError(f"cupy's ndarray.min takes no {sorted(unsupported)}")
        return _wrap(self.view(np.ndarray).min(axis=axis, keepdims=keepdims))

    def astype(self, dtype, *args, **kwargs):
        _check_dtype(dtype)
        return super().astype(dtype, *args, **kwargs)

    def view(self, *args, **kwargs):
        if args and not (isinstance(args[0], type) and issubclass(args[0], np.ndarray)):
            _check_dtype(args[0])
        return super().view(*args, **kwargs)

    def setflags(self, *args, **kwargs):
        raise AttributeError("cupy arrays have no setflags")


class _Flags:
    def __init__(self, c, f, own):
        self.c_contiguous, self.f_contiguous, self.owndata = c, f, own


def _check_dtype(dtype):
    if dtype is not None and np.dtype(dtype).kind not in "biufc":
        raise TypeError(f"cupy does not support dtype {np.dtype(dtype)}")


def _base(x):
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _unwrap_one(x, where, creation=False):
    if isinstance(x, ndarray):
        return x.view(np.ndarray)
    if isinstance(x, np.ndarray) and not creation and x.dtype != object:
        raise TypeError(f"Unsupported type {type(x)} (a host numpy array passed to device "
                        f"function {where})")
    if isinstance(x, (list, tuple)) and any(isinstance(v, np.ndarray) for v in x):
        return type(x)(_unwrap_one(v, where, creation) for v in x)
    return x


def _unwrap(args, where, creation=False):
    return tuple(_unwrap_one(a, where, creation) for a in args)


def _wrap(result):
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    if isinstance(result, list):
        return [_wrap(r) for r in result]
    if isinstance(result, np.ndarray) and not isinstance(result, ndarray):
        if result.dtype == object or result.dtype.kind in "USV":
            raise TypeError(f"cupy has no {result.dtype} arrays")
        return result.view(ndarray)
    if isinstance(result, np.generic) and result.dtype.kind in "biufc":
        return np.asarray(result).view(ndarray)
    return result


_CREATION = {"asarray", "array", "asanyarray", "ascontiguousarray", "zeros", "ones", "empty",
             "full", "zeros_like", "ones_like", "empty_like", "full_like", "arange",
             "linspace", "eye", "identity", "tri"}


def _function(np_fn, name, creation, path=()):
    real = _real_attr(path, name)
    if real is None:
        raise AttributeError(f"module 'cupy{''.join('.' + p for p in path)}' has no "
                             f"attribute {name!r}")

    def fn(*args, **kwargs):
        _check_keywords(real, name, kwargs)
        if "dtype" in kwargs:
            _check_dtype(kwargs["dtype"])
        result = np_fn(*_unwrap(args, name, creation),
                       **{k: _unwrap_one(v, name, creation) for k, v in kwargs.items()})
        if creation and isinstance(result, np.ndarray) and not result.flags.writeable:
            result = result.copy()
        return _wrap(result)
    fn.__name__ = name
    return fn


class _Grid:
    def __init__(self, grid):
        self.grid = grid

    def __getitem__(self, key):
        return _wrap(self.grid[key])


ogrid, mgrid = _Grid(np.ogrid), _Grid(np.mgrid)


def asnumpy(x):
    return np.array(x.view(np.ndarray)) if isinstance(x, ndarray) else np.asarray(x)


def _make_module(name, np_mod, creation_names):
    mod = types.ModuleType(name)
    path = tuple(name.split(".")[1:])

    def getattr_(attr):
        value = getattr(np_mod, attr)
        if isinstance(value, (np.ufunc, type, np.dtype, types.ModuleType)) or not callable(value):
            return value
        return _function(value, attr, attr in creation_names, path)
    mod.__getattr__ = getattr_
    return mod


linalg = _make_module("cupy.linalg", np.linalg, set())
lib = types.ModuleType("cupy.lib")
lib.stride_tricks = _make_module("cupy.lib.stride_tricks", np.lib.stride_tricks, set())


def __getattr__(attr):
    value = getattr(np, attr)
    if isinstance(value, (np.ufunc, type, np.dtype, types.ModuleType)) or not callable(value):
        return value
    return _function(value, attr, attr in _CREATION)


class _Runtime:
    @staticmethod
    def getDeviceCount():  # noqa: N802 - cupy's name
        return 1

    @staticmethod
    def getDeviceProperties(i):  # noqa: N802
        return {"name": b"fake device (numpy)"}


class _Device:
    def __init__(self, i=0):
        self.id = i

    def use(self):
        pass

    def synchronize(self):
        pass


cuda = types.SimpleNamespace(runtime=_Runtime, Device=_Device)


# CUDA C cannot run here; the kernels ember's CUDA backend builds are emulated in numpy by
# name (a translation of each kernel's CUDA C), so the host code around them (argument order,
# shapes, the GEMM after im2col) runs for real. The CUDA C itself is compiled by
# tests/devices/test_cuda_sources.py.
_EMBER_EMULATE_KERNELS = True


def _erf(x):
    from ember.ops.elementwise import erf  # numpy, vectorised

    return erf(np, np.asarray(x))


def _softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    s = 1 / (1 + e)
    return np.where(x >= 0, s, e * s)


_ELEMENTWISE = {
    "ember_Relu": lambda x: np.where(x < 0, x.dtype.type(0), x),
    "ember_Sigmoid": _sigmoid,
    "ember_Erf": _erf,
    "ember_Gelu": lambda x: 0.5 * x * (1 + _erf(x * x.dtype.type(np.sqrt(0.5)))),
    "ember_GeluTanh": lambda x: 0.5 * x * (1 + np.tanh(x.dtype.type(np.sqrt(2 / np.pi))
                                                       * (x + x.dtype.type(0.044715) * x ** 3))),
    "ember_Softplus": _softplus,
    "ember_HardSwish": lambda x: x * np.clip(x / 6 + x.dtype.type(0.5), 0, 1),
    "ember_Mish": lambda x: x * np.tanh(_softplus(x)),
    "ember_LeakyRelu": lambda x, a: np.where(x >= 0, x, a * x),
    "ember_Elu": lambda x, a: np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0))),
    "ember_Selu": lambda x, a, g: g * np.where(x > 0, x, a * np.expm1(np.minimum(x, 0))),
    "ember_HardSigmoid": lambda x, a, b: np.clip(a * x + b, 0, 1),
    "ember_Swish": lambda x, a: x * _sigmoid(a * x),
}


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name, **kwargs):
        if name not in _ELEMENTWISE:
            raise NotImplementedError(f"the fake cupy has no emulation of kernel {name}")
        self.fn, self.name = _ELEMENTWISE[name], name
        self.n_in = len(in_params.split(","))

    def __call__(self, *args):
        assert len(args) == self.n_in, f"{self.name}: {len(args)} arguments, {self.n_in} declared"
        x = args[0]
        assert isinstance(x, ndarray), f"{self.name}: input is not a device array"
        scalars = args[1:]
        assert all(isinstance(v, np.generic) and v.dtype == x.dtype for v in scalars), scalars
        with np.errstate(all="ignore"):
            y = self.fn(x.view(np.ndarray), *scalars)
        return np.asarray(y, dtype=x.dtype).view(ndarray)


def _im2col(x, col, total, C, H, W, KH, KW, OH, OW, SH, SW, PH, PW, DH, DW):
    N = x.size // (C * H * W)
    xb = x.view(np.ndarray).reshape(N, C, H, W)
    out = np.zeros((N, C, KH, KW, OH, OW), x.dtype)
    for kh in range(KH):
        ih = np.arange(OH) * SH - PH + kh * DH
        okh = (ih >= 0) & (ih < H)
        for kw in range(KW):
            iw = np.arange(OW) * SW - PW + kw * DW
            okw = (iw >= 0) & (iw < W)
            sub = xb[:, :, np.clip(ih, 0, H - 1)][:, :, :, np.clip(iw, 0, W - 1)]
            out[:, :, kh, kw] = np.where(okh[:, None] & okw[None, :], sub, 0)
    assert col.size == total == out.size
    col.view(np.ndarray).reshape(-1)[:] = out.reshape(-1)


def _pool2d(x, y, total, H, W, KH, KW, OH, OW, SH, SW, PH, PW, DH, DW, is_max, lo_h, hi_h,
            lo_w, hi_w):
    planes = x.view(np.ndarray).reshape(-1, H, W)
    out = y.view(np.ndarray).reshape(-1, OH, OW)
    assert out.size == total
    for oh in range(OH):
        for ow in range(OW):
            ih = oh * SH - PH + np.arange(KH) * DH
            iw = ow * SW - PW + np.arange(KW) * DW
            vh, vw = ih[(ih >= 0) & (ih < H)], iw[(iw >= 0) & (iw < W)]
            win = planes[:, vh][:, :, vw].reshape(len(planes), -1)
            if is_max:
                acc = np.full(len(planes), -np.inf, x.dtype)
                if win.shape[1]:
                    acc = np.max(win, axis=1)
            else:
                cnt = max(int(((ih >= lo_h) & (ih < hi_h)).sum()), 1) * \
                    max(int(((iw >= lo_w) & (iw < hi_w)).sum()), 1)
                acc = win.sum(axis=1) / x.dtype.type(cnt)
            out[:, oh, ow] = acc


_RAW = {"im2col": _im2col, "pool2d": _pool2d}


class RawKernel:
    def __init__(self, code, name, options=(), **kwargs):
        assert f"void {name}(" in code, f"kernel {name} is not in its source"
        self.fn = _RAW[name.rsplit("_", 1)[0]]
        self.ctype = name.rsplit("_", 1)[1]

    def __call__(self, grid, block, args):
        arrays = [a for a in args if isinstance(a, np.ndarray) and a.ndim > 0]
        assert all(isinstance(a, ndarray) and a.flags.c_contiguous for a in arrays), \
            "RawKernel arrays must be contiguous device arrays"
        assert all({"float": np.float32, "double": np.float64}[self.ctype] == a.dtype
                   for a in arrays), "array dtypes differ from the kernel's"
        ints = [int(a) for a in args if not (isinstance(a, np.ndarray) and a.ndim > 0)]
        assert all(isinstance(a, (np.int32, np.int64)) for a in args
                   if not (isinstance(a, np.ndarray) and a.ndim > 0)), args
        self.fn(*arrays, *ints)


def install():
    """Make `import cupy` give this module (returns the module it replaced, or None)."""
    previous = sys.modules.get("cupy")
    sys.modules["cupy"] = sys.modules[__name__]
    return previous
