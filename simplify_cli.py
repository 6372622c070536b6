"""`ember simplify IN.onnx -o OUT.onnx [--target onnx|ember[:B]] [--input-shape NAME:DIMS]
[--check N [--rtol R] [--atol A]] [--skip PASS ...]`: writes the simplified model (standard
ONNX at the model's own opsets unless the target is ember), prints the op counts before and
after, and the largest output difference between the two models on random inputs; with
--check, N random input sets, and exit code 1 when an output differs past the tolerances."""
from __future__ import annotations

import argparse
import time

import numpy as np

from ember.errors import EmberError, InputError
from ember.importer import import_model
from ember.importer.onnx_export import export_model, save_onnx
from ember.ir import Model
from ember.simplifier import PASSES
from ember.simplifier.api import parse_input_shapes, parse_target, simplify_model


def add_simplify_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `simplify` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "simplify", help="rewrite a model smaller and faster",
        description="Run the simplifier's passes on a model and write the result as ONNX; print "
                    "the op counts before and after, and the largest output difference between "
                    "the two models on random inputs.")
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.onnx",
                        help="where to write the simplified model")
    parser.add_argument("--skip", action="append", default=[], metavar="PASS",
                        help=f"leave a pass out (repeatable): {', '.join(PASSES)}")
    parser.add_argument("--target", default="onnx", metavar="onnx|ember[:BACKEND]",
                        help="onnx (default): standard ONNX at the model's own opsets, for any "
                             "runtime; ember[:BACKEND]: ember's fused ops where the backend "
                             "has kernels for them, ops it lacks expanded")
    parser.add_argument("--backend", default=None,
                        help="the same as --target ember:BACKEND")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMS",
                        help="fix an input's shape before folding, e.g. x:1,3,224,224 "
                             "(repeatable)")
    parser.add_argument("--check", type=int, default=0, metavar="N",
                        help="compare the two models on N random input sets; exit 1 if an "
                             "output differs past --rtol / --atol")
    parser.add_argument("--rtol", type=float, default=1e-4, help="for --check (default 1e-4)")
    parser.add_argument("--atol", type=float, default=1e-5, help="for --check (default 1e-5)")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="size of a symbolic dimension for the random inputs (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random inputs")
    parser.set_defaults(command=cmd_simplify)
    return parser


def cmd_simplify(args: argparse.Namespace) -> int:
    target, shapes = _check_arguments(args)
    original = import_model(args.model)
    before = original.op_histogram()
    stats: dict = {}
    start = time.perf_counter()
    model = simplify_model(original, target, shapes, skip=args.skip, stats=stats)
    proto = export_model(model)
    seconds = time.perf_counter() - start
    try:
        save_onnx(proto, args.output, model)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot write {args.output}: {exc}") from exc
    print(op_count_table(before, model.op_histogram()))
    print(f"simplified for {target} in {seconds:.3f} s ({stats.get('rounds', 0)} rounds); "
          f"wrote {args.output}")
    if args.check:
        return _check_outputs(original, model, args)
    print(_difference_line(original, model, args))
    return 0


def _check_arguments(args: argparse.Namespace) -> tuple[str, dict]:
    """The arguments that need no model, checked before it loads (as `ember run` does): the
    target, the --input-shape, --dim, --check and tolerance values. InputError: one line,
    exit 2. Returns (target, input shapes)."""
    from ember.golden.inputs import parse_dims
    from ember.runtime.backends import BACKENDS

    if args.backend is not None and args.backend not in BACKENDS:
        raise InputError(f"--backend {args.backend!r}: unknown backend; choose one of "
                         f"{', '.join(BACKENDS)}")
    target = args.target if args.backend is None else f"ember:{args.backend}"
    if args.backend is not None and args.target not in ("onnx", target):
        raise InputError(f"--backend {args.backend} and --target {args.target} disagree; "
                         "give one of them")
    parse_target(target)
    parse_dims(args.dim)
    if args.check < 0 or args.rtol < 0 or args.atol < 0:
        raise InputError("--check, --rtol and --atol must not be negative")
    return target, parse_input_shapes(args.input_shape)


def _check_outputs(original: Model, simplified: Model, args: argparse.Namespace) -> int:
    """--check: both models on `args.check` random input sets (ember's CPU backend, the
    original as imported); 1 when an output differs past the tolerances, else 0."""
    from ember.golden.inputs import index_bounds, make_inputs, parse_dims
    from ember.runtime.session import Session

    plain, fused = Session(original), Session(simplified)
    dims, bounds = parse_dims(args.dim), index_bounds(original.graph)
    worst = 0.0
    for i in range(args.check):
        feeds = make_inputs(plain.inputs, dims=dims, seed=args.seed + i, bounds=bounds)
        want, got = plain.run(feeds), fused.run(feeds)
        for name, expected in want.items():
            if not isinstance(expected, np.ndarray) or not expected.size:
                continue
            actual = np.asarray(got[name])
            if expected.dtype.kind not in "fc":
                if not np.array_equal(actual, expected):
                    print(f"FAIL: output '{name}' differs on input set {i}")
                    return 1
                continue
            e, a = expected.astype(np.float64), actual.astype(np.float64)
            excess = np.abs(a - e) - (args.atol + args.rtol * np.abs(e))
            worst = max(worst, float(np.max(np.abs(a - e))))
            if np.any(excess > 0) or np.isnan(a).sum() != np.isnan(e).sum():
                print(f"FAIL: output '{name}' differs by up to {np.nanmax(np.abs(a - e)):.3g} "
                      f"on input set {i} (rtol {args.rtol:g}, atol {args.atol:g})")
                return 1
    print(f"PASS: {args.check} random input set(s), largest difference {worst:.3g} "
          f"(rtol {args.rtol:g}, atol {args.atol:g})")
    return 0


def op_count_table(before: dict[str, int], after: dict[str, int]) -> str:
    """Op type | before | after, and the totals."""
    ops = sorted(set(before) | set(after), key=lambda op: (-before.get(op, 0), op))
    width = max([len("total")] + [len(op) for op in ops])
    lines = [f"{'op':<{width}}  {'before':>6}  {'after':>6}"]
    for op in ops:
        lines.append(f"{op:<{width}}  {before.get(op, 0):>6}  {after.get(op, 0):>6}")
    lines.append(f"{'total':<{width}}  {sum(before.values()):>6}  {sum(after.values()):>6}")
    return "\n".join(lines)


def _difference_line(original: Model, simplified: Model, args: argparse.Namespace) -> str:
    from ember.golden.inputs import index_bounds, make_inputs, parse_dims
    from ember.runtime.session import Session

    try:
        plain, fused = Session(original), Session(simplified)
        feeds = make_inputs(plain.inputs, dims=parse_dims(args.dim), seed=args.seed,
                            bounds=index_bounds(original.graph))
        want, got = plain.run(feeds), fused.run(feeds)
    except (EmberError, ValueError) as exc:
        return f"outputs not compared on random inputs: {exc}"
    worst, where = 0.0, ""
    for name, expected in want.items():
        actual = got[name]
        if not isinstance(expected, np.ndarray) or expected.dtype.kind not in "fiub" or \
                not expected.size:
            continue
        diff = float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64))))
        if diff >= worst:
            worst, where = diff, name
    return f"largest output difference on random inputs: {worst:.3g}" + \
        (f" (output '{where}')" if where else "")
