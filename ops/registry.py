"""The op registry: which implementation runs a node, keyed by (backend, domain, op type, version).

An op is declared once, as a subclass of `OpImpl` registered for the ONNX since-versions whose
semantics it implements:

    @register("Softmax", versions=[13])
    class Softmax13(OpImpl):
        def setup(self):                      # validate / precompute from attributes, once per node
            ...
        def run(self, x):                     # the CPU kernel: numpy in, numpy out
            ...

Attributes are set on the instance under their ONNX names (`self.axis`), with the defaults the
ONNX schema declares filled in; an optional attribute with no default is `None`. A subgraph
attribute arrives compiled: an object with `.run(inputs, scope) -> list`. A node with omitted
optional inputs receives `None` for them. `run` returns one value, or a tuple with one entry per
output (extra entries beyond the node's declared outputs are dropped).

A model's node is bound to the implementation registered for the *since-version* of the schema
in force at the model's opset, so a change of semantics at a later opset can never be run with
an older kernel by accident. Kernels for other backends subclass the CPU implementation and are
registered with `backend=`; they inherit its semantics and override `run`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from ember.errors import InvalidModelError
from ember.importer.schemas import attribute_defaults, normalize_domain, schema_for
from ember.ir import Node

# The backends a kernel may be registered for (ember.runtime.backends makes them).
BACKENDS = ("cpu", "opencl", "cuda")

# (backend, domain, op_type) -> {since_version: impl class}
_TABLE: dict[tuple[str, str, str], dict[int, type["OpImpl"]]] = {}


class Lowering(NamedTuple):
    """The kernel a node runs, and why: what `ember info --nodes`, `Session.kernels` and the
    profiler show. `kernel` is a short name ("numpy", "cpu.tiles", "opencl"...)."""
    kernel: str
    why: str


class Sketch(NamedTuple):
    """What the plan knows of an input before any run: its shape (None where unknown, a dim
    None or a name where symbolic), its dtype (or None), and its value if a constant."""
    shape: tuple | None
    dtype: np.dtype | None
    value: Any = None

    @property
    def ndim(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def static(self) -> bool:
        """Whether every dim is a known integer."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


PORTABLE = Lowering("numpy", "the op's portable array kernel")


class OpImpl:
    """One op, for one group of since-versions, bound to one node at load time."""

    domain: str = ""
    op_type: str = ""
    versions: tuple[int, ...] = ()
    backend: str = "cpu"
    # Attribute names that would shadow members of this class are stored with a trailing "_"
    # (see `attribute_slot`).
    _reserved = frozenset({"run", "setup", "node", "n_inputs", "n_outputs", "domain", "op_type",
                           "versions", "backend", "version", "attrs", "dtypes", "host_inputs",
                           "run_on_cpu", "fail", "refuses", "device", "xp",
                           "shape_inputs", "defaults", "constant_inputs", "index_inputs"})
    # Attribute defaults of ops that have no ONNX schema (com.microsoft contrib ops), as the
    # op's documentation gives them; ops with a schema take its defaults.
    defaults: dict[str, Any] = {}
    # Indices of inputs that are shape data (shapes, axes, pads, repeats, k...): small host
    # arrays that a device kernel running this op's array code keeps on the host.
    shape_inputs: tuple[int, ...] = ()
    # Inputs that index into another input (a Gather's indices into its data): {index input:
    # (indexed input, axis attribute or None, default axis)}. Random feeds for a check draw
    # such indices within the size they index (ember.golden.inputs.index_bounds).
    index_inputs: dict[int, tuple[int, str | None, int]] = {}
    # Device kernels only: dtypes run natively (None: all), and indices of inputs the kernel
    # wants as host numpy arrays (shapes, axes, pads...) rather than device arrays.
    dtypes: frozenset | None = None
    host_inputs: tuple[int, ...] = ()
    # Indices of inputs that are constants of the graph (initialisers a caller cannot
    # override), set by the planner after binding: a kernel may keep work derived from such
    # an input (a transposed weight) from one run to the next.
    constant_inputs: frozenset[int] = frozenset()

    def __init__(self, node: Node, attrs: dict[str, Any], device: Any = None):
        # The backend instance a device kernel runs on (its context, queue, allocator), bound
        # at plan time; None for CPU kernels.
        self.device = device
        # The array namespace the kernel computes with: numpy, or the device's (cupy for
        # CUDA), in the array-API style: kernels call `self.xp.<function>`, never a global.
        self.xp = np if device is None else device.xp
        self.node = node
        self.version = node.version
        self.n_inputs = len(node.inputs)
        self.n_outputs = len(node.outputs)
        self.attrs = attrs
        for name, value in attrs.items():
            setattr(self, self.attribute_slot(name), value)
        self.setup()

    @classmethod
    def attribute_slot(cls, name: str) -> str:
        """The instance attribute the ONNX attribute `name` is stored under: the name itself,
        or the name with a trailing "_" where it would shadow a member of OpImpl, or is private
        or special (`_twin`, `__dict__`, `__class__`): a model names its attributes, so no name
        may reach Python's own machinery."""
        if name in cls._reserved or name.startswith("_") or not name.isidentifier():
            return name + "_"
        return name

    @classmethod
    def refuses(cls, input_dtypes: list, output_dtypes: list = ()) -> str:
        """For device kernels, at plan time: why this kernel would not run a node whose inputs
        and outputs have these dtypes (None where unknown) natively, or '' if it would. By
        default the first input's dtype must be one of `dtypes`; kernels with other rules
        override this."""
        if cls.dtypes is None or not input_dtypes or input_dtypes[0] is None:
            return ""
        return "" if input_dtypes[0] in cls.dtypes else f"dtype {input_dtypes[0]}"

    def setup(self) -> None:
        """Check attributes and precompute what `run` needs. Runs once per node."""

    def lower(self, inputs: Sequence[Sketch | None]) -> Lowering:
        """Plan time, CPU kernels: the kernel this node runs for inputs like `inputs` (None for
        an omitted input), and why. Ops with fast paths in the CPU engine (ops/cpu) override
        it with the same tests their `run` makes; where the choice needs what only a run
        shows (a shape the graph leaves open, an input's memory layout), they say so, and
        `lowered` names what the run chose."""
        return PORTABLE

    # set by the plan where `lower` could not choose ("by geometry"): the first run settles it
    _lower_at_run = False

    def settle_lowering(self, *inputs) -> None:
        """On the first run after a plan that could not choose: `lower` again, for these
        inputs' shapes and dtypes (constants as given), kept as `lowered()`. Ops whose
        `lower` may answer "by geometry" call it first thing in `run`; one attribute test
        a call after that."""
        if self._lower_at_run:
            self._lower_at_run = False
            self._chosen = self.lower([
                None if a is None or not hasattr(a, "shape") else
                Sketch(tuple(a.shape), a.dtype, a if i in self.constant_inputs else None)
                for i, a in enumerate(inputs)])

    def lowered(self) -> Lowering | None:
        """The kernel the latest run of this node chose, for ops that choose per input
        geometry at run time: they keep it in `_chosen` (None: `lower`'s answer stands)."""
        return self.__dict__.get("_chosen")

    def run(self, *inputs):  # pragma: no cover - every op overrides it
        raise NotImplementedError(self.op_type)

    def run_on_cpu(self, *inputs):
        """For device kernels: run this op's CPU kernel on host copies of `inputs` and move
        the result back; for dtypes or cases the device kernel does not handle natively."""
        backend = self.device
        backend.fallbacks += 1
        label = self.node.name or (self.node.outputs[0] if self.node.outputs else "")
        backend.fallback_nodes[label] = backend.fallback_nodes.get(label, 0) + 1
        result = self._host_twin().run(*[backend.to_host(x) for x in inputs])
        if isinstance(result, tuple):
            return tuple(backend.to_device(r) for r in result)
        return backend.to_device(result)

    def _host_twin(self) -> "OpImpl":
        """This node's CPU kernel with this kernel's attributes and set-up state, on numpy."""
        twin = self.__dict__.get("_twin")
        if twin is None:
            cpu = lookup(self.domain, self.op_type, self.version, "cpu")
            twin = object.__new__(cpu)
            twin.__dict__.update(self.__dict__)
            twin.device, twin.xp = None, np
            self._twin = twin
        return twin

    def fail(self, message: str) -> InvalidModelError:
        """An error about this node's attributes or inputs, naming the node."""
        label = self.node.name or (self.node.outputs[0] if self.node.outputs else "?")
        return InvalidModelError(f"{self.op_type} node '{label}': {message}")


def register(op_type: str, versions: Iterable[int], domain: str = "",
             backend: str = "cpu") -> Callable[[type[OpImpl]], type[OpImpl]]:
    """Class decorator: `cls` implements `op_type` for each listed since-version."""
    domain = normalize_domain(domain)
    versions = tuple(versions)

    def wrap(cls: type[OpImpl]) -> type[OpImpl]:
        cls.op_type, cls.domain, cls.versions, cls.backend = op_type, domain, versions, backend
        slot = _TABLE.setdefault((backend, domain, op_type), {})
        for v in versions:
            if v in slot and slot[v] is not cls:
                raise RuntimeError(f"{domain}::{op_type}-{v} registered twice for {backend}")
            slot[v] = cls
        return cls

    return wrap


def since_version(domain: str, op_type: str, opset: int) -> int:
    """The since-version whose semantics apply at `opset` (the opset itself for custom ops)."""
    schema = schema_for(domain, op_type, opset)
    if schema is not None:
        return schema.since_version
    versions = [v for v in versions_registered(domain, op_type) if v <= opset]
    return max(versions) if versions else opset


def versions_registered(domain: str, op_type: str, backend: str = "cpu") -> list[int]:
    return sorted(_TABLE.get((backend, normalize_domain(domain), op_type), {}))


def lookup(domain: str, op_type: str, opset: int, backend: str = "cpu") -> type[OpImpl] | None:
    """The implementation for a node of `op_type` in `domain` under `opset`, or None."""
    domain = normalize_domain(domain)
    _ensure_loaded(backend)
    slot = _TABLE.get((backend, domain, op_type))
    if not slot:
        return None
    return slot.get(since_version(domain, op_type, opset))


def supported_ops(backend: str = "cpu") -> dict[tuple[str, str], list[int]]:
    """(domain, op_type) -> since-versions implemented, for `ember info` and the ops table (docs/ops.md)."""
    _ensure_loaded(backend)
    return {(d, op): sorted(vs) for (b, d, op), vs in sorted(_TABLE.items()) if b == backend}


def bind(node: Node, impl: type[OpImpl], attrs: dict[str, Any], device: Any = None) -> OpImpl:
    """Instantiate `impl` for `node`, filling schema defaults and checking required attributes.

    `attrs` is node.attrs with subgraphs already compiled by the caller; `device` is the
    backend instance a device kernel runs on (None for CPU kernels).
    """
    if impl.backend != "cpu" and (device is None or device.name != impl.backend):
        raise TypeError(f"{impl.__name__} is a {impl.backend} kernel: bind it to that backend")
    defaults, required = attribute_defaults(node.domain, node.op_type, node.version)
    missing = sorted(required - set(attrs))
    if missing:
        raise InvalidModelError(
            f"{node.op_type} node '{node.name or node.outputs[0]}' lacks required attribute(s) "
            f"{', '.join(missing)}")
    return impl(node, {**impl.defaults, **defaults, **attrs},
                device if impl.backend != "cpu" else None)


_loaded: set[str] = set()
# The modules holding each backend's kernels; only those of a backend asked about are imported,
# so a CPU session imports no device code.
_KERNEL_PACKAGES = {"cpu": "ember.ops", "opencl": "ember.ops.opencl", "cuda": "ember.ops.cuda"}


def _ensure_loaded(backend: str = "cpu") -> None:
    """Import the op family modules of `backend` (and the CPU ones they derive from) once, so
    their @register calls have run. Device kernel modules import no device library at import
    time, so this works on any machine."""
    for name in dict.fromkeys(("cpu", backend)):
        if name not in _loaded and name in _KERNEL_PACKAGES:
            _loaded.add(name)
            importlib.import_module(_KERNEL_PACKAGES[name])
