"""ember as a drop-in for onnxruntime's Python API (ember.runtime.ort_compat): each snippet an
onnxruntime user writes, run on both, must end the same way. onnxruntime is the oracle."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from ember.errors import BackendUnavailableError, EmberError, ExecutionError

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def _model(with_overridable=False):
    """x -> Relu -> Add(b) -> Mul(2): three nodes, metadata everywhere onnxruntime reads."""
    inits = [numpy_helper.from_array(np.array([1, -2, 3], np.float32), "b"),
             numpy_helper.from_array(np.array(2, np.float32), "two")]
    inputs = [helper.make_tensor_value_info("x", F, ["batch", 3])]
    if with_overridable:
        inputs.append(helper.make_tensor_value_info("b", F, [3]))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Add", ["r", "b"], ["a"], name="add"),
         helper.make_node("Mul", ["a", "two"], ["y"], name="mul")],
        "tiny", inputs, [helper.make_tensor_value_info("y", F, ["batch", 3])], inits,
        doc_string="the graph's doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="compat-test", producer_version="1.0",
                              doc_string="the model's doc", model_version=7)
    model.ir_version = 8
    helper.set_model_props(model, {"author": "ember", "license": "MIT"})
    return model.SerializeToString()


X = np.array([[0.5, -1.0, 2.0], [-3.0, 4.0, 0.0]], np.float32)


def _both(*args, **kwargs):
    return (ort.InferenceSession(*args, **kwargs), ember.InferenceSession(*args, **kwargs))


def test_run_and_io_metadata_match():
    o, e = _both(_model(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(e.run(None, {"x": X})[0], o.run(None, {"x": X})[0])
    for get in ("get_inputs", "get_outputs"):
        assert [(a.name, a.type, a.shape) for a in getattr(e, get)()] == \
            [(a.name, a.type, a.shape) for a in getattr(o, get)()]
    assert e.get_providers() == o.get_providers() == ["CPUExecutionProvider"]


def test_modelmeta_matches():
    o, e = _both(_model(), providers=["CPUExecutionProvider"])
    for field in ("producer_name", "graph_name", "description", "graph_description", "version",
                  "custom_metadata_map", "domain"):
        assert getattr(e.get_modelmeta(), field) == getattr(o.get_modelmeta(), field), field


def _warnings_of(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = make()
    return session, [str(w.message) for w in caught if "provider" in str(w.message)]


@pytest.mark.parametrize("providers", [
    ["CUDAExecutionProvider", "CPUExecutionProvider"],   # a fallback list
    ["NoSuchExecutionProvider"],                         # unknown: skipped, CPU serves
    [],                                                  # empty: the CPU
    None,                                                # none given: the CPU
], ids=["cuda-then-cpu", "unknown", "empty", "none"])
def test_provider_lists_fall_back_like_onnxruntime(providers):
    if providers and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here: nothing falls back")
    o, o_warned = _warnings_of(lambda: ort.InferenceSession(_model(), providers=providers))
    e, e_warned = _warnings_of(lambda: ember.InferenceSession(_model(), providers=providers))
    assert e.get_providers()[-1] == o.get_providers()[-1] == "CPUExecutionProvider"
    assert bool(e_warned) == bool(o_warned)
    # the same sentence up to the list of available providers, which differs by runtime
    assert [w.split("Available")[0] for w in e_warned] == \
        [w.split("Available")[0] for w in o_warned]
    np.testing.assert_allclose(e.run(None, {"x": X})[0], o.run(None, {"x": X})[0])


def test_providers_with_options_and_provider_options():
    pairs = [("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})]
    o, e = _both(_model(), providers=pairs)
    assert e.get_provider_options().keys() == o.get_provider_options().keys()
    e2 = ember.InferenceSession(_model(), providers=["CPUExecutionProvider"],
                                provider_options=[{"a": "1"}])
    assert e2.get_provider_options()["CPUExecutionProvider"] == {"a": "1"}
    with pytest.raises(EmberError, match="as many"):
        ember.InferenceSession(_model(), providers=["CPUExecutionProvider"],
                               provider_options=[{}, {}])
    with pytest.raises(EmberError, match="pair"):
        ember.InferenceSession(_model(), providers=[("CPUExecutionProvider",)])


def test_available_providers_and_device():
    available = ember.get_available_providers()
    assert available[-1] == "CPUExecutionProvider"
    assert set(available) <= {"CPUExecutionProvider", "OpenCLExecutionProvider",
                              "CUDAExecutionProvider"}
    assert ember.get_device() == ("GPU" if len(available) > 1 else "CPU")


def test_set_providers_and_disable_fallback():
    e = ember.InferenceSession(_model(), providers=["CPUExecutionProvider"])
    if "OpenCLExecutionProvider" in ember.get_available_providers():
        e.set_providers(["OpenCLExecutionProvider"])
        assert e.get_providers() == ["OpenCLExecutionProvider", "CPUExecutionProvider"]
        np.testing.assert_allclose(e.run(None, {"x": X})[0],
                                   ort.InferenceSession(_model()).run(None, {"x": X})[0],
                                   rtol=1e-6)
    e.set_providers(["CPUExecutionProvider"])
    assert e.get_providers() == ["CPUExecutionProvider"]
    e.disable_fallback()
    with pytest.raises(BackendUnavailableError, match="fallback is disabled"):
        e.set_providers(["NoSuchExecutionProvider"])
    e.enable_fallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e.set_providers(["NoSuchExecutionProvider"])
    assert e.get_providers() == ["CPUExecutionProvider"]


def test_session_options_have_meaning(tmp_path):
    options = ember.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ember.GraphOptimizationLevel.ORT_DISABLE_ALL
    e = ember.InferenceSession(_model(), options, providers=["CPUExecutionProvider"])
    assert e._session.threads == 1
    assert len(e._session.model.graph.nodes) == 3          # not simplified
    assert e.get_session_options() is options

    options = ember.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    e = ember.InferenceSession(_model(), options)
    written = onnx.load(options.optimized_model_filepath)
    assert len(written.graph.node) <= 3
    np.testing.assert_allclose(ember.InferenceSession(options.optimized_model_filepath)
                               .run(None, {"x": X})[0], e.run(None, {"x": X})[0])
    assert ember.SessionOptions().graph_optimization_level == \
        ort.SessionOptions().graph_optimization_level
    options.add_session_config_entry("session.use_env_allocators", "1")
    assert options.get_session_config_entry("session.use_env_allocators") == "1"


def test_an_onnxruntime_session_options_object_is_read():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    e = ember.InferenceSession(_model(), options, providers=["CPUExecutionProvider"])
    assert e._session.threads == 1
    assert len(e._session.model.graph.nodes) == 3


def test_run_options_and_terminate():
    o, e = _both(_model(), providers=["CPUExecutionProvider"])
    for runtime, session in (("ort", o), ("ember", e)):
        options = (ort if runtime == "ort" else ember).RunOptions()
        options.log_severity_level = 3
        session.run(None, {"x": X}, options)
        options.terminate = True
        with pytest.raises(Exception, match="terminate flag"):
            session.run(None, {"x": X}, options)
    with pytest.raises(ExecutionError):
        options = ember.RunOptions()
        options.terminate = True
        e.run(None, {"x": X}, options)


def test_overridable_initializers_match():
    o, e = _both(_model(with_overridable=True), providers=["CPUExecutionProvider"])
    assert [(a.name, a.type, a.shape) for a in e.get_overridable_initializers()] == \
        [(a.name, a.type, a.shape) for a in o.get_overridable_initializers()]
    assert [a.name for a in e.get_inputs()] == [a.name for a in o.get_inputs()]
    b = np.array([10, 20, 30], np.float32)
    np.testing.assert_allclose(e.run(None, {"x": X, "b": b})[0],
                               o.run(None, {"x": X, "b": b})[0])


def test_run_async_calls_back_from_a_worker_thread():
    o, e = _both(_model(), providers=["CPUExecutionProvider"])
    done, got = threading.Event(), {}

    def callback(outputs, user_data, error):
        got.update(outputs=outputs, user_data=user_data, error=error,
                   thread=threading.current_thread())
        done.set()

    e.run_async(None, {"x": X}, callback, "data")
    assert done.wait(30)
    assert got["error"] == "" and got["user_data"] == "data"
    assert got["thread"] is not threading.main_thread()
    np.testing.assert_allclose(got["outputs"][0], o.run(None, {"x": X})[0])
    # a missing input raises at the call, as onnxruntime's does
    with pytest.raises(ValueError):
        o.run_async(None, {"z": X}, callback, None)
    with pytest.raises(ember.InputError):
        e.run_async(None, {"z": X}, callback, None)


def test_profile_is_chrome_trace_with_one_event_per_node(tmp_path):
    options, ort_options = ember.SessionOptions(), ort.SessionOptions()
    for opts, name in ((options, "ember"), (ort_options, "ort")):
        opts.enable_profiling = True
        opts.profile_file_prefix = str(tmp_path / f"{name}_profile_")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    e = ember.InferenceSession(_model(), options)
    o = ort.InferenceSession(_model(), ort_options, providers=["CPUExecutionProvider"])
    for _ in range(2):
        e.run(None, {"x": X})
        o.run(None, {"x": X})
    ours, theirs = (json.load(open(s.end_profiling())) for s in (e, o))
    assert e.end_profiling() == o.end_profiling() == ""    # ended: nothing more to write

    def nodes(events):
        return [ev for ev in events if ev["cat"] == "Node"]

    assert len(nodes(ours)) == 2 * 3
    for event in ours:
        assert {"cat", "name", "ph", "ts", "dur", "pid", "tid", "args"} <= event.keys()
        assert event["ph"] == "X" and event["dur"] >= 0
    # the fields onnxruntime writes, with the same values per node
    keyed = {ev["name"]: ev["args"] for ev in nodes(theirs)}
    for event in nodes(ours)[:3]:
        want = keyed[event["name"]]
        for field in ("op_name", "provider", "input_type_shape", "output_type_shape",
                      "node_index"):
            assert event["args"][field] == want[field], (event["name"], field)
    assert sum(ev["name"] == "model_run" for ev in ours) == 2


# -- module-level names ---------------------------------------------------------------------

_ALLOCATORS = "onnxruntime's allocators and arenas; ember's memory is numpy's and its backends'"
_DEVICES = "onnxruntime's device descriptors and streams; OrtValue and IOBinding take names"
_PLUGIN_EPS = "plugin execution-provider libraries (C++); ember's backends are its own"
_TOOLS = ("onnxruntime's model tools (quantiser, transformer optimiser): ember runs the files "
          "they write")
_COMPILE = "compiling EP-context models for onnxruntime's execution providers"
_PACKAGE = "onnxruntime's model-package format; ember loads ONNX files and bytes"
_BUILD = "onnxruntime's own build, version, DLLs and diagnostics (ember.__version__ is ours)"
_INTERNALS = "modules and import machinery inside onnxruntime's package, not its API"
# onnxruntime's public module-level names that ember does not have, each with why (the table
# of docs/ort_compat.md); a name onnxruntime adds that is in neither fails the sweep below.
ORT_ABSENT = {
    "AdapterFormat": "LoRA adapter files: ember loads no adapters",
    "LoraAdapter": "LoRA adapter files: ember loads no adapters",
    "ModelCompiler": _COMPILE, "OrtCompileApiFlags": _COMPILE,
    "OrtEpContextData": _COMPILE, "OrtEpContextDataBuffer": _COMPILE,
    "ModelPackage": _PACKAGE, "ModelPackageComponentContext": _PACKAGE,
    "ModelPackageContext": _PACKAGE, "ModelPackageOptions": _PACKAGE,
    "ModelPackageWriteMode": _PACKAGE,
    "OrtAllocatorType": _ALLOCATORS, "OrtArenaCfg": _ALLOCATORS, "OrtMemType": _ALLOCATORS,
    "OrtMemoryInfo": _ALLOCATORS, "OrtDeviceMemoryType": _ALLOCATORS,
    "OrtMemoryInfoDeviceType": _ALLOCATORS, "create_and_register_allocator": _ALLOCATORS,
    "create_and_register_allocator_v2": _ALLOCATORS,
    "OrtDevice": _DEVICES, "OrtDeviceVendorId": _DEVICES, "OrtSyncStream": _DEVICES,
    "copy_tensors": _DEVICES,
    "OrtEpDevice": _PLUGIN_EPS, "OrtHardwareDevice": _PLUGIN_EPS,
    "OrtHardwareDeviceType": _PLUGIN_EPS, "OrtExecutionProviderDevicePolicy": _PLUGIN_EPS,
    "OrtEpAssignedNode": _PLUGIN_EPS, "OrtEpAssignedSubgraph": _PLUGIN_EPS,
    "get_ep_devices": _PLUGIN_EPS, "register_execution_provider_library": _PLUGIN_EPS,
    "unregister_execution_provider_library": _PLUGIN_EPS,
    "OrtExternalInitializerInfo": "initializers handed over in memory; ember reads external "
                                  "data from files beside the model",
    "OrtSparseFormat": "sparse feeds and outputs; ember takes sparse initialisers only",
    "SparseTensor": "sparse feeds and outputs; ember takes sparse initialisers only",
    "SessionIOBinding": "the C++ class under IOBinding, which ember has",
    "set_default_logger_callback": "use a logging.Handler on the `ember` logger",
    "set_global_thread_pool_sizes": "ember's threads are per session (intra_op_num_threads)",
    "set_seed": "random ops use their seed attribute, else EMBER_RANDOM_SEED",
    "get_build_info": _BUILD, "get_version_string": _BUILD, "version": _BUILD,
    "package_name": _BUILD, "cuda_version": _BUILD, "has_collective_ops": _BUILD,
    "preload_dlls": _BUILD, "print_debug_info": _BUILD,
    "capi": _INTERNALS, "contextlib": _INTERNALS, "onnxruntime_validation": _INTERNALS,
    "import_capi_exception": _INTERNALS,
    # onnxruntime's model tools, on its namespace once imported: ember runs the files they write
    "quantization": _TOOLS, "transformers": _TOOLS, "tools": _TOOLS,
}
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "ort_compat.md")


def test_every_onnxruntime_name_is_present_or_listed_as_absent():
    public = {n for n in dir(ort) if not n.startswith("_")}
    unlisted = sorted(n for n in public if not hasattr(ember, n) and n not in ORT_ABSENT)
    assert not unlisted, (f"onnxruntime {ort.__version__} has {unlisted}: add each to ember's "
                          "compat surface, or to ORT_ABSENT and docs/ort_compat.md with why not")
    stale = sorted(n for n in ORT_ABSENT if hasattr(ember, n))
    assert not stale, f"{stale} are on ember now: take them out of ORT_ABSENT and the docs"
    assert all(reason.strip() for reason in ORT_ABSENT.values())
    absent_table = open(DOCS).read().split("## Absent", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"`(\w+)`", absent_table)) >= set(ORT_ABSENT), \
        "docs/ort_compat.md's Absent table lists other names than ORT_ABSENT"
    for name in public - set(ORT_ABSENT):
        assert name in ember.__all__, f"{name} is on ember but not in ember.__all__"


@pytest.fixture
def restore_log_levels():
    level = logging.getLogger("ember").level
    yield
    logging.getLogger("ember").setLevel(level)
    ort.set_default_logger_severity(2)  # onnxruntime's default: warnings


def test_default_logger_severity_and_verbosity_end_as_in_onnxruntime(restore_log_levels):
    """`ort.set_default_logger_severity(3)` and its kin: accepted and refused alike; the
    severity is the `ember` logger's level."""
    levels = [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
    for severity, level in enumerate(levels):
        ort.set_default_logger_severity(severity)
        ember.set_default_logger_severity(severity)
        assert logging.getLogger("ember").level == level
    for bad in (5, -1, "3", 2.0):
        with pytest.raises((RuntimeError, TypeError)):
            ort.set_default_logger_severity(bad)
        with pytest.raises(EmberError, match="severity"):
            ember.set_default_logger_severity(bad)
    for verbosity in (0, 1, 1000, -1):
        assert ort.set_default_logger_verbosity(verbosity) is None
        assert ember.set_default_logger_verbosity(verbosity) is None
    for bad in ("1", 2.5):
        with pytest.raises(TypeError):
            ort.set_default_logger_verbosity(bad)
        with pytest.raises(EmberError, match="verbosity"):
            ember.set_default_logger_verbosity(bad)
    ember.set_default_logger_severity(3)
    options = ember.SessionOptions()
    options.log_severity_level = 1  # a session's severity sets the same level
    ember.InferenceSession(_model(), options)
    assert logging.getLogger("ember").level == logging.INFO


def test_all_providers_and_telemetry():
    assert set(ember.get_available_providers()) <= set(ember.get_all_providers())
    assert ember.get_all_providers()[-1] == "CPUExecutionProvider"
    assert {"CPUExecutionProvider", "CUDAExecutionProvider"} <= set(ort.get_all_providers()) \
        & set(ember.get_all_providers())  # the names ember shares with onnxruntime
    for name in ("disable_telemetry_events", "enable_telemetry_events"):
        assert getattr(ort, name)() is None and getattr(ember, name)() is None


# -- string feeds ---------------------------------------------------------------------------

def _string_model():
    """x (string [1, n]) -> StringNormalizer(LOWER, a stop word) and an Identity of x."""
    S = TensorProto.STRING
    graph = helper.make_graph(
        [helper.make_node("StringNormalizer", ["x"], ["low"], case_change_action="LOWER",
                          stopwords=["the"], locale="C.UTF-8" if _no_en_us() else "en_US.UTF-8"),
         helper.make_node("Identity", ["x"], ["same"])],
        "strings", [helper.make_tensor_value_info("x", S, [1, None])],
        [helper.make_tensor_value_info("low", S, [1, None]),
         helper.make_tensor_value_info("same", S, [1, None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]) \
        .SerializeToString()


def _no_en_us() -> bool:
    """onnxruntime's StringNormalizer needs its locale installed (ember's does not)."""
    import locale

    saved = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "en_US.UTF-8")
        return False
    except locale.Error:
        return True
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)


WORDS = ["The", "Cat", "émeu", "", "ÇA"]


@pytest.mark.parametrize("feed", [
    np.array([WORDS]),                                            # <U4
    np.array([[w.encode() for w in WORDS]], dtype="S8"),          # bytes, UTF-8
    np.array([WORDS], dtype=object),
    np.array([WORDS])[:, ::-1],                                   # a strided view
    [WORDS],
], ids=["unicode", "bytes", "object", "strided", "list"])
def test_string_feeds_as_onnxruntime_takes_them(feed):
    o, e = _both(_string_model(), providers=["CPUExecutionProvider"])
    got, want = e.run(None, {"x": feed}), o.run(None, {"x": feed})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == object and g.shape == w.shape
        assert [type(s) for s in g.reshape(-1)] == [str] * g.size
        assert g.tolist() == w.tolist()


def test_bytes_feed_read_as_numpy_reads_it():
    """A bytes array whose longest element fills its width: numpy's values (onnxruntime 1.32
    reads past the end of such an element, so it is no oracle here)."""
    feed = np.array([[b"ab", b"c"]])[:, ::-1]
    got = ember.InferenceSession(_string_model()).run(["same"], {"x": feed})[0]
    assert got.tolist() == [["c", "ab"]]


@pytest.mark.parametrize("feed, message", [
    (np.array([[b"ok", b"\xff\xfe"]]), r"element \[0, 1\] is bytes that are not valid UTF-8"),
    (np.array([["a", 1]], dtype=object), r"element \[0, 1\] is int 1"),
    (np.array([[None]], dtype=object), r"element \[0, 0\] is NoneType"),
    (np.zeros((1, 2), np.float32), "expects strings .* got dtype float32"),
])
def test_string_feeds_that_are_not_text_are_input_errors(feed, message):
    """Undecodable bytes fail in both; a number or None among the strings is an error in ember,
    where onnxruntime would store str() of it (kernels would meet a non-str otherwise)."""
    e = ember.InferenceSession(_string_model())
    with pytest.raises(ember.InputError, match=message):
        e.run(None, {"x": feed})
