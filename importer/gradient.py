"""ai.onnx.preview.training::Gradient, expanded into ordinary ONNX nodes by reverse-mode AD.

A Gradient node names values of its own graph (attributes `xs`, `zs`, `y`) and outputs dY/dX
for each X in `xs`, evaluated at the values fed to its inputs (one per name of `xs` + `zs`). A
kernel cannot see the graph, so the importer rewrites every Gradient node in place:

1. find the differentiable region: nodes fed (transitively) by `xs` that `y` depends on;
2. if the node's inputs are not the very values named in `xs` + `zs`, re-emit the forward
   nodes between them and `y` on those inputs (under fresh names);
3. seed dY/dY with ones shaped like Y, walk the region in reverse topological order, emit each
   node's vector-Jacobian product (the `_VJPS` table) and sum contributions with Add;
4. reduce gradients of broadcast operands back to the operand's shape (`_Builder.sum_to`).

Emitted nodes are in the default domain at the model's default opset. Shapes and dtypes known
statically (graph inputs, initialisers, value_info, propagated through simple ops) are used to
skip needless reductions and to pick the constants' dtype.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import onnx

from ember.errors import InvalidModelError, UnsupportedOpError
from ember.ir import Graph, Node, TensorType

TRAINING_DOMAIN = "ai.onnx.preview.training"

# Ops whose outputs carry no gradient back to their inputs (integer/boolean/shape results).
_STOP_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "Constant", "NonZero", "Equal",
                       "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And", "Or",
                       "Xor", "Sign", "ArgMax", "ArgMin", "RandomNormalLike",
                       "RandomUniformLike", "EyeLike"})
_BROADCAST_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Greater",
                            "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor"})
_BOOL_OPS = frozenset({"Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not",
                       "And", "Or", "Xor"})
_SAME_SHAPE_OPS = frozenset({"Neg", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Identity",
                             "Abs", "Sign", "Not"})

Info = tuple  # (numpy dtype or None, shape tuple or None): what is known statically


def expand_gradient_nodes(graph: Graph, opset: int | None = None) -> None:
    """Replace every top-level Gradient node of `graph` by ordinary ONNX nodes, in place."""
    if opset is None:
        opset = next((n.version for n in graph.nodes if n.domain == ""), 13)
    for k in itertools.count():
        grad = next((n for n in graph.nodes
                     if n.op_type == "Gradient" and n.domain == TRAINING_DOMAIN), None)
        if grad is None:
            return
        # In order: the forward nodes a Gradient names need not precede it in the list, and
        # nodes emitted for an earlier Gradient may be read by a later one.
        graph.nodes = _toposort(graph)
        new_nodes = _Builder(graph, opset, _prefix(grad, k)).expand(grad)
        at = graph.nodes.index(grad)
        graph.nodes[at:at + 1] = new_nodes
        graph.nodes = _toposort(graph)


def _prefix(node: Node, k: int) -> str:
    base = next((o for o in node.outputs if o), node.name or "Gradient")
    return f"{base}__grad{k}_"


def _attr_type(value) -> int:
    A = onnx.AttributeProto
    if isinstance(value, (bool, int, np.integer)):
        return A.INT
    if isinstance(value, (float, np.floating)):
        return A.FLOAT
    if isinstance(value, str):
        return A.STRING
    if isinstance(value, np.ndarray):
        return A.TENSOR
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in value):
        return A.INTS
    raise TypeError(f"no ONNX attribute type for {value!r}")


class _Builder:
    """Emits the nodes for one Gradient node and tracks static dtype/shape knowledge."""

    def __init__(self, graph: Graph, opset: int, prefix: str):
        self.graph, self.opset, self.prefix = graph, opset, prefix
        self.nodes: list[Node] = []
        self.used = ({v.name for v in graph.inputs} | {v.name for v in graph.outputs}
                     | set(graph.initializers) | set(graph.value_info)
                     | {o for n in graph.iter_nodes() for o in n.outputs})
        self.fresh_ids = itertools.count()
        self.info: dict[str, Info] = {}
        for name, value in graph.initializers.items():
            self.info[name] = (value.dtype, tuple(value.shape))
        for v in list(graph.inputs) + list(graph.value_info.values()) + list(graph.outputs):
            if isinstance(v.type, TensorType) and v.name not in self.info:
                self.info[v.name] = (v.type.dtype, v.type.shape)
        for node in graph.nodes:
            self._propagate(node)

    # -- static shapes and dtypes ---------------------------------------------------------------
    def dtype(self, name: str):
        return self.info.get(name, (None, None))[0]

    def shape(self, name: str):
        return self.info.get(name, (None, None))[1]

    def rank(self, name: str, why: str) -> int:
        shape = self.shape(name)
        if shape is None:
            raise InvalidModelError(f"Gradient: the rank of '{name}' is not known statically, "
                                    f"which differentiating {why} needs")
        return len(shape)

    def _propagate(self, node: Node) -> None:
        """Fill in dtype/shape of node's outputs from its inputs, for a few simple ops."""
        if not node.outputs or not node.outputs[0]:
            return
        out = node.outputs[0]
        known = self.info.get(out, (None, None))
        if known[0] is not None and known[1] is not None:
            return
        ins = [self.info.get(i, (None, None)) for i in node.inputs]
        dtype, shape = None, None
        if node.domain == "" and ins and node.op_type in _SHAPE_RULES:
            dtype = np.dtype(bool) if node.op_type in _BOOL_OPS else ins[-1][0] \
                if node.op_type == "Where" else ins[0][0]
            consts = [self.graph.initializers.get(i) for i in node.inputs]
            try:
                shape = _SHAPE_RULES[node.op_type](node.attrs, [s for _, s in ins], consts)
            except (TypeError, ValueError, IndexError):
                shape = None  # not enough known, or a malformed node the kernel will report
        self.info[out] = (known[0] or dtype, known[1] if known[1] is not None else shape)

    # -- emitting nodes ---------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        while True:
            name = f"{self.prefix}{hint}_{next(self.fresh_ids)}"
            if name not in self.used:
                self.used.add(name)
                return name

    def add(self, node: Node) -> None:
        self.nodes.append(node)
        self._propagate(node)

    def op(self, op_type: str, *inputs: str, info: Info | None = None, **attrs) -> str:
        """Emit one single-output default-domain node; returns its output name."""
        out = self.fresh(op_type)
        if info is not None:
            self.info[out] = info
        self.add(Node(op_type, "", self.opset, list(inputs), [out], dict(attrs),
                      {k: _attr_type(v) for k, v in attrs.items()},
                      name=self.fresh(op_type + "_node")))
        return out

    def const(self, value, dtype) -> str:
        name = self.fresh("const")
        self.graph.initializers[name] = np.asarray(value, dtype=dtype)
        self.info[name] = (np.dtype(dtype), np.shape(value))
        return name

    def scalar(self, value, like: str) -> str:
        dtype = self.dtype(like)
        if dtype is None:
            raise InvalidModelError(f"Gradient: the element type of '{like}' is not known "
                                    "statically; declare it in the graph's value_info")
        return self.const(value, dtype)

    def filled_like(self, value, like: str) -> str:
        """A tensor shaped like `like`, every element `value`, of `like`'s dtype."""
        dtype, shape = self.dtype(like), self.shape(like)
        if dtype is None:
            self.scalar(value, like)  # raises, naming the value
        if shape is not None and all(isinstance(d, int) for d in shape):
            return self.const(np.full(shape, value, dtype), dtype)
        if self.opset < 9:
            raise InvalidModelError(f"Gradient: '{like}' has a dynamic shape; filling a tensor "
                                    "shaped like it needs opset 9 (ConstantOfShape)")
        return self.op("ConstantOfShape", self.op("Shape", like),
                       value=np.full((1,), value, dtype), info=(dtype, shape))

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.const(axes, np.int64))
        return self.op("Unsqueeze", x, axes=list(axes))

    def reduce_sum(self, x: str, axes: list[int], keepdims: int = 1) -> str:
        if self.opset >= 13:
            return self.op("ReduceSum", x, self.const(axes, np.int64), keepdims=keepdims)
        return self.op("ReduceSum", x, axes=list(axes), keepdims=keepdims)

    def reshape_like(self, g: str, x: str) -> str:
        shape = self.shape(x)
        if shape is not None and all(isinstance(d, int) for d in shape):
            target = self.const(shape, np.int64)  # also right for zero-sized dims
        else:
            target = self.op("Shape", x)
        return self.op("Reshape", g, target, info=self.info.get(x))

    def sum_to(self, g: str, x: str, g_shape=None) -> str:
        """Gradient `g` (of static shape `g_shape`, if known) summed down to the shape of `x`,
        undoing numpy-style broadcasting of `x`."""
        xs = self.shape(x)
        if g_shape is not None and xs is not None:
            if len(g_shape) == len(xs) and all(a == b and a is not None
                                               for a, b in zip(g_shape, xs)):
                return g
            lead = len(g_shape) - len(xs)
            axes, static = list(range(lead)), lead >= 0
            for i, d in enumerate(xs if static else ()):
                gd = g_shape[lead + i]
                if d == 1 and gd != 1:
                    axes.append(lead + i)
                elif not (d == gd and d is not None or isinstance(d, int)):
                    static = False  # x's dim unknown and maybe broadcast
            if static:
                r = self.reduce_sum(g, axes) if axes else g
                return self.reshape_like(r, x) if lead else r
        if self.opset < 13:
            raise InvalidModelError(
                f"Gradient: cannot tell statically along which axes '{x}' was broadcast; "
                "declare its shape, or use opset >= 13 (ReduceSum with runtime axes)")
        sx, one = self.op("Shape", x), self.const([1], np.int64)
        n_lead = self.op("Sub", self.op("Shape", self.op("Shape", g)), self.op("Shape", sx))
        padded = self.op("Concat", self.op("ConstantOfShape", n_lead, value=np.ones(1, np.int64)),
                         sx, axis=0)
        axes = self.op("Reshape", self.op("NonZero", self.op("Equal", padded, one)),
                       self.const([-1], np.int64))
        r = self.op("ReduceSum", g, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", r, sx, info=self.info.get(x))

    def accumulate(self, grads: dict[str, str], name: str, g: str) -> None:
        grads[name] = self.op("Add", grads[name], g, info=self.info.get(name)) \
            if name in grads else g

    # -- the rewrite -------------------------------------------------------------------------------
    def expand(self, grad: Node) -> list[Node]:
        xs, zs = list(grad.attrs.get("xs", [])), list(grad.attrs.get("zs", []))
        y = grad.attrs.get("y")
        label = grad.name or next((o for o in grad.outputs if o), "?")
        if not xs or not y:
            raise InvalidModelError(f"Gradient node '{label}' needs attributes 'xs' and 'y'")
        if len(grad.inputs) != len(xs) + len(zs) or len(grad.outputs) > len(xs):
            raise InvalidModelError(f"Gradient node '{label}': {len(grad.inputs)} inputs and "
                                    f"{len(grad.outputs)} outputs for {len(xs)} xs and "
                                    f"{len(zs)} zs")
        forward = [n for n in self.graph.nodes if n is not grad]
        producer = {o: n for n in forward for o in n.outputs if o}
        available = ({v.name for v in self.graph.inputs} | set(self.graph.initializers)
                     | set(producer))
        for name in xs + zs + [y]:
            if name not in available:
                raise InvalidModelError(f"Gradient node '{label}' names '{name}', which the "
                                        "graph does not define")

        # Re-evaluate the forward nodes between xs+zs and y on the node's actual inputs; an
        # x fed another value gets a fresh name, so only the re-evaluated nodes depend on it.
        rename = {n: self.op("Identity", i, info=self.info.get(i)) if n in xs else i
                  for n, i in zip(xs + zs, grad.inputs) if n != i}
        if rename:
            for node in _between(forward, set(rename), y):
                outs = [self.fresh(o) if o else "" for o in node.outputs]
                rename.update((o, r) for o, r in zip(node.outputs, outs) if o)
                self.add(Node(node.op_type, node.domain, node.version,
                              [rename.get(i, i) for i in node.inputs], outs, dict(node.attrs),
                              dict(node.attr_types), self.fresh(node.op_type + "_fwd"),
                              list(node.implicit_inputs)))
            forward = self.nodes[:] + forward
        x_vals = [rename.get(x, x) for x in xs]
        y_val = rename.get(y, y)

        region = _between(forward, set(x_vals), y_val, stop=_STOP_OPS)
        diff = set(x_vals) | {o for n in region for o in n.outputs}
        unsupported = sorted({(n.domain, n.op_type, n.version) for n in region
                              if n.domain != "" or n.op_type not in _VJPS})
        if unsupported:
            err = UnsupportedOpError(unsupported)
            err.args = (f"Gradient node '{label}': no gradient rule for "
                        + ", ".join(f"{d or 'ai.onnx'}::{op}-{v}" for d, op, v in unsupported)
                        + f" (supported: {', '.join(sorted(_VJPS))})",)
            raise err

        grads: dict[str, str] = {}
        if y_val in diff:
            grads[y_val] = self.filled_like(1, y_val)
        for node in reversed(region):
            g = grads.get(node.outputs[0])
            if g is None:
                continue  # y does not depend on this node through its first output
            for inp, rule in zip(node.inputs, _VJPS[node.op_type](self, node, g)):
                if inp in diff and rule is not None:
                    self.accumulate(grads, inp, rule())
        for out, x in zip(grad.outputs, x_vals):
            if out:
                g = grads.get(x) or self.filled_like(0, x)
                self.nodes.append(Node("Identity", "", self.opset, [g], [out],
                                       name=self.fresh("Identity_node")))
                self.info[out] = self.info.get(x, (None, None))
        return self.nodes


def _between(nodes: list[Node], sources: set[str], target: str,
             stop: frozenset[str] = frozenset()) -> list[Node]:
    """Nodes (in the given topological order) fed by `sources` that `target` depends on;
    outputs of `stop` ops count as not fed."""
    fed, reached = set(sources), []
    for node in nodes:
        if any(i in fed for i in list(node.inputs) + list(node.implicit_inputs)):
            reached.append(node)
            if node.op_type not in stop:
                fed.update(o for o in node.outputs if o)
    needed, kept = {target}, []
    for node in reversed(reached):
        if any(o in needed for o in node.outputs if o):
            kept.append(node)
            needed.update(node.inputs)
            needed.update(node.implicit_inputs)
    return [n for n in kept[::-1] if n.op_type not in stop]


def _toposort(graph: Graph) -> list[Node]:
    """graph.nodes in a topological order, keeping the given order where it already is one."""
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs if o}
    seen, order = [False] * len(graph.nodes), []

    def visit(i: int) -> None:
        stack = [(i, False)]
        while stack:
            j, expanded = stack.pop()
            if expanded:
                order.append(graph.nodes[j])
                continue
            if seen[j]:
                continue  # done, or on the stack: a cycle, which the planner reports
            seen[j] = True
            stack.append((j, True))
            node = graph.nodes[j]
            for name in reversed(list(node.inputs) + list(node.implicit_inputs)):
                k = producer.get(name)
                if k is not None and not seen[k]:
                    stack.append((k, False))

    for i in range(len(graph.nodes)):
        visit(i)
    return order


def _broadcast(shapes):
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        big = [d for d in dims if d != 1]
        ints = [d for d in big if isinstance(d, int)]
        if not big:
            out.append(1)
        elif ints:
            out.append(ints[0])
        elif all(d == big[0] for d in big):
            out.append(big[0])
        else:
            out.append(None)
    return tuple(out)


def _matmul_shape(a, b):
    if a is None or b is None or not a or not b:
        return None
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    batch = _broadcast([a2[:-2], b2[:-2]])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _axes(attrs, consts, rank):
    """Axes from the `axes` attribute or a constant second input, made non-negative."""
    axes = consts[1] if len(consts) > 1 and consts[1] is not None else attrs.get("axes")
    if axes is None:
        return None
    return sorted(int(a) % rank for a in np.asarray(axes).ravel())


def _reshape_shape(attrs, shapes, consts):
    x, target = shapes[0], [int(d) for d in consts[1]]
    out = [x[i] if d == 0 and not attrs.get("allowzero") else d for i, d in enumerate(target)]
    if -1 in out:
        known = [d for d in out if d != -1]
        if not all(isinstance(d, int) for d in list(x) + known):
            return tuple(None if d == -1 else d for d in out)
        out[out.index(-1)] = int(np.prod(x)) // max(int(np.prod(known)), 1)
    return tuple(out)


def _unsqueeze_shape(attrs, shapes, consts):
    rank = len(shapes[0]) + len(np.asarray(consts[1] if len(consts) > 1 and consts[1] is not None
                                           else attrs["axes"]).ravel())
    rest = iter(shapes[0])
    axes = _axes(attrs, consts, rank)
    return tuple(1 if i in axes else next(rest) for i in range(rank))


def _squeeze_shape(attrs, shapes, consts):
    axes = _axes(attrs, consts, len(shapes[0]))
    if axes is None:
        axes = [i for i, d in enumerate(shapes[0]) if d == 1]
        if any(not isinstance(d, int) for d in shapes[0]):
            return None
    return tuple(d for i, d in enumerate(shapes[0]) if i not in axes)


def _flatten_shape(attrs, shapes, consts):
    x, axis = shapes[0], attrs.get("axis", 1) % (len(shapes[0]) + 1)

    def prod(dims):
        return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None
    return (prod(x[:axis]), prod(x[axis:]))


def _reduce_shape(attrs, shapes, consts):
    x = shapes[0]
    axes = _axes(attrs, consts, len(x))
    if axes is None or not axes:
        if axes is not None and attrs.get("noop_with_empty_axes"):
            return tuple(x)
        axes = list(range(len(x)))
    if attrs.get("keepdims", 1):
        return tuple(1 if i in axes else d for i, d in enumerate(x))
    return tuple(d for i, d in enumerate(x) if i not in axes)


def _transpose_shape(attrs, shapes, consts):
    perm = attrs.get("perm") or list(range(len(shapes[0])))[::-1]
    return tuple(shapes[0][p] for p in perm)


# op type -> (attrs, input shapes, constant inputs or None) -> output shape; may raise TypeError
# (e.g. on an unknown shape, None) when it cannot tell.
_SHAPE_RULES = {
    **{op: lambda attrs, shapes, consts: shapes[0] for op in _SAME_SHAPE_OPS},
    **{op: lambda attrs, shapes, consts: _broadcast(shapes) for op in _BROADCAST_OPS},
    "MatMul": lambda attrs, shapes, consts: _matmul_shape(*shapes),
    "Transpose": _transpose_shape,
    "Reshape": _reshape_shape,
    "Unsqueeze": _unsqueeze_shape,
    "Squeeze": _squeeze_shape,
    "Flatten": _flatten_shape,
    "ReduceSum": _reduce_shape,
}


# -- vector-Jacobian products ------------------------------------------------------------------
# Each rule gets the builder, the forward node and the gradient of its (first) output, and returns
# one entry per input: a thunk emitting that input's gradient, or None where none flows.
Rule = Callable[[_Builder, Node, str], list]


def _add(b, n, g):
    y = b.shape(n.outputs[0])
    return [lambda x=x: b.sum_to(g, x, y) for x in n.inputs]


def _sub(b, n, g):
    y = b.shape(n.outputs[0])
    return [lambda: b.sum_to(g, n.inputs[0], y),
            lambda: b.sum_to(b.op("Neg", g), n.inputs[1], y)]


def _mul(b, n, g):
    (p, q), y = n.inputs, b.shape(n.outputs[0])
    return [lambda: b.sum_to(b.op("Mul", g, q), p, y),
            lambda: b.sum_to(b.op("Mul", g, p), q, y)]


def _div(b, n, g):
    (p, q), out = n.inputs, n.outputs[0]
    y = b.shape(out)
    return [lambda: b.sum_to(b.op("Div", g, q), p, y),
            lambda: b.sum_to(b.op("Neg", b.op("Div", b.op("Mul", g, out), q)), q, y)]


def _where(b, n, g):
    c, y = n.inputs[0], b.shape(n.outputs[0])
    zero = lambda: b.scalar(0, n.outputs[0])  # noqa: E731
    return [None,
            lambda: b.sum_to(b.op("Where", c, g, zero()), n.inputs[1], y),
            lambda: b.sum_to(b.op("Where", c, zero(), g), n.inputs[2], y)]


def _matmul(b, n, g):
    a, c = n.inputs
    ra, rc = b.rank(a, "MatMul"), b.rank(c, "MatMul")
    ry = len(b.shape(n.outputs[0]) or ())
    sa, sc = b.shape(a), b.shape(c)
    # Promote 1-D operands to matrices, as MatMul does, and the gradient along with them.
    a2 = b.unsqueeze(a, [0]) if ra == 1 else a
    c2 = b.unsqueeze(c, [1]) if rc == 1 else c
    sa2 = (1,) + tuple(sa) if ra == 1 else tuple(sa)
    sc2 = tuple(sc) + (1,) if rc == 1 else tuple(sc)
    g_axes = [0, 1] if ra == rc == 1 else [ry - 1] if ra == 1 else [ry] if rc == 1 else []
    g2 = b.unsqueeze(g, g_axes) if g_axes else g
    batch = _broadcast([sa2[:-2], sc2[:-2]])
    rg = ry + len(g_axes)

    def swap(v, r):
        return b.op("Transpose", v, perm=list(range(r - 2)) + [r - 1, r - 2])

    def shaped(*tail):
        return None if batch is None else batch + tail

    def grad_c():
        if rc == 1:  # G2^T A2 = (A2^T G2)^T: the promoted axis leads, and sum_to drops it
            return b.sum_to(b.op("MatMul", swap(g2, rg), a2), c, shaped(1, sc2[-2]))
        return b.sum_to(b.op("MatMul", swap(a2, len(sa2)), g2), c, shaped(*sc2[-2:]))

    return [lambda: b.sum_to(b.op("MatMul", g2, swap(c2, len(sc2))), a, shaped(*sa2[-2:])),
            grad_c]


def _relu(b, n, g):
    x = n.inputs[0]
    return [lambda: b.op("Where", b.op("Greater", x, b.scalar(0, x)), g, b.scalar(0, x))]


def _reshape_like(b, n, g):  # Reshape, Flatten, Squeeze, Unsqueeze: only data has a gradient
    return [lambda: b.reshape_like(g, n.inputs[0])]


def _transpose(b, n, g):
    perm = n.attrs.get("perm")
    if perm is None:  # the default, reversing the axes, is its own inverse
        return [lambda: b.op("Transpose", g)]
    return [lambda: b.op("Transpose", g, perm=[int(i) for i in np.argsort(perm)])]


def _reduce_sum(b, n, g):
    x = n.inputs[0]

    def rule():
        gg = g
        runtime_axes = len(n.inputs) > 1 and n.inputs[1]
        if not runtime_axes and n.attrs.get("noop_with_empty_axes"):
            return g  # no axes and noop_with_empty_axes: ReduceSum was the identity
        if not n.attrs.get("keepdims", 1):
            axes = n.attrs.get("axes")
            if runtime_axes:
                axes = b.graph.initializers.get(n.inputs[1])
                if axes is None:
                    raise InvalidModelError(f"Gradient: ReduceSum '{n.outputs[0]}' with "
                                            "keepdims=0 needs constant axes to be differentiated")
            r = b.rank(x, "ReduceSum")
            axes = [int(a) % r for a in np.asarray(axes).ravel()] \
                if axes is not None and np.size(axes) else list(range(r))
            gg = b.unsqueeze(g, sorted(axes))
        return b.op("Expand", gg, b.op("Shape", x), info=b.info.get(x))

    return [rule, None]


_VJPS: dict[str, Rule] = {
    "Add": _add,
    "Sub": _sub,
    "Mul": _mul,
    "Div": _div,
    "Neg": lambda b, n, g: [lambda: b.op("Neg", g)],
    "Identity": lambda b, n, g: [lambda: g],
    "MatMul": _matmul,
    "Relu": _relu,
    "Sigmoid": lambda b, n, g: [  # g * y * (1 - y) = g * (y - y*y)
        lambda: b.op("Mul", g, b.op("Sub", n.outputs[0],
                                    b.op("Mul", n.outputs[0], n.outputs[0])))],
    "Tanh": lambda b, n, g: [  # g * (1 - y*y)
        lambda: b.op("Sub", g, b.op("Mul", g, b.op("Mul", n.outputs[0], n.outputs[0])))],
    "Exp": lambda b, n, g: [lambda: b.op("Mul", g, n.outputs[0])],
    "Log": lambda b, n, g: [lambda: b.op("Div", g, n.inputs[0])],
    "Sqrt": lambda b, n, g: [  # g / (2 y)
        lambda: b.op("Div", b.op("Mul", g, b.scalar(0.5, n.outputs[0])), n.outputs[0])],
    "Where": _where,
    "Reshape": _reshape_like,
    "Flatten": _reshape_like,
    "Squeeze": _reshape_like,
    "Unsqueeze": _reshape_like,
    "Transpose": _transpose,
    "ReduceSum": _reduce_sum,
}
