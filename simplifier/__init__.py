"""The simplifier: graph rewrites that make a model smaller and faster, and that rewrite what a
backend lacks into what it has.

    from ember.simplifier import simplify
    model = simplify(import_model("model.onnx"), backend="cpu", skip=("fuse_attention",))

Passes run in order, round after round, until a round changes nothing. Every rewrite keeps
results: fused ops are ONNX ops with kernels (LayerNormalization, Gelu, Attention) or ai.ember
ops whose CPU kernels live in `ember.ops.fused`.

The rounds work on ember's IR. Names and cycles are checked before the first round and after
each round that changed the graph (`graph.check_structure`, ~1 us a node: a broken graph is an
InvalidModelError, never a graph handed to onnx's C++ inference); the importer's full check
runs once, on the first graph shape inference exports. The passes keep a valid graph valid;
with EMBER_SIMPLIFY_STRICT on (the tests turn it on) the full check runs again after every
round that changed the graph, and a round that broke it raises InvalidModelError naming its
passes.
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Iterable

import numpy as np

from google.protobuf.message import DecodeError

from ember import config
from ember.errors import EmberError, InvalidModelError
from ember.ir import Graph, Model
from ember.simplifier.context import Context, graphs_of
from ember.simplifier.graph import check_structure, producers_first
from ember.simplifier.passes.compute_float16_in_float32 import compute_float16_in_float32
from ember.simplifier.passes.constant_folding import constants_to_initializers, fold_constants
from ember.simplifier.passes.cse import eliminate_common_subexpressions
from ember.simplifier.passes.dead_code import eliminate_dead_code
from ember.simplifier.passes.expand_functions import expand_functions
from ember.simplifier.passes.fold_batchnorm import fold_batchnorm_into_conv
from ember.simplifier.passes.fold_input_scale import fold_input_scale_into_matmul
from ember.simplifier.passes.fold_not import fold_not_into_where
from ember.simplifier.passes.fold_reshape_into_reduce import REDUCTIONS, fold_reshape_into_reduce
from ember.simplifier.passes.fuse_activation import (adopt_onnxruntime_fused_conv,
                                                     fuse_activations, fuse_residual_add)
from ember.simplifier.passes.fuse_attention import fuse_attention, fuse_attention_projections
from ember.simplifier.passes.fuse_elementwise import fuse_elementwise
from ember.simplifier.passes.fuse_gelu import fuse_gelu
from ember.simplifier.passes.fuse_gemm import fold_scale_into_matmul, fuse_matmul_add
from ember.simplifier.passes.fuse_groupnorm import fuse_groupnorm
from ember.simplifier.passes.fuse_layernorm import fuse_layernorm
from ember.simplifier.passes.fuse_qdq import fuse_qdq
from ember.simplifier.passes.merge_transpose import (gather_through_transpose, merge_reshapes,
                                                     merge_transposes, merge_unsqueezes)
from ember.simplifier.passes.merge_constant_operands import merge_constant_operands
from ember.simplifier.passes.noop import remove_noops
from ember.simplifier.passes.shape_inference import infer_shapes, recheck
from ember.simplifier.passes.slice_to_gather import slice_squeeze_to_gather
from ember.simplifier.passes.widen_output_cast import widen_output_cast

Pass = Callable[[Graph, Context], bool]

# Order matters within a round: shapes first (later passes read them), folding and cleanup,
# then the pattern fusions from the largest pattern to the smallest (attention and layer
# norm before the activation fusion would take their pieces), expansion last. Constants are
# merged after the MatMul+Add fusion has taken its bias Adds.
PASSES: dict[str, Pass] = {
    "infer_shapes": infer_shapes,
    "constants_to_initializers": constants_to_initializers,
    "fuse_qdq": fuse_qdq,  # before folding turns dequantised weights into float constants
    # before folding and the fusions, which then see float32 (CPU target only)
    "compute_float16_in_float32": compute_float16_in_float32,
    "fold_constants": fold_constants,
    "remove_noops": remove_noops,
    "fold_not_into_where": fold_not_into_where,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "merge_transposes": merge_transposes,
    "merge_reshapes": merge_reshapes,
    "merge_unsqueezes": merge_unsqueezes,
    "slice_squeeze_to_gather": slice_squeeze_to_gather,
    "gather_through_transpose": gather_through_transpose,
    "fold_reshape_into_reduce": fold_reshape_into_reduce,
    "fold_batchnorm_into_conv": fold_batchnorm_into_conv,
    "fuse_layernorm": fuse_layernorm,
    "fuse_groupnorm": fuse_groupnorm,
    "fuse_gelu": fuse_gelu,
    "fuse_attention": fuse_attention,
    "fuse_attention_projections": fuse_attention_projections,
    "fold_input_scale_into_matmul": fold_input_scale_into_matmul,
    "fuse_matmul_add": fuse_matmul_add,
    "fold_scale_into_matmul": fold_scale_into_matmul,
    "merge_constant_operands": merge_constant_operands,
    "adopt_onnxruntime_fused_conv": adopt_onnxruntime_fused_conv,
    "fuse_residual_add": fuse_residual_add,
    "fuse_activations": fuse_activations,
    "widen_output_cast": widen_output_cast,
    "fuse_elementwise": fuse_elementwise,  # late: see LATE
    "expand_functions": expand_functions,
    "eliminate_dead_code": eliminate_dead_code,
}
# Op types a pass starts its matches from: a graph without any of them is skipped cheaply.
_TRIGGERS = {
    "constants_to_initializers": {"Constant"}, "merge_transposes": {"Transpose"},
    "fuse_qdq": {"QuantizeLinear"},
    "merge_reshapes": {"Reshape"}, "gather_through_transpose": {"Gather"},
    "fold_batchnorm_into_conv": {"BatchNormalization"}, "fuse_layernorm": {"Div"},
    "fuse_groupnorm": {"InstanceNormalization"},
    "fuse_gelu": {"Erf", "Tanh"}, "fuse_attention": {"Softmax"},
    "fuse_attention_projections": {"Attention"}, "fuse_matmul_add": {"MatMul"},
    "fold_scale_into_matmul": {"Mul"}, "fuse_residual_add": {"Add"},
    "widen_output_cast": {"Cast"}, "fold_not_into_where": {"Not"},
    "merge_unsqueezes": {"Unsqueeze"}, "slice_squeeze_to_gather": {"Squeeze"},
    "fold_reshape_into_reduce": set(REDUCTIONS), "fold_input_scale_into_matmul": {"MatMul", "Gemm"},
    "merge_constant_operands": {"Add", "Mul"}, "adopt_onnxruntime_fused_conv": {"FusedConv"},
}
# Passes that only look at the top-level graph (subgraphs keep their own scoping rules).
_TOP_LEVEL_ONLY = {"infer_shapes"}
# Passes that run only once a round of the others has changed nothing (then alone, and in every
# round after): they take the elementwise nodes the pattern fusions above match, so those go
# first.
LATE = {"fuse_elementwise"}
MAX_ROUNDS = 8


class UnknownPassError(EmberError):
    """--skip / skip= named a pass that does not exist."""


def simplify(model: Model, backend: str = "cpu", skip: Iterable[str] = (),
             stats: dict | None = None, portable: bool = False) -> Model:
    """Rewrite `model` in place (and return it) until no pass changes anything.

    `backend` decides which fused ops may be created (only ones it has kernels for) and which
    ops are expanded into their function bodies; `portable` instead keeps the model standard
    ONNX at its own opsets, for any runtime (no ai.ember ops, no expansion). `skip` names
    passes to leave out. If `stats` is given it receives {pass name: rounds in which it
    changed the graph, "rounds": n, "seconds": t}.
    """
    skip = set(skip)
    unknown = sorted(skip - set(PASSES))
    if unknown:
        raise UnknownPassError(f"unknown pass(es) {', '.join(unknown)}; passes are: "
                               f"{', '.join(PASSES)}")
    start = time.perf_counter()
    check_structure(model.graph)
    strict = config.switch("EMBER_SIMPLIFY_STRICT", False)
    ctx = Context(model, backend, portable=portable)
    rounds = 0
    settled = not LATE - skip
    for rounds in range(1, MAX_ROUNDS + 1):
        changed = _round(model, ctx, skip if settled else skip | LATE)
        if not changed:
            if settled:
                break
            settled = True  # the late passes now, alone, then in every round
            changed = _round(model, ctx, skip | (PASSES.keys() - LATE))
            if not changed:
                break
        _check_round(ctx, rounds, changed, strict)
    sort_topologically(model.graph)
    if stats is not None:
        stats.update(ctx.changes)
        stats["rounds"] = rounds
        stats["seconds"] = time.perf_counter() - start
    return model


def _round(model: Model, ctx: Context, skip: set[str]) -> list[str]:
    """One round: every pass not skipped, on every graph it applies to; returns the names of
    the passes that changed something (counted in ctx.changes)."""
    changed: list[str] = []
    graphs = list(graphs_of(model.graph))
    for name, run_pass in PASSES.items():
        if name in skip:
            continue
        for graph in graphs:
            if name in _TOP_LEVEL_ONLY and graph is not model.graph:
                continue
            trigger = _TRIGGERS.get(name)
            if trigger and not any(n.op_type in trigger for n in graph.nodes):
                continue
            if run_pass(graph, ctx) and name != "infer_shapes":
                ctx.changes[name] = ctx.changes.get(name, 0) + 1
                if name not in changed:
                    changed.append(name)
    return changed


def _check_round(ctx: Context, round_: int, passes: list[str], strict: bool) -> None:
    """Names and cycles of the graph as this round left it, and with `strict` the importer's
    check too; a failure is a pass's bug, reported with the round's passes."""
    try:
        check_structure(ctx.model.graph)
        if strict:
            recheck(ctx)
    except (EmberError, DecodeError) as exc:
        raise InvalidModelError(f"simplifier round {round_} (passes that changed the graph: "
                                f"{', '.join(passes)}) left an invalid graph: {exc}") from exc


def copy_structure(model: Model) -> Model:
    """A copy of `model` that `simplify` can rewrite without touching the original: graphs,
    nodes and attribute containers are copied, weight arrays shared (they are never written)."""
    memo: dict[int, object] = {}
    for graph in graphs_of(model.graph):
        for value in graph.initializers.values():
            memo[id(value)] = value
        for node in graph.nodes:
            for value in node.attrs.values():
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, np.ndarray):
                        memo[id(item)] = item
    return copy.deepcopy(model, memo)


def sort_topologically(graph: Graph) -> None:
    """Order nodes producers-first (ONNX requires it; rewrites append their new nodes)."""
    for g in graphs_of(graph):
        ordered = producers_first(g)
        seen = {id(n) for n in ordered}
        g.nodes = ordered + [n for n in g.nodes if id(n) not in seen]


__all__ = ["simplify", "copy_structure", "PASSES", "Context", "UnknownPassError",
           "sort_topologically"]
