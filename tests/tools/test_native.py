"""Native modules (`ember convert`): generated packages compile, compute the executor's bits,
match onnxruntime, survive hostile names, call custom kernels, and the checked-in examples do
not drift. The whole node suite runs in benchmarks/native_suite.py; here a fixed sample."""
import ast
import io
import os
import py_compile
import re
import subprocess
import sys
import tokenize

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ember
from ember.native import Module, convert
from ember.native.safetensors import load_file, save_file
from ember.native.testing import as_list, identical, import_generated
from onnx_suites import light_models, load_case_dir, load_light_case, suite_case_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
XFAILS = os.path.join(REPO, "tests", "xfail_cpu.txt")


def convert_and_import(model_path, out_dir):
    convert(model_path, str(out_dir), progress=False)
    py_compile.compile(os.path.join(out_dir, "model.py"), doraise=True)
    return import_generated(str(out_dir))


def executor_outputs(model_path, feeds):
    session = ember.load(model_path, simplify=False)  # the module mirrors the imported graph
    result = session.run(feeds)
    return session, [result[o.name] for o in session.outputs]


def module_outputs(module, session, feeds):
    return as_list(module(*[feeds[i.name] for i in session.inputs if i.name in feeds]),
                   len(session.outputs))


# -- node suite: a deterministic sample, all control flow and sequence cases included ------
def _sample_cases():
    from onnx_suites import load_xfails

    skip = set(load_xfails(XFAILS))
    dirs = [d for d in suite_case_dirs("node") if os.path.basename(d) not in skip]
    special = re.compile(r"loop|scan|_if|sequence|optional|cast|quantize|string|float8|bfloat")
    return [d for i, d in enumerate(dirs) if i % 7 == 0 or special.search(os.path.basename(d))]


@pytest.mark.parametrize("case_dir", _sample_cases(), ids=os.path.basename)
def test_node_case_bit_identical(case_dir, tmp_path):
    case = load_case_dir(case_dir)
    module = convert_and_import(case.model_path, tmp_path).Model()
    for inputs, _ in case.data_sets:
        session, want = executor_outputs(case.model_path, inputs)
        got = module_outputs(module, session, inputs)
        for i, (w, g) in enumerate(zip(want, got)):
            assert identical(w, g) is None, f"output {i}: {identical(w, g)}"


# -- real models against onnxruntime -------------------------------------------------------
TORCH_CACHE = os.path.join(REPO, ".cache", "torch-models-2.13.0+cpu")
TORCH_MODELS = ["resnet", "mobilenet", "vit", "bert", "gpt2", "lstm_gru"]


def assert_close_relative(actual, expected, rtol=1e-4):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", TORCH_MODELS)
def test_torch_model_matches_onnxruntime(name, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = os.path.join(TORCH_CACHE, f"{name}.onnx")
    if not os.path.exists(path):
        pytest.skip(f"{path} not built (models/export_torch_models.py)")
    feeds = dict(np.load(os.path.join(TORCH_CACHE, f"{name}.inputs.npz")))
    module = convert_and_import(path, tmp_path).Model()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = as_list(module(*[feeds[i.name] for i in sess.get_inputs()]), len(want))
    for w, g in zip(want, got):
        assert_close_relative(g, w)


# Two small zoo models run here; benchmarks/native_suite.py --models runs all nine.
@pytest.mark.parametrize("model_path", [p for p in light_models()
                                        if re.search("squeezenet|shufflenet", p)],
                         ids=os.path.basename)
def test_light_model_matches_reference_outputs(model_path, tmp_path):
    case = load_light_case(model_path, str(tmp_path))
    module = convert_and_import(case.model_path, tmp_path).Model()
    feeds, want = case.data_sets[0]
    got = as_list(module(*feeds.values()), len(want))
    for w, g in zip(want, got):
        assert_close_relative(g, w)


# -- hostile names ---------------------------------------------------------------------------
EVIL_OP, EVIL_DOMAIN = "Id'); __import__('os')#", "evil'\n.domain"


@pytest.fixture
def temporary_kernels():
    """Register kernels for one test only, so the registry (and the ops table in docs/ops.md other
    tests check) is left as it was."""
    from ember.ops import registry

    added = []

    def add(op_type, domain, cls):
        registry.register(op_type, versions=[1], domain=domain)(cls)
        added.append(("cpu", registry.normalize_domain(domain), op_type))

    yield add
    for key in added:
        registry._TABLE.pop(key, None)


def _register_evil_op(add):
    """A custom op whose type, domain and attribute name are hostile strings."""
    from ember.ops.registry import OpImpl

    class EvilIdentity(OpImpl):
        def run(self, x):
            return x.copy()

    add(EVIL_OP, EVIL_DOMAIN, EvilIdentity)


def hostile_model(sentinel: str) -> onnx.ModelProto:
    """Names and strings that would run code, break out of a literal, shadow builtins or
    clash, if spliced into source."""
    payload = f"__import__('os').system('touch {sentinel}')"
    x = f'x"); {payload} #'
    w = "w'''\n" + payload
    a, b = "a-b", "a_b"  # both sanitise to a_b
    c = "__import__"
    d = "class"
    e = "λ\u2028ü\r\nself"
    out = f"out\n{payload}"
    nodes = [
        helper.make_node("MatMul", [x, w], [a], name=f"mm');{payload}#"),
        helper.make_node("Relu", [a], [b], name="\n".join(["n", payload])),
        helper.make_node("Add", [a, b], [c]),
        helper.make_node("Identity", [c], [d], name="np"),
        helper.make_node("Constant", [], ["self"], value_string=payload),
        helper.make_node("Mul", [d, d], [e]),
        helper.make_node(EVIL_OP, [e], [out], domain=EVIL_DOMAIN, **{"a'b\n)": payload}),
    ]
    weight = helper.make_tensor(w, TensorProto.FLOAT, [3, 3], np.arange(9, dtype=np.float32) - 4)
    graph = helper.make_graph(
        nodes, f"g{payload}", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("self", TensorProto.STRING, [])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(EVIL_DOMAIN, 1)],
                              producer_name=payload, doc_string=payload)
    return model


def test_hostile_names_convert_safely(tmp_path, temporary_kernels):
    _register_evil_op(temporary_kernels)
    sentinel = str(tmp_path / "PWNED")
    path = str(tmp_path / "hostile\n'.onnx")
    onnx.save(hostile_model(sentinel), path)
    out = tmp_path / "pkg"
    pkg = convert_and_import(path, out)
    module = pkg.Model()
    feeds = {next(iter(pkg.Model.input_names)): np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
    session, want = executor_outputs(path, feeds)
    got = module_outputs(module, session, feeds)
    assert all(identical(w, g) is None for w, g in zip(want, got))
    assert not os.path.exists(sentinel), "something in the model ran"
    source = (out / "model.py").read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):  # identifiers: plain ASCII, no dunder but super().__init__
        if isinstance(node, ast.Name):
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*|__file__", node.id), node.id
        if isinstance(node, ast.Attribute):
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*|__init__", node.attr), node.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id in {"super", "float"}, node.func.id
        if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call):
            assert False, "stray expression statement"
    # Every model string in the source is inside a string literal.
    literal_text = "".join(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                           and isinstance(n.value, str))
    assert "os').system" in literal_text
    names = {tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.NAME}
    assert not names & {"__import__", "eval", "exec", "system", "getattr", "compile", "open"}
    assert not os.path.exists(sentinel)


def test_identifiers_for_clashing_names(tmp_path):
    from ember.native.codegen import Names

    names = Names()
    got = [names.new(n) for n in ["a-b", "a_b", "class", "__import__", "9x", "", "ü", "self",
                                  "np", "a b"]]
    assert len(set(got)) == len(got)
    for ident in got:
        assert ident.isidentifier() and ident.isascii() and not ident.startswith("_")
        assert ident not in {"class", "self", "np", "import", "__import__"}


# -- custom ops --------------------------------------------------------------------------------
def test_custom_domain_op_loads_and_converts(tmp_path, temporary_kernels):
    from ember.ops.registry import OpImpl

    class Gelu2(OpImpl):
        """tanh-approximated GELU, scaled by the `alpha` attribute."""

        def run(self, x):
            y = 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
            return (self.alpha * y).astype(x.dtype)

    temporary_kernels("Gelu2", "com.example", Gelu2)
    node = helper.make_node("Gelu2", ["x"], ["y"], domain="com.example", alpha=2.0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    path = str(tmp_path / "custom.onnx")
    onnx.save(model, path)
    x = np.array([-2, -0.5, 0.5, 2], np.float32)
    session, (want,) = executor_outputs(path, {"x": x})
    pkg = convert_and_import(path, tmp_path / "pkg")
    assert "'Gelu2', 1" in (tmp_path / "pkg" / "model.py").read_text()
    got = pkg.Model()(x)
    assert identical(want, got) is None
    expected = 2 * 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


# -- the module API ----------------------------------------------------------------------------
def test_module_api_state_dict_and_to(tmp_path):
    path = os.path.join(REPO, "models", "mlp.onnx")
    pkg = convert_and_import(path, tmp_path / "mlp")
    m = pkg.Model(backend="cpu")
    assert isinstance(m, Module) and m.backend == "cpu" and m.to("cpu") is m
    info = ember.load(path).inputs[0]
    shape = [d if isinstance(d, int) else 2 for d in info.shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    state = m.state_dict()
    assert set(state) == set(m.parameters()) and state
    # Doubling every weight in the module equals doubling the initialisers in the ONNX model.
    doubled = {k: (v * 2).astype(v.dtype) for k, v in state.items()}
    m.load_state_dict(doubled)
    proto = onnx.load(path)
    for t in proto.graph.initializer:
        arr = onnx.numpy_helper.to_array(t)
        t.CopyFrom(onnx.numpy_helper.from_array((arr * 2).astype(arr.dtype), t.name))
    session = ember.load(proto)
    want = session.run({info.name: x})[session.outputs[0].name]
    assert identical(want, m(x)) is None
    with pytest.raises(ember.InputError):
        m.load_state_dict({k: v[..., :1] for k, v in doubled.items()})
    with pytest.raises(ember.InputError):
        m.load_state_dict({})
    with pytest.raises(ember.BackendUnavailableError):
        m.to("tpu")


def test_module_defaults_to_ember_backend(tmp_path, monkeypatch):
    path = os.path.join(REPO, "models", "mlp.onnx")
    pkg = convert_and_import(path, tmp_path / "mlp")
    monkeypatch.delenv("EMBER_BACKEND", raising=False)
    assert pkg.Model().backend == "cpu" == ember.load(path).backend
    monkeypatch.setenv("EMBER_BACKEND", "tpu")  # as ember.load: the variable is honoured
    with pytest.raises(ember.BackendUnavailableError):
        ember.load(path)
    with pytest.raises(ember.BackendUnavailableError):
        pkg.Model()
    assert pkg.Model(backend="cpu").backend == "cpu"  # an explicit backend wins
    from ember.runtime.backends import get_backend

    try:
        get_backend("opencl")
    except ember.BackendUnavailableError:
        return  # no OpenCL here: the variable's effect is shown by the error above
    monkeypatch.setenv("EMBER_BACKEND", "opencl")
    session, m = ember.load(path, simplify=False), pkg.Model()
    assert m.backend == session.backend == "opencl"
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    assert identical(session.run({"x": x})["y"], m(x)) is None


def test_module_checks_feeds_as_session_run(tmp_path):
    path = os.path.join(REPO, "models", "transformer.onnx")
    pkg = convert_and_import(path, tmp_path / "t")
    m, session = pkg.Model(backend="cpu"), ember.load(path, simplify=False)
    assert set(pkg.Model.input_types) == {i.name for i in session.inputs}
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((2, 5, 32)).astype(np.float32)
    mask = np.ones((2, 5), np.int64)
    want = session.run({"tokens": tokens, "mask": mask})
    assert identical(want[session.outputs[0].name], as_list(m(tokens, mask), 1)[0]) is None

    def both_refuse(tokens, mask):
        with pytest.raises(ember.InputError) as from_session:
            session.run({"tokens": tokens, "mask": mask})
        with pytest.raises(ember.InputError) as from_module:
            m(tokens, mask)
        assert str(from_module.value) == str(from_session.value)

    both_refuse(tokens.astype(np.float64), mask)  # dtype (it used to return float64)
    both_refuse(tokens[0], mask)  # rank
    both_refuse(tokens[..., :16], mask)  # a fixed size (it used to fail inside a kernel)
    both_refuse(tokens, mask[:, :4])  # symbolic 'seq' disagrees between the inputs
    both_refuse(tokens, mask[:1])  # and 'batch'
    with pytest.raises(ember.InputError, match="takes 2 input"):
        m(tokens)
    # by name, as a session's feeds: the same bits as by position
    out = as_list(m(tokens, mask), 1)[0]
    assert identical(out, as_list(m(**{"tokens": tokens, "mask": mask}), 1)[0]) is None
    assert identical(out, as_list(m(tokens, mask=mask), 1)[0]) is None
    with pytest.raises(ember.InputError, match="unknown input name.*'masks'"):
        m(tokens, masks=mask)
    with pytest.raises(ember.InputError, match="'tokens' given both"):
        m(tokens, tokens=tokens, mask=mask)
    with pytest.raises(ember.InputError, match="missing input.*'mask'"):
        m(tokens=tokens)
    mlp = convert_and_import(os.path.join(REPO, "models", "mlp.onnx"), tmp_path / "mlp").Model()
    listed = [[0.5, -1.0, 2.0, 0.0]]  # a nested list is converted as Session.run converts it
    want = ember.load(os.path.join(REPO, "models", "mlp.onnx"), simplify=False).run({"x": listed})
    assert identical(want["y"], mlp(listed)) is None


def test_convert_refuses_to_overwrite_without_force(tmp_path):
    env = dict(os.environ, PYTHONPATH="")
    out = tmp_path / "mlp"
    model = os.path.join(REPO, "models", "mlp.onnx")

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "ember", "convert", model, "-o", str(out),
                               "-q", *extra], capture_output=True, text=True, env=env)

    out.mkdir()  # an empty folder is fine
    assert cli().returncode == 0
    first = (out / "model.py").read_bytes()
    (out / "model.py").write_text("edited by hand\n")
    refused = cli()
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and str(out) in refused.stderr \
        and "--force" in refused.stderr
    assert (out / "model.py").read_text() == "edited by hand\n"  # left alone
    forced = cli("--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "model.py").read_bytes() == first
    with pytest.raises(ember.EmberError, match="--force"):
        convert(model, str(out), progress=False, overwrite=False)


# -- safetensors -------------------------------------------------------------------------------
def _all_dtypes():
    import ml_dtypes

    rng = np.random.default_rng(1)
    base = rng.standard_normal((3, 4)).astype(np.float32)
    arrays = {"f32": base, "f64": base.astype(np.float64), "f16": base.astype(np.float16),
              "bf16": base.astype(ml_dtypes.bfloat16), "i64": np.arange(12).reshape(3, 4),
              "u8": np.arange(12, dtype=np.uint8), "bool": base > 0, "scalar": np.float32(3)[()],
              "empty": np.zeros((0, 5), np.int32),
              "f8e4m3fn": base.astype(ml_dtypes.float8_e4m3fn),
              "f8e5m2": base.astype(ml_dtypes.float8_e5m2),
              "f8e4m3fnuz": base.astype(ml_dtypes.float8_e4m3fnuz),
              "int4": np.arange(-4, 4).astype(ml_dtypes.int4),
              "c128": (base + 1j * base).astype(np.complex128),
              "quote\"\nname": base}
    return {k: np.asarray(v) for k, v in arrays.items()}


def test_safetensors_round_trip_every_dtype(tmp_path):
    arrays = _all_dtypes()
    path = str(tmp_path / "w.safetensors")
    save_file(arrays, path)
    loaded = load_file(path)
    assert set(loaded) == set(arrays)
    for k, v in arrays.items():
        assert identical(v, loaded[k]) is None, k
        assert not loaded[k].flags.writeable
    first = open(path, "rb").read()
    save_file(arrays, path)
    assert open(path, "rb").read() == first  # deterministic


def test_safetensors_interoperates_with_the_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors")
    from safetensors.numpy import load_file as st_load, save_file as st_save

    arrays = {k: v for k, v in _all_dtypes().items()
              if v.dtype.name in ("float32", "float64", "float16", "int64", "uint8", "bool",
                                  "int32")}
    path = str(tmp_path / "ours.safetensors")
    save_file(arrays, path)
    theirs = st_load(path)
    for k, v in arrays.items():
        assert identical(v, theirs[k]) is None, k
    path2 = str(tmp_path / "theirs.safetensors")
    st_save(arrays, path2)
    for k, v in load_file(path2).items():
        assert identical(arrays[k], v) is None, k
    # bfloat16 and float8: the library reads their dtype and shape (numpy cannot hold them).
    special = {k: v for k, v in _all_dtypes().items() if k in ("bf16", "f8e4m3fn", "f8e5m2")}
    save_file(special, path)
    with st.safe_open(path, framework="np") as f:
        for k, v in special.items():
            sliced = f.get_slice(k)
            assert sliced.get_dtype() == {"bf16": "BF16", "f8e4m3fn": "F8_E4M3",
                                          "f8e5m2": "F8_E5M2"}[k]
            assert list(sliced.get_shape()) == list(v.shape)


# -- examples and determinism ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_checked_in_examples_do_not_drift(name, tmp_path):
    convert(os.path.join(REPO, "models", f"{name}.onnx"), str(tmp_path), progress=False)
    for filename in ("__init__.py", "model.py", "weights.safetensors"):
        checked_in = os.path.join(REPO, "models", "native", name, filename)
        with open(checked_in, "rb") as a, open(tmp_path / filename, "rb") as b:
            assert a.read() == b.read(), (
                f"models/native/{name}/{filename} is stale; regenerate with "
                f"ember convert models/{name}.onnx -o models/native/{name}")


def test_cli_converts_and_reports_bad_models(tmp_path):
    env = dict(os.environ, PYTHONPATH="")
    ok = subprocess.run([sys.executable, "-m", "ember", "convert",
                         os.path.join(REPO, "models", "cnn.onnx"),
                         "-o", str(tmp_path / "cnn")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""  # no progress when stderr is not a terminal
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    fail = subprocess.run([sys.executable, "-m", "ember", "convert", str(bad),
                           "-o", str(tmp_path / "x")],
                          capture_output=True, text=True, env=env)
    assert fail.returncode == 2 and "not a valid ONNX model" in fail.stderr


def test_progress_shows_on_a_terminal(tmp_path):
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.run([sys.executable, "-m", "ember", "convert",
                           os.path.join(REPO, "models", "mlp.onnx"), "-o", str(tmp_path / "mlp")],
                          stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = os.read(leader, 65536).decode()
    os.close(leader)
    assert proc.returncode == 0
    assert "generating code" in shown and "writing weights" in shown
