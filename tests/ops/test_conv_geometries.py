"""float32 convolutions of every geometry on the CPU's fast kernels (ops/conv.py): grouped
convolutions as block-diagonal register tiles (`_GroupedRoute`), the 1x1 convolutions of an
SE block's squeezed 1x1 image on the 1x1 tiles, strided 1x1 ones on the tiles, depthwise
5x5 / 7x7 windows with stride 2, dilated windows, and ConvTranspose of any stride as one
convolution per output phase (`_sub_pixel`). Small models against onnxruntime, the kernel each convolution
ran named so that a route silently dropped fails, and the sequential run's bits from
threads sharing a session."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.ops import fused
from ember.ops.cpu import tiles

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("numba")

needs_tiles = pytest.mark.skipif(tiles.HOST_LANES == 0, reason="the tiles need AVX2 or AVX-512")
wide_tiles = pytest.mark.skipif(tiles.HOST_LANES != 16, reason="the 1x1 tiles are AVX-512's")


@pytest.fixture(autouse=True)
def _numba_on(monkeypatch):
    monkeypatch.delenv("EMBER_NUMBA", raising=False)


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(nodes, x_shape, inits):
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(proto, x, kernels, rtol=1e-5):
    """ember's result against onnxruntime's (to rtol of the largest magnitude), after a
    second run (the routes' memos), and the kernels the convolutions ran, in node order."""
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    session = ember.load(proto)
    session.run({"x": x})
    got = session.run({"x": x})["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))
    ran = [k for _, op, k, _ in session.kernels if "Conv" in op]
    assert ran == kernels, session.kernels
    return session, got


def _conv(name, x, w, b=None, out="y", **attrs):
    inputs = [x, w] if b is None else [x, w, b]
    return helper.make_node("Conv", inputs, [out], name=name, **attrs)


@needs_tiles
@pytest.mark.parametrize("C, group, kernel, stride, dilation, relu", [
    (48, 6, 3, 2, 1, True),      # RegNet's first stage: groups of 8, stride 2
    (120, 15, 3, 1, 1, True),    # groups of 8, spans of 4 groups and a last one of 3
    (64, 4, 3, 1, 1, False),     # groups of 16
    (96, 4, 3, 2, 1, True),      # groups of 24: one group a span, the block part empty
    (128, 2, 3, 1, 2, False),    # groups of 64, dilated: each group two blocks
    (64, 8, 1, 1, 1, True),      # a grouped 1x1 convolution
    (32, 4, 5, 2, 1, False),     # a 5x5 window, stride 2
])
def test_grouped_convolutions_run_as_tiles(C, group, kernel, stride, dilation, relu):
    """Grouped convolutions of several group widths (with the bias and a ReLU folded into
    FusedConv) run as block-diagonal tiles and match onnxruntime."""
    pad = dilation * (kernel - 1) // 2
    x = _rand(1, C, 15, 15)
    inits = {"w": _rand(C, C // group, kernel, kernel, seed=1) / np.sqrt(C // group * kernel ** 2),
             "b": _rand(C, seed=2)}
    attrs = dict(group=group, strides=[stride] * 2, dilations=[dilation] * 2, pads=[pad] * 4)
    nodes = [_conv("conv", "x", "w", "b", out="c" if relu else "y", **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    _check(_model(nodes, x.shape, inits), x, ["cpu.tiles-grouped"])


@needs_tiles
def test_grouped_convolution_of_a_batch_with_asymmetric_pads():
    x = _rand(2, 32, 9, 11)
    inits = {"w": _rand(32, 8, 3, 3, seed=1) / 8}
    proto = _model([_conv("conv", "x", "w", group=4, strides=[2, 1], pads=[0, 1, 2, 0])],
                   x.shape, inits)
    _check(proto, x, ["cpu.tiles-grouped"])


def _se_block(C, squeezed, activation="Relu"):
    """x * sigmoid(conv(act(conv(mean(x))))): the squeeze-and-excitation block, its 1x1
    convolutions over a 1x1 image."""
    inits = {"w1": _rand(squeezed, C, 1, 1, seed=1) / np.sqrt(C), "b1": _rand(squeezed, seed=2),
             "w2": _rand(C, squeezed, 1, 1, seed=3) / np.sqrt(squeezed),
             "b2": _rand(C, seed=4)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["m"]),
             _conv("squeeze", "m", "w1", "b1", out="s1"),
             helper.make_node(activation, ["s1"], ["a1"]),
             _conv("excite", "a1", "w2", "b2", out="s2"),
             helper.make_node("Sigmoid", ["s2"], ["g"]),
             helper.make_node("Mul", ["x", "g"], ["y"])]
    return nodes, inits


@wide_tiles
@pytest.mark.parametrize("C, squeezed, activation", [(440, 110, "Relu"), (144, 6, "Sigmoid"),
                                                     (96, 24, "HardSigmoid")])
def test_se_block_convolutions_run_as_tiles(C, squeezed, activation):
    """An SE block's 1x1 convolutions of its 1x1 image: a single pixel is channels-last
    rows, so the 1x1 tiles with their epilogue take it."""
    x = _rand(1, C, 7, 7)
    nodes, inits = _se_block(C, squeezed, activation)
    _check(_model(nodes, x.shape, inits), x, ["cpu.tiles-pointwise"] * 2)


@wide_tiles
def test_one_by_one_convolution_of_a_one_pixel_batch():
    """A plain Conv (no activation to fuse) of a batch of 1x1 images, with its bias."""
    x = _rand(3, 64, 1, 1)
    inits = {"w": _rand(32, 64, 1, 1, seed=1) / 8, "b": _rand(32, seed=2)}
    _check(_model([_conv("conv", "x", "w", "b")], x.shape, inits), x, ["cpu.tiles-pointwise"])


@pytest.mark.parametrize("C, kernel", [(32, 5), (24, 5), (48, 7), (40, 7)])
def test_depthwise_large_windows_with_stride_two(C, kernel):
    """Depthwise 5x5 and 7x7 windows with stride 2 on the compiled depthwise kernels (the
    vector one on AVX-512, a last block of fewer than 16 channels masked)."""
    x = _rand(1, C, 17, 17)
    inits = {"w": _rand(C, 1, kernel, kernel, seed=1) / kernel, "b": _rand(C, seed=2)}
    proto = _model([_conv("conv", "x", "w", "b", out="c", group=C, strides=[2, 2],
                          pads=[kernel // 2] * 4),
                    helper.make_node("Relu", ["c"], ["y"])], x.shape, inits)
    vector = tiles.HOST_LANES == 16
    _check(proto, x, ["cpu.depthwise-vector" if vector else "cpu.depthwise"])


@needs_tiles
@pytest.mark.parametrize("dilation, stride", [(2, 1), (3, 2)])
def test_dilated_convolutions_run_as_tiles(dilation, stride):
    x = _rand(1, 32, 20, 20)
    inits = {"w": _rand(48, 32, 3, 3, seed=1) / 17, "b": _rand(48, seed=2)}
    proto = _model([_conv("conv", "x", "w", "b", dilations=[dilation] * 2,
                          strides=[stride] * 2, pads=[dilation] * 4)], x.shape, inits)
    _check(proto, x, ["cpu.tiles"])


@wide_tiles
def test_strided_one_by_one_convolution_runs_as_tiles():
    """A downsampling shortcut: 1x1, stride 2, with the block's residual and ReLU."""
    x, z = _rand(1, 48, 14, 14), _rand(1, 104, 7, 7, seed=3)
    inits = {"w": _rand(104, 48, 1, 1, seed=1) / 7, "b": _rand(104, seed=2), "z": z}
    proto = _model([_conv("conv", "x", "w", "b", out="c", strides=[2, 2]),
                    helper.make_node("Add", ["c", "z"], ["s"]),
                    helper.make_node("Relu", ["s"], ["y"])], x.shape, inits)
    _check(proto, x, ["cpu.tiles"])


@needs_tiles
@pytest.mark.parametrize("M, kernel", [(3, "numpy"), (8, "cpu.tiles")])
def test_few_output_channels_leave_the_tiles(M, kernel):
    """An image out (3 channels): most of a tile's block of channels would go unused, so
    conv_nd's GEMMs run it; from TILES_MIN_OUTPUTS channels the tiles do."""
    x = _rand(1, 32, 70, 66)
    inits = {"w": _rand(M, 32, 3, 3, seed=1) / 17, "b": _rand(M, seed=2)}
    proto = _model([_conv("conv", "x", "w", "b", out="c", pads=[1, 1, 1, 1]),
                    helper.make_node("Tanh", ["c"], ["y"])], x.shape, inits)
    _check(proto, x, [kernel])


@wide_tiles
@pytest.mark.parametrize("kernel, stride", [(3, 1), (5, 2)])
def test_depthwise_activations_in_the_vector_kernel(kernel, stride, monkeypatch):
    """MobileNetV3's and EfficientNet's depthwise convolutions with HardSwish or SiLU: the
    activation applied by the vector kernel to its rows (FusedConv), with no epilogue pass
    after it, on an image whose border pixels are most of it (9 x 11)."""
    monkeypatch.setattr(fused, "epilogue", lambda *args: pytest.fail("an epilogue pass"))
    x = _rand(1, 32, 9, 11)
    inits = {"w0": _rand(32, 32, 1, 1, seed=1) / 6, "w1": _rand(32, 1, kernel, kernel, seed=2),
             "b1": _rand(32, seed=3), "w2": _rand(32, 1, kernel, kernel, seed=4)}
    pads = [kernel // 2] * 4
    proto = _model([_conv("c0", "x", "w0", out="a", pads=[0] * 4),
                    _conv("d1", "a", "w1", "b1", out="d", group=32, pads=pads,
                          strides=[stride] * 2),
                    helper.make_node("HardSwish", ["d"], ["dh"]),
                    _conv("d2", "dh", "w2", out="e", group=32, pads=pads),
                    helper.make_node("Sigmoid", ["e"], ["es"]),
                    helper.make_node("Mul", ["e", "es"], ["y"])], x.shape, inits)
    _check(proto, x, ["numpy", "cpu.depthwise-vector", "cpu.depthwise-vector"])


@wide_tiles
def test_channel_shuffle_keeps_the_image_channels_last():
    """ShuffleNet's unit: a channel shuffle (Reshape, Transpose, Reshape) of a channels-last
    image copied in the image's memory order, then split: each half a channel slice of a
    channels-last image, which the 1x1 tiles read where it lies (`pixel_stride`)."""
    x = _rand(1, 24, 9, 10)
    inits = {"w0": _rand(24, 24, 3, 3, seed=1) / 15, "w1": _rand(16, 12, 1, 1, seed=2) / 3,
             "b1": _rand(16, seed=3), "w2": _rand(20, 12, 1, 1, seed=4) / 3}
    proto = _model([_conv("c0", "x", "w0", out="a", pads=[1] * 4),
                    helper.make_node("Reshape", ["a", "s5"], ["r"]),
                    helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
                    helper.make_node("Reshape", ["t", "s4"], ["u"]),
                    helper.make_node("Split", ["u", "half"], ["p", "q"], axis=1),
                    _conv("c1", "p", "w1", "b1", out="m"),
                    helper.make_node("Relu", ["m"], ["mr"]),
                    _conv("c2", "q", "w2", out="n"),
                    helper.make_node("Concat", ["mr", "n"], ["y"], axis=1)], x.shape, inits)
    proto.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
                                   (("s5", [1, 2, 12, 9, 10]), ("s4", [1, 24, 9, 10]),
                                    ("half", [12, 12])))
    proto.opset_import[0].version = 18
    _check(proto, x, ["cpu.tiles", "cpu.tiles-pointwise", "cpu.tiles-pointwise"])


@wide_tiles
def test_narrow_blocks_of_sixteen_channels_or_fewer():
    """A stem of 16 channels (planar RGB in, stride 2), a 3x3 of 16, a 1x1 of 40 (a last block
    of 8) and one of 24: blocks of at most 16 columns take the tiles' one-vector loop."""
    x = _rand(1, 3, 37, 41)
    inits = {"w0": _rand(16, 3, 3, 3, seed=1) / 5, "b0": _rand(16, seed=2),
             "w1": _rand(16, 16, 3, 3, seed=3) / 12, "b1": _rand(16, seed=4),
             "w2": _rand(40, 16, 1, 1, seed=5) / 4, "b2": _rand(40, seed=6),
             "w3": _rand(24, 40, 1, 1, seed=7) / 6}
    proto = _model([_conv("stem", "x", "w0", "b0", out="a", pads=[1] * 4, strides=[2, 2]),
                    helper.make_node("HardSwish", ["a"], ["ah"]),
                    _conv("c1", "ah", "w1", "b1", out="c", pads=[1] * 4),
                    helper.make_node("Relu", ["c"], ["cr"]),
                    _conv("c2", "cr", "w2", "b2", out="d"),
                    _conv("c3", "d", "w3", out="y")], x.shape, inits)
    _check(proto, x, ["cpu.tiles", "cpu.tiles", "cpu.tiles-pointwise", "cpu.tiles-pointwise"])


@pytest.mark.parametrize("kernel, stride, pads, output_padding, bias", [
    (4, 2, [1, 1, 1, 1], [0, 0], True),     # a decoder's upsampling (DCGAN, UNet)
    (3, 2, [1, 1, 1, 1], [1, 1], True),     # torch's output_padding=1 doubling
    (3, 2, [0, 0, 0, 0], [0, 0], False),    # phases of 2 and of 1 taps
    (5, 3, [2, 1, 1, 2], [1, 0], True),     # asymmetric pads, stride 3
    (3, 1, [1, 1, 1, 1], [0, 0], True),     # stride 1: a convolution by the flipped kernel
    (1, 2, [0, 0, 0, 0], [1, 1], True),     # phases no tap reaches: the bias alone
])
def test_conv_transpose_as_sub_pixel_convolutions(kernel, stride, pads, output_padding, bias):
    x = _rand(1, 24, 9, 10)
    inits = {"w": _rand(24, 16, kernel, kernel, seed=1) / 10}
    inputs = ["x", "w"]
    if bias:
        inits["b"] = _rand(16, seed=2)
        inputs.append("b")
    node = helper.make_node("ConvTranspose", inputs, ["y"], name="up", strides=[stride] * 2,
                            pads=pads, output_padding=output_padding)
    _check(_model([node], x.shape, inits), x, ["cpu.sub-pixel"])


def test_conv_transpose_output_shape_and_batch():
    x = _rand(2, 8, 6, 5)
    inits = {"w": _rand(8, 4, 4, 3, seed=1) / 5, "b": _rand(4, seed=2)}
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", strides=[2, 3],
                            output_shape=[13, 15], auto_pad="SAME_UPPER")
    _check(_model([node], x.shape, inits), x, ["cpu.sub-pixel"])


@needs_tiles
@wide_tiles
def test_threads_sharing_a_session_get_the_sequential_bits():
    """A grouped convolution, an SE block and an upsampling ConvTranspose in one model: runs
    from 4 threads sharing the session give the bits of the sequential run, which match a
    session on one thread."""
    C = 64
    x = _rand(1, C, 16, 16)
    se, inits = _se_block(C, 16)
    se[0].input[0] = se[-1].input[0] = "r"
    se[-1].output[0] = "e"
    inits.update({"wg": _rand(C, 8, 3, 3, seed=5) / 8, "bg": _rand(C, seed=6),
                  "wt": _rand(C, 32, 4, 4, seed=7) / 16})
    nodes = [_conv("grouped", "x", "wg", "bg", out="g0", group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["g0"], ["r"]), *se,
             helper.make_node("ConvTranspose", ["e", "wt"], ["y"], name="up", strides=[2, 2],
                              pads=[1, 1, 1, 1])]
    proto = _model(nodes, x.shape, inits)
    session, got = _check(proto, x, ["cpu.tiles-grouped", "cpu.tiles-pointwise",
                                     "cpu.tiles-pointwise", "cpu.sub-pixel"], rtol=1e-4)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: session.run({"x": x})["y"], range(12)))
    for result in results:
        np.testing.assert_array_equal(result, got)
    one = ember.load(proto, threads=1)
    np.testing.assert_array_equal(one.run({"x": x})["y"], got)


@pytest.mark.parametrize("C,L,M,k,stride,dilation,pads", [
    (1, 640, 258, 256, 128, 1, (0, 0)), (129, 4, 128, 3, 1, 1, (1, 1)),
    (16, 9, 24, 3, 2, 2, (2, 1)), (5, 7, 3, 4, 1, 1, (0, 3))])
def test_small_1d_convolutions_run_directly(C, L, M, k, stride, dilation, pads, monkeypatch):
    """A streaming audio step's 1-D convolutions (cpu.direct), chained: the second reads the
    first's channels-last result, then a ReLU fused into the convolution clips it, in the
    kernel (no epilogue pass after it); bias, strides, dilations and asymmetric pads; the
    bits from threads and from one thread."""
    def no_epilogue(*args, **kwargs):
        raise AssertionError("the fused ReLU ran as a pass of its own")
    monkeypatch.setattr(fused.FusedConv, "finish", no_epilogue)
    first = _conv("a", "x", "w1", "b1", out="h", kernel_shape=[k], strides=[stride],
                  dilations=[dilation], pads=list(pads))
    second = _conv("b", "h", "w2", "b2", out="z", kernel_shape=[3], pads=[1, 1])
    relu = helper.make_node("Relu", ["z"], ["y"])
    inits = {"w1": _rand(M, C, k, seed=1), "b1": _rand(M, seed=2), "w2": _rand(8, M, 3, seed=3),
             "b2": _rand(8, seed=4)}
    x = _rand(2, C, L, seed=5)
    session, got = _check(_model([first, second, relu], x.shape, inits), x,
                          ["cpu.direct", "cpu.direct"])
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: session.run({"x": x})["y"], range(8)))
    for result in results:
        np.testing.assert_array_equal(result, got)
