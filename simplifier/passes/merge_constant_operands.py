"""(x + a) + b -> x + (a + b) and (x * a) * b -> x * (a * b) for constants a and b: the
constants are combined once instead of applied one after the other (BERT's position and
segment embeddings of a fixed-shape export are two constant Adds after the token lookup).

The combined constant broadcasts to no more than a and b did, so the result's shape is
unchanged; only the order of the float roundings differs (for float16 and bfloat16, only
where a op b is exact in the narrow type)."""
from __future__ import annotations

import numpy as np

from ember.ir import Graph
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead, folds_exactly

_COMBINE = {"Add": np.add, "Mul": np.multiply}


def merge_constant_operands(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for outer in index.live(*_COMBINE):
        if len(outer.inputs) != 2:
            continue
        for side in (0, 1):
            inner = index.single_use_producer(outer.inputs[side], outer.op_type)
            b = index.constant(outer.inputs[1 - side])
            operands = _variable_and_constant(inner, index) if inner is not None else None
            if b is None or operands is None:
                continue
            x, a = operands
            if a.dtype != b.dtype or a.dtype.kind not in "fiu":
                continue
            try:
                shape = np.broadcast_shapes(a.shape, b.shape)
            except ValueError:
                continue
            if np.prod(shape) > max(ctx.max_folded_elements, a.size, b.size):
                continue
            with np.errstate(all="ignore"):
                combined = _COMBINE[outer.op_type](a, b).astype(a.dtype)
            if outer.op_type == "Mul" and a.dtype.kind == "f" and not _representable(a, b,
                                                                                    combined):
                continue
            if a.dtype.kind == "f" and not folds_exactly(
                    _COMBINE[outer.op_type](a.astype(np.float64), b.astype(np.float64)), a.dtype):
                continue  # a float16 a + b would be rounded where x + a was (graph.py)
            index.hand_over_read(x, inner, outer)
            outer.inputs = [x, index.add_constant(outer.inputs[1 - side], combined)]
            index.kill(inner)
            changed = True
            break
    drop_dead(graph, index)
    return changed


def _variable_and_constant(node, index: GraphIndex):
    """(x, a) for a two-input node computing x op a with exactly one constant operand."""
    if len(node.inputs) != 2:
        return None
    first, second = (index.constant(n) for n in node.inputs)
    if (first is None) == (second is None):
        return None  # two constants are constant folding's; none is not ours
    return (node.inputs[1], first) if first is not None else (node.inputs[0], second)


def _representable(a: np.ndarray, b: np.ndarray, product: np.ndarray) -> bool:
    """Whether a * b neither overflows nor underflows to zero where a and b do not: x * a * b
    can be finite and non-zero when the product of the constants alone is not."""
    expected_finite = np.isfinite(a) & np.isfinite(b)
    expected_nonzero = (a != 0) & (b != 0)
    return bool(np.all(np.isfinite(product) | ~expected_finite) and
                np.all((product != 0) | ~expected_nonzero))
