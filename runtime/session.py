"""Sessions: a loaded model plus its plan, with feed checking.

`Session` is ember's own API (`ember.load`); `InferenceSession` (ember.runtime.ort_compat)
mirrors onnxruntime's over it, so code written for onnxruntime runs by changing the import.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from ember import limits
from ember.errors import InputError
from ember.importer import ModelSource, import_model
from ember.log import logger
from ember.ir import Dim, MapType, Model, OptionalType, SequenceType, TensorType, ValueInfo
from ember.runtime.backends import Backend, get_backend
from ember.ops.cpu import threads as _threads
from ember.runtime.executor import Plan
from ember.runtime.profiler import Profiler
from ember.runtime.values import OrtValue


@dataclass(frozen=True)
class IOInfo:
    """A model input or output: name, numpy dtype (None if undeclared) and shape."""
    name: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None  # ints, str for symbolic dims, None for unknown
    type: str  # onnxruntime-style type string, e.g. "tensor(float)"


def io_info(v: ValueInfo) -> IOInfo:
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
                 threads: int | None = None, max_tensor_bytes: int | None = None,
                 profiler: Profiler | None = None):
        self.model = model
        # per-node events of each run while set (ember.runtime.profiler); end_profiling writes
        self.profiler = profiler
        # BLAS threads during run() (ember.ops.cpu.threads); default: the physical cores
        self.threads = _threads.check_threads(threads) or _threads.default_threads()
        # the largest tensor a node may produce (ember.limits); default: half the memory
        self.max_tensor_bytes = limits.resolve(max_tensor_bytes)
        # the process's CPU engine (made, and the process set up, by the first session): runs
        # set its BLAS threads and kernel pool whatever the backend (host kernels run on it)
        self._engine = get_backend("cpu").engine
        self._engine.adopt_new_libraries()  # one loaded since the last session (torch's)
        self._backend = get_backend(backend)  # a Backend instance is used as it is
        self.backend = self._backend.name
        graph = model.graph
        self._uploads: dict[str, Any] = {}  # weights on the device, shared by all plans
        self._plan = Plan(graph, self._backend, uploads=self._uploads)
        # (outputs or None, device_outputs, inputs fed on the device) -> plan
        self._plans: dict[tuple, Plan] = {(None, False, frozenset()): self._plan}
        # Inputs backed by an initialiser are optional overrides, as in onnxruntime.
        self._required = [v for v in graph.inputs if v.name not in graph.initializers]
        self._required_names = frozenset(v.name for v in self._required)
        self.inputs: list[IOInfo] = [io_info(v) for v in self._required]
        self.overridable_initializers: list[IOInfo] = [
            io_info(v) for v in graph.inputs if v.name in graph.initializers]
        self.outputs: list[IOInfo] = [io_info(v) for v in graph.outputs]
        self._input_types = {v.name: v.type for v in graph.inputs}
        self._plain = {v.name: plain for v in graph.inputs
                       if (plain := _plain_check(v.type)) is not None}
        # each input of the plans (all take the graph's inputs, in order) with its summary
        # for `_passes` (None: the full check), read by every run's `_check_feeds`
        self._feed_order = tuple((name, self._plain.get(name))
                                 for name in self._plan.input_names)
        # the host's arrays and the device's told apart in outputs (None: one and the same)
        self._on_device = self._backend.is_device_array if self.backend != "cpu" else None

    @property
    def plan(self) -> Plan:
        """The plan of the whole graph (its steps, placement and initial values), for tools that
        look inside a run, as `ember check` does."""
        return self._plan

    @property
    def backend_instance(self) -> Backend:
        """The backend object the session runs on (`backend` is its name)."""
        return self._backend

    def iterate(self, feeds: Mapping[str, Any]):
        """Run the whole graph node by node, yielding (node, its output values) as each node
        runs: values stay on the backend's device; nothing is kept for the caller."""
        return self._plan.iterate(self._check_feeds(feeds, self._plan))

    @property
    def placement(self) -> list[tuple[str, str, str]]:
        """(node name, op type, where) per node: 'device' on the backend, or a host placement
        'metadata' / 'shape' (shape work), 'control' (subgraph ops), 'fallback' (no device
        kernel), 'host' (CPU backend)."""
        return [(n.name or n.outputs[0], n.op_type, where) for n, where in self._plan.placement]

    @property
    def placement_reasons(self) -> list[tuple[str, str, str, str]]:
        """`placement` with, for each node on the host, why: no kernel for this backend, a
        dtype its kernel does not run, shape work, or control flow ('' for device nodes).
        `kernels` names the kernel each node runs, in the same order."""
        return [(name, op, where, reason) for (name, op, where), reason
                in zip(self.placement, self._plan.placement_reasons)]

    @property
    def kernels(self) -> list[tuple[str, str, str, str]]:
        """(node name, op type, kernel, why) per node, in `placement`'s order: the kernel the
        plan chose for it ("numpy", "cpu.tiles", "cpu.depthwise", "opencl"...), or for a node
        whose choice waits for its input's geometry, what its latest run chose."""
        return [(name, op, kernel, why) for (name, op, _), (kernel, why)
                in zip(self.placement, self._plan.kernels())]

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
        if outputs is None and not device_outputs and self.backend == "cpu":
            plan = self._plan  # the common call: no plan to look up
        else:
            device_inputs = frozenset(
                name for name, value in zip(self._plan.input_names, ordered) if name in feeds
                and self.backend != "cpu" and self._backend.is_device_array(value))
            plan = self._plan_for(None if outputs is None else tuple(outputs), device_outputs,
                                  device_inputs)
        engine = self._engine
        engine.enter(self.threads, plan.calls_blas)
        cap = limits.enter(self.max_tensor_bytes)
        try:
            if self.profiler is None:
                values = plan.run(ordered)
            else:
                values = self.profiler.run(plan, ordered, self._backend.synchronize)
        finally:
            limits.leave(cap)
            engine.leave()
        values = owned_outputs(values, ordered, self._on_device)
        if device_outputs:
            cpu = get_backend("cpu")
            values = [OrtValue(v, self._backend if self._backend.is_device_array(v) else cpu)
                      for v in values]
        return dict(zip(plan.output_names, values))

    def check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """Raise InputError where `run(feeds)` would, without running."""
        self._check_feeds(feeds, self._plan)

    def end_profiling(self) -> str:
        """Write the profile of the runs so far (Chrome-trace JSON) and return its path;
        profiling stops. "" when the session was not profiling."""
        if self.profiler is None:
            return ""
        path, self.profiler = self.profiler.end(), None
        return path

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
        # a dict first: isinstance against typing's Mapping costs a microsecond a call
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise InputError("feeds must be a dict of input name -> array")
        graph = self.model.graph
        # set comparisons of the key views first: the lists below only for the error message
        known = self._input_types.keys() >= feeds.keys()
        unknown = [] if known else [k for k in feeds if k not in self._input_types]
        if unknown:
            raise InputError(f"unknown input name(s) {', '.join(map(repr, unknown))}; the model's "
                             f"inputs are {', '.join(v.name for v in self._required) or 'none'}")
        missing = [] if self._required_names <= feeds.keys() else \
            [v.name for v in self._required if v.name not in feeds]
        if missing:
            raise InputError(f"missing input(s) {', '.join(map(repr, missing))}: "
                             + "; ".join(f"'{i.name}' expects {_describe(i)}"
                                         for i in self.inputs if i.name in missing))
        symbols: dict[str, tuple[int, str]] = {}
        ordered = []
        for name, plain in self._feed_order:
            if name not in feeds:
                ordered.append(graph.initializers[name])
                continue
            value = feeds[name]
            # a feed of the input's whole fixed shape, tested here: no call
            if plain is not None and (
                    (type(value) is np.ndarray and value.shape == plain.exact
                     and value.dtype == plain.dtype)
                    or _passes(name, value, plain, symbols)):
                ordered.append(value)
            else:
                ordered.append(self._check_one(name, value, symbols))
        return ordered

    def _check_one(self, name: str, value: Any, symbols: dict[str, tuple[int, str]]) -> Any:
        return check_input(name, value, self._input_types[name], self._backend, symbols)


class _Plain(NamedTuple):
    """What `check_input` asks of a numpy array fed for a tensor input of a numeric dtype."""
    dtype: np.dtype
    rank: int | None  # None: any shape
    fixed: tuple[tuple[int, int], ...]  # (axis, size) of each fixed dim
    symbolic: tuple[tuple[int, str], ...]  # (axis, name) of each symbolic dim
    exact: tuple[int, ...] | None  # the whole shape, where every dim is fixed
    # a getter of the fixed dims' sizes from a shape (C code, no generator a call), and what
    # it gives for a fitting shape; None where no dim is fixed
    pick: Any = None
    sizes: Any = None


def _plain_check(t: Any) -> _Plain | None:
    """`t` summarised for `_passes`, or None where a feed for it takes the full check."""
    if not isinstance(t, TensorType) or t.dtype is None or t.dtype.kind in "OUS":
        return None
    if t.shape is None:
        return _Plain(t.dtype, None, (), (), None)
    fixed = tuple((axis, d) for axis, d in enumerate(t.shape) if isinstance(d, int) and d > 0)
    symbolic = tuple((axis, d) for axis, d in enumerate(t.shape) if isinstance(d, str) and d)
    exact = tuple(d for _, d in fixed) if len(fixed) == len(t.shape) else None
    pick = itemgetter(*(axis for axis, _ in fixed)) if fixed else None
    sizes = None if not fixed else fixed[0][1] if len(fixed) == 1 else tuple(d for _, d in fixed)
    return _Plain(t.dtype, len(t.shape), fixed, symbolic, exact, pick, sizes)


def _passes(name: str, value: Any, plain: _Plain, symbols: dict[str, tuple[int, str]]) -> bool:
    """Whether a feed passes `check_input` as it is, by `_plain_check`'s summary, recording
    its symbolic dims in `symbols` as `check_input` does: a cheap test for the common feed;
    anything else takes the full check (and its error message)."""
    dtype, rank, _, symbolic, exact, pick, sizes = plain
    if type(value) is not np.ndarray or value.dtype != dtype:
        return False
    shape = value.shape
    if exact is not None:
        return shape == exact
    if rank is None:
        return True
    if len(shape) != rank or (pick is not None and pick(shape) != sizes):
        return False
    for axis, dim in symbolic:
        if symbols.setdefault(dim, (shape[axis], name))[0] != shape[axis]:
            return False
    return True


def check_input(name: str, value: Any, t: Any, backend: Backend,
                symbols: dict[str, tuple[int, str]]) -> Any:
    """One feed checked against its declared type `t` as `Session.run` checks it (the rules
    native modules share): dtype, rank, fixed sizes, and symbolic dims agreeing across the
    inputs of one call (`symbols`: dim name -> (size, first input)). Returns the value to run
    on: converted to an array where it was a number or a list, a map's values converted, and
    for a string input a numpy unicode or bytes array as the object array of str."""
    if isinstance(value, OrtValue):
        value = value.value_for(backend)  # another backend's device value: via host
    if isinstance(t, MapType) or (isinstance(t, SequenceType)
                                  and isinstance(t.elem, MapType)):
        return _check_maps(name, value, t)
    if isinstance(t, OptionalType):
        return None if value is None or t.elem is None else \
            check_input(name, value, t.elem, backend, symbols)
    if isinstance(t, SequenceType):
        return _check_sequence(name, value, t, backend)
    if not isinstance(t, TensorType):
        return value  # a value of a type the model does not say passes as given
    if _is_foreign_device_array(value) and not backend.is_device_array(value):
        value = value.get()  # a pyopencl / cupy array of another backend: to the host
    # device arrays of this backend are checked as they are (.dtype, .shape), not copied
    if not isinstance(value, np.ndarray) and not backend.is_device_array(value):
        value = _as_array(name, value, t)
    if t.dtype is not None and t.dtype.kind == "O":  # a string input
        value = _as_strings(name, value) if isinstance(value, np.ndarray) else value
        if value.dtype.kind != "O":
            raise InputError(f"input '{name}' expects strings (an array of str, a numpy "
                             f"unicode or bytes array), got dtype {value.dtype}")
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


def _check_sequence(name: str, value: Any, t: SequenceType, backend: Backend) -> list:
    """A sequence feed: a list (or tuple) whose tensors are checked, and converted, as tensor
    feeds of the element type are; their shapes may differ from one element to the next."""
    if not isinstance(value, (list, tuple)):
        raise InputError(f"input '{name}' expects a sequence ({_type_str(t)}), given as a list "
                         f"of arrays; got {type(value).__name__}")
    elem = t.elem
    if isinstance(elem, TensorType):
        elem = TensorType(elem.dtype, None)  # the dtype holds for all, a shape for none
    if elem is None:
        return list(value)
    return [check_input(f"{name}[{i}]", v, elem, backend, {}) for i, v in enumerate(value)]


def _as_array(name: str, value: Any, t: TensorType) -> np.ndarray:
    """A feed that is not an array yet (a number, a nested list) as an array of the input's
    dtype. What numpy cannot convert (an int out of the dtype's range, a string for a number,
    a ragged list) is an InputError naming the input and the type it expects."""
    try:
        return np.asarray(value, dtype=t.dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        want = f"{_type_str(t)} values" if t.dtype is not None else "a tensor"
        raise InputError(f"input '{name}' expects {want}; cannot convert the given "
                         f"{type(value).__name__}: {exc}") from exc


def _as_strings(name: str, value: np.ndarray) -> np.ndarray:
    """A feed for a string input as the object array of str the kernels take, as onnxruntime
    takes it: numpy unicode (<U) and bytes (S) arrays, and bytes elements, are converted
    (bytes as UTF-8). Anything else in it is an InputError: kernels call str methods on every
    element."""
    if value.dtype.kind not in "USO":
        return value  # a numeric array: the dtype check names the conversion
    if value.dtype.kind == "U":
        return value.astype(object)
    flat = value.reshape(-1).tolist()  # str or bytes (trailing NULs stripped, as numpy reads S)
    if all(type(s) is str for s in flat):
        return value
    texts = [_as_text(name, s, i, value.shape) for i, s in enumerate(flat)]
    out = np.empty(len(texts), dtype=object)
    out[:] = texts
    return out.reshape(value.shape)


def _as_text(name: str, element: Any, index: int, shape: tuple[int, ...]) -> str:
    if isinstance(element, str):
        return element
    where = tuple(int(i) for i in np.unravel_index(index, shape)) if shape else ()
    if isinstance(element, (bytes, np.bytes_)):
        try:
            return bytes(element).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"input '{name}' is a string input; element {list(where)} is "
                             f"bytes that are not valid UTF-8 ({exc.reason} at byte "
                             f"{exc.start}): decode it to str first") from exc
    raise InputError(f"input '{name}' expects strings (str, or bytes in UTF-8); element "
                     f"{list(where)} is {type(element).__name__} {element!r:.40}")


def owned_outputs(values: list[Any], feeds: Sequence[Any], on_device=None) -> list[Any]:
    """The outputs of a run as arrays the caller owns, as onnxruntime returns them: C-ordered,
    writable, and sharing memory with no feed, no weight of the model and no other output.

    Kernels return views where they can (Identity, Reshape, Slice, Split, same-type Cast...),
    so an output can be the caller's feed itself, a view of it, a view of an initialiser, or a
    view of the same buffer as another output; writing into one would change the other. Such
    an output is copied; others (almost all) are returned as they are. The model's weights
    and Constant values are read-only arrays (the plan marks them so), so an output that is
    not writable is one of them or a view of one. `on_device` tells the backend's device
    arrays (left as they are) from host arrays."""
    if on_device is None and _all_fresh(values, feeds):
        return values
    feed_roots = {id(_root(a)) for a in _arrays(feeds)}
    returned: dict[int, list[np.ndarray]] = {}  # root buffer -> outputs already given out
    return [_owned(v, feed_roots, returned, on_device) for v in values]


def _all_fresh(values: list[Any], feeds: Sequence[Any]) -> bool:
    """Whether `_owned` gives every one of `values` back as it is, by a shorter test that
    covers the common run: each a distinct, writable, C-ordered (`carray`) host array that
    owns its memory (no base), and no feed's root. Arrays without a base are no views, so none
    shares memory with another; `_owned` tests them the same way, one by one."""
    ids = set()
    for value in values:
        if type(value) is not np.ndarray or value.base is not None or not value.flags.carray:
            return False
        ids.add(id(value))
    if len(ids) != len(values):
        return False
    for feed in feeds:
        if type(feed) is np.ndarray:
            if id(feed if feed.base is None else _root(feed)) in ids:
                return False
        elif isinstance(feed, (np.ndarray, list, tuple)):
            if any(id(_root(a)) in ids for a in _arrays((feed,))):
                return False
    return True


def _owned(value: Any, feed_roots: set[int], returned: dict[int, list[np.ndarray]],
           on_device) -> Any:
    if isinstance(value, list):  # a sequence: each tensor in it
        return [_owned(v, feed_roots, returned, on_device) for v in value]
    if not isinstance(value, np.ndarray) or (on_device is not None and on_device(value)):
        return value  # a device array (fresh from its kernel), None, a map
    root = _root(value)
    siblings = returned.setdefault(id(root), [])
    flags = value.flags
    if not (flags.c_contiguous and flags.writeable) or id(root) in feed_roots \
            or (siblings and any(np.may_share_memory(value, other) for other in siblings)):
        value = np.array(value, order="C")  # its own buffer
        siblings = returned.setdefault(id(value), [])
    siblings.append(value)
    return value


def _root(array: np.ndarray) -> Any:
    """The object that owns an array's memory: the end of its chain of bases."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def _arrays(values: Sequence[Any]):
    for v in values:
        if isinstance(v, np.ndarray):
            yield v
        elif isinstance(v, (list, tuple)):  # a sequence feed
            yield from (e for e in v if isinstance(e, np.ndarray))


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
         simplify: bool = True, threads: int | None = None,
         max_tensor_bytes: int | None = None, profile: bool = False,
         profile_prefix: str = "ember_profile_") -> Session:
    """Load an ONNX model (path, bytes, onnx.ModelProto or ember IR) for `backend`.

    `backend` is a name, defaulting to $EMBER_BACKEND, then "cpu" (the process's instance of
    that backend), or a `Backend` instance to run on, e.g. an `OpenCLBackend()` of its own
    (its own context and queue). With `simplify` (the default) the graph is simplified for that
    backend first (constant folding, fusions, expansion of ops the backend lacks; see
    ember.simplifier); the caller's IR is never modified. `threads`: BLAS threads during
    `run` (default: the physical cores this process may use; see ember.ops.cpu.threads).
    `max_tensor_bytes`: the largest tensor a node may produce or ask for; past it a run fails
    with ResourceLimitError (default: $EMBER_MAX_TENSOR_BYTES, else half the memory this
    process may use; see ember.limits). `profile`: record one event per node of every run,
    written by `Session.end_profiling()` to `<profile_prefix><date>.json` (a Chrome trace in
    onnxruntime's format; see ember.runtime.profiler).
    """
    threads = _threads.check_threads(threads)
    cap = limits.resolve(max_tensor_bytes)
    instance = get_backend(backend)
    backend_name = instance.name
    profiler = Profiler(profile_prefix, backend_name) if profile else None
    t0 = time.perf_counter_ns()
    ir = model if isinstance(model, Model) else import_model(model)
    t1 = time.perf_counter_ns()
    if simplify:
        from ember.simplifier import copy_structure, simplify as simplify_model

        if ir is model:
            ir = copy_structure(ir)
        with limits.capped(cap):  # the constant folder runs kernels
            simplify_model(ir, backend=backend_name)
    session = Session(ir, instance, threads=threads, max_tensor_bytes=cap, profiler=profiler)
    if logger.isEnabledFor(logging.INFO):
        placed = session.placement_summary()
        logger.info("loaded %s for %s in %.1f ms: %d nodes%s; placement %s",
                    ir.path or "a model", backend_name, (time.perf_counter_ns() - t0) / 1e6,
                    len(ir.graph.nodes), " after simplification" if simplify else "",
                    ", ".join(f"{k} {v}" for k, v in sorted(placed.items())))
    if profiler is not None:  # onnxruntime's two load events
        profiler.session_event("model_loading", t0, t1)
        profiler.session_event("session_initialization", t1, time.perf_counter_ns())
    return session


class NodeArg:
    """onnxruntime.NodeArg look-alike."""

    def __init__(self, info: IOInfo):
        self.name = info.name
        self.type = info.type
        self.shape = list(info.shape) if info.shape is not None else None

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"
