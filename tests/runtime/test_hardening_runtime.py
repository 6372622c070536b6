"""Hardening of the runtime (issue 13): hostile sizes fail with an ember error before they are
allocated, hostile attributes and regexes cannot run unbounded, the simplifier is linear in
graph size, outputs never alias feeds or weights, odd feeds are InputErrors, and bad CLI
arguments give one line and exit 2.

Cases that could hang or exhaust memory if they regressed run in a subprocess with a timeout
(the test only asserts that it completes, never how fast)."""
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

import ember
from ember.cli import main as cli_main
from ember.errors import ResourceLimitError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(ROOT, "models", "mlp.onnx")

ort = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, outputs, opset=18, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _info(name, dtype=TP.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, dtype, shape)


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _isolated(code: str, timeout: float = 60, env: dict | None = None) -> str:
    """Run `code` in a fresh interpreter; it must finish within `timeout` and exit 0."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


# --------------------------------------------------------------------------------------------
# the tensor cap

def _constant_of_shape() -> onnx.ModelProto:
    # the shape is a graph input: nothing can fold it away before the run
    return _model([helper.make_node("ConstantOfShape", ["shape"], ["y"], name="fill")],
                  [_info("shape", TP.INT64, [1])], [_info("y")])


def test_constant_of_shape_past_the_cap_fails_before_allocating():
    sess = ember.load(_constant_of_shape(), max_tensor_bytes=1 << 30)
    with pytest.raises(ResourceLimitError, match=r"'fill'.*ConstantOfShape.*\[1000000000\].*"
                                                 r"3\.7 GiB.*max_tensor_bytes"):
        sess.run({"shape": np.array([10**9], np.int64)})


def test_raising_the_cap_lets_the_tensor_through():
    model, feeds = _constant_of_shape(), {"shape": np.array([1000], np.int64)}
    with pytest.raises(ResourceLimitError):
        ember.load(model, max_tensor_bytes=3999).run(feeds)
    out = ember.load(model, max_tensor_bytes=4000).run(feeds)["y"]
    np.testing.assert_array_equal(out, _ort(model, feeds)[0])


def test_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_MAX_TENSOR_BYTES", "1K")
    sess = ember.load(_constant_of_shape())
    assert sess.max_tensor_bytes == 1024
    with pytest.raises(ResourceLimitError, match="1.0 KiB"):
        sess.run({"shape": np.array([1000], np.int64)})
    monkeypatch.setenv("EMBER_MAX_TENSOR_BYTES", "lots")
    with pytest.raises(ember.EmberError, match="EMBER_MAX_TENSOR_BYTES"):
        ember.load(_constant_of_shape())


def test_bad_cap_argument():
    for bad in (0, -1, 1.5, True, "1G"):
        with pytest.raises(ValueError, match="max_tensor_bytes"):
            ember.load(_constant_of_shape(), max_tensor_bytes=bad)


def test_default_cap_follows_an_address_space_limit():
    """Under `ulimit -v` (as the fuzzer runs its cases) the default cap is half the limit, so
    the 1e9-element ConstantOfShape (3.7 GiB) fails cleanly instead of dying of MemoryError."""
    out = _isolated("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import numpy as np, onnx
        from onnx import TensorProto as TP, helper
        import ember
        from ember.errors import ResourceLimitError
        node = helper.make_node("ConstantOfShape", ["shape"], ["y"], name="fill")
        graph = helper.make_graph([node], "g",
                                  [helper.make_tensor_value_info("shape", TP.INT64, [1])],
                                  [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        sess = ember.load(helper.make_model(graph))
        assert sess.max_tensor_bytes <= 3 << 30, sess.max_tensor_bytes
        try:
            sess.run({"shape": np.array([10**9], np.int64)})
        except ResourceLimitError as exc:
            print("refused:", exc)
    """, env={"EMBER_MAX_TENSOR_BYTES": ""})
    assert "refused:" in out and "'fill'" in out


def _unbounded_loop() -> onnx.ModelProto:
    """A Loop with trip count 1e12 whose scan output collects a 1 MiB slice per iteration."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Identity", ["big"], ["slice"])],
        "body", [_info("i", TP.INT64, []), _info("cond_in", TP.BOOL, []),],
        [_info("cond_out", TP.BOOL, []), _info("slice", TP.FLOAT, [1 << 18])])
    loop = helper.make_node("Loop", ["trips", "cond"], ["stacked"], body=body, name="forever")
    return _model([loop], [_info("big", TP.FLOAT, [1 << 18])], [_info("stacked")],
                  initializers=[numpy_helper.from_array(np.array(10**12, np.int64), "trips"),
                                numpy_helper.from_array(np.array(True), "cond")])


def test_unbounded_loop_fails_at_the_cap():
    feeds = {"big": np.ones(1 << 18, np.float32)}
    # inside a subprocess: a regression would grow the scan output until memory runs out
    out = _isolated(f"""
        import numpy as np, onnx, ember
        from ember.errors import ResourceLimitError
        model = onnx.load_from_string({_unbounded_loop().SerializeToString()!r})
        sess = ember.load(model, max_tensor_bytes=64 << 20)
        try:
            sess.run({{"big": np.ones(1 << 18, np.float32)}})
        except ResourceLimitError as exc:
            print("refused:", exc)
    """)
    assert "refused:" in out and "'forever'" in out and "scan output 'stacked'" in out
    assert "64.0 MiB" in out
    # under the cap the same loop body runs as onnxruntime's (a short trip count)
    model = _unbounded_loop()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(3, np.int64), "trips"))
    got = ember.load(model, max_tensor_bytes=64 << 20).run(feeds)["stacked"]
    np.testing.assert_array_equal(got, _ort(model, feeds)[0])


def _one_op(op, inputs, values, attrs=None, opset=18, name="big"):
    """A model of one `op` node whose inputs are graph inputs fed `values`."""
    infos = [_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
             for n, v in zip(inputs, values)]
    node = helper.make_node(op, inputs, ["y"], name=name, **(attrs or {}))
    return _model([node], infos, [_info("y")], opset=opset), dict(zip(inputs, values))


_I64 = lambda *v: np.array(v, np.int64)  # noqa: E731
_F32 = lambda *v: np.array(v, np.float32)  # noqa: E731

# every op that sizes an allocation from data, asked for far more than a 1 MiB cap
ALLOCATING = {
    "Expand": ("Expand", ["x", "shape"], [_F32(1.0), _I64(1 << 20, 1 << 20)], {}),
    "Tile": ("Tile", ["x", "reps"], [_F32(1.0, 2.0), _I64(1 << 40)], {}),
    "Range": ("Range", ["a", "b", "d"], [np.array(0, np.int64), np.array(1 << 40, np.int64),
                                         np.array(1, np.int64)], {}),
    "Pad": ("Pad", ["x", "pads"], [_F32(1.0), _I64(1 << 30, 1 << 30)], {}),
    "Resize": ("Resize", ["x", "", "scales"], [np.ones((1, 1, 2, 2), np.float32), None,
                                               _F32(1, 1, 1e5, 1e5)], {"mode": "nearest"}),
    "OneHot": ("OneHot", ["i", "depth", "values"], [_I64(0, 1), _I64(1 << 40), _F32(0, 1)],
               {}),
    "MaxPool-pads": ("MaxPool", ["x"], [np.ones((1, 1, 4), np.float32)],
                     {"kernel_shape": [2], "pads": [1 << 30, 1 << 30]}),
    "ConvTranspose-output_shape": (
        "ConvTranspose", ["x", "w"], [np.ones((1, 1, 2), np.float32),
                                      np.ones((1, 1, 2), np.float32)],
        {"output_shape": [1 << 30]}),
    "HannWindow": ("HannWindow", ["n"], [np.array(1 << 40, np.int64)], {}),
}


@pytest.mark.parametrize("case", sorted(ALLOCATING))
def test_allocating_ops_check_the_cap_before_allocating(case):
    op, names, values, attrs = ALLOCATING[case]
    present = [(n, v) for n, v in zip(names, values) if n]
    model, feeds = _one_op(op, [n for n, _ in present], [v for _, v in present], attrs)
    model.graph.node[0].input[:] = names  # keep the omitted inputs' places ("")
    sess = ember.load(model, max_tensor_bytes=1 << 20)
    with pytest.raises(ResourceLimitError, match=rf"'big' \({op}.*over the limit of 1.0 MiB"):
        sess.run(feeds)


def test_every_node_output_is_checked_after_it_runs():
    """An op without a check of its own (a broadcast): the executor's check names the node."""
    model, feeds = _one_op("Add", ["a", "b"], [np.ones((1024, 1), np.float32),
                                               np.ones((1, 1024), np.float32)])
    with pytest.raises(ResourceLimitError, match=r"'big' \(Add.*output 'y' takes 4.0 MiB"):
        ember.load(model, max_tensor_bytes=1 << 20).run(feeds)
    np.testing.assert_array_equal(ember.load(model).run(feeds)["y"], _ort(model, feeds)[0])


# --------------------------------------------------------------------------------------------
# bounded attributes

def test_average_pool_kernel_of_2_to_40_is_refused_at_load():
    model, _ = _one_op("AveragePool", ["x"], [np.ones((1, 1, 4), np.float32)],
                       {"kernel_shape": [1 << 40]})
    with pytest.raises(ember.InvalidModelError, match=r"kernel_shape \[1099511627776\]"):
        ember.load(model)


def test_average_pool_huge_kernel_within_bounds_runs_as_onnxruntime():
    """A 2**31-1 tap kernel over 4 values with 2**30 padding each side: only the taps that
    reach the input run (a tap loop over the whole kernel would never finish)."""
    out = _isolated("""
        import numpy as np, ember
        from onnx import TensorProto as TP, helper
        node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2**31 - 1],
                                pads=[2**30, 2**30])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT,
                                                                           [1, 1, 4])],
                                  [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        y = ember.load(helper.make_model(graph)).run(
            {"x": np.arange(4, dtype=np.float32).reshape(1, 1, 4)})["y"]
        print(y.tolist())
    """)
    expected = _ort(*_one_op("AveragePool", ["x"],
                             [np.arange(4, dtype=np.float32).reshape(1, 1, 4)],
                             {"kernel_shape": [2**31 - 1], "pads": [2**30, 2**30]}))[0]
    assert out.strip() == str(expected.tolist())


@pytest.mark.parametrize("attrs", [{"kernel_shape": [0]}, {"kernel_shape": [2], "strides": [0]},
                                   {"kernel_shape": [2], "dilations": [-1]},
                                   {"kernel_shape": [2], "strides": [1, 1]},
                                   {"kernel_shape": [2], "pads": [1]}])
def test_pool_window_attributes_are_checked_at_load(attrs):
    model, _ = _one_op("MaxPool", ["x"], [np.ones((1, 1, 4), np.float32)], attrs)
    with pytest.raises(ember.InvalidModelError, match="MaxPool node 'big'"):
        ember.load(model, simplify=False)


def test_split_num_outputs_must_match_the_outputs():
    x = _info("x", TP.FLOAT, [1, 1, 4])
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=2, num_outputs=2**31, name="s")
    model = _model([node], [x], [_info("a"), _info("b")])
    # simplify=False: onnx's own shape inference, which the importer's validation guards, is
    # not what is tested here
    with pytest.raises(ember.InvalidModelError, match=r"num_outputs is 2147483648 but the node "
                                                      r"has 2 output"):
        ember.load(model, simplify=False)


# --------------------------------------------------------------------------------------------
# regexes

def _regex_model(pattern: str) -> onnx.ModelProto:
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern, name="re")
    return _model([node], [_info("x", TP.STRING, [None])], [_info("y", TP.BOOL)], opset=20)


def test_catastrophic_regex_returns():
    model = _regex_model("(a+)+$")
    text = np.array(["a" * 64 + "!", "aaaa", ""], dtype=object)
    # Python's re needs ~2**64 steps for the first string: the subprocess would time out
    out = _isolated(f"""
        import numpy as np, onnx, ember
        model = onnx.load_from_string({model.SerializeToString()!r})
        y = ember.load(model).run({{"x": np.array({text.tolist()!r}, dtype=object)}})["y"]
        print(y.tolist())
    """, timeout=30)
    assert out.strip() == str(_ort(model, {"x": text})[0].tolist())


@pytest.mark.parametrize("pattern", [r"(a)\1", r"a(?=b)", r"(?<!x)y"])
def test_regex_without_re2_syntax_fails_at_load(pattern):
    with pytest.raises(ember.InvalidModelError, match=r"RegexFullMatch node 're'.*RE2"):
        ember.load(_regex_model(pattern))


# --------------------------------------------------------------------------------------------
# the simplifier is linear

def test_long_identity_chain_simplifies():
    out = _isolated("""
        import numpy as np, ember
        from onnx import TensorProto as TP, helper
        n = 30000
        nodes = [helper.make_node("Identity", [f"v{i}"], [f"v{i + 1}"]) for i in range(n)]
        graph = helper.make_graph(nodes, "chain",
                                  [helper.make_tensor_value_info("v0", TP.FLOAT, [2])],
                                  [helper.make_tensor_value_info(f"v{n}", TP.FLOAT, [2])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        sess = ember.load(model)
        x = np.array([1.0, 2.0], np.float32)
        print(len(sess.model.graph.nodes), sess.run({"v0": x})[f"v{n}"].tolist())
    """, timeout=120)
    nodes, values = out.split(" ", 1)
    assert int(nodes) <= 1 and values.strip() == "[1.0, 2.0]"  # input -> output: one Identity


# --------------------------------------------------------------------------------------------
# outputs own their memory

def _view_op(op, opset=18):
    """(model, feeds) of one op that kernels implement as a view of its input."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    const = lambda name, *v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    cases = {
        "Identity": ([], {}),
        "Reshape": ([const("shape", 4, 3)], {}),
        "Flatten": ([], {"axis": 1}),
        "Squeeze": ([const("axes", 0)], {}),
        "Unsqueeze": ([const("axes", 0)], {}),
        "Slice": ([const("starts", 1), const("ends", 3)], {}),
        "Dropout": ([], {}),
        "Cast": ([], {"to": TP.FLOAT}),
        "Transpose": ([], {"perm": [0, 1]}),
    }
    inits, attrs = cases[op]
    if op == "Squeeze":
        x = x.reshape(1, 3, 4)
    node = helper.make_node(op, ["x"] + [t.name for t in inits], ["y"], **attrs)
    model = _model([node], [_info("x", TP.FLOAT, list(x.shape))], [_info("y")], opset=opset,
                   initializers=inits)
    return model, {"x": x}


VIEW_OPS = ["Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Dropout", "Cast",
            "Transpose"]


@pytest.mark.parametrize("simplify", [True, False], ids=["simplified", "as-imported"])
@pytest.mark.parametrize("op", VIEW_OPS)
def test_outputs_do_not_alias_the_feed(op, simplify):
    model, feeds = _view_op(op)
    y = ember.load(model, simplify=simplify).run(feeds)["y"]
    expected = _ort(model, feeds)[0]
    np.testing.assert_array_equal(y, expected)
    assert y.flags.writeable and y.flags.c_contiguous
    feeds["x"][...] = -1  # the caller reuses its buffer
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("simplify", [True, False], ids=["simplified", "as-imported"])
def test_split_outputs_do_not_alias_the_feed(simplify):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2)
    model = _model([node], [_info("x", TP.FLOAT, [2, 4])], [_info("a"), _info("b")])
    out = ember.load(model, simplify=simplify).run({"x": x})
    expected = _ort(model, {"x": x})
    x[...] = -1
    for got, want in zip(out.values(), expected):
        np.testing.assert_array_equal(got, want)


def test_graph_output_that_is_a_graph_input_is_a_copy():
    model = _model([], [_info("x", TP.FLOAT, [3])], [_info("x", TP.FLOAT, [3])])
    x = np.ones(3, np.float32)
    y = ember.load(model).run({"x": x})["x"]
    assert y is not x and not np.shares_memory(x, y)


def test_outputs_do_not_share_memory_with_each_other_or_the_weights():
    w = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Identity", ["r"], ["y1"]),
             helper.make_node("Identity", ["r"], ["y2"]),
             helper.make_node("Identity", ["w"], ["wy"])]
    model = _model(nodes, [_info("x", TP.FLOAT, [4])],
                   [_info("y1"), _info("y2"), _info("wy")], initializers=[w])
    for simplify in (True, False):
        sess = ember.load(model, simplify=simplify)
        out = sess.run({"x": np.arange(4, dtype=np.float32)})
        assert not np.shares_memory(out["y1"], out["y2"])
        out["y1"][...] = 7
        out["wy"][...] = 7  # writable, and the weight is not touched
        np.testing.assert_array_equal(out["y2"], np.arange(4))
        again = sess.run({"x": np.arange(4, dtype=np.float32)})
        np.testing.assert_array_equal(again["wy"], np.arange(4))


def test_fresh_outputs_are_not_copied():
    model, feeds = _one_op("Relu", ["x"], [np.ones(4, np.float32)])
    sess = ember.load(model)
    kernel_result = {}
    plan_run = sess._plan.run

    def spy(values, scope=None):
        kernel_result["y"] = plan_run(values, scope)[0]
        return [kernel_result["y"]]

    sess._plan.run = spy
    assert sess.run(feeds)["y"] is kernel_result["y"]


# --------------------------------------------------------------------------------------------
# feeds

@pytest.mark.parametrize("value, dtype", [
    (2**70, TP.INT64), ([1, 2**70], TP.INT64), (-1, TP.UINT8), (10**400, TP.FLOAT),
    ("abc", TP.FLOAT), ([[1, 2], [3]], TP.FLOAT)])
def test_feeds_numpy_cannot_convert_are_input_errors(value, dtype):
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [_info("x", dtype, None)],
                   [_info("y", dtype)])
    with pytest.raises(ember.InputError, match=rf"input 'x' expects tensor\(.*\) values.*"
                                               rf"{type(value).__name__}"):
        ember.load(model).run({"x": value})


# --------------------------------------------------------------------------------------------
# the CLI

@pytest.fixture
def files(tmp_path):
    text = tmp_path / "not_an_array.npy"
    text.write_text("hello\n")
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "out.npz").mkdir()
    return {"text": str(text), "objects": str(objects), "dir": str(tmp_path)}


CLI_CASES = {
    "negative dim": (["--dim", "batch=-1"], "--dim batch=-1"),
    "huge dim": (["--dim", "batch=100000000000"], "would take"),
    "unknown dim": (["--dim", "foo=3"], "no such dimension; its symbolic dimensions are batch"),
    "dim without value": (["--dim", "batch"], "NAME=VALUE"),
    "dim not a number": (["--dim", "batch=two"], "integer"),
    "missing output dir": (["-o", "{dir}/missing/dir/out.npz"], "does not exist"),
    "output is a dir": (["-o", "{dir}/out.npz"], "is a directory"),
    "text as npy": (["-i", "x={text}"], "not a .npy file"),
    "object npy": (["-i", "x={objects}"], "Python objects"),
    "input is a dir": (["-i", "x={dir}"], "Is a directory"),
    "unknown backend": (["--backend", "abacus"], "abacus"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_bad_argument_is_one_line_and_exit_2(case, files, capsys):
    args, expected = CLI_CASES[case]
    args = [a.format(**files) for a in args]
    assert cli_main(["run", MLP, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ember: error:"), err
    assert expected in err and "allow_pickle" not in err and "Traceback" not in err


def test_cli_model_that_is_a_directory(files, capsys):
    assert cli_main(["run", files["dir"]]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli_main(["info", files["dir"]]) == 2


def test_cli_in_a_subprocess_prints_no_traceback(tmp_path):
    for args in (["--dim", "batch=100000000000"], ["--dim", "batch=-1"],
                 ["-o", str(tmp_path / "missing" / "out.npz")]):
        run = subprocess.run([sys.executable, "-m", "ember", "run", MLP, *args],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


# --------------------------------------------------------------------------------------------
# Loop: hostile trip counts (fuzz cases test_loop11 / test_loop13_seq / test_loop16_seq_none)

def _loop_model(body_nodes, carried, scan=(), opset=18, trips_as_input=True,
                cond_input=True) -> onnx.ModelProto:
    """A Loop node 'loop' over `body_nodes`: the body reads (i, cond_in, *carried inputs) and
    returns (cond_out, *carried outputs, *scan outputs). `carried` and `scan` are
    (body input, body output, node input / output, ValueInfo type) tuples."""
    body_in = [_info("i", TP.INT64, []), _info("cond_in", TP.BOOL, [])]
    body_out = [_info("cond_out", TP.BOOL, [])]
    graph_in, graph_out, node_in, node_out = [], [], [], []
    for b_in, b_out, outer, kind in carried:
        body_in.append(helper.make_value_info(b_in, kind))
        body_out.append(helper.make_value_info(b_out, kind))
        graph_in.append(helper.make_value_info(f"{outer}_0", kind))
        graph_out.append(helper.make_value_info(outer, kind))
        node_in.append(f"{outer}_0")
        node_out.append(outer)
    for b_out, outer in scan:
        body_out.append(_info(b_out, TP.FLOAT))
        graph_out.append(_info(outer, TP.FLOAT))
        node_out.append(outer)
    body = helper.make_graph(body_nodes, "body", body_in, body_out)
    loop = helper.make_node("Loop", ["trips" if trips_as_input else "",
                                     "cond" if cond_input else ""] + node_in, node_out,
                            body=body, name="loop")
    inputs = ([_info("trips", TP.INT64, [])] if trips_as_input else []) + \
        ([_info("cond", TP.BOOL, [])] if cond_input else []) + graph_in
    return _model([loop], inputs, graph_out, opset=opset)


_TENSOR = helper.make_tensor_type_proto(TP.FLOAT, [1])
_SEQ = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TP.FLOAT, None))
_PASS_COND = helper.make_node("Identity", ["cond_in"], ["cond_out"])


def _counting_loop() -> onnx.ModelProto:
    """y += 1 each iteration, and y collected as a scan output: 4 bytes per iteration."""
    one = helper.make_node("Constant", [], ["one"],
                           value=numpy_helper.from_array(np.ones(1, np.float32)))
    return _loop_model([_PASS_COND, one, helper.make_node("Add", ["y", "one"], ["y_out"]),
                        helper.make_node("Identity", ["y_out"], ["scan"])],
                       [("y", "y_out", "res_y", _TENSOR)], [("scan", "res_scan")])


def _loop_feeds(trips, **carried):
    return {"trips": np.array(trips, np.int64), "cond": np.array(True), **carried}


def _loop_fails_fast(model: onnx.ModelProto, feeds: dict, cap: int | None = None,
                     env: dict | None = None) -> str:
    """Run the Loop in a subprocess (a regression would run for hours): the ember error."""
    feeds_code = "{" + ", ".join(f"{k!r}: pickle.loads({pickle.dumps(v)!r})"
                                 for k, v in feeds.items()) + "}"
    out = _isolated(f"""
        import pickle, numpy as np, onnx, ember
        model = onnx.load_from_string({model.SerializeToString()!r})
        sess = ember.load(model, max_tensor_bytes={cap!r})
        try:
            sess.run({feeds_code})
        except ember.EmberError as exc:
            print(type(exc).__name__, exc)
    """, timeout=60, env=env)
    assert out.strip(), "the loop ran to the end"
    return out


@pytest.mark.parametrize("trips", [10**9, 2**40, 2**63 - 1])
def test_loop_scan_output_too_big_for_its_trip_count_fails_after_one_iteration(trips):
    """4 bytes per iteration stay far under the cap for hours; the size the scan output is
    heading for is known after one iteration (every slice has the same shape)."""
    out = _loop_fails_fast(_counting_loop(), _loop_feeds(trips, res_y_0=_F32(0)), cap=1 << 30)
    assert out.startswith("ResourceLimitError") and "node 'loop' (Loop" in out
    assert f"scan output 'res_scan' of {trips} iterations (4 bytes each)" in out
    assert "over the limit of 1.0 GiB" in out


def test_loop_under_the_bounds_runs_as_onnxruntime():
    model, feeds = _counting_loop(), _loop_feeds(7, res_y_0=_F32(0.5))
    got = ember.load(model, max_tensor_bytes=1 << 30).run(feeds)
    for name, want in zip(["res_y", "res_scan"], _ort(model, feeds)):
        np.testing.assert_array_equal(got[name], want)


def _appending_loop(reads_length: bool = False) -> onnx.ModelProto:
    """seq_out = SequenceInsert(seq_in, x[:i+1]) (test_loop13_seq's body); with
    `reads_length` the body also reads its sequence (the slice ends at its length + 1), so
    the Loop cannot keep the sequence itself and the body gets the whole list."""
    x = helper.make_node("Constant", [], ["x"], value=numpy_helper.from_array(
        np.arange(1, 6, dtype=np.float32)))
    nodes = [_PASS_COND, x,
             helper.make_node("Constant", [], ["one"],
                              value=numpy_helper.from_array(np.array(1, np.int64))),
             helper.make_node("Constant", [], ["zero"],
                              value=numpy_helper.from_array(np.array([0], np.int64))),
             helper.make_node("Add", ["length" if reads_length else "i", "one"], ["end"]),
             helper.make_node("Unsqueeze", ["end", "zero"], ["end1"]),
             helper.make_node("Slice", ["x", "zero", "end1"], ["part"])]
    if reads_length:
        nodes.insert(0, helper.make_node("SequenceLength", ["seq"], ["length"]))
    nodes.append(helper.make_node("SequenceInsert", ["seq", "part"], ["seq_out"]))
    return _loop_model(nodes, [("seq", "seq_out", "res", _SEQ)], opset=18)


def test_loop_whose_trip_count_passes_the_iteration_limit_fails_after_one_iteration():
    """test_loop13_seq with trip count 2**63-1: its condition never changes, so the trip count
    is its only bound, and that is over the 2**31 iterations a Loop may make."""
    out = _loop_fails_fast(_appending_loop(), _loop_feeds(2**63 - 1, res_0=[]))
    assert out.startswith("ResourceLimitError") and "node 'loop' (Loop" in out
    assert "trip count 9223372036854775807 is the loop's only bound" in out
    assert "limit of 2147483648 iterations" in out and "EMBER_MAX_LOOP_ITERATIONS" in out


def test_loop_growing_sequence_fails_at_its_projected_size():
    """test_loop16_seq_none's trip count 2**31 (within the iteration limit): a sequence
    growing by one element per iteration would hold 2**31 arrays, ~270 GB."""
    out = _loop_fails_fast(_appending_loop(reads_length=True),
                           _loop_feeds(2**31, res_0=[]), cap=1 << 30)
    assert out.startswith("ResourceLimitError") and "node 'loop' (Loop" in out
    assert "loop-carried sequence 'res', growing" in out and "after 2147483648 iterations" in out


@pytest.mark.parametrize("reads_length", [False, True], ids=["appended", "copied"])
def test_loop_sequences_match_onnxruntime(reads_length):
    model = _appending_loop(reads_length)
    start = [np.array([9.0], np.float32)]
    feeds = _loop_feeds(8, res_0=start)
    got = ember.load(model).run(feeds)["res"]
    want = _ort(model, feeds)[0]
    assert len(got) == len(want) == 9
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert len(start) == 1  # the caller's sequence is not appended to


def test_loop_appends_to_its_sequence_in_linear_time(monkeypatch):
    """The body's SequenceInsert copies the list it is given: with the Loop keeping the
    sequence, that list is empty every iteration (n iterations copy nothing, not n²/2
    elements). A body that reads its sequence otherwise gets all of it, as before."""
    from ember.ops.sequence import SequenceInsert

    copied = []
    original = SequenceInsert.run
    monkeypatch.setattr(SequenceInsert, "run",
                        lambda self, seq, *rest: copied.append(len(seq)) or
                        original(self, seq, *rest))
    ember.load(_appending_loop()).run(_loop_feeds(50, res_0=[]))
    assert copied == [0] * 50
    copied.clear()
    ember.load(_appending_loop(reads_length=True)).run(_loop_feeds(50, res_0=[]))
    assert copied == list(range(50))


def _while_loop(stop: int) -> onnx.ModelProto:
    """A `while i < stop` loop as exporters write it: trip count INT64_MAX, the condition
    computed by the body."""
    limit = helper.make_node("Constant", [], ["stop"],
                             value=numpy_helper.from_array(np.array(stop, np.int64)))
    one = helper.make_node("Constant", [], ["one"],
                           value=numpy_helper.from_array(np.ones(1, np.float32)))
    step = helper.make_node("Constant", [], ["step"],
                            value=numpy_helper.from_array(np.array(1, np.int64)))
    return _loop_model([limit, one, step, helper.make_node("Add", ["i", "step"], ["next"]),
                        helper.make_node("Less", ["next", "stop"], ["cond_out"]),
                        helper.make_node("Add", ["y", "one"], ["y_out"]),
                        helper.make_node("Identity", ["y_out"], ["scan"])],
                       [("y", "y_out", "res_y", _TENSOR)], [("scan", "res_scan")])


def test_while_loop_with_int64_max_trip_count_runs_as_onnxruntime():
    model, feeds = _while_loop(300), _loop_feeds(2**63 - 1, res_y_0=_F32(0))
    got = ember.load(model, max_tensor_bytes=1 << 20).run(feeds)
    for name, want in zip(["res_y", "res_scan"], _ort(model, feeds)):
        np.testing.assert_array_equal(got[name], want)


def test_loop_iteration_limit_is_overridable(monkeypatch):
    model, feeds = _while_loop(300), _loop_feeds(2**63 - 1, res_y_0=_F32(0))
    monkeypatch.setenv("EMBER_MAX_LOOP_ITERATIONS", "100")
    sess = ember.load(model)
    with pytest.raises(ResourceLimitError, match=r"'loop' \(Loop.*has run 100 iterations and "
                                                 r"its condition still holds.*limit of 100"):
        sess.run(feeds)
    monkeypatch.setenv("EMBER_MAX_LOOP_ITERATIONS", "300")
    assert sess.run(feeds)["res_scan"].shape == (300, 1)
    monkeypatch.setenv("EMBER_MAX_LOOP_ITERATIONS", "many")
    with pytest.raises(ember.EmberError, match="EMBER_MAX_LOOP_ITERATIONS must be a positive"):
        sess.run(feeds)


def test_loop_without_trip_count_or_changing_condition_is_refused():
    model = _loop_model([_PASS_COND, helper.make_node("Identity", ["y"], ["y_out"])],
                        [("y", "y_out", "res_y", _TENSOR)], trips_as_input=False)
    with pytest.raises(ember.InvalidModelError, match="Loop node 'loop'.*would never end"):
        ember.load(model).run({"cond": np.array(True), "res_y_0": _F32(1)})
    # a false condition never enters the loop
    got = ember.load(model).run({"cond": np.array(False), "res_y_0": _F32(1)})["res_y"]
    np.testing.assert_array_equal(got, _ort(model, {"cond": np.array(False),
                                                    "res_y_0": _F32(1)})[0])


# --------------------------------------------------------------------------------------------
# TfIdfVectorizer's max_skip_count (fuzz case: 2**62)

def _tfidf(max_skip_count: int) -> onnx.ModelProto:
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="tfidf", mode="TF",
                            min_gram_length=2, max_gram_length=2, max_skip_count=max_skip_count,
                            ngram_counts=[0, 4], ngram_indexes=[0, 1, 2, 3, 4, 5, 6],
                            pool_int64s=[2, 3, 5, 4, 5, 6, 7, 8, 6, 7])
    return _model([node], [_info("x", TP.INT32, [2, 6])], [_info("y")], opset=9)


def test_tfidf_huge_skip_count_is_clamped_to_the_row():
    x = np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], np.int32)
    out = _isolated(f"""
        import numpy as np, onnx, ember
        model = onnx.load_from_string({_tfidf(2**62).SerializeToString()!r})
        print(ember.load(model).run({{"x": np.array({x.tolist()}, np.int32)}})["y"].tolist())
    """, timeout=60)
    # a skip of the row's length or more adds nothing: onnxruntime with 6 says what 2**62 does
    assert out.strip() == str(_ort(_tfidf(6), {"x": x})[0].tolist())


def test_tfidf_negative_skip_count_is_refused_at_load():
    with pytest.raises(ember.InvalidModelError, match=r"TfIdfVectorizer node 'tfidf': "
                                                      r"max_skip_count must be >= 0"):
        ember.load(_tfidf(-1))


# --------------------------------------------------------------------------------------------
# Transpose's perm (fuzz case: 2**63-1 in a pair of Transposes the simplifier merges)

def _two_transposes(outer_perm) -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3], name="inner"),
             helper.make_node("Transpose", ["t"], ["y"], perm=outer_perm, name="outer")]
    return _model(nodes, [_info("x", TP.FLOAT, [2, 3, 4, 5])], [_info("y")])


@pytest.mark.parametrize("perm, simplify", [
    ([2**63 - 1, 1, 3, 2], True), ([2**63 - 1, 1, 3, 2], False),
    ([3, 0, 1, 1], True), ([1, 0, 2, -3], True),
    ([0, 0, 1, 2], False), ([-1, 0, 1, 2], False), ([0, 1, 2, 4], False),
    # sorted but no permutation: the noop pass once took these for the identity and dropped them
    ([0, 0, 1, 2], True), ([0, 1, 2, 4], True)])
def test_transpose_perm_that_is_not_a_permutation_is_refused_at_load(perm, simplify):
    with pytest.raises(ember.InvalidModelError, match=r"Transpose node 'outer': perm .* is not "
                                                      r"a permutation of 0\.\.3"):
        ember.load(_two_transposes(perm), simplify=simplify)


def test_transpose_perm_of_the_wrong_rank_fails_at_run():
    model = _model([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0], name="t")],
                   [_info("x", TP.FLOAT, None)], [_info("y")])
    with pytest.raises(ember.InvalidModelError, match=r"'t'.*perm \[1, 0\] has 2 entries for "
                                                      r"a tensor of rank 3"):
        ember.load(model).run({"x": np.ones((1, 2, 3), np.float32)})


def test_merged_transposes_run_as_onnxruntime():
    model = _two_transposes([3, 1, 0, 2])
    feeds = {"x": np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)}
    sess = ember.load(model)
    assert [n.op_type for n in sess.model.graph.nodes] == ["Transpose"]  # merged into one
    np.testing.assert_array_equal(sess.run(feeds)["y"], _ort(model, feeds)[0])


# --------------------------------------------------------------------------------------------
# errors of the op's own, not wrapped Python exceptions (fuzz cases)

def _own_error(exc_info) -> str:
    """The message of an ember error that wraps no plain Python exception."""
    exc = exc_info.value
    assert exc.__cause__ is None and exc.__context__ is None, repr(exc.__cause__ or
                                                                   exc.__context__)
    return str(exc)


def test_scan_whose_body_does_not_fit_is_refused_at_load():
    body = helper.make_graph([], "empty", [], [])
    scan = helper.make_node("Scan", ["", "s0", "x"], ["s", "y"], body=body, num_scan_inputs=1,
                            name="scan")
    model = _model([scan], [_info("s0", TP.FLOAT, [1, 2]), _info("x", TP.FLOAT, [1, 3, 2])],
                   [_info("s"), _info("y")], opset=8)
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model, simplify=False)
    assert "Scan node 'scan': body takes 0 inputs, expected 2" in _own_error(exc)


def test_inputs_that_do_not_broadcast_are_the_ops_error():
    model, feeds = _one_op("Add", ["a", "b"], [np.ones(4, np.float32), np.ones(0, np.float32)])
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model).run(feeds)
    assert "Add node 'big': input shapes (4,), (0,) do not broadcast together" in _own_error(exc)
    model, feeds = _one_op("Where", ["c", "a", "b"], [np.ones(3, bool), np.ones(3, np.float32),
                                                      np.ones(2, np.float32)])
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model).run(feeds)
    assert "(3,), (3,), (2,) do not broadcast" in _own_error(exc)


def test_col2im_block_of_zero_is_the_ops_error():
    values = [np.ones((1, 5, 5), np.float32), _I64(5, 5), _I64(1, 0)]
    model, feeds = _one_op("Col2Im", ["x", "image", "block"], values)
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model).run(feeds)
    assert "Col2Im node 'big': block_shape [1, 0] must be positive" in _own_error(exc)
    values[2] = _I64(1, 5)  # a valid block: the same kernel agrees with onnxruntime
    model, feeds = _one_op("Col2Im", ["x", "image", "block"], values)
    np.testing.assert_allclose(ember.load(model).run(feeds)["y"], _ort(model, feeds)[0])


def test_reshape_with_a_dim_whose_product_overflows_int64():
    model, feeds = _one_op("Reshape", ["x", "shape"],
                           [np.ones((2, 3, 4), np.float32), _I64(2, -1, 2**63 - 1)])
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model).run(feeds)
    assert "cannot reshape a tensor of shape (2, 3, 4) to [2, -1, 9223372036854775807]" in \
        _own_error(exc)


def test_regex_pattern_that_is_not_utf8_is_the_ops_error():
    model = _regex_model("placeholder")
    model.graph.node[0].attribute[0].s = b"www\\.[\\w.-]+\xae\\bcom\\b"  # a lone continuation byte
    with pytest.raises(ember.InvalidModelError) as exc:
        ember.load(model)
    assert "RegexFullMatch node 're': pattern" in _own_error(exc)
    assert "is not valid UTF-8" in str(exc.value)


# --------------------------------------------------------------------------------------------
# the CLI: `check --chunk`, `simplify --backend / --dim`

@pytest.mark.parametrize("chunk", ["0", "-5"])
def test_cli_check_chunk_must_be_positive(chunk, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["check", MLP, "--chunk", chunk, "--bisect"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --chunk: must be at least 1, got {chunk}" in err.splitlines()[-1]


@pytest.mark.parametrize("args, expected", [
    (["--backend", "nope"], "--backend 'nope': unknown backend; choose one of cpu"),
    (["--dim", "batch=-1"], "--dim batch=-1: the size must be an integer >= 0")])
def test_cli_simplify_checks_its_arguments(args, expected, tmp_path, capsys):
    out = tmp_path / "s.onnx"
    assert cli_main(["simplify", MLP, "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ember: error:") and expected in err, err
    assert not out.exists()  # refused before anything was simplified or written


@pytest.mark.parametrize("bad", [-1, 8])
def test_rotary_position_ids_out_of_the_caches_range_are_refused(bad):
    """RotaryEmbedding indexes its cos/sin caches by position_ids: one outside their rows is
    the op's own error naming the range, not an IndexError from numpy."""
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"],
                            num_heads=2, name="rope")
    model = _model([node], [_info("x", TP.FLOAT, [1, 3, 8]), _info("cos", TP.FLOAT, [8, 2]),
                            _info("sin", TP.FLOAT, [8, 2]), _info("pos", TP.INT64, [1, 3])],
                   [_info("y")], opset=23)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 3, 8)).astype(np.float32),
             "cos": rng.standard_normal((8, 2)).astype(np.float32),
             "sin": rng.standard_normal((8, 2)).astype(np.float32),
             "pos": np.array([[0, 1, 2]], np.int64)}
    session = ember.load(model)
    np.testing.assert_allclose(session.run(feeds)["y"], _ort(model, feeds)[0], rtol=1e-5,
                               atol=1e-6)
    feeds["pos"] = np.array([[0, bad, 2]], np.int64)
    with pytest.raises(ember.EmberError, match=r"'rope'.*position_ids must lie in \[0, 8\)"):
        session.run(feeds)
