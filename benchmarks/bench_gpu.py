"""GPU throughput of ember's CUDA backend against onnxruntime's CUDA provider (where
onnxruntime-gpu is installed): ResNet-50 at batch 64 (224x224) and BERT-base at sequence 128,
batch 32, in samples per second.

    python benchmarks/bench_gpu.py [--rounds 3] [--iters 10] [--models resnet50,bert_base]

Each runtime runs in a process of its own (a runtime's threads and memory pools would distort
another's in one process), the processes interleaved over the rounds; the figure is the median
of the rounds, with the spread (min-max). Models are exported from PyTorch by
models/export_torch_models.py at the benchmark's batch sizes, once, into .cache/ (nothing is
downloaded). tests/gpu_check.sh runs this on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = {"resnet50": 64, "bert_base": 32}


def export(name: str) -> tuple[str, str]:
    """(model path, inputs .npz path) of `name` at its benchmark batch size."""
    sys.path.insert(0, os.path.join(REPO, "models"))
    import export_torch_models as etm
    import torch

    cache = os.path.join(REPO, ".cache", f"gpu-bench-{torch.__version__}")
    path = os.path.join(cache, f"{name}_b{BATCH[name]}.onnx")
    if not os.path.exists(path):
        base = {"resnet50": "resnet", "bert_base": "bert"}[name]
        factory, inputs, outputs, exporter = etm.model_specs(full_size=True)[base]
        rng = np.random.default_rng(0)
        batch = BATCH[name]
        if name == "resnet50":
            inputs = {"image": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}
        else:
            inputs = etm._token_inputs(rng, batch, 128, 30522)
        etm.export_module(factory, inputs, outputs, exporter, False, path)
    return path, path[:-len(".onnx")] + ".inputs.npz"


def measure(runtime: str, path: str, inputs_path: str, iters: int) -> float:
    """Samples per second of `runtime` ("ember" or "onnxruntime"), after two warm-up runs."""
    feeds = dict(np.load(inputs_path))
    batch = next(iter(feeds.values())).shape[0]
    if runtime == "ember":
        import ember
        from ember.runtime.backends import get_backend

        session = ember.load(path, backend="cuda")
        backend = get_backend("cuda")

        def run():
            session.run(feeds)
            backend.synchronize()
    else:
        import onnxruntime as ort

        session = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
        if "CUDAExecutionProvider" not in session.get_providers():
            raise SystemExit("onnxruntime has no CUDA provider here")

        def run():
            session.run(None, feeds)
    run()
    run()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    return batch * iters / (time.perf_counter() - start)


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # runtime,path,inputs,iters
    args = parser.parse_args(argv)
    if args.worker:
        runtime, path, inputs_path, iters = args.worker.split(",")
        print(json.dumps(measure(runtime, path, inputs_path, int(iters))))
        return 0
    runtimes = ["ember"] + (["onnxruntime"] if _ort_has_cuda() else [])
    if len(runtimes) == 1:
        print("onnxruntime's CUDA provider is not installed: ember alone")
    for name in args.models.split(","):
        path, inputs_path = export(name)
        samples: dict[str, list[float]] = {r: [] for r in runtimes}
        for _ in range(args.rounds):
            for runtime in runtimes:
                done = subprocess.run(
                    [sys.executable, __file__, "--worker",
                     f"{runtime},{path},{inputs_path},{args.iters}"],
                    capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{name} {runtime}: failed\n{done.stderr[-2000:]}")
                    continue
                samples[runtime].append(float(done.stdout.strip().splitlines()[-1]))
        line = [f"{name} (batch {BATCH[name]}):"]
        for runtime, values in samples.items():
            if values:
                line.append(f"{runtime} {statistics.median(values):.1f} samples/s "
                            f"({min(values):.1f}-{max(values):.1f})")
        if all(samples.values()) and len(runtimes) == 2:
            ratio = statistics.median(samples["ember"]) / statistics.median(samples["onnxruntime"])
            line.append(f"ember / onnxruntime {ratio:.2f}")
        print(" ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
