"""The CUDA backend runs the ONNX node suite and the demo/PyTorch models like the CPU backend.

Two modes, one set of tests:

* `gpu`: real cupy on a CUDA device (tests/gpu_check.sh runs this on a GPU machine); skipped
  where no device is present. Native CUDA C kernels (Conv, pools, fused activations) and the
  shared kernels (the CPU kernels' array code over cupy) both run.
* `emulated`: tests/_fake_cupy.py, a numpy stand-in for cupy that refuses host arrays mixed
  with device arrays; it runs on any machine (skipped where a real device is present, which
  tests the same code for real). It checks the shared kernels' wiring and device residency:
  every node the backend places on the device runs there on "device" arrays, and results
  match the CPU. CUDA C cannot run in it; tests/devices/test_cuda_sources.py compiles that code.

Every node case runs, with the CPU's expected failures (tests/xfail_cpu.txt) as strict
xfails. Shared kernels compute over `self.xp` (cupy) and have no per-call CPU fallback: one that
meets something cupy lacks fails the case. Which nodes run on the CPU is decided at plan time,
and `run_checking_placement` checks that every node placed on the device ran there.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from backends import cuda_backend, real_cuda_device
from onnx_suites import load_case_dir, load_xfails, run_case, suite_case_dirs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)
XFAILS = load_xfails(os.path.join(HERE, "xfail_cpu.txt"))
XFAILS.update(load_xfails(os.path.join(HERE, "xfail_cuda.txt")))
CASES = suite_case_dirs("node")
# EMBER_TEST_SHARD=i/n runs every n-th node case from the i-th (and the other tests only in
# shard 0): tests/gpu_check.sh runs shards in parallel so cupy's first-time kernel compiles
# (cached on disk afterwards) are spread over the CPU cores.
_SHARD = os.environ.get("EMBER_TEST_SHARD", "0/1")
SHARD, SHARDS = (int(v) for v in _SHARD.split("/"))


REAL = real_cuda_device()


@pytest.fixture(scope="module", params=["gpu", "emulated"])
def cuda(request):
    """The CUDA backend in one mode; yields the backend object."""
    if request.param == "gpu" and not REAL:
        pytest.skip("no CUDA device (cupy with a CUDA driver and a GPU)")
    if request.param == "emulated" and REAL:
        pytest.skip("a real CUDA device is present: the gpu mode runs instead")
    with cuda_backend(request.param) as backend:
        yield backend


@pytest.fixture
def cuda_main(cuda):
    """`cuda`, for the tests other than the node cases (run in shard 0 only)."""
    if SHARD != 0:
        pytest.skip("runs in shard 0")
    return cuda


def _param(case_dir: str):
    name = os.path.basename(case_dir)
    marks = [pytest.mark.xfail(strict=True, reason=XFAILS[name])] if name in XFAILS else []
    return pytest.param(case_dir, id=name, marks=marks)


@pytest.mark.parametrize("case_dir", [_param(d) for d in CASES[SHARD::SHARDS]])
def test_node_case(cuda, case_dir):
    before = cuda.fallbacks
    run_case(load_case_dir(case_dir), backend="cuda")
    assert cuda.fallbacks == before, "a node placed on the device ran on the CPU"


# ---------------------------------------------------------------------------------------------
# placement: the families the backend covers run on the device, without CPU fallbacks

DEVICE_CASES = {
    "test_relu": "Relu", "test_sigmoid": "Sigmoid", "test_gelu_default_1": "Gelu",
    "test_add_bcast": "Add", "test_matmul_4d": "MatMul", "test_gemm_default_no_bias": "Gemm",
    "test_basic_conv_with_padding": "Conv", "test_maxpool_2d_pads": "MaxPool",
    "test_averagepool_2d_pads_count_include_pad": "AveragePool",
    "test_globalaveragepool": "GlobalAveragePool", "test_reduce_sum_keepdims_example": "ReduceSum",
    "test_softmax_axis_1": "Softmax", "test_layer_normalization_4d_axis1": "LayerNormalization",
    "test_batchnorm_example": "BatchNormalization", "test_transpose_default": "Transpose",
    "test_concat_2d_axis_0": "Concat", "test_gather_0": "Gather", "test_slice": "Slice",
    "test_reshape_reordered_all_dims": "Reshape", "test_einsum_batch_matmul": "Einsum",
}


@pytest.mark.parametrize("case, op", sorted(DEVICE_CASES.items()))
def test_op_runs_on_device(cuda_main, case, op):
    cuda = cuda_main
    before = cuda.fallbacks
    session = run_case(load_case_dir(os.path.join(os.path.dirname(CASES[0]), case)), "cuda")
    where = {w for _, op_type, w in session.placement if op_type == op}
    assert where == {"device"}, session.placement
    assert cuda.fallbacks == before, "the kernel fell back to the CPU"


# ---------------------------------------------------------------------------------------------
# models: demo models and PyTorch exports, CUDA vs CPU

def _demo_feeds(name: str) -> dict:
    rng = np.random.default_rng(0)
    if name == "cnn":
        return {"image": rng.standard_normal((2, 3, 32, 32), dtype=np.float32)}
    if name == "mlp":
        return {"x": rng.standard_normal((5, 4), dtype=np.float32)}
    return {"tokens": rng.standard_normal((2, 7, 32), dtype=np.float32),
            "mask": np.array([[1] * 7, [1] * 5 + [0] * 2], dtype=np.int64)}


def _torch_models() -> list[str]:
    folders = sorted(d for d in os.listdir(os.path.join(REPO, ".cache"))
                     if d.startswith("torch-models")) if os.path.isdir(
        os.path.join(REPO, ".cache")) else []
    if not folders:
        return []
    root = os.path.join(REPO, ".cache", folders[-1])
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".onnx")
                  and os.path.exists(os.path.join(root, f[:-5] + ".inputs.npz")))


def assert_close_relative(actual, expected, rtol=1e-4):
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected)
        return
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _compare(path: str, feeds: dict, cuda) -> None:
    import ember

    want = ember.load(path, backend="cpu").run(feeds)
    session = ember.load(path, backend="cuda")
    got = session.run(feeds)
    assert list(got) == list(want)
    for name in want:
        assert_close_relative(got[name], want[name])
    assert session.placement_summary().get("device", 0) > 0


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_demo_model_matches_cpu(cuda_main, name):
    cuda = cuda_main
    before = cuda.fallbacks
    _compare(os.path.join(REPO, "models", f"{name}.onnx"), _demo_feeds(name), cuda)
    assert cuda.fallbacks == before


@pytest.mark.parametrize("path", _torch_models(), ids=lambda p: os.path.basename(p)[:-5])
def test_torch_model_matches_cpu(cuda_main, path):
    feeds = dict(np.load(path[:-5] + ".inputs.npz"))
    _compare(path, feeds, cuda_main)


def test_describe_and_transfers(cuda_main):
    cuda = cuda_main
    assert cuda.describe().startswith("cuda")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    d = cuda.to_device(x)
    assert cuda.is_device_array(d) and not cuda.is_device_array(x)
    back = cuda.to_host([d, [d]])
    np.testing.assert_array_equal(back[0], x)
    np.testing.assert_array_equal(back[1][0], x)
    s = np.array(["a"], dtype=object)
    assert cuda.to_device(s) is s  # strings stay on the host
    cuda.synchronize()


def test_fused_ops_run_on_device(cuda_main):
    # the simplifier fuses for the backend it simplifies for: on CUDA too, Conv + residual +
    # Relu and MatMul + bias + Gelu become ai.ember ops that run on the device
    from onnx import TensorProto, helper, numpy_helper

    import ember

    cuda = cuda_main
    rng = np.random.default_rng(1)
    weights = {"k": rng.standard_normal((4, 4, 3, 3)), "w": rng.standard_normal((9, 5)),
               "bias": rng.standard_normal(5)}
    nodes = [helper.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"]),
             helper.make_node("MatMul", ["a", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["mb"]),
             helper.make_node("Gelu", ["mb"], ["g"])]
    graph = helper.make_graph(
        nodes, "fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6, 7]),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 9])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "g")],
        [numpy_helper.from_array(v.astype(np.float32), n) for n, v in weights.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    feeds = {"x": rng.standard_normal((2, 4, 6, 7), dtype=np.float32),
             "a": rng.standard_normal((2, 3, 9), dtype=np.float32)}
    before = cuda.fallbacks
    session = ember.load(proto, backend="cuda")
    fused = {op: where for _, op, where in session.placement if op.startswith("Fused")}
    assert fused == {"FusedConv": "device", "FusedMatMul": "device"}, session.placement
    want = ember.load(proto, backend="cpu", simplify=False).run(feeds)
    got = session.run(feeds)
    for name in want:
        assert_close_relative(got[name], want[name])
    assert cuda.fallbacks == before


def test_dtypes_cupy_lacks_are_placed_on_the_host_at_plan_time(cuda_main):
    # cupy has no bfloat16 arrays: the shared kernel refuses the node when the plan is made,
    # with the reason, instead of failing (or quietly falling back) on every call
    import ml_dtypes
    from onnx import TensorProto, helper

    import ember

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=1),
         helper.make_node("Relu", ["y"], ["z"])], "bf16",
        [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 3]) for n in ("a", "b")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    session = ember.load(proto, backend="cuda")
    reasons = {op: (where, why) for _, op, where, why in session.placement_reasons}
    assert reasons["Add"] == ("fallback", "dtype bfloat16 (cupy has no such arrays)")
    assert reasons["Cast"][0] == "fallback" and reasons["Relu"] == ("device", "")
    a = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    got = session.run({"a": a, "b": a})["z"]
    np.testing.assert_array_equal(got, ember.load(proto).run({"a": a, "b": a})["z"])


def test_contrib_transformer_ops_run_on_device(cuda_main):
    # onnxruntime's fused transformer ops (com.microsoft) are shared kernels on CUDA too
    from onnx import TensorProto, helper, numpy_helper

    import ember

    cuda = cuda_main
    rng = np.random.default_rng(2)
    hidden, heads = 16, 2
    weights = {"gamma": rng.standard_normal(hidden), "beta": rng.standard_normal(hidden),
               "bias": rng.standard_normal(hidden)}
    ms = "com.microsoft"
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["n"],
                              domain=ms, epsilon=1e-5),
             helper.make_node("MultiHeadAttention", ["n", "n", "n"], ["a"], domain=ms,
                              num_heads=heads),
             helper.make_node("BiasGelu", ["a", "bias"], ["y"], domain=ms)]
    graph = helper.make_graph(
        nodes, "contrib",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, hidden]) for n in ("x", "skip")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, hidden])],
        [numpy_helper.from_array(v.astype(np.float32), n) for n, v in weights.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(ms, 1)])
    feeds = {n: rng.standard_normal((2, 5, hidden), dtype=np.float32) for n in ("x", "skip")}
    before = cuda.fallbacks
    session = ember.load(proto, backend="cuda")
    assert {where for _, _, where in session.placement} == {"device"}, session.placement
    assert_close_relative(session.run(feeds)["y"], ember.load(proto).run(feeds)["y"])
    assert cuda.fallbacks == before
