"""ember's graph IR: what the importer produces, the simplifier rewrites and the runtime plans.

The IR keeps everything needed to write the model back to ONNX (attribute types, opsets,
value infos) and to print it as Python code, but holds decoded values: attributes are
Python/numpy values, subgraphs are `Graph` objects, initialisers are numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ember.errors import InvalidModelError

Dim = Union[int, str, None]  # a fixed size, a symbolic name, or unknown


@dataclass(frozen=True)
class TensorType:
    dtype: np.dtype | None  # None when the model does not say
    shape: tuple[Dim, ...] | None  # None when the rank is unknown

    def __str__(self) -> str:
        dt = "?" if self.dtype is None else str(self.dtype)
        if self.shape is None:
            return f"tensor({dt})"
        return f"tensor({dt}, [{', '.join('?' if d is None else str(d) for d in self.shape)}])"


@dataclass(frozen=True)
class SequenceType:
    elem: "ValueType | None"

    def __str__(self) -> str:
        return f"seq({self.elem})"


@dataclass(frozen=True)
class OptionalType:
    elem: "ValueType | None"

    def __str__(self) -> str:
        return f"optional({self.elem})"


@dataclass(frozen=True)
class MapType:
    key: np.dtype
    value: "ValueType | None"


ValueType = Union[TensorType, SequenceType, OptionalType, MapType]


@dataclass
class ValueInfo:
    name: str
    type: ValueType | None = None
    doc: str = ""


@dataclass
class Node:
    op_type: str
    domain: str  # "" for the default ONNX domain
    version: int  # opset version of `domain` in force where the node sits
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    attr_types: dict[str, int] = field(default_factory=dict)  # onnx AttributeProto types
    name: str = ""
    # Outer-scope values read by this node's subgraphs (If/Loop/Scan bodies).
    implicit_inputs: list[str] = field(default_factory=list)

    def subgraphs(self) -> list["Graph"]:
        found = []
        for value in self.attrs.values():
            if isinstance(value, Graph):
                found.append(value)
            elif isinstance(value, list):
                found.extend(v for v in value if isinstance(v, Graph))
        return found

    def __str__(self) -> str:
        return f"{self.op_type}({self.name or self.outputs[0] if self.outputs else ''})"


@dataclass
class Graph:
    name: str
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    nodes: list[Node]
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_info: dict[str, ValueInfo] = field(default_factory=dict)
    doc: str = ""

    def iter_nodes(self):
        """Every node, including those inside subgraphs, depth first."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs():
                yield from sub.iter_nodes()

    def free_names(self) -> list[str]:
        """Names this graph reads that it neither defines nor receives: outer-scope captures."""
        defined = {v.name for v in self.inputs} | set(self.initializers) | {""}
        free: dict[str, None] = {}
        for node in self.nodes:
            for name in list(node.inputs) + list(node.implicit_inputs):
                if name not in defined:
                    free[name] = None
            defined.update(node.outputs)
        for out in self.outputs:
            if out.name not in defined:
                free[out.name] = None
        return list(free)


@dataclass
class Model:
    graph: Graph
    opsets: dict[str, int]  # domain -> version ("" is the default domain)
    ir_version: int = 8
    producer_name: str = ""
    producer_version: str = ""
    model_version: int = 0
    doc: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    path: str | None = None  # file the model came from, if any

    def op_histogram(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.graph.iter_nodes():
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def parameter_count(self) -> int:
        total = 0

        def visit(graph: Graph) -> None:
            nonlocal total
            total += sum(int(np.prod(a.shape)) for a in graph.initializers.values())
            for node in graph.nodes:
                for sub in node.subgraphs():
                    visit(sub)

        visit(self.graph)
        return total


def topological_order(graph: Graph, available: set[str]) -> list[Node]:
    """Nodes ordered so that each runs after its producers; raises on undefined values."""
    producers = {out: i for i, node in enumerate(graph.nodes) for out in node.outputs if out}
    order, state = [], [0] * len(graph.nodes)  # 0 new, 1 visiting, 2 done

    def visit(i: int) -> None:
        stack = [(i, False)]
        while stack:
            j, expanded = stack.pop()
            if expanded:
                state[j] = 2
                order.append(graph.nodes[j])
                continue
            if state[j] == 2:
                continue
            if state[j] == 1:
                raise InvalidModelError(f"the graph has a cycle through node "
                                        f"'{graph.nodes[j].name or graph.nodes[j].op_type}'")
            state[j] = 1
            stack.append((j, True))
            node = graph.nodes[j]
            for name in list(node.inputs) + list(node.implicit_inputs):
                if not name or name in available:
                    continue
                if name not in producers:
                    raise InvalidModelError(
                        f"node '{node.name or node.op_type}' ({node.op_type}) reads '{name}', "
                        "which no node, input or initializer of the graph defines")
                if state[producers[name]] != 2:
                    stack.append((producers[name], False))

    for i in range(len(graph.nodes)):
        if state[i] == 0:
            visit(i)
    return order
