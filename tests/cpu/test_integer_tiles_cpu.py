"""The CPU engine's channels-last 8-bit convolutions (ops/cpu/integer_tiles.py): the VNNI
pixel tiles and the depthwise vectors.

The kernels themselves against torch's float64 convolution of the shifted values (exact for
these sizes) over shapes that leave partial tiles, blocks and words (pixels not a multiple of
8, channels not of 32 or 16 or 4), both input layouts, every signedness, per-channel zero
points and the three epilogues; then models of chained 8-bit ops (the layout handed from one
to the next) against onnxruntime, bit for bit, with the plan's kernels checked, and a session
shared by threads. Weights are 7-bit in the models, where onnxruntime's u8s8 kernel would
saturate on a CPU without VNNI (tests/ops/test_contrib_quantized.py's docstring)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ember
from board import pieces_on_the_board_give_one_threads_bits
from shared_session import threads_give_sequential_bits
from ember.ops.cpu import integer, integer_tiles

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not integer_tiles.enabled(), reason="numba is not installed")


def _ints(rng, dtype, shape, bits=8):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if np.dtype(dtype) == np.int8 \
        else (0, (1 << bits) - 1)
    return rng.integers(lo, hi + 1, shape).astype(dtype)


def _layout(x, channels_last):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) \
        if channels_last else x


def _expected(x, zx, w, zw, stride, pad, dilation, groups=1):
    return torch.nn.functional.conv2d(
        torch.tensor(x.astype(np.float64) - zx),
        torch.tensor(w.astype(np.float64) - zw[:, None, None, None]), stride=stride,
        padding=pad, dilation=dilation, groups=groups).numpy()


def _run(weights, x, zx, k, s, d, p, out_dtype, **epilogue):
    N, _, H, W = x.shape
    OH = (H + 2 * p - d * (k - 1) - 1) // s + 1
    OW = (W + 2 * p - d * (k - 1) - 1) // s + 1
    M = weights.M if isinstance(weights, integer_tiles.ConvWeights) else x.shape[1]
    out = np.empty((N, OH, OW, M), out_dtype)
    plan = integer_tiles.Plan(weights, x, ((k, k), (s, s), (d, d), (p, p), (p, p)), (OH, OW))
    plan.run(x, zx, out, **epilogue)
    return out.transpose(0, 3, 1, 2)


def _epilogues(rng, exact, M):
    """(out dtype, epilogue, expected) for each mode, from the exact int sums."""
    bias = rng.integers(-2000, 2000, M)
    mult = rng.uniform(1e-4, 1e-2, M).astype(np.float32)
    fbias = rng.standard_normal(M).astype(np.float32)
    shape = (1, M, 1, 1)
    requantised = np.clip(np.rint((exact + bias.reshape(shape)).astype(np.float32)
                                  * mult.reshape(shape)) + 7, 0, 255).astype(np.uint8)
    floats = exact.astype(np.float32) * mult.reshape(shape) + fbias.reshape(shape)
    return [(np.int32, {}, exact),
            (np.uint8, dict(mode=integer.REQUANTIZE, bias=bias, mult=mult, y_zero=7.0, lo=0.0,
                            hi=255.0), requantised),
            (np.float32, dict(mode=integer.FLOAT32, mult=mult, fbias=fbias), floats)]


@pytest.mark.parametrize("adt,wdt", [(np.uint8, np.int8), (np.int8, np.int8),
                                     (np.uint8, np.uint8)])
@pytest.mark.parametrize("N,C,H,M,k,s,d,p,cl", [
    (1, 3, 23, 14, 7, 2, 1, 3, False), (2, 16, 9, 13, 3, 1, 2, 2, True),
    (1, 5, 10, 40, 1, 2, 1, 0, False), (1, 8, 12, 12, 3, 2, 1, 0, True),
    (1, 32, 14, 70, 1, 1, 1, 0, True), (1, 64, 7, 33, 3, 1, 1, 1, True)])
def test_pixel_tiles_exact(adt, wdt, N, C, H, M, k, s, d, p, cl):
    rng = np.random.default_rng(C * 100 + M + k)
    x = _layout(_ints(rng, adt, (N, C, H, H + 3)), cl)
    w = _ints(rng, wdt, (M, C, k, k))
    zx = int(_ints(rng, adt, ()))
    zw = rng.integers(-4, 5, M) + (128 if wdt == np.uint8 else 0)
    weights = integer_tiles.ConvWeights(w, zw)
    exact = _expected(x, zx, w, zw, s, p, d)
    for dtype, epilogue, expected in _epilogues(rng, exact, M):
        got = _run(weights, x, zx, k, s, d, p, dtype, **epilogue)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("N,C,H,k,s,d,cl", [
    (2, 32, 17, 3, 1, 1, True), (1, 13, 9, 3, 2, 1, False), (1, 21, 10, 7, 2, 1, True),
    (1, 48, 12, 5, 1, 2, True), (2, 3, 8, 3, 1, 1, False)])
def test_depthwise_exact(adt, N, C, H, k, s, d, cl):
    rng = np.random.default_rng(C * 10 + k)
    x = _layout(_ints(rng, adt, (N, C, H, H + 5)), cl)
    w = _ints(rng, np.int8, (C, 1, k, k))
    zx = int(_ints(rng, adt, ()))
    zw = rng.integers(-3, 4, C)
    p = k // 2 * d
    weights = integer_tiles.DepthwiseWeights(w, zw)
    exact = _expected(x, zx, w, zw, s, p, d, groups=C)
    for dtype, epilogue, expected in _epilogues(rng, exact, C):
        got = _run(weights, x, zx, k, s, d, p, dtype, **epilogue)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("depthwise", [False, True])
def test_a_plan_keeps_its_padded_copy_and_rewrites_its_padding_for_a_new_zero_point(depthwise):
    """A plan's later calls copy x into the padded image an earlier call kept, writing only
    x's values; where the zero point (the padding) changes, the whole image anew: each call
    exact, whatever the call before it left."""
    rng = np.random.default_rng(11)
    C, k, p = 32, 3, 1
    w = _ints(rng, np.int8, (C, 1, k, k) if depthwise else (24, C, k, k))
    zw = np.zeros(C if depthwise else 24, np.int64)
    weights = integer_tiles.DepthwiseWeights(w, zw) if depthwise \
        else integer_tiles.ConvWeights(w, zw)
    M = C if depthwise else 24
    xs = [_layout(_ints(rng, np.uint8, (1, C, 9, 11)), True) for _ in range(3)]
    plan = integer_tiles.Plan(weights, xs[0], ((k, k), (1, 1), (1, 1), (p, p), (p, p)), (9, 11))
    for x, zx in zip(xs, (7, 7, 200)):
        out = np.empty((1, 9, 11, M), np.int32)
        plan.run(x, zx, out)
        want = _expected(x, zx, w, zw, 1, p, 1, groups=C if depthwise else 1)
        np.testing.assert_array_equal(out.transpose(0, 3, 1, 2), want)
        assert len(plan.images) == 1   # kept for the next call


# ------------------------------------------------------------------ models against onnxruntime

def _qlinear_block_model(rng, adt):
    """x (float) -> QuantizeLinear -> 3x3 QLinearConv (pad) -> MaxPool -> depthwise 3x3 stride 2 ->
    1x1 QLinearConv -> QLinearAdd (a residual from a second 1x1) -> QLinearGlobalAveragePool
    -> DequantizeLinear: each 8-bit op reads the layout the one before left."""
    f32 = np.float32
    tp = TP.UINT8 if adt == np.uint8 else TP.INT8
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def qparams(prefix):
        return [const(prefix + "_s", f32(rng.uniform(0.02, 0.05))),
                const(prefix + "_z", np.asarray(_ints(rng, adt, ()), adt))]

    def conv(name, x, xq, C, M, k, group=1, stride=1):
        w = _ints(rng, np.int8, (M, C // group, k, k), bits=7)
        yq = qparams(name + "_y")
        nodes.append(helper.make_node(
            "QLinearConv", [x, *xq, const(name + "_w", w),
                            const(name + "_ws", rng.uniform(0.002, 0.01, M).astype(f32)),
                            const(name + "_wz", np.zeros(M, np.int8)), *yq,
                            const(name + "_b", rng.integers(-300, 300, M).astype(np.int32))],
            [name], group=group, strides=[stride] * 2, pads=[k // 2] * 4))
        return name, yq

    xq = qparams("x")
    nodes.append(helper.make_node("QuantizeLinear", ["x", *xq], ["xq"]))
    a, aq = conv("a", "xq", xq, 3, 24, 3)
    nodes.append(helper.make_node("MaxPool", [a], ["pooled"], kernel_shape=[3, 3],
                                  pads=[1, 1, 1, 1]))
    b, bq = conv("b", "pooled", aq, 24, 24, 3, group=24, stride=2)
    c, cq = conv("c", b, bq, 24, 40, 1)
    d, dq = conv("d", b, bq, 24, 40, 1)
    eq = qparams("e")
    nodes.append(helper.make_node("QLinearAdd", [c, *cq, d, *dq, *eq], ["e"],
                                  domain="com.microsoft"))
    gq = qparams("g")
    nodes.append(helper.make_node("QLinearGlobalAveragePool", ["e", *eq, *gq], ["g"],
                                  domain="com.microsoft", channels_last=0))
    nodes.append(helper.make_node("DequantizeLinear", ["g", *gq], ["y"]))
    nodes.append(helper.make_node("DequantizeLinear", ["e", *eq], ["e_float"]))
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 30, 26])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None),
         helper.make_tensor_value_info("e_float", TP.FLOAT, None),
         helper.make_tensor_value_info("c", tp, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)
    return model, {"x": rng.standard_normal((2, 3, 30, 26)).astype(f32)}


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
def test_chained_8bit_ops_against_onnxruntime(adt):
    rng = np.random.default_rng(5)
    model, feeds = _qlinear_block_model(rng, adt)
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = ember.load(model, backend="cpu")
    got = sess.run(feeds)
    for name, want in zip(("y", "e_float", "c"), expected):
        np.testing.assert_array_equal(got[name], want)
    kernels = {k for _, op, k, _ in sess.kernels if op == "QLinearConv"}
    assert kernels == {"cpu.integer-tiles", "cpu.integer-depthwise"}


def test_shared_session_threads_same_bits():
    rng = np.random.default_rng(8)
    model, _ = _qlinear_block_model(rng, np.uint8)
    sess = ember.load(model, backend="cpu")
    feeds = [{"x": rng.standard_normal((2, 3, 30, 26)).astype(np.float32)} for _ in range(6)]
    threads_give_sequential_bits(lambda feed: sess.run(feed)["e_float"], feeds)


@pytest.mark.parametrize("depthwise", [False, True])
def test_pieces_on_the_board_same_bits(depthwise, monkeypatch):
    """The kernels' pieces taken by the pool's helpers without Python (their piece
    functions), padding included: one thread's bits."""
    rng = np.random.default_rng(11)
    C, M = 40, 72
    x = _layout(_ints(rng, np.int8, (2, C, 30, 30)), True)
    w = _ints(rng, np.int8, (C, 1, 3, 3) if depthwise else (M, C, 3, 3))
    zw = rng.integers(-3, 4, C if depthwise else M)
    weights = integer_tiles.DepthwiseWeights(w, zw) if depthwise \
        else integer_tiles.ConvWeights(w, zw)
    epilogue = _epilogues(rng, np.zeros((1, 1, 1, 1)), C if depthwise else M)[1][1]

    def compute():
        return _run(weights, x, 5, 3, 1, 1, 1, np.uint8, **epilogue)

    pieces_on_the_board_give_one_threads_bits(compute, monkeypatch)


def _requantized_products_model(rng, adt, trans_b, c_shape, alpha):
    """QGemm (transB, C of `c_shape`, `alpha`, per-column b_scale) and QLinearMatMul (a 3-D
    A, per-column B scale and zero point) with 8-bit outputs: the products whose
    requantisation the pixel tiles' epilogue does."""
    f32 = np.float32
    tp = TP.UINT8 if adt == np.uint8 else TP.INT8
    M, K, N = 3, 256, 400   # at least INT_MIN_MACS: the integer product
    inits = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    b = _ints(rng, np.int8, (N, K) if trans_b else (K, N), bits=7)
    qgemm = [const("as", f32(0.03)), const("az", np.asarray(_ints(rng, adt, ()), adt)),
             const("b", b), const("bs", rng.uniform(0.002, 0.01, N).astype(f32)),
             const("bz", np.zeros(N, np.int8)),
             const("c", rng.integers(-3000, 3000, c_shape).astype(np.int32)) if c_shape else "",
             const("ys", f32(0.04)), const("yz", np.asarray(_ints(rng, adt, ()), adt))]
    b2 = _ints(rng, np.int8, (K, N), bits=7)
    matmul = ["a3", "as", "az", const("b2", b2),
              const("b2s", rng.uniform(0.002, 0.01, N).astype(f32)),
              const("b2z", rng.integers(-2, 3, N).astype(np.int8)), "ys", "yz"]
    nodes = [helper.make_node("QGemm", ["a", *qgemm], ["y"], domain="com.microsoft",
                              transB=int(trans_b), alpha=alpha),
             helper.make_node("QLinearMatMul", matmul, ["y3"])]
    graph = helper.make_graph(
        nodes, "products", [helper.make_tensor_value_info("a", tp, [M, K]),
                            helper.make_tensor_value_info("a3", tp, [2, M, K])],
        [helper.make_tensor_value_info("y", tp, None),
         helper.make_tensor_value_info("y3", tp, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)
    return model, {"a": _ints(rng, adt, (M, K)), "a3": _ints(rng, adt, (2, M, K))}


@pytest.mark.parametrize("adt", [np.uint8, np.int8])
@pytest.mark.parametrize("trans_b, c_shape, alpha", [(1, (400,), 1.0), (0, (1, 400), 0.7),
                                                    (1, None, 1.0), (0, (1,), 1.0)])
def test_requantized_products_against_onnxruntime(adt, trans_b, c_shape, alpha):
    rng = np.random.default_rng(13)
    model, feeds = _requantized_products_model(rng, adt, trans_b, c_shape, alpha)
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = ember.load(model, backend="cpu")
    for _ in range(2):   # the remembered route the second time
        got = sess.run(feeds)
        for name, want in zip(("y", "y3"), expected):
            np.testing.assert_array_equal(got[name], want)
    assert {k for _, _, k, _ in sess.kernels} == {"cpu.integer"}
