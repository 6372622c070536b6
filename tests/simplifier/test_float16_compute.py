"""compute_float16_in_float32: on the CPU, float16 graphs compute in float32 with float16 only at
their boundaries, as onnxruntime's CPU provider computes them. Checked against onnxruntime
(closer than the literal float16 graph), for the outputs' float16 type, and on the simplified
graph (no float16 computation left; integer and type-sensitive nodes untouched)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.importer import import_model
from ember.simplifier import simplify

ort = pytest.importorskip("onnxruntime")
F, H, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
PASS = "compute_float16_in_float32"


@pytest.fixture(autouse=True)
def strict_simplifier(monkeypatch):
    monkeypatch.setenv("EMBER_SIMPLIFY_STRICT", "1")


def make_model(nodes, inputs, outputs, inits=(), opset=20):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def tensor(name, shape, dtype=H):
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def half(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def dtype_of(graph, name):
    if name in graph.initializers:
        return graph.initializers[name].dtype
    info = graph.value_info.get(name) or next(
        (v for v in graph.inputs + graph.outputs if v.name == name), None)
    return None if info is None or info.type is None else info.type.dtype


def half_compute(graph):
    """The simplified graph's nodes, other than casts, that read or write float16."""
    return [n for n in graph.nodes if n.op_type != "Cast" and any(
        dtype_of(graph, v) == np.float16 for v in n.inputs + n.outputs if v)]


def error(got, want):
    """Largest difference relative to the largest magnitude of `want`."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_ort(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def check(proto, feeds, bar=2 ** -10, reference=None):
    """Simplified with the pass, ember matches onnxruntime within `bar` (relative to each
    output's largest magnitude; 2**-10 is one float16 rounding) and is as close to
    `reference` (default: onnxruntime's outputs) as the literal float16 graph, with the
    outputs' declared types; returns the simplified graph."""
    want = run_ort(proto, feeds)
    got = list(ember.load(proto).run(feeds).values())
    model = simplify(import_model(proto))
    literal = list(ember.load(simplify(import_model(proto), skip=[PASS])).run(feeds).values())
    for out, expected, actual, plain, best in zip(proto.graph.output, want, got, literal,
                                                  reference or want):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, out.name
        if actual.dtype.kind != "f":
            np.testing.assert_array_equal(actual, expected)
            continue
        assert error(actual, expected) <= bar, (out.name, error(actual, expected))
        assert error(actual, best) <= error(plain, best) + 1e-7, out.name
    return model.graph


def _mlp(rng, d=64, hidden=96, extra_output=False):
    """x16 -> MatMul -> Add -> Gelu -> MatMul -> Add = y16 (with `extra_output`, the Gelu's
    result is an output too)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["p1"]),
             helper.make_node("Add", ["p1", "b1"], ["a1"]),
             helper.make_node("Gelu", ["a1"], ["g"]),
             helper.make_node("MatMul", ["g", "w2"], ["p2"]),
             helper.make_node("Add", ["p2", "b2"], ["y"])]
    inits = [const("w1", half(rng, d, hidden, scale=d ** -0.5)), const("b1", half(rng, hidden)),
             const("w2", half(rng, hidden, d, scale=hidden ** -0.5)), const("b2", half(rng, d))]
    outputs = [tensor("y", ["n", 8, d])] + ([tensor("g", ["n", 8, hidden])] if extra_output
                                            else [])
    return make_model(nodes, [tensor("x", ["n", 8, d])], outputs, inits)


def test_matmul_add_gelu_chain_computes_in_float32():
    rng = np.random.default_rng(0)
    graph = check(_mlp(rng), {"x": half(rng, 2, 8, 64)})
    assert not half_compute(graph), half_compute(graph)
    assert all(a.dtype != np.float16 for a in graph.initializers.values())
    # the input is cast once, the output once, and the weights were converted at load
    assert [n.op_type for n in graph.nodes].count("Cast") == 2


def test_an_output_inside_the_chain_keeps_float16():
    rng = np.random.default_rng(1)
    graph = check(_mlp(rng, extra_output=True), {"x": half(rng, 3, 8, 64)})
    assert not half_compute(graph)
    assert {v.name: v.type.dtype for v in graph.outputs} == {"y": np.float16, "g": np.float16}
    assert [n.op_type for n in graph.nodes].count("Cast") == 3  # x in, y and g out


def test_layernorm_and_softmax():
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1),
             helper.make_node("Transpose", ["n"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["n", "t"], ["s"]),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1)]
    proto = make_model(nodes, [tensor("x", [2, 16, 32])], [tensor("y", [2, 16, 16])],
                       [const("scale", half(rng, 32)), const("bias", half(rng, 32))])
    graph = check(proto, {"x": half(rng, 2, 16, 32, scale=3)})
    assert not half_compute(graph)


def test_a_cast_to_float16_the_model_makes():
    """x32 -> Cast<f16> = h (an output, exactly as cast) -> Mul(c16) -> Sqrt = y16: the Mul
    reads x32 (the cast pair onnxruntime drops), h keeps its Cast."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=H),
             helper.make_node("Mul", ["h", "c"], ["m"]),
             helper.make_node("Abs", ["m"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["y"])]
    proto = make_model(nodes, [tensor("x", [4, 32], F)], [tensor("y", [4, 32]),
                                                         tensor("h", [4, 32])],
                       [const("c", half(rng, 32))])
    x = (rng.standard_normal((4, 32)) * 100).astype(np.float32)
    graph = check(proto, {"x": x})
    assert not half_compute(graph)
    # x feeds the cast that makes h, and the arithmetic (fused or not) directly
    assert sorted(n.op_type == "Cast" for n in graph.nodes if "x" in n.inputs) == [False, True]
    got = ember.load(proto).run({"x": x})
    np.testing.assert_array_equal(got["h"], x.astype(np.float16))


def test_integer_and_type_sensitive_nodes_are_untouched():
    """An int64 branch, a Shape of a float16 value, and a float16 value cast to int32: the
    integer nodes keep their types and a Cast to an integer keeps reading float16."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Mul", ["x", "c"], ["m"]),
             helper.make_node("Shape", ["m"], ["s"]),
             helper.make_node("Add", ["i", "s"], ["j"]),
             helper.make_node("Mul", ["j", "i"], ["k"]),
             helper.make_node("Cast", ["m"], ["q"], to=TensorProto.INT32),
             helper.make_node("Exp", ["m"], ["y"])]
    proto = make_model(nodes, [tensor("x", [3, 5]), tensor("i", [2], I64)],
                       [tensor("y", [3, 5]), tensor("k", [2], I64),
                        tensor("q", [3, 5], TensorProto.INT32)],
                       [const("c", np.full(5, 2.5, np.float16))])
    graph = check(proto, {"x": half(rng, 3, 5), "i": np.array([7, -2], np.int64)})
    assert not half_compute(graph)
    for node in graph.nodes:
        if node.op_type in ("Add", "Mul") and "c" not in "".join(node.inputs):
            if "i" in node.inputs:
                assert all(dtype_of(graph, v) == np.int64 for v in node.inputs + node.outputs)
    cast = next(n for n in graph.nodes if n.outputs == ["q"])
    assert dtype_of(graph, cast.inputs[0]) == np.float16  # the value the model casts


def test_model_converted_by_onnxconverter_common():
    """A float32 block (MatMul, Add, LayerNorm, Relu, Softmax) converted to float16, with and
    without keep_io_types: closer to the float32 model than the literal float16 graph."""
    float16 = pytest.importorskip("onnxconverter_common.float16")
    rng = np.random.default_rng(5)
    f = lambda *shape: (rng.standard_normal(shape) / 4).astype(np.float32)  # noqa: E731
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
             helper.make_node("Add", ["p", "b"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "g", "beta"], ["n"], axis=-1),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["rs"]),
             helper.make_node("Softmax", ["rs"], ["y"], axis=-1)]
    proto = make_model(nodes, [tensor("x", [2, 6, 32], F)], [tensor("y", [2, 12, 24], F)],
                       [const("w", f(32, 48)), const("b", f(48)), const("g", f(48) + 1),
                        const("beta", f(48)), const("shape", np.array([2, 12, 24], np.int64))])
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    for keep_io_types in (True, False):
        converted = float16.convert_float_to_float16(proto, keep_io_types=keep_io_types)
        feeds = {"x": x if keep_io_types else x.astype(np.float16)}
        reference = [y.astype(np.float32 if keep_io_types else np.float16)
                     for y in run_ort(proto, {"x": x})]
        graph = check(converted, feeds, reference=reference)
        assert not half_compute(graph), keep_io_types
        assert graph.outputs[0].type.dtype == (np.float32 if keep_io_types else np.float16)


def test_switched_off_and_other_targets_keep_float16():
    proto = _mlp(np.random.default_rng(6))
    assert half_compute(simplify(import_model(proto), skip=[PASS]).graph)
    assert half_compute(simplify(import_model(proto), portable=True).graph)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_WIDEN_HALF", "0")
        assert half_compute(simplify(import_model(proto)).graph)


def test_a_second_simplify_changes_nothing():
    model = simplify(import_model(_mlp(np.random.default_rng(7), extra_output=True)))
    stats: dict = {}
    simplify(model, stats=stats)
    assert PASS not in stats, stats


def test_a_subgraph_reading_a_float16_value():
    """An If whose branches read the float16 value the outer graph computes: the If reads it
    as float16 (its branches are typed so); the outer Mul computes in float32."""
    rng = np.random.default_rng(8)
    branches = []
    for op in ("Exp", "Tanh"):
        nodes = [helper.make_node("Mul", ["m", "k"], ["mk"]), helper.make_node(op, ["mk"], ["o"])]
        branches.append(helper.make_graph(nodes, op, [], [tensor("o", [4, 8])],
                                          initializer=[const("k", np.float16(0.5))]))
    nodes = [helper.make_node("Mul", ["x", "c"], ["m"]),
             helper.make_node("If", ["flag"], ["y"], then_branch=branches[0],
                              else_branch=branches[1])]
    proto = make_model(nodes, [tensor("x", [4, 8]), tensor("flag", [], TensorProto.BOOL)],
                       [tensor("y", [4, 8])], [const("c", half(rng, 8))])
    for flag in (True, False):
        graph = check(proto, {"x": half(rng, 4, 8), "flag": np.array(flag)})
        branch = next(n for n in graph.nodes if n.op_type == "If")
        assert dtype_of(graph, branch.implicit_inputs[0]) == np.float16
        assert [n.op_type for n in half_compute(graph)] == ["If"]  # its output is float16
