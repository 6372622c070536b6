"""OpenCL on the exported models: compile counts and times from a cold and from a warm cache,
and latency against the CPU backend.

    python benchmarks/bench_opencl_models.py [--rounds 5] [--models resnet,bert,...]

For each model of models/export_torch_models.py (exported once into .cache/; `_raw`: without
the exporter's optimiser; `_full`: ResNet-50 at 224x224, BERT-base at sequence 128):
* cold: a new process with empty ember and PoCL caches loads the model and runs it once:
  programs compiled from source, seconds spent compiling, time of the first run;
* warm: another new process on the caches the cold one left: the same figures;
* latency: the OpenCL and the CPU backend each in a process of its own, the processes
  interleaved over the rounds; the median run time of each round's 10 runs, then the median
  and the spread (min-max) over the rounds, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exported(name: str) -> tuple[str, str]:
    sys.path.insert(0, os.path.join(REPO, "models"))
    import export_torch_models as etm
    import torch

    cache = os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
    path = os.path.join(cache, f"{name}.onnx")
    if not os.path.exists(path):  # NAME, NAME_raw, NAME_full (ResNet-50 at 224, BERT-base)
        base = name.removesuffix("_raw").removesuffix("_full")
        etm.export(base, cache, full_size=name.endswith("_full"), raw=name.endswith("_raw"))
    return path, path[:-len(".onnx")] + ".inputs.npz"


def _worker(mode: str, backend: str, path: str, inputs_path: str) -> dict:
    import ember
    from ember.runtime.backends import get_backend

    feeds = dict(np.load(inputs_path))
    start = time.perf_counter()
    session = ember.load(path, backend=backend)
    session.run(feeds)
    first = time.perf_counter() - start
    be = get_backend(backend)
    result = {"first_s": first, "compiled": getattr(be, "compiled_from_source", 0),
              "compile_s": getattr(be, "compile_seconds", 0.0)}
    if mode == "latency":
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            session.run(feeds)
            times.append(time.perf_counter() - t0)
        result["run_s"] = statistics.median(times)
    return result


def _spawn(mode: str, backend: str, path: str, inputs_path: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker",
                           json.dumps([mode, backend, path, inputs_path])],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} {backend} {os.path.basename(path)} failed "
                           f"({done.returncode}): {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="resnet,mobilenet,vit,bert,gpt2,lstm_gru,"
                                            "resnet_raw,vit_raw,bert_raw")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*json.loads(args.worker))))
        return 0
    print("| model | cold: compiled, compile s, first run s | warm: compiled, first run s "
          "| OpenCL ms (spread) | CPU ms (spread) | OpenCL / CPU |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path, inputs_path = _exported(name)
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "EMBER_CACHE_DIR": os.path.join(cache, "ember"),
                   "POCL_CACHE_DIR": os.path.join(cache, "pocl")}
            cold = _spawn("first", "opencl", path, inputs_path, env)
            warm = _spawn("first", "opencl", path, inputs_path, env)
            runs: dict[str, list[float]] = {"opencl": [], "cpu": []}
            for _ in range(args.rounds):
                for backend in runs:
                    runs[backend].append(_spawn("latency", backend, path, inputs_path,
                                                env)["run_s"] * 1e3)
        med = {b: statistics.median(v) for b, v in runs.items()}
        print(f"| {name} | {cold['compiled']}, {cold['compile_s']:.2f}, {cold['first_s']:.2f} "
              f"| {warm['compiled']}, {warm['first_s']:.2f} "
              + " ".join(f"| {med[b]:.1f} ({min(v):.1f}-{max(v):.1f})" for b, v in runs.items())
              + f" | {med['opencl'] / med['cpu']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
