"""Per-node profiling: a Chrome-trace JSON in the format onnxruntime's profiler writes.

    sess = ember.load("model.onnx", profile=True)   # or SessionOptions.enable_profiling
    sess.run(feeds)
    path = sess.end_profiling()                     # opens in Perfetto / chrome://tracing

A profiled run goes through `Plan.iterate` instead of the plan's hot loop, one step at a time:
the time between two steps is the node's time (the backend synchronised after each node, so a
device kernel is timed to completion, not to its launch). Each node gives one complete event
("ph": "X", microseconds since profiling started) named `<node>_kernel_time` with onnxruntime's
fields: `op_name`, `provider`, `input_type_shape`, `output_type_shape`, `node_index`,
`output_size`; and ember's `placement` (where the node ran: device, host, or why it stayed on
the host). Loading, and each `run` as a whole, are "Session" events, as in onnxruntime.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime
from typing import Any, Callable, Sequence

import numpy as np

# ember backend -> the execution provider name a profile gives for its device nodes
_PROVIDERS = {"cpu": "CPUExecutionProvider", "opencl": "OpenCLExecutionProvider",
              "cuda": "CUDAExecutionProvider"}


class Profiler:
    """Collects events for one session until `end` writes them."""

    def __init__(self, prefix: str = "ember_profile_", backend: str = "cpu"):
        self.prefix = prefix or "ember_profile_"
        self.backend = backend
        self.start_ns = time.perf_counter_ns()
        self.start_wall_ns = time.time_ns()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # runs from several threads append events

    def _us(self, t_ns: int) -> int:
        return (t_ns - self.start_ns) // 1000

    def session_event(self, name: str, t0_ns: int, t1_ns: int) -> None:
        self._add({"cat": "Session", "name": name, "ts": self._us(t0_ns),
                   "dur": (t1_ns - t0_ns) // 1000, "args": {}})

    def _add(self, event: dict[str, Any]) -> None:
        event.update(ph="X", pid=os.getpid(), tid=threading.get_ident())
        with self._lock:
            self.events.append(event)

    def run(self, plan: Any, feeds: Sequence[Any], synchronize: Callable[[], None]
            ) -> list[Any]:
        """Run `plan` on `feeds` (aligned to its input names) step by step, recording one
        event per node; returns the plan's outputs, as `plan.run` does."""
        placement = {id(node): where for node, where in plan.placement}
        kernels = plan.kernel_of()
        shapes = _known_shapes(plan, feeds)
        t_run = time.perf_counter_ns()
        steps = plan.iterate(feeds)
        index = 0
        while True:
            t0 = time.perf_counter_ns()
            try:
                node, values = next(steps)
            except StopIteration as done:
                outputs = done.value
                break
            synchronize()
            t1 = time.perf_counter_ns()
            out_shapes = [_type_shape(v) for v in values]
            for name, entry in zip(node.outputs, out_shapes):
                if name:
                    shapes[name] = entry
            where = placement.get(id(node), "host")
            kernel, planned = kernels[id(node)]
            device = where in ("device", "host")
            self._add({
                "cat": "Node", "name": f"{node.name or node.outputs[0]}_kernel_time",
                "ts": self._us(t0), "dur": (t1 - t0) // 1000,
                "args": {
                    "op_name": node.op_type if not node.domain
                    else f"{node.domain}::{node.op_type}",
                    "provider": _PROVIDERS.get(self.backend if device else "cpu",
                                               "CPUExecutionProvider"),
                    "placement": where,
                    "kernel": (kernel.lowered() or planned).kernel,
                    "node_index": str(index),
                    "input_type_shape": [shapes.get(n, {}) for n in node.inputs if n],
                    "output_type_shape": [e for e in out_shapes if e],
                    "output_size": str(sum(_nbytes(v) for v in values)),
                }})
            index += 1
        self.session_event("model_run", t_run, time.perf_counter_ns())
        return outputs

    def end(self) -> str:
        """Write the events to `<prefix><date>.json` and return its path; profiling stops."""
        stamp = datetime.fromtimestamp(self.start_wall_ns / 1e9).strftime("%Y-%m-%d_%H-%M-%S")
        path = f"{self.prefix}{stamp}_{os.getpid()}_{id(self) % 100000}.json"
        with self._lock:
            events = sorted(self.events, key=lambda e: e["ts"])
        with open(path, "w") as f:
            json.dump(events, f, indent=0)
        return path


def _known_shapes(plan: Any, feeds: Sequence[Any]) -> dict[str, dict[str, list[int]]]:
    """Type and shape of each value known before the first step: feeds and initialisers."""
    shapes = {}
    for name, value in zip(plan.input_names, feeds):
        shapes[name] = _type_shape(value)
    for name, value in plan.graph.initializers.items():
        shapes.setdefault(name, _type_shape(value))
    return shapes


def _type_shape(value: Any) -> dict[str, list[int]]:
    """onnxruntime's {"float": [2, 3]} for a tensor; {} for what has no shape (sequences...)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return {}
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return {_ORT_TYPE_NAMES.get(name, name): [int(d) for d in shape]}


_ORT_TYPE_NAMES = {"float32": "float", "float64": "double", "object": "string"}


def _nbytes(value: Any) -> int:
    return int(getattr(value, "nbytes", 0) or 0)


def summary(events: Sequence[dict[str, Any]], runs: int, top: int = 10) -> str:
    """The node events of `runs` runs as two tables: time per op type (nodes, total ms a run,
    share, mean µs a node) and the `top` slowest nodes (mean ms a run)."""
    per_node: dict[str, list[Any]] = {}
    for ev in events:
        if ev.get("cat") != "Node":
            continue
        name = ev["name"].removesuffix("_kernel_time")
        entry = per_node.setdefault(name, [ev["args"]["op_name"], 0, ev["args"]["placement"],
                                           ev["args"]["input_type_shape"],
                                           ev["args"].get("kernel", "")])
        entry[1] += ev["dur"]
    runs = max(1, runs)
    total = sum(e[1] for e in per_node.values()) / runs or 1
    by_op: dict[str, list[float]] = {}
    for op, dur, *_ in per_node.values():
        row = by_op.setdefault(op, [0, 0.0])
        row[0] += 1
        row[1] += dur / runs
    lines = [f"{'op type':<28} {'nodes':>5} {'total ms':>9} {'share':>6} {'mean µs':>9}"]
    for op, (count, us) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{op:<28} {count:>5} {us / 1000:>9.3f} {100 * us / total:>5.1f}% "
                     f"{us / count:>9.1f}")
    lines.append(f"{'total':<28} {len(per_node):>5} {total / 1000:>9.3f} {100.0:>5.1f}%")
    lines += ["", f"{min(top, len(per_node))} slowest nodes",
              f"{'node':<32} {'op type':<24} {'ms':>8} {'where':<9} {'kernel':<20} input shapes"]
    slowest = sorted(per_node.items(), key=lambda kv: -kv[1][1])[:top]
    for name, (op, dur, where, shapes, kernel) in slowest:
        shown = " ".join("x".join(map(str, s)) for entry in shapes for s in entry.values())
        lines.append(f"{name[:32]:<32} {op[:24]:<24} {dur / runs / 1000:>8.3f} {where:<9} "
                     f"{kernel[:20]:<20} {shown}")
    return "\n".join(lines)
