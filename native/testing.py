"""Helpers to load a generated package and compare its outputs with the executor's, shared by
tests/tools/test_native.py and the benchmark scripts."""
from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
from typing import Any

import numpy as np

_counter = itertools.count()


def import_generated(package_dir: str) -> Any:
    """Import a generated package from its folder under a fresh, unique module name."""
    name = f"_ember_generated_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def identical(a: Any, b: Any) -> str | None:
    """None when `a` and `b` are the same bits (arrays), the same sequences or both None;
    otherwise what differs."""
    if a is None or b is None:
        return None if a is None and b is None else "one value is None"
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)) or len(a) != len(b):
            return "sequence length or kind differs"
        for i, (x, y) in enumerate(zip(a, b)):
            why = identical(x, y)
            if why:
                return f"[{i}] {why}"
        return None
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    if a.dtype == object:
        return None if a.tolist() == b.tolist() else "object values differ"
    if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
        return "values differ"
    return None


def as_list(result: Any, n_outputs: int) -> list:
    return list(result) if n_outputs != 1 else [result]


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="ember-native-")
