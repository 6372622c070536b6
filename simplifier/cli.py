"""`ember simplify IN.onnx -o OUT.onnx [--skip PASS ...] [--backend B]`: writes the simplified
model, prints the op counts before and after, and the largest output difference between the
two models on random inputs."""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx

from ember.errors import EmberError, InputError
from ember.importer import import_model
from ember.importer.onnx_export import export_model
from ember.ir import Model
from ember.simplifier import PASSES, simplify


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
    parser.add_argument("--backend", default="cpu",
                        help="backend to simplify for (fusions it has kernels for; ops it "
                             "lacks expanded) (default cpu)")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="size of a symbolic dimension for the random inputs (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random inputs")
    parser.set_defaults(command=cmd_simplify)
    return parser


def cmd_simplify(args: argparse.Namespace) -> int:
    _check_arguments(args)
    original = import_model(args.model)
    model = import_model(args.model)
    before = original.op_histogram()
    stats: dict = {}
    start = time.perf_counter()
    simplify(model, backend=args.backend, skip=args.skip, stats=stats)
    proto = export_model(model)
    seconds = time.perf_counter() - start
    try:
        onnx.save(proto, args.output)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot write {args.output}: {exc}") from exc
    print(op_count_table(before, model.op_histogram()))
    print(f"simplified in {seconds:.3f} s ({stats.get('rounds', 0)} rounds); wrote {args.output}")
    print(_difference_line(original, model, args))
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """The arguments that need no model, checked before it loads (as `ember run` does): the
    backend's name and the --dim values. InputError: one line, exit 2."""
    from ember.inputs import parse_dims
    from ember.runtime.backends import BACKENDS

    if args.backend not in BACKENDS:
        raise InputError(f"--backend {args.backend!r}: unknown backend; choose one of "
                         f"{', '.join(BACKENDS)}")
    parse_dims(args.dim)


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
    from ember.inputs import make_inputs, parse_dims
    from ember.runtime.session import Session

    try:
        plain, fused = Session(original), Session(simplified)
        feeds = make_inputs(plain.inputs, dims=parse_dims(args.dim), seed=args.seed)
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
