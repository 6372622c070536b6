"""The OpenCL kernels of the fused ops (ai.ember::FusedConv, FusedGemm, FusedMatMul): graphs the
simplifier fuses, loaded with backend="opencl", must contain the fused op, run it on the device
(no per-call CPU fallback), and match onnxruntime on the original model.

Covers every fused activation (Gelu in both forms), bias and residual, batch 1 and 3, sizes
that don't divide the GEMM's 8 x 32 (float32) blocks (edge blocks take the scalar epilogue,
inner ones the vector epilogue), the GEMM convolution and the direct (depthwise / small-group)
one, and the cases that fall back to the CPU kernel per call.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from backends import present_backends
from ember.ops.fused import DOMAIN
from ember.runtime.backends import get_backend

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif("opencl" not in present_backends(),
                                reason="the OpenCL backend is unavailable")
F, D, H = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16
RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def tensor(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def make_model(nodes, inputs, outputs, inits=(), opset=20):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 18 else 10
    return model


def assert_close(actual, expected, rtol=1e-5):
    scale = float(np.max(np.abs(expected))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def run_fused(proto, feeds, fused, on_device=True, expected=None, rtol=1e-5):
    """Load `proto` on OpenCL (simplified), check that its nodes are exactly `fused` (sorted op
    types, all in ai.ember), that they are placed on the device (`on_device`) or, for dtypes
    the device kernels lack, on the host at plan time, that no kernel falls back at run time,
    and that the outputs match `expected` (default: onnxruntime on the original model).
    Returns the session."""
    if expected is None:
        expected = ort.InferenceSession(proto.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)
    session = ember.load(proto, backend="opencl")
    nodes = session.model.graph.nodes
    assert sorted(n.op_type for n in nodes) == sorted(fused)
    assert all(n.domain == DOMAIN for n in nodes)
    placed = "device" if on_device else "fallback"
    assert [where for _, op, where in session.placement if op in fused] == [placed] * len(fused)
    backend = get_backend("opencl")
    before = backend.fallbacks
    got = session.run(feeds)
    assert backend.fallbacks == before
    assert len(got) == len(expected)
    for actual, want in zip(got.values(), expected):
        assert actual.shape == want.shape and actual.dtype == want.dtype
        assert_close(actual, want, rtol)
    return session


# (op, attributes, extra constant inputs)
ACTIVATIONS = [
    ("Relu", {}, []), ("LeakyRelu", {"alpha": 0.2}, []), ("Sigmoid", {}, []), ("Tanh", {}, []),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, []), ("HardSwish", {}, []),
    ("Clip", {}, [("lo", np.float32(-0.5)), ("hi", np.float32(0.7))]),
    ("Clip", {}, [("lo", np.float32(0.0))]),  # no upper bound: inf as a kernel argument
    ("Gelu", {}, []), ("Gelu", {"approximate": "tanh"}, []),
]
IDS = ["Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Clip", "ClipMin",
       "Gelu", "GeluTanh"]


def act_node(act, attrs, bounds, src, out):
    inputs = [src] + [n for n, _ in bounds]
    return helper.make_node(act, inputs, [out], **attrs)


def act_inits(bounds):
    return [const(n, v) for n, v in bounds]


# -- FusedConv ----------------------------------------------------------------------------------

@pytest.mark.parametrize("act, attrs, bounds", ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_conv_bias_activation(act, attrs, bounds, batch):
    # 11 output channels: a full 8-row block and a partial one; 4 x 7 = 28 positions: < 32
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 0, 1, 0], strides=[2, 1]),
             act_node(act, attrs, bounds, "c", "y")]
    inits = [const("w", rand(11, 3, 3, 2)), const("b", rand(11))] + act_inits(bounds)
    feeds = {"x": rand(batch, 3, 7, 8)}
    proto = make_model(nodes, [tensor("x", [batch, 3, 7, 8])], [tensor("y", None)], inits)
    run_fused(proto, feeds, ["FusedConv"])


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_and_gemm_silu_as_swish(batch):
    """SiLU written out (Sigmoid, Mul) and ONNX's Swish (alpha 0.7) fuse into the product as
    activation Swish and run on the device."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"]),
             helper.make_node("Gemm", ["a", "gw", "gb"], ["g"], transB=1),
             helper.make_node("Swish", ["g"], ["y2"], alpha=0.7)]
    inits = [const("w", rand(11, 3, 3, 3)), const("b", rand(11)), const("gw", rand(9, 7)),
             const("gb", rand(9))]
    feeds = {"x": rand(batch, 3, 7, 8) * 3, "a": rand(batch, 7) * 3}
    proto = make_model(nodes, [tensor("x", [batch, 3, 7, 8]), tensor("a", [batch, 7])],
                       [tensor("y", None), tensor("y2", None)], inits, opset=24)
    session = run_fused(proto, feeds, ["FusedConv", "FusedGemm"])
    assert [n.attrs["activation"] for n in session.model.graph.nodes] == ["Swish"] * 2


@pytest.mark.parametrize("act, attrs, bounds", ACTIVATIONS, ids=IDS)
def test_conv_residual_activation_across_blocks(act, attrs, bounds):
    # a ResNet-like block on a 67 x 61 image: 4087 positions (127 whole 32-column blocks, one
    # partial), 16 channels (two whole 8-row blocks): both epilogues with bias, Z, activation
    nodes = [helper.make_node("Conv", ["x", "k", "kb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]),
             act_node(act, attrs, bounds, "s", "y")]
    inits = [const("k", rand(16, 16, 3, 3) * 0.2), const("kb", rand(16))] + act_inits(bounds)
    feeds = {"x": rand(2, 16, 67, 61)}
    proto = make_model(nodes, [tensor("x", [2, 16, 67, 61])], [tensor("y", None)], inits)
    session = run_fused(proto, feeds, ["FusedConv"])
    assert len(session.model.graph.nodes[0].inputs) == 4


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_residual_without_activation_or_bias(batch):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["x", "c"], ["y"])]
    feeds = {"x": rand(batch, 5, 9, 7)}
    proto = make_model(nodes, [tensor("x", [batch, 5, 9, 7])], [tensor("y", [batch, 5, 9, 7])],
                       [const("w", rand(5, 5, 3, 3))])
    session = run_fused(proto, feeds, ["FusedConv"])
    node = session.model.graph.nodes[0]
    assert node.inputs[2] == "" and len(node.inputs) == 4


@pytest.mark.parametrize("act, attrs, bounds", [ACTIVATIONS[i] for i in (0, 5, 6, 9)],
                         ids=[IDS[i] for i in (0, 5, 6, 9)])
@pytest.mark.parametrize("group, out_channels", [(12, 12), (12, 24), (3, 12), (2, 18)])
def test_grouped_conv(act, attrs, bounds, group, out_channels):
    # depthwise (12, 12), channel multiplier 2 (12, 24) and 4 outputs per group (3, 12) take
    # the direct kernel; 9 outputs per group (2, 18) the batched GEMM
    c = 12
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2],
                              group=group),
             helper.make_node("Add", ["c", "r"], ["s"]),
             act_node(act, attrs, bounds, "s", "y")]
    inits = [const("w", rand(out_channels, c // group, 3, 3)), const("b", rand(out_channels))]
    out = [3, out_channels, 31, 34]
    feeds = {"x": rand(3, c, 61, 67), "r": rand(*out)}
    proto = make_model(nodes, [tensor("x", [3, c, 61, 67]), tensor("r", out)],
                       [tensor("y", None)], inits + act_inits(bounds))
    run_fused(proto, feeds, ["FusedConv"])


def test_pointwise_and_1d_conv():
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"]),
             helper.make_node("HardSwish", ["c"], ["y"]),
             helper.make_node("Conv", ["t", "w2"], ["d"], pads=[2, 2], dilations=[2]),
             helper.make_node("LeakyRelu", ["d"], ["z"])]
    inits = [const("w1", rand(7, 10, 1, 1)), const("b1", rand(7)), const("w2", rand(9, 4, 3))]
    feeds = {"x": rand(1, 10, 61, 67), "t": rand(3, 4, 131)}
    proto = make_model(nodes, [tensor("x", [1, 10, 61, 67]), tensor("t", [3, 4, 131])],
                       [tensor("y", None), tensor("z", None)], inits)
    run_fused(proto, feeds, ["FusedConv", "FusedConv"])


# -- FusedGemm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("act, attrs, bounds", ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 67])
def test_gemm_activation(act, attrs, bounds, rows):
    nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["g"], transB=1),
             act_node(act, attrs, bounds, "g", "y")]
    inits = [const("w", rand(131, 37)), const("c", rand(131))] + act_inits(bounds)
    feeds = {"a": rand(rows, 37)}
    proto = make_model(nodes, [tensor("a", [rows, 37])], [tensor("y", None)], inits)
    run_fused(proto, feeds, ["FusedGemm"])


@pytest.mark.parametrize("c_shape", [[1], [67, 1], [67, 64], None])
def test_gemm_alpha_beta_and_c_shapes(c_shape):
    # 67 x 64: whole column blocks, a partial row block; C per row, per element or absent
    inputs = ["a", "w"] + (["c"] if c_shape else [])
    nodes = [helper.make_node("Gemm", inputs, ["g"], transA=1, alpha=0.5, beta=2.0),
             helper.make_node("Sigmoid", ["g"], ["y"])]
    inits = [const("w", rand(19, 64))] + ([const("c", rand(*c_shape))] if c_shape else [])
    feeds = {"a": rand(19, 67)}
    proto = make_model(nodes, [tensor("a", [19, 67])], [tensor("y", None)], inits)
    run_fused(proto, feeds, ["FusedGemm"])


# -- FusedMatMul --------------------------------------------------------------------------------

@pytest.mark.parametrize("act, attrs, bounds", ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("a_shape", [[1, 1, 37], [3, 271, 37], [2, 3, 7, 37]])
def test_matmul_bias_residual_activation(act, attrs, bounds, a_shape):
    out = a_shape[:-1] + [131]
    nodes = [helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["mb"]),
             helper.make_node("Add", ["mb", "r"], ["s"]),
             act_node(act, attrs, bounds, "s", "y")]
    inits = [const("w", rand(37, 131)), const("bias", rand(131))] + act_inits(bounds)
    feeds = {"a": rand(*a_shape), "r": rand(*out)}
    proto = make_model(nodes, [tensor("a", a_shape), tensor("r", out)], [tensor("y", out)],
                       inits)
    session = run_fused(proto, feeds, ["FusedMatMul"])
    assert len(session.model.graph.nodes[0].inputs) == 4


@pytest.mark.parametrize("act, attrs, bounds", [ACTIVATIONS[i] for i in (2, 8)],
                         ids=[IDS[i] for i in (2, 8)])
@pytest.mark.parametrize("a_shape", [[1, 7], [5, 7], [3, 5, 7]])
def test_matmul_bias_activation_without_residual(act, attrs, bounds, a_shape):
    # rank 2 becomes Gemm (then FusedGemm), higher ranks FusedMatMul
    nodes = [helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["bias", "m"], ["mb"]),
             act_node(act, attrs, bounds, "mb", "y")]
    inits = [const("w", rand(7, 64)), const("bias", rand(64))] + act_inits(bounds)
    feeds = {"a": rand(*a_shape)}
    proto = make_model(nodes, [tensor("a", a_shape)], [tensor("y", None)], inits)
    run_fused(proto, feeds, ["FusedGemm" if len(a_shape) == 2 else "FusedMatMul"])


@pytest.mark.parametrize("a_shape", [[1, 1, 7], [2, 5, 7], [3, 33, 7]])
def test_layer_scale_folds_and_residual_fuses_into_matmul(a_shape):
    nodes = [helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["mb"]),
             helper.make_node("Mul", ["mb", "gamma"], ["scaled"]),
             helper.make_node("Add", ["a", "scaled"], ["y"])]
    inits = [const("w", rand(7, 7)), const("bias", rand(7)), const("gamma", rand(7))]
    proto = make_model(nodes, [tensor("a", a_shape)], [tensor("y", a_shape)], inits)
    session = run_fused(proto, {"a": rand(*a_shape)}, ["FusedMatMul"])
    assert len(session.model.graph.nodes[0].inputs) == 4


# -- other dtypes and the CPU fallback ------------------------------------------------------

def test_float64_runs_on_device():
    # onnxruntime has no double Conv: ember's CPU kernels on the unsimplified model instead
    nodes = [helper.make_node("Conv", ["x", "k", "kb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["cs"]),
             helper.make_node("Gelu", ["cs"], ["y1"]),
             helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["mb"]),
             helper.make_node("Add", ["mb", "r"], ["s"]),
             helper.make_node("Tanh", ["s"], ["y2"])]
    inits = [const("k", rand(6, 6, 3, 3, dtype=np.float64)), const("kb", rand(6, dtype=np.float64)),
             const("w", rand(37, 131, dtype=np.float64)),
             const("bias", rand(131, dtype=np.float64))]
    feeds = {"x": rand(2, 6, 67, 61, dtype=np.float64), "a": rand(3, 27, 37, dtype=np.float64),
             "r": rand(3, 27, 131, dtype=np.float64)}
    proto = make_model(nodes, [tensor(n, list(v.shape), D) for n, v in feeds.items()],
                       [tensor("y1", None, D), tensor("y2", None, D)], inits)
    expected = list(ember.load(proto, backend="cpu", simplify=False).run(feeds).values())
    run_fused(proto, feeds, ["FusedConv", "FusedMatMul"], expected=expected, rtol=1e-12)


def test_float16_is_placed_on_the_host():
    nodes = [helper.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["cs"]),
             helper.make_node("Relu", ["cs"], ["y1"]),
             helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["mb"]),
             helper.make_node("Sigmoid", ["mb"], ["y2"])]
    inits = [const("k", rand(4, 4, 3, 3, dtype=np.float16) * np.float16(0.2)),
             const("w", rand(7, 9, dtype=np.float16)), const("bias", rand(9, dtype=np.float16))]
    feeds = {"x": rand(1, 4, 7, 5, dtype=np.float16), "a": rand(2, 3, 7, dtype=np.float16)}
    proto = make_model(nodes, [tensor(n, list(v.shape), H) for n, v in feeds.items()],
                       [tensor("y1", None, H), tensor("y2", None, H)], inits)
    expected = list(ember.load(proto, backend="cpu", simplify=False).run(feeds).values())
    run_fused(proto, feeds, ["FusedConv", "FusedMatMul"], on_device=False, expected=expected,
              rtol=1e-2)


# -- fused nodes written directly: shapes the simplifier does not make -----------------------

@pytest.mark.parametrize("a_shape, b_shape, bias_shape, on_device", [
    ([5, 7], [7], [5], True),              # b a vector: the bias runs along M
    ([7], [7, 9], [9], True),              # a a vector
    ([3, 5, 7], [7, 9], [], True),         # one bias value
    ([3, 5, 7], [7, 9], [1, 1, 9], True),  # leading size-1 axes
    ([5, 7], [7, 9], [1, 1, 9], False),    # a bias that adds an axis: the CPU broadcasts
    ([5, 7], [7, 9], [5, 1], False),       # a bias per row
    ([2, 1, 5, 7], [3, 7, 9], [9], True),  # broadcast batch axes
])
def test_fused_matmul_node_shapes(a_shape, b_shape, bias_shape, on_device):
    a, b, bias = rand(*a_shape), rand(*b_shape), rand(*bias_shape)
    z = rand(*np.matmul(a, b).shape)  # Z has the product's shape; the bias may broadcast it
    node = helper.make_node("FusedMatMul", ["a", "b", "bias", "z"], ["y"], domain=DOMAIN,
                            activation="LeakyRelu", activation_params=[0.3])
    graph = helper.make_graph([node], "g", [tensor("a", a_shape), tensor("b", b_shape),
                                            tensor("bias", bias_shape), tensor("z", z.shape)],
                              [tensor("y", None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid(DOMAIN, 1)])
    feeds = {"a": a, "b": b, "bias": bias, "z": z}
    y = np.matmul(a, b) + bias + z
    want = np.where(y < 0, y * np.float32(0.3), y)
    session = ember.load(proto, backend="opencl", simplify=False)
    backend = get_backend("opencl")
    before = backend.fallbacks
    got = session.run(feeds)["y"]
    assert (backend.fallbacks == before) == on_device
    assert got.shape == want.shape
    assert_close(got, want)


def test_fused_node_errors_match_the_cpu():
    from ember.errors import InvalidModelError

    node = helper.make_node("FusedMatMul", ["a", "b", "", "z"], ["y"], domain=DOMAIN)
    graph = helper.make_graph([node], "g", [tensor("a", [3, 7]), tensor("b", [7, 9]),
                                            tensor("z", [3, 8])], [tensor("y", None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid(DOMAIN, 1)])
    feeds = {"a": rand(3, 7), "b": rand(7, 9), "z": rand(3, 8)}
    for backend in ("cpu", "opencl"):
        with pytest.raises(InvalidModelError, match="residual Z has shape"):
            ember.load(proto, backend=backend, simplify=False).run(feeds)
