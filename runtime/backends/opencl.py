"""The OpenCL backend, through pyopencl. With the `opencl` extra (`pyopencl[pocl]`) a portable
CPU device (PoCL) is always there, so it runs on any machine.

Device arrays are `pyopencl.array.Array`. Kernels (ops/opencl/) compile their OpenCL C through
`OpenCLBackend.kernel` / `program`, which cache built programs per (device, source hash, build
options) in memory and as binaries on disk, so a second load of a model compiles nothing.

A backend is an object: each `OpenCLBackend()` has its own context, queue, allocator, kernel
objects and cached device buffers (`cache`). An op kernel runs on the instance it was bound to
at plan time (`OpImpl.device`); `get_backend("opencl")` is only the process's default instance,
and `ember.load(model, backend=OpenCLBackend(...))` runs a session on another.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np

from ember import config
from ember.errors import BackendUnavailableError
from ember.runtime.backends.base import Backend
from ember.runtime.backends.opencl_guard import GuardedAllocator
from ember.runtime.backends.opencl_guard import enabled as guard_enabled

INSTALL_HINT = "pip install 'ember[opencl]' (pyopencl with PoCL, a CPU OpenCL driver)"
# dtypes that move to the device; everything else (strings, ml_dtypes) stays on the host and
# the kernels that meet it fall back to the CPU.
DEVICE_DTYPES = frozenset(np.dtype(t) for t in (
    np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16, np.int32,
    np.uint32, np.int64, np.uint64, np.bool_))
# Work items per group on CPU devices: 256 items x 32 KB of private state fit the 8 MiB stack.
CPU_MAX_GROUP_ITEMS = 256


# CPUs that LLVM (PoCL's compiler) models with AVX-512, by the names PoCL's device version
# gives its target ("... HSTR: pthread-x86_64-unknown-linux-gnu-<cpu>").
_AVX512_TARGETS = frozenset({
    "knl", "knm", "skylake-avx512", "skx", "cascadelake", "cooperlake", "cannonlake",
    "icelake-client", "icelake-server", "tigerlake", "rocketlake", "sapphirerapids",
    "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids", "znver4", "znver5",
    "x86-64-v4"})


def gemm_vector_bits(device_version: str, cpu_device: bool) -> int:
    """The width of the vectors ember's GEMM kernels accumulate in: 512 bits, or 256 on a
    PoCL CPU device whose compiler targets a CPU it does not model with AVX-512. PoCL 3.0
    (LLVM 14) names an AVX-512 Zen 4 "znver3" yet reports 16-float native vectors, and its
    code generator then aborted the whole process ("LLVM ERROR: Do not know how to scalarize
    this operator's operand!") on the 16-float GEMM; 8-float vectors compile and run."""
    if not cpu_device or "HSTR:" not in device_version:
        return 512
    hstr = device_version.split("HSTR:", 1)[1].strip().lower()  # ...-linux-gnu-<cpu>
    return 512 if any(hstr.endswith("-" + cpu) for cpu in _AVX512_TARGETS) else 256


def default_cache_dir() -> str:
    return os.path.join(config.cache_root(), "opencl")


class OpenCLBackend(Backend):
    name = "opencl"

    def __init__(self, device_hint: str | None = None, cache_dir: str | None = None):
        # PoCL compiles each kernel's machine code again for every new work-group size and
        # grid size it meets, so every new batch size meant seconds of silent codegen (1.5 s
        # for the demo CNN). Unspecialised work-group functions compile once per kernel and
        # measured as fast here (demo CNN batch 8: 5.8 vs 6.0 ms; transformer 16 vs 16 ms).
        # Read when PoCL first compiles; a value the user set wins.
        os.environ.setdefault("POCL_WORK_GROUP_SPECIALIZATION", "0")
        try:
            import pyopencl as cl
            import pyopencl.array as cl_array
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the OpenCL backend needs pyopencl, which is not installed: {INSTALL_HINT}") from exc
        self.cl, self.cl_array = cl, cl_array
        self.device = self._pick_device(device_hint or config.text("EMBER_OPENCL_DEVICE"))
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        # Pooled buffers: a fresh clCreateBuffer per kernel output costs more than the kernel
        # on large tensors; freed values return their buffers to the pool.
        import pyopencl.tools as cl_tools
        self.guard = GuardedAllocator(cl, self.context, self.queue) if guard_enabled() else None
        self.allocator = self.guard or cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        # Largest work-group that launches choose on a CPU device (see
        # ops/opencl/_common.capped_local_size); None leaves the choice to the driver.
        self.cpu_device = bool(self.device.type & cl.device_type.CPU)
        self.max_group_items = CPU_MAX_GROUP_ITEMS if self.cpu_device else None
        self.vector_bits = gemm_vector_bits(self.device.version, self.cpu_device)
        self.launch_lock = threading.Lock()
        self.typed_kernels: set = set()  # kernel objects whose scalar argument types are set
        self.cache_dir = cache_dir or default_cache_dir()
        self._programs: dict[str, Any] = {}
        # (source, kernel name, options) -> the kernel object, shared by every op and thread
        # of this instance (launch sets its arguments under launch_lock)
        self._kernels: dict[tuple, Any] = {}
        # Kernel modules' caches of device objects (layout tables, scratch buffers...), by
        # name: they belong to this instance's context (see `cache`).
        self._caches: dict[str, dict] = {}
        # Reentrant: `kernel` holds it while `program` takes it again.
        self._build_lock = threading.RLock()
        self.compiled_from_source = 0  # programs built from source (not from a cache)
        self.compile_seconds = 0.0  # time spent building them
        self._log_compiles = "opencl" in (config.text("EMBER_LOG") or "").lower().split(",")
        self._announced_compiles = False
        self.fallbacks = 0  # kernel calls that ran on the CPU for want of a native dtype/case
        self.transfers = {"to_device": 0, "to_host": 0}  # real copies by to_device / to_host
        self.device_key = hashlib.sha256(
            f"{self.device.platform.name}|{self.device.name}|{self.device.version}|"
            f"{self.device.driver_version}".encode()).hexdigest()[:16]
        import ember.ops.opencl  # noqa: F401  (registers the OpenCL kernels)

    def _pick_device(self, hint: str | None):
        cl = self.cl
        try:
            platforms = cl.get_platforms()
        except cl.Error as exc:  # no ICD loader configuration at all
            raise BackendUnavailableError(
                f"no OpenCL platform found ({exc}); {INSTALL_HINT}, or install your GPU's "
                "OpenCL driver") from exc
        devices = [d for p in platforms for d in p.get_devices()]
        if not devices:
            raise BackendUnavailableError(f"OpenCL platforms exist but offer no device; {INSTALL_HINT}")
        if hint:
            chosen = [d for d in devices if hint.lower() in f"{d.platform.name} {d.name}".lower()]
            if not chosen:
                raise BackendUnavailableError(
                    f"no OpenCL device matches EMBER_OPENCL_DEVICE='{hint}'; devices: "
                    + ", ".join(f"{d.platform.name}: {d.name}" for d in devices))
            return chosen[0]
        gpus = [d for d in devices if d.type & cl.device_type.GPU]
        return (gpus or devices)[0]

    def describe(self) -> str:
        return f"opencl ({self.device.platform.name}: {self.device.name.strip()})"

    # -- programs -----------------------------------------------------------------------------
    def program(self, source: str, options: tuple[str, ...] = ()):
        """A built program for `source`, from memory, the disk cache, or compiled now.

        Compiler diagnostics are silenced (`-w`) unless EMBER_LOG names `opencl`. When
        compiling from source has taken over a second in this process, one line on stderr says
        what is happening (once: later programs compile silently)."""
        key = hashlib.sha256("\0".join((self.device_key, source, *options)).encode()).hexdigest()
        program = self._programs.get(key)
        if program is not None:
            return program
        with self._build_lock:  # one build per program, however many threads want it
            program = self._programs.get(key)
            if program is None:
                program = self._load_or_build(key, source, options)
                self._programs[key] = program
        return program

    def kernel(self, source: str, name: str, options: tuple[str, ...] = ()):
        """Kernel `name` of the program built from `source` with `options` (see `program`),
        one object per (source, name, options) for this instance."""
        key = (source, name, options)
        knl = self._kernels.get(key)
        if knl is None:
            with self._build_lock:
                knl = self._kernels.get(key)
                if knl is None:
                    knl = self._kernels[key] = getattr(self.program(source, options), name)
        return knl

    def cache(self, name: str) -> dict:
        """The dict called `name` (by convention "<module>.<what>") in which a kernel module
        keeps device objects it reuses across calls (tables, scratch buffers, kernels): they
        belong to this instance's context, so they live on it, not in module globals."""
        table = self._caches.get(name)
        if table is None:
            table = self._caches.setdefault(name, {})
        return table

    def _load_or_build(self, key: str, source: str, options: tuple[str, ...]):
        with warnings.catch_warnings():
            if not self._log_compiles:
                warnings.simplefilter("ignore", self.cl.CompilerWarning)
            build_options = list(options) + ([] if self._log_compiles else ["-w"])
            path = os.path.join(self.cache_dir, self.device_key, f"{key}.bin")
            if os.path.exists(path):
                try:
                    with open(path, "rb") as f:
                        return self.cl.Program(self.context, [self.device], [f.read()]).build(
                            options=build_options)
                except self.cl.Error:
                    pass  # stale or foreign binary: rebuild from source
            start = time.perf_counter()
            program = self.cl.Program(self.context, source).build(options=build_options)
        elapsed = time.perf_counter() - start
        self.compiled_from_source += 1
        self.compile_seconds += elapsed
        if self._log_compiles:
            last_line = source.strip().splitlines()[-1][:60] if source.strip() else ""
            print(f"ember: compiled an OpenCL program in {elapsed:.2f} s ({last_line}...)",
                  file=sys.stderr)
        elif self.compile_seconds > 1.0 and not self._announced_compiles:
            self._announced_compiles = True
            print(f"ember: compiling OpenCL programs for {self.device.name.strip()} "
                  f"(cached in {self.cache_dir}; later loads skip this)", file=sys.stderr)
        self._save_binary(path, program)
        return program

    def _save_binary(self, path: str, program) -> None:
        try:
            binary = program.get_info(self.cl.program_info.BINARIES)[0]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)
        except (OSError, self.cl.Error):
            pass  # a read-only or full disk only costs a recompile next time

    # -- arrays -------------------------------------------------------------------------------
    def is_device_array(self, value: Any) -> bool:
        """A pyopencl array of this instance's context (another instance's arrays are not:
        they reach this one through the host)."""
        return isinstance(value, self.cl_array.Array) and value.context == self.context

    def empty(self, shape, dtype):
        return self.cl_array.empty(self.queue, tuple(int(d) for d in shape), np.dtype(dtype),
                                   allocator=self.allocator)

    def to_device(self, value: Any) -> Any:
        if isinstance(value, self.cl_array.Array) and value.context != self.context:
            value = value.get()  # another OpenCLBackend instance's array: through the host
        if isinstance(value, np.ndarray) and value.dtype in DEVICE_DTYPES:
            self.transfers["to_device"] += 1
            # np.require, unlike np.ascontiguousarray, keeps 0-d arrays 0-d
            return self.cl_array.to_device(self.queue, np.require(value, requirements="C"),
                                           allocator=self.allocator)
        if isinstance(value, np.generic) and np.dtype(value.dtype) in DEVICE_DTYPES:
            self.transfers["to_device"] += 1
            return self.cl_array.to_device(self.queue, np.asarray(value), allocator=self.allocator)
        return value  # device arrays as they are; sequences, optionals, strings and ml_dtypes
        # stay on the host

    def to_host(self, value: Any) -> Any:
        if isinstance(value, self.cl_array.Array):
            self.transfers["to_host"] += 1
            return value.get(queue=self.queue if value.context == self.context else None)
        if isinstance(value, list):
            return [self.to_host(v) for v in value]
        return value

    def synchronize(self) -> None:
        self.queue.finish()
