"""The size limit on tensors: no node may produce, or ask a kernel to allocate, a tensor larger
than `max_tensor_bytes`.

A model file is untrusted input, and many sizes in it are data: ConstantOfShape's shape input,
Expand's and Tile's, Range's bounds, Resize's scales, Pad's pads, a Loop's trip count (its scan
outputs grow by one slice per iteration). Without a cap a mutated number asks numpy for
terabytes, which fails slowly (swapping, then the OOM killer) or not at all. So:

* kernels that size an allocation from data call `check_shape` before allocating;
* Loop and Scan check the bytes their scan outputs have accumulated after every iteration;
* the executor checks every node's outputs (`nbytes`) as they come back: cheap, and it covers
  the kernels without a check of their own (a broadcast to a huge shape, say), after the fact.

Past the cap, `ResourceLimitError` (an `ExecutionError`) says the size and the cap; the
executor adds the node's name.

The cap is, in order: `ember.load(..., max_tensor_bytes=N)` for that session, else
$EMBER_MAX_TENSOR_BYTES (bytes; K/M/G/T suffixes of 1024 allowed), else half of the memory
this process may use: physical RAM, lowered by a cgroup memory limit or an address-space
rlimit where one is set (so a process run under `ulimit -v` gets a clean error, not a
MemoryError halfway through a kernel). Half, because a model's peak holds more than its
largest tensor: a tensor that alone fills memory cannot be computed anyway.

A Loop's iterations are bounded too (`max_loop_iterations`): one run of a Loop node may make
at most $EMBER_MAX_LOOP_ITERATIONS iterations, 2**31 by default. A loop body costs ember ten
microseconds or more per iteration, so 2**31 iterations take most of a day; real models
(decoders, beam searches, RNN-style loops, expanded Range functions) stop after thousands to
millions. The limit is a backstop, not a timeout: ops/control_flow.py's Loop says how it and
the tensor cap bound what a hostile trip count can do, most of it after one iteration.

A session's cap is in force while its `run` executes (and while `ember.load` simplifies: the
constant folder runs kernels). It lives in a context variable, so sessions with different caps
running in different threads keep their own.
"""
from __future__ import annotations

import contextvars
import functools
import os
from typing import Any, Iterable

import numpy as np

from ember import config
from ember.errors import EmberError, ResourceLimitError

ENV = "EMBER_MAX_TENSOR_BYTES"
LOOP_ENV = "EMBER_MAX_LOOP_ITERATIONS"
DEFAULT_MAX_LOOP_ITERATIONS = 2**31
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# The cap of the session running in this context (None: none is running: the default applies).
_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "ember_max_tensor_bytes", default=None)


# --------------------------------------------------------------------------------------------
# the cap

def resolve(max_tensor_bytes: Any = None) -> int:
    """The cap a session gets: its own `max_tensor_bytes` if given (a positive int), else the
    environment's or the machine's default."""
    if max_tensor_bytes is None:
        return default_max_tensor_bytes()
    if isinstance(max_tensor_bytes, bool) or not isinstance(max_tensor_bytes, (int, np.integer)) \
            or max_tensor_bytes < 1:
        raise ValueError(f"max_tensor_bytes must be a positive int (bytes) or None, got "
                         f"{max_tensor_bytes!r}")
    return int(max_tensor_bytes)


def default_max_tensor_bytes() -> int:
    """$EMBER_MAX_TENSOR_BYTES if set, else half of the memory this process may use."""
    text = config.text(ENV) or ""
    if text:
        return _parse_bytes(text)
    return _memory_default()


def _parse_bytes(text: str) -> int:
    number, scale = text, 1
    if text[-1:].upper() in _SUFFIXES:
        number, scale = text[:-1], _SUFFIXES[text[-1].upper()]
    try:
        value = int(float(number) * scale) if any(c in number for c in ".eE") \
            else int(number) * scale
    except ValueError:
        value = 0
    if value < 1:
        raise EmberError(f"${ENV} must be a positive number of bytes (e.g. 4000000000 or 4G), "
                         f"got {text!r}")
    return value


@functools.lru_cache(maxsize=1)
def _memory_default() -> int:
    return max(1, _usable_memory() // 2)


def _usable_memory() -> int:
    """Bytes of memory this process may use: the smallest of physical RAM, the cgroup's
    memory limit and the address-space / data rlimits (each only where it can be read)."""
    candidates = []
    try:
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX, or not exposed
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            candidates.append(int(text))
    try:
        import resource

        for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            soft, _ = resource.getrlimit(kind)
            if soft != resource.RLIM_INFINITY and soft > 0:
                candidates.append(soft)
    except (ImportError, ValueError, OSError, AttributeError):  # not on this platform
        pass
    return min(candidates) if candidates else 8 << 30


def max_loop_iterations() -> int:
    """The most iterations one run of a Loop node may make: $EMBER_MAX_LOOP_ITERATIONS if set
    (a positive int), else DEFAULT_MAX_LOOP_ITERATIONS. Read at each run of a Loop (not per
    iteration), so a change of the variable applies to the next run."""
    text = config.text(LOOP_ENV) or ""
    if not text:
        return DEFAULT_MAX_LOOP_ITERATIONS
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise EmberError(f"${LOOP_ENV} must be a positive number of iterations, got {text!r}")
    return value


def current() -> int:
    """The cap in force here: the running session's, else the default."""
    cap = _current.get()
    return default_max_tensor_bytes() if cap is None else cap


def enter(cap: int) -> contextvars.Token:
    """Make `cap` the cap of this context until `leave(token)`."""
    return _current.set(cap)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)


class capped:
    """`with capped(n):` runs its body under cap `n` (a context manager around enter/leave)."""

    def __init__(self, cap: int):
        self.cap = cap

    def __enter__(self) -> int:
        self._token = enter(self.cap)
        return self.cap

    def __exit__(self, *exc) -> None:
        leave(self._token)


# --------------------------------------------------------------------------------------------
# checks

def check_shape(shape: Iterable[int], dtype: Any, what: str = "output") -> None:
    """Raise ResourceLimitError if a tensor of `shape` and `dtype` would pass the cap. Call it
    before allocating anything sized from data. Sizes are Python ints: nothing overflows."""
    # called for every kernel's output: one pass, no list (a few microseconds add up)
    nbytes = np.dtype(dtype).itemsize if dtype is not None else 1
    for d in shape:
        d = int(d)
        if d <= 0:
            return  # nothing to allocate
        nbytes *= d
    cap = current()
    if nbytes > cap:
        dims = [int(d) for d in shape]
        raise ResourceLimitError(f"{what} of shape {dims} ({np.dtype(dtype).name}) would take "
                                 f"{describe_bytes(nbytes)}, {_over(cap)}")


def check_bytes(nbytes: int, what: str) -> None:
    """Raise ResourceLimitError if `nbytes` (a tensor's size, or what a loop accumulated)
    passes the cap."""
    cap = current()
    if nbytes > cap:
        raise ResourceLimitError(f"{what} takes {describe_bytes(nbytes)}, {_over(cap)}")


def too_big(nbytes: int, cap: int, what: str) -> ResourceLimitError:
    """The error for a produced tensor of `nbytes` over `cap` (the executor's check)."""
    return ResourceLimitError(f"{what} takes {describe_bytes(nbytes)}, {_over(cap)}")


def _over(cap: int) -> str:
    return (f"over the limit of {describe_bytes(cap)} per tensor (raise it with "
            f"ember.load(..., max_tensor_bytes=N) or ${ENV})")


def describe_bytes(n: int) -> str:
    """`n` bytes for people: '3.7 GiB (4000000000 bytes)'."""
    size, unit = float(n), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, name
    if unit == "bytes":
        return f"{n} bytes"
    if size >= 1024:  # past EiB: the exponent says more than the digits
        return f"{n:.3g} bytes"
    return f"{size:.1f} {unit} ({n} bytes)"
