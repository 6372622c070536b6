"""`ember.ray`: ember on Ray Data (pip install ember[ray]).

    import ray, ember.ray
    ds = ray.data.read_parquet("data/")
    out = ds.map_batches(ember.ray.Predictor,
                         fn_constructor_kwargs={"model": "model.onnx", "backend": "cpu"},
                         compute=ray.data.ActorPoolStrategy(size=4), batch_size=64)
    out.write_parquet("out/")

This file is batch/ray_api/__init__.py, installed as the module `ember.ray` by the
package-dir entry in pyproject.toml (setuptools maps it in editable installs too). It is not
a `ray.py` or `ray/` at the repository root: the root is on sys.path when tests or scripts
run from it, and such a file would shadow the real `ray` package for every import there.
"""
from ember.batch.ray_engine import Predictor, _import_ray, run_ray

_import_ray()  # ember.ray without Ray: the install hint now, not at the first batch

__all__ = ["Predictor", "run_ray"]
