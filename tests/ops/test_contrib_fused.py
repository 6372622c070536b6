"""onnxruntime's fused contrib ops (ops/microsoft/fused.py): SkipLayerNormalization,
SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization, EmbedLayerNormalization, Gelu,
BiasGelu, FastGelu, QuickGelu, BiasAdd, BiasSplitGelu, FusedMatMul, GemmFastGelu and FusedConv.

Each hand-built single-node model runs on onnxruntime (the oracle) and on ember's CPU and OpenCL
backends (contrib ops run there through a planned CPU fallback), in float32 and float16, with
optional inputs present and absent. BiasAdd, BiasSplitGelu and GemmFastGelu have no CPU kernel
in onnxruntime (CUDA/ROCm only): their oracle is onnxruntime on the equivalent unfused graph.
Then: the float16 paths round once (they equal the float32 computation rounded), GELU's negative
tail is exact, the array code runs unchanged over cupy (the numpy stand-in, or a real GPU), and
onnxruntime's transformer optimizer turns a torch-exported BERT / GPT-2 style model into these
ops, which ember runs like onnxruntime.

Tolerances: float32 within 1e-4 of max|expected|. float16 within 2e-3 of max|expected| (two
float16 ulps at the largest value): onnxruntime's float16 kernels round some intermediates to
float16 (its BiasGelu is off by one ulp on ~6% of elements, measured), while ember rounds once.
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
from ember.ops.microsoft import fused as cf
from ember.ops.registry import lookup

ort = pytest.importorskip("onnxruntime")

MS = "com.microsoft"
RNG = np.random.default_rng(20261201)
BACKENDS = ["cpu", pytest.param("opencl", marks=pytest.mark.skipif(
    unavailable_reason("opencl") is not None, reason=str(unavailable_reason("opencl"))))]
FLOATS = [np.float32, np.float16]


def rand(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


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
            initializers.append(numpy_helper.from_array(value, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
            feeds[name] = value
    node = helper.make_node(op, names, outputs, domain=domain, **(attrs or {}))
    graph = helper.make_graph([node], op, graph_inputs,
                              [onnx.ValueInfoProto(name=o) for o in outputs if o],
                              initializer=initializers)
    model = helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    return model, feeds


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
    if expected.dtype.kind in "iub":
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    scale = float(np.max(np.abs(expected.astype(np.float64)))) if expected.size else 1.0
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               rtol=rtol, atol=rtol * scale, err_msg=name)


def check(model, feeds, backend, rtol, expected=None):
    """ember on `backend` against onnxruntime (or `expected`, name -> array) on every output."""
    if expected is None:
        expected = ort_run(model, feeds)
    got = ember_run(model, feeds, backend)
    assert set(expected) <= set(got)
    for name, value in expected.items():
        assert_close(got[name], value, rtol, name)
    return got


# ---------------------------------------------------------------------------- normalisations

SKIP_SHAPES = [((2, 3, 8), (2, 3, 8)), ((2, 5, 16), (1, 5, 16)), ((3, 4, 12), (4, 12)),
               ((7, 12), (7, 12)), ((1, 1, 33), (1, 1, 33))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", SKIP_SHAPES, ids=lambda s: f"{s[0]}+{s[1]}")
@pytest.mark.parametrize("with_beta,with_bias", [(True, True), (False, False), (True, False),
                                                 (False, True)])
def test_skip_layer_normalization(backend, dtype, shapes, with_beta, with_bias):
    xs, ss = shapes
    h = xs[-1]
    inputs = [("x", rand(*xs, dtype=dtype, scale=3)), ("skip", rand(*ss, dtype=dtype)),
              ("gamma", rand(h, dtype=dtype)),
              ("beta", rand(h, dtype=dtype)) if with_beta else None,
              ("bias", rand(h, dtype=dtype)) if with_bias else None]
    while inputs[-1] is None:
        inputs.pop()
    model, feeds = node_model("SkipLayerNormalization", inputs,
                              ["y", "mean", "inv_std", "sum"], {"epsilon": 1e-5},
                              inits=("gamma", "beta"))
    got = check(model, feeds, backend, tolerance(dtype))
    assert got["mean"].dtype == np.float32 and got["mean"].shape == xs[:-1] + (1,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("outputs", [["y"], ["y", "", "", "sum"], ["y", "mean"],
                                     ["y", "", "inv_std"]], ids="-".join)
def test_skip_layer_normalization_output_subsets(backend, outputs):
    inputs = [("x", rand(2, 4, 8)), ("skip", rand(2, 4, 8)), ("gamma", rand(8)),
              ("beta", rand(8)), ("bias", rand(8))]
    model, feeds = node_model("SkipLayerNormalization", inputs, outputs)  # default epsilon
    check(model, feeds, backend, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", SKIP_SHAPES[:4], ids=lambda s: f"{s[0]}+{s[1]}")
@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_simplified_layer_normalization(backend, dtype, shapes, with_bias):
    xs, ss = shapes
    h = xs[-1]
    inputs = [("x", rand(*xs, dtype=dtype, scale=2)), ("skip", rand(*ss, dtype=dtype)),
              ("gamma", rand(h, dtype=dtype))] + \
        ([("bias", rand(h, dtype=dtype))] if with_bias else [])
    model, feeds = node_model("SkipSimplifiedLayerNormalization", inputs,
                              ["y", "mean", "inv_std", "sum"], {"epsilon": 1e-6})
    got = check(model, feeds, backend, tolerance(dtype))
    assert not got["mean"].any()  # the RMS form has no mean: 0, as onnxruntime writes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_dtype,scale_dtype", [(np.float32, np.float32),
                                                 (np.float16, np.float16),
                                                 (np.float32, np.float16),
                                                 (np.float16, np.float32)])
@pytest.mark.parametrize("shape,axis,scale_shape", [((2, 3, 8), -1, (8,)),
                                                    ((2, 3, 4, 5), -2, (4, 5)),
                                                    ((2, 3, 4, 5), 1, (3, 4, 5)),
                                                    ((2, 3, 4, 5), 2, (5,)),
                                                    ((6, 7), 0, (6, 7))])
def test_simplified_layer_normalization(backend, x_dtype, scale_dtype, shape, axis,
                                        scale_shape):
    """Default ONNX domain, as onnxruntime registers it: Y has scale's dtype, inv_std_var is
    float32 with the normalised axes kept as 1."""
    inputs = [("x", rand(*shape, dtype=x_dtype, scale=2)),
              ("scale", rand(*scale_shape, dtype=scale_dtype))]
    model, feeds = node_model("SimplifiedLayerNormalization", inputs, ["y", "inv_std"],
                              {"axis": axis, "epsilon": 1e-3}, domain="")
    got = check(model, feeds, backend, max(tolerance(x_dtype), tolerance(scale_dtype)))
    assert got["inv_std"].shape == shape[:axis % len(shape)] + (1,) * (len(shape) - axis
                                                                          % len(shape))


def test_simplified_layer_normalization_domains():
    """onnxruntime loads SimplifiedLayerNormalization only from the default domain; ember
    registers it there alone, for every default-domain opset."""
    inputs = [("x", rand(2, 8)), ("scale", rand(8))]
    for opset in (13, 17, 21):
        model, feeds = node_model("SimplifiedLayerNormalization", inputs, ["y"], domain="",
                                  opset=opset)
        check(model, feeds, "cpu", 1e-4)
    model, _ = node_model("SimplifiedLayerNormalization", inputs, ["y"], domain=MS)
    with pytest.raises(Exception, match="not a registered function/op"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(EmberError, match="unsupported"):
        ember.load(model, backend="cpu")
    assert lookup("", "SimplifiedLayerNormalization", 17) is cf.SimplifiedLayerNormalization
    assert lookup(MS, "SimplifiedLayerNormalization", 1) is None


def embed_inputs(batch, seq, hidden, dtype, segments=True, mask=None, position_ids=None,
                 vocab=30, positions=12):
    inputs = [("input_ids", RNG.integers(0, vocab, (batch, seq)).astype(np.int32)),
              ("segment_ids", RNG.integers(0, 2, (batch, seq)).astype(np.int32))
              if segments else None,
              ("word", rand(vocab, hidden, dtype=dtype)),
              ("position", rand(positions, hidden, dtype=dtype)),
              ("segment", rand(2, hidden, dtype=dtype)) if segments else None,
              ("gamma", rand(hidden, dtype=dtype)), ("beta", rand(hidden, dtype=dtype)),
              ("mask", mask) if mask is not None else None,
              ("position_ids", position_ids) if position_ids is not None else None]
    while inputs[-1] is None:
        inputs.pop()
    return inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "padded", "holes"])
@pytest.mark.parametrize("positions", ["default", "per_row", "shared"])
def test_embed_layer_normalization(backend, dtype, segments, mask_kind, positions):
    batch, seq, hidden = 3, 6, 16
    mask = None
    if mask_kind == "padded":
        mask = (np.arange(seq)[None] < np.array([[6], [4], [1]])).astype(np.int32)
    elif mask_kind == "holes":  # mask_index counts the 1s (a 2 is not a 1)
        mask = np.array([[1, 0, 1, 1, 0, 1], [2, 1, 1, 0, 0, 0], [0] * 6], np.int32)
    position_ids = None
    if positions == "per_row":
        position_ids = RNG.integers(0, 12, (batch, seq)).astype(np.int32)
    elif positions == "shared":
        position_ids = RNG.permutation(12)[:seq].reshape(1, seq).astype(np.int32)
    inputs = embed_inputs(batch, seq, hidden, dtype, segments, mask, position_ids)
    model, feeds = node_model("EmbedLayerNormalization", inputs,
                              ["y", "mask_index", "embedding_sum"], {"epsilon": 1e-5},
                              inits=("word", "position", "segment", "gamma", "beta"))
    got = check(model, feeds, backend, tolerance(dtype))
    assert got["mask_index"].dtype == np.int32


@pytest.mark.parametrize("backend", BACKENDS)
def test_embed_layer_normalization_outputs(backend):
    """The embedding_sum output is optional; onnxruntime's shape inference insists on
    mask_index, ember also runs a node with the output alone (compared with the full node)."""
    inputs = embed_inputs(2, 5, 8, np.float32, mask=np.ones((2, 5), np.int32))
    model, feeds = node_model("EmbedLayerNormalization", inputs, ["y", "mask_index"])
    full = check(model, feeds, backend, 1e-4)
    model, feeds = node_model("EmbedLayerNormalization", inputs, ["y"])
    assert_close(ember_run(model, feeds, backend)["y"], full["y"])


def test_embed_layer_normalization_random_ids_fit_the_tables():
    """The ids a check draws for a fused BERT's embeddings index inside its tables (30 words,
    2 segments, 12 positions): onnxruntime runs them."""
    from ember.importer import import_model
    from ember.golden.inputs import index_bounds, make_inputs
    from ember.runtime.session import Session

    inputs = embed_inputs(2, 5, 8, np.float32, position_ids=np.zeros((1, 5), np.int32))
    model, _ = node_model("EmbedLayerNormalization", inputs, ["y", "mask_index"],
                          inits=("word", "position", "segment", "gamma", "beta"))
    graph = import_model(model).graph
    assert index_bounds(graph) == {"input_ids": 30, "segment_ids": 2, "position_ids": 12}
    feeds = make_inputs(Session(import_model(model)).inputs, seed=3,
                        bounds=index_bounds(graph))
    assert feeds["segment_ids"].max() == 1 and 1 < feeds["input_ids"].max() < 10
    assert_close(ember_run(model, feeds)["y"], ort_run(model, feeds)["y"], 1e-4)


def test_embed_layer_normalization_rejects_bad_ids():
    for bad in ("input_ids", "position_ids"):
        inputs = embed_inputs(2, 5, 8, np.float32,
                              position_ids=np.zeros((1, 5), np.int32))
        model, feeds = node_model("EmbedLayerNormalization", inputs, ["y", "mask_index"])
        feeds[bad] = feeds[bad].copy()
        feeds[bad][0, 1] = 30 if bad == "input_ids" else 12
        with pytest.raises(Exception, match="out of range"):
            ort_run(model, feeds)
        with pytest.raises(EmberError, match="out of range"):
            ember_run(model, feeds)


# ---------------------------------------------------------------------------- GELUs

ACT_SHAPES = [(5,), (2, 3, 8), (4, 1, 17), (2, 64, 96)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["Gelu", "BiasGelu", "FastGelu", "FastGelu-bias",
                                "QuickGelu", "QuickGelu-alpha"])
def test_gelus(backend, dtype, shape, op):
    op_type, _, variant = op.partition("-")
    inputs = [("x", rand(*shape, dtype=dtype, scale=3))]
    if op_type == "BiasGelu" or variant == "bias":
        inputs.append(("bias", rand(shape[-1], dtype=dtype)))
    attrs = {"alpha": 1.25} if variant == "alpha" else {}
    model, feeds = node_model(op_type, inputs, ["y"], attrs)
    check(model, feeds, backend, tolerance(dtype))


@pytest.mark.parametrize("op", ["Gelu", "BiasGelu"])
def test_gelu_keeps_the_negative_tail(op):
    """x Phi(x) on [-13, 6] against float64, at the output's scale: float32 within a few ulp of
    max|y|, float16 within one float16 step of it, i.e. 1 + erf(x) is never evaluated in
    float16 (where it cancels below x = -2 and gelu(-3) came out 0)."""
    x = np.linspace(-13.0, 6.0, 4001)
    for dtype, steps in ((np.float32, 4), (np.float16, 1)):
        xd = x.astype(dtype)
        exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2))
                          for v in xd.astype(np.float64)])
        inputs = [("x", xd)] if op == "Gelu" else \
            [("x", xd.reshape(-1, 1)), ("b", np.zeros(1, dtype))]
        model, feeds = node_model(op, inputs, ["y"])
        got = ember_run(model, feeds)["y"].reshape(-1).astype(np.float64)
        step = float(np.spacing(dtype(np.max(np.abs(exact)))))
        assert np.max(np.abs(got - exact)) <= steps * step, dtype
        tail = (xd > -4) & (xd < -2)  # where float16's own erf would cancel
        assert np.all(got[tail] < 0), dtype


@pytest.mark.parametrize("op,specials", [("Gelu", [0.0, np.inf, np.nan]),
                                         ("FastGelu", [0.0, np.inf, -np.inf, np.nan]),
                                         ("QuickGelu", [0.0, np.inf, -np.inf, np.nan])])
def test_gelu_specials(op, specials):
    """Zeros, infinities and NaN exactly as onnxruntime gives them; far out on both sides
    within float32 precision (onnxruntime's QuickGelu flushes x sigmoid(1.702 x) to -0 at
    x = -30, ember keeps the -2e-21)."""
    x = np.array(specials, np.float32)
    model, feeds = node_model(op, [("x", x)], ["y"])
    np.testing.assert_array_equal(ember_run(model, feeds)["y"], ort_run(model, feeds)["y"])
    x = np.array([-80.0, -30.0, -1.0, 1.0, 30.0, 80.0], np.float32)
    model, feeds = node_model(op, [("x", x)], ["y"])
    np.testing.assert_allclose(ember_run(model, feeds)["y"], ort_run(model, feeds)["y"],
                               rtol=1e-6, atol=1e-20)


def bias_add_oracle(x, bias, skip):
    model, feeds = node_model_multi(
        [helper.make_node("Add", ["x", "bias"], ["t"]), helper.make_node("Add", ["t", "skip"],
                                                                         ["y"])],
        {"x": x, "bias": bias, "skip": skip})
    return ort_run(model, feeds)


def node_model_multi(nodes, feeds, opset=20):
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                            v.shape) for n, v in feeds.items()]
    graph = helper.make_graph(nodes, "g", inputs, [onnx.ValueInfoProto(name="y")])
    return helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]), feeds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 4, 8), (1, 9, 32), (3, 16)], ids=str)
def test_bias_add(backend, dtype, shape):
    """No CPU kernel in onnxruntime: the oracle is onnxruntime's Add(Add(X, bias), skip)
    (float16 rounds the inner sum there; ember rounds once)."""
    x, bias, skip = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype), \
        rand(*shape, dtype=dtype)
    expected = bias_add_oracle(x, bias, skip)
    model, feeds = node_model("BiasAdd", [("x", x), ("bias", bias), ("skip", skip)], ["y"])
    check(model, feeds, backend, tolerance(dtype), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 4, 8), (1, 9, 64), (3, 2)], ids=str)
def test_bias_split_gelu(backend, dtype, shape):
    """No CPU kernel in onnxruntime: the oracle is the unfused graph (Add, Split into halves,
    exact Gelu of the right half, Mul), evaluated by onnxruntime in float32 and rounded."""
    x, bias = rand(*shape, dtype=dtype, scale=2), rand(shape[-1], dtype=dtype)
    x32, b32 = x.astype(np.float32), bias.astype(np.float32)
    model32, feeds32 = node_model_multi([
        helper.make_node("Add", ["x", "bias"], ["s"]),
        helper.make_node("Split", ["s"], ["left", "right"], axis=-1, num_outputs=2),
        helper.make_node("Gelu", ["right"], ["g"], domain=MS),
        helper.make_node("Mul", ["left", "g"], ["y"])], {"x": x32, "bias": b32}, opset=18)
    expected = {"y": ort_run(model32, feeds32)["y"].astype(dtype)}
    model, feeds = node_model("BiasSplitGelu", [("x", x), ("bias", bias)], ["y"])
    check(model, feeds, backend, tolerance(dtype), expected)


# ---------------------------------------------------------------------------- products

def _stored(effective, trans_batch, trans):
    """The stored operand that FusedMatMul's flags turn into `effective`."""
    x = effective
    if trans and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if trans_batch and x.ndim >= 3:
        x = np.moveaxis(x, -2, 0)
    return np.ascontiguousarray(x)


MATMUL_SHAPES = [((4, 5), (5, 6)), ((3, 4, 5), (3, 5, 6)), ((2, 3, 4, 5), (2, 3, 5, 6)),
                 ((2, 1, 4, 5), (3, 5, 2)), ((5,), (5, 6)), ((2, 4, 5), (5,)),
                 ((3, 4, 5), (3, 5, 1))]
MATMUL_FLAGS = [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1),
                (1, 1, 1, 1)]
# transBatch needs equal ranks >= 3 in onnxruntime
MATMUL_CASES = [(shapes, flags) for shapes in MATMUL_SHAPES for flags in MATMUL_FLAGS
                if not (flags[2] or flags[3]) or
                (len(shapes[0]) == len(shapes[1]) and len(shapes[0]) >= 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes,flags", MATMUL_CASES,
                         ids=[f"{s}-{''.join(map(str, f))}" for s, f in MATMUL_CASES])
@pytest.mark.parametrize("alpha", [1.0, -0.375])
def test_fused_matmul(backend, dtype, shapes, flags, alpha):
    trans_a, trans_b, batch_a, batch_b = flags
    sa, sb = shapes
    eff_a, eff_b = rand(*sa, dtype=dtype), rand(*sb, dtype=dtype)
    a, b = _stored(eff_a, batch_a, trans_a), _stored(eff_b, batch_b, trans_b)
    model, feeds = node_model("FusedMatMul", [("a", a), ("b", b)], ["y"], {
        "alpha": alpha, "transA": trans_a, "transB": trans_b, "transBatchA": batch_a,
        "transBatchB": batch_b})
    expected = None
    if trans_a and len(sa) >= 2 and (len(sb) == 1 or sb[-1] == 1):
        # onnxruntime (1.32, measured) ignores transA when the product has one column (a
        # vector B): it reads A's memory untransposed. The spec's product, in float64:
        product = np.matmul(eff_a.astype(np.float64), eff_b.astype(np.float64))
        expected = {"y": (alpha * product).astype(dtype)}
    check(model, feeds, backend, tolerance(dtype), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", [((4, 8), (8, 6)), ((2, 3, 8), (8, 16)),
                                    ((2, 2, 3, 5), (5, 7))], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemm_fast_gelu(backend, dtype, shapes, with_bias):
    """No CPU kernel in onnxruntime: the oracle is onnxruntime's MatMul + FastGelu(bias),
    in float32, rounded."""
    sx, sw = shapes
    x, w, bias = rand(*sx, dtype=dtype), rand(*sw, dtype=dtype), rand(sw[-1], dtype=dtype)
    feeds32 = {"x": x.astype(np.float32), "w": w.astype(np.float32)}
    gelu_inputs = ["p"]
    if with_bias:
        feeds32["bias"] = bias.astype(np.float32)
        gelu_inputs.append("bias")
    model32, feeds32 = node_model_multi([
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("FastGelu", gelu_inputs, ["y"], domain=MS)], feeds32)
    expected = {"y": ort_run(model32, feeds32)["y"].astype(dtype)}
    inputs = [("x", x), ("w", w)] + ([("bias", bias)] if with_bias else [])
    model, feeds = node_model("GemmFastGelu", inputs, ["y"], inits=("w",))
    check(model, feeds, backend, tolerance(dtype), expected)


# ---------------------------------------------------------------------------- FusedConv

CONV_ACTIVATIONS = [("", None), ("Relu", None), ("Tanh", None), ("Sigmoid", None),
                    ("LeakyRelu", [0.15]), ("Clip", [-0.5, 0.75]), ("HardSigmoid", [0.3, 0.45])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("activation,params", CONV_ACTIVATIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("with_bias,with_z", [(True, True), (True, False), (False, True),
                                              (False, False)])
def test_fused_conv(backend, dtype, activation, params, with_bias, with_z):
    x, w = rand(2, 4, 7, 6, dtype=dtype), rand(6, 2, 3, 3, dtype=dtype)
    attrs = {"pads": [1, 0, 1, 2], "strides": [2, 1], "group": 2}
    if activation:
        attrs["activation"] = activation
    if params:
        attrs["activation_params"] = params
    out_shape = (2, 6, 4, 6)
    inputs = [("x", x), ("w", w), ("b", rand(6, dtype=dtype)) if with_bias else None,
              ("z", rand(*out_shape, dtype=dtype)) if with_z else None]
    while inputs[-1] is None:
        inputs.pop()
    model, feeds = node_model("FusedConv", inputs, ["y"], attrs, inits=("w", "b"))
    check(model, feeds, backend, tolerance(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["conv1d", "dilated", "same_upper"])
def test_fused_conv_geometry(backend, case):
    if case == "conv1d":
        x, w, attrs = rand(1, 3, 11), rand(5, 3, 4), {"pads": [2, 1]}
    elif case == "dilated":
        x, w, attrs = rand(1, 2, 9, 9), rand(3, 2, 3, 3), {"dilations": [2, 2]}
    else:
        x, w, attrs = rand(2, 2, 6, 5), rand(4, 2, 3, 2), {"auto_pad": "SAME_UPPER",
                                                            "strides": [2, 2]}
    attrs["activation"] = "Relu"
    model, feeds = node_model("FusedConv", [("x", x), ("w", w), ("b", rand(w.shape[0]))],
                              ["y"], attrs)
    check(model, feeds, backend, 1e-4)


# ---------------------------------------------------------------------------- rounding once

def _round_once_cases():
    h = 16
    f = np.float32
    yield "SkipLayerNormalization", [("x", rand(2, 5, h, scale=8)), ("skip", rand(2, 5, h)),
                                     ("gamma", rand(h)), ("beta", rand(h)), ("bias", rand(h))], 4
    yield "SkipSimplifiedLayerNormalization", [("x", rand(3, h)), ("skip", rand(3, h)),
                                               ("gamma", rand(h)), ("bias", rand(h))], 4
    yield "EmbedLayerNormalization", embed_inputs(2, 5, h, f), 3
    yield "Gelu", [("x", rand(4, 33, scale=4))], 1
    yield "BiasGelu", [("x", rand(4, 33, scale=4)), ("b", rand(33))], 1
    yield "FastGelu", [("x", rand(4, 33, scale=4)), ("b", rand(33))], 1
    yield "QuickGelu", [("x", rand(4, 33, scale=4))], 1
    yield "BiasAdd", [("x", rand(2, 3, h)), ("b", rand(h)), ("s", rand(2, 3, h))], 1
    yield "BiasSplitGelu", [("x", rand(2, 3, h, scale=3)), ("b", rand(h))], 1
    yield "FusedMatMul", [("a", rand(3, 4, 5)), ("b", rand(3, 6, 5))], 1
    yield "GemmFastGelu", [("x", rand(3, 4, 5)), ("w", rand(5, 6)), ("b", rand(6))], 1
    yield "FusedConv", [("x", rand(1, 2, 5, 5)), ("w", rand(3, 2, 3, 3)), ("b", rand(3)),
                        ("z", rand(1, 3, 3, 3))], 1


ROUND_ONCE = list(_round_once_cases())


@pytest.mark.parametrize("narrow", ["float16", "bfloat16"])
@pytest.mark.parametrize("op,inputs,n_out", ROUND_ONCE, ids=[c[0] for c in ROUND_ONCE])
def test_narrow_floats_round_once(op, inputs, n_out, narrow):
    """float16/bfloat16 nodes compute in float32 and round once: exactly the float32 node on
    the same (widened) values, rounded (statistics outputs stay float32)."""
    import ml_dtypes

    dtype = np.dtype(np.float16 if narrow == "float16" else ml_dtypes.bfloat16)
    attrs = {"transB": 1, "alpha": 0.5} if op == "FusedMatMul" else \
        {"activation": "HardSigmoid", "activation_params": [0.2, 0.5]} if op == "FusedConv" \
        else {}
    narrow_inputs = [(n, v.astype(dtype) if v.dtype == np.float32 else v)
                     for n, v in inputs]
    wide_inputs = [(n, v.astype(np.float32) if v.dtype == dtype else v)
                   for n, v in narrow_inputs]
    outputs = [f"o{i}" for i in range(n_out)]
    narrow_model, narrow_feeds = node_model(op, narrow_inputs, outputs, attrs)
    wide_model, wide_feeds = node_model(op, wide_inputs, outputs, attrs)
    got = ember_run(narrow_model, narrow_feeds)
    want = ember_run(wide_model, wide_feeds)
    for name in outputs:
        w = want[name]
        if got[name].dtype == dtype:
            w = w.astype(dtype)
        np.testing.assert_array_equal(got[name].view(np.uint16) if w.dtype == dtype
                                      else got[name], w.view(np.uint16) if w.dtype == dtype
                                      else w, err_msg=f"{op} {name}")


# ---------------------------------------------------------------------------- errors

@pytest.mark.parametrize("case", ["activation", "param_count", "bias_rank", "bias_size",
                                  "skip_batch", "gamma_size", "stash_type", "odd_split",
                                  "matmul_shapes", "segments_half"])
def test_invalid_nodes(case):
    x = ("x", rand(2, 3, 8))
    if case == "activation":
        model, feeds = node_model("FusedConv", [("x", rand(1, 2, 5, 5)), ("w", rand(3, 2, 3, 3))],
                                  ["y"], {"activation": "Elu"})
    elif case == "param_count":
        model, feeds = node_model("FusedConv", [("x", rand(1, 2, 5, 5)), ("w", rand(3, 2, 3, 3))],
                                  ["y"], {"activation": "Clip", "activation_params": [0.0]})
    elif case == "bias_rank":
        model, feeds = node_model("BiasGelu", [x, ("b", rand(3, 8))], ["y"])
    elif case == "bias_size":
        model, feeds = node_model("FastGelu", [x, ("b", rand(1))], ["y"])
    elif case == "skip_batch":
        model, feeds = node_model("SkipLayerNormalization",
                                  [x, ("s", rand(3, 3, 8)), ("g", rand(8))], ["y"])
    elif case == "gamma_size":
        model, feeds = node_model("SkipLayerNormalization",
                                  [x, ("s", rand(2, 3, 8)), ("g", rand(1, 8))], ["y"])
    elif case == "stash_type":
        model, feeds = node_model("SimplifiedLayerNormalization", [x, ("g", rand(8))], ["y"],
                                  {"stash_type": 10}, domain="")
    elif case == "odd_split":
        model, feeds = node_model("BiasSplitGelu", [("x", rand(2, 3, 7)), ("b", rand(7))],
                                  ["y"])
    elif case == "matmul_shapes":
        model, feeds = node_model("FusedMatMul", [("a", rand(2, 3, 4)), ("b", rand(3, 5))],
                                  ["y"])
    else:
        inputs = embed_inputs(2, 5, 8, np.float32)
        inputs[4] = None  # segment_ids without segment_embedding
        model, feeds = node_model("EmbedLayerNormalization", inputs, ["y", "mask_index"])
    with pytest.raises(EmberError):
        ember_run(model, feeds)


# ---------------------------------------------------------------------------- over cupy

def _device_cases():
    h = 8
    yield cf.SkipLayerNormalization, [rand(2, 3, h), rand(3, h), rand(h), rand(h), rand(h)], 4, {}
    yield cf.SkipSimplifiedLayerNormalization, [rand(2, 3, h), rand(2, 3, h), rand(h)], 4, {}
    yield cf.SimplifiedLayerNormalization, [rand(2, 3, 4), rand(3, 4)], 2, {"axis": 1}
    ids = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
    yield cf.EmbedLayerNormalization, [ids, ids % 2, rand(6, h), rand(4, h), rand(2, h), rand(h),
                                       rand(h), np.array([[1, 1, 0], [1, 1, 1]], np.int32),
                                       ids % 3], 3, {}
    yield cf.EmbedLayerNormalization, [ids, None, rand(6, h), rand(4, h), None, rand(h),
                                       rand(h)], 2, {}
    yield cf.Gelu, [rand(3000, scale=5)], 1, {}
    yield cf.BiasGelu, [rand(2, 3, h, scale=4), rand(h)], 1, {}
    yield cf.FastGelu, [rand(2, 3, h, scale=4), rand(h)], 1, {}
    yield cf.QuickGelu, [rand(2, 3, h, scale=4)], 1, {"alpha": 1.5}
    yield cf.BiasAdd, [rand(2, 3, h), rand(h), rand(2, 3, h)], 1, {}
    yield cf.BiasSplitGelu, [rand(2, 3, h), rand(h)], 1, {}
    yield cf.FusedMatMul, [rand(2, 3, 4, 5), rand(3, 4, 6, 5)], 1, \
        {"transB": 1, "transBatchA": 1, "alpha": 0.5}
    yield cf.GemmFastGelu, [rand(2, 3, h), rand(h, 4), rand(4)], 1, {}
    yield cf.FusedConv, [rand(1, 2, 5, 5), rand(3, 2, 3, 3), rand(3), rand(1, 3, 5, 5)], 1, \
        {"activation": "LeakyRelu", "activation_params": [0.1], "pads": [1, 1, 1, 1]}


DEVICE_CASES = list(_device_cases())


@pytest.fixture
def cuda():
    with cuda_backend("gpu" if real_cuda_device() else "emulated") as backend:
        yield backend


@pytest.mark.parametrize("cls,inputs,n_out,attrs", DEVICE_CASES,
                         ids=[f"{c[0].op_type}{i}" for i, c in enumerate(DEVICE_CASES)])
def test_array_code_runs_over_cupy(cuda, cls, inputs, n_out, attrs):
    """The kernels compute over `self.xp`: bound to cupy (the numpy stand-in that refuses
    host arrays mixed with device arrays, or a real GPU), they take and give device arrays and
    match the CPU kernel. (The cuda backend does not list this family yet, so sessions run
    these ops through its CPU fallback.)"""
    from ember.ir import Node
    from ember.ops.cuda._common import shared_class

    node = Node(cls.op_type, cls.domain, 1, [f"i{i}" if x is not None else ""
                                             for i, x in enumerate(inputs)],
                [f"o{i}" for i in range(n_out)], dict(attrs))
    expected = cls(node, {**cls.defaults, **attrs}).run(*inputs)
    kernel = shared_class(cls)(node, {**cls.defaults, **attrs}, device=cuda)
    got = kernel.run(*[None if x is None else cuda.to_device(x) for x in inputs])
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, cuda.xp.ndarray) and type(g) is not np.ndarray
        np.testing.assert_allclose(cuda.to_host(g), e, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- real models

def _export_bert_like(path, approximate):
    """A 2-layer, hidden-32 BERT-style encoder (word + segment + position embeddings, post-LN
    blocks with eager attention, residuals and a GELU MLP), exported by torch's TorchScript
    exporter at opset 17."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self, hidden, heads):
            super().__init__()
            self.heads, self.head = heads, hidden // heads
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

        def forward(self, x, bias):
            q, k, v = self.q(x), self.k(x), self.v(x)
            batch, seq, hidden = q.shape  # from q, so the embedding LayerNorm feeds only MatMuls

            def split(t):
                return t.reshape(batch, seq, self.heads, self.head).permute(0, 2, 1, 3)

            q, k, v = split(q), split(k), split(v)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head) + bias
            ctx = torch.matmul(torch.softmax(scores, -1), v)
            return self.o(ctx.permute(0, 2, 1, 3).reshape(batch, seq, hidden))

    class Block(nn.Module):
        def __init__(self, hidden, heads):
            super().__init__()
            self.attn = Attention(hidden, heads)
            self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.act = nn.GELU(approximate=approximate)

        def forward(self, x, bias):
            x = self.ln1(x + self.attn(x, bias))
            return self.ln2(x + self.fc2(self.act(self.fc1(x))))

    class Encoder(nn.Module):
        def __init__(self, vocab=50, hidden=32, heads=4, positions=16, layers=2):
            super().__init__()
            self.word, self.position = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
            self.segment = nn.Embedding(2, hidden)
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
            self.register_buffer("position_ids", torch.arange(positions).unsqueeze(0))

        def forward(self, input_ids, attention_mask, token_type_ids):
            seq = input_ids.shape[1]
            x = self.word(input_ids) + self.segment(token_type_ids) + \
                self.position(self.position_ids[:, :seq])
            x = self.ln(x)
            bias = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
            for block in self.blocks:
                x = block(x, bias)
            return x

    torch.manual_seed(0)
    model = Encoder().eval()
    with torch.no_grad():  # distinct LayerNorm parameters (equal ones would be deduplicated)
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64),
               torch.zeros(2, 8, dtype=torch.int64))
    torch.onnx.export(model, example, str(path), input_names=names, output_names=["out"],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names},
                      opset_version=17, dynamo=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type,approximate,gelu_op", [("bert", "none", "BiasGelu"),
                                                            ("gpt2", "tanh", "FastGelu")])
def test_transformers_optimizer_model(tmp_path, backend, model_type, approximate, gelu_op):
    """onnxruntime.transformers.optimizer fuses the exported model's Add + LayerNormalization
    into SkipLayerNormalization, bias + GELU into BiasGelu / FastGelu and the embeddings into
    EmbedLayerNormalization (attention fusion off: com.microsoft::Attention is not ours);
    ember runs the optimised model like onnxruntime and like the original."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    source, fused = tmp_path / "model.onnx", tmp_path / "model_opt.onnx"
    _export_bert_like(source, approximate)
    options = FusionOptions(model_type)
    options.enable_attention = False
    optimized = optimizer.optimize_model(str(source), model_type=model_type, num_heads=4,
                                         hidden_size=32, use_gpu=False, opt_level=0,
                                         optimization_options=options)
    optimized.save_model_to_file(str(fused))
    proto = onnx.load(str(fused))
    ops = [(n.domain, n.op_type) for n in proto.graph.node]
    assert ops.count((MS, "SkipLayerNormalization")) == 4, ops
    assert ops.count((MS, gelu_op)) == 2, ops
    assert (MS, "EmbedLayerNormalization") in ops, ops
    assert not [op for op in ops if op[0] not in ("", MS)]

    feeds = {"input_ids": RNG.integers(0, 50, (3, 7)).astype(np.int64),
             "attention_mask": (np.arange(7)[None] < np.array([[7], [5], [2]])).astype(np.int64),
             "token_type_ids": RNG.integers(0, 2, (3, 7)).astype(np.int64)}
    expected = ort_run(proto, feeds)
    got = check(proto, feeds, backend, 1e-4, expected)
    original = ember_run(onnx.load(str(source)), feeds, "cpu")
    assert_close(got["out"], original["out"], 1e-4)
