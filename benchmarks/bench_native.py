"""A generated native module against the graph executor, on one backend, in one process.

    python benchmarks/bench_native.py [--model resnet_full] [--rounds 20] [--backend cpu]

Converts the model (timed: the 100 MB conversion target is 30 s), then runs the module and
`ember.load(...).run` alternately (ABBA) so machine noise hits both alike, and reports medians and
the ratio module / executor (<= 1.0: the module is no slower). Models come from
models/export_torch_models.py (ResNet-50 at 224x224 is `resnet_full`, built with --full-size).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))

import ember  # noqa: E402
from ember.native import convert  # noqa: E402
from ember.native.testing import as_list, identical, import_generated  # noqa: E402


def model_path(name: str) -> tuple[str, dict]:
    import export_torch_models as etm
    import torch

    full = name.endswith("_full")
    cache = os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
    path = os.path.join(cache, f"{name}.onnx")
    if not os.path.exists(path):
        etm.export(name[: -len("_full")] if full else name, cache, full_size=full)
    return path, dict(np.load(os.path.join(cache, f"{name}.inputs.npz")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet_full")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args(argv)

    path, feeds = model_path(args.model)
    out = tempfile.mkdtemp(prefix="ember-bench-native-")
    try:
        t0 = time.perf_counter()
        convert(path, out, progress=False)
        convert_s = time.perf_counter() - t0
        size_mb = os.path.getsize(path) / 1e6
        t0 = time.perf_counter()
        module = import_generated(out).Model(backend=args.backend)
        build_s = time.perf_counter() - t0
        session = ember.load(path, backend=args.backend)
        names = [i.name for i in session.inputs]
        args_in = [feeds[n] for n in names]

        def run_module():
            return as_list(module(*args_in), len(session.outputs))

        def run_executor():
            result = session.run(feeds)
            return [result[o.name] for o in session.outputs]

        same = all(identical(a, b) is None for a, b in zip(run_module(), run_executor()))
        times: dict[str, list[float]] = {"module": [], "executor": []}
        cpu: dict[str, list[float]] = {"module": [], "executor": []}  # CPU seconds, all threads
        pair = [("module", run_module), ("executor", run_executor)]
        for i in range(args.rounds):
            for label, fn in (pair if i % 2 == 0 else pair[::-1]):  # ABBA: no order bias
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                times[label].append(time.perf_counter() - start)
                cpu[label].append(time.process_time() - start_cpu)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}  # robust to other load on the machine
        print(f"{args.model} ({size_mb:.0f} MB) on {args.backend}: convert {convert_s:.1f}s, "
              f"module import+bind {build_s:.2f}s")
        for label in ("module", "executor"):
            print(f"  {label:8s} median {med[label] * 1e3:8.1f} ms, best {best[label] * 1e3:8.1f} ms"
                  f" ({args.rounds} runs)")
        cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
        print(f"  ratio module/executor: median {med['module'] / med['executor']:.3f}, best "
              f"{best['module'] / best['executor']:.3f}, median CPU time "
              f"{cpu_med['module'] / cpu_med['executor']:.3f}; outputs bit-identical: {same}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
