"""The CPU engine: what makes the CPU backend fast, below the ops that lower onto it.

- `threads`: the BLAS libraries' thread counts during runs, and the cores this process has;
- `compiled`: numba-compiled kernels, atomics, and the pool of helper threads that split a
  kernel's rows among the cores;
- `blas`: GEMM split in pieces on the pool's board, with OpenBLAS kept at one thread;
- `tiles`: explicit AVX-512 / AVX2 register tiles (convolutions, recurrences' products);
- `memory`: glibc malloc's thresholds, so a run reuses the last run's pages.

Ops call these from their CPU kernels; the engine imports no op, no IR and no runtime.
"""
