"""One measurement of benchmarks/bench_cpu.py, in a process of its own.

    python benchmarks/_bench_worker.py JOB.json

The job names one runtime, one model and one inputs file. The worker loads the model, runs it
`warmup` times, then times up to `runs` runs (at least `min_runs`, fewer once `budget_s` of
timed runs is spent, and never more than the budget allows for a model whose first run alone is
long) and writes its result as JSON to job["result"]: {"status": "ok", "times": [...],
"median_s", "load_s", "first_s", "version", "rss_mb"}, or {"status": "skipped" | "error" |
"unavailable", "reason"}. Only the runtime under test is imported. With job["profile"] it times
each step of ember's plan instead (see profile_ember), or reads onnxruntime's own profiler.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import statistics
import sys
import time

import numpy as np

SAMPLE = 65536  # output elements kept for the parent's cross-runtime check


class Unavailable(Exception):
    """The runtime itself cannot be imported: the whole column is skipped."""


class TooSlow(Exception):
    pass


def _alarm(signum, frame):
    raise TooSlow()


# -- the runtimes: each gives (run, outputs, version); run() is what is timed, outputs(result)
#    turns its result into numpy arrays in the graph's output order ------------------------------

def load_ember(path: str, feeds: dict):
    import ember  # the package is the repository (pip install -e .)

    sess = ember.load(path)
    return (lambda: sess.run(feeds)), (lambda r: list(r.values())), ember.__version__, sess


def load_onnxruntime(path: str, feeds: dict, profile_prefix: str | None = None):
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Unavailable(f"onnxruntime: {exc}") from exc
    opts = ort.SessionOptions()  # the defaults, as a user gets them
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return (lambda: sess.run(None, feeds)), list, ort.__version__, sess


def load_reference(path: str, feeds: dict):
    import onnx
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(path)
    return (lambda: ref.run(None, feeds)), list, onnx.__version__, ref


def load_openvino(path: str, feeds: dict):
    try:
        import openvino as ov
    except ImportError as exc:
        raise Unavailable(f"openvino does not import ({exc}); pip install openvino") from exc
    core = ov.Core()
    model = core.read_model(path)
    # the concrete input shapes, as OpenVINO recommends for a fixed-shape workload
    model.reshape({i.get_any_name(): ov.PartialShape(list(feeds[i.get_any_name()].shape))
                   for i in model.inputs})
    compiled = core.compile_model(model, "CPU")  # default properties (latency hint)
    request = compiled.create_infer_request()
    n = len(compiled.outputs)

    def outputs(_):
        return [request.get_output_tensor(i).data for i in range(n)]

    return (lambda: request.infer(feeds)), outputs, ov.get_version(), compiled


_TRACT_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
                np.dtype(np.int64): "i64", np.dtype(np.int32): "i32", np.dtype(np.bool_): "bool",
                np.dtype(np.uint8): "u8", np.dtype(np.int8): "i8"}


def load_tract(path: str, feeds: dict):
    try:
        import tract
    except ImportError as exc:
        raise Unavailable(f"tract does not import ({exc}); pip install tract") from exc
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    names = [i.name for i in graph.input if i.name in feeds]
    # tract optimises for concrete shapes: bind the model's symbolic dims (batch, past) to the
    # feeds' sizes, as tract recommends (Model.transform(SetSymbols)). Setting concrete input
    # facts instead fails on dynamo exports, whose value_info keeps the symbols.
    symbols = {}
    for i in graph.input:
        for axis, dim in enumerate(i.type.tensor_type.shape.dim):
            if dim.dim_param and re.fullmatch(r"[A-Za-z_]\w*", dim.dim_param):
                symbols[dim.dim_param] = int(feeds[i.name].shape[axis])
    del graph
    try:
        model = tract.onnx().load(path).into_model()
        model.transform(tract.SetSymbols(symbols))
    except Exception as first:  # noqa: BLE001 - then try concrete input facts
        try:
            inference = tract.onnx().load(path)
            for k in range(inference.input_count()):
                value = feeds[inference.input_name(k)]
                inference.set_input_fact(k, ",".join(map(str, value.shape)) + ","
                                         + _TRACT_TYPES[value.dtype])
            model = inference.into_model()
        except Exception:  # noqa: BLE001
            raise first from None
    runnable = model.into_runnable()  # optimised for this CPU
    args = [feeds[n] for n in names]
    # tract returns its own tensors: turning them into numpy is part of a run
    return (lambda: [t.to_numpy() for t in runnable.run(args)]), list, tract.version(), runnable


def load_onnxruntime_nospin(path: str, feeds: dict):
    """onnxruntime with its intra-op threads' spinning off: what it costs where the cores are
    shared, and the setting issue 45's first measurements used."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Unavailable(f"onnxruntime: {exc}") from exc
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return (lambda: sess.run(None, feeds)), list, ort.__version__, sess


LOADERS = {"ember": load_ember, "onnxruntime": load_onnxruntime,
           "onnxruntime-nospin": load_onnxruntime_nospin, "reference": load_reference,
           "openvino": load_openvino, "tract": load_tract}


def _first_line(exc: BaseException) -> str:
    """The error on one line (a tract error's 'Caused by' chain included, its backtrace not)."""
    text = f"{type(exc).__name__}: {exc}".split("Stack backtrace:")[0]
    return " ".join(text.split())[:300]


def _sample(outs) -> dict:
    kept = {}
    for i, value in enumerate(outs):
        a = np.asarray(value)
        flat = a.reshape(-1)
        step = max(1, flat.size // SAMPLE)
        kept[f"out{i}"] = np.array(flat[::step][:SAMPLE], copy=True)
        kept[f"shape{i}"] = np.array(a.shape, np.int64)
    return kept


def measure(job: dict, feeds: dict) -> dict:
    t = time.perf_counter()
    run, outputs, version, _keep = LOADERS[job["runtime"]](job["model"], feeds)
    load_s = time.perf_counter() - t
    limit = job.get("first_run_limit_s")
    if limit:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        t = time.perf_counter()
        result = run()
        first_s = time.perf_counter() - t
    except TooSlow:
        return {"status": "skipped", "reason": f"one run takes over {limit:.0f} s",
                "load_s": load_s, "version": version}
    finally:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
    if job.get("outputs"):
        np.savez(job["outputs"], **_sample(outputs(result)))
    del result
    budget = job["budget_s"]
    slow = first_s > budget / 4  # the first run is warm-up enough for a long model
    for _ in range(0 if slow else job["warmup"] - 1):
        run()
    min_runs = max(1, min(job["min_runs"], int(budget / max(first_s, 1e-9))))
    times: list[float] = []
    spent = 0.0
    while len(times) < job["runs"] and (len(times) < min_runs or spent < budget):
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return {"status": "ok", "times": times, "median_s": statistics.median(times),
            "load_s": load_s, "first_s": first_s, "version": version}


# -- profiles -------------------------------------------------------------------------------------

def _small_attrs(attrs: dict) -> str:
    parts = []
    for k, v in attrs.items():
        if (k, v) in (("auto_pad", "NOTSET"), ("group", 1)) or \
                k in ("pads", "dilations", "strides") and isinstance(v, (list, tuple)) and \
                len(set(v)) == 1 and v[0] == (0 if k == "pads" else 1):
            continue  # the defaults
        if isinstance(v, (int, float, str)) and len(str(v)) <= 16:
            parts.append(f"{k}={v}")
        elif isinstance(v, (list, tuple)) and len(v) <= 4 and \
                all(isinstance(x, (int, float)) for x in v):
            parts.append(f"{k}={','.join(str(x) for x in v)}")
    return " ".join(parts)


def profile_ember(job: dict, feeds: dict) -> dict:
    """Time every step of the session's plan, by running it through Plan.iterate (which runs
    Plan._execute and yields after each step): the time between two yields is one step's
    (gathering its inputs, its kernel, then freeing the values that died). Runs of plain
    Session.run are interleaved, to show what the per-step view leaves out."""
    run, _, version, sess = load_ember(job["model"], feeds)
    from ember.ops.cpu import engine
    cpu = engine.current()
    plan = sess._plan  # the plan Session.run uses for all outputs (runtime/session.py)
    ordered = [feeds[n] for n in plan.input_names]
    for _ in range(job["warmup"]):
        run()
    shapes: dict[str, tuple] = {n: tuple(np.shape(v)) for n, v in feeds.items()}
    shapes.update({n: tuple(np.shape(v)) for n, v in plan.graph.initializers.items()})
    nodes: list = []
    per_node: list[list[float]] = []
    io: list[tuple] = []
    totals, plain = [], []
    for r in range(job["runs"]):
        t = time.perf_counter()
        run()
        plain.append(time.perf_counter() - t)
        i = 0
        cpu.enter(sess.threads)  # as Session.run does: BLAS's threads, the kernel pool's
        start = t = time.perf_counter()
        for node, outs in plan.iterate(ordered):
            now = time.perf_counter()
            if r == 0:
                nodes.append(node)
                per_node.append([])
                ins = [shapes.get(n) for n in node.inputs if n]
                for n, v in zip(node.outputs, outs):
                    if n and v is not None and hasattr(v, "shape"):
                        shapes[n] = tuple(v.shape)
                io.append((ins, [shapes.get(n) for n in node.outputs if n]))
            per_node[i].append(now - t)
            i += 1
            t = time.perf_counter()
        totals.append(time.perf_counter() - start)
        cpu.leave()
    rows = []
    for node, ts, (ins, outs) in zip(nodes, per_node, io):
        rows.append({"op": (f"{node.domain}::" if node.domain else "") + node.op_type,
                     "name": node.name or node.outputs[0], "median_s": statistics.median(ts),
                     "inputs": [list(s) if s is not None else None for s in ins],
                     "outputs": [list(s) if s is not None else None for s in outs],
                     "attrs": _small_attrs(node.attrs)})
    return {"status": "ok", "version": version, "nodes": rows,
            "steps_total_s": statistics.median(totals), "run_s": statistics.median(plain),
            "runs": job["runs"]}


def profile_onnxruntime(job: dict, feeds: dict) -> dict:
    """onnxruntime's own per-node profile (after its graph optimisations, so with its fused op
    types), over the runs after the warm-up ones."""
    prefix = os.path.join(os.path.dirname(job["result"]), "ort_profile")
    run, _, version, sess = load_onnxruntime(job["model"], feeds, prefix)
    for _ in range(job["warmup"] + job["runs"]):
        run()
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    after = starts[job["warmup"]] if len(starts) > job["warmup"] else 0
    runs = max(1, len(starts) - job["warmup"])
    by_node: dict[tuple[str, str], float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") \
                and e["ts"] >= after:
            key = (e["args"].get("op_name", "?"), e["name"][:-len("_kernel_time")])
            by_node[key] = by_node.get(key, 0.0) + e["dur"] * 1e-6
    os.remove(path)
    rows = [{"op": op, "name": name, "median_s": total / runs}  # a mean over the runs
            for (op, name), total in by_node.items()]
    return {"status": "ok", "version": version, "nodes": rows, "runs": runs}


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    with np.load(job["inputs"]) as npz:
        feeds = {k: npz[k] for k in npz.files}
    try:
        if job.get("profile"):
            result = (profile_ember if job["runtime"] == "ember" else profile_onnxruntime)(
                job, feeds)
        else:
            result = measure(job, feeds)
    except Unavailable as exc:
        result = {"status": "unavailable", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot load or run the model
        result = {"status": "error", "reason": _first_line(exc)}
    result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, job["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
