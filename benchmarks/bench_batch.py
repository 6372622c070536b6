"""Throughput of `ember batch`: the local engine, and the Ray engine with 1 and 2 workers.

    python benchmarks/bench_batch.py [--model cnn|mlp|PATH.onnx] [--rows 16000] [--files 4]
        [--batch-size 64] [--rounds 3] [--configs local,ray1,ray2] [--json FILE]

The dataset is generated once in a temporary folder: `--rows` random examples for the
model's input in `--files` Parquet files (row groups of 1,000 rows; the cells as
arrow.fixed_shape_tensor), with an id column. The default model is the demo CNN
(models/cnn.onnx, 3x32x32 images).

Every measurement is a fresh process (this script with --worker) running one configuration,
so no engine inherits another's threads, caches or Ray instance. The configurations are
interleaved: each round runs each once, in an order rotated from round to round; the report
gives per configuration the median rows/s over the rounds and the min–max spread. A Ray
worker process starts its local Ray first (ray.init(num_cpus=2 or the CPUs it has), timed
apart, "ray.init s"); the rows/s of every configuration count from the call to run_batch to
its return, so the Ray figures include starting the actor pool and loading the model in each
actor. Each run's outputs are compared with the first local run's (they must be equal).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODELS = {"cnn": os.path.join(REPO, "models", "cnn.onnx"),
          "mlp": os.path.join(REPO, "models", "mlp.onnx")}
CONFIGS = {"local": ("local", None), "ray1": ("ray", 1), "ray2": ("ray", 2)}


def make_dataset(model: str, folder: str, rows: int, files: int) -> None:
    """Random rows for the model's input (symbolic dimensions of size 1 after the batch)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ember

    (info,) = ember.load(model).inputs
    shape = [d if isinstance(d, int) else 1 for d in info.shape[1:]]
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    start = 0
    for i, count in enumerate(np.diff(np.linspace(0, rows, files + 1).astype(int))):
        x = rng.standard_normal((count, *shape)).astype(info.dtype)
        column = pa.FixedShapeTensorArray.from_numpy_ndarray(x) if shape else pa.array(x)
        table = pa.table({"id": np.arange(start, start + count), info.name: column})
        pq.write_table(table, os.path.join(folder, f"part-{i}.parquet"), row_group_size=1000)
        start += count


def worker(args: argparse.Namespace) -> None:
    """One measurement: run one configuration, print a JSON line."""
    engine, workers = CONFIGS[args.worker]
    ray_init = 0.0
    if engine == "ray":
        import logging

        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
                 logging_level=logging.ERROR)
        ray_init = time.perf_counter() - t0
    from ember.batch import run_batch

    report = run_batch(args.model_path, args.data, args.out, batch_size=args.batch_size,
                       engine=engine, workers=workers)
    print(json.dumps({"rows": report.rows, "seconds": report.seconds, "ray_init": ray_init}))


def outputs_equal(a: str, b: str) -> bool:
    import pyarrow.parquet as pq

    return sorted(os.listdir(a)) == sorted(os.listdir(b)) and all(
        pq.read_table(os.path.join(a, f)).equals(pq.read_table(os.path.join(b, f)))
        for f in os.listdir(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="cnn, mlp (demo models) or an .onnx path")
    parser.add_argument("--rows", type=int, default=16000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="local,ray1,ray2")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    model = MODELS.get(args.model, args.model)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    root = tempfile.mkdtemp(prefix="ember_bench_batch_")
    try:
        data = os.path.join(root, "data")
        make_dataset(model, data, args.rows, args.files)
        print(f"{args.rows:,} rows of {os.path.basename(model)} in {args.files} files, batch "
              f"{args.batch_size}, {args.rounds} rounds, {os.cpu_count()} CPUs", flush=True)
        results: dict[str, list[dict]] = {c: [] for c in configs}
        reference = None
        for round_ in range(args.rounds):
            order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
            for config in order:
                out = os.path.join(root, f"out_{config}_{round_}")
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", config, "--data", data, "--out", out,
                     "--model-path", model, "--batch-size", str(args.batch_size)],
                    capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    sys.exit(f"{config} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if reference is None and config == "local":
                    reference = out
                result["equal"] = reference is None or outputs_equal(reference, out)
                results[config].append(result)
                print(f"  round {round_ + 1} {config:>5}: {result['rows'] / result['seconds']:9,.0f} "
                      f"rows/s ({result['seconds']:.2f} s)"
                      + ("" if result["equal"] else "  OUTPUTS DIFFER"), flush=True)
                if out != reference:
                    shutil.rmtree(out, ignore_errors=True)
        print("\n| configuration | rows/s (median) | spread (min–max) | ray.init s |\n|---|---|---|---|")
        summary = {}
        for config in configs:
            rates = [r["rows"] / r["seconds"] for r in results[config]]
            init = statistics.median(r["ray_init"] for r in results[config])
            summary[config] = {"median_rows_per_s": statistics.median(rates),
                               "min": min(rates), "max": max(rates), "ray_init_s": init,
                               "outputs_equal": all(r["equal"] for r in results[config])}
            print(f"| {config} | {statistics.median(rates):,.0f} | {min(rates):,.0f}–"
                  f"{max(rates):,.0f} | {init:.1f} |" if CONFIGS[config][0] == "ray" else
                  f"| {config} | {statistics.median(rates):,.0f} | {min(rates):,.0f}–"
                  f"{max(rates):,.0f} | - |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": args.rows, "model": model, "batch_size": args.batch_size,
                           "results": summary}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
