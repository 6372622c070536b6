"""Structural checks on an ONNX model, run before anything native reads it.

onnx's C++ code trusts its input: shape inference aborts the process on a Split whose
`num_outputs` disagrees with its outputs and segfaults on a node reading a value nothing
defines, or on a LayerNormalization axis near 2^63. So `check_model` looks at the proto first,
in plain Python, and raises an ember error naming the node and the problem; only a model that
passes is decoded, simplified and shown to onnx's inference. In order:

- text: every string field is valid UTF-8 (upb hands back `bytes` for one that is not);
- opsets: every domain's version is in [1, MAX_OPSET];
- nesting: subgraphs nest at most MAX_NESTING levels, counting those a model-local function
  brings in where it is called; functions do not call themselves, directly or through others;
  calls nest at most MAX_CALL_DEPTH deep; inlining creates at most MAX_INLINED_NODES nodes;
- nodes: input and output counts, attribute types and required attributes against the ONNX
  schema in force; attribute names (no Python special names like `__dict__`); axis
  attributes within a tensor's rank; the kind of value each input gets (a numeric or a
  string tensor, a sequence, a map, an optional) against the kinds the schema allows there,
  where the graph fixes it (declared inputs, initialisers, and outputs of ops whose schema
  gives them one kind); and the few facts of single ops onnx's inference assumes without
  checking (Split's `num_outputs` equal to its outputs, Einsum's equation well formed);
- names: every value a node reads is defined in its graph or an enclosing one, each value is
  defined once (SSA), and no graph has a cycle. What a subgraph reads from enclosing graphs
  counts as an input of the node holding it, so an If branch reading the If's own output is a
  cycle.

Every walk here is iterative, over a nesting already bounded, so no model raises
RecursionError. Tensor payloads (raw_data sizes, sparse indices, external files) are checked
where they are decoded, in onnx_values.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Iterator

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from onnx import AttributeProto, defs

from ember.errors import InvalidModelError, ModelLoadError
from ember.importer.schemas import attribute_defaults, normalize_domain, schema_for

# Opset versions past this are no real opset (ai.onnx is at 25): a typo or a mutation.
MAX_OPSET = 10000
# protobuf refuses messages nested deeper than 100; each subgraph level costs three (node,
# attribute, graph), so no model file nests subgraphs deeper than about 31 levels, and ember
# writing a deeper IR back to protobuf (for shape inference) would fail the same way.
MAX_NESTING = 30
# Model-local functions calling functions: inlining recurses once per level.
MAX_CALL_DEPTH = 64
# Functions calling functions several times each multiply nodes when inlined (2^depth).
MAX_INLINED_NODES = 1_000_000
# An axis this large is no axis of any tensor; onnx's inference overflows on such values.
AXIS_BOUND = 1 << 31

# Integer attributes naming axes. The first group counts from the first input's rank.
_RANK_AXES = frozenset({"axis", "axes", "batch_axis", "time_axis"})
_AXIS_ATTRIBUTES = _RANK_AXES | {"scan_input_axes", "scan_output_axes"}
_SINGLE = defs.OpSchema.FormalParameterOption.Single


def check_model(proto: onnx.ModelProto) -> None:
    """Raise ModelLoadError or InvalidModelError if `proto` is malformed; see the module
    docstring for what is checked."""
    check_text(proto)
    opsets = _opsets(proto.opset_import, "the model")
    functions = {(normalize_domain(f.domain), f.name): f for f in proto.functions}
    bodies = _bodies(proto, opsets, functions)
    _check_calls(bodies, functions)
    for body in bodies:
        for index, node in enumerate(body.nodes):
            problem = _problem(node, body.version(node.domain), functions, body.ranks,
                               body.kinds)
            if problem:
                raise InvalidModelError(f"{body.label(index)}{problem}")
    for body in reversed(bodies):  # subgraphs before the graphs holding them
        _check_names(body)


def check_node(node: onnx.NodeProto, label: str, version: int,
               functions: dict[tuple[str, str], onnx.FunctionProto] | None = None) -> None:
    """One node against the ONNX schema in force (`version` of its domain) and the rules that
    hold for every op, as check_model checks each; `label` names it in messages."""
    problem = _problem(_NodeView(node), version, functions or {}, _Ranks(None))
    if problem:
        raise InvalidModelError(f"{label}{problem}")


def opset_version(opsets: dict[str, int], domain: str) -> int:
    """The version of `domain` in force under `opsets`: a domain the model does not import is
    at version 1, and the default domain of a model without opset_import too."""
    version = opsets.get(domain)
    if version is None:
        version = 1 if domain else opsets.get("", 1)
    return version


class _Problem(Exception):
    """What is wrong with a node, worded to follow its label; the caller adds the label (built
    only when something is wrong: most nodes are fine)."""


def _problem(node: "_NodeView", version: int, functions: dict, ranks: "_Ranks",
             kinds: "_Kinds | None" = None) -> str:
    """What is wrong with `node`, or ""."""
    try:
        _check_node(node, version, functions, ranks, kinds or _Kinds(None))
    except _Problem as problem:
        return str(problem)
    return ""


# -- text ---------------------------------------------------------------------------------------

def check_text(proto: onnx.ModelProto) -> None:
    """Every string field of `proto` holds valid UTF-8; names the first field that does not.

    A model of up to _STRICT_PARSE_MAX_BYTES is checked natively first: parsed again as a
    proto3 copy of onnx's schema, whose parser validates every string (proto2's, onnx's,
    does not). Only if that fails, or for larger models (whose copy would hold the weights
    twice), are the messages walked in Python, which names the field."""
    strict = _strict_model_class()
    if strict is not None and proto.ByteSize() <= _STRICT_PARSE_MAX_BYTES:
        try:
            strict.FromString(proto.SerializeToString())
            return
        except (DecodeError, ValueError):
            pass  # bad UTF-8, or nesting past protobuf's limit: the walk says which
    _walk_text(proto, "model")


# Largest serialized model the native UTF-8 check copies (see check_text).
_STRICT_PARSE_MAX_BYTES = 256 << 20


@functools.lru_cache(maxsize=1)
def _strict_model_class():
    """onnx's ModelProto as a proto3 message of a private package, or None if this protobuf
    cannot build it (the Python walk then does all the work)."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        file = descriptor_pb2.FileDescriptorProto.FromString(
            onnx.ModelProto.DESCRIPTOR.file.serialized_pb)
        package, file.package = file.package, "ember_strict_onnx"
        file.name, file.syntax = "ember/strict_onnx.proto", "proto3"
        messages = list(file.message_type)
        while messages:
            message = messages.pop()
            messages.extend(message.nested_type)
            for f in message.field:
                if f.type_name.startswith(f".{package}."):
                    f.type_name = ".ember_strict_onnx." + f.type_name[len(package) + 2:]
                f.ClearField("default_value")  # proto3 has neither defaults nor required
                if f.label == f.LABEL_REQUIRED:
                    f.label = f.LABEL_OPTIONAL
        pool = descriptor_pool.DescriptorPool()
        pool.Add(file)
        return message_factory.GetMessageClass(
            pool.FindMessageTypeByName("ember_strict_onnx.ModelProto"))
    except Exception:  # an optimisation only: any protobuf that cannot do this still walks
        return None


def _walk_text(message, path: str) -> None:
    # (message, where): `where` links to the parent's as (parent's where, field, index) and is
    # spelled out only for an error: a large model has hundreds of thousands of messages.
    stack = [(message, path)]
    while stack:
        message, where = stack.pop()
        for desc, value in message.ListFields():
            kind = desc.type
            if kind == _MESSAGE:
                if _is_repeated(desc):
                    stack.extend((m, (where, desc.name, i)) for i, m in enumerate(value))
                else:
                    stack.append((value, (where, desc.name, None)))
            elif kind == _STRING:
                repeated = _is_repeated(desc)
                for i, text in enumerate(value if repeated else (value,)):
                    if not (isinstance(text, str) and (text.isascii() or _encodes(text))):
                        field = _spelled(where) + f".{desc.name}" + (f"[{i}]" if repeated else "")
                        raise ModelLoadError(f"{field} is not valid UTF-8 ({text!r}); the file "
                                             "is corrupt or its exporter is broken")


_MESSAGE, _STRING = FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING


def _spelled(where) -> str:
    parts = []
    while isinstance(where, tuple):
        where, name, index = where
        parts.append(f".{name}" + ("" if index is None else f"[{index}]"))
    return where + "".join(reversed(parts))


@functools.lru_cache(maxsize=None)
def _is_repeated(desc: FieldDescriptor) -> bool:
    repeated = getattr(desc, "is_repeated", None)  # protobuf >= 6; `label` before
    return repeated if repeated is not None else desc.label == FieldDescriptor.LABEL_REPEATED


def _encodes(text: str) -> bool:
    """upb returns invalid UTF-8 as bytes; the pure-Python protobuf as str with surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- opsets -------------------------------------------------------------------------------------

def _opsets(entries, owner: str) -> dict[str, int]:
    opsets = {}
    for entry in entries:
        domain = normalize_domain(entry.domain)
        if not 1 <= entry.version <= MAX_OPSET:
            raise InvalidModelError(
                f"{owner} imports opset {entry.version} of domain '{entry.domain or 'ai.onnx'}'"
                f"; opset versions run from 1 to at most {MAX_OPSET}")
        opsets[domain] = int(entry.version)
    return opsets


# -- graphs, subgraphs and function bodies ------------------------------------------------------

class _NodeView:
    """A NodeProto's fields, read once: each read of a protobuf field builds a new object."""
    __slots__ = ("proto", "name", "op_type", "domain", "inputs", "outputs", "attributes")

    def __init__(self, proto: onnx.NodeProto):
        self.proto = proto
        self.name, self.op_type = proto.name, proto.op_type
        self.domain = normalize_domain(proto.domain)
        self.inputs, self.outputs = list(proto.input), list(proto.output)
        self.attributes = list(proto.attribute)

    def label(self, index: int | None) -> str:
        return node_label(self.proto, index)


def node_label(node: onnx.NodeProto | _NodeView, index: int | None) -> str:
    """"node 'name' (Op)", or for an unnamed node its position ("node #3 (Op)")."""
    if node.name:
        return f"node '{node.name}' ({node.op_type})"
    return f"node #{index} ({node.op_type})" if index is not None else f"a {node.op_type} node"


class _Ranks:
    """The ranks a graph declares for its inputs, value_info and initialisers, read from the
    proto only when an axis attribute asks for one."""

    def __init__(self, graph: onnx.GraphProto | None):
        self.graph, self._ranks = graph, None

    def get(self, name: str) -> int | None:
        if self._ranks is None:
            self._ranks = {}
            if self.graph is not None:
                for info in list(self.graph.input) + list(self.graph.value_info):
                    t = info.type
                    if t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
                        self._ranks[info.name] = len(t.tensor_type.shape.dim)
                for tensor in self.graph.initializer:
                    self._ranks[tensor.name] = len(tensor.dims)
        return self._ranks.get(name)


# The kinds of value a kernel may be given. Kernels compute on numeric arrays, call str methods
# on string tensors' elements and iterate sequences and maps, so a value of another kind than
# the schema allows would fail inside the kernel, not with an error naming the model's fault.
_TYPE_KINDS = {"tensor_type": None, "sparse_tensor_type": "sparse tensor",
                 "sequence_type": "sequence", "map_type": "map", "optional_type": "optional"}


# Kinds a kernel of ember's takes beyond its schema (an ember extension), by op and input:
# DictVectorizer also vectorises a sequence of maps, one row per map.
_EXTRA_KINDS = {("ai.onnx.ml", "DictVectorizer"): {0: frozenset({"sequence"})}}


def _kind_of_type(t: onnx.TypeProto) -> str | None:
    """The kind of value a TypeProto declares; None where it leaves that open."""
    which = t.WhichOneof("value")
    if which == "tensor_type":
        return _tensor_kind(t.tensor_type.elem_type)
    return _TYPE_KINDS.get(which)


def _tensor_kind(elem_type: int) -> str | None:
    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    return "string tensor" if elem_type == onnx.TensorProto.STRING else "numeric tensor"


def _kind_of_type_str(type_str: str) -> str | None:
    """The kind of a schema's type string: "tensor(string)", "tensor(float)", "seq(...)"."""
    if type_str == "tensor(string)":
        return "string tensor"
    for prefix, kind in (("tensor(", "numeric tensor"), ("seq(", "sequence"), ("map(", "map"),
                         ("optional(", "optional"), ("sparse_tensor(", "sparse tensor")):
        if type_str.startswith(prefix):
            return kind
    return None


class _Kinds:
    """The kind of each value of a graph known before it runs: its declared inputs and its
    initialisers, then (`learn`, node by node) the outputs whose kind the op's schema fixes:
    one kind allowed, a Cast's `to`, or the type variable of an input whose kind is known
    (Identity's output is what its input is)."""

    def __init__(self, graph: onnx.GraphProto | None):
        self._kinds: dict[str, str] = {}
        if graph is not None:
            for info in graph.input:
                kind = _kind_of_type(info.type) if info.HasField("type") else None
                if kind is not None:
                    self._kinds[info.name] = kind
            for tensor in graph.initializer:  # the value itself, whatever the input declares
                kind = _tensor_kind(tensor.data_type)
                if kind is not None:
                    self._kinds[tensor.name] = kind

    def get(self, name: str) -> str | None:
        return self._kinds.get(name)

    def learn(self, node: "_NodeView", facts: "_OpFacts | None") -> None:
        if facts is None or not facts.output_params:
            return
        outs = facts.output_params
        for index, name in enumerate(node.outputs):
            kind = self._output_kind(node, facts, outs[min(index, len(outs) - 1)])
            if name and kind is not None:
                self._kinds.setdefault(name, kind)

    def _output_kind(self, node: "_NodeView", facts: "_OpFacts", out: "_Param") -> str | None:
        if len(out.kinds) == 1 and None not in out.kinds:
            return next(iter(out.kinds))
        if node.op_type == "Cast" and not node.domain:
            to = next((a.i for a in node.attributes if a.name == "to"), None)
            return None if to is None else _tensor_kind(to)
        if not out.homogeneous:
            return None  # Loop's and Scan's V: one variable, a type per value
        for index, name in enumerate(node.inputs):
            param = facts.input_params[min(index, len(facts.input_params) - 1)]
            if name and param.homogeneous and param.type_str == out.type_str:
                kind = self._kinds.get(name)
                if kind is not None:
                    return kind
        return None


@dataclass
class _Body:
    """A graph, subgraph or function body to check, and where it sits."""
    nodes: list[_NodeView]
    inputs: list[str]
    outputs: list[str]
    initializers: list[str]
    opsets: dict[str, int]
    where: str  # "" for the main graph, else " in ..." for messages
    ranks: _Ranks
    kinds: _Kinds
    function: tuple[str, str] | None = None  # the function this body belongs to
    parent: "_Body | None" = None
    level: int = 0  # subgraph nesting below the main graph or the function body
    children: dict[int, list["_Body"]] = field(default_factory=dict)  # node index -> subgraphs
    # outer names this body reads -> who reads them first: (body, node index), or (body, None)
    # for the body's output list
    free: dict[str, tuple["_Body", int | None]] = field(default_factory=dict)

    def version(self, domain: str) -> int:
        return opset_version(self.opsets, domain)

    def label(self, index: int) -> str:
        return self.nodes[index].label(index) + self.where

    def reader(self, index: int | None, name: str) -> str:
        """Who reads `name` (the label of node `index`, or the body's outputs) for messages."""
        if index is None:
            return f"graph output '{name}'{self.where}"
        return self.label(index)


def _graph_body(g: onnx.GraphProto, opsets: dict[str, int], where: str, **links) -> _Body:
    return _Body([_NodeView(n) for n in g.node], [v.name for v in g.input],
                 [v.name for v in g.output],
                 [t.name for t in g.initializer] + [s.values.name for s in g.sparse_initializer],
                 opsets, where, _Ranks(g), _Kinds(g), **links)


def _bodies(proto: onnx.ModelProto, opsets: dict[str, int],
            functions: dict[tuple[str, str], onnx.FunctionProto]) -> list[_Body]:
    """The main graph and every function body, each followed (depth first) by the subgraphs
    inside it; parents always come before their subgraphs."""
    roots = [_graph_body(proto.graph, opsets, "")]
    for key, fn in functions.items():
        fn_opsets = {**opsets, **_opsets(fn.opset_import, f"function '{fn.name}'")}
        roots.append(_Body([_NodeView(n) for n in fn.node], list(fn.input), list(fn.output), [],
                           fn_opsets, f" in function '{fn.name}'", _Ranks(None), _Kinds(None),
                           function=key))
    order, stack = [], roots[::-1]
    while stack:
        body = stack.pop()
        order.append(body)
        for index, node in enumerate(body.nodes):
            for attr_name, sub in _subgraphs_of(node):
                where = f" in the {attr_name} of {_nested_label(body, index)}"
                if body.level + 1 > MAX_NESTING:
                    raise InvalidModelError(
                        f"subgraphs nest more than {MAX_NESTING} levels deep{where}; ember "
                        f"allows {MAX_NESTING} (protobuf refuses messages nested deeper than "
                        "100, about 31 levels of subgraphs)")
                child = _graph_body(sub, body.opsets, where, function=body.function,
                                    parent=body, level=body.level + 1)
                body.children.setdefault(index, []).append(child)
                stack.append(child)
    return order


def _nested_label(body: _Body, index: int) -> str:
    """A subgraph-holding node for messages: with the full path up to three levels down, and
    past that with its depth (a path 30 levels long says less than the number)."""
    if body.level < 3:
        return body.label(index)
    inside = f" in function '{body.function[1]}'" if body.function else ""
    return f"{body.nodes[index].label(index)} ({body.level} subgraph levels down{inside})"


def _subgraphs_of(node: _NodeView) -> Iterator[tuple[str, onnx.GraphProto]]:
    for attr in node.attributes:
        kind = attr.type
        if kind == AttributeProto.GRAPH and attr.HasField("g"):
            yield attr.name, attr.g
        elif kind == AttributeProto.GRAPHS:
            for i, g in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", g


# -- model-local functions ----------------------------------------------------------------------

def _check_calls(bodies: list[_Body], functions: dict[tuple[str, str], onnx.FunctionProto]) -> None:
    """No recursion among model-local functions; nesting, call depth and inlined size bounded
    once every call is inlined."""
    # per root (None: the main graph): the calls it makes, at which subgraph level, and the
    # deepest subgraph level and the number of nodes it has itself
    calls: dict[tuple | None, list[tuple[tuple[str, str], int]]] = {}
    deepest: dict[tuple | None, int] = {}
    own_nodes: dict[tuple | None, int] = {}
    for body in bodies:
        root = body.function
        calls.setdefault(root, [])
        deepest[root] = max(deepest.get(root, 0), body.level)
        for node in body.nodes:
            key = (node.domain, node.op_type)
            if key in functions:
                calls[root].append((key, body.level))
            else:
                own_nodes[root] = own_nodes.get(root, 0) + 1
    nesting, depth, size = {}, {}, {}
    for fn in _callees_first(calls, functions):
        nesting[fn] = max([deepest[fn]] + [lvl + nesting[c] for c, lvl in calls[fn]])
        depth[fn] = 1 + max([0] + [depth[c] for c, _ in calls[fn]])
        size[fn] = own_nodes.get(fn, 0) + sum(size[c] for c, _ in calls[fn])
        if size[fn] > MAX_INLINED_NODES:
            raise InvalidModelError(
                f"function '{fn[1]}' inlines to more than {MAX_INLINED_NODES} nodes (its calls "
                "of other functions multiply); ember refuses a graph that large")
    main = calls.get(None, [])
    if any(lvl + nesting[c] > MAX_NESTING for c, lvl in main):
        fn = next(c for c, lvl in main if lvl + nesting[c] > MAX_NESTING)
        raise InvalidModelError(
            f"with function '{fn[1]}' inlined, subgraphs nest more than {MAX_NESTING} levels "
            f"deep; ember allows {MAX_NESTING}")
    if any(depth[c] > MAX_CALL_DEPTH for c, _ in main):
        fn = next(c for c, _ in main if depth[c] > MAX_CALL_DEPTH)
        raise InvalidModelError(
            f"function '{fn[1]}' calls functions {depth[fn]} levels deep; ember inlines at "
            f"most {MAX_CALL_DEPTH}")
    if sum(size[c] for c, _ in main) > MAX_INLINED_NODES:
        raise InvalidModelError(f"inlining the model's functions creates more than "
                                f"{MAX_INLINED_NODES} nodes; ember refuses a graph that large")


def _callees_first(calls: dict, functions: dict) -> list[tuple[str, str]]:
    """The functions ordered so that each comes after every function it calls; raises on a
    cycle, naming it (f -> g -> f). An iterative depth-first search: the stack is the path."""
    order, done = [], set()
    for start in functions:
        if start in done:
            continue
        stack, on_path = [(start, iter(calls.get(start, ())))], {start}
        while stack:
            fn, pending = stack[-1]
            callee = next(pending, (None,))[0]
            if callee is None:
                stack.pop()
                on_path.discard(fn)
                done.add(fn)
                order.append(fn)
            elif callee in on_path:
                path = [f for f, _ in stack]
                cycle = path[path.index(callee):] + [callee]
                raise InvalidModelError(
                    "model-local functions call themselves: " + " -> ".join(
                        f"'{name}'" for _, name in cycle) + "; ember inlines functions and "
                    "cannot inline a recursion")
            elif callee not in done:
                stack.append((callee, iter(calls.get(callee, ()))))
                on_path.add(callee)
    return order


# -- nodes --------------------------------------------------------------------------------------

def _check_node(node: _NodeView, version: int,
                functions: dict[tuple[str, str], onnx.FunctionProto], ranks: _Ranks,
                kinds: _Kinds) -> None:
    function = functions.get((node.domain, node.op_type))
    if function is not None:
        _check_call(node, function)
        facts = None
    else:
        facts = _op_facts(node.domain, node.op_type, version)
        if facts is not None:
            _check_arity(node, facts)
            _check_input_kinds(node, facts, kinds)
    kinds.learn(node, facts)
    _check_attributes(node, facts, ranks)
    rule = _INFERENCE_RULES.get((node.domain, node.op_type))
    if rule is not None:
        rule(node, {a.name: a for a in node.attributes})


@dataclass(frozen=True)
class _OpFacts:
    """What the checks need of an op's ONNX schema, read once (pybind access is slow)."""
    name: str  # "Split-18"
    inputs: tuple[int, int]  # fewest and most
    outputs: tuple[int, int]
    required_inputs: tuple[tuple[int, str], ...]  # (index, formal name) of non-optional ones
    attribute_types: dict[str, int]  # AttributeProto types
    required_attributes: frozenset[str]
    # the formal inputs and outputs (the last one repeats for variadic ones)
    input_params: tuple["_Param", ...]
    output_params: tuple["_Param", ...]


@dataclass(frozen=True)
class _Param:
    """A formal input or output of a schema: its name, its type variable (or type), the types
    allowed there and their kinds (None in them: a kind not known here); homogeneous: all the
    values it stands for have one type."""
    name: str
    type_str: str
    types: tuple[str, ...]
    kinds: frozenset
    homogeneous: bool


@functools.lru_cache(maxsize=None)
def _op_facts(domain: str, op_type: str, version: int) -> _OpFacts | None:
    schema = schema_for(domain, op_type, version)
    if schema is None:
        return None
    return _OpFacts(
        f"{op_type}-{schema.since_version}", (schema.min_input, schema.max_input),
        (schema.min_output, schema.max_output),
        tuple((i, p.name) for i, p in enumerate(schema.inputs) if p.option == _SINGLE),
        {name: int(a.type) for name, a in schema.attributes.items()},
        attribute_defaults(domain, op_type, version)[1],
        _params(schema, schema.inputs), _params(schema, schema.outputs))


def _params(schema: defs.OpSchema, formals) -> tuple[_Param, ...]:
    constraints = {c.type_param_str: tuple(c.allowed_type_strs) for c in schema.type_constraints}
    params = []
    for p in formals:
        types = constraints.get(p.type_str, (p.type_str,))
        params.append(_Param(p.name, p.type_str, types,
                             frozenset(_kind_of_type_str(t) for t in types),
                             p.option == _SINGLE or bool(p.is_homogeneous)))
    return tuple(params)


def _check_call(node: _NodeView, fn: onnx.FunctionProto) -> None:
    for kind, given, formal in (("inputs", node.inputs, fn.input),
                                ("outputs", node.outputs, fn.output)):
        if len(given) > len(formal):
            raise _Problem(f" has {len(given)} {kind}, but function '{fn.name}' has only "
                           f"{len(formal)}")


def _check_arity(node: _NodeView, facts: _OpFacts) -> None:
    inputs = node.inputs
    for kind, count, (low, high) in (("inputs", len(inputs), facts.inputs),
                                     ("outputs", len(node.outputs), facts.outputs)):
        if not low <= count <= high:
            allowed = f"at least {low}" if high >= 1 << 30 else \
                str(low) if low == high else f"{low} to {high}"
            raise _Problem(f" has {count} {kind}; {facts.name} takes {allowed}")
    for index, formal in facts.required_inputs:
        if index < len(inputs) and not inputs[index]:
            raise _Problem(f": input {index} ('{formal}') is required but the node leaves it "
                           "empty")


def _check_input_kinds(node: _NodeView, facts: _OpFacts, kinds: _Kinds) -> None:
    """Each input whose kind the graph fixes is of a kind the schema allows there: a string
    tensor as a shape, a number where strings go, a sequence into MatMul are the model's
    fault, and onnxruntime refuses them at load too."""
    if not facts.input_params:
        return
    for index, name in enumerate(node.inputs):
        kind = kinds.get(name) if name else None
        if kind is None:
            continue
        param = facts.input_params[min(index, len(facts.input_params) - 1)]
        if kind in param.kinds or None in param.kinds or \
                kind in _EXTRA_KINDS.get((node.domain, node.op_type), {}).get(index, ()):
            continue
        shown = ", ".join(param.types) if len(param.types) <= 4 else \
            " or ".join(sorted(f"{k}s" for k in param.kinds))
        raise _Problem(f": input {index} ('{param.name}') gets '{name}', a {kind}, but "
                       f"{facts.name} takes {shown} there")


def _check_attributes(node: _NodeView, facts: _OpFacts | None, ranks: _Ranks) -> None:
    seen = set()
    for attr in node.attributes:
        name, kind = attr.name, attr.type
        if not name or (name.startswith("__") and name.endswith("__")):
            # Python's special names (__dict__, __class__) stand for nothing in ONNX; other
            # odd names are left to the op (the registry stores every name safely)
            raise _Problem(f" has an attribute named {name!r}, which is not a valid "
                           "attribute name")
        if name in seen:
            raise _Problem(f" sets attribute '{name}' twice")
        seen.add(name)
        if attr.ref_attr_name:
            continue  # a function body's reference, checked once the call resolves it
        expected = facts.attribute_types.get(name) if facts is not None else None
        if expected is not None and expected != kind:
            raise _Problem(f": attribute '{name}' is of type {_type_name(kind)}, but "
                           f"{facts.name} takes {_type_name(expected)}")
        if kind == AttributeProto.GRAPH and not attr.HasField("g"):
            raise _Problem(f": attribute '{name}' is a graph attribute without a graph")
        if name in _AXIS_ATTRIBUTES:
            _check_axes(node, attr, ranks)
    if facts is not None and not facts.required_attributes <= seen:
        missing = sorted(facts.required_attributes - seen)
        raise _Problem(f" lacks required attribute(s) {', '.join(missing)}")


def _check_axes(node: _NodeView, attr: AttributeProto, ranks: _Ranks) -> None:
    if attr.type == AttributeProto.INT:
        values = [attr.i]
    elif attr.type == AttributeProto.INTS:
        values = list(attr.ints)
    else:
        return
    for value in values:
        if not -AXIS_BOUND < value < AXIS_BOUND:
            raise _Problem(f": attribute '{attr.name}' holds {value}, which is no axis of any "
                           "tensor")
    if node.domain or attr.name not in _RANK_AXES or not node.inputs:
        return
    rank = ranks.get(node.inputs[0])
    if rank is None:
        return
    # Lenient by the values' count: Unsqueeze's axes and OneHot's and Flatten's axis count
    # from the output's rank, which is that much larger; exact ranges are the ops' business.
    extra = max(1, len(values))
    for value in values:
        if not -(rank + extra) <= value < rank + extra:
            raise _Problem(f": attribute '{attr.name}' holds {value}, out of range for input "
                           f"'{node.inputs[0]}' of rank {rank}")


# -- what onnx's inference assumes of single ops without checking --------------------------------
# Kernels check their attributes when a session binds them, after shape inference has run; these
# few facts must hold before it does. Found crashing or hanging onnx 1.23's inference.

def _split_outputs(node: _NodeView, attrs: dict[str, AttributeProto]) -> None:
    """Split-18's num_outputs is its number of outputs (inference aborts the process else)."""
    count = attrs.get("num_outputs")
    if count is not None and count.type == AttributeProto.INT and count.i != len(node.outputs):
        raise _Problem(f": num_outputs is {count.i} but the node has {len(node.outputs)} "
                       "outputs")


_EINSUM_TERM = r"\s*(?:(?:[A-Za-z]|\.\.\.)\s*)*"
_EINSUM_EQUATION = re.compile(rf"{_EINSUM_TERM}(?:,{_EINSUM_TERM})*(?:->{_EINSUM_TERM})?")


def _einsum_equation(node: _NodeView, attrs: dict[str, AttributeProto]) -> None:
    """Einsum's equation follows its grammar: terms of letters and '...', separated by ',',
    and at most one '->' (inference loops forever on a stray '.', '-' or '(')."""
    equation = attrs.get("equation")
    if equation is None or equation.type != AttributeProto.STRING:
        return
    text = equation.s.decode("utf-8", errors="replace")
    if not _EINSUM_EQUATION.fullmatch(text):
        raise _Problem(f": equation {text!r} is not an Einsum equation (terms of letters and "
                       "'...' separated by ',', then optionally '->' and the output's term)")


_INFERENCE_RULES = {("", "Split"): _split_outputs, ("", "Einsum"): _einsum_equation}


def _type_name(attr_type: int) -> str:
    try:
        return AttributeProto.AttributeType.Name(attr_type)
    except ValueError:
        return f"unknown type {attr_type}"


# -- names --------------------------------------------------------------------------------------

def _check_names(body: _Body) -> None:
    """Values defined once, every read defined here or outside (left in body.free for the
    enclosing graph), and no cycle. Subgraphs must have been checked before."""
    defined = set(body.inputs) | set(body.initializers)
    producers: dict[str, int] = {}
    for index, node in enumerate(body.nodes):
        for name in node.outputs:
            if not name:
                continue
            if name in producers or name in defined:
                first = "another node" if name in producers else "a graph input or initializer"
                raise InvalidModelError(f"{body.label(index)} defines '{name}', which {first} "
                                        "already defines; each value is defined once (SSA)")
            producers[name] = index
    readers: list[list[int]] = [[] for _ in body.nodes]  # producer index -> reading nodes
    waiting = [0] * len(body.nodes)  # per node: producers it still waits for
    for index, node in enumerate(body.nodes):
        for name, (where, reader) in _reads(body, index, node):
            producer = producers.get(name)
            if producer == index:
                whose = "its own output" if where is body else \
                    f"an output of {body.label(index)}"
                raise InvalidModelError(f"{where.reader(reader, name)} reads '{name}', "
                                        f"{whose}; no node can depend on its own result")
            if producer is not None:
                readers[producer].append(index)
                waiting[index] += 1
            elif name not in defined:
                body.free.setdefault(name, (where, reader))
    for name in body.outputs:
        if name and name not in producers and name not in defined:
            body.free.setdefault(name, (body, None))
    _check_acyclic(body, readers, waiting)
    if body.parent is None and body.free:
        name, (where, reader) = next(iter(body.free.items()))
        if reader is None:
            raise InvalidModelError(f"{where.reader(None, name)} is never computed")
        owner = f"function '{body.function[1]}'" if body.function else "the graph"
        raise InvalidModelError(f"{where.reader(reader, name)} reads '{name}', which no node, "
                                f"input or initializer of {owner} defines")


def _reads(body: _Body, index: int, node: _NodeView
           ) -> Iterator[tuple[str, tuple[_Body, int | None]]]:
    """(name, who reads it) for the node's inputs and what its subgraphs read from outside."""
    for name in node.inputs:
        if name:
            yield name, (body, index)
    for child in body.children.get(index, ()):
        yield from child.free.items()


def _check_acyclic(body: _Body, readers: list[list[int]], waiting: list[int]) -> None:
    ready = [i for i, count in enumerate(waiting) if count == 0]
    done = 0
    while ready:
        producer = ready.pop()
        done += 1
        for reader in readers[producer]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    if done < len(body.nodes):
        index = next(i for i, count in enumerate(waiting) if count > 0)
        raise InvalidModelError(f"the graph has a cycle through {body.label(index)}")
