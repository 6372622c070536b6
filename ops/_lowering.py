"""Lowerings the CPU ops share: what `OpImpl.lower` answers for kernels of the CPU engine."""
from __future__ import annotations

import functools
import importlib.util

import numpy as np

from ember.ops.cpu import compiled as _compiled
from ember.ops.registry import PORTABLE, Lowering


@functools.lru_cache(maxsize=1)
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def numba_serves() -> bool:
    """Whether compiled kernels run: numba installed and not switched off (EMBER_NUMBA=0)."""
    return _compiled.enabled() and _numba_installed()


def compiled_rows(what: str) -> Lowering:
    """`what` by a numba-compiled kernel whose rows the run's threads share, where numba
    serves; the portable kernel otherwise."""
    return Lowering("cpu.compiled", what) if numba_serves() else PORTABLE


def remembered_route(op, arrays: tuple, params: tuple, make):
    """`make()`, a route worked out for the op's inputs (its checks, parameters and kernel
    plan done once), remembered while the per-call `arrays` keep their shapes, strides and
    types, the run its thread count, and each of `params` is the same read-only array (a
    constant: scales, zero points, weights) or None. A model's node gets such inputs run
    after run, and working the route out again is a large share of a small node's time.
    One tuple per op, replaced whole: threads sharing a session read the old or the new.
    A None route (the op's other path) is not remembered, nor one over another array library.
    """
    if op.xp is not np:
        return make()
    signature = tuple((a.shape, a.strides, a.dtype) for a in arrays) + (_compiled.run_threads(),)
    last = op.__dict__.get("_remembered_route")
    if last is not None and last[0] == signature and len(last[1]) == len(params) \
            and all(a is b for a, b in zip(last[1], params)):
        return last[2]
    route = make()
    if route is not None and all(p is None or isinstance(p, np.ndarray) and not p.flags.writeable
                                 for p in params):
        op._remembered_route = (signature, params, route)
    return route
