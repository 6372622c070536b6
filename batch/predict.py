"""The step both engines share: a batch of rows -> the output columns.

`predict_batch` is the only place a batch meets the model. The local engine calls it in this
process, the Ray engine in its actors (`ember.ray.Predictor` and the CLI's part workers), on
the same batches, so their outputs are the same bits by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ember.batch.data import Batch, stack_column
from ember.errors import EmberError, InputError
from ember.runtime.session import IOInfo, Session

# The per-row error text predict_batch adds to its result (None for a row that ran). The
# engines take it out before writing: failing rows go to the errors file or stop the run.
ERROR_COLUMN = "__ember_error__"


@dataclass(frozen=True)
class ColumnPlan:
    """Which column feeds which model input, and which outputs come back."""
    inputs: dict[str, IOInfo]  # column name -> the input it feeds, in the model's input order
    outputs: tuple[str, ...]
    # 1 where the model's batch dimension is fixed at 1 (rows then run one at a time);
    # None: a whole batch runs at once
    rows_per_run: int | None

    @classmethod
    def build(cls, inputs: Sequence[IOInfo], outputs: Sequence[IOInfo],
              column_map: Mapping[str, str] | None = None) -> "ColumnPlan":
        """Each input is fed by the column of its name, or by the column `column_map` maps to
        it ({column: input}, the CLI's --map COL=INPUT)."""
        column_map = dict(column_map or {})
        by_name = {i.name: i for i in inputs}
        names = ", ".join(by_name) or "none"
        unknown = sorted(set(column_map.values()) - set(by_name))
        if unknown:
            raise InputError(f"--map names {', '.join(map(repr, unknown))}, not an input of the "
                             f"model; its inputs are {names}")
        mapped = list(column_map.values())
        twice = sorted({i for i in mapped if mapped.count(i) > 1})
        if twice:
            raise InputError(f"--map feeds input(s) {', '.join(map(repr, twice))} from more "
                             "than one column")
        fed = {column: by_name[name] for column, name in column_map.items()}
        for info in inputs:
            if info.name not in column_map.values():
                if info.name in fed:
                    raise InputError(f"column '{info.name}' is mapped to input "
                                     f"'{fed[info.name].name}', so input '{info.name}' needs a "
                                     f"column of its own: add --map COLUMN={info.name}")
                fed[info.name] = info
        rows_per_run = None
        for info in inputs:
            if info.dtype is None:
                raise InputError(f"input '{info.name}' is a {info.type}; ember batch feeds "
                                 "tensors only")
            if info.shape is not None and not info.shape:
                raise InputError(f"input '{info.name}' is a scalar: it has no batch dimension "
                                 "to stack rows along")
            first = None if info.shape is None else info.shape[0]
            if isinstance(first, int) and first != 1:
                raise InputError(f"input '{info.name}' has a fixed batch dimension of {first}; "
                                 "export the model with a dynamic (or size 1) batch dimension")
            if first == 1:
                rows_per_run = 1
        order = {info.name: i for i, info in enumerate(inputs)}
        fed = dict(sorted(fed.items(), key=lambda item: order[item[1].name]))
        return cls(fed, tuple(o.name for o in outputs), rows_per_run)

    def check_columns(self, columns: Sequence[str], path: str) -> None:
        """Raise InputError unless a file of `columns` can feed the model and keep its other
        columns beside the outputs."""
        for column, info in self.inputs.items():
            if column not in columns:
                raise InputError(
                    f"'{path}' has no column '{column}' for input '{info.name}'; its columns "
                    f"are {', '.join(columns) or 'none'} (--map COLUMN={info.name} chooses one)")
        clash = [o for o in self.outputs if o in columns and o not in self.inputs]
        if clash:
            raise InputError(f"'{path}' has column(s) {', '.join(map(repr, clash))} named like "
                             "the model's outputs, which would replace them; rename them")


def predict_batch(session: Session, batch: Batch, plan: ColumnPlan) -> dict[str, np.ndarray]:
    """Run the model on a batch of rows; returns the batch's other columns (passed through),
    then one column per model output, each (rows, *shape), then ERROR_COLUMN.

    The rows are stacked along each input's first dimension and run together. A row that
    does not fit the model (shape, dtype, a null) is left out and given its error text; if the
    model rejects the stacked batch anyway, the batch is split in halves until the failing
    rows are found, and the rows that pass run together again. Output rows of failing rows
    are zeros."""
    n = len(next(iter(batch.values()))) if batch else 0
    errors = np.full(n, None, object)
    feeds = {}
    for column, info in plan.inputs.items():
        feeds[info.name], problems = stack_column(batch[column], info, column)
        fresh = np.equal(errors, None)
        errors[fresh] = problems[fresh]
    good = np.flatnonzero(np.equal(errors, None))
    outputs, good = _run_fitting_rows(session, feeds, good, errors, plan)
    result = {name: column for name, column in batch.items() if name not in plan.inputs}
    if len(good):  # (a batch where no row fits has no output columns: nothing to write)
        for name in plan.outputs:
            value = outputs[name]
            if len(good) < n:
                value = np.zeros((n,) + value.shape[1:], value.dtype)
                value[good] = outputs[name]
            result[name] = value
    result[ERROR_COLUMN] = errors
    return result


def _run_fitting_rows(session: Session, feeds: dict[str, np.ndarray], good: np.ndarray,
                      errors: np.ndarray, plan: ColumnPlan
                      ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the outputs of rows `good` run together, the rows that ran). Rows the model rejects
    are found by halving and get their error text in `errors`; the others run again."""
    if not len(good):
        return {}, good
    try:
        return _run(session, _take(feeds, good), plan, len(good)), good
    except _OutputShapeError:
        raise
    except EmberError as whole:
        failing: dict[int, str] = {}
        _find_failing(session, feeds, good, plan, failing)
        if not failing:
            failing = {int(row): f"the batch fails as a whole, though its halves run: {whole}"
                       for row in good}
    names = ", ".join(f"'{c}'" for c in plan.inputs)
    label = f"column{'s' if len(plan.inputs) > 1 else ''} {names}"
    for row, message in failing.items():
        errors[row] = f"{label}: {message}"
    return _run_fitting_rows(session, feeds, np.setdiff1d(good, list(failing)), errors, plan)


def _find_failing(session: Session, feeds: dict[str, np.ndarray], rows: np.ndarray,
                  plan: ColumnPlan, failing: dict[int, str]) -> None:
    """Record in `failing` each of `rows` the model rejects alone, halving the rows until
    the rejected ones stand alone (about 2 log2(batch) runs per failing row)."""
    try:
        _run(session, _take(feeds, rows), plan, len(rows))
    except _OutputShapeError:
        raise
    except EmberError as exc:
        if len(rows) == 1:
            failing[int(rows[0])] = str(exc)
            return
        half = len(rows) // 2
        _find_failing(session, feeds, rows[:half], plan, failing)
        _find_failing(session, feeds, rows[half:], plan, failing)


def _take(feeds: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """The feeds of `rows` (distinct row indices); all of them: the feeds themselves."""
    if len(rows) == len(next(iter(feeds.values()))):
        return feeds
    return {name: value[rows] for name, value in feeds.items()}


def _run(session: Session, feeds: dict[str, np.ndarray], plan: ColumnPlan,
         rows: int) -> dict[str, np.ndarray]:
    """Session.run over `rows` stacked rows (one at a time for a batch dimension fixed at 1);
    every output must have the rows along its first dimension."""
    if plan.rows_per_run == 1 and rows != 1:
        runs = [_run(session, {k: v[i:i + 1] for k, v in feeds.items()}, plan, 1)
                for i in range(rows)]
        return {name: np.concatenate([r[name] for r in runs]) for name in plan.outputs}
    outputs = session.run(feeds, outputs=list(plan.outputs))
    for name, value in outputs.items():
        if not isinstance(value, np.ndarray) or value.ndim == 0 or len(value) != rows:
            shape = getattr(value, "shape", type(value).__name__)
            raise _OutputShapeError(
                f"output '{name}' has shape {shape} for a batch of {rows} row(s); ember batch "
                "needs outputs with one entry per row along the first dimension")
    return outputs


class _OutputShapeError(InputError):
    """The model's outputs do not have the batch along their first dimension: a property of
    the model, not of a row, so it stops the run even with --on-error skip."""
