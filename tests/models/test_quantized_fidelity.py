"""Models quantized by onnxruntime.quantization give onnxruntime's answers on ember (issue 43).

Three tiny torch models (a MobileNetV2-style CNN: conv / BN / ReLU6 / inverted residual /
average pool / linear; a BERT encoder; a CRNN: convolutions, an LSTM, a linear head) are
exported and quantized with onnxruntime's tools: quantize_static in the QDQ format (per tensor
and per channel) and the QOperator format, and quantize_dynamic (the BERT after onnxruntime's
transformer optimizer, so that it holds QAttention, QEmbedLayerNormalization and
MatMulInteger; the CRNN holds ConvInteger and com.microsoft DynamicQuantizeLSTM).

The oracle is onnxruntime's CPU provider with its default options. The bars:
* QOperator and QDQ: bit-exact, the QDQ files on every QuantizeLinear output inside the
  model as well as at the output (the CNN is wide enough that a float sum in another order
  moves a code there). onnxruntime runs a QDQ file's DequantizeLinear -> op -> QuantizeLinear
  units as integer kernels (its default optimisation level), and so does ember (simplifier
  pass fuse_qdq). The graph as written (`simplify=False`: the float op between dequantise and
  quantise, whose summation order the ONNX spec leaves open) must stay within one code of
  onnxruntime everywhere, and within one quantum at the output (the scale of the
  DequantizeLinear producing it), with and without onnxruntime's graph optimisations.
* Dynamic: the CRNN bit-exact. In every dynamic model each integer node
  (DynamicQuantizeLinear, MatMulInteger, ConvInteger, QEmbedLayerNormalization,
  DynamicQuantizeLSTM) gives onnxruntime's bits when fed onnxruntime's own inputs (each node
  run alone).
* Float islands: where the output comes through float ops that onnxruntime runs in its own
  MLAS float order (the BERTs' LayerNormalization / SkipLayerNormalization / Erf / BiasGelu /
  QAttention softmax, the dynamic CNN's GlobalAveragePool), those may round differently, and
  a DynamicQuantizeLinear after them may then see a scale one ulp off: the output must be
  within 1e-5 of its largest magnitude (one flipped activation code moves it by about
  a_scale * b_scale * |B|, near 1e-3 relative here, so 1e-5 rules out any flipped code), and
  every integer value inside a QOperator model must be bit-exact.
* DynamicQuantizeLSTM quantises the hidden state once per step over the rows one thread
  handles: onnxruntime splits the batch over its intra-op threads (batch > 4, or >= 2 with
  hidden <= 256), so its bits depend on its thread count. ember follows the one-thread
  grouping: the CRNN is compared with onnxruntime at intra_op_num_threads=1, and at the
  default options with a batch of one, where the grouping cannot matter.
Runs on the CPU backend and on OpenCL (PoCL) when present; OpenCL has no kernels for the
integer ops and runs them through its host fallback, so it must give the same bits.
"""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

import ember
from backends import unavailable_reason

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
quantization = pytest.importorskip("onnxruntime.quantization")
optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
from onnx import numpy_helper  # noqa: E402
from onnxruntime.transformers.fusion_options import FusionOptions  # noqa: E402

from test_ort_optimized_models import HEADS, HIDDEN, export_bert  # noqa: E402

nn = torch.nn
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::torch.jit.TracerWarning",
                                        "ignore::UserWarning")
BACKENDS = ["cpu", pytest.param("opencl", marks=pytest.mark.skipif(
    unavailable_reason("opencl") is not None, reason=str(unavailable_reason("opencl"))))]
ort.set_default_logger_severity(3)


# --------------------------------------------------------------------------------------------
# models


CNN_WIDTH = 4  # wide enough that float sums in another order move some requantised values


def _cbr(cin, cout, kernel=3, stride=1, groups=1):
    return [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout), nn.ReLU6()]


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(*_cbr(cin, hidden, 1), *_cbr(hidden, hidden, 3, stride, hidden),
                                  nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetish(nn.Module):
    def __init__(self, w=CNN_WIDTH):
        super().__init__()
        self.features = nn.Sequential(*_cbr(3, 8 * w, 3, 2), InvertedResidual(8 * w, 8 * w, 1, 4),
                                      InvertedResidual(8 * w, 12 * w, 2, 4),
                                      InvertedResidual(12 * w, 12 * w, 1, 4),
                                      *_cbr(12 * w, 32 * w, 1))
        self.head = nn.Linear(32 * w, 10)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.head(torch.flatten(x, 1))


class CRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d((2, 1)))
        self.rnn = nn.LSTM(16 * 4, 24, bidirectional=True)
        self.fc = nn.Linear(48, 12)

    def forward(self, x):
        f = self.cnn(x)
        n, c, h, w = f.shape
        y, _ = self.rnn(f.permute(3, 0, 1, 2).reshape(w, n, c * h))
        return self.fc(y)


def _randomize_batchnorm(model):
    """Non-trivial BatchNorm statistics (the exporter folds them into the convolutions)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def _export_image_model(model, shape, path):
    torch.onnx.export(model, torch.randn(*shape), str(path), input_names=["x"],
                      output_names=["y"], opset_version=13, dynamo=False,
                      dynamic_axes={"x": {0: "n"}})


def _image_feeds(shape, seed):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


class Reader(quantization.CalibrationDataReader):
    """A few calibration batches."""

    def __init__(self, batches):
        self.batches = iter(batches)

    def get_next(self):
        return next(self.batches, None)


# --------------------------------------------------------------------------------------------
# the quantized files, each made once


CNN_SHAPE, CRNN_SHAPE = (4, 3, 32, 32), (2, 1, 16, 20)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    cache = {}

    def make(name):
        if name not in cache:
            cache[name] = _make(root, name)
        return cache[name]

    return make


def _float_model(root, model):
    """(float file, feeds, calibration batches) of a model, exported once."""
    path = root / f"{model}.onnx"
    if model == "bert":
        feeds, _ = export_bert(path)
        calibration = [feeds]
        return path, feeds, calibration
    torch.manual_seed(0)
    if model == "cnn":
        _export_image_model(_randomize_batchnorm(MobileNetish().eval()), CNN_SHAPE, path)
        shape = CNN_SHAPE
    else:
        _export_image_model(CRNN().eval(), CRNN_SHAPE, path)
        shape = CRNN_SHAPE
    calibration = [_image_feeds(shape, seed) for seed in range(4)]
    return path, _image_feeds(shape, 99), calibration


def _make(root, name):
    """name = model_format, e.g. cnn_qdq_pc: (path, feeds)."""
    model, fmt = name.split("_", 1)
    src, feeds, calibration = _float_model(root, model)
    dst = root / f"{name}.onnx"
    per_channel = fmt.endswith("_pc")
    if fmt.startswith("dyn"):
        if model == "bert":  # the transformer optimizer first: fused attention and norms
            fused = root / "bert_fused.onnx"
            optimizer.optimize_model(str(src), model_type="bert", num_heads=HEADS,
                                     hidden_size=HIDDEN, opt_level=1, use_gpu=False,
                                     optimization_options=FusionOptions("bert")
                                     ).save_model_to_file(str(fused))
            src = fused
        quantization.quantize_dynamic(
            str(src), str(dst), weight_type=quantization.QuantType.QInt8,
            per_channel=per_channel,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    else:
        quantization.quantize_static(
            str(src), str(dst), Reader(calibration),
            quant_format=getattr(quantization.QuantFormat,
                                 "QDQ" if fmt.startswith("qdq") else "QOperator"),
            per_channel=per_channel, activation_type=quantization.QuantType.QUInt8,
            weight_type=quantization.QuantType.QInt8)
    return dst, feeds


def ort_run(model, feeds, threads=0, optimized=True):
    """onnxruntime's outputs for a model (a path or serialized bytes)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    model = model if isinstance(model, bytes) else str(model)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def op_types(path):
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def output_quantum(path, output):
    """The scale of the DequantizeLinear that produces `output`."""
    model = onnx.load(str(path))
    producer = next(n for n in model.graph.node if output in n.output)
    assert producer.op_type == "DequantizeLinear", producer.op_type
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return float(inits[producer.input[1]].max())


def assert_bits(got, want, what):
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, name)
        diff = np.abs(g.astype(np.float64) - w)
        assert np.array_equal(g, w), \
            f"{what}:{name}: {int((diff > 0).sum())} elements differ, by up to {diff.max():.3g}"


def assert_quanta(got, want, quantum, what):
    for name, w in want.items():
        steps = np.abs(got[name].astype(np.float64) - w) / quantum
        assert steps.max() <= 1.001, f"{what}:{name}: off by {steps.max():.2f} quanta"


# --------------------------------------------------------------------------------------------
# QOperator and QDQ


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["cnn_qop_pt", "cnn_qop_pc", "crnn_qop_pt"])
def test_qoperator_bit_exact(files, name, backend):
    path, feeds = files(name)
    ops = op_types(path)
    assert ops["QLinearConv"] + ops["QLinearMatMul"] > 0, ops
    assert_bits(ember.load(str(path), backend=backend).run(feeds), ort_run(path, feeds),
                f"{backend}:{name}")


def with_quantized_outputs(path):
    """The model with every QuantizeLinear output (but the input's) also a graph output, so
    that a code that differs anywhere is seen, not only where it reaches the output."""
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    names = []
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] != "x":
            names.append(node.output[0])
            model.graph.output.append(onnx.helper.make_tensor_value_info(
                node.output[0], inits[node.input[2]].data_type, None))
    return model.SerializeToString(), names


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["cnn_qdq_pt", "cnn_qdq_pc", "crnn_qdq_pt"])
def test_qdq_matches_onnxruntime(files, name, backend):
    path, feeds = files(name)
    model, codes = with_quantized_outputs(path)
    assert len(codes) > 5
    want = ort_run(model, feeds)
    got = ember.load(model, backend=backend).run(feeds)
    assert_bits(got, want, f"{backend}:{name}")
    literal = ember.load(model, backend=backend, simplify=False).run(feeds)
    for code in codes:  # the float graph as written: a code may round the other way
        steps = np.abs(literal[code].astype(np.int64) - want[code])
        assert steps.max() <= 1, f"{backend}:{name}:{code}: off by {steps.max()} codes"
    # at the output: the graph as written and onnxruntime without its fusions, one quantum
    quantum = output_quantum(path, "y")
    unfused = {"y": ort_run(path, feeds, optimized=False)["y"]}
    assert_quanta(literal, {"y": want["y"]}, quantum, f"{backend}:{name} simplify=False")
    assert_quanta(literal, unfused, quantum, f"{backend}:{name} simplify=False vs unfused")
    assert_quanta(got, unfused, quantum, f"{backend}:{name} vs unfused")


def test_qdq_fused_into_integer_ops(files):
    """The simplified model holds onnxruntime's integer ops, and no float Conv/MatMul left
    between a DequantizeLinear and a QuantizeLinear."""
    path, _ = files("cnn_qdq_pc")
    simplified = ember.simplify(str(path), target="ember")
    ops = collections.Counter(n.op_type for n in simplified.graph.node)
    assert ops["QLinearConv"] and ops["QLinearAdd"] and ops["QGemm"], ops
    assert ops["QLinearGlobalAveragePool"] and not ops["Conv"], ops
    portable = collections.Counter(n.op_type for n in ember.simplify(str(path)).graph.node)
    assert portable["QLinearConv"] and not portable["QLinearAdd"], portable  # standard only


# --------------------------------------------------------------------------------------------
# dynamic


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["crnn_dyn_pt", "crnn_dyn_pc"])
def test_dynamic_lstm_bit_exact(files, name, backend):
    path, feeds = files(name)
    ops = op_types(path)
    assert ops["DynamicQuantizeLinear"] and ops["ConvInteger"] and ops["DynamicQuantizeLSTM"]
    session = ember.load(str(path), backend=backend)
    # onnxruntime's LSTM groups the batch by its thread count: one thread, ember's grouping
    assert_bits(session.run(feeds), ort_run(path, feeds, threads=1), f"{backend}:{name}")
    one = {"x": feeds["x"][:1]}  # a batch of one: the grouping cannot matter, default options
    assert_bits(session.run(one), ort_run(path, one), f"{backend}:{name} batch 1")


INTEGER_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
               "QEmbedLayerNormalization", "DynamicQuantizeLSTM"}


def _every_value(path, feeds):
    """onnxruntime's value of every node output (graph optimisations off, so each node of the
    file runs as written; one thread, for DynamicQuantizeLSTM's grouping)."""
    model = onnx.load(str(path))
    known = {o.name for o in model.graph.output}
    for node in model.graph.node:
        model.graph.output.extend(onnx.ValueInfoProto(name=o) for o in node.output
                                  if o and o not in known)
        known.update(node.output)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    values.update(feeds)
    return model, values


def _alone(model, node, values):
    """`node` as a model of its own, its non-constant inputs fed from `values`."""
    inits = {i.name: i for i in model.graph.initializer}
    used = [n for n in node.input if n]
    fed = [n for n in used if n not in inits]
    graph = onnx.helper.make_graph(
        [node], "alone", [onnx.ValueInfoProto(name=n) for n in fed],
        [onnx.ValueInfoProto(name=o) for o in node.output if o],
        [inits[n] for n in used if n in inits])
    for info, name in zip(graph.input, fed):
        info.CopyFrom(onnx.helper.make_tensor_value_info(
            name, onnx.helper.np_dtype_to_tensor_dtype(values[name].dtype), None))
    single = onnx.helper.make_model(graph, opset_imports=model.opset_import)
    single.ir_version = model.ir_version
    return single, {n: values[n] for n in fed}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["bert_dyn_pt", "bert_dyn_pc", "cnn_dyn_pc", "crnn_dyn_pc"])
def test_dynamic_integer_nodes_alone(files, name, backend):
    """Each integer node, fed onnxruntime's own inputs, gives onnxruntime's bits."""
    path, feeds = files(name)
    model, values = _every_value(path, feeds)
    checked = collections.Counter()
    for node in model.graph.node:
        if node.op_type not in INTEGER_OPS:
            continue
        single, inputs = _alone(model, node, values)
        got = ember.load(single.SerializeToString(), backend=backend).run(inputs)
        assert_bits(got, {o: values[o] for o in node.output if o}, f"{backend}:{node.name}")
        checked[node.op_type] += 1
    expected = {"bert": {"QEmbedLayerNormalization", "MatMulInteger", "DynamicQuantizeLinear"},
                "cnn": {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"},
                "crnn": {"DynamicQuantizeLSTM", "ConvInteger"}}[name.split("_")[0]]
    assert expected <= set(checked), checked


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["bert_dyn_pt", "bert_dyn_pc", "cnn_dyn_pt", "cnn_dyn_pc",
                                  "bert_qdq_pt", "bert_qdq_pc", "bert_qop_pc"])
def test_float_islands_end_to_end(files, name, backend):
    """Models whose output passes through float ops onnxruntime runs in its own float order
    (the BERTs' LayerNormalization / SkipLayerNormalization / Erf / softmax, the dynamic
    CNN's GlobalAveragePool): within float rounding, no flipped activation code."""
    path, feeds = files(name)
    ops = op_types(path)
    if name == "bert_dyn_pt":
        assert ops["QAttention"] and ops["QEmbedLayerNormalization"] and ops["MatMulInteger"]
    want = ort_run(path, feeds)["y"].astype(np.float64)
    got = ember.load(str(path), backend=backend).run(feeds)["y"]
    error = np.abs(got - want).max() / np.abs(want).max()
    assert math.isfinite(error) and error <= 1e-5, f"{backend}:{name}: relative error {error:.3g}"


@pytest.mark.parametrize("name", ["bert_qop_pc", "cnn_qop_pc"])
def test_qoperator_integer_values(files, name):
    """Every integer value inside a QOperator model is onnxruntime's, float islands or not."""
    path, feeds = files(name)
    model, want = _every_value(path, feeds)
    got = ember.load(model.SerializeToString(), backend="cpu", simplify=False).run(feeds)
    integers = {k: v for k, v in want.items() if v.dtype.kind in "iu" and k not in feeds}
    assert len(integers) > 10
    assert_bits(got, integers, name)


def test_qlinear_matmul_requantizes_as_onnxruntime():
    """QLinearMatMul's requantisation in float32 as onnxruntime does it: 512 x 512 codes whose
    products land near half-codes, so a requantisation in float64 moves some of them."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    b = rng.integers(-128, 128, (256, 512), dtype=np.int8)
    inits = [numpy_helper.from_array(np.array(s, np.float32), n) for n, s in
             (("as", 0.0173), ("bs", 0.0091), ("ys", 0.731))]
    inits += [numpy_helper.from_array(np.array(z, dt), n) for n, z, dt in
              (("az", 3, np.uint8), ("bz", 0, np.int8), ("yz", 121, np.uint8))]
    inits.append(numpy_helper.from_array(b, "b"))
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    graph = helper.make_graph([node], "qmm", [helper.make_tensor_value_info(
        "a", TensorProto.UINT8, [512, 256])], [helper.make_tensor_value_info(
        "y", TensorProto.UINT8, [512, 512])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    a = rng.integers(0, 256, (512, 256), dtype=np.uint8)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    got = ember.load(model, backend="cpu").run({"a": a})
    assert_bits(got, {"y": want}, "QLinearMatMul")


def _qlinear_add(shape_a, shape_b, params):
    from onnx import TensorProto, helper

    names = ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"]
    inits = [numpy_helper.from_array(np.array(v), n) for n, v in zip(names[1:3] + names[4:], params)]
    node = helper.make_node("QLinearAdd", names, ["c"], domain="com.microsoft")
    graph = helper.make_graph([node], "qadd", [
        helper.make_tensor_value_info("a", TensorProto.UINT8, shape_a),
        helper.make_tensor_value_info("b", TensorProto.UINT8, shape_b)],
        [helper.make_tensor_value_info("c", TensorProto.UINT8, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


# Residual Adds' parameters from a real-size QDQ MobileNetV2 (float32 bits of the A, B and C
# scales; the A, B and C zero points), each of which moved one code in the 65,536 pairs when
# the sum was formed in another order than onnxruntime's kernel.
_ADD_PARAMETERS = [((1002358074, 1004555017, 1007811644), (104, 114, 121)),
                   ((1011397394, 1004078137, 1012608007), (127, 146, 101)),
                   ((1012283499, 1007240464, 1012353708), (154, 138, 140))]


@pytest.mark.parametrize("bits,zeros", _ADD_PARAMETERS)
def test_qlinear_add_every_code_pair_as_onnxruntime(bits, zeros):
    """QLinearAdd on all 256 x 256 pairs of codes, same shapes and with either side broadcast
    along the innermost axis: onnxruntime's bits."""
    scales = np.array(bits, np.uint32).view(np.float32)
    params = [scales[0], np.uint8(zeros[0]), scales[1], np.uint8(zeros[1]), scales[2],
              np.uint8(zeros[2])]
    a = np.repeat(np.arange(256, dtype=np.uint8), 256).reshape(256, 256)
    b = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(256, 256)
    for fa, fb in ((a, b), (a, b[:, :1]), (a[:, :1], b), (a, b[:1, :1])):
        model = _qlinear_add(list(fa.shape), list(fb.shape), params)
        want = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"a": fa, "b": fb})
        got = ember.load(model, backend="cpu").run({"a": fa, "b": fb})
        assert_bits(got, {"c": want[0]}, f"QLinearAdd {fa.shape} + {fb.shape}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["cnn_qdq_pc", "cnn_qop_pc", "crnn_dyn_pc"])
def test_a_shared_session_gives_each_thread_onnxruntimes_bits(files, name, backend):
    """One session run from 4 threads at once on different inputs: each result has the bits of
    onnxruntime and of the same session run alone (the integer kernels keep weights they
    prepare once, read by every thread)."""
    import concurrent.futures

    path, feeds = files(name)
    shape = next(iter(feeds.values())).shape
    inputs = [{k: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
               for k in feeds} for seed in range(8)]
    session = ember.load(path, backend=backend)
    sequential = [session.run(f) for f in inputs]
    fresh = ember.load(path, backend=backend)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(fresh.run, inputs))
    threads = 1 if name.startswith("crnn_dyn") else 0  # onnxruntime's LSTM chunks by threads
    for i, (alone, shared) in enumerate(zip(sequential, together)):
        assert_bits(shared, alone, f"{backend}:{name}: input {i}, shared against alone")
        assert_bits(shared, ort_run(path, inputs[i], threads=threads),
                    f"{backend}:{name}: input {i}, against onnxruntime")
