"""The CPU kernels that numba compiles where it is installed (ops/cpu/compiled.py), each against
its numpy kernel and onnxruntime:

* the depthwise convolution, 3x3 and any other window (numpy's einsum kernel and numba's,
  with its rows split among threads: the same bits), for NCHW input and for the
  channels-last input a preceding 1x1 convolution hands on, and from several threads at once;
* float32 GELU (erf), which must give numpy's kernel's bits exactly, in place or not;
* the vectorised float32 exp and tanh the kernels below use, within 2 ulp of numpy's float64
  functions (rounded to float32) over every range that matters;
* LSTM and GRU steps (the gates in one compiled pass) and the last-axis Softmax (also the
  attention ops' masked one), against onnxruntime, with numba and without, rows split among
  threads giving the same bits;
* steps in lockstep (each recurrent step's hidden units split between threads inside one
  compiled loop): every chunk taken once and each step seeing the whole last one; LSTM and
  GRU at hidden 256 against onnxruntime, with one thread's bits, shared by threads;
* the fused ops' epilogue (bias, residual and activation in one pass), which must give the
  numpy epilogue's bits, and a Conv + Add + activation chain fused by the simplifier against
  onnxruntime;
* the 2-D MaxPool, over contiguous planes and over channels-last input, against onnxruntime
  and with the numpy kernel's bits (NaN included), its rows split among threads or not;
* LayerNormalization (row statistics in float64), against onnxruntime over one or several
  normalised axes, transposed input and broadcast parameters, the same bits however split;
* 2-D convolutions as register tiles (ops/cpu/tiles.py), with a fused Relu / Clip and a
  residual, against onnxruntime (and the numpy kernels against it too), every part-filled
  tile, the same bits however split or shared by threads, a weight fed at run time;
* few rows by a large constant weight, as tiles and as dot products with its transpose,
  against onnxruntime and the float64 product, the same bits on one thread or several.
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from board import pieces_on_the_board_give_one_threads_bits
from ember.ops import (_epilogue, _layout, activations, conv, fused, linalg, normalization, pool,
                       reduction, rnn)
from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops.cpu import engine

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def _model(c, size, kernel, strides, dilations, pads, pointwise_first, batch):
    """[1x1 conv ->] depthwise conv -> Clip (ReLU6), as in MobileNetV2's blocks."""
    rng = np.random.default_rng(c + size)
    nodes, inits, source = [], [], "x"
    if pointwise_first:
        nodes.append(helper.make_node("Conv", ["x", "pw"], ["p"]))
        inits.append(numpy_helper.from_array(rng.standard_normal((c, c, 1, 1))
                                             .astype(np.float32) / c, "pw"))
        source = "p"
    nodes += [helper.make_node("Conv", [source, "w", "b"], ["d"], group=c, kernel_shape=kernel,
                               strides=strides, dilations=dilations, pads=pads),
              helper.make_node("Clip", ["d", "lo", "hi"], ["y"])]
    inits += [numpy_helper.from_array(rng.standard_normal((c, 1, *kernel)).astype(np.float32),
                                      "w"),
              numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
              numpy_helper.from_array(np.array(0, np.float32), "lo"),
              numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info(
        "x", F, [batch, c, size, size])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((batch, c, size, size)).astype(np.float32) * 2
    return proto.SerializeToString(), {"x": x}


CASES = [  # c, size, kernel, strides, dilations, pads
    (32, 28, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    (24, 17, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    (16, 15, [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),
    (8, 12, [3, 3], [2, 1], [1, 1], [0, 1, 1, 0]),
    (40, 9, [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),
    (12, 14, [5, 5], [2, 2], [1, 1], [2, 2, 2, 2]),
    (48, 20, [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),   # ConvNeXt's
    (20, 11, [7, 3], [1, 2], [1, 2], [2, 1, 4, 0]),
    (16, 19, [5, 5], [1, 2], [2, 1], [4, 2, 3, 1]),  # rows of 5 taps, dilated, strided
    (120, 14, [5, 5], [1, 1], [1, 1], [2, 2, 2, 2]),  # MobileNetV3's: 7 blocks and 8 masked
    (72, 13, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
]


@pytest.fixture(params=["numpy", "numba"])
def kernel(request, monkeypatch):
    """Which depthwise 3x3 kernel runs: numpy's einsum, or numba's where it is installed."""
    rows = (conv._depthwise3x3_rows, conv._depthwise_rows)
    if request.param == "numpy":
        for loops in rows:
            monkeypatch.setitem(_compiled._compiled, loops, None)
    else:
        pytest.importorskip("numba")
        for loops in rows:
            monkeypatch.delitem(_compiled._compiled, loops, raising=False)
        monkeypatch.delenv("EMBER_NUMBA", raising=False)
        assert conv._numba_depthwise3x3() is not None and conv._numba_depthwise() is not None
    return request.param


@pytest.mark.parametrize("pointwise_first", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[0]}-{c[1]}-k{c[2][0]}s{c[3]}d{c[4]}")
def test_depthwise_matches_onnxruntime(kernel, case, batch, pointwise_first):
    """Every channel count: on AVX-512 the vector kernel takes them all, a last block of
    fewer than 16 channels masked."""
    proto, feeds = _model(*case, pointwise_first, batch)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    session = ember.load(proto)
    got = session.run(feeds)["y"]
    assert got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    square = case[2][0] == case[2][1] and case[2][0] * case[2][1] in _tiles.DEPTHWISE_TAPS
    if kernel == "numba" and square and _tiles.WIDE and _tiles.depthwise_kernel(
            conv._depthwise_vector_rows) is not None:
        assert [k for _, op, k, _ in session.kernels if op.endswith("Conv")][-1] == \
            "cpu.depthwise-vector"


def test_split_rows_leaves_a_helper_that_does_not_start_out(monkeypatch):
    """A pool thread that cannot start (its core busy: here, the pool's only thread blocked)
    holds nothing up: the caller takes every piece and the helper's job is cancelled."""
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 2)
    blocker = threading.Event()
    pool = engine.current().pool
    monkeypatch.setattr(pool, "_helpers", None)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # a pool of one thread
    busy = _compiled._thread_pool().submit(blocker.wait)
    pieces = []
    try:
        _compiled.split_rows(lambda r0, r1: pieces.append((r0, r1, threading.get_ident())),
                             100, ns_per_row=tuning.MIN_PIECE_NS / 40)
    finally:
        blocker.set()
        busy.result()
        pool._helpers.shutdown()
    assert sorted(p[:2] for p in pieces) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert {p[2] for p in pieces} == {threading.get_ident()}


def test_split_rows_hands_out_pieces_only_where_each_has_enough_work(monkeypatch):
    """Pieces go to the pool only with MIN_PIECE_NS of work each (a piece handed over right
    after a GEMM waits for OpenBLAS's spinning workers): small jobs stay on the caller."""
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 2)
    pieces = []

    def record(row0, row1):
        pieces.append((row0, row1))

    _compiled.split_rows(record, 100, ns_per_row=tuning.MIN_PIECE_NS / 60)
    assert pieces == [(0, 100)]
    pieces.clear()
    _compiled.split_rows(record, 100, ns_per_row=tuning.MIN_PIECE_NS / 40)
    assert sorted(pieces) == [(0, 25), (25, 50), (50, 75), (75, 100)]  # two per thread



def test_helpers_run_jobs_hand_errors_back_and_let_pending_ones_be_cancelled():
    """The kernel pool: result() waits for a started job and re-raises what it raised; a
    job still waiting is cancelled and never runs; shutdown ends the threads."""
    helpers = _compiled._Helpers(1, engine.current())
    try:
        started, release, ran = threading.Event(), threading.Event(), []

        def slow():
            started.set()
            release.wait()
            time.sleep(0.05)
            ran.append("slow")

        first = helpers.submit(slow)
        queued = helpers.submit(ran.append, "queued")
        assert started.wait(5)
        assert queued.cancel() and not first.cancel()
        release.set()
        first.result()  # waits for the running job
        assert ran == ["slow"]

        def fail():
            raise ValueError("from a helper")

        with pytest.raises(ValueError, match="from a helper"):
            helpers.submit(fail).result()
    finally:
        helpers.shutdown()
    for thread in helpers.threads:
        thread.join(5)
        assert not thread.is_alive()
    assert ran == ["slow"]  # the cancelled job never ran


def test_compiled_wait_returns_on_a_change_on_the_end_of_runs_and_after_its_pauses():
    """wait_while_equal: GIL released, it returns once another thread changes the value,
    once no run is in flight, or after its pauses when it may not yield."""
    pytest.importorskip("numba")
    wait = _compiled.jit(_compiled.wait_while_equal)
    flag, runs = np.zeros(1, np.int64), np.ones(1, np.int64)
    wait(flag, 0, 1, runs, 10, -1)  # compiled; returns at once (the value differs)
    timer = threading.Timer(0.05, lambda: flag.__setitem__(0, 1))
    timer.start()
    wait(flag, 0, 0, runs, 1000, -1)  # no end but the change
    timer.join()
    assert flag[0] == 1
    timer = threading.Timer(0.05, lambda: runs.__setitem__(0, 0))
    timer.start()
    wait(flag, 0, 1, runs, 1000, -1)  # no end but the runs' end
    timer.join()
    runs[0] = 1
    wait(flag, 0, 1, runs, 1000, 0)   # 1000 pauses, then no yield: it returns


@pytest.mark.skipif(_compiled._current_cpu is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_getcpu and two CPUs to move between")
def test_a_helper_woken_on_the_callers_cpu_works_on_another_and_keeps_its_cpu_set():
    """A pool thread the scheduler woke on the caller's CPU (a loaded machine) moves off it
    for the work, then gets its CPU set back; one woken elsewhere is left where it is."""
    allowed = os.sched_getaffinity(0)
    seen = []

    def work(tag):
        seen.append((tag, _compiled._current_cpu(), os.sched_getaffinity(0)))

    here = _compiled._current_cpu()
    _compiled._away_from(here, work, "same")
    elsewhere = next(cpu for cpu in allowed if cpu != _compiled._current_cpu())
    _compiled._away_from(elsewhere, work, "other")
    assert os.sched_getaffinity(0) == allowed
    (_, cpu, during), (_, _, untouched) = seen
    assert cpu != here and here not in during and during == allowed - {here}
    assert untouched == allowed

@pytest.mark.parametrize("window", [(3, 3), (7, 5)])
@pytest.mark.parametrize("stride, dilation, pad", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 1, 0)])
def test_rows_split_among_threads_give_the_same_bits(kernel, window, stride, dilation, pad,
                                                    monkeypatch):
    """A run with several threads splits the output rows among them: every split must give
    the bits of one thread doing all rows (BLAS's thread count may change a GEMM's rounding;
    this kernel's must not)."""
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)  # split even this small image
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    if kernel != "numba":
        pytest.skip("the row split is the numba kernel's")
    kh, kw = window
    compiled = conv._numba_depthwise3x3() if window == (3, 3) else conv._numba_depthwise()
    rng = np.random.default_rng(stride + 3 * dilation + 7 * pad)
    x = rng.standard_normal((2, 23, 19, 40)).astype(np.float32)
    w, b = rng.standard_normal((kh, kw, 40)).astype(np.float32), np.ones(40, np.float32)
    oh = (23 + 2 * pad - (kh - 1) * dilation - 1) // stride + 1
    ow = (19 + 2 * pad - (kw - 1) * dilation - 1) // stride + 1
    a, c = np.empty((2, oh, ow, 40), np.float32), np.empty((2, oh, ow, 40), np.float32)
    args = (pad, pad, stride, stride, dilation, dilation)
    args += (np.float32(0), np.float32(6))  # bias and clamp (ReLU6) in the same pass
    compiled(x, w, b, a, *args, 0, oh)
    for i in range(0, oh, 3):  # uneven pieces, in any order
        compiled(x, w, b, c, *args, i, min(oh, i + 3))
    np.testing.assert_array_equal(a, c)
    # the loops' route (the vector kernel, tested on its own below, takes 40 channels too)
    monkeypatch.setattr(conv, "_depthwise_vector_fits", lambda x, kernel: False)
    route = conv._DepthwiseRoute.make(  # over the pool; x and w as a Conv's (N, C, H, W)
        x.transpose(0, 3, 1, 2), w.transpose(2, 0, 1)[:, None], b, (0, 6), window,
        (stride, stride), (dilation, dilation), (pad, pad), (oh, ow), {})
    assert len(route.bounds) > 2
    np.testing.assert_array_equal(a, route.run(x.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1))


def _run_from_threads(session, feeds, repeats=3):
    """One thread per feed, each running `session` on it `repeats` times at once with the
    others: the last result of each."""
    results = [None] * len(feeds)

    def work(i):
        for _ in range(repeats):
            results[i] = session.run(feeds[i])

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return results


def test_a_session_shared_by_threads_gives_sequential_bits(kernel):
    proto, _ = _model(*CASES[1], True, 2)
    session = ember.load(proto)
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((2, 24, 17, 17)).astype(np.float32)} for _ in range(8)]
    sequential = [session.run(f)["y"] for f in feeds]
    results = [r["y"] for r in _run_from_threads(session, feeds)]
    for want, got in zip(sequential, results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [1 << 14, 100_003, 393_216])
@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_gelu_gives_the_numpy_kernels_bits(size, in_place, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    monkeypatch.delitem(_compiled._compiled, activations._gelu_erf32_loops, raising=False)
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 4).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, -5.0, 0.0, -0.0]
    want = np.empty_like(x)
    for block, out in activations.blocks(np, x, want):  # numpy's kernel, block by block
        activations._gelu_erf32_block(np, block, out)
    assert _compiled.jit(activations._gelu_erf32_loops) is not None
    work = x.copy()
    got = activations.gelu(np, work, out=work if in_place else None)
    np.testing.assert_array_equal(got, want)


def test_gelu_model_matches_onnxruntime_with_the_compiled_kernel():
    pytest.importorskip("numba")
    x = (np.random.default_rng(1).standard_normal((4, 128, 96)) * 3).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"])], "gelu",
                              [helper.make_tensor_value_info("x", F, list(x.shape))],
                              [helper.make_tensor_value_info("y", F, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ember.load(proto.SerializeToString()).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _exp_loops(x, out):  # pragma: no cover - numba
    for i in range(x.shape[0]):
        out[i] = _compiled.exp_float32(x[i])


def _tanh_loops(x, out):  # pragma: no cover - numba
    for i in range(x.shape[0]):
        out[i] = _compiled.tanh_float32(x[i])


def _fma_loops(x, y, z, out):  # pragma: no cover - numba
    for i in range(x.shape[0]):
        out[i] = _compiled.fma_float32(x[i], y[i], z[i])


def test_fma_float32_rounds_once_compiled_and_in_python(monkeypatch):
    """fma_float32 is x * y + z rounded once to float32 (the oracle: the exact sum as a
    fraction, rounded to the nearest float32 by float64 steps that cannot double-round:
    the exact value's float64 neighbours decide it), compiled (the CPU's fma) and in
    Python (the emulation), ties included."""
    from fractions import Fraction
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    rng = np.random.default_rng(5)
    n = 3000
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    y = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    z = (-(x.astype(np.float64) * y) * (1 + rng.standard_normal(n) * 1e-7)).astype(np.float32)
    z[::3] = rng.standard_normal(n)[::3].astype(np.float32)   # no cancellation either
    x[:4], y[:4], z[:4] = 1 + 2.0 ** -12, 1 + 2.0 ** -12, [0, 2.0 ** -60, -(2.0 ** -60), 1]
    got = np.empty(n, np.float32)
    _compiled.jit(_fma_loops)(x, y, z, got)

    def nearest(exact):
        lo = np.float32(float(exact))   # within one float32 step of the exact value
        below = lo if Fraction(float(lo)) <= exact else np.nextafter(lo, np.float32(-np.inf))
        above = np.nextafter(below, np.float32(np.inf))
        d0, d1 = exact - Fraction(float(below)), Fraction(float(above)) - exact
        if d0 != d1:
            return below if d0 < d1 else above
        return below if int(below.view(np.int32)) % 2 == 0 else above

    for i in range(n):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        want = nearest(exact)
        assert got[i] == want, (x[i], y[i], z[i], got[i], want)
        if i % 10 == 0:
            assert _compiled.fma_float32(x[i], y[i], z[i]) == want


@pytest.mark.parametrize("name", ["exp", "tanh"])
def test_compiled_exp_and_tanh_are_within_2_ulp(name, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    loops, oracle = (_exp_loops, np.exp) if name == "exp" else (_tanh_loops, np.tanh)
    kernel = _compiled.jit(loops)
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-100, 100, 400_001, dtype=np.float32),
                        (rng.standard_normal(100_000) * 3).astype(np.float32),
                        np.geomspace(1e-30, 1, 1000, dtype=np.float32),
                        -np.geomspace(1e-30, 1, 1000, dtype=np.float32),
                        np.array([0, -0.0, 0.625, -0.625, 88.72, -86], np.float32)])
    got = np.empty_like(x)
    kernel(x, got)
    want = oracle(x.astype(np.float64))
    # exp flushes x < -86 (e^x < 2^-124) to zero, as documented; all else within 2 ulp
    flushed = x < -86 if name == "exp" else np.zeros(x.shape, bool)
    checked = ~flushed & (want != 0) & (np.abs(want) < np.finfo(np.float32).max)
    ulps = np.abs(got[checked] - want[checked]) / np.spacing(
        np.abs(want[checked]).astype(np.float32))
    assert ulps.max() <= 2, (name, ulps.max())
    assert np.all(got[flushed] == 0)
    edge = np.array([np.nan, np.inf, -np.inf], np.float32)
    edge_out = np.empty_like(edge)
    kernel(edge, edge_out)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(edge_out, oracle(edge))
    # the plain Python function (no numba) computes the same float32 operations
    python = getattr(_compiled, f"{name}_float32")
    sample = x[::997]
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(np.array([python(v) for v in sample], np.float32),
                                      got[::997])


@pytest.fixture(params=["numpy", "numba"])
def recurrent_cells(request, monkeypatch):
    """Which LSTM / GRU step runs: numpy's ufunc calls, or the compiled cells."""
    cells = (rnn._lstm_steps_loops, rnn._gru_lbr_steps_loops, rnn._gru_gates_loops,
             rnn._gru_out_loops)
    for cell in cells:
        if request.param == "numpy":
            monkeypatch.setitem(_compiled._compiled, cell, None)
        else:
            monkeypatch.delitem(_compiled._compiled, cell, raising=False)
    if request.param == "numba":
        pytest.importorskip("numba")
        monkeypatch.delenv("EMBER_NUMBA", raising=False)
    return request.param


def _recurrent_model(op, hidden, features, direction, lbr, batch, seq, states=False):
    """One LSTM / GRU node with W, R and B as initialisers; with `states`, the initial states
    as inputs too (fed random)."""
    rng = np.random.default_rng(hidden + batch)
    gates = {"LSTM": 4, "GRU": 3}[op]
    dirs = 2 if direction == "bidirectional" else 1
    scale = 1 / np.sqrt(hidden)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32),
                                     name) for name, shape in [
        ("W", (dirs, gates * hidden, features)), ("R", (dirs, gates * hidden, hidden)),
        ("B", (dirs, 2 * gates * hidden))]]
    attrs = dict(hidden_size=hidden, direction=direction)
    if op == "GRU":
        attrs["linear_before_reset"] = lbr
    inputs = ["x", "W", "R", "B"]
    if states:
        inputs += ["", "h0"] + (["c0"] if op == "LSTM" else [])
    node = helper.make_node(op, inputs, ["y", "h"], **attrs)
    fed = [helper.make_tensor_value_info(n, F, [dirs, batch, hidden]) for n in inputs[5:]]
    graph = helper.make_graph([node], "rnn", [helper.make_tensor_value_info(
        "x", F, [seq, batch, features]), *fed], [helper.make_tensor_value_info("y", F, None),
                                                 helper.make_tensor_value_info("h", F, None)],
        inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    feeds = {"x": (rng.standard_normal((seq, batch, features)) * 2).astype(np.float32)}
    for name in inputs[5:]:
        feeds[name] = rng.standard_normal((dirs, batch, hidden)).astype(np.float32)
    return proto.SerializeToString(), feeds


@pytest.mark.parametrize("op, lbr", [("LSTM", 0), ("GRU", 0), ("GRU", 1)])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("batch", [1, 5])
def test_recurrent_steps_match_onnxruntime(recurrent_cells, op, lbr, direction, batch):
    proto, feeds = _recurrent_model(op, 64, 24, direction, lbr, batch, seq=20)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ember.load(proto).run(feeds)
    for name, w in zip(["y", "h"], want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=2e-6, err_msg=name)


def _prefix_steps_loops(out, spin, owner, cuts, rank, sync):  # pragma: no cover - numba
    """A recurrence to test run_in_lockstep with: out[i, u] = sum(out[i - 1]) % 1009 + u, a
    step needing every unit of the last; `spin` iterations of busy work per chunk, so that
    the helper joins; owner[i, chunk] = the rank that took it."""
    steps, units = out.shape
    chunks = cuts.size - 1
    for i in range(steps):
        for k in range(chunks):
            chunk = (rank + k) % chunks
            if _compiled.take_chunk(sync, i, chunk, chunks):
                owner[i, chunk] = rank
                total = 0
                if i > 0:
                    for u in range(units):
                        total += out[i - 1, u]
                busy = 0
                for j in range(spin):
                    busy = (busy * 31 + j + total) % 65521
                for u in range(cuts[chunk], cuts[chunk + 1]):
                    out[i, u] = total % 1009 + u + (busy == -1)  # kept: never true
                _compiled.chunk_done(sync, i, chunks)
        _compiled.wait_step(sync, i, chunks)


def test_steps_in_lockstep_take_each_chunk_once_and_see_the_last_step(monkeypatch):
    """Two threads in lockstep: every chunk of every step taken once, the helper taking
    some, and each step reading all of the last (any stale read changes the sums)."""
    pytest.importorskip("numba")
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 2)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no helper thread")
    kernel = _compiled.jit(_prefix_steps_loops)
    if kernel is None:
        pytest.skip("compiled kernels are off (EMBER_NUMBA=0)")
    steps, units = 300, 64
    want = np.zeros((steps, units), np.int64)
    for i in range(steps):
        want[i] = (int(want[i - 1].sum()) % 1009 if i else 0) + np.arange(units)
    for _ in range(3):
        out = np.full((steps, units), -1, np.int64)
        owner = np.full((steps, 2), -1, np.int64)
        asked = _compiled.run_in_lockstep(kernel, units, steps, out, 20_000, owner,
                                          min_units=16)
        assert asked == 2
        np.testing.assert_array_equal(out, want)
        assert np.all(owner >= 0) and np.any(owner == 1)


def _big_recurrent_model(op, direction, batch, seq):
    """LSTM / GRU (linear_before_reset) at a real size, hidden 256, with initial states: a
    step's product large enough to be split between two threads."""
    return _recurrent_model(op, 256, 96, direction, 1, batch, seq, states=True)


def _spy_lockstep(monkeypatch):
    asked = []
    run = _compiled.run_in_lockstep

    def spy(*args, **kwargs):
        asked.append(run(*args, **kwargs))
        return asked[-1]

    monkeypatch.setattr(_compiled, "run_in_lockstep", spy)
    return asked


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("product", ["column-blocks", "dot-products"])
def test_recurrence_in_lockstep_matches_onnxruntime_and_one_thread(op, direction, batch,
                                                                   product, monkeypatch):
    """Hidden 256: each step split between two threads, against onnxruntime and against the
    bits of the loop on one thread; h R as vector code over R's column blocks (`_tiles`) or
    as dot products with R's rows."""
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    if product == "dot-products":
        monkeypatch.setattr(_tiles, "_vectors", False)
    elif not _tiles.recurrence_by_rows(256):
        pytest.skip("no AVX-512 or AVX2 here: the column blocks are off")
    packed = []
    real_pack = _tiles.pack_columns
    monkeypatch.setattr(_tiles, "pack_columns", lambda W: packed.append(W.shape)
                        or real_pack(W))
    asked = _spy_lockstep(monkeypatch)
    proto, feeds = _big_recurrent_model(op, direction, batch, seq=24)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)
    session = ember.load(proto, threads=2)
    got = session.run(feeds)
    session.run(feeds)  # the blocks packed on the first run are kept
    assert asked and set(asked) == {2}
    for name, w in zip(["y", "h"], want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5, err_msg=name)
    # the loop on one thread, in a session of two: the lockstep's split is what is compared
    # (the input projection before the loop is a product, which rounds differently on one
    # thread and on two: OpenBLAS's Haswell kernels, serving AVX2 CPUs, and ops/cpu/blas.py's
    # pieces), so only the lockstep is held to one thread
    monkeypatch.setattr(_compiled, "_CPUS", 1)
    one = ember.load(proto, threads=2).run(feeds)
    assert asked[-1] == 1
    for name in ("y", "h"):
        np.testing.assert_array_equal(one[name], got[name])
    directions = 2 if direction == "bidirectional" else 1
    assert len(packed) == (2 * directions if product == "column-blocks" else 0)  # 2 sessions


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_recurrence_ranks_run_on_the_board(op, monkeypatch):
    """LSTM's and GRU's (linear_before_reset) lockstep loops have piece functions: the ranks
    go on the board, a helper takes one without Python, and the bits are those of the loop
    on one thread."""
    pytest.importorskip("numba")
    from ember.ops.cpu import blas as _blas
    if not _blas.enabled():
        pytest.skip("no board here (products stay with np.matmul)")
    taken = []
    run_pieces = _blas.run_pieces
    monkeypatch.setattr(_blas, "run_pieces", lambda piece, block, bounds: (
        taken.append((n := run_pieces(piece, block, bounds), len(bounds) - 1)), n)[1])
    proto, feeds = _big_recurrent_model(op, "forward", 3, seq=24)
    session = ember.load(proto, threads=2)
    got = session.run(feeds)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(n < of for n, of in taken):
        again = session.run(feeds)
        for name in ("y", "h"):
            np.testing.assert_array_equal(again[name], got[name])
    assert taken and all(of == 2 for _, of in taken) and any(n < of for n, of in taken)
    monkeypatch.setattr(_compiled, "_CPUS", 1)   # the loop on one thread
    one = ember.load(proto, threads=2).run(feeds)
    for name in ("y", "h"):
        np.testing.assert_array_equal(one[name], got[name])


def test_a_recurrence_shared_by_threads_gives_sequential_bits(monkeypatch):
    pytest.importorskip("numba")
    asked = _spy_lockstep(monkeypatch)
    proto, _ = _big_recurrent_model("LSTM", "forward", 2, seq=32)
    session = ember.load(proto, threads=2)
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((32, 2, 96)).astype(np.float32),
              "h0": rng.standard_normal((1, 2, 256)).astype(np.float32),
              "c0": rng.standard_normal((1, 2, 256)).astype(np.float32)} for _ in range(6)]
    sequential = [session.run(f) for f in feeds]
    results = _run_from_threads(session, feeds)
    assert 2 in asked
    for want, got in zip(sequential, results):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def _softmax_model(shape, masked_rows, axis=-1):
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], "softmax",
                              [helper.make_tensor_value_info("x", F, list(shape))],
                              [helper.make_tensor_value_info("y", F, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 6).astype(np.float32)
    x.reshape(-1, shape[-1])[:masked_rows, ::3] = -np.inf   # masked entries, not whole rows
    return proto.SerializeToString(), {"x": x}


@pytest.fixture(params=["numpy", "numba"])
def softmax_kernel(request, monkeypatch):
    for loops in (reduction._softmax_rows_loops, reduction._softmax_columns_loops):
        if request.param == "numpy":
            monkeypatch.setitem(_compiled._compiled, loops, None)
        else:
            pytest.importorskip("numba")
            monkeypatch.delitem(_compiled._compiled, loops, raising=False)
            monkeypatch.delenv("EMBER_NUMBA", raising=False)
    return request.param


@pytest.mark.parametrize("shape,axis", [((2, 12, 128, 128), -1), ((3, 77, 1000), -1),
                                        ((64, 13), -1), ((1, 16, 4, 8400), 1),
                                        ((2, 21, 40, 37), 1), ((3, 700, 9), -2),
                                        ((5, 3, 300), 0)])
def test_softmax_matches_onnxruntime(softmax_kernel, shape, axis):
    """Over the last axis (rows), and over another (columns: a detector's DFL over 16 bins,
    a segmentation's classes over NCHW's channels)."""
    proto, feeds = _softmax_model(shape, masked_rows=5, axis=axis)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    session = ember.load(proto)
    got = session.run(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    if softmax_kernel == "numba" and math.prod(shape) >= tuning.SOFTMAX_COMPILED_MIN:
        assert session.kernels[0][2] == "cpu.compiled"


def test_softmax_columns_give_the_same_bits_however_split_and_keep_its_edge_cases(
        monkeypatch):
    """The column kernel: any cut into pieces (columns a piece, threads) gives the same
    bits; a column all -inf gives NaN (zeros for attention's masked rows), one with a NaN
    NaN, one with +inf NaN where numpy's gives NaN."""
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    x = (np.random.default_rng(4).standard_normal((2, 9, 1000)) * 8).astype(np.float32)
    x[0, :, 3] = -np.inf
    x[1, 4, 5] = np.nan
    x[1, 2, 7] = np.inf
    whole = reduction._softmax_columns(x, 1, False)
    for columns in (1, 7, 256, 5000):
        monkeypatch.setattr(tuning, "SOFTMAX_COLUMNS", columns)
        np.testing.assert_array_equal(reduction._softmax_columns(x, 1, False), whole)
    with np.errstate(invalid="ignore"):
        m = x.max(1, keepdims=True)
        m[~np.isfinite(m)] = 0
        e = np.exp(x - m)
        want = e / e.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.isnan(whole), np.isnan(want))
    np.testing.assert_allclose(whole, want, rtol=2e-6, atol=1e-8)
    np.testing.assert_array_equal(reduction._softmax_columns(x, 1, True)[0, :, 3], 0)


def test_softmax_rows_give_the_same_bits_however_split_and_keep_its_edge_cases():
    pytest.importorskip("numba")
    kernel = _compiled.jit(reduction._softmax_rows_loops, fastmath={"contract"})
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 61)) * 5).astype(np.float32)
    x[0] = -np.inf                 # all masked: NaN per the spec, zeros for attention
    x[1, 7] = np.nan               # NaN spreads over its row
    x[2, 9] = np.inf               # inf: NaN at it, zeros elsewhere (numpy's kernel's result)
    whole, pieces = np.empty_like(x), np.empty_like(x)
    kernel(x, whole, False, 0, 40)
    for i in range(0, 40, 7):
        kernel(x, pieces, False, i, min(40, i + 7))
    np.testing.assert_array_equal(whole, pieces)
    with np.errstate(invalid="ignore", over="ignore"):
        m = x.max(-1, keepdims=True)
        m[~np.isfinite(m)] = 0
        e = np.exp(x - m)
        want = e / e.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.isnan(whole), np.isnan(want))
    np.testing.assert_allclose(whole[3:], want[3:], rtol=2e-6, atol=1e-8)
    np.testing.assert_array_equal(whole[2][~np.isnan(whole[2])], 0)
    zeros = np.empty_like(x)
    kernel(x, zeros, True, 0, 1)
    np.testing.assert_array_equal(zeros[0], 0)


EPILOGUES = [("", []), ("Relu", []), ("LeakyRelu", [0.1]), ("Clip", [0.0, 6.0]),
             ("Clip", [-1.0]), ("HardSigmoid", [0.3, 0.4]), ("HardSwish", []), ("Gelu", []),
             ("Gelu", [1.0]), ("Sigmoid", [])]


@pytest.mark.parametrize("activation,params", EPILOGUES, ids=lambda v: str(v))
@pytest.mark.parametrize("layout", ["c-ordered", "channels-last", "mixed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias_over", ["last axis", "channels"])
def test_compiled_epilogue_gives_the_numpy_epilogues_bits(activation, params, layout, dtype,
                                                          bias_over, monkeypatch):
    """Bias over the last axis (FusedMatMul's) on C-ordered results; over the channels (a
    FusedConv's) on every layout. GELU and Sigmoid run compiled in float32 only."""
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    rng = np.random.default_rng(len(activation) + len(layout))
    y = (rng.standard_normal((2, 24, 30, 31)) * 4).astype(dtype)
    y.flat[::97] = np.nan
    y.flat[1::211] = np.inf
    z = rng.standard_normal(y.shape).astype(dtype)
    if layout != "c-ordered":   # the channels-last view a CPU convolution returns
        y = np.ascontiguousarray(y.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    if layout == "channels-last":
        z = np.ascontiguousarray(z.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    bias = rng.standard_normal(31).astype(dtype) if layout == "c-ordered" else None
    channels = None
    if bias_over == "channels":
        bias, channels = None, rng.standard_normal(24).astype(dtype)
    assert y.size >= tuning.EPILOGUE_MIN
    compiled, numpy_ = y.copy(order="K"), y.copy(order="K")
    runs = activation not in ("Gelu", "Sigmoid") or dtype == np.float32
    assert _epilogue._epilogue_compiled(compiled, bias, z, activation, params, channels) is runs
    if not runs:
        return
    monkeypatch.setattr(_epilogue, "_epilogue_compiled", lambda *args: False)  # numpy's
    assert _epilogue.epilogue(np, numpy_, bias, z, activation, params, channels) is numpy_
    if activation == "Gelu" and params:  # our float32 tanh: within 2 ulp of numpy's
        np.testing.assert_allclose(compiled, numpy_, rtol=1e-6, atol=1e-6)
        return
    if activation == "Sigmoid":   # sigmoid_float32, the chains': within a few ulp of numpy's
        np.testing.assert_allclose(compiled, numpy_, rtol=1e-6, atol=1e-30)
        return
    bits = np.int32 if dtype == np.float32 else np.int64   # NaNs' and zeros' signs too
    np.testing.assert_array_equal(compiled.view(bits), numpy_.view(bits))
    if channels is not None:   # and numpy's own broadcast, written out
        want = y + channels.reshape(24, 1, 1) + z
        _epilogue.activate_in_place(np, want, activation, params)
        np.testing.assert_array_equal(numpy_, want)


@pytest.mark.parametrize("activation,params", [("Relu", []), ("LeakyRelu", [0.1])])
def test_compiled_relu_keeps_the_numpy_epilogues_zeros_and_nans(activation, params,
                                                                 monkeypatch):
    """-0.0, NaNs of either sign and infinities straight into the activation (no bias): the
    bits of np.maximum / np.copyto (ReLU of -0.0 is +0.0), not only equal values."""
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    y = np.random.default_rng(5).standard_normal((64, 300)).astype(np.float32)
    y[0, :6] = [-0.0, 0.0, np.nan, -np.nan, -np.inf, np.inf]
    y[1, :2] = [-1e-45, 1e-45]
    compiled, numpy_ = y.copy(), y.copy()
    assert _epilogue._epilogue_compiled(compiled, None, None, activation, params)
    _epilogue.activate_in_place(np, numpy_, activation, params)
    np.testing.assert_array_equal(compiled.view(np.int32), numpy_.view(np.int32))


def test_conv_add_relu_fused_matches_onnxruntime_with_the_compiled_epilogue():
    """Conv -> Add(residual) -> Relu and Conv -> HardSwish, fused by the simplifier into
    FusedConv whose epilogue runs compiled at this size."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    c = 32
    inits = [numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32) / 4,
                                     name) for name in ("w1", "w2")]
    inits += [numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b"], ["c1"]),
             helper.make_node("Add", ["c1", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["c2"]),
             helper.make_node("HardSwish", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info(
        "x", F, [1, c, 40, 40])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ember.load(proto.SerializeToString())
    assert [op for _, op, _ in sess.placement].count("FusedConv") == 2
    x = rng.standard_normal((1, c, 40, 40)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


# Conv(bias) -> activation, one case per CPU convolution kernel: (input channels, output
# channels, image size, kernel, group, stride, activation). The bias reaches FusedConv's
# epilogue, over channels-first or channels-last results, or with an activation that is a
# clip (none, ReLU, ReLU6) the depthwise kernel's own pass. "channels-last" puts a depthwise
# convolution first, whose channels-last result the pointwise one keeps.
BIASED_CONVS = {
    "im2col": (3, 32, 40, 3, 1, 2, "Relu"),
    "pointwise": (24, 48, 30, 1, 1, 1, "Clip"),
    "pointwise, channels-last": (24, 48, 30, 1, 1, 1, "Relu"),
    "pointwise strided": (24, 16, 30, 1, 1, 2, "HardSwish"),
    "depthwise": (40, 40, 30, 3, 40, 1, "Clip"),
    "depthwise 5x5": (24, 24, 30, 5, 24, 2, "Relu"),
    "depthwise, epilogue": (40, 40, 30, 3, 40, 1, "HardSwish"),
    "shifted": (16, 24, 70, 3, 1, 1, "LeakyRelu"),
    "grouped": (32, 64, 20, 3, 4, 1, "Relu"),
}


@pytest.mark.parametrize("case", list(BIASED_CONVS))
def test_fused_conv_bias_in_the_epilogue_matches_onnxruntime(case):
    c, m, size, k, group, stride, activation = BIASED_CONVS[case]
    rng = np.random.default_rng(len(case))
    inits = [numpy_helper.from_array(
        (rng.standard_normal((m, c // group, k, k)) / k).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    attrs = {"min": 0.0, "max": 6.0} if activation == "Clip" else {}
    if activation == "Clip":   # opset 11+: min and max are inputs
        inits += [numpy_helper.from_array(np.float32(v), n) for n, v in attrs.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, strides=[stride] * 2,
                              pads=[k // 2] * 4),
             helper.make_node(activation, ["c"] + list(attrs), ["y"])]
    if case == "pointwise, channels-last":
        inits.append(numpy_helper.from_array(
            rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "dw"))
        nodes.insert(0, helper.make_node("Conv", ["x0", "dw"], ["x"], group=c, pads=[1] * 4))
    first = nodes[0].input[0]
    graph = helper.make_graph(nodes, "biased", [helper.make_tensor_value_info(
        first, F, [2, c, size, size])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ember.load(proto.SerializeToString())
    assert [op for _, op, _ in sess.placement][-1] == "FusedConv"
    x = rng.standard_normal((2, c, size, size)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {first: x})[0]
    np.testing.assert_allclose(sess.run({first: x})["y"], want, rtol=1e-5, atol=1e-5)


# depthwise conv -> 1x1 Conv(bias) [-> + the depthwise result] [-> activation]: the 1x1 one a
# FusedConv (or a Conv) of a channels-last input, whose product goes on the board with the
# epilogue in its pieces. (channels, output channels, image size, batch, activation, residual): rows
# cut (more pixels than channels), columns cut (7x7 images).
POINTWISE_ROUTES = {
    "rows, ReLU6": (32, 192, 28, 1, "Clip", False),
    "rows, residual": (96, 96, 20, 2, "", True),
    "columns, HardSwish": (160, 960, 7, 1, "HardSwish", False),
    "columns, ReLU, residual": (320, 320, 7, 2, "Relu", True),
    "rows, a plain Conv": (96, 24, 20, 1, "", False),
    "columns, a plain Conv": (960, 160, 7, 2, "", False),
}


@pytest.mark.parametrize("route", ["products", "tiles"])
@pytest.mark.parametrize("case", list(POINTWISE_ROUTES))
def test_pointwise_fused_conv_finishes_in_its_pieces(case, route, monkeypatch):
    """The route runs: the product's (_epilogue.PointwiseRoute: the bits of the convolution's
    own path with its separate epilogue) or the tiles' (_epilogue.TilesPointwiseRoute: the bits
    of one thread), in a session shared by threads too, and matches onnxruntime. A plain
    Conv (its bias the only epilogue) takes it too."""
    pytest.importorskip("numba")
    from ember.ops.cpu import blas as _blas
    if not _blas.enabled():
        pytest.skip("no board here (products stay with np.matmul)")
    if route == "tiles" and (_tiles.kernel() is None or not _tiles.WIDE):
        pytest.skip("the tiles serve 1x1 convolutions on AVX-512 only")
    if route == "products":
        monkeypatch.setattr(_epilogue, "tiles_pointwise_size", lambda x, w: False)
    c, m, size, batch, activation, residual = POINTWISE_ROUTES[case]
    rng = np.random.default_rng(len(case))
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "dw"),
             numpy_helper.from_array((rng.standard_normal((m, c, 1, 1)) / c ** 0.5)
                                     .astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "dw"], ["d"], group=c, pads=[1] * 4),
             helper.make_node("Conv", ["d", "w", "b"], ["p"])]
    last = "p"
    if residual:
        nodes.append(helper.make_node("Add", [last, "d"], ["r"]))
        last = "r"
    if activation:
        attrs = {"min": 0.0, "max": 6.0} if activation == "Clip" else {}
        inits += [numpy_helper.from_array(np.float32(v), n) for n, v in attrs.items()]
        nodes.append(helper.make_node(activation, [last] + list(attrs), ["a"]))
        last = "a"
    graph = helper.make_graph(nodes, "pointwise", [helper.make_tensor_value_info(
        "x", F, [batch, c, size, size])], [helper.make_tensor_value_info(last, F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ember.load(proto.SerializeToString(), threads=2)
    assert [op for _, op, _ in sess.placement][-1] == \
        ("FusedConv" if activation or residual else "Conv")
    x = rng.standard_normal((batch, c, size, size)).astype(np.float32)
    routed = []
    kind = _epilogue.PointwiseRoute if route == "products" else _epilogue.TilesPointwiseRoute
    run = kind.run
    monkeypatch.setattr(kind, "run", lambda self, *a: (routed.append(1), run(self, *a))[1])
    got = sess.run({"x": x})[last]
    with ThreadPoolExecutor(3) as pool:
        shared = list(pool.map(lambda _: sess.run({"x": x})[last], range(6)))
    assert len(routed) == 7
    if route == "products":
        monkeypatch.setattr(fused.FusedConv, "_pointwise_route", lambda *a: None)
        monkeypatch.setattr(conv.Conv, "route", lambda *a: None)
        monkeypatch.setattr(conv.RouteMemo, "route", lambda *a: None)
        want = sess.run({"x": x})[last]
    else:
        want = ember.load(proto.SerializeToString(), threads=1).run({"x": x})[last]
        assert len(routed) == 8
    for y in [got] + shared:
        np.testing.assert_array_equal(y, want)
    expected = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["Clip", ""])
def test_depthwise_conv_takes_its_route_from_the_second_run(activation, monkeypatch):
    """A depthwise convolution's route (conv._DepthwiseRoute), kept after the first run,
    serves the next runs, from several threads too, with conv_nd's bits; a new weight array
    is not served the old weights' route."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    c = 48
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, pads=[1] * 4)]
    out = "y"
    if activation:
        inits += [numpy_helper.from_array(np.float32(v), n) for n, v in (("lo", 0), ("hi", 6))]
        nodes.append(helper.make_node("Clip", ["y", "lo", "hi"], ["a"]))
        out = "a"
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info(
        "x", F, [1, c, 40, 40])], [helper.make_tensor_value_info(out, F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ember.load(proto.SerializeToString(), threads=2)
    x = rng.standard_normal((1, c, 40, 40)).astype(np.float32)
    routed = []
    run = conv._DepthwiseRoute.run
    monkeypatch.setattr(conv._DepthwiseRoute, "run",
                        lambda self, x: (routed.append(1), run(self, x))[1])
    made = []
    make = conv._DepthwiseRoute.make
    monkeypatch.setattr(conv._DepthwiseRoute, "make", classmethod(
        lambda cls, *a: (made.append(1), make(*a))[1]))
    first = sess.run({"x": x})[out]
    with ThreadPoolExecutor(3) as pool:
        later = list(pool.map(lambda _: sess.run({"x": x})[out], range(6)))
    assert len(made) == 1 and len(routed) == 7
    for y in later:
        np.testing.assert_array_equal(y, first)
    monkeypatch.setattr(conv.Conv, "route", lambda self, *a: None)   # conv_nd's way
    monkeypatch.setattr(conv.RouteMemo, "route", lambda *a: None)
    np.testing.assert_array_equal(sess.run({"x": x})[out], first)
    expected = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)
    # the route lives in the weights' cache: another weight array of the same shape misses it
    op = conv.Conv.__new__(conv.Conv)
    op.xp, op.group = np, c
    monkeypatch.setattr(conv, "route_key", lambda x, clamp: ("conv-route", x.shape))
    w1, w2 = (rng.standard_normal((c, 1, 3, 3)).astype(np.float32) for _ in range(2))
    for w in (w1, w2):
        w.flags.writeable = False
    op.kernel_shape, op.pads, op.strides, op.dilations, op.auto_pad = [3, 3], [1] * 4, None, \
        None, "NOTSET"
    op.setup()
    for w in (w1, w2, w1):
        want = conv.conv_nd(np, x, w, c, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1))
        np.testing.assert_array_equal(op.run(x, w), want)


def test_a_convolution_remembers_its_route_for_constant_weights_only(monkeypatch):
    """Conv.run takes the route its last call took (conv.RouteMemo) where the weight and
    bias are the same read-only arrays and x has the same geometry; a writable weight
    changed in place, or an input of another shape, is worked out again."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(8)
    c = 32
    op = conv.Conv.__new__(conv.Conv)
    op.xp, op.group = np, c
    op.kernel_shape, op.pads, op.strides, op.dilations, op.auto_pad = [3, 3], [1] * 4, None, \
        None, "NOTSET"
    op.setup()
    worked_out = []
    route = conv.Conv.route
    monkeypatch.setattr(conv.Conv, "route", lambda self, *a: (worked_out.append(1),
                                                              route(self, *a))[1])
    x = rng.standard_normal((1, c, 20, 20)).astype(np.float32)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)

    def want(x, w):
        return conv.conv_nd(np, x, w, c, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1))
    w.flags.writeable = False
    for _ in range(3):
        np.testing.assert_array_equal(op.run(x, w), want(x, w))
    assert len(worked_out) == 1
    small = x[:, :, :12, :12].copy()
    np.testing.assert_array_equal(op.run(small, w), want(small, w))
    assert len(worked_out) == 2
    writable = w.copy()
    for scale in (1, 2, 3):
        writable *= scale
        np.testing.assert_array_equal(op.run(x, writable), want(x, writable))
    assert len(worked_out) == 5


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("layout", ["channels-first", "channels-last"])
def test_fused_conv_gelu_matches_onnxruntime(kernels, layout, approximate, monkeypatch):
    """[depthwise conv ->] 1x1 Conv(bias) -> Gelu: the epilogue's GELU over a channels-first
    and a channels-last result, compiled and in numpy (which once wrote a channels-last
    result's GELU into a reshaped copy and returned the product unchanged)."""
    if kernels == "numba":
        pytest.importorskip("numba")
    else:
        for loops in (_epilogue.epilogue_loops, activations._gelu_erf32_loops):
            monkeypatch.setitem(_compiled._compiled, loops, None)
    rng = np.random.default_rng(9)
    c, m = 24, 40
    inits = [numpy_helper.from_array(rng.standard_normal((m, c, 1, 1)).astype(np.float32)
                                     / 4, "w"),
             numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32),
                                     "dw")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["p"]),
             helper.make_node("Gelu", ["p"], ["y"], approximate=approximate)]
    if layout == "channels-last":
        nodes.insert(0, helper.make_node("Conv", ["x0", "dw"], ["x"], group=c, pads=[1] * 4))
    first = nodes[0].input[0]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info(
        first, F, [2, c, 30, 30])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    sess = ember.load(proto.SerializeToString())
    assert [op for _, op, _ in sess.placement][-1] == "FusedConv"
    x = rng.standard_normal((2, c, 30, 30)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {first: x})[0]
    np.testing.assert_allclose(sess.run({first: x})["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fused_matmul_bias_gelu_matches_onnxruntime(approximate):
    """MatMul + bias + Gelu (GPT-2's MLP uses the tanh form), fused into one FusedMatMul whose
    compiled epilogue adds the bias and applies GELU in one pass."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Gelu", ["a"], ["y"], approximate=approximate)]
    inits = [numpy_helper.from_array(rng.standard_normal((96, 768)).astype(np.float32) / 8,
                                     "w"),
             numpy_helper.from_array(rng.standard_normal(768).astype(np.float32), "b")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(
        "x", F, [2, 50, 96])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    sess = ember.load(proto.SerializeToString())
    assert [op for _, op, _ in sess.placement] == ["FusedMatMul"]
    x = (rng.standard_normal((2, 50, 96)) * 2).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


POOLS = [  # kernel, strides, pads, dilations, ceil_mode
    ([3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 0),    # ResNet's stem pool
    ([2, 2], [2, 2], [0, 0, 0, 0], [1, 1], 0),    # UNet's
    ([3, 3], [2, 2], [0, 0, 0, 0], [1, 1], 1),    # ceil mode: windows past the end
    ([3, 2], [1, 2], [1, 0, 2, 1], [2, 1], 0),
    ([3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 0),    # stride 1: numpy's kernel on planes
]


@pytest.mark.parametrize("channels_last", [False, True], ids=["planes", "channels-last"])
@pytest.mark.parametrize("case", POOLS, ids=lambda c: f"k{c[0]}s{c[1]}p{c[2]}d{c[3]}c{c[4]}")
def test_maxpool_matches_onnxruntime(case, channels_last):
    """[a 1x1 Conv, whose result is channels-last ->] MaxPool."""
    pytest.importorskip("numba")
    kernel, strides, pads, dilations, ceil_mode = case
    rng = np.random.default_rng(sum(kernel) + sum(pads))
    nodes, inits, source = [], [], "x"
    if channels_last:
        nodes.append(helper.make_node("Conv", ["x", "pw"], ["p"]))
        inits.append(numpy_helper.from_array(rng.standard_normal((24, 24, 1, 1))
                                             .astype(np.float32), "pw"))
        source = "p"
    nodes.append(helper.make_node("MaxPool", [source], ["y"], kernel_shape=kernel,
                                  strides=strides, pads=pads, dilations=dilations,
                                  ceil_mode=ceil_mode))
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info(
        "x", F, [2, 24, 29, 30])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((2, 24, 29, 30)).astype(np.float32)}
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(ember.load(proto).run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["planes", "channels-last"])
@pytest.mark.parametrize("pieces, in_run, dtype", [(1, False, np.float32),
                                                   (3, False, np.float32),
                                                   (2, True, np.float32),
                                                   (2, True, np.float64)])
def test_compiled_maxpool_gives_the_numpy_kernels_bits(channels_last, pieces, in_run, dtype,
                                                       monkeypatch):
    """NaN wins a window as in np.maximum (whichever tap holds it), a window wholly in the
    padding is -inf, and any split of the rows among threads gives the same bits: as Python
    jobs, or in a run on the board (the channels-last kernel's piece functions)."""
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    if in_run:
        engine.current().enter(pieces)
    else:
        monkeypatch.setattr(engine.current(), "run_threads", lambda: pieces)
    try:
        _maxpool_bits(channels_last, dtype)
    finally:
        if in_run:
            engine.current().leave()
    if in_run and channels_last:   # its pieces went on the board
        assert _compiled._pieces.get(pool._CHANNELS_LAST_PIECES[dtype])


def _maxpool_bits(channels_last, dtype):
    x = np.random.default_rng(5).standard_normal((2, 16, 21, 20)).astype(dtype)
    x[0, 3, 4, 7] = x[1, 0, 0, 0] = x[1, 15, 20, 19] = np.nan
    x[0, 5, :6, :6] = -np.inf
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    # pads of 3 with a 3x3 window at stride 2: the first output row and column lie wholly in
    # the padding
    geometry = ([3, 3], [2, 2], [1, 1], [3, 3])
    outs = [(21 + 6 - 3) // 2 + 1, (20 + 6 - 3) // 2 + 1]
    got = pool._maxpool2d(x, *geometry, outs)
    want = pool._WindowPool.reduce_separable(np, x, *geometry, outs, np.maximum, -np.inf)
    assert got is not None and np.isnan(got).sum() == np.isnan(want).sum() > 0
    np.testing.assert_array_equal(got, want)
    assert np.all(got[:, :, 0, :] == -np.inf)


LAYERNORMS = [  # input shape, axis, scale shape, with bias, transposed input
    ((2, 197, 384), -1, (384,), True, False),          # ViT's
    ((1, 14, 14, 96), -1, (96,), True, True),          # ConvNeXt's, after a Transpose
    ((3, 5, 6, 7), 2, (6, 7), False, False),           # two normalised axes
    ((4, 33), -1, (1, 33), True, False),               # a broadcast scale
    ((2, 3, 1000), -1, (1000,), True, False),          # rows that vectorised loops end in
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", LAYERNORMS, ids=lambda c: "x".join(map(str, c[0])))
def test_layernorm_matches_onnxruntime(case, dtype, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    shape, axis, scale_shape, with_bias, transposed = case
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(len(shape) + shape[-1])
    inits = [numpy_helper.from_array(rng.standard_normal(scale_shape).astype(dtype), "s")]
    if with_bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(scale_shape).astype(dtype),
                                             "b"))
    nodes, source, x_shape = [], "x", shape
    if transposed:  # NCHW -> NHWC, as ConvNeXt's blocks do before each LayerNorm
        x_shape = (shape[0], shape[3], shape[1], shape[2])
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]))
        source = "xt"
    # float64: statistics in float64 too (stash_type 11; the default, 1, is float32)
    nodes.append(helper.make_node("LayerNormalization", [source, "s"] + (["b"] * with_bias),
                                  ["y"], axis=axis, epsilon=1e-5, stash_type=t))
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", t, x_shape)],
                              [helper.make_tensor_value_info("y", t, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": (rng.standard_normal(x_shape) * 3 + 2).astype(dtype)}
    got = ember.load(proto).run(feeds)["y"]
    if dtype == np.float32:
        want = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        tol = 1e-5
    else:  # the formula in float64, as stash_type 11 asks (onnxruntime's are float32)
        x = feeds["x"].transpose(0, 2, 3, 1) if transposed else feeds["x"]
        axes = tuple(range(axis % x.ndim, x.ndim))
        want = (x - x.mean(axes, keepdims=True)) / np.sqrt(x.var(axes, keepdims=True) + 1e-5)
        want = want * numpy_helper.to_array(inits[0])
        if with_bias:
            want = want + numpy_helper.to_array(inits[1])
        tol = 1e-12
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_layernorm_rows_give_the_same_bits_however_split(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("EMBER_NUMBA", raising=False)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((37, 300)).astype(np.float32)
    scale, bias = rng.standard_normal(300).astype(np.float32), np.zeros(300, np.float32)
    whole = normalization._layernorm_compiled(x, 1, scale, bias, 1e-5)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    split = normalization._layernorm_compiled(x, 1, scale, bias, 1e-5)
    np.testing.assert_array_equal(whole, split)
    # and the numpy kernel agrees to float32 rounding
    numpy_kernel = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(whole, numpy_kernel * scale, rtol=1e-5, atol=1e-5)


def _decoder_mlp(rows: int, k: int, n: int, weight_is_input: bool = False):
    """x [rows, 1, k] -> MatMul by a constant [k, n] weight (-> y), and x times another
    weight + bias -> Gelu (-> g, fused into a FusedMatMul): a decoder step's shapes."""
    rng = np.random.default_rng(rows + k + n)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    w2 = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("MatMul", ["x", "w2"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Gelu", ["a"], ["g"], approximate="tanh")]
    inputs = [helper.make_tensor_value_info("x", F, [rows, 1, k])]
    if weight_is_input:  # an initialiser a caller may override: not a constant
        inputs.append(helper.make_tensor_value_info("w", F, [k, n]))
    graph = helper.make_graph(nodes, "mlp", inputs,
                              [helper.make_tensor_value_info(v, F, None) for v in "yg"],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2"),
                               numpy_helper.from_array(b, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return proto.SerializeToString(), w


@pytest.fixture(params=["tiles", "dot_columns"])
def few_rows(request, monkeypatch) -> tuple[range, list]:
    """Which kernel runs few rows by a constant weight: the register tiles (AVX-512) or the
    dot products with the weight's transpose (as on a CPU without AVX-512). Returns the
    rows it takes and the list of products it took (a spy)."""
    pytest.importorskip("numba")
    if request.param == "dot_columns":
        monkeypatch.setattr(_tiles, "_vectors", False)
    elif _tiles.kernel() is None:
        pytest.skip("no AVX-512 or AVX2 here: the tiles are off")
    name = "_tiled_product" if request.param == "tiles" else "_dot_columns"
    taken = []
    original = getattr(linalg, name)

    def spy(a, b, weight):
        y = original(a, b, weight)
        if y is not None:
            taken.append((a.shape, b.shape))
        return y

    monkeypatch.setattr(linalg, name, spy)
    return (tuning.TILE_ROWS if request.param == "tiles" else tuning.DOT_ROWS), taken


@pytest.mark.parametrize("rows, k, n", [(2, 768, 1367), (4, 768, 1367), (5, 2048, 513),
                                        (8, 768, 3072), (12, 1024, 1025), (16, 512, 777),
                                        (45, 1536, 257), (128, 512, 520), (48, 64, 16385),
                                        (20, 3072, 96)])
def test_few_rows_by_a_constant_weight_match_onnxruntime(rows, k, n, few_rows, monkeypatch):
    """Few rows by a large constant weight (2-512 as tiles, K at most 3072 from 17 rows; 4-12
    as dot products; odd row and column counts included), plain and fused with bias and
    GELU; within 1e-6 of sum_k |x_k| |w_kn| of the float64 product, and close to
    onnxruntime. The tiles are this CPU's (AVX2's too, whose rule keeps BLAS from 17 rows)."""
    kernel_rows, taken = few_rows
    tiles = kernel_rows is tuning.TILE_ROWS
    if not (2 <= rows <= 512 if tiles else rows in kernel_rows):
        pytest.skip("not a row count this kernel takes")
    monkeypatch.setattr(_tiles, "WIDE", True)  # the AVX-512 rule: tiles for these rows
    proto, w = _decoder_mlp(rows, k, n)
    x = np.random.default_rng(7).standard_normal((rows, 1, k)).astype(np.float32)
    session = ember.load(proto)
    assert [op for _, op, _ in session.placement] == ["MatMul", "FusedMatMul"]
    got = session.run({"x": x})
    assert len(taken) == 2  # both products, with the kernel
    exact = x.astype(np.float64) @ w
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(got["y"] - exact) <= 1e-6 * scale)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["g"], want[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows, k, n, wide", [(17, 3073, 512, True), (513, 512, 512, True),
                                              (49, 64, 16385, True), (17, 512, 512, False),
                                              (128, 768, 512, False)])
def test_tiles_leave_long_products_and_batches_to_blas(rows, k, n, wide, few_rows,
                                                       monkeypatch):
    """From 17 rows, a K above 3072 (the weights no longer stay in cache between tiles), from
    513 rows (a batch of tokens), and from 49 rows where N is above 16384 (a vocabulary) the
    products stay with BLAS; with AVX2's tiles (`wide` False) all from 17 rows; the results
    still match onnxruntime."""
    kernel_rows, taken = few_rows
    if kernel_rows is not tuning.TILE_ROWS:
        pytest.skip("the tiles' rule")
    monkeypatch.setattr(_tiles, "WIDE", wide)
    proto, _ = _decoder_mlp(rows, k, n)
    x = np.random.default_rng(6).standard_normal((rows, 1, k)).astype(np.float32)
    got = ember.load(proto).run({"x": x})
    assert taken == []
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["g"], want[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [8, 64])
def test_few_rows_by_a_constant_weight_same_bits_on_threads(rows, few_rows, monkeypatch):
    """The columns split among the session's threads: a session shared by 4 threads gives the
    bits of sequential runs, and 1 thread gives the same bits as 2."""
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)  # split even small products
    kernel_rows, taken = few_rows
    if rows not in kernel_rows:
        pytest.skip("not a row count this kernel takes")
    monkeypatch.setattr(_tiles, "WIDE", True)  # the AVX-512 rule: tiles for 64 rows too
    proto, _ = _decoder_mlp(rows, 768, 1537)
    rng = np.random.default_rng(8)
    feeds = [{"x": rng.standard_normal((rows, 1, 768)).astype(np.float32)} for _ in range(6)]
    session = ember.load(proto, threads=2)
    sequential = [session.run(f) for f in feeds]
    one_thread = ember.load(proto, threads=1)
    for f, want in zip(feeds, sequential):
        got = one_thread.run(f)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    results = _run_from_threads(session, feeds)
    assert taken
    for want, got in zip(sequential, results):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_an_overridable_weight_is_not_kept(few_rows):
    """A weight the caller may feed (an initialiser listed among the inputs) is no constant:
    its product goes to BLAS, and each run multiplies by the weight it was given."""
    _, taken = few_rows
    proto, w = _decoder_mlp(8, 1024, 1024, weight_is_input=True)
    session = ember.load(proto)
    reference = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(9).standard_normal((8, 1, 1024)).astype(np.float32)
    for weight in (w, -2 * w, w):
        got = session.run({"x": x, "w": weight})
        want = reference.run(None, {"x": x, "w": weight})
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["g"], want[1], rtol=1e-4, atol=1e-5)
    assert len(taken) == 3  # only the product by the constant w2, once a run


# ------------------------------------------------------------------ convolutions as tiles
TILE_CASES = [  # batch, channels in, size, channels out, kernel, strides, dilations, pads
    (1, 64, 14, 64, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),    # ResNet-50's 3x3, 196 pixels
    (2, 32, 13, 40, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),    # a part-filled block of 32
    (1, 3, 30, 16, [7, 7], [2, 2], [1, 1], [3, 3, 3, 3]),     # a stem: 3 channels, 7x7
    (2, 3, 33, 32, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),     # a stem, batch 2: planes padded
    (1, 1, 12, 40, [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),     # gray: planes where they lie
    (1, 3, 17, 8, [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),      # dilated: made channels-last
    (3, 16, 9, 7, [3, 5], [1, 2], [2, 1], [2, 0, 1, 3]),      # dilated, uneven pads
    (1, 48, 7, 96, [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]),     # 1x1: 49 pixels, 4 left over
    (2, 40, 10, 33, [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),    # 1x1 strided
    (1, 32, 6, 64, [1, 1], [1, 1], [1, 1], [1, 0, 0, 1]),     # 1x1 padded
    (1, 8, 2, 5, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),       # fewer pixels than a tile
    (1, 64, 56, 256, [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]),   # ResNet-50's 1x1 at 56x56: BLAS
    (1, 512, 7, 2048, [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]),  # and at 7x7: tiles too
    (1, 512, 28, 208, [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),  # and strided, 16 channels left
]
POINTWISE_AS_TILES = {(1, 512, 7, 2048), (1, 512, 28, 208)}  # the 1x1 cases `_tiled_fits` takes


def _tiles_or_skip():
    """The compiled tiles, or a skip where they don't serve (no numba, no AVX-512)."""
    pytest.importorskip("numba")
    compiled = _tiles.kernel()
    if compiled is None:
        pytest.skip("no AVX-512 or AVX2 here: the vector kernels are off")
    return compiled


@pytest.fixture(params=["tiles", "numpy"])
def tiles(request, monkeypatch):
    """Whether 2-D float32 convolutions run as register tiles (numba) or on the numpy
    kernels; with tiles, the 1x1 convolutions here take them too (as `_tiled_fits` would
    not: BLAS serves those), with and without padding."""
    if request.param == "numpy":
        monkeypatch.setitem(_compiled._compiled, _tiles.conv_tiles_loops, None)
    else:
        monkeypatch.delenv("EMBER_NUMBA", raising=False)
        _tiles_or_skip()
        monkeypatch.setattr(conv, "_tiled_fits", _any_2d_float32_fits)
    return request.param


def _any_2d_float32_fits(x, w, group, begin, end):
    return (x.ndim == 4 and group == 1 and x.dtype == np.float32 and min(begin) >= 0
            and min(end) >= 0)


def _conv_model(case, activation, residual, weight_is_input=False, seed=0):
    """Conv [+ Add of a residual] [+ Relu / Clip(0, 6)], as the simplifier fuses them."""
    n, c, size, m, kernel, strides, dilations, pads = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = (rng.standard_normal((m, c, *kernel)) / np.sqrt(c * np.prod(kernel))).astype(np.float32)
    b = (4 * rng.standard_normal(m)).astype(np.float32)  # some results above ReLU6's 6
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides,
                              dilations=dilations, pads=pads)]
    inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.float32(0), "lo"),
             numpy_helper.from_array(np.float32(6), "hi")]
    inputs, feeds = ["x"], {"x": x}
    if weight_is_input:
        inputs.append("w")
        feeds["w"] = w
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    last = "c"
    if residual:
        out_shape = ember.load(helper.make_model(helper.make_graph(
            nodes[:1], "probe", [helper.make_tensor_value_info("x", F, list(x.shape))],
            [helper.make_tensor_value_info("c", F, None)], inits + [numpy_helper.from_array(
                w, "w")]), opset_imports=[helper.make_opsetid("", 17)])).run({"x": x})["c"].shape
        inputs.append("z")
        feeds["z"] = rng.standard_normal(out_shape).astype(np.float32)
        nodes.append(helper.make_node("Add", ["c", "z"], ["s"]))
        last = "s"
    if activation == "relu":
        nodes.append(helper.make_node("Relu", [last], ["y"]))
    elif activation == "relu6":
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    shapes = {"x": x.shape, "w": w.shape, "z": feeds.get("z", x).shape}
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info(i, F, list(shapes[i])) for i in inputs],
        [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds


@pytest.mark.parametrize("activation, residual", [(None, False), ("relu", False),
                                                  ("relu6", False), ("relu", True)])
@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "x".join(map(str, c[:4]))
                         + f"-k{c[4][0]}{c[4][1]}s{c[5][0]}{c[5][1]}")
def test_conv_matches_onnxruntime_as_tiles_and_on_numpy(tiles, case, activation, residual):
    """Convolutions through the register tiles (bias and clip in the tiles' stores) and
    through the numpy kernels, against onnxruntime: every part-filled tile (pixels left at
    an image's end, output channels short of a block of 32), strides, dilations, pads."""
    proto, feeds = _conv_model(case, activation, residual)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ember.load(proto).run(feeds)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_tiles_run_the_convolutions_they_fit(monkeypatch):
    """The tiles do run where `_tiled_fits` says (a spy on their entry, _tiles.run): every
    window but 1x1 with at least TILES_MIN_OUTPUTS output channels, the 1x1 convolutions of
    one image with 512-2048 input channels and a large product (ResNet-50's), and in runs the
    strided 1x1 ones (`_strided_pointwise_fits`); BLAS keeps the other 1x1 ones. The rule is AVX-512's here (the tiles themselves are this
    CPU's); AVX2's is below."""
    _tiles_or_skip()
    monkeypatch.setattr(_tiles, "WIDE", True)
    calls = []
    run = _tiles.run
    monkeypatch.setattr(_tiles, "run", lambda *args: calls.append(args[-1]) or run(*args))
    for case in TILE_CASES:
        proto, feeds = _conv_model(case, "relu", False)
        calls.clear()
        ember.load(proto).run(feeds)
        strided_pointwise = case[4] == [1, 1] and case[5] != [1, 1] and not any(case[7])
        window = case[4] != [1, 1] and case[3] >= tuning.TILES_MIN_OUTPUTS
        assert bool(calls) == (window or case[:4] in POINTWISE_AS_TILES
                               or strided_pointwise), case
    for x_shape, fits in [((1, 512, 28, 28), True),                         # 103M multiply-adds
                          ((2, 512, 28, 28), False),                        # a batch: BLAS
                          ((1, 512, 7, 7), False),                          # 6.4M: BLAS
                          ((1, 256, 56, 56), False), ((1, 2048, 7, 7), True),
                          ((1, 4096, 7, 7), False)]:
        x = np.ones(x_shape, np.float32)
        w = np.ones((256, x_shape[1], 1, 1), np.float32)
        assert conv._tiled_fits(x, w, 1, [0, 0], [0, 0]) == fits, x_shape
    # AVX2: no 1x1 convolution, and sums of at most 1536 terms (3x3 by 128 channels, not 256)
    monkeypatch.setattr(_tiles, "WIDE", False)
    for x_shape, w_shape, fits in [((1, 64, 56, 56), (256, 64, 1, 1), False),
                                   ((1, 128, 28, 28), (128, 128, 3, 3), True),
                                   ((1, 256, 14, 14), (256, 256, 3, 3), False),
                                   ((1, 3, 224, 224), (64, 3, 7, 7), True)]:
        x, w = np.ones(x_shape, np.float32), np.ones(w_shape, np.float32)
        assert conv._tiled_fits(x, w, 1, [1, 1], [1, 1]) == fits, w_shape
    monkeypatch.setattr(_tiles, "_vectors", False)   # a CPU without vectors: BLAS
    assert _tiles.kernel() is None
    assert not conv._tiled_fits(np.ones((1, 8, 5, 5), np.float32),
                                np.ones((8, 8, 3, 3), np.float32), 1, [1, 1], [1, 1])


def test_tiles_give_the_same_bits_however_split(monkeypatch):
    """A unit of the tiles computes its outputs in one order whatever the split: pieces in
    any order, one thread or the pool's, give the same bits."""
    compiled = _tiles_or_skip()
    rng = np.random.default_rng(3)
    n, c, hp, m, k = 2, 24, 17, 72, 3   # 15x15 outputs: 19 tiles an image, 3 blocks
    image = rng.standard_normal((n, hp, hp, c)).astype(np.float32)
    packed, bias = _tiles.pack(rng.standard_normal((k * k * c, m)).astype(np.float32),
                               rng.standard_normal(m).astype(np.float32))
    ho = hp - k + 1
    pixels = ((np.arange(ho)[:, None] * hp + np.arange(ho)).reshape(-1) * c).astype(np.int64)
    taps = ((np.arange(k)[:, None] * hp + np.arange(k)).reshape(-1) * c).astype(np.int64)
    units = packed.shape[0] * n * -(-pixels.size // _tiles.ROWS)
    args = (image.reshape(-1), hp * hp * c, pixels, taps, c, packed, bias, np.float32(0),
            np.float32(np.inf))
    whole = np.empty((n * pixels.size, m), np.float32)
    compiled(*args, whole, n, 5, 0, 0, units)
    pieces = np.empty_like(whole)
    for u in reversed(range(0, units, 7)):
        compiled(*args, pieces, n, 5, 0, u, min(units, u + 7))
    np.testing.assert_array_equal(pieces, whole)
    for band in (1, 2, 1000):   # the band changes the order units are taken in, not a bit
        other = np.empty_like(whole)
        compiled(*args, other, n, band, 0, 0, units)
        np.testing.assert_array_equal(other, whole)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    pooled = np.empty_like(whole)
    _tiles.run(compiled, image.reshape(-1), hp * hp * c, pixels, taps, c, packed, bias,
               (0.0, np.inf), pooled, n,
               *_tiles.cut(n, pixels.size, hp * hp * c, c, 1, packed, pooled.nbytes))
    np.testing.assert_array_equal(pooled, whole)
    # and the documented semantics: the tiles in Python, with the numpy `tile`
    python = np.empty_like(whole)
    _tiles.conv_tiles_loops(*args, python, n, 5, 0, 0, units)
    np.testing.assert_allclose(python, whole, rtol=1e-5, atol=1e-5 * float(whole.max()))


def test_tiles_shared_by_threads_and_with_a_weight_fed_at_run_time():
    """A session shared by 4 threads gives its sequential runs' bits; a weight that is a
    graph input is packed again on every run, not kept."""
    _tiles_or_skip()
    proto, _ = _conv_model(TILE_CASES[0], "relu", True)
    session = ember.load(proto)
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((1, 64, 14, 14)).astype(np.float32),
              "z": rng.standard_normal((1, 64, 14, 14)).astype(np.float32)} for _ in range(8)]
    sequential = [session.run(f)["y"] for f in feeds]
    for want, got in zip(sequential, _run_from_threads(session, feeds)):
        np.testing.assert_array_equal(got["y"], want)
    proto, feeds = _conv_model(TILE_CASES[1], "relu", False, weight_is_input=True)
    session = ember.load(proto)
    reference = ort.InferenceSession(proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    w = feeds["w"]
    for weight in (w, -2 * w, w):
        feeds["w"] = weight
        want = reference.run(None, feeds)[0]
        np.testing.assert_allclose(session.run(feeds)["y"], want, rtol=1e-4,
                                   atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("channels", [3, 24])   # an image's planes, channels-last
def test_tiles_keep_their_padded_image_between_runs(channels):
    """A padded convolution's route keeps its padded image (conv._TiledRoute): its border
    stays zero and each run copies its own input in, run after run and from several threads
    at once (one image each), as onnxruntime computes them; a 3x3 stride-2 stem on a 3-channel
    image, a 3x3 one on the channels-last result of a depthwise convolution."""
    _tiles_or_skip()
    rng = np.random.default_rng(13)
    size = 40
    inits = [numpy_helper.from_array(
        (rng.standard_normal((16, channels, 3, 3)) / channels).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4, strides=[2, 2])]
    if channels > 3:   # channels-last: the depthwise kernel's result
        inits.append(numpy_helper.from_array(
            rng.standard_normal((channels, 1, 3, 3)).astype(np.float32), "dw"))
        nodes.insert(0, helper.make_node("Conv", ["x0", "dw"], ["x"], group=channels,
                                         pads=[1] * 4))
    first = nodes[0].input[0]
    graph = helper.make_graph(nodes, "padded", [helper.make_tensor_value_info(
        first, F, [1, channels, size, size])], [helper.make_tensor_value_info("y", F, None)],
        inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ember.load(proto.SerializeToString(), threads=2)
    reference = ort.InferenceSession(proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    feeds = [{first: rng.standard_normal((1, channels, size, size)).astype(np.float32)}
             for _ in range(4)]
    sequential = [session.run(f)["y"] for f in feeds + feeds]
    for f, got in zip(feeds + feeds, sequential):
        want = reference.run(None, f)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    for want, got in zip(sequential, _run_from_threads(session, feeds)):
        np.testing.assert_array_equal(got["y"], want)


def test_tiles_read_a_channels_last_input_where_it_lies(monkeypatch):
    """A 3x3 convolution's channels-last result, into an unpadded 2x2 stride-2 one (a
    ConvNeXt downsampling): the second reads the first's memory without a copy."""
    _tiles_or_skip()
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 24, 16, 16)).astype(np.float32)
    w1 = (rng.standard_normal((40, 24, 3, 3)) / 15).astype(np.float32)
    w2 = (rng.standard_normal((48, 40, 2, 2)) / 12).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "down", [helper.make_tensor_value_info("x", F, [2, 24, 16, 16])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs, padded = [], []
    run, pad = conv._TiledRoute.run, conv._TiledRoute._padded
    monkeypatch.setattr(conv._TiledRoute, "run", lambda self, x: (
        inputs.append(_layout.channels_last(x)), run(self, x))[1])
    monkeypatch.setattr(conv._TiledRoute, "_padded", lambda self, layout: (
        padded.append(1), pad(self, layout))[1])
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ember.load(proto).run({"x": x})["y"]
    assert inputs == [False, True] and len(padded) == 1   # the second is not copied
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


VECTOR_DEPTHWISE_CASES = [  # c, size, kernel, strides, dilations, pads
    (32, 28, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    (48, 17, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    (16, 15, [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),
    (64, 12, [3, 3], [2, 1], [1, 1], [0, 1, 1, 0]),
    (16, 2, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),     # no pixel away from the border
    (32, 14, [5, 5], [2, 2], [1, 1], [2, 2, 2, 2]),
    (96, 20, [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),    # ConvNeXt's
    (16, 14, [7, 7], [1, 2], [1, 2], [2, 1, 4, 0]),
    (96, 120, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),   # bands of 5 output rows
    (48, 100, [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),   # bands of 27
]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", VECTOR_DEPTHWISE_CASES,
                         ids=lambda c: f"c{c[0]}-{c[1]}-k{c[2][0]}s{c[3]}d{c[4]}")
def test_depthwise_as_vector_code_matches_onnxruntime(case, batch, monkeypatch):
    """Depthwise convolutions with channels a multiple of 16 and a 3x3, 5x5 or 7x7 window
    take the vector kernel (its inner pixels) and `_pixel_by_taps` (the border), with the
    bias and a ReLU6 in the same pass: against onnxruntime, after a channels-last 1x1."""
    pytest.importorskip("numba")
    compiled = _tiles.depthwise_kernel(conv._depthwise_vector_rows)
    if compiled is None:
        pytest.skip("no AVX-512 or AVX2 here: the vector kernel is off")
    monkeypatch.setattr(_tiles, "WIDE", True)  # AVX2 keeps the numba loops: run it anyway
    calls = []  # the kernel's calls, or its pieces on the board (larger images are split)
    monkeypatch.setitem(_compiled._compiled, conv._depthwise_vector_rows,
                        lambda *args: calls.append(args[-2:]) or compiled(*args))
    on_board = _compiled._pieces_on_board
    monkeypatch.setattr(_compiled, "_pieces_on_board", lambda piece, args, bounds: (
        piece is conv._depthwise_vector_piece and calls.append(bounds)
        or on_board(piece, args, bounds)))
    proto, feeds = _model(*case, True, batch)
    want = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ember.load(proto).run(feeds)["y"]
    assert calls
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["", "HardSwish"])
def test_depthwise_vector_rows_give_the_same_bits_however_split(activation, monkeypatch):
    """The vector kernel's rows in uneven pieces, or over the pool, give one thread's bits;
    with an activation in its loops (FusedConv's HardSwish), the bits of the unactivated
    rows then numpy's HardSwish."""
    pytest.importorskip("numba")
    compiled = _tiles.depthwise_kernel(conv._depthwise_vector_rows)
    if compiled is None:
        pytest.skip("no AVX-512 or AVX2 here: the vector kernel is off")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 23, 19, 48)).astype(np.float32)
    wt = rng.standard_normal((3, 3, 48)).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    vectors, taps = conv._vector_weights(wt, 19, 1, 1, None)
    a, c = (np.empty((2, 23, 19, 48), np.float32) for _ in range(2))
    plain = (1, 1, 1, 1, 1, 1, np.float32(-np.inf), np.float32(np.inf), 0, np.float32(0),
             np.float32(0))
    geometry = plain[:6] + (np.float32(0), np.float32(6), 0, np.float32(0), np.float32(0))
    if activation:
        code, p0, p1 = _epilogue.activation_in_loops(activation, [], np.float32)
        geometry = plain[:8] + (code, np.float32(p0), np.float32(p1))
        want = np.empty_like(x)
        compiled(x, vectors, taps, wt, b, want, *plain, 0, 23)
        _epilogue.activate_in_place(np, want, activation, [])
    compiled(x, vectors, taps, wt, b, a, *geometry, 0, 23)
    if activation:
        np.testing.assert_array_equal(a, want)
    for i in range(0, 23, 5):
        compiled(x, vectors, taps, wt, b, c, *geometry, i, min(23, i + 5))
    np.testing.assert_array_equal(a, c)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    pooled = np.empty_like(a)
    _compiled.split_rows(compiled, 23, x, vectors, taps, wt, b, pooled, *geometry,
                         ns_per_row=1.0)
    np.testing.assert_array_equal(a, pooled)


def _split_kernel_cases():
    rng = np.random.default_rng(6)

    def depthwise(dtype, k):
        x = rng.standard_normal((1, 40, 23, 19)).astype(dtype)
        w = rng.standard_normal((40, 1, k, k)).astype(dtype)
        b = rng.standard_normal(40).astype(dtype)
        p = k // 2
        return lambda: conv.conv_nd(np, x, w, 40, (k, k), (1, 1), (1, 1), (p, p), (p, p), b,
                                    cache={}, clamp=(0.0, 6.0))

    def epilogue(dtype):
        y = rng.standard_normal((96, 400)).astype(dtype)
        row = rng.standard_normal(400).astype(dtype)
        z = rng.standard_normal((96, 400)).astype(dtype)

        def compute():
            out = y.copy()
            assert _epilogue._epilogue_compiled(out, row, z, "Clip", [-0.5, 0.5])
            return out
        return compute

    def tiles():
        x = rng.standard_normal((1, 32, 20, 20)).astype(np.float32)
        w = rng.standard_normal((48, 32, 3, 3)).astype(np.float32)
        b = rng.standard_normal(48).astype(np.float32)
        assert conv._tiled_fits(x, w, 1, [1, 1], [1, 1])
        return lambda: conv.conv_nd(np, x, w, 1, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), b,
                                    cache={}, clamp=(0.0, 6.0))

    def softmax():
        x = rng.standard_normal((64, 300)).astype(np.float32)
        return lambda: reduction._softmax_compiled(np, x, -1, False)

    def layernorm(dtype):
        x = rng.standard_normal((96, 400)).astype(dtype)
        scale, b = rng.standard_normal(400).astype(dtype), rng.standard_normal(400).astype(dtype)
        return lambda: normalization._layernorm_compiled(x, 1, scale, b, 1e-5)

    def depthwise_vector():
        x = rng.standard_normal((1, 48, 23, 19)).astype(np.float32)
        w = rng.standard_normal((48, 1, 3, 3)).astype(np.float32)
        b = rng.standard_normal(48).astype(np.float32)

        def compute():  # the route's cuts are made with it: under the test's MIN_PIECE_NS
            route = conv._DepthwiseRoute.make(x, w, b, (0.0, 6.0), (3, 3), (1, 1), (1, 1),
                                              (1, 1), (23, 19), {})
            assert route.piece is conv._depthwise_vector_piece
            return route.run(x)
        return compute

    return {"softmax": softmax,
            "depthwise-vector": depthwise_vector,
            "layernorm-float32": lambda: layernorm(np.float32),
            "layernorm-float64": lambda: layernorm(np.float64),
            "depthwise3x3-float32": lambda: depthwise(np.float32, 3),
            "depthwise3x3-float64": lambda: depthwise(np.float64, 3),
            "depthwise5x5-float32": lambda: depthwise(np.float32, 5),
            "depthwise5x5-float64": lambda: depthwise(np.float64, 5),
            "epilogue-float32": lambda: epilogue(np.float32),
            "epilogue-float64": lambda: epilogue(np.float64),
            "tiles": tiles}


@pytest.mark.parametrize("case", list(_split_kernel_cases()))
def test_split_kernels_run_their_pieces_on_the_board(case, monkeypatch):
    """The kernels with a piece function (softmax, layer norm, depthwise, the epilogue, the
    tiles) put their pieces on the products' board, where the helpers take them without
    Python: one thread's bits, and some pieces taken by a helper."""
    pytest.importorskip("numba")
    if case == "tiles":
        _tiles_or_skip()
    if case == "depthwise-vector":
        if _tiles.depthwise_kernel(conv._depthwise_vector_rows) is None:
            pytest.skip("no AVX-512 or AVX2 here: the vector kernel is off")
        monkeypatch.setattr(_tiles, "WIDE", True)  # AVX2 keeps the numba loops: run it anyway
    pieces_on_the_board_give_one_threads_bits(_split_kernel_cases()[case](), monkeypatch)


@pytest.mark.parametrize("in_run", [False, True])
def test_channels_last_concat_copies_its_images_pixel_by_pixel(in_run, monkeypatch):
    """Concat along the channels of channels-last float32 images (UNet's skips), of channel
    slices of one (a C2f block's Split parts) and of a planar image: the compiled copy
    (shape._copy_pixels, its pieces on the board in a run) of each input whose pixels hold
    their channels in a run, numpy's of the planar one; numpy's concatenation,
    channels-last, and no numpy copy of the channels-last inputs."""
    pytest.importorskip("numba")
    from ember.ops import shape
    rng = np.random.default_rng(3)
    a, b = (np.ascontiguousarray(rng.standard_normal((2, 37, 29, c)).astype(np.float32))
            .transpose(0, 3, 1, 2) for c in (24, 40))
    split = b[:, 8:24]                                  # 16 channels, pixels 40 apart
    planar = rng.standard_normal((2, 5, 37, 29)).astype(np.float32)
    copied = []
    kernel = _compiled.jit(shape._copy_pixels)
    monkeypatch.setitem(_compiled._compiled, shape._copy_pixels,
                        lambda *args: (copied.append(args[2]), kernel(*args)))
    if in_run:
        engine.current().enter(2)
    try:
        pair = shape._concat_channels_last([a, b])
        mixed = shape._concat_channels_last([split, a, planar, b[:, :3]])
    finally:
        if in_run:
            engine.current().leave()
    assert _layout.channels_last(pair) and _layout.channels_last(mixed)
    np.testing.assert_array_equal(pair, np.concatenate([a, b], axis=1))
    np.testing.assert_array_equal(mixed, np.concatenate([split, a, planar, b[:, :3]], axis=1))
    if not in_run:   # (in a run the pieces go on the board, not through this function)
        assert sorted(set(copied)) == [3, 16, 24, 40]


@pytest.mark.parametrize("kernel, out_channels", [(1, 96), (3, 64), (1, 40)])
def test_tiles_streaming_their_rows_match_onnxruntime(kernel, out_channels, monkeypatch):
    """Outputs from tuning.STREAM_FROM_BYTES on are stored around the caches (non-temporal
    stores, then a fence): here from 64 KB, through a 1x1 convolution's route and a 3x3 one's
    tiles, on two threads; 40 output channels are not whole vectors a row and are stored as
    usual. Same values as onnxruntime's."""
    pytest.importorskip("numba")
    if _tiles.kernel() is None or not _tiles.WIDE:
        pytest.skip("the streaming stores are AVX-512 tiles'")
    monkeypatch.setattr(tuning, "STREAM_FROM_BYTES", 1 << 16)
    rng = np.random.default_rng(kernel)
    c = 16
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "dw"),
             numpy_helper.from_array((rng.standard_normal((out_channels, c, kernel, kernel))
                                      / c).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "dw"], ["d"], group=c, pads=[1] * 4),
             helper.make_node("Conv", ["d", "w", "b"], ["y"], pads=[kernel // 2] * 4)]
    graph = helper.make_graph(nodes, "stream", [helper.make_tensor_value_info(
        "x", F, [2, c, 40, 40])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, c, 40, 40)).astype(np.float32)
    streamed = []
    streams = _tiles.streams
    monkeypatch.setattr(_tiles, "streams", lambda out: (streamed.append(streams(out)),
                                                        streams(out))[1])
    got = ember.load(proto.SerializeToString(), threads=2).run({"x": x})["y"]
    assert any(streamed) == (out_channels % _tiles.LANES == 0)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_arrays_address_is_its_data_pointer(tmp_path):
    """_compiled.address (read from the array object's C struct) is the data pointer numpy
    reports, for new arrays, views at an offset, transposed and strided views, 0-d and empty
    arrays, a numpy scalar, a memory map, and an ndarray over a foreign buffer."""
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    mapped = np.lib.format.open_memmap(tmp_path / "m.npy", mode="w+", dtype=np.float32,
                                       shape=(8,))
    arrays = [base, base[2:, 3:], base.T, base[::2, ::3], np.ones(()), np.float64(1.0),
              np.empty((0, 4)), mapped, mapped[3:], np.ndarray((4,), np.uint8, bytearray(16), 8)]
    for x in arrays:
        assert _compiled.address(x) == x.__array_interface__["data"][0]


@pytest.mark.parametrize("batch, size", [(1, 7), (3, 14), (1, 112)])
def test_mean_over_a_channels_last_images_pixels(batch, size, monkeypatch):
    """ReduceMean over the pixels of a channels-last image (a depthwise convolution's result)
    by the compiled pieces (reduction._pixel_sums), on two threads, in a session shared by
    threads too: onnxruntime's means, and the same bits run after run; 112x112 pixels are
    more than a piece sums in order (SPATIAL_MEAN_MAX_PIXELS)."""
    pytest.importorskip("numba")
    from ember.ops import reduction
    rng = np.random.default_rng(14)
    c = 64
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["d"], group=c, pads=[1] * 4),
             helper.make_node("ReduceMean", ["d", "axes"], ["y"], keepdims=1)]
    graph = helper.make_graph(nodes, "gap", [helper.make_tensor_value_info(
        "x", F, [batch, c, size, size])], [helper.make_tensor_value_info("y", F, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    summed = []
    sums = reduction._spatial_mean
    monkeypatch.setattr(reduction, "_spatial_mean", lambda x: (
        summed.append(r := sums(x)), r)[1])
    session = ember.load(proto.SerializeToString(), threads=2)
    feeds = [{"x": rng.standard_normal((batch, c, size, size)).astype(np.float32)}
             for _ in range(3)]
    reference = ort.InferenceSession(proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    sequential = [session.run(f)["y"] for f in feeds]
    assert summed and all(r is not None for r in summed)
    for f, got in zip(feeds, sequential):
        np.testing.assert_allclose(got, reference.run(None, f)[0], rtol=1e-5, atol=1e-6)
    for want, got in zip(sequential, _run_from_threads(session, feeds)):
        np.testing.assert_array_equal(got["y"], want)
