"""The OpenCL kernels of the com.microsoft transformer contrib ops (ops/opencl/contrib.py):
Attention, MultiHeadAttention, GroupQueryAttention, SkipLayerNormalization, MatMulNBits,
BiasGelu and FastGelu.

Each case is placed on the device ("device" in session.placement), runs there
(tests/backends.py run_checking_placement: no call fell back to the CPU kernel) and matches
onnxruntime's CPU provider (float32: 1e-4 relative to the output's largest magnitude; where
onnxruntime lacks a case, an equivalent model it runs). The cases the kernels leave to the CPU
are checked to be refused at plan time (dtypes) or decided in setup (attributes). The real
models: a torch-exported BERT fused by onnxruntime.transformers.optimizer, and the 4-bit
Llama-style decoder of test_contrib_lowbit.py generating greedily with its KV cache."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest

import ember
from backends import run_checking_placement, unavailable_reason

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(unavailable_reason("opencl") is not None,
                                reason=f"opencl unavailable: {unavailable_reason('opencl')}")

from test_contrib_attention import (  # noqa: E402  (helpers building the contrib models)
    MASKS, assert_close, attention_inputs, contrib_model, gqa_model, key_mask, mha_inputs,
    normal, ort_outputs, qkv, rope_caches)

MS = "com.microsoft"
F16 = np.float16
# the op types ops/opencl/contrib.py runs on the device
CONTRIB_CL = {"Attention", "MultiHeadAttention", "GroupQueryAttention",
              "SkipLayerNormalization", "MatMulNBits", "BiasGelu", "FastGelu"}


def contrib_placement(session):
    return [(op, where) for _, op, where in session.placement if op in CONTRIB_CL]


def run_cl(model, feeds):
    """Load `model` on OpenCL, assert its contrib nodes are placed on the device, run it with
    run_checking_placement; (session, outputs)."""
    session = ember.load(model, backend="opencl")
    placed = contrib_placement(session)
    assert placed and all(where == "device" for _, where in placed), session.placement_reasons
    return session, run_checking_placement(session, feeds)


def check(model, feeds, oracle=None, oracle_feeds=None, rtol=1e-4):
    """The OpenCL run against onnxruntime on `oracle` (default: the model), every output."""
    want = ort_outputs(oracle or model, oracle_feeds or feeds)
    _, got = run_cl(model, feeds)
    for o in model.graph.output:
        assert_close(got[o.name], want[o.name], rtol)
    return got


def check_against_cpu(model, feeds, rtol=1e-10):
    """float64: onnxruntime's CPU kernels of these ops are float32 only; ember's CPU kernel is
    the oracle (both compute in float64)."""
    want = ember.load(model, backend="cpu").run(feeds)
    _, got = run_cl(model, feeds)
    for name, w in want.items():
        assert_close(got[name], w, rtol)


def fallback_reason(model):
    """The placement reason of the model's one node on OpenCL."""
    (_, _, where, reason), = ember.load(model, backend="opencl").placement_reasons
    assert where == "fallback"
    return reason


# --------------------------------------------------------------------------------------------
# Attention (packed QKV projection)

@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention_masks(mask, unidirectional):
    b, s, hidden, heads = 2, 5, 12, 3
    inputs = attention_inputs(b, s, hidden) + [("mask_index", MASKS[mask](b, s, s))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=heads,
                                 unidirectional=unidirectional)
    check(model, feeds)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "end_start", "raw_2d", "raw_3d"])
@pytest.mark.parametrize("seq", [1, 3])
def test_attention_past_present(mask, seq):
    b, hidden, heads, past_len = 2, 16, 2, 4
    total = past_len + seq
    past = normal(2, b, heads, past_len, hidden // heads)
    inputs = attention_inputs(b, seq, hidden) + [("mask_index", MASKS[mask](b, seq, total)),
                                                  ("past", past)]
    model, feeds = contrib_model("Attention", inputs, ["y", "present"], num_heads=heads,
                                 unidirectional=1)
    got = check(model, feeds)
    assert got["present"].shape == (2, b, heads, total, hidden // heads)


def test_attention_past_without_present():
    """A past without the present output (onnxruntime insists on it: its oracle model has
    it): K and V are then separate arrays."""
    b, seq, hidden, heads, past_len = 2, 3, 8, 2, 4
    inputs = attention_inputs(b, seq, hidden) + [
        ("mask_index", key_mask(b, past_len + seq)), ("past", normal(2, b, heads, past_len, 4))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=heads, unidirectional=1)
    oracle, _ = contrib_model("Attention", inputs, ["y", "present"], num_heads=heads,
                              unidirectional=1)
    check(model, feeds, oracle=oracle)


def test_attention_qkv_hidden_sizes_scale_no_bias():
    inputs = attention_inputs(2, 4, 8, width=8 + 8 + 12, bias=False)
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2,
                                 qkv_hidden_sizes=[8, 8, 12], scale=0.3)
    assert check(model, feeds)["y"].shape == (2, 4, 12)
    inputs = attention_inputs(2, 4, 8, width=4 + 4 + 12)
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2,
                                 qkv_hidden_sizes=[4, 4, 12])
    check(model, feeds)


def test_attention_fully_masked_rows():
    # a key length of 0 masks every key: the softmax over scores + mask_filter_value
    inputs = attention_inputs(2, 4, 8) + [("mask_index", np.array([0, 2], np.int32))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2, mask_filter_value=-3.0)
    check(model, feeds)
    inputs[-1] = ("mask_index", key_mask(2, 4, keep_first=False))
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2, mask_filter_value=-2.0,
                                 unidirectional=1)
    check(model, feeds)


@pytest.mark.parametrize("bias_shape", [(1, 2, 4, 4), (2, 1, 4, 4), (2, 2, 4, 4), (1, 1, 4, 4)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_attention_bias(bias_shape, with_mask):
    inputs = attention_inputs(2, 4, 8) + [("mask_index", key_mask(2, 4) if with_mask else None),
                                          ("past", None), ("attention_bias", normal(*bias_shape))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2)
    check(model, feeds)


@pytest.mark.parametrize("seq,past_len", [(5, 0), (2, 3)])
def test_attention_megatron_4d_mask(seq, past_len):
    """onnxruntime refuses the (B, 1, max, max) mask; its rows are absolute query positions,
    so the oracle is the model with the sliced 3-D mask."""
    b, hidden, heads, max_len = 2, 8, 2, 8
    total = past_len + seq
    mask4 = np.broadcast_to(np.tril(np.ones((max_len, max_len), np.int32)),
                            (b, 1, max_len, max_len)).copy()
    mask4[1, :, :, 1] = 0
    base = attention_inputs(b, seq, hidden)
    past = [("past", normal(2, b, heads, past_len, hidden // heads))] if past_len else []
    outputs = ["y"] + (["present"] if past_len else [])
    model, feeds = contrib_model("Attention", base + [("mask_index", mask4)] + past, outputs,
                                 num_heads=heads)
    mask3 = mask4[:, 0, past_len:past_len + seq, :total].copy()
    oracle, oracle_feeds = contrib_model("Attention", base + [("mask_index", mask3)] + past,
                                         outputs, num_heads=heads)
    check(model, feeds, oracle=oracle, oracle_feeds=oracle_feeds)


def test_attention_bert_base_shape():
    """A BERT-base layer's attention: 12 heads of 64, 37 tokens, the second sequence padded
    (key lengths); the GEMM's edge blocks and the row kernel's vector tails."""
    b, s, hidden = 2, 37, 768
    inputs = attention_inputs(b, s, hidden) + [("mask_index", np.array([37, 29], np.int32))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=12)
    check(model, feeds)


def test_attention_float64():
    inputs = attention_inputs(2, 4, 8, dtype=np.float64) + [
        ("mask_index", key_mask(2, 7)), ("past", normal(2, 2, 2, 3, 4, dtype=np.float64))]
    model, feeds = contrib_model("Attention", inputs, ["y", "present"], num_heads=2,
                                 unidirectional=1)
    check_against_cpu(model, feeds)


def test_attention_refusals():
    inputs = attention_inputs(2, 4, 8, dtype=F16)
    model, _ = contrib_model("Attention", inputs, ["y"], num_heads=2)
    assert "float16" in fallback_reason(model)
    model, _ = contrib_model("Attention", attention_inputs(2, 4, 8) + [
        ("mask_index", np.ones((2, 4), np.int64))], ["y"], num_heads=2)
    assert "int32 only" in fallback_reason(model)
    # invalid masks fail as on the CPU
    for mask, match in [(np.zeros(3 * 2 + 2, np.int32), "3 \\* batch_size \\+ 2"),
                        (np.array([2, -1], np.int32), "non-negative"),
                        (np.ones((2, 3), np.int32), "2-D mask")]:
        model, feeds = contrib_model("Attention", attention_inputs(2, 4, 8) + [
            ("mask_index", mask)], ["y"], num_heads=2)
        with pytest.raises(ember.EmberError, match=match):
            ember.load(model, backend="opencl").run(feeds)


# --------------------------------------------------------------------------------------------
# MultiHeadAttention

def _mha_mask(mask, b, s, kv_len):
    if mask == "none":
        return None
    if mask == "key_lengths":
        return np.array([kv_len - 1, kv_len], np.int32)
    return MASKS[mask](b, s, kv_len)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "raw_2d", "raw_3d"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_mha_masks_bias_qk(mask, cross, unidirectional):
    b, s, heads, hidden = 2, 3, 2, 8
    kv_len = 5 if cross else s
    inputs = mha_inputs(normal(b, s, hidden), normal(b, kv_len, hidden), normal(b, kv_len, 12),
                        bias=normal(hidden + hidden + 12), mask=_mha_mask(mask, b, s, kv_len),
                        attention_bias=normal(1, heads, s, kv_len))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value", "qk"], num_heads=heads,
                                 unidirectional=unidirectional)
    got = check(model, feeds)
    assert got["qk"].shape == (b, heads, s, kv_len)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "raw_2d", "raw_3d"])
def test_mha_past_present(mask):
    b, s, heads, hidden, past_len = 2, 3, 2, 8, 4
    total = past_len + s
    inputs = mha_inputs(normal(b, s, hidden), normal(b, s, hidden), normal(b, s, hidden),
                        bias=normal(3 * hidden), mask=_mha_mask(mask, b, s, total),
                        past_key=normal(b, heads, past_len, hidden // heads),
                        past_value=normal(b, heads, past_len, hidden // heads))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value", "qk"], num_heads=heads,
                                 unidirectional=1, scale=0.4, mask_filter_value=-500.0)
    got = check(model, feeds)
    assert got["present_key"].shape == (b, heads, total, hidden // heads)


@pytest.mark.parametrize("with_bias", [False, True])
def test_mha_split_heads_key_value(with_bias):
    b, s, kv_len, heads, hidden = 2, 3, 6, 2, 8
    inputs = mha_inputs(normal(b, s, hidden), normal(b, heads, kv_len, hidden // heads),
                        normal(b, heads, kv_len, hidden // heads),
                        bias=normal(3 * hidden) if with_bias else None,
                        mask=np.array([4, 6], np.int32))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value"], num_heads=heads)
    check(model, feeds)


def test_mha_packed_qkv_and_kv():
    """onnxruntime's CPU kernel lacks packed QKV / KV: the oracle is the unpacked model."""
    b, s, kv_len, heads, head = 2, 4, 5, 2, 4
    hidden = heads * head
    bias = normal(3 * hidden)
    packed = normal(b, s, heads, 3, head)
    unpack = [packed[:, :, :, i].reshape(b, s, hidden) for i in range(3)]
    model, feeds = contrib_model("MultiHeadAttention", mha_inputs(packed, None, None, bias=bias),
                                 ["y"], num_heads=heads, unidirectional=1)
    oracle, oracle_feeds = contrib_model("MultiHeadAttention", mha_inputs(*unpack, bias=bias),
                                         ["y"], num_heads=heads, unidirectional=1)
    check(model, feeds, oracle=oracle, oracle_feeds=oracle_feeds)

    query, kv = normal(b, s, hidden), normal(b, kv_len, heads, 2, head)
    mask = key_mask(b, kv_len)
    outputs = ["y", "present_key", "present_value"]
    model, feeds = contrib_model("MultiHeadAttention",
                                 mha_inputs(query, kv, None, bias=bias, mask=mask), outputs,
                                 num_heads=heads)
    oracle, oracle_feeds = contrib_model(
        "MultiHeadAttention",
        mha_inputs(query, kv[:, :, :, 0].reshape(b, kv_len, hidden),
                   kv[:, :, :, 1].reshape(b, kv_len, hidden), bias=bias, mask=mask),
        outputs, num_heads=heads)
    check(model, feeds, oracle=oracle, oracle_feeds=oracle_feeds)


def test_mha_refusals():
    q = normal(2, 3, 8, dtype=F16)
    model, _ = contrib_model("MultiHeadAttention", mha_inputs(q, q, q), ["y"], num_heads=2)
    assert "float16" in fallback_reason(model)
    q = normal(2, 3, 8)
    model, _ = contrib_model("MultiHeadAttention", mha_inputs(q, q, q, bias=normal(24).astype(
        np.float64)), ["y"], num_heads=2)
    assert "float64" in fallback_reason(model)


def _error(model, feeds, backend):
    with pytest.raises(ember.EmberError) as info:
        ember.load(model, backend=backend).run(feeds)
    return type(info.value), str(info.value)


def test_mha_malformed_layouts_fail_as_on_cpu():
    """The layout checks live once on the op (MultiHeadAttention.kv_layout): malformed key /
    value layouts fail on the device with the CPU kernel's error type and message."""
    b, s, kv_len, heads, head = 2, 3, 4, 2, 4
    hidden = heads * head
    query = normal(b, s, hidden)
    cases = {
        "takes no value": (normal(b, kv_len, heads, 2, head), normal(b, kv_len, hidden), {}),
        "needs a 3-D value": (normal(b, kv_len, hidden), normal(b, heads, kv_len, head), {}),
        "do not match the query": (normal(b, kv_len, hidden), normal(b, kv_len + 1, hidden),
                                   {}),
        "key hidden size 7": (normal(b, kv_len, 7), normal(b, kv_len, hidden), {}),
        "cannot be used with a 4-D key": (
            normal(b, heads, kv_len, head), normal(b, heads, kv_len, head),
            dict(past_key=normal(b, heads, 2, head), past_value=normal(b, heads, 2, head))),
        "past_key": (normal(b, kv_len, hidden), normal(b, kv_len, hidden),
                     dict(past_key=normal(b, heads, 2, head + 1),
                          past_value=normal(b, heads, 2, head))),
    }
    for what, (key, value, past) in cases.items():
        model, feeds = contrib_model("MultiHeadAttention", mha_inputs(query, key, value, **past),
                                     ["y"], num_heads=heads)
        cpu = _error(model, feeds, "cpu")
        assert what in cpu[1]
        assert _error(model, feeds, "opencl") == cpu, what


# --------------------------------------------------------------------------------------------
# GroupQueryAttention

@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("case", ["prompt", "prompt_padded", "prompt_in_buffer", "decode",
                                  "decode_ragged", "chunk"])
def test_gqa_kv_cache(heads, kv_heads, case):
    head = 16
    b, s, buffer, seqlens, total = {
        "prompt": (2, 5, None, [4, 4], 5),
        "prompt_padded": (2, 5, None, [4, 2], 5),
        "prompt_in_buffer": (2, 5, 8, [4, 2], 5),
        "decode": (2, 1, 6, [6, 6], 7),
        "decode_ragged": (2, 1, 9, [6, 3], 7),
        "chunk": (1, 3, 5, [7], 8),
    }[case]
    past = {} if buffer is None else dict(past_key=normal(b, kv_heads, buffer, head),
                                          past_value=normal(b, kv_heads, buffer, head))
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads)
    got = check(model, feeds)
    assert got["present_key"].shape == (b, kv_heads, max(buffer or 0, total), head)


@pytest.mark.parametrize("case", ["prompt_padded", "decode", "chunk"])
def test_gqa_bidirectional(case):
    heads, kv_heads, head = 4, 2, 16
    b, s, buffer, seqlens, total = {"prompt_padded": (2, 5, None, [4, 2], 5),
                                    "decode": (2, 1, 6, [6, 3], 7),
                                    "chunk": (1, 3, 5, [7], 8)}[case]
    past = {} if buffer is None else dict(past_key=normal(b, kv_heads, buffer, head),
                                          past_value=normal(b, kv_heads, buffer, head))
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads,
                             causal=0)
    check(model, feeds)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", ["prompt", "prompt_position_ids", "decode",
                                  "decode_position_ids", "partial", "packed"])
def test_gqa_rotary(interleaved, case):
    heads, kv_heads, head = 4, 2, 32
    b, s = (2, 1) if case.startswith("decode") else (2, 6)
    seqlens, total = ([7, 4], 8) if case.startswith("decode") else ([5, 3], 6)
    cos, sin = rope_caches(16, 8 if case == "partial" else head // 2)
    inputs = qkv(b, s, heads, kv_heads, head)
    if case == "packed":
        inputs = dict(query=np.concatenate([inputs["query"], inputs["key"], inputs["value"]],
                                           axis=-1))
    past = {}
    if case.startswith("decode"):
        past = dict(past_key=normal(b, kv_heads, 7, head), past_value=normal(b, kv_heads, 7, head))
    if case.endswith("position_ids"):
        inputs["position_ids"] = (np.array([[9], [3]]) if case.startswith("decode")
                                  else np.array([[2] * s, [0] * s])).astype(np.int64)
    model, feeds = gqa_model(**inputs, **past, seqlens_k=seqlens, total_sequence_length=total,
                             cos_cache=cos, sin_cache=sin, num_heads=heads, kv_num_heads=kv_heads,
                             do_rotary=1, rotary_interleaved=interleaved)
    check(model, feeds)


@pytest.mark.parametrize("case", ["prompt", "prompt_padded", "decode"])
def test_gqa_local_window(case):
    heads, kv_heads, head = 4, 2, 16
    if case == "decode":
        b, s, seqlens, total = 2, 1, [6, 3], 7
        past = dict(past_key=normal(b, kv_heads, 6, head), past_value=normal(b, kv_heads, 6, head))
    else:
        b, s, seqlens, total = 2, 6, [5, 1] if case == "prompt_padded" else [5, 5], 6
        past = {}
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads,
                             local_window_size=2)
    check(model, feeds)


@pytest.mark.parametrize("feature", ["softcap_scale", "attention_bias", "qk_output_2",
                                     "attention_bias_padded"])
def test_gqa_softmax_features(feature):
    heads, kv_heads, head, b, s = 4, 2, 16, 2, 5
    inputs = dict(qkv(b, s, heads, kv_heads, head),
                  seqlens_k=[4, 2] if feature.endswith("padded") else [4, 4],
                  total_sequence_length=5, num_heads=heads, kv_num_heads=kv_heads)
    outputs = ["y", "present_key", "present_value"]
    if feature == "softcap_scale":
        inputs.update(softcap=1.5, scale=0.9)
    if feature.startswith("attention_bias"):
        inputs.update(attention_bias=normal(b, 1, s, 5), softcap=2.0)
    if feature == "qk_output_2":
        inputs["qk_output"] = 2
        outputs.append("qk")
    model, feeds = gqa_model(outputs, **inputs)
    check(model, feeds)


def test_gqa_decode_attention_bias_longer_buffer():
    heads, kv_heads, head, b = 4, 2, 16, 2
    model, feeds = gqa_model(["y", "present_key", "present_value", "qk"],
                             **qkv(b, 1, heads, kv_heads, head),
                             past_key=normal(b, kv_heads, 8, head),
                             past_value=normal(b, kv_heads, 8, head), seqlens_k=[6, 3],
                             total_sequence_length=7, attention_bias=normal(1, 1, 1, 7),
                             num_heads=heads, kv_num_heads=kv_heads, qk_output=2)
    check(model, feeds)


@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_generation_loop(rotary):
    """A prompt, then decode steps feeding each step's present buffers back as the past, as a
    decoder runs GroupQueryAttention; every step against onnxruntime on the same feeds."""
    heads, kv_heads, head, b = 4, 2, 32, 1
    extra = {}
    if rotary:
        cos, sin = rope_caches(32, head // 2)
        extra = dict(cos_cache=cos, sin_cache=sin, do_rotary=1)
    past_k = np.zeros((b, kv_heads, 0, head), np.float32)
    past_v = past_k
    total, s = 0, 6
    for step in range(5):
        total += s
        model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), past_key=past_k,
                                 past_value=past_v, seqlens_k=[total - 1],
                                 total_sequence_length=total, num_heads=heads,
                                 kv_num_heads=kv_heads, **extra)
        want = ort_outputs(model, feeds)
        _, got = run_cl(model, feeds)
        for name in ("y", "present_key", "present_value"):
            assert_close(got[name], want[name], 1e-4)
        past_k, past_v, s = got["present_key"], got["present_value"], 1


def test_gqa_float64():
    heads, kv_heads, head, b = 4, 2, 16, 2
    cos, sin = rope_caches(16, head // 2, dtype=np.float64)
    model, feeds = gqa_model(**qkv(b, 1, heads, kv_heads, head, dtype=np.float64),
                             past_key=normal(b, kv_heads, 6, head, dtype=np.float64),
                             past_value=normal(b, kv_heads, 6, head, dtype=np.float64),
                             seqlens_k=[6, 2], total_sequence_length=7, num_heads=heads,
                             kv_num_heads=kv_heads, cos_cache=cos, sin_cache=sin, do_rotary=1)
    check_against_cpu(model, feeds)


@pytest.mark.parametrize("feature", ["smooth_softmax", "head_sink", "qk_output_1"])
def test_gqa_cpu_cases(feature):
    """An extra softmax logit, or the qk output as masked scores set to 0, is decided in setup
    (cpu_reason) and every call runs the CPU kernel; the results still match onnxruntime."""
    heads, kv_heads, head, b, s = 4, 2, 16, 2, 5
    inputs = dict(qkv(b, s, heads, kv_heads, head), seqlens_k=[4, 2], total_sequence_length=5,
                  num_heads=heads, kv_num_heads=kv_heads)
    outputs = ["y", "present_key", "present_value"]
    if feature == "smooth_softmax":
        inputs["smooth_softmax"] = 1
    if feature == "head_sink":
        inputs["head_sink"] = normal(heads)
    if feature == "qk_output_1":
        inputs.update(qk_output=1, attention_bias=normal(b, 1, s, 5))
        outputs.append("qk")
    model, feeds = gqa_model(outputs, **inputs)
    want = ort_outputs(model, feeds)
    session = ember.load(model, backend="opencl")
    assert contrib_placement(session) == [("GroupQueryAttention", "device")]
    kernel, = [step.kernel for step in session._plan.steps
               if step.node.op_type == "GroupQueryAttention"]
    assert kernel.cpu_reason
    backend = session._backend
    before = backend.fallback_nodes.get("groupqueryattention", 0)
    got = session.run(feeds)
    assert backend.fallback_nodes["groupqueryattention"] == before + 1
    for name in outputs:
        assert_close(got[name], want[name], 1e-4)


def test_gqa_refusals():
    heads, kv_heads, head = 4, 2, 16
    model, _ = gqa_model(**qkv(1, 3, heads, kv_heads, head, dtype=F16), seqlens_k=[2],
                         total_sequence_length=3, num_heads=heads, kv_num_heads=kv_heads)
    assert "float16" in fallback_reason(model)
    inputs = dict(qkv(1, 3, heads, kv_heads, head), seqlens_k=[5], total_sequence_length=3,
                  num_heads=heads, kv_num_heads=kv_heads)
    model, feeds = gqa_model(**inputs)
    with pytest.raises(ember.EmberError, match="seqlens_k"):
        ember.load(model, backend="opencl").run(feeds)


# --------------------------------------------------------------------------------------------
# SkipLayerNormalization, BiasGelu, FastGelu

def node_model(op, feeds, outputs, **attrs):
    """A one-node com.microsoft model; `feeds` in input order (None: omitted)."""
    return contrib_model(op, list(feeds.items()), outputs, **attrs)


@pytest.mark.parametrize("shapes", [((2, 5, 16), (2, 5, 16)), ((3, 7, 40), (1, 7, 40)),
                                    ((2, 4, 24), (4, 24)), ((6, 768), (6, 768))])
@pytest.mark.parametrize("with_beta,with_bias", [(True, True), (True, False), (False, True),
                                                 (False, False)])
def test_skip_layer_normalization(shapes, with_beta, with_bias):
    x_shape, skip_shape = shapes
    hidden = x_shape[-1]
    feeds = {"input": normal(*x_shape), "skip": normal(*skip_shape),
             "gamma": normal(hidden), "beta": normal(hidden) if with_beta else None,
             "bias": normal(hidden) if with_bias else None}
    model, feeds = node_model("SkipLayerNormalization", feeds,
                              ["y", "mean", "inv_std", "sum"], epsilon=1e-5)
    check(model, feeds)


@pytest.mark.parametrize("outputs", [["y"], ["y", "", "", "sum"], ["y", "mean"]])
def test_skip_layer_normalization_output_subsets(outputs):
    feeds = {"input": normal(2, 3, 32), "skip": normal(2, 3, 32), "gamma": normal(32),
             "beta": normal(32), "bias": normal(32)}
    model, feeds = node_model("SkipLayerNormalization", feeds, outputs)
    check(model, feeds)


def test_skip_layer_normalization_float64():
    feeds = {"input": normal(2, 3, 32, dtype=np.float64), "skip": normal(3, 32, dtype=np.float64),
             "gamma": normal(32, dtype=np.float64), "beta": normal(32, dtype=np.float64)}
    model, feeds = node_model("SkipLayerNormalization", feeds, ["y", "mean", "inv_std", "sum"])
    check_against_cpu(model, feeds)


@pytest.mark.parametrize("op,with_bias", [("BiasGelu", True), ("FastGelu", True),
                                          ("FastGelu", False)])  # BiasGelu's bias is required
@pytest.mark.parametrize("shape", [(2, 5, 64), (3, 37, 3072), (7,)])
def test_gelus(op, shape, with_bias):
    x = (normal(*shape) * 3).astype(np.float32)
    x.reshape(-1)[:4] = [-12.0, 12.0, 0.0, -0.5]  # the tails
    feeds = {"x": x, "bias": normal(shape[-1]) if with_bias else None}
    model, feeds = node_model(op, feeds, ["y"])
    check(model, feeds)


@pytest.mark.parametrize("op", ["BiasGelu", "FastGelu"])
def test_gelus_float64(op):
    model, feeds = node_model(op, {"x": normal(3, 40, dtype=np.float64),
                                   "bias": normal(40, dtype=np.float64)}, ["y"])
    check_against_cpu(model, feeds, rtol=1e-12)


def test_fused_refusals():
    model, _ = node_model("SkipLayerNormalization", {
        "input": normal(2, 3, 8, dtype=F16), "skip": normal(2, 3, 8, dtype=F16),
        "gamma": normal(8, dtype=F16)}, ["y"])
    assert "float16" in fallback_reason(model)
    for op in ("BiasGelu", "FastGelu"):
        model, _ = node_model(op, {"x": normal(2, 8, dtype=F16), "bias": normal(8, dtype=F16)},
                              ["y"])
        assert "float16" in fallback_reason(model)


# --------------------------------------------------------------------------------------------
# The GPU forms of the row kernels (a work-group per row, tree reductions), on this device

def test_workgroup_row_kernels(monkeypatch):
    import ember.ops.opencl.reduction as reduction

    monkeypatch.setattr(reduction, "FORCE_WORKGROUPS", True)
    b, s, heads, hidden, kv_len = 2, 3, 2, 16, 300  # rows longer than one work-group
    inputs = mha_inputs(normal(b, s, hidden), normal(b, kv_len, hidden),
                        normal(b, kv_len, hidden), bias=normal(3 * hidden),
                        mask=np.array([kv_len - 7, kv_len], np.int32))
    model, feeds = contrib_model("MultiHeadAttention", inputs, ["y", "present_key",
                                                                "present_value", "qk"],
                                 num_heads=heads)
    check(model, feeds)
    model, feeds = gqa_model(["y", "present_key", "present_value", "qk"],
                             **qkv(b, 1, 4, 2, 16), past_key=normal(b, 2, 299, 16),
                             past_value=normal(b, 2, 299, 16), seqlens_k=[299, 150],
                             total_sequence_length=300, num_heads=4, kv_num_heads=2,
                             local_window_size=200, qk_output=2)
    check(model, feeds)
    model, feeds = node_model("SkipLayerNormalization", {
        "input": normal(3, 5, 700), "skip": normal(3, 5, 700), "gamma": normal(700),
        "beta": normal(700), "bias": normal(700)}, ["y", "mean", "inv_std", "sum"])
    check(model, feeds)


# --------------------------------------------------------------------------------------------
# MatMulNBits

from test_contrib_lowbit import _close, _nbits_model, _reference  # noqa: E402


@pytest.mark.parametrize("bits,block", [(2, 16), (2, 64), (4, 16), (4, 32), (4, 128), (8, 32),
                                        (8, 256)])
@pytest.mark.parametrize("zp", [None, "packed", "float"])
def test_matmul_nbits(bits, block, zp):
    # K a multiple of block_size and not (the last block padded), batch dims in A, bias;
    # N not a multiple of the GEMM's 32-column panels
    for k, n, a_shape, bias in ((block, 24, (3, block), False),
                                (3 * block + 5, 40, (2, 3, 3 * block + 5), True)):
        model, feeds = _nbits_model(k, n, bits, block, a_shape, zp=zp, bias=bias)
        _, got = run_cl(model, feeds)
        _close(got["Y"], _reference(model, feeds))
        if bits == 8 and zp == "float":  # onnxruntime's float zero points are 2 and 4 bits only
            continue
        want = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        _close(got["Y"], want)


@pytest.mark.parametrize("bits,block", [(4, 32), (8, 64), (2, 32)])
@pytest.mark.parametrize("zp", [None, "packed"])
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_nbits_int8_activations(bits, block, zp, m):
    """accuracy_level 4: A goes through int8 per block as onnxruntime's CPU provider does."""
    model, feeds = _nbits_model(3 * block + 7, 36, bits, block, (m, 3 * block + 7), zp=zp,
                                bias=True, level=4)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    cpu = ember.load(model, backend="cpu").run(feeds)["Y"]
    _, got = run_cl(model, feeds)
    _close(got["Y"], want, rtol=1e-5)
    _close(got["Y"], cpu, rtol=1e-5)


@pytest.mark.parametrize("zp", [None, "packed", "float"])
def test_matmul_nbits_g_idx(zp):
    k, block = 70, 16
    g = np.random.default_rng(5).integers(0, -(-k // block), k)
    model, feeds = _nbits_model(k, 20, 4, block, (3, k), zp=zp, bias=True, g_idx=g)
    cpu = ember.load(model, backend="cpu").run(feeds)["Y"]
    _, got = run_cl(model, feeds)
    _close(got["Y"], cpu, rtol=1e-5)
    _close(got["Y"], _reference(model, feeds))


def test_matmul_nbits_weight_input():
    """B fed as a graph input (not a constant): dequantised again for each new array."""
    model, feeds = _nbits_model(64, 24, 4, 32, (2, 64), b_input=True)
    session, got = run_cl(model, feeds)
    _close(got["Y"], _reference(model, feeds))
    feeds["B"] = np.ascontiguousarray(feeds["B"][::-1])
    _close(run_checking_placement(session, feeds)["Y"], _reference(model, feeds))


def test_matmul_nbits_dequantizes_once(monkeypatch):
    """The packed weight is built once per node, also with threads sharing the session."""
    from ember.ops.opencl.contrib import MatMulNBitsCL

    calls = []
    original = MatMulNBitsCL._dequantize

    def counting(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(MatMulNBitsCL, "_dequantize", counting)
    model, feeds = _nbits_model(96, 40, 4, 32, (4, 96), zp="packed", bias=True)
    session = ember.load(model, backend="opencl")
    want = _reference(model, feeds)
    errors = []

    def worker():
        try:
            for _ in range(3):
                _close(run_checking_placement(session, feeds)["Y"], want)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(calls) == 1


def test_matmul_nbits_refusals():
    model, _ = _nbits_model(64, 16, 4, 32, (2, 64), dtype=F16)
    assert "float16" in fallback_reason(model)


# --------------------------------------------------------------------------------------------
# Real models

from test_contrib_attention import _tiny_bert  # noqa: E402
from test_contrib_fused import _export_bert_like  # noqa: E402


def _optimize(source, target, model_type, **options):
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    fusion = FusionOptions(model_type)
    for name, value in options.items():
        if name == "raw_mask":
            fusion.use_raw_attention_mask(value)
        else:
            setattr(fusion, name, value)
    optimized = optimizer.optimize_model(str(source), model_type=model_type, num_heads=4,
                                         hidden_size=32, use_gpu=False, opt_level=0,
                                         optimization_options=fusion)
    optimized.save_model_to_file(str(target))
    return onnx.load(str(target))


@pytest.mark.parametrize("model_type,approximate,expect", [
    ("bert", "none", {"Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2}),
    ("gpt2", "tanh", {"SkipLayerNormalization": 4, "FastGelu": 2})])
def test_optimized_bert(tmp_path, model_type, approximate, expect):
    """The BERT-style encoder fused by onnxruntime.transformers.optimizer with its default
    options (Attention with a mask_index from EmbedLayerNormalization, SkipLayerNormalization,
    BiasGelu / FastGelu): every one of those nodes on the device, outputs as onnxruntime's."""
    source = tmp_path / "model.onnx"
    _export_bert_like(source, approximate)
    proto = _optimize(source, tmp_path / "model_opt.onnx", model_type)
    ops = [n.op_type for n in proto.graph.node if n.domain == MS]
    for op, count in expect.items():
        assert ops.count(op) == count, ops
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 50, (3, 7)).astype(np.int64),
             "attention_mask": (np.arange(7)[None] < np.array([[7], [5], [2]])).astype(np.int64),
             "token_type_ids": rng.integers(0, 2, (3, 7)).astype(np.int64)}
    want = ort_outputs(proto, feeds)["out"]
    session, got = run_cl(proto, feeds)
    assert sorted(op for op, _ in contrib_placement(session)) == sorted(
        op for op, count in expect.items() for _ in range(count))
    assert_close(got["out"], want, 1e-4)


@pytest.mark.parametrize("variant", ["mask_index", "raw_mask", "multi_head"])
def test_optimizer_fused_attention(tmp_path, variant):
    """The eager-attention BERT of test_contrib_attention.py, its attention fused into
    Attention (key-length or raw 2-D mask) or MultiHeadAttention."""
    torch, model = _tiny_bert()
    x = torch.randn(2, 7, 32)
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0
    exported = tmp_path / "bert.onnx"
    torch.onnx.export(model, (x, mask), str(exported), input_names=["x", "mask"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"},
                                    "y": {0: "b", 1: "s"}})
    options = dict(enable_skip_layer_norm=False, enable_bias_skip_layer_norm=False,
                   enable_gelu=False, enable_bias_gelu=False)
    if variant == "raw_mask":
        options["raw_mask"] = True
    if variant == "multi_head":
        options["use_multi_head_attention"] = True
    proto = _optimize(exported, tmp_path / "bert_opt.onnx", "bert", **options)
    fused = "MultiHeadAttention" if variant == "multi_head" else "Attention"
    assert [n.op_type for n in proto.graph.node].count(fused) == 2
    feeds = {"x": x.numpy(), "mask": mask.numpy()}
    want = ort_outputs(proto, feeds)["y"]
    session, got = run_cl(proto, feeds)
    assert [op for op, _ in contrib_placement(session)] == [fused] * 2
    assert_close(got["y"], want, 1e-4)
    with torch.no_grad():
        assert_close(got["y"], model(x, mask).numpy(), 1e-4)


@pytest.mark.parametrize("symmetric,level", [(False, None), (True, 4)])
def test_quantized_llama_generation(symmetric, level, tmp_path):
    """The 4-bit Llama-style decoder of test_contrib_lowbit.py: greedy tokens identical to
    onnxruntime's, with every MatMulNBits node on the device."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from test_contrib_lowbit import LAYERS, _generate, _llama_model

    quantizer = MatMulNBitsQuantizer(_llama_model(), bits=4, block_size=32,
                                     is_symmetric=symmetric, accuracy_level=level,
                                     op_types_to_quantize=("MatMul", "Gather"))
    quantizer.process()
    path = tmp_path / "llama_q4.onnx"
    quantizer.model.save_model_to_file(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    prompt = [1, 17, 42, 99, 5, 63]
    expected, expected_logits = _generate(
        lambda feeds: dict(zip(names, sess.run(None, feeds))), prompt, 32)
    session = ember.load(str(path), backend="opencl")
    placed = contrib_placement(session)
    assert placed == [("MatMulNBits", "device")] * (7 * LAYERS + 1)
    tokens, logits = _generate(lambda feeds: run_checking_placement(session, feeds), prompt, 32)
    assert len(set(expected)) > 3
    assert tokens == expected
    for a, e in zip(logits, expected_logits):
        _close(a, e, rtol=1e-4)
