"""The process's CPU engine, as the kernels find it: `current()`.

OpenBLAS's threads, glibc's malloc and the cores belong to the process, so one engine
(ember.ops.cpu.engine.CpuEngine) serves it, made on first use. The kernels' modules (compiled,
blas, tiles) reach it here, below them: the engine imports them, so they cannot import it, and
the engine's module hands its class to `provide` when it loads (ember.ops.cpu's __init__
imports it, so it has whenever any of them is imported).
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class _Slot:
    """The process's engine (None until first asked for) and what makes it."""
    __slots__ = ("engine", "make", "lock")

    def __init__(self) -> None:
        self.engine: Any = None
        self.make: Callable[[], Any] | None = None
        self.lock = threading.Lock()


_slot = _Slot()


def current() -> Any:
    """The process's CPU engine, made on the first call (under a lock: once per process)."""
    engine = _slot.engine
    return engine if engine is not None else _made()


def _made() -> Any:
    with _slot.lock:
        if _slot.engine is None:
            if _slot.make is None:
                raise RuntimeError("ember.ops.cpu.engine is not loaded")
            _slot.engine = _slot.make()
        return _slot.engine


def provide(make: Callable[[], Any]) -> None:
    """The engine's class (or any maker of one): ember.ops.cpu.engine, when it loads."""
    _slot.make = make
