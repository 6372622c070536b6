"""Conv followed by an inference BatchNormalization: the normalisation is folded into the
convolution's weights and bias (W' = W * s, b' = (b - mean) * s + beta, s = gamma / sqrt(var
+ eps)). Not for float16 or bfloat16 weights, which W * s would round (graph.folds_exactly):
the BatchNormalization kernel computes in float32 and rounds once instead."""
from __future__ import annotations

import numpy as np

from ember.ir import Graph
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead, folds_exactly


def fold_batchnorm_into_conv(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for bn in index.live("BatchNormalization"):
        if bn.version < 9 or bn.attrs.get("training_mode", 0) or \
                len([o for o in bn.outputs if o]) != 1 or len(bn.inputs) != 5:
            continue
        conv = index.single_use_producer(bn.inputs[0], "Conv")
        if conv is None or len(conv.inputs) < 2:
            continue
        params = [index.constant(n) for n in bn.inputs[1:]]
        weight = index.constant(conv.inputs[1])
        bias = index.constant(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] \
            else None
        if weight is None or any(p is None for p in params) or weight.dtype.kind != "f" or \
                (len(conv.inputs) > 2 and conv.inputs[2] and bias is None):
            continue
        gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)
        if not all(p.size == weight.shape[0] for p in (gamma, beta, mean, var)):
            continue
        scale = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        new_w = (weight.astype(np.float64) * scale.reshape((-1,) + (1,) * (weight.ndim - 1)))
        old_b = np.zeros(weight.shape[0]) if bias is None else bias.astype(np.float64)
        new_b = (old_b - mean) * scale + beta
        if not (folds_exactly(new_w, weight.dtype) and folds_exactly(new_b, weight.dtype)):
            continue  # float16 W * s rounds each weight (graph.py): the normalisation stays
        conv.inputs = [conv.inputs[0],
                       index.add_constant(conv.inputs[1], new_w.astype(weight.dtype)),
                       index.add_constant(conv.inputs[1] + "_bias", new_b.astype(weight.dtype))]
        conv.outputs = [bn.outputs[0]]
        index.kill(bn)
        changed = True
    drop_dead(graph, index)
    return changed
