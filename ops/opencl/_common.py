"""Shared pieces of the OpenCL kernels: C type names, compiling and launching, strides for
broadcasting. Imports no pyopencl at module level (kernel modules must import on machines
without it, so the ops table and `ember info` can list what the backend supports).

Every helper that touches the device takes the backend instance it works on as its first
argument, `be`: the `OpenCLBackend` (context, queue, allocator) an op was bound to at plan time,
`self.device` in an op's methods. Nothing here looks a backend up by name, so two backend
instances (two contexts, two queues) run side by side, each with its own kernel objects and
cached device buffers (`be.cache(name)`)."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

# numpy dtype -> OpenCL C type. float64 needs the cl_khr_fp64 extension (PoCL has it);
# float16 is stored as `half` and computed in float via vload_half/vstore_half.
C_TYPES = {
    np.dtype(np.float32): "float", np.dtype(np.float64): "double",
    np.dtype(np.int8): "char", np.dtype(np.uint8): "uchar", np.dtype(np.int16): "short",
    np.dtype(np.uint16): "ushort", np.dtype(np.int32): "int", np.dtype(np.uint32): "uint",
    np.dtype(np.int64): "long", np.dtype(np.uint64): "ulong", np.dtype(np.bool_): "uchar",
}
FLOAT_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
NUMERIC_TYPES = frozenset(C_TYPES)
PREAMBLE = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"


def c_type(dtype) -> str:
    return C_TYPES[np.dtype(dtype)]


def kernel(be, source: str, name: str, options: tuple[str, ...] = ()):
    """Kernel `name` from OpenCL C `source` on backend `be` (built once per backend instance;
    programs are cached in memory and on disk, kernel objects per instance)."""
    return be.kernel(PREAMBLE + source, name, tuple(options))


def launch(be, knl, global_size, *args, local_size=None) -> None:
    """Enqueue `knl` over `global_size` work items. Arrays are passed as plain `__global T*`
    buffers: one with an offset or not C-contiguous is copied to a fresh buffer first.

    Setting a kernel's arguments and enqueueing it happen under the backend's launch lock:
    kernel objects are shared by every thread, and pyopencl's `knl(queue, ...)` is set_args
    followed by an enqueue, which two threads could otherwise interleave. `knl` must come
    from `kernel(be, ...)`: it is enqueued on `be`'s queue."""
    flat = [contiguous(a).data if isinstance(a, be.cl_array.Array) else a for a in args]
    if knl not in be.typed_kernels:
        # pyopencl converts untyped numpy scalars on a generic path (~20 us each on PoCL):
        # type them once per kernel object, from the first call (a kernel's C signature fixes
        # its argument types, so every call passes the same ones)
        with be.launch_lock:  # not while another thread sets this kernel's arguments
            knl.set_scalar_arg_dtypes([a.dtype if isinstance(a, np.generic) else None
                                       for a in flat])
            be.typed_kernels.add(knl)
    if isinstance(global_size, int):
        global_size = (global_size,)
    global_size = tuple(max(int(g), 1) for g in global_size)
    if local_size is None and be.max_group_items:
        local_size = capped_local_size(global_size, be.max_group_items)
    with be.launch_lock:
        knl(be.queue, global_size, local_size, *flat)
        if be.guard is not None:  # EMBER_OPENCL_CHECK: find kernels that write out of bounds
            be.guard.check(knl, global_size, [(i, a) for i, a in enumerate(flat)
                                              if isinstance(a, be.cl.MemoryObjectHolder)])


@lru_cache(maxsize=4096)
def capped_local_size(global_size: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """A work-group shape dividing `global_size` (OpenCL 1.2 needs that) with at most `cap`
    work items, filling the first axes first.

    Why: on a CPU device PoCL runs a whole work-group inside one worker thread's stack, with
    the private variables of every work item laid side by side. Left to choose, it makes
    groups of thousands of items, and the GEMM's registers and edge buffer (~3 KB an item)
    then overflow the 8 MiB thread stack: the segfaults of issue 10."""
    local, room = [], cap
    for g in global_size:
        d = _largest_divisor_at_most(g, room)
        local.append(d)
        room //= d
    return tuple(local)


def _largest_divisor_at_most(n: int, bound: int) -> int:
    if n <= bound:
        return n
    best = 1
    i = 1
    while i * i <= n and i <= bound:
        if n % i == 0:
            best = max(best, i)
            if n // i <= bound:
                return n // i  # the co-divisors fall as i grows: the first that fits is largest
        i += 1
    return best


def contiguous(x):
    """`x` as a C-contiguous device array starting at its buffer's first byte (a copy only
    when needed)."""
    if x.flags.c_contiguous and x.offset == 0:
        return x
    return x.copy()


def broadcast_strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    """Element strides of a C-contiguous array of `shape` broadcast to `out_shape` (0 on
    broadcast axes), right-aligned, as int64."""
    strides = np.zeros(len(out_shape), np.int64)
    step = 1
    for i in range(1, len(shape) + 1):
        if shape[-i] != 1:
            strides[-i] = step
        step *= shape[-i]
    return strides


def cached_table(be, values: np.ndarray, limit: int = 1024):
    """`values` (a small index or layout table) on `be`'s device, uploaded once per distinct
    content: the same tables come back every run."""
    tables = be.cache("common.tables")
    key = (values.dtype.char, values.tobytes())
    table = tables.get(key)
    if table is None:
        if len(tables) > limit:
            tables.clear()
        table = tables[key] = be.to_device(values)
    return table


def device_int64(be, values) -> object:
    """A small int64 vector on `be`'s device (shapes, strides) for kernels to index with."""
    return be.to_device(np.ascontiguousarray(values, dtype=np.int64))
