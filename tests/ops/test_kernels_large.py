"""CPU kernels on inputs large enough to take their blocked or fast paths, which the ONNX node
cases (a few dozen elements each) never reach; each one-node model is checked against
onnxruntime."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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


@pytest.fixture
def numpy_conv_kernels(monkeypatch):
    """The convolutions' numpy kernels (BLAS), as without numba: the register tiles
    (ops/cpu/tiles.py, tested in test_compiled_cpu.py) would take these float32 cases."""
    from ember.ops.cpu import compiled as _compiled, tiles as _tiles
    monkeypatch.setitem(_compiled._compiled, _tiles.conv_tiles_loops, None)


SHIFTED_CASES = [  # batch, channels in, height, width, channels out, kernel, pads
    (1, 16, 64, 64, 32, [3, 3], [1, 1, 1, 1]),
    (2, 32, 69, 63, 20, [3, 5], [0, 2, 1, 0]),
    (2, 24, 64, 70, 8, [5, 5], [2, 2, 2, 2]),
    (1, 128, 66, 66, 64, [3, 3], [0, 0, 0, 0]),
]


@pytest.mark.parametrize("case", SHIFTED_CASES, ids=lambda c: "x".join(map(str, c[:5])))
@pytest.mark.parametrize("chained", [False, True], ids=["one", "chained-relu"])
def test_conv_as_shifted_gemms_matches_onnxruntime(case, chained, numpy_conv_kernels):
    """Stride-1 convolutions over large images with few channels take one GEMM per tap
    (ops/conv.py: _conv_shifted); chained, the second reads the first's channels-last result
    and the simplifier fuses the ReLUs into them."""
    from ember.ops import conv
    n, c, h, w_, m, kernel, pads = case
    begin, end = pads[:2], pads[2:]
    outs = conv.out_size((h, w_), kernel, (1, 1), (1, 1), begin, end)
    assert conv._shifted_fits(rand(1, c, 1, 1), 1, kernel, (1, 1), (1, 1), begin, end, outs)
    assert not conv._tiled_fits(rand(1, c, 1, 1), rand(m, c, *kernel), 1, begin, end)
    x, w1, b1 = rand(n, c, h, w_), rand(m, c, *kernel) / c, rand(m)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["y" if not chained else "c1"],
                              pads=pads)]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1")]
    if chained:
        w2 = rand(16, m, 3, 3) / m
        nodes += [helper.make_node("Relu", ["c1"], ["r1"]),
                  helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", ["c2"], ["y"])]
        inits.append(numpy_helper.from_array(w2, "w2"))
    graph = helper.make_graph(nodes, "shifted", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(x.shape))], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sess = ember.load(proto)
    got = sess.run({"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    if chained and n == 2:   # one session shared by threads: the sequential run's bits
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: sess.run({"x": x})["y"], range(8)))
        for result in results:
            np.testing.assert_array_equal(result, got)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_upsampling_and_skip_concat_match_onnxruntime(batch, with_bias):
    """A UNet decoder step: ConvTranspose with stride = kernel (ops/conv.py:
    _tiles_channels_last) of a channels-first and of a channels-last input (a shifted
    GEMM's result), each concatenated with the other's skip (ops/shape.py:
    _concat_channels_last when most of the data is channels-last) and convolved again.
    float32 only: onnxruntime has no float64 Conv."""
    t = TensorProto.FLOAT
    x, skip = rand(batch, 32, 64, 64), rand(batch, 16, 16, 16)
    inits = {"w": rand(16, 32, 3, 3) / 32, "up": rand(16, 8, 2, 2), "up2": rand(24, 6, 3, 2),
             "w2": rand(8, 6, 3, 3) / 6, "b": rand(8)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),  # channels-last
             helper.make_node("ConvTranspose", ["c", "up"] + (["b"] if with_bias else []),
                              ["u"], strides=[2, 2]),            # (batch, 8, 128, 128)
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("ConvTranspose", ["skip", "up"], ["u2"], strides=[2, 2]),
             helper.make_node("Concat", ["p", "u2"], ["cat"], axis=1),   # 16 + 8, 32x32
             helper.make_node("ConvTranspose", ["cat", "up2"], ["u3"], strides=[3, 2]),
             helper.make_node("Conv", ["u3", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "decoder", [helper.make_tensor_value_info("x", t, list(x.shape)),
                           helper.make_tensor_value_info("skip", t, list(skip.shape))],
        [helper.make_tensor_value_info("y", t, None), helper.make_tensor_value_info("u", t, None)],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": x, "skip": skip}
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ember.load(proto).run(feeds)
    for name, expected in zip(("y", "u"), want):
        assert got[name].shape == expected.shape and got[name].dtype == expected.dtype
        np.testing.assert_allclose(got[name], expected, rtol=1e-4,
                                   atol=1e-4 * float(np.abs(expected).max()))


def test_convnext_blocks_through_channels_last_transposes_match_onnxruntime():
    """Two ConvNeXt blocks: depthwise 7x7 -> Transpose to NHWC -> LayerNorm -> MatMul -> Gelu
    -> MatMul -> Transpose back to NCHW -> + residual. The Transpose back hands on a
    channels-last view (ops/shape.py), which the residual Add and the next depthwise
    convolution take as it is; the second block's output is the session's, C-ordered. A
    session shared by threads gives the sequential run's bits."""
    t, c = TensorProto.FLOAT, 32
    x = rand(2, c, 28, 28)
    inits, nodes, source = {}, [], "x"
    for k in range(2):
        inits.update({f"dw{k}": rand(c, 1, 7, 7) / 7, f"db{k}": rand(c), f"g{k}": rand(c),
                      f"be{k}": rand(c), f"w1{k}": rand(c, 4 * c) / c,
                      f"w2{k}": rand(4 * c, c) / (4 * c)})
        nodes += [helper.make_node("Conv", [source, f"dw{k}", f"db{k}"], [f"d{k}"], group=c,
                                   pads=[3] * 4),
                  helper.make_node("Transpose", [f"d{k}"], [f"t{k}"], perm=[0, 2, 3, 1]),
                  helper.make_node("LayerNormalization", [f"t{k}", f"g{k}", f"be{k}"],
                                   [f"n{k}"], axis=-1),
                  helper.make_node("MatMul", [f"n{k}", f"w1{k}"], [f"h{k}"]),
                  helper.make_node("Gelu", [f"h{k}"], [f"a{k}"]),
                  helper.make_node("MatMul", [f"a{k}", f"w2{k}"], [f"m{k}"]),
                  helper.make_node("Transpose", [f"m{k}"], [f"b{k}"], perm=[0, 3, 1, 2]),
                  helper.make_node("Add", [f"b{k}", source], ["y" if k else f"r{k}"])]
        source = f"r{k}"
    graph = helper.make_graph(nodes, "convnext", [helper.make_tensor_value_info(
        "x", t, list(x.shape))], [helper.make_tensor_value_info("y", t, None)],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sess = ember.load(proto)
    got = sess.run({"x": x})["y"]
    assert got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(lambda _: sess.run({"x": x})["y"], range(8)):
            np.testing.assert_array_equal(result, got)


def test_transpose_back_to_nchw_is_a_view_on_the_cpu():
    """NHWC -> NCHW returns the channels-last view (no copy); other layouts are copied."""
    from ember.ops.shape import Transpose
    x = rand(2, 5, 6, 7)
    op = Transpose.__new__(Transpose)   # no node needed: run reads only xp and perm
    op.xp, op.perm = np, [0, 3, 1, 2]
    y = op.run(x)
    assert np.shares_memory(y, x) and np.array_equal(y, x.transpose(0, 3, 1, 2))
    op.perm = [0, 2, 1, 3]
    y = op.run(x)
    assert not np.shares_memory(y, x) and y.flags.c_contiguous


PATCH_ROWS_CASES = [  # batch, channels in, size, channels out, kernel, strides, dilations, pads
    (1, 64, 28, 64, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),      # ResNet-50's, 28x28
    (2, 32, 30, 48, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),      # strided
    (1, 160, 15, 24, [3, 5], [1, 2], [2, 1], [2, 0, 1, 3]),     # dilated, uneven pads
    (2, 16, 20, 8, [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),
]


@pytest.mark.parametrize("case", PATCH_ROWS_CASES, ids=lambda c: "x".join(map(str, c[:4])))
@pytest.mark.parametrize("layout", ["channels-first", "channels-last"])
def test_conv_over_patch_rows_matches_onnxruntime(case, layout, numpy_conv_kernels):
    """2-D convolutions with 16 or more channels that the shifted GEMMs don't take run over
    channels-last patch rows (ops/conv.py: _conv_patch_rows), from a channels-first input
    or the channels-last result of a depthwise convolution, with a bias."""
    from ember.ops import conv
    n, c, size, m, kernel, strides, dilations, pads = case
    begin, end = pads[:2], pads[2:]
    outs = conv.out_size((size, size), kernel, strides, dilations, begin, end)
    assert conv._patch_rows_fit(rand(1, c, 1, 1), 1, begin, end)
    assert not conv._tiled_fits(rand(1, c, 1, 1), rand(m, c, *kernel), 1, begin, end)
    assert not conv._shifted_fits(rand(1, c, 1, 1), 1, kernel, strides, dilations, begin, end,
                                  outs)
    x, w, b = rand(n, c, size, size), rand(m, c, *kernel) / c, rand(m)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=strides,
                              dilations=dilations, pads=pads)]
    if layout == "channels-last":
        inits.append(numpy_helper.from_array(rand(c, 1, 3, 3), "dw"))
        nodes.insert(0, helper.make_node("Conv", ["x0", "dw"], ["x"], group=c, pads=[1] * 4))
    first = nodes[0].input[0]
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info(
        first, TensorProto.FLOAT, list(x.shape))], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {first: x})[0]
    got = ember.load(proto, simplify=False).run({first: x})["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
