"""Lowerings the CPU ops share: what `OpImpl.lower` answers for kernels of the CPU engine."""
from __future__ import annotations

import functools
import importlib.util

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
