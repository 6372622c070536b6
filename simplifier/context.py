"""State one simplify() run shares between passes: the model, the target, limits, and the
decision whether a domain's opset may be raised so a fused ONNX op (Gelu-20, Attention-23)
can be used in an older model.

The target is a backend of ember's (fused ai.ember ops where it has kernels for them, opsets
raised where that changes no existing node), or, with `portable`, any ONNX runtime: standard
ops only, at the model's own opsets, and no op expanded into its function body."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember.ir import Graph, Model
from ember.ops.registry import lookup, schema_for

# Constant folding never creates a tensor larger than this many elements, unless the
# node's constant inputs together were already that large (a Transpose of a weight).
MAX_FOLDED_ELEMENTS = 1 << 16

# New attributes whose default keeps the older behaviour (they only matter for new types).
_COMPATIBLE_NEW_ATTRIBUTES = {("Cast", "saturate"), ("CastLike", "saturate"),
                              ("Cast", "round_mode"), ("CastLike", "round_mode")}


@dataclass
class Context:
    model: Model
    backend: str = "cpu"
    max_folded_elements: int = MAX_FOLDED_ELEMENTS
    changes: dict[str, int] = field(default_factory=dict)  # pass name -> rounds it changed
    scratch: dict = field(default_factory=dict)  # per-run caches passes keep
    portable: bool = False  # standard ONNX for any runtime (see the module docstring)

    def has_kernel(self, domain: str, op_type: str, version: int) -> bool:
        """Whether the target runs this op natively: the backend has a kernel (the CPU runs
        everything it has); portable: an ONNX op of the default domain with a schema."""
        if self.portable:
            return domain in ("", "ai.onnx") and schema_for(domain, op_type, version) is not None
        return lookup(domain, op_type, version, self.backend) is not None

    def opset(self, domain: str = "") -> int:
        return self.model.opsets.get(domain, 1)

    def can_use(self, op_type: str, since: int, domain: str = "") -> int | None:
        """The opset at which a new `op_type` node (defined since `since`) can be created,
        raising the model's opset when that changes nothing for the nodes it already has;
        None when it cannot (or the backend has no kernel)."""
        current = self.opset(domain)
        target = max(current, since)
        if not self.has_kernel(domain, op_type, target):
            return None
        if self.portable and target != current:
            return None  # a portable model keeps its opsets
        if target == current:
            return current
        if not all(_same_meaning(n.domain, n.op_type, current, target)
                   for n in self.model.graph.iter_nodes() if n.domain == domain):
            return None
        self.model.opsets[domain] = target
        for node in self.model.graph.iter_nodes():
            if node.domain == domain:
                node.version = target
        return target


def _same_meaning(domain: str, op_type: str, old: int, new: int) -> bool:
    """Whether a node valid at opset `old` means the same at opset `new`: the same schema, or
    a newer one that only adds types (same inputs, outputs and attributes)."""
    a, b = schema_for(domain, op_type, old), schema_for(domain, op_type, new)
    if a is None or b is None:
        return a is None and b is None and lookup(domain, op_type, new) is not None
    if a.since_version == b.since_version:
        return True
    if b.deprecated:
        return False
    if [(p.name, p.option) for p in a.inputs] != [(p.name, p.option) for p in b.inputs]:
        return False
    if [(p.name, p.option) for p in a.outputs] != [(p.name, p.option) for p in b.outputs]:
        return False
    for name in set(a.attributes) | set(b.attributes):
        if name not in a.attributes:
            if (op_type, name) not in _COMPATIBLE_NEW_ATTRIBUTES:
                return False
            continue
        if name not in b.attributes:
            return False
        x, y = a.attributes[name], b.attributes[name]
        if x.type != y.type or x.required != y.required or \
                x.default_value.SerializeToString() != y.default_value.SerializeToString():
            return False
    return True


def graphs_of(graph: Graph):
    """`graph` and every subgraph in it, outermost first."""
    yield graph
    for node in graph.nodes:
        for sub in node.subgraphs():
            yield from graphs_of(sub)

