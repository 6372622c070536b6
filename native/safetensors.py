"""The safetensors file format, written and read without the safetensors library.

Layout: an 8-byte little-endian header length N, N bytes of JSON header
(`{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {str: str}}`,
padded with spaces to a multiple of 8), then the raw little-endian tensor bytes, with no holes.

Reading memory-maps the file (`np.memmap`, read-only), so loading a large weights file costs
no copy. dtypes safetensors has no name for (int4, the float8 *fnuz kinds, float4, complex128,
...) are stored as U8 bytes with a trailing axis of the item size, and their numpy dtype is
recorded under `__metadata__["ember.dtype:<name>"]`; the safetensors library reads those as
uint8, ember reads them back exactly.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

from ember.errors import ModelLoadError

# numpy dtype name -> safetensors dtype name
_ST_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "float64": "F64", "int64": "I64", "uint64": "U64", "complex64": "C64",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0",
}
_NP_NAMES = {v: k for k, v in _ST_NAMES.items()}
_DTYPE_KEY = "ember.dtype:"
# Refuse absurd headers before allocating for them (the format's own reader caps it too).
_MAX_HEADER_BYTES = 100 << 20


def numpy_dtype(name: str) -> np.dtype:
    """A numpy dtype from its name, including ml_dtypes' (bfloat16, float8_*, int4...)."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def can_store(array: np.ndarray) -> bool:
    """Whether `array` can go into a safetensors file (anything but strings / objects)."""
    dtype = array.dtype
    return dtype != object and dtype.kind not in "US" and dtype.fields is None and \
        (dtype.kind != "V" or dtype.name != f"void{dtype.itemsize * 8}")  # ml_dtypes are kind V


def save_file(tensors: Mapping[str, np.ndarray], path: str,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path`. Deterministic: the same tensors give the same bytes."""
    meta = dict(metadata or {})
    # Largest items first keeps every tensor aligned to its item size in the memory map.
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header: dict[str, object] = {}
    offset = 0
    blobs = []
    for name in order:
        array = np.asarray(tensors[name])
        if not can_store(array):
            raise ValueError(f"tensor {name!r} of dtype {array.dtype} cannot be stored")
        st_name = _ST_NAMES.get(array.dtype.name)
        shape = list(array.shape)
        if st_name is None:  # stored as its bytes; the real dtype goes in the metadata
            meta[_DTYPE_KEY + name] = array.dtype.name
            st_name, shape = "U8", shape + [array.dtype.itemsize]
        data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
        nbytes = data.nbytes
        header[name] = {"dtype": st_name, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        blobs.append(data)
        offset += nbytes
    if meta:
        header["__metadata__"] = dict(sorted(meta.items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(memoryview(data.reshape(-1).view(np.uint8)) if data.size else b"")
    os.replace(tmp, path)


def read_header(path: str) -> tuple[dict, int]:
    """The parsed JSON header and the offset where tensor data starts."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelLoadError(f"{path}: header length {n} exceeds the file; not a "
                                     "safetensors file, or a truncated one")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read weights file {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n


def load_file(path: str) -> dict[str, np.ndarray]:
    """Every tensor in the safetensors file at `path`, as read-only views of one memory map."""
    header, start = read_header(path)
    meta = header.pop("__metadata__", None) or {}
    data_size = os.path.getsize(path) - start
    # A plain ndarray over the memory map: np.memmap views would make every op result a
    # memmap subclass too, at a cost per op.
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(data_size,)
                       ).view(np.ndarray) if data_size > 0 else np.zeros(0, np.uint8)
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _view(path, mapped, name, entry, meta.get(_DTYPE_KEY + name))
    return tensors


def _view(path: str, mapped: np.ndarray, name: str, entry: dict, real_dtype: str | None
          ) -> np.ndarray:
    try:
        dtype = numpy_dtype(_NP_NAMES[entry["dtype"]]).newbyteorder("<")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(v) for v in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: tensor {name!r} has a malformed header entry "
                             f"{entry!r}") from exc
    count = int(np.prod(shape)) if shape else 1
    if not 0 <= begin <= end <= mapped.size or end - begin != count * dtype.itemsize:
        raise ModelLoadError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not "
                             f"match its shape {shape} and dtype, or exceeds the file")
    array = mapped[begin:end].view(dtype).reshape(shape)
    if real_dtype is not None:  # stored as bytes: restore the dtype recorded in the metadata
        real = numpy_dtype(real_dtype)
        array = array.reshape(-1).view(real).reshape(shape[:-1])
    return array
