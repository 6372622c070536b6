"""CPU latency of ember against onnxruntime, onnx's ReferenceEvaluator, OpenVINO and tract.

    python benchmarks/bench_cpu.py [--models resnet50,bert_base,...] [--batches 1,8]
        [--rounds 5] [--runtimes ember,onnxruntime,...] [--contended] [--quick] [--json FILE]
    python benchmarks/bench_cpu.py --profile MODEL [--batches 1]   # ember's time by op type

Every measurement is a fresh process (benchmarks/_bench_worker.py) that imports one runtime,
loads one model, runs it `--warmup` times and then times up to `--runs` runs (at least
`--min-runs`, fewer once `--budget` seconds of timed runs are spent), and reports its median.
No runtime shares a process with another, so none inherits another's threads, memory or
warmed caches (OpenBLAS threads that keep spinning after a run slow only their own process).
The processes are interleaved: each round runs every (model, batch) once on every runtime,
the runtimes in an order rotated from round to round, and the report gives, per model and
batch, the median over the `--rounds` rounds, the spread (min–max of the rounds' medians),
the ratio to onnxruntime (median ÷ median) and, at the end, the geometric mean of the ratios.
In round 1 each runtime's outputs (a strided sample of them) are compared with onnxruntime's;
a runtime that differs by more than 1e-3 of the output's scale is flagged.

`--models broad` runs those ten and the broad zoo of issue 45
(benchmarks/zoo/: CNN families, a detector, segmentation, audio, T5, a Llama-style decoder in
fp32 and 4-bit, onnxruntime-optimised and quantised files, float16, tree ensembles, a streaming
If/LSTM model), each built by the tool users make such files with and cached under
.cache/bench-models-<torch version>/zoo/; the report adds ember's ratio by family.

Runtimes: ember (cpu backend); onnxruntime (CPUExecutionProvider, default SessionOptions);
onnxruntime-nospin (the same with its intra-op threads' spinning off);
onnx's ReferenceEvaluator (a model is skipped for it when one run takes over `--ref-limit`
seconds, 20 by default, and so are its larger batches); OpenVINO (`pip install openvino`,
CPU device, default properties, inputs reshaped to the concrete shapes) and tract (`pip install
tract`, the sonos tract bindings, concrete input facts). A column that does not import, or a
model a runtime cannot load or run, is skipped with the reason.

Models: benchmarks/cpu_models.py, real-size architectures written there in torch and exported
with torch.onnx.export (nothing is downloaded; the exporter used for each is shown under the
table), cached under .cache/bench-models-<torch version>/; exporting needs torch and onnxscript.
gpt2_decode is one KV-cache decoding step (one new token, past length 128) and is also given
in tokens/s.

--contended runs every measurement a second time (interleaved with the plain one) with one
competing busy process, a pure-Python spin loop at nice 19 on the same cores, and reports
each runtime's slowdown (contended ÷ uncontended median). --profile MODEL times each step of
ember's plan (through Plan.iterate) and prints ember's time by op type and its slowest nodes,
next to onnxruntime's own profile by op type.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_bench_worker.py")
sys.path.insert(0, HERE)

import cpu_models  # noqa: E402  (numpy only; torch is imported by the export subprocess)
import zoo  # noqa: E402  (the broad zoo's catalogue: numpy only)

ZOO = zoo.models()

RUNTIMES = ["ember", "onnxruntime", "onnxruntime-nospin", "reference", "openvino", "tract"]
BASELINE = "onnxruntime"
CHECK_TOL = 1e-3  # max |x - ort| over max |ort|, per output
SPIN = "import os\nos.nice(19)\nwhile True:\n    pass\n"


# -- models ---------------------------------------------------------------------------------------

def cache_dir() -> str:
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = "no-torch"
    return os.path.join(REPO, ".cache", f"bench-models-{version}")


def ensure_models(names: list[str], folder: str) -> dict[str, tuple[str, dict]]:
    """name -> (path, meta), exporting (in a subprocess, so the parent never imports torch)
    the models that are missing or stale."""
    zoo_names = [n for n in names if n in ZOO]
    names = [n for n in names if n not in ZOO]
    missing = [n for n in names if cpu_models.cached(n, folder) is None]
    if missing:
        print(f"exporting {', '.join(missing)} to {folder} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "cpu_models.py"), *missing,
                               "--out", folder], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise SystemExit(f"export failed (needs torch and onnxscript):\n{tail}")
    models = {}
    for n in names:
        found = cpu_models.cached(n, folder)
        if found is None:
            raise SystemExit(f"{n}: export did not produce a model in {folder}")
        models[n] = found
    for n in zoo_names:
        models[n] = _zoo_file(n, folder)
    return models


def _zoo_file(name: str, folder: str) -> tuple[str, dict]:
    """(path, meta) of a zoo model, built (in a subprocess: torch and the tools stay out of
    this process) where missing or made from older code."""
    digest = zoo.source_digest()
    path = os.path.join(folder, "zoo", f"{name}.onnx")
    meta_path = path[:-len(".onnx")] + ".meta.json"
    meta = {"exporter": ZOO[name].tool, "note": "", "digest": digest}
    if os.path.exists(path) and os.path.exists(meta_path):
        with open(meta_path) as f:
            if json.load(f).get("digest") == digest:
                return path, meta
    print(f"building {name} ({ZOO[name].tool}) ...", file=sys.stderr, flush=True)
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import zoo; "
            f"print(zoo.models()[{name!r}].build({os.path.dirname(path)!r}))")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"building {name} failed:\n{tail}")
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return path, meta


def make_inputs(m: str, b: int) -> dict:
    """The feeds of model `m` at batch `b`, from the zoo it belongs to (seeded)."""
    if m in ZOO:
        return ZOO[m].inputs(b, np.random.default_rng(1234 + b))
    return cpu_models.make_inputs(m, b)


def batches_of(m: str, batches: list[int]) -> list[int]:
    """`batches`, less those a zoo model does not run (its file has a fixed batch)."""
    return [b for b in batches if m not in ZOO or b in ZOO[m].batches]


def label_of(m: str) -> str:
    return ZOO[m].label if m in ZOO else cpu_models.SPECS[m].label


def tokens_of(m: str) -> int:
    return 0 if m in ZOO else cpu_models.SPECS[m].tokens_per_item


# -- workers --------------------------------------------------------------------------------------

class Runner:
    def __init__(self, args, work: str):
        self.args = args
        self.work = work
        self.count = 0

    def job(self, runtime: str, path: str, inputs: str, **extra) -> dict:
        a = self.args
        self.count += 1
        job = {"runtime": runtime, "model": path, "inputs": inputs, "warmup": a.warmup,
               "runs": a.runs, "min_runs": a.min_runs, "budget_s": a.budget,
               "first_run_limit_s": a.ref_limit if runtime == "reference" else None,
               "result": os.path.join(self.work, f"result{self.count}.json")}
        job.update(extra)
        return job

    def run(self, job: dict, contended: bool = False) -> dict:
        job_path = job["result"][:-len(".json")] + ".job.json"
        with open(job_path, "w") as f:
            json.dump(job, f)
        spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if contended else None
        try:
            proc = subprocess.run([sys.executable, WORKER, job_path], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            return {"status": "error", "reason": f"worker timed out after {self.args.timeout} s"}
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        if not os.path.exists(job["result"]):
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            why = lines[-1][:200] if lines else f"exit status {proc.returncode}"
            return {"status": "error", "reason": f"worker died (exit {proc.returncode}): {why}"}
        with open(job["result"]) as f:
            return json.load(f)


def compare(sample: str, reference: str) -> float:
    """Largest |x - ort| / max|ort| over the outputs (their strided samples)."""
    with np.load(sample) as a, np.load(reference) as b:
        worst = 0.0
        i = 0
        while f"out{i}" in b.files:
            if f"out{i}" not in a.files or \
                    not np.array_equal(a[f"shape{i}"], b[f"shape{i}"]):
                return math.inf
            x, y = a[f"out{i}"].astype(np.float64), b[f"out{i}"].astype(np.float64)
            if x.shape != y.shape:
                return math.inf
            scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-30)
            worst = max(worst, float(np.max(np.abs(x - y))) / scale if y.size else 0.0)
            i += 1
        return worst


# -- the benchmark --------------------------------------------------------------------------------

def benchmark(args, models: dict, runner: Runner, work: str) -> dict:
    cells = [(m, b) for m in args.models for b in batches_of(m, args.batches)]
    inputs = {}
    for m, b in cells:
        inputs[m, b] = os.path.join(work, f"{m}.b{b}.inputs.npz")
        np.savez(inputs[m, b], **make_inputs(m, b))
    modes = ["plain", "contended"] if args.contended else ["plain"]
    # (mode, runtime, model, batch) -> list of round medians; and what stopped a cell
    medians: dict[tuple, list[float]] = {}
    detail: dict[tuple, list[dict]] = {}
    stopped: dict[tuple, str] = {}  # (runtime, model, batch) -> reason
    unavailable: dict[str, str] = {}
    versions: dict[str, str] = {}
    errors: dict[tuple, float] = {}  # (runtime, model, batch) -> relative difference to ort
    samples: dict[tuple, str] = {}
    started = time.time()
    for r in range(args.rounds):
        shift = r % len(args.runtimes)
        order = args.runtimes[shift:] + args.runtimes[:shift]
        for m, b in cells:
            for rt in order:
                if rt in unavailable or (rt, m, b) in stopped:
                    continue
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    extra = {}
                    if r == 0 and mode == "plain":
                        samples[rt, m, b] = os.path.join(work, f"{rt}.{m}.b{b}.sample.npz")
                        extra["outputs"] = samples[rt, m, b]
                    res = runner.run(runner.job(rt, models[m][0], inputs[m, b], **extra),
                                     contended=mode == "contended")
                    status = res["status"]
                    if status == "unavailable":
                        unavailable[rt] = res["reason"]
                        break
                    if status != "ok":
                        stopped[rt, m, b] = res["reason"]
                        if status == "skipped":  # too slow: so are the larger batches
                            for b2 in args.batches:
                                if b2 > b:
                                    stopped.setdefault((rt, m, b2), f"{res['reason']} at "
                                                       f"batch {b}")
                        _progress(args, r, m, b, rt, mode, res)
                        break
                    versions.setdefault(rt, res.get("version", "?"))
                    medians.setdefault((mode, rt, m, b), []).append(res["median_s"])
                    detail.setdefault((mode, rt, m, b), []).append(
                        {k: res.get(k) for k in ("median_s", "times", "load_s", "first_s",
                                                 "rss_mb")})
                    _progress(args, r, m, b, rt, mode, res)
        if r == 0:
            for m, b in cells:
                base = samples.get((BASELINE, m, b))
                if base is None or not os.path.exists(base):
                    continue
                for rt in args.runtimes:
                    s = samples.get((rt, m, b))
                    if rt != BASELINE and s and os.path.exists(s):
                        errors[rt, m, b] = compare(s, base)
    return {"medians": medians, "detail": detail, "stopped": stopped,
            "unavailable": unavailable, "versions": versions, "errors": errors,
            "elapsed_s": time.time() - started}


def _progress(args, r, m, b, rt, mode, res) -> None:
    if args.quiet:
        return
    tag = " (contended)" if mode == "contended" else ""
    if res["status"] == "ok":
        what = f"{_ms(res['median_s'])} ms  ({len(res['times'])} runs, load " \
               f"{res['load_s']:.1f} s)"
    else:
        what = f"{res['status']}: {res['reason']}"
    print(f"[round {r + 1}/{args.rounds}] {m} b{b} {rt}{tag}: {what}", file=sys.stderr,
          flush=True)


# -- the report -----------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _table(header: list[str], rows: list[list[str]], left: int = 2) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


class Notes:
    def __init__(self):
        self.items: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"

    def render(self) -> str:
        return "\n".join(f"  [{i + 1}] {t}" for i, t in enumerate(self.items))


def report(args, models: dict, res: dict) -> tuple[str, dict]:
    med, stopped, unavailable = res["medians"], res["stopped"], res["unavailable"]
    runtimes = args.runtimes
    notes = Notes()
    out: list[str] = []
    summary: dict = {"cells": [], "geomean": {}, "contended": {}}

    def label(m: str) -> str:
        return label_of(m)

    def cell_text(mode: str, rt: str, m: str, b: int) -> str:
        if rt in unavailable:
            return "n/a" + notes.mark(f"{rt}: {unavailable[rt]}")
        if (rt, m, b) in stopped:
            return "skip" + notes.mark(f"{rt}, {m} b{b}: {stopped[rt, m, b]}")
        vals = med.get((mode, rt, m, b))
        if not vals:
            return "-"
        text = f"{_ms(statistics.median(vals))} ({_ms(min(vals))}–{_ms(max(vals))})"
        err = res["errors"].get((rt, m, b))
        if mode == "plain" and err is not None and err > CHECK_TOL:
            text += notes.mark(f"{rt}, {m} b{b}: outputs differ from onnxruntime's by "
                               f"{err:.2g} of their scale")
        return text

    def median_of(mode, rt, m, b):
        vals = med.get((mode, rt, m, b))
        return statistics.median(vals) if vals else None

    cells = [(m, b) for m in args.models for b in batches_of(m, args.batches)]
    for mode in (["plain", "contended"] if args.contended else ["plain"]):
        title = "Latency" if mode == "plain" else \
            "Latency with one competing nice-19 spin process"
        out.append(f"{title}, ms: median over {args.rounds} rounds (min–max of the rounds' "
                   f"medians), each round a fresh process per runtime")
        rows = [[label(m), str(b)] + [cell_text(mode, rt, m, b) for rt in runtimes]
                for m, b in cells]
        out.append(_table(["model", "batch"] + runtimes, rows))
        out.append("")

    for m, b in cells:  # the JSON's view of the plain measurements
        base = median_of("plain", BASELINE, m, b)
        entry = {"model": m, "batch": b}
        for rt in runtimes:
            vals = med.get(("plain", rt, m, b), [])
            t = statistics.median(vals) if vals else None
            entry[rt] = None if t is None else {
                "median_ms": t * 1e3, "min_ms": min(vals) * 1e3, "max_ms": max(vals) * 1e3,
                "rounds_ms": [v * 1e3 for v in vals],
                "ratio_to_ort": t / base if base else None,
                "max_rel_diff_to_ort": res["errors"].get((rt, m, b))}
            busy = med.get(("contended", rt, m, b))
            if t and busy:
                entry[rt]["contended_median_ms"] = statistics.median(busy) * 1e3
                entry[rt]["contended_rounds_ms"] = [v * 1e3 for v in busy]
                entry[rt]["slowdown"] = statistics.median(busy) / t
            if t and tokens_of(m):
                entry[rt]["tokens_per_s"] = b * tokens_of(m) / t
        entry["skipped"] = {rt: stopped[rt, m, b] for rt in runtimes if (rt, m, b) in stopped}
        entry["unavailable"] = {rt: unavailable[rt] for rt in runtimes if rt in unavailable}
        summary["cells"].append(entry)

    others = [rt for rt in runtimes if rt != BASELINE]
    if BASELINE in runtimes and others:
        out.append("Ratio to onnxruntime (median ÷ median; below 1 is faster than onnxruntime)")
        rows, ratios = [], {rt: [] for rt in others}
        by_batch = {rt: {b: [] for b in args.batches} for rt in others}
        for m, b in cells:
            base = median_of("plain", BASELINE, m, b)
            row = [label(m), str(b)]
            for rt in runtimes:
                t = median_of("plain", rt, m, b)
                if rt == BASELINE:
                    continue
                if t is None or not base:
                    row.append("-")
                    continue
                ratios[rt].append(t / base)
                by_batch[rt][b].append(t / base)
                row.append(f"{t / base:.2f}")
            rows.append(row)
        gm_row = ["geometric mean", "all"]
        for rt in others:
            if ratios[rt]:
                g = _geomean(ratios[rt])
                summary["geomean"][rt] = {"all": g, "cells": len(ratios[rt])}
                gm_row.append(f"{g:.2f} ({len(ratios[rt])})")
            else:
                gm_row.append("-")
        rows.append(gm_row)
        if len(args.batches) > 1:
            for b in args.batches:
                r = ["geometric mean", str(b)]
                for rt in others:
                    v = by_batch[rt][b]
                    r.append(f"{_geomean(v):.2f} ({len(v)})" if v else "-")
                    if v:
                        summary["geomean"][rt][f"batch {b}"] = _geomean(v)
                rows.append(r)
        out.append(_table(["model", "batch"] + others, rows))
        out.append("  (n) after a geometric mean: the number of model×batch cells it covers")
        out.append("")

    decode = [m for m in args.models if tokens_of(m)]
    if decode:
        out.append("KV-cache decoding step, tokens/s (batch × new tokens ÷ median step time)")
        rows = []
        for m in decode:
            for b in args.batches:
                row = [label(m), str(b)]
                for rt in runtimes:
                    t = median_of("plain", rt, m, b)
                    row.append(f"{b * tokens_of(m) / t:.1f}" if t else "-")
                rows.append(row)
        out.append(_table(["model", "batch"] + runtimes, rows))
        out.append("")

    if args.contended:
        out.append("Slowdown under contention (contended ÷ uncontended median; 1.00 = unaffected)")
        rows, slow = [], {rt: [] for rt in runtimes}
        for m, b in cells:
            row = [label(m), str(b)]
            for rt in runtimes:
                p, c = median_of("plain", rt, m, b), median_of("contended", rt, m, b)
                if p and c:
                    slow[rt].append(c / p)
                    row.append(f"{c / p:.2f}")
                else:
                    row.append("-")
            rows.append(row)
        gm = ["geometric mean", "all"]
        for rt in runtimes:
            if slow[rt]:
                g = _geomean(slow[rt])
                summary["contended"][rt] = {"slowdown_geomean": g, "cells": len(slow[rt])}
                gm.append(f"{g:.2f}")
            else:
                gm.append("-")
        rows.append(gm)
        out.append(_table(["model", "batch"] + runtimes, rows))
        out.append("")

    exporters = {}
    for m in args.models:
        meta = models[m][1]
        if m in ZOO:
            key = meta["exporter"]
        else:
            key = ("torch.onnx.export dynamo=True, opset 18" if meta["exporter"] == "dynamo"
                   else "torch.onnx.export dynamo=False, opset 17") + (
                f" ({meta['note']})" if meta.get("note") else "")
        exporters.setdefault(key, []).append(m)
    out.append("Made with: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in exporters.items()))
    families: dict[str, list[float]] = {}
    for (mode, rt, m, b), vals in med.items():
        base = med.get((mode, BASELINE, m, b))
        if mode == "plain" and rt == "ember" and base:
            family = ZOO[m].family if m in ZOO else "benchmark ten"
            families.setdefault(family, []).append(
                statistics.median(vals) / statistics.median(base))
    if families:
        out.append("ember ÷ onnxruntime by family (geomean over models × batches): " + ", ".join(
            f"{f} {_geomean(v):.2f} ({len(v)})" for f, v in sorted(families.items())))
        summary["families"] = {f: _geomean(v) for f, v in families.items()}
    out.append("Versions: " + ", ".join(f"{rt} {v}" for rt, v in res["versions"].items()))
    if notes.items:
        out.append("Notes:")
        out.append(notes.render())
    return "\n".join(out), summary


# -- --profile ------------------------------------------------------------------------------------

def profile(args, models: dict, runner: Runner, work: str) -> str:
    m, b = args.profile, args.batches[0]
    inputs = os.path.join(work, f"{m}.b{b}.inputs.npz")
    np.savez(inputs, **make_inputs(m, b))
    out = [f"Profile of {label_of(m)}, batch {b}: median over {args.runs} runs "
           f"per node, after {args.warmup} warm-up runs"]
    res = runner.run(runner.job("ember", models[m][0], inputs, profile=True))
    if res["status"] != "ok":
        return f"ember could not be profiled: {res['reason']}"
    total = sum(n["median_s"] for n in res["nodes"])
    out.append(f"ember {res['version']}: Session.run {_ms(res['run_s'])} ms; the plan's "
               f"{len(res['nodes'])} steps, timed one by one, add up to {_ms(total)} ms "
               f"(Plan.iterate took {_ms(res['steps_total_s'])} ms a run)")
    out.append("")
    out.append(_by_op(res["nodes"], total, "ember by op type"))
    out.append("")
    top = sorted(res["nodes"], key=lambda n: -n["median_s"])[:args.profile_top]
    rows = [[n["op"], n["name"][:40], f"{n['median_s'] * 1e3:.3f}",
             f"{100 * n['median_s'] / total:.1f}",
             " ".join("x".join(map(str, s)) if s is not None else "?"
                      for s in n["inputs"][:3]),
             " ".join("x".join(map(str, s)) if s is not None else "?" for s in n["outputs"][:2]),
             n["attrs"][:48]] for n in top]
    out.append(f"ember's {len(top)} slowest nodes")
    out.append(_table(["op", "node", "ms", "%", "input shapes", "output shapes", "attributes"],
                      rows, left=2))
    if BASELINE in args.runtimes:
        ort = runner.run(runner.job(BASELINE, models[m][0], inputs, profile=True))
        out.append("")
        if ort["status"] == "ok":
            ort_total = sum(n["median_s"] for n in ort["nodes"])
            out.append(f"onnxruntime {ort['version']} (its own profiler, mean of {ort['runs']} "
                       f"runs; op types after its fusions): nodes add up to {_ms(ort_total)} ms")
            out.append(_by_op(ort["nodes"], ort_total, "onnxruntime by op type"))
        else:
            out.append(f"onnxruntime's profile failed: {ort['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": m, "batch": b, "ember": res,
                       "onnxruntime": ort if BASELINE in args.runtimes else None}, f, indent=1)
    return "\n".join(out)


def _by_op(nodes: list[dict], total: float, title: str) -> str:
    by: dict[str, list[float]] = {}
    for n in nodes:
        by.setdefault(n["op"], []).append(n["median_s"])
    rows = []
    for op, ts in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        s = sum(ts)
        rows.append([op, str(len(ts)), f"{s * 1e3:.3f}", f"{100 * s / total:.1f}" if total else "-",
                     f"{s / len(ts) * 1e6:.1f}"])
    rows.append(["total", str(len(nodes)), f"{total * 1e3:.3f}", "100.0",
                 f"{total / max(len(nodes), 1) * 1e6:.1f}"])
    return _table([title, "nodes", "ms", "%", "µs/node"], rows, left=1)


# -- main -----------------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="models: " + ", ".join(cpu_models.SPECS))
    p.add_argument("--models", default=",".join(cpu_models.DEFAULT_MODELS),
                   help="comma-separated (default: all)")
    p.add_argument("--batches", type=_int_list, default=[1, 8], help="default 1,8")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"default {','.join(RUNTIMES)}")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, help="untimed runs per process (default 2; --quick 1)")
    p.add_argument("--runs", type=int, help="most timed runs per process (default 20; --quick 3)")
    p.add_argument("--min-runs", type=int, help="fewest timed runs (default 3; --quick 2), fewer "
                   "only when one run alone is longer than --budget")
    p.add_argument("--budget", type=float, help="seconds of timed runs per process after which "
                   "no more are started (default 5; --quick 1)")
    p.add_argument("--ref-limit", type=float, default=20.0,
                   help="skip the ReferenceEvaluator on a model when one run takes longer (s)")
    p.add_argument("--timeout", type=float, default=900.0, help="per worker process (s)")
    p.add_argument("--quick", action="store_true", help="fewer rounds and runs: a smoke test")
    p.add_argument("--contended", action="store_true",
                   help="also measure with one competing nice-19 spin process")
    p.add_argument("--profile", metavar="MODEL", help="ember's time by op type for MODEL")
    p.add_argument("--profile-top", type=int, default=15, help="slowest nodes listed")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    defaults = dict(rounds=(2, 5), warmup=(1, 2), runs=(3, 20), min_runs=(2, 3), budget=(1.0, 5.0))
    for k, (quick, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    args.models = [m for m in args.models.split(",") if m]
    if args.models == ["broad"]:  # issue 45's benchmark: the ten models and the zoo
        args.models = list(cpu_models.DEFAULT_MODELS) + list(ZOO)
    args.runtimes = [r for r in args.runtimes.split(",") if r]
    for m in args.models + ([args.profile] if args.profile else []):
        if m not in cpu_models.SPECS and m not in ZOO:
            p.error(f"unknown model {m!r}; known: {', '.join([*cpu_models.SPECS, *ZOO])}, "
                    f"or broad (all of them)")
    for r in args.runtimes:
        if r not in RUNTIMES:
            p.error(f"unknown runtime {r!r}; known: {', '.join(RUNTIMES)}")
    if args.rounds < 1 or not args.batches:
        p.error("need at least one round and one batch")

    folder = cache_dir()
    models = ensure_models([args.profile] if args.profile else args.models, folder)
    work = tempfile.mkdtemp(prefix="ember-bench-")
    try:
        runner = Runner(args, work)
        if args.profile:
            print(profile(args, models, runner, work))
            return 0
        load_before = os.getloadavg()
        res = benchmark(args, models, runner, work)
        text, summary = report(args, models, res)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        load_after = os.getloadavg()
        print(text)
        print(f"Machine: {platform.processor() or platform.machine()}, {cpus} CPUs, load average "
              f"{load_before[0]:.2f} before and {load_after[0]:.2f} after; "
              f"{runner.count} worker processes in {res['elapsed_s'] / 60:.1f} min")
        if args.json:
            detail = [{"mode": k[0], "runtime": k[1], "model": k[2], "batch": k[3], "rounds": v}
                      for k, v in res["detail"].items()]
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items()},
                           "versions": res["versions"],
                           "unavailable": res["unavailable"],
                           "exporters": {m: models[m][1] for m in args.models},
                           "machine": {"cpus": cpus, "load_before": load_before,
                                       "load_after": load_after, "python": sys.version},
                           **summary, "measurements": detail}, f, indent=1)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
