"""The CPU engine: one object per process that owns what the CPU kernels share at run time.

    engine = current()                  # the process's (made on first use, once)
    engine.enter(threads); ...; engine.leave()   # around a run (Session.run does)

`CpuEngine` owns the BLAS libraries' thread counts during runs (`runs`, a
threads.RunThreads), the kernel pool (`pool`: the helper threads and the products' board they
watch, ops/cpu/compiled.py and ops/cpu/blas.py) and the kept large buffers of tiles.empty.
OpenBLAS's threads, glibc's malloc and the cores are the process's, so there is one engine
per process (the CPU backend's, `CpuBackend.engine`), and making it sets the process up once:
it finds the BLAS libraries, shortens OpenBLAS's idle spin (threads.shorten_openblas_spin) and
keeps freed memory for the next run (memory.keep_freed_memory).

The kernels below it (compiled, blas, tiles) find it through `current()`
(ember.ops.cpu.process), as this module imports them.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from ember.ops.cpu import blas, compiled, memory, process, threads, tuning
from ember.ops.cpu.process import current

__all__ = ["CpuEngine", "Pool", "current"]


class Pool:
    """The kernel pool: its helper threads (compiled._Helpers, started on first use) and the
    products' board they watch while they wait for jobs (blas.py: `board`, with `board_lock`,
    one product on it at a time, and `private`, a caller's own board while it is taken). One
    object, so that a forked child gets all of it anew (`CpuEngine._forked`)."""

    def __init__(self, engine: CpuEngine):
        self._engine = engine
        self._helpers: compiled._Helpers | None = None
        self._lock = threading.Lock()  # starting the helpers
        self.board = blas.new_board()
        self.board_lock = threading.Lock()
        self.private = threading.local()

    def helpers(self) -> compiled._Helpers:
        """The helper threads, one fewer than the CPUs, started by the first call."""
        helpers = self._helpers
        if helpers is None:
            with self._lock:
                if self._helpers is None:
                    self._helpers = compiled._Helpers(max(1, (os.cpu_count() or 1) - 1),
                                                      self._engine)
                helpers = self._helpers
        return helpers


class CpuEngine:
    """The process's CPU engine (see the module's docstring): made by `current()`."""

    def __init__(self) -> None:
        self.runs = threads.RunThreads(self._blas_count)  # finds the BLAS libraries
        # a run starts (`enter(threads)`) and ends (`leave()`; the last one in flight restores
        # BLAS's thread counts): RunThreads' own methods, bound once, as every run calls them
        self.enter: Callable[[int], None] = self.runs.enter
        self.leave: Callable[[], None] = self.runs.leave
        # runs in flight, read by compiled code (the helpers spin only while it is above 0)
        self.in_flight: np.ndarray = self.runs.in_flight
        # the thread count of the runs in flight (the physical cores outside a run), what
        # split kernels and products are cut for: bound once, as they ask on every call
        self.run_threads: Callable[[], int] = self.runs.run_threads
        # the libraries whose idle OpenBLAS workers were restarted to take the shorter spin
        self.spin_restarted = threads.shorten_openblas_spin(self.runs.libraries())
        self.keeps_memory = memory.keep_freed_memory()  # glibc's thresholds set
        self.pool = Pool(self)
        self.kept: list[np.ndarray] = []  # tiles.empty's large buffers
        self.kept_lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # one engine per process: registered once
            os.register_at_fork(after_in_child=self._forked)

    # ---------------------------------------------------------------- runs
    def libraries(self) -> tuple[threads._Lib, ...]:
        """The BLAS libraries whose thread counts runs set."""
        return self.runs.libraries()

    def adopt_new_libraries(self) -> None:
        """A BLAS library was loaded (numba's, with the first compiled kernel): runs in
        flight set its thread count too (threads.RunThreads.adopt_new_libraries)."""
        self.runs.adopt_new_libraries()

    def _blas_count(self, threads: int) -> int:
        """BLAS's own thread count during runs of `threads` threads: one where the products
        run on the kernel pool (blas.py), which then has the cores to itself."""
        return 1 if blas.enabled() else threads

    # ---------------------------------------------------------------- the kernel pool
    def products(self) -> bool:
        """Whether the pool runs the products (and split kernels' pieces) on its board."""
        return blas.enabled()

    def run_pieces(self, piece: int, block: np.ndarray, bounds: list[int]) -> int:
        """A split kernel's pieces on the board (blas.run_pieces)."""
        return blas.run_pieces(piece, block, bounds)

    def helper_wait(self, wait: Callable) -> Callable:
        """What a helper runs between jobs: `wait` (compiled.wait_for_job), or where the pool
        runs the products, the wait that also takes the pieces posted on the board."""
        return blas.helper_wait(self.pool.board) or wait

    def helper_pauses(self) -> int:
        """How long a helper spins for its next job (tuning.HELPER_PAUSES, or longer where the
        pool runs the products: tuning.POOL_PRODUCTS_HELPER_PAUSES)."""
        if blas.enabled():
            return tuning.POOL_PRODUCTS_HELPER_PAUSES
        return tuning.HELPER_PAUSES

    def _forked(self) -> None:
        """In a forked child: the parent's helper threads are not there, one of them may have
        been counted among the board's users, and a parent's thread may have held a lock at
        the fork: a new pool (its helpers started on first use) and a new lock for the kept
        buffers (which stay: their memory is the child's too)."""
        self.pool = Pool(self)
        self.kept_lock = threading.Lock()


process.provide(CpuEngine)

