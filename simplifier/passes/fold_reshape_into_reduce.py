"""A reduction that keeps its reduced axes (keepdims=1), followed by a Reshape, Squeeze or
Flatten that only drops them again, is one reduction with keepdims=0 (global average pooling
then flatten before a classifier: ReduceMean over H, W to [N, C, 1, 1], Reshape to [N, C])."""
from __future__ import annotations

from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, axes_are_input, drop_dead

REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
_RESHAPES = {"Reshape", "Squeeze", "Flatten"}


def fold_reshape_into_reduce(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for reduce in index.live(*REDUCTIONS):
        if not reduce.attrs.get("keepdims", 1) or len(reduce.outputs) != 1:
            continue
        reshape = index.only_consumer(reduce.outputs[0])
        if reshape is None or reshape.domain or reshape.op_type not in _RESHAPES or \
                reshape.inputs[0] != reduce.outputs[0]:
            continue
        kept = index.static_shape(reduce.outputs[0])
        axes = reduced_axes(reduce, index)
        if kept is None or axes is None:
            continue
        # Reshape, Squeeze and Flatten keep the elements' order, so equal shapes mean equal
        # tensors: the reduction's keepdims=0 result, i.e. its output without the axes.
        dropped = tuple(d for i, d in enumerate(kept) if i not in axes)
        if index.static_shape(reshape.outputs[0]) != dropped:
            continue
        reduce.attrs = dict(reduce.attrs, keepdims=0)
        reduce.attr_types = dict(reduce.attr_types, keepdims=AttributeProto.INT)
        graph.value_info.pop(reduce.outputs[0], None)
        reduce.outputs = [reshape.outputs[0]]
        index.kill(reshape)
        changed = True
    drop_dead(graph, index)
    return changed


def reduced_axes(node: Node, index: GraphIndex) -> set[int] | None:
    """The axes a reduction reduces, non-negative; None where they are not known (axes from
    a computed input) or where there are none (noop_with_empty_axes=1: the identity)."""
    rank = index.rank(node.inputs[0])
    if rank is None:
        return None
    if axes_are_input(node):
        given = node.inputs[1] if len(node.inputs) > 1 else ""
        value = index.constant(given) if given else None
        if given and value is None:
            return None
        axes = [] if value is None else [int(a) for a in value.reshape(-1)]
        if not axes and node.attrs.get("noop_with_empty_axes", 0):
            return None
    else:
        axes = [int(a) for a in node.attrs.get("axes", [])]
    if not all(-rank <= a < rank for a in axes):
        return None
    return {a % rank for a in axes} if axes else set(range(rank))
