"""Peak memory of `ember check --bisect` against a plain run, on BERT-base.

    python models/export_torch_models.py .cache/torch-models-2.13.0+cpu --only bert --full-size
    python benchmarks/bench_check_memory.py [MODEL.onnx] [--inputs FILE.npz] [--ort]

Each scenario runs in a fresh Python process, which reports its own peak resident set
(`ru_maxrss`), so the figures do not mix. The target: bisect's peak under 2x the plain run's.
`--ort` adds the same pair with onnxruntime as the reference.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import resource, sys, numpy as np
model, inputs = sys.argv[1], sys.argv[2]
with np.load(inputs) as data:
    feeds = {k: data[k] for k in data.files}
"""

SCENARIOS = {
    "plain run (ember.load + run)":
        "import ember\nember.load(model).run(feeds)",
    "check --ref cpu":
        "from ember import golden\nassert golden.check(model, 'cpu', 'cpu', inputs=feeds).passed",
    "check --ref cpu --bisect":
        "from ember import golden\n"
        "r = golden.check(model, 'cpu', 'cpu', inputs=feeds, bisect=True)\n"
        "assert r.passed and not r.backends[0].bisect.found",
}
ORT_SCENARIOS = {
    "check --ref onnxruntime":
        "from ember import golden\n"
        "assert golden.check(model, 'cpu', 'onnxruntime', inputs=feeds).passed",
    "check --ref onnxruntime --bisect":
        "from ember import golden\n"
        "r = golden.check(model, 'cpu', 'onnxruntime', inputs=feeds,"
        " bisect=True)\n"
        "assert r.passed and not r.backends[0].bisect.found",
}
_REPORT = "\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"  # KiB on Linux


def peak_mib(code: str, model: str, inputs: str) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `code` run in a fresh interpreter."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PRELUDE + code + _REPORT, model, inputs],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"scenario failed:\n{code}\n{done.stderr}")
    return int(done.stdout.split()[-1]) / 1024, time.perf_counter() - start


def default_model() -> str | None:
    found = sorted(glob.glob(os.path.join(REPO, ".cache", "torch-models*", "bert_full.onnx")))
    return found[-1] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=default_model())
    parser.add_argument("--inputs", help="default: MODEL with .inputs.npz")
    parser.add_argument("--ort", action="store_true", help="also measure --ref onnxruntime")
    args = parser.parse_args()
    if not args.model:
        raise SystemExit("no bert_full.onnx found; build it with models/export_torch_models.py "
                         ".cache/torch-models-2.13.0+cpu --only bert --full-size")
    inputs = args.inputs or args.model[:-len(".onnx")] + ".inputs.npz"
    scenarios = {**SCENARIOS, **(ORT_SCENARIOS if args.ort else {})}
    print(f"model {os.path.relpath(args.model, REPO)}")
    peaks = {}
    for name, code in scenarios.items():
        peaks[name], seconds = peak_mib(code, args.model, inputs)
        print(f"  {name:<34} peak {peaks[name]:8.0f} MiB  ({seconds:.1f} s)")
    plain = peaks["plain run (ember.load + run)"]
    ratio = peaks["check --ref cpu --bisect"] / plain
    print(f"bisect (--ref cpu) peak / plain run peak: {ratio:.2f}x (target < 2x)")
    if args.ort:
        ort_ratio = peaks["check --ref onnxruntime --bisect"] / peaks["check --ref onnxruntime"]
        print(f"bisect (--ref onnxruntime) peak / check (--ref onnxruntime) peak: {ort_ratio:.2f}x")
    return 0 if ratio < 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
