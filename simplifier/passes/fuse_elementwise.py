"""Groups of elementwise nodes -> one ai.ember::ElementwiseChain node (ops/elementwise_chain.py),
whose CPU kernel runs the whole group as one compiled loop: a SiLU's Sigmoid and Mul, a
HardSwish written out, an erf GELU, RoPE's products and sums, need no pattern of their own.

A group is a connected set of whitelisted float32 / bool elementwise nodes with one output:
every other value it computes is read by its own nodes only (not by another node, nor as a
graph output), so the group's nodes disappear and nothing outside needs what they computed.
Groups are grown from their output backwards, over producers whose every reader is already in
the group. A group becomes a node when it holds at least two steps (or one, over a large
result: `_large_alone`) and its inputs' shapes are
known (sizes or named symbols) and each broadcasts into the output's shape (a scalar, a
per-channel or trailing tensor...), or its inputs are one tensor and scalars (rank 0), whose
result has the tensor's shape whatever it is: otherwise, shapes unknown, the nodes stay.

The pass runs late (simplifier/__init__.py: `LATE`), once the other passes have settled: the
fusions that take elementwise nodes into larger ops (activations into a Conv, a scale into a
MatMul, layer norm, GELU, attention) have had them first.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import AttributeProto, TensorProto

from ember.ir import Graph, Node
from ember.ops.cpu import tuning
from ember.ops.elementwise_chain import OP_TYPE, OPS, kind_of
from ember.ops.fused import DOMAIN
from ember.ops.registry import attribute_defaults
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead, producers_first

# ONNX op -> the chain's step, where the names and semantics are the same
_SAME = {"Identity", "Neg", "Abs", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Sin", "Cos",
         "Reciprocal", "Floor", "Ceil", "Erf", "HardSwish", "Add", "Sub", "Mul", "Div", "Pow",
         "Max", "Min", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And",
         "Or", "Xor", "Where"}
# ops whose first versions had opset-1 broadcasting attributes or other semantics
_SINCE = {"Add": 7, "Sub": 7, "Mul": 7, "Div": 7, "Pow": 7, "Equal": 7, "Greater": 7,
          "Less": 7, "And": 7, "Or": 7, "Xor": 7, "Max": 8, "Min": 8}
_FLT_MAX = 3.4028234663852886e38


def fuse_elementwise(graph: Graph, ctx: Context) -> bool:
    if not ctx.has_kernel(DOMAIN, OP_TYPE, 1):
        return False
    index = GraphIndex(graph)
    order = producers_first(graph)
    steps = {}   # id(node) -> (step name, operand names, params) for the nodes that can join
    for node in order:
        step = _step(node, index)
        if step is not None:
            steps[id(node)] = step
    if not steps:
        return False
    position = {id(n): i for i, n in enumerate(order)}
    taken: set[int] = set()
    changed = False
    for sink in reversed(order):   # consumers first: each group is grown from its output
        if id(sink) not in steps or id(sink) in taken:
            continue
        group = _grow(sink, steps, taken, index)
        taken.update(id(n) for n in group)
        if sum(steps[id(n)][0] != "Identity" for n in group) < 2 and \
                not _large_alone(group, steps, index):
            continue
        group.sort(key=lambda n: position[id(n)])
        node = _chain_node(group, steps, index)
        if node is None:
            continue
        graph.nodes.append(node)
        index.kill(*group)
        for member in group[:-1]:
            graph.value_info.pop(member.outputs[0], None)
        changed = True
    drop_dead(graph, index)
    return changed


def _grow(sink: Node, steps: dict, taken: set[int], index: GraphIndex) -> list[Node]:
    """The group whose output is `sink`'s: producers join while every reader of what they
    compute is in the group (and it is no graph output)."""
    group, members = [sink], {id(sink)}
    pending = [sink]
    while pending:   # a producer is looked at as each of its readers joins: the last admits it
        node = pending.pop()
        for name in steps[id(node)][1]:
            producer = index.producer.get(name)
            if producer is None or id(producer) in members or id(producer) not in steps \
                    or id(producer) in taken or name in index.outputs:
                continue
            if all(id(reader) in members for reader in index.consumers.get(name, ())):
                group.append(producer)
                members.add(id(producer))
                pending.append(producer)
    return group


# steps numpy computes in several passes or by slow functions (a Sigmoid is four passes);
# not Pow, whose squares numpy computes as products and the loop by pow()
_FORMULAS = {"Sigmoid", "Tanh", "Exp", "Log", "Sin", "Cos", "Erf", "Gelu", "GeluTanh",
             "HardSwish", "HardSigmoid"}


def _large_alone(group: list[Node], steps: dict, index: GraphIndex) -> bool:
    """Whether a group of one op is worth a chain of its own, where the compiled loop on the
    run's threads beats numpy: a result of at least CHAIN_FORMULA_ALONE_MIN values for a
    formula (a detector's Sigmoid), of CHAIN_ALONE_MIN for a single pass (an SE block's
    broadcast Mul); a named dim, a batch, counts as 1."""
    if len(group) != 1 or steps[id(group[0])][0] == "Identity":
        return False
    shape = index.known_shape(group[0].outputs[0])
    least = tuning.CHAIN_FORMULA_ALONE_MIN if steps[id(group[0])][0] in _FORMULAS \
        else tuning.CHAIN_ALONE_MIN
    return shape is not None and math.prod(d for d in shape if isinstance(d, int)) >= least


def _chain_node(group: list[Node], steps: dict, index: GraphIndex) -> Node | None:
    """The ElementwiseChain node for `group` (producers first, its output last), or None where
    an input does not broadcast into the output, or the output's shape is not known and the
    inputs are not one tensor and scalars (a MatMulInteger's Cast and scale Mul after
    com.microsoft ops, whose shapes onnx's inference does not know)."""
    out_name = group[-1].outputs[0]
    out_shape = index.known_shape(out_name)
    members = {id(n) for n in group}
    slots: dict[str, int] = {}
    inputs: list[str] = []
    for node in group:
        for name in steps[id(node)][1]:
            producer = index.producer.get(name)
            if name not in slots and (producer is None or id(producer) not in members):
                if out_shape is not None and \
                        not _broadcasts_into(index.known_shape(name), out_shape):
                    return None
                slots[name] = len(inputs)
                inputs.append(name)
    if out_shape is None and sum(index.known_shape(name) != () for name in inputs) != 1:
        return None   # (one input of unknown shape and scalars: the output has its shape)
    ops, args, params = [], [], []
    for i, node in enumerate(group):
        name, operands, constants = steps[id(node)]
        ops.append(name)
        args.extend(slots[o] for o in operands)
        params.extend(constants)
        slots[node.outputs[0]] = len(inputs) + i
    attrs = {"ops": ops, "args": args, "params": params}
    types = {"ops": AttributeProto.STRINGS, "args": AttributeProto.INTS,
             "params": AttributeProto.FLOATS}
    if not params:
        del attrs["params"], types["params"]
    return Node(OP_TYPE, DOMAIN, 1, inputs, [out_name], attrs=attrs, attr_types=types,
                name=group[-1].name)


def _broadcasts_into(shape: tuple | None, out: tuple) -> bool:
    """Whether a value of `shape` broadcasts into `out` (each of its dims 1 or out's)."""
    if shape is None or len(shape) > len(out):
        return False
    return all(d == 1 or d == o for d, o in zip(shape, out[len(out) - len(shape):]))


def _step(node: Node, index: GraphIndex) -> tuple[str, list[str], list[float]] | None:
    """(step name, operand names, params) for a node a chain can hold, else None."""
    if node.domain or len(node.outputs) != 1 or not node.outputs[0] or node.subgraphs():
        return None
    op = node.op_type
    if node.version < _SINCE.get(op, 1):
        return None
    inputs = list(node.inputs)
    params: list[float] = []
    if op in _SAME:
        name = op
    elif op in ("LeakyRelu", "HardSigmoid"):
        defaults, _ = attribute_defaults(node.domain, op, node.version)
        names = ("alpha",) if op == "LeakyRelu" else ("alpha", "beta")
        params = [float(node.attrs.get(a, defaults.get(a))) for a in names]
        name = op
    elif op == "Gelu":
        approximate = node.attrs.get("approximate", "none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in ("none", "tanh"):
            return None
        name = "Gelu" if approximate == "none" else "GeluTanh"
    elif op == "Clip":
        name, params, inputs = "Clip", _clip_bounds(node, index), inputs[:1]
        if params is None:
            return None
    elif op == "Cast":
        to = node.attrs.get("to")
        name = {TensorProto.FLOAT: "CastFloat", TensorProto.BOOL: "CastBool"}.get(to)
        if name is None:
            return None
    else:
        return None
    step = OPS[name]
    if len(inputs) != step.arity or not all(inputs):
        return None
    for value, allowed in zip(inputs, step.kinds):
        if kind_of(index.dtype(value)) not in tuple(allowed):
            return None
    if kind_of(index.dtype(node.outputs[0])) != step.result:
        return None
    return name, inputs, params


def _clip_bounds(node: Node, index: GraphIndex) -> list[float] | None:
    """Clip's [min, max] as the kernel applies them (an absent bound: +-inf, or opset 6's
    attribute defaults), or None where a bound is not a constant scalar."""
    if node.version < 11:
        return [float(node.attrs.get("min", -_FLT_MAX)), float(node.attrs.get("max", _FLT_MAX))]
    bounds = []
    for i, default in ((1, -math.inf), (2, math.inf)):
        if len(node.inputs) <= i or not node.inputs[i]:
            bounds.append(default)
            continue
        value = index.constant(node.inputs[i])
        if value is None or value.size > 1 or value.dtype != np.float32:
            return None
        bounds.append(float(value.reshape(-1)[0]) if value.size else default)
    return bounds
