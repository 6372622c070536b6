"""Device-resident values and I/O binding, after onnxruntime's `OrtValue` and `IOBinding`.

An `OrtValue` holds one tensor either on the host (a numpy array) or on a backend's device
(a pyopencl Array, a cupy array) together with the backend object that owns it. Feeding one
to a session on the same backend costs no transfer, and a session asked for device outputs
(`Session.run(..., device_outputs=True)`, an `IOBinding` output bound to the device) hands its
results back as OrtValues left on the device. So a loop that feeds a model's outputs back as
its next inputs (a KV cache) never moves them through the host.
"""
from __future__ import annotations

import ctypes
import math
from typing import Any, Sequence

import numpy as np

from ember import config
from ember.errors import BackendUnavailableError, InputError
from ember.runtime.backends import Backend, get_backend

DEVICE_TYPES = ("cpu", "opencl", "cuda", "gpu")


def _np_dtype(element_type: Any) -> np.dtype:
    """numpy dtype of a numpy type or dtype, or of an ONNX TensorProto element type (an int)."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(int(element_type)))
    return np.dtype(element_type)


def _onnx_type(dtype: np.dtype) -> int:
    from onnx import helper

    return int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def default_device_backend() -> Backend:
    """The backend "gpu" names outside a session: $EMBER_BACKEND if it is a device backend, else
    a device backend this process already uses (CUDA first), else CUDA, else OpenCL, whichever
    runs here."""
    from ember.runtime import backends

    env = (config.text("EMBER_BACKEND") or "").lower()
    if env in ("cuda", "opencl"):
        return get_backend(env)
    for name in ("cuda", "opencl"):
        if name in backends._instances:
            return backends._instances[name]
    errors = []
    for name in ("cuda", "opencl"):
        try:
            return get_backend(name)
        except BackendUnavailableError as exc:
            errors.append(str(exc))
    raise BackendUnavailableError("device type 'gpu': no device backend runs here: "
                                  + "; ".join(errors))


def backend_for_device(device_type: str, device_id: int = 0,
                       session_backend: Backend | None = None) -> Backend:
    """The backend object for an onnxruntime-style device type ("cpu", "opencl", "cuda", or
    "gpu": the session's device backend, or `default_device_backend()` without one)."""
    kind = str(device_type).lower()
    if kind not in DEVICE_TYPES:
        raise BackendUnavailableError(f"unsupported device type '{device_type}'; choose one of "
                                      f"{', '.join(DEVICE_TYPES)}")
    if kind == "gpu":
        backend = session_backend if session_backend is not None and \
            session_backend.name != "cpu" else default_device_backend()
    else:
        backend = get_backend(kind)
    if backend.name == "cuda" and int(device_id) != backend.device_id:
        raise BackendUnavailableError(
            f"device_id {device_id}: this process runs CUDA device {backend.device_id} "
            "(set EMBER_CUDA_DEVICE to choose another)")
    if backend.name == "opencl" and int(device_id) != 0:
        raise BackendUnavailableError(
            f"device_id {device_id}: the OpenCL backend runs one device, id 0 "
            "(EMBER_OPENCL_DEVICE picks which)")
    return backend


def _device_dtypes(backend: Backend) -> frozenset:
    """The dtypes `backend` keeps on its device (its module's DEVICE_DTYPES)."""
    import importlib

    return getattr(importlib.import_module(type(backend).__module__), "DEVICE_DTYPES", frozenset())


def _count(backend: Backend, direction: str) -> None:
    transfers = getattr(backend, "transfers", None)
    if transfers is not None:
        transfers[direction] += 1


class OrtValue:
    """One tensor (or a sequence, or None for an empty optional) with the backend that holds it.

    `OrtValue(data, backend)` wraps a value as it is; the factories below mirror onnxruntime's.
    On the CPU the value shares memory with the numpy array it was made from, as in
    onnxruntime; on a device it is a copy.
    """

    __slots__ = ("_data", "_backend")

    def __init__(self, data: Any, backend: Backend):
        if not isinstance(backend, Backend):
            raise TypeError(f"OrtValue needs a Backend object, got {type(backend).__name__}")
        self._data = data
        self._backend = backend

    # -- factories ------------------------------------------------------------------------------
    @classmethod
    def ortvalue_from_numpy(cls, numpy_obj: Any, /, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> "OrtValue":
        backend = backend_for_device(device_type, device_id)
        array = np.asarray(numpy_obj)
        return cls(array if backend.name == "cpu" else backend.to_device(array), backend)

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape: Sequence[int], element_type: Any,
                                     device_type: str = "cpu", device_id: int = 0,
                                     vendor_id: int = -1) -> "OrtValue":
        """A zero-filled tensor (onnxruntime leaves it uninitialised); `element_type` is a numpy
        type or an ONNX TensorProto element type."""
        backend = backend_for_device(device_type, device_id)
        return cls._allocate(backend, shape, _np_dtype(element_type))

    @classmethod
    def _allocate(cls, backend: Backend, shape: Sequence[int], dtype: np.dtype) -> "OrtValue":
        shape = tuple(int(d) for d in shape)
        if backend.name == "cpu" or dtype not in _device_dtypes(backend):
            return cls(np.zeros(shape, dtype), backend)  # dtypes the device lacks stay on the host
        value = backend.empty(shape, dtype)
        if value.size and backend.name == "opencl":  # bytewise: pyopencl's fill lacks float16
            backend.cl.enqueue_fill_buffer(backend.queue, value.base_data, np.uint8(0),
                                           value.offset, value.nbytes)
        elif value.size:
            value.fill(0)
        return cls(value, backend)

    @classmethod
    def _from_pointer(cls, backend: Backend, buffer_ptr: int, shape: Sequence[int],
                      element_type: Any) -> "OrtValue":
        """Wrap memory the caller owns (and keeps alive): a host address on the CPU, a cl_mem
        handle (`Buffer.int_ptr`) on OpenCL, a device address on CUDA."""
        dtype = _np_dtype(element_type)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        ptr = int(buffer_ptr)
        if backend.name == "cpu":
            if nbytes == 0:
                return cls(np.zeros(shape, dtype), backend)
            raw = (ctypes.c_char * nbytes).from_address(ptr)
            return cls(np.frombuffer(raw, dtype=dtype).reshape(shape), backend)
        if backend.name == "opencl":
            if nbytes == 0:
                return cls(backend.empty(shape, dtype), backend)
            buf = backend.cl.Buffer.from_int_ptr(ptr, retain=True)
            if buf.size < nbytes:
                raise InputError(f"the OpenCL buffer holds {buf.size} bytes; shape {list(shape)} "
                                 f"of {dtype} needs {nbytes}")
            return cls(backend.cl_array.Array(backend.queue, shape, dtype, data=buf), backend)
        cp = backend.cp
        memory = cp.cuda.UnownedMemory(ptr, nbytes, None)
        return cls(cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0)), backend)

    # -- onnxruntime's accessors ----------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def data(self) -> Any:
        """The wrapped value: a numpy array, or the backend's device array."""
        return self._data

    def on_device(self) -> bool:
        return self._backend.name != "cpu" and self._backend.is_device_array(self._data)

    def device_name(self) -> str:
        """Where the data is: "cpu", "opencl" or "cuda" (a value whose dtype the device does not
        hold, e.g. strings, stays on the host and says "cpu")."""
        return self._backend.name if self.on_device() else "cpu"

    def numpy(self) -> np.ndarray:
        """The tensor as numpy: the array itself on the CPU, a copy from the device."""
        if not self.is_tensor():
            raise InputError("OrtValue.numpy() is for tensors; this value holds "
                             f"{'None' if self._data is None else type(self._data).__name__}")
        if self.on_device():
            return self._backend.to_host(self._data)
        return np.asarray(self._data)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def shape(self) -> list[int]:
        return [int(d) for d in self._data.shape]

    def element_type(self) -> int:
        """The ONNX TensorProto element type, e.g. 1 for float (as onnxruntime)."""
        return _onnx_type(self._data.dtype)

    def data_type(self) -> str:
        """onnxruntime's type string, e.g. "tensor(float)"."""
        from onnx import TensorProto

        return f"tensor({TensorProto.DataType.Name(self.element_type()).lower()})"

    def tensor_size_in_bytes(self) -> int:
        return int(math.prod(self._data.shape)) * np.dtype(self._data.dtype).itemsize

    def has_value(self) -> bool:
        return self._data is not None

    def is_tensor(self) -> bool:
        return self._data is not None and not isinstance(self._data, list) \
            and hasattr(self._data, "dtype") and hasattr(self._data, "shape")

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._data, list)

    def is_sparse_tensor(self) -> bool:
        return False

    def data_ptr(self) -> int:
        """Host address on the CPU, the cl_mem handle on OpenCL (offset 0 only), the device
        address on CUDA: what `IOBinding.bind_input`'s buffer_ptr takes."""
        data = self._data
        if not self.on_device():
            return int(np.asarray(data).ctypes.data)
        if self._backend.name == "opencl":
            if data.base_data is None:
                return 0
            if data.offset:
                raise InputError("data_ptr of an OpenCL sub-array (non-zero offset) has no handle")
            return int(data.base_data.int_ptr)
        return int(data.data.ptr)

    def update_inplace(self, array: Any) -> None:
        """Overwrite the tensor's contents with a numpy array of the same shape and dtype."""
        array = np.asarray(array)
        if array.shape != self._data.shape or array.dtype != self._data.dtype:
            raise InputError(f"update_inplace: got {array.dtype} {list(array.shape)}, the value "
                             f"is {self._data.dtype} {self.shape()}")
        if not self.on_device():
            np.copyto(self._data, array)
            return
        if array.size:
            array = np.ascontiguousarray(array)
            if self._backend.name == "opencl":
                self._data.set(array, queue=self._backend.queue)
            else:
                self._data.set(array)
            _count(self._backend, "to_device")

    def __repr__(self) -> str:
        if self.is_tensor():
            return (f"OrtValue({self.data_type()}, shape={self.shape()}, "
                    f"device={self.device_name()})")
        return f"OrtValue({type(self._data).__name__}, device={self.device_name()})"

    # -- ember ----------------------------------------------------------------------------------
    def value_for(self, backend: Backend) -> Any:
        """The data as `backend` takes it: as it is if it lives there or on the host, else
        brought to the host (a device value of another backend)."""
        if self._backend is backend or not self.on_device():
            return self._data
        return self._backend.to_host(self._data)


def to_ortvalue(value: Any, backend: Backend) -> OrtValue:
    """Wrap `value` as an OrtValue of `backend` (host values with the CPU backend)."""
    if isinstance(value, OrtValue):
        return value
    if backend.name != "cpu" and backend.is_device_array(value):
        return OrtValue(value, backend)
    return OrtValue(value, get_backend("cpu"))


def place(value: OrtValue, target: Backend) -> OrtValue:
    """`value` moved to `target` (the CPU backend: the host); unchanged if already there."""
    if target.name == "cpu":
        if not value.on_device():
            return value if value.backend is target else OrtValue(value.data, target)
        return OrtValue(value.backend.to_host(value.data), target)
    if value.on_device() and value.backend is target:
        return value
    host = value.value_for(target) if value.on_device() else value.data
    return OrtValue(target.to_device(host) if value.is_tensor() else host, target)


def copy_into(dst: OrtValue, src: OrtValue, name: str) -> None:
    """Write `src` into the preallocated `dst` (an output bound with its own buffer)."""
    if not src.is_tensor():
        raise InputError(f"output '{name}' is not a tensor and cannot fill a bound buffer")
    if dst.shape() != src.shape() or np.dtype(dst.data.dtype) != np.dtype(src.data.dtype):
        raise InputError(
            f"output '{name}' is {src.data.dtype} {src.shape()} but the buffer bound for it is "
            f"{dst.data.dtype} {dst.shape()}; bind it with bind_output(name, device_type) to have "
            "it allocated per run")
    if math.prod(src.shape()) == 0:
        return
    if not dst.on_device():
        np.copyto(dst.data, src.numpy())
        return
    if src.on_device() and src.backend is dst.backend:
        backend = dst.backend
        if backend.name == "opencl":
            s, d = src.data, dst.data
            if not (s.flags.c_contiguous and d.flags.c_contiguous):
                raise InputError(f"output '{name}': non-contiguous OpenCL buffers")
            backend.cl.enqueue_copy(backend.queue, d.base_data, s.base_data,
                                    byte_count=s.nbytes, src_offset=s.offset, dst_offset=d.offset)
        else:
            dst.data[...] = src.data
        return
    dst.update_inplace(src.numpy())


class _OutputBinding:
    __slots__ = ("backend", "buffer")

    def __init__(self, backend: Backend, buffer: OrtValue | None):
        self.backend = backend  # where the output goes (the CPU backend: the host)
        self.buffer = buffer  # a preallocated value to write into, or None: allocate per run


class IOBinding:
    """onnxruntime.IOBinding look-alike: inputs and outputs bound by name, with their devices.

    Inputs are OrtValues or host arrays; outputs are bound to a device ("cpu", "opencl",
    "cuda", "gpu") and then come back as new OrtValues there on every run, or to a preallocated
    OrtValue (`bind_ortvalue_output`, or `bind_output` with `buffer_ptr`) that each run writes
    into. Outputs are computed in the order they were bound, and only those.
    """

    def __init__(self, session):
        self._session = session  # an ember Session
        self._backend: Backend = session._backend
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, _OutputBinding] = {}
        self._results: list[OrtValue] = []

    # -- inputs -------------------------------------------------------------------------------
    def _input_name(self, name: str) -> str:
        if name not in self._session._input_types:
            raise InputError(f"cannot bind input '{name}': the model's inputs are "
                             f"{', '.join(v.name for v in self._session.inputs) or 'none'}")
        return name

    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        """Bind a host array; like onnxruntime, it is read (not copied) at each run."""
        self._inputs[self._input_name(name)] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Sequence[int], buffer_ptr: int) -> None:
        """Bind memory by address: a host pointer on the CPU, a cl_mem handle on OpenCL, a
        device pointer on CUDA (see OrtValue.data_ptr); the caller keeps it alive."""
        backend = backend_for_device(device_type, device_id, self._backend)
        self._inputs[self._input_name(name)] = OrtValue._from_pointer(
            backend, buffer_ptr, shape, element_type)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        if not isinstance(ortvalue, OrtValue):
            raise InputError(f"bind_ortvalue_input('{name}'): expected an OrtValue, got "
                             f"{type(ortvalue).__name__}")
        self._inputs[self._input_name(name)] = ortvalue

    def synchronize_inputs(self) -> None:
        self._backend.synchronize()

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # -- outputs ------------------------------------------------------------------------------
    def _output_name(self, name: str) -> str:
        if name not in {o.name for o in self._session.outputs}:
            raise InputError(f"cannot bind output '{name}': the model's outputs are "
                             f"{', '.join(o.name for o in self._session.outputs)}")
        return name

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        """Bind an output to a device; with `buffer_ptr` (and `element_type`, `shape`) to
        memory there that each run writes into."""
        backend = backend_for_device(device_type, device_id, self._backend)
        buffer = None
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InputError("`element_type` and `shape` are to be provided if pre-allocated "
                                 "memory is provided")
            buffer = OrtValue._from_pointer(backend, buffer_ptr, shape, element_type)
        self._outputs[self._output_name(name)] = _OutputBinding(backend, buffer)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        if not isinstance(ortvalue, OrtValue):
            raise InputError(f"bind_ortvalue_output('{name}'): expected an OrtValue, got "
                             f"{type(ortvalue).__name__}")
        target = ortvalue.backend if ortvalue.on_device() else get_backend("cpu")
        self._outputs[self._output_name(name)] = _OutputBinding(target, ortvalue)

    def synchronize_outputs(self) -> None:
        self._backend.synchronize()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def get_outputs(self) -> list[OrtValue]:
        """The OrtValues of the last run, in binding order (empty before a run)."""
        return list(self._results)

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self) -> list[Any]:
        return [v.numpy() if v.is_tensor() else v.data for v in self._results]

    # -- running ------------------------------------------------------------------------------
    def _run(self) -> None:
        if not self._outputs:
            raise InputError("no output is bound: bind at least one with bind_output")
        names = list(self._outputs)
        backend = self._backend
        # Outputs bound to the session's device come back as device values; others are moved
        # where they are bound below (host-bound ones with one to_host each, as a plan would).
        device = backend.name != "cpu" and any(
            b.backend is backend for b in self._outputs.values())
        result = self._session.run(self._inputs, outputs=names, device_outputs=device)
        results = []
        for name in names:
            binding = self._outputs[name]
            value = to_ortvalue(result[name], backend)
            if binding.buffer is not None:
                copy_into(binding.buffer, value, name)
                value = binding.buffer
            else:
                value = place(value, binding.backend)
            results.append(value)
        self._results = results


__all__ = ["OrtValue", "IOBinding", "backend_for_device", "default_device_backend"]
