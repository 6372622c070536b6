"""`run_batch`: checks a batch job's settings and hands it to the local or the Ray engine."""
from __future__ import annotations

import os
import time
from typing import Mapping

from ember.batch.data import list_inputs
from ember.batch.job import BatchJob, BatchReport
from ember.batch.local import run_local
from ember.batch.ray_engine import run_ray
from ember.errors import InputError
from ember.runtime.backends import BACKENDS

ENGINES = ("local", "ray")
ON_ERROR = ("fail", "skip")


def run_batch(model: str, data: str, out: str, *, batch_size: int = 64, engine: str = "local",
              workers: int | None = None, ray_address: str | None = None,
              backend: str | None = None, gpus_per_worker: float | None = None,
              column_map: Mapping[str, str] | None = None, resume: bool = False,
              on_error: str = "fail", progress: bool = False) -> BatchReport:
    """Run `model` over every row of `data` (a Parquet, .npy or .npz file or a folder of
    them) and write one Parquet file per input file into the folder `out`: the input's
    other columns, then one column per model output. See docs/batch.md.

    engine "local" runs one Session in this process; "ray" runs `workers` Ray actors (on the
    cluster at `ray_address`, else a local Ray), each with `gpus_per_worker` GPUs. `resume`
    skips input files whose output exists. `on_error` "skip" writes rows that do not fit the
    model to OUT/STEM.errors.parquet and carries on; "fail" stops at the first (BadRowError).
    `progress` shows rows/s and the ETA on stderr."""
    if engine not in ENGINES:
        raise InputError(f"unknown engine '{engine}'; choose one of {', '.join(ENGINES)}")
    if on_error not in ON_ERROR:
        raise InputError(f"on_error must be one of {', '.join(ON_ERROR)}, not '{on_error}'")
    if batch_size < 1:
        raise InputError(f"the batch size must be at least 1, not {batch_size}")
    if backend is not None and backend not in BACKENDS:
        raise InputError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if engine == "local":
        given = [flag for flag, value in (("--workers", workers), ("--ray-address", ray_address),
                                          ("--gpus-per-worker", gpus_per_worker))
                 if value is not None]
        if given:
            raise InputError(f"{', '.join(given)}: only with --engine ray (the local engine "
                             "runs one session in this process)")
    if not os.path.isfile(model):
        raise InputError(f"model '{model}' is not a file")
    list_inputs(data)  # a missing or empty input is reported before the model loads
    job = BatchJob(os.path.abspath(model), os.path.abspath(data), os.path.abspath(out),
                   batch_size, backend, dict(column_map or {}), resume, on_error)
    started = time.perf_counter()
    if engine == "local":
        report = run_local(job, progress)
    else:
        report = run_ray(job, progress, workers=workers or 1, address=ray_address,
                         gpus_per_worker=gpus_per_worker or 0)
    report.seconds = time.perf_counter() - started
    return report
