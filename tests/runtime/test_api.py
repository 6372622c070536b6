"""The public API, checked against onnxruntime on the demo models."""
import os
import re
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

import ember

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "models")


def _feeds(name: str, rng: np.random.Generator, batch: int = 2) -> dict:
    if name == "mlp":
        return {"x": rng.standard_normal((batch, 4)).astype(np.float32)}
    if name == "cnn":
        return {"image": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    mask = np.ones((batch, 7), np.int64)
    mask[0, 5:] = 0  # padding in the first sequence
    return {"tokens": rng.standard_normal((batch, 7, 32)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_demo_model_matches_onnxruntime(name):
    path = os.path.join(MODELS, f"{name}.onnx")
    feeds = _feeds(name, np.random.default_rng(0))
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ember.load(path).run(feeds)
    assert list(got) == [o.name for o in ember.load(path).outputs]
    for exp, act in zip(expected, got.values()):
        assert act.dtype == exp.dtype and act.shape == exp.shape
        np.testing.assert_allclose(act, exp, rtol=1e-4, atol=1e-5)


def test_demo_models_are_reproducible(tmp_path):
    sys.path.insert(0, MODELS)
    try:
        import build_demo_models
    finally:
        sys.path.remove(MODELS)
    for path in build_demo_models.build_all(str(tmp_path)):
        committed = os.path.join(MODELS, os.path.basename(path))
        assert open(path, "rb").read() == open(committed, "rb").read(), \
            f"{committed} is stale: run python models/build_demo_models.py"


def test_session_describes_inputs_and_outputs():
    sess = ember.load(os.path.join(MODELS, "transformer.onnx"))
    tokens, mask = sess.inputs
    assert (tokens.name, tokens.dtype, tokens.shape) == ("tokens", np.float32, ("batch", "seq", 32))
    assert (mask.name, mask.dtype, mask.shape) == ("mask", np.int64, ("batch", "seq"))
    assert [o.name for o in sess.outputs] == ["encoded"]


def test_load_accepts_path_bytes_and_proto():
    import onnx

    path = os.path.join(MODELS, "mlp.onnx")
    feeds = _feeds("mlp", np.random.default_rng(1))
    results = [ember.load(src).run(feeds)["y"] for src in
               (path, open(path, "rb").read(), onnx.load(path))]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_run_only_requested_outputs():
    path = os.path.join(MODELS, "mlp.onnx")
    sess = ember.load(path)
    full = sess.run(_feeds("mlp", np.random.default_rng(2)))
    only = sess.run(_feeds("mlp", np.random.default_rng(2)), outputs=["y"])
    assert list(only) == ["y"]
    np.testing.assert_array_equal(only["y"], full["y"])


def test_outputs_are_c_ordered_arrays():
    """A depthwise convolution computes channels-last and its kernel returns an NCHW view;
    the session hands back C-ordered arrays, as onnxruntime does."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=8, pads=[1, 1, 1, 1])], "dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 20, 20])],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 8, 20, 20)).astype(np.float32)
    y = ember.load(proto.SerializeToString()).run({"x": x})["y"]
    assert y.flags.c_contiguous
    want = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_symbolic_dimension_must_agree_across_inputs():
    sess = ember.load(os.path.join(MODELS, "transformer.onnx"))
    with pytest.raises(ember.InputError, match="dimension 'seq' is 7"):
        sess.run({"tokens": np.zeros((1, 7, 32), np.float32), "mask": np.ones((1, 6), np.int64)})


@pytest.mark.parametrize("anonymous", ["?", "", "unk__3", "-1"])
def test_anonymous_dimensions_are_independent(anonymous):
    # paddle2onnx names every image axis "?"; onnxruntime treats such names (and "", "-1",
    # its own "unk__N") as unknown, independent dims. A real name must still agree.
    from onnx import TensorProto, helper

    def info(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["a"], ["sa"], keepdims=0),
         helper.make_node("ReduceSum", ["b"], ["sb"], keepdims=0),
         helper.make_node("Add", ["sa", "sb"], ["y"])], "anon",
        [info("a", ["n", anonymous, anonymous]), info("b", ["n", anonymous])],
        [info("y", None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    feeds = {"a": np.ones((2, 48, 192), np.float32), "b": np.ones((2, 5), np.float32)}
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = ember.load(proto)
    np.testing.assert_array_equal(sess.run(feeds)["y"], want)
    with pytest.raises(ember.InputError, match="dimension 'n' is 2 in input 'a' but 3"):
        sess.run({"a": feeds["a"], "b": np.ones((3, 5), np.float32)})


def test_onnxruntime_compatible_session():
    path = os.path.join(MODELS, "cnn.onnx")
    feeds = _feeds("cnn", np.random.default_rng(3))
    ours = ember.InferenceSession(path, providers=["CPUExecutionProvider"])
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for a, b in zip(ours.get_inputs() + ours.get_outputs(), theirs.get_inputs() + theirs.get_outputs()):
        assert (a.name, a.type, a.shape) == (b.name, b.type, b.shape)
    got = ours.run(None, feeds)
    want = theirs.run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert len(ours.run(["logits"], feeds)) == 1


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "nonsense")
    with pytest.raises(ember.BackendUnavailableError, match="unknown backend 'nonsense'"):
        ember.load(os.path.join(MODELS, "mlp.onnx"))


def test_cli_run_and_info(tmp_path):
    out = tmp_path / "out.npz"
    run = subprocess.run([sys.executable, "-m", "ember", "run", os.path.join(MODELS, "transformer.onnx"),
                          "--dim", "batch=2", "--dim", "seq=5", "-o", str(out), "--seed", "3"],
                         capture_output=True, text=True, check=True)
    assert re.search(r"encoded: float32 \[2, 5, 32\]", run.stdout)
    assert np.load(out)["encoded"].shape == (2, 5, 32)
    info = subprocess.run([sys.executable, "-m", "ember", "info", os.path.join(MODELS, "cnn.onnx")],
                          capture_output=True, text=True, check=True).stdout
    assert "opsets: ai.onnx 17" in info
    assert re.search(r"image: tensor\(float\) \[batch, 3, 32, 32\]", info)
    assert re.search(r"Conv\s+2", info)
    assert "cpu: all ops have kernels" in info


def test_runtime_never_imports_oracles():
    pattern = re.compile(r"^\s*(from|import)\s+(onnx\.reference|onnxruntime)\b", re.M)
    offenders = []
    for folder in ("runtime", "importer", "ops"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for f in files:
                if f.endswith(".py") and pattern.search(open(os.path.join(root, f)).read()):
                    offenders.append(os.path.join(root, f))
    assert not offenders, f"runtime code imports a test oracle: {offenders}"
