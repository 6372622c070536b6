"""What the passes share: an index of one graph (producers, consumers, constants, types) and
the few edits every rewrite needs (alias a value away, add a constant, drop nodes).

An index is built at the start of a pass and describes the graph as it was then; a pass that
rewrites marks the nodes it consumed in `dead` and never matches them again, so overlapping
rewrites cannot happen within one sweep.

Renames keep the simplifier linear in graph size: `alias` renames through the index's consumer
lists (kept up to date by it, and by `GraphIndex.set_inputs` for passes that rewire a node), so
removing each of a 100k-node chain of Identity nodes costs the node's readers, not a walk over
the whole graph; `rename_many` applies many renames in one sweep.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

import numpy as np

from ember.errors import InvalidModelError
from ember.ir import Graph, Node, TensorType, topological_order
from ember.ops._dtypes import is_narrow_float
from ember.ops.registry import lookup


class GraphIndex:
    """Producers, consumers, constants and known types of one graph's values."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, list[Node]] = {}
        for node in graph.nodes:
            for out in node.outputs:
                if out:
                    self.producer[out] = node
            for name in _reads(node):
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {v.name for v in graph.outputs}
        self.inputs = {v.name for v in graph.inputs}
        self.dead: set[int] = set()
        # declared types of graph inputs and outputs by name (the first declaration wins)
        self._declared: dict[str, Any] = {}
        for v in itertools.chain(graph.inputs, graph.outputs):
            self._declared.setdefault(v.name, v)
        self._taken: set[str] | None = None  # every name in the graph, once a pass asks
        self._next_suffix: dict[str, int] = {}  # base -> the first suffix not yet tried

    # -- new names --------------------------------------------------------------------------
    def fresh_name(self, base: str) -> str:
        """A value name used nowhere in the graph: the graph's names are gathered once per
        index, not once per new name (a pass making a name per rewrite stays linear)."""
        if self._taken is None:
            self._taken = all_names(self.graph)
        # numbering resumes where the last name from this base stopped: a pass that derives
        # many constants from one weight or one scalar would otherwise retry every earlier
        # suffix for each new name
        name = fresh_name(self.graph, base, self._taken, self._next_suffix.get(base, 0))
        self._next_suffix[base] = int(name.rsplit("__s", 1)[1]) + 1
        return name

    def add_constant(self, base: str, value: Any) -> str:
        """Store `value` as a new initialiser named after `base`; returns its name."""
        name = self.fresh_name(base)
        self.graph.initializers[name] = np.asarray(value)
        return name

    # -- values ---------------------------------------------------------------------------
    def constant(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is a constant the caller cannot override, else None."""
        if name in self.graph.initializers and name not in self.inputs:
            value = self.graph.initializers[name]
            return value if isinstance(value, np.ndarray) else None
        return None

    def scalar(self, name: str) -> float | None:
        """A constant holding one number (any shape of size 1), as a float."""
        value = self.constant(name)
        if value is None or value.size != 1 or value.dtype.kind not in "fiu":
            return None
        return float(value.reshape(-1)[0])

    def tensor_type(self, name: str) -> TensorType | None:
        value = self.constant(name)
        if value is not None:
            return TensorType(value.dtype, tuple(value.shape))
        info = self.graph.value_info.get(name)
        if info is None:
            info = self._declared.get(name)
        return info.type if info is not None and isinstance(info.type, TensorType) else None

    def shape(self, name: str) -> tuple | None:
        t = self.tensor_type(name)
        return t.shape if t is not None else None

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        shape = self.known_shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return shape

    def known_shape(self, name: str) -> tuple[int | str, ...] | None:
        """The shape when each dimension is a size or a named symbol ("batch"), else None.
        Two names with equal known shapes have equal shapes at run time: a session binds a
        symbol to one size across a call's inputs, and inference carries symbols through."""
        shape = self.shape(name)
        # A declared input dimension of 0 is not enforced by sessions: treat it as unknown.
        smallest = 1 if name in self.inputs else 0
        if shape is None or not all(isinstance(d, int) and d >= smallest or
                                    isinstance(d, str) and d for d in shape):
            return None
        return tuple(shape)

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def dtype(self, name: str) -> np.dtype | None:
        t = self.tensor_type(name)
        return None if t is None or t.dtype is None else np.dtype(t.dtype)

    # -- structure ------------------------------------------------------------------------
    def uses(self, name: str) -> int:
        """How many times `name` is read (a graph output counts as a read)."""
        return len(self.consumers.get(name, ())) + (name in self.outputs)

    def only_consumer(self, name: str) -> Node | None:
        """The single live node reading `name`, when nothing else (graph outputs included)
        does."""
        readers = self.consumers.get(name, ())
        if len(readers) != 1 or name in self.outputs or id(readers[0]) in self.dead:
            return None
        return readers[0]

    def single_use_producer(self, name: str, op_type: str | None = None) -> Node | None:
        """The live producer of `name` when `name` is read only once (so it can be fused)."""
        node = self.producer.get(name)
        if node is None or id(node) in self.dead:
            return None
        if op_type is not None and (node.domain != "" or node.op_type != op_type):
            return None
        if self.uses(name) != 1:
            return None
        return node

    def set_inputs(self, node: Node, inputs: list[str]) -> None:
        """Rewire `node` to read `inputs`, keeping the consumer lists right (renames use them)."""
        for name in set(node.inputs) - set(inputs) - set(node.implicit_inputs):
            readers = self.consumers.get(name)
            if readers:  # by identity: nodes compare by value
                self.consumers[name] = [n for n in readers if n is not node]
        for name in set(inputs) - set(node.inputs):
            if name:
                self.consumers.setdefault(name, []).append(node)
        node.inputs = list(inputs)

    def hand_over_read(self, name: str, removed: Node, reader: Node) -> None:
        """`reader` now reads `name` in place of `removed` (about to be killed). Unlike
        set_inputs this walks only `name`'s readers: a pass merging a node into the next one
        leaves the constants `reader` stops reading listed, rather than walk every reader of a
        widely shared constant on each merge. A stale entry only over-counts uses, which can
        make a pass decline a rewrite but never make one wrong, and renames skip it."""
        self.consumers[name] = [reader if n is removed else n
                                for n in self.consumers.get(name, [])]

    def kill(self, *nodes: Node) -> None:
        self.dead.update(id(n) for n in nodes)

    def alive(self, node: Node) -> bool:
        return id(node) not in self.dead

    def live(self, *op_types: str) -> Iterator[Node]:
        """The graph's default-domain nodes of these op types that no rewrite has removed yet
        (checked as the iteration reaches each node, so rewrites may run in between)."""
        for node in self.graph.nodes:
            if not node.domain and node.op_type in op_types and self.alive(node):
                yield node


def _reads(node: Node) -> Iterable[str]:
    seen = set()
    for name in list(node.inputs) + list(node.implicit_inputs):
        if name and name not in seen:
            seen.add(name)
            yield name


def squeeze_axes(node: Node, index: GraphIndex, default: list[int] | None = None
                 ) -> list[int] | None:
    """The `axes` a Squeeze or Unsqueeze is given, as given (an attribute before opset 13, a
    constant input from 13 on); `default` where none are given, None where they are
    computed."""
    if node.version < 13:
        axes = node.attrs.get("axes")
        return default if axes is None else [int(a) for a in axes]
    if len(node.inputs) < 2 or not node.inputs[1]:
        return default
    value = index.constant(node.inputs[1])
    return None if value is None else [int(a) for a in value.reshape(-1)]


def axes_are_input(node: Node) -> bool:
    """Whether a reduction at its opset takes its axes as an input rather than an attribute
    (ReduceSum from 13, the others from 18), as its implementation declares."""
    impl = lookup(node.domain, node.op_type, node.version)
    return bool(getattr(impl, "axes_from_input", False))


def drop_dead(graph: Graph, index: GraphIndex) -> None:
    graph.nodes = [n for n in graph.nodes if index.alive(n)]


def fresh_name(graph: Graph, base: str, taken: set[str] | None = None, first: int = 0) -> str:
    """A value name not used anywhere in `graph` (nor in `taken`): `base`__sN, N >= `first`."""
    used = taken if taken is not None else all_names(graph)
    for i in itertools.count(first):
        name = f"{base}__s{i}"
        if name not in used:
            used.add(name)
            return name
    raise AssertionError("unreachable")


def all_names(graph: Graph) -> set[str]:
    names = set(graph.initializers) | {v.name for v in graph.inputs} | \
        {v.name for v in graph.outputs}
    for node in graph.iter_nodes():
        names.update(node.inputs)
        names.update(node.outputs)
    return names


def add_constant(graph: Graph, base: str, value: Any) -> str:
    """Store `value` as a new initialiser; returns its name."""
    name = fresh_name(graph, base)
    graph.initializers[name] = np.asarray(value)
    return name


def rename_uses(graph: Graph, old: str, new: str, index: GraphIndex | None = None) -> None:
    """Every read of `old` (subgraph captures included) reads `new` instead. With `index`, only
    the nodes its consumer lists name as readers of `old` are visited (and the lists follow
    the rename); without, every node of the graph is."""
    if old == new:
        return
    readers = graph.nodes if index is None else index.consumers.pop(old, [])
    for node in readers:
        _rename_in_node(node, {old: new})
    if index is not None and readers:  # they read `new` now (a node reading both is
        # listed twice, as it reads it twice); removed nodes are dropped on the way
        index.consumers.setdefault(new, []).extend(n for n in readers if index.alive(n))


def rename_many(graph: Graph, renames: dict[str, str]) -> None:
    """Apply many renames (old -> new, none of the new names renamed again) in one sweep."""
    if renames:
        for node in graph.nodes:
            _rename_in_node(node, renames)


def _rename_in_node(node: Node, renames: dict[str, str]) -> None:
    if any(n in renames for n in node.inputs):
        node.inputs = [renames.get(n, n) for n in node.inputs]
    captured = [n for n in node.implicit_inputs if n in renames]
    if captured:
        node.implicit_inputs = [renames.get(n, n) for n in node.implicit_inputs]
        for old in captured:
            for sub in node.subgraphs():
                _rename_captures(sub, old, renames[old])


def _rename_captures(graph: Graph, old: str, new: str) -> None:
    local = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in graph.nodes:
        if old in local:
            return  # shadowed from here on
        node.inputs = [new if n == old and n not in local else n for n in node.inputs]
        if old in node.implicit_inputs:
            node.implicit_inputs = [new if n == old else n for n in node.implicit_inputs]
            for sub in node.subgraphs():
                _rename_captures(sub, old, new)
        local.update(node.outputs)
    for out in graph.outputs:
        if out.name == old and old not in local:
            out.name = new


def alias(graph: Graph, index: GraphIndex, removed: str, kept: str) -> bool:
    """Make value `removed` (about to lose its producer) be `kept`. When `removed` is a graph
    output its name must survive: `kept`'s producer is renamed instead, if that is safe.
    Returns False when neither can be done (the caller then keeps its node)."""
    if removed not in index.outputs:
        rename_uses(graph, removed, kept, index)
        graph.value_info.pop(removed, None)
        return True
    producer = index.producer.get(kept)
    if producer is None or kept in index.outputs or kept in index.inputs \
            or kept in graph.initializers:
        return False
    producer.outputs = [removed if o == kept else o for o in producer.outputs]
    rename_uses(graph, kept, removed, index)
    index.producer[removed] = producer
    return True


def folds_exactly(exact: np.ndarray, dtype: np.dtype) -> bool:
    """Whether constants folded into one (`exact`: their combination computed in float64)
    are stored in `dtype` without rounding, where `dtype` is a narrow float. A rewrite that
    folds constants moves a rounding from the data to the folded constant; for float16 and
    bfloat16 that rounding is as coarse as the data's (or, in their subnormals, far coarser),
    so such folds are made only where they round nothing. Wider floats fold as before."""
    if not is_narrow_float(np.dtype(dtype)):
        return True
    with np.errstate(all="ignore"):
        stored = np.asarray(exact).astype(dtype).astype(np.float64)
        return bool(np.all((stored == exact) | (np.isnan(stored) & np.isnan(exact))))


def producers_first(graph: Graph) -> list[Node]:
    """`graph`'s nodes ordered producers first (ir.topological_order), with its inputs,
    initialisers and whatever it reads from enclosing graphs available."""
    available = {v.name for v in graph.inputs} | set(graph.initializers) | outer_names(graph)
    return topological_order(graph, available)


def check_structure(graph: Graph, outer: frozenset[str] = frozenset()) -> None:
    """The simplifier's one check of names and cycles, on `graph` and its subgraphs: every
    value read or given out is defined in its graph or an enclosing one (`outer`: the names
    those define), and no graph has a cycle; InvalidModelError, naming the node, otherwise.
    `simplify` runs it on the graph it is given and after each round that changed it (with
    EMBER_SIMPLIFY_STRICT, the importer's check too)."""
    own = {v.name for v in graph.inputs} | set(graph.initializers)
    topological_order(graph, own | outer)  # raises on a cycle or an undefined read
    visible = outer | own | {name for node in graph.nodes for name in node.outputs if name}
    for out in graph.outputs:
        if out.name not in visible:
            raise InvalidModelError(f"graph '{graph.name}': its output '{out.name}' is never "
                                    "computed (no node, input or initializer defines it)")
    for node in graph.nodes:
        for sub in node.subgraphs():
            check_structure(sub, visible)


def outer_names(graph: Graph) -> set[str]:
    """Names `graph` reads that none of its nodes, inputs or initialisers define (captures
    from enclosing graphs); unlike Graph.free_names this ignores node order."""
    defined = {v.name for v in graph.inputs} | set(graph.initializers) | {""}
    for node in graph.nodes:
        defined.update(node.outputs)
    read = {name for node in graph.nodes for name in list(node.inputs) + node.implicit_inputs}
    return read - defined
