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
from ember.ir import Dim, Model, OptionalType, SequenceType, TensorType, ValueInfo
from ember.runtime.backends import get_backend
from ember.runtime.executor import Plan


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
    if isinstance(t, OptionalType):
        return IOInfo(v.name, None, None, f"optional({_type_str(t.elem)})")
    return IOInfo(v.name, None, None, "unknown")


def _type_str(t) -> str:
    if isinstance(t, TensorType):
        return f"tensor({_ort_type_name(t.dtype)})"
    if isinstance(t, SequenceType):
        return f"seq({_type_str(t.elem)})"
    if isinstance(t, OptionalType):
        return f"optional({_type_str(t.elem)})"
    return "unknown"


_ORT_NAMES = {"float32": "float", "float64": "double", "object": "string", "bool": "bool"}


def _ort_type_name(dtype: np.dtype | None) -> str:
    if dtype is None:
        return "unknown"
    name = np.dtype(dtype).name
    return _ORT_NAMES.get(name, name)


class Session:
    """A model ready to run on one backend."""

    def __init__(self, model: Model, backend: str | None = None):
        self.model = model
        self._backend = get_backend(backend)
        self.backend = self._backend.name
        graph = model.graph
        self._plan = Plan(graph, self._backend)
        self._plans: dict[tuple[str, ...], Plan] = {}
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

    def placement_summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, _, where in self.placement:
            counts[where] = counts.get(where, 0) + 1
        return counts

    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None
            ) -> dict[str, Any]:
        """Run the model; returns {output name: array} for `outputs` (default: all)."""
        plan = self._plan if outputs is None else self._plan_for(tuple(outputs))
        values = plan.run(self._check_feeds(feeds, plan))
        return dict(zip(plan.output_names, values))

    def _plan_for(self, outputs: tuple[str, ...]) -> Plan:
        if outputs not in self._plans:
            known = {v.name for v in self.outputs}
            unknown = [o for o in outputs if o not in known]
            if unknown:
                raise InputError(f"unknown output name(s) {', '.join(map(repr, unknown))}; "
                                 f"the model's outputs are {', '.join(sorted(known))}")
            self._plans[outputs] = Plan(self.model.graph, self._backend, wanted_outputs=outputs)
        return self._plans[outputs]

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
        t = self._input_types[name]
        if not isinstance(t, TensorType):
            return value  # sequences / optionals pass through as given
        if not isinstance(value, np.ndarray):
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


def _shape_str(shape: Iterable[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _describe(info: IOInfo) -> str:
    shape = _shape_str(info.shape) if info.shape is not None else "any shape"
    return f"{info.type} {shape}"


def load(model: ModelSource | Model, backend: str | None = None, simplify: bool = True
         ) -> Session:
    """Load an ONNX model (path, bytes, onnx.ModelProto or ember IR) for `backend`.

    `backend` defaults to $EMBER_BACKEND, then "cpu". With `simplify` (the default) the graph is
    simplified for that backend first (constant folding, fusions, expansion of ops the backend
    lacks; see ember.simplifier); the caller's IR is never modified.
    """
    backend_name = get_backend(backend).name
    ir = model if isinstance(model, Model) else import_model(model)
    if simplify:
        from ember.simplifier import copy_structure, simplify as simplify_model

        if ir is model:
            ir = copy_structure(ir)
        simplify_model(ir, backend=backend_name)
    return Session(ir, backend_name)


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
        self._session = load(path_or_bytes, backend)

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
