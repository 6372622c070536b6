"""What both engines of `run_batch` share around the model — which files to do, one output
file per input file written whole or not at all, failing rows, resume and progress."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ember.batch.data import ParquetFileWriter, Source, list_inputs, open_source, pa, pc
from ember.batch.predict import ERROR_COLUMN, ColumnPlan
from ember.errors import BadRowError, InputError
from ember.runtime.session import IOInfo

ROW_COLUMN, ERROR_TEXT_COLUMN = "ember_row", "ember_error"  # the errors file's own columns


@dataclass(frozen=True)
class BatchJob:
    """What `run_batch` was asked to do, checked."""
    model: str
    data: str
    out: str
    batch_size: int = 64
    backend: str | None = None
    column_map: Mapping[str, str] = field(default_factory=dict)
    resume: bool = False
    on_error: str = "fail"


@dataclass
class BatchReport:
    """What a run did."""
    rows: int = 0  # rows written to the outputs
    error_rows: int = 0  # failing rows set aside (--on-error skip)
    files_written: int = 0
    files_skipped: int = 0  # outputs already there (--resume)
    seconds: float = 0.0
    error_files: list[str] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return (self.rows + self.error_rows) / self.seconds if self.seconds > 0 else 0.0


def plan_files(job: BatchJob, inputs: Sequence[IOInfo], report: BatchReport) -> list[Source]:
    """The input files still to do (all of them, or those without an output with --resume),
    opened; makes the output folder. Counts the skipped files in `report`."""
    paths = list_inputs(job.data)
    stems: dict[str, str] = {}
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem in stems:
            raise InputError(f"'{stems[stem]}' and '{path}' would both be written as "
                             f"{stem}.parquet; rename one")
        stems[stem] = path
    if os.path.exists(job.out) and not os.path.isdir(job.out):
        raise InputError(f"output '{job.out}' is a file; give a folder")
    os.makedirs(job.out, exist_ok=True)
    if os.path.isdir(job.data) and os.path.samefile(job.data, job.out):
        raise InputError("the output folder is the input folder; the outputs would be read as "
                         "inputs next time: write them to another folder")
    npy_column = inputs[0].name if len(inputs) == 1 else None
    sources = []
    for path in paths:
        if job.resume and os.path.exists(output_path(job.out, path)):
            report.files_skipped += 1
        else:
            sources.append(open_source(path, npy_column))
    return sources


def output_path(out: str, input_path: str) -> str:
    """OUT/STEM.parquet for the input file at `input_path`."""
    return os.path.join(out, os.path.splitext(os.path.basename(input_path))[0] + ".parquet")


class FileOutput:
    """The output of one input file, and its errors file: rows are written as they come,
    and both files appear only at `commit` (ParquetFileWriter); leaving the `with` block
    without a commit discards them."""

    def __init__(self, source: Source, job: BatchJob, plan: ColumnPlan, report: BatchReport):
        self.source, self.job, self.plan, self.report = source, job, plan, report
        self.output = ParquetFileWriter(output_path(job.out, source.path))
        self.errors_path = os.path.join(job.out, source.stem + ".errors.parquet")
        self.errors: ParquetFileWriter | None = None

    def __enter__(self) -> "FileOutput":
        return self

    def __exit__(self, *exc) -> None:
        self.output.discard()
        if self.errors is not None:
            self.errors.discard()

    def write(self, table: "pa.Table", first_row: int) -> None:
        """Write a batch's result (from predict_batch, as Arrow), whose first row is row
        `first_row` of the input file. A failing row stops the run (BadRowError), or with
        --on-error skip goes to the errors file."""
        errors = table.column(ERROR_COLUMN)
        table = table.drop_columns([ERROR_COLUMN])
        if errors.null_count == len(errors):
            self.output.write(table)
            self.report.rows += table.num_rows
            return
        failing = errors.is_valid()
        rows = np.flatnonzero(failing.to_numpy(zero_copy_only=False))
        if self.job.on_error == "fail":
            row = int(rows[0])
            raise BadRowError(self.source.path, first_row + row, errors[row].as_py())
        passthrough = [name for name in table.column_names if name not in self.plan.outputs]
        set_aside = table.filter(failing).select(passthrough)
        set_aside = set_aside.append_column(ROW_COLUMN, pa.array(first_row + rows, pa.int64()))
        set_aside = set_aside.append_column(ERROR_TEXT_COLUMN, errors.filter(failing))
        if self.errors is None:
            self.errors = ParquetFileWriter(self.errors_path)
        self.errors.write(set_aside)
        self.report.error_rows += len(rows)
        fitting = table.filter(pc.invert(failing))
        if fitting.num_rows:  # (a batch where no row fits has no output columns)
            self.output.write(fitting)
            self.report.rows += fitting.num_rows

    def commit(self) -> None:
        """Move the errors file, then the output, into place: the output's presence is what
        --resume checks, so it comes last."""
        if self.errors is not None:
            self.errors.commit()
            self.report.error_files.append(self.errors_path)
        elif os.path.exists(self.errors_path):  # from an earlier run of this file
            os.remove(self.errors_path)
        schema = self.source.schema
        if schema is not None:  # an empty file: its own columns, without the model's
            schema = pa.schema([f for f in schema if f.name not in self.plan.inputs])
        self.output.commit(schema)
        self.report.files_written += 1


class Progress:
    """A progress line on stderr: rows done of the total, rows/s and the time left. On a
    terminal it is redrawn in place (at most 5 times a second); otherwise a line is printed
    every 10 s."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.done, self.start = 0, time.perf_counter()
        self._shown = self.start

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.perf_counter()
        if self.enabled and now - self._shown >= (0.2 if self.tty else 10.0):
            self._show(now)

    def close(self) -> None:
        if self.enabled and self.done:
            self._show(time.perf_counter())
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()

    def _show(self, now: float) -> None:
        self._shown = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        line = (f"ember batch: {self.done:,}/{self.total:,} rows{share}, {rate:,.0f} rows/s, "
                f"ETA {_clock(left)}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
