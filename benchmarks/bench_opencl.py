"""OpenCL backend speed, side by side with the CPU, in one process.

    python benchmarks/bench_opencl.py [--rounds N] [--size 1024] [--no-resnet]

* GEMM: float32 SIZE^3 through ember's OpenCL GEMM (pack A, pack B, register-blocked kernel,
  operands and result resident on the device, timed to queue completion) against np.matmul,
  in GFLOP/s.
* ResNet-50 at 224x224 (models/export_torch_models.py exports it from PyTorch; nothing is
  downloaded): latency of a session on the OpenCL backend against one on the CPU backend,
  host inputs in and host outputs out, plus their largest relative difference.

Contenders are timed alternately in each round, so machine noise hits them alike; figures are
medians over the rounds. `EMBER_OPENCL_DEVICE` picks the OpenCL device (default: a GPU if any,
else PoCL's CPU device).
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


def _median_alternating(fns: dict, rounds: int) -> dict:
    for fn in fns.values():  # warm-up (compiles kernels, fills caches)
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_gemm(size: int, rounds: int) -> dict:
    from ember.ops.opencl.linalg import gemm_packed, pack_a, pack_b
    from ember.runtime.backends import get_backend

    be = get_backend("opencl")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    da, db = be.to_device(a), be.to_device(b)
    out = be.empty((1, size, size), np.float32)

    def opencl():
        ap = pack_a(be, da, size, size, size, 1, role="A")
        bp = pack_b(be, db, size, size, size, 1, role="B")
        gemm_packed(be, ap, bp, size, size, size, [0], [0], np.float32, out=out)
        be.queue.finish()

    def numpy():
        np.matmul(a, b)

    opencl()
    err = float(np.abs(out.get()[0] - a @ b).max() / np.abs(a @ b).max())
    med = _median_alternating({"opencl": opencl, "numpy": numpy}, rounds)
    flops = 2.0 * size ** 3
    return {"device": be.describe(), "opencl_gflops": flops / med["opencl"] * 1e-9,
            "numpy_gflops": flops / med["numpy"] * 1e-9, "max_rel_err": err}


def _resnet() -> tuple[str, dict]:
    import export_torch_models as etm
    import torch

    cache = os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
    path = os.path.join(cache, "resnet_full.onnx")
    if not os.path.exists(path):
        etm.export("resnet", cache, full_size=True)
    return path, dict(np.load(os.path.join(cache, "resnet_full.inputs.npz")))


def bench_resnet(rounds: int) -> dict:
    path, feeds = _resnet()
    sessions = {b: ember.load(path, backend=b) for b in ("opencl", "cpu")}
    outs = {b: s.run(feeds) for b, s in sessions.items()}
    err = max(float(np.abs(outs["opencl"][k] - outs["cpu"][k]).max()
                    / max(np.abs(outs["cpu"][k]).max(), 1e-30)) for k in outs["cpu"])
    placed = sessions["opencl"].placement_summary()
    med = _median_alternating({b: (lambda s=s: s.run(feeds)) for b, s in sessions.items()},
                              rounds)
    return {"opencl_ms": med["opencl"] * 1e3, "cpu_ms": med["cpu"] * 1e3, "max_rel_err": err,
            "placement": placed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--no-resnet", action="store_true")
    args = parser.parse_args(argv)
    g = bench_gemm(args.size, args.rounds)
    print(f"device: {g['device']}")
    n = args.size
    print(f"GEMM {n}x{n}x{n} float32   opencl {g['opencl_gflops']:7.1f} GFLOP/s   "
          f"numpy {g['numpy_gflops']:7.1f} GFLOP/s   opencl/numpy "
          f"{g['opencl_gflops'] / g['numpy_gflops']:.2f}   (max rel err {g['max_rel_err']:.1e})")
    if not args.no_resnet:
        r = bench_resnet(args.rounds)
        print(f"ResNet-50 224x224        opencl {r['opencl_ms']:7.1f} ms        cpu "
              f"{r['cpu_ms']:7.1f} ms        opencl/cpu {r['opencl_ms'] / r['cpu_ms']:.2f}   "
              f"(max rel err {r['max_rel_err']:.1e}; nodes {r['placement']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
