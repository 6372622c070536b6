"""Importer and planner behaviour, checked against onnx's reference evaluator (a test oracle)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import ember
from ember.importer import import_model
from ember.runtime.executor import Plan

F = TensorProto.FLOAT


def _vi(name, shape=(3,), elem=F):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _check_against_reference(model: onnx.ModelProto, feeds: dict, oracle: str = "onnx") -> None:
    if oracle == "onnx":
        expected = ReferenceEvaluator(model).run(None, feeds)
    else:
        import onnxruntime as ort
        expected = ort.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)
    got = list(ember.load(model).run(feeds).values())
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def _scaled_add_function() -> onnx.FunctionProto:
    # ScaledAdd(a, b; alpha) = a + alpha * b, with alpha defaulting to 2.0
    nodes = [
        helper.make_node("Constant", [], ["alpha_t"], value_float=0.0),
        helper.make_node("Mul", ["b", "alpha_t"], ["scaled"]),
        helper.make_node("Add", ["a", "scaled"], ["out"]),
    ]
    nodes[0].attribute[0].ref_attr_name = "alpha"
    nodes[0].attribute[0].name = "value_float"
    fn = helper.make_function("com.local", "ScaledAdd", ["a", "b"], ["out"], nodes,
                              [helper.make_opsetid("", 17)], attributes=[])
    default = helper.make_attribute("alpha", 2.0)
    fn.attribute_proto.append(default)
    return fn


def test_model_local_functions_are_inlined_with_attributes():
    fn = _scaled_add_function()
    graph = helper.make_graph(
        [helper.make_node("ScaledAdd", ["x", "y"], ["t"], domain="com.local", alpha=0.5),
         helper.make_node("ScaledAdd", ["t", "y"], ["z"], domain="com.local")],  # default alpha
        "g", [_vi("x"), _vi("y")], [_vi("z")])
    model = helper.make_model(graph, functions=[fn], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.local", 1)])
    ir = import_model(model)
    assert [n.op_type for n in ir.graph.nodes] == ["Constant", "Mul", "Add"] * 2
    x, y = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    # onnx's reference evaluator ignores function attribute defaults; onnxruntime honours them.
    _check_against_reference(model, {"x": x, "y": y}, oracle="onnxruntime")
    np.testing.assert_allclose(ember.load(model).run({"x": x, "y": y})["z"], x + 2.5)


def test_node_binds_to_since_version_in_force():
    # Softmax changed semantics at opset 13: before, the input is coerced to 2-D at `axis`;
    # from 13 on, it is normalised along `axis` alone. (onnx's reference evaluator applies the
    # new semantics to every version, so onnxruntime is the oracle here.)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    results = {}
    for opset in (11, 13):
        graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=1)], "g",
                                  [_vi("x", x.shape)], [_vi("y", x.shape)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        _check_against_reference(model, {"x": x}, oracle="onnxruntime")
        results[opset] = ember.load(model).run({"x": x})["y"]
    np.testing.assert_allclose(results[11].reshape(2, 12).sum(axis=1), 1, rtol=1e-6)
    np.testing.assert_allclose(results[13].sum(axis=1), 1, rtol=1e-6)


def test_if_branches_read_outer_scope_values():
    then_g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["r"])], "then", [], [_vi("r")])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "w"], ["r2"])], "else", [], [_vi("r2")])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["w"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        "g", [_vi("x"), _vi("c", (), TensorProto.BOOL)], [_vi("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    node = import_model(model).graph.nodes[1]
    assert node.implicit_inputs == ["x", "w"]
    x = np.array([1, 2, 3], np.float32)
    for c in (True, False):
        _check_against_reference(model, {"x": x, "c": np.array(c)})


def test_unsorted_graph_is_ordered():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"])],
        "g", [_vi("x")], [_vi("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([-1, 0, 2], np.float32)
    np.testing.assert_array_equal(ember.load(model).run({"x": x})["y"], np.maximum(-x, 0))


def test_undefined_value_is_reported():
    graph = helper.make_graph([helper.make_node("Relu", ["ghost"], ["y"])], "g", [_vi("x")], [_vi("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ember.InvalidModelError, match="reads 'ghost'"):
        ember.load(model)


def test_values_are_freed_after_last_use():
    # a -> b -> c -> y: each intermediate dies at the step that consumes it.
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
         helper.make_node("Neg", ["b"], ["y"])], "g", [_vi("x")], [_vi("y")])
    plan = Plan(import_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)])).graph)
    freed = [{name for name, slot in plan.slots.items() if slot in step.frees} for step in plan.steps]
    assert freed == [{"x"}, {"a"}, {"b"}]
    assert "y" not in set().union(*freed)
