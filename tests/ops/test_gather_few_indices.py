"""Gather with a few indices (a token's embedding row, an element of a shape), which
ops/indexing.py's `_fix_indices` checks in Python: in-range, negative (wrapped) and
out-of-range indices, int32 and int64, against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ember
from ember.errors import EmberError


def _model(data_shape, index_type, axis):
    graph = helper.make_graph(
        [helper.make_node("Gather", ["d", "i"], ["y"], axis=axis)], "gather",
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, list(data_shape)),
         helper.make_tensor_value_info("i", index_type, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model.SerializeToString()


@pytest.mark.parametrize("indices, axis", [
    (np.array([[17]], np.int64), 0), (np.array(3, np.int64), 1),
    (np.array([-1, 0, 5], np.int32), 0), (np.arange(-16, 0, dtype=np.int64).reshape(4, 4), 0),
    (np.zeros((0,), np.int64), 1)])
def test_few_indices_match_onnxruntime(indices, axis):
    data = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)
    proto = _model(data.shape, TensorProto.INT32 if indices.dtype == np.int32 else
                   TensorProto.INT64, axis)
    feeds = {"d": data, "i": indices}
    got = ember.load(proto).run(feeds)["y"]
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [20, -21])
def test_an_index_out_of_range_is_refused(bad):
    proto = _model((20, 6), TensorProto.INT64, 0)
    sess = ember.load(proto)
    with pytest.raises(EmberError, match="out of bounds"):
        sess.run({"d": np.zeros((20, 6), np.float32), "i": np.array([1, bad], np.int64)})
