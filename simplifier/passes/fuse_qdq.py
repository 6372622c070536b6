"""QDQ node units become integer ops, as onnxruntime's graph optimiser makes them:

    Q(Conv(DQ(x), DQ(w), DQ(b)))      -> QLinearConv(x, ..., w, ..., b)
    Q(MatMul(DQ(a), DQ(b)))           -> QLinearMatMul
    Q(Gemm(DQ(a), DQ(b), DQ(c)))      -> com.microsoft QGemm              (ember's targets)
    Q(Add|Mul(DQ(a), DQ(b)))          -> com.microsoft QLinearAdd|QLinearMul
    Q(GlobalAveragePool(DQ(x)))       -> com.microsoft QLinearGlobalAveragePool

Why: the QDQ graph means dequantise, compute in float, quantise, and the float op's summation
order is unspecified, so two runtimes may round a value near a quantisation boundary to
neighbouring codes. onnxruntime (at its default optimisation level) runs these units as the
integer kernels above: the exact integer accumulation, requantised with one float32
multiplier. Running the same kernels gives its bits; the float graph (`simplify=False`) stays
within one quantum per unit of it. A unit is fused only where onnxruntime's selectors would
fuse it: 8-bit activations of one type in and out, per-tensor constant activation
parameters, constant weights (per tensor or per output channel), an int32 bias, and an op
output read by the QuantizeLinear alone."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.ops.registry import lookup
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead

MS = "com.microsoft"
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))


class _DQ:
    """A DequantizeLinear feeding the unit: its data name and constant parameters."""

    def __init__(self, node: Node, data: str, scale: np.ndarray, zero: np.ndarray | None,
                 axis: int):
        self.node, self.data, self.scale, self.zero, self.axis = node, data, scale, zero, axis


def _dequantize(index: GraphIndex, name: str) -> _DQ | None:
    """The DequantizeLinear producing `name`, when its scale and zero point are constants
    and it is per tensor or per axis (not blocked)."""
    node = index.producer.get(name)
    if node is None or node.domain or node.op_type != "DequantizeLinear" or \
            not index.alive(node) or len(node.inputs) < 2:
        return None
    if node.attrs.get("block_size", 0) or node.attrs.get("output_dtype", 0):
        return None
    scale = index.constant(node.inputs[1])
    zero = index.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if scale is None or scale.dtype != np.float32 or \
            (len(node.inputs) > 2 and node.inputs[2] and zero is None):
        return None
    return _DQ(node, node.inputs[0], scale, zero, int(node.attrs.get("axis", 1)))


def _qtype(dq: _DQ, index: GraphIndex) -> np.dtype | None:
    """The quantised type of a DequantizeLinear's data: its zero point's (the spec makes them
    equal), else the inferred one."""
    return dq.zero.dtype if dq.zero is not None else index.dtype(dq.data)


def _per_tensor(dq: _DQ | None, index: GraphIndex) -> bool:
    """An 8-bit activation dequantised with one scale and zero point."""
    return dq is not None and dq.scale.size == 1 and (dq.zero is None or dq.zero.size == 1) \
        and _qtype(dq, index) in _INT8


def _quantize_after(index: GraphIndex, op: Node) -> Node | None:
    """The per-tensor QuantizeLinear that alone reads `op`'s only output."""
    if len([o for o in op.outputs if o]) != 1:
        return None
    q = index.only_consumer(op.outputs[0])
    if q is None or q.domain or q.op_type != "QuantizeLinear" or q.inputs[0] != op.outputs[0]:
        return None
    scale = index.constant(q.inputs[1]) if len(q.inputs) > 1 else None
    zero = index.constant(q.inputs[2]) if len(q.inputs) > 2 and q.inputs[2] else None
    if scale is None or scale.size != 1 or scale.dtype != np.float32 or zero is None or \
            zero.size != 1 or zero.dtype not in _INT8 or q.attrs.get("output_dtype", 0):
        return None
    return q


class _Unit:
    """What a rewrite needs: the index, the context and new constants' naming."""

    def __init__(self, index: GraphIndex, ctx: Context):
        self.index, self.ctx = index, ctx

    def can_create(self, domain: str, op_type: str) -> bool:
        """Whether the fused op may be written: a standard op with a schema for a portable
        model; for ember, any op with a CPU kernel (a backend without its own kernel runs
        that one through its host fallback, and so keeps onnxruntime's bits)."""
        version = 1 if domain == MS else self.ctx.opset("")
        if self.ctx.portable:
            return self.ctx.has_kernel(domain, op_type, version)
        return lookup(domain, op_type, version, "cpu") is not None

    def zero(self, dq: _DQ, dtype) -> str:
        """The zero point input of `dq` (a new 0 of `dtype` when it has none)."""
        if dq.zero is not None:
            return dq.node.inputs[2]
        return self.index.add_constant(dq.node.inputs[1] + "_zero", np.zeros((), dtype))

    def replace(self, q: Node, op: Node, op_type: str, domain: str, inputs: list[str],
                attrs: dict) -> None:
        """`q` becomes the fused node (its output and place in the graph stay); `op` goes."""
        q.op_type, q.domain = op_type, domain
        q.version = 1 if domain == MS else self.ctx.opset("")
        self.index.set_inputs(q, inputs)
        q.attrs = dict(attrs)
        q.attr_types = {k: v for k, v in op.attr_types.items() if k in attrs}
        q.name = (op.name or q.name) + "_qdq"
        if domain == MS:
            self.ctx.model.opsets.setdefault(MS, 1)
        self.index.kill(op)


def _bias(index: GraphIndex, name: str, a: _DQ, w: _DQ) -> str | None:
    """The int32 constant a bias DequantizeLinear dequantises (zero point 0), or None. The
    integer op adds it to the accumulator unscaled, so its scale must be a_scale * w_scale
    (onnxruntime's quantiser writes exactly that float32 product)."""
    dq = _dequantize(index, name)
    if dq is None or index.dtype(dq.data) != np.int32 or index.constant(dq.data) is None or \
            (dq.zero is not None and np.any(dq.zero != 0)):
        return None
    expected = (a.scale.reshape(()) * w.scale.reshape(-1)).astype(np.float32)
    scale = dq.scale.reshape(-1)
    if scale.size not in (1, expected.size) or \
            not np.allclose(scale, expected, rtol=1e-6, atol=0):
        return None
    return dq.data


def _weight(index: GraphIndex, name: str, axis: int) -> _DQ | None:
    """A constant 8-bit weight, per tensor or per `axis`."""
    dq = _dequantize(index, name)
    if dq is None or index.constant(dq.data) is None or index.dtype(dq.data) not in _INT8:
        return None
    w = index.constant(dq.data)
    if dq.scale.size != 1:
        rank = w.ndim
        if dq.scale.ndim != 1 or (dq.axis + rank if dq.axis < 0 else dq.axis) != axis % rank:
            return None
        if dq.zero is not None and dq.zero.shape != dq.scale.shape:
            return None
    elif dq.zero is not None and dq.zero.size != 1:
        return None
    return dq


def _fuse_conv(unit: _Unit, op: Node, q: Node) -> bool:
    index = unit.index
    x = _dequantize(index, op.inputs[0])
    w = _weight(index, op.inputs[1], 0) if len(op.inputs) > 1 else None
    if not _per_tensor(x, index) or w is None or \
            not unit.can_create("", "QLinearConv"):
        return False
    if _qtype(x, index) != index.constant(q.inputs[2]).dtype:
        return False
    bias = None
    if len(op.inputs) > 2 and op.inputs[2]:
        bias = _bias(index, op.inputs[2], x, w)
        if bias is None:
            return False
    inputs = [x.data, x.node.inputs[1], unit.zero(x, _qtype(x, index)),
              w.data, w.node.inputs[1], unit.zero(w, _qtype(w, index)),
              q.inputs[1], q.inputs[2]] + ([bias] if bias else [])
    unit.replace(q, op, "QLinearConv", "", inputs, op.attrs)
    return True


def _fuse_matmul(unit: _Unit, op: Node, q: Node) -> bool:
    index = unit.index
    a = _dequantize(index, op.inputs[0])
    b = _weight(index, op.inputs[1], -1)
    if not _per_tensor(a, index) or b is None or index.rank(op.inputs[1]) != 2 or \
            not unit.can_create("", "QLinearMatMul"):
        return False
    if _qtype(a, index) != index.constant(q.inputs[2]).dtype:
        return False
    inputs = [a.data, a.node.inputs[1], unit.zero(a, _qtype(a, index)),
              b.data, b.node.inputs[1], unit.zero(b, _qtype(b, index)),
              q.inputs[1], q.inputs[2]]
    unit.replace(q, op, "QLinearMatMul", "", inputs, {})
    return True


def _fuse_gemm(unit: _Unit, op: Node, q: Node) -> bool:
    index = unit.index
    trans_b = int(op.attrs.get("transB", 0))
    a = _dequantize(index, op.inputs[0])
    b = _weight(index, op.inputs[1], 0 if trans_b else 1)
    if not _per_tensor(a, index) or b is None or not unit.can_create(MS, "QGemm"):
        return False
    if _qtype(a, index) != index.constant(q.inputs[2]).dtype:
        return False
    c = ""
    if len(op.inputs) > 2 and op.inputs[2]:
        c = _bias(index, op.inputs[2], a, b)
        if c is None or float(op.attrs.get("beta", 1.0)) != 1.0:
            return False
    inputs = [a.data, a.node.inputs[1], unit.zero(a, _qtype(a, index)),
              b.data, b.node.inputs[1], unit.zero(b, _qtype(b, index)), c,
              q.inputs[1], q.inputs[2]]
    attrs = {k: op.attrs[k] for k in ("alpha", "transA", "transB") if k in op.attrs}
    unit.replace(q, op, "QGemm", MS, inputs, attrs)
    return True


def _fuse_binary(unit: _Unit, op: Node, q: Node) -> bool:
    index = unit.index
    fused = "QLinearAdd" if op.op_type == "Add" else "QLinearMul"
    a, b = (_dequantize(index, n) for n in op.inputs[:2])
    if not (_per_tensor(a, index) and _per_tensor(b, index)) or \
            not unit.can_create(MS, fused):
        return False
    dtype = _qtype(a, index)
    if _qtype(b, index) != dtype or index.constant(q.inputs[2]).dtype != dtype:
        return False
    inputs = [a.data, a.node.inputs[1], unit.zero(a, dtype),
              b.data, b.node.inputs[1], unit.zero(b, dtype), q.inputs[1], q.inputs[2]]
    unit.replace(q, op, fused, MS, inputs, {})
    return True


def _fuse_global_pool(unit: _Unit, op: Node, q: Node) -> bool:
    index = unit.index
    x = _dequantize(index, op.inputs[0])
    if not _per_tensor(x, index) or not unit.can_create(MS, "QLinearGlobalAveragePool"):
        return False
    dtype = _qtype(x, index)
    if index.constant(q.inputs[2]).dtype != dtype:
        return False
    inputs = [x.data, x.node.inputs[1], unit.zero(x, dtype), q.inputs[1], q.inputs[2]]
    unit.replace(q, op, "QLinearGlobalAveragePool", MS, inputs, {"channels_last": 0})
    q.attr_types = {"channels_last": AttributeProto.INT}
    return True


_FUSERS = {"Conv": _fuse_conv, "MatMul": _fuse_matmul, "Gemm": _fuse_gemm,
           "Add": _fuse_binary, "Mul": _fuse_binary, "GlobalAveragePool": _fuse_global_pool}


def fuse_qdq(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    unit = _Unit(index, ctx)
    changed = False
    for op in index.live(*_FUSERS):
        if not op.inputs or not op.inputs[0]:
            continue
        q = _quantize_after(index, op)
        if q is not None and _FUSERS[op.op_type](unit, op, q):
            changed = True
    drop_dead(graph, index)
    return changed
