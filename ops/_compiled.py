"""Optional compiled CPU kernels: loop-shaped kernels compiled by numba where it is installed
(`pip install ember[fast]`), the numpy kernels serving where it is not, or with EMBER_NUMBA=0.

    kernel = jit(_my_loops)              # None without numba
    if kernel is not None:
        split_rows(kernel, rows, *args)  # kernel(*args, row0, row1) over the session's threads

A kernel is compiled on first use, once per argument types, and cached on disk by numba (next
to its source, or in numba's user-wide cache directory): a later process loads it (~0.5 s with
numba's import) instead of compiling it again (a few seconds). Kernels release the GIL and
compute each output element with the same expression whatever the split, so a run gives the
same bits on one thread or several.

Threads: `split_rows` cuts the rows into one piece per thread of the run in flight
(ember.runtime.threads) and runs them on a small pool of ours. numba's own `parallel=True`
loops were slower here: numba's workers and OpenBLAS's competed for the cores from one node
to the next. The pool's idle threads wait on a queue and use no CPU.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_OPTIONS = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")
_compiled: dict[Callable, Any] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def enabled() -> bool:
    return os.environ.get("EMBER_NUMBA", "1").lower() not in ("0", "", "false", "no")


def jit(loops: Callable, **options: Any) -> Any:
    """`loops` compiled by numba (lazily, per argument types), or None where numba is not
    installed or EMBER_NUMBA=0. Options beyond ember's defaults (fastmath=...) are numba's."""
    if loops not in _compiled:
        kernel = None
        if enabled():
            try:
                import numba
            except ImportError:
                numba = None
            if numba is not None:
                kernel = numba.njit(**_OPTIONS, **options)(loops)
        _compiled[loops] = kernel
    return _compiled[loops]


def split_rows(kernel: Callable, rows: int, *args: Any, min_rows: int = 1) -> None:
    """kernel(*args, row0, row1) over rows [0, rows): one piece per thread of the run in
    flight, at least `min_rows` rows a piece; the calling thread does the first piece."""
    # imported here: ember.runtime imports the importer, which imports the ops
    from ember.runtime.threads import run_threads

    parts = max(1, min(run_threads(), rows // max(1, min_rows)))
    bounds = [rows * i // parts for i in range(parts + 1)]
    jobs = [_thread_pool().submit(kernel, *args, bounds[i], bounds[i + 1])
            for i in range(1, parts)]
    kernel(*args, bounds[0], bounds[1])
    for job in jobs:
        job.result()


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1),
                                           thread_name_prefix="ember-kernel")
    return _pool
