"""The compiled loops of the quantised element-wise ops (ops/cpu/qlinear.py): QLinearAdd /
QLinearMul, QuantizeLinear / DequantizeLinear (ONNX and com.microsoft), DynamicQuantizeLinear,
the table lookups (QLinearSigmoid / QLinearLeakyRelu) and QLinearGlobalAveragePool.

Each runs as a one-node model twice in one session, with the compiled loop forced
(QLINEAR_COMPILED_MIN = 1) and with numpy's kernel forced (the threshold out of reach): the
outputs must be the same bits (np.array_equal), on data with many values at or next to a
rounding half. The compiled route also runs against onnxruntime where it has the kernel, with
test_contrib_quantized.py's tolerance for its SIMD requantisation (one step on a few
elements). The emulated fused multiply-add is checked on its own against the numpy one and
against exact rational arithmetic on products that are float32 midpoints."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ember
from ember.ops.cpu import compiled, engine, qlinear, tuning
from ember.ops.microsoft import quantized

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("numba")

MS = "com.microsoft"
_TP = {np.dtype(np.float32): TP.FLOAT, np.dtype(np.int8): TP.INT8,
       np.dtype(np.uint8): TP.UINT8}
NUMPY = 1 << 62   # a QLINEAR_COMPILED_MIN no tensor reaches


@pytest.fixture(autouse=True)
def _numba_on(monkeypatch):
    monkeypatch.delenv("EMBER_NUMBA", raising=False)


class Const:
    """An input given as an initializer."""

    def __init__(self, value):
        self.value = np.asarray(value)


def set_thresholds(monkeypatch, least):
    """The compiled loops' thresholds (QLinearAdd's own too) all at `least`."""
    for name in ("QLINEAR_COMPILED_MIN", "QLINEAR_ADD_COMPILED_MIN"):
        monkeypatch.setattr(tuning, name, least)


def node_model(op, inputs, out_types, domain=MS, opset=21, **attrs):
    """(model, feeds) of one node; inputs are (name, array or Const), out_types the outputs'
    dtypes."""
    names, graph_inputs, inits, feeds = [], [], [], {}
    for name, value in inputs:
        names.append(name)
        if isinstance(value, Const):
            inits.append(numpy_helper.from_array(value.value, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, _TP[value.dtype],
                                                              value.shape))
            feeds[name] = value
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, names, outs, domain=domain if domain != "" else None, **attrs)
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info(o, _TP[np.dtype(t)], None)
                               for o, t in zip(outs, out_types)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(MS, 1)])
    return model, feeds


def compiled_and_numpy(monkeypatch, model, feeds):
    """The outputs with the compiled loops forced, then with numpy's kernels forced, checking
    the node named the kernel it ran each time. A session each: a node works its route out
    at its first run and keeps it."""
    results = []
    for least, kernel in ((1, "cpu.compiled"), (NUMPY, "numpy")):
        set_thresholds(monkeypatch, least)
        session = ember.load(model, "cpu")
        results.append(session.run(feeds))
        assert [k for _, _, k, _ in session.kernels] == [kernel], session.kernels
    return results


def assert_same_bits(monkeypatch, model, feeds):
    fast, slow = compiled_and_numpy(monkeypatch, model, feeds)
    for name in slow:
        assert fast[name].dtype == slow[name].dtype and fast[name].shape == slow[name].shape
        assert np.array_equal(bits(fast[name]), bits(slow[name])), name
    return fast


def bits(x):
    """x's bytes: NaNs compare by their bits."""
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def against_onnxruntime(monkeypatch, model, feeds, steps=0):
    """The compiled loop's outputs against onnxruntime's: integers within `steps` codes, 97%
    of them equal; floats equal."""
    set_thresholds(monkeypatch, 1)
    session = ember.load(model, "cpu")
    got = session.run(feeds)
    assert [k for _, _, k, _ in session.kernels] == ["cpu.compiled"], session.kernels
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    for (name, g), w in zip(sorted(got.items()), want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if g.dtype.kind == "f":
            np.testing.assert_array_equal(g, w)
            continue
        diff = np.abs(g.astype(np.int64) - w.astype(np.int64))
        assert diff.max(initial=0) <= steps, name
        assert np.mean(diff == 0) >= 0.97, name


def codes(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape, dtype=dtype)


def f32(v):
    return np.asarray(v, np.float32)


# ---------------------------------------------------------------------------- fma32


def _fma_loop(x, y, z, out):  # pragma: no cover - compiled
    for i in range(out.size):
        out[i] = qlinear.fma32(x[i], y[i], z[i])


def _midpoint_cases(rng, n):
    """x (a code) times y (float32) exactly halfway between two float32s, and z a value far
    below half the float64 product's last bit, of either sign (or zero): their float64 sum
    rounds to the midpoint, and only the rounding to odd recovers the direction the fma
    rounds in."""
    x = rng.integers(1, 256, n).astype(np.float32)
    y = (rng.random(n) * 4 - 2).astype(np.float32)
    prod = x.astype(np.float64) * y
    mid = np.abs(prod - prod.astype(np.float32)) == \
        np.spacing(np.abs(prod.astype(np.float32))).astype(np.float64) / 2
    x, y = x[mid], y[mid]
    z = (np.abs(x * y) * np.float32(2.0 ** -60) * rng.choice([-1, 1, 0], x.size)) \
        .astype(np.float32)
    return x, y, z


def test_fma32_is_numpys_fma_and_correctly_rounded():
    rng = np.random.default_rng(1)
    n = 200_000
    x = np.concatenate([rng.integers(-128, 256, n).astype(np.float32),
                        rng.standard_normal(n).astype(np.float32)])
    y = np.concatenate([(rng.random(n) * 3).astype(np.float32),
                        rng.standard_normal(n).astype(np.float32) * np.float32(1e3)])
    z = np.concatenate([(rng.standard_normal(n) * 300).astype(np.float32),
                        (rng.standard_normal(n) * 1e-20).astype(np.float32)])
    mx, my, mz = _midpoint_cases(rng, 2_000_000)
    assert mx.size > 1000
    cx = rng.integers(0, 256, 1000).astype(np.float32)   # products that z cancels exactly
    cy = (rng.integers(-512, 512, 1000) / np.float32(64)).astype(np.float32)
    x, y, z = (np.concatenate(parts) for parts in ((x, mx, cx), (y, my, cy), (z, mz, -cx * cy)))
    out = np.empty_like(x)
    compiled.jit(_fma_loop)(x, y, z, out)
    want = quantized._fma32(np, x, y, z)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    for i in rng.choice(np.flatnonzero(np.isin(x, mx)), 300):   # exact rational reference
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        lo = np.float32(float(exact))
        candidates = [lo, np.nextafter(lo, np.float32(np.inf)),
                      np.nextafter(lo, np.float32(-np.inf))]
        best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact),
                                              int(c.view(np.uint32)) & 1))
        assert out[i] == best, (x[i], y[i], z[i])


# ---------------------------------------------------------------------------- QLinearAdd/Mul

SHAPES = [((2, 16, 24, 24), (2, 16, 24, 24)),   # same shape
          ((2, 16, 24, 24), ()),                 # B a scalar
          ((1,), (2, 16, 24, 24)),               # A a one-value tensor: swapped for the kernel
          ((2, 16, 24, 24), (1, 16, 1, 1)),      # per channel
          ((1, 16, 1, 1), (2, 16, 24, 24)),
          ((2, 16, 24, 24), (24,)),              # innermost
          ((2, 16, 24, 1), (2, 16, 24, 24)),     # A one value per innermost row
          ((3, 1, 40), (1, 7, 40)),              # broadcast both ways: three runs
          ((32, 1, 1), (1, 48, 1)),              # A one value a row, not swapped
          ((3, 1, 40, 5), (1, 7, 1, 5)),         # four runs: numpy
          ((2, 3, 4, 5, 6), (2, 1, 4, 1, 6))]    # five runs: numpy


def binary_model(op, dtype, a, b, params, constant=True):
    (sa, za), (sb, zb), (sc, zc) = params
    wrap = Const if constant else (lambda v: v)
    return node_model(op, [("a", a), ("sa", wrap(f32(sa))), ("za", wrap(np.array(za, dtype))),
                           ("b", b), ("sb", wrap(f32(sb))), ("zb", wrap(np.array(zb, dtype))),
                           ("sc", wrap(f32(sc))), ("zc", wrap(np.array(zc, dtype)))],
                      [dtype])


def binary_params(rng, dtype, halves):
    lo = 0 if dtype == np.uint8 else -128
    zps = rng.integers(lo, lo + 256, 3)
    if halves:   # results on multiples of 1/4: many exact halves, rounded to even
        scales = [0.5, 0.25, 1.0]
    else:
        scales = (rng.random(3) * 0.05 + 0.005).tolist()
    return list(zip(scales, zps.tolist()))


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shapes", SHAPES)
def test_binary_same_bits_as_numpy(monkeypatch, op, dtype, shapes):
    rng = np.random.default_rng(len(str(shapes)))
    a, b = codes(rng, dtype, shapes[0]), codes(rng, dtype, shapes[1])
    for halves in (True, False):
        model, feeds = binary_model(op, dtype, a, b, binary_params(rng, dtype, halves))
        session = ember.load(model, "cpu")
        plan = qlinear.broadcast_blocks(a.shape, b.shape)
        if plan is None:   # more than three runs: numpy whatever the threshold
            set_thresholds(monkeypatch, 1)
            session.run(feeds)
            assert [k for _, _, k, _ in session.kernels] == ["numpy"]
            continue
        assert_same_bits(monkeypatch, model, feeds)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("shapes", SHAPES[:6])
def test_binary_against_onnxruntime(monkeypatch, op, shapes):
    rng = np.random.default_rng(7)
    a, b = codes(rng, np.uint8, shapes[0]), codes(rng, np.uint8, shapes[1])
    model, feeds = binary_model(op, np.uint8, a, b, binary_params(rng, np.uint8, False))
    against_onnxruntime(monkeypatch, model, feeds, steps=1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy's kernel on a zero C_scale
def test_binary_scales_as_feeds_and_unfinite_ratios(monkeypatch):
    """Parameters fed at run time take the compiled loop; a zero C_scale (infinite ratios)
    takes numpy's kernel."""
    rng = np.random.default_rng(3)
    a, b = codes(rng, np.uint8, (4, 128, 128)), codes(rng, np.uint8, (4, 128, 128))
    params = [(0.02, 100), (0.03, 120), (0.05, 128)]
    model, feeds = binary_model("QLinearAdd", np.uint8, a, b, params, constant=False)
    session = ember.load(model, "cpu")
    for sc in (0.05, 0.07, 0.05):
        feeds["sc"] = f32(sc)
        results = []
        for least in (1, NUMPY):
            set_thresholds(monkeypatch, least)
            results.append(session.run(feeds)["y0"])
        np.testing.assert_array_equal(*results)
    feeds["sc"] = f32(0)
    set_thresholds(monkeypatch, 1)
    session = ember.load(model, "cpu")
    session.run(feeds)
    assert [k for _, _, k, _ in session.kernels] == ["numpy"]


def test_add_gives_the_same_bits_however_split(monkeypatch):
    rng = np.random.default_rng(4)
    a, b = codes(rng, np.uint8, (1, 64, 56, 56)), codes(rng, np.uint8, (1, 64, 56, 56))
    args = (np.float32(0.4), np.float32(0.6), np.float32(-31.25), 0, 255,
            qlinear.broadcast_blocks(a.shape, b.shape))
    whole = qlinear.add(a, b, *args)
    monkeypatch.setattr(tuning, "MIN_PIECE_NS", 1)
    monkeypatch.setattr(tuning, "QLINEAR_CHUNK", 1000)
    monkeypatch.setattr(engine.current(), "run_threads", lambda: 3)
    np.testing.assert_array_equal(qlinear.add(a, b, *args), whole)


# ---------------------------------------------------------------------------- (De)Quantize


def quantize_data(rng, shape, scale):
    """float32 values around the codes' range, a third of them exact halves of the scale
    (ties), some one ulp off a half, NaN and infinities."""
    x = (rng.standard_normal(shape) * 100 * np.max(scale)).astype(np.float32)
    flat = x.reshape(-1)
    k = rng.integers(-300, 300, flat.size).astype(np.float32) + np.float32(0.5)
    third = flat.size // 3
    s = np.broadcast_to(np.asarray(scale, np.float32), shape).reshape(-1)
    flat[:third] = k[:third] * s[:third]
    flat[third:2 * third] = np.nextafter(k[third:2 * third] * s[third:2 * third],
                                         np.float32(np.inf))
    flat[-3:] = [np.nan, np.inf, -np.inf]
    return x


@pytest.mark.parametrize("domain", ["", MS])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_axis", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 40, 40), (1, 128, 768)])
def test_quantize_dequantize_same_bits_as_numpy(monkeypatch, domain, dtype, per_axis, shape):
    rng = np.random.default_rng(shape[1] + per_axis)
    channels = shape[1]
    if per_axis:
        scale = (rng.random(channels) * 0.05 + 0.001).astype(np.float32)
        zero = codes(rng, dtype, channels)
        view = [1] * len(shape)
        view[1] = channels
        x = quantize_data(rng, shape, scale.reshape(view))
    else:
        scale, zero = f32(0.0125), np.array(7, dtype)
        x = quantize_data(rng, shape, scale)
    params = [("s", Const(scale)), ("z", Const(zero))]
    model, feeds = node_model("QuantizeLinear", [("x", x)] + params, [dtype], domain=domain,
                              axis=1)
    q = assert_same_bits(monkeypatch, model, feeds)["y0"]
    model, feeds = node_model("DequantizeLinear", [("q", q)] + params, [np.float32],
                              domain=domain, axis=1)
    assert_same_bits(monkeypatch, model, feeds)
    if domain == "":   # onnxruntime's ONNX kernels, on finite values
        x[~np.isfinite(x)] = 0
        model, feeds = node_model("QuantizeLinear", [("x", x)] + params, [dtype], domain="",
                                  axis=1)
        against_onnxruntime(monkeypatch, model, feeds)
        model, feeds = node_model("DequantizeLinear", [("q", q)] + params, [np.float32],
                                  domain="", axis=1)
        against_onnxruntime(monkeypatch, model, feeds)


def test_quantize_without_zero_point_and_negative_axis(monkeypatch):
    rng = np.random.default_rng(11)
    scale = (rng.random(40) * 0.05 + 0.001).astype(np.float32)
    x = quantize_data(rng, (3, 5, 40), scale)
    for domain in ("", MS):
        model, feeds = node_model("QuantizeLinear", [("x", x), ("s", Const(f32(0.02)))],
                                  [np.uint8], domain=domain)
        assert_same_bits(monkeypatch, model, feeds)
        model, feeds = node_model("QuantizeLinear", [("x", x), ("s", Const(scale)),
                                                     ("z", Const(np.zeros(40, np.int8)))],
                                  [np.int8], domain=domain, axis=-1)
        assert_same_bits(monkeypatch, model, feeds)


@pytest.mark.parametrize("case", ["normal", "halves", "positive", "zeros", "nan", "tiny"])
def test_dynamic_quantize_linear(monkeypatch, case):
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((4, 128, 96)) * 3).astype(np.float32)
    if case == "halves":   # range [-1.5, 1]: scale 2.5 / 255, many exact halves of it
        x = (rng.integers(-153, 103, x.shape) * np.float32(2.5 / 255) / 2).astype(np.float32)
        x.reshape(-1)[:2] = [-1.5, 1.0]
    elif case == "positive":
        x = np.abs(x) + np.float32(1)
    elif case == "zeros":
        x[:] = 0
    elif case == "nan":
        x.reshape(-1)[5] = np.nan
    elif case == "tiny":
        x = x * np.float32(1e-38)
    model, feeds = node_model("DynamicQuantizeLinear", [("x", x)],
                              [np.uint8, np.float32, np.uint8], domain="", opset=11)
    fast, slow = compiled_and_numpy_any(monkeypatch, model, feeds,
                                        case != "nan")   # a NaN range: numpy's zeros
    for name in slow:
        assert np.array_equal(bits(fast[name]), bits(slow[name])), name
    if case in ("normal", "halves", "positive"):
        against_onnxruntime(monkeypatch, model, feeds)


def compiled_and_numpy_any(monkeypatch, model, feeds, compiled_route):
    """compiled_and_numpy where the data decides whether the compiled loop may serve."""
    if compiled_route:
        return compiled_and_numpy(monkeypatch, model, feeds)
    session = ember.load(model, "cpu")
    results = []
    for least in (1, NUMPY):
        set_thresholds(monkeypatch, least)
        results.append(session.run(feeds))
        assert [k for _, _, k, _ in session.kernels] == ["numpy"]
    return results


# ---------------------------------------------------------------------------- lookups, pools


@pytest.mark.parametrize("op,attrs", [("QLinearSigmoid", {}),
                                      ("QLinearLeakyRelu", {"alpha": 0.1})])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_lookup_same_bits_as_numpy(monkeypatch, op, attrs, dtype):
    rng = np.random.default_rng(13)
    x = codes(rng, dtype, (2, 32, 30, 30))
    zero = np.array(3, dtype)
    model, feeds = node_model(op, [("x", x), ("sx", Const(f32(0.05))), ("zx", Const(zero)),
                                   ("sy", Const(f32(0.004))), ("zy", Const(zero))], [dtype],
                              **attrs)
    assert_same_bits(monkeypatch, model, feeds)
    against_onnxruntime(monkeypatch, model, feeds, steps=1)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("shape", [(2, 64, 7, 7), (1, 16, 56, 56), (2, 8, 5, 6, 7)])
def test_global_average_pool_same_bits_as_numpy(monkeypatch, dtype, channels_last, shape):
    rng = np.random.default_rng(14)
    x = codes(rng, dtype, shape)
    zx, zy = np.array(-5 if dtype == np.int8 else 120, dtype), np.array(9, dtype)
    # y_scale a power of two times x_scale: averages on halves of a step, rounded to even
    for sx, sy in ((0.05, 0.05 * 2 ** -6), (0.0173, 0.0061)):
        model, feeds = node_model("QLinearGlobalAveragePool",
                                  [("x", x), ("sx", Const(f32(sx))), ("zx", Const(zx)),
                                   ("sy", Const(f32(sy))), ("zy", Const(zy))], [dtype],
                                  channels_last=channels_last)
        assert_same_bits(monkeypatch, model, feeds)
        if len(shape) == 4:
            against_onnxruntime(monkeypatch, model, feeds, steps=1)


# ---------------------------------------------------------------------------- plan, threads


def test_the_plan_names_the_compiled_loops():
    """Static shapes large enough for the loops: the plan names them before any run; a
    shape broadcast in more than three runs, or a small tensor, is numpy's."""
    rng = np.random.default_rng(15)
    big = codes(rng, np.uint8, (1, 64, 32, 32))
    params = [(0.02, 100), (0.03, 120), (0.05, 128)]
    for b, kernel in ((big, "cpu.compiled"), (codes(rng, np.uint8, (64, 1, 1)), "cpu.compiled"),
                      (codes(rng, np.uint8, (1, 64, 1, 32)), "cpu.compiled")):
        model, _ = binary_model("QLinearAdd", np.uint8, big, b, params)
        assert [k for _, _, k, _ in ember.load(model, "cpu").kernels] == [kernel]
    small = codes(rng, np.uint8, (2, 8, 8))
    model, _ = binary_model("QLinearMul", np.uint8, small, small, params)
    assert [k for _, _, k, _ in ember.load(model, "cpu").kernels] == ["numpy"]
    odd = codes(rng, np.uint8, (2, 16, 8, 16, 16))
    model, _ = binary_model("QLinearMul", np.uint8, odd, codes(rng, np.uint8, (2, 1, 8, 1, 16)),
                            params)
    assert [k for _, _, k, _ in ember.load(model, "cpu").kernels] == ["numpy"]


def test_threads_sharing_a_session_give_the_sequential_bits():
    """QuantizeLinear -> QLinearAdd (with itself) -> QLinearSigmoid -> DequantizeLinear, from
    4 threads at once."""
    rng = np.random.default_rng(16)
    s, z = Const(f32(0.03)), Const(np.array(128, np.uint8))
    inits = {"s": s, "z": z}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("QLinearAdd", ["q", "s", "z", "q", "s", "z", "s", "z"], ["a"],
                              domain=MS),
             helper.make_node("QLinearSigmoid", ["a", "s", "z", "s", "z"], ["g"], domain=MS),
             helper.make_node("DequantizeLinear", ["g", "s", "z"], ["y"])]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 64, 56, 56])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [numpy_helper.from_array(v.value, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(MS, 1)])
    x = rng.standard_normal((1, 64, 56, 56)).astype(np.float32) * 2
    session = ember.load(model, "cpu")
    want = session.run({"x": x})["y"]
    assert [k for _, _, k, _ in session.kernels] == ["cpu.compiled"] * 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: session.run({"x": x})["y"], range(8)))
    for result in results:
        np.testing.assert_array_equal(result, want)
