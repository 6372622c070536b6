"""More com.microsoft contrib ops (ops/microsoft/misc.py), against onnxruntime 1.32.

Oracles, op by op:
- onnxruntime's CPU kernel on the same one-node model: FusedGemm, TransposeMatMul, GatherND,
  Range, Trilu, Pad, ExpandDims, Unique, GridSample, Inverse, QLinearConv, QLinearWhere,
  MatMulInteger16, NhwcMaxPool, ScaledSiLU, CDist, MaxpoolWithMask, WordConvEmbedding,
  MurmurHash3, NGramRepeatBlock, CropAndResize, BifurcationDetector;
- onnxruntime on the equivalent ONNX-standard graph, for the ops its CPU provider does not run
  (their kernels are CUDA / ROCm / DML only, or absent): FusedMatMulActivation, QLinearReduceMean,
  MulInteger, ReduceSumInteger, NhwcConv, GroupNorm, SkipGroupNorm, BiasDropout,
  BitmaskDropout, BitmaskBiasDropout, SwiGLU, ComplexMul, ComplexMulConj, IsAllFinite,
  TorchEmbedding;
- numpy float64, where no ONNX graph says the same thing simply: Rfft / Irfft (cuFFT's
  layout: a trailing (real, imaginary) axis over the last signal_ndim axes),
  RelativePositionBias (a per-element loop over onnxruntime's CUDA bucket formula) and
  GatedRelativePositionBias (the schema's torch formula).

Every op runs on the "cpu" backend over several shapes, attributes and dtypes, and once on
"opencl" (contrib ops run there through a planned CPU fallback) when OpenCL is available.
Then: the array code runs over cupy (the numpy stand-in, or a real GPU), and onnxruntime's own
tools produce some of these ops from real models (its graph optimizer: FusedGemm, the NHWC
QLinearConv and NhwcMaxPool; its transformers fusions: NhwcConv, GroupNorm, SkipGroupNorm),
which ember runs like onnxruntime.

Tolerances: float32 within 1e-4 of max|expected| (scaled atol); float16 within 2e-3 of
max|expected| (two float16 ulps: onnxruntime's float16 kernels round intermediates, ember
rounds once); integers and quantized values exactly (every quantized kernel here matched
onnxruntime exactly on the tests' data).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import ember
from backends import cuda_backend, real_cuda_device, unavailable_reason
from ember.errors import EmberError
from ember.ops.microsoft import misc as cm
from ember.ops.registry import lookup

ort = pytest.importorskip("onnxruntime")

MS = "com.microsoft"
RNG = np.random.default_rng(20261202)
OPENCL = pytest.mark.skipif(unavailable_reason("opencl") is not None,
                            reason=str(unavailable_reason("opencl")))


def rand(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def ints(lo, hi, shape, dtype):
    return RNG.integers(lo, hi, shape).astype(dtype)


def _value_info(name, value):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                         value.shape)


def node_model(op, inputs, outputs, attrs=None, domain=MS, inits=(), opset=17):
    """A one-node model: `inputs` is a list of (name, array) or None (omitted); names listed in
    `inits` become initialisers, the others graph inputs (the returned feeds)."""
    names, graph_inputs, initializers, feeds = [], [], [], {}
    for item in inputs:
        if item is None:
            names.append("")
            continue
        name, value = item
        names.append(name)
        if name in inits:
            initializers.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            graph_inputs.append(_value_info(name, np.asarray(value)))
            feeds[name] = value
    node = helper.make_node(op, names, outputs, domain=domain)
    for key, value in (attrs or {}).items():  # (an empty list needs its type spelt out)
        node.attribute.append(helper.make_attribute(
            key, value, attr_type=onnx.AttributeProto.INTS if value == [] else None))
    graph = helper.make_graph([node], op, graph_inputs,
                              [onnx.ValueInfoProto(name=o) for o in outputs if o],
                              initializer=initializers)
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    return model, feeds


def graph_model(nodes, feeds, outputs, inits=None, opset=21):
    """An ONNX-standard oracle graph over the same feeds (dict name -> array), with constant
    initialisers `inits` (dict name -> array)."""
    graph = helper.make_graph(
        nodes, "oracle", [_value_info(n, np.asarray(v)) for n, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), n)
                     for n, v in (inits or {}).items()])
    return helper.make_model(graph, ir_version=10,
                             opset_imports=[helper.make_opsetid("", opset)])


def ort_run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def ember_run(model, feeds, backend="cpu"):
    return ember.load(model, backend=backend).run(feeds)


def tolerance(dtype) -> float:
    return 2e-3 if np.dtype(dtype) == np.float16 else 1e-4


def assert_close(actual, expected, rtol=1e-4, name=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype.kind in "iubOUS":
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    finite = np.isfinite(expected.astype(np.float64))
    np.testing.assert_array_equal(np.isfinite(actual.astype(np.float64)), finite, err_msg=name)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=name)
    e = expected.astype(np.float64)[finite]
    scale = float(np.max(np.abs(e))) if e.size else 1.0
    np.testing.assert_allclose(actual.astype(np.float64)[finite], e, rtol=rtol,
                               atol=rtol * scale, err_msg=name)


def check(model, feeds, backend="cpu", rtol=1e-4, expected=None):
    """ember on `backend` against onnxruntime on the same model (or `expected`, name ->
    array), output by output."""
    if expected is None:
        expected = ort_run(model, feeds)
    got = ember_run(model, feeds, backend)
    assert set(expected) <= set(got)
    for name, value in expected.items():
        assert_close(got[name], value, rtol, name)
    return got


def check_against_graph(model, feeds, nodes, outputs, inits=None, backend="cpu", rtol=1e-4,
                        opset=21):
    """ember's one-node `model` against onnxruntime on the ONNX-standard graph `nodes`."""
    oracle = graph_model(nodes, feeds, outputs, inits, opset)
    return check(model, feeds, backend, rtol, expected=ort_run(oracle, feeds))


def registered(op):
    cls = lookup(MS, op, 1)
    assert cls is not None and cls.domain == MS, op
    return cls


# ============================================================================ products

ACTIVATIONS = [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("Softsign", {}), ("Softplus", {}),
               ("LeakyRelu", {"alpha": 0.1}), ("Elu", {"alpha": 0.7}),
               ("ThresholdedRelu", {"alpha": 0.3}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
               ("Selu", {"alpha": 1.5, "gamma": 1.1}),
               ("ParametricSoftplus", {"alpha": 1.5, "beta": 0.7}),
               ("ScaledTanh", {"alpha": 1.5, "beta": 0.7})]


def _act_attrs(name, params):
    return {"activation": name, **{"activation_" + k: v for k, v in params.items()}}


@pytest.mark.parametrize("act,params", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_fused_gemm_activations(act, params):
    inputs = [("a", rand(5, 4, scale=3)), ("b", rand(4, 6)), ("c", rand(6))]
    model, feeds = node_model("FusedGemm", inputs, ["y"], _act_attrs(act, params))
    check(model, feeds)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (1,), (6,), (5, 1), (5, 6)], ids=str)
def test_fused_gemm_attributes(trans_a, trans_b, c_shape):
    a = rand(4, 5) if trans_a else rand(5, 4)
    b = rand(6, 4) if trans_b else rand(4, 6)
    inputs = [("a", a), ("b", b)] + ([("c", rand(*c_shape))] if c_shape else [])
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": 0.5, "beta": 2.0,
             **_act_attrs("LeakyRelu", {"alpha": 0.2})}
    model, feeds = node_model("FusedGemm", inputs, ["y"], attrs, inits=("b",))
    check(model, feeds)


def test_fused_gemm_float16_and_no_activation():
    """onnxruntime's FusedGemm is float32-only: float16 is checked against it on the same
    values widened, rounded once; without an activation (which onnxruntime refuses to load)
    ember runs plain Gemm."""
    a, b, c = rand(3, 8, dtype=np.float16), rand(8, 5, dtype=np.float16), rand(5)
    model16, feeds16 = node_model("FusedGemm", [("a", a), ("b", b), ("c", c.astype(np.float16))],
                                  ["y"], _act_attrs("Tanh", {}))
    model32, feeds32 = node_model("FusedGemm", [("a", a.astype(np.float32)),
                                                ("b", b.astype(np.float32)), ("c", c)],
                                  ["y"], _act_attrs("Tanh", {}))
    expected = ort_run(model32, feeds32)["y"].astype(np.float16)
    check(model16, feeds16, rtol=2e-3, expected={"y": expected})
    plain, feeds = node_model("FusedGemm", [("a", rand(3, 4)), ("b", rand(4, 2))], ["y"],
                              {"alpha": 2.0})
    ref = graph_model([helper.make_node("Gemm", ["a", "b"], ["y"], alpha=2.0)], feeds, ["y"])
    check(plain, feeds, expected=ort_run(ref, feeds))


@pytest.mark.parametrize("shapes,attrs", [
    (((2, 3, 4), (4, 5)), {}),
    (((2, 4, 3), (5, 4)), {"transA": 1, "transB": 1, "alpha": 2.0}),
    (((3, 2, 4, 6), (2, 6, 5)), {"alpha": -0.5}),
    (((7, 3), (5, 7)), {"transA": 1, "transB": 1}),
], ids=str)
def test_transpose_matmul(shapes, attrs):
    model, feeds = node_model("TransposeMatMul", [("a", rand(*shapes[0])),
                                                  ("b", rand(*shapes[1]))], ["y"], attrs)
    check(model, feeds)


def _activation_nodes(name, params, x, y):
    """`name`(x) -> y as ONNX-standard nodes (onnxruntime's two extra activations as their
    formulas)."""
    if name == "ScaledTanh":
        return [helper.make_node("Mul", [x, "act_b"], ["act_t"]),
                helper.make_node("Tanh", ["act_t"], ["act_u"]),
                helper.make_node("Mul", ["act_u", "act_a"], [y])], \
            {"act_a": np.float32(params["alpha"]), "act_b": np.float32(params["beta"])}
    if name == "ParametricSoftplus":
        return [helper.make_node("Mul", [x, "act_b"], ["act_t"]),
                helper.make_node("Softplus", ["act_t"], ["act_u"]),
                helper.make_node("Mul", ["act_u", "act_a"], [y])], \
            {"act_a": np.float32(params["alpha"]), "act_b": np.float32(params["beta"])}
    return [helper.make_node(name, [x], [y], **params)], {}


@pytest.mark.parametrize("act,params", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_fused_matmul_activation(act, params):
    """No CPU kernel in onnxruntime: the oracle is com.microsoft FusedMatMul followed by the
    activation."""
    a, b = rand(2, 4, 3, scale=2), rand(2, 5, 4)
    attrs = {"transA": 1, "transB": 1, "alpha": 0.75}
    model, feeds = node_model("FusedMatMulActivation", [("a", a), ("b", b)], ["y"],
                              {**attrs, **_act_attrs(act, params)})
    act_nodes, act_inits = _activation_nodes(act, params, "p", "y")
    nodes = [helper.make_node("FusedMatMul", ["a", "b"], ["p"], domain=MS, **attrs)] + act_nodes
    oracle = graph_model(nodes, feeds, ["y"], act_inits, opset=17)
    oracle.opset_import.append(helper.make_opsetid(MS, 1))
    check(model, feeds, expected=ort_run(oracle, feeds))


def test_fused_matmul_activation_float16_batch_transpose():
    a, b = rand(3, 2, 4, dtype=np.float16), rand(2, 4, 5, dtype=np.float16)
    attrs = {"transBatchA": 1}
    model, feeds = node_model("FusedMatMulActivation", [("a", a), ("b", b)], ["y"],
                              {**attrs, "activation": "Sigmoid"})
    nodes = [helper.make_node("FusedMatMul", ["a", "b"], ["p"], domain=MS, **attrs),
             helper.make_node("Sigmoid", ["p"], ["y"])]
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    oracle = graph_model(nodes, f32, ["y"], opset=17)
    oracle.opset_import.append(helper.make_opsetid(MS, 1))
    expected = ort_run(oracle, f32)["y"].astype(np.float16)
    check(model, feeds, rtol=2e-3, expected={"y": expected})


# ============================================================================ aliases


@pytest.mark.parametrize("data_shape,indices", [
    ((3, 4), [[-1, 0], [1, -2]]),
    ((2, 3, 4), [[[1]], [[0]]]),
    ((2, 3, 4), [[0, 1, 2], [1, 2, -1]]),
    ((5,), [[4], [0], [-5]]),
], ids=str)
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_gather_nd(data_shape, indices, index_dtype):
    data = np.arange(math.prod(data_shape), dtype=np.float32).reshape(data_shape)
    model, feeds = node_model("GatherND", [("d", data),
                                           ("i", np.array(indices, index_dtype))], ["y"])
    check(model, feeds)
    model, feeds = node_model("GatherND", [("d", data.astype(np.int64)),
                                           ("i", np.array(indices, index_dtype))], ["y"])
    check(model, feeds)


@pytest.mark.parametrize("start,limit,delta", [
    (1, 7, None), (10, 2, -3), (0, 0, 1), (-4, 9, 4),
    (1.0, 2.0, 0.3), (5.5, -1.0, -1.25), (0.0, 1.0, None)], ids=str)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.float32, np.float64])
def test_range(start, limit, delta, dtype):
    if np.dtype(dtype).kind == "i" and isinstance(start, float):
        pytest.skip("float bounds for an integer range")
    inputs = [("s", np.array(start, dtype)), ("l", np.array(limit, dtype))]
    if delta is not None:
        inputs.append(("d", np.array(delta, dtype)))
    model, feeds = node_model("Range", inputs, ["y"])
    check(model, feeds)


@pytest.mark.parametrize("shape", [(3, 4), (2, 5, 3), (1, 4, 4)], ids=str)
@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -2])
def test_trilu(shape, upper, k):
    inputs = [("x", rand(*shape))] + ([("k", np.array(k, np.int64))] if k is not None else [])
    model, feeds = node_model("Trilu", inputs, ["y"], {"upper": upper})
    check(model, feeds)


def test_trilu_default_upper_int64():
    model, feeds = node_model("Trilu", [("x", ints(-9, 9, (2, 4, 3), np.int64))], ["y"])
    check(model, feeds)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("pads,two_d", [([1, 0, 0, 2], False), ([1, 2, 1, 1], True),
                                        ([0, 1, 2, 0], False)], ids=str)
@pytest.mark.parametrize("value", [None, 7.5])
def test_pad(mode, pads, two_d, value):
    x = rand(3, 4)
    p = np.array([pads] if two_d else pads, np.int64)
    inputs = [("x", x), ("p", p)] + ([("v", np.array([value], np.float32))] if value else [])
    attrs = {} if mode == "constant" else {"mode": mode}
    model, feeds = node_model("Pad", inputs, ["y"], attrs, inits=("p", "v"))
    check(model, feeds)


def test_pad_negative_and_3d():
    model, feeds = node_model("Pad", [("x", rand(2, 3, 4)),
                                      ("p", np.array([0, 1, -1, 1, 0, 2], np.int64))], ["y"])
    check(model, feeds)


@pytest.mark.parametrize("shape,axis", [((2, 3), -1), ((2, 3), 0), ((2, 3), 2), ((2, 3), -3),
                                        ((4,), 1), ((), 0)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_expand_dims(shape, axis, dtype):
    x = (rand(*shape) > 0) if dtype == np.bool_ else rand(*shape, scale=5).astype(dtype)
    model, feeds = node_model("ExpandDims", [("x", np.asarray(x)),
                                             ("a", np.array(axis, np.int32))], ["y"])
    check(model, feeds)
    model, feeds = node_model("ExpandDims", [("x", np.asarray(x)),
                                             ("a", np.array([axis], np.int32))], ["y"],
                              inits=("a",))
    check(model, feeds)


@pytest.mark.parametrize("values", [[2, 1, 1, 3, 4, 3], [5.5], [0, 0, 0], [-1, 2, -1, 7, 2, 0, 9]],
                         ids=str)
def test_unique(values):
    model, feeds = node_model("Unique", [("x", np.array(values, np.float32))],
                              ["y", "idx", "counts"])
    check(model, feeds)


def test_unique_random_and_rank_check():
    model, feeds = node_model("Unique", [("x", ints(0, 12, (50,), np.float32))],
                              ["y", "idx", "counts"])
    check(model, feeds)
    model, feeds = node_model("Unique", [("x", rand(2, 3))], ["y", "idx", "counts"])
    with pytest.raises(EmberError, match="1-D"):
        ember_run(model, feeds)


GRID_CASES = [(mode, pad, align) for mode in ("bilinear", "nearest", "bicubic")
              for pad in ("zeros", "border", "reflection") for align in (0, 1)]


@pytest.mark.parametrize("mode,pad,align", GRID_CASES, ids=["-".join(map(str, c))
                                                            for c in GRID_CASES])
def test_grid_sample(mode, pad, align):
    x, grid = rand(2, 3, 5, 6), RNG.uniform(-1.3, 1.3, (2, 4, 3, 2)).astype(np.float32)
    model, feeds = node_model("GridSample", [("x", x), ("g", grid)], ["y"],
                              {"mode": mode, "padding_mode": pad, "align_corners": align})
    check(model, feeds)


def test_grid_sample_defaults_and_rank():
    model, feeds = node_model("GridSample", [("x", rand(1, 2, 4, 4)),
                                             ("g", RNG.uniform(-1, 1, (1, 2, 5, 2))
                                              .astype(np.float32))], ["y"])
    check(model, feeds)
    model, feeds = node_model("GridSample", [("x", rand(1, 2, 3, 4, 4)),
                                             ("g", rand(1, 2, 2, 2, 3))], ["y"])
    with pytest.raises(EmberError):
        ember_run(model, feeds)


def test_aliases_subclass_ember_kernels():
    from ember.ops.image import GridSample
    from ember.ops.indexing import GatherND11, Unique
    from ember.ops.shape import Pad11, Unsqueeze13
    from ember.ops.tensor import Range, Trilu

    for op, base in [("GatherND", GatherND11), ("Range", Range), ("Trilu", Trilu),
                     ("Pad", Pad11), ("ExpandDims", Unsqueeze13), ("Unique", Unique),
                     ("GridSample", GridSample)]:
        assert issubclass(registered(op), base), op


# ============================================================================ linear algebra


@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 3), (2, 2, 5, 5), (1, 1)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_inverse(shape, dtype):
    """float16 against onnxruntime's float32 inverse rounded once (its float16 kernel rounds
    the intermediates)."""
    n = shape[-1]
    x = (RNG.standard_normal(shape) + 3 * np.eye(n)).astype(dtype)
    model, feeds = node_model("Inverse", [("x", x)], ["y"])
    expected = None
    if dtype == np.float16:
        wide, wide_feeds = node_model("Inverse", [("x", x.astype(np.float32))], ["y"])
        expected = {"y": ort_run(wide, wide_feeds)["y"].astype(np.float16)}
    check(model, feeds, rtol=tolerance(dtype), expected=expected)


def _fft_reference(x, signal_ndim, onesided):
    axes = tuple(range(x.ndim - signal_ndim, x.ndim))
    w = x.astype(np.float64)
    y = np.fft.rfftn(w, axes=axes) if onesided else np.fft.fftn(w, axes=axes)
    return np.stack([y.real, y.imag], -1).astype(x.dtype)


@pytest.mark.parametrize("shape,signal_ndim", [((8,), 1), ((3, 10), 1), ((2, 4, 6), 2),
                                               ((2, 4, 6, 8), 3), ((5, 7), 1)], ids=str)
@pytest.mark.parametrize("onesided", [1, 0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_rfft(shape, signal_ndim, onesided, dtype):
    """Rfft is CUDA-only in onnxruntime (cuFFT): numpy's float64 FFT is the oracle."""
    x = rand(*shape, dtype=dtype)
    model, feeds = node_model("Rfft", [("x", x)], ["y"],
                              {"signal_ndim": signal_ndim, "onesided": onesided})
    expected = _fft_reference(x, signal_ndim, onesided)
    check(model, feeds, rtol=tolerance(dtype), expected={"y": expected})


@pytest.mark.parametrize("shape,signal_ndim", [((5, 2), 1), ((3, 6, 2), 1), ((2, 4, 5, 2), 2),
                                               ((2, 3, 4, 3, 2), 3)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_irfft(shape, signal_ndim, dtype):
    """cuFFT's one-sided inverse: m complex values on the last signal axis give 2 m - 1
    samples, normalised by the signal size (numpy's irfftn with that length)."""
    x = rand(*shape, dtype=dtype)
    model, feeds = node_model("Irfft", [("x", x)], ["y"], {"signal_ndim": signal_ndim})
    z = x[..., 0].astype(np.float64) + 1j * x[..., 1]
    axes = tuple(range(z.ndim - signal_ndim, z.ndim))
    sizes = [z.shape[a] for a in axes[:-1]] + [2 * z.shape[-1] - 1]
    expected = np.fft.irfftn(z, s=sizes, axes=axes).astype(dtype)
    check(model, feeds, expected={"y": expected})


def test_rfft_irfft_round_trip_odd():
    x = rand(3, 9)
    spec = ember_run(*node_model("Rfft", [("x", x)], ["y"]))["y"]
    back = ember_run(*node_model("Irfft", [("x", spec)], ["y"], {"signal_ndim": 1}))["y"]
    assert_close(back, x)


@pytest.mark.parametrize("a_shape,b_shape", [((3, 40), (40, 5)), ((2, 3, 40), (40, 5)),
                                             ((3, 4), (2, 4, 5)), ((2, 1, 3, 6), (4, 6, 2))],
                         ids=str)
def test_matmul_integer16(a_shape, b_shape):
    """Full-range int16: the int32 accumulation wraps, as onnxruntime's does."""
    model, feeds = node_model("MatMulInteger16", [("a", ints(-32768, 32768, a_shape, np.int16)),
                                                  ("b", ints(-32768, 32768, b_shape, np.int16))],
                              ["y"])
    check(model, feeds)


def test_matmul_integer16_unsigned():
    """uint16 x uint16 (no onnxruntime CPU kernel): exact products wrapped to uint32."""
    a, b = ints(0, 65536, (3, 6), np.uint16), ints(0, 65536, (6, 2), np.uint16)
    model, feeds = node_model("MatMulInteger16", [("a", a), ("b", b)], ["y"])
    expected = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.uint32)
    check(model, feeds, expected={"y": expected})


# ============================================================================ quantized


def _qparams(dtype):
    return (np.array(7, dtype), np.array(100, dtype)) if dtype == np.uint8 else \
        (np.array(-3, dtype), np.array(5, dtype))


def _qdata(dtype, shape):
    lo, hi = (0, 256) if dtype == np.uint8 else (-128, 128)
    return ints(lo, hi, shape, dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [(np.uint8, np.int8), (np.uint8, np.uint8),
                                             (np.int8, np.int8)])
@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("geometry", [
    {"pads": [1, 0, 1, 2], "strides": [2, 1]},
    {"pads": [1, 1, 1, 1], "dilations": [2, 1]},
    {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
], ids=["pads", "dilations", "same_upper"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(x_dtype, w_dtype, channels_last, geometry, per_channel):
    """Weights within 7 bits: onnxruntime's u8s8 kernels saturate int16 sums on CPUs without
    VNNI for full-range weights, so the oracle stays exact."""
    x = _qdata(x_dtype, (2, 3, 7, 6))
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w = ints(-64, 64, (4, 3, 3, 3), w_dtype) if w_dtype == np.int8 else \
        ints(64, 192, (4, 3, 3, 3), w_dtype)
    w_zp = np.array(0 if w_dtype == np.int8 else 128, w_dtype)
    x_zp, y_zp = _qparams(x_dtype)
    w_scale = np.array([0.01, 0.02, 0.03, 0.015] if per_channel else 0.02, np.float32)
    inputs = [("x", x), ("xs", np.array(0.05, np.float32)), ("xz", x_zp), ("w", w),
              ("ws", w_scale), ("wz", w_zp), ("ys", np.array(0.2, np.float32)), ("yz", y_zp),
              ("B", ints(-500, 500, (4,), np.int32))]
    model, feeds = node_model("QLinearConv", inputs, ["y"],
                              {"channels_last": channels_last, **geometry},
                              inits=("xs", "xz", "w", "ws", "wz", "ys", "yz", "B"))
    check(model, feeds)


def test_qlinear_conv_group_no_bias():
    x = _qdata(np.uint8, (1, 5, 6, 4, 4))  # 3-D, channels last: (N, D, H, W, C=4)
    w = ints(-64, 64, (6, 2, 2, 3, 3), np.int8)
    inputs = [("x", x), ("xs", np.array(0.03, np.float32)), ("xz", np.array(128, np.uint8)),
              ("w", w), ("ws", np.array(0.05, np.float32)), ("wz", np.array(0, np.int8)),
              ("ys", np.array(0.3, np.float32)), ("yz", np.array(120, np.uint8))]
    model, feeds = node_model("QLinearConv", inputs, ["y"], {"channels_last": 1, "group": 2},
                              inits=("xs", "xz", "w", "ws", "wz", "ys", "yz"))
    check(model, feeds)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shapes", [((3, 1, 5), (3, 4, 5), (4, 1)), ((6,), (6,), (6,)),
                                    ((2, 3), (1,), (2, 3))], ids=str)
@pytest.mark.parametrize("constant", [True, False])
def test_qlinear_where(dtype, shapes, constant):
    cs, xs, ys = shapes
    x_zp, y_zp = _qparams(dtype)
    inputs = [("c", RNG.random(cs) > 0.5), ("x", _qdata(dtype, xs)),
              ("xs", np.array(0.03, np.float32)), ("xz", x_zp), ("y", _qdata(dtype, ys)),
              ("ys", np.array(0.07, np.float32)), ("yz", y_zp),
              ("zs", np.array(0.05, np.float32)), ("zz", np.array(10, dtype))]
    params = ("xs", "xz", "ys", "yz", "zs", "zz")
    model, feeds = node_model("QLinearWhere", inputs, ["z"], inits=params if constant else ())
    check(model, feeds)


def test_qlinear_where_same_parameters_copy():
    inputs = [("c", RNG.random((4, 4)) > 0.5), ("x", _qdata(np.int8, (4, 4))),
              ("xs", np.array(0.05, np.float32)), ("xz", np.array(10, np.int8)),
              ("y", _qdata(np.int8, (4, 4))), ("ys", np.array(0.05, np.float32)),
              ("yz", np.array(10, np.int8)), ("zs", np.array(0.05, np.float32)),
              ("zz", np.array(10, np.int8))]
    model, feeds = node_model("QLinearWhere", inputs, ["z"])
    got = check(model, feeds)
    np.testing.assert_array_equal(got["z"], np.where(feeds["c"], feeds["x"], feeds["y"]))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), ([-1], 1), ([], 0)], ids=str)
@pytest.mark.parametrize("with_zero_points", [True, False])
def test_qlinear_reduce_mean(dtype, axes, keepdims, with_zero_points):
    """No onnxruntime kernel (its schema only): the oracle is DequantizeLinear ->
    ReduceMean -> QuantizeLinear, the documented formula."""
    data = _qdata(dtype, (3, 4, 5))
    dz, rz = _qparams(dtype)
    inputs = [("d", data), ("ds", np.array(0.04, np.float32)),
              ("dz", dz) if with_zero_points else None, ("rs", np.array(0.01, np.float32)),
              ("rz", rz) if with_zero_points else None]
    model, feeds = node_model("QLinearReduceMean", inputs, ["y"],
                              {"axes": axes, "keepdims": keepdims},
                              inits=("ds", "dz", "rs", "rz"))
    zero = np.array(0, dtype)
    consts = {"ds": np.float32(0.04), "rs": np.float32(0.01),
              "dz": dz if with_zero_points else zero, "rz": rz if with_zero_points else zero}
    oracle_feeds = {"d": data}
    reduce_inputs = ["f"] + (["axes"] if axes else [])
    if axes:
        consts["axes"] = np.array(axes, np.int64)
    nodes = [helper.make_node("DequantizeLinear", ["d", "ds", "dz"], ["f"]),
             helper.make_node("ReduceMean", reduce_inputs, ["m"], keepdims=keepdims),
             helper.make_node("QuantizeLinear", ["m", "rs", "rz"], ["y"])]
    expected = ort_run(graph_model(nodes, oracle_feeds, ["y"], consts), oracle_feeds)
    check(model, {"d": data}, expected=expected)


def _int32_sub(name, zp_name, out):
    return [helper.make_node("Cast", [name], [name + "_i"], to=onnx.TensorProto.INT32),
            helper.make_node("Cast", [zp_name], [zp_name + "_i"], to=onnx.TensorProto.INT32),
            helper.make_node("Sub", [name + "_i", zp_name + "_i"], [out])]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 1, 5), (4, 1)), ((6,), ())], ids=str)
@pytest.mark.parametrize("zero_points", [(True, True), (False, True), (False, False)],
                         ids=["both", "b_only", "none"])
def test_mul_integer(dtype, shapes, zero_points):
    """No onnxruntime kernel: the oracle is Cast to int32, Sub, Mul."""
    a, b = _qdata(dtype, shapes[0]), _qdata(dtype, shapes[1])
    za, zb = _qparams(dtype)
    inputs = [("a", a), ("za", za) if zero_points[0] else None, ("b", b),
              ("zb", zb) if zero_points[1] else None]
    model, feeds = node_model("MulInteger", inputs, ["y"])
    zero = np.array(0, dtype)
    consts = {"za_c": za if zero_points[0] else zero, "zb_c": zb if zero_points[1] else zero}
    nodes = _int32_sub("a", "za_c", "sa") + _int32_sub("b", "zb_c", "sb") + \
        [helper.make_node("Mul", ["sa", "sb"], ["y"])]
    expected = ort_run(graph_model(nodes, feeds, ["y"], consts), feeds)
    check(model, feeds, expected=expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), ([-1, 0], 1), ([], 1)],
                         ids=str)
def test_reduce_sum_integer(dtype, axes, keepdims):
    data = _qdata(dtype, (4, 6, 5))
    model, feeds = node_model("ReduceSumInteger", [("d", data)], ["y"],
                              {"axes": axes, "keepdims": keepdims})
    consts = {"axes": np.array(axes, np.int64)} if axes else {}
    nodes = [helper.make_node("Cast", ["d"], ["c"], to=onnx.TensorProto.INT32),
             helper.make_node("ReduceSum", ["c"] + (["axes"] if axes else []), ["y"],
                              keepdims=keepdims)]
    check(model, feeds, expected=ort_run(graph_model(nodes, feeds, ["y"], consts), feeds))


def test_integer_ops_reject_missing_attributes():
    for op in ("ReduceSumInteger", "QLinearReduceMean"):
        inputs = [("d", _qdata(np.uint8, (2, 3)))]
        if op == "QLinearReduceMean":
            inputs += [("s", np.array(0.1, np.float32)), None, ("r", np.array(0.1, np.float32))]
        model, feeds = node_model(op, inputs, ["y"], {"keepdims": 1})
        with pytest.raises(EmberError, match="axes"):
            ember_run(model, feeds)


# ============================================================================ NHWC


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shape,attrs", [
    ((2, 7, 8, 3), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((2, 7, 8, 3), {"kernel_shape": [3, 3], "dilations": [2, 1], "ceil_mode": 1,
                    "strides": [2, 2]}),
    ((1, 7, 8, 4), {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "strides": [2, 3]}),
    ((2, 9, 3), {"kernel_shape": [3]}),
    ((1, 4, 5, 6, 2), {"kernel_shape": [2, 2, 2], "strides": [1, 2, 2]}),
], ids=["pads", "dilations_ceil", "same_upper", "1d", "3d"])
def test_nhwc_max_pool(dtype, shape, attrs):
    model, feeds = node_model("NhwcMaxPool", [("x", _qdata(dtype, shape))], ["y"], attrs)
    check(model, feeds)


def _nhwc_conv_oracle(feeds, attrs, rank):
    perm_in = [0, rank - 1] + list(range(1, rank - 1))
    perm_out = [0] + list(range(2, rank)) + [1]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=perm_in),
             helper.make_node("Transpose", ["w"], ["wt"], perm=perm_in),
             helper.make_node("Conv", ["xt", "wt"] + (["b"] if "b" in feeds else []), ["yt"],
                              **attrs),
             helper.make_node("Transpose", ["yt"], ["y"], perm=perm_out)]
    return ort_run(graph_model(nodes, feeds, ["y"]), feeds)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((2, 6, 7, 4), (5, 3, 3, 4), {"pads": [1, 1, 1, 1]}),
    ((1, 8, 8, 6), (4, 3, 2, 3), {"group": 2, "strides": [2, 1]}),
    ((2, 9, 4), (3, 3, 4), {"dilations": [2], "pads": [2, 1]}),
    ((1, 4, 5, 6, 2), (3, 2, 2, 3, 2), {"pads": [0, 1, 1, 1, 0, 1]}),
], ids=["2d", "group_stride", "1d_dilated", "3d"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_nhwc_conv(x_shape, w_shape, attrs, with_bias):
    """X (N, spatial..., C) and W (M, k..., C/group), the layout onnxruntime's fusion writes;
    no CPU kernel: the oracle is Transpose + Conv + Transpose."""
    inputs = [("x", rand(*x_shape)), ("w", rand(*w_shape))] + \
        ([("b", rand(w_shape[0]))] if with_bias else [])
    model, feeds = node_model("NhwcConv", inputs, ["y"], attrs, inits=("w",))
    oracle_feeds = {k: v for k, v in inputs}
    expected = _nhwc_conv_oracle(oracle_feeds, attrs, len(x_shape))
    check(model, feeds, expected=expected)


def test_nhwc_conv_float16():
    x, w = rand(1, 5, 5, 4, dtype=np.float16), rand(6, 3, 3, 4, dtype=np.float16)
    model, feeds = node_model("NhwcConv", [("x", x), ("w", w)], ["y"], {"pads": [1, 1, 1, 1]})
    f32 = {"x": x.astype(np.float32), "w": w.astype(np.float32)}
    expected = _nhwc_conv_oracle(f32, {"pads": [1, 1, 1, 1]}, 4)["y"].astype(np.float16)
    check(model, feeds, rtol=2e-3, expected={"y": expected})


# ============================================================================ group norm


def _group_norm_nodes(x, out, groups, eps, channels_last, silu, rank):
    """GroupNorm as ONNX GroupNormalization-21 (+ x sigmoid(x)), transposed to and from
    channels-first when the data is channels-last."""
    nodes, src = [], x
    if channels_last:
        nodes.append(helper.make_node("Transpose", [x], ["gn_in"],
                                      perm=[0, rank - 1] + list(range(1, rank - 1))))
        src = "gn_in"
    nodes.append(helper.make_node("GroupNormalization", [src, "gamma", "beta"], ["gn"],
                                  num_groups=groups, epsilon=eps))
    last = "gn"
    if silu:
        nodes += [helper.make_node("Sigmoid", ["gn"], ["gn_s"]),
                  helper.make_node("Mul", ["gn", "gn_s"], ["gn_a"])]
        last = "gn_a"
    if channels_last:
        nodes.append(helper.make_node("Transpose", [last], [out],
                                      perm=[0] + list(range(2, rank)) + [1]))
    else:
        nodes.append(helper.make_node("Identity", [last], [out]))
    return nodes


GN_CASES = [((2, 4, 5, 8), 4, 1), ((2, 3, 3, 6), 2, 1), ((1, 6, 4, 4), 3, 0), ((2, 5, 12), 4, 1),
            ((3, 16), 8, 1)]


@pytest.mark.parametrize("shape,groups,channels_last", GN_CASES, ids=str)
@pytest.mark.parametrize("activation", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_group_norm(shape, groups, channels_last, activation, dtype):
    """CUDA-only in onnxruntime: the oracle is GroupNormalization-21 (+ SiLU) in float32."""
    c = shape[-1] if channels_last else shape[1]
    x, gamma, beta = rand(*shape, dtype=dtype, scale=2), rand(c), rand(c)
    attrs = {"groups": groups, "activation": activation, "channels_last": channels_last,
             "epsilon": 1e-5}
    model, feeds = node_model("GroupNorm", [("x", x), ("gamma", gamma), ("beta", beta)], ["y"],
                              attrs, inits=("gamma", "beta"))
    f32 = {"x": x.astype(np.float32)}
    nodes = _group_norm_nodes("x", "y", groups, 1e-5, channels_last, activation, len(shape))
    expected = ort_run(graph_model(nodes, f32, ["y"], {"gamma": gamma, "beta": beta}), f32)
    check(model, feeds, rtol=tolerance(dtype), expected={"y": expected["y"].astype(dtype)})


@pytest.mark.parametrize("skip_kind", ["full", "nc", "n11c"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_skip_group_norm(skip_kind, with_bias, activation, dtype):
    n, h, w, c, groups = 2, 3, 4, 8, 4
    x = rand(n, h, w, c, dtype=dtype)
    skip = {"full": rand(n, h, w, c, dtype=dtype), "nc": rand(n, c, dtype=dtype),
            "n11c": rand(n, 1, 1, c, dtype=dtype)}[skip_kind]
    gamma, beta, bias = rand(c), rand(c), rand(c, dtype=dtype)
    inputs = [("x", x), ("gamma", gamma), ("beta", beta), ("skip", skip)] + \
        ([("bias", bias)] if with_bias else [])
    attrs = {"groups": groups, "activation": activation}
    model, feeds = node_model("SkipGroupNorm", inputs, ["y", "s"], attrs,
                              inits=("gamma", "beta"))
    f32 = {"x": x.astype(np.float32), "skip": skip.astype(np.float32).reshape(
        (n, 1, 1, c) if skip_kind != "full" else skip.shape)}
    nodes = [helper.make_node("Add", ["x", "skip"], ["s0"])]
    consts = {"gamma": gamma, "beta": beta}
    if with_bias:
        consts["bias"] = bias.astype(np.float32)
        nodes.append(helper.make_node("Add", ["s0", "bias"], ["s"]))
    else:
        nodes.append(helper.make_node("Identity", ["s0"], ["s"]))
    nodes += _group_norm_nodes("s", "y", groups, 1e-5, True, activation, 4)
    expected = ort_run(graph_model(nodes, f32, ["y", "s"], consts), f32)
    check(model, feeds, rtol=tolerance(dtype),
          expected={k: v.astype(dtype) for k, v in expected.items()})


def test_group_norm_rejects_bad_attributes():
    model, feeds = node_model("GroupNorm", [("x", rand(1, 2, 2, 6)), ("g", rand(6)),
                                            ("b", rand(6))], ["y"], {"groups": 4, "activation": 0})
    with pytest.raises(EmberError, match="groups"):
        ember_run(model, feeds)
    model, feeds = node_model("GroupNorm", [("x", rand(1, 2, 2, 6)), ("g", rand(6)),
                                            ("b", rand(6))], ["y"], {"groups": 3})
    with pytest.raises(EmberError, match="required"):
        ember_run(model, feeds)


# ============================================================================ dropouts


def _training_inputs(ratio, training):
    out = []
    if ratio is not None or training is not None:
        out.append(("ratio", np.array(ratio if ratio is not None else 0.5, np.float32)))
    if training is not None:
        out.append(("training", np.array(training)))
    return out


@pytest.mark.parametrize("bias_shape", ["row", "full"])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("mode", [(None, None), (0.3, None), (0.3, False), (0.0, True)],
                         ids=["defaults", "ratio", "inference", "train_ratio0"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bias_dropout(bias_shape, with_residual, mode, dtype):
    """CUDA-only in onnxruntime: in inference mode the oracle is Add (+ Add) with an all-true
    mask."""
    x = rand(2, 3, 8, dtype=dtype)
    bias = rand(8, dtype=dtype) if bias_shape == "row" else rand(2, 3, 8, dtype=dtype)
    residual = rand(2, 3, 8, dtype=dtype) if with_residual else None
    inputs = [("x", x), ("bias", bias), ("residual", residual) if with_residual else None]
    inputs += _training_inputs(*mode)
    while inputs and inputs[-1] is None:
        inputs.pop()
    expected = x.astype(np.float32) + bias.astype(np.float32)
    if with_residual:
        expected += residual.astype(np.float32)
    model, feeds = node_model("BiasDropout", inputs, ["y", "mask"])
    f32 = {"x": x.astype(np.float32), "bias": bias.astype(np.float32)}
    nodes = [helper.make_node("Add", ["x", "bias"], ["y0"])]
    if with_residual:
        f32["residual"] = residual.astype(np.float32)
        nodes.append(helper.make_node("Add", ["y0", "residual"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["y0"], ["y"]))
    oracle = ort_run(graph_model(nodes, f32, ["y"]), f32)
    check(model, feeds, rtol=tolerance(dtype),
          expected={"y": oracle["y"].astype(dtype), "mask": np.ones(x.shape, bool)})
    model, feeds = node_model("BitmaskBiasDropout", inputs, ["y", "mask"])
    words = np.full(2, 0xFFFFFFFF, np.uint32)
    words[-1] = (1 << 16) - 1  # 48 elements: the last word's top 16 bits are unused
    check(model, feeds, rtol=tolerance(dtype),
          expected={"y": oracle["y"].astype(dtype), "mask": words})


@pytest.mark.parametrize("shape", [(2, 3, 8), (5,), (64,), (3, 33)], ids=str)
@pytest.mark.parametrize("mode", [(None, None), (0.5, False), (0.2, None)],
                         ids=["defaults", "inference", "ratio"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_bitmask_dropout(shape, mode, dtype):
    x = rand(*shape, dtype=dtype)
    model, feeds = node_model("BitmaskDropout", [("x", x)] + _training_inputs(*mode),
                              ["y", "mask"])
    words = np.full(-(-x.size // 32), 0xFFFFFFFF, np.uint32)  # memset: every bit set
    check(model, feeds, expected={"y": x, "mask": words})


def test_dropout_training_mode_is_refused():
    model, feeds = node_model("BitmaskDropout", [("x", rand(4)), ("r", np.array(0.5, np.float32)),
                                                 ("t", np.array(True))], ["y", "mask"])
    with pytest.raises(EmberError, match="training mode"):
        ember_run(model, feeds)


# ============================================================================ activations


def _swiglu_nodes(has_up, d, alpha, beta, limit):
    nodes, consts = [], {"alpha": np.float32(alpha)}
    gate, up = "gate", "up"
    if not has_up:
        consts.update(split=np.array([d // 2, d // 2], np.int64))
        nodes.append(helper.make_node("Split", ["gate", "split"], ["g0", "u0"], axis=-1))
        gate, up = "g0", "u0"
    if limit > 0:
        consts.update(lim=np.float32(limit), neg=np.float32(-limit))
        nodes += [helper.make_node("Min", [gate, "lim"], ["gc"]),
                  helper.make_node("Clip", [up, "neg", "lim"], ["uc"])]
        gate, up = "gc", "uc"
    nodes += [helper.make_node("Mul", [gate, "alpha"], ["z"]),
              helper.make_node("Sigmoid", ["z"], ["sz"]),
              helper.make_node("Mul", [gate, "sz"], ["act"])]
    if beta:
        consts["beta"] = np.float32(beta)
        nodes.append(helper.make_node("Add", [up, "beta"], ["ub"]))
        up = "ub"
    nodes.append(helper.make_node("Mul", ["act", up], ["y"]))
    return nodes, consts


@pytest.mark.parametrize("has_up", [True, False])
@pytest.mark.parametrize("attrs", [{}, {"activation_alpha": 1.702, "limit": 7.0},
                                   {"activation_alpha": 1.702, "activation_beta": 1.0,
                                    "limit": 2.0}, {"limit": -1.0, "activation_beta": 0.5}],
                         ids=["defaults", "clamped", "gpt_oss", "no_clamp"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu(has_up, attrs, dtype):
    """No onnxruntime CPU kernel: the oracle is the formula as an ONNX graph in float32."""
    d = 12
    gate = rand(2, 5, d if not has_up else d // 2, dtype=dtype, scale=4)
    inputs = [("gate", gate)]
    if has_up:
        inputs.append(("up", rand(2, 5, d // 2, dtype=dtype, scale=4)))
    model, feeds = node_model("SwiGLU", inputs, ["y"], attrs)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    nodes, consts = _swiglu_nodes(has_up, d, attrs.get("activation_alpha", 1.0),
                                  attrs.get("activation_beta", 0.0), attrs.get("limit", 0.0))
    expected = ort_run(graph_model(nodes, f32, ["y"], consts), f32)["y"].astype(dtype)
    check(model, feeds, rtol=tolerance(dtype), expected={"y": expected})


def test_swiglu_round_activation_and_tail():
    gate = np.array([-200.0, -90.0, -50.0, -1.0, 0.0, 3.0], np.float32)
    up = np.full(6, 2.0, np.float32)
    y = ember_run(*node_model("SwiGLU", [("g", gate), ("u", up)], ["y"]))["y"]
    exact = (gate.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))) * 2.0
    np.testing.assert_allclose(y, exact.astype(np.float32), rtol=1e-6, atol=0)
    assert y[1] < 0 and y[0] <= 0  # the tail keeps its sign (float32 exp would flush it)
    g16, u16 = rand(4, 6, dtype=np.float16, scale=3), rand(4, 6, dtype=np.float16, scale=3)
    y = ember_run(*node_model("SwiGLU", [("g", g16), ("u", u16)], ["y"],
                              {"round_activation": 1}))["y"]
    g32 = g16.astype(np.float32)
    act = (g32 / (1 + np.exp(-g32))).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(y, (act * u16.astype(np.float32)).astype(np.float16))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("scale", [None, ("f32", 1.3), ("f16", 0.4), ("neg", -2.0)], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5), (17,)], ids=str)
def test_scaled_silu(dtype, scale, shape):
    inputs = [("x", rand(*shape, dtype=dtype, scale=4))]
    if scale is not None:
        kind, value = scale
        inputs.append(("s", np.array(value, np.float16 if kind == "f16" else np.float32)))
    model, feeds = node_model("ScaledSiLU", inputs, ["y"], {"alpha": 0.7})
    check(model, feeds, rtol=tolerance(dtype))


# ============================================================================ distances


@pytest.mark.parametrize("metric", [None, "sqeuclidean", "euclidean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shapes", [((4, 6), (5, 6)), ((1, 3), (7, 3)), ((9, 16), (9, 16))],
                         ids=str)
def test_cdist(metric, dtype, shapes):
    attrs = {"metric": metric} if metric else {}
    model, feeds = node_model("CDist", [("a", rand(*shapes[0], dtype=dtype)),
                                        ("b", rand(*shapes[1], dtype=dtype))], ["y"], attrs)
    check(model, feeds)


def test_cdist_unsupported_metric():
    model, feeds = node_model("CDist", [("a", rand(2, 3)), ("b", rand(2, 3))], ["y"],
                              {"metric": "cosine"})
    with pytest.raises(EmberError, match="metric"):
        ember_run(model, feeds)


def _complex_nodes(conj):
    """A * B (or A * conj(B)) over trailing (real, imaginary) pairs as ONNX ops."""
    consts = {"i0": np.array([0], np.int64), "i1": np.array([1], np.int64),
              "last": np.array([-1], np.int64), "two": np.array([2], np.int64)}
    nodes = []
    for t in ("a", "b"):
        nodes += [helper.make_node("Slice", [t, "i0", "i1", "last"], [t + "r"]),
                  helper.make_node("Slice", [t, "i1", "two", "last"], [t + "i"])]
    nodes += [helper.make_node("Mul", ["ar", "br"], ["rr"]),
              helper.make_node("Mul", ["ai", "bi"], ["ii"]),
              helper.make_node("Mul", ["ar", "bi"], ["ri"]),
              helper.make_node("Mul", ["ai", "br"], ["ir"])]
    if conj:
        nodes += [helper.make_node("Add", ["rr", "ii"], ["re"]),
                  helper.make_node("Sub", ["ir", "ri"], ["im"])]
    else:
        nodes += [helper.make_node("Sub", ["rr", "ii"], ["re"]),
                  helper.make_node("Add", ["ri", "ir"], ["im"])]
    nodes.append(helper.make_node("Concat", ["re", "im"], ["y"], axis=-1))
    return nodes, consts


@pytest.mark.parametrize("op", ["ComplexMul", "ComplexMulConj"])
@pytest.mark.parametrize("shapes", [((3, 4, 2), (3, 4, 2)), ((2, 1, 5, 2), (3, 1, 2)),
                                    ((2,), (6, 2))], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_complex_mul(op, shapes, dtype):
    a, b = rand(*shapes[0], dtype=dtype), rand(*shapes[1], dtype=dtype)
    model, feeds = node_model(op, [("a", a), ("b", b)], ["y"])
    nodes, consts = _complex_nodes(op == "ComplexMulConj")
    f32 = {"a": a.astype(np.float32), "b": b.astype(np.float32)}
    expected = ort_run(graph_model(nodes, f32, ["y"], consts), f32)["y"].astype(dtype)
    check(model, feeds, rtol=tolerance(dtype), expected={"y": expected})


# ============================================================================ pooling


@pytest.mark.parametrize("shape,attrs,mask_shape", [
    ((2, 3, 7, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
     (1, 1, 7, 8)),
    ((2, 3, 7, 8), {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0]},
     (2, 3, 7, 8)),
    ((1, 2, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (1, 1, 9)),
    ((1, 2, 9), {"kernel_shape": [3]}, (1, 2, 9)),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "strides": [1, 2, 2],
                       "pads": [0, 0, 1, 1, 1, 0]}, (1, 1, 4, 5, 6)),
    ((2, 2, 5, 5), {"kernel_shape": [3, 3]}, (2, 2, 5, 5)),
    ((1, 1, 5, 6), {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 1, 5, 6)),
], ids=["2d", "2d_full_mask", "1d", "1d_channel_mask", "3d", "offsets", "same_upper"])
@pytest.mark.parametrize("density", [0.75, 0.3])
def test_maxpool_with_mask(shape, attrs, mask_shape, density):
    x = rand(*shape)
    mask = (RNG.random(mask_shape) < density).astype(np.int32)
    model, feeds = node_model("MaxpoolWithMask", [("x", x), ("m", mask)], ["y"], attrs)
    check(model, feeds)


# ============================================================================ position biases


def _relative_position_bias_reference(table, length, bidirectional, max_distance):
    """onnxruntime's CUDA kernel, element by element (float32 logs, truncation)."""
    buckets, heads = table.shape
    flat = table.reshape(-1)
    out = np.zeros((1, heads, length, length), table.dtype)
    for h in range(heads):
        for i in range(length):
            for j in range(length):
                rp, base, nb = j - i, 0, buckets
                if bidirectional:
                    nb //= 2
                    if rp > 0:
                        base = nb
                    else:
                        rp = -rp
                else:
                    rp = 0 if rp > 0 else -rp
                max_exact = nb // 2
                if rp < max_exact:
                    b = rp
                else:
                    large = np.log(np.float32(rp) / np.float32(max_exact)) / \
                        np.log(np.float32(max_distance) / np.float32(max_exact)) * \
                        np.float32(nb - max_exact)
                    b = min(max_exact + int(large), nb - 1)
                out[0, h, i, j] = flat[h * buckets + base + b]
    return out


@pytest.mark.parametrize("bidirectional", [0, 1])
@pytest.mark.parametrize("length,buckets,max_distance", [(7, 32, 128), (40, 32, 64), (1, 8, 16),
                                                          (25, 16, 20)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_relative_position_bias(bidirectional, length, buckets, max_distance, dtype):
    """CUDA-only in onnxruntime: the oracle is its bucket formula, element by element."""
    table = rand(buckets, 4, dtype=dtype)
    inputs = [("t", table), ("q", np.array(length, np.int64)), ("k", np.array(length, np.int64))]
    model, feeds = node_model("RelativePositionBias", inputs, ["y"],
                              {"is_bidirectional": bidirectional, "max_distance": max_distance},
                              inits=("t",))
    expected = _relative_position_bias_reference(table, length, bidirectional, max_distance)
    check(model, feeds, expected={"y": expected})


def test_relative_position_bias_lengths_differ():
    model, feeds = node_model("RelativePositionBias", [("t", rand(8, 2)),
                                                       ("q", np.array(3, np.int64)),
                                                       ("k", np.array(4, np.int64))], ["y"],
                              {"max_distance": 16})
    with pytest.raises(EmberError, match="key_length"):
        ember_run(model, feeds)


def _gated_reference(q, qb, rel_pos, weight, bias, eco_a, heads):
    """The schema's torch formula in float64."""
    b, s, hidden = q.shape
    x = (q.astype(np.float64) + qb).reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)
    v = x @ weight.astype(np.float64) + bias
    d = v.shape[-1]
    v = v.reshape(b, heads, s, 2, d // 2).sum(-1)
    gates = 1 / (1 + np.exp(-v))
    gate_u, gate_r = gates[..., :1], gates[..., 1:]
    return (gate_u * (gate_r * eco_a - 1.0) + 2.0) * rel_pos


@pytest.mark.parametrize("b,s,heads,head_size,d", [(2, 5, 3, 4, 6), (1, 8, 2, 8, 32),
                                                   (3, 1, 1, 2, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gated_relative_position_bias(b, s, heads, head_size, d, dtype):
    """CUDA-only in onnxruntime: the oracle is the schema's formula in float64."""
    q, qb = rand(b, s, heads * head_size, dtype=dtype), rand(heads * head_size, dtype=dtype)
    rel_pos, weight = rand(1, heads, s, s, dtype=dtype), rand(head_size, d, dtype=dtype)
    bias, eco_a = rand(d, dtype=dtype), rand(1, heads, 1, 1, dtype=dtype)
    inputs = [("q", q), ("qb", qb), ("rp", rel_pos), ("w", weight), ("bias", bias),
              ("eco", eco_a)]
    model, feeds = node_model("GatedRelativePositionBias", inputs, ["y"], {"num_heads": heads})
    expected = _gated_reference(*(t.astype(np.float64) for t in (q, qb, rel_pos, weight, bias,
                                                                 eco_a)), heads)
    check(model, feeds, rtol=tolerance(dtype), expected={"y": expected.astype(dtype)})


# ============================================================================ utilities


@pytest.mark.parametrize("flags", [{}, {"isinf_only": 1}, {"isnan_only": 1}], ids=str)
@pytest.mark.parametrize("poison", [None, np.inf, -np.inf, np.nan], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_is_all_finite(flags, poison, dtype):
    """CUDA-only in onnxruntime: the oracle is IsInf / IsNaN, ReduceMax and Not."""
    xs = [rand(3, 4, dtype=dtype), rand(5, dtype=dtype), rand(2, 2, 2, dtype=np.float32)]
    if poison is not None:
        xs[1][2] = poison
    model, feeds = node_model("IsAllFinite", [(f"x{i}", x) for i, x in enumerate(xs)], ["y"],
                              flags)
    nodes, bads = [], []
    for i in range(len(xs)):
        checks = []
        if not flags.get("isnan_only"):
            nodes.append(helper.make_node("IsInf", [f"x{i}"], [f"inf{i}"]))
            checks.append(f"inf{i}")
        if not flags.get("isinf_only"):
            nodes.append(helper.make_node("IsNaN", [f"x{i}"], [f"nan{i}"]))
            checks.append(f"nan{i}")
        if len(checks) == 2:
            nodes.append(helper.make_node("Or", checks, [f"bad{i}"]))
        else:
            nodes.append(helper.make_node("Identity", checks, [f"bad{i}"]))
        nodes += [helper.make_node("Cast", [f"bad{i}"], [f"badi{i}"], to=onnx.TensorProto.INT32),
                  helper.make_node("ReduceMax", [f"badi{i}"], [f"any{i}"], keepdims=0)]
        bads.append(f"any{i}")
    nodes += [helper.make_node("Max", bads, ["anybad"]),
              helper.make_node("Cast", ["anybad"], ["anyb"], to=onnx.TensorProto.BOOL),
              helper.make_node("Not", ["anyb"], ["y"])]
    check(model, feeds, expected=ort_run(graph_model(nodes, feeds, ["y"]), feeds))


@pytest.mark.parametrize("indices_shape", [(5,), (2, 3), (2, 1, 4), ()], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8])
@pytest.mark.parametrize("extras", [False, True])
def test_torch_embedding(indices_shape, dtype, extras):
    """No onnxruntime CPU kernel: the oracle is Gather (padding_idx and scale_grad_by_freq
    only change gradients)."""
    weight = rand(10, 4, scale=5).astype(dtype)
    idx = ints(0, 10, indices_shape, np.int64)
    inputs = [("w", weight), ("i", idx)]
    if extras:
        inputs += [("p", np.array(0, np.int64)), ("f", np.array(True))]
    model, feeds = node_model("TorchEmbedding", inputs, ["y"])
    nodes = [helper.make_node("Gather", ["w", "i"], ["y"], axis=0)]
    oracle_feeds = {"w": weight, "i": idx}
    check(model, feeds, expected=ort_run(graph_model(nodes, oracle_feeds, ["y"]), oracle_feeds))


def test_torch_embedding_rejects_out_of_range():
    model, feeds = node_model("TorchEmbedding", [("w", rand(4, 2)),
                                                 ("i", np.array([1, -1], np.int64))], ["y"])
    with pytest.raises(EmberError, match="outside"):
        ember_run(model, feeds)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64, np.float32,
                                   np.float64])
@pytest.mark.parametrize("attrs", [{}, {"positive": 0}, {"seed": 42}, {"seed": -7,
                                                                       "positive": 0}], ids=str)
def test_murmur_hash3(dtype, attrs):
    x = RNG.integers(-100000, 100000, (3, 5)).astype(dtype)
    model, feeds = node_model("MurmurHash3", [("x", x)], ["y"], attrs)
    check(model, feeds)


@pytest.mark.parametrize("attrs", [{}, {"positive": 0, "seed": 3}], ids=str)
def test_murmur_hash3_strings(attrs):
    words = np.array(["", "a", "ab", "abc", "abcd", "hello world", "h\u00e9llo",
                      "0123456789abcdefg"], dtype=object)
    model, feeds = node_model("MurmurHash3", [("x", words.reshape(2, 4))], ["y"], attrs)
    check(model, feeds)


@pytest.mark.parametrize("ngram", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("length", [2, 9, 20])
def test_ngram_repeat_block(ngram, length):
    ids = ints(0, 4, (3, length), np.int64)
    model, feeds = node_model("NGramRepeatBlock", [("ids", ids), ("s", rand(3, 6))], ["y"],
                              {"ngram_size": ngram})
    check(model, feeds)


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("with_attrs", [False, True])
def test_word_conv_embedding(window, with_attrs):
    """Words of length >= 1 (onnxruntime leaves the rows of empty words unwritten)."""
    seq = ints(1, 20, (6, 8), np.int32)
    seq[1, 5:] = 0  # a short word
    seq[2, 1:] = 0  # a one-character word: shorter than the window
    seq[3, 3] = 0  # a hole: the length counts the positive ids
    w, b, c = rand(5, 1, window, 4), rand(5), rand(20, 4)
    attrs = {"embedding_size": 5, "conv_window_size": window, "char_embedding_size": 4} \
        if with_attrs else {}
    model, feeds = node_model("WordConvEmbedding", [("seq", seq), ("w", w), ("b", b), ("c", c)],
                              ["y"], attrs, inits=("w", "b", "c"))
    check(model, feeds)


def test_word_conv_embedding_empty_word_is_zero():
    seq = np.array([[3, 4, 0], [0, 2, 1]], np.int32)
    model, feeds = node_model("WordConvEmbedding", [("seq", seq), ("w", rand(2, 1, 2, 3)),
                                                    ("b", rand(2)), ("c", rand(5, 3))], ["y"])
    y = ember_run(model, feeds)["y"]
    assert y.shape == (2, 2) and not y[1].any()


ROIS = np.array([[0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1], [-0.2, 0.3, 1.3, 0.5],
                 [0.5, 0.5, 0.5, 0.5], [0.9, 0.8, 0.1, 0.2]], np.float32)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("crop", [(4, 5), (1, 3), (2, 1), (1, 1), (6, 6)], ids=str)
@pytest.mark.parametrize("extrapolation", [None, -3.0])
def test_crop_and_resize(mode, crop, extrapolation):
    x = rand(2, 3, 7, 9)
    inputs = [("x", x), ("r", ROIS), ("b", np.array([0, 1, 1, 0, 1], np.int32)),
              ("cs", np.array(crop, np.int32))]
    attrs = {"mode": mode}
    if extrapolation is not None:
        attrs["extrapolation_value"] = extrapolation
    model, feeds = node_model("CropAndResize", inputs, ["y"], attrs, inits=("cs",))
    check(model, feeds)


SRC = np.array([1, 2, 3, 4, 2, 3, 5, 6], np.int64)
BIFURCATION_CASES = [
    (np.array([9, 1, 2]), np.array(2), np.array([3, 4, 2, 3, 7, 8, 9])),
    (np.array([9, 2, 3]), np.array(0), np.array([1, 2, 3, 4, 2, 3, 5, 6, 0])),
    (np.array([5, 6]), np.array(8), np.array([4])),
    (np.array([2, 3]), np.array([1]), None),
    (np.array([4, 2, 3, 5]), np.array(3), np.array([4, 2, 3, 5, 6, 1])),
    (np.array([7]), np.array(1), np.array([0, 0, 0, 0, 0, 0, 0, 0])),
]


@pytest.mark.parametrize("case", range(len(BIFURCATION_CASES)))
@pytest.mark.parametrize("ngrams", [(1, 3), (2, 4), (1, 1), None], ids=str)
def test_bifurcation_detector(case, ngrams):
    cur, prev, pred = BIFURCATION_CASES[case]
    inputs = [("s", SRC), ("c", cur.astype(np.int64)), ("p", prev.astype(np.int64))]
    if pred is not None:
        inputs.append(("q", pred.astype(np.int64)))
    attrs = {} if ngrams is None else {"min_ngram_size": ngrams[0],
                                       "max_ngram_size": ngrams[1]}
    model, feeds = node_model("BifurcationDetector", inputs, ["tokens", "idx"], attrs)
    check(model, feeds)


# ============================================================================ decoder attention

DMMHA_OUTPUTS = ["out", "present_key", "present_value"]


def _dmmha_self_inputs(batch, heads, head_size, max_len, past, *, packed=False, bias=False,
                       mask=False, attention_bias=False, beams=None):
    hidden = heads * head_size
    if packed:
        inputs = [("q", rand(batch, 1, 3 * hidden)), None, None]
    else:
        inputs = [("q", rand(batch, 1, hidden)), ("k", rand(batch, 1, hidden)),
                  ("v", rand(batch, 1, hidden))]
    total = past + 1
    inputs.append(("mask", (RNG.random((batch, total)) > 0.3).astype(np.int32)) if mask else None)
    inputs.append(("ab", rand(1, heads, 1, total)) if attention_bias else None)
    inputs += [("pk", rand(batch, heads, max_len, head_size)),
               ("pv", rand(batch, heads, max_len, head_size)), ("psl", np.array(past, np.int32))]
    if beams:
        inputs += [("bw", np.array(beams, np.int32)),
                   ("ci", ints(0, beams, (batch // beams, beams, max_len), np.int32))]
    else:
        inputs += [None, None]
    inputs.append(("bias", rand(3 * hidden)) if bias else None)
    while inputs[-1] is None:
        inputs.pop()
    return inputs


def _dmmha_model(inputs, heads, output_qk=False, **attrs):
    outputs = DMMHA_OUTPUTS + (["qk"] if output_qk else [])
    attrs = {"num_heads": heads, "past_present_share_buffer": 1, **attrs}
    if output_qk:
        attrs["output_qk"] = 1
    model, feeds = node_model("DecoderMaskedMultiHeadAttention", inputs, outputs, attrs)
    if output_qk:  # onnxruntime cannot infer qk's type: declare it
        model.graph.output[-1].CopyFrom(helper.make_tensor_value_info("qk", onnx.TensorProto.FLOAT,
                                                                      None))
    return model, feeds


@pytest.mark.parametrize("past", [0, 3, 6])
@pytest.mark.parametrize("options", [{}, {"bias": True}, {"mask": True},
                                     {"attention_bias": True}, {"mask": True, "bias": True,
                                                                "attention_bias": True}],
                         ids=["plain", "bias", "mask", "attention_bias", "all"])
@pytest.mark.parametrize("output_qk", [False, True])
def test_decoder_masked_mha_self(past, options, output_qk):
    inputs = _dmmha_self_inputs(2, 3, 4, 7, past, **options)
    model, feeds = _dmmha_model(inputs, 3, output_qk)
    check(model, feeds)


@pytest.mark.parametrize("scale", [0.7, 0.0])
@pytest.mark.parametrize("mask_filter_value", [-10000.0, -1e9])
def test_decoder_masked_mha_attributes(scale, mask_filter_value):
    inputs = _dmmha_self_inputs(3, 2, 8, 5, 2, mask=True)
    model, feeds = _dmmha_model(inputs, 2, True, scale=scale,
                                mask_filter_value=mask_filter_value)
    check(model, feeds)


@pytest.mark.parametrize("past,beams", [(3, 2), (5, 3), (0, 2)], ids=str)
@pytest.mark.parametrize("mask", [False, True])
def test_decoder_masked_mha_beams(past, beams, mask):
    """Inside beam search: cache_indirection says which beam's cache row each past step of
    each beam reads."""
    inputs = _dmmha_self_inputs(2 * beams, 2, 4, 6, past, mask=mask, beams=beams)
    model, feeds = _dmmha_model(inputs, 2, output_qk=True)
    check(model, feeds)


@pytest.mark.parametrize("bias", [False, True])
def test_decoder_masked_mha_packed_qkv(bias):
    """Query carrying Q, K and V: onnxruntime 1.32's CPU kernel fails on this form (a reshape
    of the packed tensor), so the oracle is onnxruntime on the same values unpacked."""
    inputs = _dmmha_self_inputs(2, 3, 4, 6, 2, packed=True, bias=bias, mask=True)
    model, feeds = _dmmha_model(inputs, 3)
    qkv = feeds["q"]
    hidden = qkv.shape[2] // 3
    unpacked = [("q", qkv[..., :hidden]), ("k", qkv[..., hidden:2 * hidden]),
                ("v", qkv[..., 2 * hidden:])] + inputs[3:]
    oracle, oracle_feeds = _dmmha_model(unpacked, 3)
    check(model, feeds, expected=ort_run(oracle, oracle_feeds))


@pytest.mark.parametrize("kv_len", [1, 5])
@pytest.mark.parametrize("mask,output_qk,bias", [(False, False, False), (True, True, False),
                                                 (False, False, True)])
def test_decoder_masked_mha_cross(kv_len, mask, output_qk, bias):
    b, n, h = 2, 3, 4
    inputs = [("q", rand(b, 1, n * h)), ("k", rand(b, n, kv_len, h)), ("v", rand(b, n, kv_len, h)),
              ("mask", (RNG.random((b, kv_len)) > 0.3).astype(np.int32)) if mask else None]
    if bias:
        inputs += [None] * 6 + [("bias", rand(3 * n * h))]
    while inputs[-1] is None:
        inputs.pop()
    outputs = ["out", "", "", "qk"] if output_qk else ["out"]
    attrs = {"num_heads": n, **({"output_qk": 1} if output_qk else {})}
    model, feeds = node_model("DecoderMaskedMultiHeadAttention", inputs, outputs, attrs)
    if output_qk:
        model.graph.output[-1].CopyFrom(helper.make_tensor_value_info("qk", onnx.TensorProto.FLOAT,
                                                                      None))
    check(model, feeds)


# ============================================================================ OpenCL


def _opencl_cases():
    """One representative model per op (and its oracle), for the OpenCL backend."""
    yield "FusedGemm", node_model("FusedGemm", [("a", rand(3, 4)), ("b", rand(5, 4)),
                                                ("c", rand(5))], ["y"],
                                  {"transB": 1, "activation": "Relu"}), None
    yield "TransposeMatMul", node_model("TransposeMatMul", [("a", rand(2, 4, 3)),
                                                            ("b", rand(4, 5))], ["y"],
                                        {"transA": 1}), None
    yield "GatherND", node_model("GatherND", [("d", rand(3, 4)),
                                              ("i", np.array([[2, 1], [-1, 0]], np.int64))],
                                 ["y"]), None
    yield "Range", node_model("Range", [("s", np.array(1, np.int32)),
                                        ("l", np.array(9, np.int32))], ["y"]), None
    yield "Trilu", node_model("Trilu", [("x", rand(3, 4)), ("k", np.array(1, np.int64))],
                              ["y"], {"upper": 0}), None
    yield "Pad", node_model("Pad", [("x", rand(2, 3)), ("p", np.array([1, 0, 0, 2], np.int64))],
                            ["y"], {"mode": "reflect"}, inits=("p",)), None
    yield "ExpandDims", node_model("ExpandDims", [("x", rand(2, 3)),
                                                  ("a", np.array(1, np.int32))], ["y"]), None
    yield "Unique", node_model("Unique", [("x", np.array([3, 1, 3, 2], np.float32))],
                               ["y", "i", "c"]), None
    yield "GridSample", node_model("GridSample", [("x", rand(1, 2, 4, 4)),
                                                  ("g", RNG.uniform(-1, 1, (1, 3, 3, 2))
                                                   .astype(np.float32))], ["y"]), None
    yield "Inverse", node_model("Inverse", [("x", rand(2, 3, 3) + 3 * np.eye(3, dtype=np.float32))],
                                ["y"]), None
    yield "QLinearConv", node_model(
        "QLinearConv", [("x", _qdata(np.uint8, (1, 5, 5, 3))), ("xs", np.array(0.05, np.float32)),
                        ("xz", np.array(7, np.uint8)), ("w", ints(-64, 64, (2, 3, 3, 3), np.int8)),
                        ("ws", np.array(0.02, np.float32)), ("wz", np.array(0, np.int8)),
                        ("ys", np.array(0.2, np.float32)), ("yz", np.array(100, np.uint8))],
        ["y"], {"channels_last": 1}, inits=("xs", "xz", "w", "ws", "wz", "ys", "yz")), None
    yield "QLinearWhere", node_model(
        "QLinearWhere", [("c", RNG.random((3, 4)) > 0.5), ("x", _qdata(np.uint8, (3, 4))),
                         ("xs", np.array(0.03, np.float32)), ("xz", np.array(3, np.uint8)),
                         ("y", _qdata(np.uint8, (3, 4))), ("ys", np.array(0.07, np.float32)),
                         ("yz", np.array(200, np.uint8)), ("zs", np.array(0.05, np.float32)),
                         ("zz", np.array(10, np.uint8))], ["z"]), None
    yield "MatMulInteger16", node_model("MatMulInteger16",
                                        [("a", ints(-3000, 3000, (3, 4), np.int16)),
                                         ("b", ints(-3000, 3000, (4, 2), np.int16))], ["y"]), None
    yield "NhwcMaxPool", node_model("NhwcMaxPool", [("x", _qdata(np.int8, (1, 5, 5, 2)))], ["y"],
                                    {"kernel_shape": [2, 2]}), None
    yield "ScaledSiLU", node_model("ScaledSiLU", [("x", rand(2, 5))], ["y"], {"alpha": 1.5}), None
    yield "CDist", node_model("CDist", [("a", rand(3, 4)), ("b", rand(2, 4))], ["y"]), None
    yield "MaxpoolWithMask", node_model(
        "MaxpoolWithMask", [("x", rand(1, 2, 5, 5)),
                            ("m", (RNG.random((1, 1, 5, 5)) > 0.3).astype(np.int32))], ["y"],
        {"kernel_shape": [2, 2]}), None
    yield "WordConvEmbedding", node_model(
        "WordConvEmbedding", [("s", ints(1, 9, (3, 5), np.int32)), ("w", rand(4, 1, 2, 3)),
                              ("b", rand(4)), ("c", rand(9, 3))], ["y"]), None
    yield "MurmurHash3", node_model("MurmurHash3", [("x", ints(0, 99, (4,), np.int32))],
                                    ["y"]), None
    yield "NGramRepeatBlock", node_model("NGramRepeatBlock", [("i", ints(0, 3, (2, 7), np.int64)),
                                                              ("s", rand(2, 4))], ["y"],
                                         {"ngram_size": 2}), None
    yield "CropAndResize", node_model("CropAndResize", [("x", rand(1, 2, 5, 6)), ("r", ROIS[:2]),
                                                        ("b", np.zeros(2, np.int32)),
                                                        ("cs", np.array([3, 3], np.int32))],
                                      ["y"], inits=("cs",)), None
    yield "BifurcationDetector", node_model(
        "BifurcationDetector", [("s", SRC), ("c", np.array([9, 1, 2], np.int64)),
                                ("p", np.array(2, np.int64)),
                                ("q", np.array([3, 4, 2, 3, 7, 8, 9], np.int64))],
        ["t", "i"]), None
    yield "DecoderMaskedMultiHeadAttention", _dmmha_model(
        _dmmha_self_inputs(2, 2, 4, 5, 2, mask=True), 2), None
    # ops without an onnxruntime CPU kernel: checked against ember's CPU backend, itself
    # checked against the oracles above
    d8 = _qdata(np.uint8, (3, 4))
    yield "QLinearReduceMean", node_model(
        "QLinearReduceMean", [("d", d8), ("s", np.array(0.1, np.float32)), None,
                              ("r", np.array(0.05, np.float32))], ["y"],
        {"axes": [1], "keepdims": 1}), "cpu"
    yield "MulInteger", node_model("MulInteger", [("a", d8), None, ("b", d8),
                                                  ("zb", np.array(3, np.uint8))], ["y"]), "cpu"
    yield "ReduceSumInteger", node_model("ReduceSumInteger", [("d", d8)], ["y"],
                                         {"axes": [0], "keepdims": 0}), "cpu"
    yield "FusedMatMulActivation", node_model(
        "FusedMatMulActivation", [("a", rand(3, 4)), ("b", rand(4, 2))], ["y"],
        {"activation": "LeakyRelu", "activation_alpha": 0.1}), "cpu"
    yield "Rfft", node_model("Rfft", [("x", rand(2, 8))], ["y"]), "cpu"
    yield "Irfft", node_model("Irfft", [("x", rand(2, 5, 2))], ["y"], {"signal_ndim": 1}), "cpu"
    yield "NhwcConv", node_model("NhwcConv", [("x", rand(1, 5, 5, 2)), ("w", rand(3, 3, 3, 2)),
                                              ("b", rand(3))], ["y"], {"pads": [1, 1, 1, 1]}), "cpu"
    yield "GroupNorm", node_model("GroupNorm", [("x", rand(1, 3, 3, 4)), ("g", rand(4)),
                                                ("b", rand(4))], ["y"],
                                  {"groups": 2, "activation": 1}), "cpu"
    yield "SkipGroupNorm", node_model("SkipGroupNorm", [("x", rand(1, 3, 3, 4)), ("g", rand(4)),
                                                        ("b", rand(4)), ("s", rand(1, 4)),
                                                        ("bias", rand(4))], ["y", "sum"],
                                      {"groups": 2, "activation": 0}), "cpu"
    yield "BiasDropout", node_model("BiasDropout", [("x", rand(2, 4)), ("b", rand(4)),
                                                    ("r", rand(2, 4))], ["y", "m"]), "cpu"
    yield "BitmaskBiasDropout", node_model("BitmaskBiasDropout", [("x", rand(2, 4)),
                                                                  ("b", rand(4))],
                                           ["y", "m"]), "cpu"
    yield "BitmaskDropout", node_model("BitmaskDropout", [("x", rand(40))], ["y", "m"]), "cpu"
    yield "SwiGLU", node_model("SwiGLU", [("g", rand(2, 8))], ["y"], {"limit": 1.0}), "cpu"
    yield "ComplexMul", node_model("ComplexMul", [("a", rand(3, 2)), ("b", rand(3, 2))],
                                   ["y"]), "cpu"
    yield "ComplexMulConj", node_model("ComplexMulConj", [("a", rand(3, 2)), ("b", rand(1, 2))],
                                       ["y"]), "cpu"
    yield "RelativePositionBias", node_model(
        "RelativePositionBias", [("t", rand(8, 2)), ("q", np.array(5, np.int64)),
                                 ("k", np.array(5, np.int64))], ["y"], {"max_distance": 16}), "cpu"
    yield "GatedRelativePositionBias", node_model(
        "GatedRelativePositionBias", [("q", rand(1, 3, 4)), ("qb", rand(4)),
                                      ("rp", rand(1, 2, 3, 3)), ("w", rand(2, 4)), ("b", rand(4)),
                                      ("e", rand(1, 2, 1, 1))], ["y"], {"num_heads": 2}), "cpu"
    yield "IsAllFinite", node_model("IsAllFinite", [("a", rand(3)), ("b", rand(2, 2))],
                                    ["y"]), "cpu"
    yield "TorchEmbedding", node_model("TorchEmbedding", [("w", rand(5, 3)),
                                                          ("i", np.array([[4, 0]], np.int64))],
                                       ["y"]), "cpu"


OPENCL_CASES = list(_opencl_cases())


@OPENCL
@pytest.mark.parametrize("op,built,oracle", OPENCL_CASES, ids=[c[0] for c in OPENCL_CASES])
def test_opencl(op, built, oracle):
    """Each op on the OpenCL backend (a planned CPU fallback), against onnxruntime or, for the
    ops onnxruntime's CPU provider does not run, against ember's CPU backend."""
    model, feeds = built
    expected = ember_run(model, feeds, "cpu") if oracle == "cpu" else None
    check(model, feeds, "opencl", expected=expected)


def test_every_op_is_registered_and_covered():
    ops = {c[0] for c in OPENCL_CASES}
    for op in ops:
        registered(op)
    declared = {cls.op_type for cls in vars(cm).values()
                if isinstance(cls, type) and getattr(cls, "domain", None) == MS
                and cls.__module__ == cm.__name__ and cls.op_type}
    assert declared == ops


# ============================================================================ over cupy


def _device_cases():
    yield cm.FusedGemm, [rand(3, 4), rand(4, 5), rand(5)], 1, {"activation": "Selu",
                                                                "activation_alpha": 1.5,
                                                                "activation_gamma": 1.1}
    yield cm.TransposeMatMul, [rand(2, 4, 3), rand(4, 5)], 1, {"transA": 1}
    yield cm.FusedMatMulActivation, [rand(3, 4), rand(4, 2)], 1, {"activation": "HardSigmoid",
                                                                   "activation_alpha": 0.2,
                                                                   "activation_beta": 0.5}
    yield cm.GatherND, [rand(3, 4), np.array([[2, 1], [-1, 0]], np.int64)], 1, {}
    yield cm.Range, [np.array(2, np.int64), np.array(11, np.int64), None], 1, {}
    yield cm.Trilu, [rand(3, 4), np.array(-1, np.int64)], 1, {}
    yield cm.Pad, [rand(2, 3), np.array([[1, 0, 0, 2]], np.int64), np.array([2.0], np.float32)], \
        1, {}
    yield cm.ExpandDims, [rand(2, 3), np.array(-1, np.int32)], 1, {}
    yield cm.Unique, [np.array([3, 1, 3, 2], np.float32)], 3, {}
    yield cm.GridSample, [rand(1, 2, 4, 4), RNG.uniform(-1, 1, (1, 3, 3, 2)).astype(np.float32)], \
        1, {"mode": "bicubic"}
    yield cm.Inverse, [rand(2, 3, 3) + 3 * np.eye(3, dtype=np.float32)], 1, {}
    yield cm.Rfft, [rand(2, 4, 6)], 1, {"signal_ndim": 2}
    yield cm.Irfft, [rand(2, 5, 2)], 1, {"signal_ndim": 1}
    yield cm.QLinearConv, [_qdata(np.uint8, (1, 5, 5, 3)), np.array(0.05, np.float32),
                           np.array(7, np.uint8), ints(-64, 64, (2, 3, 3, 3), np.int8),
                           np.array([0.02, 0.01], np.float32), np.array(0, np.int8),
                           np.array(0.2, np.float32), np.array(100, np.uint8)], 1, \
        {"channels_last": 1, "pads": [1, 1, 1, 1]}
    yield cm.QLinearWhere, [RNG.random((3, 4)) > 0.5, _qdata(np.int8, (3, 4)),
                            np.array(0.03, np.float32), np.array(3, np.int8),
                            _qdata(np.int8, (4,)), np.array(0.07, np.float32),
                            np.array(-2, np.int8), np.array(0.05, np.float32),
                            np.array(10, np.int8)], 1, {}
    d8 = _qdata(np.uint8, (3, 4))
    yield cm.QLinearReduceMean, [d8, np.array(0.1, np.float32), np.array(5, np.uint8),
                                 np.array(0.05, np.float32), np.array(9, np.uint8)], 1, \
        {"axes": [1], "keepdims": 0}
    yield cm.MulInteger, [d8, np.array(1, np.uint8), d8[:1], None], 1, {}
    yield cm.ReduceSumInteger, [d8], 1, {"axes": [], "keepdims": 1}
    yield cm.MatMulInteger16, [ints(-3000, 3000, (3, 4), np.int16),
                               ints(-3000, 3000, (4, 2), np.int16)], 1, {}
    yield cm.NhwcMaxPool, [_qdata(np.int8, (1, 5, 5, 2))], 1, {"kernel_shape": [3, 3],
                                                               "pads": [1, 1, 1, 1]}
    yield cm.NhwcConv, [rand(1, 5, 5, 2), rand(3, 3, 3, 2), rand(3)], 1, {"pads": [1, 1, 1, 1]}
    yield cm.GroupNorm, [rand(1, 3, 3, 4), rand(4), rand(4)], 1, {"groups": 2, "activation": 1}
    yield cm.SkipGroupNorm, [rand(1, 3, 3, 4), rand(4), rand(4), rand(1, 4), rand(4)], 2, \
        {"groups": 2, "activation": 0}
    yield cm.BiasDropout, [rand(2, 4), rand(4), rand(2, 4), None, np.array(False)], 2, {}
    yield cm.BitmaskBiasDropout, [rand(2, 4), rand(4)], 2, {}
    yield cm.BitmaskDropout, [rand(40)], 2, {}
    yield cm.SwiGLU, [rand(2, 8, scale=40)], 1, {"limit": 7.0, "activation_alpha": 1.702}
    yield cm.ScaledSiLU, [rand(2, 5, dtype=np.float16), np.array(0.5, np.float32)], 1, {}
    yield cm.CDist, [rand(3, 4), rand(2, 4)], 1, {"metric": "euclidean"}
    yield cm.ComplexMul, [rand(3, 2), rand(3, 2)], 1, {}
    yield cm.ComplexMulConj, [rand(3, 2), rand(1, 2)], 1, {}
    yield cm.MaxpoolWithMask, [rand(1, 2, 5, 5), (RNG.random((1, 1, 5, 5)) > 0.3)
                               .astype(np.int32)], 1, {"kernel_shape": [2, 2]}
    yield cm.RelativePositionBias, [rand(8, 2), np.array(5, np.int64), np.array(5, np.int64)], \
        1, {"max_distance": 16, "is_bidirectional": 1}
    yield cm.GatedRelativePositionBias, [rand(1, 3, 4), rand(4), rand(1, 2, 3, 3), rand(2, 4),
                                         rand(4), rand(1, 2, 1, 1)], 1, {"num_heads": 2}
    yield cm.WordConvEmbedding, [ints(1, 9, (3, 5), np.int32), rand(4, 1, 2, 3), rand(4),
                                 rand(9, 3)], 1, {}
    yield cm.IsAllFinite, [rand(3), np.array([1.0, np.inf], np.float32)], 1, {}
    yield cm.MurmurHash3, [ints(0, 99, (4,), np.int64)], 1, {"seed": 5}
    yield cm.NGramRepeatBlock, [ints(0, 3, (2, 7), np.int64), rand(2, 4)], 1, {"ngram_size": 2}
    yield cm.CropAndResize, [rand(1, 2, 5, 6), ROIS[:3], np.zeros(3, np.int32),
                             np.array([3, 4], np.int32)], 1, {}
    yield cm.BifurcationDetector, [SRC, np.array([9, 1, 2], np.int64), np.array(2, np.int64),
                                   np.array([3, 4, 2, 3, 7, 8, 9], np.int64)], 2, {}
    yield cm.TorchEmbedding, [rand(5, 3), np.array([[4, 0]], np.int64)], 1, {}
    yield cm.DecoderMaskedMultiHeadAttention, [
        rand(4, 1, 8), rand(4, 1, 8), rand(4, 1, 8), np.ones((4, 4), np.int32), rand(1, 2, 1, 4),
        rand(4, 2, 6, 4), rand(4, 2, 6, 4), np.array(3, np.int32), np.array(2, np.int32),
        ints(0, 2, (2, 2, 6), np.int32), rand(24)], 4, \
        {"num_heads": 2, "past_present_share_buffer": 1, "output_qk": 1}
    yield cm.DecoderMaskedMultiHeadAttention, [rand(2, 1, 8), rand(2, 2, 5, 4), rand(2, 2, 5, 4),
                                               np.ones((2, 5), np.int32)], 1, {"num_heads": 2}


DEVICE_CASES = list(_device_cases())


@pytest.fixture
def cuda():
    with cuda_backend("gpu" if real_cuda_device() else "emulated") as backend:
        yield backend


@pytest.mark.parametrize("cls,inputs,n_out,attrs", DEVICE_CASES,
                         ids=[f"{c[0].op_type}{i}" for i, c in enumerate(DEVICE_CASES)])
def test_array_code_runs_over_cupy(cuda, cls, inputs, n_out, attrs):
    """The kernels compute over `self.xp`: bound to cupy (the numpy stand-in that refuses
    host arrays mixed with device arrays, or a real GPU), they take and give device arrays
    (shape inputs stay on the host) and match the CPU kernel."""
    from ember.ir import Node
    from ember.ops.cuda._common import shared_class

    node = Node(cls.op_type, cls.domain, 1, [f"i{i}" if x is not None else ""
                                             for i, x in enumerate(inputs)],
                [f"o{i}" for i in range(n_out)], dict(attrs))
    expected = cls(node, {**cls.defaults, **attrs}).run(*inputs)
    kernel = shared_class(cls)(node, {**cls.defaults, **attrs}, device=cuda)
    args = [None if x is None else x if i in cls.shape_inputs else cuda.to_device(x)
            for i, x in enumerate(inputs)]
    got = kernel.run(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e is None:  # an output the node's form does not produce
            assert g is None
            continue
        assert isinstance(g, cuda.xp.ndarray) and type(g) is not np.ndarray
        g = cuda.to_host(g)
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.dtype.kind in "iub":
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


# ============================================================================ real models


def _init(name, shape, scale=0.3):
    return numpy_helper.from_array(rand(*shape, scale=scale), name)


def test_fused_gemm_from_onnxruntime_optimizer(tmp_path):
    """onnxruntime's graph optimiser (GemmActivationFusion) folds Gemm + activation into
    FusedGemm; the optimised model it saves runs on ember like on onnxruntime."""
    TP = onnx.TensorProto
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["g1"]),
             helper.make_node("LeakyRelu", ["g1"], ["h1"], alpha=0.2),
             helper.make_node("Gemm", ["h1", "w2"], ["g2"], alpha=0.5, transB=1),
             helper.make_node("Sigmoid", ["g2"], ["h2"]),
             helper.make_node("Gemm", ["h2", "w3", "b3"], ["g3"]),
             helper.make_node("HardSigmoid", ["g3"], ["y"], alpha=0.3, beta=0.4)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TP.FLOAT,
                                                                           ["N", 8])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                              [_init("w1", (8, 6)), _init("b1", (6,)), _init("w2", (5, 6)),
                               _init("w3", (5, 4)), _init("b3", (4,))])
    src, fused = tmp_path / "mlp.onnx", tmp_path / "fused.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=9), str(src))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(fused)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(fused))
    assert [n.op_type for n in model.graph.node if n.domain == MS] == ["FusedGemm"] * 3
    feeds = {"x": rand(5, 8, scale=2)}
    check(model, feeds)


def test_nhwc_qlinear_conv_and_max_pool_from_onnxruntime_optimizer(tmp_path):
    """quantize_static (QOperator and QDQ), then onnxruntime's NHWC transformer (optimisation
    level ALL) rewrites the convolutions as com.microsoft QLinearConv with channels_last and
    the pool as NhwcMaxPool; ember runs the saved model exactly like onnxruntime."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    TP = onnx.TensorProto
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1],
                              strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TP.FLOAT,
                                                                           [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                              [_init("w1", (8, 3, 3, 3)), _init("b1", (8,), 0.1),
                               _init("w2", (6, 8, 3, 3)), _init("b2", (6,), 0.1)])
    src = tmp_path / "cnn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=9), str(src))

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rand(1, 3, 12, 12)} for _ in range(8)])

        def get_next(self):
            return next(self.batches, None)

    for fmt in ("QOperator", "QDQ"):
        for activation in ("QUInt8", "QInt8"):
            quantized, fused = tmp_path / f"q_{fmt}.onnx", tmp_path / f"f_{fmt}.onnx"
            # reduce_range: 7-bit weights, so onnxruntime's u8s8 kernels do not saturate
            quantize_static(str(src), str(quantized), Calibration(),
                            quant_format=getattr(QuantFormat, fmt), reduce_range=True,
                            activation_type=getattr(QuantType, activation),
                            weight_type=QuantType.QInt8)
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.optimized_model_filepath = str(fused)
            options.log_severity_level = 3
            ort.InferenceSession(str(quantized), options, providers=["CPUExecutionProvider"])
            model = onnx.load(str(fused))
            ms_ops = [(n.op_type, {a.name: helper.get_attribute_value(a) for a in n.attribute})
                      for n in model.graph.node if n.domain == MS]
            assert [op for op, _ in ms_ops] == ["QLinearConv", "NhwcMaxPool", "QLinearConv"]
            assert all(a["channels_last"] == 1 for op, a in ms_ops if op == "QLinearConv")
            check(model, {"x": rand(1, 3, 12, 12)})


def _unet_block_file(tmp_path):
    """A UNet resnet block (GroupNorm + SiLU, 3x3 convolutions, a time-embedding add, a
    residual), exported by torch's TorchScript exporter at opset 17."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, channels=32, groups=8):
            super().__init__()
            self.gn1, self.gn2 = nn.GroupNorm(groups, channels), nn.GroupNorm(groups, channels)
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
            self.temb = nn.Linear(16, channels)

        def forward(self, x, t):
            h = self.conv1(nn.functional.silu(self.gn1(x)))
            h = h + self.temb(t)[:, :, None, None]
            return x + self.conv2(nn.functional.silu(self.gn2(h)))

    torch.manual_seed(0)
    block = Block().eval()
    x, t = torch.randn(2, 32, 8, 8), torch.randn(2, 16)
    path = tmp_path / "unet_block.onnx"
    torch.onnx.export(block, (x, t), str(path), input_names=["x", "t"], output_names=["y"],
                      opset_version=17, dynamo=False)
    with torch.no_grad():
        expected = block(x, t).numpy()
    return path, {"x": x.numpy(), "t": t.numpy()}, expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning",
                            "ignore:Converting a tensor to a Python boolean")
@pytest.mark.parametrize("float16", [False, True])
def test_unet_fusions_from_onnxruntime_transformers(tmp_path, float16):
    """onnxruntime.transformers' UNet optimiser turns a torch-exported resnet block into
    GroupNorm, SkipGroupNorm and NhwcConv (its CUDA-only ops); ember runs the result like
    torch (onnxruntime's CPU provider cannot run it at all). float16: the optimiser's float16
    conversion (inputs and outputs kept float32), within 1e-2 of max|expected|."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    path, feeds, expected = _unet_block_file(tmp_path)
    optimized = optimizer.optimize_model(str(path), model_type="unet", opt_level=0,
                                         optimization_options=FusionOptions("unet"))
    if float16:
        optimized.convert_float_to_float16(keep_io_types=True)
    out = tmp_path / "optimized.onnx"
    optimized.save_model_to_file(str(out))
    model = onnx.load(str(out))
    ms_ops = sorted(n.op_type for n in model.graph.node if n.domain == MS)
    assert ms_ops == ["GroupNorm", "NhwcConv", "NhwcConv", "SkipGroupNorm"]
    got = ember_run(model, feeds)
    assert_close(got["y"], expected, 1e-2 if float16 else 1e-5, "y")
