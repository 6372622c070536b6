"""ember.ops.cpu.memory: freed memory is kept for the next run (glibc's malloc thresholds)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys
import numpy as np
from ember.ops.cpu import memory

def faults_of_a_run():   # six 3 MiB arrays alive at once, then freed: a run's outputs

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(3 << 18, np.float32) for _ in range(6)]
    for a in arrays:
        a.fill(1.0)        # touch every page
    del arrays, a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "keep":
    assert memory.keep_freed_memory()
faults_of_a_run()          # the first time, the pages come from the kernel either way
print(faults_of_a_run(), faults_of_a_run())
"""


def _second_faults(mode: str, **env: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_array_of_a_size_freed_before_is_served_without_page_faults():
    """18 MiB (4,608 pages) a run: without ember's setting glibc gives them back to the
    kernel after each run and faults them in again; with it, the freed pages are reused."""
    env = {"EMBER_KEEP_MEMORY": "1"}
    kept = _second_faults("keep", **env)
    plain = _second_faults("plain", **env)
    assert max(kept) < 200, kept
    assert min(plain) > 4000, plain


def test_the_users_own_malloc_settings_and_the_opt_out_are_left_alone():
    for env in ({"EMBER_KEEP_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1000000"}):
        code = "from ember.ops.cpu import memory; print(memory.keep_freed_memory())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True)
        assert out.stdout.strip() == "False"


def test_a_large_buffer_is_handed_out_again_only_once_nothing_refers_to_it(monkeypatch):
    """ops/cpu/tiles.empty from 32 MB: a freed buffer is reused, one still referred to (by the
    array or any view of it) is not, and at most KEEP_BUFFER_BYTES are kept (in the process's
    CPU engine's list)."""
    from ember.ops.cpu import engine, tiles as _tiles, tuning
    monkeypatch.setenv("EMBER_KEEP_MEMORY", "1")
    monkeypatch.setattr(engine.current(), "kept", [])
    n = _tiles.KEEP_FROM_BYTES // 4 + 1024

    def address(a):
        return a.__array_interface__["data"][0]

    first = _tiles.empty((n,))
    held = address(first)
    second = _tiles.empty((n,))
    assert address(second) != held
    del first
    third = _tiles.empty((n,))
    assert address(third) == held           # freed: handed out again
    view = third[10:20]
    del third
    assert address(_tiles.empty((n,))) != held  # a view keeps it in use
    del view
    assert address(_tiles.empty((n // 4,))) != held  # far smaller: not this buffer
    size = engine.current().kept[0].size
    monkeypatch.setattr(tuning, "KEEP_BUFFER_BYTES", 4 * size)   # four buffers of n floats
    alive = [_tiles.empty((n,)) for _ in range(6)]
    assert len(engine.current().kept) == 4
    assert all(a.flags.c_contiguous and address(a) % 64 == 0 for a in alive)
    del alive
    again = _tiles.empty((n,))
    assert any(again.base is b for b in engine.current().kept)   # a kept one, freed


def test_a_large_output_held_by_the_user_is_not_overwritten_by_the_next_run():
    """A MatMul whose 37.7 MB output lands in a kept buffer: the first run's output, still
    held, keeps onnxruntime's values after a second run with other inputs."""
    ort = pytest.importorskip("onnxruntime")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import ember
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 2304)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ember.load(proto.SerializeToString())
    oracle = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x1, x2 = (rng.standard_normal((4096, 64)).astype(np.float32) for _ in range(2))
    y1 = sess.run({"x": x1})["y"]
    y2 = sess.run({"x": x2})["y"]
    assert y1.nbytes >= 32 << 20
    np.testing.assert_allclose(y1, oracle.run(None, {"x": x1})[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y2, oracle.run(None, {"x": x2})[0], rtol=1e-4, atol=1e-4)
