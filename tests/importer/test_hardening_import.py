"""Issue 13, load time: a malformed model gives an ember error naming the node and the problem,
never a crash, a hang or a plain Python exception. One regression test per defect.

Models that once killed the process (inside onnx's C++ shape inference) are loaded in a
subprocess, so a regression fails the test instead of taking pytest down.
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper

import ember
from ember.cli import main as cli_main
from ember.native import convert
from ember.ops.registry import OpImpl

F = TensorProto.FLOAT
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _vi(name, shape=(3,), elem=F):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _model(nodes, inputs, outputs, opset=17, initializers=(), **kwargs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    kwargs.setdefault("opset_imports", [helper.make_opsetid("", opset)])
    return helper.make_model(graph, **kwargs)


def _load_error(model) -> ember.EmberError:
    with pytest.raises(ember.EmberError) as info:
        ember.load(model)
    return info.value


_CHILD = """
import json, sys
import ember
try:
    ember.load(sys.argv[1])
    print(json.dumps({"loaded": True}))
except ember.EmberError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def _load_in_subprocess(model: onnx.ModelProto, tmp_path) -> dict:
    """ember.load in a child process: its verdict, or a failed test if the child dies."""
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    env = dict(os.environ, PYTHONPATH=os.path.dirname(REPO))
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                              text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the model hung for 60 s")
    assert proc.returncode == 0, (f"the process died (exit {proc.returncode}) loading the "
                                  f"model:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- defect 1: models that killed the process inside onnx's shape inference ----------------------

def test_split_with_num_outputs_disagreeing_with_its_outputs(tmp_path):
    split = helper.make_node("Split", ["x"], ["a", "b", "c", "d"], name="split", axis=0,
                             num_outputs=3)
    model = _model([split], [_vi("x", (12,))], [_vi(o, None) for o in "abcd"], opset=18)
    verdict = _load_in_subprocess(model, tmp_path)  # was SIGABRT
    assert verdict.get("error") == "InvalidModelError", verdict
    assert "node 'split' (Split)" in verdict["message"]
    assert "num_outputs is 3" in verdict["message"] and "4 outputs" in verdict["message"]


def test_regex_full_match_reading_an_undefined_value(tmp_path):
    node = helper.make_node("RegexFullMatch", ["ghost"], ["y"], name="match", pattern="a+")
    model = _model([node], [_vi("x", (2,), TensorProto.STRING)],
                   [_vi("y", (2,), TensorProto.BOOL)], opset=20)
    verdict = _load_in_subprocess(model, tmp_path)  # was SIGSEGV
    assert verdict.get("error") == "InvalidModelError", verdict
    assert "node 'match' (RegexFullMatch) reads 'ghost'" in verdict["message"]


def test_regex_full_match_on_a_value_of_unknown_type(tmp_path):
    # defined, but of unknown type: onnx's RegexFullMatch inference dereferences the type
    untyped = onnx.ValueInfoProto(name="x")
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], name="match", pattern="a+")
    model = _model([node], [untyped], [_vi("y", (2,), TensorProto.BOOL)], opset=20)
    assert _load_in_subprocess(model, tmp_path) == {"loaded": True}  # was SIGSEGV
    out = ember.load(model).run({"x": np.array(["aa", "ab"], dtype=object)})["y"]
    np.testing.assert_array_equal(out, [True, False])


def test_regex_full_match_in_a_branch_on_a_value_of_unknown_type(tmp_path):
    branches = {}
    for key, pattern in (("then_branch", "a+"), ("else_branch", "b+")):
        node = helper.make_node("RegexFullMatch", ["x"], [f"r_{key}"], pattern=pattern)
        branches[key] = helper.make_graph([node], key, [], [_vi(f"r_{key}", None,
                                                                TensorProto.BOOL)])
    model = _model([helper.make_node("If", ["c"], ["y"], **branches)],
                   [onnx.ValueInfoProto(name="x"), _vi("c", (), TensorProto.BOOL)],
                   [_vi("y", None, TensorProto.BOOL)], opset=20)
    assert _load_in_subprocess(model, tmp_path) == {"loaded": True}
    out = ember.load(model).run({"x": np.array(["aa", "b"], dtype=object), "c": np.array(False)})
    np.testing.assert_array_equal(out["y"], [False, True])


@pytest.mark.parametrize("axis", [2**63 - 1, 2**62 - 1, -(2**40)])
def test_layer_normalization_with_a_huge_axis(tmp_path, axis):
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"],
                            name="ln", axis=axis)
    model = _model([node], [_vi("x", (2, 3)), _vi("s", (3,)), _vi("b", (3,))],
                   [_vi("y", (2, 3))])
    verdict = _load_in_subprocess(model, tmp_path)  # 2^63-1 was SIGSEGV
    assert verdict.get("error") == "InvalidModelError", verdict
    assert "node 'ln' (LayerNormalization): attribute 'axis'" in verdict["message"]
    assert str(axis) in verdict["message"]


@pytest.mark.parametrize("equation", ["bij,bjk(->bik", "bi.j,bjk", "bij,bjk-"])
def test_einsum_with_an_equation_outside_its_grammar(tmp_path, equation):
    node = helper.make_node("Einsum", ["x", "y"], ["z"], name="es", equation=equation)
    model = _model([node], [_vi("x", (5, 2, 3)), _vi("y", (5, 3, 4))], [_vi("z", None)],
                   opset=12)
    verdict = _load_in_subprocess(model, tmp_path)  # onnx's inference looped forever
    assert verdict.get("error") == "InvalidModelError", verdict
    assert f"node 'es' (Einsum): equation {equation!r} is not an Einsum equation" \
        in verdict["message"]


def test_axis_out_of_range_for_a_known_rank():
    node = helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=7)
    error = _load_error(_model([node], [_vi("x", (2, 3))], [_vi("y", (2, 3))]))
    assert isinstance(error, ember.InvalidModelError)
    assert "node 'sm' (Softmax): attribute 'axis' holds 7" in str(error)
    assert "rank 2" in str(error)


# -- names: undefined, self-reads, cycles, duplicates -------------------------------------------

def test_undefined_value_inside_a_subgraph_names_the_reader():
    then_g = helper.make_graph([helper.make_node("Neg", ["ghost"], ["r"], name="inner")],
                               "then", [], [_vi("r")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["r2"])], "else", [], [_vi("r2")])
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g,
                            else_branch=else_g)
    error = _load_error(_model([node], [_vi("x"), _vi("c", (), TensorProto.BOOL)], [_vi("y")]))
    assert isinstance(error, ember.InvalidModelError)
    assert "node 'inner' (Neg) in the then_branch of node 'branch' (If) reads 'ghost'" \
        in str(error)


def _if_reading_its_own_output() -> onnx.ModelProto:
    then_g = helper.make_graph([helper.make_node("Neg", ["y"], ["r"], name="inner")],
                               "then", [], [_vi("r")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["r2"])], "else", [], [_vi("r2")])
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g,
                            else_branch=else_g)
    return _model([node], [_vi("x"), _vi("c", (), TensorProto.BOOL)], [_vi("y")])


def test_if_branch_reading_the_ifs_own_output():
    error = _load_error(_if_reading_its_own_output())
    assert isinstance(error, ember.InvalidModelError)
    assert "reads 'y', an output of node 'branch' (If)" in str(error)


def test_cycle_is_reported():
    nodes = [helper.make_node("Neg", ["b"], ["a"], name="n1"),
             helper.make_node("Neg", ["a"], ["b"], name="n2"),
             helper.make_node("Neg", ["x"], ["y"])]
    error = _load_error(_model(nodes, [_vi("x")], [_vi("y")]))
    assert isinstance(error, ember.InvalidModelError) and "cycle through node 'n" in str(error)


def test_a_value_defined_twice():
    nodes = [helper.make_node("Neg", ["x"], ["y"], name="first"),
             helper.make_node("Relu", ["x"], ["y"], name="second")]
    error = _load_error(_model(nodes, [_vi("x")], [_vi("y")]))
    assert isinstance(error, ember.InvalidModelError)
    assert "node 'second' (Relu) defines 'y', which another node already defines" in str(error)


# -- arity and attributes against the schema -----------------------------------------------------

def test_too_many_inputs_for_the_schema():
    node = helper.make_node("Relu", ["x", "x"], ["y"], name="relu")
    error = _load_error(_model([node], [_vi("x")], [_vi("y")]))
    assert isinstance(error, ember.InvalidModelError)
    assert "node 'relu' (Relu) has 2 inputs; Relu-14 takes 1" in str(error)


def test_required_input_left_empty():
    node = helper.make_node("Add", ["x", ""], ["y"], name="add")
    error = _load_error(_model([node], [_vi("x")], [_vi("y")]))
    assert "node 'add' (Add): input 1 ('B') is required" in str(error)


def test_attribute_of_the_wrong_type():
    node = helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1.5)
    error = _load_error(_model([node], [_vi("x", (2, 3))], [_vi("y", (2, 3))]))
    assert isinstance(error, ember.InvalidModelError)
    assert "node 'sm' (Softmax): attribute 'axis' is of type FLOAT, but Softmax-13 takes INT" \
        in str(error)


@pytest.mark.parametrize("name", ["__dict__", "__class__", "__init__"])
def test_attribute_names_that_cannot_be_attributes(name):
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    node.attribute.append(helper.make_attribute(name, 1))
    error = _load_error(_model([node], [_vi("x")], [_vi("y")]))
    assert isinstance(error, ember.InvalidModelError)
    assert f"node 'relu' (Relu) has an attribute named {name!r}" in str(error)


def test_any_attribute_name_is_stored_safely():
    # the registry's own defence, for IR built in memory: no name reaches Python's machinery
    assert OpImpl.attribute_slot("axis") == "axis"
    for name in ("__dict__", "__class__", "_twin", "run", "a b"):
        assert OpImpl.attribute_slot(name) == name + "_"


def test_missing_required_attribute():
    node = helper.make_node("Cast", ["x"], ["y"], name="cast")
    error = _load_error(_model([node], [_vi("x")], [_vi("y")]))
    assert "node 'cast' (Cast) lacks required attribute(s) to" in str(error)


@pytest.mark.parametrize("version", [0, 2**31, 2**40])
def test_opset_versions_out_of_range(version):
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")])
    model.opset_import[0].version = version
    error = _load_error(model)
    assert isinstance(error, ember.InvalidModelError)
    assert f"opset {version} of domain 'ai.onnx'" in str(error)


# -- tensors: sparse initialisers and raw_data ----------------------------------------------------

def _sparse_model(values, indices, dims) -> onnx.ModelProto:
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.asarray(values, np.float32), "w"),
        numpy_helper.from_array(np.asarray(indices, np.int64), "w_idx"), dims)
    graph = helper.make_graph([helper.make_node("Reshape", ["w", "shape"], ["y"])], "g", [],
                              [_vi("y", None)],
                              [numpy_helper.from_array(np.array([-1], np.int64), "shape")])
    graph.sparse_initializer.append(sparse)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_valid_sparse_initializer_is_densified():
    out = ember.load(_sparse_model([1, 2], [1, 4], [2, 3])).run({})["y"]
    np.testing.assert_array_equal(out, [0, 1, 0, 0, 2, 0])
    coordinates = ember.load(_sparse_model([1, 2], [[0, 1], [1, 1]], [2, 3])).run({})["y"]
    np.testing.assert_array_equal(coordinates, [0, 1, 0, 0, 2, 0])


@pytest.mark.parametrize("values, indices, dims, problem", [
    ([1, 2], [1, 6], [2, 3], "outside the 6 elements"),              # was IndexError
    ([1, 2], [[0, 1], [2, 0]], [2, 3], "outside shape"),
    ([1, 2], [4, 1], [2, 3], "ascending order"),
    ([1, 2], [3, 3], [2, 3], "without duplicates"),
    ([1, 2, 3], [1, 4], [2, 3], "do not fit 3 values"),
    ([1], [0], [-2, 3], "negative dimension"),
    ([1], [0], [2**40, 2**40], "over the limit"),                     # was "array is too big"
])
def test_malformed_sparse_initializer(values, indices, dims, problem):
    error = _load_error(_sparse_model(values, indices, dims))
    assert isinstance(error, ember.ModelLoadError)
    assert "sparse tensor 'w'" in str(error) and problem in str(error)


def test_raw_data_that_does_not_fit_the_dims():
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32), "w")
    weight.raw_data = weight.raw_data[:10]
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", (6,))],
                   [_vi("y", (6,))], initializers=[weight])
    error = _load_error(model)
    assert isinstance(error, ember.ModelLoadError)
    assert "tensor 'w': raw_data holds 10 bytes, but dims [6] of FLOAT take 24" in str(error)


# -- recursion and nesting ------------------------------------------------------------------------

def _function_model(functions, call="f0") -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    graph = helper.make_graph([helper.make_node(call, ["x"], ["y"], domain="local")], "g",
                              [_vi("x")], [_vi("y")])
    return helper.make_model(graph, functions=functions, opset_imports=opsets)


def _function(name, callees) -> onnx.FunctionProto:
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    names = ["a"] + [f"t{i}" for i in range(len(callees) - 1)] + ["b"]
    nodes = [helper.make_node(c, [names[i]], [names[i + 1]], domain="" if c == "Neg" else "local")
             for i, c in enumerate(callees)]
    return helper.make_function("local", name, ["a"], ["b"], nodes, opsets)


@pytest.mark.parametrize("functions, cycle", [
    ([_function("f0", ["f0"])], "'f0' -> 'f0'"),
    ([_function("f0", ["f1"]), _function("f1", ["f2"]), _function("f2", ["f0"])],
     "'f0' -> 'f1' -> 'f2' -> 'f0'"),
])
def test_recursive_functions(functions, cycle):
    error = _load_error(_function_model(functions))  # was RecursionError
    assert isinstance(error, ember.InvalidModelError)
    assert f"model-local functions call themselves: {cycle}" in str(error)


def test_functions_nested_a_thousand_deep():
    functions = [_function(f"f{i}", [f"f{i + 1}"]) for i in range(1000)]
    functions.append(_function("f1000", ["Neg"]))
    error = _load_error(_function_model(functions))  # was RecursionError
    assert isinstance(error, ember.InvalidModelError)
    assert "calls functions 1001 levels deep; ember inlines at most 64" in str(error)


def test_functions_that_multiply_when_inlined():
    functions = [_function(f"f{i}", [f"f{i + 1}"] * 2) for i in range(40)]  # 2^40 Negs
    functions.append(_function("f40", ["Neg"]))
    error = _load_error(_function_model(functions))
    assert isinstance(error, ember.InvalidModelError) and "inlines to more than" in str(error)


def _deep_if(depth: int) -> onnx.ModelProto:
    """If nested `depth` deep, built in place: protobuf's copies refuse messages nested more
    than 100 deep, so helper.make_graph cannot build it."""
    model = _model([], [_vi("c", (), TensorProto.BOOL), _vi("x", (1,))], [_vi("y", (1,))])
    graph = model.graph
    for i in range(depth):
        node = graph.node.add(op_type="If", input=["c"], output=["y"], name=f"if{i}")
        other = node.attribute.add(name="else_branch", type=AttributeProto.GRAPH)
        other.g.node.add(op_type="Identity", input=["x"], output=["y"])
        other.g.output.add(name="y")
        then = node.attribute.add(name="then_branch", type=AttributeProto.GRAPH)
        then.g.output.add(name="y")
        graph = then.g
    graph.node.add(op_type="Identity", input=["x"], output=["y"])
    return model


def test_if_nested_a_thousand_deep_as_a_model_proto():
    error = _load_error(_deep_if(1000))  # was RecursionError
    assert isinstance(error, ember.InvalidModelError)
    assert "subgraphs nest more than 30 levels deep" in str(error)


def test_if_nested_thirty_deep_loads_and_runs():
    sess = ember.load(_deep_if(30))
    out = sess.run({"c": np.array(False), "x": np.ones(1, np.float32)})["y"]
    np.testing.assert_array_equal(out, [1])


def test_if_nested_fifty_deep_in_a_file_names_protobufs_limit(tmp_path):
    from google._upb import _message  # lets this process write what it cannot read back

    _message.SetAllowOversizeProtos(True)
    try:
        data = _deep_if(50).SerializeToString()
    finally:
        _message.SetAllowOversizeProtos(False)
    path = tmp_path / "deep.onnx"
    path.write_bytes(data)
    with pytest.raises(ember.ModelLoadError) as info:  # was "truncated or corrupt"
        ember.load(str(path))
    assert "deeper than protobuf's limit of 100 levels" in str(info.value)
    assert "truncated" not in str(info.value)


# -- text -----------------------------------------------------------------------------------------

def test_invalid_utf8_in_a_name():
    model = _model([helper.make_node("Relu", ["xQQ"], ["y"], name="relu")],
                   [_vi("xQQ")], [_vi("y")])
    data = model.SerializeToString().replace(b"xQQ", b"x\xff\xfe")
    with pytest.raises(ember.ModelLoadError) as info:  # was UnicodeDecodeError
        ember.load(data)
    assert "is not valid UTF-8" in str(info.value)
    assert "model.graph." in str(info.value)  # which field


# -- defect 8: hard-linked external data ----------------------------------------------------------

def test_external_data_through_a_hard_link_is_refused(tmp_path):
    weight = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="weights.bin")
    weight.ClearField("raw_data")
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", (4,))],
                   [_vi("y", (4,))], initializers=[weight])
    folder = tmp_path / "model_dir"
    folder.mkdir()
    (tmp_path / "elsewhere.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    try:
        os.link(tmp_path / "elsewhere.bin", folder / "weights.bin")
    except OSError as exc:
        pytest.skip(f"no hard links here: {exc}")
    onnx.save(model, str(folder / "model.onnx"))
    with pytest.raises(ember.ModelLoadError) as info:
        ember.load(str(folder / "model.onnx"))
    assert "'weights.bin' has 2 hard links" in str(info.value)


# -- defect 7: convert validates as load does -----------------------------------------------------

def test_convert_rejects_what_load_rejects(tmp_path, capsys):
    path = tmp_path / "self_read.onnx"
    onnx.save(_if_reading_its_own_output(), str(path))
    load_error = _load_error(str(path))
    with pytest.raises(ember.InvalidModelError) as info:
        convert(str(path), tmp_path / "out", progress=False)
    assert str(info.value) == str(load_error)
    assert cli_main(["convert", str(path), "-o", str(tmp_path / "out2"), "-q"]) == 2
    assert "an output of node 'branch' (If)" in capsys.readouterr().err
