"""`ember batch --engine ray` and `ember.ray.Predictor` on a local Ray (ray.init(num_cpus=2)):
the output folder is the local engine's, file for file and bit for bit, on 10,000+ rows in
several Parquet files (the demo MLP, a CNN exported from PyTorch); failing rows, the public
Predictor in a user's own pipeline, and an actor that crashes (Ray restarts it and retries)."""
import os
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
import pyarrow.parquet as pq  # noqa: E402

import ember  # noqa: E402
import ember.ray  # noqa: E402
from batch_datasets import (MLP, assert_matches_session_loop, export_tiny_cnn,  # noqa: E402
                            stacked, write_bad_dataset, write_dataset)
from ember.batch import column_to_numpy, run_batch  # noqa: E402
from ember.batch.job import BatchJob  # noqa: E402
from ember.batch.ray_engine import _PartWorker, run_ray  # noqa: E402
from ember.errors import BadRowError  # noqa: E402

ROWS = 12_000


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def mlp_data(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlp") / "data")
    x = np.random.default_rng(0).standard_normal((ROWS, 4)).astype(np.float32)
    write_dataset(folder, "x", x, files=4)
    return folder, x


def assert_same_folders(local: str, other: str) -> None:
    """The same files, each with the same schema and the same values, bit for bit (a NaN
    output, which Arrow's equals never calls equal, included)."""
    assert sorted(os.listdir(local)) == sorted(os.listdir(other))
    for name in os.listdir(local):
        a, b = pq.read_table(os.path.join(local, name)), pq.read_table(os.path.join(other, name))
        assert a.schema == b.schema, name
        for column in a.column_names:
            x, y = column_to_numpy(a.column(column)), column_to_numpy(b.column(column))
            if x.dtype.kind == "f":
                x, y = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
            np.testing.assert_array_equal(x, y, err_msg=f"{name}: {column}")


def test_ray_engine_equals_the_local_engine(mlp_data, tmp_path):
    data, _ = mlp_data
    local = run_batch(MLP, data, str(tmp_path / "local"))
    distributed = run_batch(MLP, data, str(tmp_path / "ray"), engine="ray", workers=2)
    assert (distributed.rows, distributed.files_written) == (ROWS, 4)
    assert_same_folders(str(tmp_path / "local"), str(tmp_path / "ray"))
    assert_matches_session_loop(
        MLP, data, str(tmp_path / "ray"),
        lambda b: {"x": stacked(b.column("x")).astype(np.float32)}, ["y"])
    print(f"\nlocal {local.rows_per_second:,.0f} rows/s, ray 2 workers "
          f"{distributed.rows_per_second:,.0f} rows/s (with actor start-up)")


def test_ray_engine_on_an_exported_cnn(tmp_path):
    pytest.importorskip("torch")
    model = export_tiny_cnn(str(tmp_path / "tiny_cnn.onnx"))
    images = np.random.default_rng(1).integers(0, 256, (10_000, 1, 8, 8), dtype=np.uint8)
    data = str(tmp_path / "data")
    write_dataset(data, "image", images, files=4, encodings=("list", "tensor"))
    run_batch(model, data, str(tmp_path / "local"), batch_size=50)
    report = run_batch(model, data, str(tmp_path / "ray"), batch_size=50, engine="ray",
                       workers=1)
    assert report.rows == 10_000
    assert_same_folders(str(tmp_path / "local"), str(tmp_path / "ray"))


def test_ray_engine_failing_rows(mlp_data, tmp_path):
    """--on-error skip: the same outputs and errors file as the local engine; fail: the error
    names the file, the row and the column."""
    path = write_bad_dataset(tmp_path / "data", mlp_data[1][:6000])
    data = str(tmp_path / "data")
    run_batch(MLP, data, str(tmp_path / "local"), on_error="skip")
    report = run_batch(MLP, data, str(tmp_path / "ray"), on_error="skip", engine="ray",
                       workers=2)
    assert (report.rows, report.error_rows) == (5998, 2)
    assert_same_folders(str(tmp_path / "local"), str(tmp_path / "ray"))
    with pytest.raises(BadRowError) as info:
        run_batch(MLP, data, str(tmp_path / "ray_fail"), engine="ray", workers=2)
    assert f"{path}, row 1234, column 'x'" in str(info.value)
    assert os.listdir(tmp_path / "ray_fail") == ["part-0.parquet"]


def test_predictor_in_a_users_own_pipeline(mlp_data, tmp_path, monkeypatch):
    """The example of docs/batch.md: read_parquet, map_batches(ember.ray.Predictor), write_parquet.
    Ray chooses the batches there, so rows are compared with a Session.run within rounding."""
    data, x = mlp_data
    monkeypatch.setattr(ray.data.DataContext.get_current().execution_options, "preserve_order",
                        True)
    ds = ray.data.read_parquet(data)
    # one actor: with two on this 2-CPU Ray, the read tasks would find no CPU left
    out = ds.map_batches(ember.ray.Predictor,
                         fn_constructor_kwargs={"model": MLP, "backend": "cpu"},
                         compute=ray.data.ActorPoolStrategy(size=1), batch_size=64)
    rows = out.take_batch(ROWS, batch_format="numpy")
    assert set(rows) == {"id", "name", "y"}
    np.testing.assert_array_equal(rows["id"], np.arange(ROWS))
    np.testing.assert_allclose(rows["y"], ember.load(MLP).run({"x": x})["y"], rtol=1e-6, atol=1e-6)
    out.write_parquet(str(tmp_path / "out"))
    assert sum(pq.read_metadata(os.path.join(tmp_path / "out", f)).num_rows
               for f in os.listdir(tmp_path / "out")) == ROWS


class CrashOnce(_PartWorker):
    """A worker whose process dies in its third part, once (the marker file remembers)."""
    marker = ""  # set by the test; the class travels to the workers by value

    def __call__(self, items):
        if int(items["index"][0]) == 2 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return super().__call__(items)


def test_a_crashed_actor_is_restarted_and_its_part_retried(mlp_data, tmp_path, monkeypatch):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    monkeypatch.setattr(CrashOnce, "marker", str(tmp_path / "crashed"))
    data, _ = mlp_data
    report = run_ray(BatchJob(MLP, data, str(tmp_path / "out")), workers=1, _worker=CrashOnce)
    assert os.path.exists(CrashOnce.marker) and report.rows == ROWS
    run_batch(MLP, data, str(tmp_path / "local"))
    assert_same_folders(str(tmp_path / "local"), str(tmp_path / "out"))
