"""CPU kernels on inputs large enough to take their blocked or fast paths, which the ONNX node
cases (a few dozen elements each) never reach; each one-node model is checked against
onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def one_node(op, feeds, inits=(), opset=20, **attrs):
    """A model of the single node `op`(feeds..., inits...) with output y."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape))
              for n, v in feeds.items()]
    node = helper.make_node(op, list(feeds) + [n for n, _ in inits], ["y"], **attrs)
    graph = helper.make_graph([node], "large", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def matches_onnxruntime(proto, feeds, rtol=1e-5):
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ember.load(proto, simplify=False).run(feeds)["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


@pytest.mark.parametrize("shape, perm", [((3072, 771), [1, 0]), ((3, 300, 259), [0, 2, 1]),
                                         ((200, 130), None), ((2, 3, 300, 140), [0, 1, 3, 2])])
def test_transpose_of_large_matrices(shape, perm):
    attrs = {} if perm is None else {"perm": perm}
    x = rand(*shape)
    matches_onnxruntime(one_node("Transpose", {"x": x}, **attrs), {"x": x}, rtol=0)


@pytest.mark.parametrize("op, attrs", [("Erf", {}), ("Gelu", {}),
                                       ("Gelu", {"approximate": "tanh"})])
def test_erf_and_gelu_over_many_blocks(op, attrs):
    x = rand(3, 257, 131) * 3  # 101k elements, not a multiple of the block size
    matches_onnxruntime(one_node(op, {"x": x}, **attrs), {"x": x})


def test_batchnorm_over_a_large_activation():
    x = rand(2, 64, 57, 55)
    stats = [("scale", rand(64)), ("bias", rand(64)), ("mean", rand(64)),
             ("var", np.abs(rand(64)) + 0.5)]
    matches_onnxruntime(one_node("BatchNormalization", {"x": x}, stats, epsilon=1e-3), {"x": x})


def test_conv_with_a_bias_computed_at_run_time():
    # the bias is a graph input here, not a constant: Conv adds it after the GEMM
    x, w, b = rand(1, 16, 30, 30), rand(32, 16, 3, 3), rand(32)
    matches_onnxruntime(one_node("Conv", {"x": x, "w": w, "b": b}, pads=[1, 1, 1, 1]),
                        {"x": x, "w": w, "b": b})
