"""A constant scalar factor of a matrix product's operand moves into the product:

    MatMul(x * c, W) -> MatMul(x, c * W)       (W constant; also with x / c, and the factor
    Gemm(x * c, B)   -> Gemm(x, B, alpha * c)   anywhere in a tree of single-use Muls)

An erf GELU's 0.5 before the second feed-forward projection goes this way: x * 0.5 * (1 +
erf(x / sqrt(2))) feeding MatMul(., W2) becomes x * (1 + erf(...)) and 0.5 * W2, one Mul fewer.
Where a Gelu op can be created (ember's targets, or a model at opset 20 or later), that 0.5
is left for fuse_gelu. A float16 or bfloat16 W takes only a factor that scales it exactly (a
power of two): c * W would otherwise be rounded to the narrow type (graph.folds_exactly)."""
from __future__ import annotations

import math

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, alias, drop_dead, folds_exactly

_GELU_OPSET = 20
_MAX_DEPTH = 3  # levels of the Mul tree searched for the factor
_GELU_DEPTH = 6  # levels searched for a GELU's Erf or Tanh (Mul, Mul, Add, Add, Erf)


def fold_input_scale_into_matmul(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    gelu_possible = not ctx.portable or ctx.opset("") >= _GELU_OPSET
    for product in index.live("MatMul", "Gemm"):
        if len(product.inputs) < 2 or len(product.outputs) != 1:
            continue
        for side in (0, 1):
            weight = index.constant(product.inputs[1 - side])
            if product.op_type == "MatMul" and (weight is None or weight.dtype.kind != "f"):
                continue  # the factor needs a constant to go into (Gemm has alpha)
            found = scalar_factor(product.inputs[side], index, _MAX_DEPTH)
            if found is None or (gelu_possible and
                                 _holds_gelu_half(product.inputs[side], index, _GELU_DEPTH)):
                continue
            scaling, factor, operand, dtype = found
            if dtype != index.dtype(product.inputs[side]) or \
                    (weight is not None and dtype != weight.dtype):
                continue
            if product.op_type == "MatMul" and \
                    not folds_exactly(weight.astype(np.float64) * factor, weight.dtype):
                continue  # a float16 c * W would be rounded where x * c was (graph.py)
            if not alias(graph, index, scaling.outputs[0], operand):
                continue
            index.kill(scaling)
            if product.op_type == "Gemm":
                product.attrs = dict(product.attrs,
                                     alpha=float(product.attrs.get("alpha", 1.0)) * factor)
                product.attr_types = dict(product.attr_types, alpha=AttributeProto.FLOAT)
            else:
                scaled = (weight * np.asarray(factor, weight.dtype)).astype(weight.dtype)
                # a new constant (the weight may be shared); the old one's reader list keeps
                # this node, as set_inputs would walk all readers of a shared weight per fold
                product.inputs = list(product.inputs)
                product.inputs[1 - side] = index.add_constant(product.inputs[1 - side], scaled)
            changed = True
            break
    drop_dead(graph, index)
    return changed


def scalar_factor(name: str, index: GraphIndex, depth: int):
    """(node, factor, operand, dtype): a single-use Mul by (or Div by) a constant scalar in
    the tree of single-use Muls producing `name`, the number it multiplies by, its other
    operand (which the node's output can be replaced by) and the type of both."""
    node = index.producer.get(name)
    if depth == 0 or node is None or node.domain or node.op_type not in ("Mul", "Div") or \
            len(node.inputs) != 2 or index.single_use_producer(name) is None:
        return None
    pairs = [(0, 1), (1, 0)] if node.op_type == "Mul" else [(0, 1)]
    for kept, constant in pairs:
        operand, value = node.inputs[kept], index.constant(node.inputs[constant])
        if _usable_scalar(value, operand, index) and value.dtype == index.dtype(operand):
            number = float(value.reshape(-1)[0])
            factor = number if node.op_type == "Mul" else 1.0 / number
            return node, factor, operand, value.dtype
    if node.op_type == "Mul":
        for operand in node.inputs:
            found = scalar_factor(operand, index, depth - 1)
            if found is not None:
                return found
    return None


def _usable_scalar(value: np.ndarray | None, other: str, index: GraphIndex) -> bool:
    """Whether a constant is one finite, non-zero float that does not broadcast `other` to a
    higher rank (so dropping it leaves the product's shape as it was)."""
    other_rank = index.rank(other)
    if value is None or value.size != 1 or value.dtype.kind != "f" or other_rank is None or \
            value.ndim > other_rank:
        return False
    number = float(value.reshape(-1)[0])
    return math.isfinite(number) and number != 0.0


def _holds_gelu_half(name: str, index: GraphIndex, depth: int) -> bool:
    """Whether the Muls and Adds computing `name` reach an Erf or Tanh: a GELU written out,
    whose 0.5 fuse_gelu wants (perhaps only in a later round, once the other passes have
    tidied its pattern)."""
    node = index.producer.get(name)
    if depth == 0 or node is None or node.domain:
        return False
    if node.op_type in ("Erf", "Tanh"):
        return True
    return node.op_type in ("Mul", "Add") and any(_holds_gelu_half(i, index, depth - 1)
                                                  for i in node.inputs)
