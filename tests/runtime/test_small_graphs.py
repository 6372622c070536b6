"""Small graphs run at the cost of their kernels: the work a node can do once per input
geometry is done once (Slice's index from constant bounds, Pad's gather indices) and must
give what the op gives for every shape fed; a run enters and leaves the CPU engine leaving
BLAS's thread counts as they were; Loop checks its bounds without a call per iteration; a
one-direction LSTM's states come back as buffers of their own. What a node keeps per input
geometry (the recurrences' route, Gemm's checks) gives the bits of the general path, and a
plan whose ops call no BLAS leaves BLAS's thread counts alone."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper

import ember
from ember.errors import ResourceLimitError
from ember.ops.cpu import engine

F = T.FLOAT


def _vi(name, dtype=F, shape=None):
    return h.make_tensor_value_info(name, dtype, shape)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(nodes, inputs, outputs, initializers=(), opset=18) -> bytes:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)]).SerializeToString()


def _reference_pad(x, pads, mode):
    """numpy's pad of `x` by ONNX `pads` (negative ones crop first); a single element
    reflected repeats itself, as ONNX says."""
    rank = x.ndim
    before, after = list(pads[:rank]), list(pads[rank:])
    x = x[tuple(slice(-min(b, 0), x.shape[i] + min(e, 0) or None)
                for i, (b, e) in enumerate(zip(before, after)))]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(before, after)]
    for axis, width in enumerate(widths):
        one = [(0, 0)] * rank
        one[axis] = width
        axis_mode = "edge" if mode == "reflect" and x.shape[axis] == 1 else mode
        x = np.pad(x, one, mode=axis_mode)
    return x


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[0, 0, 0, 0, 0, 64], [1, 2, 3, 2, 1, 0],
                                  [0, 0, 9, 0, 0, 11], [0, -1, 2, 0, 1, -2]])
def test_pad_by_gathering_is_numpys_pad_for_every_shape(mode, pads):
    """Constant pads (the gather indices remembered per shape): each shape fed, again and in
    turn, gives np.pad's values, pads longer than the axis and single elements included."""
    sess = ember.load(_model([h.make_node("Pad", ["x", "pads"], ["y"], mode=mode)],
                             [_vi("x", F, ["a", "b", "c"])], [_vi("y", F, None)],
                             [_ints("pads", pads)], opset=19))
    rng = np.random.default_rng(0)
    shapes = [(1, 3, 4), (2, 4, 3), (1, 3, 4), (3, 2, 7), (2, 4, 3)]
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        got = sess.run({"x": x})["y"]
        assert np.array_equal(got, _reference_pad(x, pads, mode)), shape


def test_pad_with_pads_fed_each_run():
    sess = ember.load(_model([h.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")],
                             [_vi("x", F, [2, 5]), _vi("pads", T.INT64, [4])],
                             [_vi("y", F, None)]))
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    for pads in ([0, 2, 0, 3], [1, 0, 0, 1], [0, 4, 0, 4]):
        got = sess.run({"x": x, "pads": np.array(pads, np.int64)})["y"]
        assert np.array_equal(got, _reference_pad(x, pads, "reflect")), pads


def test_pad_of_an_empty_axis_is_refused():
    sess = ember.load(_model([h.make_node("Pad", ["x", "pads"], ["y"], mode="edge")],
                             [_vi("x", F, ["a", 3])], [_vi("y", F, None)],
                             [_ints("pads", [1, 0, 1, 0])]))
    with pytest.raises(ember.EmberError, match="empty axis"):
        sess.run({"x": np.zeros((0, 3), np.float32)})


def test_slice_with_constant_bounds_for_every_shape():
    """The index is remembered per input shape: each shape gets its own clamping."""
    nodes = [h.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])]
    inits = [_ints("starts", [1, -1]), _ints("ends", [-1, -1000]), _ints("axes", [0, 1]),
             _ints("steps", [1, -2])]
    sess = ember.load(_model(nodes, [_vi("x", F, ["a", "b"])], [_vi("y", F, None)], inits))
    for shape in [(4, 5), (3, 8), (4, 5), (1, 1), (6, 2)]:
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        assert np.array_equal(sess.run({"x": x})["y"], x[1:-1, ::-2]), shape


def test_slice_with_bounds_fed_each_run():
    nodes = [h.make_node("Slice", ["x", "starts", "ends"], ["y"])]
    sess = ember.load(_model(nodes, [_vi("x", F, [6]), _vi("starts", T.INT64, [1]),
                                     _vi("ends", T.INT64, [1])], [_vi("y", F, None)]))
    x = np.arange(6, dtype=np.float32)
    for start, end in [(0, 3), (2, 6), (-4, -1)]:
        got = sess.run({"x": x, "starts": np.array([start]), "ends": np.array([end])})["y"]
        assert np.array_equal(got, x[start:end])


def test_runs_leave_blas_thread_counts_as_they_found_them():
    """A run sets BLAS's count for its duration; after it, and after nested runs of other
    counts, each library has its own count back."""
    cpu = engine.current()
    before = cpu.runs.current_threads()
    cpu.enter(1)
    cpu.enter(3)
    cpu.leave()
    cpu.leave()
    assert cpu.runs.current_threads() == before
    sess = ember.load(_model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", F, [2])],
                             [_vi("y", F, [2])]), threads=1)
    for _ in range(3):
        sess.run({"x": np.ones(2, np.float32)})
    assert cpu.runs.current_threads() == before
    assert cpu.run_threads() == cpu.runs._cores  # no run in flight


def _loop_model(trips: int) -> bytes:
    """Loop of `trips` iterations, a float carried (+1 each) and scanned out."""
    body = h.make_graph(
        [h.make_node("Identity", ["cond"], ["cond_out"]),
         h.make_node("Add", ["v", "one"], ["v_out"]),
         h.make_node("Identity", ["v_out"], ["scan"])],
        "body", [_vi("i", T.INT64, []), _vi("cond", T.BOOL, []), _vi("v", F, [4])],
        [_vi("cond_out", T.BOOL, []), _vi("v_out", F, [4]), _vi("scan", F, [4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "one")])
    return _model([h.make_node("Loop", ["M", "", "v0"], ["v", "scans"], body=body)],
                  [_vi("v0", F, [4])], [_vi("v", F, [4]), _vi("scans", F, None)],
                  [_ints("M", trips)])


@pytest.mark.parametrize("trips", [0, 1, 2, 3, 5, 8, 13])
def test_loop_results_for_any_trip_count(trips):
    out = ember.load(_loop_model(trips)).run({"v0": np.zeros(4, np.float32)})
    assert np.array_equal(out["v"], np.full(4, trips, np.float32))
    want = np.repeat(np.arange(1, trips + 1, dtype=np.float32)[:, None], 4, axis=1)
    assert np.array_equal(out["scans"], want.reshape(trips, 4))


def test_loop_scan_outputs_checked_every_iteration():
    """With a trip count, the stacked size is projected after the first iteration: the
    loop fails then, not at its end."""
    sess = ember.load(_loop_model(1_000_000), max_tensor_bytes=1 << 16)
    with pytest.raises(ResourceLimitError, match="scan output"):
        sess.run({"v0": np.zeros(4, np.float32)})


def test_lstm_one_direction_states_are_buffers_of_their_own():
    """The final h is a view of Y's last step inside the plan; what the caller gets are
    separate writable arrays, equal to Y's last step."""
    H, I = 16, 8
    rng = np.random.default_rng(3)
    W = rng.standard_normal((1, 4 * H, I)).astype(np.float32)
    R = rng.standard_normal((1, 4 * H, H)).astype(np.float32)
    model = _model([h.make_node("LSTM", ["x", "W", "R"], ["y", "hn", "cn"], hidden_size=H)],
                   [_vi("x", F, [3, 2, I])], [_vi(n, F, None) for n in ("y", "hn", "cn")],
                   [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")],
                   opset=14)
    out = ember.load(model).run({"x": rng.standard_normal((3, 2, I)).astype(np.float32)})
    assert out["hn"].shape == (1, 2, H) and out["cn"].shape == (1, 2, H)
    assert np.array_equal(out["hn"][0], out["y"][-1, 0])
    assert not np.shares_memory(out["hn"], out["y"])
    assert out["hn"].flags.writeable and out["hn"].flags.c_contiguous



def _onnxruntime(model: bytes):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_reflect_pad_by_constant_pads_matches_onnxruntime(opset):
    """Pad-11/13/18 with constant pads (their gathers kept per shape) against onnxruntime,
    each shape fed in turn and again."""
    model = _model([h.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")],
                   [_vi("x", F, [1, 1, "n"])], [_vi("y", F, None)],
                   [_ints("pads", [0, 0, 0, 0, 0, 64])], opset=opset)
    sess, ref = ember.load(model), _onnxruntime(model)
    rng = np.random.default_rng(1)
    for n in (512, 256, 512, 100):
        x = rng.standard_normal((1, 1, n)).astype(np.float32)
        np.testing.assert_array_equal(sess.run({"x": x})["y"], ref.run(None, {"x": x})[0])


def test_reduce_mean_with_kept_axes_matches_onnxruntime_for_each_rank():
    """ReduceMean's axes (the attribute, or a constant input) are kept per rank: inputs of
    another rank fed after the first give the reduction over their own axes."""
    attr = _model([h.make_node("ReduceMean", ["x"], ["y"], axes=[-1], keepdims=0)],
                  [_vi("x", F, None)], [_vi("y", F, None)], opset=13)
    given = _model([h.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)],
                   [_vi("x", F, None)], [_vi("y", F, None)], [_ints("axes", [-1, 1])],
                   opset=18)
    rng = np.random.default_rng(2)
    for model in (attr, given):
        sess, ref = ember.load(model), _onnxruntime(model)
        for shape in [(1, 128, 1), (2, 3, 4, 5), (1, 128, 1), (3, 5), (2, 3, 4, 5)]:
            x = rng.standard_normal(shape).astype(np.float32)
            np.testing.assert_allclose(sess.run({"x": x})["y"], ref.run(None, {"x": x})[0],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", [0, -1, 2, [1, -2, 0]])
def test_gather_by_a_constant_index_matches_onnxruntime_for_every_shape(index):
    """Gather's constant indices are checked once per data shape: each shape fed gives
    onnxruntime's values, and an index out of range of a later shape is still refused."""
    model = _model([h.make_node("Gather", ["x", "i"], ["y"], axis=1)],
                   [_vi("x", F, ["a", "b", "c"])], [_vi("y", F, None)],
                   [_ints("i", index)], opset=13)
    sess, ref = ember.load(model), _onnxruntime(model)
    rng = np.random.default_rng(3)
    for shape in [(1, 3, 128), (2, 4, 3), (1, 3, 128)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(sess.run({"x": x})["y"], ref.run(None, {"x": x})[0])
    x = np.zeros((1, 1, 2), np.float32)  # an axis of one: only indices 0 and -1 in range
    if index in (0, -1):
        np.testing.assert_array_equal(sess.run({"x": x})["y"], ref.run(None, {"x": x})[0])
    else:
        with pytest.raises(ember.errors.EmberError, match="out of bounds"):
            sess.run({"x": x})


def test_gemm_bias_broadcast_matches_onnxruntime_and_a_bad_bias_is_refused():
    w = numpy_helper.from_array(np.random.default_rng(4).standard_normal((1, 128))
                                .astype(np.float32), "w")
    for bias_shape in [(1,), (1, 1), ()]:
        b = numpy_helper.from_array(np.full(bias_shape, 0.25, np.float32), "b")
        model = _model([h.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                       [_vi("x", F, ["m", 128])], [_vi("y", F, None)], [w, b], opset=13)
        sess, ref = ember.load(model), _onnxruntime(model)
        for m in (1, 3):
            x = np.random.default_rng(m).standard_normal((m, 128)).astype(np.float32)
            np.testing.assert_allclose(sess.run({"x": x})["y"], ref.run(None, {"x": x})[0],
                                       rtol=1e-5, atol=1e-6)
    bad = numpy_helper.from_array(np.zeros((2, 1), np.float32), "b")
    sess = ember.load(_model([h.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                             [_vi("x", F, ["m", 128])], [_vi("y", F, None)], [w, bad],
                             opset=13), simplify=False)
    with pytest.raises(ember.errors.EmberError, match="does not broadcast"):
        sess.run({"x": np.zeros((3, 128), np.float32)})


def test_plans_set_blas_thread_counts_only_where_an_op_may_call_blas():
    """A plan of ops known to call no BLAS (`calls_blas` False) leaves the libraries' counts
    as they are, yet its run is in flight with its threads (the kernel pool's helpers and
    `run_threads` serve it); a run that calls BLAS beside it sets them, and the last run
    out restores them."""
    cpu = engine.current()
    relu = ember.load(_model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", F, [2])],
                             [_vi("y", F, [2])]))
    matmul = ember.load(_model([h.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", F, [1, 2])],
                               [_vi("y", F, None)],
                               [numpy_helper.from_array(np.ones((2, 2), np.float32), "w")]))
    assert not relu.plan.calls_blas and matmul.plan.calls_blas
    before = cpu.runs.current_threads()
    cpu.enter(3, False)
    assert cpu.runs.current_threads() == before
    assert cpu.run_threads() == 3 and cpu.in_flight[0] >= 1
    cpu.enter(3)
    assert all(c == cpu._blas_count(3) for c in cpu.runs.current_threads())
    cpu.leave()
    cpu.leave()
    assert cpu.runs.current_threads() == before
    assert cpu.run_threads() == cpu.runs._cores
    for sess in (relu, matmul, relu):
        shape = (2,) if sess is relu else (1, 2)
        sess.run({"x": np.ones(shape, np.float32)})
        assert cpu.runs.current_threads() == before


@pytest.mark.parametrize("shape", [[2, "n", 3], ["n", 4], [2, 4]])
def test_feed_checks_refuse_wrong_sizes_as_before(shape):
    """Feeds checked by the input's summary (fixed sizes picked out at once): a right feed
    passes, a wrong size or dtype is the InputError naming the dimension."""
    sess = ember.load(_model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", F, shape)],
                             [_vi("y", F, None)]))
    good = tuple(5 if isinstance(d, str) else d for d in shape)
    x = np.ones(good, np.float32)
    np.testing.assert_array_equal(sess.run({"x": x})["y"], x)
    for axis, d in enumerate(shape):
        if isinstance(d, int):
            bad = list(good)
            bad[axis] += 1
            with pytest.raises(ember.errors.InputError, match=f"size {d} in dimension {axis}"):
                sess.run({"x": np.ones(bad, np.float32)})
    with pytest.raises(ember.errors.InputError, match="expects dtype float32"):
        sess.run({"x": np.ones(good, np.float64)})


def _recurrence(op, H, I, direction, layout, states, rng, lens=False):
    """An LSTM (or GRU with linear_before_reset) over x [seq, batch, I] (layout 0) or
    [batch, seq, I] (layout 1) of any seq and batch, with constant weights, its initial
    states as inputs where `states`, and sequence_lens as an input where `lens`."""
    D = 2 if direction == "bidirectional" else 1
    gates = 4 if op == "LSTM" else 3
    inits = [numpy_helper.from_array(
        (rng.standard_normal(shape) * 0.3).astype(np.float32), name)
        for name, shape in (("W", (D, gates * H, I)), ("R", (D, gates * H, H)),
                            ("B", (D, 2 * gates * H)))]
    n_states = 2 if op == "LSTM" else 1
    state_names = ["h0", "c0"][:n_states]
    names = ["x", "W", "R", "B", "lens" if lens else ""] + (state_names if states else [])
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    node = h.make_node(op, names, ["y", "hn", "cn"][:1 + n_states], hidden_size=H,
                       direction=direction, layout=layout, **attrs)
    x_shape = ["s", "b", I] if layout == 0 else ["b", "s", I]
    state_shape = [D, "b", H] if layout == 0 else ["b", D, H]
    inputs = [_vi("x", F, x_shape)] + ([_vi("lens", T.INT32, ["b"])] if lens else []) + \
        ([_vi(n, F, state_shape) for n in state_names] if states else [])
    return _model([node], inputs, [_vi(n, F, None) for n in ["y", "hn", "cn"][:1 + n_states]],
                  inits, opset=14)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction,layout,states,H", [
    ("forward", 0, True, 32), ("forward", 0, False, 32), ("reverse", 1, True, 32),
    ("bidirectional", 0, True, 32), ("bidirectional", 1, False, 32),
    ("bidirectional", 0, True, 256)])
def test_recurrence_kept_route_gives_the_general_paths_bits(op, direction, layout, states, H):
    """The compiled recurrences' route kept per input geometry (on one thread, or at H 256
    threads in lockstep): every shape fed, in turn and again, gives the bits of the general
    path (the same op given full sequence_lens, which checks everything anew each call) and
    onnxruntime's values; a session shared by threads gives each thread the sequential
    bits."""
    I = 24
    rng = np.random.default_rng(7)
    kept = ember.load(_recurrence(op, H, I, direction, layout, states, np.random.default_rng(1)))
    general = ember.load(_recurrence(op, H, I, direction, layout, states,
                                     np.random.default_rng(1), lens=True))
    # (onnxruntime runs no batch-first recurrence: layout 1 is compared with the general path)
    ref = _onnxruntime(_recurrence(op, H, I, direction, layout, states,
                                   np.random.default_rng(1))) if layout == 0 else None
    D = 2 if direction == "bidirectional" else 1
    feeds_list = []
    for seq, batch in [(1, 1), (5, 2), (1, 1), (3, 1), (5, 2)]:
        x = rng.standard_normal((seq, batch, I) if layout == 0 else (batch, seq, I))
        feeds = {"x": x.astype(np.float32)}
        if states:
            shape = (D, batch, H) if layout == 0 else (batch, D, H)
            feeds["h0"] = rng.standard_normal(shape).astype(np.float32)
            if op == "LSTM":
                feeds["c0"] = rng.standard_normal(shape).astype(np.float32)
        feeds_list.append(feeds)
        got = kept.run(feeds)
        want = general.run({**feeds, "lens": np.full(batch, seq, np.int32)})
        theirs = ref.run(None, feeds) if ref is not None else [None] * len(got)
        for name, value in zip(got, theirs):
            np.testing.assert_array_equal(got[name], want[name])
            if value is not None:
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)
    sequential = [kept.run(f) for f in feeds_list]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        shared = list(pool.map(kept.run, feeds_list * 4))
    for k, out in enumerate(shared):
        for name in out:
            np.testing.assert_array_equal(out[name], sequential[k % len(feeds_list)][name])


@pytest.mark.parametrize("alpha,beta,activation", [(1.0, 1.0, "Sigmoid"), (0.5, 2.0, "Relu"),
                                                   (1.0, 0.0, None)])
def test_gemm_kept_checks_match_onnxruntime_for_every_shape(alpha, beta, activation):
    """Gemm (fused with its activation) keeps its checks, B's view and C scaled while A keeps
    its shape and B and C are the same constants: each shape fed in turn and again gives
    onnxruntime's values, the bits of its first run, and a wrong A is still refused."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((4, 128)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "b")
    nodes = [h.make_node("Gemm", ["x", "w", "b"], ["g" if activation else "y"], transB=1,
                         alpha=alpha, beta=beta)]
    if activation:
        nodes.append(h.make_node(activation, ["g"], ["y"]))
    model = _model(nodes, [_vi("x", F, ["m", "k"])], [_vi("y", F, None)], [w, b], opset=13)
    sess, ref = ember.load(model), _onnxruntime(model)
    first = {}
    for m in (1, 3, 1, 2, 3):
        x = np.random.default_rng(m).standard_normal((m, 128)).astype(np.float32)
        got = sess.run({"x": x})["y"]
        np.testing.assert_allclose(got, ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got, first.setdefault(m, got))
    with pytest.raises(ember.errors.EmberError, match="inner dimensions differ"):
        sess.run({"x": np.ones((1, 64), np.float32)})
