"""The ONNX backend test suites shipped in the onnx package, as data for ember's tests.

Node cases are generated from `onnx.backend.test.case.node.collect_testcases()` into a cache
folder (once per onnx version) in the same layout as the suites shipped as files
(`model.onnx`, `test_data_set_N/input_K.pb`, `output_K.pb`), so one loader reads them all.

Run directly to check cases by hand, e.g.  python tests/onnx_suites.py node -k softmax
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("EMBER_TEST_CACHE", os.path.join(REPO, ".cache"))
ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-7


@dataclass
class Case:
    name: str
    model_path: str
    data_sets: list[tuple[list, list]]  # (inputs, expected outputs), decoded lazily
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL


def node_cases_dir() -> str:
    """Folder holding the generated node cases for the installed onnx version."""
    root = os.path.join(CACHE, f"onnx-{onnx.__version__}", "node")
    marker = os.path.join(root, ".complete")
    if not os.path.exists(marker):
        _generate_node_cases(root)
        with open(marker, "w") as f:
            f.write(onnx.__version__)
    return root


def _generate_node_cases(root: str) -> None:
    from onnx.backend.test.case.node import collect_testcases

    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    for case in cases:
        case_dir = os.path.join(tmp, case.name)
        os.makedirs(case_dir)
        with open(os.path.join(case_dir, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        with open(os.path.join(case_dir, "tolerance.json"), "w") as f:
            json.dump({"rtol": case.rtol, "atol": case.atol}, f)
        graph = case.model.graph
        for i, (inputs, outputs) in enumerate(case.data_sets):
            ds = os.path.join(case_dir, f"test_data_set_{i}")
            os.makedirs(ds)
            for kind, values, infos in (("input", inputs, graph.input),
                                        ("output", outputs, graph.output)):
                for j, value in enumerate(values):
                    with open(os.path.join(ds, f"{kind}_{j}.pb"), "wb") as f:
                        f.write(_encode(value, infos[j]).SerializeToString())
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)


def _encode(value, info: onnx.ValueInfoProto):
    if isinstance(value, onnx.TensorProto):
        return value
    kind = info.type.WhichOneof("value")
    if kind == "sequence_type":
        return numpy_helper.from_list(value, info.name)
    if kind == "optional_type":
        return numpy_helper.from_optional(value, info.name)
    if kind == "map_type":
        return numpy_helper.from_dict(value, info.name)
    return numpy_helper.from_array(value, info.name)


def _decode_file(path: str, info: onnx.ValueInfoProto):
    with open(path, "rb") as f:
        data = f.read()
    kind = info.type.WhichOneof("value")
    if kind == "sequence_type":
        proto = onnx.SequenceProto()
        proto.ParseFromString(data)
        return numpy_helper.to_list(proto)
    if kind == "optional_type":
        proto = onnx.OptionalProto()
        proto.ParseFromString(data)
        return numpy_helper.to_optional(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(data)
    if proto.data_type == onnx.TensorProto.STRING:
        return np.array([s.decode("utf-8") for s in proto.string_data],
                        dtype=object).reshape(tuple(proto.dims))
    return numpy_helper.to_array(proto)


def load_case_dir(case_dir: str) -> Case:
    model_path = os.path.join(case_dir, "model.onnx")
    model = onnx.load(model_path, load_external_data=False)
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    feed_infos = [v for v in graph.input if v.name not in inits]
    data_sets = []
    for ds in sorted(d for d in os.listdir(case_dir) if d.startswith("test_data_set_")):
        ds_dir = os.path.join(case_dir, ds)
        n_in = len([f for f in os.listdir(ds_dir) if f.startswith("input_")])
        n_out = len([f for f in os.listdir(ds_dir) if f.startswith("output_")])
        # Some cases feed fewer inputs than the graph declares (optional trailing inputs).
        inputs = {feed_infos[j].name: _decode_file(os.path.join(ds_dir, f"input_{j}.pb"),
                                                   feed_infos[j]) for j in range(n_in)}
        outputs = [_decode_file(os.path.join(ds_dir, f"output_{j}.pb"), graph.output[j])
                   for j in range(n_out)]
        data_sets.append((inputs, outputs))
    tol = {"rtol": DEFAULT_RTOL, "atol": DEFAULT_ATOL}
    tol_path = os.path.join(case_dir, "tolerance.json")
    if os.path.exists(tol_path):
        with open(tol_path) as f:
            tol.update(json.load(f))
    return Case(os.path.basename(case_dir), model_path, data_sets, tol["rtol"], tol["atol"])


SUITES = ("node", "simple", "pytorch-converted", "pytorch-operator")


def suite_case_dirs(suite: str) -> list[str]:
    """Case folders of a suite: 'node' (generated), or 'simple', 'pytorch-converted',
    'pytorch-operator' (shipped in the onnx wheel)."""
    root = node_cases_dir() if suite == "node" else os.path.join(ONNX_DATA, suite)
    return sorted(os.path.join(root, d) for d in os.listdir(root)
                  if os.path.isdir(os.path.join(root, d)))


def light_models() -> list[str]:
    """Paths of the `light` model-zoo models in the onnx wheel."""
    root = os.path.join(ONNX_DATA, "light")
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".onnx"))


def load_light_case(model_path: str, folder: str | None = None) -> Case:
    """A light model with onnx's runner's inputs (arange(n)/n) and its stored outputs; with a
    `folder`, a model whose stored outputs are no sound oracle (_JUDGED_ON_LOGITS) comes cut
    before its Softmax, saved there, with onnx.reference's logits as the expected outputs."""
    model = onnx.load(model_path, load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for info in model.graph.input:
        if info.name in inits:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1
                      for d in info.type.tensor_type.shape.dim)
        n = int(np.prod(shape))
        feeds[info.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    prefix = os.path.splitext(model_path)[0]
    outputs = [_decode_file(f"{prefix}_output_{i}.pb", info)
               for i, info in enumerate(model.graph.output)]
    name = os.path.basename(prefix)
    case = Case(name, model_path, [(feeds, outputs)])
    return _logits_case(case, folder) if folder and name in _JUDGED_ON_LOGITS else case


# light_squeezenet's stored output is a Softmax over 1000 logits of ~6.8e9, all equal in the
# run that stored it. One float32 step there is 512, so the same float32 sums in another order
# (OpenBLAS's Haswell kernels, on AVX2 CPUs, round a product's last columns differently from
# the others) move its probabilities anywhere in [0, 1]: that oracle is unsound for it. The
# model is judged on its logits instead, the Softmax's input, against onnx.reference's.
_JUDGED_ON_LOGITS = {"light_squeezenet"}


def _logits_case(case: Case, folder: str) -> Case:
    """`case` with its model's final Softmax cut off (saved in `folder`): the logits are the
    output, and onnx.reference's logits the expected values."""
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(case.model_path)
    softmax = model.graph.node[-1]
    assert softmax.op_type == "Softmax" and softmax.output[0] == model.graph.output[0].name
    del model.graph.node[-1]
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        softmax.input[0], onnx.TensorProto.FLOAT, None))
    path = os.path.join(folder, f"{case.name}_logits.onnx")
    onnx.save(model, path)
    feeds, _ = case.data_sets[0]
    return Case(case.name, path, [(feeds, ReferenceEvaluator(model).run(None, feeds))])


def assert_outputs_match(expected: list, actual: list, rtol: float, atol: float,
                         where: str = "output") -> None:
    """onnx's backend-runner comparison: shapes and dtypes equal, values allclose
    (NaN equal), strings and integers exact, sequences element by element."""
    assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
    for i, (exp, act) in enumerate(zip(expected, actual)):
        label = f"{where}[{i}]"
        if isinstance(exp, (list, tuple)):
            assert isinstance(act, (list, tuple)), f"{label}: got {type(act).__name__}, " \
                                                   "expected a sequence"
            assert_outputs_match(list(exp), list(act), rtol, atol, label)
            continue
        if exp is None:
            assert act is None, f"{label}: expected an empty optional, got {type(act).__name__}"
            continue
        assert isinstance(act, np.ndarray), f"{label}: got {type(act).__name__}, expected array"
        assert act.shape == exp.shape, f"{label}: shape {act.shape}, expected {exp.shape}"
        if exp.dtype == object:
            np.testing.assert_array_equal(act, exp, err_msg=label)
            continue
        assert act.dtype == exp.dtype, f"{label}: dtype {act.dtype}, expected {exp.dtype}"
        if exp.dtype.kind in "biu" or exp.dtype == bool:
            np.testing.assert_array_equal(act, exp, err_msg=label)
            continue
        out_rtol = rtol
        if exp.dtype.kind not in "fc":  # ml_dtypes floats: compare in float32
            if exp.dtype.name == "bfloat16":
                out_rtol = max(rtol, 2 ** -6)
            act, exp = act.astype(np.float32), exp.astype(np.float32)
        np.testing.assert_allclose(act, exp, rtol=out_rtol, atol=atol, err_msg=label)


def run_case(case: Case, backend: str = "cpu", simplify: bool = True):
    """Load the case's model in ember and check every data set; raises on mismatch.
    Returns the session (its .placement tells where each node ran)."""
    import ember

    session = ember.load(case.model_path, backend=backend, simplify=simplify)
    for inputs, expected in case.data_sets:
        result = session.run(inputs)
        actual = [result[o.name] for o in session.outputs]
        assert_outputs_match(expected, actual, case.rtol, case.atol)
    return session


def load_xfails(path: str) -> dict[str, str]:
    """`name: reason` lines (# comments allowed) -> {name: reason}."""
    found = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    name, _, reason = line.partition(":")
                    found[name.strip()] = reason.strip() or "no reason given"
    return found


def main(argv: list[str]) -> int:
    """Tiny runner for development: prints failures, and for a device backend where nodes
    ran."""
    import argparse
    import traceback

    from ember.runtime.backends import get_backend

    parser = argparse.ArgumentParser(prog="python tests/onnx_suites.py",
                                     description="Run ONNX backend test suites on ember.")
    parser.add_argument("suite", nargs="?", default="node", choices=SUITES)
    parser.add_argument("-k", dest="pattern", default="*", help="case name glob")
    parser.add_argument("--backend", default=os.environ.get("EMBER_BACKEND", "cpu"))
    parser.add_argument("-v", dest="verbose", action="store_true", help="print tracebacks")
    args = parser.parse_args(argv)
    suite, pattern, backend, verbose = args.suite, args.pattern, args.backend, args.verbose
    placed: dict[str, int] = {}
    dirs = [d for d in suite_case_dirs(suite)
            if fnmatch.fnmatch(os.path.basename(d), f"*{pattern}*")]
    passed, failed = 0, []
    for d in dirs:
        try:
            session = run_case(load_case_dir(d), backend)
            for where, count in session.placement_summary().items():
                placed[where] = placed.get(where, 0) + count
            passed += 1
        except Exception as exc:  # report every failure, keep going
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            failed.append((os.path.basename(d), f"{type(exc).__name__}: {first}"))
            if verbose:
                traceback.print_exc()
    for name, why in failed:
        print(f"FAIL {name}: {why}")
    if backend != "cpu":
        print(f"nodes of passing cases by placement: {placed}; "
              f"kernel calls that fell back to the CPU: {get_backend(backend).fallbacks}")
    print(f"{passed} passed, {len(failed)} failed")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    raise SystemExit(main(sys.argv[1:]))
