"""Control flow runs subgraphs planned once: If, Loop and Scan against onnxruntime, with bodies
that read outer-scope values (inputs, and constants the body's plan holds and folds), a
nested If inside a Loop, no plan made while running, and a session shared by threads giving
the same bits as sequential runs."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper

import ember
from ember.ir import Node
from ember.ops.registry import bind, lookup
from ember.runtime import executor

F = T.FLOAT


def _vi(name, dtype=F, shape=None):
    return h.make_tensor_value_info(name, dtype, shape)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(graph, opset=17, check=True) -> onnx.ModelProto:
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def _if_model() -> onnx.ModelProto:
    """y = If(c): then (x + w) reshaped to Shape(w) read inside the branch (shape arithmetic on
    an outer constant: folded by the branch's plan), else Squeeze(Unsqueeze(x * k))."""
    then = h.make_graph(
        [h.make_node("Add", ["x", "w"], ["sum"]),
         h.make_node("Shape", ["w"], ["w_shape"]),
         h.make_node("Constant", [], ["zero"], value=_ints("zero_v", [0])),
         h.make_node("Gather", ["w_shape", "zero"], ["rows"]),
         h.make_node("Constant", [], ["minus1"], value=_ints("m1_v", [-1])),
         h.make_node("Concat", ["rows", "minus1"], ["new_shape"], axis=0),
         h.make_node("Reshape", ["sum", "new_shape"], ["a"])],
        "then", [], [_vi("a", F, [2, 6])])
    other = h.make_graph(
        [h.make_node("Mul", ["x", "k"], ["prod"]),
         h.make_node("Unsqueeze", ["prod", "axes"], ["wide"]),
         h.make_node("Squeeze", ["wide", "axes"], ["b0"]),
         h.make_node("Reshape", ["b0", "flat"], ["b"])],
        "else", [], [_vi("b", F, [2, 6])])
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "if",
        [_vi("c", T.BOOL, []), _vi("x", F, [2, 3, 2])], [_vi("y", F, [2, 6])],
        initializer=[numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(2, 3, 2),
                                             "w"),
                     numpy_helper.from_array(np.array(0.5, np.float32), "k"),
                     _ints("axes", [0]), _ints("flat", [2, 6])])
    return _model(graph)


def _loop_model() -> onnx.ModelProto:
    """Loop of `n` iterations, carried s and a running count, stopping early once the sum of
    s passes `limit`; scan outputs: s after each iteration and the iteration number."""
    body = h.make_graph(
        [h.make_node("Add", ["s", "x"], ["s1"]),
         h.make_node("Mul", ["s1", "scale"], ["s_out"]),
         h.make_node("ReduceSum", ["s_out"], ["total"], keepdims=0),
         h.make_node("Less", ["total", "limit"], ["go"]),
         h.make_node("Add", ["count", "one"], ["count_out"]),
         h.make_node("Identity", ["s_out"], ["s_scan"]),
         h.make_node("Identity", ["i"], ["i_scan"])],
        "body", [_vi("i", T.INT64, []), _vi("cond", T.BOOL, []), _vi("s", F, [3]),
                 _vi("count", T.INT64, [])],
        [_vi("go", T.BOOL, []), _vi("s_out", F, [3]), _vi("count_out", T.INT64, []),
         _vi("s_scan", F, [3]), _vi("i_scan", T.INT64, [])])
    graph = h.make_graph(
        [h.make_node("Loop", ["n", "start", "s0", "c0"], ["s_end", "count_end", "ss", "iters"],
                     body=body)], "loop",
        [_vi("n", T.INT64, []), _vi("start", T.BOOL, []), _vi("s0", F, [3]),
         _vi("x", F, [3]), _vi("limit", F, [])],
        [_vi("s_end", F, [3]), _vi("count_end", T.INT64, []), _vi("ss", F, [None, 3]),
         _vi("iters", T.INT64, [None])],
        initializer=[numpy_helper.from_array(np.array(1.25, np.float32), "scale"),
                     _ints("c0", 0), _ints("one", 1)])
    return _model(graph)


def _scan_model() -> onnx.ModelProto:
    """Scan-9 over the rows of xs (forwards) and of ys (backwards): a running sum as state,
    and per step the state times an outer weight, stacked along axis 1."""
    body = h.make_graph(
        [h.make_node("Add", ["acc", "xt"], ["acc1"]),
         h.make_node("Sub", ["acc1", "yt"], ["acc_out"]),
         h.make_node("Mul", ["acc_out", "w"], ["out_t"])],
        "body", [_vi("acc", F, [4]), _vi("xt", F, [4]), _vi("yt", F, [4])],
        [_vi("acc_out", F, [4]), _vi("out_t", F, [4])])
    graph = h.make_graph(
        [h.make_node("Scan", ["acc0", "xs", "ys"], ["acc_end", "outs"], body=body,
                     num_scan_inputs=2, scan_input_directions=[0, 1], scan_output_axes=[1])],
        "scan", [_vi("acc0", F, [4]), _vi("xs", F, [5, 4]), _vi("ys", F, [5, 4])],
        [_vi("acc_end", F, [4]), _vi("outs", F, [4, 5])],
        initializer=[numpy_helper.from_array(np.linspace(-1, 1, 4).astype(np.float32), "w")])
    return _model(graph)


def _nested_model() -> onnx.ModelProto:
    """A Loop whose body holds an If on the iteration's parity: even iterations add the outer
    input x, odd ones multiply by an outer constant reshaped inside the branch; both
    branches read the body's carried value."""
    even = h.make_graph([h.make_node("Add", ["s", "x"], ["e"])], "even", [],
                        [_vi("e", F, [2, 2])])
    odd = h.make_graph(
        [h.make_node("Shape", ["s"], ["s_shape"]),
         h.make_node("Reshape", ["m", "s_shape"], ["m2"]),
         h.make_node("Mul", ["s", "m2"], ["o"])], "odd", [], [_vi("o", F, [2, 2])])
    body = h.make_graph(
        [h.make_node("Mod", ["i", "two"], ["parity"]),
         h.make_node("Equal", ["parity", "zero"], ["is_even"]),
         h.make_node("If", ["is_even"], ["s_next"], then_branch=even, else_branch=odd),
         h.make_node("Identity", ["cond"], ["cond_out"]),
         h.make_node("ReduceSum", ["s_next"], ["step_sum"], keepdims=0)],
        "body", [_vi("i", T.INT64, []), _vi("cond", T.BOOL, []), _vi("s", F, [2, 2])],
        [_vi("cond_out", T.BOOL, []), _vi("s_next", F, [2, 2]), _vi("step_sum", F, [])])
    graph = h.make_graph(
        [h.make_node("Loop", ["n", "", "s0"], ["s_end", "sums"], body=body)], "nested",
        [_vi("n", T.INT64, []), _vi("s0", F, [2, 2]), _vi("x", F, [2, 2])],
        [_vi("s_end", F, [2, 2]), _vi("sums", F, [None])],
        initializer=[numpy_helper.from_array(np.array([0.5, -1.0, 2.0, 0.25], np.float32), "m"),
                     _ints("two", 2), _ints("zero", 0)])
    return _model(graph)


def _check(model: onnx.ModelProto, feeds: dict, session=None) -> None:
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    got = (session or ember.load(model)).run(feeds)
    assert list(got) == [o.name for o in model.graph.output]
    for name, exp, act in zip(got, want, got.values()):
        assert act.dtype == exp.dtype and act.shape == exp.shape, name
        np.testing.assert_allclose(act, exp, rtol=1e-6, atol=1e-6, err_msg=name)


def _kernel_of(session, op_type: str):
    return next(s.kernel for s in session.plan.steps if s.node.op_type == op_type)


@pytest.mark.parametrize("simplify", [True, False])
def test_if_both_branches_read_outer_scope(simplify):
    model = _if_model()
    session = ember.load(model, simplify=simplify)
    x = np.random.default_rng(0).standard_normal((2, 3, 2)).astype(np.float32)
    for cond in (True, False, True):
        _check(model, {"c": np.array(cond), "x": x}, session)
    # the then-branch's shape arithmetic on the outer constant w was folded at plan time,
    # and the branch holds w itself: only x comes through the scope
    then = _kernel_of(session, "If").then_branch
    assert [s.node.op_type for s in then.steps] == ["Add", "Reshape"]
    assert then.outer_names == ["x"]


def test_loop_carried_state_and_scan_outputs():
    model = _loop_model()
    session = ember.load(model)
    x = np.array([0.5, 1.0, -0.25], np.float32)
    s0 = np.array([1.0, 2.0, 3.0], np.float32)
    for n, limit in ((6, 1e9), (6, 20.0), (0, 1e9)):  # all iterations, an early stop, none
        _check(model, {"n": np.array(n, np.int64), "start": np.array(True), "s0": s0, "x": x,
                       "limit": np.array(limit, np.float32)}, session)


def test_scan_forwards_and_backwards():
    model = _scan_model()
    rng = np.random.default_rng(1)
    _check(model, {"acc0": rng.standard_normal(4).astype(np.float32),
                   "xs": rng.standard_normal((5, 4)).astype(np.float32),
                   "ys": rng.standard_normal((5, 4)).astype(np.float32)})


def test_if_nested_in_loop():
    model = _nested_model()
    session = ember.load(model)
    rng = np.random.default_rng(2)
    for n in (1, 4, 7):
        _check(model, {"n": np.array(n, np.int64),
                       "s0": rng.standard_normal((2, 2)).astype(np.float32),
                       "x": rng.standard_normal((2, 2)).astype(np.float32)}, session)


def test_no_plan_is_made_while_running(monkeypatch):
    """Every subgraph is planned when the session is; runs only enter those plans."""
    sessions = [(ember.load(_nested_model()),
                 {"n": np.array(5, np.int64), "s0": np.ones((2, 2), np.float32),
                  "x": np.ones((2, 2), np.float32)}),
                (ember.load(_if_model()),
                 {"c": np.array(False), "x": np.ones((2, 3, 2), np.float32)})]
    made = []
    original = executor.Plan.__init__

    def counting(self, *args, **kwargs):
        made.append(args[0].name)
        original(self, *args, **kwargs)

    monkeypatch.setattr(executor.Plan, "__init__", counting)
    for session, feeds in sessions:
        for _ in range(3):
            session.run(feeds)
    assert made == []


def test_session_shared_by_threads_gives_sequential_bits():
    model = _nested_model()
    session = ember.load(model)
    rng = np.random.default_rng(3)
    feeds = [{"n": np.array(n, np.int64), "s0": rng.standard_normal((2, 2)).astype(np.float32),
              "x": rng.standard_normal((2, 2)).astype(np.float32)} for n in range(1, 9)]
    expected = [session.run(f) for f in feeds]
    wrong, errors = [], []

    def work(thread: int) -> None:
        try:
            for call in range(60):
                i = (thread + call) % len(feeds)
                for key, value in session.run(feeds[i]).items():
                    if value.tobytes() != expected[i][key].tobytes():
                        wrong.append((thread, call, key))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert not wrong, wrong[:5]


def test_failed_fold_is_reported_by_the_run():
    """Shape work on constants that cannot succeed is left to the run, which names the node."""
    then = h.make_graph([h.make_node("Reshape", ["w", "bad"], ["a"])], "then", [],
                        [_vi("a", F, [None, None])])
    other = h.make_graph([h.make_node("Identity", ["w"], ["b"])], "else", [],
                         [_vi("b", F, [6])])
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="choose")],
        "g", [_vi("c", T.BOOL, [])], [_vi("y", F, None)],
        initializer=[numpy_helper.from_array(np.ones(6, np.float32), "w"),
                     _ints("bad", [4, 4])])
    session = ember.load(_model(graph, check=False), simplify=False)  # invalid on purpose
    np.testing.assert_array_equal(session.run({"c": np.array(False)})["y"], np.ones(6))
    with pytest.raises(ember.errors.EmberError, match="Reshape"):
        session.run({"c": np.array(True)})


@pytest.mark.parametrize("op, param, cases, bad", [
    ("Reshape", [0, -1], [((2, 3, 4), (2, 12)), ((5, 3, 4), (5, 12)), ((2, 3, 4), (2, 12))],
     ()),
    ("Unsqueeze", [0, -1], [((3, 4), (1, 3, 4, 1)), ((6, 4), (1, 6, 4, 1)),
                            ((3, 4), (1, 3, 4, 1))], None),
    ("Squeeze", [0, 2], [((1, 3, 1, 4), (3, 4)), ((1, 7, 1, 2), (7, 2)),
                         ((1, 3, 1, 4), (3, 4))], (2, 2, 2))])
def test_view_ops_return_views_for_every_shape(op, param, cases, bad):
    """Reshape, Squeeze, Unsqueeze with a constant dims input remember the dims per input
    shape (a new shape gets its own), and always return a view of their input."""
    kernel = bind(Node(op, "", 17, ["x", "p"], ["y"]), lookup("", op, 17), {})
    kernel.constant_inputs = frozenset({1})
    p = np.array(param, np.int64)
    for shape, want in cases:
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        y = kernel.run(x, p)
        assert y.shape == want
        assert np.shares_memory(y, x)
        np.testing.assert_array_equal(y.reshape(-1), x.reshape(-1))
    if bad is not None:  # an input the dims do not fit is refused, not remembered
        for _ in range(2):
            with pytest.raises(ember.errors.EmberError):
                kernel.run(np.zeros(bad, np.float32), p)


@pytest.mark.parametrize("op, attrs, cases", [
    ("Unsqueeze", {"axes": [1]}, [((3, 4), (3, 1, 4)), ((5,), (5, 1))]),
    ("Squeeze", {"axes": [0]}, [((1, 3), (3,)), ((1, 2, 2), (2, 2))])])
def test_view_ops_with_attribute_dims(op, attrs, cases):
    """The opset-11 forms (dims as attributes) remember their dims per shape as well."""
    kernel = bind(Node(op, "", 11, ["x"], ["y"], attrs=dict(attrs)), lookup("", op, 11),
                  dict(attrs))
    for shape, want in cases * 2:
        x = np.ones(shape, np.float32)
        y = kernel.run(x)
        assert y.shape == want and np.shares_memory(y, x)


def test_top_level_graph_runs_as_imported():
    """Only subgraph plans fold: without the simplifier the top-level graph keeps its nodes."""
    graph = h.make_graph(
        [h.make_node("Shape", ["w"], ["s"]), h.make_node("Reshape", ["x", "s"], ["y"])], "g",
        [_vi("x", F, [6])], [_vi("y", F, [2, 3])],
        initializer=[numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")])
    session = ember.load(_model(graph), simplify=False)
    assert [s.node.op_type for s in session.plan.steps] == ["Shape", "Reshape"]
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x.reshape(2, 3))
