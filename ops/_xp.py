"""Where cupy's array API differs from numpy's, for the kernels written over `xp`.

An op's CPU kernel is written once against the array namespace `xp = self.xp` (OpImpl.xp,
bound at plan time: numpy on the CPU, cupy on CUDA), in the array-API style of scipy and
scikit-learn: array work is `xp.<function>`, while `np.` is kept for dtypes, scalar types and
host-side shape arithmetic. Numpy ufuncs stored in tables (`np.add`) apply to cupy arrays too,
by numpy's `__array_ufunc__` protocol. The few numpy features cupy lacks are the functions
below, each an open branch on `xp`.
"""
from __future__ import annotations

import numpy as np


def is_numpy(xp) -> bool:
    return xp is np


def to_host(xp, x) -> np.ndarray:
    """`x` as a host numpy array, for values a kernel must read in Python (data-dependent
    output shapes, loop bounds): a device-to-host copy under cupy."""
    return np.asarray(x) if xp is np else xp.asnumpy(x)


def amax(xp, a, axis=None, keepdims: bool = False, initial=None):
    """`np.max(a, axis, keepdims=, initial=)`; cupy's max has no `initial`."""
    return _extreme(xp, a, axis, keepdims, initial, largest=True)


def amin(xp, a, axis=None, keepdims: bool = False, initial=None):
    """`np.min(a, axis, keepdims=, initial=)`; cupy's min has no `initial`."""
    return _extreme(xp, a, axis, keepdims, initial, largest=False)


def _extreme(xp, a, axis, keepdims, initial, largest):
    reduce = xp.max if largest else xp.min
    if xp is np or initial is None:
        return reduce(a, axis=axis, keepdims=keepdims,
                      **({} if initial is None else {"initial": initial}))
    if a.size == 0:  # the identity of an empty reduction: `initial`, in the reduced shape
        axes = range(a.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
        axes = {ax % a.ndim for ax in axes}
        shape = tuple(1 if i in axes else d for i, d in enumerate(a.shape)
                      if keepdims or i not in axes)
        return xp.full(shape, initial, a.dtype)
    bound = xp.asarray(initial, dtype=a.dtype)
    r = reduce(a, axis=axis, keepdims=keepdims)
    return xp.maximum(r, bound) if largest else xp.minimum(r, bound)


def as_strided(xp, x, shape, strides):
    """A read-only strided view of `x` (cupy's as_strided has no `writeable`; its views are
    never written by the kernels either)."""
    if xp is np:
        return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)
    return xp.lib.stride_tricks.as_strided(x, shape, strides)


def is_array(xp, x) -> bool:
    """Whether `x` is an array of namespace `xp` (a numpy array on the CPU, a device array
    under cupy)."""
    return isinstance(x, xp.ndarray)
