"""The OpenCL Attention kernel (ops/opencl/attention.py): placed on the device and matching
onnxruntime (or, for what onnxruntime does not cover, ember's CPU kernel) to 1e-4 relative to
each output's largest magnitude."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import ember
from backends import unavailable_reason

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(unavailable_reason("opencl") is not None,
                                reason=f"opencl unavailable: {unavailable_reason('opencl')}")

_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
          np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.int64): TensorProto.INT64}


def attention_model(feeds: dict, n_outputs: int = 1, opset: int = 23, **attrs):
    """A one-node Attention model whose inputs are `feeds` (in the op's input order; omitted
    optional inputs are absent from the dict) and with the first n_outputs outputs."""
    order = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
    names = [n if n in feeds else "" for n in order]
    while names and not names[-1]:
        names.pop()
    outputs = ["Y", "present_key", "present_value", "qk_matmul_output"][:n_outputs]
    node = helper.make_node("Attention", names, outputs, name="attn", **attrs)
    inputs = [helper.make_tensor_value_info(n, _TYPES[v.dtype], v.shape) for n, v in feeds.items()]
    outs = [helper.make_tensor_value_info(n, _TYPES[feeds["Q"].dtype], None) for n in outputs]
    graph = helper.make_graph([node], "attention", inputs, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_opencl(model, feeds):
    session = ember.load(model, backend="opencl")
    assert [w for _, op, w in session.placement if op == "Attention"] == ["device"]
    return session.run(feeds)


def assert_close(actual, expected, rtol=1e-4):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    finite = np.abs(expected[np.isfinite(expected)])  # a qk output holds the mask's -inf
    scale = float(np.max(finite)) if finite.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def check_against_ort(model, feeds):
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_opencl(model, feeds)
    assert len(got) == len(want)
    for name, w in zip([o.name for o in model.graph.output], want):
        assert_close(got[name], w)


def check_against_cpu(model, feeds):
    want = ember.load(model, backend="cpu").run(feeds)
    got = run_opencl(model, feeds)
    for name, w in want.items():
        assert_close(got[name], w)
        assert not np.isnan(got[name]).any() or np.isnan(w).any()


rng = np.random.default_rng(0)


def normal(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def bert_feeds(mask_rows: int):
    """3-D (B, S, H*D) inputs, 12 heads of 64, a (B, 1, mask_rows, S) additive padding mask
    (the second sequence padded after 29 tokens)."""
    b, s, heads, d = 2, 37, 12, 64
    mask = np.zeros((b, 1, mask_rows, s), np.float32)
    mask[1, ..., 29:] = -10000.0
    return {"Q": normal(b, s, heads * d), "K": normal(b, s, heads * d),
            "V": normal(b, s, heads * d), "attn_mask": mask}


def test_bert_like_padding_mask():
    feeds = bert_feeds(37)  # onnxruntime wants the mask's query axis in full
    check_against_ort(attention_model(feeds, q_num_heads=12, kv_num_heads=12), feeds)


def test_bert_like_broadcast_mask():
    feeds = bert_feeds(1)  # (B, 1, 1, S), broadcast over heads and queries
    check_against_cpu(attention_model(feeds, q_num_heads=12, kv_num_heads=12), feeds)


def test_gqa():
    """8 query heads sharing 2 kv heads, a float mask, an explicit scale."""
    b, hq, hkv, q_len, kv_len, d = 2, 8, 2, 5, 11, 16
    feeds = {"Q": normal(b, hq, q_len, d), "K": normal(b, hkv, kv_len, d),
             "V": normal(b, hkv, kv_len, d), "attn_mask": normal(q_len, kv_len)}
    check_against_ort(attention_model(feeds, scale=0.3), feeds)


def test_gqa_short_mask():
    """A mask shorter than the kv length is padded with -inf (onnxruntime rejects it)."""
    b, hq, hkv, q_len, kv_len, d = 2, 8, 2, 5, 11, 16
    feeds = {"Q": normal(b, hq, q_len, d), "K": normal(b, hkv, kv_len, d),
             "V": normal(b, hkv, kv_len, d), "attn_mask": normal(q_len, 9)}
    check_against_cpu(attention_model(feeds, scale=0.3), feeds)


def test_causal_with_past_and_present():
    b, h, past, new, d = 2, 4, 6, 3, 32
    feeds = {"Q": normal(b, h, new, d), "K": normal(b, h, new, d), "V": normal(b, h, new, d),
             "past_key": normal(b, h, past, d), "past_value": normal(b, h, past, d)}
    check_against_ort(attention_model(feeds, n_outputs=3, is_causal=1), feeds)


def test_bool_mask_4d():
    b, h, q_len, kv_len, d = 2, 3, 7, 7, 8
    mask = rng.random((b, 1, q_len, kv_len)) > 0.4
    mask[..., 0] = True  # no fully masked rows (onnxruntime gives NaN there, ember zeros)
    feeds = {"Q": normal(b, h, q_len, d), "K": normal(b, h, kv_len, d),
             "V": normal(b, h, kv_len, d), "attn_mask": mask}
    check_against_ort(attention_model(feeds), feeds)


def test_3d_gqa_causal_with_past_and_bool_mask():
    b, hq, hkv, past, new, d = 1, 6, 3, 4, 5, 8
    mask = rng.random((new, past + new)) > 0.3
    mask[:, 0] = True
    feeds = {"Q": normal(b, new, hq * d), "K": normal(b, new, hkv * d),
             "V": normal(b, new, hkv * d), "attn_mask": mask,
             "past_key": normal(b, hkv, past, d), "past_value": normal(b, hkv, past, d)}
    model = attention_model(feeds, n_outputs=3, is_causal=1, q_num_heads=hq, kv_num_heads=hkv)
    check_against_ort(model, feeds)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_output_modes_softcap_and_float64(mode):
    """Features onnxruntime's CPU provider covers unevenly: against ember's CPU kernel."""
    b, h, q_len, kv_len, d = 2, 2, 4, 6, 8
    mask = np.zeros((b, h, q_len, kv_len))
    mask[0, 0, 1] = -np.inf  # one fully masked row: zeros, not NaN
    feeds = {"Q": normal(b, h, q_len, d, dtype=np.float64),
             "K": normal(b, h, kv_len, d, dtype=np.float64),
             "V": normal(b, h, kv_len, d, dtype=np.float64), "attn_mask": mask}
    model = attention_model(feeds, n_outputs=4, softcap=2.0, qk_matmul_output_mode=mode)
    check_against_cpu(model, feeds)


def test_nonpad_kv_seqlen_and_window():
    """Opset 25: a causal sliding window and per-batch valid kv lengths (decode step)."""
    b, hq, hkv, q_len, kv_len, d = 2, 4, 2, 1, 9, 8
    feeds = {"Q": normal(b, hq, q_len, d), "K": normal(b, hkv, kv_len, d),
             "V": normal(b, hkv, kv_len, d),
             "nonpad_kv_seqlen": np.array([9, 5], np.int64)}
    model = attention_model(feeds, opset=25, is_causal=1, left_window_size=3)
    check_against_cpu(model, feeds)


def test_workgroup_row_kernel(monkeypatch):
    """The GPU form of the row kernel (a work-group per row, tree reductions) on this device."""
    import ember.ops.opencl.reduction as reduction

    monkeypatch.setattr(reduction, "FORCE_WORKGROUPS", True)
    b, h, q_len, kv_len, d = 2, 4, 5, 300, 16  # rows longer than one work-group
    mask = rng.random((b, 1, 1, kv_len)) > 0.2
    feeds = {"Q": normal(b, h, q_len, d), "K": normal(b, h, kv_len, d),
             "V": normal(b, h, kv_len, d), "attn_mask": mask}
    check_against_cpu(attention_model(feeds, n_outputs=4, qk_matmul_output_mode=3), feeds)


@pytest.mark.parametrize("dtype,precision", [(np.float32, None), (np.float32, 11),
                                             (np.float64, None), (np.float64, 1)])
@pytest.mark.parametrize("mask_kind", ["bool", "float_short"])
def test_vector_rows_against_cpu(dtype, precision, mask_kind):
    """Rows long enough for the row kernel's vector loop (and a scalar tail), in each
    supported type pairing, with every structural limit at once (opset 25)."""
    b, hq, hkv, past, new, q_len, d = 2, 4, 2, 7, 38, 9, 8
    total = past + new
    if mask_kind == "bool":
        mask = rng.random((b, 1, q_len, total)) > 0.3
    else:  # shorter than the kv length: -inf beyond
        mask = rng.standard_normal((hq, q_len, total - 5)).astype(dtype)
    feeds = {"Q": normal(b, hq, q_len, d, dtype=dtype), "K": normal(b, hkv, new, d, dtype=dtype),
             "V": normal(b, hkv, new, d, dtype=dtype), "attn_mask": mask,
             "past_key": normal(b, hkv, past, d, dtype=dtype),
             "past_value": normal(b, hkv, past, d, dtype=dtype),
             "nonpad_kv_seqlen": np.array([total, total - 11], np.int64)}
    attrs = dict(is_causal=1, left_window_size=30, right_window_size=2, softcap=3.0,
                 qk_matmul_output_mode=2)
    if precision:
        attrs["softmax_precision"] = precision
    check_against_cpu(attention_model(feeds, n_outputs=4, opset=25, **attrs), feeds)
