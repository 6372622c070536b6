"""Memory layouts of images that the CPU kernels hand each other."""
from __future__ import annotations


def channels_last(x) -> bool:
    """Whether x (N, C, *spatial) is a view of C-contiguous (N, *spatial, C) memory (and not
    also plain C-contiguous, as when C or the spatial size is 1)."""
    if x.ndim < 3 or x.flags.c_contiguous:
        return False
    return x.transpose(0, *range(2, x.ndim), 1).flags.c_contiguous


def pixel_rows(x):
    """A channels-last (N, C, *spatial) array as its (pixels, C) rows (a view), or None."""
    if x is None:
        return None
    rows = x.transpose(0, *range(2, x.ndim), 1)
    return rows.reshape(-1, x.shape[1]) if rows.flags.c_contiguous else None
