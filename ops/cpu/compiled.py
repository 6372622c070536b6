"""Optional compiled CPU kernels: loop-shaped kernels compiled by numba where it is installed
(`pip install ember[fast]`), the numpy kernels serving where it is not, or with EMBER_NUMBA=0.

    kernel = jit(_my_loops)              # None without numba
    if kernel is not None:
        split_rows(kernel, rows, *args, ns_per_row=...)  # kernel(*args, row0, row1), threaded

A kernel is compiled on first use, once per argument types, and cached on disk by numba (next
to its source, or in numba's user-wide cache directory): a later process loads it instead of
compiling it again, many times faster. numba checks only the kernel's own file for changes:
after editing a function it calls from another file (`kernel_math`, the vector code of
ops/cpu/tiles.py), or a value in ops/cpu/tuning.py that compiled code reads, delete
ops/__pycache__/*.nbi and *.nbc, or it runs the old code (an installed release writes every
file anew, which clears them all). Kernels release
the GIL and compute each output element with the same expression whatever the split, so a run
gives the same bits on one thread or several.

Threads: `split_rows` cuts the rows into two pieces per thread of the run in flight
(ember.ops.cpu.threads), which the caller and a small pool of ours (`_Helpers`) take in
turn; a kernel with a piece function (see "pieces without Python" below) has them taken
from the board the helpers watch, without the GIL. Not numba's own `parallel=True` loops:
numba's workers and OpenBLAS's competed for the cores from one node to the next. The pool's
threads spin a short while for a next job during a run (HELPER_PAUSES, longer where the pool
runs the products too: POOL_PRODUCTS_HELPER_PAUSES, ops/cpu/tuning.py), then sleep: they use
no CPU between runs. The pool, its board and the run-thread count are the process's CPU
engine's (ember.ops.cpu.engine, found through `current()`): this module imports neither blas
nor threads, and asks the engine what they decide.

Steps in lockstep: `run_in_lockstep` runs a loop of dependent steps (a recurrence's time
steps) on several threads with no Python between the steps: each step's units (hidden units)
are cut into one chunk per thread; a thread takes a chunk with an atomic exchange
(`take_chunk`, its own chunk first, so each thread's share of the weights stays in its core's
cache), counts it done (`chunk_done`), and waits until the step is complete (`wait_step`)
before the next. The calling thread runs the whole loop; a pool thread joins whenever it
starts and finds only the chunks not taken yet, so a late or busy helper (a loaded machine,
a session shared by threads) never holds the caller up, and nothing waits for it to start.
Waiting spins with the CPU's pause for a few microseconds, then yields the core
(sched_yield); no thread spins once the last step is complete. With a piece function the
helpers' part starts and ends on the board, without Python.

Math for kernels: `exp_float32` and `tanh_float32` are float32 functions that LLVM inlines
and vectorises in a kernel's loop (the C library's expf / tanhf are scalar calls; these also
run faster than numpy's float32 exp / tanh). Plain Python functions, callable from Python
too; `jit` registers them with numba before it compiles a kernel. Both are within 2 ulp of
the correctly rounded result; exp_float32 flushes results below 2**-124 (x < -86) to zero.
Other modules declare such functions with `kernel_math` (activations.py's float32 GELU, which
the GELU kernel and the fused epilogue share).
"""
from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from ember import config
from ember.ops.cpu import tuning
from ember.ops.cpu.process import current

_OPTIONS = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")
# loops -> its compiled kernel (or None): a memo of what numba compiled, the same for every
# engine and thread, so a module table rather than engine state
_compiled: dict[Callable, Any] = {}
_lock = threading.Lock()  # registering functions with numba (kernel_math, _register_math)


class Once:
    """fn(*args) run once per process, by its first caller, under a lock (numba must not learn
    an intrinsic twice); later calls return that first result without taking the lock."""

    def __init__(self, fn: Callable):
        self._fn, self._lock, self._done, self._result = fn, threading.Lock(), False, None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        if not self._done:
            with self._lock:
                if not self._done:
                    self._result = self._fn(*args)
                    self._done = True
        return self._result


def enabled() -> bool:
    return config.switch("EMBER_NUMBA", True)


# An array's data pointer is read from the array object itself: numpy's PyArrayObject puts it
# right after the object's header (its C ABI), several times faster than __array_interface__,
# which builds a dict for it, and the kernels' calls write two to four addresses a node. Plain
# ndarrays only; checked on arrays and views when this module loads; where the header differs
# (another Python build), __array_interface__ serves.
_pointer_at = ctypes.c_void_p.from_address
_DATA_OFFSET = object.__basicsize__


def _interface_address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def _struct_address(x: np.ndarray) -> int:
    if type(x) is not np.ndarray:   # a subclass or a numpy scalar: its own struct
        return _interface_address(x)
    return _pointer_at(id(x) + _DATA_OFFSET).value or 0


_probes = [np.arange(6.0), np.zeros((3, 4), np.float32)]
_probes += [_probes[0][2:], _probes[1].T, _probes[1][1:, ::2]]
address = _struct_address if all(_struct_address(x) == _interface_address(x)
                                 for x in _probes) else _interface_address
del _probes


def jit(loops: Callable, **options: Any) -> Any:
    """`loops` compiled by numba (lazily, per argument types), or None where numba is not
    installed or EMBER_NUMBA=0. Options beyond ember's defaults (fastmath=...) are numba's."""
    if loops not in _compiled:
        kernel = None
        numba = _numba() if enabled() else None
        if numba is not None:
            _register_math(numba)
            kernel = numba.njit(**_OPTIONS, **options)(loops)
        _compiled[loops] = kernel
    return _compiled[loops]


@functools.lru_cache(maxsize=1)
def _numba() -> Any:
    """numba, imported on the first call, or None. With it, the BLAS its CPU target loads on
    its first compilation (scipy's OpenBLAS, where scipy is installed: numba.np.arraymath
    calls ensure_blas on import) is loaded now, and the runs in flight set its thread count
    (the engine's, ember.ops.cpu.threads.RunThreads): otherwise it would appear in the middle
    of a run, unmanaged until the next one. Both once per process (looking the libraries up
    is slow: threads.find_libraries); the engine is made first, so that a copy loaded now
    reads the OpenBLAS spin the engine sets."""
    try:
        import numba
    except ImportError:
        return None
    engine = current()
    try:
        from numba.np.linalg import ensure_blas
        ensure_blas()
    except ImportError:  # no scipy: numba loads no BLAS of its own
        pass
    else:
        engine.adopt_new_libraries()
    return numba


def split_rows(kernel: Callable, rows: int, *args: Any, ns_per_row: float,
               piece: Callable | None = None) -> None:
    """kernel(*args, row0, row1) over rows [0, rows): on up to as many threads as the run in
    flight has, but no more than leave each tuning.MIN_PIECE_NS of work by the estimate
    `ns_per_row` (the kernel's time per row on one core, roughly). The rows are cut into two
    pieces per thread, taken in turn by the calling thread and by the pool's threads as they
    start: a helper that is slow to start (its core busy) leaves its pieces to the others
    instead of holding the call up, and one not started by the end is cancelled.

    `piece`, the kernel's piece function (see `piece_address`), puts the pieces on the board
    the helpers watch, where they take them without Python; without one (or where the board
    is not watched, or an argument is not C-ordered) the helpers take them as Python jobs."""
    run_rows(kernel, row_bounds(rows, ns_per_row), *args, piece=piece)


def row_bounds(rows: int, ns_per_row: float) -> list[int]:
    """How split_rows cuts `rows` rows in the run in flight: the pieces' bounds."""
    # each piece at least MIN_PIECE_NS of work: below, handing pieces to our pool costs more
    # than it saves, as after a BLAS product OpenBLAS's workers spin (ember.ops.cpu.threads)
    # on the very cores our pool's threads would need, and a piece handed over waits for them
    threads = max(1, min(run_threads(), int(rows * ns_per_row // tuning.MIN_PIECE_NS)))
    pieces = 1 if threads == 1 else min(rows, 2 * threads)
    return [rows * i // pieces for i in range(pieces + 1)]


def run_rows(kernel: Callable, bounds: list[int], *args: Any,
             piece: Callable | None = None) -> None:
    """split_rows with its cuts made (`row_bounds`): kernel(*args, row0, row1) on each piece
    [bounds[i], bounds[i + 1])."""
    pieces = len(bounds) - 1
    if pieces == 1:  # most calls: no lists, no pool
        kernel(*args, bounds[0], bounds[1])
        return
    if piece is not None and _pieces_on_board(piece, args, bounds):
        return
    take = itertools.count().__next__  # atomic under the GIL

    def work() -> None:
        while (piece := take()) < pieces:
            kernel(*args, bounds[piece], bounds[piece + 1])

    cpu = _caller_cpu()
    helpers = -(-pieces // 2) - 1   # two pieces a thread (row_bounds)
    pool = _thread_pool() if helpers else None  # resolved once a call, started on first use
    jobs = [pool.submit(_away_from, cpu, work) for _ in range(helpers)]
    work()
    for job in jobs:
        if not job.cancel():
            job.result()


def run_in_lockstep(kernel: Callable, units: int, steps: int, *args: Any, min_units: int,
                    align: int = 16, piece: Callable | None = None) -> int:
    """kernel(*args, cuts, rank, sync) for `steps` steps over `units` units, on up to one
    thread per core of the run in flight with at least `min_units` units each: `cuts`
    bounds the chunks (multiples of `align`), `rank` is the thread's own chunk, `sync` the
    steps' claims and counts (see take_chunk). Returns the number of threads asked.

    `piece`, the kernel's piece function (its row0 is the rank), puts the ranks on the board
    the helpers watch (as `split_rows` does): a helper then neither starts nor ends its part
    in Python, where it would take the GIL from the caller, which went on with the next
    nodes and then waited for it."""
    threads = max(1, min(run_threads(), _CPUS, units // max(1, min_units)))
    cuts = np.array([units * k // threads // align * align for k in range(threads)] + [units],
                    np.int64)
    sync = np.zeros(steps * (threads + 1), np.int64)
    if threads > 1 and piece is not None and _pieces_on_board(piece, args + (cuts, sync),
                                                              list(range(threads + 1))):
        return threads
    if threads == 1:  # no helper to place: the caller's CPU is not asked (a syscall)
        kernel(*args, cuts, 0, sync)
        return threads
    cpu = _caller_cpu()
    pool = _thread_pool()
    helpers = [pool.submit(_away_from, cpu, kernel, *args, cuts, rank, sync)
               for rank in range(1, threads)]
    kernel(*args, cuts, 0, sync)
    for helper in helpers:  # not waited for: a running one finds nothing left to take
        helper.cancel()
    return threads


_CPUS = os.cpu_count() or 1


def _current_cpu_function() -> Callable[[], int] | None:
    """libc's sched_getcpu (through ctypes), or None where there is none (macOS)."""
    try:
        getcpu = ctypes.PyDLL(None).sched_getcpu  # PyDLL: keeps the GIL (a thread waiting
        # for it would take it, and the caller then sleeps to get it back: a slow wake-up)
    except (AttributeError, OSError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu if hasattr(os, "sched_setaffinity") else None


_current_cpu = _current_cpu_function()


def _caller_cpu() -> int:
    return _current_cpu() if _current_cpu is not None else -1


def _away_from(cpu: int, work: Callable, *args: Any) -> None:
    """work(*args) on a pool thread, moved off the CPU the caller runs on (`cpu`) if the
    scheduler woke it there. With every core busy (another process, even at nice 19), Linux
    often wakes the helper on the caller's own CPU (no CPU is idle, the waker's is preferred),
    and the load balancer moves neither before the work is done: the two threads then share
    one core, and the split takes one thread's time. Two syscalls, only when it happens."""
    if cpu < 0 or _current_cpu() != cpu:
        work(*args)
        return
    try:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, allowed - {cpu})
    except (OSError, ValueError):  # a CPU set of one, or affinity not ours to change
        work(*args)
        return
    try:
        work(*args)
    finally:
        os.sched_setaffinity(0, allowed)


def run_threads() -> int:
    """The thread count of the runs in flight (the physical cores outside a run): the
    engine's (ember.ops.cpu.threads.RunThreads)."""
    return current().run_threads()


def rouse_helpers(pool: _Helpers) -> None:
    """Products on the board (ops/cpu/blas.py) are taken by the helpers that are awake: one
    asleep is woken by a job that does nothing, for the products that follow, moved off the
    caller's CPU if it woke there (`_away_from`): pieces taken on the board never pass
    through a Python job that would move it, and a helper sharing the caller's core (beside
    a nice-19 spinner, where Linux wakes it there) stayed there for the whole process."""
    if pool.sleeping and not pool.jobs:
        pool.submit(_away_from, _caller_cpu(), _nothing)


def _thread_pool() -> _Helpers:
    """The engine's helpers (ember.ops.cpu.engine.Pool), started on first use."""
    return current().pool.helpers()


class _Job:
    """A call handed to the helpers: `cancel()` before a helper takes it, or `result()`.
    `lock` is its pool's: a job's state is taken by a helper, or cancelled by its caller."""
    __slots__ = ("fn", "args", "state", "error", "done", "lock")
    PENDING, RUNNING, CANCELLED = range(3)

    def __init__(self, fn: Callable, args: tuple, lock: threading.Lock):
        self.fn, self.args, self.state, self.error = fn, args, _Job.PENDING, None
        self.done = np.zeros(1, np.int64)  # 1 once it has run (or raised)
        self.lock = lock

    def cancel(self) -> bool:
        with self.lock:
            if self.state == _Job.PENDING:
                self.state = _Job.CANCELLED
                return True
            return False

    def result(self) -> None:
        """Wait until the job has run, spinning (GIL released): the helper is running it,
        and a sleeping caller would be slow to wake once it is done (see _Helpers)."""
        wait = jit(wait_while_equal)
        if wait is None:
            while not self.done[0]:
                time.sleep(0)
        else:
            wait(self.done, 0, 0, _ALWAYS, SPINS_BEFORE_YIELD, -1)
        if self.error is not None:
            raise self.error


class _Helpers:
    """The kernel pool: `threads` daemon threads running the jobs handed to `submit`, for
    `engine` (ember.ops.cpu.engine.CpuEngine: the runs in flight, and the wait between jobs).

    Handing work to a sleeping thread costs the wake-up of an idle core, often a small
    kernel's whole time, and so does a caller that sleeps until a helper is done. So, while a
    run is in flight (the engine's `in_flight`), a helper that has just run a job waits
    HELPER_PAUSES pauses (ops/cpu/tuning.py) for the next one, GIL released (`wait_for_job`),
    before it sleeps on a condition; and a caller waits for a started job spinning
    (`_Job.result`). The spin is short and never yields the core: a helper that yielded while
    another process is busy (even at nice 19) handed it its core for a time slice, and splits
    under load got slower. Once no run is in flight, a helper watching the products' board
    spins LINGER_PAUSES more for the next run (ops/cpu/blas.py), then nothing spins."""

    def __init__(self, threads: int, engine: Any):
        self.engine = engine
        self.job_lock = threading.Lock()  # the jobs' states (_Job.lock)
        self.jobs: collections.deque[_Job] = collections.deque()
        self.posted = np.zeros(1, np.int64)   # jobs handed over so far: what spinners watch
        self.wakeup = threading.Condition(threading.Lock())
        self.sleeping = 0
        self.closed = False
        self.threads = [threading.Thread(target=self._serve, name=f"ember-kernel-{i}",
                                         daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable, *args: Any) -> _Job:
        job = _Job(fn, args, self.job_lock)
        self.jobs.append(job)
        self.posted[0] += 1
        if self.sleeping:
            with self.wakeup:
                self.wakeup.notify()
        return job

    def shutdown(self) -> None:
        """Let the threads end once the jobs handed over are done (tests' own pools)."""
        with self.wakeup:
            self.closed = True
            self.wakeup.notify_all()

    def _serve(self) -> None:
        wait = jit(wait_for_job)
        engine = self.engine
        finished = None  # the done flag of the job just run: set once the GIL is released
        while True:
            try:
                job = self.jobs.popleft()
            except IndexError:
                job = None
            if job is None and finished is not None and wait is not None:
                engine.helper_wait(wait)(finished, self.posted, self.posted[0],
                                         engine.in_flight, engine.helper_pauses(),
                                         tuning.SETTLE_PAUSES)
                finished = None
                continue
            if finished is not None:
                finished[0] = 1
                finished = None
            if job is None:
                with self.wakeup:
                    self.sleeping += 1
                    while not self.jobs and not self.closed:
                        self.wakeup.wait()
                    self.sleeping -= 1
                    if self.closed and not self.jobs:
                        return
                continue
            with self.job_lock:
                if job.state != _Job.PENDING:
                    continue
                job.state = _Job.RUNNING
            try:
                job.fn(*job.args)
            except BaseException as error:  # re-raised by result(), in the caller
                job.error = error
            finished = job.done


_ALWAYS = np.ones(1, np.int64)  # as `runs` for wait_while_equal: wait whether runs are or not


def _nothing() -> None:
    pass


def wait_while_equal(a, i, value, runs, pauses, yields):
    """Spin while a[i] == value and runs[0] > 0: the CPU's pause up to `pauses` times, then
    sched_yield up to `yields` times (without end if negative)."""
    spins = 0
    while load_acquire(a, i) == value and load_acquire(runs, 0) > 0:
        spins += 1
        if spins <= pauses:
            cpu_pause()
        elif 0 <= yields <= spins - pauses - 1:
            return
        else:
            os_yield()


def wait_for_job(finished, posted, seen, runs, pauses, settle):
    """A helper between jobs, the GIL released: mark the job it ran done (here, so that the
    caller that waits for it finds the GIL free), wait for posted[0] to move on from `seen`
    (wait_while_equal), then pause `settle` times more: the caller that posted the job is
    still in Python until its own kernel releases the GIL, and a thread that finds the GIL
    held sleeps (a slow wake-up)."""
    exchange(finished, 0, 1)
    wait_while_equal(posted, 0, seen, runs, pauses, 0)
    for _ in range(settle):
        cpu_pause()


# ------------------------------------------------------------------ pieces without Python
# A split kernel's pieces go on the board the pool's helpers watch while they spin (the
# products' board, ops/cpu/blas.py), and a helper runs them without taking the GIL, as it runs
# a product's pieces: a helper handed a Python job instead takes the GIL first, in turn with
# the caller, and the two threads then wait on each other for it. For that the kernel has a
# *piece function*: a plain function (block, row0, row1) that finds the kernel's arguments in
# an int64 block (`piece_block`: an array as its address and shape, a number as itself or its
# float64 bits), rebuilds the arrays (`array_at`) and calls the kernel (a `kernel_math`
# function) on rows [row0, row1). It is compiled as a C function (numba's cfunc, cached on
# disk like the kernels) whose address the board carries; a helper calls it through that
# address (`call_piece`).

def _pieces_on_board(piece: Callable, args: tuple, bounds: list[int]) -> bool:
    """Run the pieces [bounds[i], bounds[i + 1]) of `piece` on `args` on the board, if it
    can take them (a board, numba, C-ordered arrays, not too many pieces): whether it ran.
    The board is the engine's, run by ops/cpu/blas.py (which imports this module)."""
    engine = current()
    if len(bounds) - 1 > _MAX_BOARD_PIECES or not engine.products():
        return False
    address = piece_address(piece)
    block = piece_block(args) if address is not None else None
    if block is None:
        return False
    engine.run_pieces(address, block, bounds)
    return True


def piece_block(args: tuple) -> np.ndarray | None:
    """A kernel's arguments as a piece function finds them: each array as its address and
    its shape, each integer or bool as itself, each float as its float64 bits; None where an
    array is not C-ordered (a piece function rebuilds C-ordered arrays only) or without
    numba. Packed by compiled code (`_pack_block`): reading the addresses from Python took
    several times longer."""
    pack = jit(_pack_block)
    if pack is None:
        return None
    block = np.empty(_BLOCK_FIELDS, np.int64)
    used = pack(block, args)
    return block[:used] if used >= 0 else None


_BLOCK_FIELDS = 64  # room for any kernel's arguments (an LSTM's: 29 fields)


def _pack_block(block, args):  # pragma: no cover - numba
    """Write `args` into block as piece_block lays them out; the fields used, or -1."""
    used = 0
    for value in literal_unroll(args):
        if used >= 0:
            used = put_field(block, used, value)
    return used


def put_field(block, at, value):
    """Write one argument at block[at:] (see piece_block); the next free field, or -1 (no
    room, or an array not C-ordered). Compiled code only."""
    raise NotImplementedError("compiled code only")


def literal_unroll(values):
    """A loop over a tuple of mixed types; numba's literal_unroll once numba is imported
    (`_register_pieces`)."""
    return values


def piece_address(fn: Callable) -> int | None:
    """The address of the piece function `fn` compiled as C's void fn(int64 block, int64
    row0, int64 row1), or None without numba."""
    if fn not in _pieces:
        address = None
        numba = _numba() if enabled() else None
        if numba is not None:
            _register_math(numba)
            types = numba.types
            compiled = numba.cfunc(types.void(types.int64, types.int64, types.int64),
                                   cache=True, boundscheck=False, error_model="numpy")(fn)
            _pieces_kept.append(compiled)
            address = compiled.address
        _pieces[fn] = address
    return _pieces[fn]


_MAX_BOARD_PIECES = 256  # ops/cpu/blas.py's _MAX_PIECES
# piece function -> its C address: like _compiled, a memo of what numba compiled, the process's
_pieces: dict[Callable, int | None] = {}
_pieces_kept: list[Any] = []  # the compiled piece functions (their addresses stay valid)


def array_at(address, shape, dtype):
    """The C-ordered array of `shape` and `dtype` at `address` (compiled code only)."""
    raise NotImplementedError("compiled code only")


def call_piece(fn, block, row0, row1):
    """The piece function at address `fn` on rows [row0, row1) (compiled code only)."""
    raise NotImplementedError("compiled code only")


# ------------------------------------------------------------------ math for kernels
def float32_from_bits(bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    return np.int32(bits).view(np.float32)


def fma_float32(x, y, z):
    """float32 x * y + z rounded once: compiled, the CPU's fused multiply-add (llvm.fma,
    which loops vectorise; libm's fmaf where the CPU has none). In Python, exactly emulated:
    the float64 product is exact, the float64 sum is rounded to odd (stepped one ulp toward
    its lost part when that is not zero and the sum's last bit is even), so rounding it to
    float32 is not a double rounding."""
    p = np.float64(np.float32(x)) * np.float64(np.float32(y))
    c = np.float64(np.float32(z))
    t = p + c
    back = t - p
    lost = (p - (t - back)) + (c - back)
    bits = np.float64(t).view(np.int64)
    # nextafter(t, toward lost) as numpy's: one step up or down in magnitude of the sign and
    # magnitude bits; never at an infinity (numpy's step from inf rounds back to inf)
    step = np.int64((lost > 0.0) == (t > 0.0)) * 2 - 1
    odd = (lost != 0.0) & ((bits & 1) == 0) & (abs(t) < np.inf)
    return np.float32(np.int64(bits + step * np.int64(odd)).view(np.float64))


# exp: x = k ln2 + r (ln2 split in two for an exact k ln2), e^r by Cephes' expf polynomial on
# |r| <= ln2 / 2, 2^k built in the exponent bits (as 2^(k-1) * 2, so k = 128 stays finite).
_LOG2E, _LN2_HI, _LN2_LO = np.float32(1.4426950408889634), np.float32(0.693359375), \
    np.float32(-2.12194440e-4)
_E0, _E1, _E2, _E3, _E4, _E5 = (np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds to an integer
_EXP_LO, _EXP_HI = np.float32(-86.0), np.float32(88.72283)


def exp_float32(x):
    """e^x in float32: 0 below -86, inf above log(FLT_MAX), NaN kept."""
    v = min(max(x, _EXP_LO), _EXP_HI)
    k = (v * _LOG2E + _ROUND) - _ROUND
    r = (v - k * _LN2_HI) - k * _LN2_LO
    p = ((((_E0 * r + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5
    y = p * (r * r) + r + np.float32(1)
    y = y * float32_from_bits((np.int32(k) + np.int32(126)) << np.int32(23)) * np.float32(2)
    y = np.float32(0) if x < _EXP_LO else y
    y = np.float32(np.inf) if x > _EXP_HI else y
    return x if x != x else y


# tanh: Cephes' tanhf polynomial below 0.625 (no cancellation near 0), 1 - 2 / (e^(2|x|) + 1)
# above, with x's sign
_T0, _T1, _T2, _T3, _T4 = (np.float32(c) for c in (
    -5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
    -3.33332819422e-1))


def tanh_float32(x):
    """tanh(x) in float32, NaN kept."""
    a = abs(x)
    z = x * x
    small = ((((_T0 * z + _T1) * z + _T2) * z + _T3) * z + _T4) * z * x + x
    large = np.float32(1) - np.float32(2) / (exp_float32(a + a) + np.float32(1))
    large = large if x >= np.float32(0) else -large
    return small if a < np.float32(0.625) else large


# ------------------------------------------------------------------ steps in lockstep
# In Python these are plain reads and writes; compiled, atomic loads and read-modify-writes
# (acquire / acquire-release), x86's pause and sched_yield (see `_register_barrier`).
def load_acquire(a, i):
    return a[i]


def cpu_pause():
    pass


def os_yield():
    time.sleep(0)


def fetch_add(a, i, v):
    old = a[i]
    a[i] += v
    return old


def exchange(a, i, v):
    old = a[i]
    a[i] = v
    return old


# a plain global (ops/cpu/tuning.py): compiled code reads it (wait_step, blas._wait_for)
SPINS_BEFORE_YIELD = tuning.SPINS_BEFORE_YIELD


def take_chunk(sync, step, chunk, chunks):
    """Whether this thread is the first to take `chunk` of `step` (see run_in_lockstep):
    sync holds, per step, one claim per chunk, then the count of chunks done."""
    return exchange(sync, step * (chunks + 1) + chunk, 1) == 0


def chunk_done(sync, step, chunks):
    """Count one chunk of `step` done: what it wrote is visible to whoever sees the count."""
    fetch_add(sync, step * (chunks + 1) + chunks, 1)


def wait_step(sync, step, chunks):
    """Wait until every chunk of `step` is done."""
    at = step * (chunks + 1) + chunks
    spins = 0
    while load_acquire(sync, at) < chunks:
        spins += 1
        if spins < SPINS_BEFORE_YIELD:
            cpu_pause()
        else:
            os_yield()


# callable from kernels, each with the numba options it is compiled with; a module table, as
# the functions numba learns are the process's (kernel_math adds to it as modules load)
_kernel_math: list[tuple[Callable, dict]] = [
    (exp_float32, {}), (tanh_float32, {}), (take_chunk, {}), (chunk_done, {}), (wait_step, {}),
    (wait_while_equal, {})]
_kernel_math_registered: set[Callable] = set()


def kernel_math(fn: Callable | None = None, **options: Any) -> Any:
    """Declare the plain Python function `fn` callable from compiled kernels (as exp_float32
    is), compiled with numba `options` (fastmath=...) whatever its caller's; it stays
    callable from Python. numba learns it before it compiles the next kernel. Used as
    `@kernel_math` or `@kernel_math(fastmath=...)`."""
    if fn is None:
        return lambda f: kernel_math(f, **options)
    with _lock:
        _kernel_math.append((fn, options))
    return fn


def _register_math(numba: Any) -> None:
    """Make the math above, and each `kernel_math` function, callable from compiled kernels;
    each once per process."""
    from numba.extending import register_jitable
    with _lock:
        _register_intrinsics(numba)
        for fn, options in _kernel_math:
            if fn not in _kernel_math_registered:
                # numpy's error model, as the kernels': with Python's, a division checks its
                # divisor for zero and keeps the loop calling it from vectorising
                register_jitable(**{"error_model": "numpy", **options})(fn)
                _kernel_math_registered.add(fn)


@Once
def _register_intrinsics(numba: Any) -> None:
    """float32_from_bits, fma_float32, the barrier's and the pieces' compiled forms: once per
    process."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    @intrinsic
    def bitcast_int32_float32(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return numba.types.float32(numba.types.int32), codegen

    @overload(float32_from_bits)
    def _float32_from_bits(bits):
        return lambda bits: bitcast_int32_float32(np.int32(bits))

    @intrinsic
    def fused_float32(typingctx, x, y, z):
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fma = cgutils.get_or_insert_function(builder.module,
                                                 ir.FunctionType(f32, [f32, f32, f32]),
                                                 "llvm.fma.f32")
            return builder.call(fma, list(args))
        f32 = numba.types.float32
        return f32(f32, f32, f32), codegen

    @overload(fma_float32)
    def _fma_float32(x, y, z):
        return lambda x, y, z: fused_float32(np.float32(x), np.float32(y), np.float32(z))

    _register_barrier(numba, ir, intrinsic, overload)
    _register_pieces(numba, ir, intrinsic, overload)


def _register_barrier(numba: Any, ir: Any, intrinsic: Any, overload: Any) -> None:
    """Compiled forms of load_acquire, fetch_add, exchange, cpu_pause and os_yield."""
    import ctypes
    import platform

    import llvmlite.binding as llvm
    from numba.core import cgutils
    types = numba.types

    def element_pointer(context, builder, array_type, array, index):
        ary = context.make_array(array_type)(context, builder, array)
        return cgutils.get_item_pointer(context, builder, array_type, ary, [index])

    @intrinsic
    def atomic_load(typingctx, a, i):
        def codegen(context, builder, signature, args):
            ptr = element_pointer(context, builder, signature.args[0], *args)
            return builder.load_atomic(ptr, "acquire", 8)
        return types.int64(a, i), codegen

    def read_modify_write(op):
        @intrinsic
        def rmw(typingctx, a, i, v):
            def codegen(context, builder, signature, args):
                ptr = element_pointer(context, builder, signature.args[0], args[0], args[1])
                return builder.atomic_rmw(op, ptr, args[2], "acq_rel")
            return types.int64(a, i, types.int64), codegen
        return rmw

    atomic_add, atomic_exchange = read_modify_write("add"), read_modify_write("xchg")

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

    @intrinsic
    def pause(typingctx):
        def codegen(context, builder, signature, args):
            if x86:  # elsewhere: a plain spin (LLVM has no portable pause)
                fn = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
                builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    # sched_yield, resolved by address (numba's JIT links against registered symbols)
    try:
        libc_yield = getattr(ctypes.CDLL(None), "sched_yield", None)
    except (OSError, TypeError):  # no C library to open by None (Windows)
        libc_yield = None
    if libc_yield is not None:
        llvm.add_symbol("sched_yield", ctypes.cast(libc_yield, ctypes.c_void_p).value)

    @intrinsic
    def yield_core(typingctx):
        def codegen(context, builder, signature, args):
            if libc_yield is not None:  # elsewhere: keep spinning
                fn = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
                builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    overload(load_acquire)(lambda a, i: lambda a, i: atomic_load(a, i))
    overload(fetch_add)(lambda a, i, v: lambda a, i, v: atomic_add(a, i, np.int64(v)))
    overload(exchange)(lambda a, i, v: lambda a, i, v: atomic_exchange(a, i, np.int64(v)))
    overload(cpu_pause)(lambda: lambda: pause())
    overload(os_yield)(lambda: lambda: yield_core())


def _register_pieces(numba: Any, ir: Any, intrinsic: Any, overload: Any) -> None:
    """Compiled forms of array_at, call_piece, put_field and literal_unroll."""
    types = numba.types

    @intrinsic
    def pointer_to(typingctx, address, dtype):
        target = dtype.dtype if isinstance(dtype, types.NumberClass) else dtype

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return types.CPointer(target)(address, dtype), codegen

    @intrinsic
    def call_through(typingctx, fn, block, row0, row1):
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            function = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(),
                                                                 [i64, i64, i64]).as_pointer())
            builder.call(function, args[1:])
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen

    def put_array(block, at, value):
        end = at + 1 + value.ndim
        if end > block.size or not value.flags.c_contiguous:
            return -1
        block[at] = value.ctypes.data
        for axis in range(value.ndim):
            block[at + 1 + axis] = value.shape[axis]
        return end

    def put_float(block, at, value):
        if at >= block.size:
            return -1
        block[at] = np.float64(value).view(np.int64)
        return at + 1

    def put_integer(block, at, value):
        if at >= block.size:
            return -1
        block[at] = np.int64(value)
        return at + 1

    def typed_put(block, at, value):
        if isinstance(value, types.Array):
            return put_array
        if isinstance(value, types.Float):
            return put_float
        if isinstance(value, (types.Integer, types.Boolean)):
            return put_integer
        return None

    overload(put_field)(typed_put)
    # numba's own literal_unroll, bound in this module's namespace where _pack_block's compiled
    # loop finds it (its compiler unrolls loops over that very function, not an overload)
    globals()["literal_unroll"] = numba.literal_unroll
    carray = numba.carray
    overload(array_at)(lambda address, shape, dtype: lambda address, shape, dtype: carray(
        pointer_to(address, dtype), shape))
    overload(call_piece)(lambda fn, block, row0, row1: lambda fn, block, row0, row1:
                         call_through(fn, block, row0, row1))
