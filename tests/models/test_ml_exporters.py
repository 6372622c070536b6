"""Models written by the classic-ML exporters (skl2onnx, onnxmltools), and the ai.onnx.ml map
ops (ZipMap, DictVectorizer, CastMap) and the com.microsoft Tokenizer, against onnxruntime.

Each model runs on onnxruntime (the oracle) and on ember's CPU backend, and on the OpenCL
backend where it is available (these host ops run there through planned CPU placement).

Comparison: labels, integers and strings exactly; float outputs within 1e-5 absolute (float32
probabilities), scaled by the largest magnitude for regressors' unbounded outputs; a ZipMap
output (a sequence of maps) as a list of dicts with the same keys, of the same Python types,
and values within the same tolerance, as onnxruntime returns it.
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto, helper

import ember
from backends import unavailable_reason

ort = pytest.importorskip("onnxruntime")

ML, MS = "ai.onnx.ml", "com.microsoft"
ATOL = 1e-5
BACKENDS = ["cpu", pytest.param("opencl", marks=pytest.mark.skipif(
    unavailable_reason("opencl") is not None,
    reason=f"OpenCL unavailable: {unavailable_reason('opencl')}"))]
RNG = np.random.default_rng(20240917)


# ---------------------------------------------------------------- helpers

def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def ember_run(model, feeds, backend):
    return ember.load(model, backend=backend).run(feeds)


def assert_same(got, want, what=""):
    """`got` (ember) against `want` (onnxruntime), for tensors and sequences of maps."""
    if isinstance(want, list):
        assert isinstance(got, list), f"{what}: expected a list of maps, got {type(got)}"
        assert len(got) == len(want), f"{what}: {len(got)} maps, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert isinstance(g, dict), f"{what}[{i}]: {type(g)} is not a dict"
            assert list(g) == list(w), f"{what}[{i}]: keys {list(g)} != {list(w)}"
            assert [type(k) for k in g] == [type(k) for k in w], f"{what}[{i}]: key types"
            gv = np.array(list(g.values()), dtype=np.float64)
            wv = np.array(list(w.values()), dtype=np.float64)
            assert all(isinstance(v, float) for v in g.values()), f"{what}[{i}]: value types"
            np.testing.assert_allclose(gv, wv, rtol=0, atol=ATOL, err_msg=f"{what}[{i}]")
        return
    want = np.asarray(want)
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype.kind == "f":
        w = want.astype(np.float64)
        finite = np.abs(w[np.isfinite(w)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0  # infs must match
        np.testing.assert_allclose(got.astype(np.float64), w, rtol=0, atol=ATOL * scale,
                                   err_msg=what)
    else:
        assert got.tolist() == want.tolist(), f"{what}: {got.tolist()} != {want.tolist()}"


def check(model, feeds, backend):
    """Run on both and compare every output."""
    want = ort_run(model, feeds)
    got = ember_run(model, feeds, backend)
    assert list(got) == list(want)
    for name in want:
        assert_same(got[name], want[name], name)
    return got


def one_node(op, domain, inputs, outputs, **attrs):
    """A model of one node; inputs/outputs are (name, TypeProto) pairs."""
    node = helper.make_node(op, [n for n, _ in inputs], [n for n, _ in outputs], domain=domain,
                            **attrs)
    graph = helper.make_graph([node], op, [helper.make_value_info(n, t) for n, t in inputs],
                              [helper.make_value_info(n, t) for n, t in outputs])
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(ML, 3), helper.make_opsetid(MS, 1)])


def tensor_type(elem, shape=None):
    return helper.make_tensor_type_proto(elem, shape)


def map_type(key, value):
    return helper.make_map_type_proto(key, tensor_type(value))


def seq_map_type(key, value):
    return helper.make_sequence_type_proto(map_type(key, value))


# ---------------------------------------------------------------- ZipMap

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("labels", [
    {"classlabels_int64s": [0, 1, 5]},
    {"classlabels_int64s": [7, -2, 3]},  # onnxruntime's dicts come in sorted key order
    {"classlabels_int64s": [4, 1, 4]},  # a repeated label keeps its last column
    {"classlabels_strings": ["cat", "dog", "émeu"]},
    {"classlabels_strings": ["émeu", "Dog", "cat"]},
])
@pytest.mark.parametrize("shape", [(4, 3), (1, 3), (3,), (0, 3)])
def test_zipmap(backend, labels, shape):
    key = TensorProto.INT64 if "classlabels_int64s" in labels else TensorProto.STRING
    model = one_node("ZipMap", ML, [("X", tensor_type(TensorProto.FLOAT, [None] * len(shape)))],
                     [("Z", seq_map_type(key, TensorProto.FLOAT))], **labels)
    x = RNG.random(shape, dtype=np.float32)
    got = check(model, {"X": x}, backend)
    assert len(got["Z"]) == (1 if len(shape) == 1 else shape[0])


def test_zipmap_errors():
    with pytest.raises(ember.errors.InvalidModelError, match="exactly one"):
        ember.load(one_node("ZipMap", ML, [("X", tensor_type(TensorProto.FLOAT, [2, 2]))],
                            [("Z", seq_map_type(TensorProto.INT64, TensorProto.FLOAT))],
                            classlabels_int64s=[0, 1], classlabels_strings=["a", "b"]))
    sess = ember.load(one_node("ZipMap", ML, [("X", tensor_type(TensorProto.FLOAT, None))],
                               [("Z", seq_map_type(TensorProto.INT64, TensorProto.FLOAT))],
                               classlabels_int64s=[0, 1]))
    with pytest.raises(ember.errors.EmberError, match="columns"):
        sess.run({"X": np.zeros((2, 3), np.float32)})


# ---------------------------------------------------------------- DictVectorizer

# onnxruntime's Python binding feeds only maps of floats (map(string | int64, float)): those
# are compared with it; the other value types against values written out here.
DICT_CASES = [
    ({"string_vocabulary": ["a", "b", "c", "a"]}, TensorProto.STRING,
     {"a": np.float32(1.5), "c": np.float32(-2.0), "zz": np.float32(7.0)}),
    ({"string_vocabulary": ["x", "y"]}, TensorProto.STRING, {"y": 0.1}),
    ({"int64_vocabulary": [3, 1, 7]}, TensorProto.INT64,
     {1: np.float32(0.25), 7: np.float32(4.0), 8: np.float32(1.0)}),
    ({"int64_vocabulary": [10, 20, 10]}, TensorProto.INT64, {np.int64(10): 2.5}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(DICT_CASES)))
def test_dict_vectorizer(backend, case):
    vocab, key, feed = DICT_CASES[case]
    model = one_node("DictVectorizer", ML, [("M", map_type(key, TensorProto.FLOAT))],
                     [("Y", tensor_type(TensorProto.FLOAT, [1, None]))], **vocab)
    check(model, {"M": feed}, backend)


@pytest.mark.parametrize("value, feed, want", [
    (TensorProto.DOUBLE, {"y": np.float64(0.1), "q": np.float64(1)},
     np.array([[0.0, 0.1]], dtype=np.float64)),
    (TensorProto.INT64, {"x": 3, "y": np.int64(-9)}, np.array([[3, -9]], dtype=np.int64)),
    (TensorProto.STRING, {"y": "hello"}, np.array([["", "hello"]], dtype=object)),
    (TensorProto.FLOAT, {"x": 1, "y": 2.5}, np.array([[1.0, 2.5]], dtype=np.float32)),
    (TensorProto.FLOAT, {"x": np.array([0.5], np.float32)}, np.array([[0.5, 0]], np.float32)),
])
def test_dict_vectorizer_other_value_types(value, feed, want):
    model = one_node("DictVectorizer", ML, [("M", map_type(TensorProto.STRING, value))],
                     [("Y", tensor_type(value, [1, None]))], string_vocabulary=["x", "y"])
    assert_same(ember.load(model).run({"M": feed})["Y"], want, "Y")


def test_dict_vectorizer_list_of_maps():
    """A sequence of maps (an ember extension: onnxruntime's DictVectorizer takes one map)
    gives one row per map."""
    def model(input_type):
        return one_node("DictVectorizer", ML, [("M", input_type)],
                        [("Y", tensor_type(TensorProto.FLOAT, [None, 3]))],
                        string_vocabulary=["a", "b", "c"])

    one = model(map_type(TensorProto.STRING, TensorProto.FLOAT))
    seq = model(seq_map_type(TensorProto.STRING, TensorProto.FLOAT))
    maps = [{"a": 1.0}, {"b": 2.0, "c": 3.0}, {}]
    got = ember.load(seq).run({"M": maps})["Y"]
    want = np.stack([ort_run(one, {"M": m})["Y"][0] if m else np.zeros(3, np.float32)
                     for m in maps])  # (onnxruntime's binding refuses an empty map)
    assert_same(got, want, "Y")
    with pytest.raises(ember.errors.EmberError, match="string"):
        ember.load(one).run({"M": {1: 2.0}})


# ---------------------------------------------------------------- CastMap

CAST_TYPES = {"TO_FLOAT": TensorProto.FLOAT, "TO_INT64": TensorProto.INT64,
              "TO_STRING": TensorProto.STRING}
CAST_FORMS = [("DENSE", 1), ("DENSE", 0), ("SPARSE", 6), ("SPARSE", 12), ("SPARSE", 1)]


def cast_map_model(value_type, cast_to, form, max_map):
    return one_node("CastMap", ML, [("M", map_type(TensorProto.INT64, value_type))],
                    [("Y", tensor_type(CAST_TYPES[cast_to], [1, None]))],
                    cast_to=cast_to, map_form=form, max_map=max_map)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cast_to", sorted(CAST_TYPES))
@pytest.mark.parametrize("form", CAST_FORMS)
def test_cast_map(backend, cast_to, form):
    """Float maps (the only kind onnxruntime's Python binding feeds): against onnxruntime."""
    feed = {5: np.float32(3e9), 0: np.float32(1.5), 2: np.float32(-2.75), 7: np.float32(0.1),
            3: np.float32(-0.5)}
    check(cast_map_model(TensorProto.FLOAT, cast_to, *form), {"M": feed}, backend)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.strtof.restype = ctypes.c_float
        libc.strtof.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        libc.strtoll.restype = ctypes.c_longlong
        libc.strtoll.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                 ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        pytest.skip("no C library to take strtof / strtoll from")


@pytest.mark.parametrize("cast_to", sorted(CAST_TYPES))
@pytest.mark.parametrize("form", CAST_FORMS)
def test_cast_map_strings(cast_to, form):
    """String maps: onnxruntime converts with std::stof / std::stoll (strtof / strtoll of the
    C library, the rest of the string ignored); its binding cannot feed them, so the C
    library itself is the oracle."""
    libc = _libc()
    feed = {1: "  12.5abc", 0: "-3", 4: "7e2", 3: "0x1p3", 9: "+42 apples", 2: "inf",
            6: "\t.25"}
    keys = sorted(feed)
    if cast_to == "TO_FLOAT":
        conv = [libc.strtof(feed[k].encode(), None) for k in keys]
        dtype, pad = np.float32, 0
    elif cast_to == "TO_INT64":
        feed.pop(2)  # strtoll reads nothing from "inf" (std::stoll throws)
        feed[6] = " 17"
        keys = sorted(feed)
        conv = [libc.strtoll(feed[k].encode(), None, 10) for k in keys]
        dtype, pad = np.int64, 0
    else:
        conv = [feed[k] for k in keys]
        dtype, pad = object, "0.f"
    form_name, max_map = form
    if form_name == "DENSE":
        want = np.array([conv], dtype=dtype)
    else:
        want = np.full((1, max_map), pad, dtype=dtype)
        for k, v in zip(keys, conv):
            if k < max_map:
                want[0, k] = v
    got = ember.load(cast_map_model(TensorProto.STRING, cast_to, *form)).run({"M": feed})["Y"]
    assert_same(got, want, "Y")


def test_cast_map_errors():
    model = one_node("CastMap", ML, [("M", map_type(TensorProto.INT64, TensorProto.STRING))],
                     [("Y", tensor_type(TensorProto.FLOAT, [1, None]))], cast_to="TO_FLOAT")
    with pytest.raises(ember.errors.EmberError, match="cannot convert"):
        ember.load(model).run({"M": {0: "abc"}})
    sparse = one_node("CastMap", ML, [("M", map_type(TensorProto.INT64, TensorProto.FLOAT))],
                      [("Y", tensor_type(TensorProto.FLOAT, [1, None]))], map_form="SPARSE",
                      max_map=3)
    with pytest.raises(ember.errors.EmberError, match="negative"):
        ember.load(sparse).run({"M": {-1: 1.0}})
    with pytest.raises(ember.errors.InvalidModelError, match="max_map"):  # as onnxruntime
        ember.load(cast_map_model(TensorProto.FLOAT, "TO_FLOAT", "SPARSE", 0))
    with pytest.raises(ember.errors.InvalidModelError, match="cast_to"):
        ember.load(one_node("CastMap", ML, [("M", map_type(TensorProto.INT64, TensorProto.FLOAT))],
                            [("Y", tensor_type(TensorProto.FLOAT, [1, None]))],
                            cast_to="TO_BOOL"))


# ---------------------------------------------------------------- Tokenizer

def skip_without_re2(attrs):
    """Regular expressions need google-re2 (literal patterns and character mode do not)."""
    pats = list(attrs.get("separators") or [])
    if "separators" not in attrs and attrs.get("tokenexp"):
        pats.append(attrs["tokenexp"])
    if any(set(p) & set("\\.^$|?*+()[]{}") for p in pats if p not in ("", ".")):
        pytest.importorskip("re2", reason="regex Tokenizer patterns need google-re2")


def tokenizer(rank, **attrs):
    return one_node("Tokenizer", MS, [("X", tensor_type(TensorProto.STRING, [None] * rank))],
                    [("Y", tensor_type(TensorProto.STRING, None))], **attrs)


TEXTS_1D = ["Hello World", "I love computer science !", "", "  héllo,wörld  ",
            "é ab ü cdé ô,"]
TEXTS_2D = [["a b", "c,d"], ["", "dé f g"]]
BASE = dict(mark=0, mincharnum=1, pad_value="#")
TOKENIZER_CASES = [
    dict(BASE, separators=[" "]),
    dict(BASE, mark=1, separators=[" "]),
    dict(BASE, separators=[" ", ","]),
    dict(BASE, mincharnum=2, separators=[",", " "]),  # characters, not bytes: "é" is short
    dict(BASE, mincharnum=2, tokenexp=r"[^ ,]+"),
    dict(BASE, separators=[""]),  # character mode
    dict(BASE, mark=1, tokenexp="."),  # character mode
    dict(BASE, separators=["a|ab", r"\s+"]),  # leftmost-longest separators
    dict(BASE, tokenexp="a|ab"),  # leftmost-longest: "ab" wins
    dict(BASE, tokenexp="[a-z]+", mincharnum=2),
    dict(BASE, pad_value="<pad>", tokenexp=r"\b\w\w+\b"),  # RE2's ASCII \w and \b
    dict(BASE, tokenexp=r"[a-zA-Z0-9_]+"),  # skl2onnx's TfidfVectorizer pattern
    dict(BASE, tokenexp="^."),  # ^ only at the start of the string
    dict(BASE, separators=["^."]),
    dict(BASE, tokenexp="x*"),  # only empty matches: no tokens
    dict(BASE, separators=["o*"]),  # empty separator matches drop characters
    dict(BASE, separators=[r"\s+", "o"]),  # separators applied in turn
    dict(BASE, mark=1, tokenexp="(?i)L+"),
    dict(BASE, separators=["é", "ö"]),
    dict(BASE, separators=[" "], tokenexp="[a-z]"),  # separators win over tokenexp
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(TOKENIZER_CASES)))
@pytest.mark.parametrize("texts", [TEXTS_1D, TEXTS_2D])
def test_tokenizer(backend, case, texts):
    skip_without_re2(TOKENIZER_CASES[case])
    x = np.array(texts, dtype=object)
    check(tokenizer(x.ndim, **TOKENIZER_CASES[case]), {"X": x}, backend)


FUZZ_PATTERNS = [
    dict(separators=[" "]), dict(separators=[",", " "]), dict(separators=[r"\s+"]),
    dict(separators=["[, ]+", "é"]), dict(separators=["ab|a", "b"]), dict(separators=["^a"]),
    dict(tokenexp="[a-z]+"), dict(tokenexp="a|ab|aba"), dict(tokenexp=r"\b\w+\b"),
    dict(tokenexp="[^ ]*"), dict(tokenexp="é?b+"), dict(tokenexp="(?i)AB*"),
    dict(tokenexp="b$"), dict(tokenexp="."), dict(separators=[""]),
]


FUZZ_CASES = [(case, mincharnum) for case, p in enumerate(FUZZ_PATTERNS)
              for mincharnum in (1, 2, 3)  # character mode takes mincharnum 1 only
              if mincharnum == 1 or not (p.get("tokenexp") == "." or p.get("separators") == [""])]


@pytest.mark.parametrize("case, mincharnum", FUZZ_CASES)
def test_tokenizer_fuzz(case, mincharnum):
    """Random strings over a small alphabet (separators, a two-byte letter, a tab) against
    onnxruntime."""
    attrs = dict(FUZZ_PATTERNS[case], mark=int(mincharnum == 2), mincharnum=mincharnum,
                 pad_value="~")
    skip_without_re2(attrs)
    rng = np.random.default_rng(case * 10 + mincharnum)
    alphabet = np.array(list("aabbB ,,é\tc"), dtype=object)
    texts = ["".join(rng.choice(alphabet, size=rng.integers(0, 14))) for _ in range(60)]
    x = np.array(texts, dtype=object).reshape(12, 5)
    check(tokenizer(2, **attrs), {"X": x}, "cpu")


@pytest.mark.skipif(unavailable_reason("opencl") is not None, reason="OpenCL unavailable")
def test_host_ops_on_opencl_are_planned_on_the_host():
    """On OpenCL the map and string ops have no device kernel: the plan puts them on the
    host (placement 'fallback') and the run still matches onnxruntime."""
    model = one_node("ZipMap", ML, [("X", tensor_type(TensorProto.FLOAT, [None, 2]))],
                     [("Z", seq_map_type(TensorProto.INT64, TensorProto.FLOAT))],
                     classlabels_int64s=[3, 4])
    sess = ember.load(model, backend="opencl")
    assert [where for _, op, where in sess.placement if op == "ZipMap"] == ["fallback"]
    tok = ember.load(tokenizer(1, **dict(BASE, separators=[" "])), backend="opencl")
    assert [where for _, op, where in tok.placement if op == "Tokenizer"] == ["fallback"]


@pytest.mark.parametrize("x", [
    np.array(["  ", " "], dtype=object),  # everything is a separator: [C, 0], even with mark
    np.zeros((0,), dtype=object),
    np.zeros((2, 0), dtype=object),
    np.zeros((0, 3), dtype=object),
])
@pytest.mark.parametrize("mark", [0, 1])
def test_tokenizer_empty(x, mark):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(tokenizer(x.ndim, mark=mark, mincharnum=1, pad_value="#", separators=[" "]),
              {"X": x}, "cpu")


@pytest.mark.parametrize("attrs, message", [
    (dict(BASE, mincharnum=0, separators=[" "]), "positive"),
    (dict(BASE, mincharnum=2, separators=[""]), "character tokenization"),
    (dict(BASE, mincharnum=2, tokenexp="."), "character tokenization"),
    (dict(BASE, separators=["("]), "cannot compile"),
    (dict(BASE), "one of separators, tokenexp"),
    (dict(mark=0, mincharnum=1, separators=[" "]), "pad_value"),
])
def test_tokenizer_bad_attributes(attrs, message):
    skip_without_re2(attrs)
    with pytest.raises(ember.errors.InvalidModelError, match=message):
        ember.load(tokenizer(1, **attrs))


@pytest.mark.parametrize("attrs", [dict(BASE, separators=[" "]), dict(BASE, tokenexp="."),
                                   dict(BASE, tokenexp="[a-z]+")])
def test_tokenizer_invalid_utf8(attrs):
    """Undecodable bytes (kept by the importer as surrogates) are an error, as onnxruntime's
    "invalid utf8 chars"."""
    skip_without_re2(attrs)
    with pytest.raises(ember.errors.EmberError, match="not valid UTF-8"):
        ember.load(tokenizer(1, **attrs)).run({"X": np.array(["ab \udcff c"], dtype=object)})


def test_tokenizer_empty_separator_list():
    model = tokenizer(1, **BASE)
    model.graph.node[0].attribute.append(
        helper.make_attribute("separators", [], attr_type=AttributeProto.STRINGS))
    with pytest.raises(ember.errors.InvalidModelError, match="must not be empty"):
        ember.load(model)


def test_tokenizer_pathological_pattern_is_linear():
    """A pattern with nested quantifiers (exponential time for a backtracking engine) on a
    long string that does not match finishes at once: patterns from a model go to RE2, never
    to Python's re. (Run in a subprocess so that a regression fails instead of hanging.)"""
    pytest.importorskip("re2")
    code = (
        "import numpy as np, ember\n"
        "from onnx import TensorProto, helper\n"
        "node = helper.make_node('Tokenizer', ['X'], ['Y'], domain='com.microsoft', mark=0,\n"
        "                        mincharnum=1, pad_value='#', tokenexp='(a+)+$')\n"
        "g = helper.make_graph([node], 'g',\n"
        "    [helper.make_tensor_value_info('X', TensorProto.STRING, [1])],\n"
        "    [helper.make_tensor_value_info('Y', TensorProto.STRING, None)])\n"
        "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 17),\n"
        "                                        helper.make_opsetid('com.microsoft', 1)])\n"
        "x = np.array(['a' * 20000 + 'b'], dtype=object)\n"
        "print(ember.load(m).run({'X': x})['Y'].shape)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(1, 0)"


def test_tokenizer_without_re2_refuses_regex(monkeypatch):
    """Without google-re2, literal patterns still work and regexes fail at load time."""
    from ember.ops.microsoft import text as contrib_text

    monkeypatch.setattr(contrib_text, "_re2", None)
    x = np.array(["a,b;;c", "d"], dtype=object)
    model = tokenizer(1, **dict(BASE, separators=[",", ";"]))
    assert_same(ember.load(model).run({"X": x})["Y"], ort_run(model, {"X": x})["Y"], "Y")
    with pytest.raises(ember.errors.InvalidModelError, match="google-re2"):
        ember.load(tokenizer(1, **dict(BASE, tokenexp="[a-z]+")))


# ---------------------------------------------------------------- exporters: scikit-learn

def _need_sklearn():
    pytest.importorskip("sklearn")
    pytest.importorskip("skl2onnx")


def _data(n=60, features=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    score = x[:, 0] + 0.5 * x[:, 1] - 0.25 * x[:, 2]
    edges = np.quantile(score, np.linspace(0, 1, classes + 1)[1:-1])
    return x, np.digitize(score, edges)


def _export(model, x, zipmap=None, estimator=None):
    """skl2onnx's export of `model`; `zipmap` sets that option of `estimator` (the model
    itself by default, or the classifier at the end of a pipeline)."""
    from skl2onnx import to_onnx

    options = None
    if zipmap is not None:
        options = {id(estimator if estimator is not None else model): {"zipmap": zipmap}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return to_onnx(model, x[:1], options=options, target_opset={"": 17, ML: 3})


def _classifiers():
    from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.svm import SVC

    return {
        "logreg": lambda: LogisticRegression(max_iter=500),
        "forest": lambda: RandomForestClassifier(n_estimators=8, max_depth=5, random_state=0),
        "gboost": lambda: GradientBoostingClassifier(n_estimators=10, max_depth=3,
                                                     random_state=0),
        "svc": lambda: SVC(probability=True, random_state=0),
        "knn": lambda: KNeighborsClassifier(n_neighbors=5),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zipmap", [True, False])
@pytest.mark.parametrize("classes", [2, 3])
@pytest.mark.parametrize("name", sorted(_classifiers()))
def test_sklearn_classifier(name, classes, zipmap, backend):
    _need_sklearn()
    x, y = _data(classes=classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # sklearn 1.9 deprecates SVC's
        clf = _classifiers()[name]().fit(x, y)  # probability=True; skl2onnx still needs it
    model = _export(clf, x, zipmap=zipmap)
    check(model, {"X": x}, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sklearn_string_labels_zipmap(backend):
    """String class labels: ZipMap with classlabels_strings, string label output."""
    _need_sklearn()
    from sklearn.ensemble import RandomForestClassifier

    x, y = _data(classes=3, seed=1)
    labels = np.array(["low", "mid", "high"], dtype=object)[y]
    clf = RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0).fit(x, labels)
    check(_export(clf, x, zipmap=True), {"X": x[:11]}, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sklearn_gradient_boosting_regressor(backend):
    _need_sklearn()
    from sklearn.ensemble import GradientBoostingRegressor

    x, _ = _data(seed=2)
    y = x[:, 0] * 3 - x[:, 3] ** 2
    reg = GradientBoostingRegressor(n_estimators=20, max_depth=3, random_state=0).fit(x, y)
    check(_export(reg, x), {"X": x[:13]}, backend)


TEXTS = ["the cat sat on the mat", "dogs and cats are friends", "a dog barked at the cat",
         "the mat was red", "cats sleep all day", "dogs run in the park", "Red cats, red dogs!",
         "the park was empty", "a cat and a dog", "MAT mat mat"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zipmap", [True, False])
@pytest.mark.parametrize("ngrams", [(1, 1), (1, 2)])
def test_sklearn_tfidf_pipeline(ngrams, zipmap, backend):
    """TfidfVectorizer + LogisticRegression: StringNormalizer, Tokenizer (com.microsoft),
    TfIdfVectorizer, then the linear classifier."""
    _need_sklearn()
    pytest.importorskip("re2", reason="skl2onnx's Tokenizer pattern is a regex: google-re2")
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    labels = [0, 1, 1, 0, 1, 1, 2, 0, 2, 0]
    pipe = make_pipeline(TfidfVectorizer(ngram_range=ngrams),
                         LogisticRegression(max_iter=500)).fit(TEXTS, labels)
    x = np.array(TEXTS + ["unseen words only", "the the the"], dtype=object).reshape(-1, 1)
    model = _with_installed_locale(_export(pipe, x, zipmap=zipmap, estimator=pipe.steps[-1][1]))
    assert "Tokenizer" in [n.op_type for n in model.graph.node]
    check(model, {"X": x}, backend)


@pytest.mark.parametrize("form", ["unicode", "bytes"])
def test_sklearn_tfidf_pipeline_numpy_string_feeds(form):
    """The pipeline fed as users of onnxruntime feed it (issue 43): a numpy unicode array
    (<U) straight from a list of texts, or UTF-8 bytes (S); onnxruntime gets the same array."""
    _need_sklearn()
    pytest.importorskip("re2", reason="skl2onnx's Tokenizer pattern is a regex: google-re2")
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    labels = [0, 1, 1, 0, 1, 1, 2, 0, 2, 0]
    pipe = make_pipeline(TfidfVectorizer(), LogisticRegression(max_iter=500)).fit(TEXTS, labels)
    texts = TEXTS + ["unseen words only", "the the the"]
    model = _with_installed_locale(_export(
        pipe, np.array(texts, dtype=object).reshape(-1, 1), zipmap=False,
        estimator=pipe.steps[-1][1]))
    x = np.array(texts).reshape(-1, 1)
    assert x.dtype.kind == "U"
    if form == "bytes":
        # wider than the longest text: onnxruntime 1.32 reads past an element that fills its
        # width (ember reads it as numpy does; tests/runtime/test_ort_compat.py)
        width = max(len(t.encode()) for t in texts) + 1
        x = np.array([[t.encode()] for t in texts], dtype=f"S{width}")
    got = check(model, {"X": x}, "cpu")
    assert next(iter(got.values())).tolist() == pipe.predict(texts).tolist()  # the labels


def _with_installed_locale(model):
    """onnxruntime's StringNormalizer builds a C++ locale (en_US.UTF-8 by default) and fails
    where it is not installed: point the model at C.UTF-8 then (ember lower-cases with
    Python's str.lower whatever the locale; the texts here are ASCII)."""
    import locale

    try:
        saved = locale.setlocale(locale.LC_CTYPE)
        locale.setlocale(locale.LC_CTYPE, "en_US.UTF-8")
        locale.setlocale(locale.LC_CTYPE, saved)
        return model
    except locale.Error:
        pass
    for node in model.graph.node:
        if node.op_type == "StringNormalizer":
            for a in list(node.attribute):
                if a.name == "locale":
                    node.attribute.remove(a)
            node.attribute.append(helper.make_attribute("locale", "C.UTF-8"))
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zipmap", [True, False])
@pytest.mark.parametrize("head", ["logreg", "forest"])
def test_sklearn_dict_vectorizer_pipeline(head, zipmap, backend):
    """DictVectorizer + classifier: a map input, one map per run as onnxruntime takes it."""
    _need_sklearn()
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.feature_extraction import DictVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import DictionaryType, FloatTensorType, StringTensorType

    rng = np.random.default_rng(3)
    keys = ["age", "height", "weight", "score"]
    dicts = [{k: float(v) for k, v in zip(keys, rng.normal(size=4)) if rng.random() > 0.2}
             for _ in range(40)]
    y = [int(d.get("age", 0) + d.get("score", 0) > 0) for d in dicts]
    est = LogisticRegression() if head == "logreg" else \
        RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0)
    pipe = make_pipeline(DictVectorizer(sparse=False), est).fit(dicts, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_sklearn(
            pipe, initial_types=[("input", DictionaryType(StringTensorType([1]),
                                                          FloatTensorType([1])))],
            options={id(est): {"zipmap": zipmap}}, target_opset={"": 17, ML: 3})
    assert "DictVectorizer" in [n.op_type for n in model.graph.node]
    sess = ember.load(model, backend=backend)
    for d in dicts[:8] + [{"unknown": 3.0, "age": 1.0}]:  # (onnxruntime refuses {})
        feed = {"input": {k: np.float32(v) for k, v in d.items()}}
        want = ort_run(model, feed)
        got = sess.run(feed)
        for name in want:
            assert_same(got[name], want[name], name)


# ---------------------------------------------------------------- exporters: onnxmltools

def _onnxmltools_convert(kind, estimator, x, **kw):
    onnxmltools = pytest.importorskip("onnxmltools")
    from onnxmltools.convert.common.data_types import FloatTensorType

    convert = {"lightgbm": onnxmltools.convert_lightgbm,
               "xgboost": onnxmltools.convert_xgboost}[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(estimator, initial_types=[("X", FloatTensorType([None, x.shape[1]]))],
                       target_opset=15, **kw)  # the newest onnxmltools 1.16 writes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("task, zipmap", [("binary", True), ("binary", False),
                                          ("multiclass", True), ("multiclass", False),
                                          ("regression", None)])
def test_lightgbm(task, zipmap, backend):
    lightgbm = pytest.importorskip("lightgbm")
    x, y = _data(n=120, classes=2 if task == "binary" else 3, seed=4)
    params = dict(n_estimators=10, num_leaves=7, min_child_samples=5, verbose=-1)
    if task == "regression":
        est = lightgbm.LGBMRegressor(**params).fit(x, x[:, 0] * 2 + x[:, 1])
    else:
        est = lightgbm.LGBMClassifier(**params).fit(x, y)
    kw = {} if zipmap is None else {"zipmap": zipmap}
    model = _onnxmltools_convert("lightgbm", est, x, **kw)
    assert ("ZipMap" in [n.op_type for n in model.graph.node]) == bool(zipmap)
    check(model, {"X": x}, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("task", ["binary", "multiclass", "regression"])
def test_xgboost(task, backend):
    xgboost = pytest.importorskip("xgboost")
    x, y = _data(n=120, classes=2 if task == "binary" else 3, seed=5)
    params = dict(n_estimators=8, max_depth=3, learning_rate=0.3)
    if task == "regression":
        est = xgboost.XGBRegressor(**params).fit(x, x[:, 0] * 2 + x[:, 1])
    else:
        est = xgboost.XGBClassifier(**params).fit(x, y)
    check(_onnxmltools_convert("xgboost", est, x), {"X": x}, backend)

