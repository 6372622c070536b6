"""Data for `ember batch`: input files read a part and a batch at a time, cells stacked into
feeds, columns turned into Arrow, and output files written whole or not at all.

Inputs are Parquet, .npy and .npz files. Each file is cut into parts, the units of work a Ray
worker takes: a Parquet file's row groups, slices of an .npy file (memory-mapped, not read),
a whole .npz file. A part is read in batches of `batch_size` rows that never cross the part,
so both engines run the model on exactly the same batches.

A batch is a dict {column name: column}, each column a pyarrow Array (Parquet) or a numpy
array (.npy/.npz, and the batches Ray hands `ember.ray.Predictor`), one cell per row.
`stack_column` turns a column into the (rows, *example shape) array a model input takes.
"""
from __future__ import annotations

import os
import uuid
import zipfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ember.errors import BackendUnavailableError, InputError
from ember.runtime.session import IOInfo

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
except ImportError as exc:  # an extra: `import ember` never needs it
    raise BackendUnavailableError(
        "ember batch needs pyarrow, which is not installed: pip install ember[batch]") from exc

SUFFIXES = (".parquet", ".npy", ".npz")
# rows per part of an .npy file, rounded up to a whole number of batches
NPY_PART_ROWS = 65536

Column = Any  # a pyarrow Array or a numpy array: one cell per row
Batch = dict[str, Column]


@dataclass(frozen=True)
class Part:
    """A unit of work within one input file: `num_rows` rows from row `first_row`."""
    index: int
    first_row: int
    num_rows: int


# -- input files --------------------------------------------------------------------------------

def list_inputs(data: str) -> list[str]:
    """The input files under `data`: the file itself, or the Parquet, .npy and .npz files of the
    folder (not its subfolders; names starting with '.' or '_' are skipped, as Spark's and
    Hadoop's markers are), sorted by name."""
    if os.path.isfile(data):
        if not data.endswith(SUFFIXES):
            raise InputError(f"'{data}' is not a Parquet, .npy or .npz file")
        return [data]
    if not os.path.isdir(data):
        raise InputError(f"input '{data}' does not exist")
    paths = sorted(os.path.join(data, name) for name in os.listdir(data)
                   if name.endswith(SUFFIXES) and not name.startswith((".", "_"))
                   and os.path.isfile(os.path.join(data, name)))
    if not paths:
        raise InputError(f"'{data}' holds no .parquet, .npy or .npz file")
    return paths


def open_source(path: str, npy_column: str | None = None) -> "Source":
    """The reader for one input file; an .npy file's single column is called `npy_column`."""
    if path.endswith(".parquet"):
        return ParquetSource(path)
    if path.endswith(".npz"):
        return NpzSource(path)
    if npy_column is None:
        raise InputError(f"'{path}': an .npy file holds one array, and the model has several "
                         "inputs; give .npz files with one array per input (numpy.savez)")
    return NpySource(path, npy_column)


class Source:
    """One input file: its rows, its columns, its parts, and its batches."""
    path: str
    num_rows: int
    columns: list[str]
    schema: "pa.Schema | None"  # the Arrow schema where the file has one (Parquet)

    @property
    def stem(self) -> str:
        """The file name without its suffix: the output is written as STEM.parquet."""
        return os.path.splitext(os.path.basename(self.path))[0]

    def parts(self, batch_size: int) -> list[Part]:
        raise NotImplementedError

    def batches(self, part: Part, batch_size: int) -> Iterator[tuple[int, Batch]]:
        """(the file's index of the batch's first row, batch) for `part`, in row order."""
        raise NotImplementedError


class ParquetSource(Source):
    """A Parquet file, streamed a row group (part) and a record batch at a time."""

    def __init__(self, path: str):
        self.path = path
        with _reading(path):
            with pq.ParquetFile(path) as f:
                meta, self.schema = f.metadata, f.schema_arrow
        self.columns = self.schema.names
        self.num_rows = meta.num_rows
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        starts = np.cumsum([0] + sizes)
        self._parts = [Part(i, int(start), n) for i, (start, n) in enumerate(zip(starts, sizes))]

    def parts(self, batch_size: int) -> list[Part]:
        return self._parts

    def batches(self, part: Part, batch_size: int) -> Iterator[tuple[int, Batch]]:
        row = part.first_row
        with _reading(self.path):
            with pq.ParquetFile(self.path) as f:
                for record_batch in f.iter_batches(batch_size=batch_size,
                                                   row_groups=[part.index]):
                    yield row, dict(zip(record_batch.schema.names, record_batch.columns))
                    row += record_batch.num_rows


class NpySource(Source):
    """An .npy file: one column, one row per entry of its first axis; memory-mapped."""
    schema = None

    def __init__(self, path: str, column: str):
        self.path, self.columns = path, [column]
        with _reading(path):
            self._array = np.load(path, mmap_mode="r", allow_pickle=False)
        if self._array.ndim == 0:
            raise InputError(f"'{path}' holds a single value; its first axis must hold the rows")
        self.num_rows = len(self._array)

    def parts(self, batch_size: int) -> list[Part]:
        step = -(-NPY_PART_ROWS // batch_size) * batch_size
        return [Part(i, start, min(step, self.num_rows - start))
                for i, start in enumerate(range(0, self.num_rows, step))]

    def batches(self, part: Part, batch_size: int) -> Iterator[tuple[int, Batch]]:
        for start in range(part.first_row, part.first_row + part.num_rows, batch_size):
            stop = min(start + batch_size, part.first_row + part.num_rows)
            yield start, {self.columns[0]: np.asarray(self._array[start:stop])}


class NpzSource(Source):
    """An .npz file: one column per array, rows along their first axes. Read whole (numpy
    cannot map a zip member), one file at a time; its shapes come from the array headers."""
    schema = None

    def __init__(self, path: str):
        self.path = path
        with _reading(path):
            shapes = _npz_shapes(path)
        if not shapes:
            raise InputError(f"'{path}' holds no array")
        rows = {name: shape[0] if shape else None for name, shape in shapes.items()}
        if None in rows.values() or len(set(rows.values())) != 1:
            raise InputError(f"'{path}': every array needs the same number of rows along its "
                             f"first axis; the shapes are {shapes}")
        self.columns, self.num_rows = list(shapes), next(iter(rows.values()))

    def parts(self, batch_size: int) -> list[Part]:
        return [Part(0, 0, self.num_rows)] if self.num_rows else []

    def batches(self, part: Part, batch_size: int) -> Iterator[tuple[int, Batch]]:
        with _reading(self.path):
            with np.load(self.path, allow_pickle=False) as f:
                arrays = {name: f[name] for name in self.columns}
        for start in range(0, self.num_rows, batch_size):
            yield start, {name: a[start:start + batch_size] for name, a in arrays.items()}


def _npz_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each array's shape, read from its .npy header inside the zip (no data is read)."""
    shapes = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            with archive.open(member) as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shapes[member.removesuffix(".npy")] = read_header(f)[0]
    return shapes


class _reading:
    """Turns a failure to read `path` (missing, not the format it claims, cut short) into an
    InputError naming it."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, (OSError, ValueError, EOFError, zipfile.BadZipFile,
                            pa.ArrowException)) and not isinstance(exc, InputError):
            raise InputError(f"cannot read '{self.path}': {exc}") from exc
        return False


# -- cells -> feeds -----------------------------------------------------------------------------

def stack_column(column: Column, info: IOInfo, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The cells of one column stacked along a new first axis and cast to `info`'s dtype.

    Returns (values, problems): `values[i]` is row i's example, zeros where the row does not
    fit; `problems[i]` is None for a row that fits, else why it does not (the text names the
    column `name` and what the input expects). A cell may be a scalar, a list, a nested list,
    an Arrow fixed-shape tensor or a numpy array. Dimensions the model declares fix the shape
    a row must have; for the others, the shape most rows of the batch share is taken."""
    n = len(column)
    want = None if info.shape is None else tuple(info.shape[1:])
    if isinstance(column, np.ndarray) and column.dtype != object:
        good_values, problems = column, np.full(n, None, object)
    elif isinstance(column, np.ndarray):
        good_values, problems = _object_cells(column, want)
    else:
        good_values, problems = _arrow_cells(column, want)
    rows = np.flatnonzero(np.equal(problems, None))  # the rows good_values holds, in order
    lost = None
    problem = _shape_problem(good_values.shape[1:], want, info)
    if problem is None:
        good_values, lost, problem = _cast(good_values, info.dtype, info.name)
    if problem is not None:  # the column as a whole does not fit
        problems[rows] = problem
        rows, good_values = rows[:0], good_values[:0]
    elif lost is not None and lost.any():
        problems[rows[lost]] = (f"a value is out of the range of {info.dtype}, the dtype of "
                                f"input '{info.name}'")
        rows, good_values = rows[~lost], good_values[~lost]
    for row in np.flatnonzero(np.not_equal(problems, None)):
        problems[row] = f"column '{name}': {problems[row]}"
    if len(rows) == n:
        return good_values, problems
    dtype = good_values.dtype if info.dtype is None else info.dtype
    values = np.zeros((n,) + good_values.shape[1:], dtype)
    values[rows] = good_values
    return values, problems


def _arrow_cells(array: "pa.Array", want: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow column's cells as (the fitting rows stacked, per-row problems): ragged rows,
    null cells and nulls inside them are problems; nested lists are checked one level at a
    time, over all rows at once."""
    n = len(array)
    problems = np.full(n, None, object)
    if isinstance(array.type, pa.FixedShapeTensorType):
        nulls = _nulls(array)
        problems[nulls] = "the cell is null"
        return (array.filter(pa.array(~nulls)) if nulls.any() else array).to_numpy_ndarray(), problems
    if isinstance(array.type, pa.ExtensionType):
        problems[:] = (f"cells of type {array.type} are not read; store examples as lists or "
                       "arrow.fixed_shape_tensor")
        return np.zeros((0,)), problems
    depth, t = 0, array.type
    while _is_list(t):
        depth, t = depth + 1, t.value_type
    # the model's dimensions fix the lengths only where the nesting has its rank; otherwise
    # the batch's own shape is found, for _shape_problem to report
    declared_dims = want if want is not None and len(want) == depth else (None,) * depth
    rows = np.arange(n)  # the row each element of the current level belongs to
    dims: list[int] = []
    while _is_list(array.type):
        axis = len(dims) + 1  # the model's dimension this level fills
        nulls = _nulls(array)
        _note(problems, rows[nulls], lambda i: f"a null list in dimension {axis}")
        lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        declared = declared_dims[axis - 1]
        if isinstance(declared, int):
            expected = declared
        else:  # a free dimension: the length most rows of the batch have
            seen, counts = np.unique(lengths[~nulls & np.equal(problems[rows], None)],
                                     return_counts=True)
            expected = int(seen[counts.argmax()]) if seen.size else 0
        wrong = np.flatnonzero(~nulls & (lengths != expected))
        source = "the model expects" if isinstance(declared, int) else "the other rows have"
        _note(problems, rows[wrong], lambda i: f"{lengths[wrong[i]]} values in dimension "
                                               f"{axis} where {source} {expected}")
        rows = rows[pc.list_parent_indices(array).to_numpy(zero_copy_only=False)]
        array = pc.list_flatten(array)
        dims.append(int(expected))
    _note(problems, rows[_nulls(array)], lambda i: "a null value")
    values = array.to_numpy(zero_copy_only=False)
    keep = np.equal(problems[rows], None)
    if not keep.all():
        values = values[keep]
    return values.reshape((np.count_nonzero(np.equal(problems, None)), *dims)), problems


def _object_cells(column: np.ndarray, want: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """A numpy column of per-row objects (arrays, lists, None: what Ray makes of list
    columns) as (the fitting rows stacked, per-row problems)."""
    n = len(column)
    problems = np.full(n, None, object)
    cells: list[np.ndarray | None] = []
    for row, cell in enumerate(column):  # one object per row: there is nothing to vectorise
        try:
            cells.append(None if cell is None else _as_array(cell))
        except ValueError as exc:
            cells.append(None)
            problems[row] = f"a ragged cell ({exc})"
        if cell is None:
            problems[row] = "the cell is null"
    shapes = [c.shape for c in cells if c is not None]
    expected = Counter(shapes).most_common(1)[0][0] if shapes else ()
    source = "the other rows have"
    if want is not None and len(want) == len(expected):  # (a rank mismatch: _shape_problem)
        expected = tuple(w if isinstance(w, int) else e for w, e in zip(want, expected))
        if all(isinstance(w, int) for w in want):
            source = "the model expects"
    for row, cell in enumerate(cells):
        if cell is not None and cell.shape != expected:
            problems[row] = f"a cell of shape {list(cell.shape)} where {source} {list(expected)}"
    good = [c for c, p in zip(cells, problems) if p is None]
    return (np.stack(good) if good else np.zeros((0, *expected))), problems


def _as_array(cell: Any) -> np.ndarray:
    """One cell as an array; object arrays of arrays (nested lists, as Ray hands them over)
    are stacked. A ragged cell raises ValueError."""
    array = np.asarray(cell)
    if array.dtype == object and array.size and isinstance(array.flat[0], (np.ndarray, list)):
        return np.stack([_as_array(c) for c in array])
    return array


def _shape_problem(cell_shape: tuple[int, ...], want: tuple | None, info: IOInfo) -> str | None:
    """Why rows of `cell_shape` do not fit `info` (None if they do)."""
    if want is None:
        return None
    if len(cell_shape) == len(want) and all(not isinstance(w, int) or w == got
                                            for w, got in zip(want, cell_shape)):
        return None
    return (f"rows of shape {list(cell_shape)}; input '{info.name}' takes "
            f"{_shape_text(info.shape)}, rows of shape {_shape_text(want)}")


def _shape_text(shape: Sequence) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _cast(values: np.ndarray, dtype: np.dtype | None, input_name: str
          ) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """`values` as the input's dtype -> (values, rows whose values do not survive the cast,
    a problem of the whole column). ember casts within a kind (float64 -> float32, int64 ->
    uint8 where every value fits) and from integers or booleans to floats, never from floats
    to integers or from strings to numbers: a cast that loses more than rounding is an error."""
    if dtype is None or values.dtype == dtype:
        return values, None, None
    source = values.dtype
    if dtype == object:  # a string input
        if source.kind in "OUS":
            return values.astype(object), None, None
    elif source.kind in "biuf" and (np.can_cast(source, dtype, "same_kind")
                                    or (source.kind in "iu" and dtype.kind in "iu")):
        cast = values.astype(dtype)
        if dtype.kind in "iu":
            lost = cast != values
        elif dtype.kind == "f":
            lost = np.isinf(cast) & ~np.isinf(values)
        else:
            lost = np.zeros(values.shape, bool)
        return cast, lost.reshape(len(values), -1).any(axis=1), None
    held = "strings" if source.kind in "OUS" else f"{source} values"
    return values, None, (f"holds {held}; input '{input_name}' takes {dtype} (ember casts "
                          "within a kind or from integers to floats, never where values change)")


def _is_list(t: "pa.DataType") -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _nulls(array: "pa.Array") -> np.ndarray:
    if array.null_count == 0:
        return np.zeros(len(array), bool)
    return array.is_null().to_numpy(zero_copy_only=False)


def _note(problems: np.ndarray, rows: np.ndarray, message) -> None:
    """Give each of `rows` without a problem yet `message(i)`, i its first position in
    `rows` (a row can own many elements of a level; the first problem found is kept)."""
    if not rows.size:
        return
    unique, first = np.unique(rows, return_index=True)
    for row, i in zip(unique, first):
        if problems[row] is None:
            problems[row] = message(i)


# -- columns -> Arrow -> Parquet ----------------------------------------------------------------

def to_arrow_table(columns: Mapping[str, Column]) -> "pa.Table":
    """Columns as one Arrow table: Arrow columns as they are, numpy ones by `to_arrow`."""
    try:
        return pa.table({name: to_arrow(column, name) for name, column in columns.items()})
    except (pa.ArrowException, ValueError) as exc:
        raise InputError(f"cannot assemble the output columns: {exc}") from exc


def to_arrow(column: Column, name: str = "") -> "pa.Array":
    """A column as Arrow. A numpy column of one value per row is a plain column; one of
    numeric tensors is an `arrow.fixed_shape_tensor` column (the canonical extension type:
    dtype and shape are in the schema, and `.to_numpy_ndarray()` gives the array back
    exactly); booleans and strings per row become nested fixed-size lists."""
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        return column
    array = np.asarray(column)
    try:
        if array.ndim == 1:
            return pa.array(array)
        if array.dtype.kind in "iuf":
            return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(array))
        nested = pa.array(array.reshape(-1))
        for size in reversed(array.shape[1:]):
            nested = pa.FixedSizeListArray.from_arrays(nested, size)
        return nested
    except (pa.ArrowException, TypeError) as exc:
        raise InputError(f"column '{name}' of {array.dtype} values cannot be written to "
                         f"Parquet: {exc}") from exc


def column_to_numpy(column: "pa.Array | pa.ChunkedArray") -> np.ndarray:
    """An output column read back as numpy: (rows, *shape) for tensor columns."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    if pa.types.is_fixed_size_list(column.type):
        shape = []
        while pa.types.is_fixed_size_list(column.type):
            shape.append(column.type.list_size)
            column = column.flatten()
        return column.to_numpy(zero_copy_only=False).reshape(-1, *shape)
    return column.to_numpy(zero_copy_only=False)


class ParquetFileWriter:
    """One Parquet file, written whole or not at all: tables go to a hidden temporary file in
    the same folder, which `commit` flushes to disk and renames into place (a rename within a
    folder is atomic), so a crash leaves the old file or none, never a partial one. Tables are
    gathered into row groups of about ROW_GROUP_ROWS rows (or ROW_GROUP_BYTES) before writing."""
    ROW_GROUP_ROWS = 65536
    ROW_GROUP_BYTES = 64 << 20

    def __init__(self, path: str):
        folder, name = os.path.split(path)
        self.path, self.folder = path, folder or "."
        self.temp = os.path.join(self.folder, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._pending: list[pa.Table] = []

    def write(self, table: "pa.Table") -> None:
        if self._pending and not table.schema.equals(self._pending[0].schema):
            raise InputError(_schema_change(self.path, self._pending[0].schema, table.schema))
        if self._writer is not None and not table.schema.equals(self._writer.schema):
            raise InputError(_schema_change(self.path, self._writer.schema, table.schema))
        self._pending.append(table)
        self.rows += table.num_rows
        if (sum(t.num_rows for t in self._pending) >= self.ROW_GROUP_ROWS
                or sum(t.nbytes for t in self._pending) >= self.ROW_GROUP_BYTES):
            self._flush()

    def _flush(self, schema: "pa.Schema | None" = None) -> None:
        if self._writer is None:
            schema = self._pending[0].schema if self._pending else schema
            self._writer = pq.ParquetWriter(self.temp, schema)
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending))
            self._pending = []

    def commit(self, empty_schema: "pa.Schema | None" = None) -> None:
        """Finish the file and move it into place; a file that got no rows gets
        `empty_schema`."""
        self._flush(empty_schema if empty_schema is not None else pa.schema([]))
        self._writer.close()
        self._writer = None
        _fsync(self.temp)
        os.replace(self.temp, self.path)
        _fsync(self.folder)  # the rename itself

    def discard(self) -> None:
        """Drop what was written (the temporary file); the final path is not touched."""
        self._pending = []
        if self._writer is not None:
            try:
                self._writer.close()
            except (OSError, pa.ArrowException):
                pass
        try:
            os.remove(self.temp)
        except FileNotFoundError:
            pass


def _schema_change(path: str, before: "pa.Schema", now: "pa.Schema") -> str:
    changed = [f"'{f.name}' was {f.type} and is now {now.field(f.name).type}"
               for f in before if f.name in now.names and not f.equals(now.field(f.name))]
    return (f"output '{path}': the columns changed between batches ({'; '.join(changed) or now}); "
            "a column's type and row shape must be the same in every batch of a file")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
