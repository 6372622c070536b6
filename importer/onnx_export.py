"""ember IR -> ONNX protobuf: the inverse of onnx_import.

Attributes are encoded with the ONNX type recorded at import (`Node.attr_types`), so a model
that is imported and exported again carries the same attributes, opsets and value infos.
Nodes a rewrite created may carry a higher version than the model declares for their domain
(a fused Gelu-20 in an opset-18 model); the exported opset of a domain is the highest version
any of its nodes uses, and the IR version is raised to what that opset requires.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from ember.errors import InvalidModelError
from ember.importer.onnx_values import np_to_onnx_dtype
from ember.ir import Graph, MapType, Model, Node, OptionalType, SequenceType, TensorType, ValueInfo

A = AttributeProto


def export_model(model: Model) -> onnx.ModelProto:
    """The IR as an ONNX ModelProto (initialisers inline, subgraphs included)."""
    opsets = dict(model.opsets)
    for node in model.graph.iter_nodes():
        opsets[node.domain] = max(opsets.get(node.domain, 0), node.version)
    proto = helper.make_model(
        export_graph(model.graph),
        opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
        producer_name=model.producer_name, producer_version=model.producer_version,
        doc_string=model.doc)
    proto.ir_version = max(model.ir_version, _ir_version_for(opsets.get("", 1)))
    if proto.ir_version < 4:  # before IR 4 every initialiser must also be a graph input
        _declare_initializers_as_inputs(proto.graph, model.graph)
    proto.model_version = model.model_version
    for key, value in model.metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto


def _declare_initializers_as_inputs(proto: onnx.GraphProto, graph: Graph) -> None:
    declared = {v.name for v in graph.inputs}
    for name, value in graph.initializers.items():
        if name not in declared:
            array = np.asarray(value)
            proto.input.append(export_value_info(
                ValueInfo(name, TensorType(array.dtype, tuple(array.shape)))))


def _ir_version_for(opset: int) -> int:
    """The lowest IR version that allows ai.onnx `opset` (from onnx's version table)."""
    for _, ir_version, ai_onnx, *_ in onnx.helper.VERSION_TABLE:
        if ai_onnx >= opset:
            return ir_version
    return onnx.IR_VERSION


def export_graph(graph: Graph) -> onnx.GraphProto:
    """A Graph as a GraphProto."""
    return helper.make_graph(
        nodes=[export_node(n) for n in graph.nodes],
        name=graph.name or "graph",
        inputs=[export_value_info(v) for v in graph.inputs],
        outputs=[export_value_info(v) for v in graph.outputs],
        initializer=[array_to_tensor(value, name) for name, value in graph.initializers.items()],
        doc_string=graph.doc or None,
        value_info=[export_value_info(v) for v in graph.value_info.values()],
    )


def export_node(node: Node) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, node.inputs, node.outputs, name=node.name or None,
                             domain=node.domain or None)
    for name, value in node.attrs.items():
        proto.attribute.append(export_attribute(name, value, node.attr_types.get(name)))
    return proto


def export_value_info(v: ValueInfo) -> onnx.ValueInfoProto:
    info = onnx.ValueInfoProto()
    info.name = v.name
    if v.doc:
        info.doc_string = v.doc
    if v.type is not None:
        info.type.CopyFrom(export_type(v.type))
    return info


def export_type(t: Any) -> onnx.TypeProto:
    proto = onnx.TypeProto()
    if isinstance(t, TensorType):
        tt = proto.tensor_type
        if t.dtype is not None:
            tt.elem_type = np_to_onnx_dtype(t.dtype)
        if t.shape is not None:
            shape = tt.shape
            shape.SetInParent()  # rank 0 still has a (empty) shape
            for d in t.shape:
                dim = shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif isinstance(d, str):
                    dim.dim_param = d
    elif isinstance(t, SequenceType):
        proto.sequence_type.SetInParent()
        if t.elem is not None:
            proto.sequence_type.elem_type.CopyFrom(export_type(t.elem))
    elif isinstance(t, OptionalType):
        proto.optional_type.SetInParent()
        if t.elem is not None:
            proto.optional_type.elem_type.CopyFrom(export_type(t.elem))
    elif isinstance(t, MapType):
        proto.map_type.key_type = np_to_onnx_dtype(t.key)
        if t.value is not None:
            proto.map_type.value_type.CopyFrom(export_type(t.value))
    return proto


def array_to_tensor(value: Any, name: str = "") -> onnx.TensorProto:
    """A numpy array (or scalar) as a TensorProto, strings included."""
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "US":
        tensor = helper.make_tensor(name, TensorProto.STRING, array.shape,
                                    [_to_bytes(s) for s in array.reshape(-1)])
        return tensor
    if isinstance(array, np.memmap):
        array = np.asarray(array)
    return numpy_helper.from_array(array, name)


def _to_bytes(s: Any) -> bytes:
    return s if isinstance(s, bytes) else str(s).encode("utf-8", errors="surrogateescape")


def _sparse(value: np.ndarray, name: str = "") -> onnx.SparseTensorProto:
    """A dense array as a sparse tensor holding its non-zero entries (linear indices)."""
    array = np.asarray(value)
    flat = array.reshape(-1)
    idx = np.flatnonzero(flat).astype(np.int64)
    return helper.make_sparse_tensor(array_to_tensor(flat[idx], name),
                                     array_to_tensor(idx, ""), list(array.shape))


def _guess_type(value: Any) -> int:
    """The AttributeProto type of a value whose type was not recorded (a rewrite made it)."""
    if isinstance(value, Graph):
        return A.GRAPH
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return A.INT
    if isinstance(value, (float, np.floating)):
        return A.FLOAT
    if isinstance(value, (str, bytes)):
        return A.STRING
    if isinstance(value, np.ndarray):
        return A.TENSOR
    if isinstance(value, (list, tuple)):
        if not value:
            return A.INTS
        first = value[0]
        if isinstance(first, Graph):
            return A.GRAPHS
        if isinstance(first, (str, bytes)):
            return A.STRINGS
        if isinstance(first, np.ndarray):
            return A.TENSORS
        if all(isinstance(v, (int, np.integer)) for v in value):
            return A.INTS
        return A.FLOATS
    raise InvalidModelError(f"cannot export attribute value of type {type(value).__name__}")


def export_attribute(name: str, value: Any, attr_type: int | None) -> onnx.AttributeProto:
    t = attr_type if attr_type not in (None, A.UNDEFINED) else _guess_type(value)
    attr = onnx.AttributeProto()
    attr.name = name
    attr.type = t
    if t == A.FLOAT:
        attr.f = float(value)
    elif t == A.INT:
        attr.i = int(value)
    elif t == A.STRING:
        attr.s = _to_bytes(value)
    elif t == A.TENSOR:
        attr.t.CopyFrom(array_to_tensor(value))
    elif t == A.SPARSE_TENSOR:
        attr.sparse_tensor.CopyFrom(_sparse(value))
    elif t == A.GRAPH:
        attr.g.CopyFrom(value if isinstance(value, onnx.GraphProto) else export_graph(value))
    elif t == A.TYPE_PROTO:
        attr.tp.CopyFrom(export_type(value))
    elif t == A.FLOATS:
        attr.floats.extend(float(v) for v in value)
    elif t == A.INTS:
        attr.ints.extend(int(v) for v in value)
    elif t == A.STRINGS:
        attr.strings.extend(_to_bytes(v) for v in value)
    elif t == A.TENSORS:
        attr.tensors.extend(array_to_tensor(v) for v in value)
    elif t == A.SPARSE_TENSORS:
        attr.sparse_tensors.extend(_sparse(v) for v in value)
    elif t == A.GRAPHS:
        attr.graphs.extend(g if isinstance(g, onnx.GraphProto) else export_graph(g)
                           for g in value)
    elif t == A.TYPE_PROTOS:
        attr.type_protos.extend(export_type(v) for v in value)
    else:
        raise InvalidModelError(f"attribute '{name}' has unknown type {t}")
    return attr


# protobuf cannot serialise a message past 2 GiB: weights beyond this go to external data
_EXTERNAL_DATA_BYTES = (1 << 31) - (1 << 26)


def save_onnx(proto: onnx.ModelProto, path: str, model: Model) -> None:
    """Write `proto` (exported from `model`) to `path`; with more than ~2 GB of weights they
    go to a data file beside it (`<file name>.data`), as onnx writes them."""
    import os

    weights = sum(int(getattr(v, "nbytes", 0)) for v in model.graph.initializers.values())
    if weights <= _EXTERNAL_DATA_BYTES:
        onnx.save_model(proto, path)
        return
    onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=os.path.basename(path) + ".data", size_threshold=1024)
