"""Scaled dot-product attention written out as ops becomes one Attention (opset 23):

    Softmax((Q @ Transpose(K)) / c [+ mask]) @ V      (or * s instead of / c)

with Q, K, V of shape (batch, heads, seq, head_size) and the mask additive and broadcastable
to (batch, heads, q_seq, kv_seq). A second rewrite then takes the usual projection layout
too: when Q, K and V are the three slices of one packed projection reshaped to
(batch, seq, 3, heads, head_size) and the result is transposed back and reshaped to
(batch, seq, hidden), the Attention reads 3-D Q/K/V (a Split of the projection) and writes the
3-D result directly.
"""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead, squeeze_axes

_INT, _FLOAT = AttributeProto.INT, AttributeProto.FLOAT


def fuse_attention(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for softmax in index.live("Softmax"):
        found = _match(softmax, index)
        if found is None:
            continue
        q, k, v, mask, scale, out, matched = found
        version = ctx.can_use("Attention", 23)
        if version is None:
            return changed
        inputs = [q, k, v] + ([mask] if mask else [])
        graph.nodes.append(Node("Attention", "", version, inputs, [out],
                                attrs={"scale": scale}, attr_types={"scale": _FLOAT},
                                name=softmax.name))
        index.kill(*matched)
        changed = True
    drop_dead(graph, index)
    return changed


def _match(softmax: Node, index: GraphIndex):
    rank = index.rank(softmax.inputs[0])
    axis = int(softmax.attrs.get("axis", -1 if softmax.version >= 13 else 1))
    if rank != 4 or axis not in (-1, 3) or softmax.version < 13:
        return None
    add = index.single_use_producer(softmax.inputs[0], "Add")
    if add is None:
        return _match_scores(softmax, softmax.inputs[0], None, [softmax], index)
    for scores, mask in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        if _mask_fits(mask, index):
            found = _match_scores(softmax, scores, mask, [softmax, add], index)
            if found is not None:
                return found
    return None


def _match_scores(softmax: Node, scores: str, mask: str | None, matched: list[Node],
                  index: GraphIndex):
    """The rest of the pattern below the (optional) mask Add."""
    matched = list(matched)
    scale = 1.0
    scaled = index.single_use_producer(scores)
    if scaled is not None and scaled.op_type in ("Div", "Mul") and not scaled.domain:
        operands = [(scaled.inputs[0], scaled.inputs[1])]
        if scaled.op_type == "Mul":
            operands.append((scaled.inputs[1], scaled.inputs[0]))
        for product, c_name in operands:
            c = index.scalar(c_name)
            if c:
                scale, scores = (1.0 / c if scaled.op_type == "Div" else c), product
                matched.append(scaled)
                break
        else:
            return None
    qk = index.single_use_producer(scores, "MatMul")
    if qk is None:
        return None
    q, kt = qk.inputs
    transpose = index.single_use_producer(kt, "Transpose")
    if transpose is None or list(transpose.attrs.get("perm", [])) != [0, 1, 3, 2]:
        return None
    k = transpose.inputs[0]
    pv = index.only_consumer(softmax.outputs[0])
    if pv is None or pv.domain or pv.op_type != "MatMul" or pv.inputs[0] != softmax.outputs[0]:
        return None
    v = pv.inputs[1]
    dtypes = {index.dtype(n) for n in (q, k, v)}
    if len(dtypes) != 1 or None in dtypes or next(iter(dtypes)).kind != "f" or \
            any(index.rank(n) != 4 for n in (q, k, v)):
        return None
    if mask and index.dtype(mask) != next(iter(dtypes)):
        return None  # additive float masks only (a bool mask is a Where, not an Add)
    matched += [qk, transpose, pv]
    return q, k, v, mask, scale, pv.outputs[0], matched


def _mask_fits(mask: str, index: GraphIndex) -> bool:
    rank = index.rank(mask)
    return rank is not None and 2 <= rank <= 4  # Attention's attn_mask is 2-D to 4-D


def fuse_attention_projections(graph: Graph, ctx: Context) -> bool:
    """4-D Attention fed by slices of one packed QKV projection -> Split + 3-D Attention."""
    index = GraphIndex(graph)
    changed = False
    for att in index.live("Attention"):
        if len(att.inputs) > 4 or len(att.outputs) != 1 or att.attrs.get("q_num_heads"):
            continue
        packed = _packed_qkv(att, index)
        output = _merged_output(att, index)
        if packed is None or output is None:
            continue
        source, heads, head_size, qkv_nodes = packed
        final, out_nodes = output
        hidden = heads * head_size
        if index.static_shape(final) is None or index.static_shape(final)[-1] != hidden:
            continue
        parts = [index.fresh_name(f"{att.outputs[0]}_{p}") for p in "qkv"]
        split_sizes = index.add_constant("qkv_split", np.array([hidden] * 3, np.int64))
        split_version = ctx.opset("")
        if split_version < 13:
            continue
        graph.nodes.append(Node("Split", "", split_version, [source, split_sizes], parts,
                                attrs={"axis": -1}, attr_types={"axis": _INT},
                                name=f"{att.name}_split" if att.name else ""))
        attrs = dict(att.attrs)
        attrs.update(q_num_heads=heads, kv_num_heads=heads)
        types = dict(att.attr_types, q_num_heads=_INT, kv_num_heads=_INT)
        graph.nodes.append(Node("Attention", "", att.version, parts + att.inputs[3:], [final],
                                attrs=attrs, attr_types=types, name=att.name))
        index.kill(att, *qkv_nodes, *out_nodes)
        changed = True
    drop_dead(graph, index)
    return changed


def _packed_qkv(att: Node, index: GraphIndex):
    """(projection, heads, head_size, nodes) when Q, K, V = Squeeze(Slice(Transpose(
    Reshape(projection, [b, s, 3, heads, head_size]), [2, 0, 3, 1, 4]), i:i+1, axis 0)), or
    a Gather of index i along axis 0 in place of the Squeeze and Slice."""
    transposes, nodes = set(), []
    for i, name in enumerate(att.inputs[:3]):
        taken = _taken_along_axis_0(name, i, index)
        if taken is None:
            return None
        source, taking_nodes = taken
        transposes.add(source)
        nodes += taking_nodes
    if len(transposes) != 1:
        return None
    permuted = transposes.pop()
    transpose = index.producer.get(permuted)
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain or \
            list(transpose.attrs.get("perm", [])) != [2, 0, 3, 1, 4] or index.uses(permuted) != 3:
        return None
    reshape = index.single_use_producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    shape = index.static_shape(reshape.outputs[0])
    source_shape = index.static_shape(reshape.inputs[0])
    if shape is None or source_shape is None or len(shape) != 5 or shape[2] != 3 or \
            len(source_shape) != 3 or source_shape[:2] != shape[:2] or \
            source_shape[2] != 3 * shape[3] * shape[4]:
        return None
    return reshape.inputs[0], shape[3], shape[4], nodes + [transpose, reshape]


def _taken_along_axis_0(name: str, i: int, index: GraphIndex):
    """(x, nodes) when `name` is x[i] along axis 0: Squeeze(Slice(x, i:i+1)), or the scalar
    Gather that slice_squeeze_to_gather makes of it."""
    gather = index.single_use_producer(name, "Gather")
    if gather is not None:
        position = index.constant(gather.inputs[1])
        if position is None or position.ndim != 0 or int(position) != i or \
                gather.attrs.get("axis", 0) != 0:
            return None
        return gather.inputs[0], [gather]
    squeeze = index.single_use_producer(name, "Squeeze")
    if squeeze is None or squeeze_axes(squeeze, index) != [0]:
        return None
    sliced = index.single_use_producer(squeeze.inputs[0], "Slice")
    if sliced is None or _slice_range(sliced, index) != (i, i + 1):
        return None
    return sliced.inputs[0], [squeeze, sliced]


def _merged_output(att: Node, index: GraphIndex):
    """(final name, nodes) when the 4-D result goes Transpose([0, 2, 1, 3]) -> Reshape to
    (batch, seq, heads * head_size)."""
    transpose = index.only_consumer(att.outputs[0])
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain or \
            list(transpose.attrs.get("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = index.only_consumer(transpose.outputs[0])
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain:
        return None
    before, after = index.static_shape(transpose.outputs[0]), \
        index.static_shape(reshape.outputs[0])
    if before is None or after is None or len(after) != 3 or \
            after != (before[0], before[1], before[2] * before[3]):
        return None
    return reshape.outputs[0], [transpose, reshape]


def _slice_range(node: Node, index: GraphIndex) -> tuple[int, int] | None:
    """(start, end) of a Slice along axis 0 with step 1."""
    if node.version < 10 or len(node.inputs) < 3:
        return None
    values = [index.constant(n) if n else None for n in node.inputs[1:5]]
    starts, ends = values[0], values[1]
    axes = values[2] if len(values) > 2 else None
    steps = values[3] if len(values) > 3 else None
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if len(node.inputs) > 3 and node.inputs[3] and (axes is None or int(axes.reshape(-1)[0])):
        return None
    if len(node.inputs) > 4 and node.inputs[4] and (steps is None or
                                                    int(steps.reshape(-1)[0]) != 1):
        return None
    return int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])

