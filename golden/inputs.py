"""Model inputs for the command line: read from files, or random from the declared types and
shapes (shared by `ember run`, `ember check` and `ember simplify`)."""
from __future__ import annotations

import re
import zipfile
from typing import Any, Mapping, Sequence

import numpy as np

from ember import limits
from ember.errors import InputError
from ember.ir import Graph
from ember.ops import registry
from ember.runtime.session import IOInfo

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
# what reading an array file can raise besides OSError: numpy's ValueErrors (a bad header, an
# object array), a broken zip, a file cut short
_READ_ERRORS = (OSError, ValueError, zipfile.BadZipFile, EOFError)


def load_input_files(files: Mapping[str, str] | None = None, npz: str | None = None
                     ) -> dict[str, np.ndarray]:
    """Inputs from `-i NAME=FILE.npy` pairs and an `--inputs FILE.npz` (keys NAME or input:NAME)."""
    feeds: dict[str, np.ndarray] = {}
    if npz:
        what = f"inputs from '{npz}'"
        _check_format(npz, what, _ZIP_MAGIC, "an .npz file (numpy.savez)")
        try:
            with np.load(npz, allow_pickle=False) as data:
                for key in data.files:
                    if key.startswith("output:"):
                        continue
                    feeds[key[len("input:"):] if key.startswith("input:") else key] = data[key]
        except _READ_ERRORS as exc:
            raise InputError(f"cannot read {what}: {_reason(exc)}") from exc
    for name, path in (files or {}).items():
        what = f"input '{name}' from '{path}'"
        _check_format(path, what, _NPY_MAGIC, "a .npy file (numpy.save)")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except _READ_ERRORS as exc:
            raise InputError(f"cannot read {what}: {_reason(exc)}") from exc
    return feeds


def _check_format(path: str, what: str, magic: bytes, kind: str) -> None:
    """Refuse a file that does not start as `kind` does (numpy would try to unpickle it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(magic))
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror or exc}") from exc
    if head != magic:
        raise InputError(f"cannot read {what}: it is not {kind}")


def _reason(exc: Exception) -> str:
    """numpy's message, without its advice to unpickle (ember never loads pickles)."""
    text = getattr(exc, "strerror", None) or str(exc)
    if "allow_pickle" in text or "pickled" in text:
        return ("it holds Python objects (a pickled object array), which ember does not "
                "load; save strings as a unicode array (arr.astype(str))")
    return text


def make_inputs(inputs: Sequence[IOInfo], given: Mapping[str, Any] | None = None,
                dims: Mapping[str, int] | None = None,
                ranges: Mapping[str, tuple[float, float]] | None = None,
                seed: int = 0, bounds: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Feeds for every model input: `given` ones as they are, the others random from the declared
    dtype and shape (`dims` sizes symbolic dimensions, default 1; `ranges` bounds the values:
    integers draw from [LO, HI), floats uniformly from [LO, HI); default N(0, 1) and [0, 10)).
    Integer inputs in `bounds` (index inputs: `index_bounds`) draw from [0, min(10, bound))
    where `ranges` does not name them: a BERT's token types index a table of 2 rows."""
    given, dims, ranges = dict(given or {}), dict(dims or {}), dict(ranges or {})
    known = {i.name for i in inputs}
    unknown = sorted((set(given) | set(ranges)) - known)
    if unknown:
        raise InputError(f"unknown input name(s) {', '.join(unknown)}; the model's inputs are "
                         f"{', '.join(i.name for i in inputs) or 'none'}")
    for name, bound in (bounds or {}).items():
        if name in known and bound > 0:
            ranges.setdefault(name, (0, min(_INT_HIGH, bound)))
    _check_dims(inputs, dims)
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in inputs:
        if info.name in given:
            feeds[info.name] = _as_declared(info, given[info.name])
        else:
            feeds[info.name] = random_input(info, dims, ranges.get(info.name), rng)
    return feeds


_INT_HIGH = 10  # random integers are below this by default


def index_bounds(graph: Graph) -> dict[str, int]:
    """Graph inputs that index into a constant (a Gather's indices into an embedding table, as
    the op's `index_inputs` declares): name -> the size they index, the smallest where several
    nodes use one. Subgraphs are not searched."""
    bounds: dict[str, int] = {}
    fed = {v.name for v in graph.inputs} - set(graph.initializers)
    for node in graph.nodes:
        impl = registry.lookup(node.domain, node.op_type, node.version)
        for index, (indexed, axis_attribute, axis) in getattr(impl, "index_inputs", {}).items():
            name = node.inputs[index] if index < len(node.inputs) else ""
            table = graph.initializers.get(node.inputs[indexed]) \
                if indexed < len(node.inputs) else None
            if name not in fed or not isinstance(table, np.ndarray) or table.ndim == 0:
                continue
            if axis_attribute is not None:
                axis = node.attrs.get(axis_attribute, axis)
            if isinstance(axis, (int, np.integer)) and -table.ndim <= axis < table.ndim:
                bounds[name] = min(bounds.get(name, table.shape[axis]), table.shape[axis])
    return bounds


def dim_size(dim: Any, dims: Mapping[str, int]) -> int:
    """The size of a declared dimension for random inputs: a fixed one as it is; a symbolic
    one from `dims` (default 1); an expression of symbols, as exporters name a dimension that
    grows from another ("past + 1", "2*seq"), from the sizes of its symbols, so that a
    decoder's mask is one longer than its cache. Anything else unknown is 1."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim if dim > 0 else 1
    if not isinstance(dim, str):
        return 1
    if dim in dims:
        return int(dims[dim])
    value = _dim_expression(dim, dims)
    return value if value is not None and value >= 0 else 1


_DIM_TOKEN = re.compile(r"\s*(?:(\d{1,9})|([A-Za-z_][A-Za-z0-9_]*)|([-+*]))")
_DIM_MAX = 1 << 62  # beyond this an expression is no size (and its arithmetic stays cheap)


def _dim_expression(text: str, dims: Mapping[str, int]) -> int | None:
    """A sum of products of symbols and integers ("past + 1", "2*seq - 1"), or None where
    `text` is not one (a plain symbol included): parsed, never evaluated as code."""
    tokens, at, end = [], 0, len(text.rstrip())
    while at < end:
        match = _DIM_TOKEN.match(text, at)
        if match is None:
            return None
        tokens.append(match.groups())
        at = match.end()
    if len(tokens) < 3 or len(tokens) % 2 == 0:
        return None  # a symbol or a number alone is no expression; nor is "a +"
    total, sign, term = 0, 1, 1
    for k, (number, name, operator) in enumerate(tokens):
        if k % 2 == 0:                         # an operand
            if operator is not None:
                return None
            term *= int(number) if number is not None else int(dims.get(name, 1))
        elif operator is None:                 # two operands in a row
            return None
        elif operator != "*":
            total, sign, term = total + sign * term, 1 if operator == "+" else -1, 1
        if abs(term) > _DIM_MAX or abs(total) > _DIM_MAX:
            return None
    return total + sign * term


def dim_symbols(dim: Any) -> set[str]:
    """The symbols a declared dimension names: itself, or those of its expression."""
    if not isinstance(dim, str) or not dim:
        return set()
    if _dim_expression(dim, {}) is None:
        return {dim}
    return {dim} | set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim))


def random_input(info: IOInfo, dims: Mapping[str, int], value_range: tuple[float, float] | None,
                 rng: np.random.Generator) -> np.ndarray:
    """A random array of an input's declared dtype and shape."""
    if info.dtype is None or info.shape is None:
        raise InputError(f"input '{info.name}' ({info.type}) declares no tensor type and shape; "
                         "feed it with -i NAME=FILE.npy or --inputs FILE.npz")
    shape = [dim_size(d, dims) for d in info.shape]
    dtype = np.dtype(info.dtype)
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes > limits.current():
        raise InputError(f"a random input '{info.name}' of shape {shape} ({dtype}) would take "
                         f"{limits.describe_bytes(nbytes)}, over the limit of "
                         f"{limits.describe_bytes(limits.current())} per tensor; choose smaller "
                         f"--dim values")
    if dtype == bool:
        return np.asarray(rng.random(shape) < 0.5)  # a 0-d comparison gives a numpy scalar
    if dtype == object:
        return np.array(rng.choice(["a", "b", "c"], size=shape), dtype=object)
    if dtype.kind in "iu":
        lo, hi = value_range or (0, _INT_HIGH)
        return rng.integers(int(lo), int(hi), size=shape).astype(dtype)
    if value_range is not None:
        return rng.uniform(value_range[0], value_range[1], size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _as_declared(info: IOInfo, value: Any) -> Any:
    """Recorded strings come back as fixed-width unicode; the model wants object arrays."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "U" and info.dtype == object:
        return value.astype(object)
    return value


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """`--dim NAME=VALUE` -> {NAME: VALUE} for symbolic dimensions (VALUE an int >= 0)."""
    dims = {}
    for name, text in parse_pairs(items, "--dim").items():
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise InputError(f"--dim {name}={text}: the size must be an integer >= 0")
        dims[name] = value
    return dims


def _check_dims(inputs: Sequence[IOInfo], dims: Mapping[str, int]) -> None:
    """Every --dim names a symbolic dimension of the model's inputs (a typo would otherwise
    silently leave that dimension at 1)."""
    symbolic = sorted({s for i in inputs for d in (i.shape or ()) for s in dim_symbols(d)})
    unknown = sorted(set(dims) - set(symbolic))
    if unknown:
        has = (f"its symbolic dimensions are {', '.join(symbolic)}" if symbolic
               else "its inputs have no symbolic dimensions")
        raise InputError(f"--dim {', '.join(unknown)}: the model has no such dimension; {has}")


def parse_ranges(items: Sequence[str]) -> dict[str, tuple[float, float]]:
    """`--range NAME=LO,HI` -> {NAME: (LO, HI)}."""
    ranges = {}
    for name, text in parse_pairs(items, "--range").items():
        lo, sep, hi = text.partition(",")
        try:
            bounds = (float(lo), float(hi))
        except ValueError:
            bounds = None
        if not sep or bounds is None or not bounds[0] < bounds[1]:
            raise InputError(f"--range expects NAME=LO,HI with LO < HI, got '{name}={text}'")
        ranges[name] = bounds
    return ranges


def parse_pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """`NAME=VALUE` command-line items -> {NAME: VALUE}."""
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InputError(f"{flag} expects NAME=VALUE, got '{item}'")
        pairs[name] = value
    return pairs


def int_at_least(least: int):
    """An argparse type: an integer >= `least` (argparse turns its error into one line and
    exit code 2)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse
