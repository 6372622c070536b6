"""Plans and runs an IR graph.

A `Plan` is built once per graph: nodes in topological order, each bound to its kernel, every
value given a slot in a flat list, and for each step the slots that die after it. `run` then is
a single loop over precomputed steps; nothing walks the graph per run. Subgraphs (If, Loop,
Scan bodies) are compiled into plans of their own once, when their node is bound; a control
flow node then enters one at the cost of a call. Values a body reads from enclosing scopes
are handed to it as a name -> value dict, except the enclosing plan's constants, which the
body's plan holds as constants of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Collection, Iterator, Mapping, Sequence

import numpy as np

from ember import limits
from ember.errors import (EmberError, ExecutionError, InvalidModelError, ResourceLimitError,
                          UnsupportedOpError)
from ember.ir import Graph, Node, topological_order
from ember.ops.registry import Lowering, OpImpl, Sketch, bind, lookup, since_version
from ember.runtime.backends import Backend, get_backend

_OMITTED = 0  # slot that always holds None: an omitted optional input
_DISCARD = 1  # slot that receives omitted optional outputs
_RESERVED_SLOTS = 2


@dataclass
class Step:
    node: Node
    kernel: OpImpl
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]  # slots whose value is dead after this step
    scope: tuple[tuple[str, int], ...]  # outer-scope values the node's subgraphs read


def missing_ops(graph: Graph, backend: str = "cpu") -> list[tuple[str, str, int]]:
    """Every (domain, op, since-version) in `graph` (subgraphs included) that neither `backend`
    nor the CPU (every backend's fallback) has a kernel for."""
    missing = []
    for node in graph.iter_nodes():
        if lookup(node.domain, node.op_type, node.version, "cpu") is None and \
                lookup(node.domain, node.op_type, node.version, backend) is None:
            missing.append((node.domain, node.op_type,
                            since_version(node.domain, node.op_type, node.version)))
    return sorted(set(missing))


class Transfer:
    """A pseudo-kernel that moves one value between the host and the backend's device."""

    def __init__(self, run):
        self.run = run


# Ops that read only an input's metadata: they run on the host whatever the input's residency.
_METADATA_OPS = {("", "Shape"), ("", "Size")}
# Integer initialisers up to this size count as shape data, kept on the host.
_SHAPE_CONSTANT_MAX = 1024
# Ops a subgraph's plan runs once at plan time when all their inputs are constants: the shape
# arithmetic exporters write (Shape -> Gather -> Concat -> Reshape...), cheap and pure.
_FOLDABLE = frozenset({
    "Constant", "Identity", "Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Reshape",
    "Flatten", "Concat", "Slice", "Transpose", "Cast", "ConstantOfShape", "Range", "Expand",
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Min", "Max", "Floor", "Ceil", "Sqrt",
    "Equal", "Less", "Greater", "Not", "And", "Or", "Where"})
# A folded value is kept only up to this size: the fold is for shape data, not weights.
_FOLD_MAX_BYTES = 1 << 16
# Ops whose CPU kernels call no BLAS on any route (tree walks, ufuncs, views, casts): a plan of
# these alone runs without setting the BLAS libraries' thread counts (`Plan.calls_blas`).
# Only ops known to be so are named; any other op may call BLAS.
_NO_BLAS = frozenset({
    ("ai.onnx.ml", "TreeEnsembleClassifier"), ("ai.onnx.ml", "TreeEnsembleRegressor"),
    ("ai.onnx.ml", "TreeEnsemble"), ("ai.onnx.ml", "ZipMap"),
    ("", "Identity"), ("", "Cast"), ("", "Reshape"), ("", "Flatten"), ("", "Squeeze"),
    ("", "Unsqueeze"), ("", "Shape"), ("", "Add"), ("", "Sub"), ("", "Mul"), ("", "Div"),
    ("", "Relu"), ("", "Sigmoid")})


def needed_nodes(graph: Graph, outputs: Sequence[str], available: set[str]) -> list[Node]:
    """The nodes `outputs` depend on, in execution order; `available` are the values given."""
    needed, kept = set(outputs), []
    for node in reversed(topological_order(graph, available)):
        if any(out in needed for out in node.outputs if out):
            kept.append(node)
            needed.update(n for n in node.inputs if n)
            needed.update(node.implicit_inputs)
    return kept[::-1]


class Plan:
    """A graph compiled for repeated execution on one backend.

    Each node is placed on the backend's device where the backend has a kernel for it, and on
    the host (CPU kernels) otherwise; shape-only work (Shape, Size and arithmetic on their
    results and on small integer constants) always stays on the host. Transfers are inserted
    as steps of their own, once per value and direction, so values stay on the device between
    device nodes. A plan takes host values in and gives host values out, except for the inputs
    named in `device_inputs`, which it is given as the backend's device arrays, and, with
    `device_outputs`, the outputs computed on the device, which it leaves there. `uploads`
    (initialiser name -> device copy) lets plans of one graph share their uploaded weights.

    A subgraph's plan is given `outer_constants`, the enclosing plan's constants among its
    `outer_names`: it holds them as its own, and runs the nodes that compute shape data from
    constants alone (`_FOLDABLE`) once, now. The simplifier cannot fold those: it sees a
    subgraph's captures only as names.
    """

    def __init__(self, graph: Graph, backend: str | Backend = "cpu",
                 outer_names: Sequence[str] = (), wanted_outputs: Sequence[str] | None = None,
                 device_inputs: Collection[str] = (), device_outputs: bool = False,
                 uploads: dict[str, Any] | None = None,
                 outer_constants: Mapping[str, Any] | None = None):
        self.graph = graph
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        missing = missing_ops(graph, self.backend.name)
        if missing:
            raise UnsupportedOpError(missing, self.backend.name)

        self.input_names = [v.name for v in graph.inputs]
        self.output_names = list(wanted_outputs) if wanted_outputs is not None \
            else [v.name for v in graph.outputs]
        # subgraphs only: the top-level graph was folded by the simplifier, or is to run as
        # imported; and on the CPU only, so that a device plan places shape work as before
        fold = outer_constants is not None and self.backend.name == "cpu"
        outer_constants = {} if outer_constants is None else dict(outer_constants)
        self.outer_names = [n for n in outer_names if n not in outer_constants]

        self.slots: dict[str, int] = {}
        available = set(self.input_names) | set(graph.initializers) | set(outer_names)
        nodes = needed_nodes(graph, self.output_names, available)
        self._constants = {self._slot(name): value for name, value in graph.initializers.items()}
        for name, value in outer_constants.items():
            self._constants[self._slot(name)] = value
        for value in self._constants.values():
            if isinstance(value, np.ndarray) and value.flags.writeable:
                value.setflags(write=False)  # kernels must never write into weights
        # name -> value of everything fixed for the plan's life: initialisers no caller can
        # override, the enclosing plan's constants, and what was folded from them
        self._fixed: dict[str, Any] = {n: v for n, v in graph.initializers.items()
                                       if n not in self.input_names}
        self._fixed.update(outer_constants)
        self.input_slots = [self._slot(n) for n in self.input_names]
        self.outer_slots = [(n, self._slot(n)) for n in self.outer_names]

        # values resident on the backend's device
        self._on_device: set[str] = set(device_inputs) & set(self.input_names) \
            if self.backend.name != "cpu" else set()
        self._uploads = {} if uploads is None else uploads
        self._moved: dict[tuple[str, bool], str] = {}  # (value, to_device) -> the moved copy
        self._steps: list[Step] = []
        self.placement: list[tuple[Node, str]] = []
        self.placement_reasons: list[str] = []  # why each host node is on the host
        dtypes = known_dtypes(graph)
        shape_like = shape_constants(graph)
        for node in nodes:
            if not (fold and self._fold(node)):
                self._add_step(node, shape_like, dtypes)
        for name in self.output_names:
            if name not in self.slots and name not in available:
                raise InvalidModelError(f"graph output '{name}' is never computed")
        self.output_slots = [self._slot(n if device_outputs else self._resident(n, False))
                             for n in self.output_names]
        self.steps = self._with_frees(self._steps, set(self.output_slots))
        # the inputs that no step reads and no output passes on (a Loop body's iteration
        # number, often): the node running this plan need not make their values
        read = set(self.output_slots)
        for step in self.steps:
            read.update(step.inputs, (s for _, s in step.scope))
        self.unread_inputs = frozenset(k for k, s in enumerate(self.input_slots)
                                       if s not in read)
        # whether a run may call BLAS, so that Session.run sets its libraries' thread counts
        # (ops/cpu/threads.py): decided here, once, from the ops (`_NO_BLAS`)
        self.calls_blas = self.backend.name != "cpu" or any(
            (step.node.domain, step.node.op_type) not in _NO_BLAS for step in self.steps)
        # what `run` reads per step, bound once: the kernel's run method, a getter of its
        # arguments from the slots, and the slots it writes and frees
        self._program = tuple((step.kernel.run, _getter(step.inputs),
                               step.outputs[0] if step.outputs else _DISCARD,
                               step.outputs, step.frees, step.scope, step.node)
                              for step in self.steps)
        # a getter of the outputs' values (C code): a subgraph's plan runs once a call of its
        # node or an iteration of its loop, so its entry and exit are kept short
        self._results = _getter(tuple(self.output_slots))
        self.initial_env: list[Any] = [None] * (_RESERVED_SLOTS + len(self.slots))
        for s, value in self._constants.items():
            self.initial_env[s] = value
        self.lowerings = self._lower(graph, dtypes)
        del self._constants, self._on_device, self._moved, self._steps, self._fixed  # building

    def _fold(self, node: Node) -> bool:
        """Run `node` now if it is shape work (`_FOLDABLE`) on constants alone, its outputs
        becoming constants of the plan; False when it is left to run with the plan. A fold
        that fails, or makes more than shape data, leaves the node to the run, which reports
        any error against it as it would have."""
        if node.domain or node.op_type not in _FOLDABLE or node.subgraphs() or \
                any(n and n not in self._fixed for n in node.inputs):
            return False
        if (node.domain, node.op_type) not in _METADATA_OPS and any(
                getattr(self._fixed[n], "nbytes", 0) > _FOLD_MAX_BYTES for n in node.inputs if n):
            return False  # work on a weight, not on shape data
        impl = lookup(node.domain, node.op_type, node.version, "cpu")
        try:
            with limits.capped(_FOLD_MAX_BYTES):  # ops that make a shape check it first
                result = bind(node, impl, dict(node.attrs)).run(
                    *[self._fixed[n] if n else None for n in node.inputs])
        except Exception:
            return False
        values = result if type(result) is tuple else (result,)
        if len(values) < len(node.outputs) or not all(
                isinstance(v, (np.ndarray, *_SCALARS)) and np.asarray(v).nbytes <= _FOLD_MAX_BYTES
                for v in values):
            return False
        for name, value in zip(node.outputs, values):
            if name:
                value = np.asarray(value)
                value.setflags(write=False)
                self._fixed[name] = self._constants[self._slot(name)] = value
        return True

    def _slot(self, name: str) -> int:
        if name not in self.slots:
            self.slots[name] = _RESERVED_SLOTS + len(self.slots)
        return self.slots[name]

    def _resident(self, name: str, want_device: bool) -> str:
        """The name under which `name` is available where wanted, moving it if needed."""
        if not name or (name in self._on_device) == want_device:
            return name
        key = (name, want_device)
        if key not in self._moved:
            self._moved[key] = self._move(name, want_device)
        return self._moved[key]

    def _move(self, name: str, want_device: bool) -> str:
        """A transfer of `name` to the device or the host: a step, or for a weight that no
        caller overrides, its upload made now."""
        graph, uploads, slot = self.graph, self._uploads, self._slot
        target = f"{name}@{'device' if want_device else 'host'}"
        move = self.backend.to_device if want_device else self.backend.to_host
        if name in graph.initializers and want_device:
            if name not in uploads:  # uploaded once
                uploads[name] = move(graph.initializers[name])
            if name in self.input_names:  # an input the caller may override
                self._steps.append(Step(Node("ToDevice", "", 0, [name], [target]),
                                        Transfer(_upload_unless(graph.initializers[name],
                                                                uploads[name], move)),
                                        (slot(name),), (slot(target),), (), ()))
            else:
                self._constants[slot(target)] = uploads[name]
        else:
            self._steps.append(Step(Node("ToDevice" if want_device else "ToHost", "", 0,
                                         [name], [target]), Transfer(move),
                                    (slot(name),), (slot(target),), (), ()))
        return target

    def _add_step(self, node: Node, shape_like: set[str], dtypes: dict[str, np.dtype]) -> None:
        """Place and bind `node`, with the transfers its inputs need before it."""
        where, reason = self._place(node, shape_like, dtypes)
        self.placement.append((node, where))
        self.placement_reasons.append(reason)
        device = where == "device"
        impl = lookup(node.domain, node.op_type, node.version,
                      self.backend.name if device else "cpu")
        host_inputs = set(getattr(impl, "host_inputs", ())) if device else set()
        if where == "metadata":
            inputs = list(node.inputs)
        else:
            inputs = [self._resident(n, device and i not in host_inputs)
                      for i, n in enumerate(node.inputs)]
        # the subgraphs hold the plan's constants as their own (`_bind`): not passed per run
        scope = tuple((n, self._slot(self._resident(n, False))) for n in node.implicit_inputs
                      if n not in self._fixed)
        kernel = self._bind(node, impl)
        # by resident name: a device kernel's input is an uploaded copy (another name),
        # and its CPU fallback gets a fresh host copy each run, nothing worth keeping
        kernel.constant_inputs = frozenset(i for i, n in enumerate(inputs) if n in self._fixed)
        self._steps.append(Step(
            node=node,
            kernel=kernel,
            inputs=tuple(self._slot(n) if n else _OMITTED for n in inputs),
            outputs=tuple(self._slot(n) if n else _DISCARD for n in node.outputs),
            frees=(),
            scope=scope,
        ))
        if device:
            self._on_device.update(o for o in node.outputs if o)

    def _lower(self, graph: Graph, dtypes: dict[str, np.dtype]) -> list[Lowering]:
        """The lowering phase: each node's kernel, chosen once for what the plan knows of its
        inputs (shapes, dtypes, constants); ops whose choice waits for a run say so."""
        shapes = known_shapes(graph)
        lowerings = []
        for step in self.steps:
            if isinstance(step.kernel, Transfer):
                continue
            if step.kernel.backend != "cpu":
                lowerings.append(Lowering(step.kernel.backend, f"{self.backend.name} kernel"))
                continue
            sketches = [None if not n else Sketch(shapes.get(n), dtypes.get(n),
                                                  graph.initializers.get(n))
                        for n in step.node.inputs]
            lowering = step.kernel.lower(sketches)
            step.kernel._lower_at_run = lowering.kernel == "by geometry"
            lowerings.append(lowering)
        return lowerings

    def kernels(self) -> list[Lowering]:
        """Each node's kernel, in `placement`'s order: the plan's choice, or for a node that
        chooses per input geometry, what its latest run chose."""
        return [kernel.lowered() or planned for kernel, planned in self._lowered_steps()]

    def kernel_of(self) -> dict[int, tuple[OpImpl, Lowering]]:
        """id(node) -> (its bound kernel, the plan's lowering), for tools that follow a run."""
        return {id(kernel.node): (kernel, planned) for kernel, planned in self._lowered_steps()}

    def _lowered_steps(self) -> list[tuple[OpImpl, Lowering]]:
        nodes = [step.kernel for step in self.steps if not isinstance(step.kernel, Transfer)]
        return list(zip(nodes, self.lowerings))

    def _place(self, node: Node, shape_like: set[str], dtypes: dict[str, np.dtype]
               ) -> tuple[str, str]:
        """(where, why): 'device', or a host placement 'metadata', 'shape', 'control' or
        'fallback', with the reason a node is on the host ('' on the device)."""
        if self.backend.name == "cpu":
            return "host", ""
        where = host_placement(node, shape_like)
        if where is not None:
            return where, {"metadata": "reads only shapes", "shape": "shape arithmetic",
                           "control": "control flow (subgraphs run on the host)"}[where]
        impl = lookup(node.domain, node.op_type, node.version, self.backend.name)
        if impl is None:
            return "fallback", f"no {self.backend.name} kernel"
        refusal = impl.refuses([dtypes.get(n) if n else None for n in node.inputs],
                               [dtypes.get(n) if n else None for n in node.outputs])
        if refusal:
            return "fallback", refusal
        return "device", ""

    def _bind(self, node: Node, impl: type[OpImpl]) -> OpImpl:
        attrs = {}
        for name, value in node.attrs.items():
            if isinstance(value, Graph):
                value = self._subplan(value)
            elif isinstance(value, list) and value and isinstance(value[0], Graph):
                value = [self._subplan(g) for g in value]
            attrs[name] = value
        return bind(node, impl, attrs, self.backend if impl.backend != "cpu" else None)

    def _subplan(self, graph: Graph) -> "Plan":
        """The plan of a subgraph, made once here: its node runs it with `run(inputs, scope)`
        for as many calls and iterations as it makes."""
        free = graph.free_names()
        return Plan(graph, self.backend, outer_names=free,
                    outer_constants={n: self._fixed[n] for n in free if n in self._fixed})

    @staticmethod
    def _with_frees(steps: list[Step], keep: set[int]) -> list[Step]:
        last_use: dict[int, int] = {}
        for i, step in enumerate(steps):
            for s in step.inputs + step.outputs + tuple(s for _, s in step.scope):
                last_use[s] = i
        dying: dict[int, list[int]] = {}
        for s, i in last_use.items():
            if s >= _RESERVED_SLOTS and s not in keep:
                dying.setdefault(i, []).append(s)
        for i, step in enumerate(steps):
            step.frees = tuple(dying.get(i, ()))
        return steps

    def run(self, feeds: Sequence[Any], scope: dict[str, Any] | None = None) -> list[Any]:
        """Run with `feeds` aligned to `input_names`; `scope` gives outer-scope values."""
        env = self._start(feeds, scope)
        cap = limits.current()  # the running session's max_tensor_bytes
        node = None
        # the hot loop: no generator, no step counter (a failure names the loop's `node`),
        # each step's bound kernel and slots fetched once
        try:
            for run, arguments, first, outputs, frees, scope_slots, node in self._program:
                if scope_slots:
                    result = run(*arguments(env), scope={n: env[s] for n, s in scope_slots})
                else:
                    result = run(*arguments(env))
                if type(result) is np.ndarray:
                    if result.nbytes > cap:
                        raise limits.too_big(result.nbytes, cap, f"output '{node.outputs[0]}'")
                    env[first] = result
                else:
                    _store(outputs, result, env, cap, node)
                for s in frees:
                    env[s] = None
        except Exception as exc:
            if node is None:
                raise
            located = _located(exc, node)
            if located is exc:
                raise
            raise located from exc
        return list(self._results(env))

    def iterate(self, feeds: Sequence[Any], scope: dict[str, Any] | None = None
                ) -> Iterator[tuple[Node, list[Any]]]:
        """Run step by step, yielding each node (transfers excepted) with its output values
        right after it runs; values are freed as in `run`, so memory stays at one run's peak.
        The generator's return value (StopIteration.value) is `run`'s result."""
        env = self._start(feeds, scope)
        cap = limits.current()
        for step in self.steps:
            try:
                args = [env[s] for s in step.inputs]
                if step.scope:
                    result = step.kernel.run(*args, scope={n: env[s] for n, s in step.scope})
                else:
                    result = step.kernel.run(*args)
                _store(step.outputs, result, env, cap, step.node)
            except Exception as exc:
                located = _located(exc, step.node)
                if located is exc:
                    raise
                raise located from exc
            if not isinstance(step.kernel, Transfer):
                yield step.node, [env[s] if s != _DISCARD else None for s in step.outputs]
            for s in step.frees:
                env[s] = None
        return [env[s] for s in self.output_slots]

    def _start(self, feeds: Sequence[Any], scope: dict[str, Any] | None) -> list[Any]:
        env = self.initial_env.copy()
        for s, value in zip(self.input_slots, feeds):
            env[s] = value
        if scope is not None:
            for name, s in self.outer_slots:
                env[s] = scope[name]
        return env


def _getter(slots: tuple[int, ...]):
    """A function of the slots list giving the values in `slots`, to be unpacked as a kernel's
    arguments: an itemgetter (C code, no per-call list building). For one slot it takes a
    one-item slice, since itemgetter of one index returns the item itself, not a sequence."""
    if len(slots) == 1:
        return itemgetter(slice(slots[0], slots[0] + 1))
    return itemgetter(*slots) if slots else itemgetter(slice(0, 0))


def _store(outputs: tuple[int, ...], result: Any, env: list[Any], cap: int, node: Node) -> None:
    """A kernel's result into its output slots; scalars become 0-d arrays. Tensors (host or
    device arrays: anything with `nbytes`) over `cap` bytes are refused."""
    values = result if type(result) is tuple else (result,)
    k = 0
    for s, value in zip(outputs, values):
        if type(value) is not np.ndarray or value.nbytes > cap:  # most values pass this test
            if isinstance(value, _SCALARS):
                value = np.asarray(value)
            elif getattr(value, "nbytes", 0) > cap:
                name = node.outputs[k] if k < len(node.outputs) else f"#{k}"
                raise limits.too_big(value.nbytes, cap, f"output '{name}'")
        env[s] = value
        k += 1


def _located(exc: Exception, node: Node) -> Exception:
    """`exc` as the error to raise for a failure in `node`: ember errors get the node's name
    once; anything else becomes an ExecutionError naming it."""
    if isinstance(exc, EmberError):
        if not getattr(exc, "_ember_located", False):
            exc.args = (f"{_describe(node)}: {exc}",)
            exc._ember_located = True
        return exc
    if isinstance(exc, MemoryError):  # an allocation the tensor cap let through, or numpy's
        # own "array is too big": the machine's memory is the limit that was hit
        return ResourceLimitError(f"{_describe(node)} ran out of memory ({exc or 'MemoryError'}); "
                                  f"lower the sizes it is given, or the tensor cap "
                                  f"(max_tensor_bytes) so that such a node fails up front")
    return ExecutionError(f"{_describe(node)} failed: {type(exc).__name__}: {exc}")


# numpy reductions over 0-d arrays return scalars; values in the plan are always arrays.
_SCALARS = (np.generic, int, float, complex)


def _describe(node: Node) -> str:
    label = f" '{node.name}'" if node.name else f" producing '{node.outputs[0]}'" \
        if node.outputs else ""
    domain = f"{node.domain}::" if node.domain else ""
    return f"node{label} ({domain}{node.op_type}, opset {node.version})"


def known_dtypes(graph: Graph) -> dict[str, np.dtype]:
    """The dtype of every value whose type the graph declares or whose value it holds."""
    dtypes: dict[str, np.dtype] = {}
    for info in [*graph.inputs, *graph.value_info.values(), *graph.outputs]:
        dtype = getattr(info.type, "dtype", None)
        if dtype is not None:
            dtypes[info.name] = np.dtype(dtype)
    for name, value in graph.initializers.items():
        if isinstance(value, np.ndarray):
            dtypes[name] = value.dtype
    return dtypes


def known_shapes(graph: Graph) -> dict[str, tuple]:
    """The shape of every value whose shape the graph declares or whose value it holds."""
    shapes: dict[str, tuple] = {}
    for info in [*graph.inputs, *graph.value_info.values(), *graph.outputs]:
        shape = getattr(info.type, "shape", None)
        if shape is not None:
            shapes[info.name] = tuple(shape)
    for name, value in graph.initializers.items():
        if isinstance(value, np.ndarray):
            shapes[name] = value.shape
    return shapes


def _upload_unless(default: Any, uploaded: Any, move):
    """A transfer for an initialiser-backed input: its upload made at plan time when the
    caller left the default, a fresh upload of what the caller fed otherwise."""
    def run(value):
        return uploaded if value is default else move(value)
    return run


def shape_constants(graph: Graph) -> set[str]:
    """Initialisers that are shape data (small integer tensors): they stay on the host."""
    return {name for name, value in graph.initializers.items()
            if isinstance(value, np.ndarray) and value.dtype.kind in "iub"
            and value.size <= _SHAPE_CONSTANT_MAX}


def host_placement(node: Node, shape_like: set[str]) -> str | None:
    """Where `node` runs on the host on a device backend whatever kernels the backend has:
    'metadata' (Shape, Size), 'control' (ops with subgraphs) or 'shape' (arithmetic on shape
    data); None if it belongs on the device. Adds the outputs of shape work to `shape_like`."""
    inputs = [n for n in node.inputs if n]
    if (node.domain, node.op_type) in _METADATA_OPS:
        where = "metadata"
    elif node.implicit_inputs or node.subgraphs():
        return "control"
    elif (inputs and all(n in shape_like for n in inputs)) or \
            (not inputs and node.op_type == "Constant" and _is_shape_constant(node)):
        where = "shape"
    else:
        return None
    shape_like.update(o for o in node.outputs if o)
    return where


def _is_shape_constant(node: Node) -> bool:
    value = node.attrs.get("value", node.attrs.get("value_ints", node.attrs.get("value_int")))
    if isinstance(value, (int, list)):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in "iub" \
        and value.size <= _SHAPE_CONSTANT_MAX
