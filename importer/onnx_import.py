"""ONNX protobuf -> ember IR.

Phases, in order: read bytes safely, parse, resolve opsets per domain, inline model-local
functions, decode every graph (subgraphs included) into IR nodes with decoded attributes,
record which outer-scope values each subgraph-carrying node reads, and rewrite Gradient
nodes into the ops that compute them.
"""
from __future__ import annotations

import itertools
import os
import re
from typing import Union

import onnx
from google.protobuf.message import DecodeError

from ember.errors import ModelLoadError
from ember.importer.gradient import expand_gradient_nodes
from ember.importer.onnx_values import decode_attribute, decode_type, tensor_to_array
from ember.importer.validate import check_model, check_node, node_label, opset_version
from ember.ir import Graph, Model, Node, ValueInfo
from ember.importer.schemas import normalize_domain

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]

# How protobuf's parsers say a message nests too deep: upb ("Exceeded
# upb_DecodeOptions_MaxDepth"), the pure-Python one ("too many levels of nesting") and the
# C++ one ("recursion limit" / "depth").
_RECURSION_LIMIT = re.compile(r"MaxDepth|depth|nesting|recursion", re.IGNORECASE)


def read_model_proto(source: ModelSource) -> tuple[onnx.ModelProto, str | None]:
    """Parse `source` into a ModelProto without touching external data; returns its folder."""
    if isinstance(source, onnx.ModelProto):
        return source, None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(bytes(source), "<bytes>"), None
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    return _parse(data, path), os.path.dirname(os.path.abspath(path))


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    if not data:
        raise ModelLoadError(f"{label}: the file is empty, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        if _RECURSION_LIMIT.search(str(exc)):
            raise ModelLoadError(
                f"{label}: the model nests messages deeper than protobuf's limit of 100 levels "
                f"(subgraphs inside subgraphs: If, Loop or Scan bodies more than about 31 "
                f"deep), so protobuf refuses to parse it ({exc}); the file itself may be "
                "intact, but no protobuf-based tool reads it") from exc
        raise ModelLoadError(f"{label}: not a valid ONNX model (protobuf parse failed: {exc}); "
                             "the file may be truncated or corrupt") from exc
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise ModelLoadError(f"{label}: parsed, but holds no graph; is this an ONNX model file?")
    if not proto.opset_import and proto.ir_version >= 3:
        raise ModelLoadError(f"{label}: the model declares no opset_import")
    return proto


def import_model(source: ModelSource) -> Model:
    """Read an ONNX model (path, bytes or ModelProto) into ember's IR. The proto is checked
    (importer.validate) before anything decodes it."""
    proto, base_dir = read_model_proto(source)
    check_model(proto)
    return Importer(proto, base_dir).model(path=os.fspath(source)
                                           if isinstance(source, (str, os.PathLike)) else None)


class Importer:
    def __init__(self, proto: onnx.ModelProto, base_dir: str | None):
        self.proto = proto
        self.base_dir = base_dir
        self.opsets = {normalize_domain(o.domain): int(o.version) for o in proto.opset_import}
        if not proto.opset_import:  # IR version < 3 models predate opset_import
            self.opsets[""] = 1
        self.functions = {(normalize_domain(f.domain), f.name): f for f in proto.functions}
        self._fresh = itertools.count()

    def model(self, path: str | None = None) -> Model:
        p = self.proto
        graph = self.graph(p.graph, self.opsets)
        expand_gradient_nodes(graph, self.opsets.get("", 1))  # training-preview Gradient nodes
        return Model(
            graph=graph,
            opsets=dict(self.opsets),
            ir_version=p.ir_version,
            producer_name=p.producer_name,
            producer_version=p.producer_version,
            model_version=p.model_version,
            doc=p.doc_string,
            metadata={e.key: e.value for e in p.metadata_props},
            path=path,
        )

    # -- graphs -------------------------------------------------------------------------------
    def graph(self, g: onnx.GraphProto, opsets: dict[str, int]) -> Graph:
        initializers = {t.name: tensor_to_array(t, self.base_dir) for t in g.initializer}
        for sparse in g.sparse_initializer:
            from ember.importer.onnx_values import sparse_to_array
            initializers[sparse.values.name] = sparse_to_array(sparse, self.base_dir)
        nodes: list[Node] = []
        for node_proto in g.node:
            nodes.extend(self.nodes_for(node_proto, opsets))
        return Graph(
            name=g.name,
            inputs=[self.value_info(v) for v in g.input],
            outputs=[self.value_info(v) for v in g.output],
            nodes=nodes,
            initializers=initializers,
            value_info={v.name: self.value_info(v) for v in g.value_info},
            doc=g.doc_string,
        )

    def value_info(self, v: onnx.ValueInfoProto) -> ValueInfo:
        return ValueInfo(v.name, decode_type(v.type) if v.HasField("type") else None, v.doc_string)

    # -- nodes --------------------------------------------------------------------------------
    def nodes_for(self, n: onnx.NodeProto, opsets: dict[str, int]) -> list[Node]:
        domain = normalize_domain(n.domain)
        function = self.functions.get((domain, n.op_type))
        if function is not None:
            result = []
            for inner, inner_opsets in self.inline(n, function, opsets):
                result.extend(self.nodes_for(inner, inner_opsets))
            return result
        version = opset_version(opsets, domain)
        attrs, attr_types = {}, {}
        for a in n.attribute:
            if a.ref_attr_name:
                raise ModelLoadError(f"node '{n.name}' ({n.op_type}) refers to attribute "
                                     f"'{a.ref_attr_name}' outside of a function")
            attrs[a.name] = decode_attribute(a, self.base_dir,
                                             lambda sub: self.graph(sub, opsets))
            attr_types[a.name] = a.type
        node = Node(op_type=n.op_type, domain=domain, version=version, inputs=list(n.input),
                    outputs=list(n.output), attrs=attrs, attr_types=attr_types, name=n.name)
        for sub in node.subgraphs():
            for name in sub.free_names():
                if name not in node.implicit_inputs:
                    node.implicit_inputs.append(name)
        return [node]

    def inline(self, call: onnx.NodeProto, fn: onnx.FunctionProto,
               caller_opsets: dict[str, int]) -> list[tuple[onnx.NodeProto, dict[str, int]]]:
        """The body of a model-local function, renamed into the caller's scope."""
        prefix = f"{fn.name}_{next(self._fresh)}__"
        rename = {formal: (call.input[i] if i < len(call.input) else "")
                  for i, formal in enumerate(fn.input)}
        rename.update({formal: (call.output[i] if i < len(call.output) else prefix + formal)
                       for i, formal in enumerate(fn.output)})
        call_attrs = {a.name: a for a in call.attribute}
        for default in getattr(fn, "attribute_proto", []):
            call_attrs.setdefault(default.name, default)
        opsets = dict(caller_opsets)
        opsets.update({normalize_domain(o.domain): int(o.version) for o in fn.opset_import})

        def mapped(name: str) -> str:
            if not name:
                return ""
            if name not in rename:
                rename[name] = prefix + name
            return rename[name]

        body = []
        for index, inner in enumerate(fn.node):
            new = onnx.NodeProto()
            new.CopyFrom(inner)
            del new.input[:], new.output[:], new.attribute[:]
            new.input.extend(mapped(x) for x in inner.input)
            new.output.extend(mapped(x) for x in inner.output)
            new.name = prefix + inner.name if inner.name else ""
            referenced = False
            for a in inner.attribute:
                if a.ref_attr_name:
                    referenced = True
                    if a.ref_attr_name not in call_attrs:
                        continue  # optional attribute left unset by the caller
                    resolved = onnx.AttributeProto()
                    resolved.CopyFrom(call_attrs[a.ref_attr_name])
                    resolved.name = a.name
                    new.attribute.append(resolved)
                else:
                    copied = new.attribute.add()
                    copied.CopyFrom(a)
                    if a.type == onnx.AttributeProto.GRAPH:
                        _rename_outer_refs(copied.g, rename)
                    for g in copied.graphs:
                        _rename_outer_refs(g, rename)
            if referenced:  # the caller's attribute values meet the inner op's schema only here
                check_node(new, f"{node_label(inner, index)} in function '{fn.name}' (called "
                           f"by {node_label(call, None)})",
                           opset_version(opsets, normalize_domain(new.domain)), self.functions)
            body.append((new, opsets))
        return body


def _rename_outer_refs(g: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Rename references a subgraph makes to names of the enclosing function body."""
    local = {v.name for v in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name and name not in local and name in rename:
                n.input[i] = rename[name]
        local.update(n.output)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _rename_outer_refs(a.g, rename)
            for sub in a.graphs:
                _rename_outer_refs(sub, rename)
    for out in g.output:
        if out.name not in local and out.name in rename:
            out.name = rename[out.name]
