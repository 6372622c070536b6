"""Layer normalisation written out as ReduceMean / Sub / Pow / ReduceMean / Add / Sqrt / Div
(and an optional * gamma + beta) becomes one LayerNormalization (opset 17)."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, axes_are_input, drop_dead


def fuse_layernorm(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for div in index.live("Div"):
        found = _match(div, index)
        if found is None:
            continue
        x, axis, eps, matched = found
        scale, bias, tail, out = _affine(div, index, axis, x)
        dtype = index.dtype(x)
        if dtype is None or dtype.kind != "f":
            continue
        if scale is None:
            shape = index.static_shape(x)
            if shape is None:
                continue
            scale = index.add_constant("ln_scale", np.ones(shape[axis:], dtype))
        version = ctx.can_use("LayerNormalization", 17)
        if version is None:
            return changed
        graph.nodes.append(Node(
            "LayerNormalization", "", version, [x, scale] + ([bias] if bias else []), [out],
            attrs={"axis": axis, "epsilon": eps, "stash_type": 1},
            attr_types={"axis": AttributeProto.INT, "epsilon": AttributeProto.FLOAT,
                        "stash_type": AttributeProto.INT}, name=div.name))
        index.kill(div, *matched, *tail)
        changed = True
    drop_dead(graph, index)
    return changed


def _match(div: Node, index: GraphIndex):
    """(x, axis (negative), epsilon, nodes) when div = (x - mean(x)) / sqrt(var(x) + eps)."""
    d, std = div.inputs
    sub = index.producer.get(d)
    sqrt = index.single_use_producer(std, "Sqrt")
    if sub is None or sub.domain or sub.op_type != "Sub" or sqrt is None:
        return None
    add = index.single_use_producer(sqrt.inputs[0], "Add")
    if add is None:
        return None
    var_mean, eps_name = add.inputs
    eps = index.scalar(eps_name)
    if eps is None:
        var_mean, eps_name = eps_name, var_mean
        eps = index.scalar(eps_name)
    reduce_var = index.single_use_producer(var_mean, "ReduceMean")
    if eps is None or reduce_var is None:
        return None
    square = index.single_use_producer(reduce_var.inputs[0])
    if square is None or square.domain or not _is_square_of(square, d, index):
        return None
    x, mean = sub.inputs
    reduce_mean = index.single_use_producer(mean, "ReduceMean")
    if reduce_mean is None or reduce_mean.inputs[0] != x:
        return None
    readers = {id(n) for n in index.consumers.get(d, ())}
    if readers != {id(div), id(square)} or d in index.outputs:
        return None
    rank = index.rank(x)
    axes_mean, axes_var = _axes(reduce_mean, index, rank), _axes(reduce_var, index, rank)
    if axes_mean is None or axes_mean != axes_var:
        return None
    return x, axes_mean, eps, [sub, sqrt, add, reduce_var, square, reduce_mean]


def _is_square_of(node: Node, d: str, index: GraphIndex) -> bool:
    if node.op_type == "Pow":
        return node.inputs[0] == d and index.scalar(node.inputs[1]) == 2.0
    return node.op_type == "Mul" and node.inputs == [d, d]


def _axes(reduce: Node, index: GraphIndex, rank: int | None) -> int | None:
    """The first reduced axis, negative, when the reduction covers the trailing axes with
    keepdims; else None."""
    if not reduce.attrs.get("keepdims", 1):
        return None
    if axes_are_input(reduce):
        if len(reduce.inputs) < 2 or not reduce.inputs[1]:
            return None
        value = index.constant(reduce.inputs[1])
        axes = None if value is None else [int(a) for a in value.reshape(-1)]
    else:
        axes = reduce.attrs.get("axes")
    if not axes:
        return None
    if rank is not None:
        axes = sorted(a - rank if a >= 0 else a for a in axes)
    if any(a >= 0 for a in axes) or axes != list(range(-len(axes), 0)):
        return None
    return axes[0]


def _affine(div: Node, index: GraphIndex, axis: int, x: str):
    """(scale, bias, nodes, output) of an optional `* gamma + beta` after the division."""
    out, tail = div.outputs[0], []
    scale = bias = None
    mul = index.only_consumer(out)
    if mul is not None and not mul.domain and mul.op_type == "Mul":
        gamma = mul.inputs[1] if mul.inputs[0] == out else mul.inputs[0]
        value = index.constant(gamma)
        if value is not None and value.ndim <= -axis and value.dtype == index.dtype(x):
            scale, out, tail = gamma, mul.outputs[0], [mul]
    if scale is not None:
        add = index.only_consumer(out)
        if add is not None and not add.domain and add.op_type == "Add":
            beta = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
            value = index.constant(beta)
            if value is not None and value.ndim <= -axis and value.dtype == index.dtype(x):
                bias, out, tail = beta, add.outputs[0], tail + [add]
    return scale, bias, tail, out
