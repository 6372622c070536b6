"""Decoding ONNX protobuf values (tensors, attributes, types) into numpy and IR values.

External tensor data is read relative to the model's folder only; a location that escapes it
(`..`, an absolute path, a symlink pointing out) is refused. Large external tensors are
memory-mapped instead of copied.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from ember.errors import ModelLoadError
from ember.ir import Graph, MapType, OptionalType, SequenceType, TensorType, ValueType

# Above this size an external tensor is memory-mapped rather than read into memory.
MMAP_THRESHOLD_BYTES = 1 << 20


def onnx_to_np_dtype(elem_type: int) -> np.dtype:
    if elem_type == TensorProto.STRING:
        return np.dtype(object)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"unknown ONNX tensor element type {elem_type}") from exc


def np_to_onnx_dtype(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == object or dtype.kind in "US":
        return TensorProto.STRING
    return helper.np_dtype_to_tensor_dtype(dtype)


def resolve_external_path(base_dir: str | None, location: str, tensor_name: str) -> str:
    """The file an external tensor lives in, refusing any location outside `base_dir`."""
    if base_dir is None:
        raise ModelLoadError(
            f"tensor '{tensor_name}' has external data '{location}' but the model was not "
            "loaded from a file; load it by path so its folder is known")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise ModelLoadError(
            f"tensor '{tensor_name}': external data location '{location}' is an absolute path; "
            "only paths inside the model's folder are allowed")
    root = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, path]) != root:
        raise ModelLoadError(
            f"tensor '{tensor_name}': external data location '{location}' points outside the "
            f"model's folder {root}; refusing to read it")
    if not os.path.isfile(path):
        raise ModelLoadError(f"tensor '{tensor_name}': external data file '{location}' not found "
                             f"in {root}")
    return path


def _external_info(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def tensor_to_array(tensor: TensorProto, base_dir: str | None = None) -> np.ndarray:
    """A TensorProto as a numpy array (read-only memory map for large external data)."""
    try:
        if tensor.data_location == TensorProto.EXTERNAL:
            return _external_tensor(tensor, base_dir)
        if tensor.data_type == TensorProto.STRING:
            return np.array([s.decode("utf-8", errors="surrogateescape") for s in tensor.string_data],
                            dtype=object).reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)
    except ModelLoadError:
        raise
    except Exception as exc:  # malformed tensor payloads surface as many numpy/onnx errors
        raise ModelLoadError(f"tensor '{tensor.name}' cannot be decoded: {exc}") from exc


def _external_tensor(tensor: TensorProto, base_dir: str | None) -> np.ndarray:
    info = _external_info(tensor)
    path = resolve_external_path(base_dir, info.get("location", ""), tensor.name)
    offset = int(info.get("offset", 0))
    file_size = os.path.getsize(path)
    length = int(info["length"]) if "length" in info else file_size - offset
    if offset < 0 or length < 0 or offset + length > file_size:
        raise ModelLoadError(f"tensor '{tensor.name}': external data range [{offset}, "
                             f"{offset + length}) exceeds file '{info.get('location')}' "
                             f"({file_size} bytes)")
    dtype = onnx_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    count = int(np.prod(shape)) if shape else 1
    packed = dtype.itemsize == 1 and tensor.data_type in _PACKED_TYPES
    if not packed and dtype != object and length == count * dtype.itemsize \
            and length >= MMAP_THRESHOLD_BYTES:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    inline = TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = TensorProto.DEFAULT
    inline.raw_data = raw
    return numpy_helper.to_array(inline)


_PACKED_TYPES = {t for t in (getattr(TensorProto, n, None) for n in
                             ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")) if t is not None}


_ANONYMOUS_DIM = re.compile(r"\s*(\?|-1|unk__\d+|)\s*")


def is_anonymous_dim(param: str) -> bool:
    """Whether a dim_param names no dimension: "?" (paddle2onnx names every image axis so),
    "", "-1", or onnxruntime's "unk__N". Such dims are independent unknowns, not one symbol
    that must agree across inputs."""
    return _ANONYMOUS_DIM.fullmatch(param) is not None


def decode_type(type_proto: onnx.TypeProto) -> ValueType | None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" or kind == "sparse_tensor_type":
        tt = getattr(type_proto, kind)
        dtype = onnx_to_np_dtype(tt.elem_type) if tt.elem_type else None
        shape = None
        if tt.HasField("shape"):
            dims = []
            for d in tt.shape.dim:
                which = d.WhichOneof("value")
                dims.append(d.dim_value if which == "dim_value" else
                            None if which != "dim_param" or is_anonymous_dim(d.dim_param)
                            else d.dim_param)
            shape = tuple(dims)
        return TensorType(dtype, shape)
    if kind == "sequence_type":
        return SequenceType(decode_type(type_proto.sequence_type.elem_type))
    if kind == "optional_type":
        return OptionalType(decode_type(type_proto.optional_type.elem_type))
    if kind == "map_type":
        mt = type_proto.map_type
        return MapType(onnx_to_np_dtype(mt.key_type), decode_type(mt.value_type))
    return None


def decode_attribute(attr: AttributeProto, base_dir: str | None = None,
                     decode_graph: Callable[[onnx.GraphProto], Graph] | None = None) -> Any:
    """An attribute's value as a Python/numpy/IR value."""
    t = attr.type
    A = AttributeProto
    if t == A.FLOAT:
        return float(attr.f)
    if t == A.INT:
        return int(attr.i)
    if t == A.STRING:
        return attr.s.decode("utf-8", errors="surrogateescape")
    if t == A.TENSOR:
        return tensor_to_array(attr.t, base_dir)
    if t == A.SPARSE_TENSOR:
        return sparse_to_array(attr.sparse_tensor, base_dir)
    if t == A.GRAPH:
        return decode_graph(attr.g) if decode_graph else attr.g
    if t == A.TYPE_PROTO:
        return decode_type(attr.tp)
    if t == A.FLOATS:
        return [float(v) for v in attr.floats]
    if t == A.INTS:
        return [int(v) for v in attr.ints]
    if t == A.STRINGS:
        return [s.decode("utf-8", errors="surrogateescape") for s in attr.strings]
    if t == A.TENSORS:
        return [tensor_to_array(v, base_dir) for v in attr.tensors]
    if t == A.SPARSE_TENSORS:
        return [sparse_to_array(v, base_dir) for v in attr.sparse_tensors]
    if t == A.GRAPHS:
        return [decode_graph(g) if decode_graph else g for g in attr.graphs]
    if t == A.TYPE_PROTOS:
        return [decode_type(tp) for tp in attr.type_protos]
    raise ModelLoadError(f"attribute '{attr.name}' has unknown type {t}")


def sparse_to_array(sparse: onnx.SparseTensorProto, base_dir: str | None = None) -> np.ndarray:
    """A sparse tensor densified (ember computes on dense arrays)."""
    values = tensor_to_array(sparse.values, base_dir)
    indices = tensor_to_array(sparse.indices, base_dir).astype(np.int64)
    shape = tuple(sparse.dims)
    dense = np.zeros(shape, dtype=values.dtype)
    if indices.ndim == 1:  # linearised indices
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense
