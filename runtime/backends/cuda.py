"""The CUDA backend, through cupy (`pip install 'ember[cuda]'`, the cupy-cuda12x wheel), for
NVIDIA GPUs with a CUDA 12 driver.

Device arrays are `cupy.ndarray`. Kernels (ops/cuda/) are either the CPU kernels' own array
code run over cupy, or CUDA C compiled by cupy (RawKernel / ElementwiseKernel, cached by cupy
in memory and on disk under ~/.cupy/kernel_cache). Matrix products go to cuBLAS through
cupy.matmul.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ember import config
from ember.errors import BackendUnavailableError
from ember.ops.cuda._common import DEVICE_DTYPES
from ember.runtime.backends.base import Backend

INSTALL_HINT = "pip install 'ember[cuda]' (cupy-cuda12x, for a CUDA 12 driver)"


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int | None = None):
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the CUDA backend needs cupy, which is not installed: {INSTALL_HINT}") from exc
        except Exception as exc:  # a broken cupy install (e.g. two cupy wheels side by side)
            raise BackendUnavailableError(
                f"the CUDA backend could not import cupy ({type(exc).__name__}: {exc}); "
                f"reinstall it: {INSTALL_HINT}") from exc
        self.cp = self.xp = cupy  # the kernels' array namespace (OpImpl.xp)
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no driver, or a driver older than the CUDA runtime
            raise BackendUnavailableError(
                "the CUDA backend found no usable NVIDIA driver (cupy.cuda.runtime."
                f"getDeviceCount() failed: {exc}); it needs an NVIDIA GPU with a CUDA 12 "
                "driver") from exc
        if count < 1:
            raise BackendUnavailableError(
                "the CUDA backend found no CUDA device (the NVIDIA driver reports 0 GPUs)")
        if device is None:
            device = int(config.text("EMBER_CUDA_DEVICE") or 0)
        if not 0 <= device < count:
            raise BackendUnavailableError(
                f"no CUDA device {device}: this machine has {count} (EMBER_CUDA_DEVICE)")
        self.device_id = device
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.fallbacks = 0  # kernel calls that ran on the CPU for want of a native dtype/case
        self.transfers = {"to_device": 0, "to_host": 0}  # real copies by to_device / to_host
        import ember.ops.cuda  # noqa: F401  (registers the CUDA kernels)

    def describe(self) -> str:
        try:
            props = self.cp.cuda.runtime.getDeviceProperties(self.device_id)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else name
            return f"cuda (device {self.device_id}: {name}, cupy {self.cp.__version__})"
        except Exception:
            return f"cuda (device {self.device_id}, cupy {self.cp.__version__})"

    # -- arrays -------------------------------------------------------------------------------
    def is_device_array(self, value: Any) -> bool:
        return isinstance(value, self.cp.ndarray)

    def empty(self, shape, dtype):
        return self.cp.empty(tuple(int(d) for d in shape), np.dtype(dtype))

    def to_device(self, value: Any) -> Any:
        if isinstance(value, (np.ndarray, np.generic)) and np.dtype(value.dtype) in DEVICE_DTYPES:
            self.transfers["to_device"] += 1
            return self.cp.asarray(value)
        return value  # device arrays as they are; sequences, optionals, strings and ml_dtypes
        # stay on the host

    def to_host(self, value: Any) -> Any:
        if isinstance(value, self.cp.ndarray):
            self.transfers["to_host"] += 1
            return self.cp.asnumpy(value)
        if isinstance(value, list):
            return [self.to_host(v) for v in value]
        return value

    def synchronize(self) -> None:
        self.cp.cuda.Device(self.device_id).synchronize()
