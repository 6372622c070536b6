"""The CPU kernels that numba compiles where it is installed (ops/_compiled.py), each against
its numpy kernel and onnxruntime:

* the depthwise 3x3 convolution (numpy's einsum kernel and numba's, with its rows split among
  threads: the same bits), for NCHW input and for the channels-last input a preceding 1x1
  convolution hands on, and from several threads at once;
* float32 GELU (erf), which must give numpy's kernel's bits exactly, in place or not.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.ops import _compiled, activations, conv

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def _model(c, size, kernel, strides, dilations, pads, pointwise_first, batch):
    """[1x1 conv ->] depthwise conv -> Clip (ReLU6), as in MobileNetV2's blocks."""
    rng = np.random.default_rng(c + size)
    nodes, inits, source = [], [], "x"
    if pointwise_first:
        nodes.append(helper.make_node("Conv", ["x", "pw"], ["p"]))
        inits.append(numpy_helper.from_array(rng.standard_normal((c, c, 1, 1))
                                             .astype(np.float32) / c, "pw"))
        source = "p"
    nodes += [helper.make_node("Conv", [source, "w", "b"], ["d"], group=c, kernel_shape=kernel,
                               strides=strides, dilations=dilations, pads=pads),
              helper.make_node("Clip", ["d", "lo", "hi"], ["y"])]
    inits += [numpy_helper.from_array(rng.standard_normal((c, 1, *kernel)).astype(np.float32),
                                      "w"),
              numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
              numpy_helper.from_array(np.array(0, np.float32), "lo"),
              numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info(
        "x", F, [batch, c, size, size])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((batch, c, size, size)).astype(np.float32) * 2
    return proto.SerializeToString(), {"x": x}


CASES = [  # c, size, kernel, strides, dilations, pads
    (32, 28, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    (24, 17, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    (16, 15, [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),
    (8, 12, [3, 3], [2, 1], [1, 1], [0, 1, 1, 0]),
    (40, 9, [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),
    (12, 14, [5, 5], [2, 2], [1, 1], [2, 2, 2, 2]),
]


@pytest.fixture(params=["numpy", "numba"])
def kernel(request, monkeypatch):
    """Which depthwise 3x3 kernel runs: numpy's einsum, or numba's where it is installed."""
    if request.param == "numpy":
        monkeypatch.setitem(_compiled._compiled, conv._depthwise3x3_rows, None)
    else:
        pytest.importorskip("numba")
        monkeypatch.delitem(_compiled._compiled, conv._depthwise3x3_rows, raising=False)
        monkeypatch.delenv("EMBER_NUMBA", raising=False)
        assert conv._numba_depthwise3x3() is not None
    return request.param


@pytest.mark.parametrize("pointwise_first", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[0]}-{c[1]}-k{c[2][0]}s{c[3]}d{c[4]}")
def test_depthwise_matches_onnxruntime(kernel, case, batch, pointwise_first):
    proto, feeds = _model(*case, pointwise_first, batch)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ember.load(proto).run(feeds)["y"]
    assert got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride, dilation, pad", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 1, 0)])
def test_rows_split_among_threads_give_the_same_bits(kernel, stride, dilation, pad):
    """A run with several threads splits the output rows among them: every split must give
    the bits of one thread doing all rows (BLAS's thread count may change a GEMM's rounding;
    this kernel's must not)."""
    if kernel != "numba":
        pytest.skip("the row split is the numba kernel's")
    compiled = conv._numba_depthwise3x3()
    rng = np.random.default_rng(stride + 3 * dilation + 7 * pad)
    x = rng.standard_normal((2, 23, 19, 40)).astype(np.float32)
    w, b = rng.standard_normal((3, 3, 40)).astype(np.float32), np.ones(40, np.float32)
    oh = (23 + 2 * pad - 2 * dilation - 1) // stride + 1
    ow = (19 + 2 * pad - 2 * dilation - 1) // stride + 1
    a, c = np.empty((2, oh, ow, 40), np.float32), np.empty((2, oh, ow, 40), np.float32)
    args = (pad, pad, stride, stride, dilation, dilation)
    compiled(x, w, b, a, *args, 0, oh)
    for i in range(0, oh, 3):  # uneven pieces, in any order
        compiled(x, w, b, c, *args, i, min(oh, i + 3))
    np.testing.assert_array_equal(a, c)
    split = np.empty_like(a)
    conv._run_depthwise3x3(compiled, x, w, b, split, *args)  # over the pool
    np.testing.assert_array_equal(a, split)


def test_a_session_shared_by_threads_gives_sequential_bits(kernel):
    proto, _ = _model(*CASES[1], True, 2)
    session = ember.load(proto)
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((2, 24, 17, 17)).astype(np.float32)} for _ in range(8)]
    sequential = [session.run(f)["y"] for f in feeds]
    results = [None] * len(feeds)

    def work(i):
        for _ in range(3):
            results[i] = session.run(feeds[i])["y"]

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for want, got in zip(sequential, results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [1 << 14, 100_003, 393_216])
@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_gelu_gives_the_numpy_kernels_bits(size, in_place, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    monkeypatch.delitem(_compiled._compiled, activations._gelu_erf32_loops, raising=False)
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 4).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, -5.0, 0.0, -0.0]
    want = np.empty_like(x)
    for block, out in activations.blocks(np, x, want):  # numpy's kernel, block by block
        activations._gelu_erf32_block(np, block, out)
    assert _compiled.jit(activations._gelu_erf32_loops) is not None
    work = x.copy()
    got = activations.gelu(np, work, out=work if in_place else None)
    np.testing.assert_array_equal(got, want)


def test_gelu_model_matches_onnxruntime_with_the_compiled_kernel():
    pytest.importorskip("numba")
    x = (np.random.default_rng(1).standard_normal((4, 128, 96)) * 3).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"])], "gelu",
                              [helper.make_tensor_value_info("x", F, list(x.shape))],
                              [helper.make_tensor_value_info("y", F, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ember.load(proto.SerializeToString()).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
