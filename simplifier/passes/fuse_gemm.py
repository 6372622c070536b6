"""MatMul followed by the Add of a constant bias: Gemm when A is a matrix, else
ai.ember::FusedMatMul (any rank, bias over the last axis). And a constant per-column scale
after a matrix product folded into its weights (float16 and bfloat16 ones only where the
scaled weights are exact: graph.folds_exactly)."""
from __future__ import annotations

import numpy as np

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.ops.fused import DOMAIN
from ember.simplifier.graph import GraphIndex, drop_dead, folds_exactly


def fuse_matmul_add(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for add in index.live("Add"):
        if len(add.inputs) != 2:
            continue
        for side in (0, 1):
            matmul = index.single_use_producer(add.inputs[side], "MatMul")
            bias_name = add.inputs[1 - side]
            if matmul is None or not _fits(matmul, index, bias_name):
                continue
            fused = _fused_node(matmul, bias_name, add.outputs[0], index, ctx)
            if fused is None:
                continue
            graph.nodes.append(fused)
            index.kill(matmul, add)
            changed = True
            break
    drop_dead(graph, index)
    return changed


def _fits(matmul: Node, index: GraphIndex, bias_name: str) -> bool:
    """A constant float B matrix and a bias that only spans B's columns."""
    b = index.constant(matmul.inputs[1])
    bias = index.constant(bias_name)
    if b is None or bias is None or b.ndim != 2 or b.dtype.kind != "f" or bias.dtype != b.dtype:
        return False
    n = b.shape[1]
    if bias.size != n or bias.ndim < 1 or bias.shape[-1] != n:
        return False
    a_rank = index.rank(matmul.inputs[0])
    return a_rank is not None and a_rank >= max(bias.ndim, 1) and index.dtype(
        matmul.inputs[0]) == b.dtype


def _fused_node(matmul: Node, bias_name: str, out: str, index: GraphIndex,
                ctx: Context) -> Node | None:
    a, b = matmul.inputs
    if index.rank(a) == 2 and ctx.has_kernel("", "Gemm", ctx.opset("")) and ctx.opset("") >= 7:
        bias = index.constant(bias_name)
        if bias.ndim == 1 or bias.ndim == 2:
            return Node("Gemm", "", ctx.opset(""), [a, b, bias_name], [out],
                        name=matmul.name + "_gemm" if matmul.name else "")
    if not ctx.has_kernel(DOMAIN, "FusedMatMul", 1):
        return None
    return Node("FusedMatMul", DOMAIN, 1, [a, b, bias_name], [out],
                name=matmul.name + "_fused" if matmul.name else "")



_SCALABLE = {("", "MatMul"), ("", "Gemm"), (DOMAIN, "FusedMatMul")}


def fold_scale_into_matmul(graph: Graph, ctx: Context) -> bool:
    """(A @ B + bias) * g with a constant g per output column (a layer scale): B and bias are
    scaled once instead, and the Mul disappears."""
    index = GraphIndex(graph)
    changed = False
    for mul in index.live("Mul"):
        if len(mul.inputs) != 2:
            continue
        for side in (0, 1):
            product = index.single_use_producer(mul.inputs[side])
            scale = index.constant(mul.inputs[1 - side])
            if product is None or scale is None or not _scalable(product, index, scale):
                continue
            weight = index.constant(product.inputs[1])
            column_scale = scale.reshape(-1)
            product.inputs = list(product.inputs)
            product.inputs[1] = index.add_constant(product.inputs[1], weight * column_scale)
            if len(product.inputs) > 2 and product.inputs[2]:
                bias = index.constant(product.inputs[2])
                product.inputs[2] = index.add_constant(product.inputs[2],
                                                       (bias * column_scale).astype(bias.dtype))
            product.outputs = [mul.outputs[0]]
            index.kill(mul)
            changed = True
            break
    drop_dead(graph, index)
    return changed


def _scalable(product: Node, index: GraphIndex, scale) -> bool:
    if (product.domain, product.op_type) not in _SCALABLE or product.attrs.get("activation"):
        return False
    if len(product.inputs) > 3 or len(product.outputs) != 1:
        return False  # a residual Z would be scaled too
    if product.op_type == "Gemm" and (product.attrs.get("transB") or
                                      product.attrs.get("beta", 1.0) != 1.0):
        return False
    weight = index.constant(product.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype.kind != "f" or \
            scale.dtype != weight.dtype:
        return False
    if len(product.inputs) > 2 and product.inputs[2]:
        bias = index.constant(product.inputs[2])
        if bias is None or bias.shape[-1:] != (weight.shape[1],) or bias.size != weight.shape[1]:
            return False
    n = weight.shape[1]
    out_rank = index.rank(product.outputs[0])
    # g must vary only along the last axis and not broadcast the result to more dimensions
    if out_rank is None or scale.ndim > out_rank or \
            not (scale.size == 1 or (scale.size == n and scale.shape[-1] == n)):
        return False
    # float16 weights and bias scaled by g are rounded where the product times g was
    # (graph.py, folds_exactly): only an exact scaling, such as by a power of two, is folded
    column_scale = scale.astype(np.float64).reshape(-1)
    scaled = [weight] + ([bias] if len(product.inputs) > 2 and product.inputs[2] else [])
    return all(folds_exactly(v.astype(np.float64) * column_scale, v.dtype) for v in scaled)
