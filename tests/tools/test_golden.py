"""`ember check` (ember.golden): references, tolerances, report, exit codes and bisect.

The wrong kernel is a CPU Tanh that adds a shift, swapped into the op registry for one test at a
time; onnxruntime and onnx's ReferenceEvaluator are the independent oracles.
"""
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ember import golden
from ember.cli import main as cli_main
from ember.errors import EmberError
from ember.importer import import_model
from ember.ops import registry
from ember.runtime.backends import get_backend
from ember.runtime.session import Session

FAULTY = "faulty_tanh"
BLOCKS = 13  # 4 nodes each: 52 nodes, plus the output Identity nodes


def build_chain_model(path) -> str:
    """x[4,16] -> 13 x (MatMul, Add, activation, Mul): Sigmoid everywhere except one Tanh (the
    node whose kernel the tests break). `early` is taken before it, `y` at the end."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i in range(BLOCKS):
        w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
        b = rng.standard_normal(16).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}"),
                  numpy_helper.from_array(np.array(1.5, np.float32), f"s{i}")]
        act = "Tanh" if i == 8 else "Sigmoid"
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"mm{i}"], name=f"matmul_{i}"),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"add_{i}"),
                  helper.make_node(act, [f"add{i}"], [f"act{i}"],
                                   name=FAULTY if act == "Tanh" else f"sigmoid_{i}"),
                  helper.make_node("Mul", [f"act{i}", f"s{i}"], [f"h{i}"], name=f"scale_{i}")]
        h = f"h{i}"
    nodes += [helper.make_node("Identity", ["h4"], ["early"], name="early_out"),
              helper.make_node("Identity", [h], ["y"], name="final_out")]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("early", TensorProto.FLOAT, ["batch", 16]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_chain_model(tmp_path_factory.mktemp("golden") / "chain.onnx")


def break_tanh(monkeypatch, shift: float = 0.1, backend: str = "cpu") -> None:
    """Register a Tanh kernel for `backend` that is off by `shift` (for this test only)."""
    correct = registry.lookup("", "Tanh", 17, backend)

    class WrongTanh(correct):
        def run(self, x):
            return super().run(x) + np.float32(shift)

    table = {v: WrongTanh for v in registry._TABLE[(backend, "", "Tanh")]}
    monkeypatch.setitem(registry._TABLE, (backend, "", "Tanh"), table)


def with_shifted_tanh(path, shift: float, folder) -> str:
    """The model with `Tanh(a) + shift` in place of its Tanh, for onnxruntime to run."""
    model = onnx.load(path)
    nodes = list(model.graph.node)
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Tanh")
    tanh = nodes[at]
    out = tanh.output[0]
    tanh.output[0] = out + "_raw"
    model.graph.initializer.append(numpy_helper.from_array(np.array(shift, np.float32), "shift"))
    nodes.insert(at + 1, helper.make_node("Add", [out + "_raw", "shift"], [out]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    shifted = str(folder / "shifted.onnx")
    onnx.save(model, shifted)
    return shifted


def ort_outputs(path, feeds) -> dict:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def run_cli(args, tmp_path, capsys):
    """`ember check` in this process (so a patched registry applies); returns (rc, report, out)."""
    report = tmp_path / "report.json"
    rc = cli_main(["check", *map(str, args), "--json", str(report)])
    out = capsys.readouterr()
    data = json.loads(report.read_text()) if report.exists() else None
    return rc, data, out


# -- done when: bisect names exactly the node with the wrong kernel, in one command -------------

@pytest.mark.parametrize("ref,chunk", [("onnxruntime", 7), ("onnx", 200)])
def test_bisect_names_the_node_with_the_wrong_kernel(model_path, tmp_path, capsys, monkeypatch,
                                                      ref, chunk):
    assert sum(1 for _ in onnx.load(model_path).graph.node) >= 50
    break_tanh(monkeypatch)
    rc, report, out = run_cli([model_path, "--backend", "cpu", "--ref", ref, "--bisect",
                               "--chunk", chunk, "--dim", "batch=4", "--no-simplify"],
                              tmp_path, capsys)
    assert rc == 1
    finding = report["backends"][0]["bisect"]
    assert finding["found"] and finding["node_name"] == FAULTY and finding["op_type"] == "Tanh"
    assert finding["position"] == 8 * 4 + 3  # in topological order
    assert [i["name"] for i in finding["inputs"]] == ["add8"]
    assert finding["inputs"][0]["status"] == "agrees"
    diverged = finding["outputs"][0]
    assert diverged["name"] == "act8" and not diverged["passed"]
    assert diverged["max_abs_error"] == pytest.approx(0.1, abs=1e-5)
    assert f"first divergence at node '{FAULTY}' (Tanh, opset 17)" in out.out
    outputs = {o["name"]: o["passed"] for o in report["backends"][0]["outputs"]}
    assert outputs == {"early": True, "y": False}
    # run alone on the reference's inputs, the broken node is the one off by the shift
    added = finding["added_error"]
    assert added["node_name"] == FAULTY and added["simplifier"] == ""
    assert added["isolated_max_abs_error"] == pytest.approx(0.1, abs=1e-5)
    assert added["next_ulps"] <= 2
    assert f"bisect: error grows most at node '{FAULTY}' (Tanh, opset 17)" in out.out


def test_bisect_opencl_against_cpu_names_the_wrong_device_kernel(model_path, tmp_path, capsys,
                                                                 monkeypatch):
    """The issue's case: a wrong kernel on one device backend, another ember backend as the
    reference, both plans run in lockstep."""
    try:
        get_backend("opencl")
    except (EmberError, ImportError) as exc:
        pytest.skip(f"opencl backend unavailable: {exc}")
    if registry.lookup("", "Tanh", 17, "opencl") is None:
        pytest.skip("no OpenCL Tanh kernel to break")
    break_tanh(monkeypatch, backend="opencl")
    rc, report, out = run_cli([model_path, "--backend", "opencl", "--ref", "cpu", "--bisect",
                               "--dim", "batch=4", "--no-simplify"], tmp_path, capsys)
    assert rc == 1, out.out + out.err
    finding = report["backends"][0]["bisect"]
    assert finding["found"] and finding["node_name"] == FAULTY
    assert finding["inputs"][0]["status"] == "agrees"
    assert finding["outputs"][0]["max_abs_error"] == pytest.approx(0.1, abs=1e-5)
    # isolated on the device: the reference's values uploaded for the broken OpenCL kernel
    assert finding["added_error"]["node_name"] == FAULTY
    assert finding["added_error"]["isolated_max_abs_error"] == pytest.approx(0.1, abs=1e-5)


def test_bisect_in_lockstep_with_another_ember_plan(model_path):
    """Against an ember backend both plans run side by side; break one kernel instance of the
    candidate only (the reference plan binds its own)."""
    ir = import_model(model_path)
    candidate, reference = Session(ir, "cpu"), Session(ir, "cpu")
    step = next(s for s in candidate._plan.steps if s.node.name == FAULTY)
    step.kernel.run = lambda x: np.tanh(x) * np.float32(0.5)
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)}
    finding = golden.find_divergence(candidate, reference, feeds, golden.Tolerances())
    assert finding.found and finding.node_name == FAULTY
    assert finding.inputs[0].status == "agrees"
    assert finding.output_stats[0]["candidate"].shape == [3, 16]
    candidate_stats, reference_stats = finding.output_stats[0].values()
    assert candidate_stats.max == pytest.approx(reference_stats.max * 0.5, rel=1e-5)


def test_bisect_finds_nothing_when_backends_agree(model_path, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((6, 16), np.float32))
    rc, report, out = run_cli([model_path, "--ref", "cpu", "--bisect", "--no-simplify", "-i",
                               f"x={tmp_path / 'x.npy'}"], tmp_path, capsys)
    assert rc == 0 and report["inputs"]["x"]["shape"] == [6, 16]
    assert report["backends"][0]["bisect"]["found"] is False
    assert report["backends"][0]["bisect"]["nodes_compared"] == BLOCKS * 4 + 2
    assert "no node diverges" in out.out
    assert report["backends"][0]["bisect"]["added_error"]["isolated_ulps"] == 0  # same kernels
    assert "bisect: no node adds more than rounding" in out.out


# -- recorded references ----------------------------------------------------------------------

def test_save_golden_then_replay_without_a_reference_runtime(model_path, tmp_path, capsys,
                                                              monkeypatch):
    golden_file = tmp_path / "golden.npz"
    rc, _, _ = run_cli([model_path, "--ref", "onnxruntime", "--save-golden", golden_file,
                        "--dim", "batch=5", "--seed", "3"], tmp_path, capsys)
    assert rc == 0
    with np.load(golden_file) as data:
        recorded = {k: data[k] for k in data.files}
    assert sorted(recorded) == ["input:x", "output:early", "output:y"]
    expected = ort_outputs(model_path, {"x": recorded["input:x"]})
    np.testing.assert_array_equal(recorded["output:y"], expected["y"])

    # No reference runtime importable from here on.
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    monkeypatch.setitem(sys.modules, "onnx.reference", None)
    rc, report, out = run_cli([model_path, "--ref", golden_file], tmp_path, capsys)
    assert rc == 0, out.out
    assert report["passed"] and report["inputs"]["x"]["shape"] == [5, 16]
    rc, _, out = run_cli([model_path, "--ref", "onnxruntime"], tmp_path, capsys)
    assert rc == 2 and "needs the onnxruntime package" in out.err


def test_onnx_test_directory_reference(model_path, tmp_path, capsys, monkeypatch):
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)}
    expected = ort_outputs(model_path, feeds)
    data_set = tmp_path / "case" / "test_data_set_0"
    data_set.mkdir(parents=True)
    (data_set / "input_0.pb").write_bytes(
        numpy_helper.from_array(feeds["x"], "x").SerializeToString())
    for k, name in enumerate(["early", "y"]):
        (data_set / f"output_{k}.pb").write_bytes(
            numpy_helper.from_array(expected[name], name).SerializeToString())
    rc, report, _ = run_cli([model_path, "--ref", tmp_path / "case"], tmp_path, capsys)
    assert rc == 0 and report["inputs"]["x"]["shape"] == [2, 16]
    break_tanh(monkeypatch)
    rc, report, _ = run_cli([model_path, "--ref", data_set, "--no-simplify"], tmp_path, capsys)
    assert rc == 1
    rc, _, out = run_cli([model_path, "--ref", data_set, "--bisect"], tmp_path, capsys)
    assert rc == 2 and "--bisect needs a reference that can run the model" in out.err


# -- tolerances, report, exit codes -----------------------------------------------------------

def test_per_output_tolerance_and_failing_output_statistics(model_path, tmp_path, capsys,
                                                            monkeypatch):
    shift = 0.05
    break_tanh(monkeypatch, shift)
    feeds_file = tmp_path / "feeds.npz"
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    np.savez(feeds_file, x=x)
    args = [model_path, "--inputs", feeds_file, "--atol", "1e-4", "--rtol", "0",
            "--atol", "early:1e-3", "--no-simplify"]
    rc, report, out = run_cli(args, tmp_path, capsys)
    assert rc == 1
    y = next(o for o in report["backends"][0]["outputs"] if o["name"] == "y")
    early = next(o for o in report["backends"][0]["outputs"] if o["name"] == "early")
    assert early["passed"] and not y["passed"]
    # Oracle: onnxruntime on the correct model, and on a copy whose Tanh adds the same shift.
    expected = ort_outputs(model_path, {"x": x})["y"]
    shifted = ort_outputs(with_shifted_tanh(model_path, shift, tmp_path), {"x": x})["y"]
    err = np.abs(shifted.astype(np.float64) - expected)
    assert y["candidate_dtype"] == y["reference_dtype"] == "float32"
    assert y["candidate_shape"] == y["reference_shape"] == [4, 16]
    near_atol = (err > 0.9e-4) & (err < 1.1e-4)
    assert not near_atol.any()  # so float32 noise cannot move an element across the tolerance
    assert y["max_abs_error"] == pytest.approx(err.max(), rel=1e-2)
    # several elements share the largest error to within float32 noise (the shift passes
    # through the same ops), so the reported one must be among them, not argmax's first
    at = tuple(y["max_abs_error_at"])
    assert err[at] >= err.max() - 1e-6
    assert y["reference_at_max"] == pytest.approx(float(expected[at]), rel=1e-6)
    assert y["mean_abs_error"] == pytest.approx(err.mean(), rel=1e-2)
    assert y["max_rel_error"] == pytest.approx((err / np.abs(expected)).max(), rel=1e-2)
    assert y["total"] == 64 and y["mismatched"] == np.count_nonzero(err > 1e-4) > 0
    assert y["mismatch_share"] == y["mismatched"] / 64
    assert y["min_atol"] == pytest.approx(y["max_abs_error"])
    assert "FAIL: 1 of 2 output(s) out of tolerance: y on cpu" in out.out
    assert "would pass with atol >=" in out.out

    rc, report, _ = run_cli([*args, "--atol", f"y:{shift}"], tmp_path, capsys)
    assert rc == 0 and [o["atol"] for o in report["backends"][0]["outputs"]] == [1e-3, shift]


@pytest.mark.parametrize("args,message", [
    (["--ref", "nowhere.npz"], "recorded reference not found"),
    (["--ref", "tensorflow"], "unknown reference"),
    (["--atol", "y:abc"], "--atol expects VALUE or OUTPUT:VALUE"),
    (["--atol", "nope:1e-3"], "tolerance given for unknown value(s) nope"),
    (["--range", "x=5,1"], "--range expects NAME=LO,HI"),
    (["--backend", "tpu"], "unknown backend 'tpu'"),
])
def test_user_errors_exit_2(model_path, tmp_path, capsys, args, message):
    rc, report, out = run_cli([model_path, *args], tmp_path, capsys)
    assert rc == 2 and report is None
    assert message in out.err


def test_python_api_returns_the_report(model_path):
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    report = golden.check(model_path, backend="cpu", ref="onnx", inputs={"x": x},
                          atol={"": 1e-5, "y": 1e-4}, mode="max")
    assert isinstance(report, golden.CheckReport) and report.passed and report.exit_code == 0
    assert [c.name for c in report.backends[0].outputs] == ["early", "y"]
    assert report.backends[0].outputs[1].atol == 1e-4


def test_integer_inputs_take_ranges(tmp_path):
    """Token ids must stay inside the embedding table: --range bounds them."""
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"])], "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(table, "table")])
    path = str(tmp_path / "emb.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    save = tmp_path / "g.npz"
    assert cli_main(["check", path, "--dim", "n=300", "--range", "ids=40,50",
                        "--save-golden", str(save)]) == 0
    with np.load(save) as data:
        ids, emb = data["input:ids"], data["output:emb"]
    assert ids.shape == (300,) and ids.min() >= 40 and ids.max() < 50
    np.testing.assert_array_equal(emb, table[ids])


def _bert_like_embeddings(path) -> str:
    """A BERT's embeddings: word ids into 50 rows, token types into 2 (axis 0), and position
    ids into the 3 columns of a transposed table (a Gather on axis 1)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["words", "ids"], ["w"]),
         helper.make_node("Gather", ["types", "token_type_ids"], ["t"]),
         helper.make_node("Gather", ["positions_t", "pos"], ["p_t"], axis=1),
         helper.make_node("Transpose", ["p_t"], ["p"], perm=[1, 2, 0]),
         helper.make_node("Add", ["w", "t"], ["wt"]),
         helper.make_node("Add", ["wt", "p"], ["emb"])], "embeddings",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", 16])
         for n in ("ids", "token_type_ids", "pos")],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", 16, 8])],
        [numpy_helper.from_array(rng.standard_normal((50, 8)).astype(np.float32), "words"),
         numpy_helper.from_array(rng.standard_normal((2, 8)).astype(np.float32), "types"),
         numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32),
                                 "positions_t")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_index_inputs_stay_inside_their_tables(tmp_path):
    """Random token types and positions stay inside their tables without --range (the default,
    [0, 10), made onnxruntime refuse a BERT's token types before); word ids keep it."""
    from ember.golden.inputs import index_bounds
    path = _bert_like_embeddings(tmp_path / "emb.onnx")
    assert index_bounds(import_model(path).graph) == {"ids": 50, "token_type_ids": 2, "pos": 3}
    save = tmp_path / "g.npz"
    assert cli_main(["check", path, "--ref", "onnxruntime", "--dim", "b=64",
                     "--save-golden", str(save)]) == 0
    with np.load(save) as data:
        feeds = {k[6:]: v for k, v in data.items() if k.startswith("input:")}
    assert set(np.unique(feeds["token_type_ids"])) == {0, 1}
    assert set(np.unique(feeds["pos"])) == {0, 1, 2}
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() == 9   # the default range
    # a range given on the command line wins: token types of 2 are off the table, and the
    # reference refuses them (exit 2)
    assert cli_main(["check", path, "--ref", "onnx", "--range", "token_type_ids=2,3"]) == 2


def test_dimension_expressions_size_random_inputs(tmp_path):
    """A decoder step's mask is declared [batch, past + 1] (as torch.onnx names it) beside a
    cache of [batch, past, 4]: random inputs give it past + 1 columns, so the mask fits the
    cache with the new step appended (with every symbolic dim at 1 both were 1 before)."""
    from ember.golden.inputs import dim_size
    graph = helper.make_graph(
        [helper.make_node("Concat", ["past", "new"], ["present"], axis=1),
         helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
         helper.make_node("Mul", ["present", "mask3"], ["y"])], "step",
        [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", "past", 4]),
         helper.make_tensor_value_info("new", TensorProto.FLOAT, ["batch", 1, 4]),
         helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "past + 1"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "past + 1", 4])],
        [numpy_helper.from_array(np.array([2], np.int64), "last")])
    path = str(tmp_path / "step.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    save = tmp_path / "g.npz"
    assert cli_main(["check", path, "--ref", "onnxruntime", "--dim", "past=6", "--dim", "batch=2",
                     "--save-golden", str(save)]) == 0
    with np.load(save) as data:
        assert data["input:mask"].shape == (2, 7) and data["output:y"].shape == (2, 7, 4)
    assert cli_main(["check", path, "--ref", "onnxruntime"]) == 0    # past 1, mask 2
    assert [dim_size(d, {"seq": 5}) for d in ("2*seq - 1", "seq", "other", 3)] == [9, 5, 1, 3]
    # a dimension name is parsed, never run: anything but sums of products is a plain symbol
    assert dim_size("__import__('os').getpid()", {}) == 1



def test_a_random_0d_bool_input_runs_against_onnxruntime(tmp_path):
    """A 0-d bool input (a flag) drawn at random is a 0-d array, as onnxruntime takes it: a
    numpy scalar (what `rng.random(()) < 0.5` gives) it refused. 0-d outputs compare too."""
    from ember.golden.inputs import make_inputs
    from ember.runtime.session import load
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["minus_x"]),
         helper.make_node("Where", ["flag", "x", "minus_x"], ["y"]),
         helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0),
         helper.make_node("Not", ["flag"], ["unflagged"])], "flagged",
        [helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("unflagged", TensorProto.BOOL, [])])
    path = str(tmp_path / "flag.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    flag = make_inputs(load(path).inputs, seed=0)["flag"]
    assert isinstance(flag, np.ndarray) and flag.shape == () and flag.dtype == bool
    save, flags = tmp_path / "g.npz", set()
    for seed in ("0", "1", "2", "3"):
        assert cli_main(["check", path, "--ref", "onnxruntime", "--seed", seed,
                         "--save-golden", str(save)]) == 0
        with np.load(save) as data:
            assert data["input:flag"].shape == () and data["input:flag"].dtype == bool
            flags.add(bool(data["input:flag"]))
            want = data["input:x"] if data["input:flag"] else -data["input:x"]
            np.testing.assert_array_equal(data["output:y"], want)
            assert data["output:total"].shape == data["output:unflagged"].shape == ()
    assert flags == {False, True}
    report = golden.check(path, "cpu", ref="onnxruntime", bisect=True)
    assert report.passed and [c.total for c in report.backends[0].outputs] == [3, 1, 1]

# -- comparing values (hand-computed expectations) --------------------------------------------

def test_compare_elementwise_statistics():
    ref = np.array([1.0, 2.0, 0.0, -4.0], np.float32)
    cand = np.array([1.0, 2.1, 0.05, -4.0], np.float32)
    c = golden.compare_values("v", cand, ref, golden.Tolerance(0.01, 0.01))
    assert not c.passed and c.mismatched == 2 and c.total == 4
    assert c.max_abs_error == pytest.approx(0.1, rel=1e-5) and c.max_abs_error_at == [1]
    assert c.max_rel_error == np.inf  # 0.05 against 0
    assert c.mean_abs_error == pytest.approx(0.15 / 4, rel=1e-5)
    assert c.min_atol == pytest.approx(0.08, rel=1e-4)  # 0.1 - 0.01 * 2 > 0.05 - 0
    assert c.min_rtol == np.inf


def test_compare_max_and_mean_modes():
    ref = np.array([1.0, 1.0, 1.0, 1.0])
    cand = np.array([1.0, 1.0, 1.0, 1.4])
    tol = golden.Tolerance(0.2, 0.0)
    assert not golden.compare_values("v", cand, ref, tol, "max").passed
    mean = golden.compare_values("v", cand, ref, tol, "mean")
    assert mean.passed and mean.min_atol == pytest.approx(0.1)


def test_nan_inf_must_match_and_integers_are_exact():
    tol = golden.Tolerance(1.0, 1.0)
    same = np.array([np.nan, np.inf, -np.inf, 1.0])
    assert golden.compare_values("v", same.copy(), same, tol).passed
    flipped = np.array([np.nan, -np.inf, -np.inf, 1.0])
    c = golden.compare_values("v", flipped, same, tol)
    assert not c.passed and c.mismatched == 1 and "NaN/Inf" in c.note and c.min_atol is None
    assert not golden.compare_values("v", np.array([1.0, 2.0]), np.array([np.nan, 2.0]),
                                     tol).passed
    big = np.array([2**60 + 1], np.int64)
    assert not golden.compare_values("i", big, big - 1, golden.Tolerance(10.0, 1.0)).passed
    assert not golden.compare_values("b", np.array([True]), np.array([False]), tol).passed
    shape = golden.compare_values("s", np.zeros(3, np.float32), np.zeros(4, np.float32), tol)
    assert not shape.passed and shape.note == "shapes differ"
    dtype = golden.compare_values("d", np.zeros(3, np.float64), np.zeros(3, np.float32), tol)
    assert not dtype.passed and "dtypes differ" in dtype.note


def test_report_on_an_empty_output_says_so(tmp_path):
    """An output with no elements: nothing to compare, said in words (not "at None")."""
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "start", "end"], ["y"], name="empty")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([2], np.int64), "start"),
         numpy_helper.from_array(np.array([2], np.int64), "end")])
    path = tmp_path / "empty.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    report = golden.check(str(path), "cpu", ref="onnxruntime")
    text = golden.format_report(report)
    assert report.passed
    assert "no elements to compare" in text and "None" not in text


def _tol(atol=1e-4, rtol=1e-3, **kw):
    return golden.Tolerance(atol, rtol, **kw)


def test_error_statistics_modes():
    """median / quantile:Q / mean pass or fail on the statistic, where max would not."""
    ref = np.linspace(1, 2, 1000).astype(np.float32)
    cand = ref.copy()
    cand[:100] += 0.5                                    # 10% of the elements far off
    for mode, passes in [("median", True), ("quantile:0.85", True), ("quantile:0.95", False),
                         ("max", False), ("elementwise", False)]:
        got = golden.compare_values("y", cand, ref, _tol(1e-3, 0), mode)
        assert got.passed is passes, mode
    got = golden.compare_values("y", cand, ref, _tol(1e-3, 0), "quantile:0.95")
    assert got.statistic == pytest.approx(float(np.quantile(np.abs(cand - ref), 0.95)))


def test_distance_and_similarity_modes():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(4096).astype(np.float32)
    noise = (rng.standard_normal(4096) * 1e-3).astype(np.float32)
    cand = ref + noise
    norm_ratio = np.linalg.norm(noise.astype(np.float64)) / np.linalg.norm(ref.astype(np.float64))
    assert golden.compare_values("y", cand, ref, _tol(0, norm_ratio * 1.01), "l2").passed
    assert not golden.compare_values("y", cand, ref, _tol(0, norm_ratio * 0.99), "l2").passed
    # cosine: a scaled copy is perfectly similar; an orthogonal vector is not
    assert golden.compare_values("y", 3 * ref, ref, _tol(0, 1e-6), "cosine").passed
    ortho = np.zeros(4, np.float32), np.zeros(4, np.float32)
    ortho[0][0], ortho[1][1] = 1, 1
    assert not golden.compare_values("y", ortho[0], ortho[1], _tol(0, 0.5), "cosine").passed
    # psnr: 20 log10(peak / rms)
    psnr = 20 * np.log10(np.abs(ref).max() / np.sqrt(np.mean(noise.astype(np.float64) ** 2)))
    got = golden.compare_values("y", cand, ref, _tol(), f"psnr:{psnr - 1}")
    assert got.passed and got.statistic == pytest.approx(psnr, rel=1e-4)
    assert not golden.compare_values("y", cand, ref, _tol(), f"psnr:{psnr + 1}").passed


def test_topk_and_validate():
    ref = np.array([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 0.6, 0.1]], np.float32)
    swapped = ref.copy()
    swapped[0, [2, 3]] = swapped[0, [3, 2]]               # rank 2 and 3 swap in row 0
    loose = _tol(1, 1)
    assert golden.compare_values("y", swapped, ref, loose).passed
    assert golden.compare_values("y", swapped, ref, _tol(1, 1, topk=1)).passed
    failed = golden.compare_values("y", swapped, ref, _tol(1, 1, topk=2))
    assert not failed.passed and "top-2" in failed.note
    nan = ref.copy()
    nan[1, 1] = np.nan
    assert golden.compare_values("y", nan, nan, loose).passed       # NaN meets NaN
    flagged = golden.compare_values("y", nan, nan, _tol(1, 1, validate=True))
    assert not flagged.passed and "--validate" in flagged.note


@pytest.mark.parametrize("mode", ["quantile", "quantile:1.5", "psnr:x", "l3", "max:2"])
def test_bad_check_modes_exit_2(mode, tmp_path, capsys):
    path = build_chain_model(tmp_path / "chain.onnx")
    assert cli_main(["check", path, "--check", mode]) == 2
    assert "--check" in capsys.readouterr().err


def test_fail_fast_and_timing(model_path, monkeypatch):
    """--fail-fast: no backend runs after the first that fails; --iterations: a latency line
    per backend that ran."""
    report = golden.check(model_path, "cpu,cpu", ref="onnxruntime", iterations=3, warm_up=1)
    assert report.passed and len(report.backends) == 2
    assert all(b.timing["iterations"] == 3 and b.timing["median_ms"] > 0
               for b in report.backends)
    assert "latency: median" in golden.format_report(report)
    break_tanh(monkeypatch)
    assert len(golden.check(model_path, "cpu,cpu", ref="onnxruntime").backends) == 2
    failing = golden.check(model_path, "cpu,cpu", ref="onnxruntime", fail_fast=True,
                           simplify=False)
    assert not failing.passed and len(failing.backends) == 1
    with pytest.raises(SystemExit):
        cli_main(["check", model_path, "--iterations", "-1"])


def test_marked_intermediates_are_compared(model_path, monkeypatch):
    """--mark NAME: the value is compared like an output, against onnxruntime exposing it;
    a broken kernel upstream of it shows there, and one downstream does not."""
    tanh = next(n for n in onnx.load(model_path).graph.node if n.name == FAULTY)
    before, after = tanh.input[0], tanh.output[0]    # the broken Tanh's input and output
    report = golden.check(model_path, "cpu", ref="onnxruntime", marks=[before, after],
                          simplify=False)
    marked = {c.name: c for c in report.backends[0].outputs if c.name.startswith("mark:")}
    assert set(marked) == {f"mark:{before}", f"mark:{after}"}
    assert all(c.passed for c in marked.values())
    break_tanh(monkeypatch)
    report = golden.check(model_path, "cpu", ref="onnxruntime", marks=[before, after],
                          simplify=False)
    marked = {c.name: c for c in report.backends[0].outputs if c.name.startswith("mark:")}
    assert marked[f"mark:{before}"].passed and not marked[f"mark:{after}"].passed
    with pytest.raises(EmberError, match="--mark: no node produces nope"):
        golden.check(model_path, "cpu", ref="onnxruntime", marks=["nope"])


def test_polygraphy_json_inputs_outputs_and_reference(model_path, tmp_path, monkeypatch):
    """Polygraphy's own JSON (its save_json / RunResults are the oracle of the format): its
    input sets feed `ember check`, ember's saved inputs and outputs load in Polygraphy, and
    its run results serve as the reference."""
    pg_json = pytest.importorskip("polygraphy.json")
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult

    rng = np.random.default_rng(3)
    sets = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(2)]
    inputs = str(tmp_path / "inputs.json")
    pg_json.save_json(sets, inputs)
    saved_in, saved_out = str(tmp_path / "ember_in.json"), str(tmp_path / "ember_out.json")
    assert cli_main(["check", model_path, "--load-inputs", inputs, "--save-inputs", saved_in,
                     "--save-outputs", saved_out]) == 0
    for mine, theirs in zip(pg_json.load_json(saved_in), sets):
        np.testing.assert_array_equal(mine["x"], theirs["x"])
    runner, iterations = RunResults.load(saved_out)[0]
    assert runner == "ember-cpu" and len(iterations) == 2
    for iteration, feeds in zip(iterations, sets):
        want = ort_outputs(model_path, feeds)
        for name in want:
            np.testing.assert_allclose(np.asarray(iteration[name]), want[name], rtol=1e-5,
                                       atol=1e-6)
    # onnxruntime's outputs recorded by Polygraphy's own classes, as the reference
    results = RunResults()
    results.append(("onnxrt-runner", [IterationResult(ort_outputs(model_path, f), 0.0,
                                                      "onnxrt-runner") for f in sets]))
    recorded = str(tmp_path / "ort_results.json")
    results.save(recorded)
    assert cli_main(["check", model_path, "--ref", recorded, "--load-inputs", inputs]) == 0
    break_tanh(monkeypatch)
    assert cli_main(["check", model_path, "--ref", recorded, "--load-inputs", inputs,
                     "--no-simplify"]) == 1


def test_polygraphy_json_refuses_what_is_not_arrays(model_path, tmp_path, capsys):
    import base64
    import io

    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    bad = tmp_path / "pickled.json"
    bad.write_text(json.dumps([{"x": {"array": base64.b64encode(pickled.getvalue()).decode(),
                                      "polygraphy_class": "ndarray"}}]))
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    for path in (bad, not_json):
        assert cli_main(["check", model_path, "--load-inputs", str(path)]) == 2
        assert "ember: error:" in capsys.readouterr().err
    assert cli_main(["check", model_path, "--ref", str(tmp_path / "none.json")]) == 2
