"""Type and shape inference, with symbolic dimensions, by onnx's own inference over the
exported graph. Large weights travel as typed inputs rather than data: inference needs their
shapes, not their values, and serialising a BERT's weights on every round would cost seconds.

onnx's inference is C++ that trusts its input: a malformed graph can abort or crash the
process, not just raise. So the exported graph goes through the importer's structural check
(importer.validate), and inference runs only on a graph that passed it. Once per run (per
Context) is enough: later rounds export the passes' rewrites of the checked graph, which keep
it valid (with EMBER_SIMPLIFY_STRICT, `recheck` checks after every round all the same). Nodes of
ops whose inference dereferences an input's type without looking (RegexFullMatch and three
ai.onnx.ml ops) are hidden from it while that type is unknown.

Inference reads protobuf, so each round still exports the graph for it; the value infos and
small initialisers that stay the same from round to round are converted once per run, and so
are the types decoded back."""
from __future__ import annotations

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from ember.errors import EmberError
from ember.importer.onnx_export import array_to_tensor, export_model, export_value_info
from ember.importer.onnx_values import decode_type
from ember.importer.validate import check_model
from ember.ir import Graph, Model, Node, TensorType, ValueInfo
from ember.simplifier.context import Context

# ctx.scratch key: a graph of this run has passed the importer's check.
_CHECKED = "infer_shapes.checked"
# ctx.scratch keys: the caches _inference_proto and _decode keep across rounds.
_EXPORTED = "infer_shapes.exported"
_DECODED = "infer_shapes.decoded"
# Initialisers up to this many elements are exported with their data (shape arithmetic on
# them lets inference compute Reshape targets and the like).
_DATA_MAX_ELEMENTS = 4096


def infer_shapes(graph: Graph, ctx: Context) -> bool:
    """Fill graph.value_info with what onnx's inference knows. Returns whether it learnt
    anything new (it never changes the graph itself)."""
    if graph is not ctx.model.graph:
        return False
    try:
        proto = _inference_proto(ctx.model, ctx.scratch.setdefault(_EXPORTED, {}))
        if not ctx.scratch.get(_CHECKED):
            check_model(proto)
    except (EmberError, DecodeError):  # not fit for the C++ code; the planner says what is wrong
        return False
    ctx.scratch[_CHECKED] = True
    # Data propagation (shape values through Shape -> Gather -> Concat) costs most of the
    # time; it only matters while Shape / Size nodes remain that folding could not remove.
    propagate = any(n.op_type in ("Shape", "Size") for n in graph.nodes)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False,
                                                     data_prop=propagate)
    except Exception:  # inference is advice: a model it cannot handle is simplified without
        return False
    return _learn(graph, inferred.graph, ctx.scratch.setdefault(_DECODED, {}))


def _learn(graph: Graph, inferred: onnx.GraphProto, decoded: dict) -> bool:
    """Fill graph.value_info from `inferred` (the same graph as inference returned it), and
    each subgraph's from its counterpart (onnx's inference types the bodies of If, Loop and
    Scan too: without their types, the fusions would leave a body's Conv + Relu apart).
    Returns whether anything new was learnt."""
    learnt = False
    known = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for info in inferred.value_info:
        if info.name in known or info.name in graph.initializers:
            continue
        value_type = _decode(info, decoded)
        if not isinstance(value_type, TensorType):
            continue
        old = graph.value_info.get(info.name)
        if old is None or old.type != value_type and _more_specific(value_type, old.type):
            graph.value_info[info.name] = ValueInfo(info.name, value_type)
            learnt = True
    # a body's counterpart: the exported node with the same outputs, its attribute by name
    exported = {tuple(n.output): n for n in inferred.node
                if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in n.attribute)}
    for node in graph.nodes:
        twin = exported.get(tuple(node.outputs)) if node.subgraphs() else None
        if twin is None:
            continue
        bodies = {a.name: [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
                  for a in twin.attribute}
        for name, value in node.attrs.items():
            subs = [value] if isinstance(value, Graph) else value \
                if isinstance(value, list) and value and isinstance(value[0], Graph) else []
            for sub, inferred_sub in zip(subs, bodies.get(name, ())):
                learnt |= _learn(sub, inferred_sub, decoded)
    return learnt


def _decode(info: onnx.ValueInfoProto, memo: dict):
    """decode_type of `info`'s type, memoised by its bytes: most values keep their type
    from round to round."""
    if not info.HasField("type"):
        return None
    key = info.type.SerializeToString()
    if key not in memo:
        memo[key] = decode_type(info.type)
    return memo[key]


def recheck(ctx: Context) -> None:
    """EMBER_SIMPLIFY_STRICT, after a round that changed the graph: the importer's check on the
    graph as inference now sees it, once a graph of this run has passed it (until then
    infer_shapes checks every round itself). Raises what the check raises."""
    if ctx.scratch.get(_CHECKED):
        check_model(_inference_proto(ctx.model))


def _more_specific(new: TensorType, old) -> bool:
    if not isinstance(old, TensorType):
        return True
    if old.shape is None or old.dtype is None:
        return True
    if new.shape is None or len(new.shape) != len(old.shape):
        return False
    return sum(isinstance(d, int) for d in new.shape) > sum(isinstance(d, int) for d in old.shape)


def _inference_proto(model: Model, cache: dict | None = None) -> onnx.ModelProto:
    """The graph as inference sees it: large initialisers as typed inputs, small ones with
    their data. `cache` (kept across one run's rounds) holds the protos of the value infos and
    small initialisers exported before: most of them are the same round after round."""
    graph = model.graph
    big = {name: value for name, value in graph.initializers.items()
           if isinstance(value, np.ndarray) and value.size > _DATA_MAX_ELEMENTS}
    small = {k: v for k, v in graph.initializers.items() if k not in big}
    if cache is not None and model.ir_version < 4:
        cache = None  # the export declares initialisers as inputs there: it needs them all
    slim = Graph(graph.name, list(graph.inputs), list(graph.outputs), _shown_nodes(graph),
                 small if cache is None else {},
                 dict(graph.value_info) if cache is None else {})
    declared = {v.name for v in graph.inputs}
    slim.inputs += [ValueInfo(name, TensorType(value.dtype, tuple(value.shape)))
                    for name, value in big.items() if name not in declared]
    proto = export_model(Model(slim, dict(model.opsets), model.ir_version))
    if cache is not None:  # as export_graph writes them, in the same order
        proto.graph.initializer.extend(_initializer_protos(small, cache))
        proto.graph.value_info.extend(_value_info_protos(graph.value_info.values(), cache))
    return proto


def _initializer_protos(initializers: dict, cache: dict):
    """TensorProtos of `initializers`, each made once per array (weights are never written,
    only replaced, so an array is known by its identity)."""
    for name, value in initializers.items():
        entry = cache.get(("initializer", name))
        if entry is None or entry[0] is not value:
            entry = cache[("initializer", name)] = (value, array_to_tensor(value, name))
        yield entry[1]


def _value_info_protos(infos, cache: dict):
    """ValueInfoProtos of `infos`, each made once per name, type and doc."""
    for info in infos:
        key = ("value_info", info.name, info.type, info.doc)
        try:
            proto = cache.get(key)
        except TypeError:  # a type built with unhashable parts (a list for a shape)
            yield export_value_info(info)
            continue
        if proto is None:
            proto = cache[key] = export_value_info(info)
        yield proto


# Ops whose onnx inference reads an input's type without checking that there is one, so it
# segfaults on a value of unknown type. Found by running onnx 1.23's inference on every
# schema version with inputs of unknown type (and of every other kind: shapeless, scalar,
# string, sequence, optional, map), each in a child process: only these crashed.
_NEEDS_INPUT_TYPES = {("", "RegexFullMatch"), ("ai.onnx.ml", "DictVectorizer"),
                      ("ai.onnx.ml", "LabelEncoder"), ("ai.onnx.ml", "TreeEnsemble")}


def _shown_nodes(graph: Graph, outer: tuple[set[str], ...] = ()) -> list[Node]:
    """graph.nodes, with each node of an op in _NEEDS_INPUT_TYPES whose input types are not
    all declared replaced by an opaque stand-in (a custom op, which inference skips), in
    subgraphs too (those are copied, never changed). `outer`: the typed names of enclosing
    graphs, innermost last."""
    if not outer and not any((n.domain, n.op_type) in _NEEDS_INPUT_TYPES
                             for n in graph.iter_nodes()):
        return graph.nodes  # the usual case: nothing to hide
    typed = outer + ({v.name for v in graph.inputs if v.type is not None} | set(graph.initializers)
                     | {n for n, v in graph.value_info.items() if v.type is not None},)
    shown = []
    for node in graph.nodes:
        if (node.domain, node.op_type) in _NEEDS_INPUT_TYPES and \
                not all(any(name in names for names in typed) for name in node.inputs if name):
            node = Node("Opaque", "ai.ember.hidden", 1, list(node.inputs), list(node.outputs),
                        name=node.name)
        elif node.subgraphs():
            node = _with_shown_subgraphs(node, typed)
        shown.append(node)
    return shown


def _with_shown_subgraphs(node: Node, typed: tuple[set[str], ...]) -> Node:
    """`node` itself, or a copy whose subgraphs hide what _shown_nodes hides."""
    changed = False

    def shown(graph: Graph) -> Graph:
        nonlocal changed
        nodes = _shown_nodes(graph, typed)
        if all(a is b for a, b in zip(nodes, graph.nodes)):
            return graph
        changed = True
        return Graph(graph.name, graph.inputs, graph.outputs, nodes, graph.initializers,
                     graph.value_info, graph.doc)

    attrs = {name: shown(value) if isinstance(value, Graph) else
             [shown(v) for v in value] if isinstance(value, list) and value
             and isinstance(value[0], Graph) else value
             for name, value in node.attrs.items()}
    if not changed:
        return node
    return Node(node.op_type, node.domain, node.version, node.inputs, node.outputs, attrs,
                node.attr_types, node.name, node.implicit_inputs)
