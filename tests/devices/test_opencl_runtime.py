"""The OpenCL runtime's own behaviour: the bounds-checked mode catches a kernel that writes out
of bounds, a new batch size compiles nothing, placement is decided at plan time with dtypes
and is the placement that runs, and an initialiser-backed input fed by the caller is used."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends import run_checking_placement, unavailable_reason

import ember

pytestmark = pytest.mark.skipif(unavailable_reason("opencl") is not None,
                                reason=str(unavailable_reason("opencl")))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_check_mode_names_the_kernel_that_writes_out_of_bounds(tmp_path):
    # in a subprocess: the mode is chosen when the backend starts
    script = textwrap.dedent("""
        import numpy as np
        from ember.ops.opencl._common import kernel, launch
        from ember.runtime.backends import get_backend
        from ember.runtime.backends.opencl_guard import OutOfBoundsError
        be = get_backend("opencl")
        y = be.empty((100,), np.float32)
        knl = kernel(be, "__kernel void overrun(__global float* y) "
                     "{ y[get_global_id(0)] = 1.0f; }", "overrun")
        launch(be, knl, 100, y)  # in bounds
        try:
            launch(be, knl, 104, y)  # four floats past the end
        except OutOfBoundsError as exc:
            print("CAUGHT", exc)
    """)
    env = {**os.environ, "EMBER_OPENCL_CHECK": "1", "EMBER_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "CAUGHT" in done.stdout and "'overrun'" in done.stdout
    assert "16 byte(s) after argument 0" in done.stdout, done.stdout


def _feeds(name: str, batch: int) -> dict:
    rng = np.random.default_rng(batch)
    if name == "cnn":
        return {"image": rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)}
    return {"tokens": rng.standard_normal((batch, 7, 32), dtype=np.float32),
            "mask": np.ones((batch, 7), np.int64)}


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_new_batch_sizes_compile_nothing(name):
    session = ember.load(os.path.join(REPO, "models", f"{name}.onnx"), backend="opencl")
    cpu = ember.load(os.path.join(REPO, "models", f"{name}.onnx"), backend="cpu")
    be = session._backend
    session.run(_feeds(name, 1))
    for batch in (3, 5, 7):
        before = be.compiled_from_source
        got = session.run(_feeds(name, batch))
        assert be.compiled_from_source == before, f"batch {batch} compiled programs"
        want = cpu.run(_feeds(name, batch))
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_placement_is_decided_with_dtypes_and_is_what_runs():
    # Conv's OpenCL kernel runs float32/float64: a float16 Conv is placed on the host at plan
    # time, with its reason, and never reaches the device kernel
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float16)
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                    helper.make_node("Relu", ["c"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                   [numpy_helper.from_array(w, "w")])
    session = ember.load(model, backend="opencl", simplify=False)
    reasons = {name: (where, reason) for name, _, where, reason in session.placement_reasons}
    assert reasons["conv"] == ("fallback", "dtype float16")
    assert reasons["relu"] == ("device", "")
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float16)
    got = run_checking_placement(session, {"x": x})["y"]
    want = ember.load(model, backend="cpu", simplify=False).run({"x": x})["y"]
    np.testing.assert_array_equal(got, want)


def test_cli_info_shows_the_plan_that_runs(tmp_path):
    path = os.path.join(REPO, "models", "transformer.onnx")
    done = subprocess.run([sys.executable, "-m", "ember", "info", path, "--backend", "opencl"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    session = ember.load(path, backend="opencl")
    listed = [line.split()[:2] for line in done.stdout.splitlines()
              if line.startswith("  ") and len(line.split()) >= 3
              and line.split()[1] in ("device", "fallback", "shape", "metadata", "control")]
    assert listed == [[op, where] for _, op, where in session.placement]


def test_fed_initializer_input_is_used_on_the_device():
    # an input backed by an initialiser is a default the caller may override (onnxruntime)
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                    helper.make_tensor_value_info("w", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                   [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    session = ember.load(model, backend="opencl", simplify=False)
    x = np.zeros(2, np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], [1, 1])
    np.testing.assert_array_equal(session.run({"x": x, "w": np.full(2, 5, np.float32)})["y"],
                                  [5, 5])
    np.testing.assert_array_equal(session.run({"x": x})["y"], [1, 1])


def _kernel_contexts(be) -> set:
    return {knl.context.int_ptr for knl in be._kernels.values()}


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_two_backend_instances_run_side_by_side(name):
    # each OpenCLBackend() is its own context and queue; a session runs every kernel on the
    # instance it was loaded with (the process's default instance compiles and runs nothing)
    from ember.runtime import backends
    from ember.runtime.backends.opencl import OpenCLBackend

    default = backends._instances.get("opencl")
    default_kernels = len(default._kernels) if default is not None else None
    first, second = OpenCLBackend(), OpenCLBackend()
    assert first.context != second.context and first.queue != second.queue
    path = os.path.join(REPO, "models", f"{name}.onnx")
    sessions = [ember.load(path, backend=be) for be in (first, second)]
    for session, be in zip(sessions, (first, second)):
        assert session._backend is be and session.backend == "opencl"
    cpu = ember.load(path, backend="cpu")
    for batch in (1, 3):
        feeds = _feeds(name, batch)
        got = [s.run(feeds) for s in sessions]
        want = cpu.run(feeds)
        for key in want:
            np.testing.assert_array_equal(got[0][key], got[1][key])
            np.testing.assert_allclose(got[0][key], want[key], rtol=1e-4, atol=1e-4)
    for be in (first, second):
        assert be._kernels and _kernel_contexts(be) == {be.context.int_ptr}
    if default is None:
        assert "opencl" not in backends._instances
    else:
        assert len(default._kernels) == default_kernels
    # results left on one instance's device feed the other's session (through the host)
    feeds = _feeds(name, 2)
    on_first = sessions[0].run(feeds, device_outputs=True)
    assert all(v.data.context == first.context for v in on_first.values() if v.on_device())
    if name == "cnn":
        image = first.to_device(feeds["image"])
        assert first.is_device_array(image) and not second.is_device_array(image)
        np.testing.assert_array_equal(sessions[1].run({"image": image})["logits"],
                                      sessions[1].run(feeds)["logits"])


def test_no_opencl_kernel_module_looks_its_backend_up():
    # kernels run on the instance they were bound to (OpImpl.device), never a global one
    import re

    import ember.ops.opencl as package

    folder = os.path.dirname(package.__file__)
    sources = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert "_common.py" in sources and "fused.py" in sources and "attention.py" in sources
    for filename in sources:
        with open(os.path.join(folder, filename), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"\bget_backend\b", text), filename
        assert not re.search(r"(?<![\w.])backend\(\)", text), filename
        assert "_instances" not in text, filename
