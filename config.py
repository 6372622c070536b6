"""The environment variables ember reads: each is named, parsed and documented here, once.

| variable | default | read when | what it sets |
|---|---|---|---|
| `EMBER_BACKEND` | `cpu` | a session is made without a backend; "gpu" is resolved | the backend |
| `EMBER_CACHE_DIR` | `$XDG_CACHE_HOME/ember` (`~/.cache/ember`) | a backend compiles | where compiled OpenCL programs are kept |
| `EMBER_LOG` | unset: no handler | `import ember` (`opencl`: an OpenCL backend is made) | the `ember` logger's level (debug ... critical, or a number); `opencl` in its comma list shows compiler diagnostics |
| `EMBER_NUMBA` | on | the first compiled kernel | off: the numpy kernels only |
| `EMBER_POOL_PRODUCTS` | on | the first matrix product | off: products through numpy's matmul, not ember's thread pool |
| `EMBER_KEEP_MEMORY` | on | the first session | off: glibc malloc and the kernels keep no freed memory |
| `EMBER_RANDOM_SEED` | unset: OS entropy | each run of a random op without a `seed` | the generator's seed |
| `EMBER_MAX_TENSOR_BYTES` | half the memory the process may use | a session is made | the largest tensor a node may make (`ember.limits`) |
| `EMBER_MAX_LOOP_ITERATIONS` | 2**31 | each run of a Loop | the most iterations one run may make |
| `EMBER_OPENCL_DEVICE` | a GPU, else the first device | an OpenCL backend is made | which device (a name fragment or an index) |
| `EMBER_OPENCL_CHECK` | off | an OpenCL backend is made | guard bytes around device buffers, checked after each kernel |
| `EMBER_CUDA_DEVICE` | 0 | the CUDA backend is made | which device |
| `EMBER_SIMPLIFY_STRICT` | off | each `simplify` | on: the importer's check after every simplifier round that changed the graph (a debug mode; the tests turn it on) |
| `EMBER_WIDEN_HALF` | on | each `simplify` for the CPU | off: float16 nodes compute in float16, as written, not in float32 (the simplifier's `compute_float16_in_float32`) |

A switch is off for `0`, `false`, `no` or an empty value (any case) and on for anything else.
Each setting is read when what it sets is made, as the table says, so a process may change a
variable before it makes a session (or runs a Loop) and the next one follows it."""
from __future__ import annotations

import os

VARIABLES = ("EMBER_BACKEND", "EMBER_CACHE_DIR", "EMBER_LOG", "EMBER_NUMBA",
             "EMBER_POOL_PRODUCTS", "EMBER_KEEP_MEMORY", "EMBER_RANDOM_SEED",
             "EMBER_MAX_TENSOR_BYTES", "EMBER_MAX_LOOP_ITERATIONS", "EMBER_OPENCL_DEVICE",
             "EMBER_OPENCL_CHECK", "EMBER_CUDA_DEVICE", "EMBER_SIMPLIFY_STRICT",
             "EMBER_WIDEN_HALF")

_OFF = ("0", "false", "no", "")


def text(name: str) -> str | None:
    """The variable's value, stripped; None where it is unset or empty."""
    _known(name)
    value = os.environ.get(name, "").strip()
    return value or None


def switch(name: str, default: bool) -> bool:
    """An on/off variable: `default` where it is unset, else off for 0, false, no or empty."""
    _known(name)
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


def cache_root() -> str:
    """ember's cache folder: $EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember or ~/.cache/ember."""
    return text("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "ember")


def _known(name: str) -> None:
    if name not in VARIABLES:  # a new variable is added to the table above first
        raise KeyError(f"{name} is not one of ember's settings (ember.config.VARIABLES)")
