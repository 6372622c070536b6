"""Control flow: If, Loop, Scan. Bodies arrive as compiled plans (`plan.run(inputs, scope)`)."""
from __future__ import annotations

import numpy as np

from ember.ir import TensorType
from ember.ops.registry import OpImpl, register

_ALL = [1, 11, 13, 16, 19, 21, 23, 24, 25]


def _truth(value) -> bool:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"condition must hold exactly one element, got shape {arr.shape}")
    return bool(arr.reshape(-1)[0])


def _stack(values: list, axis: int = 0) -> np.ndarray:
    return np.stack([np.asarray(v) for v in values], axis=axis)


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


@register("If", versions=_ALL)
class If(OpImpl):
    def setup(self):
        if self.then_branch is None or self.else_branch is None:
            raise self.fail("If needs both then_branch and else_branch")

    def run(self, cond, scope=None):
        plan = self.then_branch if _truth(cond) else self.else_branch
        outs = plan.run([], scope)
        if len(outs) < self.n_outputs:
            raise self.fail(f"branch produced {len(outs)} outputs, node declares {self.n_outputs}")
        return tuple(outs)


@register("Loop", versions=_ALL)
class Loop(OpImpl):
    def setup(self):
        body = self.body
        self.n_carried = self.n_inputs - 2
        if len(body.input_names) != self.n_carried + 2:
            raise self.fail(f"body takes {len(body.input_names)} inputs, expected "
                            f"{self.n_carried + 2} (iteration, condition, loop-carried values)")
        self.n_scan = len(body.output_names) - 1 - self.n_carried
        if self.n_scan < 0:
            raise self.fail("body has too few outputs for the loop-carried values")

    def run(self, trip_count, cond, *carried, scope=None):
        body = self.body
        max_trips = None if trip_count is None else int(np.asarray(trip_count).reshape(-1)[0])
        keep_going = True if cond is None else _truth(cond)
        cond_value = np.array(keep_going)
        state = list(carried)
        scans: list[list] = [[] for _ in range(self.n_scan)]
        i = 0
        while keep_going and (max_trips is None or i < max_trips):
            outs = body.run([np.array(i, dtype=np.int64), cond_value] + state, scope)
            cond_value = np.asarray(outs[0])
            keep_going = _truth(cond_value)
            state = list(outs[1:1 + self.n_carried])
            for k in range(self.n_scan):
                scans[k].append(outs[1 + self.n_carried + k])
            i += 1
        results = state
        for k in range(self.n_scan):
            results.append(_stack(scans[k]) if scans[k]
                           else _empty_like_output(body, 1 + self.n_carried + k))
        return tuple(results)


class _ScanBase(OpImpl):
    def _run_scan(self, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs, scope):
        body = self.body
        n_states = len(states)
        lengths = {x.shape[a] for x, a in zip(scan_inputs, in_axes)}
        if len(lengths) > 1:
            raise self.fail(f"scan inputs disagree on the sequence length: {sorted(lengths)}")
        length = lengths.pop() if lengths else 0
        n_scan_out = len(body.output_names) - n_states
        collected: list[list] = [[] for _ in range(n_scan_out)]
        state = list(states)
        for t in range(length):
            slices = []
            for x, a, d in zip(scan_inputs, in_axes, in_dirs):
                idx = length - 1 - t if d else t
                slices.append(np.take(x, idx, axis=a))
            outs = body.run(state + slices, scope)
            state = list(outs[:n_states])
            for k in range(n_scan_out):
                collected[k].append(np.asarray(outs[n_states + k]))
        results = state
        for k in range(n_scan_out):
            vals = collected[k]
            if out_dirs[k]:
                vals = vals[::-1]
            if vals:
                results.append(np.stack(vals, axis=out_axes[k] % (vals[0].ndim + 1)))
            else:
                results.append(_empty_like_output(body, n_states + k))
        return results


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
        if self.n_states < 0:
            raise self.fail("num_scan_inputs exceeds the node's inputs")
        self.dirs = _norm_list(self.directions, self.num_scan_inputs, 0, "directions", self)

    def run(self, sequence_lens, *inputs, scope=None):
        states, scans = inputs[:self.n_states], inputs[self.n_states:]
        batch = (states[0] if states else scans[0]).shape[0]
        n_scan_out = len(self.body.output_names) - self.n_states
        out_states = [[] for _ in range(self.n_states)]
        out_scans = [[] for _ in range(n_scan_out)]
        max_len = scans[0].shape[1] if scans else 0
        for b in range(batch):
            length = max_len if sequence_lens is None else int(np.asarray(sequence_lens)[b])
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


@register("Scan", versions=[9, 11, 16, 19, 21, 23, 24, 25])
class Scan9(_ScanBase):
    def setup(self):
        m = self.num_scan_inputs
        self.n_states = self.n_inputs - m
        if self.n_states < 0:
            raise self.fail("num_scan_inputs exceeds the node's inputs")
        n_out = len(self.body.output_names) - self.n_states
        self.in_axes = _norm_list(self.scan_input_axes, m, 0, "scan_input_axes", self)
        self.in_dirs = _norm_list(self.scan_input_directions, m, 0, "scan_input_directions", self)
        self.out_axes = _norm_list(self.scan_output_axes, n_out, 0, "scan_output_axes", self)
        self.out_dirs = _norm_list(self.scan_output_directions, n_out, 0,
                                   "scan_output_directions", self)

    def run(self, *inputs, scope=None):
        states, scans = list(inputs[:self.n_states]), list(inputs[self.n_states:])
        axes = [a % x.ndim for a, x in zip(self.in_axes, scans)]
        return tuple(self._run_scan(states, scans, axes, self.in_dirs, self.out_axes,
                                    self.out_dirs, scope))
