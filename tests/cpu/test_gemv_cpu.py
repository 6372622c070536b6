"""The compiled GEMV of one row by a constant float32 weight (ops/cpu/gemv.py, chosen by
ops/linalg.py's `product_lowering` as "cpu.gemv"): onnxruntime's results within the products'
tolerance, for widths that are and are not whole column blocks, and the same bits from one
thread, two threads, and a session shared by several caller threads."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.ops.cpu import gemv, tiles

pytestmark = pytest.mark.skipif(gemv.kernel() is None,
                                reason="needs numba and an AVX-512 or AVX2 CPU")


def _model(k, n, rank, bias):
    """x (1, k) or (1, 1, k) @ a constant W (k, n), then + a bias: a decoder's projection."""
    rng = np.random.default_rng(k * 7 + n)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    last = "y"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
        nodes.append(helper.make_node("Add", ["y", "b"], ["z"]))
        last = "z"
    shape = [1, k] if rank == 2 else [1, 1, k]
    graph = helper.make_graph(
        nodes, "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


@pytest.mark.parametrize("k, n, rank, bias", [(512, 1408, 3, False), (1408, 512, 2, True),
                                              (300, 1000, 2, False), (256, 8000, 3, True)])
def test_one_row_gemv_matches_onnxruntime_and_gives_the_same_bits_on_any_threads(k, n, rank,
                                                                                    bias):
    proto = _model(k, n, rank, bias)
    x = np.random.default_rng(1).standard_normal((1, k) if rank == 2 else (1, 1, k))
    feeds = {"x": x.astype(np.float32)}
    sess = ember.load(proto, threads=2)
    # x @ W + b is a Gemm at rank 2, a FusedMatMul at rank 3: each keeps W packed
    assert [kernel for _, op, kernel, _ in sess.kernels
            if op in ("MatMul", "Gemm", "FusedMatMul")] == ["cpu.gemv"]
    name = sess.outputs[0].name
    got = sess.run(feeds)[name]
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with ThreadPoolExecutor(3) as pool:
        shared = list(pool.map(lambda _: sess.run(feeds)[name], range(6)))
    one = ember.load(proto, threads=1).run(feeds)[name]
    for y in shared + [one]:
        np.testing.assert_array_equal(y, got)


def test_more_rows_or_a_small_weight_are_not_the_gemv():
    """Two rows go to the register tiles (or BLAS), a weight under GEMV_MIN_KN to BLAS."""
    from ember.ops import linalg
    from ember.ops.registry import Sketch
    f32 = np.dtype(np.float32)

    def kernel(m, k, n):
        return linalg.product_lowering(Sketch((m, k), f32), Sketch((k, n), f32), True).kernel

    assert kernel(1, 512, 512) == "cpu.gemv"
    assert kernel(2, 512, 512) != "cpu.gemv"
    assert kernel(1, 64, 64) != "cpu.gemv"


def test_pack_pads_the_last_block_with_zero_columns():
    w = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
    packed = gemv.pack(w)
    assert packed.shape == (-(-20 // tiles.LANES), 3, tiles.LANES)
    flat = packed.transpose(1, 0, 2).reshape(3, -1)
    np.testing.assert_array_equal(flat[:, :20], w)
    assert not flat[:, 20:].any()


def test_gemm_with_a_transposed_constant_weight_packs_it_once(monkeypatch):
    """Gemm(x, W, c, transB=1), as a Linear layer is often exported: the GEMV, W packed at
    the first run only (its transposed view is kept, so the pack is found again)."""
    k, n = 640, 1000
    rng = np.random.default_rng(3)
    w = rng.standard_normal((n, k)).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)],
        "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    proto = proto.SerializeToString()
    packs = []
    pack = gemv.pack
    monkeypatch.setattr(gemv, "pack", lambda b: (packs.append(b.shape), pack(b))[1])
    sess = ember.load(proto, threads=2)
    assert [kernel for _, _, kernel, _ in sess.kernels] == ["cpu.gemv"]
    feeds = {"x": rng.standard_normal((1, k)).astype(np.float32)}
    got = [sess.run(feeds)["y"] for _ in range(3)]
    assert packs == [(k, n)]
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    for y in got[1:]:
        np.testing.assert_array_equal(y, got[0])
