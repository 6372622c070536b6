"""Bad input gives an ember error with an actionable message, and the CLI exits 2 on it."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.cli import main as cli_main

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")
MLP = os.path.join(MODELS, "mlp.onnx")


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def _unknown_ops_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("FrobnicateA", ["a"], ["b"], domain="com.example"),
        helper.make_node("FrobnicateB", ["b"], ["c"], domain="com.example"),
        helper.make_node("NotAnOnnxOp", ["c"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.example", 1)])


def test_truncated_file(tmp_path):
    data = open(MLP, "rb").read()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ember.ModelLoadError, match="truncated or corrupt|no graph"):
        ember.load(str(path))


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(os.urandom(64) + b"\xff" * 64)
    with pytest.raises(ember.ModelLoadError):
        ember.load(str(path))


def test_empty_and_missing_file(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ember.ModelLoadError, match="empty"):
        ember.load(str(empty))
    with pytest.raises(ember.ModelLoadError, match="not found"):
        ember.load(str(tmp_path / "nope.onnx"))


def test_unknown_ops_are_listed_all_at_once():
    with pytest.raises(ember.UnsupportedOpError) as info:
        ember.load(_unknown_ops_model())
    message = str(info.value)
    assert "com.example::FrobnicateA-1" in message
    assert "com.example::FrobnicateB-1" in message
    assert "NotAnOnnxOp" in message
    assert "3 unsupported" in message
    assert len(info.value.missing) == 3


def test_missing_input_names_the_input():
    sess = ember.load(MLP)
    with pytest.raises(ember.InputError, match="missing input.*'x'.*tensor\\(float\\)"):
        sess.run({})


def test_unknown_input_name():
    sess = ember.load(MLP)
    with pytest.raises(ember.InputError, match="unknown input name.*'z'.*inputs are x"):
        sess.run({"x": np.zeros((1, 4), np.float32), "z": np.zeros(1)})


def test_wrong_dtype_names_expected_and_given():
    sess = ember.load(MLP)
    with pytest.raises(ember.InputError, match="'x' expects dtype float32, got float64"):
        sess.run({"x": np.zeros((1, 4), np.float64)})


def test_wrong_rank_and_fixed_dimension():
    sess = ember.load(MLP)
    with pytest.raises(ember.InputError, match="expects rank 2"):
        sess.run({"x": np.zeros(4, np.float32)})
    with pytest.raises(ember.InputError, match="expects size 4 in dimension 1"):
        sess.run({"x": np.zeros((1, 5), np.float32)})


def test_unknown_output_name():
    sess = ember.load(MLP)
    with pytest.raises(ember.InputError, match="unknown output name"):
        sess.run({"x": np.zeros((1, 4), np.float32)}, outputs=["nope"])


def _external_model(tmp_path, location: str) -> str:
    weight = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", location
    weight.ClearField("raw_data")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = tmp_path / "model_dir"
    folder.mkdir(exist_ok=True)
    return _save(model, folder / "model.onnx")


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"])
def test_external_data_outside_model_folder_is_refused(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = _external_model(tmp_path, location)
    with pytest.raises(ember.ModelLoadError, match="outside|absolute"):
        ember.load(path)


def test_external_data_symlink_out_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = _external_model(tmp_path, "link.bin")
    os.symlink(tmp_path / "secret.bin", tmp_path / "model_dir" / "link.bin")
    with pytest.raises(ember.ModelLoadError, match="outside"):
        ember.load(path)


def test_external_data_inside_folder_is_read(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (tmp_path / "model_dir" / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    out = ember.load(path).run({"x": np.ones(4, np.float32)})["y"]
    np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32) + 1)


def test_large_external_tensor_is_memory_mapped(tmp_path):
    from ember.importer import import_model

    n = 1 << 19  # 2 MiB of float32, above the mmap threshold
    path = _external_model(tmp_path, "big.bin")
    model = onnx.load(path, load_external_data=False)
    model.graph.initializer[0].dims[:] = [n]
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = n
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = n
    onnx.save(model, path)
    (tmp_path / "model_dir" / "big.bin").write_bytes(np.arange(n, dtype=np.float32).tobytes())
    weight = import_model(path).graph.initializers["w"]
    assert isinstance(weight, np.memmap)
    out = ember.load(path).run({"x": np.zeros(n, np.float32)})["y"]
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))


# -- the CLI turns each of these into one line on stderr and exit code 2 -------------------------
def test_cli_exit_2_on_corrupt_file(tmp_path, capsys):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x08\x07garbage" * 10)
    assert cli_main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error:") and "Traceback" not in err


def test_cli_exit_2_on_unknown_op(tmp_path, capsys):
    path = _save(_unknown_ops_model(), tmp_path / "unknown.onnx")
    assert cli_main(["run", path]) == 2
    err = capsys.readouterr().err
    assert "FrobnicateA" in err and "FrobnicateB" in err and len(err.strip().splitlines()) == 1


def test_cli_exit_2_on_wrong_dtype_input(tmp_path, capsys):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((1, 4), np.float64))
    assert cli_main(["run", MLP, "-i", f"x={npy}"]) == 2
    assert "expects dtype float32" in capsys.readouterr().err


def test_cli_exit_2_on_unknown_input(tmp_path, capsys):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((1, 4), np.float32))
    assert cli_main(["run", MLP, "-i", f"nope={npy}"]) == 2
    assert "unknown input name" in capsys.readouterr().err


def test_map_feeds_are_checked_against_the_declared_map_type():
    from onnx import TensorProto, helper

    map_type = helper.make_map_type_proto(TensorProto.STRING,
                                          helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    graph = helper.make_graph(
        [helper.make_node("DictVectorizer", ["m"], ["y"], domain="ai.onnx.ml",
                          string_vocabulary=["a", "b"])], "maps",
        [helper.make_value_info("m", map_type)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 1)])
    sess = ember.load(proto)
    assert sess.inputs[0].type == "map(string,tensor(float))"
    np.testing.assert_array_equal(sess.run({"m": {"b": 2}})["y"], [[0.0, 2.0]])
    with pytest.raises(ember.InputError, match="expects a dict"):
        sess.run({"m": [1.0, 2.0]})
    with pytest.raises(ember.InputError, match="key 3 is not of the map's key type string"):
        sess.run({"m": {3: 1.0}})
    with pytest.raises(ember.InputError, match="is not float"):
        sess.run({"m": {"a": "x"}})


# -- values of the wrong kind (issue 43): refused where the model's fault is, never left to
# fail inside a kernel. The models are the fuzzer's (tests/fuzz_mutants.py, m_issue43).

_LOADED_SEQUENCE = r"input 0 \('{}'\) gets 'q', a sequence, but {}-\d+ takes"
KIND_CASES = {
    # variant: (error type, phase, message)
    "constantofshape_string_shape": (ember.InvalidModelError, "load",
                                     r"input 0 \('input'\) gets 's', a string tensor, but "
                                     r"ConstantOfShape-9 takes tensor\(int64\)"),
    "constantofshape_string_constant": (ember.InvalidModelError, "run",
                                        "shape input must be an integer tensor"),
    "tile_string_repeats": (ember.InvalidModelError, "load",
                            r"input 1 \('repeats'\) gets 's', a string tensor, but Tile-13"),
    **{f"{op.lower()}_sequence": (ember.InvalidModelError, "load",
                                  _LOADED_SEQUENCE.format(x, op))
       for op, x in (("MatMul", "A"), ("Gemm", "A"), ("Conv", "X"))},
    **{f"{op.lower()}_if_sequence": (ember.InvalidModelError, "run",
                                     f"{op} .*input {x} must be a tensor, got a sequence")
       for op, x in (("MatMul", "A"), ("Gemm", "A"), ("Conv", "X"))},
    **{f"{op.lower()}_string_at": (ember.InvalidModelError, "run",
                                   f"{op} .*input {x} must be a numeric tensor, got a string")
       for op, x in (("MatMul", "A"), ("Gemm", "A"), ("Conv", "X"))},
    "stringnormalizer_numbers": (ember.InvalidModelError, "load",
                                 "gets 't', a numeric tensor, but StringNormalizer-10 takes "
                                 r"tensor\(string\)"),
    "stringnormalizer_int_input": (ember.InvalidModelError, "load",
                                   "gets 't', a numeric tensor, but StringNormalizer-10 takes "
                                   r"tensor\(string\)"),
    "stringnormalizer_int_at": (ember.InvalidModelError, "run",
                                "StringNormalizer .*input X must be a string tensor, got int64"),
    "string_feed_of_numbers": (ember.InputError, "run", r"element \[1\] is int 1"),
    "sequence_feed_scalar": (ember.InputError, "run", r"expects a sequence \(seq\(tensor"
                                                      r"\(float\)\)\), given as a list of "
                                                      "arrays; got float32"),
}


@pytest.mark.parametrize("variant", sorted(KIND_CASES))
def test_values_of_the_wrong_kind_are_ember_errors_naming_the_fault(variant):
    """Each case once raised AttributeError / TypeError / ValueError inside a kernel or the
    constant folder. ember now refuses it at load where the graph fixes the value's kind,
    else before the kernel touches it, saying which input holds what; onnxruntime refuses
    each too (bar one: see below)."""
    import random

    import fuzz_mutants as fm

    error, phase, message = KIND_CASES[variant]
    built = fm.m_issue43(random.Random(0), None, variant)
    with pytest.raises(error, match=message) as info:
        session = ember.load(built["model"])
        assert phase == "run", "loaded, but the load should have refused it"
        session.run(built["feeds"])
    assert fm.internal_cause(info.value) is None
    ort = pytest.importorskip("onnxruntime")
    if variant == "string_feed_of_numbers":
        return  # onnxruntime stores str() of a number among strings; ember refuses it
    with pytest.raises(Exception):
        ort.InferenceSession(built["model"].SerializeToString()).run(None, built["feeds"])


def test_a_string_shape_never_reaches_the_constant_folders_size_guess():
    """The folder's size prediction reads only integer shapes; any other is the kernel's to
    refuse (it crashed on int('x') before)."""
    from ember.ir import Node
    from ember.simplifier.passes.constant_folding import _predicted_size

    strings = np.array(["2", "x"], dtype=object)
    assert _predicted_size(Node("ConstantOfShape", "", 17, ["s"], ["y"]), [strings]) == 0
    assert _predicted_size(Node("Expand", "", 13, ["x", "s"], ["y"]),
                           [np.zeros(2), strings]) == 0
    assert _predicted_size(Node("Tile", "", 13, ["x", "r"], ["y"]),
                           [np.zeros(2), strings]) == 0
    assert _predicted_size(Node("ConstantOfShape", "", 17, ["s"], ["y"]),
                           [np.array([3, 4])]) == 12


def test_every_wrong_kind_the_fuzzer_builds_is_checked_here():
    import fuzz_mutants as fm

    assert set(KIND_CASES) == set(fm.ISSUE43_VARIANTS)


def _roi_align(scale: float) -> onnx.ModelProto:
    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], output_height=2,
                            output_width=2, spatial_scale=scale)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4]),
                      helper.make_tensor_value_info("rois", TensorProto.FLOAT, [1, 4]),
                      helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_roi_align_refuses_boxes_at_no_place():
    """A non-finite spatial_scale (found by the long fuzz campaign: an IndexError inside the
    kernel) is refused at load; boxes that scale to non-finite coordinates at run time."""
    with pytest.raises(ember.InvalidModelError, match="spatial_scale must be finite"):
        ember.load(_roi_align(float("inf")))
    feeds = {"x": np.ones((1, 1, 4, 4), np.float32), "idx": np.zeros(1, np.int64)}
    sess = ember.load(_roi_align(1e30))
    assert sess.run({**feeds, "rois": np.zeros((1, 4), np.float32)})["y"].shape == (1, 1, 2, 2)
    with pytest.raises(ember.EmberError, match="must be finite"):
        sess.run({**feeds, "rois": np.array([[0, 0, np.inf, 1]], np.float32)})
    with pytest.raises(ember.EmberError, match="RoiAlign"):  # 5e29 samples a bin: refused
        sess.run({**feeds, "rois": np.array([[0, 0, 1, 1]], np.float32)})
