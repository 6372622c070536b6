"""Sessions: a loaded model plus its plan, with feed checking.

`Session` is ember's own API (`ember.load`); `InferenceSession` mirrors onnxruntime's so code
written for onnxruntime runs by changing the import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ember.errors import InputError
from ember.importer import ModelSource, import_model
from ember.ir import Dim, MapType, Model, OptionalType, SequenceType, TensorType, ValueInfo
from ember.runtime.backends import Backend, get_backend
from ember.runtime import threads as _threads
from ember.runtime.executor import Plan
from ember.runtime.values import IOBinding, OrtValue, _np_dtype, backend_for_device


@dataclass(frozen=True)
class IOInfo:
    """A model input or output: name, numpy dtype (None if undeclared) and shape."""
    name: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None  # ints, str for symbolic dims, None for unknown
    type: str  # onnxruntime-style type string, e.g. "tensor(float)"


def _io_info(v: ValueInfo) -> IOInfo:
    t = v.type
    if isinstance(t, TensorType):
        return IOInfo(v.name, t.dtype, t.shape, f"tensor({_ort_type_name(t.dtype)})")
    if isinstance(t, SequenceType):
        return IOInfo(v.name, None, None, f"seq({_type_str(t.elem)})")
    if isinstance(t, (OptionalType, MapType)):
        return IOInfo(v.name, None, None, _type_str(t))
    return IOInfo(v.name, None, None, "unknown")


def _type_str(t) -> str:
    if isinstance(t, TensorType):
        return f"tensor({_ort_type_name(t.dtype)})"
    if isinstance(t, SequenceType):
        return f"seq({_type_str(t.elem)})"
    if isinstance(t, OptionalType):
        return f"optional({_type_str(t.elem)})"
    if isinstance(t, MapType):
        return f"map({_ort_type_name(t.key)},{_type_str(t.value)})"
    return "unknown"


_ORT_NAMES = {"float32": "float", "float64": "double", "object": "string", "bool": "bool"}


def _ort_type_name(dtype: np.dtype | None) -> str:
    if dtype is None:
        return "unknown"
    name = np.dtype(dtype).name
    return _ORT_NAMES.get(name, name)


class Session:
    """A model ready to run on one backend."""

    def __init__(self, model: Model, backend: str | Backend | None = None,
                 threads: int | None = None):
        self.model = model
        # BLAS threads during run() (ember.runtime.threads); default: the physical cores
        self.threads = _threads.check_threads(threads) or _threads.default_threads()
        _threads.refresh()  # the BLAS libraries loaded by now
        self._backend = get_backend(backend)  # a Backend instance is used as it is
        self.backend = self._backend.name
        graph = model.graph
        self._uploads: dict[str, Any] = {}  # weights on the device, shared by all plans
        self._plan = Plan(graph, self._backend, uploads=self._uploads)
        # (outputs or None, device_outputs, inputs fed on the device) -> plan
        self._plans: dict[tuple, Plan] = {(None, False, frozenset()): self._plan}
        # Inputs backed by an initialiser are optional overrides, as in onnxruntime.
        self._required = [v for v in graph.inputs if v.name not in graph.initializers]
        self.inputs: list[IOInfo] = [_io_info(v) for v in self._required]
        self.outputs: list[IOInfo] = [_io_info(v) for v in graph.outputs]
        self._input_types = {v.name: v.type for v in graph.inputs}

    @property
    def placement(self) -> list[tuple[str, str, str]]:
        """(node name, op type, where) per node: 'device' on the backend, or a host placement
        'metadata' / 'shape' (shape work), 'control' (subgraph ops), 'fallback' (no device
        kernel), 'host' (CPU backend)."""
        return [(n.name or n.outputs[0], n.op_type, where) for n, where in self._plan.placement]

    @property
    def placement_reasons(self) -> list[tuple[str, str, str, str]]:
        """`placement` with, for each node on the host, why: no kernel for this backend, a
        dtype its kernel does not run, shape work, or control flow ('' for device nodes)."""
        return [(name, op, where, reason) for (name, op, where), reason
                in zip(self.placement, self._plan.placement_reasons)]

    def placement_summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, _, where in self.placement:
            counts[where] = counts.get(where, 0) + 1
        return counts

    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None,
            device_outputs: bool = False) -> dict[str, Any]:
        """Run the model; returns {output name: array} for `outputs` (default: all).

        Feeds may be numpy arrays, the backend's device arrays or OrtValues; a feed already on
        the backend's device is used where it is. With `device_outputs` the outputs come back as
        OrtValues, those computed on the device left there (no copy to the host)."""
        ordered = self._check_feeds(feeds, self._plan)
        device_inputs = frozenset(
            name for name, value in zip(self._plan.input_names, ordered)
            if name in feeds and self.backend != "cpu" and self._backend.is_device_array(value))
        plan = self._plan_for(None if outputs is None else tuple(outputs), device_outputs,
                              device_inputs)
        _threads.enter(self.threads)
        try:
            values = plan.run(ordered)
        finally:
            _threads.leave()
        # kernels may return strided views (a channels-last convolution's NCHW view): users
        # get C-ordered arrays, as onnxruntime returns (copied only where a view came back)
        values = [np.ascontiguousarray(v) if isinstance(v, np.ndarray) and
                  not v.flags.c_contiguous else v for v in values]
        if device_outputs:
            cpu = get_backend("cpu")
            values = [OrtValue(v, self._backend if self._backend.is_device_array(v) else cpu)
                      for v in values]
        return dict(zip(plan.output_names, values))

    def _plan_for(self, outputs: tuple[str, ...] | None, device_outputs: bool = False,
                  device_inputs: frozenset[str] = frozenset()) -> Plan:
        if outputs is not None and list(outputs) == [v.name for v in self.outputs]:
            outputs = None  # all of them, in order: the same plan as none asked
        if self.backend == "cpu":
            device_outputs, device_inputs = False, frozenset()  # host and device are one
        key = (outputs, bool(device_outputs), device_inputs)
        if key not in self._plans:
            if outputs is not None:
                known = {v.name for v in self.outputs}
                unknown = [o for o in outputs if o not in known]
                if unknown:
                    raise InputError(f"unknown output name(s) {', '.join(map(repr, unknown))}; "
                                     f"the model's outputs are {', '.join(sorted(known))}")
            self._plans[key] = Plan(self.model.graph, self._backend, wanted_outputs=outputs,
                                    device_inputs=device_inputs,
                                    device_outputs=bool(device_outputs), uploads=self._uploads)
        return self._plans[key]

    def _check_feeds(self, feeds: Mapping[str, Any], plan: Plan) -> list[Any]:
        if not isinstance(feeds, Mapping):
            raise InputError("feeds must be a dict of input name -> array")
        graph = self.model.graph
        unknown = [k for k in feeds if k not in self._input_types]
        if unknown:
            raise InputError(f"unknown input name(s) {', '.join(map(repr, unknown))}; the model's "
                             f"inputs are {', '.join(v.name for v in self._required) or 'none'}")
        missing = [v.name for v in self._required if v.name not in feeds]
        if missing:
            raise InputError(f"missing input(s) {', '.join(map(repr, missing))}: "
                             + "; ".join(f"'{i.name}' expects {_describe(i)}"
                                         for i in self.inputs if i.name in missing))
        symbols: dict[str, tuple[int, str]] = {}
        ordered = []
        for name in plan.input_names:
            if name not in feeds:
                ordered.append(graph.initializers[name])
                continue
            ordered.append(self._check_one(name, feeds[name], symbols))
        return ordered

    def _check_one(self, name: str, value: Any, symbols: dict[str, tuple[int, str]]) -> Any:
        if isinstance(value, OrtValue):
            value = value.value_for(self._backend)  # another backend's device value: via host
        t = self._input_types[name]
        if isinstance(t, MapType) or (isinstance(t, SequenceType)
                                      and isinstance(t.elem, MapType)):
            return _check_maps(name, value, t)
        if not isinstance(t, TensorType):
            return value  # sequences / optionals pass through as given
        if _is_foreign_device_array(value) and not self._backend.is_device_array(value):
            value = value.get()  # a pyopencl / cupy array of another backend: to the host
        # device arrays of this backend are checked as they are (.dtype, .shape), not copied
        if not isinstance(value, np.ndarray) and not self._backend.is_device_array(value):
            try:
                value = np.asarray(value, dtype=t.dtype)
            except (TypeError, ValueError) as exc:
                raise InputError(f"input '{name}': cannot convert {type(value).__name__} to "
                                 f"{t.dtype}: {exc}") from exc
        if t.dtype is not None and value.dtype != t.dtype:
            raise InputError(f"input '{name}' expects dtype {t.dtype}, got {value.dtype}; "
                             f"convert it with .astype(np.{t.dtype})")
        if t.shape is not None:
            if value.ndim != len(t.shape):
                raise InputError(f"input '{name}' expects rank {len(t.shape)} "
                                 f"(shape {_shape_str(t.shape)}), got shape {value.shape}")
            for axis, (want, got) in enumerate(zip(t.shape, value.shape)):
                if isinstance(want, int) and want > 0 and want != got:
                    raise InputError(f"input '{name}' expects size {want} in dimension {axis} "
                                     f"(shape {_shape_str(t.shape)}), got shape {value.shape}")
                if isinstance(want, str) and want:
                    seen = symbols.setdefault(want, (got, name))
                    if seen[0] != got:
                        raise InputError(
                            f"dimension '{want}' is {seen[0]} in input '{seen[1]}' but {got} in "
                            f"input '{name}' (shape {value.shape})")
        return value


def _check_maps(name: str, value: Any, t: MapType | SequenceType) -> Any:
    """A map feed (or a list of maps) with keys of the declared type and values converted to
    the declared value type, as onnxruntime converts them."""
    if isinstance(t, SequenceType):
        if not isinstance(value, (list, tuple)):
            raise InputError(f"input '{name}' expects a list of dicts, got {type(value).__name__}")
        return [_check_map(name, m, t.elem) for m in value]
    return _check_map(name, value, t)


def _check_map(name: str, value: Any, t: MapType) -> dict:
    if not isinstance(value, Mapping):
        raise InputError(f"input '{name}' expects a dict, got {type(value).__name__}")
    string_keys = np.dtype(t.key).kind in "OUS"
    value_dtype = getattr(t.value, "dtype", None)
    string_values = value_dtype is not None and np.dtype(value_dtype).kind in "OUS"
    checked = {}
    for key, v in value.items():
        key_ok = isinstance(key, str) if string_keys else \
            isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_))
        if not key_ok:
            raise InputError(f"input '{name}': key {key!r} is not of the map's key type "
                             f"{_ort_type_name(t.key)}")
        if value_dtype is None:
            checked[key] = v
            continue
        if isinstance(v, str) != string_values:
            raise InputError(f"input '{name}': value {v!r} of key {key!r} is not "
                             f"{_ort_type_name(value_dtype)}")
        try:
            checked[key] = np.asarray(v, dtype=value_dtype).reshape(())[()]
        except (TypeError, ValueError) as exc:
            raise InputError(f"input '{name}': value of key {key!r}: {exc}") from exc
    return checked


def _is_foreign_device_array(value: Any) -> bool:
    module = type(value).__module__.split(".")[0]
    return module in ("pyopencl", "cupy") and hasattr(value, "get")


def _shape_str(shape: Iterable[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _describe(info: IOInfo) -> str:
    shape = _shape_str(info.shape) if info.shape is not None else "any shape"
    return f"{info.type} {shape}"


def load(model: ModelSource | Model, backend: str | Backend | None = None,
         simplify: bool = True, threads: int | None = None) -> Session:
    """Load an ONNX model (path, bytes, onnx.ModelProto or ember IR) for `backend`.

    `backend` is a name, defaulting to $EMBER_BACKEND, then "cpu" (the process's instance of
    that backend), or a `Backend` instance to run on, e.g. an `OpenCLBackend()` of its own
    (its own context and queue). With `simplify` (the default) the graph is simplified for that
    backend first (constant folding, fusions, expansion of ops the backend lacks; see
    ember.simplifier); the caller's IR is never modified. `threads`: BLAS threads during
    `run` (default: the physical cores this process may use; see ember.runtime.threads).
    """
    threads = _threads.check_threads(threads)
    instance = get_backend(backend)
    backend_name = instance.name
    ir = model if isinstance(model, Model) else import_model(model)
    if simplify:
        from ember.simplifier import copy_structure, simplify as simplify_model

        if ir is model:
            ir = copy_structure(ir)
        simplify_model(ir, backend=backend_name)
    return Session(ir, instance, threads=threads)


class NodeArg:
    """onnxruntime.NodeArg look-alike."""

    def __init__(self, info: IOInfo):
        self.name = info.name
        self.type = info.type
        self.shape = list(info.shape) if info.shape is not None else None

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


_PROVIDERS = {"CPUExecutionProvider": "cpu", "OpenCLExecutionProvider": "opencl",
              "CUDAExecutionProvider": "cuda"}


class InferenceSession:
    """Drop-in for onnxruntime.InferenceSession (the common subset)."""

    def __init__(self, path_or_bytes: ModelSource, sess_options: Any = None,
                 providers: Sequence[Any] | None = None, **_: Any):
        backend = None
        for p in providers or ():
            name = p[0] if isinstance(p, (tuple, list)) else p
            backend = _PROVIDERS.get(name, name)
            break
        # onnxruntime.SessionOptions.intra_op_num_threads: 0 (its default) = the physical cores
        threads = getattr(sess_options, "intra_op_num_threads", 0) or None
        self._session = load(path_or_bytes, backend, threads=threads)

    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(i) for i in self._session.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(o) for o in self._session.outputs]

    def get_providers(self) -> list[str]:
        return [k for k, v in _PROVIDERS.items() if v == self._session.backend]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        result = self._session.run(input_feed, outputs=list(output_names) if output_names else None)
        return list(result.values())

    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, Any], run_options: Any = None
                            ) -> list[OrtValue]:
        """Run on OrtValues (or arrays); the outputs are OrtValues, left on the device where
        they were computed there."""
        result = self._session.run(input_dict_ort_values, device_outputs=True,
                                   outputs=list(output_names) if output_names else None)
        return list(result.values())

    def io_binding(self) -> IOBinding:
        return IOBinding(self._session)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        if iobinding._session is not self._session:
            raise ValueError("IOBinding must be used with the session that created it.")
        iobinding._run()

    def create_ortvalue_from_shape_and_type(self, shape: Sequence[int], element_type: Any,
                                            device_type: str, device_id: int = 0,
                                            vendor_id: int = -1) -> OrtValue:
        """A zero-filled OrtValue; "gpu" means this session's device backend."""
        backend = backend_for_device(device_type, device_id, self._session._backend)
        return OrtValue._allocate(backend, shape, np.dtype(_np_dtype(element_type)))
