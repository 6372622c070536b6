"""Golden-tensor checks: compare ember backends with a reference, down to the first diverging node.

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
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ember.errors import EmberError, InputError
from ember.importer import ModelSource, import_model, read_model_proto
from ember.ir import Model, OptionalType, SequenceType
from ember.inputs import (index_bounds, int_at_least, load_input_files, make_inputs, parse_dims,
                          parse_pairs, parse_ranges)
from ember.ops.fused import DOMAIN as FUSED_DOMAIN
from ember.runtime.backends import BACKENDS, resolve_backend_name
from ember.polygraphy_json import load_inputs
from ember.runtime.session import Session, load

DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-3
CHECK_MODES = ("elementwise", "max", "mean", "median", "quantile:Q", "l2", "cosine", "psnr:DB")
DEFAULT_PSNR_DB = 60.0
DEFAULT_CHUNK = 200  # intermediate values exposed per reference run during bisect
_RUNTIME_REFS = {"onnxruntime": "onnxruntime", "ort": "onnxruntime", "onnx": "onnx"}


class CheckError(EmberError):
    """`ember check` cannot proceed: a reference that cannot run, or unusable recorded data."""


# -- tolerances --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    validate: bool = False  # NaN or Inf on either side fails (Polygraphy's --validate)
    topk: int = 0  # also compare the indices of the k largest values along the last axis


class Tolerances:
    """Global atol/rtol with per-output overrides, and the check mode.

    Modes (Polygraphy's error statistics and distance / similarity functions):
    `elementwise` (every element: |c - r| <= atol + rtol * |r|); `max`, `mean`, `median` and
    `quantile:Q` (that statistic of the abs error <= atol, or of the rel error <= rtol; Q in
    [0, 1]); `l2` (||c - r|| <= atol + rtol * ||r||, Euclidean norms over the whole tensor);
    `cosine` (1 - cosine similarity of the flattened tensors <= rtol); `psnr:DB` (peak
    signal-to-noise ratio, 20 log10(max |r| / rms(c - r)), at least DB decibels; default 60).
    NaN and Inf must occur at the same places in every mode; integers, bools and strings
    compare exactly.
    """

    def __init__(self, atol: float | Mapping[str, float] = DEFAULT_ATOL,
                 rtol: float | Mapping[str, float] = DEFAULT_RTOL, mode: str = "elementwise",
                 validate: bool = False, topk: int = 0):
        parse_mode(mode)
        if topk < 0:
            raise InputError(f"--topk must be at least 1, got {topk}")
        self.mode, self.validate, self.topk = mode, validate, topk
        self.atol, self.atol_per_output = _split_tolerance(atol, DEFAULT_ATOL)
        self.rtol, self.rtol_per_output = _split_tolerance(rtol, DEFAULT_RTOL)

    def for_value(self, name: str) -> Tolerance:
        return Tolerance(self.atol_per_output.get(name, self.atol),
                         self.rtol_per_output.get(name, self.rtol), self.validate, self.topk)

    def unknown_outputs(self, known: set[str]) -> list[str]:
        return sorted((set(self.atol_per_output) | set(self.rtol_per_output)) - known)


def parse_mode(mode: str) -> tuple[str, float | None]:
    """("quantile", 0.99) for "quantile:0.99", ("psnr", 60.0) for "psnr", (mode, None) else;
    InputError for anything that is no mode."""
    name, sep, text = mode.partition(":")
    known = {m.partition(":")[0] for m in CHECK_MODES}
    if name not in known or (sep and name not in ("quantile", "psnr")):
        raise InputError(f"--check must be one of {', '.join(CHECK_MODES)}, got '{mode}'")
    if name == "quantile" and not sep:
        raise InputError("--check quantile needs its quantile: quantile:Q, e.g. quantile:0.99")
    if not sep:
        return name, (DEFAULT_PSNR_DB if name == "psnr" else None)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or (name == "quantile" and not 0 <= value <= 1):
        raise InputError(f"--check {mode}: expected {name}:"
                         f"{'Q with Q in [0, 1]' if name == 'quantile' else 'DB'}")
    return name, value


def _split_tolerance(value: float | Mapping[str, float], default: float
                     ) -> tuple[float, dict[str, float]]:
    """A float, or {output: value} where the key "" (or "*") sets the global value."""
    if isinstance(value, Mapping):
        per = {str(k): float(v) for k, v in value.items()}
        glob = per.pop("", per.pop("*", default))
        return glob, per
    return float(value), {}


def parse_tolerances(items: Sequence[str], flag: str) -> dict[str, float]:
    """`--atol 1e-4` (global) and `--atol out0:1e-4` (one output) -> {"": 1e-4, "out0": 1e-4}."""
    parsed: dict[str, float] = {}
    for item in items:
        name, sep, text = item.rpartition(":")
        try:
            value = float(text)
        except ValueError:
            raise InputError(f"{flag} expects VALUE or OUTPUT:VALUE, got '{item}'") from None
        if value < 0 or math.isnan(value):
            raise InputError(f"{flag} must be a non-negative number, got '{item}'")
        parsed[name if sep else ""] = value
    return parsed


# -- comparing one value -----------------------------------------------------------------------

@dataclass
class Comparison:
    """One value of the candidate compared with the reference's."""
    name: str
    passed: bool
    candidate_dtype: str
    candidate_shape: list[int] | None
    reference_dtype: str
    reference_shape: list[int] | None
    atol: float
    rtol: float
    max_abs_error: float | None = None
    max_abs_error_at: list[int] | None = None
    candidate_at_max: Any = None
    reference_at_max: Any = None
    max_rel_error: float | None = None
    mean_abs_error: float | None = None
    mismatched: int = 0
    total: int = 0
    min_atol: float | None = None  # smallest atol that passes at this rtol (None: none does)
    min_rtol: float | None = None  # smallest rtol that passes at this atol
    statistic: float | None = None  # the mode's metric (median error, cosine similarity, ...)
    statistic_name: str = ""
    note: str = ""
    dataset: int | None = None  # which recorded data set, when there are several

    @property
    def mismatch_share(self) -> float:
        return self.mismatched / self.total if self.total else 0.0


def compare_values(name: str, candidate: Any, reference: Any, tol: Tolerance,
                   mode: str = "elementwise") -> Comparison:
    """Compare one candidate value with its reference under `tol` and `mode`."""
    if isinstance(candidate, list) or isinstance(reference, list):
        return _compare_sequences(name, candidate, reference, tol, mode)
    if candidate is None or reference is None:
        both = candidate is None and reference is None
        return Comparison(name, both, _dtype_str(candidate), _shape(candidate),
                          _dtype_str(reference), _shape(reference), tol.atol, tol.rtol,
                          note="" if both else "one side is an empty optional")
    c, r = np.asarray(candidate), np.asarray(reference)
    result = Comparison(name, False, str(c.dtype), list(c.shape), str(r.dtype), list(r.shape),
                        tol.atol, tol.rtol, total=int(r.size))
    if c.shape != r.shape:
        result.note = "shapes differ"
        return result
    if _is_text(c) or _is_text(r):
        return _compare_exact_text(result, c, r)
    if not (_is_numeric(c) and _is_numeric(r)):
        result.note = "cannot compare these dtypes"
        return result
    exact = _is_exact(c) and _is_exact(r)
    _fill_numeric(result, c, r, tol, mode, exact)
    if tol.validate and not exact and not (np.isfinite(c).all() and np.isfinite(r).all()):
        result.passed = False
        result.note = _joined(result.note, "NaN or Inf present (--validate)")
    if tol.topk and c.ndim and c.shape[-1] and not _same_topk(c, r, tol.topk):
        result.passed = False
        result.note = _joined(result.note, f"top-{tol.topk} indices differ")
    if c.dtype != r.dtype:
        result.passed = False
        result.note = "dtypes differ" + (f"; {result.note}" if result.note else "")
    return result


def _joined(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def _same_topk(c: np.ndarray, r: np.ndarray, k: int) -> bool:
    """Whether each row (the last axis) has the same k largest entries, as index sets."""
    k = min(k, c.shape[-1])
    top_c = np.sort(np.argsort(-_as_float(c), axis=-1, kind="stable")[..., :k], axis=-1)
    top_r = np.sort(np.argsort(-_as_float(r), axis=-1, kind="stable")[..., :k], axis=-1)
    return bool(np.array_equal(top_c, top_r))


def _fill_numeric(result: Comparison, c: np.ndarray, r: np.ndarray, tol: Tolerance, mode: str,
                  exact: bool) -> None:
    # float32 stays float32 (errors of float32 values are exact enough; halves the memory and
    # time on big intermediates); reductions accumulate in float64.
    cf, rf = _as_float(c), _as_float(r)
    finite = np.isfinite(cf) & np.isfinite(rf)
    all_finite = bool(finite.all())
    special = None if all_finite else _special_mismatch(cf, rf)
    n_special = 0 if special is None else int(special.sum())
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # arrays even where 0-d (numpy's ufuncs give scalars there, which take no assignment)
        err = np.asarray(np.abs(cf - rf))
        scale = np.asarray(np.abs(rf))
        if not all_finite:
            err[~finite] = 0
            scale[~finite] = 0
        rel = np.asarray(err / scale)
        rel[err == 0] = 0  # 0/0: no error
    if err.size:
        at = int(np.argmax(err))
        result.max_abs_error = float(err.flat[at])
        result.max_abs_error_at = [int(i) for i in np.unravel_index(at, err.shape)]
        result.candidate_at_max = _scalar(c.flat[at])
        result.reference_at_max = _scalar(r.flat[at])
        result.max_rel_error = float(rel.max())
        result.mean_abs_error = float(err.mean(dtype=np.float64))
    else:
        result.max_abs_error = result.max_rel_error = result.mean_abs_error = 0.0
    if exact:
        result.mismatched = int(np.count_nonzero(c != r))  # not via float64: int64 is exact
        result.passed = result.mismatched == 0
        result.note = "integers and bools compare exactly"
        return
    out_of_tol = err > tol.atol + tol.rtol * scale
    if special is not None:
        out_of_tol |= special
    result.mismatched = int(np.count_nonzero(out_of_tol))
    if n_special:
        result.note = f"NaN/Inf differ at {n_special} place(s)"
    if mode == "elementwise":
        result.passed = result.mismatched == 0
        with np.errstate(invalid="ignore", divide="ignore"):
            need_atol = float(np.max(err - tol.rtol * scale, initial=0.0))
            over = err > tol.atol
            need_rtol = float(np.max((err[over] - tol.atol) / scale[over], initial=0.0))
    elif mode == "max":
        result.passed = n_special == 0 and (result.max_abs_error <= tol.atol
                                            or result.max_rel_error <= tol.rtol)
        need_atol, need_rtol = result.max_abs_error, result.max_rel_error
    elif mode in ("mean", "median") or mode.startswith("quantile"):
        need_atol, need_rtol = _error_statistic(mode, err[finite], rel[finite])
        result.statistic, result.statistic_name = need_atol, f"{mode} abs error"
        result.passed = n_special == 0 and (need_atol <= tol.atol or need_rtol <= tol.rtol)
    else:
        result.statistic, result.passed, need_atol, need_rtol = _distance(
            mode, cf[finite], rf[finite], tol)
        result.statistic_name = {"l2": "l2 norm of the difference",
                                 "cosine": "cosine similarity"}.get(mode, "PSNR (dB)")
        result.passed = result.passed and n_special == 0
    if not n_special and need_atol is not None:
        result.min_atol, result.min_rtol = need_atol, need_rtol


def _error_statistic(mode: str, err: np.ndarray, rel: np.ndarray) -> tuple[float, float]:
    """(statistic of the abs errors, of the rel errors) for mean, median or quantile:Q."""
    if not err.size:
        return 0.0, 0.0
    name, q = parse_mode(mode)
    if name == "mean":
        return float(err.mean(dtype=np.float64)), float(rel.mean(dtype=np.float64))
    q = 0.5 if name == "median" else q
    return float(np.quantile(err, q)), float(np.quantile(rel, q))


def _distance(mode: str, c: np.ndarray, r: np.ndarray, tol: Tolerance
              ) -> tuple[float, bool, float | None, float | None]:
    """(the metric, passed, the atol and rtol that would pass) for l2, cosine and psnr over
    the finite elements, in float64."""
    name, db = parse_mode(mode)
    c, r = c.astype(np.float64).ravel(), r.astype(np.float64).ravel()
    diff_norm, ref_norm = float(np.linalg.norm(c - r)), float(np.linalg.norm(r))
    if name == "l2":
        passed = diff_norm <= tol.atol + tol.rtol * ref_norm
        return diff_norm, passed, diff_norm, (diff_norm / ref_norm if ref_norm else 0.0)
    if name == "cosine":
        norms = float(np.linalg.norm(c)) * ref_norm
        similarity = float(c @ r) / norms if norms else float(diff_norm == 0)
        return similarity, 1 - similarity <= tol.rtol, None, 1 - similarity
    rms = diff_norm / math.sqrt(c.size) if c.size else 0.0
    peak = float(np.max(np.abs(r))) if r.size else 0.0
    psnr = math.inf if rms == 0 else (20 * math.log10(peak / rms) if peak else -math.inf)
    return psnr, psnr >= db, None, None


def _special_mismatch(cf: np.ndarray, rf: np.ndarray) -> np.ndarray:
    """Where NaN does not meet NaN, or an Inf does not meet the same Inf."""
    nan_c, nan_r = np.isnan(cf), np.isnan(rf)
    inf_either = np.isinf(cf) | np.isinf(rf)
    return (nan_c != nan_r) | (inf_either & ~(nan_c | nan_r) & (cf != rf))


def _compare_exact_text(result: Comparison, c: np.ndarray, r: np.ndarray) -> Comparison:
    differ = c.astype(str) != r.astype(str)
    result.mismatched = int(differ.sum())
    result.passed = result.mismatched == 0
    if result.mismatched:
        at = int(np.argmax(differ.reshape(-1)))
        result.max_abs_error_at = [int(i) for i in np.unravel_index(at, c.shape)]
        result.candidate_at_max, result.reference_at_max = str(c.flat[at]), str(r.flat[at])
    result.note = "strings compare exactly"
    return result


def _compare_sequences(name: str, candidate: Any, reference: Any, tol: Tolerance,
                       mode: str) -> Comparison:
    if not (isinstance(candidate, list) and isinstance(reference, list)) \
            or len(candidate) != len(reference):
        return Comparison(name, False, _dtype_str(candidate), _shape(candidate),
                          _dtype_str(reference), _shape(reference), tol.atol, tol.rtol,
                          note="sequences differ in kind or length")
    parts = [compare_values(f"{name}[{i}]", c, r, tol, mode)
             for i, (c, r) in enumerate(zip(candidate, reference))]
    worst = max(parts, key=lambda p: (not p.passed, p.max_abs_error or 0.0), default=None)
    summary = Comparison(name, all(p.passed for p in parts), _dtype_str(candidate),
                         [len(candidate)], _dtype_str(reference), [len(reference)],
                         tol.atol, tol.rtol, total=sum(p.total for p in parts),
                         mismatched=sum(p.mismatched for p in parts))
    if worst is not None:
        for key in ("max_abs_error", "max_abs_error_at", "candidate_at_max", "reference_at_max",
                    "max_rel_error", "mean_abs_error", "min_atol", "min_rtol"):
            setattr(summary, key, getattr(worst, key))
        summary.note = f"sequence; worst element {worst.name}" + \
            (f": {worst.note}" if worst.note else "")
    return summary


def _as_float(a: np.ndarray) -> np.ndarray:
    if a.dtype in (np.float32, np.float64, np.complex64, np.complex128):
        return a
    if a.dtype.kind == "c":
        return a.astype(np.complex128)
    return a.astype(np.float64)


def _is_text(a: np.ndarray) -> bool:
    return a.dtype.kind in "USO"


def _is_numeric(a: np.ndarray) -> bool:
    if a.dtype.kind in "biufc":
        return True
    try:  # ml_dtypes (bfloat16, float8, int4) convert to float64
        a.reshape(-1)[:1].astype(np.float64)
        return True
    except (TypeError, ValueError):
        return False


def _is_exact(a: np.ndarray) -> bool:
    return a.dtype.kind in "biu" or a.dtype.name in ("int4", "uint4", "int2", "uint2")


def _scalar(x: Any) -> Any:
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _dtype_str(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, list):
        return "sequence"
    return str(np.asarray(v).dtype)


def _shape(v: Any) -> list[int] | None:
    if isinstance(v, np.ndarray):
        return list(v.shape)
    if isinstance(v, list):
        return [len(v)]
    return None


# -- statistics of one value (for bisect) -------------------------------------------------------

@dataclass
class ValueStats:
    dtype: str
    shape: list[int] | None
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    nan: int = 0
    inf: int = 0


def value_stats(value: Any) -> ValueStats:
    """dtype, shape and (for numbers) min, max, mean, std and NaN/Inf counts of a value."""
    if not isinstance(value, np.ndarray):
        return ValueStats(_dtype_str(value), _shape(value))
    stats = ValueStats(str(value.dtype), list(value.shape))
    if value.size and _is_numeric(value) and value.dtype.kind != "c":
        v = _as_float(value)
        is_finite = np.isfinite(v)
        if not is_finite.all():
            stats.nan, stats.inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
            v = v[is_finite]
        if v.size:
            stats.min, stats.max = float(v.min()), float(v.max())
            stats.mean, stats.std = float(v.mean(dtype=np.float64)), float(v.std(dtype=np.float64))
    return stats


# -- references --------------------------------------------------------------------------------

Case = tuple[dict[str, Any], "dict[str, Any] | None"]  # feeds, recorded outputs (None: compute)


class Reference:
    """Where expected values come from."""
    name = "reference"

    def cases(self, model: Model) -> list[Case]:
        """Recorded (feeds, outputs); empty for runtimes, which compute outputs from any feeds."""
        return []

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Drop whatever the reference holds (sessions, model copies)."""


class EmberReference(Reference):
    """Another ember backend, sharing the candidate's IR (so host weights are not duplicated)."""

    def __init__(self, model: Model, backend: str):
        self.name = backend
        self.session = Session(model, backend)

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return self.session.run(feeds)

    def close(self) -> None:
        self.session = None


class ProtoReference(Reference):
    """onnxruntime or onnx's ReferenceEvaluator, given the ONNX model itself.

    For bisect, `values` exposes named intermediates as graph outputs; the caller asks for a
    chunk at a time so the reference never holds all of them at once.
    """

    def __init__(self, kind: str, source: ModelSource):
        self.name = kind
        self.source = source
        self._runtime = _import_runtime(kind)
        self._plain = None
        self._proto = None  # the graph without weights (see _graph_only)
        self._folder = None  # temporary folder holding the weights file

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self._plain is None:
            self._plain = self._session(self._plain_source(), optimize=True)
        names = self._output_names(self._plain)
        return dict(zip(names, self._run(self._plain, feeds)))

    def values(self, feeds: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
        """Run once with exactly `names` as the graph's outputs."""
        self._plain = None  # one reference session at a time
        session = self._session(self._model_exposing(names), optimize=False)
        return dict(zip(names, self._run(session, feeds)))

    def produced_names(self) -> set[str]:
        """Values that nodes of the model's main graph produce (what can be exposed)."""
        return {o for n in self._graph_only().graph.node for o in n.output if o}

    def close(self) -> None:
        self._plain = self._proto = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def _model_exposing(self, names: Sequence[str]) -> str:
        """A model file whose outputs are `names`; it shares one weights file with the others."""
        import onnx

        proto = self._graph_only()
        del proto.graph.output[:]
        proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
        path = os.path.join(self._folder.name, "exposed.onnx")
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())
        return path

    def _graph_only(self):
        """The model with its weights moved, once, into a temporary external-data file, so
        each chunk's model is small to write and no copy of the weights stays in memory."""
        if self._proto is None:
            import tempfile

            import onnx
            from onnx.external_data_helper import convert_model_to_external_data

            if isinstance(self.source, (str, os.PathLike)):
                proto = onnx.load(os.fspath(self.source))  # external data included
            else:
                proto = onnx.ModelProto()
                proto.CopyFrom(read_model_proto(self.source)[0])  # never alter the caller's
            self._folder = tempfile.TemporaryDirectory(prefix="ember-check-")
            convert_model_to_external_data(proto, all_tensors_to_one_file=True,
                                           location="weights.bin", size_threshold=1024)
            path = os.path.join(self._folder.name, "model.onnx")
            onnx.save_model(proto, path)  # writes weights.bin
            del proto  # frees the weights' buffers (clearing fields alone would keep them)
            self._proto = onnx.load(path, load_external_data=False)
        return self._proto

    def _plain_source(self) -> Any:
        if isinstance(self.source, (str, os.PathLike)):
            return os.fspath(self.source)
        if isinstance(self.source, (bytes, bytearray, memoryview)):
            return bytes(self.source)
        return self.source.SerializeToString() if self.name == "onnxruntime" else self.source

    def _session(self, model: Any, optimize: bool) -> Any:
        try:
            if self.name == "onnxruntime":
                options = self._runtime.SessionOptions()
                if not optimize:  # unfused kernels: the reference closest to each op's definition
                    options.graph_optimization_level = \
                        self._runtime.GraphOptimizationLevel.ORT_DISABLE_ALL
                return self._runtime.InferenceSession(model, options,
                                                      providers=["CPUExecutionProvider"])
            return self._runtime.ReferenceEvaluator(model)
        except Exception as exc:  # the runtime's own error types
            raise CheckError(f"reference {self.name} cannot load the model: "
                             f"{type(exc).__name__}: {exc}") from exc

    def _output_names(self, session: Any) -> list[str]:
        if self.name == "onnxruntime":
            return [o.name for o in session.get_outputs()]
        return list(session.output_names)

    def _run(self, session: Any, feeds: Mapping[str, Any]) -> list[Any]:
        try:
            return list(session.run(None, dict(feeds)))
        except Exception as exc:
            raise CheckError(f"reference {self.name} failed to run the model: "
                             f"{type(exc).__name__}: {exc}") from exc


def _import_runtime(kind: str) -> Any:
    try:
        if kind == "onnxruntime":
            import onnxruntime
            return onnxruntime
        from onnx import reference
        return reference
    except ImportError as exc:
        hint = "pip install onnxruntime" if kind == "onnxruntime" else "pip install onnx"
        raise CheckError(f"--ref {kind} needs the {kind} package, which is not installed "
                         f"({hint}), or compare with --ref cpu or recorded data "
                         "(--ref golden.npz)") from exc


class NpzReference(Reference):
    """Recorded inputs and outputs: keys `input:NAME` and `output:NAME`."""

    def __init__(self, path: str):
        self.name = path
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise CheckError(f"cannot read recorded reference '{path}': {exc}") from exc
        self.inputs = {k[6:]: v for k, v in arrays.items() if k.startswith("input:")}
        self.expected = {k[7:]: v for k, v in arrays.items() if k.startswith("output:")}
        if not self.expected:
            raise CheckError(f"'{path}' records no outputs (keys 'output:NAME'); record one "
                             "with: ember check MODEL --ref onnxruntime --save-golden FILE.npz")

    def cases(self, model: Model) -> list[Case]:
        return [(self.inputs, self.expected)]


class TestDirReference(Reference):
    """An ONNX test directory: DIR/test_data_set_N/{input,output}_K.pb, or one such set."""

    def __init__(self, path: str):
        self.name = path
        if os.path.isfile(os.path.join(path, "output_0.pb")):
            self.sets = [path]
        else:
            self.sets = sorted((os.path.join(path, d) for d in os.listdir(path)
                                if d.startswith("test_data_set_")),
                               key=lambda p: int(p.rsplit("_", 1)[-1])
                               if p.rsplit("_", 1)[-1].isdigit() else 0)
        if not self.sets:
            raise CheckError(f"'{path}' holds no test_data_set_N folders with output_K.pb files")

    def cases(self, model: Model) -> list[Case]:
        graph = model.graph
        feeds_info = [v for v in graph.inputs if v.name not in graph.initializers]
        cases = []
        for folder in self.sets:
            files = sorted(os.listdir(folder))
            n_in = sum(f.startswith("input_") and f.endswith(".pb") for f in files)
            n_out = sum(f.startswith("output_") and f.endswith(".pb") for f in files)
            if n_in > len(feeds_info) or n_out > len(graph.outputs):
                raise CheckError(f"'{folder}' holds {n_in} inputs and {n_out} outputs; the model "
                                 f"has {len(feeds_info)} and {len(graph.outputs)}")
            feeds = {feeds_info[k].name: _read_pb(os.path.join(folder, f"input_{k}.pb"),
                                                  feeds_info[k].type) for k in range(n_in)}
            outputs = {graph.outputs[k].name: _read_pb(os.path.join(folder, f"output_{k}.pb"),
                                                       graph.outputs[k].type)
                       for k in range(n_out)}
            cases.append((feeds, outputs))
        return cases


def _read_pb(path: str, value_type: Any) -> Any:
    """A TensorProto (or SequenceProto / OptionalProto, by the declared type) file as values."""
    import onnx
    from onnx import numpy_helper

    from ember.importer.onnx_values import tensor_to_array

    try:
        with open(path, "rb") as f:
            data = f.read()
        if isinstance(value_type, SequenceType):
            proto = onnx.SequenceProto()
            proto.ParseFromString(data)
            return numpy_helper.to_list(proto)
        if isinstance(value_type, OptionalType):
            proto = onnx.OptionalProto()
            proto.ParseFromString(data)
            return numpy_helper.to_optional(proto)
        proto = onnx.TensorProto()
        proto.ParseFromString(data)
        return tensor_to_array(proto)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckError(f"cannot read recorded tensor '{path}': {exc}") from exc


class PolygraphyReference(Reference):
    """Polygraphy's run results (`polygraphy run --save-outputs FILE.json`): the first runner's
    outputs, one data set per iteration, fed with the matching sets of `--load-inputs`."""

    def __init__(self, path: str, input_sets: Sequence[Mapping[str, Any]] | None):
        from ember.polygraphy_json import load_run_results

        self.name = path
        if not os.path.isfile(path):
            raise CheckError(f"recorded reference not found: {path}")
        if not input_sets:
            raise CheckError(f"{path}: Polygraphy's results hold no inputs; give the ones they "
                             "were computed from with --load-inputs FILE.json")
        runs = load_run_results(path)
        if not runs or not runs[0][1]:
            raise CheckError(f"{path}: no runner results in it")
        runner, iterations = runs[0]
        if len(iterations) != len(input_sets):
            raise CheckError(f"{path}: runner {runner} has {len(iterations)} iteration(s) but "
                             f"--load-inputs gives {len(input_sets)} input set(s)")
        self.recorded = [(dict(f), o) for f, o in zip(input_sets, iterations)]

    def cases(self, model: Model) -> list[Case]:
        return self.recorded


def make_reference(ref: str, source: ModelSource, model: Model,
                   input_sets: Sequence[Mapping[str, Any]] | None = None) -> Reference:
    """`ref` is onnxruntime, onnx, an ember backend, an .npz file, an ONNX test directory or
    Polygraphy's run results (.json, with `input_sets` the inputs they were computed from)."""
    key = ref.lower()
    if key in _RUNTIME_REFS:
        return ProtoReference(_RUNTIME_REFS[key], source)
    if key in BACKENDS:
        return EmberReference(model, key)
    if os.path.isdir(ref):
        return TestDirReference(ref)
    if ref.endswith(".npz"):
        if not os.path.isfile(ref):
            raise CheckError(f"recorded reference not found: {ref}")
        return NpzReference(ref)
    if ref.endswith(".json"):
        return PolygraphyReference(ref, input_sets)
    raise CheckError(f"unknown reference '{ref}'; use onnxruntime, onnx, one of "
                     f"{', '.join(BACKENDS)}, a .npz file, an ONNX test directory or "
                     "Polygraphy's results (.json)")


def write_golden(path: str, feeds: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
    """Record inputs and reference outputs as `input:NAME` / `output:NAME` in an .npz."""
    arrays = {}
    for prefix, values in (("input", feeds), ("output", outputs)):
        for name, value in values.items():
            if not isinstance(value, np.ndarray):
                raise CheckError(f"cannot record {prefix} '{name}' in an .npz: it is a "
                                 f"{_dtype_str(value)}, not a tensor")
            if value.dtype == object:  # strings: stored without pickle
                value = value.astype(str)
            arrays[f"{prefix}:{name}"] = value
    try:
        np.savez(path, **arrays)
    except OSError as exc:
        raise CheckError(f"cannot write '{path}': {exc}") from exc


# -- bisect ------------------------------------------------------------------------------------

@dataclass
class InputAgreement:
    """One input of the diverging node: whether both sides agreed on it, and its statistics."""
    name: str
    status: str  # "agrees", "not compared" (graph input, weight, or unavailable in the reference)
    candidate: ValueStats | None = None
    reference: ValueStats | None = None


@dataclass
class AddedError:
    """The node whose own error is largest: run alone on the reference's values of its inputs,
    its output is furthest from the reference's. Errors are in ulps: units in the last place of
    the value's dtype at the reference's largest magnitude (integers and bools: steps of 1)."""
    node_name: str
    op_type: str
    domain: str
    opset: int
    position: int  # 1-based, in topological order
    output: str  # the node's output where its own error is largest
    dtype: str
    isolated_ulps: float  # on the reference's inputs
    isolated_max_abs_error: float
    output_ulps: float | None  # in the candidate's own run (inputs carrying upstream error)
    input_ulps: float | None  # the worst of its inputs in the candidate's run, each in its units
    next_ulps: float  # the largest own error of any other node
    next_node: str
    nodes_isolated: int
    simplifier: str = ""  # "" as in the original model, else how the simplifier made the node


@dataclass
class BisectResult:
    """The first node whose output diverges while its inputs agree, or found=False."""
    found: bool
    nodes_compared: int
    node_name: str = ""
    op_type: str = ""
    domain: str = ""
    opset: int = 0
    position: int = 0  # 1-based, in topological order
    inputs: list[InputAgreement] = field(default_factory=list)
    outputs: list[Comparison] = field(default_factory=list)
    output_stats: list[dict[str, ValueStats]] = field(default_factory=list)
    values_not_compared: int = 0
    note: str = ""
    # the node that adds the most error of its own (see AddedError); None when none was isolated
    added_error: AddedError | None = None


class _Stream:
    """Yields, node by node, the reference's values for the candidate's node outputs."""

    def take(self, node) -> list[Any] | None:
        raise NotImplementedError


class _LockstepStream(_Stream):
    """Another ember plan of the same graph, advanced one node per candidate node."""

    def __init__(self, session: Session, feeds: Mapping[str, Any]):
        self.backend = session.backend_instance
        self.steps = session.iterate(feeds)

    def take(self, node) -> list[Any] | None:
        ref_node, values = next(self.steps)
        if list(ref_node.outputs) != list(node.outputs):  # plans order a graph identically
            raise CheckError(f"reference plan diverged from the candidate's at node "
                             f"'{node.name or node.outputs[0]}'")
        return [self.backend.to_host(v) for v in values]


class _ChunkedStream(_Stream):
    """onnxruntime/onnx values, fetched as graph outputs `chunk` at a time in candidate order."""

    def __init__(self, reference: ProtoReference, feeds: Mapping[str, Any],
                 order: Sequence[str], chunk: int):
        exposable = reference.produced_names()
        self.reference, self.feeds, self.chunk = reference, feeds, max(1, chunk)
        self.order = [n for n in order if n in exposable]
        self.position = {n: i for i, n in enumerate(self.order)}
        self.buffer: dict[str, Any] = {}

    def take(self, node) -> list[Any] | None:
        return [self._value(n) for n in node.outputs]

    def _value(self, name: str) -> Any:
        if name not in self.position:
            return _UNAVAILABLE
        if name not in self.buffer:
            start = self.position[name]
            self.buffer = self.reference.values(self.feeds,
                                                self.order[start:start + self.chunk])
        return self.buffer.pop(name)  # compared once, then dropped


_UNAVAILABLE = object()


def find_divergence(candidate: Session, reference: Reference | Session, feeds: Mapping[str, Any],
                    tolerances: Tolerances, chunk: int = DEFAULT_CHUNK,
                    original: Model | None = None) -> BisectResult:
    """Run the candidate step by step and compare each node's outputs with the reference's as
    they are produced; describe the first node that diverges while its inputs agree.

    The run goes on to the end: each node is also run alone on the reference's values of its
    inputs, and the node whose own error is largest is reported as `added_error`. Where every
    node differs a little (float16, where each side rounds differently), the first divergence
    is mere rounding; the node that adds the most error is the cause. `original` (the model
    as imported, before simplification) tells the simplifier's nodes from the model's own."""
    plan = candidate.plan
    steps = candidate.iterate(feeds)
    stream = _reference_stream(reference, feeds, plan, chunk)
    to_host = candidate.backend_instance.to_host
    graph = candidate.model.graph
    isolation = _Isolation(candidate, feeds)
    stats: dict[str, tuple[ValueStats, ValueStats | None]] = {}  # small: no arrays are kept
    ulps: dict[str, float] = {}  # each compared value's error in the candidate's run
    not_compared = position = 0
    first = None
    for position, (node, values) in enumerate(steps, start=1):
        expected = stream.take(node)
        isolation.measure(node, position, expected, stats)
        comparisons, out_stats = [], []
        for name, value, ref_value in zip(node.outputs, values, expected):
            if not name:
                continue
            value = to_host(value)
            if ref_value is _UNAVAILABLE:
                not_compared += 1
                continue
            comparisons.append(compare_values(name, value, ref_value,
                                              tolerances.for_value(name), tolerances.mode))
            stats[name] = (value_stats(value), value_stats(ref_value))
            out_stats.append({"candidate": stats[name][0], "reference": stats[name][1]})
            measured = error_in_ulps(value, ref_value)
            if measured is not None:
                ulps[name] = measured[1]
            isolation.keep(name, ref_value)  # only while a later node reads it
            del value, ref_value
        isolation.release(node)
        if first is None and any(not c.passed for c in comparisons):
            first = _finding(node, position, comparisons, out_stats, stats, graph, feeds,
                             not_compared)
    result = first or BisectResult(False, position, values_not_compared=not_compared)
    result.added_error = isolation.finding(ulps, _original_producers(original))
    return result


# -- bisect: each node on the reference's inputs ------------------------------------------------

class _Isolation:
    """Runs each candidate node's bound kernel alone on the reference's values of its inputs
    (Polygraphy's per-node isolation), and keeps the two nodes with the largest own error.

    The reference's values are kept from the node that produces them to the last node that
    reads them, so bisect holds about one run's values of the reference beside the
    candidate's. Nodes with subgraphs, and nodes with an input the reference does not expose
    (a value the simplifier made) or whose reference value differs in dtype or shape, are not
    isolated."""

    def __init__(self, session: Session, feeds: Mapping[str, Any]):
        plan = session.plan
        self.backend, self.feeds, self.constants = session.backend_instance, feeds, plan.initial_env
        self.steps = {id(s.node): s for s in plan.steps if not _is_transfer(s)}
        self.on_device = {id(node) for node, where in plan.placement if where == "device"}
        self.last_reader = {name: id(s.node) for s in plan.steps if not _is_transfer(s)
                            for name in s.node.inputs if name}
        self.values: dict[str, Any] = {}  # the reference's values still to be read
        self.ranked: list[_OwnError] = []  # the two nodes with the largest own error
        self.isolated = 0

    def keep(self, name: str, ref_value: Any) -> None:
        if name in self.last_reader and isinstance(ref_value, np.ndarray):
            self.values[name] = ref_value

    def release(self, node) -> None:
        for name in node.inputs:
            if name and self.last_reader.get(name) == id(node):
                self.values.pop(name, None)

    def measure(self, node, position: int, expected: list[Any], stats: dict) -> None:
        """Run `node` alone on the reference's inputs; rank it by its worst output's error."""
        step = self.steps.get(id(node))
        args = self._inputs(step, stats) if step is not None and not step.scope else None
        if args is None:
            return
        try:
            result = step.kernel.run(*args)
        except EmberError:  # the kernel refuses the reference's values: nothing to learn
            return
        self.isolated += 1
        got = result if type(result) is tuple else (result,)
        worst = None
        for name, value, ref_value in zip(node.outputs, got, expected):
            if not name or ref_value is _UNAVAILABLE or value is None:
                continue
            measured = error_in_ulps(np.asarray(self.backend.to_host(value)), ref_value)
            if measured is not None and (worst is None or measured[1] > worst.ulps):
                worst = _OwnError(measured[1], measured[0], position, node, name,
                                  _dtype_str(ref_value))
        if worst is not None:  # the larger error first; on a tie the earlier node
            self.ranked = sorted(self.ranked + [worst],
                                 key=lambda e: (-e.ulps, e.position))[:2]

    def _inputs(self, step, stats: dict) -> list[Any] | None:
        """The kernel's arguments: weights as the plan holds them (uploaded, prepared), feeds
        and the reference's values as copies (a kernel may write into an input it is given),
        on the device where the kernel reads them there; None if one is missing."""
        device_side = id(step.node) in self.on_device
        host_inputs = set(getattr(step.kernel, "host_inputs", ()))
        args = []
        for i, (name, slot) in enumerate(zip(step.node.inputs, step.inputs)):
            if not name:
                args.append(None)
                continue
            if name not in self.feeds and self.constants[slot] is not None:
                args.append(self.constants[slot])
                continue
            value = self.feeds.get(name, self.values.get(name))
            candidate, ref = stats.get(name, (None, None))
            if value is None or (candidate is not None and
                                 (candidate.dtype, candidate.shape) != (ref.dtype, ref.shape)):
                return None
            value = np.array(value)
            args.append(self.backend.to_device(value)
                        if device_side and i not in host_inputs else value)
        return args

    def finding(self, ulps: dict[str, float], original: dict[str, tuple[str, str]] | None
                ) -> AddedError | None:
        if not self.ranked:
            return None
        top, node = self.ranked[0], self.ranked[0].node
        runner_up = self.ranked[1] if len(self.ranked) > 1 else None
        inputs = [ulps[n] for n in node.inputs if n in ulps]
        return AddedError(node.name, node.op_type, node.domain, node.version, top.position,
                          top.output, top.dtype, top.ulps, top.abs_error, ulps.get(top.output),
                          max(inputs) if inputs else None,
                          runner_up.ulps if runner_up else 0.0,
                          _node_label(runner_up.node) if runner_up else "",
                          self.isolated, _simplifier_origin(node, original))


class _OwnError(NamedTuple):
    """One node's error on the reference's inputs, at its worst output."""
    ulps: float
    abs_error: float
    position: int
    node: Any
    output: str
    dtype: str


def error_in_ulps(value: Any, reference: Any) -> tuple[float, float] | None:
    """(max |value - reference|, the same in ulps: units in the last place of the reference's
    dtype at the reference's largest magnitude; integers and bools in steps of 1). inf where
    NaN or Inf sit at different places; None unless both are numeric arrays of one shape."""
    if not (isinstance(value, np.ndarray) and isinstance(reference, np.ndarray)) or \
            value.shape != reference.shape or not (_is_numeric(value) and _is_numeric(reference)) \
            or value.dtype.kind == "c" or reference.dtype.kind == "c":
        return None
    if not value.size:
        return 0.0, 0.0
    v, r = value.astype(np.float64), reference.astype(np.float64)
    finite = np.isfinite(v) & np.isfinite(r)
    if not finite.all():
        if _special_mismatch(v, r).any():
            return math.inf, math.inf
        v, r = v[finite], r[finite]
    if not r.size:
        return 0.0, 0.0
    error = float(np.max(np.abs(v - r)))
    if _is_exact(reference):
        return error, error
    scale = float(np.max(np.abs(r))) or float(np.max(np.abs(v)))  # all-zero reference: v's
    return error, error / _ulp(reference.dtype, scale)


def _ulp(dtype: np.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (its smallest normal's below that)."""
    info = _float_info(dtype)
    if info is None:
        return 1.0
    magnitude = max(magnitude, float(info.smallest_normal))
    return 2.0 ** (math.floor(math.log2(magnitude)) - int(info.nmant))


def _float_info(dtype: np.dtype) -> Any:
    """numpy's finfo, or ml_dtypes' for bfloat16 and the float8 kinds; None for others."""
    if dtype.kind == "f":
        return np.finfo(dtype)
    try:
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    except (ImportError, TypeError, ValueError):
        return None


def _node_label(node) -> str:
    return node.name or node.outputs[0]


# The simplifier's passes that create each op (passes are named as `skip=` takes them).
_MADE_BY = {("", "LayerNormalization"): "fuse_layernorm", ("", "Gelu"): "fuse_gelu",
            ("", "Attention"): "fuse_attention", ("", "Gemm"): "fuse_matmul_add",
            (FUSED_DOMAIN, "FusedMatMul"): "fuse_matmul_add",
            (FUSED_DOMAIN, "FusedGemm"): "fuse_activations",
            (FUSED_DOMAIN, "FusedConv"): "fuse_activations",
            ("", "Split"): "fuse_attention_projections", ("", "Gather"): "slice_squeeze_to_gather",
            ("", "Cast"): "widen_output_cast", ("", "QLinearConv"): "fuse_qdq",
            ("", "QLinearMatMul"): "fuse_qdq", ("com.microsoft", "QGemm"): "fuse_qdq",
            ("com.microsoft", "QLinearAdd"): "fuse_qdq",
            ("com.microsoft", "QLinearMul"): "fuse_qdq",
            ("com.microsoft", "QLinearGlobalAveragePool"): "fuse_qdq"}


def _original_producers(original: Model | None) -> dict[str, tuple[str, str]] | None:
    """{value: (domain, op type) of the node producing it} in the graph before simplification
    (None when it is not known)."""
    if original is None:
        return None
    return {o: (n.domain, n.op_type) for n in original.graph.nodes for o in n.outputs if o}


def _simplifier_origin(node, original: dict[str, tuple[str, str]] | None) -> str:
    """How the simplifier made `node`: '' where the original graph has it (same op making the
    same value) or the original is unknown; else which pass creates such nodes, and what
    the original graph has in its place."""
    if original is None:
        return ""
    name = next((o for o in node.outputs if o), "")
    before = original.get(name)
    if before == (node.domain, node.op_type):
        return ""
    made = _MADE_BY.get((node.domain, node.op_type))
    text = f"made by the simplifier (pass {made})" if made else "made by the simplifier"
    if before is None:
        return f"{text}, computing a value the original graph does not have"
    domain = f"{before[0]}::" if before[0] else ""
    return f"{text}, in place of the original graph's {domain}{before[1]} node"


def _reference_stream(reference: Reference | Session, feeds: Mapping[str, Any], plan,
                      chunk: int) -> _Stream:
    if isinstance(reference, EmberReference):
        reference = reference.session
    if isinstance(reference, Session):
        return _LockstepStream(reference, feeds)
    if isinstance(reference, ProtoReference):
        order = [o for step in plan.steps if not _is_transfer(step) for o in step.node.outputs
                 if o]
        return _ChunkedStream(reference, feeds, order, chunk)
    raise CheckError(_NEEDS_RUNTIME)


_NEEDS_RUNTIME = ("--bisect needs a reference that can run the model (onnxruntime, onnx or an "
                  "ember backend); recorded data holds only the final outputs")


def _is_transfer(step) -> bool:
    from ember.runtime.executor import Transfer

    return isinstance(step.kernel, Transfer)


def _finding(node, position: int, comparisons: list[Comparison], out_stats: list,
             stats: dict, graph, feeds: Mapping[str, Any], not_compared: int) -> BisectResult:
    inputs = []
    for name in node.inputs:
        if not name:
            continue
        if name in stats:
            inputs.append(InputAgreement(name, "agrees", *stats[name]))
        elif name in feeds or name in graph.initializers:
            value = feeds[name] if name in feeds else graph.initializers[name]
            kind = "graph input" if name in feeds else "initializer"
            inputs.append(InputAgreement(name, f"agrees ({kind}, same on both sides)",
                                         value_stats(value), None))
        else:
            inputs.append(InputAgreement(name, "not compared (the reference does not expose it)"))
    unchecked = [i.name for i in inputs if i.status.startswith("not compared")]
    note = f"input(s) {', '.join(unchecked)} could not be compared" if unchecked else ""
    return BisectResult(True, position, node.name, node.op_type, node.domain, node.version,
                        position, inputs, comparisons, out_stats, not_compared, note)


# -- the check ---------------------------------------------------------------------------------

@dataclass
class BackendReport:
    backend: str
    outputs: list[Comparison]
    bisect: BisectResult | None = None
    # with iterations: {"median_ms", "p90_ms", "min_ms", "iterations", "warm_up"}
    timing: dict[str, float] | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.outputs)


@dataclass
class CheckReport:
    """What `ember check` found: per backend, per output, and the bisect finding if asked."""
    model: str
    reference: str
    mode: str
    backends: list[BackendReport]
    inputs: dict[str, ValueStats]
    saved_golden: str | None = None
    simplified: bool = True  # each backend ran its simplified graph (False: --no-simplify)

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.backends)

    @property
    def exit_code(self) -> int:
        """0 when every output passes, 1 on a mismatch (errors raise instead: exit 2)."""
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        for backend, raw in zip(self.backends, data["backends"]):
            raw["passed"] = backend.passed
            for comparison, out in zip(backend.outputs, raw["outputs"]):
                out["mismatch_share"] = comparison.mismatch_share
        return _json_safe(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        return format_report(self)


def check(model: ModelSource, backend: str | Sequence[str] | None = None,
          ref: str = "onnxruntime", *, inputs: Mapping[str, Any] | None = None,
          seed: int = 0, dims: Mapping[str, int] | None = None,
          ranges: Mapping[str, tuple[float, float]] | None = None,
          atol: float | Mapping[str, float] = DEFAULT_ATOL,
          rtol: float | Mapping[str, float] = DEFAULT_RTOL, mode: str = "elementwise",
          bisect: bool = False, save_golden: str | None = None,
          chunk: int = DEFAULT_CHUNK, validate: bool = False, topk: int = 0,
          fail_fast: bool = False, iterations: int = 0, warm_up: int = 0,
          marks: Sequence[str] = (), input_sets: Sequence[Mapping[str, Any]] | None = None,
          save_inputs: str | None = None, save_outputs: str | None = None,
          simplify: bool = True) -> CheckReport:
    """Compare `model` on each candidate `backend` (a name, "cpu,opencl" or a list; default
    $EMBER_BACKEND or cpu) with `ref`; see the module docstring for references and modes.

    `inputs` fixes some or all feeds (the rest are random from `seed`, `dims`, `ranges`); recorded
    references bring their own. `atol`/`rtol` are floats or {output: value} ("" for the global
    value). `bisect` also names the first node that diverges and the node that adds the most
    error of its own (see find_divergence); `save_golden` records the
    inputs and the reference's outputs as an .npz. `validate`: NaN or Inf on either side
    fails; `topk`: the indices of each row's k largest values must also agree. `fail_fast`
    stops at the first data set and backend that fail. `iterations` (after `warm_up` untimed
    runs) times each backend on the first data set. `marks` names intermediate values to
    compare too (on the first data set), reported as "mark:NAME". Polygraphy's JSON:
    `input_sets` (its --save-inputs files, ember.polygraphy_json.load_inputs) are the data sets
    to run; `save_inputs` / `save_outputs` write the data sets and each backend's outputs in
    its formats (runners named ember-BACKEND), so `polygraphy run --load-inputs /
    --load-outputs` can use them. `simplify` (the default) checks each backend's graph
    simplified for it, as `ember.load` runs it, and an ember backend as the reference then runs
    the same simplified graph; simplify=False checks the graph as imported."""
    if iterations < 0 or warm_up < 0:
        raise InputError("--iterations and --warm-up must not be negative")
    tolerances = Tolerances(atol, rtol, mode, validate=validate, topk=topk)
    ir = model if isinstance(model, Model) else import_model(model)
    source = model if not isinstance(model, Model) else ir.path
    if source is None and ref.lower() in _RUNTIME_REFS:
        raise CheckError(f"--ref {ref} needs the ONNX model (a path, bytes or ModelProto), "
                         "not ember IR built in memory")
    # Per-value tolerances may name outputs or, for --bisect, intermediate values.
    values = {v.name for v in ir.graph.outputs} | {o for n in ir.graph.nodes for o in n.outputs}
    unmarked = sorted(set(marks) - values)
    if unmarked:
        raise InputError(f"--mark: no node produces {', '.join(unmarked)}")
    unknown = tolerances.unknown_outputs(values)
    if unknown:
        raise InputError(f"tolerance given for unknown value(s) {', '.join(unknown)}; the "
                         f"model's outputs are {', '.join(v.name for v in ir.graph.outputs)}")
    backends = _backend_names(backend)
    reference = make_reference(ref, source, ir, input_sets)
    try:
        if bisect and not isinstance(reference, (ProtoReference, EmberReference)):
            raise CheckError(_NEEDS_RUNTIME)
        cases = _prepare_cases(reference, ir, inputs, seed, dims, ranges,
                               None if isinstance(reference, PolygraphyReference)
                               else input_sets)
        if save_inputs:
            from ember.polygraphy_json import save_inputs as write_inputs
            write_inputs(save_inputs, [feeds for feeds, _ in cases])
        if save_golden:
            if len(cases) != 1:
                raise CheckError("--save-golden records one data set; this reference has "
                                 f"{len(cases)}")
            write_golden(save_golden, *cases[0])
        reports, runs = [], []
        for name in backends:
            collected = [] if save_outputs else None
            reports.append(_check_backend(ir, name, reference, cases, tolerances, bisect, chunk,
                                          fail_fast, iterations, warm_up, marks, collected,
                                          simplify))
            if collected is not None:
                runs.append((f"ember-{name}", collected))
            if fail_fast and not reports[-1].passed:
                break  # the backends after the first failing one are not run
        if save_outputs:
            from ember.polygraphy_json import save_run_results
            save_run_results(save_outputs, runs)
    finally:
        reference.close()
    return CheckReport(model=str(ir.path or "<memory>"), reference=reference.name, mode=mode,
                       backends=reports, inputs={k: value_stats(v) for k, v in cases[0][0].items()},
                       saved_golden=save_golden, simplified=simplify)


def _backend_names(backend: str | Sequence[str] | None) -> list[str]:
    if backend is None or isinstance(backend, str):
        parts = [p.strip() for p in (backend or "").split(",") if p.strip()] or [None]
    else:
        parts = list(backend)
    return [resolve_backend_name(p) for p in parts]


def _prepare_cases(reference: Reference, ir: Model,
                   inputs: Mapping[str, Any] | None, seed: int, dims, ranges,
                   input_sets: Sequence[Mapping[str, Any]] | None = None) -> list[Case]:
    """Feeds and expected outputs per data set: recorded, or computed by the reference (on
    each of `input_sets`, or on one set)."""
    from ember.runtime.session import io_info

    graph = ir.graph
    declared = [io_info(v) for v in graph.inputs if v.name not in graph.initializers]
    bounds = index_bounds(graph)
    recorded = reference.cases(ir)
    if recorded:
        clash = sorted(set(inputs or {}) & set().union(*(set(f) for f, _ in recorded)))
        if clash:
            raise InputError(f"the recorded reference fixes input(s) {', '.join(clash)}; "
                             "drop -i/--inputs for them")
        return [(make_inputs(declared, {**feeds, **(inputs or {})}, dims, ranges, seed, bounds),
                 outputs) for feeds, outputs in recorded]
    cases = []
    for given in input_sets or [{}]:
        feeds = make_inputs(declared, {**given, **(inputs or {})}, dims, ranges, seed, bounds)
        cases.append((feeds, reference.outputs(feeds)))
    return cases


def _check_backend(ir: Model, backend: str, reference: Reference, cases: list[Case],
                   tolerances: Tolerances, want_bisect: bool, chunk: int,
                   fail_fast: bool = False, iterations: int = 0,
                   warm_up: int = 0, marks: Sequence[str] = (),
                   collected: list | None = None, simplify: bool = True) -> BackendReport:
    # simplified as ember.load does it: on a copy of the IR, for this backend
    session = load(ir, backend, simplify=True) if simplify else Session(ir, backend)
    same_graph = _same_graph_reference(reference, session)
    if same_graph is not reference:  # its outputs computed again, from the simplified graph
        reference, cases = same_graph, [(feeds, same_graph.outputs(feeds)) for feeds, _ in cases]
    outputs = []
    for index, (feeds, expected) in enumerate(cases):
        if fail_fast and not all(c.passed for c in outputs):
            break  # the first data set that fails is the last one run
        got = session.run(feeds)
        if collected is not None:  # --save-outputs
            collected.append(got)
        for name, ref_value in expected.items():
            if name not in got:
                tol = tolerances.for_value(name)
                outputs.append(Comparison(name, False, "missing", None, _dtype_str(ref_value),
                                          _shape(ref_value), tol.atol, tol.rtol,
                                          note="the candidate has no such output"))
                continue
            comparison = compare_values(name, got[name], ref_value,
                                        tolerances.for_value(name), tolerances.mode)
            comparison.dataset = index if len(cases) > 1 else None
            outputs.append(comparison)
        del got
    if marks:
        outputs.extend(_compare_marks(session, reference, cases[0][0], marks, tolerances))
    report = BackendReport(backend, outputs)
    if want_bisect:
        report.bisect = find_divergence(session, reference, cases[0][0], tolerances, chunk,
                                        original=ir)
    if iterations:
        report.timing = _time_runs(session, cases[0][0], iterations, warm_up)
    return report


def _same_graph_reference(reference: Reference, session: Session) -> Reference:
    """An ember backend as the reference runs the candidate's own graph, simplified where the
    candidate's is: it checks one backend's kernels against another's on the same nodes, and
    bisect runs the two plans in lockstep, node for node."""
    if isinstance(reference, EmberReference) and session.model is not reference.session.model:
        return EmberReference(session.model, reference.name)
    return reference


def _marked_values(session: Session, feeds: Mapping[str, Any], names: Sequence[str]
                   ) -> dict[str, Any]:
    """The values `names` take in one run of `session`'s plan (host copies)."""
    wanted, found = set(names), {}
    to_host = session.backend_instance.to_host
    for node, values in session.iterate(feeds):
        for name, value in zip(node.outputs, values):
            if name in wanted:
                found[name] = to_host(value) if value is not None else None
    return found


def _reference_marks(reference: Reference, feeds: Mapping[str, Any], names: Sequence[str]
                     ) -> dict[str, Any]:
    if isinstance(reference, ProtoReference):
        return reference.values(feeds, list(names))
    if isinstance(reference, EmberReference):
        return _marked_values(reference.session, feeds, names)
    raise CheckError("--mark needs a runtime reference (onnxruntime, onnx or an ember "
                     "backend): recorded data holds no intermediate values")


def _compare_marks(session: Session, reference: Reference, feeds: Mapping[str, Any],
                   marks: Sequence[str], tolerances: Tolerances) -> list[Comparison]:
    """--mark: each named intermediate value compared as an output is, "mark:NAME"."""
    got, want = _marked_values(session, feeds, marks), _reference_marks(reference, feeds, marks)
    compared = []
    for name in marks:
        comparison = compare_values(f"mark:{name}", got.get(name), want.get(name),
                                    tolerances.for_value(name), tolerances.mode)
        if name not in got:  # only a simplified graph lacks a value the model computes
            comparison.passed = False
            comparison.note = "the simplified graph does not compute it (fused or folded " \
                              "away); compare it with --no-simplify"
        compared.append(comparison)
    return compared


def _time_runs(session: Session, feeds: Mapping[str, Any], iterations: int,
               warm_up: int) -> dict[str, float]:
    """Latency of `session.run(feeds)`: `warm_up` untimed runs, then `iterations` timed."""
    import time

    for _ in range(warm_up):
        session.run(feeds)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        session.run(feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "min_ms": float(min(times)), "iterations": iterations, "warm_up": warm_up}


# -- printing ----------------------------------------------------------------------------------

def format_report(report: CheckReport) -> str:
    """The human-readable report: one block per output, bisect findings, a summary line."""
    lines = [f"ember check {report.model}: reference {report.reference}, "
             f"check {report.mode}" + ("" if report.simplified else ", graph as imported")]
    for b in report.backends:
        for c in b.outputs:
            lines.extend(_format_comparison(f"[{b.backend}]", c))
        if b.bisect is not None:
            lines.extend(_format_bisect(b.backend, b.bisect))
        if b.timing is not None:
            t = b.timing
            lines.append(f"[{b.backend}] latency: median {t['median_ms']:.3f} ms, p90 "
                         f"{t['p90_ms']:.3f} ms, min {t['min_ms']:.3f} ms over "
                         f"{t['iterations']} run(s) after {t['warm_up']} warm-up run(s)")
    if report.saved_golden:
        lines.append(f"saved inputs and reference outputs to {report.saved_golden}")
    lines.append(_summary_line(report))
    return "\n".join(lines)


def _format_comparison(head: str, c: Comparison, indent: str = "") -> list[str]:
    label = c.name if c.dataset is None else f"{c.name} (data set {c.dataset})"
    lines = [f"{indent}{head} {label}: {'PASS' if c.passed else 'FAIL'}"
             + (f" ({c.note})" if c.note else "")]
    pad = indent + "    "
    lines.append(f"{pad}candidate {c.candidate_dtype} {_fmt_shape(c.candidate_shape)}, "
                 f"reference {c.reference_dtype} {_fmt_shape(c.reference_shape)}")
    if c.max_abs_error is not None and c.max_abs_error_at is None:
        lines.append(f"{pad}no elements to compare (empty tensors)")
    elif c.max_abs_error is not None:
        lines.append(f"{pad}max abs error {_g(c.max_abs_error)} at {c.max_abs_error_at} "
                     f"(candidate {_g(c.candidate_at_max)}, reference {_g(c.reference_at_max)}); "
                     f"max rel error {_g(c.max_rel_error)}; mean abs error {_g(c.mean_abs_error)}")
    if c.statistic is not None:
        lines.append(f"{pad}{c.statistic_name}: {_g(c.statistic)}")
    if c.total:
        lines.append(f"{pad}out of tolerance: {c.mismatched:,} of {c.total:,} "
                     f"({100 * c.mismatch_share:.3g}%) at atol {_g(c.atol)}, rtol {_g(c.rtol)}")
    if not c.passed and c.min_atol is not None:
        lines.append(f"{pad}would pass with atol >= {_g(c.min_atol)} (rtol {_g(c.rtol)}) or "
                     f"rtol >= {_g(c.min_rtol)} (atol {_g(c.atol)})")
    return lines


def _format_bisect(backend: str, b: BisectResult) -> list[str]:
    return _format_first_divergence(backend, b) + _format_added_error(backend, b.added_error)


def _format_first_divergence(backend: str, b: BisectResult) -> list[str]:
    if not b.found:
        extra = f"; {b.values_not_compared} value(s) not exposed by the reference" \
            if b.values_not_compared else ""
        return [f"[{backend}] bisect: no node diverges ({b.nodes_compared} nodes compared{extra})"]
    domain = f"{b.domain}::" if b.domain else ""
    lines = [f"[{backend}] bisect: first divergence at node '{b.node_name or b.outputs[0].name}' "
             f"({domain}{b.op_type}, opset {b.opset}), node {b.position} in topological order"]
    if b.note:
        lines.append(f"    note: {b.note}")
    for i in b.inputs:
        lines.append(f"    input '{i.name}': {i.status}"
                     + (f"; {_fmt_stats(i.candidate)}" if i.candidate else ""))
    for c, s in zip(b.outputs, b.output_stats):
        lines.extend(_format_comparison("output", c, indent="    "))
        lines.append(f"        candidate {_fmt_stats(s['candidate'])}")
        lines.append(f"        reference {_fmt_stats(s['reference'])}")
    return lines


def _format_added_error(backend: str, a: AddedError | None) -> list[str]:
    """The node whose own error is largest, against the other nodes and its inputs' error."""
    if a is None:
        return []
    domain = f"{a.domain}::" if a.domain else ""
    node = f"node '{a.node_name or a.output}' ({domain}{a.op_type}, opset {a.opset}), " \
           f"node {a.position} in topological order" + (f", {a.simplifier}" if a.simplifier else "")
    head = f"[{backend}] bisect: error grows most at {node}" if a.isolated_ulps > _ROUNDING_ULPS \
        else f"[{backend}] bisect: no node adds more than rounding; the most: {node}"
    others = f" ('{a.next_node}')" if a.next_node else ""
    lines = [head, f"    on the reference's inputs it is off by {_ulps(a.isolated_ulps)} of "
                   f"{a.dtype} (max abs error {_g(a.isolated_max_abs_error)} in '{a.output}'); "
                   f"no other of the {a.nodes_isolated} nodes run so is off by more than "
                   f"{_ulps(a.next_ulps)}{others}"]
    if a.output_ulps is not None:
        inputs = f"its inputs at most {_ulps(a.input_ulps)}, " if a.input_ulps is not None else ""
        lines.append(f"    in the candidate's own run: {inputs}its output {_ulps(a.output_ulps)} "
                     "off the reference")
    return lines


# Two correctly rounded results differ by up to one unit in the last place.
_ROUNDING_ULPS = 1.0


def _ulps(x: float) -> str:
    return f"{x:.3g} ulp" + ("" if x == 1 else "s")


def _summary_line(report: CheckReport) -> str:
    total = sum(len(b.outputs) for b in report.backends)
    failed = [(b.backend, c.name) for b in report.backends for c in b.outputs if not c.passed]
    names = ", ".join(b.backend for b in report.backends)
    if not failed:
        return f"PASS: {total} output(s) within tolerance on {names} vs {report.reference}"
    listed = ", ".join(f"{name} on {backend}" for backend, name in failed)
    return f"FAIL: {len(failed)} of {total} output(s) out of tolerance: {listed}"


def _fmt_stats(s: ValueStats) -> str:
    text = f"{s.dtype} {_fmt_shape(s.shape)}"
    if s.min is not None:
        text += f" min {_g(s.min)} max {_g(s.max)} mean {_g(s.mean)} std {_g(s.std)}"
    if s.nan or s.inf:
        text += f" NaN {s.nan} Inf {s.inf}"
    return text


def _fmt_shape(shape: list[int] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _g(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _json_safe(value: Any) -> Any:
    """Infinities and NaN as strings: strict JSON has no literals for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


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
