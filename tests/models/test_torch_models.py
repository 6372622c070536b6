"""Models exported from PyTorch run in ember and match onnxruntime to 1e-4 relative.

Built by models/export_torch_models.py into a cache folder (both as exported by default and
with `--raw`); skipped where torch is absent
(.ci/run installs it). Tolerance: |ember - ort| <= 1e-4 * (|ort| + max|ort|), i.e. 1e-4
relative, measured against the output's scale so values near zero are not held to 1e-4 of
themselves.
"""
import os
import sys

import numpy as np
import pytest

import ember
from backends import present_backends, run_checking_placement

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "models"))
import export_torch_models  # noqa: E402

CACHE = os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
SPECS = export_torch_models.model_specs()
# each model as exported by default, and each dynamo model also exported raw (the exporter's
# optimiser off: BatchNorm layers, run-time weight transposes and shape plumbing left in)
NAMES = list(SPECS) + [f"{name}_raw" for name, spec in SPECS.items() if spec[3] == "dynamo"]


@pytest.fixture(scope="module", params=NAMES)
def exported(request):
    name = request.param
    path = os.path.join(CACHE, f"{name}.onnx")
    if not os.path.exists(path):
        export_torch_models.export(name.removesuffix("_raw"), CACHE, raw=name.endswith("_raw"))
    inputs = dict(np.load(os.path.join(CACHE, f"{name}.inputs.npz")))
    return name, path, inputs


def assert_close_relative(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-4):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


# Ops whose every node must run on the device when the model runs on a device backend.
DEVICE_OPS = {"Conv", "MatMul", "Gemm", "BatchNormalization", "LayerNormalization", "Attention",
              "FusedConv", "FusedGemm", "FusedMatMul",
              "InstanceNormalization", "GroupNormalization", "Softmax"}


@pytest.mark.parametrize("backend,simplify",
                         [("cpu", False)] + [(b, True) for b in present_backends()],
                         ids=lambda v: {False: "raw", True: "simplified"}.get(v, v))
def test_matches_onnxruntime(exported, backend, simplify):
    name, path, inputs = exported
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)
    session = ember.load(path, backend=backend, simplify=simplify)
    got = run_checking_placement(session, inputs)
    if backend != "cpu":
        on_cpu = [(node, op) for node, op, where in session.placement
                  if op in DEVICE_OPS and where != "device"]
        assert not on_cpu, f"not placed on {backend}: {on_cpu}"
    assert len(got) == len(want)
    for act, exp in zip(got.values(), want):
        assert_close_relative(act, exp)


def test_opsets_are_as_exported(exported):
    name, path, _ = exported
    opset = ember.load(path, simplify=False).model.opsets[""]  # fusions may raise it
    assert opset == (17 if name == "lstm_gru" else 18)


def test_portable_simplify_runs_in_onnxruntime(exported):
    """`ember.simplify` (the default target, onnx): the file loads in onnxruntime, at the
    model's own opsets with no op outside its domains, gives the original's outputs within
    1e-5 relative, and has no more nodes than it had, and fewer than onnx-simplifier leaves
    where that is installed."""
    import onnx

    name, path, inputs = exported
    original = onnx.load(path)
    simplified = ember.simplify(path)
    assert {o.domain: o.version for o in simplified.opset_import if o.domain in ("", "ai.onnx")} \
        == {o.domain: o.version for o in original.opset_import if o.domain in ("", "ai.onnx")}
    assert {n.domain for n in simplified.graph.node} <= {n.domain for n in original.graph.node}
    assert len(simplified.graph.node) <= len(original.graph.node)
    try:  # onnx-simplifier, where it is installed (not a test dependency)
        import onnxsim
    except ImportError:
        onnxsim = None
    if onnxsim is not None:
        assert len(simplified.graph.node) < len(onnxsim.simplify(onnx.load(path))[0].graph.node)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)
    got = ort.InferenceSession(simplified.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, inputs)
    for w, g in zip(want, got):
        assert_close_relative(g, w, rtol=1e-5)
