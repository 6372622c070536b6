"""onnxruntime's Python API over ember: code written for onnxruntime runs after

    import ember as ort            # or: from ember import InferenceSession, SessionOptions

`InferenceSession`, `SessionOptions`, `RunOptions`, `GraphOptimizationLevel`, `ExecutionMode`,
`ExecutionOrder`, `get_available_providers`, `get_all_providers`, `get_device`,
`set_default_logger_severity` and `set_default_logger_verbosity` behave as onnxruntime's do
(onnxruntime is the oracle of tests/runtime/test_ort_compat.py); docs/ort_compat.md lists
onnxruntime's other module-level names and why ember has none of them. What the options mean
here:

* providers: a list of names or (name, options) pairs, tried in order. A provider ember cannot
  use on this machine, or does not know, is skipped with onnxruntime's warning, and the CPU
  serves when none is left; after `disable_fallback()` an unavailable provider is an error.
  CPUExecutionProvider = backend "cpu", OpenCLExecutionProvider = "opencl",
  CUDAExecutionProvider = "cuda".
* SessionOptions.intra_op_num_threads: ember's `threads` (0, the default: the physical cores).
  graph_optimization_level: ORT_DISABLE_ALL loads the graph as it is (simplify=False); any
  other level simplifies. optimized_model_filepath: the simplified model is written there as
  ONNX. enable_profiling / profile_file_prefix: a Chrome trace (ember.runtime.profiler),
  written by `end_profiling()`. log_severity_level: the level of the `ember` logger (0 verbose
  ... 4 fatal; ember.log), as `set_default_logger_severity` sets it for the process. Log
  verbosity is checked and kept: ember logs nothing finer than DEBUG, so it changes nothing.
  Options with no meaning for ember (arenas, memory patterns, execution mode,
  inter-op threads) are accepted and kept.
* An onnxruntime.SessionOptions object is read the same way (its attributes, by name).
* RunOptions are accepted; `terminate = True` makes `run` raise, as in onnxruntime.
"""
from __future__ import annotations

import enum
import operator
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ember import log
from ember.errors import BackendUnavailableError, EmberError, ExecutionError
from ember.importer import ModelSource

PROVIDERS = {"CPUExecutionProvider": "cpu", "OpenCLExecutionProvider": "opencl",
             "CUDAExecutionProvider": "cuda"}
_BACKEND_PROVIDERS = {backend: name for name, backend in PROVIDERS.items()}


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


class SessionOptions:
    """onnxruntime.SessionOptions; see the module docstring for what ember does with each."""

    def __init__(self) -> None:
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.optimized_model_filepath = ""
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.execution_order = ExecutionOrder.DEFAULT
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True
        self._config: dict[str, str] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        _add_entry(self._config, key, value)

    def get_session_config_entry(self, key: str) -> str:
        return _get_entry(self._config, key, "SessionOptions")

    def register_custom_ops_library(self, library_path: str) -> None:
        raise EmberError("custom op libraries are onnxruntime's C++ kernels, which ember cannot "
                         "load; register a Python op instead (docs/native.md: custom kernels)")


class RunOptions:
    """onnxruntime.RunOptions: accepted; `terminate` stops the runs that see it."""

    def __init__(self) -> None:
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self._config: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        _add_entry(self._config, key, value)

    def get_run_config_entry(self, key: str) -> str:
        return _get_entry(self._config, key, "RunOptions")


def _add_entry(config: dict[str, str], key: str, value: str) -> None:
    config[str(key)] = str(value)


def _get_entry(config: dict[str, str], key: str, owner: str) -> str:
    if key not in config:
        raise EmberError(f"{owner} has no config entry {key!r}")
    return config[key]


@dataclass
class ModelMetadata:
    """onnxruntime.ModelMetadata."""
    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


def get_available_providers() -> list[str]:
    """The providers whose backend can run on this machine, CPU last (onnxruntime's order)."""
    from ember.runtime.backends import get_backend

    available = []
    for name, backend in PROVIDERS.items():
        if backend == "cpu":
            continue
        try:
            get_backend(backend)
        except BackendUnavailableError:
            continue
        available.append(name)
    return available + ["CPUExecutionProvider"]


def get_all_providers() -> list[str]:
    """Every provider ember knows, usable here or not, CPU last (onnxruntime's order)."""
    return [name for name in PROVIDERS if name != "CPUExecutionProvider"] + \
        ["CPUExecutionProvider"]


def get_device() -> str:
    """"GPU" where a device provider is available, else "CPU" (onnxruntime.get_device)."""
    return "GPU" if len(get_available_providers()) > 1 else "CPU"


def set_default_logger_severity(severity: int) -> None:
    """onnxruntime's default log severity, 0 verbose, 1 info, 2 warning, 3 error, 4 fatal, as
    the level of the `ember` logger (ember.log). Outside 0..4 is an error, as there."""
    severity = _log_int(severity, "severity")
    if not 0 <= severity < len(log.ORT_SEVERITY_LEVELS):
        raise EmberError(f"Invalid logging severity {severity}. 0:Verbose, 1:Info, 2:Warning, "
                         "3:Error, 4:Fatal")
    log.set_ort_severity(severity)


def set_default_logger_verbosity(verbosity: int) -> None:
    """onnxruntime's verbosity of its verbose (severity 0) records: any integer, as there.
    ember logs nothing finer than DEBUG, so beyond the check it changes nothing."""
    _log_int(verbosity, "verbosity")


def _log_int(value: Any, what: str) -> int:
    """An integer log setting; anything else is refused, as onnxruntime's binding does."""
    try:
        return operator.index(value)
    except TypeError:
        raise EmberError(f"the logging {what} must be an integer, got "
                         f"{type(value).__name__} {value!r}") from None


def disable_telemetry_events() -> None:
    """Accepted: ember sends no telemetry."""


def enable_telemetry_events() -> None:
    """Accepted: ember sends no telemetry, so there is none to enable."""


def _options_dict(options: Any) -> dict[str, Any]:
    """The SessionOptions fields ember reads, from ours or from onnxruntime's own object."""
    fields = ("intra_op_num_threads", "graph_optimization_level", "optimized_model_filepath",
              "enable_profiling", "profile_file_prefix", "log_severity_level")
    defaults = SessionOptions()
    return {f: getattr(options, f, getattr(defaults, f)) for f in fields}


def _normalize_providers(providers: Sequence[Any] | None,
                         provider_options: Sequence[Mapping[str, Any]] | None
                         ) -> list[tuple[str, dict[str, Any]]]:
    """[(name, options)] from onnxruntime's forms: names, (name, options) pairs, or names with
    a parallel `provider_options` list."""
    if providers is None:
        return []
    if isinstance(providers, str):
        providers = [providers]
    pairs: list[tuple[str, dict[str, Any]]] = []
    for entry in providers:
        if isinstance(entry, (tuple, list)):
            if len(entry) != 2 or not isinstance(entry[0], str) or not isinstance(entry[1],
                                                                                   Mapping):
                raise EmberError(f"a provider entry must be a name or a (name, options dict) "
                                 f"pair, got {entry!r}")
            pairs.append((entry[0], dict(entry[1])))
        elif isinstance(entry, str):
            pairs.append((entry, {}))
        else:
            raise EmberError(f"a provider must be a name or a (name, options) pair, "
                             f"got {entry!r}")
    if provider_options is not None:
        if len(provider_options) != len(pairs):
            raise EmberError(f"{len(pairs)} provider(s) but {len(provider_options)} "
                             "provider_options: they must be as many")
        pairs = [(name, {**opts, **dict(extra)}) for (name, opts), extra
                 in zip(pairs, provider_options)]
    return pairs


class InferenceSession:
    """onnxruntime.InferenceSession over an ember Session."""

    def __init__(self, path_or_bytes: ModelSource, sess_options: Any = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None,
                 max_tensor_bytes: int | None = None, **kwargs: Any):
        self._model_source = path_or_bytes
        self._sess_options = sess_options if sess_options is not None else SessionOptions()
        self._options = _options_dict(self._sess_options)
        self._max_tensor_bytes = max_tensor_bytes
        self._fallback = True
        self._profiling_start_ns = 0
        _apply_log_level(self._options["log_severity_level"])
        self._create(_normalize_providers(providers, provider_options))

    # -- creation -------------------------------------------------------------------------
    def _create(self, requested: list[tuple[str, dict[str, Any]]]) -> None:
        from ember.runtime.backends import get_backend

        chosen: tuple[str, dict[str, Any]] | None = None
        for name, opts in requested:
            backend = PROVIDERS.get(name)
            reason = None
            if backend is None:
                reason = "not a provider ember has"
            else:
                try:
                    get_backend(backend)
                except BackendUnavailableError as exc:
                    reason = str(exc)
            if reason is None:
                chosen = (name, opts)
                break
            if not self._fallback:
                raise BackendUnavailableError(f"provider {name!r} cannot be used ({reason}) "
                                              "and fallback is disabled")
            # onnxruntime's own warning, word for word
            warnings.warn(f"Specified provider '{name}' is not in available provider names."
                          f"Available providers: '{', '.join(get_available_providers())}'",
                          stacklevel=3)
        if chosen is None:
            chosen = ("CPUExecutionProvider", {})
        self._provider, self._provider_opts = chosen
        self._session = self._load(PROVIDERS[self._provider])

    def _load(self, backend: str) -> Any:
        from ember.runtime.session import load

        opts = self._options
        simplify = int(opts["graph_optimization_level"]) != GraphOptimizationLevel.ORT_DISABLE_ALL
        session = load(self._model_source, backend, simplify=simplify,
                       threads=int(opts["intra_op_num_threads"] or 0) or None,
                       max_tensor_bytes=self._max_tensor_bytes,
                       profile=bool(opts["enable_profiling"]),
                       profile_prefix=opts["profile_file_prefix"] or "onnxruntime_profile_")
        if simplify and opts["optimized_model_filepath"]:
            _save(session.model, opts["optimized_model_filepath"])
        return session

    # -- onnxruntime's methods ----------------------------------------------------------------
    def get_inputs(self) -> list[Any]:
        from ember.runtime.session import NodeArg
        return [NodeArg(i) for i in self._session.inputs]

    def get_outputs(self) -> list[Any]:
        from ember.runtime.session import NodeArg
        return [NodeArg(o) for o in self._session.outputs]

    def get_overridable_initializers(self) -> list[Any]:
        """Graph inputs backed by an initialiser (a feed of that name overrides it)."""
        from ember.runtime.session import NodeArg
        return [NodeArg(i) for i in self._session.overridable_initializers]

    def get_modelmeta(self) -> ModelMetadata:
        m = self._session.model
        return ModelMetadata(producer_name=m.producer_name or "", graph_name=m.graph.name or "",
                             domain=getattr(m, "domain", "") or "", description=m.doc or "",
                             graph_description=m.graph.doc or "",
                             version=int(m.model_version or 0),
                             custom_metadata_map=dict(m.metadata))

    def get_providers(self) -> list[str]:
        return [self._provider] if self._provider == "CPUExecutionProvider" \
            else [self._provider, "CPUExecutionProvider"]

    def get_provider_options(self) -> dict[str, dict[str, Any]]:
        return {name: (dict(self._provider_opts) if name == self._provider else {})
                for name in self.get_providers()}

    def get_session_options(self) -> Any:
        return self._sess_options

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Reload on the given providers (onnxruntime recreates its session the same way)."""
        self._create(_normalize_providers(providers, provider_options))

    def disable_fallback(self) -> None:
        self._fallback = False

    def enable_fallback(self) -> None:
        self._fallback = True

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        _check_run_options(run_options)
        result = self._session.run(input_feed,
                                   outputs=list(output_names) if output_names else None)
        return list(result.values())

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[Any, Any, str], None], user_data: Any,
                  run_options: Any = None) -> None:
        """Run on a worker thread, then call callback(outputs, user_data, error message); the
        message is "" on success, and outputs is None on failure, as in onnxruntime. Feeds
        are checked before the thread starts (a missing input raises here, as there)."""
        self._session.check_feeds(input_feed)

        def work() -> None:
            try:
                outputs = self.run(output_names, input_feed, run_options)
            except Exception as exc:  # handed to the callback, as onnxruntime does
                callback(None, user_data, str(exc))
                return
            callback(outputs, user_data, "")

        threading.Thread(target=work, name="ember-run-async", daemon=True).start()

    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, Any], run_options: Any = None
                            ) -> list[Any]:
        """Run on OrtValues (or arrays); the outputs are OrtValues, left on the device where
        they were computed there."""
        _check_run_options(run_options)
        result = self._session.run(input_dict_ort_values, device_outputs=True,
                                   outputs=list(output_names) if output_names else None)
        return list(result.values())

    def io_binding(self) -> Any:
        from ember.runtime.values import IOBinding
        return IOBinding(self._session)

    def run_with_iobinding(self, iobinding: Any, run_options: Any = None) -> None:
        if iobinding._session is not self._session:
            raise ValueError("IOBinding must be used with the session that created it.")
        _check_run_options(run_options)
        iobinding._run()

    def create_ortvalue_from_shape_and_type(self, shape: Sequence[int], element_type: Any,
                                            device_type: str, device_id: int = 0,
                                            vendor_id: int = -1) -> Any:
        """A zero-filled OrtValue; "gpu" means this session's device backend."""
        import numpy as np

        from ember.runtime.values import OrtValue, _np_dtype, backend_for_device
        backend = backend_for_device(device_type, device_id, self._session._backend)
        return OrtValue._allocate(backend, shape, np.dtype(_np_dtype(element_type)))

    def end_profiling(self) -> str:
        """Write the profile and return its path; "" when profiling is off (or ended)."""
        return self._session.end_profiling()

    def get_profiling_start_time_ns(self) -> int:
        profiler = self._session.profiler
        return 0 if profiler is None else profiler.start_wall_ns


def _save(model: Any, path: str) -> None:
    """The (simplified) model as ONNX at `path`; weights beside it past protobuf's 2 GB."""
    from ember.importer.onnx_export import export_model, save_onnx
    save_onnx(export_model(model), path, model)


def _check_run_options(run_options: Any) -> None:
    if run_options is not None and getattr(run_options, "terminate", False):
        raise ExecutionError("Exiting due to terminate flag being set to true.")


def _apply_log_level(severity: Any) -> None:
    """onnxruntime's log_severity_level (-1: unset) as the `ember` logger's level."""
    try:
        severity = int(severity)
    except (TypeError, ValueError):
        return
    if 0 <= severity < len(log.ORT_SEVERITY_LEVELS):
        log.set_ort_severity(severity)
