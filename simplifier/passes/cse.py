"""Common-subexpression elimination: identical nodes on identical inputs compute once, and
identical small constants are stored once."""
from __future__ import annotations

import numpy as np

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, alias, drop_dead, producers_first, rename_many
from ember.simplifier.passes.constant_folding import NONDETERMINISTIC

# Constants are compared byte for byte up to this size; larger ones are left alone.
_MAX_DEDUP_BYTES = 1 << 16


def eliminate_common_subexpressions(graph: Graph, ctx: Context) -> bool:
    changed = _merge_constants(graph)
    index = GraphIndex(graph)
    seen: dict[tuple, Node] = {}
    # producers first, so that a duplicate's readers, renamed to the kept node's outputs, are
    # keyed (and merged) in the same sweep; simplify checked names and cycles before round 1
    for node in producers_first(graph):
        key = _node_key(node)
        if key is None:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        if all(alias(graph, index, mine, theirs) for mine, theirs in
               zip(node.outputs, first.outputs) if mine):
            index.kill(node)
            changed = True
    drop_dead(graph, index)
    return changed


def _node_key(node: Node) -> tuple | None:
    if node.op_type in NONDETERMINISTIC or node.subgraphs() or not node.outputs:
        return None
    attrs = []
    for name, value in sorted(node.attrs.items()):
        attrs.append((name, _hashable(value)))
    return (node.domain, node.op_type, node.version, tuple(node.inputs), tuple(attrs),
            len(node.outputs), tuple(bool(o) for o in node.outputs))


def _hashable(value):
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes()
                if value.dtype != object else tuple(value.reshape(-1)))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _merge_constants(graph: Graph) -> bool:
    inputs = {v.name for v in graph.inputs}
    outputs = {v.name for v in graph.outputs}
    seen: dict[tuple, str] = {}
    renames: dict[str, str] = {}  # duplicate -> the first of its value (never renamed itself)
    for name, value in list(graph.initializers.items()):
        if name in inputs or not isinstance(value, np.ndarray) or value.dtype == object \
                or value.nbytes > _MAX_DEDUP_BYTES:
            continue
        key = (value.dtype.str, value.shape, value.tobytes())
        first = seen.setdefault(key, name)
        if first != name and name not in outputs:
            renames[name] = first
            del graph.initializers[name]
    rename_many(graph, renames)  # one sweep over the nodes for all duplicates
    return bool(renames)
