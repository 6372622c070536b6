"""`ember.Module`: the base of generated and hand-written native modules.

A module owns named parameters (host numpy arrays, e.g. memory-mapped from a safetensors file)
and ops declared with `self.op(...)`. An op is bound to its kernel through the op registry
exactly as the graph executor binds a node (`lookup` + `bind` on an `ir.Node`), and it places
itself as the executor would on a device backend, so a module computes the same bits as
`ember.load(model).run(...)` on the same backend.

    class Tiny(Module):
        def __init__(self, backend=None):  # None: $EMBER_BACKEND, then "cpu"
            super().__init__()
            self.add_parameter("w", np.ones((4, 4), np.float32))
            self.matmul = self.op("MatMul", 13, params={1: "w"})
            self.relu = self.op("Relu", 14)
            self.to(backend)

        def forward(self, x):
            return self.outputs(self.relu(self.matmul(x)))

Custom ops and hand-written hot paths: register a kernel with the op registry, then declare
the op with its domain. The registry call is the same one ember's own ops use:

    from ember.ops.registry import OpImpl, register

    @register("Gelu2", versions=[1], domain="com.example")
    class Gelu2(OpImpl):
        def run(self, x):
            return (0.5 * x * (1 + np.tanh(0.79788456 * (x + 0.044715 * x ** 3)))).astype(x.dtype)

    self.gelu = self.op("Gelu2", 1, domain="com.example")

A model using `com.example::Gelu2` then loads in the graph executor, and `ember convert` turns
it into a module whose `forward` calls `self.gelu_3(x)`; import the module registering the
kernel before building the model. A kernel for a device backend is registered with
`backend="opencl"` (or "cuda") and used after `.to("opencl")`.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ember.errors import EmberError, ExecutionError, InputError, InvalidModelError, \
    UnsupportedOpError
# MapType, OptionalType, SequenceType: for generated code (rt.MapType(...) in input_types)
from ember.ir import MapType, Node, OptionalType, SequenceType, TensorType, ValueInfo  # noqa: F401
from ember.ops.registry import OpImpl, bind, lookup, normalize_domain, since_version
from ember.native.safetensors import numpy_dtype
from ember.runtime.backends import Backend, get_backend
from ember.runtime.session import check_input

# numpy reductions over 0-d arrays return scalars; values are always arrays, as in the executor.
_SCALARS = (np.generic, int, float, complex)


class Weight:
    """An attribute value held in the module's parameters (a large constant tensor); resolved
    to the array when the op is bound."""

    def __init__(self, key: str):
        self.key = key

    def __repr__(self) -> str:
        return f"Weight({self.key!r})"


class Op:
    """One declared op: the node it stands for, and its kernel bound for the module's backend.

    Calling it runs the kernel on the given inputs (parameter inputs are filled in) and returns
    one value, or a tuple with one entry per declared output.
    """

    def __init__(self, module: "Module", op_type: str, opset: int, attrs: dict[str, Any],
                 domain: str, params: dict[int, str], n_in: int, n_out: int, name: str,
                 place: str | None, bodies: tuple[str, ...] = ()):
        self.module = module
        self.bodies = bodies  # subgraph attributes given per call (with_bodies)
        self.op_type, self.opset, self.domain = op_type, opset, normalize_domain(domain)
        self.attrs, self.params, self.name, self.place = attrs, params, name, place
        self.n_in, self.n_out = n_in, n_out
        self.free_positions = [i for i in range(n_in) if i not in params]
        self.kernel: OpImpl | None = None
        self.on_device = False

    def node(self) -> Node:
        """The IR node the executor would bind for this op (input/output names are
        placeholders: kernels see only how many there are)."""
        return Node(self.op_type, self.domain, self.opset,
                    inputs=[f"in{i}" for i in range(self.n_in)],
                    outputs=[f"out{i}" for i in range(self.n_out)],
                    attrs=dict(self.attrs), name=self.name)

    def bind(self, backend: Backend) -> None:
        """Choose the kernel and residency as the executor's Plan does for `backend`."""
        self.backend = backend
        if any(b not in self.attrs for b in self.bodies):
            return  # bound per call, once its bodies are known (with_bodies)
        node = self.node()
        where = self.place
        if backend.name != "cpu" and where is None:
            device_impl = lookup(self.domain, self.op_type, self.opset, backend.name)
            where = "device" if device_impl is not None else "fallback"
        self.on_device = where == "device"
        self.moves = backend.name != "cpu" and where != "metadata"
        impl = lookup(self.domain, self.op_type, self.opset,
                      backend.name if self.on_device else "cpu")
        if impl is None:
            raise UnsupportedOpError([(self.domain, self.op_type, since_version(
                self.domain, self.op_type, self.opset))], backend.name)
        attrs = {k: self.module._resolve_attr(v) for k, v in self.attrs.items()}
        self.kernel = bind(node, impl, attrs, backend if self.on_device else None)
        self.host_inputs = set(getattr(impl, "host_inputs", ())) if self.on_device else set()
        self.backend = backend
        self.template: list[Any] = [None] * self.n_in
        for pos, key in self.params.items():
            device = self.on_device and pos not in self.host_inputs
            self.template[pos] = self.module._parameter_on(key, device)
        self.run = self.kernel.run

    def __call__(self, *args: Any) -> Any:
        if self.params:
            full = self.template.copy()
            for pos, value in zip(self.free_positions, args):
                full[pos] = value
        else:
            full = list(args)
        if self.moves:
            full = self._resident(full)
        try:
            result = self.run(*full)
        except EmberError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{self.describe()} failed: {type(exc).__name__}: {exc}") \
                from exc
        return self._normalise(result)

    def with_bodies(self, **bodies: "Body") -> "Op":
        """This op re-bound with subgraph attributes given as Python functions (`Body`), for
        subgraph ops other than If/Loop/Scan, whose bodies are nested functions in forward."""
        bound = Op(self.module, self.op_type, self.opset, {**self.attrs, **bodies},
                   self.domain, self.params, self.n_in, self.n_out, self.name, self.place,
                   self.bodies)
        bound.bind(self.backend)
        return bound

    def _resident(self, values: list[Any]) -> list[Any]:
        """Inputs moved where the kernel runs: the device for device kernels (except their
        host inputs), the host otherwise."""
        backend = self.backend
        if self.on_device:
            return [backend.to_host(v) if i in self.host_inputs else backend.to_device(v)
                    for i, v in enumerate(values)]
        return [backend.to_host(v) for v in values]

    def _normalise(self, result: Any) -> Any:
        n = self.n_out
        if type(result) is tuple:
            values = [np.asarray(v) if isinstance(v, _SCALARS) else v for v in result[:n]]
            if n == 1:
                return values[0] if values else None
            return tuple(values) + (None,) * (n - len(values))
        if isinstance(result, _SCALARS):
            result = np.asarray(result)
        return result if n == 1 else (result,) + (None,) * (n - 1)

    def describe(self) -> str:
        domain = f"{self.domain}::" if self.domain else ""
        label = f" '{self.name}'" if self.name else ""
        return f"op{label} ({domain}{self.op_type}, opset {self.opset})"

    def __repr__(self) -> str:
        return f"<Op {self.describe()}>"


class Body:
    """A nested function standing in for a compiled subgraph plan (`.run(inputs, scope)`),
    for kernels that take a subgraph attribute."""

    def __init__(self, module: "Module", fn: Callable, n_inputs: int,
                 output_types: Sequence[TensorType | None]):
        self.module, self.fn = module, fn
        self.input_names = [f"in{i}" for i in range(n_inputs)]
        self.output_names = [f"out{i}" for i in range(len(output_types))]
        self.graph = _BodyGraph([ValueInfo(n, t) for n, t in zip(self.output_names, output_types)])

    def run(self, inputs: Sequence[Any], scope: Mapping[str, Any] | None = None) -> list[Any]:
        return list(self.fn(*inputs))


class _BodyGraph:
    def __init__(self, outputs: list[ValueInfo]):
        self.outputs = outputs


class Module:
    """Base of native modules: parameters by name, ops bound to one backend, `.to(backend)`.

    A module whose class declares `input_names` and `input_types` (name -> TensorType, as
    generated modules do) has its positional inputs checked before `forward` with the rules
    of `Session.run` (dtype, rank, fixed and symbolic dims), raising InputError."""

    input_names: tuple[str, ...] = ()
    input_types: Mapping[str, Any] = {}

    def __init__(self) -> None:
        self._parameters: dict[str, Any] = {}
        self._ops: list[Op] = []
        self._backend: Backend = get_backend("cpu")
        self._device_parameters: dict[str, Any] = {}

    # -- parameters -------------------------------------------------------------------------
    def add_parameter(self, key: str, value: Any) -> None:
        self._parameters[key] = value
        self._device_parameters.pop(key, None)

    def parameters(self) -> dict[str, Any]:
        """Parameter name -> host array (memory-mapped when loaded from a weights file)."""
        return dict(self._parameters)

    def state_dict(self) -> dict[str, Any]:
        """The parameters, for saving (`ember.native.safetensors.save_file`) or copying."""
        return dict(self._parameters)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Replace parameters by name; shapes and dtypes must match. With `strict`, the keys
        must be exactly this module's. Ops are re-bound, so constants they precompute follow."""
        if strict:
            missing = sorted(set(self._parameters) - set(state))
            unknown = sorted(set(state) - set(self._parameters))
            if missing or unknown:
                raise InputError(f"state dict mismatch: missing {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''}, unexpected "
                                 f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for key, value in state.items():
            if key not in self._parameters:
                continue
            old, new = self._parameters[key], np.asarray(value)
            if getattr(old, "shape", None) != new.shape or getattr(old, "dtype", None) != new.dtype:
                raise InputError(f"parameter {key!r}: expected {old.dtype}{list(old.shape)}, "
                                 f"got {new.dtype}{list(new.shape)}")
            self._parameters[key] = new
        self._device_parameters.clear()
        self.to(self._backend.name)

    def load_weights(self, weights: str | os.PathLike | Mapping[str, Any]) -> None:
        """Add every tensor of a safetensors file (memory-mapped) or a mapping as parameters."""
        from ember.native.safetensors import load_file

        tensors = load_file(os.fspath(weights)) if isinstance(weights, (str, os.PathLike)) \
            else weights
        for key, value in tensors.items():
            self.add_parameter(key, value)

    def _parameter_on(self, key: str, device: bool) -> Any:
        if key not in self._parameters:
            raise InvalidModelError(f"the module has no parameter {key!r}; are the weights "
                                    "those of this model?")
        if not device:
            return self._parameters[key]
        if key not in self._device_parameters:  # uploaded once per backend
            self._device_parameters[key] = self._backend.to_device(self._parameters[key])
        return self._device_parameters[key]

    def param(self, key: str) -> Any:
        """A parameter as a value in forward (host array)."""
        return self._parameters[key]

    def _resolve_attr(self, value: Any) -> Any:
        if isinstance(value, Weight):
            return self._parameters[value.key]
        if isinstance(value, list) and any(isinstance(v, Weight) for v in value):
            return [self._resolve_attr(v) for v in value]
        return value

    # -- ops and backends -------------------------------------------------------------------
    def op(self, op_type: str, opset: int, attrs: dict[str, Any] | None = None, *,
           domain: str = "", params: dict[int, str] | None = None, n_in: int | None = None,
           n_out: int = 1, name: str = "", place: str | None = None,
           bodies: Sequence[str] = ()) -> Op:
        """Declare an op. `opset` is the opset of `domain` in force (the kernel is the one for
        the schema's since-version there); `params` maps input positions to parameter names;
        `n_in`/`n_out` count inputs/outputs including omitted ones (default: as passed);
        `place` ('metadata' or 'host') pins it to the host on device backends as the executor
        does for shape computations and control flow; `bodies` names subgraph attributes
        passed per call through `Op.with_bodies`."""
        params = dict(params or {})
        op = Op(self, op_type, opset, dict(attrs or {}), domain, params,
                n_in if n_in is not None else len(params) + 1, n_out, name, place,
                tuple(bodies))
        self._ops.append(op)
        op.bind(self._backend)
        return op

    def body(self, fn: Callable, n_inputs: int, output_types: Sequence[TensorType | None]
             ) -> Body:
        return Body(self, fn, n_inputs, output_types)

    @property
    def backend(self) -> str:
        return self._backend.name

    def to(self, backend: str | Backend | None) -> "Module":
        """Re-bind every op for `backend` ("cpu", "opencl", "cuda", a Backend instance; None:
        $EMBER_BACKEND, then "cpu", as for `ember.load`); returns self."""
        target = get_backend(backend)
        if target is not self._backend:
            self._device_parameters.clear()
        self._backend = target
        for op in self._ops:
            op.bind(target)
        return self

    # -- helpers the generated forward uses -------------------------------------------------
    def host(self, value: Any) -> Any:
        """`value` on the host (a no-op on the CPU backend)."""
        return self._backend.to_host(value)

    def outputs(self, *values: Any) -> Any:
        """Host copies of the outputs: one value, or a tuple in the model's output order."""
        if self._backend.name != "cpu":
            values = tuple(self._backend.to_host(v) for v in values)
        return values[0] if len(values) == 1 else values

    def truth(self, value: Any) -> bool:
        """A one-element condition (If, Loop) as a Python bool."""
        arr = np.asarray(self.host(value))
        if arr.size != 1:
            raise ExecutionError(f"condition must hold exactly one element, got shape {arr.shape}")
        return bool(arr.reshape(-1)[0])

    def forward(self, *inputs: Any) -> Any:  # pragma: no cover - subclasses define it
        raise NotImplementedError

    def __call__(self, /, *inputs: Any, **named: Any) -> Any:
        """forward on the inputs: positional, in `input_names` order, and/or by their ONNX
        names as a session's feeds are (`m(**feeds)`, `m(x, attention_mask=mask)`)."""
        if named:
            inputs = self._positional(inputs, named)
        if self.input_types:
            inputs = self.check_inputs(inputs)
        return self.forward(*inputs)

    def _positional(self, inputs: Sequence[Any], named: Mapping[str, Any]) -> tuple[Any, ...]:
        names = self.input_names
        unknown = [n for n in named if n not in names]
        if unknown:
            raise InputError(f"unknown input name(s) {', '.join(map(repr, unknown))}; "
                             f"{type(self).__name__}'s inputs are {', '.join(names) or 'none'}")
        twice = [n for n in names[:len(inputs)] if n in named]
        if twice:
            raise InputError(f"input(s) {', '.join(map(repr, twice))} given both by position "
                             "and by name")
        missing = [n for n in names[len(inputs):] if n not in named]
        if missing:
            raise InputError(f"missing input(s) {', '.join(map(repr, missing))}")
        return tuple(inputs) + tuple(named[n] for n in names[len(inputs):])

    def check_inputs(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The positional inputs checked against `input_types` as `Session.run` checks feeds
        (InputError on a wrong count, dtype, rank or size); numbers and lists become arrays."""
        names = self.input_names
        if len(inputs) != len(names):
            raise InputError(f"{type(self).__name__} takes {len(names)} input(s) "
                             f"({', '.join(names) or 'none'}), got {len(inputs)}")
        symbols: dict[str, tuple[int, str]] = {}
        return tuple(value if self.input_types.get(name) is None else
                     check_input(name, value, self.input_types[name], self._backend, symbols)
                     for name, value in zip(names, inputs))


# -- runtime helpers for generated Loop/Scan code (mirroring ops/control_flow.py) ------------
def trip_limit(trip_count: Any) -> int | None:
    """A Loop's maximum trip count, None when omitted."""
    return None if trip_count is None else int(np.asarray(trip_count).reshape(-1)[0])


def stack_outputs(values: list[Any], dtype: str | None, tail: tuple | None,
                  axis: int = 0, reverse: bool = False) -> np.ndarray:
    """Per-iteration outputs stacked along `axis`; an empty array typed from the body's
    declaration when the loop never ran."""
    if reverse:
        values = values[::-1]
    if not values:
        return np.empty((0,) + tuple(tail or ()), dtype=numpy_dtype(dtype or "float32"))
    arrays = [np.asarray(v) for v in values]
    return np.stack(arrays, axis=axis % (arrays[0].ndim + 1))


def scan_length(values: Sequence[np.ndarray], axes: Sequence[int]) -> int:
    """The common length of a Scan's inputs along their scan axes."""
    lengths = {x.shape[a % x.ndim] for x, a in zip(values, axes)}
    if len(lengths) > 1:
        raise ExecutionError(f"scan inputs disagree on the sequence length: {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def scan_slice(x: np.ndarray, t: int, length: int, axis: int, reverse: bool) -> np.ndarray:
    """Step `t` of a Scan input along `axis` (from the end when `reverse`)."""
    return np.take(x, length - 1 - t if reverse else t, axis=axis % x.ndim)


def array(values: Any, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A constant array from a literal (used by generated code for small constants)."""
    dt = numpy_dtype(dtype) if dtype != "object" else np.dtype(object)
    if dt == object:
        flat = np.empty(len(values), dtype=object)
        flat[:] = list(values)
        return flat.reshape(tuple(shape))
    return np.array(values, dtype=dt).reshape(tuple(shape))
