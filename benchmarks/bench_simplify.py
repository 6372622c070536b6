"""ember's simplifier against onnxsim on the exported PyTorch models: node counts before,
after onnxsim and after ember, ember's largest relative output difference, and the time each
tool takes; then the CPU speed of BERT-base and ResNet-50 unsimplified vs simplified.

    python benchmarks/bench_simplify.py [--models a,b] [--speed] [--repeats N]

Models come from .cache/torch-models-<torch version>/ (models/export_torch_models.py and
benchmarks/simplify_models.py write them; --speed needs the *_full models built with
`--full-size`, and `--full-size --raw` for the *_full_raw ones). onnxsim is optional (pip
install onnxsim); without it its column reads "-". The speed table gives each model's median
run time unsimplified and simplified, their ratio, the interquartile range of the ratios of
alternating pairs of runs, and the least CPU time of each.
On a shared machine run the speed part with OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1: CPU
time of a single-threaded BLAS is then a stable measure even while other processes load the
cores (multi-threaded BLAS spins, and wall time mostly measures the neighbours).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import ember  # noqa: E402
from ember.importer import import_model  # noqa: E402
from ember.importer.onnx_export import export_model  # noqa: E402
from ember.simplifier import simplify  # noqa: E402

TIMING_RUNS = 3  # each tool's time is its best of three (first calls pay for lazy imports)
MODELS = ["resnet", "mobilenet", "vit", "convnext", "bert", "distilbert", "gpt2", "lstm_gru"]
# and each dynamo model exported with `--raw` (no exporter optimiser), where built
MODELS_RAW = [f"{name}_raw" for name in MODELS if name != "lstm_gru"]


def cache_dir() -> str:
    import torch

    return os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")


def relative_difference(got: dict, want: dict) -> float:
    """max |got - want| / max |want| over all outputs."""
    worst = 0.0
    for name, expected in want.items():
        scale = float(np.max(np.abs(expected))) if expected.size else 0.0
        diff = float(np.max(np.abs(got[name].astype(np.float64) - expected))) if expected.size \
            else 0.0
        worst = max(worst, diff / scale if scale else diff)
    return worst


def onnxsim_nodes(path: str) -> tuple[int | None, float | None]:
    try:
        import onnx
        import onnxsim
    except ImportError:
        return None, None
    seconds = []
    for _ in range(TIMING_RUNS):
        proto = onnx.load(path)
        start = time.perf_counter()
        simplified, ok = onnxsim.simplify(proto)
        seconds.append(time.perf_counter() - start)
    return (len(simplified.graph.node) if ok else None), min(seconds)


def original_outputs(path: str, inputs: dict) -> dict:
    """The unsimplified model's outputs: onnxruntime's where installed, else ember's own with
    simplification off."""
    try:
        import onnxruntime
    except ImportError:
        return ember.load(path, simplify=False).run(inputs)
    onnxruntime.set_default_logger_severity(3)  # its constant folder warns about CastLike
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def compare(name: str) -> dict:
    path = os.path.join(cache_dir(), f"{name}.onnx")
    inputs = dict(np.load(os.path.join(cache_dir(), f"{name}.inputs.npz")))
    nodes_before = len(import_model(path).graph.nodes)
    reference = original_outputs(path, inputs)
    ember_seconds = []
    for _ in range(TIMING_RUNS):
        model = import_model(path)
        start = time.perf_counter()
        simplify(model)
        proto = export_model(model)  # ember's time includes writing the model back out
        ember_seconds.append(time.perf_counter() - start)
    simplified = ember.load(proto.SerializeToString()).run(inputs)
    sim_nodes, sim_seconds = onnxsim_nodes(path)
    return {"model": name, "before": nodes_before, "onnxsim": sim_nodes,
            "ember": len(proto.graph.node), "diff": relative_difference(simplified, reference),
            "onnxsim_s": sim_seconds, "ember_s": min(ember_seconds)}


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<15} {'before':>6} {'onnxsim':>7} {'ember':>6} {'max rel diff':>12} "
          f"{'onnxsim s':>9} {'ember s':>8}")
    for r in rows:
        sim = "-" if r["onnxsim"] is None else str(r["onnxsim"])
        sim_s = "-" if r["onnxsim_s"] is None else f"{r['onnxsim_s']:.3f}"
        print(f"{r['model']:<15} {r['before']:>6} {sim:>7} {r['ember']:>6} {r['diff']:>12.2e} "
              f"{sim_s:>9} {r['ember_s']:>8.3f}")


def run_times(session, inputs: dict) -> tuple[float, float]:
    """(wall, CPU) seconds of one run. CPU time (all of this process's threads) is reported
    too because on a shared, loaded machine wall time mostly measures the other processes."""
    wall, cpu = time.perf_counter(), time.process_time()
    session.run(inputs)
    return time.perf_counter() - wall, time.process_time() - cpu


# The speed models: the exporter's default output, whose own optimiser (onnxscript's) has
# already folded BatchNorm and constants, and the `--raw` export without it, as unsimplified
# models come (BatchNorm layers kept, weights transposed at run time, shape plumbing).
SPEED_MODELS = ["bert_full", "bert_full_raw", "resnet_full", "resnet_full_raw"]


def speed(name: str, repeats: int) -> None:
    path = os.path.join(cache_dir(), f"{name}.onnx")
    if not os.path.exists(path):
        flags = "--full-size" + (" --raw" if name.endswith("_raw") else "")
        print(f"{name}: {path} missing; build it with models/export_torch_models.py "
              f"{cache_dir()} --only {name.split('_')[0]} {flags}")
        return
    inputs = dict(np.load(os.path.join(cache_dir(), f"{name}.inputs.npz")))
    plain = ember.Session(import_model(path))
    fused = ember.Session(simplify(import_model(path)))
    diff = relative_difference(fused.run(inputs), plain.run(inputs))
    plain_times, fused_times = [], []
    for _ in range(repeats):  # alternate so drift in machine load hits both alike
        plain_times.append(run_times(plain, inputs))
        fused_times.append(run_times(fused, inputs))
    # medians of wall time, minima of CPU time (the least disturbed run), and the spread of
    # the per-pair wall ratios (each unsimplified run against the simplified run after it)
    a_wall, b_wall = (float(np.median([w for w, _ in t])) for t in (plain_times, fused_times))
    a_cpu, b_cpu = (min(c for _, c in t) for t in (plain_times, fused_times))
    pairs = [a[0] / b[0] for a, b in zip(plain_times, fused_times)]
    low, high = np.percentile(pairs, [25, 75])
    print(f"{name:<16} {len(plain.model.graph.nodes):>5} -> {len(fused.model.graph.nodes):<4} "
          f"{1e3 * a_wall:>7.1f} {1e3 * b_wall:>7.1f} {a_wall / b_wall:>6.2f}x "
          f"[{low:.2f}-{high:.2f}] {1e3 * a_cpu:>7.0f} {1e3 * b_cpu:>7.0f} "
          f"{a_cpu / b_cpu:>5.2f}x {diff:>9.1e}")


def print_speed_header() -> None:
    print(f"{'model':<16} {'nodes':>13} {'ms':>7} {'ms simp':>7} {'wall':>7} {'pair IQR':>11} "
          f"{'CPU ms':>7} {'simp':>7} {'CPU':>6} {'max diff':>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(
        name for pair in zip(MODELS, MODELS_RAW + [None]) for name in pair if name))
    parser.add_argument("--speed", action="store_true", help="also time BERT-base and ResNet-50")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        if not os.path.exists(os.path.join(cache_dir(), f"{name}.onnx")):
            print(f"{name}: not built (models/export_torch_models.py or "
                  "benchmarks/simplify_models.py)")
            continue
        rows.append(compare(name))
    print_table(rows)
    if args.speed:
        print_speed_header()
        for name in SPEED_MODELS:
            speed(name, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
