"""CPU latency of ember against onnxruntime and onnx's ReferenceEvaluator, in one process.

    python benchmarks/bench_cpu.py [--rounds N] [--models resnet50,bert_base,...] [--no-reference]

Runtimes are timed alternately (ember, onnxruntime, reference, ember, ...) so that machine
noise hits them alike; each figure is the median over the rounds. Models are exported from
PyTorch by models/export_torch_models.py (needs torch; nothing is downloaded): ResNet-50 at
224x224 and BERT-base at sequence 128 (`--full-size`), plus the small test models.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))

import ember  # noqa: E402


def _model(name: str) -> tuple[str, dict]:
    import export_torch_models as etm
    import torch

    full = name.endswith("_full")
    base = name[: -len("_full")] if full else name
    cache = os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
    path = os.path.join(cache, f"{name}.onnx")
    if not os.path.exists(path):
        etm.export(base, cache, full_size=full)
    return path, dict(np.load(os.path.join(cache, f"{name}.inputs.npz")))


ALIASES = {"resnet50": "resnet_full", "bert_base": "bert_full"}


def _time(fn, feeds) -> float:
    t0 = time.perf_counter()
    fn(feeds)
    return time.perf_counter() - t0


def bench(name: str, rounds: int, with_reference: bool) -> dict:
    import onnxruntime as ort

    path, feeds = _model(ALIASES.get(name, name))
    runners = {"ember": ember.load(path).run}
    opts = ort.SessionOptions()
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    runners["onnxruntime"] = lambda f: sess.run(None, f)
    if with_reference:
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(path)
        runners["reference"] = lambda f: ref.run(None, f)
    for run in runners.values():  # warm-up
        run(feeds)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for key, run in runners.items():
            times[key].append(_time(run, feeds))
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"model": name, **medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", default="resnet50,bert_base,resnet,mobilenet,vit,bert,gpt2,lstm_gru")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip onnx's ReferenceEvaluator (slow on big models)")
    args = parser.parse_args(argv)
    print(f"{'model':<12} {'ember ms':>10} {'ort ms':>10} {'ref ms':>10} {'ember/ort':>10} "
          f"{'ember/ref':>10}")
    for name in args.models.split(","):
        r = bench(name, args.rounds, not args.no_reference)
        ref = r.get("reference")
        ref_ms = f"{ref:.2f}" if ref else "-"
        vs_ref = f"{r['ember'] / ref:.2f}" if ref else "-"
        print(f"{name:<12} {r['ember']:>10.2f} {r['onnxruntime']:>10.2f} {ref_ms:>10} "
              f"{r['ember'] / r['onnxruntime']:>10.2f} {vs_ref:>10}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
