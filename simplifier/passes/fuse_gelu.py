"""GELU written out as elementwise ops, in its erf and tanh forms, becomes one Gelu (opset 20):

    0.5 * x * (1 + erf(x / sqrt(2)))                                     (any association)
    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))
"""
from __future__ import annotations

import math

from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead

_TOL = 1e-4


def fuse_gelu(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for node in index.live("Erf", "Tanh"):
        inner = _erf_argument(node, index) if node.op_type == "Erf" else \
            _tanh_argument(node, index)
        if inner is None:
            continue
        x, argument_nodes = inner
        outer = _outer_product(node, x, index)
        if outer is None:
            continue
        top, product_nodes = outer
        dtype = index.dtype(x)
        if dtype is None or dtype.kind != "f":
            continue
        version = ctx.can_use("Gelu", 20)
        if version is None:
            return changed
        approximate = "none" if node.op_type == "Erf" else "tanh"
        graph.nodes.append(Node("Gelu", "", version, [x], [top.outputs[0]],
                                attrs={"approximate": approximate},
                                attr_types={"approximate": AttributeProto.STRING},
                                name=top.name))
        index.kill(node, *argument_nodes, *product_nodes)
        changed = True
    drop_dead(graph, index)
    return changed


def close(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= _TOL * max(1.0, abs(want))


def mul_factors(name: str, index: GraphIndex, depth: int = 3) -> tuple[list[str], list[Node]]:
    """Leaves of the single-use Mul tree producing `name` (itself when it is no Mul)."""
    node = index.single_use_producer(name, "Mul") if depth else None
    if node is None or len(node.inputs) != 2:
        return [name], []
    leaves, nodes = [], [node]
    for operand in node.inputs:
        sub_leaves, sub_nodes = mul_factors(operand, index, depth - 1)
        leaves += sub_leaves
        nodes += sub_nodes
    return leaves, nodes


def _erf_argument(erf: Node, index: GraphIndex) -> tuple[str, list[Node]] | None:
    """x where erf's input is x / sqrt(2) or x * (1 / sqrt(2))."""
    node = index.single_use_producer(erf.inputs[0])
    if node is None or node.domain or len(node.inputs) != 2:
        return None
    x, c = node.inputs
    if node.op_type == "Div" and close(index.scalar(c), math.sqrt(2)):
        return x, [node]
    if node.op_type == "Mul":
        for x, c in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            if close(index.scalar(c), math.sqrt(0.5)):
                return x, [node]
    return None


def _tanh_argument(tanh: Node, index: GraphIndex) -> tuple[str, list[Node]] | None:
    """x where tanh's input is sqrt(2/pi) * (x + 0.044715 * x**3)."""
    leaves, scale_nodes = mul_factors(tanh.inputs[0], index, 1)
    if len(leaves) != 2:
        return None
    for s, c in ((leaves[0], leaves[1]), (leaves[1], leaves[0])):
        if not close(index.scalar(c), math.sqrt(2 / math.pi)):
            continue
        add = index.single_use_producer(s, "Add")
        if add is None:
            continue
        for x, cubic in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            cube_nodes = _cubic_term(cubic, x, index)
            if cube_nodes is not None:
                return x, scale_nodes + [add] + cube_nodes
    return None


def _cubic_term(name: str, x: str, index: GraphIndex) -> list[Node] | None:
    """Nodes computing 0.044715 * x**3 (Pow(x, 3) or x*x*x) into `name`."""
    leaves, nodes = mul_factors(name, index)
    constants = [v for v in leaves if index.scalar(v) is not None]
    others = [v for v in leaves if index.scalar(v) is None]
    if len(constants) != 1 or not close(index.scalar(constants[0]), 0.044715):
        return None
    if others == [x, x, x]:
        return nodes
    if len(others) == 1:
        power = index.single_use_producer(others[0], "Pow")
        if power is not None and power.inputs[0] == x and close(index.scalar(power.inputs[1]), 3):
            return nodes + [power]
    return None


def _outer_product(fn: Node, x: str, index: GraphIndex) -> tuple[Node, list[Node]] | None:
    """The Mul node computing 0.5 * x * (1 + fn(...)), and every node of that product."""
    add = index.only_consumer(fn.outputs[0])
    if add is None or add.domain or add.op_type != "Add":
        return None
    other = add.inputs[1] if add.inputs[0] == fn.outputs[0] else add.inputs[0]
    if not close(index.scalar(other), 1.0):
        return None
    top = index.only_consumer(add.outputs[0])
    for _ in range(3):  # climb the Mul chain until it holds all three factors
        if top is None or top.domain or top.op_type != "Mul":
            return None
        leaves, nodes = mul_factors(top.outputs[0], _AsSingleUse(index, top.outputs[0]))
        scalars = [v for v in leaves if index.scalar(v) is not None]
        rest = sorted(v for v in leaves if index.scalar(v) is None)
        if rest == sorted([x, add.outputs[0]]) and len(scalars) == 1 and \
                close(index.scalar(scalars[0]), 0.5):
            return top, nodes + [add]
        top = index.only_consumer(top.outputs[0])
    return None


class _AsSingleUse:
    """An index view in which `root` counts as used once (it is the value being replaced,
    so its own readers do not matter)."""

    def __init__(self, index: GraphIndex, root: str):
        self._index, self._root = index, root

    def single_use_producer(self, name, op_type=None):
        if name == self._root:
            node = self._index.producer.get(name)
            return node if node is not None and node.op_type == op_type and not node.domain \
                and self._index.alive(node) else None
        return self._index.single_use_producer(name, op_type)

    def __getattr__(self, item):
        return getattr(self._index, item)
