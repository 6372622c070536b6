"""Memory layouts of images that the CPU kernels hand each other."""
from __future__ import annotations

import numpy as np


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


def pixel_stride(x) -> int | None:
    """The distance in values between neighbouring pixels of x (N, C, *spatial), where each
    pixel's C channels are contiguous and the pixels, image after image, are evenly spaced
    (a channels-last image: C; a channel slice of one, a Split's part: the whole image's
    channels); else None."""
    if x.ndim < 3 or x.strides[1] != x.itemsize and x.shape[1] > 1:
        return None
    step = None
    for n, st in zip(reversed((x.shape[0],) + x.shape[2:]),
                     reversed((x.strides[0],) + x.strides[2:])):
        if n == 1:
            continue
        if step is None:
            if st % x.itemsize or st // x.itemsize < x.shape[1]:
                return None
            step, expected = st // x.itemsize, st
        if st != expected:
            return None
        expected = st * n
    return x.shape[1] if step is None else step


def memory_span(x) -> int | None:
    """The values from a strided view's first to its last, where a kernel reads it where it
    lies as one run of memory (`as_run`: a Split's channel slice of an image); None where x
    is C-ordered or its strides are not whole non-negative values."""
    if x.flags.c_contiguous or x.size == 0 or any(
            st < 0 or st % x.itemsize for n, st in zip(x.shape, x.strides) if n > 1):
        return None
    return 1 + sum((n - 1) * st // x.itemsize for n, st in zip(x.shape, x.strides) if n > 1)


def as_run(x, span: int):
    """x's memory from its first value on, `span` values (`memory_span`), as a 1-D view."""
    return np.lib.stride_tricks.as_strided(x, (span,), (x.itemsize,))


def memory_order(inputs: tuple) -> tuple[int, ...] | None:
    """The axes of the first dense input of the inputs' broadcast shape in its memory's order
    (a channels-last image between convolutions: (0, 2, 3, 1)), where that is a permutation
    of C order other than the identity; else None (C order, no such input, or shapes that do
    not broadcast: the portable kernel raises numpy's error). A strided view (a Split's part
    of an image) is passed over for a dense input after it; with none, the first view's
    order of strides stands, so that a copy of it reads its memory in order."""
    try:
        shape = np.broadcast_shapes(*(x.shape for x in inputs))
    except ValueError:
        return None
    views = []
    for x in inputs:
        if x.shape != shape or x.ndim < 2:
            continue
        if x.flags.c_contiguous:
            return None
        order = tuple(sorted(range(x.ndim), key=lambda axis: -x.strides[axis]))
        if x.transpose(order).flags.c_contiguous:
            return order
        views.append(order)
    return views[0] if views and views[0] != tuple(range(len(shape))) else None


def moved(x, order: tuple[int, ...]):
    """x (broadcast to the rank of `order` by leading ones) with its axes in that order."""
    rank = len(order)
    return x.reshape((1,) * (rank - x.ndim) + x.shape).transpose(order)


def in_memory_order(inputs: tuple) -> tuple[list, tuple[int, ...] | None]:
    """The inputs with their axes in the memory order of the first one of the result's shape
    (`memory_order`), and the transpose that takes a result computed in that order back to
    the inputs' axes (None: no change). The result then has that input's layout, as numpy's
    ufuncs give it, and no input of that layout is copied to C order for the loop."""
    order = memory_order(inputs)
    if order is None:
        return list(inputs), None
    return [moved(x, order) for x in inputs], tuple(int(axis) for axis in np.argsort(order))
