"""Ops the target backend lacks, expanded into their ONNX function body.

For a backend other than the CPU, a node with no kernel on that backend whose ONNX schema
defines a function body (LayerNormalization, Gelu, HardSwish, Celu,
MeanVarianceNormalization, ...) is replaced by the body's nodes, renamed into the graph, so
the backend runs them natively instead of falling back to the CPU. Context-dependent bodies
(built from the node's input types) are asked for with the types shape inference found.
"""
from __future__ import annotations

import itertools

import onnx

from ember.importer.onnx_export import export_node, export_type
from ember.importer.onnx_import import Importer
from ember.ir import Graph, Node
from ember.ops._dtypes import is_narrow_float
from ember.ops.registry import schema_for
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, all_names, drop_dead


def expand_functions(graph: Graph, ctx: Context) -> bool:
    if ctx.backend == "cpu":
        return False
    index = GraphIndex(graph)
    changed = False
    for node in list(graph.nodes):
        if node.subgraphs() or ctx.has_kernel(node.domain, node.op_type, node.version):
            continue
        if any(is_narrow_float(t) for t in map(index.dtype, node.inputs + node.outputs)
               if t is not None):
            continue  # the kernel rounds a float16 result once; a body (in T) at every step
        body = function_body(node, index)
        if body is None:
            continue
        expanded = _inline(node, body, ctx)
        if not all(ctx.has_kernel(n.domain, n.op_type, n.version) or
                   function_body(n, index) is not None for n in expanded):
            continue  # the body would fall back anyway: keep the op whole
        graph.nodes.extend(expanded)
        index.kill(node)
        changed = True
    drop_dead(graph, index)
    return changed


def function_body(node: Node, index: GraphIndex) -> onnx.FunctionProto | None:
    """The node's ONNX function body at the best version for its opset, or None."""
    schema = schema_for(node.domain, node.op_type, node.version)
    if schema is None:
        return None
    plain = [v for v in schema.function_opset_versions if v <= node.version]
    contextual = [v for v in schema.context_dependent_function_opset_versions
                  if v <= node.version]
    proto = None
    if schema.has_function and plain:
        proto = schema.get_function_with_opset_version(max(plain))
    elif schema.has_context_dependent_function and contextual:
        types = [index.tensor_type(n) if n else None for n in node.inputs]
        if any(n and (t is None or t.dtype is None) for n, t in zip(node.inputs, types)):
            return None
        encoded = [export_type(t).SerializeToString() if t is not None
                   else onnx.TypeProto().SerializeToString() for t in types]
        try:
            proto = schema.get_context_dependent_function_with_opset_version(
                max(contextual), export_node(node).SerializeToString(), encoded)
        except Exception:  # onnx refuses some contexts (unsupported types): keep the op
            return None
    if not proto:
        return None
    function = onnx.FunctionProto()
    function.ParseFromString(proto if isinstance(proto, bytes) else proto.SerializeToString())
    return function


def _inline(node: Node, function: onnx.FunctionProto, ctx: Context) -> list[Node]:
    importer = ctx.scratch.get("importer")
    if importer is None:
        importer = ctx.scratch["importer"] = Importer(onnx.ModelProto(), None)
        # body values are named "<op>_<n>__<name>": start n past anything already there
        importer._fresh = itertools.count(len(all_names(ctx.model.graph)))
    call = export_node(node)
    call.name = call.name or f"{node.op_type}_{node.outputs[0]}"
    _add_schema_defaults(call, node)
    opsets = dict(ctx.model.opsets)
    nodes: list[Node] = []
    for inner, inner_opsets in importer.inline(call, function, opsets):
        nodes.extend(importer.nodes_for(inner, inner_opsets))
    return nodes


def _add_schema_defaults(call: onnx.NodeProto, node: Node) -> None:
    """The op schema's defaults for the attributes the call leaves unset: a function body's
    references to them (HammingWindow's Cast to=@output_datatype) take the default, as in
    onnx's own function expansion."""
    schema = schema_for(node.domain, node.op_type, node.version)
    if schema is None:
        return
    given = {a.name for a in call.attribute}
    for name, attr in schema.attributes.items():
        if name not in given and attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            default = call.attribute.add()
            default.CopyFrom(attr.default_value)
            default.name = name
