"""`ember check`'s command line."""
from __future__ import annotations

import argparse
from typing import Any

from ember.golden.compare import (CheckError, DEFAULT_ATOL, DEFAULT_CHUNK, DEFAULT_RTOL,
                                  parse_tolerances)
from ember.golden.inputs import (int_at_least, load_input_files, parse_dims, parse_pairs,
                                 parse_ranges)
from ember.golden.polygraphy_json import load_inputs
from ember.golden.run import check
from ember.runtime.backends import BACKENDS

# -- command line ------------------------------------------------------------------------------

def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `ember check` on an argparse subparsers object; sets command=cmd_check."""
    p = subparsers.add_parser("check", help="compare backends with a reference (golden tensors)",
                              description="Compare ember's outputs with a reference and, with "
                              "--bisect, name the first node that diverges and the node that adds "
                              "the most error. Exit 0 pass, "
                              "1 mismatch, 2 error.")
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--backend", default=None, metavar="B[,B...]",
                   help=f"candidate backend(s) among {', '.join(BACKENDS)} "
                        "(default: $EMBER_BACKEND or cpu)")
    p.add_argument("--ref", default="onnxruntime",
                   help="onnxruntime (default), onnx, an ember backend, a recorded .npz "
                        "(input:NAME/output:NAME) or an ONNX test directory")
    p.add_argument("-i", "--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="feed an input from a .npy file (repeatable)")
    p.add_argument("--inputs", metavar="FILE.npz", help="feed inputs from an .npz (keys NAME)")
    p.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="size of a symbolic dimension for random inputs (default 1)")
    p.add_argument("--range", action="append", default=[], metavar="NAME=LO,HI",
                   help="value range of a random input (token ids need it)")
    p.add_argument("--atol", action="append", default=[], metavar="[OUTPUT:]VALUE",
                   help=f"absolute tolerance, global or per output (default {DEFAULT_ATOL})")
    p.add_argument("--rtol", action="append", default=[], metavar="[OUTPUT:]VALUE",
                   help=f"relative tolerance, global or per output (default {DEFAULT_RTOL})")
    p.add_argument("--check", default="elementwise", dest="mode", metavar="MODE",
                   help="how outputs compare: elementwise (default); max, mean, median or "
                        "quantile:Q error against --atol / --rtol; l2 (norm of the difference "
                        "<= atol + rtol * norm of the reference); cosine (1 - similarity <= "
                        "rtol); psnr:DB (at least DB decibels, default 60)")
    p.add_argument("--validate", action="store_true",
                   help="fail where either side has NaN or Inf")
    p.add_argument("--topk", type=_positive_int, default=0, metavar="K",
                   help="also require the same indices of the K largest values in each row")
    p.add_argument("--load-inputs", metavar="INPUTS.json",
                   help="Polygraphy input data (polygraphy run --save-inputs): the data sets")
    p.add_argument("--save-inputs", metavar="INPUTS.json",
                   help="write the data sets as Polygraphy input data")
    p.add_argument("--save-outputs", metavar="OUTPUTS.json",
                   help="write each backend's outputs as Polygraphy run results")
    p.add_argument("--mark", nargs="+", default=[], metavar="NAME",
                   help="also compare these intermediate values (on the first data set)")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first data set or backend that fails")
    p.add_argument("--iterations", type=_non_negative_int, default=0, metavar="N",
                   help="also time N runs of each backend on the first data set")
    p.add_argument("--warm-up", type=_non_negative_int, default=0, metavar="K", dest="warm_up",
                   help="untimed runs before --iterations (default 0)")
    p.add_argument("--bisect", action="store_true",
                   help="name the first node whose output diverges while its inputs agree, "
                        "and the node that adds the most error when run alone on the "
                        "reference's inputs")
    p.add_argument("--simplify", action=argparse.BooleanOptionalAction, default=True,
                   help="check each backend's graph simplified for it, as ember.load runs it "
                        "(the default); --no-simplify checks the graph as imported")
    p.add_argument("--chunk", type=_positive_int, default=DEFAULT_CHUNK,
                   help="intermediates per onnxruntime/onnx run during --bisect "
                        f"(default {DEFAULT_CHUNK})")
    p.add_argument("--save-golden", metavar="FILE.npz",
                   help="record the inputs and the reference's outputs")
    p.add_argument("--json", metavar="REPORT.json", help="also write the report as JSON")
    p.set_defaults(command=cmd_check)
    return p


_positive_int, _non_negative_int = int_at_least(1), int_at_least(0)


def cmd_check(args: argparse.Namespace) -> int:
    """`ember check`: print the report, write --json, return 0 pass / 1 mismatch."""
    dims = parse_dims(args.dim)
    report = check(args.model, args.backend, args.ref,
                   inputs=load_input_files(parse_pairs(args.input, "-i"), args.inputs),
                   seed=args.seed, dims=dims, ranges=parse_ranges(args.range),
                   atol=_with_default(parse_tolerances(args.atol, "--atol"), DEFAULT_ATOL),
                   rtol=_with_default(parse_tolerances(args.rtol, "--rtol"), DEFAULT_RTOL),
                   mode=args.mode, bisect=args.bisect,
                   save_golden=args.save_golden, chunk=args.chunk,
                   validate=args.validate, topk=args.topk, fail_fast=args.fail_fast,
                   iterations=args.iterations, warm_up=args.warm_up, marks=args.mark,
                   input_sets=load_inputs(args.load_inputs) if args.load_inputs else None,
                   save_inputs=args.save_inputs, save_outputs=args.save_outputs,
                   simplify=args.simplify)
    print(report.format())
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(report.to_json())
        except OSError as exc:
            raise CheckError(f"cannot write '{args.json}': {exc}") from exc
    return report.exit_code


def _with_default(parsed: dict[str, float], default: float) -> dict[str, float]:
    return {"": default, **parsed}
