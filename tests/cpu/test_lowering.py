"""Kernel choice as a plan-time phase (OpImpl.lower, Plan.lowerings): every node is named a
kernel, the plan's choice is the one the run makes, and `ember info --nodes`, `sess.kernels`
and the profiler show it. The run's own route objects are the
oracle: a convolution's route records the kernel it runs."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.cli import main
from ember.ops import linalg
from ember.ops.cpu import tiles

from backends import present_backends

RNG = np.random.default_rng(0)


def _weight(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32) * 0.1, name)


def _cnn(path, batch=1):
    """3x3 conv (+ReLU), depthwise 3x3, pointwise 1x1, global mean, softmax over classes."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y2"], group=32, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["y2", "w3"], ["y3"]),
             helper.make_node("ReduceMean", ["y3"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Softmax", ["m"], ["out"], axis=-1)]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, 28, 28])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [_weight("w1", (32, 16, 3, 3)), _weight("b1", (32,)), _weight("w2", (32, 1, 3, 3)),
         _weight("w3", (64, 32, 1, 1))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _decoder_step(path, rows=8):
    """A few rows by a large constant weight (a decoder step), then GELU-free bias add."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["out"])],
        "step", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 768])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [_weight("w", (768, 2304)), _weight("b", (2304,))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _feeds(session):
    return {i.name: RNG.standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
            .astype(np.float32) for i in session.inputs}


@pytest.mark.parametrize("backend", present_backends())
def test_every_node_is_named_a_kernel(backend, tmp_path):
    session = ember.load(_cnn(str(tmp_path / "cnn.onnx")), backend)
    kernels = session.kernels
    assert [op for _, op, _ in session.placement] == [op for _, op, _, _ in kernels]
    for name, op, kernel, why in kernels:
        assert kernel and why, (name, op)
    if backend != "cpu":
        assert any(kernel == backend for _, _, kernel, _ in kernels)


def test_a_convolutions_plan_is_the_route_its_run_takes(tmp_path):
    """Where the plan knows the input's shape and the weights (3x3, depthwise), its choice is
    the route the first run builds; where the choice needs the input's layout (1x1), the plan
    says so and the run names what it chose."""
    session = ember.load(_cnn(str(tmp_path / "cnn.onnx")), "cpu")
    plan = session.plan
    planned = {op_name: lowering for (op_name, _, _), lowering
               in zip(session.placement, plan.lowerings)}
    session.run(_feeds(session))
    ran = {name: kernel for name, _, kernel, _ in session.kernels}
    convs = [name for name, op, _ in session.placement if op in ("Conv", "FusedConv")]
    assert len(convs) == 3
    for name in convs:
        if planned[name].kernel not in ("by layout", "by geometry"):
            assert ran[name] == planned[name].kernel, name
    kernels = [planned[n].kernel for n in convs]
    if tiles.kernel() is not None:   # the register tiles serve this machine
        assert kernels[0] == "cpu.tiles"
        assert kernels[1] in ("cpu.depthwise-vector", "cpu.depthwise")
        assert kernels[2] == "by layout"
        assert ran[convs[2]] != "by layout"   # the run chose


def test_a_products_plan_is_the_kernel_its_run_takes(tmp_path, monkeypatch):
    """The plan's product kernel for a few rows by a constant weight is the one the run
    calls: the register tiles run exactly when the plan says so."""
    session = ember.load(_decoder_step(str(tmp_path / "step.onnx")), "cpu", simplify=False)
    planned = dict((name, kernel) for name, _, kernel, _ in session.kernels)
    calls = []
    real = linalg._tiled_product

    def spy(a, b, weight):
        out = real(a, b, weight)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(linalg, "_tiled_product", spy)
    session.run(_feeds(session))
    matmul = next(name for name, op, _ in session.placement if op == "MatMul")
    assert calls and calls[0] == (planned[matmul] == "cpu.tiles-gemm")


def test_info_nodes_names_each_nodes_kernel(tmp_path, capsys):
    path = _cnn(str(tmp_path / "cnn.onnx"))
    assert main(["info", path, "--backend", "cpu", "--nodes"]) == 0
    out = capsys.readouterr().out
    placement = out[out.index("placement on cpu"):].splitlines()[1:-1]
    session = ember.load(path, "cpu")
    assert len(placement) == len(session.placement)
    for line, (name, op, kernel, _) in zip(placement, session.kernels):
        assert op in line and kernel in line and name in line
    assert main(["info", path, "--backend", "cpu", "--run", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    chosen = [n["kernel"] for n in summary["plan"]["nodes"]]
    assert len(chosen) == len(session.placement)
    assert "by layout" not in chosen or tiles.kernel() is None


def test_profile_shows_each_nodes_kernel(tmp_path, capsys):
    path = _cnn(str(tmp_path / "cnn.onnx"))
    trace = tmp_path / "trace.json"
    assert main(["profile", path, "--repeat", "2", "--warmup", "1", "--trace", str(trace)]) == 0
    assert "kernel" in capsys.readouterr().out
    events = [e for e in json.load(open(trace)) if e["cat"] == "Node"]
    session = ember.load(path, "cpu")
    session.run(_feeds(session))
    ran = {name: kernel for name, _, kernel, _ in session.kernels}
    for event in events:
        name = event["name"].removesuffix("_kernel_time")
        assert event["args"]["kernel"] == ran[name]


def test_a_choice_the_plan_leaves_to_the_run_is_named_after_it(tmp_path):
    """Symbolic rows: the plan cannot choose the product's or the softmax's kernel; the first
    run chooses with its shapes, and `kernels` names the choice, as `lower` makes it for them."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Softmax", ["y"], ["out"], axis=-1)],
        "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 768])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [_weight("w", (768, 2304))])
    path = str(tmp_path / "rows.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    session = ember.load(path, "cpu", simplify=False)
    assert [k for _, _, k, _ in session.kernels] == ["by geometry", "by geometry"]
    session.run({"x": RNG.standard_normal((8, 768)).astype(np.float32)})
    after = [k for _, _, k, _ in session.kernels]
    assert "by geometry" not in after
    known = ember.load(_decoder_step(str(tmp_path / "step.onnx")), "cpu", simplify=False)
    assert after[0] == known.kernels[0][2]   # 8 x 768 by a constant 768 x 2304, as planned
