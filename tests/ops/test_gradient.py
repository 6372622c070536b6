"""ai.onnx.preview.training::Gradient, expanded by importer/gradient.py into ordinary nodes.

The oracle is numerical: central finite differences of sum(Y), computed by running the forward
model (without the Gradient node) in ember itself, in float64.
"""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ember
from ember.importer import import_model
from ember.importer.gradient import expand_gradient_nodes
from onnx_suites import assert_outputs_match, load_case_dir, suite_case_dirs

D = TensorProto.DOUBLE
TRAINING = "ai.onnx.preview.training"


def _models(nodes, inputs, y, xs, zs=(), opset=13, grad_inputs=None):
    """(forward model with output y, model with outputs y and dY/dX for X in xs)."""
    vis = [helper.make_tensor_value_info(n, D, s) for n, s in inputs]
    y_info = helper.make_tensor_value_info(y, D, None)
    fwd = helper.make_model(helper.make_graph(nodes, "fwd", vis, [y_info]),
                            opset_imports=[helper.make_opsetid("", opset)])
    outs = [f"d_{x}" for x in xs]
    attrs = {"xs": list(xs), "y": y, **({"zs": list(zs)} if zs else {})}
    grad = helper.make_node("Gradient", grad_inputs or list(xs) + list(zs), outs, domain=TRAINING,
                            **attrs)
    full = helper.make_model(
        helper.make_graph(nodes + [grad], "grad", vis,
                          [y_info] + [helper.make_tensor_value_info(o, D, None) for o in outs]),
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)])
    return fwd, full


def _load_expanded(model: onnx.ModelProto) -> ember.Session:
    ir = import_model(model)
    expand_gradient_nodes(ir.graph, ir.opsets[""])  # a no-op once the importer does it
    assert not any(n.op_type == "Gradient" for n in ir.graph.nodes)
    return ember.load(ir)


def _numeric_grad(fwd: onnx.ModelProto, feeds: dict, x: str, eps: float = 1e-6) -> np.ndarray:
    sess = ember.load(fwd)
    y = fwd.graph.output[0].name
    grad = np.zeros_like(feeds[x])
    for i in np.ndindex(feeds[x].shape):
        total = []
        for step in (eps, -eps):
            shifted = dict(feeds)
            shifted[x] = feeds[x].copy()
            shifted[x][i] += step
            total.append(sess.run(shifted)[y].sum())
        grad[i] = (total[0] - total[1]) / (2 * eps)
    return grad


def _check(fwd, full, feeds, xs):
    got = _load_expanded(full).run(feeds)
    np.testing.assert_allclose(got[fwd.graph.output[0].name],
                               ember.load(fwd).run(feeds)[fwd.graph.output[0].name])
    for x in xs:
        g = got[f"d_{x}"]
        assert g.shape == feeds[x].shape and g.dtype == feeds[x].dtype, x
        np.testing.assert_allclose(g, _numeric_grad(fwd, feeds, x), rtol=1e-5, atol=1e-6,
                                   err_msg=f"d/d{x}")


def _rand(*shape, seed=0, low=-1.0, high=1.0):
    return np.random.default_rng(seed + len(shape)).uniform(low, high, shape)


@pytest.mark.parametrize("opset", [12, 13, 17])
def test_broadcast_add_mul_relu(opset):
    # y = Relu(x * w + b), w and b broadcast along rows; b is also used twice.
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Sub", ["r", "b"], ["y"])]
    fwd, full = _models(nodes, [("x", [3, 4]), ("w", [4]), ("b", [1, 4])], "y", ["x", "w", "b"],
                        opset=opset)
    feeds = {"x": _rand(3, 4), "w": _rand(4, seed=1), "b": _rand(1, 4, seed=2)}
    _check(fwd, full, feeds, ["x", "w", "b"])


def test_matmul_batched_and_vector():
    # y = Tanh(A @ B) + Sigmoid(v @ B): batched A broadcasts against B; v is 1-D.
    nodes = [helper.make_node("MatMul", ["A", "B"], ["ab"]),
             helper.make_node("Tanh", ["ab"], ["t"]),
             helper.make_node("MatMul", ["v", "B"], ["vb"]),
             helper.make_node("Sigmoid", ["vb"], ["s"]),
             helper.make_node("Add", ["t", "s"], ["y"])]
    fwd, full = _models(nodes, [("A", [2, 3, 4]), ("B", [4, 5]), ("v", [4])], "y",
                        ["A", "B", "v"])
    feeds = {"A": _rand(2, 3, 4), "B": _rand(4, 5, seed=3), "v": _rand(4, seed=4)}
    _check(fwd, full, feeds, ["A", "B", "v"])


def test_matrix_vector_and_dot():
    nodes = [helper.make_node("MatMul", ["M", "v"], ["mv"]),   # [3,4] @ [4] -> [3]
             helper.make_node("MatMul", ["mv", "u"], ["y"])]   # [3] @ [3] -> scalar
    fwd, full = _models(nodes, [("M", [3, 4]), ("v", [4]), ("u", [3])], "y", ["M", "v", "u"])
    feeds = {"M": _rand(3, 4), "v": _rand(4, seed=5), "u": _rand(3, seed=6)}
    _check(fwd, full, feeds, ["M", "v", "u"])


def test_div_neg_exp_identity_with_zs():
    # c is a zs input: it feeds the graph but gets no gradient output.
    nodes = [helper.make_node("Neg", ["x"], ["nx"]),
             helper.make_node("Exp", ["nx"], ["e"]),
             helper.make_node("Sub", ["x", "c"], ["d"]),
             helper.make_node("Div", ["e", "d"], ["q"]),
             helper.make_node("Identity", ["x"], ["ix"]),
             helper.make_node("Mul", ["ix", "x"], ["sq"]),
             helper.make_node("Div", ["sq", "q"], ["y"])]
    fwd, full = _models(nodes, [("x", [2, 3]), ("c", [1])], "y", ["x"], zs=["c"])
    feeds = {"x": _rand(2, 3, low=1.0, high=2.0), "c": np.array([-0.5])}
    _check(fwd, full, feeds, ["x"])


@pytest.mark.parametrize("opset", [11, 13])
def test_shape_ops_log_sqrt_where(opset):
    axes = lambda name, values: (  # noqa: E731  axes as attribute (< 13) or input (>= 13)
        {"inputs": [name]} if opset >= 13 else {"attrs": {"axes": values}})
    ax = {"u": [0], "s": [0], "r": [1]}
    init = [helper.make_tensor(f"axes_{k}", TensorProto.INT64, [len(v)], v) for k, v in ax.items()]

    def with_axes(op, inputs, outputs, key, **attrs):
        spec = axes(f"axes_{key}", ax[key])
        return helper.make_node(op, inputs + spec.get("inputs", []), outputs,
                                **spec.get("attrs", {}), **attrs)

    nodes = [helper.make_node("Sqrt", ["x"], ["sx"]),                         # [2,3]
             helper.make_node("Reshape", ["sx", "shape"], ["rs"]),             # [3,2]
             helper.make_node("Transpose", ["rs"], ["t"], perm=[1, 0]),        # [2,3]
             helper.make_node("Log", ["t"], ["l"]),
             helper.make_node("Transpose", ["l"], ["td"]),                     # [3,2]
             with_axes("Unsqueeze", ["td"], ["un"], "u"),                       # [1,3,2]
             with_axes("Squeeze", ["un"], ["sq"], "s"),                         # [3,2]
             helper.make_node("Flatten", ["sq"], ["fl"], axis=1),              # [3,2]
             helper.make_node("Greater", ["fl", "zero"], ["pos"]),
             helper.make_node("Where", ["pos", "fl", "x2"], ["w"]),            # x2: [1,2]
             with_axes("ReduceSum", ["w"], ["r0"], "r", keepdims=0),            # [3]
             helper.make_node("ReduceSum", ["w"], ["r1"], keepdims=1),         # [1,1]
             helper.make_node("Mul", ["r0", "r1"], ["y"])]
    fwd, full = _models(nodes, [("x", [2, 3]), ("x2", [1, 2])], "y", ["x", "x2"], opset=opset)
    extra = init + [helper.make_tensor("shape", TensorProto.INT64, [2], [3, 2]),
                    helper.make_tensor("zero", D, [], [0.0])]
    for m in (fwd, full):
        m.graph.initializer.extend(extra)
    feeds = {"x": _rand(2, 3, low=0.5, high=3.0), "x2": _rand(1, 2, seed=11)}
    _check(fwd, full, feeds, ["x", "x2"])


def test_dynamic_shapes_broadcast_at_runtime():
    # b's shape is unknown statically: the reduction axes are found at run time (opset 13).
    nodes = [helper.make_node("Add", ["x", "b"], ["h"]),
             helper.make_node("Mul", ["h", "h"], ["y"])]
    fwd, full = _models(nodes, [("x", ["N", 4]), ("b", None)], "y", ["x", "b"])
    feeds = {"x": _rand(3, 4), "b": _rand(4, seed=7)}
    _check(fwd, full, feeds, ["x", "b"])
    feeds["b"] = _rand(3, 1, seed=8)
    _check(fwd, full, feeds, ["x", "b"])


def test_dynamic_broadcast_before_opset13_is_refused():
    nodes = [helper.make_node("Add", ["x", "b"], ["y"])]
    _, full = _models(nodes, [("x", [3, 4]), ("b", None)], "y", ["x", "b"], opset=12)
    with pytest.raises(ember.InvalidModelError, match="broadcast"):
        ir = import_model(full)  # raises here once the importer expands Gradient itself
        expand_gradient_nodes(ir.graph, 12)


def test_gradient_at_other_values_and_unused_x():
    # Gradient(xs=[H, w], y=Y) fed h1: dY/dH evaluated at H = h1, not at the graph's H. Y also
    # reads h1 directly, which is no path from H.
    nodes = [helper.make_node("Mul", ["x", "x"], ["H"]),
             helper.make_node("Tanh", ["H"], ["t"]),
             helper.make_node("Mul", ["h1", "h1"], ["hh"]),
             helper.make_node("Add", ["t", "hh"], ["Y"])]
    _, full = _models(nodes, [("x", [3]), ("h1", [3]), ("w", [2])], "Y", ["H", "w"],
                      grad_inputs=["h1", "w"])
    feeds = {"x": _rand(3), "h1": _rand(3, seed=9), "w": _rand(2, seed=10)}
    got = _load_expanded(full).run(feeds)
    np.testing.assert_allclose(got["d_H"], 1 - np.tanh(feeds["h1"]) ** 2, rtol=1e-12)
    np.testing.assert_array_equal(got["d_w"], np.zeros(2))  # Y does not depend on w
    np.testing.assert_allclose(got["Y"], np.tanh(feeds["x"] ** 2) + feeds["h1"] ** 2, rtol=1e-12)


def test_second_order():
    # y = x^3; g = dy/dx = 3x^2 (first Gradient); dg/dx = 6x (second Gradient, on g).
    nodes = [helper.make_node("Mul", ["x", "x"], ["x2"]),
             helper.make_node("Mul", ["x2", "x"], ["y"]),
             helper.make_node("Gradient", ["x"], ["g"], domain=TRAINING, xs=["x"], y="y")]
    _, full = _models(nodes, [("x", [4])], "g", ["x"])
    feeds = {"x": _rand(4)}
    got = _load_expanded(full).run(feeds)
    np.testing.assert_allclose(got["g"], 3 * feeds["x"] ** 2, rtol=1e-12)
    np.testing.assert_allclose(got["d_x"], 6 * feeds["x"], rtol=1e-12)


def test_unsupported_op_is_named():
    nodes = [helper.make_node("Softmax", ["x"], ["s"]),
             helper.make_node("Mul", ["s", "x"], ["y"])]
    _, full = _models(nodes, [("x", [2, 3])], "y", ["x"])
    with pytest.raises(ember.UnsupportedOpError, match="Softmax"):
        _load_expanded(full)


@pytest.mark.parametrize("case_dir", [d for d in suite_case_dirs("simple") if "gradient" in d],
                         ids=os.path.basename)
def test_shipped_simple_cases(case_dir):
    case = load_case_dir(case_dir)
    sess = _load_expanded(onnx.load(case.model_path))
    for inputs, expected in case.data_sets:
        result = sess.run(inputs)
        assert_outputs_match(expected, [result[o.name] for o in sess.outputs],
                             case.rtol, case.atol)
