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
