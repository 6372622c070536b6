"""The OpenCL backend's bounds-checked mode (`EMBER_OPENCL_CHECK=1`).

PoCL runs kernels inside the host process, so a kernel that writes past its buffer corrupts
the Python heap and the process dies later, somewhere unrelated. In this mode every device
buffer is allocated exactly to size with a guard band of canary bytes before and after it (a
sub-buffer of a larger one), and after each kernel launch the queue is drained and the guards
of every buffer the kernel was given are checked. The first kernel that touches a guard raises
`OutOfBoundsError` naming itself, its global size and which argument it overran.

Reads out of bounds are not caught (they corrupt nothing); writes are. The mode costs a queue
drain and two small reads per buffer argument per launch: it is for tests and debugging.
"""
from __future__ import annotations

import numpy as np

from ember import config

GUARD_BYTES = 4096  # a multiple of every device's base address alignment we have met
CANARY = 0xA5


def enabled() -> bool:
    return config.switch("EMBER_OPENCL_CHECK", False)


class OutOfBoundsError(RuntimeError):
    """A kernel wrote outside the buffer it was given (a bug in ember's OpenCL code)."""


class GuardedAllocator:
    """A pyopencl allocator: `allocator(nbytes) -> Buffer`, each buffer framed by canaries."""

    def __init__(self, cl, context, queue):
        self.cl, self.context, self.queue = cl, context, queue
        self._guarded: dict[int, tuple[object, int]] = {}  # sub-buffer ptr -> (parent, nbytes)
        self._canary = np.full(GUARD_BYTES, CANARY, np.uint8)

    def __call__(self, nbytes: int):
        nbytes = max(int(nbytes), 1)
        self._prune()
        cl = self.cl
        parent = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes + 2 * GUARD_BYTES)
        cl.enqueue_copy(self.queue, parent, self._canary, dst_offset=0)
        cl.enqueue_copy(self.queue, parent, self._canary, dst_offset=GUARD_BYTES + nbytes)
        buffer = parent.get_sub_region(GUARD_BYTES, nbytes)
        self._guarded[buffer.int_ptr] = (parent, nbytes)
        return buffer

    def _prune(self) -> None:
        """Forget buffers whose sub-buffer is gone (the parent's only reference is ours)."""
        if len(self._guarded) < 256:
            return
        self._guarded = {ptr: (parent, n) for ptr, (parent, n) in self._guarded.items()
                         if parent.reference_count > 1}

    def check(self, kernel, global_size, buffers) -> None:
        """Drain the queue, then raise if `kernel` overwrote a guard of any of `buffers`."""
        self.queue.finish()
        seen = set()
        for position, buffer in buffers:
            entry = self._guarded.get(buffer.int_ptr)
            if entry is None or buffer.int_ptr in seen:
                continue  # scratch or foreign buffers are not guarded
            seen.add(buffer.int_ptr)
            parent, nbytes = entry
            for where, offset in (("before", 0), ("after", GUARD_BYTES + nbytes)):
                band = np.empty(GUARD_BYTES, np.uint8)
                self.cl.enqueue_copy(self.queue, band, parent, src_offset=offset)
                self.queue.finish()
                bad = np.flatnonzero(band != CANARY)
                if bad.size:
                    first = int(bad[0]) - GUARD_BYTES if where == "before" else int(bad[0])
                    # restore the band so one bug is reported once
                    self.cl.enqueue_copy(self.queue, parent, self._canary, dst_offset=offset)
                    raise OutOfBoundsError(
                        f"OpenCL kernel '{kernel.function_name}' (global size {global_size}) "
                        f"wrote {bad.size} byte(s) {where} argument {position} "
                        f"({nbytes} bytes), the first at byte {first} {where} it")
