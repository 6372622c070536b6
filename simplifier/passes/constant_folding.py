"""Constant folding: nodes whose inputs are all constants run once, now, on ember's own CPU
kernels, and become initialisers. Also Constant nodes -> initialisers, and Shape / Size of
values whose shape is fully static."""
from __future__ import annotations

import numpy as np

from ember import limits
from ember.errors import EmberError
from ember.ir import Graph, Node
from ember.ops.registry import bind, lookup
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead

# Ops whose result is not a function of their inputs.
NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                    "Bernoulli", "Multinomial", "Dropout"}
# Ops whose output size is known from their inputs before running: checked up front so a
# huge ConstantOfShape / Tile / Expand is never materialised at all.
_SIZE_FROM_SHAPE_INPUT = {"ConstantOfShape": 0, "Expand": 1}


def constants_to_initializers(graph: Graph, ctx: Context) -> bool:
    """Constant nodes become initialisers (one representation of constants for every pass)."""
    index = GraphIndex(graph)
    changed = False
    for node in graph.nodes:
        if node.op_type != "Constant" or node.domain or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if out in index.outputs or out in graph.initializers:
            continue
        value = _constant_node_value(node)
        if value is None:
            continue
        graph.initializers[out] = value
        index.kill(node)
        changed = True
    drop_dead(graph, index)
    return changed


def _constant_node_value(node: Node) -> np.ndarray | None:
    attrs = node.attrs
    if "value" in attrs or "sparse_value" in attrs:
        value = attrs.get("value", attrs.get("sparse_value"))
        return np.asarray(value) if isinstance(value, np.ndarray) else None
    if "value_float" in attrs:
        return np.array(attrs["value_float"], np.float32)
    if "value_floats" in attrs:
        return np.array(attrs["value_floats"], np.float32)
    if "value_int" in attrs:
        return np.array(attrs["value_int"], np.int64)
    if "value_ints" in attrs:
        return np.array(attrs["value_ints"], np.int64)
    return None  # strings stay Constant nodes


def fold_constants(graph: Graph, ctx: Context) -> bool:
    """Evaluate deterministic nodes whose inputs are all constants, within a size bound."""
    index = GraphIndex(graph)
    changed = False
    for node in graph.nodes:
        values = _fold(node, index, ctx) or _fold_shape(node, index)
        if values is None:
            continue
        for name, value in zip(node.outputs, values):
            if name:
                graph.initializers[name] = value
                graph.value_info.pop(name, None)
        index.kill(node)
        changed = True
    drop_dead(graph, index)
    return changed


def _foldable(node: Node, index: GraphIndex) -> bool:
    if node.op_type in NONDETERMINISTIC or node.op_type == "Constant" and node.domain == "":
        return False
    if node.subgraphs() or node.implicit_inputs or not node.outputs:
        return False
    if any(out in index.outputs for out in node.outputs):
        return False  # a graph output keeps its producer
    return all(not name or index.constant(name) is not None for name in node.inputs)


def _fold(node: Node, index: GraphIndex, ctx: Context) -> list[np.ndarray] | None:
    if not _foldable(node, index):
        return None
    impl = lookup(node.domain, node.op_type, node.version, "cpu")
    if impl is None:
        return None
    inputs = [index.constant(n) if n else None for n in node.inputs]
    budget = max(ctx.max_folded_elements, sum(int(v.size) for v in inputs if v is not None))
    if _predicted_size(node, inputs) > budget:
        return None
    try:
        kernel = bind(node, impl, dict(node.attrs))
        # the kernels' own size checks hold them to the folding budget (16 bytes an element:
        # complex128), so a fold never allocates what it would then throw away
        with limits.capped(min(limits.current(), budget * 16)):
            result = kernel.run(*inputs)
    except (EmberError, ArithmeticError, ValueError, TypeError, IndexError, MemoryError):
        return None  # left for run time, where the error is reported with its inputs
    results = list(result) if isinstance(result, tuple) else [result]
    results = [np.asarray(r) if isinstance(r, (np.generic, int, float)) else r
               for r in results[:len(node.outputs)]]
    if len(results) < len([o for o in node.outputs if o]) or \
            not all(isinstance(r, np.ndarray) for r in results):
        return None
    if sum(int(r.size) for r in results) > budget:
        return None
    return results


def _predicted_size(node: Node, inputs: list) -> int:
    """The elements the node would produce, read from its shape input; 0 where that cannot
    be told before running (the kernel then refuses a shape that is not integers)."""
    if node.domain or node.op_type not in _SIZE_FROM_SHAPE_INPUT:
        if node.op_type == "Tile" and len(inputs) == 2 and _is_integers(inputs[1]) \
                and inputs[0] is not None:
            return int(inputs[0].size) * int(np.prod(np.maximum(inputs[1], 0)))
        return 0
    shape = inputs[_SIZE_FROM_SHAPE_INPUT[node.op_type]]
    if not _is_integers(shape):
        return 0
    return int(np.prod(np.maximum(shape.astype(np.int64), 1)))


def _is_integers(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind in "iu"


def _fold_shape(node: Node, index: GraphIndex) -> list[np.ndarray] | None:
    """Shape and Size of a value whose shape inference found fully static."""
    if node.domain or node.op_type not in ("Shape", "Size") or not node.inputs:
        return None
    if node.outputs[0] in index.outputs:
        return None
    shape = index.static_shape(node.inputs[0])
    if shape is None:
        return None
    if node.op_type == "Size":
        return [np.array(int(np.prod(shape)), np.int64)]
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    return [np.array(shape[slice(start, None if end is None else int(end))], np.int64)]
