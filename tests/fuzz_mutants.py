"""A seeded mutation fuzzer for ember's loader and runtime (issue 13, item 6).

Every mutant is a pure function of an integer case id (and a base seed): the seed model, the
mutation and its parameters are drawn from `random.Random(f"ember-fuzz:{base}:{id}")`, so
`python tests/fuzz_worker.py --case ID` rebuilds exactly the mutant a campaign ran.

Seeds: a fixed, diverse set of ONNX node-suite models (different op types, control flow,
sequences, strings), the demo models in models/, and a few models built here with
onnx.helper (an MLP, a model-local function, a sparse initializer). Feeds: the case's
input_*.pb, else zeros of the declared shape (unknown dims 1).

Mutations: byte-level (bit flips, truncation, inserted bytes, duplicated chunks, overlong
varints) on the serialized model, and structured ones on the ModelProto (attributes, axes,
dims, names, cycles, opsets, subgraphs, sparse tensors, raw_data, functions, nesting depth,
invalid UTF-8, hostile sizes) and on the feeds. The first ids of any campaign pin every
mutation kind once and then every named variant of the targeted kinds once, so even a short
campaign covers all of them.

`run_cases(ids)` runs cases in worker subprocesses (tests/fuzz_worker.py) with an address-space
cap and a per-case timeout, and classifies each: `ran`, `ember_error`, `python_error`,
`killed` (the worker died) or `hung` (past the timeout). `internal_error`: an ember error
that wraps one of INTERNAL_ERRORS (AttributeError, TypeError, IndexError...) raised by ember's
own code, a bug the wrapping hides (issue 43). `unsafe_ran`: a mutant that must be
refused (external data reached through `..`, an absolute path, a symlink or a hard link out of
the model's folder) loaded and ran. `harness_error` means the fuzzer itself could not build
the mutant (a bug here, not in ember).

No pytest dependency: the test, the worker and benchmarks/fuzz_report.py all import this.
"""
from __future__ import annotations

import collections
import copy
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "fuzz_worker.py")
OUTCOMES = ("ran", "ember_error", "python_error", "internal_error", "killed", "hung",
            "unsafe_ran", "harness_error")
ACCEPTED = ("ran", "ember_error")
# Exceptions that say ember's own code is wrong (it read a missing attribute, indexed past an
# end, called with the wrong type...), never that the model or feed is: wrapped in an ember
# error, they are still bugs to fix where they are raised.
INTERNAL_ERRORS = ("AttributeError", "TypeError", "IndexError", "KeyError", "NameError",
                   "UnboundLocalError", "ZeroDivisionError")
# Where ember turns such an exception from a library into an error on purpose (file, function
# raising the ember error): the library's refusal is the message, not a bug of ember's.
TRANSLATIONS = {
    ("runtime/session.py", "_as_array"): "numpy cannot convert a feed (a dict, a ragged list)",
}

I64_MAX, I64_MIN = 2 ** 63 - 1, -(2 ** 63)
HUGE_INTS = (I64_MAX, 2 ** 62, 2 ** 40, 2 ** 31, 2 ** 31 - 1, 10 ** 9, -1, -2, -(2 ** 40), I64_MIN, 0)
AXIS_VALUES = (I64_MAX, -(2 ** 40), 99, -99, 2 ** 31, I64_MIN)

# --------------------------------------------------------------------------------------------
# seeds

# Node-suite cases: chosen for op diversity; those missing from an onnx version are skipped.
NODE_SEEDS = (
    "test_if", "test_if_seq", "test_if_opt", "test_loop11", "test_loop13_seq",
    "test_loop16_seq_none", "test_scan9_sum", "test_scan_sum",
    "test_sequence_map_add_2_sequences", "test_split_equal_parts_1d_opset18",
    "test_split_equal_parts_2d", "test_split_variable_parts_2d_opset13",
    "test_split_to_sequence_1", "test_layer_normalization_4d_axis1",
    "test_layer_normalization_default_axis", "test_layer_normalization_2d_axis0_expanded",
    "test_regex_full_match_basic", "test_regex_full_match_email_domain",
    "test_averagepool_2d_pads", "test_averagepool_3d_default", "test_maxpool_2d_default",
    "test_constantofshape_float_ones", "test_constantofshape_int_zeros", "test_constant",
    "test_constant_pad", "test_conv_with_strides_padding", "test_gemm_default_matrix_bias",
    "test_matmul_2d", "test_softmax_axis_1", "test_transpose_default", "test_concat_2d_axis_1",
    "test_slice", "test_slice_neg_steps", "test_reshape_negative_dim",
    "test_reshape_zero_and_negative_dim", "test_expand_dim_changed", "test_tile",
    "test_gather_0", "test_gather_elements_negative_indices", "test_scatter_elements_with_axis",
    "test_onehot_with_axis", "test_range_float_type_positive_delta_expanded", "test_top_k",
    "test_cumsum_2d_axis_1", "test_einsum_batch_matmul", "test_lstm_defaults",
    "test_gru_defaults", "test_rnn_seq_length", "test_batchnorm_example",
    "test_instancenorm_example", "test_resize_upsample_scales_nearest", "test_nonzero_example",
    "test_unique_sorted_with_axis", "test_compress_0", "test_where_example",
    "test_cast_FLOAT_to_DOUBLE", "test_squeeze", "test_unsqueeze_two_axes",
    "test_flatten_axis0", "test_reduce_sum_keepdims_example", "test_argmax_keepdims_example",
    "test_dft", "test_stft", "test_string_split_basic", "test_string_concat",
    "test_tfidfvectorizer_tf_batch_onlybigrams_skip0", "test_shape_start_1_end_2", "test_size",
    "test_identity_sequence", "test_optional_get_element_tensor", "test_depthtospace_example",
    "test_col2im", "test_nonmaxsuppression_two_batches", "test_roialign_aligned_false",
    "test_quantizelinear_axis", "test_group_normalization_example", "test_rotary_embedding",
    "test_attention_4d", "test_center_crop_pad_crop_and_pad", "test_hardmax_axis_1",
)
DEMO_SEEDS = ("demo:mlp", "demo:cnn", "demo:transformer")
BUILTIN_SEEDS = ("builtin:mlp", "builtin:function", "builtin:sparse")


def node_suite_dir() -> str:
    """The node-suite case folders: shipped in the onnx package where it has them, else the
    ones tests/onnx_suites.py generates into .cache/ (onnx >= 1.2x ships no node data)."""
    import onnx.backend.test

    shipped = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "node")
    if os.path.isdir(shipped) and os.listdir(shipped):
        return shipped
    sys.path.insert(0, TESTS)
    import onnx_suites

    return onnx_suites.node_cases_dir()


_SEED_NAMES: list[str] | None = None


def seed_names() -> list[str]:
    global _SEED_NAMES
    if _SEED_NAMES is None:
        root = node_suite_dir()
        present = [n for n in NODE_SEEDS if os.path.isfile(os.path.join(root, n, "model.onnx"))]
        _SEED_NAMES = present + list(DEMO_SEEDS) + list(BUILTIN_SEEDS)
    return _SEED_NAMES


@dataclass
class Seed:
    name: str
    data: bytes  # the serialized model
    feeds: dict[str, Any]

    def proto(self) -> onnx.ModelProto:
        m = onnx.ModelProto()
        m.ParseFromString(self.data)
        return m


_SEEDS: dict[str, Seed] = {}


def load_seed(name: str) -> Seed:
    if name not in _SEEDS:
        _SEEDS[name] = _load_seed(name)
    return _SEEDS[name]


def _load_seed(name: str) -> Seed:
    if name.startswith("builtin:"):
        model, feeds = BUILTIN_BUILDERS[name]()
        return Seed(name, model.SerializeToString(), feeds)
    if name.startswith("demo:"):
        with open(os.path.join(REPO, "models", name[5:] + ".onnx"), "rb") as f:
            data = f.read()
        m = onnx.ModelProto()
        m.ParseFromString(data)
        return Seed(name, data, zero_feeds(m.graph))
    case_dir = os.path.join(node_suite_dir(), name)
    with open(os.path.join(case_dir, "model.onnx"), "rb") as f:
        data = f.read()
    m = onnx.ModelProto()
    m.ParseFromString(data)
    feeds = zero_feeds(m.graph)
    ds = os.path.join(case_dir, "test_data_set_0")
    infos = feed_infos(m.graph)
    if os.path.isdir(ds):
        sys.path.insert(0, TESTS)
        from onnx_suites import _decode_file

        for j, info in enumerate(infos):
            path = os.path.join(ds, f"input_{j}.pb")
            if os.path.exists(path):
                feeds[info.name] = _decode_file(path, info)
            elif j >= len([f for f in os.listdir(ds) if f.startswith("input_")]):
                feeds.pop(info.name, None)  # an optional trailing input the case leaves out
    return Seed(name, data, feeds)


def feed_infos(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    return [v for v in graph.input if v.name not in inits]


def zero_feeds(graph: onnx.GraphProto) -> dict[str, Any]:
    return {v.name: zero_value(v.type) for v in feed_infos(graph)}


def zero_value(t: onnx.TypeProto) -> Any:
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1
                 for d in t.tensor_type.shape.dim]
        if t.tensor_type.elem_type == TensorProto.STRING:
            return np.full(shape, "", dtype=object)
        try:
            dtype = helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)
        except Exception:
            dtype = np.float32
        return np.zeros(shape, dtype=dtype)
    if kind == "sequence_type":
        return []
    if kind == "optional_type":
        return None
    return None


def copy_feeds(feeds: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.copy() if isinstance(v, np.ndarray) else copy.deepcopy(v))
            for k, v in feeds.items()}


# -- built-in seeds ----------------------------------------------------------------------------

def _opsets(*extra: tuple[str, int], default: int = 17):
    return [helper.make_opsetid("", default)] + [helper.make_opsetid(d, v) for d, v in extra]


def _model(graph, opsets=None, functions=(), ir_version=8) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=opsets or _opsets(), functions=list(functions))
    m.ir_version = ir_version
    return m


def build_mlp():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"], name="mm1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
             helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
             helper.make_node("MatMul", ["h2", "W2"], ["h3"], name="mm2"),
             helper.make_node("Softmax", ["h3"], ["h4"], name="softmax", axis=-1),
             helper.make_node("Reshape", ["h4"], ["y"], name="reshape")]
    nodes[-1].input.append("shape")
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    return _model(graph), {"x": rng.standard_normal((2, 4)).astype(np.float32)}


def build_function_model():
    fn = helper.make_function(
        "fuzz.local", "AddMul", ["a", "b"], ["c"],
        [helper.make_node("Add", ["a", "b"], ["t"]),
         helper.make_node("Mul", ["t", "t"], ["c"])],
        opset_imports=[helper.make_opsetid("", 17)])
    nodes = [helper.make_node("AddMul", ["x", "x"], ["m"], domain="fuzz.local", name="call"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "fn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return _model(graph, _opsets(("fuzz.local", 1)), [fn]), \
        {"x": np.array([1.0, -2.0, 3.0], dtype=np.float32)}


def build_sparse_model():
    values = numpy_helper.from_array(np.array([1.0, 2.0, 3.0], dtype=np.float32), "S")
    indices = numpy_helper.from_array(np.array([0, 7, 19], dtype=np.int64), "S_idx")
    sparse = helper.make_sparse_tensor(values, indices, [4, 5])
    cvalues = numpy_helper.from_array(np.array([5.0, -1.0], dtype=np.float32), "C")
    cindices = numpy_helper.from_array(np.array([1, 4], dtype=np.int64), "C_idx")
    const = helper.make_node("Constant", [], ["c"], name="sparse_const",
                             sparse_value=helper.make_sparse_tensor(cvalues, cindices, [5]))
    nodes = [const,
             helper.make_node("MatMul", ["x", "S"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "c"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
                              sparse_initializer=[sparse])
    return _model(graph), {"x": np.ones((2, 4), dtype=np.float32)}


BUILTIN_BUILDERS = {"builtin:mlp": build_mlp, "builtin:function": build_function_model,
                    "builtin:sparse": build_sparse_model}

# --------------------------------------------------------------------------------------------
# mutants


class NotApplicable(Exception):
    """This mutation has nothing to act on in this seed; the case draws another seed."""


@dataclass
class Mutant:
    case_id: int
    seed: str
    mutation: str
    params: str
    model: Any  # bytes or onnx.ModelProto
    feeds: dict[str, Any]
    as_file: bool = False  # write the model to model/model.onnx and load it from the path
    files: dict[str, bytes] = field(default_factory=dict)  # relative to the model's folder
    symlinks: dict[str, str] = field(default_factory=dict)  # name -> target (relative/absolute)
    hardlinks: dict[str, str] = field(default_factory=dict)  # name -> file relative to it
    must_fail: bool = False  # running it is a security defect (`unsafe_ran`), not a pass

    def describe(self) -> dict[str, str]:
        return {"seed": self.seed, "mutation": self.mutation, "params": self.params}

    def model_bytes(self) -> bytes:
        return self.model if isinstance(self.model, (bytes, bytearray)) else \
            self.model.SerializeToString()


# A mutation: fn(rng, seed or None, variant or None) -> (model, feeds, params[, extras]).
@dataclass
class Mutation:
    name: str
    weight: float
    fn: Callable
    needs_seed: bool = True
    variants: tuple = ()  # named variants, each pinned once at the start of every campaign


MUTATIONS: dict[str, Mutation] = {}


def mutation(name: str, weight: float, needs_seed: bool = True, variants: tuple = ()):
    def register(fn):
        MUTATIONS[name] = Mutation(name, weight, fn, needs_seed, variants)
        return fn
    return register


def _out(model, feeds, params, **extra) -> dict:
    return dict(model=model, feeds=feeds, params=params, **extra)


# -- proto helpers -----------------------------------------------------------------------------

def iter_graphs(g: onnx.GraphProto):
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from iter_graphs(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from iter_graphs(sub)


def node_lists(m: onnx.ModelProto):
    """(container, nodes) for every graph and subgraph, then every model-local function."""
    for g in iter_graphs(m.graph):
        yield g, g.node
    for f in m.functions:
        yield f, f.node
        for n in f.node:
            for a in n.attribute:
                if a.type == AttributeProto.GRAPH:
                    for g in iter_graphs(a.g):
                        yield g, g.node


def all_nodes(m: onnx.ModelProto) -> list:
    return [n for _, nodes in node_lists(m) for n in nodes]


def pick(rng: random.Random, items: Sequence, what: str = "candidate"):
    items = list(items)
    if not items:
        raise NotApplicable(f"no {what}")
    return rng.choice(items)


def node_label(n) -> str:
    return f"{n.op_type}({n.name or (n.output[0] if n.output else '?')})"


def replace_attr(node, attr: AttributeProto) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == attr.name:
            del node.attribute[i]
            break
    node.attribute.append(attr)


def tensors_of(m: onnx.ModelProto, int_only: bool = False) -> list[tuple[str, TensorProto]]:
    """Initializers and Constant-node value tensors of every graph (for dims/raw_data)."""
    found = []
    for g in iter_graphs(m.graph):
        for t in g.initializer:
            found.append((f"initializer {t.name}", t))
    for n in all_nodes(m):
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.type == AttributeProto.TENSOR:
                    found.append((f"Constant {n.output[0] if n.output else '?'}", a.t))
    if int_only:
        found = [(w, t) for w, t in found
                 if t.data_type in (TensorProto.INT64, TensorProto.INT32)]
    return found


def set_tensor_array(t: TensorProto, arr: np.ndarray) -> None:
    new = numpy_helper.from_array(arr, t.name)
    t.CopyFrom(new)


def _small_graph(name: str = "g") -> onnx.GraphProto:
    return helper.make_graph([helper.make_node("Identity", ["fz_in"], ["fz_out"])], name,
                             [helper.make_tensor_value_info("fz_in", TensorProto.FLOAT, [1])],
                             [helper.make_tensor_value_info("fz_out", TensorProto.FLOAT, [1])])


def make_typed_attr(name: str, kind: int) -> AttributeProto:
    a = AttributeProto(name=name, type=kind)
    if kind == AttributeProto.FLOAT:
        a.f = 1.5
    elif kind == AttributeProto.INT:
        a.i = 7
    elif kind == AttributeProto.STRING:
        a.s = b"fuzz"
    elif kind == AttributeProto.TENSOR:
        a.t.CopyFrom(numpy_helper.from_array(np.array([1.0, 2.0], dtype=np.float32), "t"))
    elif kind == AttributeProto.GRAPH:
        a.g.CopyFrom(_small_graph())
    elif kind == AttributeProto.FLOATS:
        a.floats.extend([1.0, 2.0])
    elif kind == AttributeProto.INTS:
        a.ints.extend([1, 2, 3])
    elif kind == AttributeProto.STRINGS:
        a.strings.extend([b"a", b"b"])
    elif kind == AttributeProto.TENSORS:
        a.tensors.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "t"))
    elif kind == AttributeProto.GRAPHS:
        a.graphs.append(_small_graph())
    elif kind == AttributeProto.SPARSE_TENSOR:
        a.sparse_tensor.CopyFrom(helper.make_sparse_tensor(
            numpy_helper.from_array(np.array([1.0], dtype=np.float32), "v"),
            numpy_helper.from_array(np.array([0], dtype=np.int64), "i"), [2]))
    elif kind == AttributeProto.TYPE_PROTO:
        a.tp.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, [1]))
    return a


ATTR_KINDS = (AttributeProto.FLOAT, AttributeProto.INT, AttributeProto.STRING, AttributeProto.TENSOR,
              AttributeProto.GRAPH, AttributeProto.FLOATS, AttributeProto.INTS, AttributeProto.STRINGS,
              AttributeProto.TENSORS, AttributeProto.GRAPHS, AttributeProto.SPARSE_TENSOR,
              AttributeProto.TYPE_PROTO, AttributeProto.UNDEFINED)

# -- byte-level --------------------------------------------------------------------------------


@mutation("bitflip", 9)
def m_bitflip(rng, seed, variant):
    data = bytearray(seed.data)
    flips = [(rng.randrange(len(data)), rng.randrange(8)) for _ in range(rng.choice((1, 1, 2, 4, 8)))]
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    return _out(bytes(data), copy_feeds(seed.feeds), "flips " + ",".join(f"{p}:{b}" for p, b in flips))


@mutation("truncate", 5)
def m_truncate(rng, seed, variant):
    cut = rng.randrange(1, len(seed.data))
    return _out(seed.data[:cut], copy_feeds(seed.feeds), f"cut at {cut} of {len(seed.data)}")


@mutation("insert_bytes", 5)
def m_insert(rng, seed, variant):
    pos = rng.randrange(len(seed.data) + 1)
    n = rng.choice((1, 2, 4, 8, 16, 64, 256))
    junk = bytes(rng.randrange(256) for _ in range(n))
    return _out(seed.data[:pos] + junk + seed.data[pos:], copy_feeds(seed.feeds),
                f"{n} bytes at {pos}")


@mutation("dup_chunk", 5)
def m_dup_chunk(rng, seed, variant):
    start = rng.randrange(len(seed.data))
    length = rng.choice((1, 4, 16, 64, 256, 4096))
    chunk = seed.data[start:start + length]
    at = rng.choice((start + len(chunk), rng.randrange(len(seed.data) + 1)))
    return _out(seed.data[:at] + chunk * rng.choice((1, 1, 2, 8)) + seed.data[at:],
                copy_feeds(seed.feeds), f"chunk {start}+{len(chunk)} at {at}")


@mutation("overwrite_varint", 3)
def m_varint(rng, seed, variant):
    pos = rng.randrange(len(seed.data))
    junk = rng.choice((b"\xff" * 10, b"\xff" * 9 + b"\x01", b"\x80" * 11, b"\xff\xff\xff\xff\x0f",
                       b"\x00", b"\xff\xff\xff\x7f"))
    data = seed.data[:pos] + junk + seed.data[pos + len(junk):]
    return _out(data, copy_feeds(seed.feeds), f"{junk.hex()} at {pos}")

# -- attributes --------------------------------------------------------------------------------


def _attr_nodes(m):
    return [n for n in all_nodes(m) if n.attribute]


@mutation("attr_wrong_type", 5)
def m_attr_wrong_type(rng, seed, variant):
    m = seed.proto()
    n = pick(rng, _attr_nodes(m), "node with attributes")
    a = pick(rng, n.attribute)
    kind = rng.choice([k for k in ATTR_KINDS if k != a.type])
    if rng.random() < 0.3:  # the type field lies: the payload stays
        old = a.type
        a.type = kind
        params = f"{node_label(n)}.{a.name}: type {old} -> {kind}, payload kept"
    else:
        new = make_typed_attr(a.name, kind)
        params = f"{node_label(n)}.{a.name}: type {a.type} -> {kind}"
        replace_attr(n, new)
    return _out(m, copy_feeds(seed.feeds), params)


@mutation("attr_removed", 4)
def m_attr_removed(rng, seed, variant):
    m = seed.proto()
    n = pick(rng, _attr_nodes(m), "node with attributes")
    i = rng.randrange(len(n.attribute))
    name = n.attribute[i].name
    del n.attribute[i]
    return _out(m, copy_feeds(seed.feeds), f"{node_label(n)}: removed {name}")


DUNDER_NAMES = ("__dict__", "__class__", "__init__", "__setattr__", "__getattribute__",
                "_reserved", "xp", "attrs", "setup", "node")


@mutation("attr_dunder", 4)
def m_attr_dunder(rng, seed, variant):
    m = seed.proto()
    nodes = all_nodes(m)
    n = pick(rng, nodes, "node")
    name = rng.choice(DUNDER_NAMES)
    if n.attribute and rng.random() < 0.5:
        a = rng.choice(list(n.attribute))
        params = f"{node_label(n)}: renamed {a.name} -> {name}"
        a.name = name
    else:
        n.attribute.append(make_typed_attr(name, rng.choice(ATTR_KINDS[:10])))
        params = f"{node_label(n)}: added {name}"
    return _out(m, copy_feeds(seed.feeds), params)


@mutation("attr_extreme", 5)
def m_attr_extreme(rng, seed, variant):
    m = seed.proto()
    n = pick(rng, _attr_nodes(m), "node with attributes")
    a = pick(rng, [a for a in n.attribute if a.type in (
        AttributeProto.INT, AttributeProto.INTS, AttributeProto.FLOAT, AttributeProto.FLOATS,
        AttributeProto.STRING, AttributeProto.STRINGS)], "scalar attribute")
    if a.type == AttributeProto.INT:
        a.i = rng.choice(HUGE_INTS)
        v = a.i
    elif a.type == AttributeProto.INTS:
        choice = rng.choice(("elem", "empty", "long"))
        if choice == "elem" and len(a.ints):
            a.ints[rng.randrange(len(a.ints))] = v = rng.choice(HUGE_INTS)
        elif choice == "long":
            a.ints.extend([rng.choice((1, 2, 2 ** 31))] * 64)
            v = "64 more"
        else:
            del a.ints[:]
            v = "[]"
    elif a.type == AttributeProto.FLOAT:
        a.f = v = rng.choice((float("nan"), float("inf"), -float("inf"), 1e38, -1e38, 0.0))
    elif a.type == AttributeProto.FLOATS:
        if a.floats:
            a.floats[rng.randrange(len(a.floats))] = v = rng.choice((float("nan"), float("inf"), 1e38))
        else:
            a.floats.extend([float("nan")])
            v = "[nan]"
    elif a.type == AttributeProto.STRING:
        a.s = v = rng.choice((b"", b"bogus", b"x" * 4096, b"\x00"))
    else:
        a.strings.append(b"bogus")
        v = "+bogus"
    return _out(m, copy_feeds(seed.feeds), f"{node_label(n)}.{a.name} = {v!r}"[:160])


AXIS_ATTRS = ("axis", "axes", "perm", "batch_axis", "time_axis", "blocksize", "group", "k")
AXIS_OPS = ("Softmax", "LogSoftmax", "Hardmax", "Concat", "Gather", "GatherElements",
            "LayerNormalization", "Split", "Flatten", "ArgMax", "ArgMin", "ScatterElements",
            "OneHot", "Compress", "QuantizeLinear", "DequantizeLinear", "Unique", "TopK",
            "CumSum", "ReduceSum", "Squeeze", "Unsqueeze", "Transpose", "GroupNormalization",
            "RMSNormalization", "Scan", "DFT", "SplitToSequence", "ConcatFromSequence")


@mutation("axis_out_of_range", 6)
def m_axis(rng, seed, variant):
    m = seed.proto()
    cands = [(n, a.name) for n in all_nodes(m) for a in n.attribute
             if a.name in AXIS_ATTRS and a.type in (AttributeProto.INT, AttributeProto.INTS)]
    cands += [(n, "axis") for n in all_nodes(m) if n.op_type in AXIS_OPS
              and not any(a.name == "axis" for a in n.attribute)]
    n, name = pick(rng, cands, "node with an axis")
    value = rng.choice(AXIS_VALUES)
    old = next((a for a in n.attribute if a.name == name), None)
    if old is not None and old.type == AttributeProto.INTS:
        vals = list(old.ints) or [0]
        vals[rng.randrange(len(vals))] = value
        replace_attr(n, helper.make_attribute(name, vals))
    else:
        replace_attr(n, helper.make_attribute(name, value))
    return _out(m, copy_feeds(seed.feeds), f"{node_label(n)}.{name} = {value}")

# -- shapes and sizes --------------------------------------------------------------------------


def promote_feed(rng, m: onnx.ModelProto, feeds: dict, kinds: str) -> tuple[str, TensorProto]:
    """Turn a numeric feed (dtype kind in `kinds`) into an initializer of the same name: most
    node-suite models feed their shapes and axes as inputs, where a mutated initializer is what
    a model file carries. The graph input stays (an overridable default); the feed goes."""
    name = pick(rng, [k for k, v in feeds.items() if isinstance(v, np.ndarray)
                      and v.dtype.kind in kinds and v.dtype != object and v.size], "numeric feed")
    t = numpy_helper.from_array(np.ascontiguousarray(feeds.pop(name)), name)
    m.graph.initializer.append(t)
    return f"initializer {name} (was a feed)", m.graph.initializer[-1]


@mutation("huge_dim_initializer", 5)
def m_huge_dim_init(rng, seed, variant):
    m = seed.proto()
    feeds = copy_feeds(seed.feeds)
    cands = tensors_of(m, int_only=True)
    if cands and rng.random() < 0.7:
        where, t = rng.choice(cands)
    else:
        where, t = promote_feed(rng, m, feeds, "iu")
        if t.data_type not in (TensorProto.INT64, TensorProto.INT32):
            raise NotApplicable("not int32/int64")
    arr = numpy_helper.to_array(t).copy()
    if arr.size == 0:
        raise NotApplicable("empty tensor")
    i = rng.randrange(arr.size)
    if arr.dtype == np.int32:
        value = rng.choice((2 ** 31 - 1, -(2 ** 31), -1, 2 ** 30, 0))
    else:
        value = rng.choice(HUGE_INTS)
    arr.reshape(-1)[i] = value
    set_tensor_array(t, arr)
    return _out(m, feeds, f"{where}[{i}] = {value}")


@mutation("huge_value_feed", 4)
def m_huge_feed(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    name = pick(rng, [k for k, v in feeds.items() if isinstance(v, np.ndarray)
                      and v.dtype.kind in "iu" and v.size], "integer feed")
    arr = feeds[name]
    info = np.iinfo(arr.dtype)
    value = rng.choice([v for v in HUGE_INTS if info.min <= v <= info.max] + [info.max, info.min])
    i = rng.randrange(arr.size)
    arr.reshape(-1)[i] = value
    return _out(seed.data, feeds, f"feed {name}[{i}] = {value}")


@mutation("graph_input_dim", 4)
def m_graph_dim(rng, seed, variant):
    m = seed.proto()
    g = m.graph
    values = [v for v in list(g.input) + list(g.output)
              if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")]
    v = pick(rng, values, "graph input/output with a shape")
    dims = v.type.tensor_type.shape.dim
    choice = rng.choice(("value", "value", "param", "add_dim", "drop_shape", "elem_type"))
    if choice == "value" and len(dims):
        d = dims[rng.randrange(len(dims))]
        d.dim_value = val = rng.choice((I64_MAX, 2 ** 40, 2 ** 31, -1, -5, 0, I64_MIN))
        params = f"{v.name} dim = {val}"
    elif choice == "param" and len(dims):
        d = dims[rng.randrange(len(dims))]
        d.dim_param = val = rng.choice(("", "N", "__dict__", "a b", "batch"))
        params = f"{v.name} dim = {val!r}"
    elif choice == "add_dim":
        dims.add().dim_value = val = rng.choice((1, 2 ** 40, -3))
        params = f"{v.name} extra dim {val}"
    elif choice == "drop_shape":
        v.type.tensor_type.ClearField("shape")
        params = f"{v.name} shape removed"
    else:
        v.type.tensor_type.elem_type = val = rng.choice((0, 999, -1, TensorProto.STRING, TensorProto.COMPLEX128))
        params = f"{v.name} elem_type = {val}"
    return _out(m, copy_feeds(seed.feeds), params)


def _ops_model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "huge", inputs, outputs, list(inits))
    return _model(graph, _opsets(default=opset))


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _f32(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.float32), name)


HUGE_ALLOC_VARIANTS = ("constantofshape_1e9", "constantofshape_1e6x1e6", "constantofshape_2p62",
                       "constantofshape_feed", "expand_1e12", "tile_1e10", "range_1e12",
                       "resize_scale_1e6", "pad_1e10", "onehot_depth_1e12", "reshape_to_huge",
                       "constantofshape_negative")


@mutation("huge_alloc", 2.5, needs_seed=False, variants=HUGE_ALLOC_VARIANTS)
def m_huge_alloc(rng, seed, variant):
    v = variant or rng.choice(HUGE_ALLOC_VARIANTS)
    Y = helper.make_tensor_value_info
    F, I = TensorProto.FLOAT, TensorProto.INT64
    value = helper.make_tensor("value", F, [1], [1.0])
    feeds: dict[str, Any] = {}
    if v.startswith("constantofshape"):
        shape = {"constantofshape_1e9": [10 ** 9], "constantofshape_1e6x1e6": [10 ** 6, 10 ** 6],
                 "constantofshape_2p62": [2 ** 62], "constantofshape_feed": [10 ** 9],
                 "constantofshape_negative": [-5, 3]}[v]
        node = helper.make_node("ConstantOfShape", ["shape"], ["y"], value=value)
        if v == "constantofshape_feed":
            m = _ops_model([node], [Y("shape", I, [1])], [Y("y", F, None)])
            feeds["shape"] = np.array(shape, dtype=np.int64)
        else:
            m = _ops_model([node], [], [Y("y", F, None)], [_i64("shape", shape)])
    elif v == "expand_1e12":
        m = _ops_model([helper.make_node("Expand", ["x", "shape"], ["y"])], [Y("x", F, [1])],
                       [Y("y", F, None)], [_i64("shape", [10 ** 6, 10 ** 6])])
        feeds["x"] = np.ones(1, dtype=np.float32)
    elif v == "tile_1e10":
        m = _ops_model([helper.make_node("Tile", ["x", "reps"], ["y"])], [Y("x", F, [2])],
                       [Y("y", F, None)], [_i64("reps", [5 * 10 ** 9])])
        feeds["x"] = np.ones(2, dtype=np.float32)
    elif v == "range_1e12":
        m = _ops_model([helper.make_node("Range", ["s", "l", "d"], ["y"])], [], [Y("y", F, None)],
                       [_f32("s", 0.0), _f32("l", 1e12), _f32("d", 1.0)])
    elif v == "resize_scale_1e6":
        m = _ops_model([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")],
                       [Y("x", F, [1, 1, 4, 4])], [Y("y", F, None)],
                       [_f32("scales", [1.0, 1.0, 1e6, 1e6])])
        feeds["x"] = np.ones((1, 1, 4, 4), dtype=np.float32)
    elif v == "pad_1e10":
        m = _ops_model([helper.make_node("Pad", ["x", "pads"], ["y"])], [Y("x", F, [2])],
                       [Y("y", F, None)], [_i64("pads", [10 ** 10, 0])])
        feeds["x"] = np.ones(2, dtype=np.float32)
    elif v == "onehot_depth_1e12":
        m = _ops_model([helper.make_node("OneHot", ["i", "depth", "vals"], ["y"])], [Y("i", I, [2])],
                       [Y("y", F, None)], [_i64("depth", [10 ** 12]), _f32("vals", [0.0, 1.0])])
        feeds["i"] = np.array([0, 1], dtype=np.int64)
    else:  # reshape_to_huge: a shape whose product overflows int64
        m = _ops_model([helper.make_node("Reshape", ["x", "shape"], ["y"])], [Y("x", F, [4])],
                       [Y("y", F, None)], [_i64("shape", [2 ** 62, 2 ** 62, 0])])
        feeds["x"] = np.ones(4, dtype=np.float32)
    return _out(m, feeds, v)

# -- names, cycles, duplicates -----------------------------------------------------------------


def _nodes_with_inputs(m):
    return [n for n in all_nodes(m) if any(n.input)]


@mutation("undefined_input", 5)
def m_undefined(rng, seed, variant):
    m = seed.proto()
    if rng.random() < 0.2 and len(m.graph.output):
        o = m.graph.output[rng.randrange(len(m.graph.output))]
        params = f"graph output {o.name} -> fuzz_undefined"
        o.name = "fuzz_undefined"
        return _out(m, copy_feeds(seed.feeds), params)
    n = pick(rng, _nodes_with_inputs(m), "node with inputs")
    i = rng.choice([i for i, x in enumerate(n.input) if x])
    params = f"{node_label(n)}.input[{i}] {n.input[i]} -> fuzz_undefined"
    n.input[i] = "fuzz_undefined"
    return _out(m, copy_feeds(seed.feeds), params)


@mutation("cycle", 5)
def m_cycle(rng, seed, variant):
    m = seed.proto()
    lists = [(c, nodes) for c, nodes in node_lists(m) if len(nodes)]
    _, nodes = pick(rng, lists, "graph with nodes")
    idx = rng.randrange(len(nodes))
    n = nodes[idx]
    later = list(range(idx + 1, len(nodes)))
    if later and rng.random() < 0.5:
        j = rng.choice(later)
        src = pick(rng, [o for o in nodes[j].output if o], "later output")
        kind = f"reads later node {j}'s output {src}"
    else:
        src = pick(rng, [o for o in n.output if o], "own output")
        kind = f"reads its own output {src}"
    if len(n.input) and rng.random() < 0.7:
        k = rng.randrange(len(n.input))
        n.input[k] = src
    else:
        n.input.append(src)
    return _out(m, copy_feeds(seed.feeds), f"{node_label(n)} {kind}")


@mutation("duplicate_output", 4)
def m_dup_output(rng, seed, variant):
    m = seed.proto()
    g = m.graph
    choice = rng.choice(("two_producers", "graph_output_twice", "shadows_input", "shadows_init",
                         "same_node_twice"))
    nodes = list(g.node)
    if choice == "two_producers" and len(nodes) >= 2:
        a, b = rng.sample(range(len(nodes)), 2)
        if not nodes[a].output or not nodes[b].output:
            raise NotApplicable("no output")
        nodes[b].output[0] = nodes[a].output[0]
        params = f"node {b} also produces {nodes[a].output[0]}"
    elif choice == "graph_output_twice" and len(g.output):
        g.output.append(g.output[rng.randrange(len(g.output))])
        params = f"graph output {g.output[-1].name} listed twice"
    elif choice == "shadows_input" and len(g.input) and nodes:
        n = rng.choice(nodes)
        if not n.output:
            raise NotApplicable("no output")
        n.output[0] = g.input[rng.randrange(len(g.input))].name
        params = f"{node_label(n)} output shadows graph input {n.output[0]}"
    elif choice == "shadows_init" and len(g.initializer) and nodes:
        n = rng.choice(nodes)
        if not n.output:
            raise NotApplicable("no output")
        n.output[0] = g.initializer[rng.randrange(len(g.initializer))].name
        params = f"{node_label(n)} output shadows initializer {n.output[0]}"
    elif nodes:
        n = rng.choice(nodes)
        if not n.output:
            raise NotApplicable("no output")
        n.output.append(n.output[0])
        params = f"{node_label(n)} lists output {n.output[0]} twice"
    else:
        raise NotApplicable("empty graph")
    return _out(m, copy_feeds(seed.feeds), params)

# -- opsets and domains ------------------------------------------------------------------------


@mutation("opset", 4)
def m_opset(rng, seed, variant):
    m = seed.proto()
    choice = rng.choice(("version", "version", "version", "remove", "unknown_domain_node",
                         "unknown_domain_import", "duplicate_import"))
    if choice == "version":
        op = pick(rng, list(m.opset_import), "opset import")
        op.version = v = rng.choice((0, -1, 2 ** 31, 2 ** 31 - 1, I64_MAX, 1, 10 ** 6))
        params = f"opset {op.domain or 'ai.onnx'} = {v}"
    elif choice == "remove":
        del m.opset_import[:]
        params = "opset_import removed"
    elif choice == "unknown_domain_node":
        n = pick(rng, all_nodes(m), "node")
        n.domain = "com.fuzz.unknown"
        if rng.random() < 0.5:
            m.opset_import.append(helper.make_opsetid("com.fuzz.unknown", 1))
        params = f"{node_label(n)} domain com.fuzz.unknown"
    elif choice == "unknown_domain_import":
        m.opset_import.append(helper.make_opsetid(rng.choice(("com.fuzz", "", "ai.onnx.ml")),
                                                  rng.choice((1, 0, 2 ** 31))))
        params = f"extra import {m.opset_import[-1].domain!r} {m.opset_import[-1].version}"
    else:
        m.opset_import.append(helper.make_opsetid("", 1))
        params = "default domain imported twice (v1)"
    if rng.random() < 0.2:
        m.ir_version = rng.choice((0, 1, 2, 99, -1))
        params += f", ir_version {m.ir_version}"
    return _out(m, copy_feeds(seed.feeds), params)

# -- subgraphs ---------------------------------------------------------------------------------


@mutation("subgraph", 4)
def m_subgraph(rng, seed, variant):
    m = seed.proto()
    cands = [(n, i) for n in all_nodes(m) for i, a in enumerate(n.attribute)
             if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS)]
    n, i = pick(rng, cands, "node with a subgraph")
    a = n.attribute[i]
    choice = rng.choice(("remove", "remove", "empty", "drop_output", "extra_output",
                         "drop_input", "extra_input", "swap_type"))
    if choice == "remove":
        name = a.name
        del n.attribute[i]
        params = f"{node_label(n)}: removed {name}"
    elif choice == "empty" and a.type == AttributeProto.GRAPH:
        a.g.CopyFrom(onnx.GraphProto(name="empty"))
        params = f"{node_label(n)}.{a.name}: empty graph"
    elif choice == "drop_output" and a.type == AttributeProto.GRAPH and len(a.g.output):
        del a.g.output[rng.randrange(len(a.g.output))]
        params = f"{node_label(n)}.{a.name}: dropped an output"
    elif choice == "extra_output" and a.type == AttributeProto.GRAPH and len(a.g.output):
        a.g.output.append(a.g.output[0])
        params = f"{node_label(n)}.{a.name}: extra output"
    elif choice == "drop_input" and a.type == AttributeProto.GRAPH and len(a.g.input):
        del a.g.input[rng.randrange(len(a.g.input))]
        params = f"{node_label(n)}.{a.name}: dropped an input"
    elif choice == "extra_input" and a.type == AttributeProto.GRAPH:
        a.g.input.append(helper.make_tensor_value_info("fuzz_extra", TensorProto.FLOAT, [1]))
        params = f"{node_label(n)}.{a.name}: extra input"
    else:
        name = a.name
        del n.attribute[i]
        n.attribute.append(helper.make_attribute(name, 3))
        params = f"{node_label(n)}.{name}: INT instead of a graph"
    return _out(m, copy_feeds(seed.feeds), params)

# -- tensors: sparse and raw_data --------------------------------------------------------------


def _sparse_tensors(m):
    found = [("sparse_initializer", t) for g in iter_graphs(m.graph) for t in g.sparse_initializer]
    for n in all_nodes(m):
        for a in n.attribute:
            if a.type == AttributeProto.SPARSE_TENSOR:
                found.append((f"{node_label(n)}.{a.name}", a.sparse_tensor))
    return found


SPARSE_VARIANTS = ("index_out_of_range", "index_negative", "index_huge", "values_longer",
                   "values_shorter", "indices_2d_wrong", "dims_huge", "dims_negative",
                   "indices_int32", "indices_unsorted_dup", "dims_empty", "values_missing")


@mutation("sparse", 3, variants=SPARSE_VARIANTS)
def m_sparse(rng, seed, variant):
    if seed is None or not seed.name == "builtin:sparse":
        seed = load_seed("builtin:sparse")
    m = seed.proto()
    where, sp = pick(rng, _sparse_tensors(m), "sparse tensor")
    v = variant or rng.choice(SPARSE_VARIANTS)
    n = int(np.prod(sp.dims)) if len(sp.dims) else 0
    idx = numpy_helper.to_array(sp.indices).copy()
    vals = numpy_helper.to_array(sp.values).copy()
    if v == "index_out_of_range":
        idx[-1] = n
    elif v == "index_negative":
        idx[0] = -1
    elif v == "index_huge":
        idx[0] = 2 ** 62
    elif v == "values_longer":
        vals = np.concatenate([vals, vals])
    elif v == "values_shorter":
        vals = vals[:1]
    elif v == "indices_2d_wrong":
        idx = np.stack([idx, idx, idx], axis=1)  # 3 coordinates for a rank-2 (or 1) tensor
    elif v == "dims_huge":
        del sp.dims[:]
        sp.dims.extend([2 ** 20, 2 ** 20, 2 ** 10])
    elif v == "dims_negative":
        sp.dims[0] = -4
    elif v == "indices_int32":
        idx = idx.astype(np.int32)
    elif v == "indices_unsorted_dup":
        idx = idx[::-1].copy()
        idx[0] = idx[1]
    elif v == "dims_empty":
        del sp.dims[:]
    if v == "values_missing":
        sp.ClearField("values")
    else:
        sp.values.CopyFrom(numpy_helper.from_array(vals, sp.values.name))
    sp.indices.CopyFrom(numpy_helper.from_array(idx, sp.indices.name))
    return _out(m, copy_feeds(seed.feeds), f"{where}: {v}")


RAW_VARIANTS = ("cut_one", "cut_half", "empty", "append", "dims_plus_one", "dims_huge",
                "dims_negative", "dtype_double", "both_fields", "dtype_undefined", "dtype_999")


@mutation("raw_data", 4, variants=RAW_VARIANTS)
def m_raw_data(rng, seed, variant):
    m = seed.proto()
    feeds = copy_feeds(seed.feeds)
    cands = [(w, t) for w, t in tensors_of(m) if t.data_type != TensorProto.STRING]
    if cands and rng.random() < 0.7:
        where, t = rng.choice(cands)
    else:
        where, t = promote_feed(rng, m, feeds, "biufc")
    if not t.raw_data:
        try:
            set_tensor_array(t, numpy_helper.to_array(t))
        except Exception as exc:  # pragma: no cover - exotic types
            raise NotApplicable(str(exc))
    v = variant or rng.choice(RAW_VARIANTS)
    raw = t.raw_data
    if v == "cut_one":
        t.raw_data = raw[:-1]
    elif v == "cut_half":
        t.raw_data = raw[: len(raw) // 2]
    elif v == "empty":
        t.raw_data = b""
    elif v == "append":
        t.raw_data = raw + b"\x01\x02\x03"
    elif v == "dims_plus_one":
        if len(t.dims):
            t.dims[0] += 1
        else:
            t.dims.append(2)
    elif v == "dims_huge":
        del t.dims[:]
        t.dims.extend([2 ** 40])
    elif v == "dims_negative":
        t.dims.append(-3)
    elif v == "dtype_double":
        t.data_type = TensorProto.DOUBLE if t.data_type != TensorProto.DOUBLE else TensorProto.FLOAT
    elif v == "both_fields":
        t.float_data.extend([1.0, 2.0])
    elif v == "dtype_undefined":
        t.data_type = 0
    else:
        t.data_type = 999
    return _out(m, feeds, f"{where}: {v}")


OUTSIDE = "@OUTSIDE@"
EXTERNAL_VARIANTS = ("missing_file", "traversal", "absolute", "length_beyond", "offset_beyond",
                     "symlink_out", "hardlink_out", "bytes_no_dir", "bad_key", "dir_as_file")


@mutation("external_data", 2, variants=EXTERNAL_VARIANTS)
def m_external(rng, seed, variant):
    if seed is None or seed.name != "builtin:mlp":
        seed = load_seed("builtin:mlp")
    m = seed.proto()
    t = m.graph.initializer[0]  # W1, 4x8 float32: 128 bytes
    payload = t.raw_data
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    v = variant or rng.choice(EXTERNAL_VARIANTS)
    files, symlinks, hardlinks = {}, {}, {}
    entries = {"location": "w1.bin"}
    if v == "missing_file":
        entries["location"] = "nope.bin"
    elif v == "traversal":
        entries["location"] = "../outside/secret.bin"
    elif v == "absolute":
        entries["location"] = OUTSIDE + "/secret.bin"  # materialize() makes it absolute
    elif v == "length_beyond":
        files["w1.bin"] = payload
        entries["length"] = str(2 ** 40)
    elif v == "offset_beyond":
        files["w1.bin"] = payload
        entries["offset"] = str(2 ** 40)
    elif v == "symlink_out":
        symlinks["w1.bin"] = "../outside/secret.bin"
    elif v == "hardlink_out":
        hardlinks["w1.bin"] = "../outside/secret.bin"
    elif v == "bad_key":
        files["w1.bin"] = payload
        entries["offset"] = "-5"
        entries["__class__"] = "x"
    elif v == "dir_as_file":
        entries["location"] = "."
    for k, val in entries.items():
        e = t.external_data.add()
        e.key, e.value = k, val
    extra = dict(files=files, symlinks=symlinks, hardlinks=hardlinks,
                 must_fail=v in ("traversal", "absolute", "symlink_out", "hardlink_out"))
    return _out(m, copy_feeds(seed.feeds), v, as_file=(v != "bytes_no_dir"), **extra)

# -- functions and nesting ---------------------------------------------------------------------


FUNCTION_VARIANTS = ("self_call", "mutual", "nested_1000", "nested_100", "empty_body",
                     "undefined_in_body", "missing_function", "wrong_arity", "ref_attr_missing",
                     "duplicate_function")


@mutation("function", 3, needs_seed=False, variants=FUNCTION_VARIANTS)
def m_function(rng, seed, variant):
    base = load_seed("builtin:function")
    m = base.proto()
    feeds = copy_feeds(base.feeds)
    v = variant or rng.choice(FUNCTION_VARIANTS)
    f = m.functions[0]
    if v == "self_call":
        f.node.append(helper.make_node("AddMul", ["c", "c"], ["c2"], domain="fuzz.local"))
        f.output[0] = "c2"
        f.opset_import.append(helper.make_opsetid("fuzz.local", 1))
    elif v == "mutual":
        g = helper.make_function("fuzz.local", "MulAdd", ["a", "b"], ["c"],
                                 [helper.make_node("AddMul", ["a", "b"], ["c"], domain="fuzz.local")],
                                 opset_imports=[helper.make_opsetid("fuzz.local", 1)])
        f.node[1].op_type, f.node[1].domain = "MulAdd", "fuzz.local"
        f.opset_import.append(helper.make_opsetid("fuzz.local", 1))
        m.functions.append(g)
    elif v.startswith("nested_"):
        depth = int(v.split("_")[1])
        del m.functions[:]
        for i in range(depth):
            body = [helper.make_node("Add", ["a", "b"], ["c"])] if i == depth - 1 else \
                [helper.make_node(f"F{i + 1}", ["a", "b"], ["c"], domain="fuzz.local")]
            m.functions.append(helper.make_function(
                "fuzz.local", f"F{i}", ["a", "b"], ["c"], body,
                opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("fuzz.local", 1)]))
        m.graph.node[0].op_type = "F0"
    elif v == "empty_body":
        del f.node[:]
    elif v == "undefined_in_body":
        f.node[1].input[0] = "fuzz_undefined"
    elif v == "missing_function":
        del m.functions[:]
    elif v == "wrong_arity":
        m.graph.node[0].input.append("x")
    elif v == "ref_attr_missing":
        a = AttributeProto(name="alpha", type=AttributeProto.FLOAT, ref_attr_name="alpha_missing")
        f.node.append(helper.make_node("LeakyRelu", ["c"], ["c2"]))
        f.node[-1].attribute.append(a)
        f.output[0] = "c2"
    else:  # duplicate_function: two definitions of the same (domain, name)
        dup = onnx.FunctionProto()
        dup.CopyFrom(f)
        del dup.node[1:]
        dup.node[0].output[0] = "c"
        m.functions.append(dup)
    return _out(m, feeds, v)


def _nested_if(depth: int) -> tuple[onnx.ModelProto, dict]:
    """If nested `depth` deep, built top-down (protobuf's Python copies stop at ~30 levels)."""
    m = onnx.ModelProto(ir_version=8)
    m.opset_import.add(domain="", version=17)
    g = m.graph
    g.name = "g0"
    g.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    g.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]))
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g.output.append(out)
    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "leaf", [], [out])
    for i in range(depth):
        n = g.node.add()
        n.op_type = "If"
        n.input.append("c")
        n.output.append("y")
        a = n.attribute.add()
        a.name, a.type = "else_branch", AttributeProto.GRAPH
        a.g.CopyFrom(leaf)
        a = n.attribute.add()
        a.name, a.type = "then_branch", AttributeProto.GRAPH
        g = a.g
        g.name = f"g{i + 1}"
        g.output.append(out)
    g.node.append(helper.make_node("Identity", ["x"], ["y"]))
    return m, {"c": np.array(True), "x": np.ones(1, dtype=np.float32)}


NESTING_VARIANTS = ("if_1000_proto", "if_300_proto", "if_50_file", "if_50_bytes", "if_20_bytes",
                    "if_5000_proto")


@mutation("deep_nesting", 1.5, needs_seed=False, variants=NESTING_VARIANTS)
def m_nesting(rng, seed, variant):
    v = variant or rng.choice(NESTING_VARIANTS)
    depth = int(v.split("_")[1])
    m, feeds = _nested_if(depth)
    if v.endswith("_proto"):
        return _out(m, feeds, v)
    data = m.SerializeToString()
    return _out(data, feeds, v, as_file=v.endswith("_file"))

# -- invalid UTF-8 -----------------------------------------------------------------------------

MARKER = "FUZZMARKERFUZZMARKER"
BAD_UTF8 = (b"\xff\xfe" + b"\xc3\x28" + b"\xa0\xa1" + b"\xe2\x28\xa1" + b"\xf0\x28\x8c\xbc"
            + b"\xed\xa0\x80" + b"\x80")[:len(MARKER)].ljust(len(MARKER), b"\xff")


def _rename_value(m: onnx.ModelProto, old: str, new: str) -> None:
    for g in iter_graphs(m.graph):
        for coll in (g.input, g.output, g.value_info):
            for v in coll:
                if v.name == old:
                    v.name = new
        for t in g.initializer:
            if t.name == old:
                t.name = new
    for n in all_nodes(m):
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new
        for i, x in enumerate(n.output):
            if x == old:
                n.output[i] = new


@mutation("invalid_utf8", 3)
def m_utf8(rng, seed, variant):
    m = seed.proto()
    where = rng.choice(("value", "value", "node_name", "op_type", "attr_name", "attr_string",
                        "graph_name", "producer", "doc", "domain"))
    nodes = all_nodes(m)
    if where == "value":
        names = sorted({x for n in nodes for x in list(n.input) + list(n.output) if x})
        old = pick(rng, names, "value name")
        _rename_value(m, old, MARKER)
        params = f"value {old}"
    elif where == "node_name":
        n = pick(rng, nodes, "node")
        n.name = MARKER
        params = f"name of {n.op_type}"
    elif where == "op_type":
        n = pick(rng, nodes, "node")
        params = f"op_type {n.op_type}"
        n.op_type = MARKER
    elif where == "attr_name":
        n = pick(rng, _attr_nodes(m), "node with attributes")
        a = rng.choice(list(n.attribute))
        params = f"attribute {n.op_type}.{a.name}"
        a.name = MARKER
    elif where == "attr_string":
        cands = [(n, a) for n in nodes for a in n.attribute
                 if a.type in (AttributeProto.STRING, AttributeProto.STRINGS)]
        if not cands:
            n = pick(rng, nodes, "node")
            n.attribute.append(helper.make_attribute("fuzz_s", MARKER.encode()))
            params = f"new string attribute on {n.op_type}"
        else:
            n, a = rng.choice(cands)
            if a.type == AttributeProto.STRING:
                a.s = MARKER.encode()
            else:
                a.strings.append(MARKER.encode())
            params = f"string attribute {n.op_type}.{a.name}"
    elif where == "graph_name":
        m.graph.name = MARKER
        params = "graph name"
    elif where == "producer":
        m.producer_name = MARKER
        params = "producer_name"
    elif where == "doc":
        m.graph.doc_string = MARKER
        params = "doc_string"
    else:
        n = pick(rng, nodes, "node")
        n.domain = MARKER
        m.opset_import.append(helper.make_opsetid(MARKER, 1))
        params = f"domain of {n.op_type}"
    data = m.SerializeToString().replace(MARKER.encode(), BAD_UTF8)
    feeds = copy_feeds(seed.feeds)
    if where == "value" and old in feeds:  # the feed keeps its name: it cannot name the bytes
        pass
    return _out(data, feeds, params)

# -- targeted ops ------------------------------------------------------------------------------


def _split_nodes(m):
    return [n for n in all_nodes(m) if n.op_type == "Split"]


@mutation("split", 2)
def m_split(rng, seed, variant):
    m = seed.proto()
    n = pick(rng, _split_nodes(m), "Split")
    k = len(n.output)
    value = rng.choice((k + 1, k - 1, 0, -1, 2 ** 31, 2 ** 31 - 1, I64_MAX, 10 ** 6))
    replace_attr(n, helper.make_attribute("num_outputs", value))
    if rng.random() < 0.3 and len(n.input) == 1:
        n.input.append("fuzz_split_sizes")
        m.graph.initializer.append(_i64("fuzz_split_sizes", [1] * max(1, k)))
    return _out(m, copy_feeds(seed.feeds), f"{node_label(n)}: num_outputs {value} for {k} outputs")


def _pool_nodes(m):
    return [n for n in all_nodes(m) if n.op_type in ("AveragePool", "MaxPool", "LpPool", "Conv")]


@mutation("pool_sizes", 2)
def m_pool(rng, seed, variant):
    m = seed.proto()
    n = pick(rng, _pool_nodes(m), "pool node")
    attr = rng.choice(("kernel_shape", "kernel_shape", "strides", "pads", "dilations", "rank"))
    value = rng.choice((2 ** 40, 2 ** 31, 0, -1, 2 ** 20))
    rank = 2
    ks = next((list(a.ints) for a in n.attribute if a.name == "kernel_shape"), None)
    if ks:
        rank = len(ks)
    if attr == "rank":
        replace_attr(n, helper.make_attribute("kernel_shape", [3] * (rank + 3)))
        params = f"{node_label(n)}.kernel_shape rank {rank + 3}"
    else:
        count = 2 * rank if attr == "pads" else rank
        vals = [1] * count
        vals[rng.randrange(count)] = value
        replace_attr(n, helper.make_attribute(attr, vals))
        params = f"{node_label(n)}.{attr} = {vals}"
    return _out(m, copy_feeds(seed.feeds), params)


REGEX_VARIANTS = ("redos_24", "redos_28", "redos_32", "invalid_paren", "backref",
                  "huge_repeat", "lookbehind", "empty_input")


@mutation("regex", 1.5, needs_seed=False, variants=REGEX_VARIANTS)
def m_regex(rng, seed, variant):
    v = variant or rng.choice(REGEX_VARIANTS)
    pattern = {"invalid_paren": "(", "backref": r"(a)\1", "huge_repeat": "a{1000000000}",
               "lookbehind": "(?<=a)b"}.get(v, "(a+)+$")
    if v.startswith("redos_"):
        text = ["a" * int(v.split("_")[1]) + "!"]
    elif v == "empty_input":
        text = []
    else:
        text = ["aab", "b"]
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern)
    g = helper.make_graph([node], "regex", [helper.make_tensor_value_info("x", TensorProto.STRING, [None])],
                          [helper.make_tensor_value_info("y", TensorProto.BOOL, [None])])
    m = _model(g, _opsets(default=20), ir_version=9)
    return _out(m, {"x": np.array(text, dtype=object)}, f"{v}: {pattern!r}")


CHAIN_VARIANTS = ("identity_10000", "identity_20000", "identity_30000")


@mutation("long_chain", 0.2, needs_seed=False, variants=CHAIN_VARIANTS)
def m_chain(rng, seed, variant):
    v = variant or rng.choice(CHAIN_VARIANTS)
    n = int(v.split("_")[1])
    nodes = [helper.make_node("Identity", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < n - 1 else "y"])
             for i in range(n)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return _out(_model(g), {"x": np.arange(4, dtype=np.float32)}, f"{n} Identity nodes")


LOOP_VARIANTS = ("scan_output_1e12", "doubling_state", "scan_output_int64_max", "negative_trip")


@mutation("loop_trip", 1, needs_seed=False, variants=LOOP_VARIANTS)
def m_loop(rng, seed, variant):
    v = variant or rng.choice(LOOP_VARIANTS)
    Y = helper.make_tensor_value_info
    F, I, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    trip = {"scan_output_1e12": 10 ** 12, "doubling_state": 10 ** 12,
            "scan_output_int64_max": I64_MAX, "negative_trip": -5}[v]
    if v == "doubling_state":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Concat", ["s_in", "s_in"], ["s_out"], axis=0)],
            "body", [Y("i", I, []), Y("cond_in", B, []), Y("s_in", F, [None])],
            [Y("cond_out", B, []), Y("s_out", F, [None])])
        loop = helper.make_node("Loop", ["M", "cond", "x"], ["y"], body=body)
        outputs = [Y("y", F, None)]
    else:
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Identity", ["s_in"], ["s_out"]),
             helper.make_node("Identity", ["s_in"], ["scan"])],
            "body", [Y("i", I, []), Y("cond_in", B, []), Y("s_in", F, [None])],
            [Y("cond_out", B, []), Y("s_out", F, [None]), Y("scan", F, [None])])
        loop = helper.make_node("Loop", ["M", "cond", "x"], ["y", "ys"], body=body)
        outputs = [Y("y", F, None), Y("ys", F, None)]
    # 1 MiB a slice: a scan output passes any sane tensor cap within a few thousand iterations
    g = helper.make_graph([loop], "loop", [Y("x", F, [1 << 18])], outputs,
                          [_i64("M", trip), numpy_helper.from_array(np.array(True), "cond")])
    return _out(_model(g), {"x": np.ones(1 << 18, dtype=np.float32)}, f"{v}: M={trip}")


ISSUE13_VARIANTS = ("split_3_of_4", "regex_undefined", "layernorm_axis_max", "if_reads_own_output",
                    "split_2p31", "avgpool_2p40", "int64_overflow_feed", "output_is_input")


@mutation("issue13", 1.5, needs_seed=False, variants=ISSUE13_VARIANTS)
def m_issue13(rng, seed, variant):
    """The defects issue 13 names, each built exactly."""
    v = variant or rng.choice(ISSUE13_VARIANTS)
    Y = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    feeds: dict[str, Any] = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    if v in ("split_3_of_4", "split_2p31"):
        outs = ["a", "b", "c", "d"] if v == "split_3_of_4" else ["a", "b"]
        node = helper.make_node("Split", ["x"], outs, axis=1,
                                num_outputs=3 if v == "split_3_of_4" else 2 ** 31)
        g = helper.make_graph([node], "split", [Y("x", F, [3, 4])], [Y(o, F, None) for o in outs])
        m = _model(g, _opsets(default=18))
    elif v == "regex_undefined":
        node = helper.make_node("RegexFullMatch", ["nowhere"], ["y"], pattern="a+")
        g = helper.make_graph([node], "regex", [Y("x", TensorProto.STRING, [2])],
                              [Y("y", TensorProto.BOOL, [2])])
        m = _model(g, _opsets(default=20), ir_version=9)
        feeds = {"x": np.array(["a", "b"], dtype=object)}
    elif v == "layernorm_axis_max":
        node = helper.make_node("LayerNormalization", ["x", "s"], ["y"], axis=I64_MAX)
        g = helper.make_graph([node], "ln", [Y("x", F, [3, 4])], [Y("y", F, [3, 4])],
                              [_f32("s", np.ones(4))])
        m = _model(g)
    elif v == "if_reads_own_output":
        out = Y("y", F, [3, 4])
        then = helper.make_graph([helper.make_node("Identity", ["y"], ["t"])], "then", [], [Y("t", F, [3, 4])])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [Y("e", F, [3, 4])])
        node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
        g = helper.make_graph([node], "if", [Y("c", TensorProto.BOOL, []), Y("x", F, [3, 4])], [out])
        m = _model(g)
        feeds["c"] = np.array(True)
    elif v == "avgpool_2p40":
        node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2 ** 40, 1])
        g = helper.make_graph([node], "pool", [Y("x", F, [1, 1, 3, 4])], [Y("y", F, None)])
        m = _model(g)
        feeds = {"x": np.ones((1, 1, 3, 4), dtype=np.float32)}
    elif v == "int64_overflow_feed":
        node = helper.make_node("Identity", ["i"], ["y"])
        g = helper.make_graph([node], "id", [Y("i", TensorProto.INT64, [2])], [Y("y", TensorProto.INT64, [2])])
        m = _model(g)
        feeds = {"i": [1, 2 ** 70]}
    else:  # output_is_input: a graph output that is also the graph input
        g = helper.make_graph([], "passthrough", [Y("x", F, [3, 4])], [Y("x", F, [3, 4])])
        m = _model(g)
    return _out(m, feeds, v)

_PRODUCTS = ("matmul", "gemm", "conv")
ISSUE43_VARIANTS = (
    "constantofshape_string_shape", "constantofshape_string_constant", "tile_string_repeats",
    *(f"{op}_{route}" for op in _PRODUCTS for route in ("sequence", "if_sequence", "string_at")),
    "stringnormalizer_numbers", "stringnormalizer_int_input", "stringnormalizer_int_at",
    "string_feed_of_numbers", "sequence_feed_scalar")


@mutation("issue43", 1, needs_seed=False, variants=ISSUE43_VARIANTS)
def m_issue43(rng, seed, variant):
    """Values of the wrong kind where kernels took them on trust (issue 43): a string shape,
    a sequence or strings into a product, numbers into StringNormalizer, odd feeds of strings
    and sequences. Some the loader can see (a declared input, an initialiser, what an
    Identity or a Cast makes), others only show at run time (an If's output, a SequenceAt's
    element). Each must end as an ember error naming the fault."""
    v = variant or rng.choice(ISSUE43_VARIANTS)
    Y, F, S = helper.make_tensor_value_info, TensorProto.FLOAT, TensorProto.STRING
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    if v.startswith("constantofshape") or v == "tile_string_repeats":
        shape = helper.make_tensor("s", S, [2], [b"2", b"x"])
        if v == "constantofshape_string_constant":
            first, inits = [helper.make_node("Constant", [], ["s"], value=shape)], []
        else:
            first, inits = [], [shape]
        op = helper.make_node("Tile", ["x", "s"], ["c"]) if v == "tile_string_repeats" else \
            helper.make_node("ConstantOfShape", ["s"], ["c"])
        nodes = first + [op, helper.make_node("Identity", ["c"], ["y"])]  # folded: not an output
        return _out(_ops_model(nodes, [Y("x", F, None)], [Y("y", F, None)], inits), {"x": x}, v)
    if v.split("_")[0] in _PRODUCTS:
        op, route = v.split("_", 1)
        nodes = _wrong_kind(route, "q") + [
            helper.make_node({"matmul": "MatMul", "gemm": "Gemm", "conv": "Conv"}[op],
                             ["q", "x"], ["y"])]
        x = x if op == "conv" else x.reshape(2, 2)
        model = _ops_model(nodes, [Y("x", F, None), Y("c", TensorProto.BOOL, [])],
                           [Y("y", F, None)], [_i64("i", 0)])
        return _out(model, {"x": x, "c": np.array(True)}, v)
    if v.startswith("stringnormalizer"):
        norm = helper.make_node("StringNormalizer", ["t"], ["y"], case_change_action="LOWER")
        if v == "stringnormalizer_int_input":
            model = _ops_model([norm], [Y("t", TensorProto.INT64, [3])], [Y("y", S, None)])
            return _out(model, {"t": np.ones(3, np.int64)}, v)
        made = [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.INT64)]
        if v == "stringnormalizer_int_at":  # the element of a sequence: known at run time
            made = [helper.make_node("Cast", ["x"], ["n"], to=TensorProto.INT64),
                    helper.make_node("SequenceConstruct", ["n"], ["s"]),
                    helper.make_node("SequenceAt", ["s", "i"], ["t"])]
        model = _ops_model(made + [norm], [Y("x", F, [3])], [Y("y", S, None)], [_i64("i", 0)])
        return _out(model, {"x": np.ones(3, np.float32)}, v)
    if v == "string_feed_of_numbers":
        model = _ops_model([helper.make_node("StringNormalizer", ["t"], ["y"])],
                           [Y("t", S, [2])], [Y("y", S, None)])
        return _out(model, {"t": np.array(["a", 1], dtype=object)}, v)
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, None))
    model = _ops_model([helper.make_node("SequenceInsert", ["s", "x"], ["y"])],
                       [helper.make_value_info("s", seq), Y("x", F, None)],
                       [helper.make_value_info("y", seq)])
    return _out(model, {"s": np.float32(1.0), "x": x}, v)


def _wrong_kind(route: str, out: str) -> list:
    """Nodes making `out` from x (float) and c (bool): a sequence through an Identity (its
    kind known at load), a sequence from an If (known only at run time), or a string tensor
    taken from a sequence (known only at run time)."""
    if route == "sequence":
        return [helper.make_node("SequenceConstruct", ["x"], ["s"]),
                helper.make_node("Identity", ["s"], [out])]
    if route == "if_sequence":
        seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT,
                                                                            None))
        branch = helper.make_graph([helper.make_node("SequenceConstruct", ["x"], ["b"])],
                                   "branch", [], [helper.make_value_info("b", seq)])
        return [helper.make_node("If", ["c"], [out], then_branch=branch, else_branch=branch)]
    return [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.STRING),
            helper.make_node("SequenceConstruct", ["t"], ["s"]),
            helper.make_node("SequenceAt", ["s", "i"], [out])]

# -- feeds -------------------------------------------------------------------------------------


def _feed_names(seed, arrays_only=True):
    return [k for k, v in seed.feeds.items() if not arrays_only or isinstance(v, np.ndarray)]


@mutation("feed_int_overflow", 1.5)
def m_feed_overflow(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    name = pick(rng, _feed_names(seed), "array feed")
    big = rng.choice((2 ** 64, 2 ** 70, -(2 ** 70), 2 ** 1100))
    arr = feeds[name]
    feeds[name] = rng.choice((big, [big], [big] * max(1, arr.shape[0] if arr.ndim else 1),
                              np.array([big], dtype=object)))
    return _out(seed.data, feeds, f"feed {name} = {type(feeds[name]).__name__} holding "
                                  f"{'-' if big < 0 else ''}2**{abs(big).bit_length() - 1}")


DTYPES = ("float64", "float16", "int8", "int64", "uint64", "bool", "object", "complex64", "U3",
          "datetime64[s]", "V4")


@mutation("feed_wrong_dtype", 2)
def m_feed_dtype(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    name = pick(rng, _feed_names(seed), "array feed")
    arr = feeds[name]
    dt = rng.choice([d for d in DTYPES if np.dtype(d) != arr.dtype])
    try:
        feeds[name] = arr.astype(dt)
    except (TypeError, ValueError):
        feeds[name] = np.zeros(arr.shape, dtype=dt)
    return _out(seed.data, feeds, f"feed {name} {arr.dtype} -> {dt}")


@mutation("feed_wrong_shape", 2)
def m_feed_shape(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    name = pick(rng, _feed_names(seed), "array feed")
    arr = feeds[name]
    choice = rng.choice(("add_dim", "drop_dim", "scalar", "resize", "zero", "transpose"))
    if choice == "add_dim":
        new = arr[None]
    elif choice == "drop_dim" and arr.ndim:
        new = arr.reshape(arr.shape[1:]) if arr.shape[0] == 1 else arr[0]
    elif choice == "scalar":
        new = np.array(arr.reshape(-1)[0] if arr.size else 0, dtype=arr.dtype)
    elif choice == "resize" and arr.ndim:
        shape = list(arr.shape)
        shape[rng.randrange(len(shape))] += rng.choice((1, 7))
        new = np.zeros(shape, dtype=arr.dtype)
    elif choice == "zero" and arr.ndim:
        shape = list(arr.shape)
        shape[rng.randrange(len(shape))] = 0
        new = np.zeros(shape, dtype=arr.dtype)
    else:
        new = arr.T
    feeds[name] = new
    return _out(seed.data, feeds, f"feed {name} {arr.shape} -> {np.shape(new)} ({choice})")


@mutation("feed_missing_extra", 2)
def m_feed_names(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    choice = rng.choice(("missing", "extra", "empty", "not_a_dict", "renamed"))
    if choice == "missing":
        name = pick(rng, list(feeds), "feed")
        del feeds[name]
        params = f"feed {name} missing"
    elif choice == "extra":
        feeds["fuzz_extra"] = np.zeros(2, dtype=np.float32)
        params = "extra feed fuzz_extra"
    elif choice == "empty":
        feeds = {}
        params = "no feeds"
    elif choice == "not_a_dict":
        feeds = rng.choice((list(feeds.values()), None, "x", 3))
        params = f"feeds is a {type(feeds).__name__}"
    else:
        name = pick(rng, list(feeds), "feed")
        feeds[rng.choice((name.upper() + "_", name + " ", ""))] = feeds.pop(name)
        params = f"feed {name} renamed"
    return _out(seed.data, feeds, params)


@mutation("feed_weird", 2)
def m_feed_weird(rng, seed, variant):
    feeds = copy_feeds(seed.feeds)
    name = pick(rng, list(feeds), "feed")
    arr = feeds[name]
    choice = rng.choice(("none", "str", "dict", "ragged", "obj_of_arrays", "np_scalar", "fortran",
                         "strided", "readonly", "nan", "inf", "bytes", "structured", "matrix"))
    shape = arr.shape if isinstance(arr, np.ndarray) else ()
    dtype = arr.dtype if isinstance(arr, np.ndarray) else np.float32
    if choice == "none":
        new = None
    elif choice == "str":
        new = "not an array"
    elif choice == "dict":
        new = {"a": 1}
    elif choice == "ragged":
        new = [[1, 2], [3]]
    elif choice == "obj_of_arrays":
        new = np.empty(2, dtype=object)
        new[0], new[1] = np.zeros(2), np.zeros(3)
    elif choice == "np_scalar":
        new = np.float32(1.0)
    elif choice == "fortran" and isinstance(arr, np.ndarray):
        new = np.asfortranarray(arr)
    elif choice == "strided" and isinstance(arr, np.ndarray) and arr.ndim:
        big = np.zeros((arr.shape[0] * 2,) + arr.shape[1:], dtype=arr.dtype)
        big[::2] = arr
        new = big[::2]
    elif choice == "readonly" and isinstance(arr, np.ndarray):
        new = arr.copy()
        new.flags.writeable = False
    elif choice in ("nan", "inf") and isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
        new = np.full(shape, np.nan if choice == "nan" else np.inf, dtype=dtype)
    elif choice == "bytes":
        new = b"\x00\x01\x02"
    elif choice == "structured":
        new = np.zeros(shape, dtype=[("a", "f4"), ("b", "i4")])
    else:
        new = np.asmatrix(np.zeros((1, 1))) if not shape or len(shape) == 2 else np.ma.zeros(shape)
    feeds[name] = new
    return _out(seed.data, feeds, f"feed {name}: {choice}")

# --------------------------------------------------------------------------------------------
# cases


def pinned_cases() -> list[tuple[str, str | None]]:
    """What the first ids of every campaign run: each mutation kind once, then each named
    variant of each kind once."""
    pins: list[tuple[str, str | None]] = [(name, None) for name in MUTATIONS]
    for name, mut in MUTATIONS.items():
        pins.extend((name, v) for v in mut.variants)
    return pins


def _applicable_seeds(kind: str) -> list[str] | None:
    names = seed_names()
    if kind == "split":
        return [n for n in names if "split" in n and "to_sequence" not in n] or None
    if kind == "pool_sizes":
        return [n for n in names if "pool" in n or "conv" in n or n in ("demo:cnn",)]
    if kind == "subgraph":
        return [n for n in names if any(k in n for k in ("if", "loop", "scan", "sequence_map",
                                                         "range_float_type_positive_delta_expanded"))]
    if kind == "sparse":
        return ["builtin:sparse"]
    if kind == "external_data":
        return ["builtin:mlp"]
    return None


def make_case(case_id: int, base_seed: int = 0) -> Mutant:
    """The mutant of `case_id`: deterministic for (case_id, base_seed)."""
    rng = random.Random(f"ember-fuzz:{base_seed}:{case_id}")
    pins = pinned_cases()
    names = list(MUTATIONS)
    variant = None
    if case_id < len(pins):
        kind, variant = pins[case_id]
    else:
        kind = rng.choices(names, weights=[MUTATIONS[n].weight for n in names])[0]
    mut = MUTATIONS[kind]
    seeds = _applicable_seeds(kind) or seed_names()
    last: Exception | None = None
    for _attempt in range(25):
        seed = load_seed(rng.choice(seeds)) if mut.needs_seed else None
        try:
            out = mut.fn(rng, seed, variant)
        except NotApplicable as exc:
            last = exc
            continue
        seed_name = seed.name if seed is not None else f"built:{kind}"
        return Mutant(case_id, seed_name, kind, out.pop("params"), out.pop("model"),
                      out.pop("feeds"), **out)
    # nothing applicable in 25 draws: a bit flip of the last seed drawn, labelled as such
    seed = load_seed(rng.choice(seed_names()))
    out = m_bitflip(rng, seed, None)
    return Mutant(case_id, seed.name, "bitflip", f"(fallback from {kind}: {last}) " + out["params"],
                  out["model"], out["feeds"])


def materialize(mutant: Mutant, workdir: str) -> Any:
    """What ember.load gets: bytes, a ModelProto, or the path of a model written to disk
    (with its side files) under `workdir`."""
    if not mutant.as_file:
        return mutant.model
    case_dir = os.path.join(workdir, f"case{mutant.case_id}")
    model_dir = os.path.join(case_dir, "model")
    outside = os.path.join(case_dir, "outside")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, "secret.bin"), "wb") as f:
        f.write(b"\x00" * 128)  # the same size as the tensor it replaces: readable if followed
    for name, data in mutant.files.items():
        with open(os.path.join(model_dir, name), "wb") as f:
            f.write(data)
    for name, target in mutant.symlinks.items():
        os.symlink(target, os.path.join(model_dir, name))
    for name, source in mutant.hardlinks.items():
        os.link(os.path.normpath(os.path.join(model_dir, source)), os.path.join(model_dir, name))
    data = mutant.model_bytes()
    if OUTSIDE.encode() in data:  # an absolute external-data location: this case's outside/
        m = onnx.ModelProto()
        m.ParseFromString(data)
        for g in iter_graphs(m.graph):
            for t in g.initializer:
                for e in t.external_data:
                    e.value = e.value.replace(OUTSIDE, outside)
        data = m.SerializeToString()
    path = os.path.join(model_dir, "model.onnx")
    with open(path, "wb") as f:
        f.write(data)
    return path

# --------------------------------------------------------------------------------------------
# running one case (in the worker process)


def short_path(path: str) -> str:
    path = os.path.abspath(path)
    if path.startswith(REPO + os.sep) and os.sep + ".venv" + os.sep not in path:
        return os.path.relpath(path, REPO)
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.basename(path)


def _is_ember_file(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(REPO + os.sep) and os.sep + ".venv" + os.sep not in path and \
        not path.startswith(TESTS + os.sep)


def _frames(tb) -> tuple[str, str]:
    import traceback

    frames = traceback.extract_tb(tb)
    last = f"{short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
    ember = next((f"{short_path(f.filename)}:{f.lineno}" for f in reversed(frames)
                  if _is_ember_file(f.filename)), "")
    return last, ember


# Negative case ids are the runner's self-tests: each misbehaves in one way, with no model
# involved, so a test can check that the runner classifies crashes, hangs and errors.
SELF_TESTS = {-1: "killed", -2: "hung", -3: "python_error", -4: "python_error",
              -5: "ember_error", -6: "ran", -7: "internal_error"}


def run_self_test(case_id: int) -> dict:
    info: dict[str, Any] = {"seed": "self-test", "mutation": SELF_TESTS.get(case_id, "?"),
                            "params": str(case_id)}
    try:
        if case_id == -1:
            import ctypes

            ctypes.string_at(0)  # SIGSEGV
        elif case_id == -2:
            time.sleep(3600)
        elif case_id == -3:
            raise ValueError("self-test")
        elif case_id == -4:
            bytearray(64 << 30)  # past any address-space cap the runner sets: MemoryError
        elif case_id == -5:
            from ember.errors import InvalidModelError

            raise InvalidModelError("self-test")
        elif case_id == -7:
            _wrapped_internal_error()
        info["outcome"] = "ran"
    except BaseException as exc:  # noqa: BLE001
        from ember.errors import EmberError

        info["outcome"] = "ember_error" if isinstance(exc, EmberError) else "python_error"
        internal = internal_cause(exc) if info["outcome"] == "ember_error" else None
        if internal is not None:
            info["outcome"] = "internal_error"
            info["cause"] = type(internal).__name__
            info["cause_where"] = _frames(internal.__traceback__)[0]
        info["error"] = type(exc).__name__
        info["where"], info["ember_where"] = _frames(exc.__traceback__)
    return info


def _wrapped_internal_error() -> None:
    """An AttributeError raised inside ember's code (a node that is None), wrapped in an
    ExecutionError as the executor wraps a kernel's exception."""
    from ember.errors import ExecutionError
    from ember.runtime.executor import _describe

    try:
        _describe(None)
    except AttributeError as exc:
        raise ExecutionError("self-test") from exc


def run_mutant(mutant: Mutant, workdir: str) -> dict:
    """Load and run one mutant; classify. Never raises (but may crash or hang, by design)."""
    import ember
    from ember.errors import EmberError

    info: dict[str, Any] = mutant.describe()
    phase = "load"
    try:
        source = materialize(mutant, workdir)
        sess = ember.load(source, backend="cpu")
        phase = "run"
        sess.run(mutant.feeds)
        info["outcome"] = "unsafe_ran" if mutant.must_fail else "ran"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - classifying is the point
        info["phase"] = phase
        info["error"] = type(exc).__name__
        info["message"] = str(exc).replace("\n", " ")[:300]
        info["where"], info["ember_where"] = _frames(exc.__traceback__)
        if isinstance(exc, EmberError):
            info["outcome"] = "ember_error"
            cause = exc.__cause__ or exc.__context__
            if cause is not None and not isinstance(cause, EmberError):
                info["cause"] = type(cause).__name__
                info["cause_where"] = _frames(cause.__traceback__)[0]
            internal = internal_cause(exc)
            if internal is not None:
                info["outcome"] = "internal_error"
                info["cause"] = type(internal).__name__
                info["cause_where"] = _frames(internal.__traceback__)[0]
                info["message"] += f" <- {type(internal).__name__}: {internal}"[:200]
        else:
            info["outcome"] = "python_error"
    return info


def internal_cause(exc: BaseException) -> BaseException | None:
    """The first exception in `exc`'s cause chain that is one of INTERNAL_ERRORS raised by
    ember's own code (its innermost frame in an ember file), unless the ember error wrapping
    it is one of the deliberate TRANSLATIONS; None if there is none."""
    wrapper, seen = exc, set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if type(cause).__name__ in INTERNAL_ERRORS and _raised_by_ember(cause) \
                and _raise_site(wrapper) not in TRANSLATIONS:
            return cause
        wrapper, cause = cause, cause.__cause__ or cause.__context__
    return None


def _raised_by_ember(exc: BaseException) -> bool:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _is_ember_file(frames[-1].filename)


def _raise_site(exc: BaseException) -> tuple[str, str]:
    """(file, function) where `exc` was raised."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return (short_path(frames[-1].filename), frames[-1].name) if frames else ("?", "?")

# --------------------------------------------------------------------------------------------
# the runner: worker subprocesses with a memory cap and a per-case timeout


@dataclass
class CaseResult:
    case_id: int
    outcome: str
    seed: str = "?"
    mutation: str = "?"
    params: str = ""
    phase: str = ""
    error: str = ""
    message: str = ""
    where: str = ""
    ember_where: str = ""
    cause: str = ""
    cause_where: str = ""
    seconds: float = 0.0

    @property
    def signature(self) -> str:
        """What groups failures of one defect: the error type and where it was raised."""
        if self.outcome == "python_error":
            ew = f" (ember: {self.ember_where})" if self.ember_where and \
                self.ember_where != self.where else ""
            return f"{self.error} at {self.where}{ew}"
        if self.outcome == "unsafe_ran":
            return f"unsafe_ran {self.params}"
        if self.outcome in ("killed", "hung"):
            return f"{self.outcome} {self.error} at {self.ember_where or self.where or '?'}"
        if self.outcome in ("ember_error", "internal_error") and self.cause:
            return f"{self.error}<-{self.cause} at {self.cause_where}"
        return f"{self.outcome} {self.error}".strip()

    def row(self) -> str:
        detail = self.message
        where = self.where + (f" (ember: {self.ember_where})" if self.ember_where
                              and self.ember_where != self.where else "")
        return (f"{self.case_id:>6}  {self.seed[:40]:<40}  {self.mutation:<20}  {self.outcome:<12}  "
                f"{self.error} {where}: {detail[:120]}  [{self.params[:80]}]")


class _LineReader:
    def __init__(self, fd: int):
        self.fd, self.buf, self.eof = fd, b"", False

    def readline(self, deadline: float) -> str | None:
        """A line, '' at EOF, None past the deadline."""
        while b"\n" not in self.buf:
            if self.eof:
                line, self.buf = self.buf, b""
                return line.decode("utf-8", "replace")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.eof = True
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace") + "\n"


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(EMBER_NUMBA="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", NUMEXPR_NUM_THREADS="1", EMBER_RANDOM_SEED="0",
               PYTHONFAULTHANDLER="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("EMBER_BACKEND", None)
    return env


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')


def _dump_frames(text: str) -> tuple[str, str]:
    """(innermost frame, innermost ember frame) of the last faulthandler dump in `text`."""
    start = max(text.rfind("Fatal Python error"), text.rfind("Current thread"),
                text.rfind("Thread 0x"))
    if start < 0:
        return "", ""
    frames = [(m.group(1), m.group(2)) for m in map(_FRAME.match, text[start:].splitlines()) if m]
    if not frames:
        return "", ""
    inner = f"{short_path(frames[0][0])}:{frames[0][1]}"
    ember = next((f"{short_path(f)}:{n}" for f, n in frames if _is_ember_file(f)), "")
    return inner, ember


def _stderr_note(text: str) -> str:
    """The last stderr line that is no part of a faulthandler dump (a C++ abort message...)."""
    for line in reversed(text.splitlines()):
        s = line.strip()
        if s and not s.startswith(("File ", "Current thread", "Thread 0x", "Fatal Python",
                                   "Extension modules", "<no Python frame>")) \
                and not s.startswith("Stack (most recent"):
            return s[:200]
    return ""


class _Worker:
    def __init__(self, base_seed: int, mem_bytes: int, workdir: str, startup_timeout: float):
        self.stderr = tempfile.TemporaryFile(dir=workdir)
        cmd = [sys.executable, WORKER, "--serve", "--base-seed", str(base_seed),
               "--mem", str(mem_bytes), "--workdir", workdir]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=worker_env(), cwd=workdir,
                                     start_new_session=True)
        self.reader = _LineReader(self.proc.stdout.fileno())
        deadline = time.monotonic() + startup_timeout
        while True:
            line = self.reader.readline(deadline)
            if line is None or line == "":
                tail = self.stderr_text(0)[-2000:]
                self.kill()
                raise RuntimeError(f"fuzz worker failed to start: {tail}")
            if line.startswith("READY"):
                return

    def stderr_text(self, offset: int) -> str:
        self.stderr.flush()
        size = os.fstat(self.stderr.fileno()).st_size
        return os.pread(self.stderr.fileno(), max(0, size - offset), offset).decode("utf-8", "replace")

    def stderr_size(self) -> int:
        return os.fstat(self.stderr.fileno()).st_size

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.stderr.close()

    def run(self, case_id: int, timeout_s: float) -> CaseResult:
        offset = self.stderr_size()
        t0 = time.monotonic()
        desc: dict[str, Any] = {}
        try:
            self.proc.stdin.write(f"{case_id}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died(case_id, desc, offset, t0)
        deadline = t0 + timeout_s
        while True:
            line = self.reader.readline(deadline)
            if line is None:
                return self._hung(case_id, desc, offset, t0, timeout_s)
            if line == "":
                return self._died(case_id, desc, offset, t0)
            head, _, rest = line.rstrip("\n").partition(" ")
            if head == "CASE":
                desc = json.loads(rest.partition(" ")[2])
            elif head == "RESULT":
                info = json.loads(rest.partition(" ")[2])
                return CaseResult(case_id, info.pop("outcome"), seconds=time.monotonic() - t0,
                                  **{k: str(v) for k, v in info.items()
                                     if k in CaseResult.__dataclass_fields__})

    def _died(self, case_id, desc, offset, t0) -> CaseResult:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        text = self.stderr_text(offset)
        inner, ember = _dump_frames(text)
        if code is not None and code < 0:
            try:
                what = signal.Signals(-code).name
            except ValueError:
                what = f"signal {-code}"
        else:
            what = f"exit {code}"
        self.kill()
        return CaseResult(case_id, "killed", error=what, where=inner, ember_where=ember,
                          message=_stderr_note(text), seconds=time.monotonic() - t0,
                          **{k: desc[k] for k in ("seed", "mutation", "params") if k in desc})

    def _hung(self, case_id, desc, offset, t0, timeout_s) -> CaseResult:
        try:  # faulthandler in the worker dumps every thread's stack on SIGUSR1
            self.proc.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 3
        text = ""
        while time.monotonic() < end:  # until the dump is there (it is written in one go)
            time.sleep(0.1)
            text = self.stderr_text(offset)
            if "Current thread" in text or "Thread 0x" in text:
                time.sleep(0.3)
                text = self.stderr_text(offset)
                break
        inner, ember = _dump_frames(text)
        self.kill()
        return CaseResult(case_id, "hung", error=f"> {timeout_s:g} s", where=inner,
                          ember_where=ember, seconds=time.monotonic() - t0,
                          **{k: desc[k] for k in ("seed", "mutation", "params") if k in desc})


def run_cases(case_ids: Iterable[int], timeout_s: float = 20.0, mem_bytes: int = 3 << 30,
              workers: int = 2, base_seed: int = 0, startup_timeout: float = 120.0,
              progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Run cases in `workers` subprocesses, each capped at `mem_bytes` of address space; a case
    past `timeout_s` is `hung`, a worker that dies takes its case as `killed`. A new worker
    takes over the remaining cases. Results come back in case-id order."""
    pending = collections.deque(case_ids)
    results: dict[int, CaseResult] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    workdir = tempfile.mkdtemp(prefix="ember-fuzz-")

    def slot():
        worker = None
        failures = 0
        try:
            while True:
                with lock:
                    if not pending or errors:
                        return
                    case_id = pending.popleft()
                if worker is None:
                    try:
                        worker = _Worker(base_seed, mem_bytes, workdir, startup_timeout)
                        failures = 0
                    except RuntimeError:
                        failures += 1
                        with lock:
                            pending.appendleft(case_id)
                        if failures >= 3:
                            raise
                        continue
                result = worker.run(case_id, timeout_s)
                if result.outcome in ("killed", "hung"):
                    worker = None  # it was killed; the next case starts a fresh one
                with lock:
                    results[case_id] = result
                if progress is not None:
                    progress(result)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
        finally:
            if worker is not None:
                try:
                    worker.proc.stdin.close()
                    worker.proc.wait(timeout=10)
                except Exception:
                    pass
                worker.kill()

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        raise errors[0]
    return [results[k] for k in sorted(results)]

# --------------------------------------------------------------------------------------------
# summaries


def summarize(results: Sequence[CaseResult]) -> str:
    """Counts per outcome and per mutation kind, then each distinct failure signature with an
    example case."""
    lines = [f"{len(results)} cases"]
    counts = collections.Counter(r.outcome for r in results)
    lines.append("")
    lines.append(f"{'outcome':<14} {'cases':>7}")
    for o in OUTCOMES:
        lines.append(f"{o:<14} {counts.get(o, 0):>7}")
    lines.append("")
    per_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        per_kind[r.mutation][r.outcome] += 1
    short = OUTCOMES
    lines.append(f"{'mutation':<22}" + "".join(f"{o[:12]:>14}" for o in short))
    for kind in sorted(per_kind):
        lines.append(f"{kind:<22}" + "".join(f"{per_kind[kind].get(o, 0):>14}" for o in short))
    slow = sorted((r for r in results if r.outcome in ACCEPTED), key=lambda r: -r.seconds)[:10]
    if slow:
        lines.append("")
        lines.append("slowest accepted cases: " + ", ".join(
            f"{r.case_id} {r.mutation} {r.seconds:.1f}s" for r in slow))
        spent: dict[str, float] = collections.defaultdict(float)
        for r in results:
            spent[r.mutation] += r.seconds
        lines.append("worker seconds per mutation kind: " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:12]))
    bad = [r for r in results if r.outcome not in ACCEPTED]
    if bad:
        lines.append("")
        lines.append("distinct failure signatures (count, example case, mutation, detail):")
        groups: dict[str, list[CaseResult]] = collections.defaultdict(list)
        for r in bad:
            groups[r.signature].append(r)
        for sig, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            r = rs[0]
            lines.append(f"  {len(rs):>4}  {sig}")
            lines.append(f"        e.g. case {r.case_id}: {r.seed} / {r.mutation} [{r.params[:100]}]"
                         + (f": {r.message[:140]}" if r.message else ""))
    wrapped = [r for r in results if r.outcome == "ember_error" and r.cause]
    if wrapped:
        lines.append("")
        lines.append("ember errors wrapping a plain Python exception (accepted, listed for review):")
        groups = collections.defaultdict(list)
        for r in wrapped:
            groups[r.signature].append(r)
        for sig, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"  {len(rs):>4}  {sig}   e.g. case {rs[0].case_id} ({rs[0].mutation})")
    return "\n".join(lines)


def failure_table(results: Sequence[CaseResult], limit: int = 80) -> str:
    bad = [r for r in results if r.outcome not in ACCEPTED]
    rows = [f"{'case':>6}  {'seed':<40}  {'mutation':<20}  {'outcome':<12}  detail"]
    rows += [r.row() for r in bad[:limit]]
    if len(bad) > limit:
        rows.append(f"... and {len(bad) - limit} more")
    rows.append("reproduce one in-process with: python tests/fuzz_worker.py --case ID")
    return "\n".join(rows)
