"""What `ember check` found (`CheckReport`, per backend and output), as JSON and as text: one
block per output, the bisect findings, a summary line."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from ember.golden.bisect import AddedError, BisectResult
from ember.golden.compare import Comparison, ValueStats


@dataclass
class BackendReport:
    backend: str
    outputs: list[Comparison]
    bisect: BisectResult | None = None
    # with iterations: {"median_ms", "p90_ms", "min_ms", "iterations", "warm_up"}
    timing: dict[str, float] | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.outputs)


@dataclass
class CheckReport:
    """What `ember check` found: per backend, per output, and the bisect finding if asked."""
    model: str
    reference: str
    mode: str
    backends: list[BackendReport]
    inputs: dict[str, ValueStats]
    saved_golden: str | None = None
    simplified: bool = True  # each backend ran its simplified graph (False: --no-simplify)

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.backends)

    @property
    def exit_code(self) -> int:
        """0 when every output passes, 1 on a mismatch (errors raise instead: exit 2)."""
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        for backend, raw in zip(self.backends, data["backends"]):
            raw["passed"] = backend.passed
            for comparison, out in zip(backend.outputs, raw["outputs"]):
                out["mismatch_share"] = comparison.mismatch_share
        return _json_safe(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        return format_report(self)


# -- printing ----------------------------------------------------------------------------------

def format_report(report: CheckReport) -> str:
    """The human-readable report: one block per output, bisect findings, a summary line."""
    lines = [f"ember check {report.model}: reference {report.reference}, "
             f"check {report.mode}" + ("" if report.simplified else ", graph as imported")]
    for b in report.backends:
        for c in b.outputs:
            lines.extend(_format_comparison(f"[{b.backend}]", c))
        if b.bisect is not None:
            lines.extend(_format_bisect(b.backend, b.bisect))
        if b.timing is not None:
            t = b.timing
            lines.append(f"[{b.backend}] latency: median {t['median_ms']:.3f} ms, p90 "
                         f"{t['p90_ms']:.3f} ms, min {t['min_ms']:.3f} ms over "
                         f"{t['iterations']} run(s) after {t['warm_up']} warm-up run(s)")
    if report.saved_golden:
        lines.append(f"saved inputs and reference outputs to {report.saved_golden}")
    lines.append(_summary_line(report))
    return "\n".join(lines)


def _format_comparison(head: str, c: Comparison, indent: str = "") -> list[str]:
    label = c.name if c.dataset is None else f"{c.name} (data set {c.dataset})"
    lines = [f"{indent}{head} {label}: {'PASS' if c.passed else 'FAIL'}"
             + (f" ({c.note})" if c.note else "")]
    pad = indent + "    "
    lines.append(f"{pad}candidate {c.candidate_dtype} {_fmt_shape(c.candidate_shape)}, "
                 f"reference {c.reference_dtype} {_fmt_shape(c.reference_shape)}")
    if c.max_abs_error is not None and c.max_abs_error_at is None:
        lines.append(f"{pad}no elements to compare (empty tensors)")
    elif c.max_abs_error is not None:
        lines.append(f"{pad}max abs error {_g(c.max_abs_error)} at {c.max_abs_error_at} "
                     f"(candidate {_g(c.candidate_at_max)}, reference {_g(c.reference_at_max)}); "
                     f"max rel error {_g(c.max_rel_error)}; mean abs error {_g(c.mean_abs_error)}")
    if c.statistic is not None:
        lines.append(f"{pad}{c.statistic_name}: {_g(c.statistic)}")
    if c.total:
        lines.append(f"{pad}out of tolerance: {c.mismatched:,} of {c.total:,} "
                     f"({100 * c.mismatch_share:.3g}%) at atol {_g(c.atol)}, rtol {_g(c.rtol)}")
    if not c.passed and c.min_atol is not None:
        lines.append(f"{pad}would pass with atol >= {_g(c.min_atol)} (rtol {_g(c.rtol)}) or "
                     f"rtol >= {_g(c.min_rtol)} (atol {_g(c.atol)})")
    return lines


def _format_bisect(backend: str, b: BisectResult) -> list[str]:
    return _format_first_divergence(backend, b) + _format_added_error(backend, b.added_error)


def _format_first_divergence(backend: str, b: BisectResult) -> list[str]:
    if not b.found:
        extra = f"; {b.values_not_compared} value(s) not exposed by the reference" \
            if b.values_not_compared else ""
        return [f"[{backend}] bisect: no node diverges ({b.nodes_compared} nodes compared{extra})"]
    domain = f"{b.domain}::" if b.domain else ""
    lines = [f"[{backend}] bisect: first divergence at node '{b.node_name or b.outputs[0].name}' "
             f"({domain}{b.op_type}, opset {b.opset}), node {b.position} in topological order"]
    if b.note:
        lines.append(f"    note: {b.note}")
    for i in b.inputs:
        lines.append(f"    input '{i.name}': {i.status}"
                     + (f"; {_fmt_stats(i.candidate)}" if i.candidate else ""))
    for c, s in zip(b.outputs, b.output_stats):
        lines.extend(_format_comparison("output", c, indent="    "))
        lines.append(f"        candidate {_fmt_stats(s['candidate'])}")
        lines.append(f"        reference {_fmt_stats(s['reference'])}")
    return lines


def _format_added_error(backend: str, a: AddedError | None) -> list[str]:
    """The node whose own error is largest, against the other nodes and its inputs' error."""
    if a is None:
        return []
    domain = f"{a.domain}::" if a.domain else ""
    node = f"node '{a.node_name or a.output}' ({domain}{a.op_type}, opset {a.opset}), " \
           f"node {a.position} in topological order" + (f", {a.simplifier}" if a.simplifier else "")
    head = f"[{backend}] bisect: error grows most at {node}" if a.isolated_ulps > _ROUNDING_ULPS \
        else f"[{backend}] bisect: no node adds more than rounding; the most: {node}"
    others = f" ('{a.next_node}')" if a.next_node else ""
    lines = [head, f"    on the reference's inputs it is off by {_ulps(a.isolated_ulps)} of "
                   f"{a.dtype} (max abs error {_g(a.isolated_max_abs_error)} in '{a.output}'); "
                   f"no other of the {a.nodes_isolated} nodes run so is off by more than "
                   f"{_ulps(a.next_ulps)}{others}"]
    if a.output_ulps is not None:
        inputs = f"its inputs at most {_ulps(a.input_ulps)}, " if a.input_ulps is not None else ""
        lines.append(f"    in the candidate's own run: {inputs}its output {_ulps(a.output_ulps)} "
                     "off the reference")
    return lines


# Two correctly rounded results differ by up to one unit in the last place.
_ROUNDING_ULPS = 1.0


def _ulps(x: float) -> str:
    return f"{x:.3g} ulp" + ("" if x == 1 else "s")


def _summary_line(report: CheckReport) -> str:
    total = sum(len(b.outputs) for b in report.backends)
    failed = [(b.backend, c.name) for b in report.backends for c in b.outputs if not c.passed]
    names = ", ".join(b.backend for b in report.backends)
    if not failed:
        return f"PASS: {total} output(s) within tolerance on {names} vs {report.reference}"
    listed = ", ".join(f"{name} on {backend}" for backend, name in failed)
    return f"FAIL: {len(failed)} of {total} output(s) out of tolerance: {listed}"


def _fmt_stats(s: ValueStats) -> str:
    text = f"{s.dtype} {_fmt_shape(s.shape)}"
    if s.min is not None:
        text += f" min {_g(s.min)} max {_g(s.max)} mean {_g(s.mean)} std {_g(s.std)}"
    if s.nan or s.inf:
        text += f" NaN {s.nan} Inf {s.inf}"
    return text


def _fmt_shape(shape: list[int] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _g(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _json_safe(value: Any) -> Any:
    """Infinities and NaN as strings: strict JSON has no literals for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
