"""Compute backends. A backend owns its device arrays and the transfers to and from numpy;
its kernels live with the ops (ops/<family>.py for the CPU, ops/opencl/, ops/cuda/), registered
under the backend's name."""
from __future__ import annotations

from ember import config
from ember.errors import BackendUnavailableError
from ember.ops.registry import BACKENDS
from ember.runtime.backends.base import Backend, CpuBackend

_instances: dict[str, Backend] = {}


def resolve_backend_name(name: str | None) -> str:
    name = (name or config.text("EMBER_BACKEND") or "cpu").lower()
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    return name


def get_backend(name: "str | Backend | None" = None) -> Backend:
    """The backend called `name` (default $EMBER_BACKEND, then cpu), created once per process;
    a `Backend` instance (e.g. an `OpenCLBackend()` of its own) is returned unchanged.

    Raises BackendUnavailableError, saying what is missing and how to install it, when the
    backend cannot run on this machine."""
    if isinstance(name, Backend):
        return name
    name = resolve_backend_name(name)
    if name not in _instances:
        if name == "cpu":
            _instances[name] = CpuBackend()
        elif name == "opencl":
            from ember.runtime.backends.opencl import OpenCLBackend
            _instances[name] = OpenCLBackend()
        else:
            from ember.runtime.backends.cuda import CudaBackend
            _instances[name] = CudaBackend()
    return _instances[name]


__all__ = ["BACKENDS", "Backend", "CpuBackend", "get_backend", "resolve_backend_name"]
