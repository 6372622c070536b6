"""`ember batch` with the local engine: outputs equal a plain loop over Session.run, bit for
bit and in row order, on datasets of 10,000+ rows in several Parquet files (the demo MLP and a
CNN exported from PyTorch), and on .npy / .npz folders; resume, failing rows, --map, the
CLI. The Ray engine: tests/tools/test_batch_ray.py."""
import io
import os
import subprocess
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

import ember  # noqa: E402
from batch_datasets import (CNN, MLP, ROW_GROUP, assert_matches_session_loop,  # noqa: E402
                            export_tiny_cnn, session_loop, stacked, write_bad_dataset,
                            write_dataset)
from ember.batch import (ERROR_COLUMN, ColumnPlan, predict_batch, read_output,  # noqa: E402
                         run_batch)
from ember.batch.job import Progress  # noqa: E402
from ember.cli import main  # noqa: E402
from ember.errors import BadRowError, InputError  # noqa: E402

ROWS = 12_000


@pytest.fixture(scope="module")
def mlp_data(tmp_path_factory):
    """12,000 rows of x [4] in 4 files, one per cell encoding (list, fixed_size_list,
    fixed-shape tensor, float64 lists), with id and name columns."""
    folder = str(tmp_path_factory.mktemp("mlp") / "data")
    x = np.random.default_rng(0).standard_normal((ROWS, 4)).astype(np.float32)
    write_dataset(folder, "x", x, files=4)
    return folder, x


@pytest.fixture(scope="module")
def mlp_out(mlp_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mlp") / "out")
    report = run_batch(MLP, mlp_data[0], out)
    return out, report


@pytest.fixture(scope="module")
def tiny_cnn(tmp_path_factory):
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("tiny_cnn")
    model = export_tiny_cnn(str(folder / "tiny_cnn.onnx"))
    images = np.random.default_rng(1).integers(0, 256, (10_000, 1, 8, 8), dtype=np.uint8)
    write_dataset(str(folder / "data"), "image", images, files=4,
                  encodings=("list", "tensor", "fixed_size_list", "tensor"))
    return model, str(folder / "data"), images


def test_mlp_matches_a_session_loop(mlp_data, mlp_out):
    data, x = mlp_data
    out, report = mlp_out
    assert (report.rows, report.files_written, report.error_rows) == (ROWS, 4, 0)
    assert sorted(os.listdir(out)) == sorted(os.listdir(data))
    assert_matches_session_loop(
        MLP, data, out, lambda b: {"x": stacked(b.column("x")).astype(np.float32)}, ["y"])
    # and, row by row, a Session.run of each row alone within rounding
    got = np.concatenate([read_output(os.path.join(out, f"part-{i}.parquet"))["y"]
                          for i in range(4)])
    session = ember.load(MLP)
    alone = np.concatenate([session.run({"x": x[i:i + 1]})["y"] for i in range(0, ROWS, 7)])
    np.testing.assert_allclose(got[::7], alone, rtol=1e-6, atol=1e-6)


def test_output_column_types(mlp_out):
    """Model outputs are arrow.fixed_shape_tensor columns: dtype and row shape are in the
    schema, and pyarrow alone reads them back exactly."""
    schema = pq.read_schema(os.path.join(mlp_out[0], "part-0.parquet"))
    assert schema.names == ["id", "name", "y"]
    assert schema.field("id").type == pa.int64() and schema.field("name").type == pa.string()
    assert isinstance(schema.field("y").type, pa.FixedShapeTensorType)
    assert schema.field("y").type.shape == [2] and schema.field("y").type.value_type == pa.float32()
    # one row group per 65,536 rows gathered, not one per batch
    assert pq.ParquetFile(os.path.join(mlp_out[0], "part-0.parquet")).metadata.num_row_groups == 1


def test_exported_cnn_matches_a_session_loop(tiny_cnn, tmp_path):
    """A CNN exported by torch.onnx.export (two outputs), over 10,000 uint8 images stored as
    nested lists, fixed-size lists and fixed-shape tensors (cast to float32: lossless)."""
    model, data, images = tiny_cnn
    report = run_batch(model, data, str(tmp_path / "out"), batch_size=50)
    assert report.rows == 10_000
    assert_matches_session_loop(
        model, data, str(tmp_path / "out"),
        lambda b: {"image": stacked(b.column("image")).astype(np.float32)}, ["logits", "probs"],
        batch_size=50)
    got = np.concatenate([read_output(str(tmp_path / "out" / f"part-{i}.parquet"))["probs"]
                          for i in range(4)])
    session = ember.load(model)
    rows = range(0, 10_000, 97)
    alone = np.concatenate([session.run({"image": images[i:i + 1].astype(np.float32)})["probs"]
                            for i in rows])
    np.testing.assert_allclose(got[list(rows)], alone, rtol=1e-5, atol=1e-6)


def test_demo_cnn_over_nested_lists(tmp_path):
    """The demo CNN's [3, 32, 32] images as lists of lists of lists."""
    images = np.random.default_rng(2).standard_normal((300, 3, 32, 32)).astype(np.float32)
    data = tmp_path / "data"
    write_dataset(str(data), "image", images, files=2, encodings=("list", "list_float64"))
    run_batch(CNN, str(data), str(tmp_path / "out"), batch_size=32)
    assert_matches_session_loop(
        CNN, str(data), str(tmp_path / "out"),
        lambda b: {"image": stacked(b.column("image")).astype(np.float32)}, ["logits"],
        batch_size=32)


def test_npy_and_npz_folders(mlp_data, mlp_out, tmp_path):
    """An .npy file feeds the model's only input; an .npz file has one array per column
    (here the input and an id). Same outputs as the Parquet files holding the same rows."""
    data, x = mlp_data
    npy, npz = tmp_path / "npy", tmp_path / "npz"
    npy.mkdir(), npz.mkdir()
    parts = np.array_split(np.arange(ROWS), 4)
    for i, rows in enumerate(parts):
        np.save(npy / f"part-{i}.npy", x[rows])
        np.savez(npz / f"part-{i}.npz", x=x[rows], id=rows)
    run_batch(MLP, str(npy), str(tmp_path / "out_npy"), batch_size=ROW_GROUP)
    run_batch(MLP, str(npz), str(tmp_path / "out_npz"), batch_size=ROW_GROUP)
    session = ember.load(MLP)
    for i, rows in enumerate(parts):
        from_npy = read_output(str(tmp_path / "out_npy" / f"part-{i}.parquet"))
        from_npz = read_output(str(tmp_path / "out_npz" / f"part-{i}.parquet"))
        assert list(from_npy) == ["y"] and list(from_npz) == ["id", "y"]
        np.testing.assert_array_equal(from_npz["id"], rows)
        want = np.concatenate([session.run({"x": x[rows][k:k + ROW_GROUP]})["y"]
                               for k in range(0, len(rows), ROW_GROUP)])
        np.testing.assert_array_equal(from_npy["y"], want)
        np.testing.assert_array_equal(from_npz["y"], want)


def test_map_feeds_an_input_from_another_column(mlp_data, tmp_path):
    data, x = mlp_data
    table = pq.read_table(os.path.join(data, "part-0.parquet")).rename_columns(
        ["id", "name", "features"])
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "a.parquet", row_group_size=ROW_GROUP)
    with pytest.raises(InputError, match=r"no column 'x' for input 'x'.*--map COLUMN=x"):
        run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"))
    run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"), column_map={"features": "x"})
    got = read_output(str(tmp_path / "out" / "a.parquet"))
    assert list(got) == ["id", "name", "y"]
    want = session_loop(MLP, str(tmp_path / "data" / "a.parquet"),
                        lambda b: {"x": stacked(b.column("features")).astype(np.float32)})
    np.testing.assert_array_equal(got["y"], want["y"])
    with pytest.raises(InputError, match="not an input of the model"):
        run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"), column_map={"features": "z"})


def test_resume_skips_written_files_and_ignores_stale_temp_files(mlp_data, mlp_out, tmp_path):
    """A run that died mid-file left a temporary file and no output for that file; --resume
    does only the files without an output, and the stale temporary file changes nothing."""
    data, _ = mlp_data
    out = tmp_path / "out"
    out.mkdir()
    for i in (0, 2):  # finished by the run that died
        with open(os.path.join(mlp_out[0], f"part-{i}.parquet"), "rb") as f:
            (out / f"part-{i}.parquet").write_bytes(f.read())
    stale = out / ".part-1.parquet.4242-deadbeef.tmp"
    stale.write_bytes(b"PAR1 half a file")
    before = {i: os.stat(out / f"part-{i}.parquet").st_mtime_ns for i in (0, 2)}
    report = run_batch(MLP, data, str(out), resume=True)
    assert (report.files_skipped, report.files_written, report.rows) == (2, 2, ROWS // 2)
    assert {i: os.stat(out / f"part-{i}.parquet").st_mtime_ns for i in (0, 2)} == before
    for i in range(4):
        assert read_output(str(out / f"part-{i}.parquet")).keys() == {"id", "name", "y"}
        np.testing.assert_array_equal(read_output(str(out / f"part-{i}.parquet"))["y"],
                                      read_output(os.path.join(mlp_out[0], f"part-{i}.parquet"))["y"])
    assert sorted(p for p in os.listdir(out) if p.endswith(".tmp")) == [stale.name]
    report = run_batch(MLP, data, str(out), resume=True)
    assert (report.files_skipped, report.files_written) == (4, 0)


def test_an_interrupted_run_leaves_no_partial_output(mlp_data, tmp_path, monkeypatch):
    """Stopped in the middle of the second file: the first file's output is complete, the
    second has none and no temporary file is left; --resume then finishes the job."""
    import ember.batch.local as local

    data, _ = mlp_data
    calls = {"n": 0}
    real = local.predict_batch

    def interrupted(session, batch, plan):
        calls["n"] += 1
        if calls["n"] == 3000 // 64 + 10:  # ten batches into part-1
            raise KeyboardInterrupt
        return real(session, batch, plan)

    monkeypatch.setattr(local, "predict_batch", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_batch(MLP, data, str(out))
    assert sorted(os.listdir(out)) == ["part-0.parquet"]
    monkeypatch.setattr(local, "predict_batch", real)
    report = run_batch(MLP, data, str(out), resume=True)
    assert (report.files_skipped, report.files_written) == (1, 3)


def test_a_bad_row_names_its_file_row_and_column(mlp_data, tmp_path):
    data, x = mlp_data
    path = write_bad_dataset(tmp_path / "data", x[:6000])
    out = tmp_path / "out"
    with pytest.raises(BadRowError) as info:
        run_batch(MLP, str(tmp_path / "data"), str(out))
    message = str(info.value)
    assert str(path) in message and "row 1234" in message and "column 'x'" in message
    assert "5 values in dimension 1 where the model expects 4" in message
    assert (info.value.path, info.value.row) == (str(path), 1234)
    # nothing already written is lost: part-0 is complete, part-1 absent
    assert sorted(os.listdir(out)) == ["part-0.parquet"]
    assert len(read_output(str(out / "part-0.parquet"))["y"]) == 3000


def test_on_error_skip_sets_failing_rows_aside(mlp_data, tmp_path):
    data, x = mlp_data
    write_bad_dataset(tmp_path / "data", x[:6000])
    out = tmp_path / "out"
    report = run_batch(MLP, str(tmp_path / "data"), str(out), on_error="skip")
    assert (report.rows, report.error_rows) == (5998, 2)
    assert sorted(os.listdir(out)) == ["part-0.parquet", "part-1.errors.parquet", "part-1.parquet"]
    errors = pq.read_table(out / "part-1.errors.parquet").to_pydict()
    assert errors["id"] == [3000 + 1234, 3000 + 1500]
    assert errors["ember_row"] == [1234, 1500]
    assert "5 values in dimension 1" in errors["ember_error"][0]
    assert "null" in errors["ember_error"][1] and "column 'x'" in errors["ember_error"][1]
    got = read_output(str(out / "part-1.parquet"))
    kept = np.setdiff1d(np.arange(3000, 6000), [4234, 4500])
    np.testing.assert_array_equal(got["id"], kept)
    x = x.copy()
    x[5000] = [np.nan, 0, 0, 0]
    want = ember.load(MLP).run({"x": x[kept]})["y"]
    np.testing.assert_allclose(got["y"], want, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert np.isnan(got["y"][list(kept).index(5000)]).all()  # the NaN row ran
    # a clean rerun removes the stale errors file
    write_dataset(str(tmp_path / "data"), "x", x[:6000], files=2, encodings=("list", "list"))
    run_batch(MLP, str(tmp_path / "data"), str(out), on_error="skip")
    assert sorted(os.listdir(out)) == ["part-0.parquet", "part-1.parquet"]


def test_dtype_and_shape_errors_name_the_column(tmp_path):
    (tmp_path / "data").mkdir()
    strings = pa.table({"x": pa.array([["a", "b", "c", "d"]] * 3)})
    pq.write_table(strings, tmp_path / "data" / "s.parquet")
    with pytest.raises(BadRowError, match=r"s.parquet, row 0, column 'x': holds strings; "
                                          r"input 'x' takes float32"):
        run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"))
    os.remove(tmp_path / "data" / "s.parquet")
    deep = pa.table({"x": pa.array([[[1.0] * 4]] * 3)})
    pq.write_table(deep, tmp_path / "data" / "d.parquet")
    with pytest.raises(BadRowError, match=r"row 0, column 'x': rows of shape \[1, 4\]; input "
                                          r"'x' takes \[batch, 4\]"):
        run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"))


def test_model_rejected_rows_are_found_by_halving():
    """When the model rejects a stacked batch, the failing rows are found (halving) and the
    others run together again: bit-equal to a run over the good rows alone."""
    session = ember.load(MLP)

    class Picky:  # rejects any batch holding a row whose first value is 99
        inputs, outputs = session.inputs, session.outputs

        def run(self, feeds, outputs=None):
            if (feeds["x"][:, 0] == 99).any():
                raise InputError("row with 99")
            return session.run(feeds, outputs)

    x = np.random.default_rng(3).standard_normal((64, 4)).astype(np.float32)
    x[[5, 40, 41], 0] = 99
    plan = ColumnPlan.build(session.inputs, session.outputs)
    result = predict_batch(Picky(), {"x": x, "id": np.arange(64)}, plan)
    assert list(result) == ["id", "y", ERROR_COLUMN]
    bad = np.flatnonzero(np.not_equal(result[ERROR_COLUMN], None))
    assert list(bad) == [5, 40, 41]
    assert result[ERROR_COLUMN][5] == "column 'x': row with 99"
    good = np.setdiff1d(np.arange(64), bad)
    np.testing.assert_array_equal(result["y"][good], session.run({"x": x[good]})["y"])
    assert not result["y"][bad].any()


def test_fixed_batch_of_one_runs_row_by_row(tmp_path):
    """A model exported with batch size 1 runs each row on its own."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "one.onnx")
    np.save(tmp_path / "x.npy", np.arange(30, dtype=np.float32).reshape(10, 3))
    run_batch(str(tmp_path / "one.onnx"), str(tmp_path / "x.npy"), str(tmp_path / "out"))
    np.testing.assert_array_equal(read_output(str(tmp_path / "out" / "x.parquet"))["y"],
                                  2 * np.arange(30, dtype=np.float32).reshape(10, 3))


def test_cli(mlp_data, tmp_path, capsys):
    data, _ = mlp_data
    assert main(["batch", MLP, data, str(tmp_path / "out"), "--batch-size", "128",
                 "--no-progress"]) == 0
    assert "12,000 rows written to 4 file(s)" in capsys.readouterr().out
    write_bad_dataset(tmp_path / "bad", np.zeros((6000, 4), np.float32))
    assert main(["batch", MLP, str(tmp_path / "bad"), str(tmp_path / "out2"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "part-1.parquet, row 1234, column 'x'" in err
    assert main(["batch", MLP, str(tmp_path / "bad"), str(tmp_path / "out2"), "--no-progress",
                 "--on-error", "skip"]) == 0
    assert "2 failing row(s) set aside in" in capsys.readouterr().out
    assert main(["batch", MLP, data, str(tmp_path / "out3"), "--workers", "2"]) == 2
    assert "only with --engine ray" in capsys.readouterr().err
    assert main(["batch", MLP, str(tmp_path / "missing"), str(tmp_path / "out3")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_progress_shows_rate_and_eta():
    stream = io.StringIO()
    progress = Progress(1000, stream=stream)
    progress.advance(250)
    progress.close()
    assert "250/1,000 rows (25%)" in stream.getvalue() and "rows/s, ETA 0:00:" in stream.getvalue()


def test_empty_file_gives_an_empty_output(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "x": pa.array([], pa.list_(pa.float32()))}),
                   tmp_path / "data" / "e.parquet")
    run_batch(MLP, str(tmp_path / "data"), str(tmp_path / "out"))
    assert pq.read_table(tmp_path / "out" / "e.parquet").schema.names == ["id"]


def test_extras_stay_optional():
    """`import ember` imports neither pyarrow nor ray, and without pyarrow `ember batch`
    says which extra to install (exit 2, one line)."""
    code = ("import sys, ember, ember.cli; assert 'pyarrow' not in sys.modules, 'pyarrow'; "
            "assert 'ray' not in sys.modules, 'ray'; sys.modules['pyarrow'] = None; "
            f"sys.exit(ember.cli.main(['batch', {MLP!r}, 'data', 'out']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "pip install ember[batch]" in done.stderr and done.stderr.count("\n") == 1


def test_two_inputs_with_a_free_dimension(tmp_path):
    """The demo transformer: tokens [batch, seq, 32] and mask [batch, seq] (int32 cells cast
    to int64). Each file has its own seq; a row whose seq differs from its batch's is set
    aside, naming the column where it differs."""
    from batch_datasets import REPO, cells

    model = os.path.join(REPO, "models", "transformer.onnx")
    rng = np.random.default_rng(4)
    (tmp_path / "data").mkdir()
    tokens = {}
    for name, seq in (("a", 8), ("b", 12)):
        tokens[name] = rng.standard_normal((200, seq, 32)).astype(np.float32)
        mask = np.ones((200, seq), np.int32)
        mask[:, -2:] = 0
        table = pa.table({"id": np.arange(200), "tokens": cells(tokens[name], "list"),
                          "mask": cells(mask, "list")})
        if name == "a":  # row 60: a mask of 7
            masks = table.column("mask").to_pylist()
            masks[60] = masks[60][:7]
            table = table.set_column(2, "mask", pa.array(masks, pa.list_(pa.int32())))
        pq.write_table(table, tmp_path / "data" / f"{name}.parquet")
    report = run_batch(model, str(tmp_path / "data"), str(tmp_path / "out"), on_error="skip")
    assert (report.rows, report.error_rows) == (399, 1)
    errors = pq.read_table(tmp_path / "out" / "a.errors.parquet").to_pydict()
    assert errors["ember_row"] == [60]
    assert errors["ember_error"][0] == ("column 'mask': 7 values in dimension 1 where the "
                                        "other rows have 8")
    session = ember.load(model)
    for name, seq in (("a", 8), ("b", 12)):
        got = read_output(str(tmp_path / "out" / f"{name}.parquet"))
        assert got["encoded"].shape == (199 if name == "a" else 200, seq, 32)
        mask = np.ones((64, seq), np.int64)
        mask[:, -2:] = 0
        want = session.run({"tokens": tokens[name][128:192], "mask": mask})["encoded"]
        np.testing.assert_array_equal(got["encoded"][-72:-8] if name == "a"
                                      else got["encoded"][128:192], want)


def test_the_ray_engine_without_ray_says_what_to_install(mlp_data, tmp_path, monkeypatch):
    from ember.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as without Ray
    with pytest.raises(BackendUnavailableError, match=r"pip install ember\[ray\]"):
        run_batch(MLP, mlp_data[0], str(tmp_path / "out"), engine="ray")
