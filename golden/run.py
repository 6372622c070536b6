"""The check itself: `check()` runs each backend on each data set and compares its outputs."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ember.errors import InputError
from ember.golden.bisect import _NEEDS_RUNTIME, find_divergence
from ember.golden.compare import (_dtype_str, _RUNTIME_REFS, _shape, CheckError, compare_values,
                                  Comparison, DEFAULT_ATOL, DEFAULT_CHUNK, DEFAULT_RTOL,
                                  Tolerances, value_stats)
from ember.golden.inputs import index_bounds, make_inputs
from ember.golden.references import (Case, EmberReference, make_reference, PolygraphyReference,
                                     ProtoReference, Reference, write_golden)
from ember.golden.report import BackendReport, CheckReport
from ember.importer import ModelSource, import_model
from ember.ir import Model
from ember.runtime.backends import resolve_backend_name
from ember.runtime.session import Session, load

# -- the check ---------------------------------------------------------------------------------

def check(model: ModelSource, backend: str | Sequence[str] | None = None,
          ref: str = "onnxruntime", *, inputs: Mapping[str, Any] | None = None,
          seed: int = 0, dims: Mapping[str, int] | None = None,
          ranges: Mapping[str, tuple[float, float]] | None = None,
          atol: float | Mapping[str, float] = DEFAULT_ATOL,
          rtol: float | Mapping[str, float] = DEFAULT_RTOL, mode: str = "elementwise",
          bisect: bool = False, save_golden: str | None = None,
          chunk: int = DEFAULT_CHUNK, validate: bool = False, topk: int = 0,
          fail_fast: bool = False, iterations: int = 0, warm_up: int = 0,
          marks: Sequence[str] = (), input_sets: Sequence[Mapping[str, Any]] | None = None,
          save_inputs: str | None = None, save_outputs: str | None = None,
          simplify: bool = True) -> CheckReport:
    """Compare `model` on each candidate `backend` (a name, "cpu,opencl" or a list; default
    $EMBER_BACKEND or cpu) with `ref`; see the module docstring for references and modes.

    `inputs` fixes some or all feeds (the rest are random from `seed`, `dims`, `ranges`); recorded
    references bring their own. `atol`/`rtol` are floats or {output: value} ("" for the global
    value). `bisect` also names the first node that diverges and the node that adds the most
    error of its own (see find_divergence); `save_golden` records the
    inputs and the reference's outputs as an .npz. `validate`: NaN or Inf on either side
    fails; `topk`: the indices of each row's k largest values must also agree. `fail_fast`
    stops at the first data set and backend that fail. `iterations` (after `warm_up` untimed
    runs) times each backend on the first data set. `marks` names intermediate values to
    compare too (on the first data set), reported as "mark:NAME". Polygraphy's JSON:
    `input_sets` (its --save-inputs files, ember.golden.polygraphy_json.load_inputs) are the data sets
    to run; `save_inputs` / `save_outputs` write the data sets and each backend's outputs in
    its formats (runners named ember-BACKEND), so `polygraphy run --load-inputs /
    --load-outputs` can use them. `simplify` (the default) checks each backend's graph
    simplified for it, as `ember.load` runs it, and an ember backend as the reference then runs
    the same simplified graph; simplify=False checks the graph as imported."""
    if iterations < 0 or warm_up < 0:
        raise InputError("--iterations and --warm-up must not be negative")
    tolerances = Tolerances(atol, rtol, mode, validate=validate, topk=topk)
    ir = model if isinstance(model, Model) else import_model(model)
    source = model if not isinstance(model, Model) else ir.path
    if source is None and ref.lower() in _RUNTIME_REFS:
        raise CheckError(f"--ref {ref} needs the ONNX model (a path, bytes or ModelProto), "
                         "not ember IR built in memory")
    # Per-value tolerances may name outputs or, for --bisect, intermediate values.
    values = {v.name for v in ir.graph.outputs} | {o for n in ir.graph.nodes for o in n.outputs}
    unmarked = sorted(set(marks) - values)
    if unmarked:
        raise InputError(f"--mark: no node produces {', '.join(unmarked)}")
    unknown = tolerances.unknown_outputs(values)
    if unknown:
        raise InputError(f"tolerance given for unknown value(s) {', '.join(unknown)}; the "
                         f"model's outputs are {', '.join(v.name for v in ir.graph.outputs)}")
    backends = _backend_names(backend)
    reference = make_reference(ref, source, ir, input_sets)
    try:
        if bisect and not isinstance(reference, (ProtoReference, EmberReference)):
            raise CheckError(_NEEDS_RUNTIME)
        cases = _prepare_cases(reference, ir, inputs, seed, dims, ranges,
                               None if isinstance(reference, PolygraphyReference)
                               else input_sets)
        if save_inputs:
            from ember.golden.polygraphy_json import save_inputs as write_inputs
            write_inputs(save_inputs, [feeds for feeds, _ in cases])
        if save_golden:
            if len(cases) != 1:
                raise CheckError("--save-golden records one data set; this reference has "
                                 f"{len(cases)}")
            write_golden(save_golden, *cases[0])
        reports, runs = [], []
        for name in backends:
            collected = [] if save_outputs else None
            reports.append(_check_backend(ir, name, reference, cases, tolerances, bisect, chunk,
                                          fail_fast, iterations, warm_up, marks, collected,
                                          simplify))
            if collected is not None:
                runs.append((f"ember-{name}", collected))
            if fail_fast and not reports[-1].passed:
                break  # the backends after the first failing one are not run
        if save_outputs:
            from ember.golden.polygraphy_json import save_run_results
            save_run_results(save_outputs, runs)
    finally:
        reference.close()
    return CheckReport(model=str(ir.path or "<memory>"), reference=reference.name, mode=mode,
                       backends=reports, inputs={k: value_stats(v) for k, v in cases[0][0].items()},
                       saved_golden=save_golden, simplified=simplify)


def _backend_names(backend: str | Sequence[str] | None) -> list[str]:
    if backend is None or isinstance(backend, str):
        parts = [p.strip() for p in (backend or "").split(",") if p.strip()] or [None]
    else:
        parts = list(backend)
    return [resolve_backend_name(p) for p in parts]


def _prepare_cases(reference: Reference, ir: Model,
                   inputs: Mapping[str, Any] | None, seed: int, dims, ranges,
                   input_sets: Sequence[Mapping[str, Any]] | None = None) -> list[Case]:
    """Feeds and expected outputs per data set: recorded, or computed by the reference (on
    each of `input_sets`, or on one set)."""
    from ember.runtime.session import io_info

    graph = ir.graph
    declared = [io_info(v) for v in graph.inputs if v.name not in graph.initializers]
    bounds = index_bounds(graph)
    recorded = reference.cases(ir)
    if recorded:
        clash = sorted(set(inputs or {}) & set().union(*(set(f) for f, _ in recorded)))
        if clash:
            raise InputError(f"the recorded reference fixes input(s) {', '.join(clash)}; "
                             "drop -i/--inputs for them")
        return [(make_inputs(declared, {**feeds, **(inputs or {})}, dims, ranges, seed, bounds),
                 outputs) for feeds, outputs in recorded]
    cases = []
    for given in input_sets or [{}]:
        feeds = make_inputs(declared, {**given, **(inputs or {})}, dims, ranges, seed, bounds)
        cases.append((feeds, reference.outputs(feeds)))
    return cases


def _check_backend(ir: Model, backend: str, reference: Reference, cases: list[Case],
                   tolerances: Tolerances, want_bisect: bool, chunk: int,
                   fail_fast: bool = False, iterations: int = 0,
                   warm_up: int = 0, marks: Sequence[str] = (),
                   collected: list | None = None, simplify: bool = True) -> BackendReport:
    # simplified as ember.load does it: on a copy of the IR, for this backend
    session = load(ir, backend, simplify=True) if simplify else Session(ir, backend)
    same_graph = _same_graph_reference(reference, session)
    if same_graph is not reference:  # its outputs computed again, from the simplified graph
        reference, cases = same_graph, [(feeds, same_graph.outputs(feeds)) for feeds, _ in cases]
    outputs = []
    for index, (feeds, expected) in enumerate(cases):
        if fail_fast and not all(c.passed for c in outputs):
            break  # the first data set that fails is the last one run
        got = session.run(feeds)
        if collected is not None:  # --save-outputs
            collected.append(got)
        for name, ref_value in expected.items():
            if name not in got:
                tol = tolerances.for_value(name)
                outputs.append(Comparison(name, False, "missing", None, _dtype_str(ref_value),
                                          _shape(ref_value), tol.atol, tol.rtol,
                                          note="the candidate has no such output"))
                continue
            comparison = compare_values(name, got[name], ref_value,
                                        tolerances.for_value(name), tolerances.mode)
            comparison.dataset = index if len(cases) > 1 else None
            outputs.append(comparison)
        del got
    if marks:
        outputs.extend(_compare_marks(session, reference, cases[0][0], marks, tolerances))
    report = BackendReport(backend, outputs)
    if want_bisect:
        report.bisect = find_divergence(session, reference, cases[0][0], tolerances, chunk,
                                        original=ir)
    if iterations:
        report.timing = _time_runs(session, cases[0][0], iterations, warm_up)
    return report


def _same_graph_reference(reference: Reference, session: Session) -> Reference:
    """An ember backend as the reference runs the candidate's own graph, simplified where the
    candidate's is: it checks one backend's kernels against another's on the same nodes, and
    bisect runs the two plans in lockstep, node for node."""
    if isinstance(reference, EmberReference) and session.model is not reference.session.model:
        return EmberReference(session.model, reference.name)
    return reference


def _marked_values(session: Session, feeds: Mapping[str, Any], names: Sequence[str]
                   ) -> dict[str, Any]:
    """The values `names` take in one run of `session`'s plan (host copies)."""
    wanted, found = set(names), {}
    to_host = session.backend_instance.to_host
    for node, values in session.iterate(feeds):
        for name, value in zip(node.outputs, values):
            if name in wanted:
                found[name] = to_host(value) if value is not None else None
    return found


def _reference_marks(reference: Reference, feeds: Mapping[str, Any], names: Sequence[str]
                     ) -> dict[str, Any]:
    if isinstance(reference, ProtoReference):
        return reference.values(feeds, list(names))
    if isinstance(reference, EmberReference):
        return _marked_values(reference.session, feeds, names)
    raise CheckError("--mark needs a runtime reference (onnxruntime, onnx or an ember "
                     "backend): recorded data holds no intermediate values")


def _compare_marks(session: Session, reference: Reference, feeds: Mapping[str, Any],
                   marks: Sequence[str], tolerances: Tolerances) -> list[Comparison]:
    """--mark: each named intermediate value compared as an output is, "mark:NAME"."""
    got, want = _marked_values(session, feeds, marks), _reference_marks(reference, feeds, marks)
    compared = []
    for name in marks:
        comparison = compare_values(f"mark:{name}", got.get(name), want.get(name),
                                    tolerances.for_value(name), tolerances.mode)
        if name not in got:  # only a simplified graph lacks a value the model computes
            comparison.passed = False
            comparison.note = "the simplified graph does not compute it (fused or folded " \
                              "away); compare it with --no-simplify"
        compared.append(comparison)
    return compared


def _time_runs(session: Session, feeds: Mapping[str, Any], iterations: int,
               warm_up: int) -> dict[str, float]:
    """Latency of `session.run(feeds)`: `warm_up` untimed runs, then `iterations` timed."""
    import time

    for _ in range(warm_up):
        session.run(feeds)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        session.run(feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "min_ms": float(min(times)), "iterations": iterations, "warm_up": warm_up}
