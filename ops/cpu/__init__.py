"""The CPU engine: what makes the CPU backend fast, below the ops that lower onto it.

- `engine`: `CpuEngine`, the process's one object owning the run-time state the kernels share:
  the BLAS libraries' thread counts during runs, the kernel pool (helper threads and the
  board they watch) and the kept large buffers; `current()` gives it (`process`);
- `threads`: the BLAS libraries' thread counts during runs, and the cores this process has;
- `compiled`: numba-compiled kernels, atomics, and the helper threads that split a kernel's
  rows among the cores;
- `blas`: GEMM split in pieces on the pool's board, with OpenBLAS kept at one thread;
- `tiles`: explicit AVX-512 / AVX2 register tiles (convolutions, recurrences' products);
- `memory`: glibc malloc's thresholds, so a run reuses the last run's pages.

Ops call these from their CPU kernels; the engine imports no op, no IR and no runtime.
"""
# The engine hands its class to ember.ops.cpu.process, where the kernels' modules find the
# process's engine: imported here so that it has whichever of them is imported first.
from ember.ops.cpu import engine

__all__ = ["engine"]
