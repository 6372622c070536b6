"""Control flow: If, Loop, Scan. Bodies arrive as compiled plans (`plan.run(inputs, scope)`)."""
from __future__ import annotations

import collections

import numpy as np

from ember import limits
from ember.errors import ResourceLimitError
from ember.ir import Graph, TensorType
from ember.ops.registry import OpImpl, register

_ALL = [1, 11, 13, 16, 19, 21, 23, 24, 25]

# What a sequence element costs beyond its data: the numpy array object and the list's pointer
# to it. A sequence of a billion 4-byte tensors takes ~120 GB, not 4 GB.
_ELEMENT_OVERHEAD = 120


def _truth(op: OpImpl, value, what: str = "condition") -> bool:
    if type(value) is np.ndarray and value.size == 1:  # the usual condition: asked each iteration
        return bool(value)
    arr = np.asarray(value)
    if arr.size != 1:
        raise op.fail(f"the {what} must hold exactly one element, got shape {arr.shape}")
    return bool(arr.reshape(-1)[0])


def _scalar_int(op: OpImpl, value, what: str) -> int:
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "iub":
        raise op.fail(f"the {what} must be one integer, got {arr.dtype} of shape {arr.shape}")
    return int(arr.reshape(-1)[0])


def _value_bytes(value) -> int:
    """Memory a loop-carried value holds: a tensor's bytes, or a sequence's elements with
    their per-element overhead."""
    if isinstance(value, list):
        return sum(getattr(v, "nbytes", 0) + _ELEMENT_OVERHEAD for v in value)
    return getattr(value, "nbytes", 0)


def _stack(values: list, axis: int = 0) -> np.ndarray:
    return np.stack([np.asarray(v) for v in values], axis=axis)


class _Accumulated:
    """The slices a scan output collects, one per iteration, with their bytes so far: the
    stacked output is a tensor like any other, so it may not pass the tensor cap. A Loop
    with a trip count of 1e12 fails once its scan outputs reach the cap, not when memory
    runs out."""

    def __init__(self, name: str):
        self.name = name
        self.values: list = []
        self.nbytes = 0
        self.last = 0  # bytes of the latest slice
        self.cap = limits.current()  # read once: the cap of the run that made this

    def append(self, value) -> None:
        self.values.append(value)
        self.last = getattr(value, "nbytes", 0)
        self.nbytes += self.last
        if self.nbytes > self.cap:
            limits.check_bytes(self.nbytes, f"scan output '{self.name}' after "
                                            f"{len(self.values)} iterations")

    def check_projected(self, trips: int) -> None:
        """Fail now if `trips` iterations in all would stack past the cap: every slice of a
        scan output has the same shape, so the stacked size is known after one."""
        projected = self.nbytes + self.last * (trips - len(self.values))
        if projected > self.cap:
            limits.check_bytes(projected, f"scan output '{self.name}' of {trips} iterations "
                                          f"({self.last} bytes each)")


class _Carried:
    """The size of one loop-carried value, sampled after iterations 1, 2, 4, 8, ... (a
    sequence is summed element by element: sampling at powers of two keeps that linear in
    the iterations). A sequence past the tensor cap fails like a scan output; in a loop whose
    trip count alone decides its length, a value growing steadily fails as soon as its
    growth between two samples, extended to the last iteration, passes the cap."""

    def __init__(self, name: str):
        self.name = name
        self.sample: tuple[int, int] | None = None  # (iteration, bytes) at the last sample

    def observe(self, value, iteration: int, trips: int | None) -> None:
        if iteration & (iteration - 1):  # not a power of two
            return
        nbytes = _value_bytes(value)
        kind = "sequence" if isinstance(value, list) else "value"
        what = f"loop-carried {kind} '{self.name}'"
        if isinstance(value, list):  # tensors are checked by the executor as they are made
            limits.check_bytes(nbytes, f"{what} after {iteration} iterations")
        previous, self.sample = self.sample, (iteration, nbytes)
        if trips is None or previous is None or nbytes <= previous[1]:
            return
        growth, span = nbytes - previous[1], iteration - previous[0]
        projected = nbytes + growth * (trips - iteration) // span
        if projected > limits.current():
            limits.check_bytes(projected, f"{what}, growing {growth // span} bytes per "
                                          f"iteration, after {trips} iterations")


def _empty_like_output(plan, index: int) -> np.ndarray:
    """An empty scan output for a body that never ran, typed from the body's declaration."""
    info = plan.graph.outputs[index] if index < len(plan.graph.outputs) else None
    dtype, tail = np.float32, ()
    if info is not None and isinstance(info.type, TensorType):
        if info.type.dtype is not None:
            dtype = info.type.dtype
        if info.type.shape is not None and all(isinstance(d, int) for d in info.type.shape):
            tail = tuple(info.type.shape)
    return np.empty((0,) + tail, dtype=dtype)


def _condition_is_fixed(graph: Graph) -> bool:
    """Whether a Loop body's condition output always equals its condition input: passed
    through (directly or by Identity), or a constant true. Then the condition can never end
    the loop, and the trip count alone says how many iterations run."""
    if len(graph.inputs) < 2 or not graph.outputs:
        return False
    producer = {out: node for node in graph.nodes for out in node.outputs}
    name = graph.outputs[0].name
    for _ in range(len(graph.nodes) + 1):  # bounded: a malformed body may have a cycle
        node = producer.get(name)
        if node is None:
            break
        if node.op_type == "Identity" and not node.domain and node.inputs:
            name = node.inputs[0]
        elif node.op_type == "Constant" and not node.domain:
            return _is_true(node.attrs.get("value"))
        else:
            return False
    if name == graph.inputs[1].name:
        return True
    return name in graph.initializers and _is_true(graph.initializers[name])


def _is_true(value) -> bool:
    return isinstance(value, np.ndarray) and value.size == 1 and bool(value.reshape(-1)[0])


def _appended_sequences(graph: Graph, n_carried: int) -> frozenset[int]:
    """The loop-carried values k that the body only appends to: its output 1+k is
    SequenceInsert(its input 2+k, t) at the end, and nothing else in the body (a nested
    subgraph included) reads that input or that output. SequenceInsert copies its input (the
    list may be read elsewhere), so a loop that grows a sequence that way copies n(n-1)/2
    elements over n iterations; for these values Loop keeps the list itself, hands the body
    an empty one and appends what comes back."""
    producer, reads = {}, collections.Counter()
    for node in graph.nodes:
        producer.update((out, node) for out in node.outputs)
        reads.update(name for name in list(node.inputs) + list(node.implicit_inputs) if name)
    reads.update(out.name for out in graph.outputs)
    found = []
    for k in range(min(n_carried, len(graph.inputs) - 2, len(graph.outputs) - 1)):
        seq_in, seq_out = graph.inputs[2 + k].name, graph.outputs[1 + k].name
        node = producer.get(seq_out)
        if node is None or node.op_type != "SequenceInsert" or node.domain or \
                len(node.inputs) < 2 or node.inputs[0] != seq_in or \
                (len(node.inputs) > 2 and node.inputs[2]):
            continue
        if reads[seq_in] == 1 and reads[seq_out] == 1:
            found.append(k)
    return frozenset(found)


@register("If", versions=_ALL)
class If(OpImpl):
    def setup(self):
        if self.then_branch is None or self.else_branch is None:
            raise self.fail("If needs both then_branch and else_branch")

    def run(self, cond, scope=None):
        plan = self.then_branch if _truth(self, cond) else self.else_branch
        outs = plan.run([], scope)
        if len(outs) < self.n_outputs:
            raise self.fail(f"branch produced {len(outs)} outputs, node declares {self.n_outputs}")
        return tuple(outs)


@register("Loop", versions=_ALL)
class Loop(OpImpl):
    """Loop, with bounds on what a hostile trip count can make it do.

    * A Loop whose condition can never end it (no `cond` input, or a body that passes its
      condition through or returns a constant true: see `_condition_is_fixed`) runs exactly
      its trip count M. Without M it would never end: refused when it starts. With M, after
      the first iteration the size of each scan output is known (all slices have one shape)
      and the size of a steadily growing loop-carried value can be extended to M: past the
      tensor cap (ember.limits), ResourceLimitError now rather than after hours of running.
    * One run of a Loop makes at most `limits.max_loop_iterations()` iterations
      ($EMBER_MAX_LOOP_ITERATIONS, default 2**31): a Loop of the first kind with a larger M
      fails after its first iteration; any other when it reaches the limit with its
      condition still true. The trip count INT64_MAX that exporters write for `while` loops
      is fine as long as the condition ends the loop first.
    * Scan outputs and loop-carried sequences fail once they pass the tensor cap, whatever
      the trip count.

    A loop-carried sequence the body only appends to is accumulated here, in linear time
    (`_appended_sequences`).
    """

    def setup(self):
        body = self.body
        self.n_carried = self.n_inputs - 2
        if len(body.input_names) != self.n_carried + 2:
            raise self.fail(f"body takes {len(body.input_names)} inputs, expected "
                            f"{self.n_carried + 2} (iteration, condition, loop-carried values)")
        self.n_scan = len(body.output_names) - 1 - self.n_carried
        if self.n_scan < 0:
            raise self.fail("body has too few outputs for the loop-carried values")
        graph = getattr(body, "graph", None)
        self.fixed_condition = graph is not None and _condition_is_fixed(graph)
        self.appended = _appended_sequences(graph, self.n_carried) if graph is not None \
            else frozenset()
        # a body that never reads its iteration number is not given one (an array a turn)
        self.counted = 0 not in getattr(body, "unread_inputs", ())

    def run(self, trip_count, cond, *carried, scope=None):
        body = self.body
        max_trips = None if trip_count is None else _scalar_int(self, trip_count, "trip count")
        keep_going = True if cond is None else _truth(self, cond)
        if keep_going and self.fixed_condition and max_trips is None:
            raise self.fail("the loop has no trip count and its condition never changes: it "
                            "would never end")
        # the trip count binds only when the condition cannot end the loop first
        trips = max_trips if self.fixed_condition else None
        limit = limits.max_loop_iterations()
        cond_value = np.array(keep_going)
        state = list(carried)
        kept = {k: list(state[k]) for k in self.appended if isinstance(state[k], list)}
        scans = [_Accumulated(self._output_name(1 + self.n_carried + k))
                 for k in range(self.n_scan)]
        sizes = [_Carried(self._output_name(1 + k)) for k in range(self.n_carried)]
        # the projected sizes are checked after every iteration, the rest at powers of two
        # (`_check_bounds`): a loop of neither pays for no call
        every = bool(scans) and trips is not None
        end_carried = 1 + self.n_carried
        i = 0
        while keep_going and (max_trips is None or i < max_trips):
            for k in kept:
                state[k] = []  # the body appends to an empty list; `kept` holds the rest
            number = np.array(i, dtype=np.int64) if self.counted else None
            outs = body.run([number, cond_value] + state, scope)
            cond_value = np.asarray(outs[0])
            keep_going = _truth(self, cond_value, "body's condition output")
            state = outs[1:end_carried]  # a new list: the body's own is not kept
            for k, acc in kept.items():
                acc.extend(state[k])
                state[k] = acc
            for acc, value in zip(scans, outs[end_carried:]):
                acc.append(value)
            i += 1
            if every or not i & (i - 1):
                self._check_bounds(i, trips, limit, scans, sizes, state)
            if i >= limit and keep_going and (max_trips is None or i < max_trips):
                raise ResourceLimitError(
                    f"the loop has run {i} iterations and its condition still holds: over the "
                    f"limit of {limit} iterations per Loop (raise it with "
                    f"${limits.LOOP_ENV})")
        results = state
        for k in range(self.n_scan):
            results.append(_stack(scans[k].values) if scans[k].values
                           else _empty_like_output(body, 1 + self.n_carried + k))
        return tuple(results)

    def _check_bounds(self, i: int, trips: int | None, limit: int, scans, sizes, state) -> None:
        """After iteration `i` (each one where scan outputs have a trip count to be projected
        to, else each power of two): the sizes the loop is heading for, then the iteration
        limit (the sizes first: an output that cannot fit is the more telling error)."""
        if trips is not None:
            for acc in scans:
                acc.check_projected(trips)
        if not i & (i - 1):  # the sizes are sampled at powers of two (`_Carried.observe`)
            for k, size in enumerate(sizes):
                size.observe(state[k], i, trips)
        if i == 1 and trips is not None and trips > limit:
            raise ResourceLimitError(
                f"the trip count {trips} is the loop's only bound (its condition never "
                f"changes), over the limit of {limit} iterations per Loop (raise it with "
                f"${limits.LOOP_ENV})")

    def _output_name(self, body_index: int) -> str:
        """The node output a body output becomes (the body's name if the node has none)."""
        k = body_index - 1  # the body's first output is the condition
        if 0 <= k < len(self.node.outputs) and self.node.outputs[k]:
            return self.node.outputs[k]
        return self.body.output_names[body_index]


class _ScanBase(OpImpl):
    def _run_scan(self, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs, scope):
        body = self.body
        n_states = len(states)
        lengths = {x.shape[a] for x, a in zip(scan_inputs, in_axes)}
        if len(lengths) > 1:
            raise self.fail(f"scan inputs disagree on the sequence length: {sorted(lengths)}")
        length = lengths.pop() if lengths else 0
        n_scan_out = len(body.output_names) - n_states
        collected = [_Accumulated(body.output_names[n_states + k]) for k in range(n_scan_out)]
        state = list(states)
        # each step's slices as views (kernels never write into their inputs): index tuples
        # with the step at the scan axis; the trailing Ellipsis keeps a 0-d slice an array
        leads = [(slice(None),) * a for a in in_axes]
        for t in range(length):
            slices = [x[lead + (length - 1 - t if d else t, ...)]
                      for x, lead, d in zip(scan_inputs, leads, in_dirs)]
            outs = body.run(state + slices, scope)
            state = list(outs[:n_states])
            for k in range(n_scan_out):
                collected[k].append(np.asarray(outs[n_states + k]))
        results = state
        for k in range(n_scan_out):
            vals = collected[k].values
            if out_dirs[k]:
                vals = vals[::-1]
            if vals:
                rank = np.ndim(vals[0]) + 1
                if not -rank <= out_axes[k] < rank:
                    raise self.fail(f"scan_output_axes entry {out_axes[k]} is out of range for "
                                    f"scan output '{body.output_names[n_states + k]}' of rank "
                                    f"{rank}")
                results.append(np.stack(vals, axis=out_axes[k] % rank))
            else:
                results.append(_empty_like_output(body, n_states + k))
        return results


def _check_scan_body(op: OpImpl, n_states: int, n_scan_inputs: int) -> None:
    """Load-time: the body's inputs are the states then one slice per scan input, and its
    outputs the states then the scan outputs."""
    if n_scan_inputs < 1:
        raise op.fail(f"num_scan_inputs must be at least 1, got {n_scan_inputs}")
    if n_states < 0:
        raise op.fail("num_scan_inputs exceeds the node's inputs")
    body = op.body
    if len(body.input_names) != n_states + n_scan_inputs:
        raise op.fail(f"body takes {len(body.input_names)} inputs, expected "
                      f"{n_states + n_scan_inputs} ({n_states} state values and "
                      f"{n_scan_inputs} scan inputs)")
    if len(body.output_names) < n_states:
        raise op.fail(f"body has {len(body.output_names)} outputs, fewer than the "
                      f"{n_states} state values")


def _check_rank(op: OpImpl, value, least: int, what: str) -> None:
    if not isinstance(value, np.ndarray) or value.ndim < least:
        shape = getattr(value, "shape", type(value).__name__)
        raise op.fail(f"{what} must be a tensor of rank >= {least}, got {shape}")


def _norm_list(values, n, default, name, op):
    if values is None:
        return [default] * n
    if len(values) != n:
        raise op.fail(f"{name} has {len(values)} entries, expected {n}")
    return list(values)


@register("Scan", versions=[8])
class Scan8(_ScanBase):
    """Scan-8: a leading batch axis on every state and scan value; optional sequence_lens."""

    def setup(self):
        self.n_states = self.n_inputs - 1 - self.num_scan_inputs
        _check_scan_body(self, self.n_states, self.num_scan_inputs)
        self.dirs = _norm_list(self.directions, self.num_scan_inputs, 0, "directions", self)

    def run(self, sequence_lens, *inputs, scope=None):
        states, scans = inputs[:self.n_states], inputs[self.n_states:]
        for k, v in enumerate(states):
            _check_rank(self, v, 1, f"state input {k} (batch first)")
        for k, v in enumerate(scans):
            _check_rank(self, v, 2, f"scan input {k} (batch, sequence, ...)")
        batches = {v.shape[0] for v in list(states) + list(scans)}
        if len(batches) != 1:
            raise self.fail(f"the inputs disagree on the batch size: {sorted(batches)}")
        batch = batches.pop()
        n_scan_out = len(self.body.output_names) - self.n_states
        out_states = [[] for _ in range(self.n_states)]
        out_scans = [[] for _ in range(n_scan_out)]
        max_len = scans[0].shape[1]
        lengths = self._lengths(sequence_lens, batch, max_len)
        for b in range(batch):
            length = lengths[b]
            res = self._run_scan([s[b] for s in states], [x[b, :length] for x in scans],
                                 [0] * len(scans), self.dirs, [0] * n_scan_out,
                                 [0] * n_scan_out, scope)
            for k in range(self.n_states):
                out_states[k].append(res[k])
            for k in range(n_scan_out):
                val = res[self.n_states + k]
                if val.shape[0] < max_len:  # shorter sequence: zero padding
                    pad = np.zeros((max_len - val.shape[0],) + val.shape[1:], dtype=val.dtype)
                    val = np.concatenate([val, pad], axis=0)
                out_scans[k].append(val)
        return tuple([np.stack(v) for v in out_states] + [np.stack(v) for v in out_scans])

    def _lengths(self, sequence_lens, batch: int, max_len: int) -> list[int]:
        """Each batch entry's sequence length: sequence_lens, or the whole sequence."""
        if sequence_lens is None:
            return [max_len] * batch
        lengths = [int(v) for v in np.asarray(sequence_lens).reshape(-1)]
        if len(lengths) != batch or any(not 0 <= n <= max_len for n in lengths):
            raise self.fail(f"sequence_lens {lengths} must hold {batch} lengths between 0 "
                            f"and the sequence length {max_len}")
        return lengths


@register("Scan", versions=[9, 11, 16, 19, 21, 23, 24, 25])
class Scan9(_ScanBase):
    def setup(self):
        m = self.num_scan_inputs
        self.n_states = self.n_inputs - m
        _check_scan_body(self, self.n_states, m)
        n_out = len(self.body.output_names) - self.n_states
        self.in_axes = _norm_list(self.scan_input_axes, m, 0, "scan_input_axes", self)
        self.in_dirs = _norm_list(self.scan_input_directions, m, 0, "scan_input_directions", self)
        self.out_axes = _norm_list(self.scan_output_axes, n_out, 0, "scan_output_axes", self)
        self.out_dirs = _norm_list(self.scan_output_directions, n_out, 0,
                                   "scan_output_directions", self)

    def run(self, *inputs, scope=None):
        states, scans = list(inputs[:self.n_states]), list(inputs[self.n_states:])
        axes = []
        for k, (a, x) in enumerate(zip(self.in_axes, scans)):
            _check_rank(self, x, 1, f"scan input {k}")
            if not -x.ndim <= a < x.ndim:
                raise self.fail(f"scan_input_axes entry {a} is out of range for scan input {k} "
                                f"of rank {x.ndim}")
            axes.append(a % x.ndim)
        return tuple(self._run_scan(states, scans, axes, self.in_dirs, self.out_axes,
                                    self.out_dirs, scope))
