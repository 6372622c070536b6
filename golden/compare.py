"""Tolerances, one value compared with its reference, and a value's statistics."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ember.errors import EmberError, InputError

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
