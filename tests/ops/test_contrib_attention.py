"""com.microsoft attention contrib ops (ops/microsoft/attention.py): Attention, MultiHeadAttention,
GroupQueryAttention, RotaryEmbedding and BiasSoftmax against onnxruntime's CPU kernels, on the
CPU backend and on OpenCL (where they run through a planned CPU fallback); plus onnxruntime's
transformer optimizer fusing a torch-exported BERT into Attention / MultiHeadAttention.

Where onnxruntime's CPU provider lacks a case (BiasSoftmax has CUDA kernels only; Attention's
4-D Megatron mask; MultiHeadAttention's packed QKV / KV), the oracle is onnxruntime running an
equivalent model (the unfused graph, the sliced 3-D mask, the unpacked inputs)."""
import math

import numpy as np
import pytest
from onnx import helper

import ember
from backends import unavailable_reason
from ember.errors import InvalidModelError

ort = pytest.importorskip("onnxruntime")

MS = "com.microsoft"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
F16 = np.float16


@pytest.fixture(params=["cpu", "opencl"])
def backend(request):
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} unavailable: {reason}")
    return request.param


rng = np.random.default_rng(0)


def normal(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def contrib_model(op, inputs, outputs, opsets=OPSETS, **attrs):
    """A one-node com.microsoft `op` model. `inputs` lists (name, array or None) in the op's
    input order (None: an omitted optional input); returns the model and its feeds."""
    names = [name if value is not None else "" for name, value in inputs]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, list(outputs), name=op.lower(), domain=MS, **attrs)
    given = [(n, v) for n, v in inputs if v is not None]
    out_type = helper.np_dtype_to_tensor_dtype(given[0][1].dtype)
    graph = helper.make_graph(
        [node], op.lower(),
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in given],
        [helper.make_tensor_value_info(o, out_type, None) for o in outputs if o])
    return helper.make_model(graph, opset_imports=opsets), dict(given)


def ort_outputs(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def assert_close(actual, expected, rtol):
    """Within rtol relative, atol scaled by the largest |expected| of ordinary size (< 100).
    Masked scores in a qk output (-10000 plus a score, the lowest float32) must match to 1e-6
    relative on their own, so they neither hide nor inflate the ordinary values' errors."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        actual.shape, actual.dtype, expected.shape, expected.dtype)
    want, got = expected.astype(np.float64), actual.astype(np.float64)
    huge = np.abs(want) >= 100
    np.testing.assert_allclose(got[huge], want[huge], rtol=1e-6)
    ordinary = np.abs(want[~huge])
    scale = float(ordinary.max()) if ordinary.size else 0.0
    np.testing.assert_allclose(got[~huge], want[~huge], rtol=rtol, atol=rtol * scale)


def tolerance(dtype):
    # float16: onnxruntime rounds the projected / rotated Q, K, V to float16 before attending,
    # ember keeps them in float32 and rounds the results once: a few float16 steps apart.
    return 4e-3 if np.dtype(dtype) == F16 else 1e-4


def check(model, feeds, backend, oracle=None, oracle_feeds=None, rtol=None, only=None):
    """ember on `backend` against onnxruntime running `oracle` (default: the model itself),
    output by output (outputs named alike; `only` restricts the names compared)."""
    want = ort_outputs(oracle or model, oracle_feeds or feeds)
    session = ember.load(model, backend=backend)
    got = session.run(feeds)
    names = only or [o.name for o in model.graph.output]
    for name in names:
        assert_close(got[name], want[name], rtol or tolerance(want[name].dtype))
    return got


# --------------------------------------------------------------------------------------------
# Attention (packed QKV weights)

def attention_inputs(batch, seq, hidden, width=None, dtype=np.float32, bias=True):
    width = width or 3 * hidden
    return [("input", normal(batch, seq, hidden, dtype=dtype)),
            ("weights", (normal(hidden, width) / math.sqrt(hidden)).astype(dtype)),
            ("bias", normal(width, dtype=dtype) if bias else None)]


def key_mask(batch, total, keep_first=True):
    m = rng.integers(0, 2, (batch, total)).astype(np.int32)
    if keep_first:
        m[:, 0] = 1  # no fully masked row: their -10000 scores lose float32 precision
    return m


MASKS = {
    "none": lambda b, s, t: None,
    "key_lengths": lambda b, s, t: np.array([t - 2, t][:b], np.int32),
    "end_start": lambda b, s, t: np.array([t, t - 1, 1, 0][:2 * b], np.int32),
    "raw_2d": lambda b, s, t: key_mask(b, t),
    "dummy_2d": lambda b, s, t: np.ones((b, 1), np.int32),
    "raw_3d": lambda b, s, t: np.concatenate(
        [np.ones((b, s, 1), np.int32), rng.integers(0, 2, (b, s, t - 1)).astype(np.int32)], -1),
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention_masks(backend, mask, unidirectional):
    b, s, hidden, heads = 2, 5, 12, 3
    inputs = attention_inputs(b, s, hidden) + [("mask_index", MASKS[mask](b, s, s))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=heads,
                                 unidirectional=unidirectional)
    check(model, feeds, backend)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "end_start", "raw_2d", "raw_3d"])
@pytest.mark.parametrize("seq", [1, 3])
def test_attention_past_present(backend, mask, seq):
    b, hidden, heads, past_len = 2, 16, 2, 4
    total = past_len + seq
    past = normal(2, b, heads, past_len, hidden // heads)
    inputs = attention_inputs(b, seq, hidden) + [("mask_index", MASKS[mask](b, seq, total)),
                                                  ("past", past)]
    model, feeds = contrib_model("Attention", inputs, ["y", "present"], num_heads=heads,
                                 unidirectional=1)
    got = check(model, feeds, backend)
    assert got["present"].shape == (2, b, heads, total, hidden // heads)


def test_attention_qkv_hidden_sizes_scale_no_bias(backend):
    inputs = attention_inputs(2, 4, 8, width=8 + 8 + 12, bias=False)
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2,
                                 qkv_hidden_sizes=[8, 8, 12], scale=0.3)
    assert check(model, feeds, backend)["y"].shape == (2, 4, 12)
    inputs = attention_inputs(2, 4, 8, width=4 + 4 + 12)
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2,
                                 qkv_hidden_sizes=[4, 4, 12])
    check(model, feeds, backend)


def test_attention_mask_filter_value_fully_masked_rows(backend):
    # a key length of 0 masks every key: the row is a softmax over scores - 3, i.e. the
    # unmasked softmax; a small filter value keeps float32 precision for the comparison
    inputs = attention_inputs(2, 4, 8) + [("mask_index", np.array([0, 2], np.int32))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2, mask_filter_value=-3.0)
    check(model, feeds, backend)
    inputs[-1] = ("mask_index", key_mask(2, 4, keep_first=False))
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2, mask_filter_value=-2.0,
                                 unidirectional=1)
    check(model, feeds, backend)


@pytest.mark.parametrize("bias_shape", [(1, 2, 4, 4), (2, 1, 4, 4), (2, 2, 4, 4), (1, 1, 4, 4)])
def test_attention_attention_bias(backend, bias_shape):
    inputs = attention_inputs(2, 4, 8) + [("mask_index", key_mask(2, 4)), ("past", None),
                                          ("attention_bias", normal(*bias_shape))]
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2)
    check(model, feeds, backend)


@pytest.mark.parametrize("seq,past_len", [(5, 0), (2, 3)])
def test_attention_megatron_4d_mask(backend, seq, past_len):
    """onnxruntime's CPU kernel refuses the 4-D (B, 1, max, max) mask; its rows are absolute
    query positions, so the oracle is the same model with the sliced 3-D mask."""
    b, hidden, heads, max_len = 2, 8, 2, 8
    total = past_len + seq
    causal = np.tril(np.ones((max_len, max_len), np.int32))
    mask4 = np.broadcast_to(causal, (b, 1, max_len, max_len)).copy()
    mask4[1, :, :, 1] = 0  # padding too (never a whole row: key 0 stays)
    base = attention_inputs(b, seq, hidden)
    past = [("past", normal(2, b, heads, past_len, hidden // heads))] if past_len else []
    model, feeds = contrib_model("Attention", base + [("mask_index", mask4)] + past,
                                 ["y"] + (["present"] if past_len else []), num_heads=heads)
    mask3 = mask4[:, 0, past_len:past_len + seq, :total].copy()
    oracle, oracle_feeds = contrib_model("Attention", base + [("mask_index", mask3)] + past,
                                         ["y"] + (["present"] if past_len else []),
                                         num_heads=heads)
    check(model, feeds, backend, oracle=oracle, oracle_feeds=oracle_feeds)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "raw_2d"])
def test_attention_float16(backend, mask):
    b, s, hidden, heads = 2, 6, 16, 2
    past = normal(2, b, heads, 3, hidden // heads, dtype=F16)
    inputs = attention_inputs(b, s, hidden, dtype=F16) + [("mask_index", MASKS[mask](b, s, s + 3)),
                                                         ("past", past)]
    model, feeds = contrib_model("Attention", inputs, ["y", "present"], num_heads=heads,
                                 unidirectional=1)
    got = check(model, feeds, backend)
    assert got["y"].dtype == F16 and got["present"].dtype == F16


def test_attention_refusals():
    inputs = attention_inputs(2, 4, 8)
    model, feeds = contrib_model("Attention", inputs, ["y"], num_heads=2, do_rotary=1)
    with pytest.raises(InvalidModelError, match="do_rotary"):
        ember.load(model, backend="cpu").run(feeds)
    for mask, match in [(np.zeros(3 * 2 + 2, np.int32), "3 \\* batch_size \\+ 2"),
                        (np.array([2, -1], np.int32), "non-negative"),
                        (np.ones((2, 3), np.int32), "2-D mask")]:
        model, feeds = contrib_model("Attention", inputs + [("mask_index", mask)], ["y"],
                                     num_heads=2)
        with pytest.raises(InvalidModelError, match=match):
            ember.load(model, backend="cpu").run(feeds)
    model, feeds = contrib_model("Attention", attention_inputs(2, 4, 8, width=20), ["y"],
                                 num_heads=2)
    with pytest.raises(InvalidModelError, match="divisible by 3"):
        ember.load(model, backend="cpu").run(feeds)


# --------------------------------------------------------------------------------------------
# MultiHeadAttention

def mha_inputs(query, key, value, bias=None, mask=None, attention_bias=None, past_key=None,
               past_value=None):
    return [("query", query), ("key", key), ("value", value), ("bias", bias),
            ("key_padding_mask", mask), ("attention_bias", attention_bias),
            ("past_key", past_key), ("past_value", past_value)]


@pytest.mark.parametrize("mask", ["none", "key_lengths", "raw_2d", "raw_3d"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_mha_masks_bias_qk(backend, mask, cross, unidirectional):
    b, s, heads, hidden = 2, 3, 2, 8
    kv_len = 5 if cross else s
    mask_value = None if mask == "none" else (
        np.array([kv_len - 1, kv_len], np.int32) if mask == "key_lengths"
        else MASKS[mask](b, s, kv_len))
    inputs = mha_inputs(normal(b, s, hidden), normal(b, kv_len, hidden), normal(b, kv_len, 12),
                        bias=normal(hidden + hidden + 12), mask=mask_value,
                        attention_bias=normal(1, heads, s, kv_len))
    model, feeds = contrib_model("MultiHeadAttention", inputs, ["y", "present_key",
                                                                "present_value", "qk"],
                                 num_heads=heads, unidirectional=unidirectional)
    got = check(model, feeds, backend)
    assert got["qk"].shape == (b, heads, s, kv_len)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "raw_2d", "raw_3d"])
def test_mha_past_present(backend, mask):
    b, s, heads, hidden, past_len = 2, 3, 2, 8, 4
    total = past_len + s
    mask_value = None if mask == "none" else (
        np.array([total - 2, total], np.int32) if mask == "key_lengths"
        else MASKS[mask](b, s, total))
    inputs = mha_inputs(normal(b, s, hidden), normal(b, s, hidden), normal(b, s, hidden),
                        bias=normal(3 * hidden), mask=mask_value,
                        past_key=normal(b, heads, past_len, hidden // heads),
                        past_value=normal(b, heads, past_len, hidden // heads))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value", "qk"], num_heads=heads,
                                 unidirectional=1, scale=0.4, mask_filter_value=-500.0)
    got = check(model, feeds, backend)
    assert got["present_key"].shape == (b, heads, total, hidden // heads)


@pytest.mark.parametrize("with_bias", [False, True])
def test_mha_split_heads_key_value(backend, with_bias):
    """Cross-attention with key/value already projected to (B, N, L, H): no bias on them."""
    b, s, kv_len, heads, hidden = 2, 3, 6, 2, 8
    inputs = mha_inputs(normal(b, s, hidden), normal(b, heads, kv_len, hidden // heads),
                        normal(b, heads, kv_len, hidden // heads),
                        bias=normal(3 * hidden) if with_bias else None,
                        mask=np.array([4, 6], np.int32))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value"], num_heads=heads)
    check(model, feeds, backend)


def test_mha_packed_qkv_and_kv(backend):
    """onnxruntime's CPU kernel refuses packed QKV (B, S, N, 3, H) and KV (B, L, N, 2, H); the
    oracle is the unpacked model."""
    b, s, kv_len, heads, head = 2, 4, 5, 2, 4
    hidden = heads * head
    bias = normal(3 * hidden)
    qkv = normal(b, s, heads, 3, head)
    unpack = [qkv[:, :, :, i].reshape(b, s, hidden) for i in range(3)]
    model, feeds = contrib_model("MultiHeadAttention",
                                 mha_inputs(qkv, None, None, bias=bias), ["y"], num_heads=heads,
                                 unidirectional=1)
    oracle, oracle_feeds = contrib_model("MultiHeadAttention", mha_inputs(*unpack, bias=bias),
                                         ["y"], num_heads=heads, unidirectional=1)
    check(model, feeds, backend, oracle=oracle, oracle_feeds=oracle_feeds)

    query, kv = normal(b, s, hidden), normal(b, kv_len, heads, 2, head)
    mask = key_mask(b, kv_len)
    model, feeds = contrib_model("MultiHeadAttention",
                                 mha_inputs(query, kv, None, bias=bias, mask=mask),
                                 ["y", "present_key", "present_value"], num_heads=heads)
    oracle, oracle_feeds = contrib_model(
        "MultiHeadAttention",
        mha_inputs(query, kv[:, :, :, 0].reshape(b, kv_len, hidden),
                   kv[:, :, :, 1].reshape(b, kv_len, hidden), bias=bias, mask=mask),
        ["y", "present_key", "present_value"], num_heads=heads)
    check(model, feeds, backend, oracle=oracle, oracle_feeds=oracle_feeds)


def test_mha_float16(backend):
    b, s, heads, hidden, past_len = 2, 4, 2, 16, 3
    inputs = mha_inputs(normal(b, s, hidden, dtype=F16), normal(b, s, hidden, dtype=F16),
                        normal(b, s, hidden, dtype=F16), bias=normal(3 * hidden, dtype=F16),
                        mask=key_mask(b, past_len + s),
                        past_key=normal(b, heads, past_len, hidden // heads, dtype=F16),
                        past_value=normal(b, heads, past_len, hidden // heads, dtype=F16))
    model, feeds = contrib_model("MultiHeadAttention", inputs,
                                 ["y", "present_key", "present_value"], num_heads=heads,
                                 unidirectional=1)
    got = check(model, feeds, backend)
    assert got["y"].dtype == F16


def test_mha_refusals():
    b, s, hidden = 2, 3, 8
    q = normal(b, s, hidden)
    for mask, match in [(np.zeros(3 * b + 2, np.int32), "3 \\* batch_size \\+ 2"),
                        (np.ones((b, 4), np.int32), "2-D mask")]:
        model, feeds = contrib_model("MultiHeadAttention", mha_inputs(q, q, q, mask=mask), ["y"],
                                     num_heads=2)
        with pytest.raises(InvalidModelError, match=match):
            ember.load(model, backend="cpu").run(feeds)
    model, feeds = contrib_model("MultiHeadAttention", mha_inputs(q, None, None), ["y"],
                                 num_heads=2)
    with pytest.raises(InvalidModelError, match="key is required"):
        ember.load(model, backend="cpu").run(feeds)


# --------------------------------------------------------------------------------------------
# GroupQueryAttention (onnxruntime wants head sizes that are multiples of 16 with rotary)

GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k",
              "total_sequence_length", "cos_cache", "sin_cache", "position_ids",
              "attention_bias", "head_sink"]


def gqa_model(outputs=("y", "present_key", "present_value"), **inputs_and_attrs):
    inputs = [(name, inputs_and_attrs.pop(name, None)) for name in GQA_INPUTS]
    values = dict(inputs)
    values["seqlens_k"] = np.asarray(values["seqlens_k"], np.int32)
    values["total_sequence_length"] = np.asarray(values["total_sequence_length"], np.int32)
    inputs = [(name, values[name]) for name in GQA_INPUTS]
    return contrib_model("GroupQueryAttention", inputs, list(outputs), **inputs_and_attrs)


def rope_caches(length, half, dtype=np.float32):
    angles = rng.uniform(0, 2 * np.pi, (length, half))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def qkv(b, s, heads, kv_heads, head, dtype=np.float32):
    return dict(query=normal(b, s, heads * head, dtype=dtype),
                key=normal(b, s, kv_heads * head, dtype=dtype),
                value=normal(b, s, kv_heads * head, dtype=dtype))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("case", ["prompt", "prompt_padded", "prompt_in_buffer", "decode",
                                  "decode_ragged", "chunk"])
def test_gqa_kv_cache(backend, heads, kv_heads, case):
    head = 16
    b, s, buffer, seqlens, total = {
        "prompt": (2, 5, None, [4, 4], 5),
        "prompt_padded": (2, 5, None, [4, 2], 5),
        "prompt_in_buffer": (2, 5, 8, [4, 2], 5),  # the past is ignored in a first prompt
        "decode": (2, 1, 6, [6, 6], 7),
        "decode_ragged": (2, 1, 9, [6, 3], 7),  # buffer longer than total: present keeps it
        "chunk": (1, 3, 5, [7], 8),  # a later prompt chunk after 5 cached tokens
    }[case]
    past = {}
    if buffer is not None:
        past = dict(past_key=normal(b, kv_heads, buffer, head),
                    past_value=normal(b, kv_heads, buffer, head))
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads)
    got = check(model, feeds, backend)
    assert got["present_key"].shape == (b, kv_heads, max(buffer or 0, total), head)


@pytest.mark.parametrize("case", ["prompt_padded", "decode", "chunk"])
def test_gqa_bidirectional(backend, case):
    heads, kv_heads, head = 4, 2, 16
    b, s, buffer, seqlens, total = {"prompt_padded": (2, 5, None, [4, 2], 5),
                                    "decode": (2, 1, 6, [6, 3], 7),
                                    "chunk": (1, 3, 5, [7], 8)}[case]
    past = {} if buffer is None else dict(past_key=normal(b, kv_heads, buffer, head),
                                          past_value=normal(b, kv_heads, buffer, head))
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads,
                             causal=0)
    check(model, feeds, backend)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", ["prompt", "prompt_position_ids", "decode",
                                  "decode_position_ids", "partial", "packed"])
def test_gqa_rotary(backend, interleaved, case):
    heads, kv_heads, head = 4, 2, 32
    b, s = (2, 1) if case.startswith("decode") else (2, 6)
    seqlens, total = ([7, 4], 8) if case.startswith("decode") else ([5, 3], 6)
    cos, sin = rope_caches(16, 8 if case == "partial" else head // 2)
    inputs = qkv(b, s, heads, kv_heads, head)
    if case == "packed":
        inputs = dict(query=np.concatenate([inputs["query"], inputs["key"], inputs["value"]], -1))
    if case.startswith("decode"):
        inputs.update(past_key=normal(b, kv_heads, 7, head),
                      past_value=normal(b, kv_heads, 7, head))
    if case == "prompt_position_ids":  # onnxruntime reads only position_ids[0, 0] here
        inputs["position_ids"] = np.array([[2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5]], np.int64)
    if case == "decode_position_ids":
        inputs["position_ids"] = np.array([[9], [3]], np.int64)
    model, feeds = gqa_model(**inputs, seqlens_k=seqlens, total_sequence_length=total,
                             cos_cache=cos, sin_cache=sin, num_heads=heads, kv_num_heads=kv_heads,
                             do_rotary=1, rotary_interleaved=interleaved)
    check(model, feeds, backend)


@pytest.mark.parametrize("case", ["prompt", "prompt_padded", "decode"])
def test_gqa_local_window(backend, case):
    heads, kv_heads, head = 4, 2, 16
    if case == "decode":
        b, s, seqlens, total = 2, 1, [6, 3], 7
        past = dict(past_key=normal(b, kv_heads, 6, head), past_value=normal(b, kv_heads, 6, head))
    else:
        b, s, seqlens, total = 2, 6, [5, 1] if case == "prompt_padded" else [5, 5], 6
        past = {}
    # Padded prompt rows beyond a window: onnxruntime's kernels differ there (its output is
    # unspecified); ember follows the one used when the present outputs are requested.
    model, feeds = gqa_model(**qkv(b, s, heads, kv_heads, head), **past, seqlens_k=seqlens,
                             total_sequence_length=total, num_heads=heads, kv_num_heads=kv_heads,
                             local_window_size=2)
    check(model, feeds, backend)


@pytest.mark.parametrize("feature", ["softcap_scale", "smooth_softmax", "head_sink",
                                     "head_sink_and_smooth", "attention_bias", "qk_output_1",
                                     "qk_output_2"])
def test_gqa_softmax_features(backend, feature):
    heads, kv_heads, head, b, s = 4, 2, 16, 2, 5
    inputs = dict(qkv(b, s, heads, kv_heads, head), seqlens_k=[4, 2], total_sequence_length=5,
                  num_heads=heads, kv_num_heads=kv_heads)
    outputs = ["y", "present_key", "present_value"]
    if feature == "softcap_scale":
        inputs.update(softcap=1.5, scale=0.9)
    if feature in ("smooth_softmax", "head_sink_and_smooth"):
        inputs["smooth_softmax"] = 1
    if feature.startswith("head_sink"):
        inputs["head_sink"] = normal(heads)
    if feature in ("attention_bias", "qk_output_1"):
        inputs.update(attention_bias=normal(b, 1, s, 5), softcap=2.0)
    if feature.startswith("qk_output"):
        inputs["qk_output"] = int(feature[-1])
        outputs.append("qk")
    model, feeds = gqa_model(outputs, **inputs)
    check(model, feeds, backend)


def test_gqa_decode_attention_bias_longer_buffer(backend):
    heads, kv_heads, head, b = 4, 2, 16, 2
    model, feeds = gqa_model(["y", "present_key", "present_value", "qk"],
                             **qkv(b, 1, heads, kv_heads, head),
                             past_key=normal(b, kv_heads, 8, head),
                             past_value=normal(b, kv_heads, 8, head), seqlens_k=[6, 3],
                             total_sequence_length=7, attention_bias=normal(1, 1, 1, 7),
                             num_heads=heads, kv_num_heads=kv_heads, qk_output=2)
    check(model, feeds, backend)


@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_float16(backend, rotary):
    heads, kv_heads, head, b = 4, 2, 32, 2
    extra = {}
    if rotary:
        cos, sin = rope_caches(16, head // 2, dtype=F16)
        extra = dict(cos_cache=cos, sin_cache=sin, do_rotary=1)
    model, feeds = gqa_model(**qkv(b, 1, heads, kv_heads, head, dtype=F16),
                             past_key=normal(b, kv_heads, 6, head, dtype=F16),
                             past_value=normal(b, kv_heads, 6, head, dtype=F16),
                             seqlens_k=[6, 2], total_sequence_length=7, num_heads=heads,
                             kv_num_heads=kv_heads, **extra)
    got = check(model, feeds, backend)
    assert got["y"].dtype == F16 and got["present_key"].dtype == F16


def test_gqa_refusals():
    heads, kv_heads, head = 4, 2, 16
    inputs = dict(qkv(1, 3, heads, kv_heads, head), seqlens_k=[2], total_sequence_length=3,
                  num_heads=heads, kv_num_heads=kv_heads)
    model, feeds = gqa_model(**inputs, sliding_window_cache=1, local_window_size=2)
    with pytest.raises(InvalidModelError, match="sliding_window_cache"):
        ember.load(model, backend="cpu").run(feeds)
    model, feeds = gqa_model(**inputs, causal=0, local_window_size=2)
    with pytest.raises(InvalidModelError, match="causal is 0"):
        ember.load(model, backend="cpu").run(feeds)
    model, feeds = gqa_model(**dict(inputs, seqlens_k=[5]))
    with pytest.raises(InvalidModelError, match="seqlens_k"):
        ember.load(model, backend="cpu").run(feeds)
    model, feeds = gqa_model(**inputs, do_rotary=1)
    with pytest.raises(InvalidModelError, match="cos_cache"):
        ember.load(model, backend="cpu").run(feeds)


# --------------------------------------------------------------------------------------------
# RotaryEmbedding (com.microsoft)

@pytest.mark.parametrize("layout", ["bsd", "bsd_no_heads", "bnsh"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("positions", ["offset", "ids"])
def test_rotary_embedding(backend, layout, interleaved, positions):
    b, s, heads, head = 2, 3, 2, 8
    x = normal(b, heads, s, head) if layout == "bnsh" else normal(b, s, heads * head)
    pos = np.array([2], np.int64) if positions == "offset" else \
        np.array([[0, 1, 2], [4, 5, 9]], np.int64)
    cos, sin = rope_caches(10, head // 2)
    attrs = dict(interleaved=interleaved)
    if layout == "bsd":
        attrs["num_heads"] = heads
    model, feeds = contrib_model("RotaryEmbedding", [("input", x), ("position_ids", pos),
                                                     ("cos_cache", cos), ("sin_cache", sin)],
                                 ["y"], **attrs)
    check(model, feeds, backend)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_rotary_embedding_partial(backend, interleaved, dtype):
    b, s, heads, head, rot = 2, 4, 3, 8, 4
    cos, sin = rope_caches(6, rot // 2, dtype=dtype)
    model, feeds = contrib_model(
        "RotaryEmbedding", [("input", normal(b, s, heads * head, dtype=dtype)),
                            ("position_ids", np.array([[0, 1, 2, 3], [2, 3, 4, 5]], np.int64)),
                            ("cos_cache", cos), ("sin_cache", sin)],
        ["y"], num_heads=heads, rotary_embedding_dim=rot, interleaved=interleaved)
    check(model, feeds, backend)


def test_rotary_embedding_refusals():
    cos, sin = rope_caches(4, 4)
    model, feeds = contrib_model(
        "RotaryEmbedding", [("input", normal(1, 3, 16)), ("position_ids", np.array([2], np.int64)),
                            ("cos_cache", cos), ("sin_cache", sin)], ["y"])
    with pytest.raises(InvalidModelError, match="position ids"):
        ember.load(model, backend="cpu").run(feeds)


# --------------------------------------------------------------------------------------------
# BiasSoftmax: onnxruntime has CUDA kernels only; the oracle is Add + Softmax-11 (a softmax
# over the flattened dimensions from `axis` on)

@pytest.mark.parametrize("shape,bias_shape,axis,inner", [
    ((2, 3, 4, 5), (2, 1, 4, 5), 2, 1),   # BERT-style mask broadcast over heads
    ((2, 3, 4, 5), (2, 1, 1, 5), 3, 1),
    ((2, 3, 4, 5), (1, 3, 4, 5), 2, 0),
    ((2, 3, 4, 5), (4, 5), 2, 0),
    ((2, 3, 4, 5), (2, 3, 4, 5), -1, 0),
    ((2, 3, 4, 5), (3, 4, 5), 1, 0),
    ((3, 7), (3, 7), 1, 1),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, F16])
def test_bias_softmax(backend, shape, bias_shape, axis, inner, dtype):
    data, bias = normal(*shape, dtype=dtype), normal(*bias_shape, dtype=dtype)
    model, feeds = contrib_model("BiasSoftmax", [("data", data), ("bias", bias)], ["y"],
                                 axis=axis, is_inner_broadcast=inner)
    # oracle: the unfused graph in float32 (float64 for float64), then rounded: the fused
    # op computes float16 in float32 and rounds once
    work = np.float64 if dtype == np.float64 else np.float32
    add = helper.make_node("Add", ["data", "bias"], ["sum"])
    softmax = helper.make_node("Softmax", ["sum"], ["soft"], axis=axis)
    cast = helper.make_node("Cast", ["soft"], ["y"], to=helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype)))
    wt = helper.np_dtype_to_tensor_dtype(np.dtype(work))
    graph = helper.make_graph(
        [add, softmax, cast], "unfused",
        [helper.make_tensor_value_info("data", wt, shape),
         helper.make_tensor_value_info("bias", wt, bias_shape)],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                       None)])
    oracle = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    check(model, feeds, backend, oracle=oracle,
          oracle_feeds={"data": data.astype(work), "bias": bias.astype(work)},
          rtol=1e-3 if dtype == F16 else 1e-5)


def test_bias_softmax_bad_bias():
    model, feeds = contrib_model("BiasSoftmax", [("data", normal(2, 3, 4)),
                                                 ("bias", normal(5))], ["y"], axis=2)
    with pytest.raises(InvalidModelError, match="does not broadcast"):
        ember.load(model, backend="cpu").run(feeds)


# --------------------------------------------------------------------------------------------
# onnxruntime's transformer optimizer on a torch-exported BERT with eager attention

def _tiny_bert():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self, hidden=32, heads=4, ffn=64):
            super().__init__()
            self.heads, self.head = heads, hidden // heads
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x, mask):
            b, s, hidden = x.shape
            additive = (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0

            def split(t):
                return t.view(b, s, self.heads, self.head).permute(0, 2, 1, 3)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head)
            probs = torch.softmax(scores + additive, dim=-1)
            ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, s, hidden)
            x = self.ln1(x + self.o(ctx))
            return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

        def forward(self, x, mask):
            for layer in self.layers:
                x = layer(x, mask)
            return x

    torch.manual_seed(0)
    return torch, Bert().eval()


@pytest.mark.parametrize("variant", ["mask_index", "raw_mask", "multi_head"])
def test_optimizer_fuses_bert_attention(backend, tmp_path, variant):
    torch, model = _tiny_bert()
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    x = torch.randn(2, 7, 32)
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0  # right padding: the mask-index (key length) form is equivalent
    exported = tmp_path / "bert.onnx"
    torch.onnx.export(model, (x, mask), str(exported), input_names=["x", "mask"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"},
                                    "y": {0: "b", 1: "s"}})
    options = FusionOptions("bert")
    # keep only the attention fusion: SkipLayerNormalization / BiasGelu are other families
    options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = False
    options.enable_gelu = options.enable_bias_gelu = False
    if variant == "raw_mask":
        options.use_raw_attention_mask(True)
    if variant == "multi_head":
        options.use_multi_head_attention = True
    optimized = optimizer.optimize_model(str(exported), model_type="bert", num_heads=4,
                                         hidden_size=32, opt_level=0, use_gpu=False,
                                         optimization_options=options)
    path = tmp_path / "bert_optimized.onnx"
    optimized.save_model_to_file(str(path))
    fused = "MultiHeadAttention" if variant == "multi_head" else "Attention"
    ops = [(n.domain, n.op_type) for n in optimized.model.graph.node]
    assert ops.count((MS, fused)) == 2, ops

    feeds = {"x": x.numpy(), "mask": mask.numpy()}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ember.load(str(path), backend=backend).run(feeds)["y"]
    assert_close(got, want, 1e-4)
    with torch.no_grad():
        assert_close(got, model(x, mask).numpy(), 1e-4)


# --------------------------------------------------------------------------------------------
# The kernels' array code over cupy: ops/cuda/shared.py lists the families it runs on the CUDA
# backend; these ops run there once this module joins that list. Here each kernel runs as its
# shared CUDA class over the numpy stand-in for cupy (tests/_fake_cupy.py refuses host arrays
# mixed with device arrays) and matches its CPU run.

def _device_cases():
    heads, kv_heads, head = 4, 2, 16
    cos, sin = rope_caches(12, head // 2)
    yield contrib_model("Attention", attention_inputs(2, 3, 8) + [
        ("mask_index", np.array([6, 5, 1, 0], np.int32)),
        ("past", normal(2, 2, 2, 4, 4)), ("attention_bias", normal(1, 2, 3, 7))],
        ["y", "present"], num_heads=2, unidirectional=1)
    yield contrib_model("Attention", attention_inputs(2, 4, 8) + [
        ("mask_index", np.tril(np.ones((2, 1, 6, 6), np.int32)))], ["y"], num_heads=2)
    yield contrib_model("MultiHeadAttention", mha_inputs(
        normal(2, 3, 8), normal(2, 5, 8), normal(2, 5, 8), bias=normal(24),
        mask=key_mask(2, 7), attention_bias=normal(2, 1, 3, 7),
        past_key=normal(2, 2, 2, 4), past_value=normal(2, 2, 2, 4)),
        ["y", "present_key", "present_value", "qk"], num_heads=2, unidirectional=1)
    yield contrib_model("MultiHeadAttention", mha_inputs(normal(2, 3, 2, 3, 4), None, None,
                                                         bias=normal(24)), ["y"], num_heads=2)
    yield contrib_model("MultiHeadAttention", mha_inputs(
        normal(2, 3, 8), normal(2, 2, 5, 4), normal(2, 2, 5, 4),
        mask=np.array([3, 5], np.int32)), ["y"], num_heads=2)
    yield gqa_model(["y", "present_key", "present_value", "qk"],
                    **qkv(2, 1, heads, kv_heads, head), past_key=normal(2, kv_heads, 8, head),
                    past_value=normal(2, kv_heads, 8, head), seqlens_k=[6, 3],
                    total_sequence_length=7, cos_cache=cos, sin_cache=sin,
                    position_ids=np.array([[6], [3]], np.int64), attention_bias=normal(1, 1, 1, 7),
                    head_sink=normal(heads), num_heads=heads, kv_num_heads=kv_heads, do_rotary=1,
                    local_window_size=3, softcap=2.0, qk_output=1)
    yield gqa_model(query=np.concatenate(list(qkv(2, 5, heads, kv_heads, head).values()), -1),
                    seqlens_k=[4, 2], total_sequence_length=5, cos_cache=cos, sin_cache=sin,
                    num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=1,
                    smooth_softmax=1)
    yield contrib_model("RotaryEmbedding", [("input", normal(2, 3, 16)),
                                            ("position_ids", np.array([1], np.int64)),
                                            ("cos_cache", cos[:, :2].copy()),
                                            ("sin_cache", sin[:, :2].copy())],
                        ["y"], num_heads=2, rotary_embedding_dim=4, interleaved=1)
    yield contrib_model("RotaryEmbedding", [("input", normal(2, 2, 3, 16)),
                                            ("position_ids", np.array([[0, 1, 2], [5, 6, 7]], np.int64)),
                                            ("cos_cache", cos), ("sin_cache", sin)], ["y"])
    yield contrib_model("BiasSoftmax", [("data", normal(2, 3, 4, 5)), ("bias", normal(2, 1, 4, 5))],
                        ["y"], axis=2, is_inner_broadcast=1)


def test_array_code_on_emulated_cupy():
    from backends import cuda_backend
    from ember.importer import import_model
    from ember.ops.cuda._common import shared_class
    from ember.ops.registry import lookup

    with cuda_backend("emulated") as device:
        for model, feeds in _device_cases():
            node = import_model(model).graph.nodes[0]
            cpu = lookup(MS, node.op_type, 1, "cpu")
            args = [feeds.get(name) if name else None for name in node.inputs]
            want = cpu(node, {**cpu.defaults, **node.attrs}).run(*args)
            kernel = shared_class(cpu)(node, {**cpu.defaults, **node.attrs}, device)
            assert kernel.xp is device.xp
            on_device = [None if a is None else a if i in cpu.shape_inputs
                         else device.to_device(a) for i, a in enumerate(args)]
            got = kernel.run(*on_device)
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert isinstance(g, device.xp.ndarray), (node.op_type, type(g))
                assert_close(device.to_host(g), w, 1e-6)
