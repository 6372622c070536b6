"""ember's BLAS thread pool on the CPU (ember.ops.cpu.threads): the `threads` session option is
what BLAS runs with inside `run` (as threadpoolctl reports it), results do not depend on it, and
no BLAS worker keeps a core busy after `run` returns.

Results across thread counts: OpenBLAS's sgemm does not give the same bits on 1 and on 2+
threads (its threaded driver blocks the product differently: ~5e-7 of the largest output
element apart, measured with OpenBLAS 0.3.31); products it keeps on one thread (M*N*K up to
262144) are deterministic. So the demo transformer (every product that small) is asserted
bit-identical across thread counts; a BERT-like model with products BLAS threads is asserted
within 1e-6 of its largest output, and single products within 1e-6 of sum_k |a_ik| |b_kj|
(the scale any summation order's rounding is relative to).

The idle test is a measurement, not a speed assertion: the CPU time of this process (all its
threads) across a 200 ms sleep after `run` returns must stay under 50 ms. Before ember set
OPENBLAS_THREAD_TIMEOUT, a BERT-like model left one OpenBLAS worker per extra core spinning
for ~0.1 s (one whole core on a 2-core machine). Other processes on the machine do not count
in it, but threads of other libraries in this process would (onnxruntime's pool spins for a
while after its own runs), so nothing else runs in between.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import threadpoolctl
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.ops.cpu import blas as _blas, compiled as _compiled
from ember.ops import fused, linalg
from ember.ops.cpu import engine, threads as ember_threads, tuning

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRANSFORMER = os.path.join(REPO, "models", "transformer.onnx")

pytestmark = pytest.mark.skipif(
    not ember_threads.find_libraries(), reason="threadpoolctl finds no BLAS library")


def _bert_like(seq: int = 128, dim: int = 256, ff: int = 1024, heads: int = 4,
               layers: int = 2) -> bytes:
    """A BERT-like encoder (attention + GELU feed-forward + LayerNorm) whose projections are
    large enough for OpenBLAS to share among threads."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def w(name, *shape, scale=0.05):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name, value, dtype=np.int64):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    hd = dim // heads
    split = const("split_shape", [0, 0, heads, hd])
    merge = const("merge_shape", [0, 0, dim])
    scale = const("scale", 1.0 / np.sqrt(hd), np.float32)
    x = "x"
    for i in range(layers):
        p = f"l{i}_"
        qkv = []
        for part in "qkv":
            mm = p + part
            nodes.append(helper.make_node("MatMul", [x, w(mm + "_w", dim, dim)], [mm + "_mm"]))
            nodes.append(helper.make_node("Add", [mm + "_mm", w(mm + "_b", dim)], [mm + "_y"]))
            nodes.append(helper.make_node("Reshape", [mm + "_y", split], [mm + "_r"]))
            perm = [0, 2, 3, 1] if part == "k" else [0, 2, 1, 3]
            nodes.append(helper.make_node("Transpose", [mm + "_r"], [mm + "_t"], perm=perm))
            qkv.append(mm + "_t")
        nodes.append(helper.make_node("MatMul", qkv[:2], [p + "s"]))
        nodes.append(helper.make_node("Mul", [p + "s", scale], [p + "ss"]))
        nodes.append(helper.make_node("Softmax", [p + "ss"], [p + "a"], axis=-1))
        nodes.append(helper.make_node("MatMul", [p + "a", qkv[2]], [p + "c"]))
        nodes.append(helper.make_node("Transpose", [p + "c"], [p + "ct"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [p + "ct", merge], [p + "cm"]))
        nodes.append(helper.make_node("MatMul", [p + "cm", w(p + "o_w", dim, dim)], [p + "o"]))
        nodes.append(helper.make_node("Add", [p + "o", x], [p + "r1"]))
        nodes.append(helper.make_node("LayerNormalization", [p + "r1", w(p + "g1", dim),
                                                            w(p + "b1", dim)], [p + "n1"],
                                      axis=-1))
        nodes.append(helper.make_node("MatMul", [p + "n1", w(p + "f1", dim, ff)], [p + "h"]))
        nodes.append(helper.make_node("Gelu", [p + "h"], [p + "g"], domain="com.microsoft"))
        nodes.append(helper.make_node("MatMul", [p + "g", w(p + "f2", ff, dim)], [p + "f"]))
        nodes.append(helper.make_node("Add", [p + "f", p + "n1"], [p + "r2"]))
        nodes.append(helper.make_node("LayerNormalization", [p + "r2", w(p + "g2", dim),
                                                            w(p + "b2", dim)], [p + "n2"],
                                      axis=-1))
        x = p + "n2"
    graph = helper.make_graph(
        nodes, "bert_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, dim])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", seq, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def _gemm_model(m: int, k: int, n: int) -> tuple[bytes, np.ndarray]:
    w = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "w"], ["y"], transB=1)], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model.SerializeToString(), w


@pytest.fixture(scope="module")
def bert_like() -> tuple[bytes, dict]:
    x = np.random.default_rng(1).standard_normal((2, 128, 256), dtype=np.float32)
    return _bert_like(), {"x": x}


def _transformer_feeds() -> dict:
    rng = np.random.default_rng(0)
    return {"tokens": rng.standard_normal((2, 7, 32), dtype=np.float32),
            "mask": (np.arange(7)[None, :] < np.array([[7], [4]])).astype(np.int64)}


def _blas_threads_reported() -> dict[str, int]:
    """Each loaded BLAS library's thread count, by file (numba's first kernel loads scipy's
    OpenBLAS in the middle of a run)."""
    return {lib["filepath"]: lib["num_threads"] for lib in threadpoolctl.threadpool_info()
            if lib["user_api"] == "blas"}


def test_physical_cores():
    n = ember_threads.physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert ember.load(TRANSFORMER).threads == n == ember_threads.default_threads()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_threads_option_checked(bad):
    with pytest.raises(ValueError):
        ember.load(TRANSFORMER, threads=bad)


def _spy_matmul(monkeypatch) -> list[dict[str, int]]:
    """Record what threadpoolctl reports inside every MatMul / FusedMatMul kernel call (of the
    sessions loaded after this: plans bind their kernels' methods)."""
    seen: list[dict[str, int]] = []
    for cls in (linalg.MatMul, fused.FusedMatMul):
        def run(self, *args, _original=cls.run):
            seen.append(_blas_threads_reported())
            return _original(self, *args)

        monkeypatch.setattr(cls, "run", run)
    return seen


def _blas_count_in_runs(threads: int) -> int:
    """BLAS's own thread count during runs: one where ember's pool runs the products."""
    return 1 if _blas.enabled() else threads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_option_honoured_inside_run(monkeypatch, threads):
    before = _blas_threads_reported()
    seen = _spy_matmul(monkeypatch)
    pool_threads, split_rows = [], _compiled.split_rows
    monkeypatch.setattr(_compiled, "split_rows", lambda *args, **kw: (
        pool_threads.append(_compiled.run_threads()), split_rows(*args, **kw)))
    sess = ember.load(TRANSFORMER, threads=threads)
    assert sess.threads == threads
    sess.run(_transformer_feeds())
    blas = _blas_count_in_runs(threads)
    assert seen and all(set(counts.values()) == {blas} for counts in seen), seen
    assert set(pool_threads) <= {threads}  # what the kernel pool splits for
    after = _blas_threads_reported()
    assert {lib: after[lib] for lib in before} == before  # restored when run returns


def test_intra_op_num_threads_honoured(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    seen = _spy_matmul(monkeypatch)
    sess = ember.InferenceSession(TRANSFORMER, opts, providers=["CPUExecutionProvider"])
    assert sess._session.threads == 1
    sess.run(None, _transformer_feeds())
    assert seen and all(set(counts.values()) == {1} for counts in seen), seen
    assert sess._session.threads == 1
    opts.intra_op_num_threads = 0  # onnxruntime's default: the physical cores
    default = ember.InferenceSession(TRANSFORMER, opts)
    assert default._session.threads == ember_threads.physical_cores()


def test_results_identical_across_thread_counts():
    """Every product of the demo transformer runs on one BLAS thread: the same bits."""
    feeds = _transformer_feeds()
    outs = [ember.load(TRANSFORMER, threads=n).run(feeds) for n in (1, 2, 4)]
    for other in outs[1:]:
        for key, want in outs[0].items():
            assert np.array_equal(other[key], want), key


def test_results_close_across_thread_counts(bert_like):
    """Products that BLAS shares among threads: within 1e-6 of the largest output."""
    model, feeds = bert_like
    outs = [ember.load(model, threads=n).run(feeds) for n in (1, 2, 4)]
    for other in outs[1:]:
        for key, want in outs[0].items():
            scale = float(np.max(np.abs(want)))
            assert float(np.max(np.abs(other[key] - want))) <= 1e-6 * scale, key


@pytest.mark.parametrize("shape", [(1, 1024, 1024), (2, 768, 768), (3, 512, 1024), (4, 512, 512),
                                   (4, 512, 768), (16, 256, 256), (64, 768, 768),
                                   (256, 768, 3072), (1000, 64, 1000)])
def test_products_close_across_thread_counts(shape):
    """Each product on 1, 2 and 3 BLAS threads, through linalg (2-4 rows: by row where that
    is faster) and straight to BLAS."""
    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    via_linalg, direct = [], []
    for threads in (1, 2, 3):
        engine.current().enter(threads)
        try:
            via_linalg.append(linalg.matmul(np, a, b))
            direct.append(np.matmul(a, b))
        finally:
            engine.current().leave()
    for r in via_linalg[1:] + direct:
        assert np.all(np.abs(r.astype(np.float64) - via_linalg[0]) <= 1e-6 * scale)


def test_small_products_by_row():
    """2-4 row products run as one GEMV per row where measured faster, with the same values
    (within rounding) and shapes; others go to BLAS as they are."""
    def by_row(m, k, n):
        return linalg._rows_faster(np.ones((m, k), np.float32), np.ones((k, n), np.float32))

    assert by_row(2, 768, 768) and by_row(2, 3072, 768) and by_row(3, 512, 1024)
    assert by_row(4, 1024, 1024)
    assert not (by_row(1, 768, 768) or by_row(8, 512, 512) or by_row(2, 64, 64)
                or by_row(3, 1024, 256) or by_row(4, 512, 512))
    rng = np.random.default_rng(0)
    for m, k, n in ((2, 768, 768), (3, 512, 1024), (4, 1024, 1024), (4, 512, 512)):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        for bb in (b, np.asfortranarray(b)):  # also a transposed weight (Gemm transB)
            scale = np.abs(a).astype(np.float64) @ np.abs(bb).astype(np.float64)
            got = linalg.matmul(np, a, bb)
            assert got.dtype == np.float32 and got.shape == (m, n)
            assert np.all(np.abs(got - a.astype(np.float64) @ bb) <= 1e-6 * scale)
        batched = linalg.matmul(np, a.reshape(m, 1, k), b)  # a decoder step: [batch, 1, K]
        assert np.array_equal(batched.reshape(m, n), linalg.matmul(np, a, b))
    model, w = _gemm_model(2, 768, 768)  # Gemm with transB=1: by row over a transposed weight
    x = rng.standard_normal((2, 768), dtype=np.float32)
    got = ember.load(model).run({"a": x})["y"]
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= 1e-6 * scale)


def test_openblas_spin_shortened():
    """ember applied OPENBLAS_THREAD_TIMEOUT to the OpenBLAS numpy had already loaded."""
    libs = [lib for lib in engine.current().libraries() if lib.raw]
    if not libs:
        pytest.skip("no OpenBLAS on its pthreads server")
    if "GOTO_THREAD_TIMEOUT" in os.environ and "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
        pytest.skip("the user's GOTO_THREAD_TIMEOUT is left as it is")
    wanted = int(os.environ.get("OPENBLAS_THREAD_TIMEOUT", tuning.THREAD_TIMEOUT))
    for lib in libs:
        timeout = ember_threads._symbol(lib.dynlib, "openblas_thread_timeout")
        if timeout is None:
            pytest.skip("this OpenBLAS does not export openblas_thread_timeout")
        assert timeout() == wanted


def _lstm(hidden: int = 256, features: int = 64, seq: int = 48, batch: int = 1):
    """One LSTM layer at a size whose steps are split between threads (ops/rnn.py)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) / 16).astype(np.float32), name)
             for name, shape in [("W", (1, 4 * hidden, features)),
                                 ("R", (1, 4 * hidden, hidden))]]
    graph = helper.make_graph(
        [helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=hidden)], "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return proto.SerializeToString(), {"x": rng.standard_normal((seq, batch, features))
                                       .astype(np.float32)}


@pytest.mark.parametrize("which", ["transformer", "bert_like", "lstm"])
def test_no_cpu_used_after_run(bert_like, which):
    """Measured, not timed: CPU seconds of this process in a 200 ms sleep after run < 0.05
    (the LSTM's steps run on threads that wait for one another: none may keep waiting)."""
    if which == "transformer":
        sess, feeds = ember.load(TRANSFORMER, threads=2), _transformer_feeds()
    elif which == "lstm":
        proto, feeds = _lstm()
        sess = ember.load(proto, threads=2)
    else:
        sess, feeds = ember.load(bert_like[0], threads=2), bert_like[1]
    sess.run(feeds)
    time.sleep(0.3)  # anything started before this test settles
    used = []
    for _ in range(3):
        sess.run(feeds)
        t0 = time.process_time()
        time.sleep(0.2)
        used.append(time.process_time() - t0)
    assert min(used) < 0.05, used
