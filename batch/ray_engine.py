"""The Ray engine: Ray Data runs the batches on a pool of actors, each holding one Session;
ember grows no scheduler of its own. Needs `pip install ember[ray]`.

Two callable classes run `predict_batch` in the actors:
- `Predictor` (public, as `ember.ray.Predictor`) for a user's own Ray Data pipeline:
  `ds.map_batches(Predictor, fn_constructor_kwargs={"model": ...}, ...)`. Ray chooses the
  batches (they may span files).
- `_PartWorker` for `ember batch --engine ray`: a row of its dataset names one part of one
  input file (see ember.batch.data); the actor reads that part itself and runs it in the
  same batches as the local engine, so the outputs are the same bits. The driver gets each
  part's result back in order (preserve_order) as Arrow IPC bytes, which carry every column
  type through Ray unchanged, and writes the output files as the local engine does.
"""
from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Mapping

import numpy as np

from ember.batch.data import Batch, open_source, pa, to_arrow_table
from ember.batch.job import BatchJob, BatchReport, FileOutput, Progress, plan_files
from ember.batch.predict import ERROR_COLUMN, ColumnPlan, predict_batch
from ember import errors
from ember.errors import BackendUnavailableError, BadRowError, EmberError, InputError
from ember.runtime.session import io_info, load

# Ray restarts an actor that died (its process crashed, its node was lost) and retries its
# tasks on the new one, this many times; bounded, so that a row that crashes the process
# every time ends the run instead of looping. (Ray's own default is to retry forever.)
MAX_RESTARTS = 3


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise BackendUnavailableError(
            "the Ray engine needs Ray, which is not installed: pip install ember[ray]") from exc
    return ray


def _assigned_cpus() -> int | None:
    """The CPUs Ray gave this actor (its BLAS threads), or None outside a Ray worker."""
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            return max(1, int(cpus)) if cpus else None
    except Exception:  # not in a Ray worker
        return None
    return None


class Predictor:
    """A Ray Data callable class that runs an ONNX model over batches:

        ds.map_batches(ember.ray.Predictor,
                       fn_constructor_kwargs={"model": "model.onnx", "backend": "cpu"},
                       compute=ray.data.ActorPoolStrategy(size=4), batch_size=64)

    Each actor loads the model once, on `backend`, with as many BLAS threads as the CPUs Ray
    gave it (`threads` overrides). A batch (a dict of numpy arrays, Ray's default format, or
    a pyarrow Table) comes back as its other columns, then one column per model output, each
    holding its row's slice. A row that does not fit the model raises BadRowError naming the
    row within the batch and the column (`ember batch --engine ray` sets failing rows aside
    instead)."""

    def __init__(self, model: str, backend: str | None = None,
                 column_map: Mapping[str, str] | None = None, threads: int | None = None):
        self.session = load(model, backend, threads=threads or _assigned_cpus())
        self.plan = ColumnPlan.build(self.session.inputs, self.session.outputs, column_map)

    def __call__(self, batch: "Mapping[str, np.ndarray] | pa.Table") -> Any:
        as_table = isinstance(batch, pa.Table)
        columns: Batch = ({name: batch.column(name).combine_chunks() for name in batch.column_names}
                          if as_table else dict(batch))
        self.plan.check_columns(list(columns), "the batch")
        result = predict_batch(self.session, columns, self.plan)
        problems = result.pop(ERROR_COLUMN)
        failing = np.flatnonzero(np.not_equal(problems, None))
        if failing.size:
            row = int(failing[0])
            where = "a batch" if "path" not in columns else \
                f"a batch (its row {row} from {columns['path'][row]})"  # read with include_paths
            raise BadRowError(where, row, problems[row], hint="")
        if as_table:
            return to_arrow_table(result)
        return {name: column if isinstance(column, np.ndarray)
                else column.to_numpy(zero_copy_only=False) for name, column in result.items()}


class _PartWorker(Predictor):
    """The CLI's actor: given rows {"index", "path", "part"}, runs each named part of an
    input file and returns {"index", "table"}: the part's result (predict_batch's columns,
    failing rows and their errors included) as Arrow IPC bytes. It loads its session and
    plan as Predictor does."""

    def __init__(self, model: str, backend: str | None, column_map: Mapping[str, str],
                 batch_size: int, threads: int | None = None):
        super().__init__(model, backend, column_map, threads)
        self.batch_size = batch_size
        self.npy_column = self.session.inputs[0].name if len(self.session.inputs) == 1 else None
        self._source = None  # the last file opened: parts of a file come in order

    def __call__(self, items: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        blobs = [self._run_part(str(path), int(part))
                 for path, part in zip(items["path"], items["part"])]
        return {"index": np.asarray(items["index"]), "table": np.array(blobs, dtype=object)}

    def _run_part(self, path: str, index: int) -> bytes:
        if self._source is None or self._source.path != path:
            self._source = open_source(path, self.npy_column)
        source = self._source
        part = source.parts(self.batch_size)[index]
        tables = [to_arrow_table(predict_batch(self.session, batch, self.plan))
                  for _, batch in source.batches(part, self.batch_size)]
        try:  # a batch where no row fits has no output columns: they are null there
            table = pa.concat_tables(tables, promote_options="default")
        except pa.ArrowInvalid as exc:
            raise InputError(f"'{path}': the output columns changed between batches ({exc}); a "
                             "column's type and row shape must be the same in every batch of a "
                             "file") from exc
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as stream:
            stream.write_table(table)
        return sink.getvalue().to_pybytes()


def model_signature(model: str):
    """(inputs, outputs) of the model file, as IOInfo, without planning a session."""
    from ember.importer import import_model

    graph = import_model(model).graph
    return ([io_info(v) for v in graph.inputs if v.name not in graph.initializers],
            [io_info(v) for v in graph.outputs])


def run_ray(job: BatchJob, progress: bool = False, workers: int = 1,
            address: str | None = None, gpus_per_worker: float = 0,
            _worker: type = None) -> BatchReport:
    """Run `job` on Ray Data with `workers` actors (see ember.batch.run_batch). Uses the Ray
    instance this process has already started, else connects to `address`, else starts a
    local one (and stops what it started). `_worker` replaces _PartWorker (tests: an actor
    that crashes)."""
    if workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if gpus_per_worker < 0:
        raise InputError(f"--gpus-per-worker must be at least 0, not {gpus_per_worker}")
    ray = _import_ray()
    inputs, outputs = model_signature(job.model)
    plan = ColumnPlan.build(inputs, outputs, job.column_map)
    report = BatchReport()
    sources = plan_files(job, inputs, report)
    for source in sources:
        plan.check_columns(source.columns, source.path)
    parts = [(source, part) for source in sources for part in source.parts(job.batch_size)]
    for source in sources:  # files without rows: nothing for Ray to do
        if not source.parts(job.batch_size):
            with FileOutput(source, job, plan, report) as output:
                output.commit()
    if not parts:
        return report
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    saved = (context.execution_options.preserve_order, context.enable_progress_bars)
    # rows come back in input order; ember's own progress line replaces Ray's bars (and its
    # notice that they are off), and Ray Data's INFO lines about each execution
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    quieted = {name: logging.getLogger(name).level
               for name in ("ray.data", "ray.data._internal.progress")}
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    bar = Progress(sum(s.num_rows for s in sources), progress)
    results = None
    try:
        if started_here and address is None:
            _check_resources(ray, workers, gpus_per_worker)
        dataset = _dataset(ray, job, parts, workers, gpus_per_worker, _worker or _PartWorker)
        results = iter(dataset.iter_rows())
        for source in sources:
            ours = [(i, part) for i, (s, part) in enumerate(parts) if s is source]
            if not ours:
                continue
            with FileOutput(source, job, plan, report) as output:
                for index, part in ours:
                    row = _next_result(results)
                    if int(row["index"]) != index:  # preserve_order is what the files rely on
                        raise RuntimeError(f"Ray returned part {row['index']}, expected {index}")
                    table = pa.ipc.open_stream(row["table"]).read_all()
                    output.write(table, part.first_row)
                    bar.advance(table.num_rows)
                output.commit()
        for extra in results:  # (runs the iterator to its end, while Ray is still up)
            raise RuntimeError(f"Ray returned part {extra['index']} beyond the {len(parts)} given")
    finally:
        bar.close()
        if results is not None and hasattr(results, "close"):
            results.close()  # stop Ray's execution before Ray goes away
        context.execution_options.preserve_order, context.enable_progress_bars = saved
        for name, level in quieted.items():
            logging.getLogger(name).setLevel(level)
        if started_here:
            ray.shutdown()
    return report


def _dataset(ray, job: BatchJob, parts: list, workers: int, gpus_per_worker: float,
             worker: type):
    """The Ray dataset: one row per part, mapped by a pool of `workers` `worker` actors."""
    items = [{"index": i, "path": source.path, "part": part.index}
             for i, (source, part) in enumerate(parts)]
    # a block per part, so that parts spread over the actors
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    with warnings.catch_warnings():
        # Ray 2.5x deprecates passing actor options (max_restarts...) as **ray_remote_args
        # but names no replacement yet; they still work, and Ray >= 2.9 takes them
        warnings.simplefilter("ignore", DeprecationWarning)
        return dataset.map_batches(
            worker, batch_size=1, batch_format="numpy",
            fn_constructor_kwargs={"model": job.model, "backend": job.backend,
                                   "column_map": dict(job.column_map),
                                   "batch_size": job.batch_size},
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_gpus=gpus_per_worker or None,
            max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)


def _next_result(results) -> dict:
    """The next part's result; an ember error raised in an actor is raised here as itself."""
    try:
        return next(results)
    except StopIteration:
        raise RuntimeError("Ray returned fewer parts than it was given") from None
    except Exception as exc:  # Ray's wrappers (RayTaskError, ray.data's UserCodeException...)
        cause = _ember_cause(exc)
        if cause is not None:
            raise cause from None
        raise


def _ember_cause(exc: BaseException) -> EmberError | None:
    """The EmberError behind a Ray exception, if there is one. Ray wraps a task's exception
    (RayTaskError.cause), and may wrap that again; an actor whose __init__ failed (a backend
    missing on the node, a model it cannot read) comes back as ActorDiedError, which keeps
    only the text of the traceback: the error is then rebuilt from its last line."""
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EmberError):
            return exc
        chain.append(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__
    for wrapper in chain:
        found = re.findall(r"ember\.errors\.(\w+): (.+)", str(wrapper))
        kind = getattr(errors, found[-1][0], None) if found else None
        if isinstance(kind, type) and issubclass(kind, EmberError):
            rebuilt = kind.__new__(kind)  # (not kind(...): some take structured arguments)
            Exception.__init__(rebuilt, f"{found[-1][1]} (in a Ray worker)")
            return rebuilt
    return None


def _check_resources(ray, workers: int, gpus_per_worker: float) -> None:
    """On a local Ray started here: enough CPUs and GPUs for the actors (Ray would wait for
    them forever)."""
    have = ray.cluster_resources()
    cpus, gpus = have.get("CPU", 0), have.get("GPU", 0)
    if workers > cpus:
        raise InputError(f"--workers {workers} needs {workers} CPUs; this machine's Ray has "
                         f"{cpus:g} (connect to a cluster with --ray-address)")
    if workers * gpus_per_worker > gpus:
        raise InputError(f"--workers {workers} --gpus-per-worker {gpus_per_worker:g} needs "
                         f"{workers * gpus_per_worker:g} GPUs; this machine's Ray has {gpus:g}")
