"""The `ember` command line: run a model, describe it, check it against a reference, run it
over a dataset (`ember batch`).

Exit codes: 0 success, 1 `check` found a mismatch, 2 a bad argument, model or input: an ember
error, or a file the user named that cannot be read or written (one line on stderr, no
traceback). Any other exception is a bug in ember and keeps its traceback (exit 1), so it can
be reported and found.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

import numpy as np

from ember import __version__
from ember.errors import EmberError, InputError
from ember.golden import add_check_parser
from ember.native.convert import add_convert_parser
from ember.simplify_cli import add_simplify_parser
from ember.importer import import_model
from ember.golden.inputs import (index_bounds, int_at_least, load_input_files, make_inputs, parse_dims,
                          parse_pairs)
from ember.ir import Model
from ember.runtime.backends import BACKENDS
from ember.runtime.profiler import Profiler, summary
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
        return _fail(str(exc))
    except BrokenPipeError:  # the reader went away (`ember info M | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        if exc.filename is None:
            raise  # not about a path the user gave: a bug, shown in full
        return _fail(f"{exc.filename}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("ember: interrupted", file=sys.stderr)
        return 130


def _fail(message: str) -> int:
    """Report a user's error as one line on stderr; exit code 2."""
    line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"ember: error: {line}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ONNX inference with pluggable backends")
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers()

    run = sub.add_parser(
        "run", help="run a model on given or random inputs",
        description="Load a model, run it once (or --repeat times) on inputs from .npy files or "
                    "random ones, and print a summary of each output and the time taken.")
    run.add_argument("model", help="path to an .onnx file")
    _add_feed_arguments(run)
    run.add_argument("-o", "--output", metavar="OUT.npz", help="save all outputs to an .npz file")
    run.add_argument("--repeat", type=int_at_least(1), default=1, metavar="N",
                     help="timed runs; with N > 1 the median and p90 latency are reported")
    run.add_argument("--warmup", type=int_at_least(0), default=0, metavar="K",
                     help="untimed runs first (default 0)")
    run.set_defaults(command=cmd_run)

    profile = sub.add_parser(
        "profile", help="time each node: a table per op type and the slowest nodes",
        description="Run a model --warmup times untimed, then --repeat times profiled, and print "
                    "the time per op type (nodes, total ms a run, share, mean µs a node) and the "
                    "slowest nodes. --trace keeps the Chrome-trace JSON (Perfetto opens it).")
    profile.add_argument("model", help="path to an .onnx file")
    _add_feed_arguments(profile)
    profile.add_argument("--repeat", type=int_at_least(1), default=10, metavar="N",
                         help="profiled runs (default 10)")
    profile.add_argument("--warmup", type=int_at_least(0), default=2, metavar="K",
                         help="untimed runs first (default 2)")
    profile.add_argument("--top", type=int_at_least(1), default=15, metavar="T",
                         help="slowest nodes listed (default 15)")
    profile.add_argument("--trace", metavar="TRACE.json",
                         help="also write the trace (one event per node and run) there")
    profile.set_defaults(command=cmd_profile)

    info = sub.add_parser(
        "info", help="describe a model: metadata, opsets, inputs, outputs, ops",
        description="Describe a model without running it: producer, doc string and custom "
                    "metadata, opsets, inputs and outputs, parameters, op counts and which "
                    "backends have kernels for them; --nodes lists every node with its shapes, "
                    "--backend the plan `ember run` executes there: where each node runs and "
                    "the kernel chosen for it, and why. A few CPU kernels are chosen at a "
                    "node's first run (by its input's geometry or layout): --run runs the "
                    "model once on random inputs to show those choices.")
    info.add_argument("model", help="path to an .onnx file")
    info.add_argument("--backend", default=None,
                      help="also show the plan on this backend: where each node runs")
    info.add_argument("--nodes", action="store_true",
                      help="list every node: op, name, inputs and outputs with their shapes")
    info.add_argument("--run", action="store_true",
                      help="with --backend: run once on random inputs (symbolic dims 1), so "
                           "that kernels chosen at the first run are shown as chosen")
    info.add_argument("--json", action="store_true", help="print it all as one JSON object")
    info.set_defaults(command=cmd_info)

    ops = sub.add_parser("ops", help="print the table of ops each backend implements (markdown)",
                         description="Print the table of every registered op and the "
                                     "since-versions each backend implements, as markdown (the "
                                     "ops table in docs/ops.md).")
    ops.set_defaults(command=cmd_ops)
    _add_batch_parser(sub)
    add_check_parser(sub)
    add_convert_parser(sub)
    add_simplify_parser(sub)
    return parser


def _add_batch_parser(sub) -> None:
    batch = sub.add_parser(
        "batch", help="run a model over every row of a dataset (Parquet, .npy/.npz folders)",
        description="Run a model over every row of DATA (a Parquet, .npy or .npz file, or a "
                    "folder of them) in batches, and write one Parquet file per input file "
                    "into the folder OUT: the input's other columns, then one column per "
                    "model output. Each output file appears complete or not at all. The "
                    "local engine runs in this process; --engine ray runs Ray Data actors "
                    "(pip install ember[ray]). See docs/batch.md.")
    batch.add_argument("model", help="path to an .onnx file")
    batch.add_argument("data", help="a Parquet, .npy or .npz file, or a folder of them")
    batch.add_argument("out", help="the folder for the outputs (made if missing)")
    batch.add_argument("--batch-size", type=int_at_least(1), default=64, metavar="N",
                       help="rows per model run (default 64)")
    batch.add_argument("--engine", choices=("local", "ray"), default="local",
                       help="local: this process (default); ray: Ray Data actors")
    batch.add_argument("--workers", type=int_at_least(1), default=None, metavar="N",
                       help="Ray actors, each loading the model once (default 1)")
    batch.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="the Ray cluster to connect to (default: start a local Ray)")
    batch.add_argument("--backend", default=None, help=f"one of {', '.join(BACKENDS)} "
                                                       "(default: $EMBER_BACKEND or cpu)")
    batch.add_argument("--gpus-per-worker", type=float, default=None, metavar="G",
                       help="GPUs each Ray actor requests (with --backend cuda)")
    batch.add_argument("--map", action="append", default=[], metavar="COL=INPUT",
                       help="feed model input INPUT from column COL (repeatable; default: "
                            "the column of the input's name)")
    batch.add_argument("--resume", action="store_true",
                       help="skip input files whose output file exists")
    batch.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                       help="a row that does not fit the model: stop (default), or write it "
                            "to OUT/STEM.errors.parquet and carry on")
    batch.add_argument("--no-progress", action="store_true",
                       help="no progress line (rows/s, ETA) on stderr")
    batch.set_defaults(command=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    from ember.batch import run_batch  # needs pyarrow: imported only here

    column_map = parse_pairs(args.map, "--map")
    report = run_batch(model_file(args.model), args.data, args.out, batch_size=args.batch_size,
                       engine=args.engine, workers=args.workers, ray_address=args.ray_address,
                       backend=args.backend, gpus_per_worker=args.gpus_per_worker,
                       column_map=column_map, resume=args.resume, on_error=args.on_error,
                       progress=not args.no_progress)
    skipped = f", {report.files_skipped} skipped (--resume)" if report.files_skipped else ""
    print(f"{report.rows:,} rows written to {report.files_written} file(s) in {args.out}"
          f"{skipped}; {report.seconds:.1f} s, {report.rows_per_second:,.0f} rows/s")
    if report.error_rows:
        print(f"{report.error_rows:,} failing row(s) set aside in "
              f"{', '.join(report.error_files)}")
    return 0


def _add_feed_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `run` and `profile` that choose the backend and make the feeds."""
    parser.add_argument("-i", "--input", action="append", default=[], metavar="NAME=FILE.npy",
                        help="feed an input from a .npy file (repeatable); others are random")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="size of a symbolic dimension for random inputs (default 1)")
    parser.add_argument("--backend", default=None, help=f"one of {', '.join(BACKENDS)} "
                                                        "(default: $EMBER_BACKEND or cpu)")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="seed for random inputs (default 0)")
    parser.add_argument("--no-simplify", action="store_true",
                        help="run the graph as imported, without the simplifier's rewrites")


def _prepared(args: argparse.Namespace, **load_options) -> tuple[Session, dict, float]:
    """(session, feeds, load ms) from the feed arguments; every argument is checked before the
    model loads: a typo costs no waiting."""
    dims = parse_dims(args.dim)
    files = load_input_files(parse_pairs(args.input, "-i"))
    model_file(args.model)
    t0 = time.perf_counter()
    session = load(args.model, args.backend, simplify=not args.no_simplify, **load_options)
    load_ms = (time.perf_counter() - t0) * 1e3
    feeds = make_inputs(session.inputs, files, dims=dims, seed=args.seed,
                        bounds=index_bounds(session.model.graph))
    return session, feeds, load_ms


def cmd_run(args: argparse.Namespace) -> int:
    output = output_path(args.output, ".npz") if args.output else None
    session, feeds, load_ms = _prepared(args)
    for _ in range(args.warmup):
        session.run(feeds)
    compiling_before = getattr(session.backend_instance, "compile_seconds", 0.0)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        outputs = session.run(feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    compiled = getattr(session.backend_instance, "compile_seconds", 0.0) - compiling_before
    compile_ms = compiled * 1e3
    for name, value in outputs.items():
        print(_summary(name, value))
    if args.repeat == 1:
        timing = f"run {times[0]:.2f} ms"
    else:
        timing = (f"run median {np.median(times):.2f} ms, p90 {np.percentile(times, 90):.2f} ms "
                  f"over {args.repeat} runs (min {min(times):.2f}, max {max(times):.2f})")
    print(f"backend {session.backend}: load {load_ms:.1f} ms, {timing}"
          + (f" (of which {compile_ms:.1f} ms compiling device programs on first use)"
             if compile_ms > 0 else ""))
    if output:
        np.savez(output, **{k: v for k, v in outputs.items() if isinstance(v, np.ndarray)})
        print(f"saved outputs to {output}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    trace = output_path(args.trace, ".json") if args.trace else None
    session, feeds, load_ms = _prepared(args)
    for _ in range(args.warmup):
        session.run(feeds)
    session.profiler = Profiler(backend=session.backend)
    for _ in range(args.repeat):
        session.run(feeds)
    profiler = session.profiler
    session.profiler = None
    print(f"{args.model} on {session.backend}: load {load_ms:.1f} ms; {args.repeat} profiled "
          f"run(s) after {args.warmup} warm-up run(s), times per run")
    print(summary(profiler.events, args.repeat, args.top))
    if trace:
        written = profiler.end()
        os.replace(written, trace)
        print(f"trace written to {trace}")
    return 0


def model_file(path: str) -> str:
    """`path` unless it is a directory (a missing or unreadable file is the importer's
    ModelLoadError)."""
    if os.path.isdir(path):
        raise InputError(f"'{path}' is a directory; give the path of an .onnx file")
    return path


def output_path(path: str, suffix: str) -> str:
    """Where an output file will be written (numpy.savez adds `suffix` when it is missing),
    once its folder is known to exist: an InputError now rather than after the run."""
    final = path if path.endswith(suffix) else path + suffix
    folder = os.path.dirname(final) or "."
    if os.path.isdir(final):
        raise InputError(f"output '{final}' is a directory; give a file name")
    if not os.path.isdir(folder):
        raise InputError(f"output '{final}': the directory '{folder}' does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"output '{final}': the directory '{folder}' is not writable")
    return final


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
    model = import_model(model_file(args.model))
    # the plan `ember run` executes: simplified for that backend
    session = load(model, args.backend) if args.backend else None
    if session is not None and args.run:
        from ember.golden.inputs import index_bounds, make_inputs

        session.run(make_inputs(session.inputs, bounds=index_bounds(session.plan.graph)))
    if args.nodes or args.json:
        _infer_shapes(model)
    if args.json:
        print(json.dumps(model_summary(model, session, nodes=args.nodes), indent=1))
        return 0
    print(describe(model))
    if args.nodes:
        print(describe_nodes(model))
    if session is not None:
        print(describe_placement(session))
    return 0


def _infer_shapes(model: Model) -> None:
    """The shapes of intermediate values, as the simplifier infers them (the graph itself is
    left as imported)."""
    from ember.simplifier.context import Context
    from ember.simplifier.passes.shape_inference import infer_shapes

    infer_shapes(model.graph, Context(model))


def _shape_of(model: Model, name: str) -> str:
    from ember.runtime.session import io_info

    graph = model.graph
    if name in graph.initializers:
        value = graph.initializers[name]
        return f"{getattr(value, 'dtype', '?')}[{', '.join(map(str, getattr(value, 'shape', ())))}]"
    info = graph.value_info.get(name) or next(
        (v for v in graph.inputs + graph.outputs if v.name == name), None)
    if info is None or info.type is None:
        return "?"
    io = io_info(info)
    if io.shape is None:
        return io.type
    return f"{io.dtype}[{', '.join(map(str, io.shape))}]"


def describe_nodes(model: Model) -> str:
    lines = [f"nodes ({len(model.graph.nodes)}, top level):"]
    for node in model.graph.nodes:
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        ins = ", ".join(f"{n} {_shape_of(model, n)}" if n else "-" for n in node.inputs)
        outs = ", ".join(f"{n} {_shape_of(model, n)}" for n in node.outputs if n)
        lines.append(f"  {op:<24} {node.name or '-'}: {ins} -> {outs}")
    return "\n".join(lines)


def model_summary(model: Model, session: Session | None, nodes: bool) -> dict:
    """`ember info --json`: what `describe` prints, as data."""
    from ember.ops.registry import lookup
    from ember.runtime.session import io_info

    graph = model.graph

    def io(v):
        info = io_info(v)
        return {"name": info.name, "type": info.type,
                "shape": None if info.shape is None else list(info.shape)}

    summary = {
        "path": model.path, "ir_version": model.ir_version,
        "producer": {"name": model.producer_name, "version": model.producer_version},
        "model_version": model.model_version, "doc": model.doc,
        "graph": {"name": graph.name, "doc": graph.doc},
        "metadata": dict(model.metadata), "opsets": dict(model.opsets),
        "inputs": [io(v) for v in graph.inputs if v.name not in graph.initializers],
        "outputs": [io(v) for v in graph.outputs],
        "parameters": model.parameter_count(), "initializers": len(graph.initializers),
        "ops": model.op_histogram(),
        "ops_without_kernel": {b: sorted({n.op_type for n in graph.iter_nodes()
                                          if lookup(n.domain, n.op_type, n.version, b) is None})
                               for b in BACKENDS},
    }
    if nodes:
        summary["nodes"] = [{"op": n.op_type, "domain": n.domain, "name": n.name,
                             "inputs": [{"name": i, "shape": _shape_of(model, i)} if i else None
                                        for i in n.inputs],
                             "outputs": [{"name": o, "shape": _shape_of(model, o)}
                                         for o in n.outputs if o]} for n in graph.nodes]
    if session is not None:
        summary["plan"] = {"backend": session.backend_instance.describe(),
                           "nodes": [{"name": name, "op": op, "where": where, "reason": reason,
                                      "kernel": kernel, "kernel_reason": why}
                                     for (name, op, where, reason), (_, _, kernel, why)
                                     in zip(session.placement_reasons, session.kernels)],
                           "summary": session.placement_summary()}
    return summary


def describe_placement(session: Session) -> str:
    """Where each node runs on the session's backend, and how many fall back to the CPU."""
    lines = [f"placement on {session.backend_instance.describe()}:"]
    for (name, op, where, reason), (_, _, kernel, why) in zip(session.placement_reasons,
                                                              session.kernels):
        lines.append(f"  {op:<24} {where:<9} {kernel:<22} {name}  ("
                     + "; ".join(filter(None, (reason, why))) + ")")
    counts = session.placement_summary()
    lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                 + f"; {counts.get('fallback', 0)} node(s) fall back to the CPU")
    return "\n".join(lines)


def describe(model: Model) -> str:
    from ember.ops.registry import lookup, since_version
    from ember.runtime.session import io_info

    lines = [f"model: {model.path or '<memory>'}",
             f"producer: {model.producer_name} {model.producer_version}".rstrip(),
             f"ir version {model.ir_version}, model version {model.model_version}",
             "opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(model.opsets.items()))]
    if model.doc:
        lines.append(f"doc: {' '.join(model.doc.split())[:200]}")
    for key, value in sorted(model.metadata.items()):
        lines.append(f"metadata: {key} = {' '.join(str(value).split())[:200]}")
    graph = model.graph
    lines.append("inputs:")
    for v in graph.inputs:
        if v.name not in graph.initializers:
            lines.append(f"  {_io_line(io_info(v))}")
    lines.append("outputs:")
    for v in graph.outputs:
        lines.append(f"  {_io_line(io_info(v))}")
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
    """The ops table of docs/ops.md: every registered op with the since-versions each backend runs."""
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
