"""The backend interface, and the CPU backend (numpy arrays; transfers are the identity)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ember.ops.cpu import engine as cpu_engine


class Backend:
    """What the executor needs from a backend.

    `name` keys its kernels in the op registry. Device arrays are whatever the backend uses
    (numpy for the CPU, pyopencl arrays, cupy arrays); `to_device`/`to_host` move tensors;
    sequences and optionals stay on the host.
    """

    name = "cpu"
    # The array namespace kernels compute with on this backend (OpImpl.xp): numpy, or the
    # device's numpy-like module (cupy). OpenCL kernels are written against pyopencl directly;
    # their host code, and the CPU kernels they fall back to, use numpy.
    xp = np
    fallbacks = 0  # device-kernel calls that ran on the CPU (see OpImpl.run_on_cpu)

    @property
    def fallback_nodes(self) -> dict[str, int]:
        """Node label -> device-kernel calls of that node that ran on the CPU."""
        if "_fallback_nodes" not in self.__dict__:
            self._fallback_nodes = {}
        return self._fallback_nodes

    def to_device(self, value: Any) -> Any:
        return value

    def to_host(self, value: Any) -> Any:
        return value

    def is_device_array(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""

    def describe(self) -> str:
        return self.name

    def supports(self, domain: str, op_type: str, opset: int, dtype: np.dtype | None = None
                 ) -> bool:
        """Capability query: does this backend run (domain, op, opset[, dtype]) natively?"""
        from ember.ops.registry import lookup

        impl = lookup(domain, op_type, opset, self.name)
        if impl is None:
            return False
        return not impl.refuses([None if dtype is None else np.dtype(dtype)], [])


class CpuBackend(Backend):
    """The CPU backend. Its `engine` (ember.ops.cpu.engine.CpuEngine) owns the kernel pool,
    its board and BLAS's threads during runs: the process's one engine, as those are the
    process's (made with the first CPU backend, or by the first kernel that needs it)."""

    name = "cpu"

    def __init__(self) -> None:
        self.engine = cpu_engine.current()

    def describe(self) -> str:
        return "cpu (numpy)"
