"""Convert every ONNX node-suite case the graph executor passes into a native module, check
the generated model.py compiles, and compare its outputs with the executor's bit for bit.

    python benchmarks/native_suite.py [-k PATTERN] [--backend cpu]
    python benchmarks/native_suite.py --models [--backend cpu]

Prints the counts and every case that does not convert or differs, with the reason. With
--models: the exported PyTorch models and the light model zoo instead, each compared with
onnxruntime (1e-4 relative to the output's largest magnitude) and with the executor (bits).
"""
from __future__ import annotations

import fnmatch
import os
import py_compile
import shutil
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import ember  # noqa: E402
from ember.native import convert  # noqa: E402
from ember.native.testing import as_list, identical, import_generated, scratch_dir  # noqa: E402
from onnx_suites import (assert_outputs_match, light_models, load_case_dir,  # noqa: E402
                         load_light_case, suite_case_dirs)

TORCH_CACHE = os.path.join(os.path.dirname(HERE), ".cache", "torch-models-2.13.0+cpu")
TORCH_MODELS = ("resnet", "mobilenet", "vit", "bert", "gpt2", "lstm_gru")

# Ops drawing random numbers without a seed: two runs never agree, so nothing to compare.
UNSEEDED_RANDOM = ("bernoulli", "dropout_random", "randomnormal", "randomuniform")


def check_case(case_dir: str, backend: str, root: str) -> tuple[str, str]:
    """('ok' | 'executor-fails' | 'convert-fails' | 'differs' | 'random', reason)."""
    case = load_case_dir(case_dir)
    try:
        session = ember.load(case.model_path, backend=backend, simplify=False)
        expected = []
        for inputs, want in case.data_sets:
            got = session.run(inputs)
            got = [got[o.name] for o in session.outputs]
            assert_outputs_match(want, got, case.rtol, case.atol)
            expected.append(got)
    except Exception as exc:  # not a case the executor passes: out of scope
        return "executor-fails", f"{type(exc).__name__}: {exc}"[:200]
    out = os.path.join(root, case.name)
    try:
        convert(case.model_path, out, progress=False)
        py_compile.compile(os.path.join(out, "model.py"), doraise=True)
        model = import_generated(out).Model(backend=backend)
    except Exception as exc:
        return "convert-fails", f"{type(exc).__name__}: {exc}"[:300]
    for (inputs, _), want in zip(case.data_sets, expected):
        try:
            got = as_list(model(*[inputs[i.name] for i in session.inputs if i.name in inputs]),
                          len(session.outputs))
        except Exception as exc:
            return "differs", f"module raised {type(exc).__name__}: {exc}"[:300]
        for i, (w, g) in enumerate(zip(want, got)):
            why = identical(w, g)
            if why:
                if any(r in case.name for r in UNSEEDED_RANDOM):
                    return "random", "unseeded random op"
                return "differs", f"output {i}: {why}"
    return "ok", ""


def model_items() -> list[tuple[str, dict]]:
    import numpy as np

    items = [(os.path.join(TORCH_CACHE, f"{n}.onnx"),
              dict(np.load(os.path.join(TORCH_CACHE, f"{n}.inputs.npz"))))
             for n in TORCH_MODELS if os.path.exists(os.path.join(TORCH_CACHE, f"{n}.onnx"))]
    return items + [(p, load_light_case(p).data_sets[0][0]) for p in light_models()]


def check_models(backend: str) -> int:
    import numpy as np
    import onnxruntime as ort

    root, failures = scratch_dir(), 0
    for path, feeds in model_items():
        name = os.path.basename(path)
        try:
            start = time.perf_counter()
            convert(path, os.path.join(root, name), progress=False)
            convert_s = time.perf_counter() - start
            model = import_generated(os.path.join(root, name)).Model(backend=backend)
            sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            want = sess.run(None, feeds)
            got = as_list(model(*[feeds[i.name] for i in sess.get_inputs()]), len(want))
            session = ember.load(path, backend=backend, simplify=False)
            ran = session.run(feeds)
            same = all(identical(ran[o.name], g) is None for o, g in zip(session.outputs, got))
            worst = max(float(np.max(np.abs(g.astype(np.float64) - w))) /
                        max(float(np.max(np.abs(w))), 1e-30) for w, g in zip(want, got))
            ok = worst <= 1e-4 and same
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: convert {convert_s:.1f}s, max error "
                  f"{worst:.1e} of the output scale vs onnxruntime, bit-identical to the "
                  f"executor: {same}")
        except Exception as exc:
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}"[:300])
    shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    pattern = argv[argv.index("-k") + 1] if "-k" in argv else "*"
    backend = argv[argv.index("--backend") + 1] if "--backend" in argv else "cpu"
    if "--models" in argv:
        return check_models(backend)
    dirs = [d for d in suite_case_dirs("node") if fnmatch.fnmatch(os.path.basename(d), f"*{pattern}*")]
    root = scratch_dir()
    counts: dict[str, list] = {}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for d in dirs:
            status, reason = check_case(d, backend, root)
            counts.setdefault(status, []).append((os.path.basename(d), reason))
    shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - start
    passed_by_executor = len(dirs) - len(counts.get("executor-fails", []))
    print(f"{len(dirs)} node cases, {passed_by_executor} pass in the executor on {backend}; "
          f"of those: {len(counts.get('ok', []))} convert, compile and match bit for bit "
          f"({seconds:.0f}s)")
    for status in ("convert-fails", "differs", "random"):
        for name, reason in counts.get(status, []):
            print(f"  {status}: {name}: {reason}")
    return 0 if not counts.get("convert-fails") and not counts.get("differs") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
