"""Runs every ONNX node case through import -> simplify -> Session and checks the expected
outputs, and checks that the simplified model exports to a valid ONNX model.

    python benchmarks/simplify_suite.py [--suite S] [-k PATTERN] [--backend B] [--no-export-check]
                                        [--round-trip]

--round-trip instead checks import -> export -> import without any pass: outputs identical
(bit for bit) to the directly imported model's, and the exported model valid.

S is node (default), simple, pytorch-converted, pytorch-operator or light.

Prints failures, how often each pass changed a case, and the totals; the target is the same
number of passing cases as without simplification (cases listed in tests/xfail_cpu.txt are
skipped, as they fail without simplification too).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time

import onnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from onnx_suites import (assert_outputs_match, light_models, load_case_dir,  # noqa: E402
                         load_light_case, load_xfails, suite_case_dirs)

import ember  # noqa: E402
from ember.importer import import_model  # noqa: E402
from ember.importer.onnx_export import export_model  # noqa: E402
from ember.simplifier import simplify  # noqa: E402


def round_trip_one(case_dir: str, backend: str) -> None:
    """Exporting the unsimplified IR gives a valid model computing exactly the same."""
    case = load_light_case(case_dir) if case_dir.endswith(".onnx") else load_case_dir(case_dir)
    proto = export_model(import_model(case.model_path))
    if _checker_accepts(onnx.load(case.model_path)):
        onnx.checker.check_model(proto, full_check=True)
    direct, exported = ember.load(case.model_path, backend), ember.load(proto, backend)
    for inputs, _ in case.data_sets:
        want = list(direct.run(inputs).values())
        got = list(exported.run(inputs).values())
        assert_outputs_match(want, got, rtol=0, atol=0)


def _checker_accepts(proto: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception:
        return False
    return True


def run_one(case_dir: str, backend: str, export_check: bool, pass_counts: dict) -> None:
    case = load_light_case(case_dir) if case_dir.endswith(".onnx") else load_case_dir(case_dir)
    model = import_model(case.model_path)
    stats: dict = {}
    simplify(model, backend=backend, stats=stats)
    for name, count in stats.items():
        if name not in ("rounds", "seconds"):
            pass_counts[name] = pass_counts.get(name, 0) + 1
    session = ember.Session(model, backend)
    for inputs, expected in case.data_sets:
        result = session.run(inputs)
        assert_outputs_match(expected, [result[o.name] for o in session.outputs],
                             case.rtol, case.atol)
    if export_check:
        proto = export_model(model)
        if _checker_accepts(onnx.load(case.model_path)):  # valid in, valid out
            onnx.checker.check_model(proto, full_check=True)


def _case_name(path: str, suite: str) -> str:
    name = os.path.basename(path)
    return "light_" + name[:-5] if suite == "light" else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="node")
    parser.add_argument("-k", default="*", help="glob on case names")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--no-export-check", action="store_true")
    parser.add_argument("--round-trip", action="store_true",
                        help="check import -> export -> import without passes instead")
    args = parser.parse_args(argv)
    xfails = load_xfails(os.path.join(REPO, "tests", "xfail_cpu.txt"))
    every = light_models() if args.suite == "light" else suite_case_dirs(args.suite)
    dirs = [d for d in every if fnmatch.fnmatch(os.path.basename(d), f"*{args.k}*")
            and _case_name(d, args.suite) not in xfails]
    passed, failed, counts = 0, [], {}
    start = time.perf_counter()
    for d in dirs:
        try:
            if args.round_trip:
                round_trip_one(d, args.backend)
            else:
                run_one(d, args.backend, not args.no_export_check, counts)
            passed += 1
        except Exception as exc:  # report every failure, keep going
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            failed.append((os.path.basename(d), f"{type(exc).__name__}: {text}"))
    for name, why in failed:
        print(f"FAIL {name}: {why}")
    print("cases changed per pass: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"{passed} passed, {len(failed)} failed ({len(xfails)} xfail-listed cases skipped) "
          f"in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
