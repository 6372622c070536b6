"""The CPU engine's integer products (ops/cpu/integer.py, integer_tiles.py): exact int32 sums
of 8-bit products.

The kernel itself against numpy's int64 matmul and torch's float64 convolution of the shifted
values (exact for these sizes), over the shapes that leave partial tiles, blocks and words
(rows not a multiple of 12, columns of 32, K of 4), every signedness and per-row zero points;
then the ops that run on it, as one-node models against onnxruntime, bit for bit, with the
plan's kernel checked to be the integer one (so the test fails if the route silently stops),
and a session shared by threads. Weights are 7-bit where onnxruntime's u8s8 kernel would
saturate on a CPU without VNNI (tests/ops/test_contrib_quantized.py's docstring)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ember
from shared_session import threads_give_sequential_bits
from ember.ops.cpu import integer, integer_tiles

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not integer.enabled(), reason="numba is not installed")

_TP = {np.dtype(np.int8): TP.INT8, np.dtype(np.uint8): TP.UINT8,
       np.dtype(np.float32): TP.FLOAT, np.dtype(np.int32): TP.INT32}


def _ints(rng, dtype, shape, bits=8):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if np.dtype(dtype) == np.int8 \
        else (0, (1 << bits) - 1)
    return rng.integers(lo, hi + 1, shape).astype(dtype)


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("wdt", [np.int8, np.uint8])
@pytest.mark.parametrize("M,K,N", [(1, 4, 1), (5, 13, 7), (33, 100, 45), (70, 259, 25)])
def test_matmul_kernel_exact(adt, wdt, M, K, N):
    rng = np.random.default_rng(M * 1000 + K)
    x, w = _ints(rng, adt, (M, K)), _ints(rng, wdt, (K, N))
    zx = int(_ints(rng, adt, ()))
    zw = _ints(rng, wdt, (N,)).astype(np.int64)
    out = np.empty((1, 1, M, N), np.int32)
    weights = integer_tiles.ConvWeights(np.ascontiguousarray(w.T).reshape(N, K, 1, 1), zw)
    image = x.reshape(1, 1, M, K).transpose(0, 3, 1, 2)   # the rows as M pixels
    pointwise = ((1, 1), (1, 1), (1, 1), (0, 0), (0, 0))
    integer_tiles.Plan(weights, image, pointwise, (1, M)).run(image, zx, out)
    expected = (x.astype(np.int64) - zx) @ (w.astype(np.int64) - zw)
    np.testing.assert_array_equal(out.reshape(M, N), expected)


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("C,H,M,k,s,d,p", [(3, 23, 14, 7, 2, 1, 3), (16, 9, 13, 3, 1, 2, 2),
                                          (5, 10, 40, 1, 2, 1, 0), (8, 12, 12, 3, 2, 1, 0)])
def test_conv_kernel_exact(adt, C, H, M, k, s, d, p):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(C * 100 + M)
    x, w = _ints(rng, adt, (C, H, H)), _ints(rng, np.int8, (M, C, k, k))
    zx = int(_ints(rng, adt, ()))
    zw = rng.integers(-4, 5, M)
    OH = (H + 2 * p - d * (k - 1) - 1) // s + 1
    packed, sums, shift = integer.pack_patches(x, zx, (k, k), (s, s), (d, d), (p, p), (p, p),
                                               (OH, OH))
    out = np.empty((M, OH * OH), np.int32)
    integer.product(integer.conv_weights(w, zw), packed, sums, zx + shift, out)
    expected = torch.nn.functional.conv2d(
        torch.tensor(x.astype(np.float64) - zx)[None],
        torch.tensor(w.astype(np.float64) - zw[:, None, None, None]), stride=s, padding=p,
        dilation=d)[0].numpy().reshape(M, -1)
    np.testing.assert_array_equal(out, expected)


def _model(op, inputs, out_dtype, domain="", **attrs):
    """One node; `inputs` (name, array, constant?) with None for an omitted input."""
    feeds, inits, graph_inputs, names = {}, [], [], []
    for name, value, constant in inputs:
        if value is None:
            names.append("")
            continue
        names.append(name)
        if constant:
            inits.append(numpy_helper.from_array(value, name))
        else:
            feeds[name] = value
            graph_inputs.append(helper.make_tensor_value_info(name, _TP[value.dtype],
                                                              value.shape))
    node = helper.make_node(op, names, ["y"], domain=domain, **attrs)
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info("y", _TP[np.dtype(out_dtype)],
                                                             None)], inits)
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain
                                               else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8), feeds


def _check(model, feeds, exact=True, kernel="cpu.integer"):
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = ember.load(model, backend="cpu")
    got = sess.run(feeds)["y"]
    assert [k for _, _, k, _ in sess.kernels] == [kernel]
    if exact:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6,
                                   atol=1e-6 * float(np.abs(expected).max()))
    return sess, got


@pytest.mark.parametrize("adt,wdt", [(np.uint8, np.int8), (np.uint8, np.uint8),
                                     (np.int8, np.int8)])
def test_matmul_integer_against_onnxruntime(adt, wdt):
    rng = np.random.default_rng(1)
    a, b = _ints(rng, adt, (2, 37, 70)), _ints(rng, wdt, (70, 51), bits=7)
    za, zb = _ints(rng, adt, ()), _ints(rng, wdt, (51,), bits=7)
    model, feeds = _model("MatMulInteger", [("a", a, False), ("b", b, True),
                                            ("za", za, False), ("zb", zb, True)], np.int32)
    _check(model, feeds)


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("group,stride,dilation,pad", [(1, 1, 1, 1), (1, 2, 1, 0), (2, 1, 2, 2),
                                                      (1, 1, 1, 3), (12, 1, 1, 1), (12, 2, 1, 1),
                                                      (12, 1, 2, 0)])
def test_qlinearconv_against_onnxruntime(adt, group, stride, dilation, pad):
    """Group 12 is depthwise (12 channels in and out)."""
    rng = np.random.default_rng(2)
    C, M, k = 12, 12 if group == 12 else 32, 3 if pad < 3 else 7
    x = _ints(rng, adt, (2, C, 15, 17))
    w = _ints(rng, np.int8, (M, C // group, k, k), bits=7)
    bias = rng.integers(-500, 500, M).astype(np.int32)
    f32 = np.float32
    inputs = [("x", x, False), ("xs", f32(0.02), True), ("xz", _ints(rng, adt, ()), True),
              ("w", w, True), ("ws", rng.uniform(0.001, 0.01, M).astype(f32), True),
              ("wz", np.zeros(M, np.int8), True), ("ys", f32(0.05), True),
              ("yz", _ints(rng, adt, ()), True), ("B", bias, True)]
    model, feeds = _model("QLinearConv", inputs, adt, group=group, strides=[stride] * 2,
                          dilations=[dilation] * 2, pads=[pad] * 4)
    _check(model, feeds, kernel=_CONV_KERNELS[group])


# the kernels by group: one (the pixel tiles), depthwise (12 and 9 channels), two (the GEMM)
_CONV_KERNELS = {1: "cpu.integer-tiles", 12: "cpu.integer-depthwise", 9: "cpu.integer-depthwise",
                 2: "cpu.integer"}


@pytest.mark.parametrize("group", [1, 9])
def test_convinteger_against_onnxruntime(group):
    rng = np.random.default_rng(3)
    M = 24 if group == 1 else 9
    x = _ints(rng, np.uint8, (2, 9, 20, 20))
    w = _ints(rng, np.uint8, (M, 9 // group, 3, 3), bits=7)
    model, feeds = _model("ConvInteger", [("x", x, False), ("w", w, True),
                                          ("xz", np.uint8(7), True), ("wz", np.uint8(3), True)],
                          np.int32, pads=[1, 1, 1, 1], group=group)
    _check(model, feeds, kernel=_CONV_KERNELS[group])


@pytest.mark.parametrize("adt,wdt", [(np.uint8, np.int8), (np.int8, np.int8),
                                     (np.uint8, np.uint8)])
@pytest.mark.parametrize("rows", [1, 3, 19])
def test_few_rows_against_onnxruntime(adt, wdt, rows):
    """Fewer rows than a block of the GEMM's columns: the pixel tiles' route (_few_rows), K
    not a multiple of 4, per-column zero points; QGemm's classifier head of one row."""
    rng = np.random.default_rng(rows)
    a, b = _ints(rng, adt, (rows, 259)), _ints(rng, wdt, (259, 1030), bits=7)
    za, zb = _ints(rng, adt, ()), _ints(rng, wdt, (1030,), bits=7)
    model, feeds = _model("MatMulInteger", [("a", a, False), ("b", b, True),
                                            ("za", za, False), ("zb", zb, True)], np.int32)
    _check(model, feeds)
    f32 = np.float32
    inputs = [("a", a, False), ("sa", f32(0.03), True), ("za", za, True),
              ("b", np.ascontiguousarray(b.T), True),
              ("sb", rng.uniform(0.001, 0.01, 1030).astype(f32), True),
              ("zb", np.zeros(1030, wdt), True),
              ("c", rng.integers(-900, 900, 1030).astype(np.int32), True),
              ("sy", f32(0.2), True), ("zy", _ints(rng, adt, ()), True)]
    model, feeds = _model("QGemm", inputs, adt, domain="com.microsoft", transB=1)
    _check(model, feeds)


def test_qgemm_and_integer_to_float_against_onnxruntime():
    rng = np.random.default_rng(4)
    f32 = np.float32
    a, b = _ints(rng, np.uint8, (64, 256)), _ints(rng, np.int8, (48, 256), bits=7)
    inputs = [("a", a, False), ("sa", f32(0.03), True), ("za", np.uint8(120), True),
              ("b", b, True), ("sb", rng.uniform(0.001, 0.01, 48).astype(f32), True),
              ("zb", np.zeros(48, np.int8), True),
              ("c", rng.integers(-900, 900, 48).astype(np.int32), True),
              ("sy", f32(0.2), True), ("zy", np.uint8(128), True)]
    model, feeds = _model("QGemm", inputs, np.uint8, domain="com.microsoft", transB=1)
    _check(model, feeds)
    bt = np.ascontiguousarray(b.T)
    inputs = [("a", a, False), ("b", bt, True), ("sa", f32(0.03), True),
              ("sb", rng.uniform(0.001, 0.01, 48).astype(f32), True),
              ("za", np.uint8(120), True), ("zb", np.zeros(48, np.int8), True),
              ("bias", rng.standard_normal(48).astype(f32), True)]
    model, feeds = _model("MatMulIntegerToFloat", inputs, f32, domain="com.microsoft")
    _check(model, feeds, exact=False)
    inputs = [("a", rng.standard_normal((3, 20, 256)).astype(f32), False), ("b", bt, True),
              ("sb", rng.uniform(0.001, 0.01, 48).astype(f32), True),
              ("zb", np.zeros(48, np.int8), True), ("bias", None, False)]
    model, feeds = _model("DynamicQuantizeMatMul", inputs, f32, domain="com.microsoft")
    _check(model, feeds, exact=False)


def test_shared_session_threads_same_bits():
    rng = np.random.default_rng(5)
    f32 = np.float32
    w = _ints(rng, np.int8, (64, 32, 3, 3), bits=7)
    inputs = [("x", _ints(rng, np.uint8, (1, 32, 24, 24)), False), ("xs", f32(0.02), True),
              ("xz", np.uint8(100), True), ("w", w, True), ("ws", f32(0.004), True),
              ("wz", np.int8(0), True), ("ys", f32(0.05), True), ("yz", np.uint8(90), True)]
    model, _ = _model("QLinearConv", inputs, np.uint8, pads=[1, 1, 1, 1])
    sess = ember.load(model, backend="cpu")
    xs = [{"x": _ints(rng, np.uint8, (1, 32, 24, 24))} for _ in range(8)]
    threads_give_sequential_bits(lambda feed: sess.run(feed)["y"], xs, repeats=3)


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("stride,dilation,pad,k", [(1, 1, 1, 3), (2, 1, 1, 3), (3, 2, 2, 3),
                                                   (2, 1, 2, 5), (1, 2, 0, 3)])
def test_depthwise_by_planes_against_onnxruntime(adt, stride, dilation, pad, k):
    """Wide rows: the plane-by-plane depthwise loop (its stride phases), not the
    channels-last one the short rows above take."""
    rng = np.random.default_rng(6)
    C, f32 = 8, np.float32
    w = _ints(rng, np.int8, (C, 1, k, k), bits=7)
    inputs = [("x", _ints(rng, adt, (2, C, 41, 77)), False), ("xs", f32(0.02), True),
              ("xz", _ints(rng, adt, ()), True), ("w", w, True),
              ("ws", rng.uniform(0.001, 0.01, C).astype(f32), True),
              ("wz", np.zeros(C, np.int8), True), ("ys", f32(0.05), True),
              ("yz", _ints(rng, adt, ()), True),
              ("B", rng.integers(-500, 500, C).astype(np.int32), True)]
    model, feeds = _model("QLinearConv", inputs, adt, group=C, strides=[stride] * 2,
                          dilations=[dilation] * 2, pads=[pad] * 4)
    _check(model, feeds, kernel="cpu.integer-depthwise")
