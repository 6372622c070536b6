"""The `ember` command line: run a model, describe a model, check it against a reference.

Exit codes: 0 success, 1 `check` found a mismatch, 2 an ember error (one line, no traceback).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from ember.errors import EmberError
from ember.golden import add_check_parser
from ember.native.convert import add_convert_parser
from ember.simplifier.cli import add_simplify_parser
from ember.importer import import_model
from ember.inputs import load_input_files, make_inputs, parse_dims, parse_pairs
from ember.ir import Model
from ember.runtime.backends import BACKENDS
from ember.runtime.session import IOInfo, Session, load


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.command(args)
    except EmberError as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ONNX inference with pluggable backends")
    sub = parser.add_subparsers()

    run = sub.add_parser("run", help="run a model on given or random inputs")
    run.add_argument("model", help="path to an .onnx file")
    run.add_argument("-i", "--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="feed an input from a .npy file (repeatable); others are random")
    run.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                     help="size of a symbolic dimension for random inputs (default 1)")
    run.add_argument("--backend", default=None, help=f"one of {', '.join(BACKENDS)} "
                                                     "(default: $EMBER_BACKEND or cpu)")
    run.add_argument("-o", "--output", metavar="OUT.npz", help="save all outputs to an .npz file")
    run.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    run.add_argument("--no-simplify", action="store_true",
                     help="run the graph as imported, without the simplifier's rewrites")
    run.set_defaults(command=cmd_run)

    info = sub.add_parser("info", help="describe a model: opsets, inputs, outputs, ops")
    info.add_argument("model", help="path to an .onnx file")
    info.add_argument("--backend", default=None,
                      help="also show where each node runs on this backend (needs its device)")
    info.set_defaults(command=cmd_info)

    ops = sub.add_parser("ops", help="print the table of ops each backend implements (markdown)")
    ops.set_defaults(command=cmd_ops)
    add_check_parser(sub)
    add_convert_parser(sub)
    add_simplify_parser(sub)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    session = load(args.model, args.backend, simplify=not args.no_simplify)
    load_ms = (time.perf_counter() - t0) * 1e3
    feeds = make_inputs(session.inputs, load_input_files(parse_pairs(args.input, "-i")),
                        dims=parse_dims(args.dim), seed=args.seed)
    compiling_before = getattr(session._backend, "compile_seconds", 0.0)
    t0 = time.perf_counter()
    outputs = session.run(feeds)
    run_ms = (time.perf_counter() - t0) * 1e3
    compile_ms = (getattr(session._backend, "compile_seconds", 0.0) - compiling_before) * 1e3
    for name, value in outputs.items():
        print(_summary(name, value))
    print(f"backend {session.backend}: load {load_ms:.1f} ms, run {run_ms:.2f} ms"
          + (f" (of which {compile_ms:.1f} ms compiling device programs on first use)"
             if compile_ms > 0 else ""))
    if args.output:
        np.savez(args.output, **{k: v for k, v in outputs.items() if isinstance(v, np.ndarray)})
        print(f"saved outputs to {args.output}")
    return 0


def _summary(name: str, value) -> str:
    if isinstance(value, list):
        return f"{name}: sequence of {len(value)}"
    if value is None:
        return f"{name}: empty optional"
    head = np.array2string(value.reshape(-1)[:6], precision=5, separator=", ")
    stats = ""
    if value.size and value.dtype.kind in "fiu":
        v = value.astype(np.float64)
        stats = f" min {v.min():.5g} max {v.max():.5g} mean {v.mean():.5g}"
    return f"{name}: {value.dtype} {list(value.shape)}{stats} first {head}"


def cmd_info(args: argparse.Namespace) -> int:
    model = import_model(args.model)
    print(describe(model))
    if args.backend:  # the plan `ember run` executes: simplified for that backend
        print(describe_placement(load(model, args.backend)))
    return 0


def describe_placement(session: Session) -> str:
    """Where each node runs on the session's backend, and how many fall back to the CPU."""
    lines = [f"placement on {session._backend.describe()}:"]
    for name, op, where, reason in session.placement_reasons:
        lines.append(f"  {op:<24} {where:<9} {name}" + (f"  ({reason})" if reason else ""))
    counts = session.placement_summary()
    lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                 + f"; {counts.get('fallback', 0)} node(s) fall back to the CPU")
    return "\n".join(lines)


def describe(model: Model) -> str:
    from ember.ops.registry import lookup, since_version
    from ember.runtime.session import _io_info

    lines = [f"model: {model.path or '<memory>'}",
             f"producer: {model.producer_name} {model.producer_version}".rstrip(),
             "opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(model.opsets.items()))]
    graph = model.graph
    lines.append("inputs:")
    for v in graph.inputs:
        if v.name not in graph.initializers:
            lines.append(f"  {_io_line(_io_info(v))}")
    lines.append("outputs:")
    for v in graph.outputs:
        lines.append(f"  {_io_line(_io_info(v))}")
    lines.append(f"parameters: {model.parameter_count():,} in {len(graph.initializers)} initializers")
    hist = model.op_histogram()
    lines.append(f"ops: {sum(hist.values())} nodes, {len(hist)} op types")
    for op, count in hist.items():
        lines.append(f"  {op:<28} {count}")
    lines.append("kernels per backend (ops without one run on the CPU):")
    for backend in BACKENDS:
        missing = sorted({f"{n.op_type}-{since_version(n.domain, n.op_type, n.version)}"
                          for n in graph.iter_nodes()
                          if lookup(n.domain, n.op_type, n.version, backend) is None})
        if missing:
            lines.append(f"  {backend}: {len(missing)} op(s) without a kernel: {', '.join(missing)}")
        else:
            lines.append(f"  {backend}: all ops have kernels")
    return "\n".join(lines)


def ops_table_markdown() -> str:
    """The README's ops table: every registered op with the since-versions each backend runs."""
    from ember.ops.registry import supported_ops

    per_backend = {b: supported_ops(b) for b in BACKENDS}
    keys = sorted(set().union(*per_backend.values()), key=lambda k: (k[0], k[1].lower()))
    rows = ["| domain | op | " + " | ".join(BACKENDS) + " |",
            "|---|---|" + "---|" * len(BACKENDS)]
    for domain, op in keys:
        cells = [", ".join(map(str, per_backend[b].get((domain, op), []))) or "-" for b in BACKENDS]
        rows.append(f"| {domain or 'ai.onnx'} | {op} | " + " | ".join(cells) + " |")
    counts = ", ".join(f"{b}: {len(per_backend[b])}" for b in BACKENDS)
    return "\n".join(rows) + f"\n\nOp types per backend: {counts}.\n"


def cmd_ops(args: argparse.Namespace) -> int:
    print(ops_table_markdown(), end="")
    return 0


def _io_line(info: IOInfo) -> str:
    shape = "?" if info.shape is None else "[" + ", ".join(
        "?" if d is None else str(d) for d in info.shape) + "]"
    return f"{info.name}: {info.type} {shape}"


if __name__ == "__main__":
    raise SystemExit(main())
