"""ember's control of the BLAS thread pool (numpy's OpenBLAS, or whichever BLAS numpy loads).

Three things, all on the host (they matter to the CPU kernels and to host fallbacks):

* Thread count. A session runs with `threads` threads (`ember.load(..., threads=N)`,
  `SessionOptions.intra_op_num_threads` in `ember.InferenceSession`), by default the number of
  physical cores this process may run on (`physical_cores`: the CPUs of
  `os.sched_getaffinity`, hyperthread siblings counted once), as onnxruntime does. BLAS thread
  pools are process-wide, so the count is set when a run starts and the previous one restored
  when the last run in flight returns (with runs of different counts in flight at once, the
  latest asked wins). Where ember's kernel pool runs the products (ember.ops.cpu.blas: numba
  installed, numpy's BLAS an OpenBLAS) the pool takes that count and BLAS is set to one
  thread for the run instead (the `blas_count` the CPU engine gives `RunThreads`: this module
  knows nothing of the pool). The libraries are found with threadpoolctl;
  OpenBLAS on its own pthreads server is set through its C entry points directly (faster
  than threadpoolctl's `set_num_threads`, which in threadpoolctl 3.8 does nothing when
  called from a thread other than the first one that used it, and runs come from any
  thread).

* No spinning after `run()` returns. After each parallel call, OpenBLAS's worker threads
  busy-wait (a `sched_yield` loop) before they sleep: 2**28 TSC cycles by default, a whole
  core for each worker after every run, taken from whatever runs next. OpenBLAS reads
  OPENBLAS_THREAD_TIMEOUT (the log2 of that spin, 4..30) when the library loads, which is
  always before ember runs (numpy is imported first). So, unless the user set it, ember sets
  OPENBLAS_THREAD_TIMEOUT to THREAD_TIMEOUT (ops/cpu/tuning.py: a spin long enough to stay
  awake between the products of one run, short enough that a large pool spins only briefly
  after it) for OpenBLAS copies loaded later, and for those already loaded re-reads the
  environment (`openblas_read_env`) and restarts the idle worker threads
  (`blas_thread_shutdown_`, the call OpenBLAS itself makes before every fork; the workers come
  back on the next parallel call and read the new timeout then). This happens once, when the
  process's CPU engine is made (ember.ops.cpu.engine: by the first session, run or compiled
  kernel), and is the process's setting from then on. Setting the thread count to 1 after
  a run does not help: the workers spin on whatever the count is. A longer spin is a trade:
  a worker asleep after one product is slow to wake for the next, but a spinning one takes a
  core from the threads of a compiled loop.

* No product is sent to one thread: BLAS's own threading threshold is already the crossover
  (docs/performance.md, under BY_ROW_KN), also for the recurrences' loops of small products
  (ops/rnn.py).
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np
import threadpoolctl

from ember.ops.cpu import tuning

AFFIXES = [(p, s) for p in ("", "scipy_") for s in ("", "64_", "_64")]


# --------------------------------------------------------------------------------------------
# cores

def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (os.sched_getaffinity): logical
    CPUs that are hyperthreads of one core count once. Falls back to the logical CPU count
    where the topology is not readable."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{topo}/core_id") as f:
                core = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    """physical_cores(), read once per process (it reads the CPU topology from /sys)."""
    return physical_cores()


def check_threads(threads: Any) -> int | None:
    """`threads` as given to a session: None (the default) or a positive int."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    return threads


# --------------------------------------------------------------------------------------------
# the BLAS libraries of the process

class _Lib:
    """One loaded BLAS library: get/set its thread count. `raw` for OpenBLAS on its own
    pthreads server, set through its C functions (process-wide, any thread may set it)."""

    def __init__(self, controller: Any):
        self.controller = controller
        self.raw = False
        self.dynlib = getattr(controller, "dynlib", None)
        if (controller.internal_api == "openblas" and self.dynlib is not None
                and getattr(controller, "threading_layer", None) != "openmp"):
            for prefix, suffix in AFFIXES:
                get = getattr(self.dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
                set_ = getattr(self.dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    self.get, self.set, self.raw = get, set_, True
                    break
        if not self.raw:
            self.get, self.set = controller.get_num_threads, controller.set_num_threads


def find_libraries() -> tuple[_Lib, ...]:
    """The BLAS libraries loaded in the process now (threadpoolctl: slow, so looked up once,
    and again only where a library may have been loaded since)."""
    return tuple(_Lib(c) for c in threadpoolctl.ThreadpoolController()
                 .select(user_api="blas").lib_controllers)


# --------------------------------------------------------------------------------------------
# the thread count during runs

class RunThreads:
    """The BLAS libraries' thread count during runs, and the runs in flight. BLAS's threads are
    the process's, so the process has one of these: the CPU engine's (ember.ops.cpu.engine).

    `blas_count(threads)` says BLAS's own count during runs of `threads` threads (one where
    ember's kernel pool runs the products instead): asked by its owner, which knows the pool,
    so that this module knows nothing of it."""

    def __init__(self, blas_count: Callable[[int], int]):
        self._blas_count = blas_count
        self._cores = default_threads()
        self._lock = threading.Lock()
        self._libs_lock = threading.Lock()
        self._libs = find_libraries()
        self._active = 0               # runs in flight
        # runs in flight, read by compiled code: the kernel pool's helpers spin for the next
        # job only while it is above 0 (ember.ops.cpu.compiled)
        self.in_flight = np.zeros(1, np.int64)
        # each library's count before the first run in flight that calls BLAS; None while
        # no such run is in flight (the libraries are as their users left them)
        self._saved: list[tuple[_Lib, Any]] | None = None
        self._target: int | None = None  # the count the runs in flight asked for
        # BLAS's own count during the runs in flight that call it (blas_count of the latest's
        # threads), None while there are none
        self._blas: int | None = None
        # blas_count per run thread count: asked once, as its answer is the process's (whether
        # the pool runs the products), and a run that asks again pays for it every call
        self._counts: dict[int, int] = {}

    def refresh(self) -> tuple[_Lib, ...]:
        """Look the loaded BLAS libraries up again (find_libraries)."""
        found = find_libraries()
        with self._libs_lock:
            self._libs = found
        return found

    def libraries(self) -> tuple[_Lib, ...]:
        """The BLAS libraries found (when this was made, or by the last refresh)."""
        return self._libs

    def enter(self, threads: int, blas: bool = True) -> None:
        """A run starts: BLAS uses `threads` threads (one where ember's pool runs the products)
        until the last run in flight calls `leave`. A run whose plan calls no BLAS
        (`blas` False: Plan.calls_blas) leaves the libraries as they are, but is in flight
        all the same: the kernel pool's threads and `run_threads` serve it as any run."""
        count = self._counts.get(threads)
        if count is None:  # first: its first call may load numba, and a BLAS with it
            count = self._counts[threads] = self._blas_count(threads)  # (adopt_new_libraries)
        # every run enters and leaves: plain loops and locals, no list built but the saved
        # counts (a microsecond of a small model's call)
        with self._lock:
            if blas:
                if self._saved is None:  # the first run in flight that calls BLAS
                    saved = []
                    for lib in self._libs:
                        was = lib.get()
                        if was != count:
                            lib.set(count)
                        saved.append((lib, was))
                    self._saved = saved
                elif count != self._blas:
                    for lib, _ in self._saved:
                        lib.set(count)
                self._blas = count
            self._target = threads
            self._active = self.in_flight[0] = self._active + 1

    def leave(self) -> None:
        with self._lock:
            active = self._active = self.in_flight[0] = self._active - 1
            if not active:
                saved = self._saved
                if saved is not None:
                    blas = self._blas
                    for lib, count in saved:
                        if count is not None and count != blas:
                            lib.set(count)
                    self._saved = None
                self._target = self._blas = None

    def adopt_new_libraries(self) -> None:
        """Look the BLAS libraries up again after something loaded one (numba's CPU target
        loads scipy's OpenBLAS, and numba comes with the first compiled kernel, inside a run):
        one loaded while runs that call BLAS are in flight gets their thread count now, and
        its own back when they end."""
        found = self.refresh()
        with self._lock:
            if self._saved is None:
                return
            known = {lib.controller.filepath for lib, _ in self._saved}
            for lib in found:
                if lib.controller.filepath not in known:
                    count = lib.get()
                    self._saved.append((lib, count))
                    if count != self._blas:
                        lib.set(self._blas)

    def run_threads(self) -> int:
        """The thread count of the runs in flight (the physical cores outside a run): what
        the kernel pool splits for, and kernels with threads of their own use."""
        target = self._target
        return target if target is not None else self._cores

    def current_threads(self) -> list[int]:
        """The thread count of each loaded BLAS library, as the libraries report it."""
        return [lib.get() for lib in self._libs]


# --------------------------------------------------------------------------------------------
# OpenBLAS's idle spin

def _symbol(dynlib: Any, name: str) -> Any:
    for prefix, suffix in AFFIXES:
        fn = getattr(dynlib, f"{prefix}{name}{suffix}", None)
        if fn is not None:
            return fn
    return None


def shorten_openblas_spin(libs: Sequence[_Lib]) -> list[str]:
    """Make OpenBLAS's idle workers sleep after 2**THREAD_TIMEOUT cycles (ops/cpu/tuning.py)
    instead of 2**28 (see the module docstring); a user's OPENBLAS_THREAD_TIMEOUT is applied
    instead, also to the copies loaded before it was set (GOTO_THREAD_TIMEOUT alone: left as
    it is). Returns the files of the loaded libraries whose workers were restarted to take
    it."""
    env = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    if env is None:
        if "GOTO_THREAD_TIMEOUT" in os.environ:
            return []
        env = str(tuning.THREAD_TIMEOUT)
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = env  # for the copies loaded later
    try:
        wanted = int(env)
    except ValueError:
        return []
    done = []
    for lib in libs:
        if not lib.raw:
            continue
        read_env = _symbol(lib.dynlib, "openblas_read_env")
        timeout = _symbol(lib.dynlib, "openblas_thread_timeout")
        shutdown = _symbol(lib.dynlib, "blas_thread_shutdown_")
        if read_env is None or timeout is None or shutdown is None:
            continue
        read_env.restype, timeout.restype, shutdown.restype = None, ctypes.c_int, ctypes.c_int
        if timeout() == wanted:
            continue  # read when the library loaded, the environment already said so
        read_env()
        if timeout() == wanted:
            shutdown()  # the idle workers exit; the next parallel call starts them again
            done.append(getattr(lib.controller, "filepath", "?"))
    return done
