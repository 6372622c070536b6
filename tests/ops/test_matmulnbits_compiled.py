"""MatMulNBits' CPU routes (ops/microsoft/lowbit.py, ops/cpu/lowbit.py): the compiled 4-bit
GEMV for a few rows and BLAS on the weight dequantised once for many, against onnxruntime,
with the route each call took checked through `sess.kernels` (so that a route that silently
stops serving fails here), and the same bits from threads sharing a session."""
from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ember
from ember.ops.cpu import lowbit as _lowbit
from ember.ops.cpu import tuning

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
COMPILED = _lowbit.serves()


def _model(k, n, block, *, zp=None, bias=False, a_shape=None, level=None, g_idx=False,
           seed=0):
    """A one-node 4-bit MatMulNBits model with random packed weights (A's shape left open
    unless `a_shape` is given)."""
    rng = np.random.default_rng(seed)
    kb = -(-k // block)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, kb, block // 2), np.uint8), "B"),
             numpy_helper.from_array((rng.random((n, kb)) * 0.05 + 0.001).astype(np.float32),
                                     "scales")]
    names = ["A", "B", "scales", "", "", ""]
    if zp == "packed":
        inits.append(numpy_helper.from_array(
            rng.integers(0, 256, (n, -(-kb // 2)), np.uint8), "zp"))
        names[3] = "zp"
    elif zp == "float":
        inits.append(numpy_helper.from_array((rng.random((n, kb)) * 15).astype(np.float32),
                                             "zp"))
        names[3] = "zp"
    if g_idx:
        inits.append(numpy_helper.from_array((np.arange(k) // block).astype(np.int32),
                                             "g_idx"))
        names[4] = "g_idx"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32),
                                             "bias"))
        names[5] = "bias"
    while names[-1] == "":
        names.pop()
    attrs = dict(K=k, N=n, bits=4, block_size=block)
    if level is not None:
        attrs["accuracy_level"] = level
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TP.FLOAT, a_shape)],
        [helper.make_tensor_value_info("Y", TP.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=OPSETS)


def _feeds(m, k, seed=1):
    return {"A": np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)}


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _route(m):
    if not COMPILED:
        return "numpy"
    return "cpu.nbits-gemv" if m <= tuning.NBITS_GEMV_ROWS else "cpu.board-gemm"


def _close(actual, expected):
    """Within float32 rounding of onnxruntime: relative to the output's largest value."""
    assert actual.dtype == expected.dtype == np.float32 and actual.shape == expected.shape
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("k", [64, 96, 256])
@pytest.mark.parametrize("n", [32, 100])
@pytest.mark.parametrize("zp,bias", [(None, False), (None, True), ("packed", False),
                                     ("packed", True)])
def test_matmulnbits_routes_match_onnxruntime(block, k, n, zp, bias):
    # K 96 with blocks of 64 or 128 pads its last block; blocks of 16 with an odd count pad a
    # whole chunk of the GEMV's rows
    model = _model(k, n, block, zp=zp, bias=bias)
    sess = ember.load(model)
    for m in (1, 3, 64):
        feeds = _feeds(m, k, seed=m)
        y = sess.run(feeds)["Y"]
        assert sess.kernels[0][2] == _route(m)
        _close(y, _ort(model, feeds))


def test_matmulnbits_float_zero_points():
    model = _model(96, 40, 32, zp="float", bias=True)
    sess = ember.load(model)
    for m in (1, 5, 64):
        feeds = _feeds(m, 96)
        y = sess.run(feeds)["Y"]
        assert sess.kernels[0][2] == _route(m)
        _close(y, _ort(model, feeds))


def test_matmulnbits_batch_dims_and_rows_in_groups():
    # rows from batch dimensions, and 4 + 4 + 3 rows a column (the GEMV's row groups)
    model = _model(256, 48, 32, zp="packed", bias=True)
    sess = ember.load(model)
    a = np.random.default_rng(2).standard_normal((1, 11, 256)).astype(np.float32)
    y = sess.run({"A": a})["Y"]
    assert sess.kernels[0][2] == _route(11)
    _close(y, _ort(model, {"A": a}))


@pytest.mark.parametrize("m", [8, 13, 16])
def test_matmulnbits_rows_give_their_bits_alone(m):
    # rows in groups of 4 a column (then 3, 2, 1): each row's sum is the same expression as
    # when it runs alone (the compiled GEMV's; BLAS's blocking is its own)
    model = _model(256, 40, 32, zp="packed", bias=True)
    sess = ember.load(model)
    feeds = _feeds(m, 256, seed=m)
    y = sess.run(feeds)["Y"]
    assert sess.kernels[0][2] == _route(m)
    _close(y, _ort(model, feeds))
    if not COMPILED:
        return
    alone = np.concatenate([sess.run({"A": feeds["A"][i:i + 1]})["Y"] for i in range(m)])
    np.testing.assert_array_equal(y, alone)


@pytest.mark.skipif(not COMPILED, reason="numba unavailable or EMBER_NUMBA=0")
def test_matmulnbits_static_rows_chosen_at_plan():
    # a known A shape: the plan chooses without a run
    for m, route in ((1, "cpu.nbits-gemv"), (128, "cpu.board-gemm")):
        sess = ember.load(_model(64, 32, 32, a_shape=[m, 64]))
        assert sess.kernels[0][2] == route


@pytest.mark.parametrize("what", ["g_idx", "level4"])
def test_matmulnbits_other_cases_stay_numpy(what):
    # (g_idx without zero points: onnxruntime's kernel does not take both as documented)
    model = _model(96, 24, 32, zp=None if what == "g_idx" else "packed",
                   g_idx=what == "g_idx", level=4 if what == "level4" else None)
    sess = ember.load(model)
    feeds = _feeds(1, 96)
    y = sess.run(feeds)["Y"]
    assert sess.kernels[0][2] == "numpy"
    if what == "g_idx":
        _close(y, _ort(model, feeds))


def test_matmulnbits_threads_share_a_session():
    # 4 threads on one session, decode and prefill rows mixed: each result the bits of a
    # one-thread session (a weight large enough for the GEMV's columns to be split)
    model = _model(1024, 1024, 32, zp="packed", bias=True)
    sess = ember.load(model)
    feeds = [_feeds(m, 1024, seed=i) for i, m in enumerate((1, 3, 64, 1, 2, 17, 1, 5))]
    one = ember.load(model, threads=1)
    expected = [one.run(f)["Y"] for f in feeds]
    for f, e in zip(feeds, expected):
        assert np.array_equal(sess.run(f)["Y"], e)
    errors = []

    def worker(t):
        try:
            for _ in range(3):
                for i in range(t, len(feeds) + t):
                    i %= len(feeds)
                    assert np.array_equal(sess.run(feeds[i])["Y"], expected[i])
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
