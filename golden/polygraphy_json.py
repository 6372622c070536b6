"""Polygraphy's JSON files, read and written without Polygraphy: input data
(`polygraphy run --save-inputs` / `--load-inputs`: a list of {name: array}, one per iteration)
and run results (`--save-outputs` / `--load-outputs`: per runner, a list of iterations, each
{"outputs": {name: array}}).

An array is {"array": base64 of numpy's .npy bytes, "polygraphy_class": "ndarray"}, wrapped in
{"values": ..., "polygraphy_class": "LazyArray"} in run results. Arrays are read with
`allow_pickle=False`: a file can hold numbers, never code (an object array is refused).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any, Mapping, Sequence

import numpy as np

from ember.errors import InputError


def load_inputs(path: str) -> list[dict[str, np.ndarray]]:
    """The input data sets of a `--save-inputs` file."""
    data = _read(path)
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise InputError(f"{path}: not Polygraphy input data (a JSON list of "
                         "{name: array} objects)")
    return [{str(k): _array(v, path) for k, v in feeds.items()} for feeds in data]


def save_inputs(path: str, data_sets: Sequence[Mapping[str, Any]]) -> None:
    _write(path, [{k: _encode(v) for k, v in feeds.items()} for feeds in data_sets])


def load_run_results(path: str) -> list[tuple[str, list[dict[str, np.ndarray]]]]:
    """[(runner name, [outputs of each iteration])] of a `--save-outputs` file."""
    data = _read(path)
    try:
        runners = data["lst"] if isinstance(data, dict) else None
        return [(str(name), [{str(k): _array(v, path) for k, v in it["outputs"].items()}
                             for it in iterations]) for name, iterations in runners]
    except (TypeError, KeyError, ValueError) as exc:
        raise InputError(f"{path}: not Polygraphy run results ({exc})") from None


def save_run_results(path: str, runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]
                     ) -> None:
    _write(path, {"lst": [[name, [{"outputs": {k: {"values": _encode(v),
                                                   "polygraphy_class": "LazyArray"}
                                               for k, v in outputs.items()},
                                   "runtime": 0.0, "runner_name": name,
                                   "polygraphy_class": "IterationResult"}
                                  for outputs in iterations]] for name, iterations in runs],
                  "polygraphy_class": "RunResults"})


def _read(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None


def _write(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _array(entry: Any, path: str) -> np.ndarray:
    if isinstance(entry, dict) and entry.get("polygraphy_class") == "LazyArray":
        entry = entry.get("values")
    if not isinstance(entry, dict) or entry.get("polygraphy_class") != "ndarray":
        raise InputError(f"{path}: expected a Polygraphy ndarray, got {str(entry)[:60]!r}")
    try:
        raw = base64.b64decode(entry["array"], validate=True)
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (KeyError, TypeError, binascii.Error, ValueError, EOFError) as exc:
        raise InputError(f"{path}: an array that is not numpy .npy data ({exc})") from None


def _encode(value: Any) -> dict[str, str]:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(value), allow_pickle=False)
    return {"array": base64.b64encode(buffer.getvalue()).decode("ascii"),
            "polygraphy_class": "ndarray"}
