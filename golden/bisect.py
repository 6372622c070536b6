"""Bisect: the first node that diverges while its inputs agree, and the node that adds the
most error of its own (each node run alone on the reference's values of its inputs)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ember.errors import EmberError
from ember.golden.compare import (_dtype_str, _is_exact, _is_numeric, _special_mismatch,
                                  CheckError, compare_values, Comparison, DEFAULT_CHUNK,
                                  Tolerances, value_stats, ValueStats)
from ember.golden.references import EmberReference, ProtoReference, Reference
from ember.ir import Model
from ember.ops.fused import DOMAIN as FUSED_DOMAIN
from ember.runtime.session import Session

# -- bisect ------------------------------------------------------------------------------------

@dataclass
class InputAgreement:
    """One input of the diverging node: whether both sides agreed on it, and its statistics."""
    name: str
    status: str  # "agrees", "not compared" (graph input, weight, or unavailable in the reference)
    candidate: ValueStats | None = None
    reference: ValueStats | None = None


@dataclass
class AddedError:
    """The node whose own error is largest: run alone on the reference's values of its inputs,
    its output is furthest from the reference's. Errors are in ulps: units in the last place of
    the value's dtype at the reference's largest magnitude (integers and bools: steps of 1)."""
    node_name: str
    op_type: str
    domain: str
    opset: int
    position: int  # 1-based, in topological order
    output: str  # the node's output where its own error is largest
    dtype: str
    isolated_ulps: float  # on the reference's inputs
    isolated_max_abs_error: float
    output_ulps: float | None  # in the candidate's own run (inputs carrying upstream error)
    input_ulps: float | None  # the worst of its inputs in the candidate's run, each in its units
    next_ulps: float  # the largest own error of any other node
    next_node: str
    nodes_isolated: int
    simplifier: str = ""  # "" as in the original model, else how the simplifier made the node


@dataclass
class BisectResult:
    """The first node whose output diverges while its inputs agree, or found=False."""
    found: bool
    nodes_compared: int
    node_name: str = ""
    op_type: str = ""
    domain: str = ""
    opset: int = 0
    position: int = 0  # 1-based, in topological order
    inputs: list[InputAgreement] = field(default_factory=list)
    outputs: list[Comparison] = field(default_factory=list)
    output_stats: list[dict[str, ValueStats]] = field(default_factory=list)
    values_not_compared: int = 0
    note: str = ""
    # the node that adds the most error of its own (see AddedError); None when none was isolated
    added_error: AddedError | None = None


class _Stream:
    """Yields, node by node, the reference's values for the candidate's node outputs."""

    def take(self, node) -> list[Any] | None:
        raise NotImplementedError


class _LockstepStream(_Stream):
    """Another ember plan of the same graph, advanced one node per candidate node."""

    def __init__(self, session: Session, feeds: Mapping[str, Any]):
        self.backend = session.backend_instance
        self.steps = session.iterate(feeds)

    def take(self, node) -> list[Any] | None:
        ref_node, values = next(self.steps)
        if list(ref_node.outputs) != list(node.outputs):  # plans order a graph identically
            raise CheckError(f"reference plan diverged from the candidate's at node "
                             f"'{node.name or node.outputs[0]}'")
        return [self.backend.to_host(v) for v in values]


class _ChunkedStream(_Stream):
    """onnxruntime/onnx values, fetched as graph outputs `chunk` at a time in candidate order."""

    def __init__(self, reference: ProtoReference, feeds: Mapping[str, Any],
                 order: Sequence[str], chunk: int):
        exposable = reference.produced_names()
        self.reference, self.feeds, self.chunk = reference, feeds, max(1, chunk)
        self.order = [n for n in order if n in exposable]
        self.position = {n: i for i, n in enumerate(self.order)}
        self.buffer: dict[str, Any] = {}

    def take(self, node) -> list[Any] | None:
        return [self._value(n) for n in node.outputs]

    def _value(self, name: str) -> Any:
        if name not in self.position:
            return _UNAVAILABLE
        if name not in self.buffer:
            start = self.position[name]
            self.buffer = self.reference.values(self.feeds,
                                                self.order[start:start + self.chunk])
        return self.buffer.pop(name)  # compared once, then dropped


_UNAVAILABLE = object()


def find_divergence(candidate: Session, reference: Reference | Session, feeds: Mapping[str, Any],
                    tolerances: Tolerances, chunk: int = DEFAULT_CHUNK,
                    original: Model | None = None) -> BisectResult:
    """Run the candidate step by step and compare each node's outputs with the reference's as
    they are produced; describe the first node that diverges while its inputs agree.

    The run goes on to the end: each node is also run alone on the reference's values of its
    inputs, and the node whose own error is largest is reported as `added_error`. Where every
    node differs a little (float16, where each side rounds differently), the first divergence
    is mere rounding; the node that adds the most error is the cause. `original` (the model
    as imported, before simplification) tells the simplifier's nodes from the model's own."""
    plan = candidate.plan
    steps = candidate.iterate(feeds)
    stream = _reference_stream(reference, feeds, plan, chunk)
    to_host = candidate.backend_instance.to_host
    graph = candidate.model.graph
    isolation = _Isolation(candidate, feeds)
    stats: dict[str, tuple[ValueStats, ValueStats | None]] = {}  # small: no arrays are kept
    ulps: dict[str, float] = {}  # each compared value's error in the candidate's run
    not_compared = position = 0
    first = None
    for position, (node, values) in enumerate(steps, start=1):
        expected = stream.take(node)
        isolation.measure(node, position, expected, stats)
        comparisons, out_stats = [], []
        for name, value, ref_value in zip(node.outputs, values, expected):
            if not name:
                continue
            value = to_host(value)
            if ref_value is _UNAVAILABLE:
                not_compared += 1
                continue
            comparisons.append(compare_values(name, value, ref_value,
                                              tolerances.for_value(name), tolerances.mode))
            stats[name] = (value_stats(value), value_stats(ref_value))
            out_stats.append({"candidate": stats[name][0], "reference": stats[name][1]})
            measured = error_in_ulps(value, ref_value)
            if measured is not None:
                ulps[name] = measured[1]
            isolation.keep(name, ref_value)  # only while a later node reads it
            del value, ref_value
        isolation.release(node)
        if first is None and any(not c.passed for c in comparisons):
            first = _finding(node, position, comparisons, out_stats, stats, graph, feeds,
                             not_compared)
    result = first or BisectResult(False, position, values_not_compared=not_compared)
    result.added_error = isolation.finding(ulps, _original_producers(original))
    return result


# -- bisect: each node on the reference's inputs ------------------------------------------------

class _Isolation:
    """Runs each candidate node's bound kernel alone on the reference's values of its inputs
    (Polygraphy's per-node isolation), and keeps the two nodes with the largest own error.

    The reference's values are kept from the node that produces them to the last node that
    reads them, so bisect holds about one run's values of the reference beside the
    candidate's. Nodes with subgraphs, and nodes with an input the reference does not expose
    (a value the simplifier made) or whose reference value differs in dtype or shape, are not
    isolated."""

    def __init__(self, session: Session, feeds: Mapping[str, Any]):
        plan = session.plan
        self.backend, self.feeds, self.constants = session.backend_instance, feeds, plan.initial_env
        self.steps = {id(s.node): s for s in plan.steps if not _is_transfer(s)}
        self.on_device = {id(node) for node, where in plan.placement if where == "device"}
        self.last_reader = {name: id(s.node) for s in plan.steps if not _is_transfer(s)
                            for name in s.node.inputs if name}
        self.values: dict[str, Any] = {}  # the reference's values still to be read
        self.ranked: list[_OwnError] = []  # the two nodes with the largest own error
        self.isolated = 0

    def keep(self, name: str, ref_value: Any) -> None:
        if name in self.last_reader and isinstance(ref_value, np.ndarray):
            self.values[name] = ref_value

    def release(self, node) -> None:
        for name in node.inputs:
            if name and self.last_reader.get(name) == id(node):
                self.values.pop(name, None)

    def measure(self, node, position: int, expected: list[Any], stats: dict) -> None:
        """Run `node` alone on the reference's inputs; rank it by its worst output's error."""
        step = self.steps.get(id(node))
        args = self._inputs(step, stats) if step is not None and not step.scope else None
        if args is None:
            return
        try:
            result = step.kernel.run(*args)
        except EmberError:  # the kernel refuses the reference's values: nothing to learn
            return
        self.isolated += 1
        got = result if type(result) is tuple else (result,)
        worst = None
        for name, value, ref_value in zip(node.outputs, got, expected):
            if not name or ref_value is _UNAVAILABLE or value is None:
                continue
            measured = error_in_ulps(np.asarray(self.backend.to_host(value)), ref_value)
            if measured is not None and (worst is None or measured[1] > worst.ulps):
                worst = _OwnError(measured[1], measured[0], position, node, name,
                                  _dtype_str(ref_value))
        if worst is not None:  # the larger error first; on a tie the earlier node
            self.ranked = sorted(self.ranked + [worst],
                                 key=lambda e: (-e.ulps, e.position))[:2]

    def _inputs(self, step, stats: dict) -> list[Any] | None:
        """The kernel's arguments: weights as the plan holds them (uploaded, prepared), feeds
        and the reference's values as copies (a kernel may write into an input it is given),
        on the device where the kernel reads them there; None if one is missing."""
        device_side = id(step.node) in self.on_device
        host_inputs = set(getattr(step.kernel, "host_inputs", ()))
        args = []
        for i, (name, slot) in enumerate(zip(step.node.inputs, step.inputs)):
            if not name:
                args.append(None)
                continue
            if name not in self.feeds and self.constants[slot] is not None:
                args.append(self.constants[slot])
                continue
            value = self.feeds.get(name, self.values.get(name))
            candidate, ref = stats.get(name, (None, None))
            if value is None or (candidate is not None and
                                 (candidate.dtype, candidate.shape) != (ref.dtype, ref.shape)):
                return None
            value = np.array(value)
            args.append(self.backend.to_device(value)
                        if device_side and i not in host_inputs else value)
        return args

    def finding(self, ulps: dict[str, float], original: dict[str, tuple[str, str]] | None
                ) -> AddedError | None:
        if not self.ranked:
            return None
        top, node = self.ranked[0], self.ranked[0].node
        runner_up = self.ranked[1] if len(self.ranked) > 1 else None
        inputs = [ulps[n] for n in node.inputs if n in ulps]
        return AddedError(node.name, node.op_type, node.domain, node.version, top.position,
                          top.output, top.dtype, top.ulps, top.abs_error, ulps.get(top.output),
                          max(inputs) if inputs else None,
                          runner_up.ulps if runner_up else 0.0,
                          _node_label(runner_up.node) if runner_up else "",
                          self.isolated, _simplifier_origin(node, original))


class _OwnError(NamedTuple):
    """One node's error on the reference's inputs, at its worst output."""
    ulps: float
    abs_error: float
    position: int
    node: Any
    output: str
    dtype: str


def error_in_ulps(value: Any, reference: Any) -> tuple[float, float] | None:
    """(max |value - reference|, the same in ulps: units in the last place of the reference's
    dtype at the reference's largest magnitude; integers and bools in steps of 1). inf where
    NaN or Inf sit at different places; None unless both are numeric arrays of one shape."""
    if not (isinstance(value, np.ndarray) and isinstance(reference, np.ndarray)) or \
            value.shape != reference.shape or not (_is_numeric(value) and _is_numeric(reference)) \
            or value.dtype.kind == "c" or reference.dtype.kind == "c":
        return None
    if not value.size:
        return 0.0, 0.0
    v, r = value.astype(np.float64), reference.astype(np.float64)
    finite = np.isfinite(v) & np.isfinite(r)
    if not finite.all():
        if _special_mismatch(v, r).any():
            return math.inf, math.inf
        v, r = v[finite], r[finite]
    if not r.size:
        return 0.0, 0.0
    error = float(np.max(np.abs(v - r)))
    if _is_exact(reference):
        return error, error
    scale = float(np.max(np.abs(r))) or float(np.max(np.abs(v)))  # all-zero reference: v's
    return error, error / _ulp(reference.dtype, scale)


def _ulp(dtype: np.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (its smallest normal's below that)."""
    info = _float_info(dtype)
    if info is None:
        return 1.0
    magnitude = max(magnitude, float(info.smallest_normal))
    return 2.0 ** (math.floor(math.log2(magnitude)) - int(info.nmant))


def _float_info(dtype: np.dtype) -> Any:
    """numpy's finfo, or ml_dtypes' for bfloat16 and the float8 kinds; None for others."""
    if dtype.kind == "f":
        return np.finfo(dtype)
    try:
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    except (ImportError, TypeError, ValueError):
        return None


def _node_label(node) -> str:
    return node.name or node.outputs[0]


# The simplifier's passes that create each op (passes are named as `skip=` takes them).
_MADE_BY = {("", "LayerNormalization"): "fuse_layernorm", ("", "Gelu"): "fuse_gelu",
            ("", "Attention"): "fuse_attention", ("", "Gemm"): "fuse_matmul_add",
            (FUSED_DOMAIN, "FusedMatMul"): "fuse_matmul_add",
            (FUSED_DOMAIN, "FusedGemm"): "fuse_activations",
            (FUSED_DOMAIN, "FusedConv"): "fuse_activations",
            ("", "Split"): "fuse_attention_projections", ("", "Gather"): "slice_squeeze_to_gather",
            ("", "Cast"): "widen_output_cast", ("", "QLinearConv"): "fuse_qdq",
            ("", "QLinearMatMul"): "fuse_qdq", ("com.microsoft", "QGemm"): "fuse_qdq",
            ("com.microsoft", "QLinearAdd"): "fuse_qdq",
            ("com.microsoft", "QLinearMul"): "fuse_qdq",
            ("com.microsoft", "QLinearGlobalAveragePool"): "fuse_qdq"}


def _original_producers(original: Model | None) -> dict[str, tuple[str, str]] | None:
    """{value: (domain, op type) of the node producing it} in the graph before simplification
    (None when it is not known)."""
    if original is None:
        return None
    return {o: (n.domain, n.op_type) for n in original.graph.nodes for o in n.outputs if o}


def _simplifier_origin(node, original: dict[str, tuple[str, str]] | None) -> str:
    """How the simplifier made `node`: '' where the original graph has it (same op making the
    same value) or the original is unknown; else which pass creates such nodes, and what
    the original graph has in its place."""
    if original is None:
        return ""
    name = next((o for o in node.outputs if o), "")
    before = original.get(name)
    if before == (node.domain, node.op_type):
        return ""
    made = _MADE_BY.get((node.domain, node.op_type))
    text = f"made by the simplifier (pass {made})" if made else "made by the simplifier"
    if before is None:
        return f"{text}, computing a value the original graph does not have"
    domain = f"{before[0]}::" if before[0] else ""
    return f"{text}, in place of the original graph's {domain}{before[1]} node"


def _reference_stream(reference: Reference | Session, feeds: Mapping[str, Any], plan,
                      chunk: int) -> _Stream:
    if isinstance(reference, EmberReference):
        reference = reference.session
    if isinstance(reference, Session):
        return _LockstepStream(reference, feeds)
    if isinstance(reference, ProtoReference):
        order = [o for step in plan.steps if not _is_transfer(step) for o in step.node.outputs
                 if o]
        return _ChunkedStream(reference, feeds, order, chunk)
    raise CheckError(_NEEDS_RUNTIME)


_NEEDS_RUNTIME = ("--bisect needs a reference that can run the model (onnxruntime, onnx or an "
                  "ember backend); recorded data holds only the final outputs")


def _is_transfer(step) -> bool:
    from ember.runtime.executor import Transfer

    return isinstance(step.kernel, Transfer)


def _finding(node, position: int, comparisons: list[Comparison], out_stats: list,
             stats: dict, graph, feeds: Mapping[str, Any], not_compared: int) -> BisectResult:
    inputs = []
    for name in node.inputs:
        if not name:
            continue
        if name in stats:
            inputs.append(InputAgreement(name, "agrees", *stats[name]))
        elif name in feeds or name in graph.initializers:
            value = feeds[name] if name in feeds else graph.initializers[name]
            kind = "graph input" if name in feeds else "initializer"
            inputs.append(InputAgreement(name, f"agrees ({kind}, same on both sides)",
                                         value_stats(value), None))
        else:
            inputs.append(InputAgreement(name, "not compared (the reference does not expose it)"))
    unchecked = [i.name for i in inputs if i.status.startswith("not compared")]
    note = f"input(s) {', '.join(unchecked)} could not be compared" if unchecked else ""
    return BisectResult(True, position, node.name, node.op_type, node.domain, node.version,
                        position, inputs, comparisons, out_stats, not_compared, note)
