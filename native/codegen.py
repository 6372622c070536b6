"""ember IR -> Python source of a native module (`ember.native.Module` subclass).

The generated `forward` is straight-line code, one statement per ONNX node, in the order the
graph executor runs them; each op is declared once in `__init__` with its attributes as
literals and bound to the same kernel the executor binds. If becomes a Python `if`, Loop a
`while` and Scan a `for` over nested functions holding the bodies.

A model is untrusted input, so nothing it contains reaches the source except as `ascii()` of
a literal (strings, attribute values) or as a sanitised identifier: ASCII letters, digits and
`_` only, never a keyword, builtin, dunder or a name the module itself uses, deduplicated.
"""
from __future__ import annotations

import builtins
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import InvalidModelError, UnsupportedOpError
from ember.ir import Graph, MapType, Model, Node, OptionalType, SequenceType, TensorType
from ember.native.safetensors import can_store
from ember.ops.registry import since_version
from ember.runtime.executor import (host_placement, missing_ops, needed_nodes,
                                    shape_constants)

# Arrays up to this many elements are written into the code as literals; larger ones go to
# the weights file.
LITERAL_MAX_ELEMENTS = 64
_IDENT_MAX = 40
_RESERVED = (set(keyword.kwlist) | set(getattr(keyword, "softkwlist", [])) | set(dir(builtins))
             | {"self", "np", "rt", "os", "Model", "Module", "Weight", "TensorType",
                "SequenceType", "OptionalType", "MapType", "WEIGHTS", "forward"})


class Names:
    """Allocates unique, safe Python identifiers from untrusted names."""

    def __init__(self, reserved: set[str] = frozenset()):
        self.taken: set[str] = set(_RESERVED) | set(reserved)

    def new(self, hint: str, suffix_always: bool = False) -> str:
        base = re.sub(r"[^0-9A-Za-z]+", "_", hint).strip("_")[:_IDENT_MAX].rstrip("_") or "v"
        if base[0].isdigit():
            base = "v" + base
        if base in _RESERVED and not suffix_always:
            base += "_"
        candidate, n = (f"{base}_1", 1) if suffix_always else (base, 1)
        while candidate in self.taken:
            n += 1
            candidate = f"{base}_{n}"
        self.taken.add(candidate)
        return candidate


@dataclass
class Scope:
    """ONNX value name -> ('local', identifier) or ('param', key), chained to outer scopes."""
    parent: "Scope | None" = None
    values: dict[str, tuple[str, str]] = field(default_factory=dict)

    def find(self, name: str) -> tuple[str, str] | None:
        scope = self
        while scope is not None:
            if name in scope.values:
                return scope.values[name]
            scope = scope.parent
        return None


@dataclass
class Generated:
    source: str  # model.py
    weights: dict[str, np.ndarray]  # for weights.safetensors


def literal(value: Any) -> str:
    """Python source for a plain value (no arrays): strings only ever via ascii()."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "-float('inf')"
        return repr(value)
    if isinstance(value, str):
        return ascii(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    raise TypeError(type(value).__name__)


def array_literal(array: np.ndarray) -> str | None:
    """`rt.array([...], dtype, shape)` reproducing `array` bit for bit, or None when it cannot
    be written exactly or is too large (it then goes to the weights file)."""
    flat = array.reshape(-1)
    if array.dtype == object:
        if not all(isinstance(v, str) for v in flat):
            return None
        values = [str(v) for v in flat]
    else:
        if array.size > LITERAL_MAX_ELEMENTS or array.dtype.kind in "cmMSU" or \
                not can_store(array):
            return None
        if array.dtype.kind == "b":
            values = [bool(v) for v in flat]
        elif array.dtype.kind in "iu":
            values = [int(v) for v in flat]
        else:
            try:
                values = [float(v) for v in flat]
            except (TypeError, ValueError):
                return None
            try:
                exact = all(math.isfinite(v) for v in values) and np.array(
                    values, dtype=array.dtype).tobytes() == np.ascontiguousarray(array).tobytes()
            except (TypeError, ValueError, OverflowError):
                exact = False
            if not exact:
                return None
    return f"rt.array({literal(values)}, {ascii(array.dtype.name)}, {literal(tuple(array.shape))})"


def type_literal(t: Any) -> str:
    if t is None:
        return "None"
    if isinstance(t, TensorType):
        dtype = "None" if t.dtype is None else f"rt.numpy_dtype({ascii(np.dtype(t.dtype).name)})"
        shape = "None" if t.shape is None else literal(tuple(t.shape))
        return f"rt.TensorType({dtype}, {shape})"
    if isinstance(t, SequenceType):
        return f"rt.SequenceType({type_literal(t.elem)})"
    if isinstance(t, OptionalType):
        return f"rt.OptionalType({type_literal(t.elem)})"
    if isinstance(t, MapType):
        return (f"rt.MapType(rt.numpy_dtype({ascii(np.dtype(t.key).name)}), "
                f"{type_literal(t.value)})")
    raise UnsupportedConversion(f"attribute type {type(t).__name__} cannot be written as code")


class UnsupportedConversion(InvalidModelError):
    """The model cannot be converted to a native module (the reason says why)."""


def host_placements(graph: Graph, nodes: list[Node]) -> dict[int, str]:
    """id(node) -> 'metadata' or 'host' for the nodes the executor keeps on the host on a
    device backend whatever kernels it has (shape work, control flow)."""
    shape_like = shape_constants(graph)
    placed: dict[int, str] = {}
    for node in nodes:
        where = host_placement(node, shape_like)
        if where is not None:
            placed[id(node)] = "metadata" if where == "metadata" else "host"
    return placed


class CodeGenerator:
    """Turns one IR model into the source of model.py plus its weights."""

    def __init__(self, model: Model, source_name: str, ember_version: str):
        self.model = model
        self.source_name = source_name
        self.ember_version = ember_version
        self.locals = Names()
        self.attrs = Names(set(dir(_module_base())))
        self.weights: dict[str, np.ndarray] = {}
        self.literal_params: list[tuple[str, str]] = []  # (key, source) for unstorable params
        self.param_keys: set[str] = set()
        self.init_lines: list[str] = []

    # -- entry ------------------------------------------------------------------------------
    def generate(self) -> Generated:
        missing = missing_ops(self.model.graph, "cpu")
        if missing:
            raise UnsupportedOpError(missing, "cpu")
        graph = self.model.graph
        scope = Scope()
        self._add_initializers(graph, scope)
        args = []
        for info in graph.inputs:
            if info.name in graph.initializers:
                continue  # an initialiser-backed input: a parameter here
            ident = self.locals.new(info.name)
            scope.values[info.name] = ("local", ident)
            args.append(ident)
        body = self._graph_body(graph, scope, [v.name for v in graph.outputs], depth=2)
        outs = ", ".join(self._value(scope, v.name) for v in graph.outputs)
        body.append(f"        return self.outputs({outs})")
        return Generated(self._file(args, body), self.weights)

    def _file(self, args: list[str], body: list[str]) -> str:
        m, g = self.model, self.model.graph
        opsets = {d or "ai.onnx": v for d, v in sorted(m.opsets.items())}
        lines = [
            f"# Generated by ember {self.ember_version} (`ember convert`) from "
            f"{ascii(self.source_name)}; opsets {ascii(opsets)}.",
            "# Each statement in forward() is one ONNX node, computed by the same kernel as the",
            "# graph executor. Edit freely: replace a statement with your own code, or register",
            "# a kernel (ember.ops.registry.register) and declare it with self.op(...).",
            "import os",
            "",
            "import numpy as np",
            "",
            "from ember.ir import OptionalType, SequenceType, TensorType",
            "from ember.native import module as rt",
            "from ember.native.module import Module, Weight",
            "",
            "WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "
            "'weights.safetensors')",
            "",
            "",
            "class Model(Module):",
            f"    source = {ascii(self.source_name)}",
            f"    opsets = {ascii(dict(sorted(m.opsets.items())))}",
            f"    producer = {ascii((m.producer_name, m.producer_version))}",
            f"    input_names = {literal(tuple(v.name for v in g.inputs if v.name not in g.initializers))}",
            f"    output_names = {literal(tuple(v.name for v in g.outputs))}",
            # checked before forward as Session.run checks feeds (Module.check_inputs)
            "    input_types = {" + ", ".join(
                f"{ascii(v.name)}: {self._input_type(v.type)}" for v in g.inputs
                if v.name not in g.initializers) + "}",
            "",
            "    def __init__(self, backend=None, weights=None):",
            "        super().__init__()",
            "        self.load_weights(WEIGHTS if weights is None else weights)",
        ]
        for key, src in self.literal_params:
            lines.append(f"        self.add_parameter({ascii(key)}, {src})")
        lines += [f"        {line}" for line in self.init_lines]
        lines += ["        self.to(backend)", "",
                  f"    def forward(self{''.join(', ' + a for a in args)}):"]
        lines += body
        return "\n".join(lines) + "\n"

    @staticmethod
    def _input_type(t: Any) -> str:
        """A declared input type as source; None (not checked) for one without a literal."""
        try:
            return type_literal(t)
        except UnsupportedConversion:
            return "None"

    # -- values -----------------------------------------------------------------------------
    def _add_initializers(self, graph: Graph, scope: Scope) -> None:
        for name, value in graph.initializers.items():
            scope.values[name] = ("param", self._store(name, np.asarray(value)))

    def _store(self, hint: str, array: np.ndarray) -> str:
        """Put `array` among the parameters under a unique key derived from `hint`."""
        key, n = hint, 1
        while key in self.param_keys:
            n += 1
            key = f"{hint}#{n}"
        self.param_keys.add(key)
        if can_store(array):
            self.weights[key] = array
        else:
            src = array_literal(array)
            if src is None:
                raise UnsupportedConversion(f"tensor {hint!r} ({array.dtype}) can be stored "
                                            "neither in safetensors nor as a literal")
            self.literal_params.append((key, src))
        return key

    def _value(self, scope: Scope, name: str) -> str:
        """Source for reading value `name` in forward."""
        if not name:
            return "None"
        found = scope.find(name)
        if found is None:
            raise InvalidModelError(f"the graph reads '{name}', which nothing defines")
        kind, ref = found
        return ref if kind == "local" else f"self.param({ascii(ref)})"

    def _define(self, scope: Scope, name: str) -> str:
        if not name:
            return "_"
        found = scope.values.get(name)
        if found is not None and found[0] == "local":
            return found[1]
        ident = self.locals.new(name)
        scope.values[name] = ("local", ident)
        return ident

    def _targets(self, scope: Scope, names: list[str]) -> str:
        return ", ".join(self._define(scope, n) for n in names)

    # -- graphs -----------------------------------------------------------------------------
    def _graph_body(self, graph: Graph, scope: Scope, outputs: list[str], depth: int
                    ) -> list[str]:
        """Statements computing `outputs` of `graph` (its values already in `scope`)."""
        available = {v.name for v in graph.inputs} | set(graph.initializers) | \
            set(graph.free_names())
        nodes = needed_nodes(graph, outputs, available)
        placed = host_placements(graph, nodes)
        for name in outputs:
            if name and scope.find(name) is None and not any(name in n.outputs for n in nodes):
                raise InvalidModelError(f"graph output '{name}' is never computed")
        lines: list[str] = []
        pad = "    " * depth
        dying = _dead_after(nodes, set(outputs))
        for i, node in enumerate(nodes):
            for line in self._node(node, scope, placed.get(id(node)), depth):
                lines.append(pad + line if line else "")
            dead = [scope.values[n][1] for n in dying.get(i, ())
                    if scope.values.get(n, ("", ""))[0] == "local"]
            if dead:  # free dead values as the executor does: lower peak memory
                lines.append(f"{pad}del {', '.join(dead)}")
        return lines

    def _node(self, node: Node, scope: Scope, place: str | None, depth: int) -> list[str]:
        if node.domain == "" and node.op_type == "If":
            return self._if(node, scope, depth)
        if node.domain == "" and node.op_type == "Loop":
            return self._loop(node, scope, depth)
        if node.domain == "" and node.op_type == "Scan" and \
                since_version("", "Scan", node.version) >= 9:
            return self._scan(node, scope, depth)
        if node.subgraphs():
            return self._op_with_bodies(node, scope, place, depth)
        call = self._declare(node, scope, place)
        return [f"{self._targets(scope, node.outputs) or '_'} = {call}"]

    def _declare(self, node: Node, scope: Scope, place: str | None,
                 skip_attrs: tuple[str, ...] = ()) -> str:
        """Declare the op in __init__; returns the call expression for forward."""
        params, args = {}, []
        for pos, name in enumerate(node.inputs):
            found = scope.find(name) if name else None
            if found is not None and found[0] == "param":
                params[pos] = found[1]
            else:
                args.append(self._value(scope, name))
        attr = self.attrs.new(_snake(node.op_type), suffix_always=True)
        attrs = ", ".join(f"{ascii(k)}: {self._attr_literal(node, k, v)}"
                          for k, v in node.attrs.items() if k not in skip_attrs)
        extra = []
        if node.domain:
            extra.append(f"domain={ascii(node.domain)}")
        if params:
            extra.append("params={" + ", ".join(f"{p}: {ascii(k)}" for p, k in params.items()) + "}")
        if len(node.inputs) != len(params) + 1:
            extra.append(f"n_in={len(node.inputs)}")
        if len(node.outputs) != 1:
            extra.append(f"n_out={len(node.outputs)}")
        if node.name:
            extra.append(f"name={ascii(node.name)}")
        if place:
            extra.append(f"place={ascii(place)}")
        if skip_attrs:
            extra.append(f"bodies={literal(tuple(skip_attrs))}")
        tail = "".join(", " + e for e in extra)
        self.init_lines.append(f"self.{attr} = self.op({ascii(node.op_type)}, {node.version}, "
                               f"{{{attrs}}}{tail})")
        return f"self.{attr}({', '.join(args)})"

    def _attr_literal(self, node: Node, key: str, value: Any) -> str:
        if isinstance(value, np.ndarray):
            src = array_literal(value)
            if src is not None:
                return src
            label = node.name or (node.outputs[0] if node.outputs else node.op_type)
            return f"Weight({ascii(self._store(f'{label}.{key}', value))})"
        if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            return "[" + ", ".join(self._attr_literal(node, key, v) for v in value) + "]"
        if isinstance(value, (TensorType, SequenceType, OptionalType, MapType)):
            return type_literal(value)
        if isinstance(value, list) and value and isinstance(value[0], (TensorType, SequenceType,
                                                                       OptionalType)):
            return "[" + ", ".join(type_literal(v) for v in value) + "]"
        return literal(value)

    # -- subgraphs --------------------------------------------------------------------------
    def _function(self, graph: Graph, scope: Scope, depth: int, hint: str) -> tuple[str, list[str]]:
        """A nested function computing `graph`: (its name, its source lines, unindented)."""
        inner = Scope(scope)
        self._add_initializers(graph, inner)
        params = []
        for info in graph.inputs:
            ident = self.locals.new(info.name)
            inner.values[info.name] = ("local", ident)
            params.append(ident)
        fn = self.locals.new(hint, suffix_always=True)
        body = self._graph_body(graph, inner, [v.name for v in graph.outputs], depth + 1)
        outs = ", ".join(f"self.host({self._value(inner, v.name)})" for v in graph.outputs)
        pad = "    " * (depth + 1)
        body.append(f"{pad}return ({outs}{',' if len(graph.outputs) == 1 else ''})")
        lines = [f"def {fn}({', '.join(params)}):"] + [line[len("    " * depth):] if line
                                                        else "" for line in body]
        return fn, lines

    def _if(self, node: Node, scope: Scope, depth: int) -> list[str]:
        then_g, else_g = node.attrs.get("then_branch"), node.attrs.get("else_branch")
        if not isinstance(then_g, Graph) or not isinstance(else_g, Graph):
            raise InvalidModelError("If needs both then_branch and else_branch")
        cond = self._value(scope, node.inputs[0] if node.inputs else "")
        targets = [self._define(scope, n) for n in node.outputs]
        lines = [f"if self.truth({cond}):  # If{_label(node)}"]
        for keyword_line, branch in ((None, then_g), ("else:", else_g)):
            if len(branch.outputs) < len(node.outputs):
                raise InvalidModelError(f"If{_label(node)}: a branch produces "
                                        f"{len(branch.outputs)} outputs, the node declares "
                                        f"{len(node.outputs)}")
            if keyword_line:
                lines.append(keyword_line)
            inner = Scope(scope)
            self._add_initializers(branch, inner)
            wanted = [v.name for v in branch.outputs]
            body = self._graph_body(branch, inner, wanted, depth + 1)
            lines += [line[len("    " * depth):] if line else "" for line in body]
            values = [f"self.host({self._value(inner, v.name)})" for v in branch.outputs]
            if targets:
                lines.append(f"    {', '.join(targets)} = {', '.join(values[:len(targets)])}")
            else:
                lines.append("    pass")
        return lines

    def _loop(self, node: Node, scope: Scope, depth: int) -> list[str]:
        body = node.attrs.get("body")
        n_carried = len(node.inputs) - 2
        if not isinstance(body, Graph) or n_carried < 0 or len(body.inputs) != n_carried + 2:
            raise InvalidModelError(f"Loop{_label(node)}: the body must take the iteration "
                                    "number, the condition and each loop-carried value")
        n_scan = len(body.outputs) - 1 - n_carried
        if n_scan < 0:
            raise InvalidModelError(f"Loop{_label(node)}: body has too few outputs")
        fn, fn_lines = self._function(body, scope, depth, "loop_body")
        trip, cond = (node.inputs + ["", ""])[:2]
        limit, keep, cond_v, i = (self.locals.new(h) for h in ("max_trips", "keep_going",
                                                               "cond", "i"))
        state = [self.locals.new("state") for _ in range(n_carried)]
        scans = [self.locals.new("scan") for _ in range(n_scan)]
        step = [self.locals.new("step") for _ in range(n_scan)]
        lines = [f"# Loop{_label(node)}"] + fn_lines
        lines.append(f"{limit} = rt.trip_limit(self.host({self._value(scope, trip)}))" if trip
                     else f"{limit} = None")
        lines.append(f"{keep} = self.truth({self._value(scope, cond)})" if cond
                     else f"{keep} = True")
        lines.append(f"{cond_v} = np.array({keep})")
        if state:
            lines.append(f"{', '.join(state)} = "
                         f"{', '.join(self._value(scope, n) for n in node.inputs[2:])}")
        lines += [f"{s} = []" for s in scans] + [f"{i} = 0"]
        lines.append(f"while {keep} and ({limit} is None or {i} < {limit}):")
        results = ", ".join([cond_v] + state + step)
        lines.append(f"    {results} = {fn}(np.array({i}, dtype=np.int64), "
                     f"{', '.join([cond_v] + state)})")
        lines.append(f"    {keep} = self.truth({cond_v})")
        lines += [f"    {s}.append({v})" for s, v in zip(scans, step)]
        lines.append(f"    {i} += 1")
        finals = state + [self._stack(scans[k], body, 1 + n_carried + k, 0, 0)
                          for k in range(n_scan)]
        lines += self._assign_outputs(node, scope, finals)
        return lines

    def _scan(self, node: Node, scope: Scope, depth: int) -> list[str]:
        body = node.attrs.get("body")
        m = node.attrs.get("num_scan_inputs")
        if not isinstance(body, Graph) or not isinstance(m, int):
            raise InvalidModelError(f"Scan{_label(node)} needs a body and num_scan_inputs")
        n_states = len(node.inputs) - m
        n_out = len(body.outputs) - n_states
        if n_states < 0 or n_out < 0:
            raise InvalidModelError(f"Scan{_label(node)}: num_scan_inputs exceeds the inputs")

        def per_input(attr: str, n: int) -> list[int]:
            values = node.attrs.get(attr)
            if values is None:
                return [0] * n
            if len(values) != n:
                raise InvalidModelError(f"Scan{_label(node)}: {attr} has {len(values)} "
                                        f"entries, expected {n}")
            return list(values)

        in_axes, in_dirs = per_input("scan_input_axes", m), per_input("scan_input_directions", m)
        out_axes = per_input("scan_output_axes", n_out)
        out_dirs = per_input("scan_output_directions", n_out)
        fn, fn_lines = self._function(body, scope, depth, "scan_body")
        xs = [self.locals.new("scan_in") for _ in range(m)]
        length, t = self.locals.new("length"), self.locals.new("t")
        state = [self.locals.new("state") for _ in range(n_states)]
        collected = [self.locals.new("scan") for _ in range(n_out)]
        step = [self.locals.new("step") for _ in range(n_out)]
        lines = [f"# Scan{_label(node)}"] + fn_lines
        lines += [f"{x} = self.host({self._value(scope, n)})"
                  for x, n in zip(xs, node.inputs[n_states:])]
        lines.append(f"{length} = rt.scan_length([{', '.join(xs)}], {literal(in_axes)})")
        if state:
            lines.append(f"{', '.join(state)} = "
                         f"{', '.join(self._value(scope, n) for n in node.inputs[:n_states])}")
        lines += [f"{c} = []" for c in collected]
        lines.append(f"for {t} in range({length}):")
        slices = [f"rt.scan_slice({x}, {t}, {length}, {a}, {bool(d)})"
                  for x, a, d in zip(xs, in_axes, in_dirs)]
        lines.append(f"    {', '.join(state + step) or '_'} = {fn}({', '.join(state + slices)})")
        lines += [f"    {c}.append({s})" for c, s in zip(collected, step)]
        finals = state + [self._stack(collected[k], body, n_states + k, out_axes[k], out_dirs[k])
                          for k in range(n_out)]
        lines += self._assign_outputs(node, scope, finals)
        return lines

    def _stack(self, values: str, body: Graph, index: int, axis: int, reverse: int) -> str:
        """Stacked per-iteration outputs; typed as the body declares when there are none."""
        dtype, tail = "float32", ()
        info = body.outputs[index] if index < len(body.outputs) else None
        if info is not None and isinstance(info.type, TensorType):
            if info.type.dtype is not None:
                dtype = np.dtype(info.type.dtype).name
            if info.type.shape is not None and all(isinstance(d, int) for d in info.type.shape):
                tail = tuple(info.type.shape)
        return (f"rt.stack_outputs({values}, {ascii(dtype)}, {literal(tail)}, "
                f"axis={axis}, reverse={bool(reverse)})")

    def _assign_outputs(self, node: Node, scope: Scope, values: list[str]) -> list[str]:
        lines = []
        for k, name in enumerate(node.outputs):
            if name and k < len(values):
                lines.append(f"{self._define(scope, name)} = {values[k]}")
            elif name:
                lines.append(f"{self._define(scope, name)} = None")
        return lines

    def _op_with_bodies(self, node: Node, scope: Scope, place: str | None, depth: int
                        ) -> list[str]:
        """A subgraph op other than If/Loop/Scan-9: its kernel, given nested functions."""
        lines, bodies = [f"# {_snake(node.op_type)}{_label(node)}"], []
        graphs = [k for k, v in node.attrs.items() if isinstance(v, Graph)]
        if any(isinstance(v, list) and v and isinstance(v[0], Graph) for v in node.attrs.values()):
            raise UnsupportedConversion(f"{node.op_type}{_label(node)}: graph-list attributes")
        for key in graphs:
            graph = node.attrs[key]
            fn, fn_lines = self._function(graph, scope, depth, f"{key}_body")
            lines += fn_lines
            types = "[" + ", ".join(type_literal(v.type if isinstance(
                v.type, (TensorType, SequenceType, OptionalType)) else None)
                for v in graph.outputs) + "]"
            bodies.append(f"{ascii(key)}: self.body({fn}, {len(graph.inputs)}, {types})")
        call = self._declare(node, scope, place, skip_attrs=tuple(graphs))
        op_ref, _, args = call.partition("(")
        targets = self._targets(scope, node.outputs) or "_"
        lines.append(f"{targets} = {op_ref}.with_bodies(**{{{', '.join(bodies)}}})({args}")
        return lines


def _dead_after(nodes: list[Node], keep: set[str]) -> dict[int, list[str]]:
    """Node index -> values defined by this graph's nodes that are dead after that node."""
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.outputs:
            if name:
                last[name] = i
    defined = set(last)
    for i, node in enumerate(nodes):
        for name in list(node.inputs) + list(node.implicit_inputs):
            if name in defined:
                last[name] = max(last[name], i)
    dying: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            dying.setdefault(i, []).append(name)
    return dying


def _snake(op_type: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op_type).lower()


def _label(node: Node) -> str:
    return f" {ascii(node.name)}" if node.name else ""


def _module_base():
    from ember.native.module import Module
    return Module


def generate(model: Model, source_name: str) -> Generated:
    """The source of model.py and the weights for `model`."""
    from ember import __version__
    return CodeGenerator(model, source_name, __version__).generate()
