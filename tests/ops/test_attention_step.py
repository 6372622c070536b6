"""Attention (opset 23) of a decoder step's few query rows as one compiled kernel (ops/attention.py
`_step`, kernel "cpu.attention-step"): onnxruntime's results, with a KV cache, grouped-query
heads, masks (float, bool, causal) and 3-D inputs; the same bits on one thread, two, and from
a session shared by caller threads; a prefill's many rows keep the BLAS products."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ember
from ember.ops.cpu import compiled

pytestmark = pytest.mark.skipif(not compiled.enabled(), reason="needs numba")

F = TensorProto.FLOAT


def _model(q_shape, kv_shape, past_shape, mask, causal, q_heads=None, kv_heads=None):
    """Attention(Q, K, V, mask?, past K, past V) -> Y, present K, present V; `mask` None,
    "float" or "bool", of shape (1, 1, L, past + S); shapes as given (None: symbolic)."""
    names = ["q", "k", "v", "m" if mask else "", "pk", "pv"]
    attrs = {"is_causal": int(causal)}
    if q_heads:
        attrs.update(q_num_heads=q_heads, kv_num_heads=kv_heads)
    node = helper.make_node("Attention", names, ["y", "present_k", "present_v"], **attrs)
    length = None if q_shape is None else q_shape[-2 if len(q_shape) == 4 else 1]
    total = None if length is None else past_shape[2] + kv_shape[-2 if len(kv_shape) == 4
                                                                  else 1]
    inputs = [helper.make_tensor_value_info("q", F, q_shape),
              helper.make_tensor_value_info("k", F, kv_shape),
              helper.make_tensor_value_info("v", F, kv_shape)]
    if mask:
        inputs.append(helper.make_tensor_value_info(
            "m", TensorProto.BOOL if mask == "bool" else F, [1, 1, length, total]))
    inputs += [helper.make_tensor_value_info("pk", F, past_shape),
               helper.make_tensor_value_info("pv", F, past_shape)]
    graph = helper.make_graph([node], "step", inputs,
                              [helper.make_tensor_value_info(n, F, None)
                               for n in ("y", "present_k", "present_v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model.SerializeToString()


def _feeds(batch, q_heads, kv_heads, length, past, mask, three_d, rng):
    head = 64
    q = rng.standard_normal((batch, q_heads, length, head)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, length, head)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, length, head)).astype(np.float32)
    if three_d:
        q, k, v = (x.transpose(0, 2, 1, 3).reshape(batch, length, -1) for x in (q, k, v))
    feeds = {"q": q, "k": k, "v": v,
             "pk": rng.standard_normal((batch, kv_heads, past, head)).astype(np.float32),
             "pv": rng.standard_normal((batch, kv_heads, past, head)).astype(np.float32)}
    if mask:
        allowed = rng.random((1, 1, length, past + length)) > 0.2
        allowed[..., -1] = True  # each row sees at least its own key
        feeds["m"] = allowed if mask == "bool" else np.where(allowed, 0, -np.inf).astype(
            np.float32)
    return feeds


def _check(proto, feeds, kernel):
    sess = ember.load(proto, threads=2)
    got = sess.run(feeds)
    assert [k for _, op, k, _ in sess.kernels if op == "Attention"] == [kernel]
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)
    for name, expected in zip(("y", "present_k", "present_v"), want):
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-5)
    with ThreadPoolExecutor(3) as pool:
        shared = list(pool.map(lambda _: sess.run(feeds)["y"], range(6)))
    one = ember.load(proto, threads=1).run(feeds)["y"]
    for y in shared + [one]:
        np.testing.assert_array_equal(y, got["y"])


@pytest.mark.parametrize("batch, q_heads, kv_heads, length, mask, causal", [
    (1, 8, 2, 1, "float", False),   # a GQA decoder step, as llama's
    (2, 4, 4, 1, "bool", False),
    (3, 8, 2, 2, None, True),       # two new tokens, causal over the cache
    (1, 6, 3, 1, None, False),
])
def test_decoder_step_is_one_compiled_call_matching_onnxruntime(batch, q_heads, kv_heads,
                                                                 length, mask, causal):
    past = 37
    rng = np.random.default_rng(batch * 10 + q_heads)
    feeds = _feeds(batch, q_heads, kv_heads, length, past, mask, False, rng)
    proto = _model(list(feeds["q"].shape), list(feeds["k"].shape), list(feeds["pk"].shape),
                   mask, causal)
    _check(proto, feeds, "cpu.attention-step")


def test_three_d_inputs_with_the_heads_attributes():
    rng = np.random.default_rng(5)
    feeds = _feeds(2, 8, 2, 1, 20, "float", True, rng)
    proto = _model(list(feeds["q"].shape), list(feeds["k"].shape), list(feeds["pk"].shape),
                   "float", False, q_heads=8, kv_heads=2)
    _check(proto, feeds, "cpu.attention-step")


def test_a_prefill_keeps_the_products_and_symbolic_shapes_settle_at_the_first_run():
    rng = np.random.default_rng(6)
    feeds = _feeds(1, 4, 4, 24, 0, None, False, rng)  # 24 query rows a kv head: a prefill
    proto = _model(list(feeds["q"].shape), list(feeds["k"].shape), list(feeds["pk"].shape),
                   None, True)
    _check(proto, feeds, "cpu.board-gemm" if ember.load(proto).kernels[0][2] != "numpy"
           else "numpy")
    symbolic = _model(["b", 8, "s", 64], ["b", 2, "s", 64], ["b", 2, "p", 64], None, False)
    sess = ember.load(symbolic)
    assert sess.kernels[0][2] == "by geometry"
    sess.run(_feeds(1, 8, 2, 1, 9, None, False, rng))
    assert sess.kernels[0][2] == "cpu.attention-step"


def test_a_step_split_between_threads_gives_one_threads_bits(monkeypatch):
    """Large enough to be cut into pieces on two threads (the pieces run the piece function,
    one thread the kernel itself): the same bits either way."""
    rng = np.random.default_rng(7)
    feeds = _feeds(8, 8, 2, 2, 300, "float", False, rng)
    proto = _model(list(feeds["q"].shape), list(feeds["k"].shape), list(feeds["pk"].shape),
                   "float", False)
    pieces = []
    run_rows = compiled.run_rows
    monkeypatch.setattr(compiled, "run_rows", lambda kernel, bounds, *args, **kw: (
        pieces.append(len(bounds) - 1), run_rows(kernel, bounds, *args, **kw))[1])
    two = ember.load(proto, threads=2).run(feeds)["y"]
    one = ember.load(proto, threads=1).run(feeds)["y"]
    assert pieces == [4, 1]
    np.testing.assert_array_equal(two, one)
