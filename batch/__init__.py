"""Batch inference over datasets: `ember batch MODEL DATA OUT` and `ember.batch.run_batch`.

- ember.batch.data        input files (Parquet, .npy, .npz) read a part and a batch at a time,
                          cells stacked into feeds, outputs written atomically as Parquet
- ember.batch.predict     predict_batch: a batch of rows -> the output columns, the one step
                          both engines run
- ember.batch.run         run_batch: checks the settings, picks the engine
- ember.batch.job         what the engines share: files to do, resume, failing
                          rows, progress
- ember.batch.local       the local engine (the default)
- ember.batch.ray_engine  the Ray Data engine (pip install ember[ray]); `ember.ray.Predictor`
                          is its public callable class

Needs pyarrow (pip install ember[batch]); `import ember` imports none of this.
"""
from ember.batch.data import column_to_numpy, list_inputs, open_source, to_arrow_table
from ember.batch.job import BatchReport
from ember.batch.run import run_batch
from ember.errors import BadRowError
from ember.batch.predict import ERROR_COLUMN, ColumnPlan, predict_batch

__all__ = ["run_batch", "BatchReport", "BadRowError", "predict_batch", "ColumnPlan",
           "ERROR_COLUMN", "list_inputs", "open_source", "to_arrow_table", "column_to_numpy",
           "read_output"]


def read_output(path: str) -> dict:
    """An output file of `ember batch` as {column: numpy array}; tensor columns come back
    as (rows, *shape) arrays of their dtype."""
    from ember.batch.data import pq

    table = pq.read_table(path)
    return {name: column_to_numpy(table.column(name)) for name in table.column_names}
