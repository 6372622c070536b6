"""Datasets and models for the `ember batch` tests (tests/tools/test_batch.py, test_batch_ray.py),
and the oracle: a plain loop over Session.run."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import ember
from ember.batch import read_output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(REPO, "models", "mlp.onnx")  # x [batch, 4] -> y [batch, 2]
CNN = os.path.join(REPO, "models", "cnn.onnx")  # image [batch, 3, 32, 32] -> logits [batch, 10]
ROW_GROUP = 1000
# how the example cells of each file are stored: every form a cell may take
ENCODINGS = ("list", "fixed_size_list", "tensor", "list_float64")


def cells(x: np.ndarray, encoding: str) -> pa.Array:
    """One cell per row of `x` (rows, *shape), stored as `encoding`."""
    if encoding == "list_float64":
        x, encoding = x.astype(np.float64), "list"
    if encoding == "tensor":
        return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(x))
    if x.ndim == 1:
        return pa.array(x)
    nested = pa.array(x.reshape(-1))
    for size in reversed(x.shape[1:]):
        if encoding == "fixed_size_list":
            nested = pa.FixedSizeListArray.from_arrays(nested, size)
        else:
            offsets = pa.array(np.arange(0, len(nested) + 1, size, dtype=np.int32))
            nested = pa.ListArray.from_arrays(offsets, nested)
    return nested


def write_dataset(folder: str, column: str, x: np.ndarray, files: int,
                  encodings=ENCODINGS) -> list[str]:
    """`x` split into `files` Parquet files part-N.parquet with columns id, name, `column`
    (file N stores its cells as encodings[N % len]), row groups of ROW_GROUP rows."""
    os.makedirs(folder, exist_ok=True)
    paths, start = [], 0
    for i, chunk in enumerate(np.array_split(x, files)):
        ids = np.arange(start, start + len(chunk))
        start += len(chunk)
        table = pa.table({"id": ids, "name": pa.array([f"row{k}" for k in ids]),
                          column: cells(chunk, encodings[i % len(encodings)])})
        path = os.path.join(folder, f"part-{i}.parquet")
        pq.write_table(table, path, row_group_size=ROW_GROUP)
        paths.append(path)
    return paths


def write_bad_dataset(folder, x: np.ndarray) -> str:
    """Two files of the MLP's rows `x`; in part-1: row 1234 has 5 values, row 1500 is null,
    row 2000 holds a NaN (it runs: a value, not a shape). Returns part-1's path."""
    write_dataset(str(folder), "x", x, files=2, encodings=("list", "list"))
    path = os.path.join(str(folder), "part-1.parquet")
    table = pq.read_table(path)
    rows = table.column("x").to_pylist()
    rows[1234] = [1.0, 2.0, 3.0, 4.0, 5.0]
    rows[1500] = None
    rows[2000] = [float("nan"), 0.0, 0.0, 0.0]
    table = table.set_column(2, "x", pa.array(rows, pa.list_(pa.float32())))
    pq.write_table(table, path, row_group_size=ROW_GROUP)
    return path


def stacked(column: pa.Array) -> np.ndarray:
    """A column of equal-shaped cells as one (rows, *shape) array, by a route of its own
    (Python lists), independent of ember.batch.data."""
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    return np.array(column.to_pylist())


def session_loop(model: str, path: str, feeds_of, batch_size: int = 64) -> dict:
    """The oracle: each row group of the file in batches of `batch_size` rows (the batches
    ember batch runs), through a plain Session.run; outputs concatenated in row order."""
    session = ember.load(model)
    outputs: dict[str, list] = {}
    with pq.ParquetFile(path) as f:
        for group in range(f.metadata.num_row_groups):
            for batch in f.iter_batches(batch_size=batch_size, row_groups=[group]):
                for name, value in session.run(feeds_of(batch)).items():
                    outputs.setdefault(name, []).append(value)
    return {name: np.concatenate(values) for name, values in outputs.items()}


def export_tiny_cnn(path: str) -> str:
    """A tiny conv net exported from PyTorch (TorchScript exporter, dynamic batch):
    image [batch, 1, 8, 8] float32 -> logits [batch, 5], probs [batch, 5]."""
    import torch
    from torch import nn

    class TinyCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
            self.fc = nn.Linear(8 * 4 * 4, 5)

        def forward(self, image):
            h = torch.relu(self.bn(self.conv1(image)))
            h = torch.relu(self.conv2(h))
            logits = self.fc(h.flatten(1))
            return logits, logits.softmax(-1)

    torch.manual_seed(0)
    model = TinyCNN().eval()
    with torch.no_grad():  # BatchNorm statistics as trained ones have
        model.bn.running_mean.normal_(0, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    torch.onnx.export(model, (torch.randn(2, 1, 8, 8),), path, input_names=["image"],
                      output_names=["logits", "probs"], opset_version=17, dynamo=False,
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"},
                                    "probs": {0: "batch"}})
    return path


def assert_matches_session_loop(model, data, out, feeds_of, outputs, batch_size=64):
    """Each output file equals the oracle on its input file bit for bit, and carries the
    input's id and name columns first, in row order."""
    for name in sorted(os.listdir(data)):
        got = read_output(os.path.join(out, name))
        source = pq.read_table(os.path.join(data, name))
        assert list(got) == ["id", "name"] + outputs
        np.testing.assert_array_equal(got["id"], source.column("id").to_numpy())
        assert list(got["name"]) == source.column("name").to_pylist()
        want = session_loop(model, os.path.join(data, name), feeds_of, batch_size)
        for output in outputs:
            assert got[output].dtype == want[output].dtype
            np.testing.assert_array_equal(got[output], want[output])
