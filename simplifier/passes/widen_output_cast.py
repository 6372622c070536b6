"""The float16 (or bfloat16) ops at the end of a graph whose output is cast to float32 compute
in float32: `y = Cast<float>(Gemm(ReduceMean(x16), b16))` becomes
`y = Gemm(ReduceMean(Cast<float>(x16)), b16_as_float32)`.

This is the shape the float16 converters leave at every output (keep_io_types=True), and it is
what onnxruntime's CPU provider computes for it: it runs float16 ops it has no float16 kernel
for in float32 between casts, and drops the cast pairs between them, so the float16 roundings
of the output's tail are skipped (measured on a converted ResNet: 1.9e-4 relative error
against the float32 model, against 4.7e-4 with every rounding the graph spells out).

The widening starts from a Cast<float> that is a graph output and walks up through producers
whose result nothing else reads; the inputs it reaches are widened exactly (a Cast, or a
float32 copy of a constant). So the result is closer to the float32 model than the literal
float16 graph, and differs from the literal graph by the roundings skipped. A value read
twice, an op without an ONNX schema (ai.ember's fused ops) or one whose schema does not allow
float32 ends the walk: the interior of the graph keeps the float16 roundings the model asks
for. An unsimplified run keeps them all.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import AttributeProto, TensorProto

from ember.ir import Graph, Node, TensorType, ValueInfo
from ember.ops.registry import schema_for
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead

_NARROW = {np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}


def widen_output_cast(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    # Casts to float32 whose producer may compute in float32 instead: the graph's outputs
    # first, then the casts this pass puts in front of each widened op's inputs.
    work = [c for c in index.live("Cast") if c.outputs[0] in index.outputs]
    changed = False
    while work:
        cast = work.pop()
        if cast.attrs.get("to") != TensorProto.FLOAT:
            continue
        source = cast.inputs[0]
        narrow = index.dtype(source)
        producer = index.single_use_producer(source)
        if narrow not in _NARROW or producer is None or producer.domain:
            continue
        widened = _widenable_inputs(producer, index, narrow)
        if not widened:
            continue
        position = graph.nodes.index(producer)
        wide_names: dict[str, str] = {}  # one cast per distinct input (Mul(x, x) reads x once)
        for i in widened:
            name = producer.inputs[i]
            if name not in wide_names:
                value = index.constant(name)
                if value is not None:
                    wide_names[name] = index.add_constant(name, value.astype(np.float32))
                else:
                    wide = wide_names[name] = index.fresh_name(name + "_float32")
                    widen = Node("Cast", "", ctx.opset(""), [name], [wide],
                                 attrs={"to": TensorProto.FLOAT},
                                 attr_types={"to": AttributeProto.INT})
                    graph.nodes.insert(position, widen)
                    position += 1
                    graph.value_info[wide] = ValueInfo(
                        wide, TensorType(np.dtype(np.float32), index.shape(name)))
                    # `name` is still read once (by the new cast): the index stays right for
                    # everything upstream, and the walk goes on from there
                    work.append(widen)
            producer.inputs[i] = wide_names[name]
        producer.outputs = [cast.outputs[0] if o == source else o for o in producer.outputs]
        graph.value_info.pop(source, None)
        index.kill(cast)
        changed = True
    drop_dead(graph, index)
    return changed


def _widenable_inputs(node: Node, index: GraphIndex, narrow: np.dtype) -> list[int]:
    """The positions of `node`'s inputs that share its output's type (all of dtype `narrow`)
    when its schema lets that type be float32; [] when the node cannot be widened."""
    schema = schema_for(node.domain, node.op_type, node.version)
    if schema is None or node.subgraphs() or not schema.outputs:
        return []
    if [o for o in node.outputs if o] != node.outputs[:1]:
        return []  # a second output (LayerNormalization's Mean) would need widening too
    kind = schema.outputs[0].type_str
    allowed = next((c.allowed_type_strs for c in schema.type_constraints
                    if c.type_param_str == kind), [])
    if "tensor(float)" not in allowed:
        return []
    positions = []
    for i, name in enumerate(node.inputs):
        formal = schema.inputs[min(i, len(schema.inputs) - 1)] if schema.inputs else None
        if not name or formal is None or formal.type_str != kind:
            continue
        if index.dtype(name) != narrow:
            return []
        positions.append(i)
    return positions
