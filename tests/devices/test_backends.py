"""The backend switch: placement, transfers, the OpenCL program cache, unavailable backends."""
import os
import subprocess
import sys

import numpy as np
import pytest

import ember
from backends import unavailable_reason
from ember.runtime.backends import get_backend
from ember.runtime.executor import Transfer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CNN = os.path.join(REPO, "models", "cnn.onnx")
needs_opencl = pytest.mark.skipif(unavailable_reason("opencl") is not None,
                                  reason=f"opencl unavailable: {unavailable_reason('opencl')}")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ember.BackendUnavailableError, match="unknown backend 'tpu'"):
        ember.load(CNN, backend="tpu")


def test_unavailable_backend_names_what_is_missing():
    for backend in ("opencl", "cuda"):
        reason = unavailable_reason(backend)
        if reason is not None:  # the message says what is missing and how to install it
            assert "install" in reason or "driver" in reason or "device" in reason, reason


@pytest.mark.parametrize("version, cpu, bits", [
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver3", True, 256),  # Zen 4 too
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-haswell", True, 256),
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-sapphirerapids", True, 512),
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver4", True, 512),
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-skylake-avx512", True, 512),
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-icelake-server", True, 512),
    ("OpenCL 3.0 CUDA", False, 512),
    ("OpenCL 3.0 (Build 0)", True, 512),  # a CPU driver other than PoCL: as before
])
def test_gemm_vectors_fit_the_cpu_pocl_compiles_for(version, cpu, bits):
    """PoCL 3.0's LLVM 14 compiles for "znver3" on an AVX-512 Zen 4 and aborted the process on
    16-float vectors: the OpenCL kernels' vectors are as wide as the CPU PoCL targets."""
    from ember.runtime.backends.opencl import gemm_vector_bits

    assert gemm_vector_bits(version, cpu) == bits


@needs_opencl
def test_same_user_code_any_backend():
    feeds = {"image": np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)}
    cpu = ember.load(CNN).run(feeds)["logits"]
    cl = ember.load(CNN, backend="opencl").run(feeds)["logits"]
    assert isinstance(cl, np.ndarray)
    np.testing.assert_allclose(cl, cpu, rtol=1e-4, atol=1e-5)


@needs_opencl
def test_environment_variable_selects_backend(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "opencl")
    assert ember.load(CNN).backend == "opencl"


@needs_opencl
def test_values_stay_on_device_between_device_nodes():
    sess = ember.load(CNN, backend="opencl")
    transfers = [step.node.op_type for step in sess._plan.steps if isinstance(step.kernel, Transfer)]
    device_nodes = sum(1 for _, _, where in sess.placement if where == "device")
    fallback_nodes = sum(1 for _, _, where in sess.placement if where == "fallback")
    # One upload of the input and one download of the output, plus at most a round trip
    # around each node that has no device kernel.
    assert transfers.count("ToDevice") <= 1 + fallback_nodes
    assert transfers.count("ToHost") <= 1 + fallback_nodes
    assert device_nodes + fallback_nodes == len(sess.placement)


@needs_opencl
def test_second_load_compiles_nothing(tmp_path):
    script = (
        "import numpy as np, ember\n"
        "from ember.runtime.backends import get_backend\n"
        f"s = ember.load({CNN!r}, backend='opencl')\n"
        "s.run({'image': np.zeros((1, 3, 32, 32), np.float32)})\n"
        "print(get_backend('opencl').compiled_from_source)\n")
    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path)}
    runs = [int(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                               text=True, check=True).stdout.split()[-1]) for _ in range(2)]
    assert runs[0] > 0, "the first load should compile the model's kernels"
    assert runs[1] == 0, "the second load should take every program from the disk cache"


@needs_opencl
def test_shape_work_stays_on_host():
    sess = ember.load(os.path.join(REPO, "models", "transformer.onnx"), backend="opencl")
    for name, op, where in sess.placement:
        if op in ("Shape", "Size"):
            assert where == "metadata", (name, where)
    assert get_backend("opencl").is_device_array(get_backend("opencl").to_device(np.ones(2)))


def test_cpu_session_imports_no_device_code():
    script = ("import sys, numpy as np, ember\n"
              "s = ember.load(sys.argv[1])\n"
              "s.run({'image': np.zeros((1, 3, 32, 32), np.float32)})\n"
              "print([m for m in sys.modules if m.startswith(('ember.ops.opencl', "
              "'ember.ops.cuda', 'ember.runtime.backends.opencl', 'ember.runtime.backends.cuda', "
              "'pyopencl', 'cupy'))])\n")
    done = subprocess.run([sys.executable, "-c", script, os.path.join(REPO, "models", "cnn.onnx")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
