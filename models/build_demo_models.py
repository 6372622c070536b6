"""Build ember's demo models with onnx.helper and numpy (no downloads, deterministic).

    python models/build_demo_models.py            # writes models/*.onnx next to this script

- mlp.onnx:         burn's book example, Linear(4, 2) after a hidden Linear(4, 4) + ReLU
- cnn.onnx:         a small CNN: Conv-BN-ReLU x2, MaxPool, global average pool, Gemm classifier
- transformer.onnx: one transformer encoder block (multi-head self-attention with a padding
                    mask, LayerNormalization, erf-GELU MLP), symbolic batch and sequence sizes
"""
from __future__ import annotations

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = 17


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    array = np.asarray(array)
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # demo weights are float32 throughout
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="ember-demo", producer_version="1")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def build_mlp(rng: np.random.Generator) -> onnx.ModelProto:
    w1 = rng.standard_normal((4, 4)).astype(np.float32) * 0.5
    b1 = rng.standard_normal(4).astype(np.float32) * 0.1
    w2 = rng.standard_normal((2, 4)).astype(np.float32) * 0.5  # Linear(4, 2): weight [out, in]
    b2 = rng.standard_normal(2).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["h_relu"], name="relu"),
        helper.make_node("Gemm", ["h_relu", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [_init("w1", w1), _init("b1", b1), _init("w2", w2), _init("b2", b2)])
    return _model(graph)


def build_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    inits, nodes = [], []

    def conv_bn_relu(x: str, cin: int, cout: int, tag: str) -> str:
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2 / (cin * 9))).astype(np.float32)
        inits.extend([
            _init(f"{tag}_w", w),
            _init(f"{tag}_b", np.zeros(cout, np.float32)),
            _init(f"{tag}_scale", (1 + 0.1 * rng.standard_normal(cout)).astype(np.float32)),
            _init(f"{tag}_bias", (0.1 * rng.standard_normal(cout)).astype(np.float32)),
            _init(f"{tag}_mean", (0.1 * rng.standard_normal(cout)).astype(np.float32)),
            _init(f"{tag}_var", (1 + 0.1 * rng.random(cout)).astype(np.float32)),
        ])
        nodes.extend([
            helper.make_node("Conv", [x, f"{tag}_w", f"{tag}_b"], [f"{tag}_conv"], name=f"{tag}_conv",
                             pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
            helper.make_node("BatchNormalization", [f"{tag}_conv", f"{tag}_scale", f"{tag}_bias",
                                                    f"{tag}_mean", f"{tag}_var"], [f"{tag}_bn"],
                             name=f"{tag}_bn"),
            helper.make_node("Relu", [f"{tag}_bn"], [f"{tag}_out"], name=f"{tag}_relu"),
        ])
        return f"{tag}_out"

    h = conv_bn_relu("image", 3, 8, "block1")
    nodes.append(helper.make_node("MaxPool", [h], ["pooled"], name="pool", kernel_shape=[2, 2],
                                  strides=[2, 2]))
    h = conv_bn_relu("pooled", 8, 16, "block2")
    nodes.append(helper.make_node("GlobalAveragePool", [h], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["features"], name="flatten"))
    inits.append(_init("fc_w", rng.standard_normal((10, 16)).astype(np.float32) * 0.25))
    inits.append(_init("fc_b", np.zeros(10, np.float32)))
    nodes.append(helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], name="fc",
                                  transB=1))
    graph = helper.make_graph(
        nodes, "small_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    return _model(graph)


def build_transformer(rng: np.random.Generator, d_model: int = 32, heads: int = 4,
                      d_ff: int = 64) -> onnx.ModelProto:
    head_dim = d_model // heads
    inits, nodes = [], []

    def weight(name: str, shape: tuple[int, ...], scale: float = 0.1) -> str:
        inits.append(_init(name, (scale * rng.standard_normal(shape)).astype(np.float32)))
        return name

    def const(name: str, value) -> str:
        inits.append(_init(name, np.asarray(value)))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    x = "tokens"  # [batch, seq, d_model]
    # Padding mask [batch, seq] of 1 (keep) / 0 (pad) -> additive bias [batch, 1, 1, seq].
    mask_f = node("Cast", ["mask"], "mask_f", to=TensorProto.FLOAT)
    inv = node("Sub", [const("one", np.float32(1)), mask_f], "mask_inv")
    bias = node("Mul", [inv, const("neg_big", np.float32(-1e9))], "mask_bias")
    bias4 = node("Unsqueeze", [bias, const("mask_axes", np.array([1, 2], np.int64))], "mask_bias4")

    split_shape = const("split_shape", np.array([0, 0, heads, head_dim], np.int64))
    perm = [0, 2, 1, 3]

    def project(tag: str) -> str:
        mm = node("MatMul", [x, weight(f"w_{tag}", (d_model, d_model))], f"{tag}_mm")
        biased = node("Add", [mm, weight(f"b_{tag}", (d_model,))], f"{tag}_proj")
        heads_ = node("Reshape", [biased, split_shape], f"{tag}_heads")
        return node("Transpose", [heads_], f"{tag}_t", perm=perm)  # [b, h, s, hd]

    q, k, v = project("q"), project("k"), project("v")
    kt = node("Transpose", [k], "k_tt", perm=[0, 1, 3, 2])
    scores = node("MatMul", [q, kt], "scores")
    scaled = node("Mul", [scores, const("scale", np.float32(1 / np.sqrt(head_dim)))], "scaled")
    masked = node("Add", [scaled, bias4], "masked")
    probs = node("Softmax", [masked], "probs", axis=-1)
    ctx = node("MatMul", [probs, v], "context")
    ctx_t = node("Transpose", [ctx], "context_t", perm=perm)
    merged = node("Reshape", [ctx_t, const("merge_shape", np.array([0, 0, d_model], np.int64))],
                  "context_merged")
    attn = node("Add", [node("MatMul", [merged, weight("w_o", (d_model, d_model))], "o_mm"),
                        weight("b_o", (d_model,))], "attn_out")
    res1 = node("Add", [x, attn], "residual1")
    ln1 = node("LayerNormalization", [res1, const("ln1_g", np.ones(d_model, np.float32)),
                                      const("ln1_b", np.zeros(d_model, np.float32))], "ln1",
               axis=-1, epsilon=1e-5)
    # GELU, erf form: 0.5 * x * (1 + erf(x / sqrt(2)))
    ff1 = node("Add", [node("MatMul", [ln1, weight("w_ff1", (d_model, d_ff))], "ff1_mm"),
                       weight("b_ff1", (d_ff,))], "ff1")
    erf = node("Erf", [node("Div", [ff1, const("sqrt2", np.float32(np.sqrt(2)))], "ff1_div")],
               "ff1_erf")
    gelu = node("Mul", [node("Mul", [ff1, const("half", np.float32(0.5))], "ff1_half"),
                        node("Add", [erf, "one"], "ff1_erf1")], "gelu")
    ff2 = node("Add", [node("MatMul", [gelu, weight("w_ff2", (d_ff, d_model))], "ff2_mm"),
                       weight("b_ff2", (d_model,))], "ff2")
    res2 = node("Add", [ln1, ff2], "residual2")
    node("LayerNormalization", [res2, const("ln2_g", np.ones(d_model, np.float32)),
                                const("ln2_b", np.zeros(d_model, np.float32))], "encoded",
         axis=-1, epsilon=1e-5)
    graph = helper.make_graph(
        nodes, "transformer_encoder_block",
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "seq", d_model]),
         helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("encoded", TensorProto.FLOAT, ["batch", "seq", d_model])],
        inits)
    return _model(graph)


BUILDERS = {"mlp": build_mlp, "cnn": build_cnn, "transformer": build_transformer}


def build_all(out_dir: str = HERE) -> list[str]:
    paths = []
    for i, (name, build) in enumerate(BUILDERS.items()):
        model = build(np.random.default_rng(1000 + i))
        path = os.path.join(out_dir, f"{name}.onnx")
        onnx.save(model, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build_all(sys.argv[1] if len(sys.argv) > 1 else HERE):
        print("wrote", p)
