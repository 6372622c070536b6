"""Decoding ONNX protobuf values (tensors, attributes, types) into numpy and IR values.

External tensor data is read relative to the model's folder only; a location that escapes it
(`..`, an absolute path, a symlink pointing out) is refused, and so is a file with more than
one hard link (a hard link can bring any file of the same disk into the folder; onnx refuses
them too). Large external tensors are memory-mapped instead of copied.

A tensor's payload must fit its dims (raw_data bytes, external data length) and a sparse
tensor's indices must be in range, sorted and unique, as the ONNX spec requires; anything
else is a ModelLoadError naming the tensor.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from ember import limits
from ember.errors import ModelLoadError, ResourceLimitError
from ember.ir import Graph, MapType, OptionalType, SequenceType, TensorType, ValueType

# Above this size an external tensor is memory-mapped rather than read into memory.
MMAP_THRESHOLD_BYTES = 1 << 20


def onnx_to_np_dtype(elem_type: int) -> np.dtype:
    if elem_type == TensorProto.STRING:
        return np.dtype(object)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        pass  # raised below, without onnx's KeyError attached: the message says it all
    raise ModelLoadError(f"unknown ONNX tensor element type {elem_type}")


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
    links = os.stat(path).st_nlink
    if links > 1:
        raise ModelLoadError(
            f"tensor '{tensor_name}': external data file '{location}' has {links} hard links; "
            "refusing to read it (a hard link can expose a file from outside the model's "
            "folder; onnx refuses such files too)")
    return path


def _external_info(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def tensor_to_array(tensor: TensorProto, base_dir: str | None = None) -> np.ndarray:
    """A TensorProto as a numpy array (read-only memory map for large external data)."""
    try:
        if tensor.data_location == TensorProto.EXTERNAL:
            return _external_tensor(tensor, base_dir)
        if tensor.HasField("raw_data"):
            _check_payload(tensor, len(tensor.raw_data), "raw_data")
        if tensor.data_type == TensorProto.STRING:
            return np.array([s.decode("utf-8", errors="surrogateescape") for s in tensor.string_data],
                            dtype=object).reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)
    except ModelLoadError:
        raise
    except Exception as exc:  # malformed tensor payloads surface as many numpy/onnx errors
        raise ModelLoadError(f"tensor '{tensor.name}' cannot be decoded: {exc}") from exc


def _payload_bytes(tensor: TensorProto) -> int | None:
    """The bytes raw data of `tensor`'s dims and type take (None for strings: no raw form)."""
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"tensor '{tensor.name}' has a negative dimension in {dims}")
    if tensor.data_type == TensorProto.STRING:
        return None
    count = math.prod(dims)
    bits = _PACKED_BITS.get(tensor.data_type)
    if bits is not None:
        return (count * bits + 7) // 8
    return count * onnx_to_np_dtype(tensor.data_type).itemsize


def _check_payload(tensor: TensorProto, size: int, what: str) -> None:
    expected = _payload_bytes(tensor)
    if expected is None:
        raise ModelLoadError(f"tensor '{tensor.name}' holds strings, which have no {what} form")
    if size != expected:
        raise ModelLoadError(
            f"tensor '{tensor.name}': {what} holds {size} bytes, but dims {list(tensor.dims)} "
            f"of {TensorProto.DataType.Name(tensor.data_type)} take {expected}; the tensor is "
            "truncated or corrupt")


def _external_tensor(tensor: TensorProto, base_dir: str | None) -> np.ndarray:
    info = _external_info(tensor)
    path = resolve_external_path(base_dir, info.get("location", ""), tensor.name)
    try:
        offset = int(info.get("offset", 0))
        file_size = os.path.getsize(path)
        length = int(info["length"]) if "length" in info else file_size - offset
    except ValueError as exc:
        raise ModelLoadError(f"tensor '{tensor.name}': external data offset or length is not "
                             f"a number: {exc}") from exc
    if offset < 0 or length < 0 or offset + length > file_size:
        raise ModelLoadError(f"tensor '{tensor.name}': external data range [{offset}, "
                             f"{offset + length}) exceeds file '{info.get('location')}' "
                             f"({file_size} bytes)")
    _check_payload(tensor, length, "its external data")
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


# Sub-byte types, packed: bits per element.
_PACKED_BITS = {getattr(TensorProto, name): bits for name, bits in
                (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
                if hasattr(TensorProto, name)}
_PACKED_TYPES = set(_PACKED_BITS)


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
    """A sparse tensor densified (ember computes on dense arrays), after checking it as the
    spec requires: values 1-D, indices [NNZ] (linear) or [NNZ, rank], in range, ascending and
    unique; the dense size within the tensor cap (ember.limits)."""
    name = sparse.values.name or "(unnamed)"
    shape = tuple(sparse.dims)
    if any(d < 0 for d in shape):
        raise ModelLoadError(f"sparse tensor '{name}' has a negative dimension in {list(shape)}")
    values = tensor_to_array(sparse.values, base_dir)
    indices = tensor_to_array(sparse.indices, base_dir)
    if values.ndim != 1:
        raise ModelLoadError(f"sparse tensor '{name}': values must be 1-D, got shape "
                             f"{values.shape}")
    try:
        limits.check_shape(shape, values.dtype, f"sparse tensor '{name}' densified")
    except ResourceLimitError as exc:
        raise ModelLoadError(str(exc)) from exc
    linear = _linear_indices(name, indices, len(values), shape)
    dense = np.zeros(shape, dtype=values.dtype)
    dense.reshape(-1)[linear] = values
    return dense


def _linear_indices(name: str, indices: np.ndarray, nnz: int, shape: tuple[int, ...]
                    ) -> np.ndarray:
    """The sparse tensor's indices as checked, ascending positions in the flattened tensor."""
    if indices.dtype.kind not in "iu":
        raise ModelLoadError(f"sparse tensor '{name}': indices must be integers, got "
                             f"{indices.dtype}")
    indices = indices.astype(np.int64)
    if indices.ndim == 1 and indices.shape == (nnz,):
        linear = indices
        if nnz and (linear.min() < 0 or linear.max() >= math.prod(shape)):
            raise ModelLoadError(f"sparse tensor '{name}': an index is outside the "
                                 f"{math.prod(shape)} elements of shape {list(shape)}")
    elif indices.ndim == 2 and indices.shape == (nnz, len(shape)):
        if nnz and ((indices < 0).any() or (indices >= np.array(shape, np.int64)).any()):
            raise ModelLoadError(f"sparse tensor '{name}': an index is outside shape "
                                 f"{list(shape)}")
        linear = np.ravel_multi_index(tuple(indices.T), shape) if nnz else \
            np.zeros(0, np.int64)
    else:
        raise ModelLoadError(f"sparse tensor '{name}': indices of shape {indices.shape} do not "
                             f"fit {nnz} values of a rank-{len(shape)} tensor (expected "
                             f"[{nnz}] or [{nnz}, {len(shape)}])")
    if nnz > 1 and not (np.diff(linear) > 0).all():
        raise ModelLoadError(f"sparse tensor '{name}': indices must be in ascending order "
                             "without duplicates")
    return linear
