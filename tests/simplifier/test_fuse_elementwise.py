"""fuse_elementwise: groups of elementwise nodes as one ai.ember::ElementwiseChain node, checked
against onnxruntime on the original graph and against ember's unfused graph; and the chain's
compiled loop against its portable kernel, on one thread and several."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.importer import import_model
from ember.ir import Node
from ember.ops.cpu import tuning
from ember.ops.elementwise_chain import OP_TYPE, layout
from ember.ops.registry import bind, lookup
from ember.simplifier import simplify

ort = pytest.importorskip("onnxruntime")
F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
RNG = np.random.default_rng(7)
DEFAULT_MIN = tuning.CHAIN_COMPILED_MIN


@pytest.fixture(autouse=True)
def compiled_at_any_size(monkeypatch):
    """The compiled loop for tensors of every size: these tests check it on small ones,
    which by default run numpy's operations (test_small_tensors_run_numpys_operations)."""
    monkeypatch.setattr(tuning, "CHAIN_COMPILED_MIN", 0)


@pytest.fixture(autouse=True)
def strict_simplifier(monkeypatch):
    monkeypatch.setenv("EMBER_SIMPLIFY_STRICT", "1")


def make_model(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def tensor(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def chains(graph):
    return [n for n in graph.nodes if n.op_type == OP_TYPE]


def check(proto, feeds, fused_ops=None, rtol=1e-6, exact=False, skip=()):
    """Run `proto` through ember (simplified, with `skip` left out) and compare with
    onnxruntime and with ember's graph without the fusion; returns the simplified graph."""
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    model = simplify(import_model(proto), skip=skip)
    got = list(ember.Session(model).run(feeds).values())
    unfused = simplify(import_model(proto), skip=tuple(skip) + ("fuse_elementwise",))
    assert not chains(unfused.graph)
    plain = list(ember.Session(unfused).run(feeds).values())
    for expected, actual, reference in zip(want, got, plain):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        if actual.dtype == bool:
            np.testing.assert_array_equal(actual, expected)
        else:
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol)
            if exact:  # no transcendental step: the unfused ops' very bits
                np.testing.assert_array_equal(actual.view(np.uint32), reference.view(np.uint32))
            else:
                np.testing.assert_allclose(actual, reference, rtol=rtol, atol=rtol)
    if fused_ops is not None:
        assert [n.attrs["ops"] for n in chains(model.graph)] == fused_ops
    return model.graph


def test_silu_is_one_node():
    x = RNG.standard_normal((2, 16, 9, 11)).astype(np.float32) * 4
    proto = make_model([helper.make_node("Sigmoid", ["x"], ["s"]),
                        helper.make_node("Mul", ["x", "s"], ["y"])],
                       [tensor("x", list(x.shape))], [tensor("y", list(x.shape))])
    graph = check(proto, {"x": x}, [["Sigmoid", "Mul"]])
    assert len(graph.nodes) == 1
    session = ember.load(proto)
    assert [k[2] for k in session.kernels] in (["cpu.compiled"], ["numpy"])


def test_hardswish_written_out_and_hardsigmoid_times_x():
    """PyTorch's HardSwish before opset 14 (x * clip(x + 3, 0, 6) / 6) and MobileNetV3's
    HardSigmoid(x) * x: the unfused ops' bits."""
    x = (RNG.standard_normal((1, 8, 13, 13)) * 5).astype(np.float32)
    x[0, 0, 0, :4] = [-3, 3, -0.0, np.nan]
    proto = make_model(
        [helper.make_node("Add", ["x", "three"], ["a"]),
         helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
         helper.make_node("Mul", ["x", "c"], ["m"]),
         helper.make_node("Div", ["m", "six"], ["h"]),
         helper.make_node("HardSigmoid", ["h"], ["g"], alpha=1 / 6, beta=0.5),
         helper.make_node("Mul", ["g", "h"], ["y"])],
        [tensor("x", list(x.shape))], [tensor("y", list(x.shape))],
        [const("three", np.float32(3)), const("zero", np.float32(0)),
         const("six", np.float32(6))])
    check(proto, {"x": x}, [["Add", "Clip", "Mul", "Div", "HardSigmoid", "Mul"]], exact=True)


@pytest.mark.parametrize("skip", [(), ("fuse_gelu",)])
def test_gelu_from_erf_after_a_bias(skip):
    """x * 0.5 * (1 + erf(x / sqrt 2)) after a bias over the last axis: written out (erf as
    the chain's step) or as the Gelu op fuse_gelu makes of it."""
    x = RNG.standard_normal((2, 7, 24)).astype(np.float32) * 3
    bias = RNG.standard_normal(24).astype(np.float32)
    proto = make_model(
        [helper.make_node("Add", ["x", "bias"], ["b"]),
         helper.make_node("Div", ["b", "sqrt2"], ["d"]),
         helper.make_node("Erf", ["d"], ["e"]),
         helper.make_node("Add", ["e", "one"], ["p"]),
         helper.make_node("Mul", ["b", "p"], ["m"]),
         helper.make_node("Mul", ["m", "half"], ["y"])],
        [tensor("x", list(x.shape))], [tensor("y", list(x.shape))],
        [const("bias", bias), const("sqrt2", np.float32(math.sqrt(2))),
         const("one", np.float32(1)), const("half", np.float32(0.5))])
    graph = check(proto, {"x": x}, skip=skip, rtol=2e-6)
    (node,) = chains(graph)
    assert node.attrs["ops"][0] == "Add" and ("Erf" in node.attrs["ops"]) == bool(skip)
    assert len(graph.nodes) == 1


def test_clip_and_casts():
    """A mask made by a comparison and a Cast to float, a Clip, and an integer input cast to
    float with an outer-product broadcast (RoPE's angles) and its sine."""
    x = RNG.standard_normal((3, 50)).astype(np.float32) * 4
    pos = np.arange(3, dtype=np.int64).reshape(3, 1) * 7
    freq = np.exp(-np.arange(50, dtype=np.float32) / 10).reshape(1, 50).astype(np.float32)
    proto = make_model(
        [helper.make_node("Greater", ["x", "zero"], ["g"]),
         helper.make_node("Cast", ["g"], ["gf"], to=F),
         helper.make_node("Mul", ["x", "gf"], ["m"]),
         helper.make_node("Clip", ["m", "zero", "six"], ["y"]),
         helper.make_node("Cast", ["pos"], ["pf"], to=F),
         helper.make_node("Mul", ["pf", "freq"], ["angle"]),
         helper.make_node("Sin", ["angle"], ["s"])],
        [tensor("x", [3, 50]), tensor("pos", [3, 1], I64)],
        [tensor("y", [3, 50]), tensor("s", [3, 50])],
        [const("zero", np.float32(0)), const("six", np.float32(6)), const("freq", freq)])
    graph = check(proto, {"x": x, "pos": pos}, rtol=2e-6)
    assert sorted(n.attrs["ops"] for n in chains(graph)) == [
        ["CastFloat", "Mul", "Sin"], ["Greater", "CastFloat", "Mul", "Clip"]]


def test_where_with_broadcasting_and_a_bool_output():
    """An attention mask (B, 1, 1, S) over scaled scores (B, H, S, S), and a second chain whose
    output is bool."""
    scores = RNG.standard_normal((2, 3, 5, 5)).astype(np.float32)
    mask = RNG.random((2, 1, 1, 5)) > 0.3
    proto = make_model(
        [helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
         helper.make_node("Where", ["mask", "scaled", "low"], ["w"]),
         helper.make_node("Add", ["w", "bias"], ["y"]),
         helper.make_node("Less", ["scores", "zero"], ["neg"]),
         helper.make_node("Not", ["neg"], ["pos"]),
         helper.make_node("And", ["pos", "mask"], ["both"])],
        [tensor("scores", [2, 3, 5, 5]), tensor("mask", [2, 1, 1, 5], B)],
        [tensor("y", [2, 3, 5, 5]), tensor("both", [2, 3, 5, 5], B)],
        [const("scale", np.float32(0.125)), const("low", np.float32(-1e4)),
         const("bias", RNG.standard_normal((5, 5)).astype(np.float32)),
         const("zero", np.float32(0))])
    graph = check(proto, {"scores": scores, "mask": mask}, exact=True)
    assert sorted(n.attrs["ops"] for n in chains(graph)) == [
        ["Less", "Not", "And"], ["Mul", "Where", "Add"]]


def test_rotary_embedding_arithmetic():
    """x * cos + rotate_half(x) * sin, cos and sin over (1, 1, S, D): the products and the sum
    are one chain (the rotation's Slice / Neg / Concat stay as they are)."""
    b, h, s, d = 2, 3, 5, 8
    x = RNG.standard_normal((b, h, s, d)).astype(np.float32)
    angle = np.arange(s)[:, None] * np.exp(-np.arange(d) / d)[None, :]
    nodes = [
        helper.make_node("Slice", ["x", "start0", "half", "axis"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "axis"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"])]
    inits = [const("start0", np.array([0], np.int64)), const("half", np.array([d // 2])),
             const("end", np.array([d])), const("axis", np.array([-1])),
             const("cos", np.cos(angle).astype(np.float32).reshape(1, 1, s, d)),
             const("sin", np.sin(angle).astype(np.float32).reshape(1, 1, s, d))]
    proto = make_model(nodes, [tensor("x", [b, h, s, d])], [tensor("y", [b, h, s, d])], inits)
    check(proto, {"x": x}, [["Mul", "Mul", "Add"]], exact=True)


def test_an_intermediate_that_is_a_graph_output_is_not_fused():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    proto = make_model([helper.make_node("Sigmoid", ["x"], ["s"]),
                        helper.make_node("Mul", ["x", "s"], ["y"])],
                       [tensor("x", [4, 6])], [tensor("y", [4, 6]), tensor("s", [4, 6])])
    graph = check(proto, {"x": x}, [])
    assert sorted(n.op_type for n in graph.nodes) == ["Mul", "Sigmoid"]


def test_a_value_read_outside_stays_out_of_the_group():
    """t = x + 1 is read by the chain and by a Transpose: the chain starts after it."""
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    proto = make_model([helper.make_node("Add", ["x", "one"], ["t"]),
                        helper.make_node("Relu", ["t"], ["r"]),
                        helper.make_node("Neg", ["r"], ["y"]),
                        helper.make_node("Transpose", ["t"], ["z"])],
                       [tensor("x", [4, 6])], [tensor("y", [4, 6]), tensor("z", [6, 4])],
                       [const("one", np.float32(1))])
    graph = check(proto, {"x": x}, [["Relu", "Neg"]], exact=True)
    assert sorted(n.op_type for n in graph.nodes) == ["Add", OP_TYPE, "Transpose"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unfused Mul's inf * 0
def test_mixed_broadcasts_and_special_values():
    """Per-channel, trailing, middle and scalar inputs in one chain, with a value read by two
    of its steps (a SiLU of a biased input); inf, NaN and -0.0 among the inputs."""
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32) * 3
    x.reshape(-1)[:5] = [np.inf, -np.inf, np.nan, -0.0, 0.0]
    proto = make_model(
        [helper.make_node("Add", ["x", "channel"], ["a"]),
         helper.make_node("Mul", ["a", "last"], ["b"]),
         helper.make_node("Sub", ["b", "middle"], ["c"]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("Max", ["r", "scalar"], ["m"]),
         helper.make_node("Min", ["m", "x"], ["n"]),
         helper.make_node("LeakyRelu", ["n"], ["y"], alpha=0.1),
         helper.make_node("Add", ["x", "channel2"], ["xb"]),
         helper.make_node("Sigmoid", ["xb"], ["s"]),
         helper.make_node("Mul", ["xb", "s"], ["silu"])],
        [tensor("x", [2, 3, 4, 5])], [tensor("y", [2, 3, 4, 5]), tensor("silu", [2, 3, 4, 5])],
        [const("channel", RNG.standard_normal((3, 1, 1)).astype(np.float32)),
         const("channel2", RNG.standard_normal((1, 3, 1, 1)).astype(np.float32)),
         const("last", RNG.standard_normal(5).astype(np.float32)),
         const("middle", RNG.standard_normal((1, 4, 1)).astype(np.float32)),
         const("scalar", np.float32(-0.5))])
    graph = check(proto, {"x": x}, rtol=2e-6)
    assert sorted(n.attrs["ops"] for n in chains(graph)) == [
        ["Add", "Mul", "Sub", "Relu", "Max", "Min", "LeakyRelu"], ["Add", "Sigmoid", "Mul"]]


def test_unknown_shapes_are_left_alone():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    y = RNG.standard_normal((6,)).astype(np.float32)
    proto = make_model([helper.make_node("Add", ["x", "y"], ["t"]),
                        helper.make_node("Relu", ["t"], ["r"])],
                       [tensor("x", [4, 6]), tensor("y", None)], [tensor("r", None)])
    check(proto, {"x": x, "y": y}, [], exact=True)


def test_only_for_backends_with_the_kernel_and_not_for_portable_models():
    proto = make_model([helper.make_node("Sigmoid", ["x"], ["s"]),
                        helper.make_node("Mul", ["x", "s"], ["y"])],
                       [tensor("x", [4, 6])], [tensor("y", [4, 6])])
    assert chains(simplify(import_model(proto)).graph)
    assert not chains(simplify(import_model(proto), portable=True).graph)
    assert not chains(simplify(import_model(proto), backend="opencl").graph)


def _silu_session(shape):
    proto = make_model([helper.make_node("Sigmoid", ["x"], ["s"]),
                        helper.make_node("Mul", ["x", "s"], ["y"])],
                       [tensor("x", list(shape))], [tensor("y", list(shape))])
    return proto


def test_same_bits_on_any_thread_count_and_from_threads_sharing_a_session():
    shape = (1, 16, 96, 96)
    proto = _silu_session(shape)
    feeds = [{"x": RNG.standard_normal(shape).astype(np.float32) * 4} for _ in range(4)]
    one = ember.load(proto, threads=1)
    assert chains(one.model.graph)
    sequential = [one.run(f)["y"] for f in feeds]
    shared = ember.load(proto, threads=2)
    got = [None] * len(feeds)

    def work(i):
        for _ in range(3):
            got[i] = shared.run(feeds[i])["y"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(sequential, got):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("shapes", [[(2, 3, 4, 5), (3, 1, 1), (1,), (5,), (4, 1)],
                                    [(7, 1), (1, 9)], [(6,), ()], [(0, 3), (3,)]])
def test_compiled_loop_matches_the_portable_kernel(shapes):
    """x0 + x1, * x2, + x3 ... then HardSwish, over inputs of `shapes`."""
    n = len(shapes)
    ops, args, last = [], [], 0
    for k in range(1, n):
        ops.append("Add" if k % 2 else "Mul")
        args += [last, k]
        last = n + len(ops) - 1
    ops.append("HardSwish")
    args.append(last)
    params = []
    node = Node(OP_TYPE, "ai.ember", 1, [f"x{k}" for k in range(len(shapes))], ["y"],
                attrs={"ops": ops, "args": args, "params": params})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    inputs = [RNG.standard_normal(s).astype(np.float32) * 4 for s in shapes]
    got, want = kernel.run(*inputs), kernel.portable(inputs)
    assert got.shape == want.shape == np.broadcast_shapes(*shapes)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert layout(list(shapes)).shape == want.shape


def test_a_channels_last_input_gives_a_channels_last_result():
    """Between convolutions images are channels-last views: the loop runs in their memory
    order and the result keeps it (numpy's ufuncs do), with no copy to C order."""
    node = Node(OP_TYPE, "ai.ember", 1, ["x", "b"], ["y"],
                attrs={"ops": ["Add", "Sigmoid", "Mul"], "args": [0, 1, 2, 2, 3]})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    x = RNG.standard_normal((2, 9, 7, 5)).astype(np.float32).transpose(0, 3, 1, 2)
    b = RNG.standard_normal((5, 1, 1)).astype(np.float32)
    got, want = kernel.run(x, b), kernel.portable([x, b])
    assert got.strides == want.strides and not got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_small_tensors_run_numpys_operations(monkeypatch):
    """Below CHAIN_COMPILED_MIN values an input (a decoding step's vectors) the chain runs
    numpy's operations one by one, chosen at plan time for static shapes; above, the loop."""
    monkeypatch.setattr(tuning, "CHAIN_COMPILED_MIN", DEFAULT_MIN)
    for shape, kernel in (((4, 8), "numpy"), ((64, 256), "cpu.compiled")):
        proto = _silu_session(shape)
        session = ember.load(proto)
        if kernel == "cpu.compiled" and session.kernels[0][2] == "numpy":
            pytest.skip("numba is not installed: numpy's operations serve every size")
        assert [k[2] for k in session.kernels] == [kernel]
        x = RNG.standard_normal(shape).astype(np.float32)
        got = session.run({"x": x})["y"]
        np.testing.assert_allclose(got, x / (1 + np.exp(-x)), rtol=1e-6, atol=1e-7)
        assert [k[2] for k in session.kernels] == [kernel]


def test_one_large_op_is_a_chain_and_a_small_one_stays():
    """A single one-pass elementwise op over at least CHAIN_ALONE_MIN values (an SE block's
    broadcast Mul) becomes a chain of one step, for the loop on the run's threads, and a
    formula (a detector's Sigmoid) from CHAIN_FORMULA_ALONE_MIN values; a small one stays a
    plain node."""
    for shape, fused in (((1, 64, 64, 64), [["Mul"]]), ((1, 64, 32, 32), [])):
        x = RNG.standard_normal(shape).astype(np.float32)
        s = RNG.standard_normal((1, shape[1], 1, 1)).astype(np.float32)
        proto = make_model([helper.make_node("Mul", ["x", "s"], ["y"])],
                           [tensor("x", list(shape)), tensor("s", list(s.shape))],
                           [tensor("y", list(shape))])
        assert math.prod(shape) >= tuning.CHAIN_ALONE_MIN or not fused
        check(proto, {"x": x, "s": s}, fused, exact=True)
    for shape, fused in (((1, 80, 120), [["Sigmoid"]]), ((1, 20, 100), [])):
        x = RNG.standard_normal(shape).astype(np.float32) * 6
        proto = make_model([helper.make_node("Sigmoid", ["x"], ["y"])],
                           [tensor("x", list(shape))], [tensor("y", list(shape))])
        assert (math.prod(shape) >= tuning.CHAIN_FORMULA_ALONE_MIN) == bool(fused)
        check(proto, {"x": x}, fused)
    x = RNG.standard_normal((1, 80, 120)).astype(np.float32)   # numpy squares by products
    proto = make_model([helper.make_node("Pow", ["x", "two"], ["y"])],
                       [tensor("x", [1, 80, 120])], [tensor("y", [1, 80, 120])],
                       [const("two", np.float32(2))])
    check(proto, {"x": x}, [])


def test_a_strided_view_is_read_in_its_memory_order(monkeypatch):
    """A Split's part of a channels-last image is a strided view: with no dense input the loop
    runs in the view's memory order and the result has that order; a dense input after it
    decides over it. Either way the view is read where it lies, not copied (its channels
    contiguous); a view whose innermost values are apart (every other channel) is copied."""
    copies = []
    contiguous = np.ascontiguousarray
    monkeypatch.setattr(np, "ascontiguousarray",
                        lambda x, *a, **k: (copies.append(x.flags.c_contiguous),
                                            contiguous(x, *a, **k))[1])
    node = Node(OP_TYPE, "ai.ember", 1, ["x"], ["y"],
                attrs={"ops": ["Sigmoid", "Neg"], "args": [0, 1]})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    base = RNG.standard_normal((2, 30, 24)).astype(np.float32)
    view = base[:, :, 8:].transpose(0, 2, 1)            # (2, 16, 30), channels innermost
    got, want = kernel.run(view), kernel.portable([view])
    assert got.transpose(0, 2, 1).flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    node = Node(OP_TYPE, "ai.ember", 1, ["a", "b"], ["y"],
                attrs={"ops": ["Add", "Neg"], "args": [0, 1, 2]})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    image = RNG.standard_normal((1, 5, 6, 16)).astype(np.float32).transpose(0, 3, 1, 2)
    part = RNG.standard_normal((1, 5, 6, 40)).astype(np.float32)[..., 4:20] \
        .transpose(0, 3, 1, 2)
    got = kernel.run(part, image)
    assert got.strides == image.strides
    np.testing.assert_array_equal(got, kernel.portable([part, image]))
    if kernel.kernels.get(*kernel._program, ("v", "f"), (np.dtype(np.float32),) * 2,
                          np.dtype(np.float32))[0] is not None:   # (numba: the loop ran)
        assert False not in copies   # only C-ordered arrays went through ascontiguousarray
        apart = RNG.standard_normal((1, 5, 6, 32)).astype(np.float32)[..., ::2] \
            .transpose(0, 3, 1, 2)
        np.testing.assert_array_equal(kernel.run(apart, image),
                                      kernel.portable([apart, image]))
        assert False in copies


def test_pieces_on_the_board_same_bits(monkeypatch):
    """The loop's pieces taken by the pool's helpers without Python (its generated piece
    function), for a broadcast operand and a bool result: one thread's bits."""
    from board import pieces_on_the_board_give_one_threads_bits
    node = Node(OP_TYPE, "ai.ember", 1, ["x", "b"], ["y"],
                attrs={"ops": ["Add", "Sigmoid", "Mul", "Greater"],
                       "args": [0, 1, 2, 2, 3, 4, 0]})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    x = RNG.standard_normal((4, 96, 40, 30)).astype(np.float32)
    b = RNG.standard_normal((96, 1, 1)).astype(np.float32)
    pieces_on_the_board_give_one_threads_bits(lambda: kernel.run(x, b), monkeypatch)
    node = Node(OP_TYPE, "ai.ember", 1, ["x", "b"], ["y"],
                attrs={"ops": ["Add", "Sigmoid", "Mul"], "args": [0, 1, 2, 2, 3]})
    kernel = bind(node, lookup("ai.ember", OP_TYPE, 1), dict(node.attrs))
    got = kernel.run(x, b)
    np.testing.assert_allclose(got, kernel.portable([x, b]), rtol=1e-6, atol=1e-7)


def test_one_tensor_of_unknown_shape_and_scalars_fuse():
    """After com.microsoft ops onnx's inference knows no shapes: a MatMulInteger's Cast and
    its scale Mul (the scales' product a scalar) still fuse, the output having the one
    tensor's shape; two tensors of unknown shapes do not (their broadcast is unknown)."""
    a = RNG.integers(-1000, 1000, (3, 5, 7)).astype(np.int32)
    proto = make_model([helper.make_node("Mul", ["sa", "sb"], ["s"]),
                        helper.make_node("Cast", ["a"], ["f"], to=F),
                        helper.make_node("Mul", ["f", "s"], ["y"])],
                       [tensor("a", None, TensorProto.INT32), tensor("sa", [])],
                       [tensor("y", None)], [const("sb", np.float32(0.5))])
    graph = check(proto, {"a": a, "sa": np.array(0.02, np.float32)},
                  [["Mul", "CastFloat", "Mul"]], exact=True)
    assert len(graph.nodes) == 1
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    proto = make_model([helper.make_node("Add", ["x", "z"], ["t"]),
                        helper.make_node("Sigmoid", ["t"], ["y"])],
                       [tensor("x", None), tensor("z", None)], [tensor("y", None)])
    check(proto, {"x": x, "z": x[:1]}, [])
