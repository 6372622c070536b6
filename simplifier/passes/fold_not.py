"""Where(Not(c), a, b) -> Where(c, b, a): the Not goes when the Where is all that reads it
(causal masks exported from `masked_fill(~mask, ...)` carry one)."""
from __future__ import annotations

from ember.ir import Graph
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead


def fold_not_into_where(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for where in index.live("Where"):
        if len(where.inputs) != 3:
            continue
        negation = index.single_use_producer(where.inputs[0], "Not")
        if negation is None or len(negation.inputs) != 1 or not negation.inputs[0]:
            continue
        condition, a, b = negation.inputs[0], where.inputs[1], where.inputs[2]
        index.set_inputs(where, [condition, b, a])
        index.kill(negation)
        changed = True
    drop_dead(graph, index)
    return changed
