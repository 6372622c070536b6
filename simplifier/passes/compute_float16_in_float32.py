"""On the CPU, float16 computation runs in float32: float16 values keep their float16 type only
where one must leave the float32 region (graph outputs, and readers that need float16 exactly).

numpy's float16 arithmetic is many times slower than its float32 arithmetic, and ember's fused
CPU kernels are float32 ones. onnxruntime's CPU provider computes such models the same way: its
InsertCastTransformer wraps each float16 node without a float16 kernel in casts to and from
float32, and RemoveDuplicateCastTransformer drops the cast pairs between them, so whole chains
run in float32 and round to float16 only at their ends. Following it makes ember's results
agree with onnxruntime's (and with the float32 model) more closely than the literal float16
roundings of every node would.

The rewrite, on each graph of a CPU (non-portable) target:

- a node is widened (computed in float32) when it is a default-domain op whose schema allows
  float32 wherever the node has float16, every value it reads or writes has a known type, and
  its meaning does not depend on the element type (not Cast, CastLike, ops with a `dtype` or
  `to` attribute, ops with subgraphs). Ops that compute a float16 result are widened; ops that
  only move or select float16 values (Reshape, Transpose, Concat, Gather...), and ops whose
  results are not float16 (Shape, comparisons), are widened when a neighbour through a float16
  value is, so the float32 region does not stop at them and a lone one gets no casts around it;
- a float16 value a widened node reads becomes: a float32 copy of a float16 initializer (made
  once, here); the source of a `Cast(to=float16)` (cast to float32 where it is not float32
  already), as onnxruntime drops a model's cast to float16 that meets its inserted cast back;
  else `Cast(to=float)` of the value;
- a float16 value a widened node writes is float32; where a graph output or another reader
  needs the float16 value, `Cast(to=float16)` makes it under its own name, so outputs keep
  their names and declared float16 type. A `Cast(to=float)` reading such a value reads the
  float32 value (it then is a no-op, removed by remove_noops), as the cast pair is in
  onnxruntime; any other cast keeps reading the float16 value.

Switched off by EMBER_WIDEN_HALF=0 (or skip=("compute_float16_in_float32",)); an
unsimplified run keeps every float16 rounding. bfloat16 is left as the model writes it.
"""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto

from ember import config
from ember.ir import Graph, Node, TensorType, ValueInfo
from ember.ops.registry import schema_for
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, producers_first

_HALF = np.dtype(np.float16)
_FLOAT = np.dtype(np.float32)

# Ops whose result depends on the element type they are asked for, not only on the values.
_TYPED = {"Cast", "CastLike", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal",
          "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}
_TYPE_ATTRIBUTES = {"to", "dtype", "output_dtype"}

# Ops that move or select values without arithmetic: computing them in float16 or float32
# gives the same values, so they follow their neighbours rather than start a float32 region.
_MOVES = {"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat",
          "Split", "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad",
          "DepthToSpace", "SpaceToDepth", "Where", "Max", "Min", "ReduceMax", "ReduceMin",
          "Abs", "Neg", "Relu", "Compress", "ScatterElements", "ScatterND", "ReverseSequence",
          "Trilu", "Dropout"}


def compute_float16_in_float32(graph: Graph, ctx: Context) -> bool:
    if ctx.portable or ctx.backend != "cpu" or \
            not config.switch("EMBER_WIDEN_HALF", True):
        return False
    index = GraphIndex(graph)
    widened = _widened_nodes(graph, index)
    if not widened:
        return False

    def is_widened(node: Node | None) -> bool:
        return node is not None and id(node) in widened

    wide: dict[str, str] = {}  # float16 value -> its float32 version
    new_nodes: list[Node] = []

    def cast(source: str, to: int, output: str, dtype: np.dtype, shape) -> None:
        new_nodes.append(Node("Cast", "", ctx.opset(""), [source], [output], attrs={"to": to},
                              attr_types={"to": AttributeProto.INT}))
        graph.value_info[output] = ValueInfo(output, TensorType(dtype, shape))

    # What the widened nodes write: float32, with a float16 copy where something needs one.
    for node in graph.nodes:
        if not is_widened(node):
            continue
        for k, name in enumerate(node.outputs):
            if not name or index.dtype(name) != _HALF:
                continue
            readers = index.consumers.get(name, [])
            needs_half = name in index.outputs or any(
                not is_widened(r) and not _reads_as_float(r) for r in readers)
            shape = index.shape(name)
            if needs_half:
                wide[name] = index.fresh_name(name + "_float32")
                node.outputs[k] = wide[name]
                graph.value_info[wide[name]] = ValueInfo(wide[name], TensorType(_FLOAT, shape))
                cast(wide[name], TensorProto.FLOAT16, name, _HALF, shape)
            else:
                wide[name] = name
                graph.value_info[name] = ValueInfo(name, TensorType(_FLOAT, shape))
            for reader in readers:
                if not is_widened(reader) and _reads_as_float(reader):
                    reader.inputs = [wide[name] if n == name else n for n in reader.inputs]

    def float32_of(name: str) -> str:
        if name in wide:
            return wide[name]
        value = index.constant(name)
        producer = index.producer.get(name)
        if value is not None:
            wide[name] = index.add_constant(name + "_float32", value.astype(np.float32))
        elif _drops_to_half(producer, index):
            source = producer.inputs[0]
            if index.dtype(source) == _FLOAT:
                wide[name] = source
            else:
                wide[name] = index.fresh_name(name + "_float32")
                cast(source, TensorProto.FLOAT, wide[name], _FLOAT, index.shape(name))
        else:
            wide[name] = index.fresh_name(name + "_float32")
            cast(name, TensorProto.FLOAT, wide[name], _FLOAT, index.shape(name))
        return wide[name]

    # What they read.
    for node in graph.nodes:
        if is_widened(node):
            node.inputs = [float32_of(n) if n and index.dtype(n) == _HALF else n
                           for n in node.inputs]
    graph.nodes.extend(new_nodes)
    graph.nodes = producers_first(graph)  # the new casts sit before their readers
    return True


def _widened_nodes(graph: Graph, index: GraphIndex) -> set[int]:
    """The ids of the nodes to compute in float32: those that compute a float16 result, then,
    until nothing changes, the moving and non-float16-result ones next to a widened node
    through a float16 value (or reading a cast to float16, whose source they can read)."""
    widened: set[int] = set()
    followers: list[Node] = []
    for node in graph.nodes:
        if not _can_widen(node, index):
            continue
        writes_half = any(o and index.dtype(o) == _HALF for o in node.outputs)
        if writes_half and node.op_type not in _MOVES:
            widened.add(id(node))
        else:
            followers.append(node)
    changed = bool(followers)
    while changed:
        changed = False
        for node in followers:
            if id(node) in widened:
                continue
            halves_in = [n for n in node.inputs if n and index.dtype(n) == _HALF]
            halves_out = [o for o in node.outputs if o and index.dtype(o) == _HALF]
            producers = [index.producer.get(n) for n in halves_in]
            if any(id(p) in widened or _drops_to_half(p, index) for p in producers) or any(
                    id(r) in widened for o in halves_out for r in index.consumers.get(o, [])):
                widened.add(id(node))
                changed = True
    return widened


def _can_widen(node: Node, index: GraphIndex) -> bool:
    """Whether `node` computes the same op in float32 in place of float16: see the module
    docstring."""
    if node.domain or node.op_type in _TYPED or node.subgraphs() or \
            _TYPE_ATTRIBUTES & node.attrs.keys():
        return False
    values = [(i, n, True) for i, n in enumerate(node.inputs) if n] + \
        [(i, n, False) for i, n in enumerate(node.outputs) if n]
    dtypes = [index.dtype(n) for _, n, _ in values]
    if _HALF not in dtypes or any(d is None for d in dtypes):
        return False
    schema = schema_for(node.domain, node.op_type, node.version)
    if schema is None:
        return False
    bound: dict[str, set[np.dtype]] = {}  # type parameter -> the dtypes bound to it
    for (i, _, is_input), dtype in zip(values, dtypes):
        formals = schema.inputs if is_input else schema.outputs
        if not formals:
            return False
        formal = formals[min(i, len(formals) - 1)]
        if dtype == _HALF and formal.type_str.startswith("tensor("):
            return False  # this position is float16 by definition
        bound.setdefault(formal.type_str, set()).add(dtype)
    for constraint in schema.type_constraints:
        dtypes_of = bound.get(constraint.type_param_str, set())
        if _HALF in dtypes_of and (dtypes_of != {_HALF} or
                                   "tensor(float)" not in constraint.allowed_type_strs):
            return False
    return True


def _reads_as_float(node: Node) -> bool:
    """A Cast to float32: reading the float32 value in place of its float16 rounding is the
    cast pair onnxruntime removes."""
    return not node.domain and node.op_type == "Cast" and \
        node.attrs.get("to") == TensorProto.FLOAT


def _drops_to_half(node: Node | None, index: GraphIndex) -> bool:
    """Whether `node` is a Cast to float16 from a number type, whose source a float32 reader
    can take in its place (cast to float32)."""
    if node is None or node.domain or node.op_type != "Cast" or \
            node.attrs.get("to") != TensorProto.FLOAT16:
        return False
    source = index.dtype(node.inputs[0])
    return source is not None and source.kind in "fiub"
