"""No-op removal: nodes whose output equals one of their inputs.

Identity, Dropout in inference, Cast/CastLike to the type the value already has, Reshape /
Expand / Flatten / Squeeze / Unsqueeze to the shape it already has, an identity Transpose,
a single-input Concat, Sum, Max, Min or Mean, and x+0, x-0, x*1, x/1 where the constant does
not broadcast the result to a larger shape or another type.
"""
from __future__ import annotations

import numpy as np

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, alias, drop_dead

_SHAPE_PRESERVING_WHEN_EQUAL = {"Reshape", "Expand", "Flatten", "Squeeze", "Unsqueeze"}
_SINGLE_INPUT_PASSTHROUGH = {"Concat", "Sum", "Max", "Min", "Mean"}
_NEUTRAL = {"Add": (0.0, "either"), "Sub": (0.0, "second"), "Mul": (1.0, "either"),
            "Div": (1.0, "second")}


def remove_noops(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for node in graph.nodes:
        if node.domain or not index.alive(node):
            continue
        source = passthrough_input(node, index)
        if source is None or source == node.outputs[0]:
            continue
        if alias(graph, index, node.outputs[0], source):
            index.kill(node)
            changed = True
    drop_dead(graph, index)
    return changed


def passthrough_input(node: Node, index: GraphIndex) -> str | None:
    """The input a node's (only) output equals, or None."""
    op = node.op_type
    if not node.outputs or not node.inputs or not node.inputs[0]:
        return None
    x = node.inputs[0]
    if op == "Identity":
        return x
    if op == "Dropout":
        return x if _inference_dropout(node, index) else None
    if len([o for o in node.outputs if o]) != 1 or node.outputs[0] == "":
        return None
    if op in ("Cast", "CastLike"):
        want = _cast_target(node, index)
        return x if want is not None and want == index.dtype(x) else None
    if op in _SHAPE_PRESERVING_WHEN_EQUAL:
        before, after = index.static_shape(x), index.static_shape(node.outputs[0])
        same_type = index.dtype(x) is not None and index.dtype(x) == index.dtype(node.outputs[0])
        return x if before is not None and before == after and same_type else None
    if op == "Transpose":
        perm = node.attrs.get("perm")
        # the identity permutation only (a malformed perm is the op's to report, not ours to drop)
        return x if perm is not None and list(perm) == list(range(len(perm))) else None
    if op in _SINGLE_INPUT_PASSTHROUGH and len(node.inputs) == 1:
        return x
    if op in _NEUTRAL and len(node.inputs) == 2:
        return _neutral_operand(node, index)
    return None


def _inference_dropout(node: Node, index: GraphIndex) -> bool:
    if len(node.outputs) > 1 and node.outputs[1] and index.uses(node.outputs[1]):
        return False  # the mask is read
    if node.version < 7 and not node.attrs.get("is_test", 0):
        return False  # before opset 7 Dropout trains unless is_test is set
    if len(node.inputs) > 2 and node.inputs[2]:
        training = index.constant(node.inputs[2])
        return training is not None and not bool(training.reshape(-1)[0])
    return True


def _cast_target(node: Node, index: GraphIndex) -> np.dtype | None:
    if node.op_type == "CastLike":
        return index.dtype(node.inputs[1]) if len(node.inputs) > 1 else None
    from ember.importer.onnx_values import onnx_to_np_dtype

    to = node.attrs.get("to")
    return None if to is None else onnx_to_np_dtype(int(to))


def _neutral_operand(node: Node, index: GraphIndex) -> str | None:
    neutral, side = _NEUTRAL[node.op_type]
    a, b = node.inputs
    candidates = [(a, b), (b, a)] if side == "either" else [(a, b)]
    out_shape = index.static_shape(node.outputs[0])
    for x, c in candidates:
        value = index.constant(c)
        if value is None or value.size == 0 or value.dtype.kind not in "fiuc":
            continue
        if not np.all(value == neutral):
            continue
        x_shape, x_type = index.shape(x), index.dtype(x)
        if x_shape is None or x_type is None or x_type != value.dtype:
            continue
        # the constant must not widen the result: rank and every dimension stay x's
        if value.ndim > len(x_shape):
            continue
        if any(d != 1 for d in value.shape) and (out_shape is None or
                                                 tuple(out_shape) != tuple(x_shape)):
            continue
        return x
    return None
