"""`ember check`: compare ember backends with a reference, down to the node that makes the error.

    ember check model.onnx --backend opencl --ref onnxruntime
    ember check model.onnx --backend cpu,opencl --ref golden.npz --atol 1e-4 --rtol 1e-3
    ember check model.onnx --backend opencl --ref cpu --bisect
    ember check model.onnx --ref onnxruntime --save-golden golden.npz

A reference is a runtime (onnxruntime, onnx's ReferenceEvaluator, another ember backend) or
recorded data (an .npz with `input:NAME` / `output:NAME` keys, or an ONNX test directory with
`test_data_set_N/input_K.pb`, `output_K.pb`). `check()` returns a `CheckReport`; the CLI prints it,
optionally writes it as JSON, and exits 0 on pass, 1 on a mismatch, 2 on an error.

Bisect compares every intermediate value in topological order while both sides run: against
another ember backend the two plans run in lockstep (`Plan.iterate`), against onnxruntime or onnx
the reference exposes intermediates as extra graph outputs a chunk at a time. Either way each value
is compared as it is produced and then dropped, so memory stays near one run's peak (plus the
reference's values that later nodes read, see below).

It reports two nodes. The first divergence: the first node whose output fails the tolerances
while its inputs agree. And the node that adds the most error: each node's kernel also runs alone
on the reference's values of its inputs (per-node isolation, as Polygraphy's debug tools do), and
its distance from the reference's output, in ulps, is that node's own error. In float16 every
node differs by an ulp or so and the first divergence is mere rounding; the second finding is the
node that makes the error, and says whether the simplifier made it.

What is checked is what ember runs: each backend's graph simplified for it, as `ember.load` runs
it by default (`--no-simplify`, simplify=False: the graph as imported).

The package, in the order a check runs:
- ember.golden.inputs           random and recorded feeds (also `ember run`'s)
- ember.golden.references       what is compared with: a runtime or recorded data
- ember.golden.compare          tolerances and modes; one value against its reference
- ember.golden.run              check(): each backend on each data set
- ember.golden.bisect           the first divergence and the node that adds the most error
- ember.golden.report           CheckReport, as JSON and as text
- ember.golden.polygraphy_json  Polygraphy's JSON files of inputs and outputs
- ember.golden.cli              the `ember check` command
"""
from ember.golden.bisect import AddedError, BisectResult, error_in_ulps, find_divergence
from ember.golden.cli import add_check_parser, cmd_check
from ember.golden.compare import (CHECK_MODES, DEFAULT_ATOL, DEFAULT_CHUNK, DEFAULT_RTOL,
                                  CheckError, Comparison, Tolerance, Tolerances, ValueStats,
                                  compare_values, value_stats)
from ember.golden.references import make_reference, write_golden
from ember.golden.report import BackendReport, CheckReport, format_report
from ember.golden.run import check

__all__ = ["check", "CheckReport", "BackendReport", "CheckError", "format_report",
           "compare_values", "Comparison", "Tolerance", "Tolerances", "ValueStats", "value_stats",
           "find_divergence", "BisectResult", "AddedError", "error_in_ulps", "make_reference",
           "write_golden", "add_check_parser", "cmd_check", "CHECK_MODES", "DEFAULT_ATOL",
           "DEFAULT_RTOL", "DEFAULT_CHUNK"]
