"""Type and shape inference, with symbolic dimensions, by onnx's own inference over the
exported graph. Large weights travel as typed inputs rather than data: inference needs their
shapes, not their values, and serialising a BERT's weights on every round would cost seconds."""
from __future__ import annotations

import numpy as np
import onnx

from ember.importer.onnx_export import export_model
from ember.importer.onnx_values import decode_type
from ember.ir import Graph, Model, TensorType, ValueInfo
from ember.simplifier.context import Context

# Initialisers up to this many elements are exported with their data (shape arithmetic on
# them lets inference compute Reshape targets and the like).
_DATA_MAX_ELEMENTS = 4096


def infer_shapes(graph: Graph, ctx: Context) -> bool:
    """Fill graph.value_info with what onnx's inference knows. Returns whether it learnt
    anything new (it never changes the graph itself)."""
    if graph is not ctx.model.graph:
        return False
    proto = _inference_proto(ctx.model)
    # Data propagation (shape values through Shape -> Gather -> Concat) costs most of the
    # time; it only matters while Shape / Size nodes remain that folding could not remove.
    propagate = any(n.op_type in ("Shape", "Size") for n in graph.nodes)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False,
                                                     data_prop=propagate)
    except Exception:  # inference is advice: a model it cannot handle is simplified without
        return False
    learnt = False
    known = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for info in inferred.graph.value_info:
        if info.name in known or info.name in graph.initializers:
            continue
        value_type = decode_type(info.type) if info.HasField("type") else None
        if not isinstance(value_type, TensorType):
            continue
        old = graph.value_info.get(info.name)
        if old is None or old.type != value_type and _more_specific(value_type, old.type):
            graph.value_info[info.name] = ValueInfo(info.name, value_type)
            learnt = True
    return learnt


def _more_specific(new: TensorType, old) -> bool:
    if not isinstance(old, TensorType):
        return True
    if old.shape is None or old.dtype is None:
        return True
    if new.shape is None or len(new.shape) != len(old.shape):
        return False
    return sum(isinstance(d, int) for d in new.shape) > sum(isinstance(d, int) for d in old.shape)


def _inference_proto(model: Model) -> onnx.ModelProto:
    graph = model.graph
    big = {name: value for name, value in graph.initializers.items()
           if isinstance(value, np.ndarray) and value.size > _DATA_MAX_ELEMENTS}
    slim = Graph(graph.name, list(graph.inputs), list(graph.outputs), graph.nodes,
                 {k: v for k, v in graph.initializers.items() if k not in big},
                 dict(graph.value_info))
    declared = {v.name for v in graph.inputs}
    slim.inputs += [ValueInfo(name, TensorType(value.dtype, tuple(value.shape)))
                    for name, value in big.items() if name not in declared]
    return export_model(Model(slim, dict(model.opsets), model.ir_version))
