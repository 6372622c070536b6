"""The compiled CPU kernels of InstanceNormalization, GroupNormalization, BatchNormalization
(inference), RMSNormalization and Resize (ops/normalization.py `_group_norm_rows`,
`_channel_affine_rows`, `_rmsnorm_rows`; ops/image.py `_resize_rows`,
`_resize_nearest_rows`, and their channels-last forms): one-node models against
onnxruntime, the plan's kernel named so that a route silently dropped fails, Resize with the
numpy gathers' bits, channels-last images (a convolution's result) handled in their layout,
and the same bits however the rows are split, on the board, or from threads sharing a
session."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from board import pieces_on_the_board_give_one_threads_bits
from ember.ops import image, normalization
from ember.ops.cpu import engine, tuning

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("numba")


@pytest.fixture(autouse=True)
def _numba_on(monkeypatch):
    monkeypatch.delenv("EMBER_NUMBA", raising=False)


def _model(op, x_shape, inits=(), opset=21, inputs=("x",), outputs=("y",), extra_inputs=(),
           **attrs):
    """A model of the single node `op`(inputs..., inits...) -> y; `extra_inputs` are further
    graph inputs as (name, TensorProto type, shape)."""
    names = list(inputs) + [n for n, _ in inits if n not in inputs]
    node = helper.make_node(op, names, list(outputs), **attrs)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    graph_inputs += [helper.make_tensor_value_info(n, t, s) for n, t, s in extra_inputs]
    graph = helper.make_graph([node], op, graph_inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _onnxruntime(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _run_compiled(proto, feeds):
    """ember's output, after checking the node ran the compiled kernel."""
    session = ember.load(proto, "cpu")
    got = session.run(feeds)["y"]
    assert [k for _, _, k, _ in session.kernels] == ["cpu.compiled"], session.kernels
    return got


def _close(got, want, rtol):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


def _rand(rng, *shape, loc=0.0, scale=1.0):
    return (rng.standard_normal(shape) * scale + loc).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# norms


@pytest.mark.parametrize("shape", [(2, 16, 12, 10), (3, 8, 100), (1, 4, 3, 5, 6), (1, 7, 3)])
def test_instance_norm_matches_onnxruntime(shape):
    rng = np.random.default_rng(sum(shape))
    c = shape[1]
    proto = _model("InstanceNormalization", shape, [("s", _rand(rng, c)), ("b", _rand(rng, c))],
                   opset=17, epsilon=1e-5)
    feeds = {"x": _rand(rng, *shape, loc=3.0, scale=2.0)}  # a mean well off zero
    _close(_run_compiled(proto, feeds), _onnxruntime(proto, feeds), 1e-5)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("shape, groups", [((2, 64, 9, 11), 32), ((1, 32, 16, 16), 4),
                                           ((2, 12, 50), 3), ((1, 8, 7, 5), 1),
                                           ((1, 8, 7, 5), 8)])
def test_group_norm_matches_onnxruntime(shape, groups, opset):
    """Opset 18 takes a scale and a bias per group, 21 per channel."""
    rng = np.random.default_rng(sum(shape) + groups + opset)
    params = groups if opset == 18 else shape[1]
    proto = _model("GroupNormalization", shape, [("s", _rand(rng, params)),
                                                 ("b", _rand(rng, params))],
                   opset=opset, num_groups=groups, epsilon=1e-5)
    feeds = {"x": _rand(rng, *shape, loc=-2.0, scale=3.0)}
    _close(_run_compiled(proto, feeds), _onnxruntime(proto, feeds), 1e-5)


@pytest.mark.parametrize("opset", [9, 15])
def test_batch_norm_matches_onnxruntime_with_numpys_bits(opset):
    rng = np.random.default_rng(opset)
    shape, c = (2, 24, 13, 17), 24
    s, b, m, v = _rand(rng, c), _rand(rng, c), _rand(rng, c), np.abs(_rand(rng, c)) + 0.5
    proto = _model("BatchNormalization", shape, [("s", s), ("b", b), ("m", m), ("v", v)],
                   opset=opset, epsilon=1e-5)
    x = _rand(rng, *shape)
    got = _run_compiled(proto, {"x": x})
    _close(got, _onnxruntime(proto, {"x": x}), 1e-5)
    # the numpy kernel's two passes: the product rounded, then the sum
    k = (s / np.sqrt(v + np.float32(1e-5))).reshape(1, c, 1, 1)
    shift = b.reshape(1, c, 1, 1) - m.reshape(1, c, 1, 1) * k
    numpy_kernel = x * k
    numpy_kernel += shift
    np.testing.assert_array_equal(got, numpy_kernel)
    # a channels-last image (a convolution's result): the same bits, in its layout
    last = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    in_layout = normalization._channel_affine_compiled(last, k, shift)
    assert in_layout.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_array_equal(in_layout, numpy_kernel)


@pytest.mark.parametrize("shape, axis", [((2, 7, 384), -1), ((3, 4, 5, 6), 2), ((5, 1000), 1)])
def test_rms_norm_matches_onnxruntime(shape, axis):
    rng = np.random.default_rng(len(shape) + shape[-1])
    proto = _model("RMSNormalization", shape, [("s", _rand(rng, *shape[axis:]))], opset=23,
                   axis=axis, epsilon=1e-5)
    feeds = {"x": _rand(rng, *shape, loc=1.0, scale=2.0)}
    _close(_run_compiled(proto, feeds), _onnxruntime(proto, feeds), 1e-5)


def test_group_norm_rows_give_the_same_bits_however_split(monkeypatch):
    rng = np.random.default_rng(5)
    x = _rand(rng, 3, 32, 9, 7, loc=1.0)
    scale, bias = _rand(rng, 8, 4), _rand(rng, 8, 4)
    whole = normalization._group_norm_compiled(x, 8, scale, bias, 1e-5)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    split = normalization._group_norm_compiled(x, 8, scale, bias, 1e-5)
    np.testing.assert_array_equal(whole, split)
    groups = x.reshape(3, 8, -1).astype(np.float64)
    want = (groups - groups.mean(2, keepdims=True)) / np.sqrt(groups.var(2, keepdims=True)
                                                              + 1e-5)
    want = want.reshape(x.shape) * scale.reshape(1, 32, 1, 1) + bias.reshape(1, 32, 1, 1)
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)


def test_group_norm_of_a_channels_last_image_gives_the_same_bits_however_split(monkeypatch):
    """A channels-last view (a 3x3 convolution's result) is normalised in its layout, to the
    planar kernel's result within float32 rounding, and written channels-last."""
    rng = np.random.default_rng(8)
    x = _rand(rng, 2, 11, 13, 32, loc=4.0, scale=0.5).transpose(0, 3, 1, 2)  # > 1 pixel block
    scale, bias = _rand(rng, 8, 4), _rand(rng, 8, 4)
    whole = normalization._group_norm_compiled(x, 8, scale, bias, 1e-5)
    assert whole.transpose(0, 2, 3, 1).flags.c_contiguous
    planar = normalization._group_norm_compiled(np.ascontiguousarray(x), 8, scale, bias, 1e-5)
    np.testing.assert_allclose(whole, planar, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    np.testing.assert_array_equal(whole, normalization._group_norm_compiled(x, 8, scale, bias,
                                                                            1e-5))


@pytest.mark.parametrize("op, groups", [("GroupNormalization", 8), ("InstanceNormalization", 0)])
def test_norm_after_a_convolution_matches_onnxruntime(op, groups):
    """Conv 3x3 -> the norm: the convolution hands on a channels-last image."""
    rng = np.random.default_rng(groups)
    c = 32
    inits = [("w", _rand(rng, c, 16, 3, 3) / 12), ("s", _rand(rng, c)), ("b", _rand(rng, c))]
    attrs = {"num_groups": groups} if groups else {}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(op, ["c", "s", "b"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "conv_norm", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 16, 24, 20])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(v, n) for n, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = {"x": _rand(rng, 2, 16, 24, 20, loc=1.0)}
    session = ember.load(proto, "cpu")
    got = session.run(feeds)["y"]
    assert session.kernels[1][2] == "cpu.compiled"
    _close(got, _onnxruntime(proto, feeds), 1e-4)


# ----------------------------------------------------------------------------------------------
# Resize


def _resize_model(x_shape, mode, scales=None, sizes=None, opset=19, **attrs):
    inits = [("roi", np.zeros(0, np.float32))]
    inits.append(("scales", np.asarray(scales if scales is not None else [], np.float32)))
    if sizes is not None:
        inits.append(("sizes", np.asarray(sizes, np.int64)))
    return _model("Resize", x_shape, inits, opset=opset, mode=mode, **attrs)


def _numpy_resize(x, out_shape, scales, monkeypatch, **options):
    """resize_nd's numpy gathers: the compiled route switched off."""
    with monkeypatch.context() as m:
        m.setattr(image, "_resize_compiled", lambda *a, **k: None)
        return image.resize_nd(np, x, out_shape, scales, **options)


CTS = ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]
# scales whose output lengths are whole (align_corners with a fractional target length
# follows the ONNX reference, which onnxruntime does not): up, down, one axis of each
LINEAR_SCALES = [[1, 1, 2, 2], [1, 1, 0.5, 0.5], [1, 1, 1.5, 0.75], [1, 1, 1, 3]]


@pytest.mark.parametrize("scales", LINEAR_SCALES, ids=lambda s: "x".join(map(str, s[2:])))
@pytest.mark.parametrize("ct", CTS)
def test_resize_linear_matches_onnxruntime_with_numpys_bits(ct, scales, monkeypatch):
    rng = np.random.default_rng(len(ct) + int(4 * scales[2] + scales[3]))
    x = _rand(rng, 2, 3, 8, 12)
    proto = _resize_model(x.shape, "linear", scales, coordinate_transformation_mode=ct)
    got = _run_compiled(proto, {"x": x})
    _close(got, _onnxruntime(proto, {"x": x}), 2e-6)
    numpy_kernel = _numpy_resize(x, got.shape, scales, monkeypatch, mode="linear", ct=ct,
                                 nearest_mode="round_prefer_floor")
    np.testing.assert_array_equal(got, numpy_kernel)


@pytest.mark.parametrize("ct", CTS)
def test_resize_linear_to_sizes_matches_onnxruntime(ct):
    rng = np.random.default_rng(len(ct))
    x = _rand(rng, 1, 5, 9, 7)
    proto = _resize_model(x.shape, "linear", sizes=[1, 5, 20, 4],
                          coordinate_transformation_mode=ct)
    _close(_run_compiled(proto, {"x": x}), _onnxruntime(proto, {"x": x}), 2e-6)


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor",
                                          "ceil"])
@pytest.mark.parametrize("ct", ["asymmetric", "half_pixel", "align_corners"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 3], [1, 1, 0.5, 0.25], [1, 1, 1.5, 1]],
                         ids=["up", "down", "mixed"])
def test_resize_nearest_matches_onnxruntime_exactly(nearest_mode, ct, scales):
    rng = np.random.default_rng(7)
    x = _rand(rng, 2, 3, 8, 12)
    proto = _resize_model(x.shape, "nearest", scales, nearest_mode=nearest_mode,
                          coordinate_transformation_mode=ct)
    got = _run_compiled(proto, {"x": x})
    want = _onnxruntime(proto, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode, scales, attrs", [
    ("cubic", [1, 1, 2, 2], {}),
    ("cubic", [1, 1, 0.5, 0.75], {"exclude_outside": 1}),
    ("linear", [1, 1, 0.5, 0.25], {"antialias": 1}),
    ("cubic", [1, 1, 0.5, 0.5], {"antialias": 1})], ids=["cubic", "cubic-exclude",
                                                          "linear-antialias", "cubic-antialias"])
def test_resize_with_more_taps_has_numpys_bits(mode, scales, attrs, monkeypatch):
    rng = np.random.default_rng(3)
    x = _rand(rng, 1, 4, 16, 16)
    proto = _resize_model(x.shape, mode, scales, **attrs)
    got = _run_compiled(proto, {"x": x})
    _close(got, _onnxruntime(proto, {"x": x}), 1e-5)
    numpy_kernel = _numpy_resize(x, got.shape, scales, monkeypatch, mode=mode, ct="half_pixel",
                                 nearest_mode="round_prefer_floor",
                                 exclude_outside=bool(attrs.get("exclude_outside")),
                                 antialias=bool(attrs.get("antialias")))
    np.testing.assert_array_equal(got, numpy_kernel)


def test_resize_with_scales_fed_at_run_time_chooses_in_the_run():
    """Scales the plan cannot see: "by geometry" until a run, then the compiled kernel where
    only H and W are resized, numpy where C is."""
    x = _rand(np.random.default_rng(2), 1, 4, 6, 6)
    proto = _model("Resize", x.shape, [("roi", np.zeros(0, np.float32))],
                   inputs=("x", "roi", "scales"),
                   extra_inputs=[("scales", TensorProto.FLOAT, [4])], opset=19, mode="linear")
    session = ember.load(proto, "cpu")
    assert session.kernels[0][2] == "by geometry"
    scales = np.array([1, 1, 2, 2], np.float32)
    got = session.run({"x": x, "scales": scales})["y"]
    assert session.kernels[0][2] == "cpu.compiled"
    _close(got, _onnxruntime(proto, {"x": x, "scales": scales}), 2e-6)
    other = ember.load(proto, "cpu")
    other.run({"x": x, "scales": np.array([1, 2, 2, 2], np.float32)})
    assert other.kernels[0][2] == "numpy"


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_runs_compiled(mode):
    x = _rand(np.random.default_rng(4), 1, 3, 5, 6)
    proto = _model("Upsample", x.shape, [("scales", np.array([1, 1, 2, 3], np.float32))],
                   opset=9, mode=mode)
    _close(_run_compiled(proto, {"x": x}), _onnxruntime(proto, {"x": x}), 2e-6)


def test_resize_rows_give_the_same_bits_however_split(monkeypatch):
    x = _rand(np.random.default_rng(6), 2, 5, 17, 23)
    options = dict(mode="linear", ct="half_pixel", nearest_mode="round_prefer_floor",
                   cubic_a=-0.75, exclude_outside=False, antialias=False)
    out_shape, scales = [2, 5, 34, 46], [1.0, 1.0, 2.0, 2.0]
    whole = image._resize_compiled(x, out_shape, scales, **options)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    np.testing.assert_array_equal(whole, image._resize_compiled(x, out_shape, scales,
                                                                **options))


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
def test_resize_of_a_channels_last_image_has_the_planar_bits(mode, monkeypatch):
    """A channels-last view (a convolution's result) is resized in its layout, written
    channels-last, with the planar kernel's bits, however split."""
    x = _rand(np.random.default_rng(10), 2, 9, 11, 24).transpose(0, 3, 1, 2)
    options = dict(mode=mode, ct="half_pixel", nearest_mode="round_prefer_floor",
                   cubic_a=-0.75, exclude_outside=False, antialias=False)
    out_shape, scales = [2, 24, 18, 16], [1.0, 1.0, 2.0, 16 / 11]
    got = image._resize_compiled(x, out_shape, scales, **options)
    assert got.transpose(0, 2, 3, 1).flags.c_contiguous
    planar = image._resize_compiled(np.ascontiguousarray(x), out_shape, scales, **options)
    np.testing.assert_array_equal(got, planar)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    np.testing.assert_array_equal(got, image._resize_compiled(x, out_shape, scales, **options))


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resize_after_a_convolution_matches_onnxruntime(mode):
    """Conv 3x3 -> Resize x2 -> Conv 3x3, a UNet decoder's upsampling."""
    rng = np.random.default_rng(11)
    inits = [("w1", _rand(rng, 32, 16, 3, 3) / 12), ("w2", _rand(rng, 8, 32, 3, 3) / 17),
             ("roi", np.zeros(0, np.float32)), ("s2", np.array([1, 1, 2, 2], np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "roi", "s2"], ["r"], mode=mode),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "conv_resize", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 16, 20, 24])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(v, n) for n, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    feeds = {"x": _rand(rng, 1, 16, 20, 24)}
    session = ember.load(proto, "cpu")
    got = session.run(feeds)["y"]
    assert session.kernels[1][2] == "cpu.compiled"
    _close(got, _onnxruntime(proto, feeds), 1e-4)


# ----------------------------------------------------------------------------------------------
# pieces on the board (ops/cpu/compiled.py: the helpers run them without Python)


def _board_cases():
    rng = np.random.default_rng(12)
    planar = _rand(rng, 2, 32, 24, 20, loc=1.0)
    last = _rand(rng, 2, 24, 20, 32, loc=1.0).transpose(0, 3, 1, 2)
    scale, bias = _rand(rng, 8, 4), _rand(rng, 8, 4)
    k, shift = _rand(rng, 1, 32, 1, 1), _rand(rng, 1, 32, 1, 1)
    rows, rms_scale = _rand(rng, 64, 300), _rand(rng, 300)
    options = dict(ct="half_pixel", nearest_mode="round_prefer_floor", cubic_a=-0.75,
                   exclude_outside=False, antialias=False)

    def resize(x, mode):
        return lambda: image._resize_compiled(x, [2, 32, 48, 40], [1, 1, 2, 2], mode=mode,
                                              **options)

    return {"group-norm": lambda: normalization._group_norm_compiled(planar, 8, scale, bias,
                                                                     1e-5),
            "group-norm-channels-last": lambda: normalization._group_norm_compiled(
                last, 8, scale, bias, 1e-5),
            "batch-norm": lambda: normalization._channel_affine_compiled(planar, k, shift),
            "batch-norm-channels-last": lambda: normalization._channel_affine_compiled(
                last, k, shift),
            "rms-norm": lambda: normalization._rmsnorm_compiled(rows, 1, rms_scale, 1e-5),
            "resize-linear": resize(planar, "linear"),
            "resize-nearest": resize(planar, "nearest"),
            "resize-linear-channels-last": resize(last, "linear"),
            "resize-nearest-channels-last": resize(last, "nearest")}


@pytest.mark.parametrize("case", list(_board_cases()))
def test_split_kernels_run_their_pieces_on_the_board(case, monkeypatch):
    """Each kernel's piece function rebuilds its arguments right: one thread's bits, with some
    pieces taken by a helper."""
    pieces_on_the_board_give_one_threads_bits(_board_cases()[case], monkeypatch)


# ----------------------------------------------------------------------------------------------
# threads sharing a session


def test_threads_sharing_a_session_give_the_sequential_bits():
    """GroupNorm -> Resize (bilinear x2) -> InstanceNorm -> Resize (nearest x2), large enough
    to be split among the run's threads, from 4 threads at once."""
    rng = np.random.default_rng(9)
    c = 32
    inits = [("gs", _rand(rng, c)), ("gb", _rand(rng, c)), ("is", _rand(rng, c)),
             ("ib", _rand(rng, c)), ("roi", np.zeros(0, np.float32)),
             ("s2", np.array([1, 1, 2, 2], np.float32))]
    nodes = [helper.make_node("GroupNormalization", ["x", "gs", "gb"], ["g"], num_groups=8),
             helper.make_node("Resize", ["g", "roi", "s2"], ["r"], mode="linear"),
             helper.make_node("InstanceNormalization", ["r", "is", "ib"], ["i"]),
             helper.make_node("Resize", ["i", "roi", "s2"], ["y"], mode="nearest")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, c, 64, 64])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(v, n) for n, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    x = _rand(rng, 1, c, 64, 64)
    session = ember.load(proto, "cpu")
    want = session.run({"x": x})["y"]
    assert [k for _, _, k, _ in session.kernels] == ["cpu.compiled"] * 4
    _close(want, _onnxruntime(proto, {"x": x}), 1e-5)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: session.run({"x": x})["y"], range(8)))
    for result in results:
        np.testing.assert_array_equal(result, want)
