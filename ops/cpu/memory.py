"""Freed memory kept for the next run: glibc malloc's thresholds, set once per process.

Every node's output is a fresh numpy array. glibc serves an allocation above its mmap threshold
(128 KiB at first, raised up to the size of the largest mmap-ed block freed since) with fresh
pages from the kernel, and gives freed memory at the top of its heap back to the kernel beyond
its trim threshold. Either way, the next run's arrays of the same sizes land on pages the
kernel must fault in and zero again, which can cost a convolution most of its time.
onnxruntime keeps its memory in an arena for the same reason.

So, when the process's CPU engine is made (ember.ops.cpu.engine: by the first session, run or
compiled kernel), ember raises glibc's mmap threshold to its maximum (32 MiB; larger blocks
are still mmap-ed: the kernels' large outputs, from ops/cpu/tiles.empty, reuse up to 4 such
buffers once freed) and keeps up to TRIM_THRESHOLD (ops/cpu/tuning.py) of free memory at the
top of the heap. The cost is memory: up to that much freed memory stays with the process.
It is left alone where the user set glibc's own MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ / GLIBC_TUNABLES, with EMBER_KEEP_MEMORY=0, and off glibc.
"""
from __future__ import annotations

import ctypes
import functools
import os

from ember import config
from ember.ops.cpu import tuning

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20                     # glibc's largest allowed on 64-bit

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set glibc's thresholds as above, once per process (the CPU engine does when it is made,
    ember.ops.cpu.engine); returns whether they are set. Cached, not locked: two first calls at
    once would both set the same thresholds, which is harmless."""
    return _apply()


def opted_out() -> bool:
    """EMBER_KEEP_MEMORY=0 (or false, no, empty): keep no freed memory, here or in the kernels'
    kept buffers (ops/cpu/tiles.empty)."""
    return not config.switch("EMBER_KEEP_MEMORY", True)


def _apply() -> bool:
    if opted_out():
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_TRIM_THRESHOLD, tuning.TRIM_THRESHOLD))
