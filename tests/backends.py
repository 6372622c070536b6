"""Which backends the tests run on, and per-backend placement statistics for the summary."""
from __future__ import annotations

import contextlib
import functools
import os
import sys

from ember.errors import BackendUnavailableError
from ember.runtime.backends import BACKENDS, get_backend

HERE = os.path.dirname(os.path.abspath(__file__))

# backend -> {placement: node count} over the cases run, printed at the end of the test run
PLACEMENT: dict[str, dict[str, int]] = {}


@functools.lru_cache(maxsize=None)
def unavailable_reason(backend: str) -> str | None:
    """None if `backend` can run here, else why not (the BackendUnavailableError message)."""
    try:
        get_backend(backend)
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def present_backends() -> list[str]:
    return [b for b in BACKENDS if unavailable_reason(b) is None]


def xfail_file(backend: str) -> str:
    return os.path.join(HERE, f"xfail_{backend}.txt")


def record_placement(backend: str, session) -> None:
    counts = PLACEMENT.setdefault(backend, {})
    for where, n in session.placement_summary().items():
        counts[where] = counts.get(where, 0) + n


def real_cuda_device() -> bool:
    """Whether real cupy sees a CUDA device."""
    try:
        import cupy

        if getattr(cupy, "_EMBER_FAKE", False):
            return False
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@contextlib.contextmanager
def cuda_backend(mode: str):
    """The CUDA backend on real cupy (`mode` "gpu") or on tests/_fake_cupy.py, the numpy
    stand-in for cupy ("emulated"); restores the previous cupy module and backend instance
    afterwards."""
    from ember.ops.cuda import _common
    from ember.runtime import backends

    saved_module, saved_instance = sys.modules.get("cupy"), backends._instances.pop("cuda", None)
    if mode == "emulated":
        import _fake_cupy

        _fake_cupy.install()
        _common.reset_kernels()
    try:
        yield backends.get_backend("cuda")
    finally:
        backends._instances.pop("cuda", None)
        if saved_instance is not None:
            backends._instances["cuda"] = saved_instance
        if mode == "emulated":
            if saved_module is not None:
                sys.modules["cupy"] = saved_module
            else:
                sys.modules.pop("cupy", None)
            _common.reset_kernels()


def run_checking_placement(session, feeds) -> dict:
    """`session.run(feeds)`, asserting that every node the plan placed on the device ran there:
    none of them fell back to its CPU kernel during the run (the placement `ember info` and
    `session.placement` report is the one that runs)."""
    backend = session._backend
    before = dict(backend.fallback_nodes)
    result = session.run(feeds)
    fell_back = {label for label, calls in backend.fallback_nodes.items()
                 if calls > before.get(label, 0)}
    wrong = [(label, op) for label, op, where in session.placement
             if where == "device" and label in fell_back]
    assert not wrong, f"placed on {session.backend} but ran on the CPU: {wrong}"
    return result
