"""Group normalisation written out as Reshape (N, G, -1) / InstanceNormalization / Reshape back
(PyTorch's exporters write GroupNorm so below opset 21) becomes one GroupNormalization-21 (the
model's opset raised where that changes no other node), its scale and bias per channel those
of the InstanceNormalization's groups: the same computation. The per-channel affine after it
(a Mul and an Add) stays, for the elementwise fusion.

Why: the reshapes of a channels-last image (the layout the CPU engine's convolutions write)
copy it to planar order and back, and the InstanceNormalization then normalises planes; the
GroupNormalization reads the image where it lies, in one compiled pass."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead


def fuse_groupnorm(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for norm in index.live("InstanceNormalization"):
        found = _match(norm, index)
        if found is None:
            continue
        x, groups, scale, bias, into, back = found
        version = ctx.can_use("GroupNormalization", 21)
        if version is None:
            return changed
        graph.nodes.append(Node(
            "GroupNormalization", "", version,
            [x, index.add_constant("gn_scale", scale), index.add_constant("gn_bias", bias)],
            list(back.outputs),
            attrs={"epsilon": float(norm.attrs.get("epsilon", 1e-5)), "num_groups": groups},
            attr_types={"epsilon": AttributeProto.FLOAT, "num_groups": AttributeProto.INT},
            name=norm.name))
        index.kill(into, norm, back)
        changed = True
    drop_dead(graph, index)
    return changed


def _match(norm: Node, index: GraphIndex):
    """(x, groups, scale and bias per channel, the reshape into groups, the reshape back)
    where norm's input is x (N, C, spatial...) reshaped to (N, G, C / G * spatial), its scale
    and bias constants, and its output reshaped back to x's shape, each reshape read only
    here; else None."""
    into = index.single_use_producer(norm.inputs[0], "Reshape")
    back = index.only_consumer(norm.outputs[0])
    if into is None or back is None or back.domain or back.op_type != "Reshape" \
            or len(norm.inputs) != 3:
        return None
    x = into.inputs[0]
    # known shapes: sizes or named symbols ("batch"), equal where the values' shapes are
    shape, grouped = index.known_shape(x), index.known_shape(norm.inputs[0])
    scale, bias = index.constant(norm.inputs[1]), index.constant(norm.inputs[2])
    if shape is None or grouped is None or len(shape) < 3 or len(grouped) != 3 \
            or scale is None or bias is None \
            or index.known_shape(back.outputs[0]) != shape:
        return None
    C, G = shape[1], grouped[1]
    # the reshape keeps the size: with the batch kept and G dividing C, the rest is C / G
    # times the spatial size
    if grouped[0] != shape[0] or not isinstance(C, int) or not isinstance(G, int) or G < 1 \
            or C % G or scale.shape != (G,) or bias.shape != (G,):
        return None
    return x, G, np.repeat(scale, C // G), np.repeat(bias, C // G), into, back
