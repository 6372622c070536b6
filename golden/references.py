"""What ember check compares with: a runtime (onnxruntime, onnx's evaluator, another
ember backend) or recorded data (an .npz, an ONNX test directory, Polygraphy's JSON)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from ember.golden.compare import _dtype_str, _RUNTIME_REFS, CheckError
from ember.importer import ModelSource, read_model_proto
from ember.ir import Model, OptionalType, SequenceType
from ember.runtime.backends import BACKENDS
from ember.runtime.session import Session

# -- references --------------------------------------------------------------------------------

Case = tuple[dict[str, Any], "dict[str, Any] | None"]  # feeds, recorded outputs (None: compute)


class Reference:
    """Where expected values come from."""
    name = "reference"

    def cases(self, model: Model) -> list[Case]:
        """Recorded (feeds, outputs); empty for runtimes, which compute outputs from any feeds."""
        return []

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Drop whatever the reference holds (sessions, model copies)."""


class EmberReference(Reference):
    """Another ember backend, sharing the candidate's IR (so host weights are not duplicated)."""

    def __init__(self, model: Model, backend: str):
        self.name = backend
        self.session = Session(model, backend)

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return self.session.run(feeds)

    def close(self) -> None:
        self.session = None


class ProtoReference(Reference):
    """onnxruntime or onnx's ReferenceEvaluator, given the ONNX model itself.

    For bisect, `values` exposes named intermediates as graph outputs; the caller asks for a
    chunk at a time so the reference never holds all of them at once.
    """

    def __init__(self, kind: str, source: ModelSource):
        self.name = kind
        self.source = source
        self._runtime = _import_runtime(kind)
        self._plain = None
        self._proto = None  # the graph without weights (see _graph_only)
        self._folder = None  # temporary folder holding the weights file

    def outputs(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self._plain is None:
            self._plain = self._session(self._plain_source(), optimize=True)
        names = self._output_names(self._plain)
        return dict(zip(names, self._run(self._plain, feeds)))

    def values(self, feeds: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
        """Run once with exactly `names` as the graph's outputs."""
        self._plain = None  # one reference session at a time
        session = self._session(self._model_exposing(names), optimize=False)
        return dict(zip(names, self._run(session, feeds)))

    def produced_names(self) -> set[str]:
        """Values that nodes of the model's main graph produce (what can be exposed)."""
        return {o for n in self._graph_only().graph.node for o in n.output if o}

    def close(self) -> None:
        self._plain = self._proto = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def _model_exposing(self, names: Sequence[str]) -> str:
        """A model file whose outputs are `names`; it shares one weights file with the others."""
        import onnx

        proto = self._graph_only()
        del proto.graph.output[:]
        proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
        path = os.path.join(self._folder.name, "exposed.onnx")
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())
        return path

    def _graph_only(self):
        """The model with its weights moved, once, into a temporary external-data file, so
        each chunk's model is small to write and no copy of the weights stays in memory."""
        if self._proto is None:
            import tempfile

            import onnx
            from onnx.external_data_helper import convert_model_to_external_data

            if isinstance(self.source, (str, os.PathLike)):
                proto = onnx.load(os.fspath(self.source))  # external data included
            else:
                proto = onnx.ModelProto()
                proto.CopyFrom(read_model_proto(self.source)[0])  # never alter the caller's
            self._folder = tempfile.TemporaryDirectory(prefix="ember-check-")
            convert_model_to_external_data(proto, all_tensors_to_one_file=True,
                                           location="weights.bin", size_threshold=1024)
            path = os.path.join(self._folder.name, "model.onnx")
            onnx.save_model(proto, path)  # writes weights.bin
            del proto  # frees the weights' buffers (clearing fields alone would keep them)
            self._proto = onnx.load(path, load_external_data=False)
        return self._proto

    def _plain_source(self) -> Any:
        if isinstance(self.source, (str, os.PathLike)):
            return os.fspath(self.source)
        if isinstance(self.source, (bytes, bytearray, memoryview)):
            return bytes(self.source)
        return self.source.SerializeToString() if self.name == "onnxruntime" else self.source

    def _session(self, model: Any, optimize: bool) -> Any:
        try:
            if self.name == "onnxruntime":
                options = self._runtime.SessionOptions()
                if not optimize:  # unfused kernels: the reference closest to each op's definition
                    options.graph_optimization_level = \
                        self._runtime.GraphOptimizationLevel.ORT_DISABLE_ALL
                return self._runtime.InferenceSession(model, options,
                                                      providers=["CPUExecutionProvider"])
            return self._runtime.ReferenceEvaluator(model)
        except Exception as exc:  # the runtime's own error types
            raise CheckError(f"reference {self.name} cannot load the model: "
                             f"{type(exc).__name__}: {exc}") from exc

    def _output_names(self, session: Any) -> list[str]:
        if self.name == "onnxruntime":
            return [o.name for o in session.get_outputs()]
        return list(session.output_names)

    def _run(self, session: Any, feeds: Mapping[str, Any]) -> list[Any]:
        try:
            return list(session.run(None, dict(feeds)))
        except Exception as exc:
            raise CheckError(f"reference {self.name} failed to run the model: "
                             f"{type(exc).__name__}: {exc}") from exc


def _import_runtime(kind: str) -> Any:
    try:
        if kind == "onnxruntime":
            import onnxruntime
            return onnxruntime
        from onnx import reference
        return reference
    except ImportError as exc:
        hint = "pip install onnxruntime" if kind == "onnxruntime" else "pip install onnx"
        raise CheckError(f"--ref {kind} needs the {kind} package, which is not installed "
                         f"({hint}), or compare with --ref cpu or recorded data "
                         "(--ref golden.npz)") from exc


class NpzReference(Reference):
    """Recorded inputs and outputs: keys `input:NAME` and `output:NAME`."""

    def __init__(self, path: str):
        self.name = path
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise CheckError(f"cannot read recorded reference '{path}': {exc}") from exc
        self.inputs = {k[6:]: v for k, v in arrays.items() if k.startswith("input:")}
        self.expected = {k[7:]: v for k, v in arrays.items() if k.startswith("output:")}
        if not self.expected:
            raise CheckError(f"'{path}' records no outputs (keys 'output:NAME'); record one "
                             "with: ember check MODEL --ref onnxruntime --save-golden FILE.npz")

    def cases(self, model: Model) -> list[Case]:
        return [(self.inputs, self.expected)]


class TestDirReference(Reference):
    """An ONNX test directory: DIR/test_data_set_N/{input,output}_K.pb, or one such set."""

    def __init__(self, path: str):
        self.name = path
        if os.path.isfile(os.path.join(path, "output_0.pb")):
            self.sets = [path]
        else:
            self.sets = sorted((os.path.join(path, d) for d in os.listdir(path)
                                if d.startswith("test_data_set_")),
                               key=lambda p: int(p.rsplit("_", 1)[-1])
                               if p.rsplit("_", 1)[-1].isdigit() else 0)
        if not self.sets:
            raise CheckError(f"'{path}' holds no test_data_set_N folders with output_K.pb files")

    def cases(self, model: Model) -> list[Case]:
        graph = model.graph
        feeds_info = [v for v in graph.inputs if v.name not in graph.initializers]
        cases = []
        for folder in self.sets:
            files = sorted(os.listdir(folder))
            n_in = sum(f.startswith("input_") and f.endswith(".pb") for f in files)
            n_out = sum(f.startswith("output_") and f.endswith(".pb") for f in files)
            if n_in > len(feeds_info) or n_out > len(graph.outputs):
                raise CheckError(f"'{folder}' holds {n_in} inputs and {n_out} outputs; the model "
                                 f"has {len(feeds_info)} and {len(graph.outputs)}")
            feeds = {feeds_info[k].name: _read_pb(os.path.join(folder, f"input_{k}.pb"),
                                                  feeds_info[k].type) for k in range(n_in)}
            outputs = {graph.outputs[k].name: _read_pb(os.path.join(folder, f"output_{k}.pb"),
                                                       graph.outputs[k].type)
                       for k in range(n_out)}
            cases.append((feeds, outputs))
        return cases


def _read_pb(path: str, value_type: Any) -> Any:
    """A TensorProto (or SequenceProto / OptionalProto, by the declared type) file as values."""
    import onnx
    from onnx import numpy_helper

    from ember.importer.onnx_values import tensor_to_array

    try:
        with open(path, "rb") as f:
            data = f.read()
        if isinstance(value_type, SequenceType):
            proto = onnx.SequenceProto()
            proto.ParseFromString(data)
            return numpy_helper.to_list(proto)
        if isinstance(value_type, OptionalType):
            proto = onnx.OptionalProto()
            proto.ParseFromString(data)
            return numpy_helper.to_optional(proto)
        proto = onnx.TensorProto()
        proto.ParseFromString(data)
        return tensor_to_array(proto)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckError(f"cannot read recorded tensor '{path}': {exc}") from exc


class PolygraphyReference(Reference):
    """Polygraphy's run results (`polygraphy run --save-outputs FILE.json`): the first runner's
    outputs, one data set per iteration, fed with the matching sets of `--load-inputs`."""

    def __init__(self, path: str, input_sets: Sequence[Mapping[str, Any]] | None):
        from ember.golden.polygraphy_json import load_run_results

        self.name = path
        if not os.path.isfile(path):
            raise CheckError(f"recorded reference not found: {path}")
        if not input_sets:
            raise CheckError(f"{path}: Polygraphy's results hold no inputs; give the ones they "
                             "were computed from with --load-inputs FILE.json")
        runs = load_run_results(path)
        if not runs or not runs[0][1]:
            raise CheckError(f"{path}: no runner results in it")
        runner, iterations = runs[0]
        if len(iterations) != len(input_sets):
            raise CheckError(f"{path}: runner {runner} has {len(iterations)} iteration(s) but "
                             f"--load-inputs gives {len(input_sets)} input set(s)")
        self.recorded = [(dict(f), o) for f, o in zip(input_sets, iterations)]

    def cases(self, model: Model) -> list[Case]:
        return self.recorded


def make_reference(ref: str, source: ModelSource, model: Model,
                   input_sets: Sequence[Mapping[str, Any]] | None = None) -> Reference:
    """`ref` is onnxruntime, onnx, an ember backend, an .npz file, an ONNX test directory or
    Polygraphy's run results (.json, with `input_sets` the inputs they were computed from)."""
    key = ref.lower()
    if key in _RUNTIME_REFS:
        return ProtoReference(_RUNTIME_REFS[key], source)
    if key in BACKENDS:
        return EmberReference(model, key)
    if os.path.isdir(ref):
        return TestDirReference(ref)
    if ref.endswith(".npz"):
        if not os.path.isfile(ref):
            raise CheckError(f"recorded reference not found: {ref}")
        return NpzReference(ref)
    if ref.endswith(".json"):
        return PolygraphyReference(ref, input_sets)
    raise CheckError(f"unknown reference '{ref}'; use onnxruntime, onnx, one of "
                     f"{', '.join(BACKENDS)}, a .npz file, an ONNX test directory or "
                     "Polygraphy's results (.json)")


def write_golden(path: str, feeds: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
    """Record inputs and reference outputs as `input:NAME` / `output:NAME` in an .npz."""
    arrays = {}
    for prefix, values in (("input", feeds), ("output", outputs)):
        for name, value in values.items():
            if not isinstance(value, np.ndarray):
                raise CheckError(f"cannot record {prefix} '{name}' in an .npz: it is a "
                                 f"{_dtype_str(value)}, not a tensor")
            if value.dtype == object:  # strings: stored without pickle
                value = value.astype(str)
            arrays[f"{prefix}:{name}"] = value
    try:
        np.savez(path, **arrays)
    except OSError as exc:
        raise CheckError(f"cannot write '{path}': {exc}") from exc
