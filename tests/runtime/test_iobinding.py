"""Device-resident values: `ember.OrtValue` and `IOBinding` side by side with onnxruntime's, and
a KV-cache decode loop on OpenCL whose cache never leaves the device (counted transfers)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ember
from backends import unavailable_reason
from ember.runtime.backends import get_backend

ort = pytest.importorskip("onnxruntime")

NO_OPENCL = unavailable_reason("opencl")
needs_opencl = pytest.mark.skipif(NO_OPENCL is not None, reason=f"opencl unavailable: {NO_OPENCL}")
BACKENDS = ["cpu", pytest.param("opencl", marks=needs_opencl)]
PROVIDER = {"cpu": "CPUExecutionProvider", "opencl": "OpenCLExecutionProvider",
            "cuda": "CUDAExecutionProvider"}


def small_model() -> bytes:
    """y = a + b (device), c = CumSum(a) (no OpenCL kernel: a host node reading an input),
    s = Shape(a) (host metadata)."""
    nodes = [helper.make_node("Add", ["a", "b"], ["y"]),
             helper.make_node("CumSum", ["a", "axis"], ["c"]),
             helper.make_node("Shape", ["a"], ["s"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "small",
        [helper.make_tensor_value_info("a", f, ["n", 3]),
         helper.make_tensor_value_info("b", f, ["n", 3])],
        [helper.make_tensor_value_info("y", f, ["n", 3]),
         helper.make_tensor_value_info("c", f, ["n", 3]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [numpy_helper.from_array(np.array(0, np.int64), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def transfers(backend: str) -> dict:
    return dict(getattr(get_backend(backend), "transfers", {"to_device": 0, "to_host": 0}))


def delta(before: dict, backend: str) -> tuple[int, int]:
    after = transfers(backend)
    return after["to_device"] - before["to_device"], after["to_host"] - before["to_host"]


# -- OrtValue ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int32,
                                   np.uint8, np.bool_])
def test_ortvalue_matches_onnxruntime(backend, dtype):
    array = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    ours = ember.OrtValue.ortvalue_from_numpy(array, backend)
    theirs = ort.OrtValue.ortvalue_from_numpy(array)
    assert ours.shape() == theirs.shape() == [2, 3, 4]
    assert ours.data_type() == theirs.data_type()
    assert ours.element_type() == theirs.element_type()
    assert ours.tensor_size_in_bytes() == theirs.tensor_size_in_bytes()
    assert ours.is_tensor() and ours.has_value() and not ours.is_tensor_sequence()
    assert ours.device_name() == backend
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    np.testing.assert_array_equal(np.asarray(ours), array)
    if backend == "cpu":  # shares the numpy array's memory, as onnxruntime's does
        assert ours.data_ptr() == theirs.data_ptr() == array.ctypes.data
    else:
        assert ours.backend is get_backend(backend)
        assert get_backend(backend).is_device_array(ours.data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("element_type", [np.float32, np.int64, TensorProto.FLOAT16,
                                          TensorProto.BOOL])
def test_ortvalue_from_shape_and_type(backend, element_type):
    ours = ember.OrtValue.ortvalue_from_shape_and_type([3, 0, 2] if element_type is np.int64
                                                       else [3, 2], element_type, backend)
    theirs = ort.OrtValue.ortvalue_from_shape_and_type([3, 0, 2] if element_type is np.int64
                                                       else [3, 2], element_type)
    assert (ours.shape(), ours.data_type(), ours.element_type()) == \
        (theirs.shape(), theirs.data_type(), theirs.element_type())
    assert ours.device_name() == backend
    assert not ours.numpy().any()  # zero-filled (onnxruntime leaves it uninitialised)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ortvalue_update_inplace(backend):
    value = ember.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float32, backend)
    value.update_inplace(np.full((2, 2), 3, np.float32))
    np.testing.assert_array_equal(value.numpy(), np.full((2, 2), 3, np.float32))
    with pytest.raises(ember.InputError, match="update_inplace"):
        value.update_inplace(np.zeros((3,), np.float32))


def test_device_types():
    assert ember.OrtValue.ortvalue_from_numpy(np.zeros(2), "CPU").device_name() == "cpu"
    with pytest.raises(ember.BackendUnavailableError, match="unsupported device type 'npu'"):
        ember.OrtValue.ortvalue_from_numpy(np.zeros(2), "npu")
    with pytest.raises(TypeError):
        ember.OrtValue(np.zeros(2), "cpu")  # the backend is an object, not a name


@needs_opencl
def test_gpu_alias_is_the_session_device():
    sess = ember.InferenceSession(small_model(), providers=["OpenCLExecutionProvider"])
    value = sess.create_ortvalue_from_shape_and_type([2, 3], np.float32, "gpu")
    assert value.device_name() == "opencl"
    binding = sess.io_binding()
    binding.bind_output("y", "gpu")
    binding.bind_ortvalue_input("a", value)
    binding.bind_ortvalue_input("b", value)
    sess.run_with_iobinding(binding)
    assert binding.get_outputs()[0].device_name() == "opencl"
    with pytest.raises(ember.BackendUnavailableError, match="device_id 1"):
        binding.bind_output("y", "opencl", 1)


# -- IOBinding against onnxruntime's ----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_iobinding_matches_onnxruntime(backend):
    """The same calls on onnxruntime's IOBinding (CPU) and ember's (on `backend`), with inputs
    placed on `backend` for ember, give the same outputs in the same order."""
    model = small_model()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3)).astype(np.float32)
    b = rng.standard_normal((2, 3)).astype(np.float32)
    sessions = {"ort": ort.InferenceSession(model, providers=["CPUExecutionProvider"]),
                "ember": ember.InferenceSession(model, providers=[PROVIDER[backend]])}
    values = {"ort": ort.OrtValue, "ember": ember.OrtValue}
    device = {"ort": "cpu", "ember": backend}
    bindings = {k: s.io_binding() for k, s in sessions.items()}

    def run():
        for k, s in sessions.items():
            s.run_with_iobinding(bindings[k])

    def same_outputs(expected_names):
        ours, theirs = bindings["ember"].get_outputs(), bindings["ort"].get_outputs()
        assert len(ours) == len(theirs) == len(expected_names)
        for o, t in zip(ours, theirs):
            assert (o.shape(), o.data_type()) == (t.shape(), t.data_type())
        for o, t in zip(bindings["ember"].copy_outputs_to_cpu(),
                        bindings["ort"].copy_outputs_to_cpu()):
            assert o.dtype == t.dtype
            np.testing.assert_allclose(o, t, rtol=1e-6, atol=1e-6)

    for k, binding in bindings.items():
        assert binding.get_outputs() == []
        binding.bind_cpu_input("a", a)
        binding.bind_ortvalue_input("b", values[k].ortvalue_from_numpy(b, device[k]))
    for k, s in sessions.items():  # no output bound
        with pytest.raises((ember.InputError, RuntimeError), match="output"):
            s.run_with_iobinding(bindings[k])

    for binding in bindings.values():
        binding.bind_output("s")
        binding.bind_output("y")
        binding.bind_output("c")
    run()
    same_outputs("syc")
    assert [v.device_name() for v in bindings["ember"].get_outputs()] == ["cpu"] * 3

    for binding in bindings.values():  # rebinding a name replaces it, in its place
        binding.bind_cpu_input("a", 3 * a)
        binding.bind_output("s")
    run()
    same_outputs("syc")

    prealloc = {k: values[k].ortvalue_from_shape_and_type([2, 3], np.float32) for k in values}
    for k, binding in bindings.items():
        binding.clear_binding_outputs()
        assert binding.get_outputs() == []
        binding.bind_ortvalue_output("y", prealloc[k])
    run()
    same_outputs("y")
    np.testing.assert_allclose(prealloc["ember"].numpy(), prealloc["ort"].numpy(), rtol=1e-6)
    assert bindings["ember"].get_outputs()[0] is prealloc["ember"]

    x = np.ascontiguousarray(2 * a)
    for binding in bindings.values():  # a raw host pointer
        binding.bind_input("a", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
        binding.clear_binding_outputs()
        binding.bind_output("y")
    run()
    same_outputs("y")

    buffers = {k: np.zeros((2, 3), np.float32) for k in bindings}
    for k, binding in bindings.items():  # an output written into memory given by address
        binding.clear_binding_outputs()
        binding.bind_output("y", "cpu", 0, np.float32, [2, 3], buffers[k].ctypes.data)
    run()
    same_outputs("y")
    np.testing.assert_allclose(buffers["ember"], buffers["ort"], rtol=1e-6)
    assert buffers["ember"].any()

    for names in (["y"], None):
        ours = sessions["ember"].run_with_ort_values(
            names, {"a": ember.OrtValue.ortvalue_from_numpy(a, backend),
                    "b": ember.OrtValue.ortvalue_from_numpy(b)})
        theirs = sessions["ort"].run_with_ort_values(
            names, {"a": ort.OrtValue.ortvalue_from_numpy(a),
                    "b": ort.OrtValue.ortvalue_from_numpy(b)})
        assert len(ours) == len(theirs) and all(isinstance(v, ember.OrtValue) for v in ours)
        for o, t in zip(ours, theirs):
            np.testing.assert_allclose(o.numpy(), t.numpy(), rtol=1e-6, atol=1e-6)

    for k, s in sessions.items():  # a missing input
        bindings[k].clear_binding_inputs()
        bindings[k].bind_cpu_input("b", b)
        with pytest.raises((ember.InputError, RuntimeError)):
            s.run_with_iobinding(bindings[k])


def test_iobinding_errors():
    sess = ember.InferenceSession(small_model())
    binding = sess.io_binding()
    with pytest.raises(ember.InputError, match="cannot bind input 'z'"):
        binding.bind_cpu_input("z", np.zeros(1))
    with pytest.raises(ember.InputError, match="cannot bind output 'z'"):
        binding.bind_output("z")
    with pytest.raises(ember.InputError, match="element_type"):
        binding.bind_output("y", "cpu", 0, None, None, 1234)
    binding.bind_cpu_input("a", np.zeros((2, 3), np.float64))
    binding.bind_cpu_input("b", np.zeros((2, 3), np.float32))
    binding.bind_output("y")
    with pytest.raises(ember.InputError, match="input 'a' expects dtype float32"):
        sess.run_with_iobinding(binding)
    binding.bind_cpu_input("a", np.zeros((2, 3), np.float32))
    wrong = ember.OrtValue.ortvalue_from_shape_and_type([3, 3], np.float32)
    binding.bind_ortvalue_output("y", wrong)
    with pytest.raises(ember.InputError, match=r"output 'y' is float32 \[2, 3\] but the buffer"):
        sess.run_with_iobinding(binding)
    with pytest.raises(ValueError, match="session that created it"):
        ember.InferenceSession(small_model()).run_with_iobinding(binding)


@needs_opencl
def test_iobinding_device_outputs_stay_on_the_device():
    sess = ember.InferenceSession(small_model(), providers=["OpenCLExecutionProvider"])
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2))
    expected = dict(zip("ycs", ort.InferenceSession(small_model()).run(["y", "c", "s"],
                                                                          {"a": a, "b": b})))
    da = ember.OrtValue.ortvalue_from_numpy(a, "opencl")
    db = ember.OrtValue.ortvalue_from_numpy(b, "opencl")
    binding = sess.io_binding()
    binding.bind_ortvalue_input("a", da)
    binding.bind_input("b", "opencl", 0, np.float32, db.shape(), db.data_ptr())  # a cl_mem handle
    binding.bind_output("y", "opencl")
    before = transfers("opencl")
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    assert delta(before, "opencl") == (0, 0)  # device in, device out: no copy at all
    (y,) = binding.get_outputs()
    assert y.device_name() == "opencl"
    np.testing.assert_allclose(y.numpy(), expected["y"], rtol=1e-6)

    # c comes from a host node (CumSum has no OpenCL kernel): `a` goes down once for it, and
    # c goes up once because it is bound to the device; the shape output is host data.
    out = ember.OrtValue.ortvalue_from_shape_and_type([4, 3], np.float32, "opencl")
    binding.clear_binding_outputs()
    binding.bind_ortvalue_output("y", out)
    binding.bind_output("c", "opencl")
    binding.bind_output("s", "cpu")
    before = transfers("opencl")
    sess.run_with_iobinding(binding)
    got = binding.get_outputs()
    assert [v.device_name() for v in got] == ["opencl", "opencl", "cpu"]
    assert got[0] is out  # written in place, on the device
    where = {n: w for n, _, w in sess._session.placement}
    if where["c"] == "fallback":
        assert delta(before, "opencl") == (1, 1)
    for name, value in zip("ycs", binding.copy_outputs_to_cpu()):
        np.testing.assert_allclose(value, expected[name], rtol=1e-6)

    handle = ember.OrtValue.ortvalue_from_shape_and_type([4, 3], np.float32, "opencl")
    binding.clear_binding_outputs()
    binding.bind_output("y", "opencl", 0, np.float32, [4, 3], handle.data_ptr())
    before = transfers("opencl")
    sess.run_with_iobinding(binding)
    assert delta(before, "opencl") == (0, 0)
    np.testing.assert_allclose(handle.numpy(), expected["y"], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_run_device_outputs(backend):
    sess = ember.load(small_model(), backend=backend)
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((3, 3)).astype(np.float32) for _ in range(2))
    host = sess.run({"a": a, "b": b})
    out = sess.run({"a": a, "b": b}, device_outputs=True)
    assert list(out) == ["y", "c", "s"] and all(isinstance(v, ember.OrtValue) for v in out.values())
    placement = {n: w for n, _, w in sess.placement}
    for name, value in out.items():
        on_device = backend != "cpu" and placement[name] == "device"
        assert value.device_name() == (backend if on_device else "cpu"), name
        np.testing.assert_array_equal(value.numpy(), host[name])
    # feed device values back: OrtValues and raw device arrays alike, no copy for either
    before = transfers(backend)
    again = sess.run({"a": out["y"], "b": out["y"].data}, outputs=["y"], device_outputs=True)
    if backend != "cpu":
        assert delta(before, backend) == (0, 0)
    np.testing.assert_allclose(again["y"].numpy(), 2 * host["y"], rtol=1e-6)
    # plain run() with device feeds still returns numpy; CumSum reads the device feed via host
    plain = sess.run({"a": out["y"], "b": out["y"]})
    assert all(isinstance(v, np.ndarray) for v in plain.values())
    np.testing.assert_allclose(plain["c"], np.cumsum(host["y"], axis=0), rtol=1e-5)


@needs_opencl
def test_device_feeds_are_checked_without_copies():
    sess = ember.load(small_model(), backend="opencl")
    be = get_backend("opencl")
    good = be.to_device(np.zeros((2, 3), np.float32))
    before = transfers("opencl")
    with pytest.raises(ember.InputError, match="input 'a' expects dtype float32, got float64"):
        sess.run({"a": be.to_device(np.zeros((2, 3))), "b": good})
    with pytest.raises(ember.InputError, match=r"input 'b' expects rank 2"):
        sess.run({"a": good, "b": be.to_device(np.zeros((6,), np.float32))})
    with pytest.raises(ember.InputError, match="dimension 'n' is 2 in input 'a' but 4"):
        sess.run({"a": good, "b": be.to_device(np.zeros((4, 3), np.float32))})
    assert delta(before, "opencl") == (3, 0)  # the three uploads above, nothing brought back


@needs_opencl
def test_device_values_of_another_backend_go_through_the_host():
    sess = ember.load(small_model(), backend="cpu")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    value = ember.OrtValue.ortvalue_from_numpy(a, "opencl")
    before = transfers("opencl")
    out = sess.run({"a": value, "b": value.data}, device_outputs=True)  # OrtValue, raw array
    assert delta(before, "opencl")[1] >= 1
    assert out["y"].device_name() == "cpu"
    np.testing.assert_array_equal(out["y"].numpy(), 2 * a)


# -- a KV-cache decode loop -------------------------------------------------------------------

D, H, VOCAB, STEPS = 32, 4, 40, 16
DH = D // H


def decoder_model() -> tuple[bytes, np.ndarray, np.ndarray]:
    """One decoder step: x [1,1,D], past_k/past_v [1,H,T,dh] -> logits [1,1,V] and
    present_k/present_v = Concat(past, new) [1,H,T+1,dh], with attention over the cache
    (MatMul, Softmax, MatMul). Returns the model, a token embedding and a position table."""
    rng = np.random.default_rng(7)

    def weight(name, shape, scale=0.4):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(values, name)

    inits = [weight("Wq", (D, D)), weight("Wk", (D, D)), weight("Wv", (D, D)),
             weight("Wo", (D, D)), weight("Wout", (D, VOCAB)),
             numpy_helper.from_array(np.array([1, 1, H, DH], np.int64), "heads"),
             numpy_helper.from_array(np.array([1, 1, D], np.int64), "flat"),
             numpy_helper.from_array(np.array(1 / np.sqrt(DH), np.float32), "scale")]
    nodes = []
    for name, w in (("q", "Wq"), ("k", "Wk"), ("v", "Wv")):
        nodes += [helper.make_node("MatMul", ["x", w], [f"{name}_p"]),
                  helper.make_node("Reshape", [f"{name}_p", "heads"], [f"{name}_r"]),
                  helper.make_node("Transpose", [f"{name}_r"], [name], perm=[0, 2, 1, 3])]
    nodes += [
        helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
        helper.make_node("Transpose", ["present_k"], ["kT"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kT"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_v"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "flat"], ["ctx_f"]),
        helper.make_node("MatMul", ["ctx_f", "Wo"], ["attn"]),
        helper.make_node("Add", ["x", "attn"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "Wout"], ["logits"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "decoder_step",
        [helper.make_tensor_value_info("x", f, [1, 1, D]),
         helper.make_tensor_value_info("past_k", f, [1, H, "T", DH]),
         helper.make_tensor_value_info("past_v", f, [1, H, "T", DH])],
        [helper.make_tensor_value_info("logits", f, [1, 1, VOCAB]),
         helper.make_tensor_value_info("present_k", f, [1, H, "T1", DH]),
         helper.make_tensor_value_info("present_v", f, [1, H, "T1", DH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    embedding = rng.standard_normal((VOCAB, D)).astype(np.float32)
    positions = (rng.standard_normal((STEPS, D)) * 0.5).astype(np.float32)
    return model.SerializeToString(), embedding, positions


def greedy(step, embedding, positions) -> list[int]:
    """Greedy decoding from token 0: `step(t, x)` runs one step and returns the logits."""
    token, tokens = 0, []
    for t in range(STEPS):
        logits = step(t, (embedding[token] + positions[t])[None, None])
        token = int(np.argmax(logits[0, 0]))
        tokens.append(token)
    return tokens


def ort_tokens(model, embedding, positions) -> tuple[list[int], float]:
    """onnxruntime's own io_binding loop (CPU), and the smallest top-1/top-2 logit gap."""
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    empty = np.zeros((1, H, 0, DH), np.float32)
    cache = [ort.OrtValue.ortvalue_from_numpy(empty), ort.OrtValue.ortvalue_from_numpy(empty)]
    gaps = []

    def step(t, x):
        # onnxruntime keeps each run's outputs bound as the next run's buffers, so a growing
        # cache is bound afresh every step (ember allocates bound outputs anew on each run)
        for name in ("logits", "present_k", "present_v"):
            binding.bind_output(name, "cpu")
        binding.bind_cpu_input("x", x)
        binding.bind_ortvalue_input("past_k", cache[0])
        binding.bind_ortvalue_input("past_v", cache[1])
        sess.run_with_iobinding(binding)
        logits, cache[0], cache[1] = binding.get_outputs()
        top = np.sort(logits.numpy()[0, 0])
        gaps.append(float(top[-1] - top[-2]))
        return logits.numpy()

    return greedy(step, embedding, positions), min(gaps)


def ember_iobinding_tokens(model, embedding, positions, backend):
    """The same loop on ember: logits bound to the host, the cache to the device, each step's
    present fed back as the next past. Returns the tokens and (to_device, to_host) per step."""
    sess = ember.InferenceSession(model, providers=[PROVIDER[backend]])
    binding = sess.io_binding()
    empty = np.zeros((1, H, 0, DH), np.float32)
    cache = [ember.OrtValue.ortvalue_from_numpy(empty, backend),
             ember.OrtValue.ortvalue_from_numpy(empty, backend)]
    binding.bind_output("logits", "cpu")
    binding.bind_output("present_k", backend)
    binding.bind_output("present_v", backend)
    counts = []

    def step(t, x):
        binding.bind_cpu_input("x", x)
        binding.bind_ortvalue_input("past_k", cache[0])
        binding.bind_ortvalue_input("past_v", cache[1])
        before = transfers(backend)
        sess.run_with_iobinding(binding)
        logits, cache[0], cache[1] = binding.get_outputs()
        counts.append(delta(before, backend))
        assert cache[0].shape() == [1, H, t + 1, DH] and cache[0].device_name() == backend
        assert logits.device_name() == "cpu"
        return logits.numpy()

    return greedy(step, embedding, positions), counts


def ember_session_tokens(model, embedding, positions, backend):
    """The loop in ember's own terms: Session.run(..., device_outputs=True)."""
    sess = ember.load(model, backend=backend)
    be = get_backend(backend)
    empty = np.zeros((1, H, 0, DH), np.float32)
    cache = {"past_k": be.to_device(empty), "past_v": be.to_device(empty)}
    counts = []

    def step(t, x):
        before = transfers(backend)
        out = sess.run({"x": x, **cache}, device_outputs=True)
        cache["past_k"], cache["past_v"] = out["present_k"], out["present_v"]
        logits = out["logits"].numpy()
        counts.append(delta(before, backend))
        return logits

    return greedy(step, embedding, positions), counts


def test_kv_cache_decode_matches_onnxruntime_on_cpu():
    model, embedding, positions = decoder_model()
    expected, gap = ort_tokens(model, embedding, positions)
    assert gap > 1e-3 and len(set(expected)) > 2  # a decode that a rounding cannot flip
    assert ember_iobinding_tokens(model, embedding, positions, "cpu")[0] == expected
    assert ember_session_tokens(model, embedding, positions, "cpu")[0] == expected


@needs_opencl
def test_kv_cache_decode_on_opencl_keeps_the_cache_on_the_device():
    model, embedding, positions = decoder_model()
    expected, _ = ort_tokens(model, embedding, positions)
    cpu_tokens, _ = ember_iobinding_tokens(model, embedding, positions, "cpu")
    sess = ember.load(model, backend="opencl")
    assert {w for _, _, w in sess.placement} == {"device"}, sess.placement

    # Per step exactly one upload (the new token's embedding) and one download (the logits):
    # the cache stays on the device. The first run of a fresh process also uploads the batched
    # GEMM's index tables once (kernel state, cached), so the counts are checked on every step
    # after the first, and on every step of a second loop.
    for _ in range(2):
        tokens, counts = ember_iobinding_tokens(model, embedding, positions, "opencl")
        assert tokens == expected == cpu_tokens
        assert counts[1:] == [(1, 1)] * (STEPS - 1), counts
    assert counts == [(1, 1)] * STEPS, counts

    tokens, counts = ember_session_tokens(model, embedding, positions, "opencl")
    assert tokens == expected
    assert counts == [(1, 1)] * STEPS, counts


@needs_opencl
def test_kv_cache_decode_without_device_values_moves_the_cache():
    """The baseline the binding avoids: numpy in, numpy out moves both caches both ways."""
    model, embedding, positions = decoder_model()
    sess = ember.load(model, backend="opencl")
    cache = {"past_k": np.zeros((1, H, 0, DH), np.float32),
             "past_v": np.zeros((1, H, 0, DH), np.float32)}
    counts = []

    def step(t, x):
        before = transfers("opencl")
        out = sess.run({"x": x, **cache})
        cache["past_k"], cache["past_v"] = out["present_k"], out["present_v"]
        counts.append(delta(before, "opencl"))
        return out["logits"]

    assert greedy(step, embedding, positions) == ort_tokens(model, embedding, positions)[0]
    assert counts[1:] == [(3, 3)] * (STEPS - 1), counts


def test_kv_cache_decode_on_cuda_keeps_the_cache_on_the_device():
    """The same loop on the CUDA backend: real cupy on a GPU, else tests/_fake_cupy.py (which
    checks residency: its arrays refuse to mix with host arrays)."""
    try:
        from backends import cuda_backend, real_cuda_device
    except ImportError as exc:
        pytest.skip(f"no CUDA test harness: {exc}")
    model, embedding, positions = decoder_model()
    expected, _ = ort_tokens(model, embedding, positions)
    with cuda_backend("gpu" if real_cuda_device() else "emulated"):
        for _ in range(2):  # the first step of a fresh process may upload kernel tables once
            tokens, counts = ember_iobinding_tokens(model, embedding, positions, "cuda")
            assert tokens == expected
            assert counts[1:] == [(1, 1)] * (STEPS - 1), counts
        assert counts == [(1, 1)] * STEPS, counts
        tokens, counts = ember_session_tokens(model, embedding, positions, "cuda")
        assert tokens == expected and counts == [(1, 1)] * STEPS, counts
