"""Traditional ML ops of the ai.onnx.ml domain (feature extraction, encoders, linear models, trees)."""
from __future__ import annotations

import math
import re

import numpy as np

from ember.ops.cpu import compiled as _compiled, tuning
from ember.ops.registry import Lowering, OpImpl, register

ML = "ai.onnx.ml"


# ---------------------------------------------------------------- shared post-transforms

def _erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function: Giles' approximation refined by two Newton steps."""
    y = np.clip(np.asarray(y, dtype=np.float64), -1 + 1e-15, 1 - 1e-15)
    w = -np.log((1.0 - y) * (1.0 + y))
    small = w < 5.0
    ws, wl = w - 2.5, np.sqrt(np.maximum(w, 5.0)) - 3.0
    ps = np.full_like(w, 2.81022636e-08)
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        ps = c + ps * ws
    pl = np.full_like(w, -0.000200214257)
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        pl = c + pl * wl
    x = np.where(small, ps, pl) * y
    erf = np.vectorize(math.erf, otypes=[np.float64])
    for _ in range(2):
        x = x - (erf(x) - y) / (2.0 / math.sqrt(math.pi) * np.exp(-x * x))
    return x


def post_transform(scores: np.ndarray, how: str) -> np.ndarray:
    """NONE / SOFTMAX / LOGISTIC / SOFTMAX_ZERO / PROBIT over the last axis."""
    if how in ("NONE", None):
        return scores
    s = scores.astype(np.float64)
    if how == "LOGISTIC":
        out = 1.0 / (1.0 + np.exp(-s))
    elif how == "SOFTMAX":
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        out = e / e.sum(axis=-1, keepdims=True)
    elif how == "SOFTMAX_ZERO":
        nz = s != 0
        m = np.where(nz, s, -np.inf).max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.where(nz, np.exp(s - m), 0.0)
        tot = e.sum(axis=-1, keepdims=True)
        out = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    elif how == "PROBIT":
        out = math.sqrt(2.0) * _erfinv(2.0 * s - 1.0)
    else:
        raise ValueError(f"unknown post_transform {how!r}")
    return out.astype(scores.dtype)


_POST_CODES = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO", 4: "PROBIT"}


def _as_2d(x: np.ndarray) -> np.ndarray:
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)


def _float_out(x: np.ndarray) -> np.dtype:
    return x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float32)


# ---------------------------------------------------------------- simple transforms

@register("ArrayFeatureExtractor", versions=[1], domain=ML)
class ArrayFeatureExtractor(OpImpl):
    def run(self, x, indices):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = x.shape[-1]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise self.fail(f"index out of range for last dimension {n}")
        out = np.take(x, idx, axis=-1)
        return out.reshape(1, -1) if x.ndim == 1 else out


@register("Binarizer", versions=[1], domain=ML)
class Binarizer(OpImpl):
    def run(self, x):
        return (x > self.threshold).astype(x.dtype)


@register("Scaler", versions=[1], domain=ML)
class Scaler(OpImpl):
    def run(self, x):
        offset = np.asarray(self.offset if self.offset is not None else [0.0], dtype=np.float32)
        scale = np.asarray(self.scale if self.scale is not None else [1.0], dtype=np.float32)
        return ((x.astype(np.float32) - offset) * scale).astype(np.float32)


@register("Normalizer", versions=[1], domain=ML)
class Normalizer(OpImpl):
    def setup(self):
        if self.norm not in ("MAX", "L1", "L2"):
            raise self.fail(f"unknown norm {self.norm!r}")

    def run(self, x):
        x2 = _as_2d(x).astype(np.float32)
        if self.norm == "MAX":
            d = x2.max(axis=1, keepdims=True)
        elif self.norm == "L1":
            d = np.abs(x2).sum(axis=1, keepdims=True)
        else:
            d = np.sqrt((x2 * x2).sum(axis=1, keepdims=True))
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(d != 0, x2 / np.where(d != 0, d, 1), x2)
        return out.astype(np.float32).reshape(x.shape if x.ndim > 1 else (1, -1))


@register("Imputer", versions=[1], domain=ML)
class Imputer(OpImpl):
    def run(self, x):
        if x.dtype.kind == "f":
            values = np.asarray(self.imputed_value_floats or [], dtype=x.dtype)
            target = self.replaced_value_float
            mask = np.isnan(x) if np.isnan(target) else (x == target)
        else:
            values = np.asarray(self.imputed_value_int64s or [], dtype=x.dtype)
            mask = x == self.replaced_value_int64
        if values.size == 0:
            raise self.fail("no imputed values given")
        x2 = _as_2d(x)
        vals = np.broadcast_to(values if values.size > 1 else values[:1], x2.shape[1:])
        out = np.where(mask.reshape(x2.shape), vals, x2)
        return out.reshape(x.shape)


@register("OneHotEncoder", versions=[1], domain=ML)
class OneHotEncoder(OpImpl):
    def setup(self):
        cats = self.cats_strings if self.cats_strings is not None else self.cats_int64s
        if cats is None:
            raise self.fail("one of cats_strings, cats_int64s is required")
        self.index = {c: i for i, c in enumerate(cats)}
        self.strings = self.cats_strings is not None

    def run(self, x):
        flat = x.reshape(-1)
        keys = [str(v) for v in flat] if self.strings else [int(v) for v in flat]
        pos = np.array([self.index.get(k, -1) for k in keys], dtype=np.int64)
        if not self.zeros and (pos < 0).any():
            raise self.fail("input holds a category that is not in the list")
        out = np.zeros((flat.size, len(self.index)), dtype=np.float32)
        hit = pos >= 0
        out[np.nonzero(hit)[0], pos[hit]] = 1.0
        return out.reshape(x.shape + (len(self.index),))


# ---------------------------------------------------------------- LabelEncoder

class _LabelEncoderBase(OpImpl):
    def _build(self, keys, values, default, out_dtype):
        if keys is None or values is None:
            raise self.fail("keys and values must both be given")
        if len(keys) != len(values):
            raise self.fail(f"{len(keys)} keys but {len(values)} values")
        self.out_dtype = np.dtype(out_dtype)
        self.default = default
        self.nan_value = None
        self.table = {}
        for k, v in zip(keys, values):
            if isinstance(k, float) and math.isnan(k):
                self.nan_value = v
            else:
                self.table[k] = v

    def run(self, x):
        flat = x.reshape(-1)
        if flat.dtype == object:
            keys = [str(v) for v in flat]
        elif flat.dtype.kind == "f":
            keys = flat.tolist()
        else:
            keys = [int(v) for v in flat]
        get, default, nan_value = self.table.get, self.default, self.nan_value
        out = []
        for k in keys:
            if nan_value is not None and isinstance(k, float) and k != k:
                out.append(nan_value)
            else:
                out.append(get(k, default))
        if self.out_dtype == object:
            arr = np.empty(len(out), dtype=object)
            arr[:] = out
        else:
            arr = np.array(out, dtype=self.out_dtype)
        return arr.reshape(x.shape)


@register("LabelEncoder", versions=[1], domain=ML)
class LabelEncoder1(_LabelEncoderBase):
    """v1: string <-> int64 by position in classes_strings."""

    def setup(self):
        classes = list(self.classes_strings or [])
        self.s2i = {c: i for i, c in enumerate(classes)}
        self.classes = classes

    def run(self, x):
        flat = x.reshape(-1)
        if x.dtype == object:
            return np.array([self.s2i.get(str(s), self.default_int64) for s in flat],
                            dtype=np.int64).reshape(x.shape)
        n = len(self.classes)
        out = np.empty(flat.size, dtype=object)
        out[:] = [self.classes[i] if 0 <= i < n else self.default_string for i in flat.tolist()]
        return out.reshape(x.shape)


def _tensor_list(t):
    arr = np.asarray(t).reshape(-1)
    return [str(v) for v in arr] if arr.dtype == object else arr.tolist()


@register("LabelEncoder", versions=[2, 4], domain=ML)
class LabelEncoder2(_LabelEncoderBase):
    def setup(self):
        keys = None
        for name in ("keys_strings", "keys_int64s", "keys_floats", "keys_tensor"):
            v = getattr(self, name, None)
            if v is not None:
                if keys is not None:
                    raise self.fail("only one keys_* attribute may be set")
                keys = _tensor_list(v) if name == "keys_tensor" else list(v)
        values, dtype, default = None, None, None
        for name, dt, dname in (("values_strings", object, "default_string"),
                                ("values_int64s", np.int64, "default_int64"),
                                ("values_floats", np.float32, "default_float")):
            v = getattr(self, name, None)
            if v is not None:
                if values is not None:
                    raise self.fail("only one values_* attribute may be set")
                values, dtype, default = list(v), dt, getattr(self, dname)
        vt = getattr(self, "values_tensor", None)
        if vt is not None:
            if values is not None:
                raise self.fail("only one values_* attribute may be set")
            vt = np.asarray(vt)
            values, dtype = _tensor_list(vt), vt.dtype
            dt_default = getattr(self, "default_tensor", None)
            if dt_default is not None:
                default = _tensor_list(dt_default)[0]
            elif vt.dtype == object:
                default = "_Unused"
            elif vt.dtype.kind in "iu":
                default = -1
            else:
                default = -0.0
        self._build(keys, values, default, dtype)


# ---------------------------------------------------------------- linear models

@register("LinearRegressor", versions=[1], domain=ML)
class LinearRegressor(OpImpl):
    def setup(self):
        self.coef = np.asarray(self.coefficients or [], dtype=np.float32)
        self.icpt = np.asarray(self.intercepts or [0.0] * self.targets, dtype=np.float32)

    def run(self, x):
        x2 = _as_2d(x).astype(np.float32)
        w = self.coef.reshape(self.targets, -1)
        y = x2 @ w.T + self.icpt
        return post_transform(y, self.post_transform).astype(np.float32)


@register("LinearClassifier", versions=[1], domain=ML)
class LinearClassifier(OpImpl):
    def setup(self):
        self.labels = self.classlabels_strings if self.classlabels_strings is not None \
            else self.classlabels_ints
        if self.labels is None:
            raise self.fail("class labels are required")
        coef = np.asarray(self.coefficients, dtype=np.float32)
        self.n_cls = len(self.intercepts) if self.intercepts else len(self.labels)
        self.w = coef.reshape(self.n_cls, -1)
        self.b = np.asarray(self.intercepts or [0.0] * self.n_cls, dtype=np.float32)

    def run(self, x):
        x2 = _as_2d(x).astype(np.float32)
        scores = x2 @ self.w.T + self.b
        labels = self.labels
        if self.n_cls == 1 and len(labels) == 2:  # binary: one score for the positive class
            # (onnxruntime's layout: [1 - p, p], p the transformed score for LOGISTIC/PROBIT
            # and the raw score otherwise; the positive class wins when the raw score is > 0)
            s = scores[:, 0]
            p = post_transform(s, self.post_transform) \
                if self.post_transform in ("LOGISTIC", "PROBIT") else s
            scores = np.stack([1 - p, p], axis=1)
            idx = (s > 0).astype(np.int64)
        else:
            scores = post_transform(scores, self.post_transform)
            idx = np.argmax(scores, axis=1)
        return _labels(labels, idx), scores.astype(np.float32)


def _labels(labels, idx: np.ndarray) -> np.ndarray:
    if labels and isinstance(labels[0], str):
        out = np.empty(idx.size, dtype=object)
        out[:] = [labels[i] for i in idx]
        return out
    return np.asarray(labels, dtype=np.int64)[idx]


# ---------------------------------------------------------------- tree ensembles

def _tree_lowering(op: OpImpl, dtype: np.dtype | None) -> Lowering:
    """The tree op's kernel for rows of `dtype` (None: not known yet), its `_Predictor` made
    now where the paired walk serves."""
    if dtype is not None and _fused(op, np.dtype(dtype)) is not None:
        return Lowering("cpu.compiled", "each row down eight trees at a time, branch-free, with "
                        "the sums, post-transform and labels in the same compiled call, rows "
                        "split among the threads")
    if dtype is not None and op.forest.compiled_walk(dtype):
        return Lowering("cpu.compiled", "each row down each tree in one compiled walk, rows "
                        "split among the threads")
    return Lowering("numpy", "the trees walked a level at a time for all rows at once")


@_compiled.kernel_math
def _leaf(x, r, cur, feature, threshold, mode, true_step, false_step, missing_true,
          is_leaf):  # pragma: no cover - compiled
    """The leaf row r of x reaches from node `cur`: the comparison of each node's mode (a NaN
    takes the true branch where the node says so, as it does in `_Forest.leaves`); -1 where
    the walk outlasts the node count (a cyclic tree)."""
    steps = 0
    while not is_leaf[cur]:
        v = x[r, feature[cur]]
        th = threshold[cur]
        m = mode[cur]
        if m == 0:
            cond = v <= th
        elif m == 1:
            cond = v < th
        elif m == 2:
            cond = v >= th
        elif m == 3:
            cond = v > th
        elif m == 4:
            cond = v == th
        else:
            cond = v != th
        if v != v and missing_true[cur]:
            cond = True
        cur = true_step[cur] if cond else false_step[cur]
        steps += 1
        if steps > mode.shape[0]:
            return -1
    return cur


def _walk_trees(x, feature, threshold, mode, true_step, false_step, missing_true, is_leaf,
                roots, out, cyclic, row0, row1):  # pragma: no cover - compiled
    """out[r, t] = the leaf row r reaches in tree t (`_leaf`), for rows [row0, row1);
    cyclic[0] = 1 where a walk outlasts the node count."""
    for r in range(row0, row1):
        for t in range(roots.shape[0]):
            leaf = _leaf(x, r, roots[t], feature, threshold, mode, true_step, false_step,
                         missing_true, is_leaf)
            if leaf < 0:
                cyclic[0] = 1
                return
            out[r, t] = leaf


def _walk_and_sum(x, feature, threshold, mode, true_step, false_step, missing_true, is_leaf,
                  roots, c_start, c_count, c_target, c_weight, out, cyclic, row0,
                  row1):  # pragma: no cover - compiled
    """out[r] += each leaf's weights, for the leaf row r reaches in each tree in turn, rows
    [row0, row1) (out zeroed, in the weights' dtype): `_walk_trees` and the SUM of
    `_Forest.scores` in one loop, the same additions in the same order (tree by tree)."""
    for r in range(row0, row1):
        for t in range(roots.shape[0]):
            leaf = _leaf(x, r, roots[t], feature, threshold, mode, true_step, false_step,
                         missing_true, is_leaf)
            if leaf < 0:
                cyclic[0] = 1
                return
            for k in range(c_start[leaf], c_start[leaf] + c_count[leaf]):
                out[r, c_target[k]] += c_weight[k]


# The paired walk: each tree's nodes renumbered so that a node's two children sit side by
# side and every comparison reads "goes to the first iff value <= threshold" (`_PairedWalk`),
# so a step is two loads, a compare and an add, with no branch to mispredict; eight trees
# are walked at once, their chains of loads overlapping (a third faster than four, on the
# zoo's forests), each group for as many steps as its deepest tree (a leaf steps to itself;
# trees of like depths are grouped together).
_GROUP = 8
_G_TREES, _G_STEPS = _GROUP, 2 * _GROUP  # groups[g]: 8 roots, their 8 trees, the steps
# head[...] of `_predict`, the epilogue's switches
_H_POST, _H_BINARY, _H_PROBABILITY, _H_TARGETS = range(4)
# consts[...] of `_predict`, in the sums' dtype
_C_DIVISOR, _C_CUT, _C_ONE = range(3)
_FUSED_POST = {"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2, "SOFTMAX_ZERO": 3}  # (PROBIT: numpy)
_SUM_COLUMNS = 128  # softmax rows summed as numpy sums them (`_numpy_sum`) up to this width


def _predict(x, nodes, thresholds, groups, windows, weight, base, head, consts, labels,
             label_out, out, row0, row1):  # pragma: no cover - compiled
    """Rows [row0, row1) of a tree op, whole: each row's leaf in each tree by the paired
    walk, its leaves' weights summed in the weights' dtype, each target's in tree order (the
    bits of `_walk_and_sum`; the +0.0s of `_PairedWalk._windows` change none), then
    `_finish_row`. Node k is nodes[4k:4k + 4] (`_PairedWalk`), its threshold
    thresholds[4k + 2]; the walk holds 4k."""
    n_feat = x.shape[1]
    rows = np.empty((2, 2 * n_feat + 1), x.dtype)  # 0, then each value and its negation
    leaves = np.empty((2, _GROUP * groups.shape[0]), np.int64)  # each tree's (padding last)
    sums = np.empty(head[_H_TARGETS], weight.dtype)
    spare = np.empty(out.shape[1], np.float64)
    for r0 in range(row0, row1, 2):
        n = min(2, row1 - r0)  # two rows at once where there are: twice the loads in flight
        for k in range(n):
            rows[k, 0] = 0
            for j in range(n_feat):
                rows[k, 1 + 2 * j] = x[r0 + k, j]
                rows[k, 2 + 2 * j] = -x[r0 + k, j]
        if n == 2:
            _walk_two(nodes, thresholds, groups, rows[0], rows[1], leaves[0], leaves[1])
        else:
            _walk_one(nodes, thresholds, groups, rows[0], leaves[0])
        for k in range(n):
            sums[:] = 0
            for t in range(leaves.shape[1]):
                at, first = nodes[leaves[k, t] + 3], windows[t, 0]
                for j in range(windows[t, 1]):
                    sums[first + j] += weight[at + j]
            _finish_row(sums, r0 + k, base, head, consts, labels, label_out, out, spare)


@_compiled.kernel_math
def _step(nodes, thresholds, row, a):  # pragma: no cover - compiled
    """From node offset a one level down for `row`: its first child where the row's entry
    is <= the threshold, else the second (a leaf stays)."""
    return nodes[a + 1] + (0 if row[nodes[a]] <= thresholds[a + 2] else 4)


@_compiled.kernel_math
def _walk_one(nodes, thresholds, groups, row, leaves):  # pragma: no cover - compiled
    """leaves[tree] = the leaf `row` reaches in each tree, eight trees at a time."""
    for g in range(groups.shape[0]):
        a, b, c, d = groups[g, 0], groups[g, 1], groups[g, 2], groups[g, 3]
        e, f, h, i = groups[g, 4], groups[g, 5], groups[g, 6], groups[g, 7]
        for _ in range(groups[g, _G_STEPS]):
            a = _step(nodes, thresholds, row, a)
            b = _step(nodes, thresholds, row, b)
            c = _step(nodes, thresholds, row, c)
            d = _step(nodes, thresholds, row, d)
            e = _step(nodes, thresholds, row, e)
            f = _step(nodes, thresholds, row, f)
            h = _step(nodes, thresholds, row, h)
            i = _step(nodes, thresholds, row, i)
        _put_leaves(groups, g, leaves, a, b, c, d, e, f, h, i)


@_compiled.kernel_math
def _walk_two(nodes, thresholds, groups, row, row2, leaves,
              leaves2):  # pragma: no cover - compiled
    """`_walk_one` for two rows at once: sixteen chains of loads in flight, not eight."""
    for g in range(groups.shape[0]):
        a, b, c, d = groups[g, 0], groups[g, 1], groups[g, 2], groups[g, 3]
        e, f, h, i = groups[g, 4], groups[g, 5], groups[g, 6], groups[g, 7]
        a2, b2, c2, d2, e2, f2, h2, i2 = a, b, c, d, e, f, h, i
        for _ in range(groups[g, _G_STEPS]):
            a = _step(nodes, thresholds, row, a)
            b = _step(nodes, thresholds, row, b)
            c = _step(nodes, thresholds, row, c)
            d = _step(nodes, thresholds, row, d)
            e = _step(nodes, thresholds, row, e)
            f = _step(nodes, thresholds, row, f)
            h = _step(nodes, thresholds, row, h)
            i = _step(nodes, thresholds, row, i)
            a2 = _step(nodes, thresholds, row2, a2)
            b2 = _step(nodes, thresholds, row2, b2)
            c2 = _step(nodes, thresholds, row2, c2)
            d2 = _step(nodes, thresholds, row2, d2)
            e2 = _step(nodes, thresholds, row2, e2)
            f2 = _step(nodes, thresholds, row2, f2)
            h2 = _step(nodes, thresholds, row2, h2)
            i2 = _step(nodes, thresholds, row2, i2)
        _put_leaves(groups, g, leaves, a, b, c, d, e, f, h, i)
        _put_leaves(groups, g, leaves2, a2, b2, c2, d2, e2, f2, h2, i2)


@_compiled.kernel_math
def _put_leaves(groups, g, leaves, a, b, c, d, e, f, h, i):  # pragma: no cover - compiled
    """Group g's eight leaves at their trees' places."""
    leaves[groups[g, _G_TREES]] = a
    leaves[groups[g, _G_TREES + 1]] = b
    leaves[groups[g, _G_TREES + 2]] = c
    leaves[groups[g, _G_TREES + 3]] = d
    leaves[groups[g, _G_TREES + 4]] = e
    leaves[groups[g, _G_TREES + 5]] = f
    leaves[groups[g, _G_TREES + 6]] = h
    leaves[groups[g, _G_TREES + 7]] = i


@_compiled.kernel_math
def _finish_row(sums, r, base, head, consts, labels, label_out, out,
                spare):  # pragma: no cover - compiled
    """Row r's outputs from its sums, as the ops' numpy epilogues compute them: divided by
    consts[_C_DIVISOR] (AVERAGE), plus `base` (empty: none); a binary classifier's two
    columns from the sum of column head[_H_BINARY] (`TreeEnsembleClassifier._binary`);
    otherwise label_out[r] = labels[argmax] (where label_out is not empty) and out[r] the
    sums in out's dtype, post-transformed in float64 (`post_transform`)."""
    post = head[_H_POST]
    for j in range(head[_H_TARGETS]):
        sums[j] = sums[j] / consts[_C_DIVISOR]
    if head[_H_BINARY] >= 0:
        s = sums[head[_H_BINARY]]
        if base.shape[0]:
            s = s + base[0]
        label_out[r] = labels[1 if s > consts[_C_CUT] else 0]
        if post == 2:  # LOGISTIC: p in the sums' dtype, then [1 - p, p]
            sums[0] = 1.0 / (1.0 + math.exp(-np.float64(s)))
            s = sums[0]
            out[r, 0] = consts[_C_ONE] - s
        else:
            out[r, 0] = consts[_C_ONE] - s if head[_H_PROBABILITY] else -s
        out[r, 1] = s
        return
    cols = out.shape[1]
    if base.shape[0]:
        for j in range(cols):
            sums[j] = sums[j] + base[j]
    if label_out.shape[0]:
        best = 0  # np.argmax: the first largest, the first NaN if any
        for j in range(1, cols):
            if sums[best] != sums[best]:
                break
            if sums[j] > sums[best] or sums[j] != sums[j]:
                best = j
        label_out[r] = labels[best]
    for j in range(cols):
        out[r, j] = sums[j]
    if post == 2:
        for j in range(cols):
            out[r, j] = 1.0 / (1.0 + math.exp(-np.float64(out[r, j])))
    elif post == 1 or post == 3:  # SOFTMAX, SOFTMAX_ZERO (zeros stay out, and come out 0)
        top = -np.inf if post == 3 else np.float64(out[r, 0])
        for j in range(cols):
            v = np.float64(out[r, j])
            if (post == 1 or v != 0) and top == top and (v > top or v != v):
                top = v  # np.max: NaN wins
        if post == 3 and not math.isfinite(top):
            top = 0.0
        for j in range(cols):
            v = np.float64(out[r, j])
            spare[j] = math.exp(v - top) if post == 1 or v != 0 else 0.0
        total = _numpy_sum(spare, cols)
        for j in range(cols):
            out[r, j] = spare[j] / total if post == 1 or total > 0 else 0.0


@_compiled.kernel_math
def _numpy_sum(a, n):  # pragma: no cover - compiled
    """a[:n].sum() with numpy's pairwise order for n <= 128 (eight running sums over
    blocks of eight, combined pairwise, the tail added in turn), so that a softmax
    divides by the very total numpy's `post_transform` does."""
    if n < 8:
        s = 0.0
        for i in range(n):
            s += a[i]
        return s
    r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    i = 8
    while i < n - n % 8:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        s += a[i]
        i += 1
    return s


_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER, _LEAF = range(8)
_COMPARE = {_LEQ: np.less_equal, _LT: np.less, _GTE: np.greater_equal, _GT: np.greater,
            _EQ: np.equal, _NEQ: np.not_equal}
_MODE_NAMES = {"BRANCH_LEQ": _LEQ, "BRANCH_LT": _LT, "BRANCH_GTE": _GTE, "BRANCH_GT": _GT,
               "BRANCH_EQ": _EQ, "BRANCH_NEQ": _NEQ, "BRANCH_MEMBER": _MEMBER, "LEAF": _LEAF}


class _Forest:
    """Trees as flat arrays over global node ids (leaves are nodes with mode LEAF), evaluated
    for a whole batch at once, one tree level per step."""

    def __init__(self, feature, threshold, mode, true_next, false_next, missing_true, roots,
                 members, contrib_node, contrib_target, contrib_weight, n_targets):
        self.feature = np.asarray(feature, dtype=np.int64)
        self.threshold = np.asarray(threshold, dtype=np.float64)
        self.mode = np.asarray(mode, dtype=np.int64)
        self.true_next = np.asarray(true_next, dtype=np.int64)
        self.false_next = np.asarray(false_next, dtype=np.int64)
        self.missing_true = np.asarray(missing_true, dtype=bool)
        self.roots = np.asarray(roots, dtype=np.int64)
        self.members = members  # node id -> array of member values
        self.n_targets = n_targets
        self.is_leaf = self.mode == _LEAF
        # int32 node ids halve the memory traffic of the per-level gathers
        idx = np.int32 if len(self.mode) < 2 ** 31 else np.int64
        here = np.arange(len(self.mode), dtype=idx)
        self.true_step = np.where(self.is_leaf, here, self.true_next).astype(idx)
        self.false_step = np.where(self.is_leaf, here, self.false_next).astype(idx)
        self.roots = self.roots.astype(idx)
        self.feature = np.where(self.is_leaf, 0, self.feature).astype(idx)
        self.max_feature = int(self.feature.max(initial=-1))
        interior = set(np.unique(self.mode[~self.is_leaf]).tolist())
        self.uniform_mode = interior.pop() if len(interior) == 1 and _MEMBER not in interior \
            else None
        # leaf contributions grouped by node: node k owns entries start[k] : start[k] + count[k]
        node = np.asarray(contrib_node, dtype=np.int64).reshape(-1)
        order = np.argsort(node, kind="stable")
        self.c_target = np.asarray(contrib_target, dtype=np.int64).reshape(-1)[order]
        self.c_weight = np.asarray(contrib_weight, dtype=np.float64).reshape(-1)[order]
        if self.c_target.size and (self.c_target.min() < 0 or self.c_target.max() >= n_targets):
            raise ValueError(f"a leaf names a target outside [0, {n_targets})")
        # a tree's depth, as balanced trees of its size have it: the compiled walk's cost
        self.depth = max(1, math.ceil(math.log2(max(2, len(self.mode) / max(1, len(roots))))))
        self._thresholds: dict[np.dtype, np.ndarray] = {}  # by the rows' dtype
        self._weights: dict[np.dtype, np.ndarray] = {}     # the leaf weights by the sums' dtype
        self._paired: dict[np.dtype, _PairedWalk | None] = {}  # by the rows' dtype
        self.c_count = np.bincount(node, minlength=len(self.mode)).astype(np.int64)
        self.c_start = np.concatenate([[0], np.cumsum(self.c_count)[:-1]]).astype(np.int64)

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """[N, n_trees] leaf node ids reached by each row in each tree. Every row walks every
        tree one level per step; rows already at a leaf stay there (leaves loop to themselves)."""
        n, n_feat = x.shape
        self.check_width(n_feat)
        if self.compiled_walk(x.dtype):
            return self._walk_compiled(x)
        flat_x = np.ascontiguousarray(x).reshape(-1)
        thr = self.threshold.astype(x.dtype) if x.dtype.kind == "f" else self.threshold
        has_nan = x.dtype.kind == "f" and bool(np.isnan(x).any())
        offset = (np.arange(n, dtype=np.int64 if n * n_feat >= 2 ** 31 else np.int32)
                  * n_feat)[:, None]
        cur = np.broadcast_to(self.roots, (n, len(self.roots))).copy()
        for _ in range(len(self.mode) + 1):
            if self.is_leaf[cur].all():
                return cur
            v = flat_x[offset + self.feature[cur]]
            t = thr[cur]
            if self.uniform_mode is not None:
                cond = _COMPARE[self.uniform_mode](v, t)
            else:
                m = self.mode[cur]
                cond = np.select([m == k for k in _COMPARE], [f(v, t) for f in _COMPARE.values()],
                                 False)
                for node, values in self.members.items():
                    sel = cur == node
                    if sel.any():
                        cond[sel] = np.isin(v[sel], values)
            if has_nan:  # NaN takes the true branch where the node says so (NEQ: always)
                cond |= np.isnan(v) & self.missing_true[cur]
            cur = np.where(cond, self.true_step[cur], self.false_step[cur])
        raise ValueError("tree traversal did not terminate (cyclic tree)")

    def check_width(self, n_feat: int) -> None:
        if self.max_feature >= n_feat:
            raise ValueError(f"trees read feature {self.max_feature}, input has {n_feat}")

    def compiled_walk(self, dtype: np.dtype) -> bool:
        """Whether `_walk_compiled` serves rows of `dtype`: float rows, no set-membership
        nodes, and numba."""
        return np.dtype(dtype) in (np.float32, np.float64) and not self.members \
            and _compiled.jit(_walk_trees) is not None

    def paired(self, dtype: np.dtype) -> "_PairedWalk | None":
        """The layout of the paired walk (`_predict`) for rows of `dtype`, made once, or
        None where it does not serve these trees."""
        dtype = np.dtype(dtype)
        if dtype not in self._paired:
            self._paired[dtype] = _PairedWalk.of(self, dtype)
        return self._paired[dtype]

    def _threshold_as(self, dtype: np.dtype) -> np.ndarray:
        """The thresholds in the rows' dtype, as the level-by-level walk compares them."""
        kept = self._thresholds.get(dtype)
        if kept is None:
            kept = self._thresholds[dtype] = self.threshold.astype(dtype)
        return kept

    def _walk_compiled(self, x: np.ndarray) -> np.ndarray:
        """`leaves` by a compiled walk: each row down each tree, rows split among the run's
        threads; the same leaf ids as the level-by-level walk."""
        x = np.ascontiguousarray(x)
        out = np.empty((x.shape[0], len(self.roots)), self.roots.dtype)
        cyclic = np.zeros(1, np.int64)
        _compiled.split_rows(_compiled.jit(_walk_trees), x.shape[0], x, self.feature,
                             self._threshold_as(x.dtype), self.mode, self.true_step,
                             self.false_step, self.missing_true, self.is_leaf, self.roots,
                             out, cyclic,
                             ns_per_row=tuning.TREE_STEP_NS * len(self.roots) * self.depth)
        if cyclic[0]:
            raise ValueError("tree traversal did not terminate (cyclic tree)")
        return out

    def _sum_compiled(self, x: np.ndarray, aggregate: str, dtype: np.dtype) -> np.ndarray:
        """`scores`' SUM / AVERAGE by one compiled loop that walks each tree and adds its
        leaf's weights as it goes (`_walk_and_sum`): the bits of the numpy aggregation (per
        cell, in tree order, in `dtype`) without its dozen passes, most of a few rows' time."""
        x = np.ascontiguousarray(x)
        out = np.zeros((x.shape[0], self.n_targets), dtype)
        cyclic = np.zeros(1, np.int64)
        weights = self._weights.get(dtype)
        if weights is None:
            weights = self._weights[dtype] = self.c_weight.astype(dtype)
        _compiled.split_rows(_compiled.jit(_walk_and_sum), x.shape[0], x, self.feature,
                             self._threshold_as(x.dtype), self.mode, self.true_step,
                             self.false_step, self.missing_true, self.is_leaf, self.roots,
                             self.c_start, self.c_count, self.c_target, weights, out, cyclic,
                             ns_per_row=tuning.TREE_STEP_NS * len(self.roots) * self.depth)
        if cyclic[0]:
            raise ValueError("tree traversal did not terminate (cyclic tree)")
        if aggregate == "AVERAGE" and len(self.roots):
            out = out / dtype.type(len(self.roots))
        return out

    def scores(self, x: np.ndarray, aggregate: str, dtype=np.float64) -> np.ndarray:
        """[N, n_targets] aggregated leaf weights in `dtype`. In float32 the sums are
        accumulated in float32 tree by tree, as onnxruntime's float kernels do (a class
        probability summed in float64 can land just above a 0.5 decision threshold that the
        float32 sum meets exactly)."""
        if aggregate in ("SUM", "AVERAGE") and x.shape[1] > self.max_feature \
                and self.compiled_walk(x.dtype):
            walk = self.paired(x.dtype) if x.dtype == dtype else None
            if walk is not None:
                return _Predictor(self, walk, out_dtype=dtype, columns=self.n_targets,
                                  average=aggregate == "AVERAGE")(x)[1]
            return self._sum_compiled(x, aggregate, np.dtype(dtype))
        leaves = self.leaves(x)
        n, n_trees = leaves.shape
        flat_leaves = leaves.reshape(-1)
        cnt = self.c_count[flat_leaves]
        ends = np.cumsum(cnt)
        pos = np.arange(int(ends[-1]) if ends.size else 0) - np.repeat(ends - cnt, cnt) \
            + np.repeat(self.c_start[flat_leaves], cnt)
        rows = np.repeat(np.arange(n).repeat(n_trees), cnt)
        cell = rows * self.n_targets + self.c_target[pos]
        size = n * self.n_targets
        weights = self.c_weight[pos]
        if aggregate in ("SUM", "AVERAGE") and np.dtype(dtype) == np.float32:
            # np.add.at adds in index order: per cell, in tree order (leaves are row-major)
            out = np.zeros(size, dtype=np.float32)
            np.add.at(out, cell, weights.astype(np.float32))
            if aggregate == "AVERAGE" and n_trees:
                out = out / np.float32(n_trees)
        elif aggregate in ("SUM", "AVERAGE"):
            out = np.bincount(cell, weights=weights, minlength=size)
            if aggregate == "AVERAGE" and n_trees:
                out = out / n_trees
        elif aggregate in ("MIN", "MAX"):
            out = np.full(size, np.inf if aggregate == "MIN" else -np.inf)
            (np.minimum if aggregate == "MIN" else np.maximum).at(out, cell, weights)
            out[np.bincount(cell, minlength=size) == 0] = 0.0
        else:
            raise ValueError(f"unknown aggregate_function {aggregate!r}")
        return out.astype(dtype, copy=False).reshape(n, self.n_targets)


class _PairedWalk:
    """A forest laid out for `_predict`, for rows of one float dtype. Slot k's node is
    nodes[4k:4k + 4], unsigned (compiled indexing then needs no negative-index fix-up) of the
    rows' width: the entry of the walk's row it compares (0, always 0, for a leaf; 1 + 2 f
    for feature f, 2 + 2 f for its negation), 4 times the slot of its first child (the second
    is next to it; a leaf's is itself), and its threshold in the rows' dtype (`thresholds`
    views the same memory). `groups` [groups, 17] uint32: eight roots (4 times their slots),
    their trees' indices, and the steps of the deepest; padding lanes walk an empty leaf, as
    trees after the last. Tree t adds to the sums of targets windows[t, 0] onward,
    windows[t, 1] of them, the weights (in the rows' dtype) from weight[nodes[4k + 3]] for
    its leaf k (`_windows`)."""

    def __init__(self, nodes, thresholds, groups, windows, weight, n_trees):
        self.nodes, self.thresholds, self.groups = nodes, thresholds, groups
        self.windows, self.weight = windows, weight
        self.steps = int(groups[:, _G_STEPS].sum())  # group steps a row takes
        self.n_trees = n_trees

    @classmethod
    def of(cls, forest: "_Forest", dtype: np.dtype) -> "_PairedWalk | None":
        """The layout, or None where it does not serve: a node that is not LEQ / LT / GTE /
        GT, a child out of range, a node reached twice (a shared subtree, a cycle)."""
        f, dtype = forest, np.dtype(dtype)
        n, inner = len(f.mode), ~f.is_leaf
        children = np.concatenate([f.true_next[inner], f.false_next[inner]])
        if f.members or n >= 2 ** 29 or not np.isin(f.mode[inner], (_LEQ, _LT, _GTE, _GT)).all() \
                or (f.feature[inner] < 0).any() or ((children < 0) | (children >= n)).any():
            return None
        first, second, column, threshold = cls._comparisons(f, dtype)
        roots = f.roots.astype(np.int64)
        n_trees = len(roots)
        if len(np.unique(roots)) < n_trees:
            return None
        # each tree's interior nodes level by level, and its depth
        seen = np.zeros(n, bool)
        seen[roots] = True
        depth = np.zeros(n_trees, np.int64)
        parents, owners = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        frontier, owner, level = roots, np.arange(n_trees), 0
        while True:
            keep = inner[frontier]
            frontier, owner = frontier[keep], owner[keep]
            if not frontier.size:
                break
            kids = np.stack([first[frontier], second[frontier]], axis=1).reshape(-1)
            if seen[kids].any() or len(np.unique(kids)) < len(kids):
                return None
            seen[kids] = True
            level += 1
            depth[owner] = level
            parents.append(frontier)
            owners.append(owner)
            frontier, owner = kids, np.repeat(owner, 2)
        order = np.argsort(np.concatenate(owners), kind="stable")
        parents, owners = np.concatenate(parents)[order], np.concatenate(owners)[order]
        # slots: the roots, then each tree's children pairs on even slots (a pair of 16-byte
        # nodes in one cache line), then the empty leaf that pads the last group
        pairs = n_trees + n_trees % 2 + 2 * np.arange(len(parents))
        n_slots = n_trees + n_trees % 2 + 2 * len(parents) + 1
        slot_of = np.full(n, -1, np.int64)
        slot_of[roots] = np.arange(n_trees)
        slot_of[first[parents]] = pairs
        slot_of[second[parents]] = pairs + 1
        node_at = np.full(n_slots, -1, np.int64)
        node_at[slot_of[seen]] = np.nonzero(seen)[0]
        table = np.zeros((n_slots, 4), f"u{dtype.itemsize}")
        table[:, 1] = 4 * np.arange(n_slots)  # leaves (and unused slots) step to themselves
        branch = np.zeros(n_slots, bool)
        branch[node_at >= 0] = inner[node_at[node_at >= 0]]
        u = node_at[branch]
        table[branch, 0] = column[u]
        table[branch, 1] = 4 * slot_of[first[u]]
        table[branch, 2] = threshold[u].view(table.dtype)
        nodes = table.reshape(-1)
        tree_of = np.zeros(n_slots, np.int64)
        tree_of[:n_trees] = np.arange(n_trees)
        tree_of[pairs], tree_of[pairs + 1] = owners, owners
        windows, weight, offset = cls._windows(f, node_at, branch, tree_of, n_trees, dtype)
        if windows is None:
            return None
        table[~branch, 3] = offset[~branch]
        n_groups = -(-n_trees // _GROUP)
        lanes = n_groups * _GROUP
        by_depth = np.argsort(depth, kind="stable")
        trees = np.arange(lanes)
        trees[:n_trees] = by_depth
        roots = np.full(lanes, n_slots - 1, np.int64)
        roots[:n_trees] = by_depth  # the root slots are the trees' indices
        steps = np.zeros(lanes, np.int64)
        steps[:n_trees] = depth[by_depth]
        groups = np.zeros((n_groups, 2 * _GROUP + 1), np.uint32)
        groups[:, :_GROUP] = 4 * roots.reshape(-1, _GROUP)
        groups[:, _G_TREES:_G_STEPS] = trees.reshape(-1, _GROUP)
        groups[:, _G_STEPS] = steps.reshape(-1, _GROUP).max(axis=1, initial=0)
        lane_windows = np.zeros((lanes, 2), np.int64)  # (padding lanes: none)
        lane_windows[:n_trees] = windows
        return cls(nodes, nodes.view(dtype), groups, lane_windows, weight, n_trees)

    @staticmethod
    def _windows(f: "_Forest", node_at, branch, tree_of, n_trees: int, dtype: np.dtype):
        """Each tree's leaf weights as dense vectors over the tree's window of targets (a
        tree scoring one class: that class; a forest's leaf scoring every class: all), so
        that the sums' addresses come from the trees, known ahead, not from each leaf:
        [trees, 2] int64 of each window's first target and width; the weights, with +0.0
        where a leaf scores no target of its window (a sum from +0.0 never is -0.0, so
        adding it changes no bit); each slot's offset into them. (None, None, None) where a
        leaf scores a target twice or the windows would hold too many zeros."""
        leaf_slots = np.nonzero((node_at >= 0) & ~branch)[0]
        u = node_at[leaf_slots]
        n_entries = f.c_count[u]
        entry = np.repeat(f.c_start[u] - np.cumsum(n_entries) + n_entries, n_entries) \
            + np.arange(int(n_entries.sum()))
        slot = np.repeat(leaf_slots, n_entries)
        target, tree = f.c_target[entry], tree_of[slot]
        if len(np.unique(slot * f.n_targets + target)) < len(slot):
            return None, None, None
        windows = np.zeros((n_trees, 2), np.int64)
        lo = np.full(n_trees, np.iinfo(np.int64).max)
        hi = np.zeros(n_trees, np.int64)
        np.minimum.at(lo, tree, target)
        np.maximum.at(hi, tree, target + 1)
        scored = hi > 0
        windows[scored, 0], windows[scored, 1] = lo[scored], hi[scored] - lo[scored]
        width = np.zeros(len(node_at), np.int64)
        width[leaf_slots] = windows[tree_of[leaf_slots], 1]
        if width.sum() > 2 * len(slot) + len(leaf_slots):
            return None, None, None
        offset = np.cumsum(width) - width
        dense = np.zeros(int(width.sum()), dtype)
        dense[offset[slot] + target - windows[tree, 0]] = f.c_weight[entry]
        return windows, dense, offset

    @staticmethod
    def _comparisons(f: "_Forest", dtype: np.dtype):
        """Each node's comparison as "goes to `first` iff entry <= threshold", NaN going to
        `second`: (first, second, entry, threshold) per node. With the thresholds in the
        rows' dtype, LT / GTE compare with the next value below, GT / GTE swap the branches,
        and a node whose NaN goes the other way reads the negated value against the negated
        next value up; a NaN threshold means never, +inf always."""
        mode, inf = f.mode, dtype.type(np.inf)
        th = f.threshold.astype(dtype)
        a_true = (mode == _LEQ) | (mode == _LT)  # `a`, where v <= bound goes: the true branch?
        with np.errstate(invalid="ignore", over="ignore"):
            bound = np.where((mode == _LT) | (mode == _GTE),
                             np.where(th == -inf, np.nan, np.nextafter(th, -inf)), th)
            bound = np.where(np.isnan(th), np.where(a_true, np.nan, inf), bound).astype(dtype)
            up = -np.nextafter(bound, inf)
        a = np.where(a_true, f.true_next, f.false_next)
        b = np.where(a_true, f.false_next, f.true_next)
        flip = f.missing_true == a_true  # NaN takes the true branch where missing_true
        flipped = np.where(np.isnan(bound), inf, np.where(bound == inf, np.nan, up))
        return (np.where(flip, b, a), np.where(flip, a, b),
                1 + 2 * f.feature.astype(np.int64) + flip,
                np.where(flip, flipped, bound).astype(dtype))


class _Predictor:
    """A tree op's whole run over float rows of one dtype in one compiled call (`_predict`):
    the paired walk, the sums and the op's epilogue (see `_finish_row`), into outputs
    allocated once a call. Everything the epilogue decides is fixed here, once."""

    def __init__(self, forest: _Forest, walk: _PairedWalk, *, out_dtype, columns: int,
                 post: str = "NONE", base=None, average: bool = False, binary: int = -1,
                 probability: bool = False, labels=None):
        dtype = walk.weight.dtype
        n_trees = walk.n_trees
        self.out_dtype, self.columns = np.dtype(out_dtype), columns
        self.forest, self.width = forest, forest.max_feature + 1
        head = np.array([_FUSED_POST[post], binary, probability, forest.n_targets], np.int64)
        consts = np.array([n_trees if average and n_trees else 1,
                           0.5 if probability else 0.0, 1], dtype)
        base = np.zeros(0, dtype) if base is None else np.array(base, dtype)  # C-ordered
        self.has_labels = labels is not None
        labels = np.zeros(0, np.int64) if labels is None else np.asarray(labels, np.int64)
        # `_predict`'s arguments between the rows and the outputs, the same every call
        self.model = (walk.nodes, walk.thresholds, walk.groups, walk.windows, walk.weight,
                      base, head, consts, labels)
        self.no_labels = np.zeros(0, np.int64)  # label_out where there are none (never written)
        self.kernel = _compiled.jit(_predict)
        self.ns_per_row = tuning.TREE_GROUP_STEP_NS * walk.steps
        # split_rows's cut gives one piece below two pieces' work (tuning.MIN_PIECE_NS): the
        # kernel is then called here, without asking the engine for the run's threads (a
        # microsecond, a fifth of a small run)
        self.one_piece_rows = 2 * tuning.MIN_PIECE_NS / self.ns_per_row

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(labels, or their indices, where the op has labels; the scores) for rows x."""
        if x.shape[1] < self.width:
            self.forest.check_width(x.shape[1])
        rows = x.shape[0]
        out = np.empty((rows, self.columns), self.out_dtype)
        label_out = np.empty(rows, np.int64) if self.has_labels else self.no_labels
        if rows < self.one_piece_rows:
            self.kernel(np.ascontiguousarray(x), *self.model, label_out, out, 0, rows)
        else:
            _compiled.split_rows(self.kernel, rows, np.ascontiguousarray(x), *self.model,
                                 label_out, out, ns_per_row=self.ns_per_row)
        return label_out, out


def _fusable(post: str, columns: int) -> bool:
    """Whether `_finish_row` does this post-transform (PROBIT stays numpy's) over `columns`."""
    return post in _FUSED_POST and (post in ("NONE", "LOGISTIC") or columns <= _SUM_COLUMNS)


def _fused(op: OpImpl, dtype: np.dtype) -> _Predictor | None:
    """op's `_Predictor` for rows of `dtype`, made by op.predictor(walk, dtype) on first use
    (at plan time for the dtype `lower` sees), or None where the paired walk does not serve."""
    try:
        return op.fused[dtype]
    except KeyError:
        walk = op.forest.paired(dtype) if op.forest.compiled_walk(dtype) else None
        made = op.fused[dtype] = None if walk is None else op.predictor(walk, dtype)
        return made


@register("TreeEnsemble", versions=[5], domain=ML)
class TreeEnsemble(OpImpl):
    def setup(self):
        modes = np.asarray(self.nodes_modes).astype(np.int64).reshape(-1)
        n = len(modes)
        feats = list(self.nodes_featureids or [])
        splits = np.asarray(self.nodes_splits, dtype=np.float64).reshape(-1)
        tids, fids = list(self.nodes_truenodeids), list(self.nodes_falsenodeids)
        tleaf = list(self.nodes_trueleafs or [0] * n)
        fleaf = list(self.nodes_falseleafs or [0] * n)
        if not all(len(a) == n for a in (feats, splits, tids, fids, tleaf, fleaf)):
            raise self.fail("nodes_* attributes differ in length")
        miss = self.nodes_missing_value_tracks_true
        miss = [0] * n if miss is None else list(miss)
        leaf_w = np.asarray(self.leaf_weights, dtype=np.float64).reshape(-1)
        leaf_t = list(self.leaf_targetids)
        n_leaves = len(leaf_w)
        if len(leaf_t) != n_leaves:
            raise self.fail("leaf_targetids and leaf_weights differ in length")
        true_next = [n + t if tl else t for t, tl in zip(tids, tleaf)]
        false_next = [n + f if fl else f for f, fl in zip(fids, fleaf)]
        members = {}
        if (modes == _MEMBER).any():
            vals = np.asarray(self.membership_values, dtype=np.float64).reshape(-1)
            groups, cur = [], []
            for v in vals:
                if np.isnan(v):
                    groups.append(np.asarray(cur))
                    cur = []
                else:
                    cur.append(v)
            if cur:
                groups.append(np.asarray(cur))
            member_nodes = np.nonzero(modes == _MEMBER)[0]
            if len(groups) < len(member_nodes):
                raise self.fail("membership_values has fewer sets than BRANCH_MEMBER nodes")
            members = {int(i): g for i, g in zip(member_nodes, groups)}
        try:
            self.forest = _Forest(
                feature=feats + [0] * n_leaves,
                threshold=np.concatenate([splits, np.zeros(n_leaves)]),
                mode=np.concatenate([modes, np.full(n_leaves, _LEAF)]),
                true_next=true_next + [0] * n_leaves, false_next=false_next + [0] * n_leaves,
                missing_true=miss + [0] * n_leaves, roots=list(self.tree_roots),
                members=members, contrib_node=np.arange(n, n + n_leaves),
                contrib_target=leaf_t, contrib_weight=leaf_w, n_targets=self.n_targets)
        except (ValueError, IndexError) as exc:
            raise self.fail(str(exc)) from exc
        aggs = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}
        if self.aggregate_function not in aggs or self.post_transform not in _POST_CODES:
            raise self.fail("unknown aggregate_function or post_transform")
        self.agg = aggs[self.aggregate_function]
        self.post = _POST_CODES[self.post_transform]
        self.fused: dict[np.dtype, _Predictor | None] = {}  # by the rows' dtype (`_fused`)

    def lower(self, inputs):
        x = inputs[0]
        return _tree_lowering(self, None if x is None else x.dtype)

    def predictor(self, walk: _PairedWalk, dtype: np.dtype) -> _Predictor | None:
        if self.agg not in ("SUM", "AVERAGE") or not _fusable(self.post, self.forest.n_targets):
            return None
        return _Predictor(self.forest, walk, out_dtype=dtype, columns=self.forest.n_targets,
                          post=self.post, average=self.agg == "AVERAGE")

    def run(self, x):
        x2 = _as_2d(x)
        predict = _fused(self, x.dtype)
        if predict is not None:
            return predict(x2)[1]
        work = np.float32 if x.dtype == np.float32 else np.float64  # as onnxruntime sums
        out = self.forest.scores(x2, self.agg, work).astype(x.dtype)
        return post_transform(out, self.post)


def _old_forest(op: OpImpl, prefix: str, n_targets: int) -> _Forest:
    """The v1/v3 encoding (nodes keyed by tree id and node id, mode LEAF marks leaves)."""
    tree_ids, node_ids = list(op.nodes_treeids), list(op.nodes_nodeids)
    n = len(tree_ids)
    gid = {(t, i): k for k, (t, i) in enumerate(zip(tree_ids, node_ids))}
    values = getattr(op, "nodes_values_as_tensor", None)
    values = np.asarray(values if values is not None else op.nodes_values or [0.0] * n,
                        dtype=np.float64).reshape(-1)
    modes = [_MODE_NAMES[m] for m in op.nodes_modes]
    tnext = [gid.get((t, i), 0) if m != _LEAF else 0
             for t, i, m in zip(tree_ids, op.nodes_truenodeids, modes)]
    fnext = [gid.get((t, i), 0) if m != _LEAF else 0
             for t, i, m in zip(tree_ids, op.nodes_falsenodeids, modes)]
    miss = op.nodes_missing_value_tracks_true
    miss = [0] * n if miss is None else list(miss)
    roots, seen = [], set()
    for k, t in enumerate(tree_ids):
        if t not in seen:
            seen.add(t)
            roots.append(gid.get((t, 0), k))
    weights = getattr(op, f"{prefix}_weights_as_tensor", None)
    weights = weights if weights is not None else getattr(op, f"{prefix}_weights")
    cnode = [gid[(t, i)] for t, i in zip(getattr(op, f"{prefix}_treeids"),
                                         getattr(op, f"{prefix}_nodeids"))]
    return _Forest(list(op.nodes_featureids), values, modes, tnext, fnext, miss, roots, {},
                   cnode, list(getattr(op, f"{prefix}_ids")),
                   np.asarray(weights, dtype=np.float64).reshape(-1), n_targets)


def _base_values(op: OpImpl):
    b = getattr(op, "base_values_as_tensor", None)
    b = b if b is not None else op.base_values
    return None if b is None else np.asarray(b, dtype=np.float64).reshape(-1)


@register("TreeEnsembleRegressor", versions=[1, 3], domain=ML)
class TreeEnsembleRegressor(OpImpl):
    def setup(self):
        try:
            self.forest = _old_forest(self, "target", self.n_targets or 1)
        except (KeyError, ValueError, IndexError) as exc:
            raise self.fail(f"malformed tree attributes: {exc}") from exc
        self.base = _base_values(self)
        self.fused: dict[np.dtype, _Predictor | None] = {}  # by the rows' dtype (`_fused`)

    def lower(self, inputs):
        return _tree_lowering(self, np.dtype(np.float32))  # rows in float32 or 64

    def predictor(self, walk: _PairedWalk, dtype: np.dtype) -> _Predictor | None:
        n = self.forest.n_targets
        if self.aggregate_function not in ("SUM", "AVERAGE") \
                or not _fusable(self.post_transform, n) \
                or (self.base is not None and len(self.base) not in (1, n)):
            return None
        base = None if self.base is None else np.broadcast_to(self.base, n)
        return _Predictor(self.forest, walk, out_dtype=np.float32, columns=n,
                          post=self.post_transform, base=base,
                          average=self.aggregate_function == "AVERAGE")

    def run(self, x):
        predict = self.fused.get(x.dtype) if x.ndim == 2 else None  # (rows as they come)
        if predict is not None:
            return predict(x)[1]
        work = np.float64 if x.dtype == np.float64 else np.float32
        x2 = _as_2d(x).astype(work, copy=False)
        predict = _fused(self, x2.dtype)
        if predict is not None:
            return predict(x2)[1]
        out = self.forest.scores(x2, self.aggregate_function, work)
        if self.base is not None:
            out = out + self.base.astype(work)
        return post_transform(out.astype(np.float32), self.post_transform)


@register("TreeEnsembleClassifier", versions=[1, 3], domain=ML)
class TreeEnsembleClassifier(OpImpl):
    def setup(self):
        self.labels = self.classlabels_strings if self.classlabels_strings is not None \
            else self.classlabels_int64s
        if self.labels is None:
            raise self.fail("class labels are required")
        self.n_cls = len(self.labels)
        try:
            self.forest = _old_forest(self, "class", max([self.n_cls] + [c + 1 for c in self.class_ids]))
        except (KeyError, ValueError, IndexError) as exc:
            raise self.fail(f"malformed tree attributes: {exc}") from exc
        self.base = _base_values(self)
        self.binary = self.n_cls == 2 and len(set(self.class_ids)) == 1
        self.int_labels = not (self.labels and isinstance(self.labels[0], str))
        self.fused: dict[np.dtype, _Predictor | None] = {}  # by the rows' dtype (`_fused`)

    def lower(self, inputs):
        return _tree_lowering(self, np.dtype(np.float32))  # rows in float32 or 64

    def predictor(self, walk: _PairedWalk, dtype: np.dtype) -> _Predictor | None:
        """The run as one compiled call; string labels come back as their indices."""
        labels = self.labels if self.int_labels else np.arange(self.n_cls)
        if self.binary:
            if self.post_transform not in ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"):
                return None
            base = self.base[:1] if self.base is not None and len(self.base) == 1 else None
            return _Predictor(self.forest, walk, out_dtype=np.float32, columns=2,
                              post=self.post_transform, base=base, binary=self.class_ids[0],
                              probability=self._all_positive(), labels=labels)
        if not self.n_cls or not _fusable(self.post_transform, self.n_cls):
            return None
        base = self.base if self.base is not None and len(self.base) == self.n_cls else None
        return _Predictor(self.forest, walk, out_dtype=np.float32, columns=self.n_cls,
                          post=self.post_transform, base=base, labels=labels)

    def run(self, x):
        predict = self.fused.get(x.dtype) if x.ndim == 2 else None  # (rows as they come)
        if predict is None:
            work = np.float64 if x.dtype == np.float64 else np.float32
            x = _as_2d(x).astype(work, copy=False)
            predict = _fused(self, x.dtype)
        if predict is not None:
            idx, scores = predict(x)
            return (idx if self.int_labels else _labels(self.labels, idx)), scores
        out = self.forest.scores(x, "SUM", work)
        if self.binary:
            return self._binary(out[:, self.class_ids[0]])
        out = out[:, :self.n_cls]
        if self.base is not None and len(self.base) == out.shape[1]:
            out = out + self.base.astype(work)
        scores = post_transform(out.astype(np.float32), self.post_transform)
        return _labels(self.labels, np.argmax(out, axis=1)), scores

    def _binary(self, s):
        """Two labels, every leaf scoring one class: `s` is the positive class's score (the
        onnxruntime convention). With all weights >= 0 it is read as a probability (positive
        above 0.5, scores [1 - s, s]), otherwise as a margin (positive above 0, [-s, s])."""
        if self.base is not None and len(self.base) == 1:
            s = s + self.base.astype(s.dtype)[0]
        all_positive = self._all_positive()
        idx = (s > (0.5 if all_positive else 0.0)).astype(np.int64)
        if self.post_transform in ("LOGISTIC", "PROBIT"):
            p = post_transform(s, self.post_transform)
            scores = np.stack([1 - p, p], axis=1)
        else:
            scores = np.stack([1 - s if all_positive else -s, s], axis=1)
        return _labels(self.labels, idx), scores.astype(np.float32)

    def _all_positive(self) -> bool:
        return bool((self.forest.c_weight >= 0).all())


# ---------------------------------------------------------------- more encoders

@register("CategoryMapper", versions=[1], domain=ML)
class CategoryMapper(OpImpl):
    def setup(self):
        ints, strs = list(self.cats_int64s or []), list(self.cats_strings or [])
        if len(ints) != len(strs):
            raise self.fail("cats_int64s and cats_strings differ in length")
        self.s2i = dict(zip(strs, ints))
        self.i2s = dict(zip(ints, strs))

    def run(self, x):
        flat = x.reshape(-1)
        if x.dtype == object:  # strings -> int64
            return np.array([self.s2i.get(str(s), self.default_int64) for s in flat],
                            dtype=np.int64).reshape(x.shape)
        out = np.empty(flat.size, dtype=object)
        out[:] = [self.i2s.get(i, self.default_string) for i in flat.tolist()]
        return out.reshape(x.shape)


@register("FeatureVectorizer", versions=[1], domain=ML)
class FeatureVectorizer(OpImpl):
    def run(self, *inputs):
        dims = list(self.inputdimensions or [])
        if len(dims) != len(inputs):
            raise self.fail(f"inputdimensions has {len(dims)} entries for {len(inputs)} inputs")
        parts = []
        for x, width in zip(inputs, dims):
            x2 = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
            x2 = x2.astype(np.float32)
            if x2.shape[1] >= width:
                parts.append(x2[:, :width])
            else:  # short input: zero padded to its declared width
                pad = np.zeros((x2.shape[0], width - x2.shape[1]), dtype=np.float32)
                parts.append(np.concatenate([x2, pad], axis=1))
        return np.concatenate(parts, axis=1)


# ---------------------------------------------------------------- support vector machines

class _SVMBase(OpImpl):
    def _kernel_setup(self):
        params = list(self.kernel_params or [0.0, 0.0, 0.0]) + [0.0, 0.0, 0.0]
        self.gamma, self.coef0, self.degree = float(params[0]), float(params[1]), params[2]
        if self.kernel_type not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            raise self.fail(f"unknown kernel_type {self.kernel_type!r}")

    def _kernel(self, x: np.ndarray, sv: np.ndarray, kind: str) -> np.ndarray:
        """[N, V] kernel values between rows of x and support vectors sv (in float64)."""
        if kind == "RBF":
            d2 = (x * x).sum(axis=1)[:, None] - 2 * x @ sv.T + (sv * sv).sum(axis=1)[None, :]
            return np.exp(-self.gamma * np.maximum(d2, 0.0))
        dot = x @ sv.T
        if kind == "POLY":
            return (self.gamma * dot + self.coef0) ** self.degree
        if kind == "SIGMOID":
            return np.tanh(self.gamma * dot + self.coef0)
        return dot


@register("SVMRegressor", versions=[1], domain=ML)
class SVMRegressor(_SVMBase):
    def setup(self):
        self._kernel_setup()
        self.coef = np.asarray(self.coefficients or [], dtype=np.float64)
        self.rho0 = float((self.rho or [0.0])[0])
        if self.n_supports > 0:
            self.sv = np.asarray(self.support_vectors, dtype=np.float64).reshape(
                self.n_supports, -1)

    def run(self, x):
        x2 = _as_2d(x).astype(np.float64)
        if self.n_supports > 0:
            y = self._kernel(x2, self.sv, self.kernel_type) @ self.coef + self.rho0
        else:
            y = x2 @ self.coef + self.rho0
        if self.one_class:
            y = np.where(y > 0, 1.0, -1.0)
        y = y.reshape(-1, 1).astype(np.float32)
        return post_transform(y, self.post_transform) if self.post_transform == "PROBIT" else y


def _couple_pairwise(r: np.ndarray) -> np.ndarray:
    """Class probabilities from pairwise ones r[i, j] = P(i | i or j) (Wu, Lin & Weng, method 2,
    as libsvm solves it)."""
    k = r.shape[0]
    q = -(r.T * r)
    np.fill_diagonal(q, 0.0)
    np.fill_diagonal(q, (r.T ** 2).sum(axis=1) - np.diag(r) ** 2)
    p = np.full(k, 1.0 / k)
    eps = 0.005 / k
    for _ in range(max(100, k)):
        qp = q @ p
        pqp = p @ qp
        if np.abs(qp - pqp).max() < eps:
            break
        for t in range(k):
            diff = (pqp - qp[t]) / q[t, t]
            p[t] += diff
            pqp = (pqp + diff * (diff * q[t, t] + 2 * qp[t])) / (1 + diff) ** 2
            p /= 1 + diff
            qp = (qp + diff * q[t]) / (1 + diff)
    return p


@register("SVMClassifier", versions=[1], domain=ML)
class SVMClassifier(_SVMBase):
    """Linear (one score per class) or libsvm-style one-vs-one SVC with voting and optional
    Platt-scaled probabilities; binary outputs follow onnxruntime's conventions."""

    def setup(self):
        self._kernel_setup()
        self.labels = self.classlabels_strings if self.classlabels_strings is not None \
            else self.classlabels_ints
        if self.labels is None:
            raise self.fail("class labels are required")
        self.n_cls = max(len(self.labels), 1)
        coef = np.asarray(self.coefficients or [], dtype=np.float64)
        self.rho_ = np.asarray(self.rho or [0.0], dtype=np.float64)
        per_class = list(self.vectors_per_class or [])
        self.n_sv = int(sum(per_class))
        if self.n_sv > 0:
            self.sv = np.asarray(self.support_vectors, dtype=np.float64).reshape(self.n_sv, -1)
            self.coef = coef.reshape(-1, self.n_sv)
            starts = np.concatenate([[0], np.cumsum(per_class)[:-1]]).astype(int)
            self.ranges = [(int(s), int(s + c)) for s, c in zip(starts, per_class)]
            self.pairs = [(i, j) for i in range(self.n_cls) for j in range(i + 1, self.n_cls)]
            if len(self.rho_) < len(self.pairs):
                raise self.fail(f"rho has {len(self.rho_)} entries for {len(self.pairs)} pairs")
        else:
            self.coef = coef.reshape(self.n_cls, -1)
        self.prob_a_ = np.asarray(self.prob_a or [], dtype=np.float64)
        self.prob_b_ = np.asarray(self.prob_b or [], dtype=np.float64)

    def run(self, x):
        x2 = _as_2d(x).astype(np.float64)
        n = x2.shape[0]
        votes = None
        if self.n_sv > 0:
            kern = self._kernel(x2, self.sv, self.kernel_type)
            scores = np.empty((n, len(self.pairs)))
            votes = np.zeros((n, self.n_cls))
            for p, (i, j) in enumerate(self.pairs):
                (a0, a1), (b0, b1) = self.ranges[i], self.ranges[j]
                s = (self.rho_[p] + kern[:, a0:a1] @ self.coef[j - 1, a0:a1]
                     + kern[:, b0:b1] @ self.coef[i, b0:b1])
                scores[:, p] = s
                votes[np.arange(n), np.where(s > 0, i, j)] += 1
        else:
            scores = x2 @ self.coef.T + self.rho_[0]
        has_proba = self.n_sv > 0 and self.prob_a_.size > 0
        if has_proba:
            probs = np.empty((n, self.n_cls))
            for row in range(n):
                r = np.zeros((self.n_cls, self.n_cls))
                for p, (i, j) in enumerate(self.pairs):
                    v = 1.0 / (1.0 + np.exp(scores[row, p] * self.prob_a_[p] + self.prob_b_[p]))
                    v = min(max(v, 1e-7), 1 - 1e-7)
                    r[i, j], r[j, i] = v, 1 - v
                probs[row] = _couple_pairwise(r)
            scores = probs
        ref = votes if votes is not None else scores
        labels = _labels(self.labels, np.argmax(ref, axis=1))
        if scores.shape[1] == 1 and len(self.labels) == 2:
            # one pairwise score: onnxruntime's layouts for the two-column output
            s = scores[:, 0]
            if self.post_transform == "LOGISTIC":
                p = 1.0 / (1.0 + np.exp(-s))
                out = np.stack([1 - p, p], axis=1)
            elif self.post_transform in ("SOFTMAX", "SOFTMAX_ZERO"):
                out = np.stack([1 - s, s], axis=1)
            else:
                out = np.stack([-s, s], axis=1)
        else:
            out = post_transform(scores, self.post_transform)
        return labels, out.astype(np.float32)


# ---------------------------------------------------------------- maps
# A map value is a Python dict (key -> scalar), a sequence of maps a list of dicts, as
# onnxruntime takes them as feeds and returns them from InferenceSession.run.

def _is_int_key(k) -> bool:
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def _scalar(v):
    """A map value as a Python/numpy scalar (one-element arrays unwrapped)."""
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise ValueError(f"map value of shape {v.shape} is not a scalar")
        return v.reshape(-1)[0]
    return v


def _values_dtype(values) -> np.dtype:
    """The tensor dtype of a map's values: numpy scalars keep their dtype (promoted together);
    Python floats read as float32 and Python ints as int64 (the ONNX-ML map types; ints among
    floats as float32), strings as object."""
    strong, py_int, py_float, strings, numbers = set(), False, False, False, False
    for v in values:
        if isinstance(v, (str, np.str_, bytes)):
            strings = True
            continue
        numbers = True
        if isinstance(v, np.generic):
            strong.add(v.dtype)
        elif isinstance(v, (bool, int)):
            py_int = True
        elif isinstance(v, float):
            py_float = True
        else:
            raise ValueError(f"unsupported map value type {type(v).__name__}")
    if strings:
        if numbers:
            raise ValueError("map values mix strings and numbers")
        return np.dtype(object)
    if strong:
        dtype = np.result_type(*strong)
        return np.dtype(np.float32) if py_float and dtype.kind != "f" else dtype
    return np.dtype(np.float32) if py_float or not py_int else np.dtype(np.int64)


@register("ZipMap", versions=[1], domain=ML)
class ZipMap(OpImpl):
    """[N, C] (or [C]) scores -> a list of N dicts {class label: score}. Like onnxruntime's
    std::map, each dict has its keys in sorted order, and a repeated label keeps the score of
    its last column."""

    def setup(self):
        strings, ints = self.classlabels_strings, self.classlabels_int64s
        if (not strings) == (not ints):
            raise self.fail("exactly one of classlabels_strings, classlabels_int64s must be set")
        self.labels = [str(s) for s in strings] if strings else [int(i) for i in ints]
        last = {label: j for j, label in enumerate(self.labels)}
        self.keys = sorted(last)  # (str order is UTF-8 byte order, std::string's)
        columns = [last[k] for k in self.keys]
        # None where the columns are in key order already (labels sorted, each once, as
        # exporters write them): the gather would cost a small run's microseconds for nothing
        self.columns = None if columns == list(range(len(self.labels))) \
            else np.asarray(columns, dtype=np.int64)

    def run(self, x):
        x = np.asarray(x)
        if x.ndim not in (1, 2):
            raise self.fail(f"input must be 1-D or 2-D, got shape {list(x.shape)}")
        if x.shape[-1] != len(self.labels):
            raise self.fail(f"input has {x.shape[-1]} columns for {len(self.labels)} class labels")
        x2 = x.astype(np.float32, copy=False).reshape(-1, len(self.labels))
        if self.columns is not None:
            x2 = x2[:, self.columns]
        keys = self.keys
        return [dict(zip(keys, row)) for row in x2.tolist()]


@register("DictVectorizer", versions=[1], domain=ML)
class DictVectorizer(OpImpl):
    """A map (or a list of maps) -> [1, V] (or [N, V]): the value of each vocabulary key, 0
    (or "") where the map lacks it. Duplicate vocabulary entries each get the value."""

    def setup(self):
        strings, ints = self.string_vocabulary, self.int64_vocabulary
        if (not strings) == (not ints):
            raise self.fail("exactly one of string_vocabulary, int64_vocabulary must be set")
        self.string_keys = bool(strings)
        vocab = [str(s) for s in strings] if strings else [int(i) for i in ints]
        self.size = len(vocab)
        self.positions: dict = {}
        for i, k in enumerate(vocab):
            self.positions.setdefault(k, []).append(i)

    def run(self, m):
        maps = [m] if isinstance(m, dict) else m
        if not isinstance(maps, (list, tuple)) or not all(isinstance(d, dict) for d in maps):
            raise self.fail(f"input must be a map (dict) or a sequence of maps, got "
                            f"{type(m).__name__}")
        try:
            rows, cols, vals = self._entries(maps)
            dtype = _values_dtype(_scalar(v) for d in maps for v in d.values())
        except ValueError as exc:
            raise self.fail(str(exc)) from exc
        out = np.full((len(maps), self.size), "" if dtype == object else 0, dtype=dtype)
        if vals:
            if dtype == object:
                flat = np.empty(len(vals), dtype=object)
                flat[:] = [str(v) for v in vals]
            else:
                flat = np.asarray(vals, dtype=dtype)
            out[np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)] = flat
        return out

    def _entries(self, maps):
        """(row, column, value) of every map entry the vocabulary holds."""
        rows, cols, vals = [], [], []
        for r, d in enumerate(maps):
            for k, v in d.items():
                if self.string_keys:
                    if not isinstance(k, str):
                        raise self.fail(f"string_vocabulary needs string keys, got "
                                        f"{type(k).__name__} key {k!r}")
                elif _is_int_key(k):
                    k = int(k)
                else:
                    raise self.fail(f"int64_vocabulary needs integer keys, got "
                                    f"{type(k).__name__} key {k!r}")
                pos = self.positions.get(k)
                if pos:
                    v = _scalar(v)
                    for p in pos:
                        rows.append(r)
                        cols.append(p)
                        vals.append(v)
        return rows, cols, vals


# C library conversions onnxruntime's CastMap uses: std::stof / std::stoll (a number prefix
# after leading C whitespace, the rest ignored), std::to_string(float) ("%f").
_C_SPACE = " \t\n\v\f\r"


# (fixed patterns of ours, not from a model)
_STOF = re.compile(r"[+-]?(?:(inf(?:inity)?)|(nan)(?:\([0-9A-Za-z_]*\))?"
                   r"|(0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?)"
                   r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)", re.IGNORECASE)
_STOLL = re.compile(r"[+-]?[0-9]+")


def _stof_prefix(s: str):
    """The longest prefix of `s` (after C whitespace) that strtof reads, as a float, or None."""
    m = _STOF.match(s.lstrip(_C_SPACE))
    if m is None:
        return None
    text = m.group(0)
    if m.group(2):  # nan, nan(chars)
        return float("nan")
    if m.group(3):  # hexadecimal float
        sign = -1.0 if text.startswith("-") else 1.0
        return sign * float.fromhex(m.group(3))
    return float(text)  # float() reads inf / infinity / nan too


def _stoll_prefix(s: str):
    m = _STOLL.match(s.lstrip(_C_SPACE))
    return None if m is None else int(m.group(0))


@register("CastMap", versions=[1], domain=ML)
class CastMap(OpImpl):
    """A map int64 -> (string | float) -> a [1, n] tensor: DENSE packs the values in key
    order, SPARSE puts each value at its key's position in [0, max_map) (other keys ignored)
    and pads the rest (0, or the string "0.f" as onnxruntime does)."""

    _TYPES = {"TO_FLOAT": np.float32, "TO_INT64": np.int64, "TO_STRING": object}

    def setup(self):
        if self.cast_to not in self._TYPES:
            raise self.fail(f"unknown cast_to {self.cast_to!r}")
        if self.map_form not in ("DENSE", "SPARSE"):
            raise self.fail(f"unknown map_form {self.map_form!r}")
        if self.map_form == "SPARSE" and self.max_map <= 0:
            raise self.fail(f"max_map must be positive with SPARSE, got {self.max_map}")

    def run(self, m):
        if not isinstance(m, dict):
            raise self.fail(f"input must be a map (dict), got {type(m).__name__}")
        if not all(_is_int_key(k) for k in m):
            raise self.fail("CastMap needs a map with int64 keys")
        try:
            items = sorted((int(k), _scalar(v)) for k, v in m.items())
        except ValueError as exc:
            raise self.fail(str(exc)) from exc
        keys = [k for k, _ in items]
        values = [v for _, v in items]
        strings = any(isinstance(v, (str, np.str_)) for v in values)
        if strings and not all(isinstance(v, (str, np.str_)) for v in values):
            raise self.fail("map values mix strings and numbers")
        converted = self._convert(values, strings)
        if self.map_form == "DENSE":
            return converted.reshape(1, -1)
        if keys and keys[0] < 0:
            raise self.fail(f"negative keys are not allowed with SPARSE, got {keys[0]}")
        dtype = self._TYPES[self.cast_to]
        out = np.full(self.max_map, "0.f" if dtype is object else 0, dtype=dtype)
        idx = np.asarray(keys, dtype=np.int64)
        keep = idx < self.max_map
        out[idx[keep]] = converted[keep]
        return out.reshape(1, -1)

    def _convert(self, values, strings: bool) -> np.ndarray:
        to = self.cast_to
        n = len(values)
        if not strings:
            f = np.asarray(values, dtype=np.float32).reshape(n)  # the map's float values
            if to == "TO_FLOAT":
                return f
            if to == "TO_INT64":  # truncation towards zero (static_cast)
                with np.errstate(invalid="ignore"):
                    return np.trunc(f).astype(np.int64)
            out = np.empty(n, dtype=object)
            out[:] = ["%f" % v for v in f.tolist()]
            return out
        if to == "TO_STRING":
            out = np.empty(n, dtype=object)
            out[:] = [str(v) for v in values]
            return out
        parse = _stof_prefix if to == "TO_FLOAT" else _stoll_prefix
        parsed = []
        for v in values:
            p = parse(str(v))
            if p is None:
                raise self.fail(f"cannot convert {str(v)!r} to "
                                f"{'float' if to == 'TO_FLOAT' else 'int64'}")
            parsed.append(p)
        if to == "TO_FLOAT":
            arr = np.asarray(parsed, dtype=np.float64)
            big = np.isfinite(arr) & (np.abs(arr) > np.finfo(np.float32).max)
            if big.any():
                raise self.fail(f"value {arr[big][0]!r} is out of float range")
            return arr.astype(np.float32)
        if any(not -2 ** 63 <= p < 2 ** 63 for p in parsed):
            raise self.fail("value out of int64 range")
        return np.asarray(parsed, dtype=np.int64)
