"""Dead-code elimination: nodes none of whose outputs is read, and initialisers nothing reads."""
from __future__ import annotations

from ember.ir import Graph
from ember.simplifier.context import Context


def eliminate_dead_code(graph: Graph, ctx: Context) -> bool:
    """Drop nodes that no graph output depends on, then unread initialisers (those that are
    also graph inputs stay: they are part of the model's interface)."""
    needed = {v.name for v in graph.outputs}
    producers = {out: node for node in graph.nodes for out in node.outputs if out}
    live: set[int] = set()
    stack = [producers[n] for n in needed if n in producers]
    while stack:
        node = stack.pop()
        if id(node) in live:
            continue
        live.add(id(node))
        for name in list(node.inputs) + list(node.implicit_inputs):
            if name in producers and id(producers[name]) not in live:
                stack.append(producers[name])
    kept = [n for n in graph.nodes if id(n) in live or not n.outputs]
    changed = len(kept) != len(graph.nodes)
    graph.nodes = kept
    read = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for node in graph.nodes:
        read.update(node.inputs)
        read.update(node.implicit_inputs)
    unused = [name for name in graph.initializers if name not in read]
    for name in unused:
        del graph.initializers[name]
    stale = [name for name in graph.value_info if name not in read and name not in producers]
    for name in stale:
        del graph.value_info[name]
    return changed or bool(unused)
