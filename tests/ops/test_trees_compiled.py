"""The compiled tree walk (ops/ml.py `_walk_trees`): random regressor forests with every
comparison mode, mixed modes and NaN rows routed by `missing_value_tracks_true`, against
onnxruntime, and leaf for leaf against the level-by-level numpy walk."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ember

ort = pytest.importorskip("onnxruntime")

MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]
FEATURES = 6


def _forest(rng, trees: int, depth: int, modes: list[str]) -> onnx.ModelProto:
    """Full binary trees of `depth` levels: interior nodes split a random feature at a
    random threshold (values on a grid, so that EQ / NEQ splits are met), leaves weigh 1 target."""
    attrs = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values",
                             "nodes_modes", "nodes_truenodeids", "nodes_falsenodeids",
                             "nodes_missing_value_tracks_true", "target_treeids", "target_nodeids",
                             "target_ids", "target_weights")}
    interior = 2 ** depth - 1
    for t in range(trees):
        for n in range(2 * interior + 1):
            leaf = n >= interior
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(n)
            attrs["nodes_featureids"].append(0 if leaf else int(rng.integers(FEATURES)))
            attrs["nodes_values"].append(0.0 if leaf else float(rng.integers(-4, 5)) / 2)
            attrs["nodes_modes"].append("LEAF" if leaf else modes[int(rng.integers(len(modes)))])
            attrs["nodes_truenodeids"].append(0 if leaf else 2 * n + 1)
            attrs["nodes_falsenodeids"].append(0 if leaf else 2 * n + 2)
            attrs["nodes_missing_value_tracks_true"].append(int(rng.integers(2)))
            if leaf:
                attrs["target_treeids"].append(t)
                attrs["target_nodeids"].append(n)
                attrs["target_ids"].append(0)
                attrs["target_weights"].append(float(rng.standard_normal()))
    node = helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain="ai.onnx.ml",
                            n_targets=1, aggregate_function="SUM", **attrs)
    graph = helper.make_graph([node], "forest",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [None, FEATURES])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.onnx.ml", 3)])


def _rows(rng, n: int) -> np.ndarray:
    x = (rng.integers(-5, 6, size=(n, FEATURES)) / 2).astype(np.float32)  # on the split grid
    x[rng.random(x.shape) < 0.1] = np.nan
    return x


@pytest.mark.parametrize("modes", [[m] for m in MODES] + [MODES], ids=MODES + ["mixed"])
def test_compiled_walk_matches_onnxruntime_and_the_numpy_walk(modes):
    rng = np.random.default_rng(len(modes) * 7 + MODES.index(modes[0]))
    model = _forest(rng, trees=12, depth=5, modes=modes)
    x = _rows(rng, 257)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    session = ember.load(model, "cpu")
    got = session.run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    forest = next(step.kernel.forest for step in session.plan.steps
                  if hasattr(step.kernel, "forest"))
    if not forest.compiled_walk(x.dtype):
        pytest.skip("numba is not installed: only the numpy walk runs")
    assert [k for _, _, k, _ in session.kernels] == ["cpu.compiled"]
    np.testing.assert_array_equal(forest.leaves(x), _numpy_leaves(forest, x))


def _numpy_leaves(forest, x):
    """The level-by-level walk: `leaves` with the compiled walk switched off."""
    forest.compiled_walk = lambda dtype: False
    try:
        return forest.leaves(x)
    finally:
        del forest.compiled_walk


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE"])
def test_compiled_sums_give_the_numpy_aggregations_bits(dtype, aggregate):
    """The walk that adds each leaf's weights as it goes (`_walk_and_sum`): the same sums, in
    the same order and dtype, as the numpy aggregation over the numpy walk's leaves."""
    rng = np.random.default_rng(11)
    model = _forest(rng, trees=40, depth=6, modes=MODES)
    session = ember.load(model, "cpu")
    forest = next(step.kernel.forest for step in session.plan.steps
                  if hasattr(step.kernel, "forest"))
    x = _rows(rng, 301).astype(dtype)
    if not forest.compiled_walk(x.dtype):
        pytest.skip("numba is not installed: only the numpy walk runs")
    got = forest.scores(x, aggregate, dtype)
    forest.compiled_walk = lambda dtype: False
    try:
        want = forest.scores(x, aggregate, dtype)
    finally:
        del forest.compiled_walk
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the paired walk (`_predict`)
# Forests of LEQ / LT / GTE / GT nodes run as one compiled call: the walk, the sums and the
# op's epilogue. Against the numpy walk and epilogue bit for bit (EMBER_NUMBA=0's path), and
# against onnxruntime.

PAIRED = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT"]
EDGES = [-np.inf, np.inf, np.nan, 0.0, -1.0, 1.5]  # thresholds at the comparisons' edges


def _numpy_run(session, feeds):
    """`session.run` with every tree kernel on its numpy walk and epilogue."""
    ops = [step.kernel for step in session.plan.steps if hasattr(step.kernel, "forest")]
    for op in ops:
        op.forest.compiled_walk = lambda dtype: False
        saved, op.fused = op.fused, {}
    try:
        return session.run(feeds)
    finally:
        for op in ops:
            del op.forest.compiled_walk
            op.fused = saved


def _tree_attrs(rng, trees, depth, modes, prefix, n_targets, edges=False):
    """Full binary trees (as `_forest`), each leaf weighing one or every target."""
    attrs = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids",
                             "nodes_values", "nodes_modes", "nodes_truenodeids",
                             "nodes_falsenodeids", "nodes_missing_value_tracks_true",
                             f"{prefix}_treeids", f"{prefix}_nodeids", f"{prefix}_ids",
                             f"{prefix}_weights")}
    interior = 2 ** depth - 1
    for t in range(trees):
        every = bool(rng.integers(2))
        for n in range(2 * interior + 1):
            leaf = n >= interior
            value = float(rng.integers(-4, 5)) / 2
            if edges and rng.random() < 0.3:
                value = float(rng.choice(EDGES))
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(n)
            attrs["nodes_featureids"].append(0 if leaf else int(rng.integers(FEATURES)))
            attrs["nodes_values"].append(0.0 if leaf else value)
            attrs["nodes_modes"].append("LEAF" if leaf else modes[int(rng.integers(len(modes)))])
            attrs["nodes_truenodeids"].append(0 if leaf else 2 * n + 1)
            attrs["nodes_falsenodeids"].append(0 if leaf else 2 * n + 2)
            attrs["nodes_missing_value_tracks_true"].append(int(rng.integers(2)))
            if leaf:
                for c in (range(n_targets) if every else [t % n_targets]):
                    attrs[f"{prefix}_treeids"].append(t)
                    attrs[f"{prefix}_nodeids"].append(n)
                    attrs[f"{prefix}_ids"].append(c)
                    attrs[f"{prefix}_weights"].append(float(rng.standard_normal()))
    return attrs


def _model(node, inputs, outputs, ml_opset=3):
    graph = helper.make_graph([node], "forest", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.onnx.ml", ml_opset)])


def _edge_rows(rng, n, dtype):
    x = _rows(rng, n).astype(dtype)
    x[rng.random(x.shape) < 0.05] = np.inf
    x[rng.random(x.shape) < 0.05] = -np.inf
    return x


def _paired_kernel(session):
    return [why for _, _, kernel, why in session.kernels if "eight trees" in why]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("aggregate,base", [("SUM", None), ("AVERAGE", [0.25]),
                                            ("SUM", [0.5, -1.0, 2.0])])
def test_paired_regressor_gives_the_numpy_bits_at_the_edges(dtype, aggregate, base):
    """Thresholds at +-inf and NaN, rows with +-inf and NaN, every mode, both NaN routes."""
    rng = np.random.default_rng(5)
    attrs = _tree_attrs(rng, trees=19, depth=4, modes=PAIRED, prefix="target", n_targets=3,
                        edges=True)
    extra = {} if base is None else {"base_values": base}
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    node = helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain="ai.onnx.ml",
                            n_targets=3, aggregate_function=aggregate, **attrs, **extra)
    model = _model(node, [helper.make_tensor_value_info("x", elem, [None, FEATURES])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])])
    session = ember.load(model, "cpu")
    x = _edge_rows(rng, 203, dtype)
    got = session.run({"x": x})["y"]
    np.testing.assert_array_equal(got, _numpy_run(session, {"x": x})["y"])
    if _compiled_available(session):
        assert _paired_kernel(session)


def _compiled_available(session):
    forest = next(step.kernel.forest for step in session.plan.steps
                  if hasattr(step.kernel, "forest"))
    return forest.compiled_walk(np.dtype(np.float32))


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"])
@pytest.mark.parametrize("classes", [2, 3, 11])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_paired_classifier_matches_onnxruntime_and_the_numpy_epilogue(post, classes, dtype):
    """Labels and probabilities: multi-class (with base values) and binary (one column of
    scores), int labels. Against onnxruntime where the numpy epilogue agrees with it (not
    PROBIT, nor this binary layout with negative weights: ember's own conventions)."""
    rng = np.random.default_rng(classes * 13 + len(post))
    binary = classes == 2
    attrs = _tree_attrs(rng, trees=21, depth=4, modes=PAIRED, prefix="class",
                        n_targets=1 if binary else classes)
    if binary:
        attrs["class_ids"] = [1] * len(attrs["class_ids"])
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "scores"],
                            domain="ai.onnx.ml", post_transform=post,
                            classlabels_int64s=list(range(10, 10 + classes)),
                            base_values=[0.1] if binary else list(np.linspace(-1, 1, classes)),
                            **attrs)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    model = _model(node, [helper.make_tensor_value_info("x", elem, [None, FEATURES])],
                   [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                    helper.make_tensor_value_info("scores", TensorProto.FLOAT,
                                                  [None, classes])])
    session = ember.load(model, "cpu")
    x = _rows(rng, 97).astype(dtype)
    got = session.run({"x": x})
    want = _numpy_run(session, {"x": x})
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_array_equal(got["scores"], want["scores"])
    if dtype == np.float32 and not binary and post != "PROBIT":
        ref = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
        np.testing.assert_array_equal(got["label"], ref[0])
        np.testing.assert_allclose(got["scores"], ref[1], rtol=1e-5, atol=1e-5)
    if _compiled_available(session) and post != "PROBIT":
        assert _paired_kernel(session)


def test_paired_classifier_string_labels_and_one_row():
    rng = np.random.default_rng(3)
    attrs = _tree_attrs(rng, trees=9, depth=3, modes=["BRANCH_LEQ"], prefix="class",
                        n_targets=3)
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "scores"],
                            domain="ai.onnx.ml", post_transform="SOFTMAX",
                            classlabels_strings=["a", "b", "c"], **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [None, FEATURES])],
                   [helper.make_tensor_value_info("label", TensorProto.STRING, [None]),
                    helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3])])
    session = ember.load(model, "cpu")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in (_rows(rng, 1), _rows(rng, 40)):
        got = session.run({"x": x})
        want = ref.run(None, {"x": x})
        assert list(got["label"]) == list(want[0])
        np.testing.assert_allclose(got["scores"], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_paired_tree_ensemble_v5_gives_the_numpy_bits(dtype, post):
    """TreeEnsemble (ai.onnx.ml 5): leaves as their own nodes, the output in the rows'
    dtype, AVERAGE."""
    rng = np.random.default_rng(9)
    modes, splits, feats, tids, fids, tleaf, fleaf, miss = [], [], [], [], [], [], [], []
    leaf_t, leaf_w, roots = [], [], []
    codes = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3}
    for t in range(13):  # full trees of depth 3: 7 interior nodes, 8 leaves each
        base_node, base_leaf = len(modes), len(leaf_w)
        roots.append(base_node)
        for n in range(7):
            modes.append(codes[PAIRED[int(rng.integers(4))]])
            splits.append(float(rng.integers(-4, 5)) / 2)
            feats.append(int(rng.integers(FEATURES)))
            miss.append(int(rng.integers(2)))
            kids = (2 * n + 1, 2 * n + 2)
            is_leaf = kids[0] >= 7
            tids.append(base_leaf + kids[0] - 7 if is_leaf else base_node + kids[0])
            fids.append(base_leaf + kids[1] - 7 if is_leaf else base_node + kids[1])
            tleaf.append(int(is_leaf))
            fleaf.append(int(is_leaf))
        for _ in range(8):
            leaf_t.append(int(rng.integers(2)))
            leaf_w.append(float(rng.standard_normal()))
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    node = helper.make_node(
        "TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml", n_targets=2, aggregate_function=0,
        post_transform={"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2}[post], tree_roots=roots,
        nodes_modes=helper.make_tensor("modes", TensorProto.UINT8, [len(modes)], modes),
        nodes_splits=helper.make_tensor("splits", elem, [len(splits)], splits),
        nodes_featureids=feats, nodes_truenodeids=tids, nodes_falsenodeids=fids,
        nodes_trueleafs=tleaf, nodes_falseleafs=fleaf, nodes_missing_value_tracks_true=miss,
        leaf_targetids=leaf_t,
        leaf_weights=helper.make_tensor("w", elem, [len(leaf_w)], leaf_w))
    model = _model(node, [helper.make_tensor_value_info("x", elem, [None, FEATURES])],
                   [helper.make_tensor_value_info("y", elem, [None, 2])], ml_opset=5)
    session = ember.load(model, "cpu")
    x = _rows(rng, 77).astype(dtype)
    got = session.run({"x": x})["y"]
    assert got.dtype == dtype
    want = _numpy_run(session, {"x": x})["y"]
    if dtype == np.float64 and post != "NONE":  # the C library's exp against numpy's: an ulp
        np.testing.assert_allclose(got, want, rtol=4e-16, atol=0)
    else:
        np.testing.assert_array_equal(got, want)
    if _compiled_available(session):
        assert _paired_kernel(session)


def test_shared_subtrees_keep_the_general_walk():
    """A node reached from two parents (here: both branches of a root) is no tree for the
    paired layout: the walk of `_walk_and_sum` serves, with the same results."""
    attrs = dict(nodes_treeids=[0, 0], nodes_nodeids=[0, 1], nodes_featureids=[0, 0],
                 nodes_values=[0.5, 0.0], nodes_modes=["BRANCH_LEQ", "LEAF"],
                 nodes_truenodeids=[1, 0], nodes_falsenodeids=[1, 0],
                 target_treeids=[0], target_nodeids=[1], target_ids=[0], target_weights=[2.0])
    node = helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain="ai.onnx.ml",
                            n_targets=1, **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])])
    session = ember.load(model, "cpu")
    np.testing.assert_array_equal(session.run({"x": np.ones((3, 1), np.float32)})["y"],
                                  np.full((3, 1), 2.0, np.float32))
    assert not _paired_kernel(session)


def test_paired_rows_split_among_threads_give_the_same_bits(monkeypatch):
    """Pieces of rows (split_rows, forced here) walk their own pairs of rows: the same
    outputs as one piece."""
    from ember.ops.cpu import tuning
    rng = np.random.default_rng(21)
    attrs = _tree_attrs(rng, trees=33, depth=5, modes=PAIRED, prefix="class", n_targets=4)
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "scores"],
                            domain="ai.onnx.ml", post_transform="SOFTMAX",
                            classlabels_int64s=[1, 2, 3, 4], **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [None, FEATURES])],
                   [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                    helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 4])])
    x = _rows(rng, 301)
    whole = ember.load(model, "cpu").run({"x": x})
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)  # as many pieces as there are threads
    split = ember.load(model, "cpu").run({"x": x})
    np.testing.assert_array_equal(split["label"], whole["label"])
    np.testing.assert_array_equal(split["scores"], whole["scores"])
