"""ember: ONNX import and inference with pluggable compute backends.

    import ember
    sess = ember.load("model.onnx")          # backend="cpu" by default
    out = sess.run({"x": x})                  # {output name: numpy array}
"""
from ember.log import configure_from_env as _configure_logging
from ember.errors import (BackendUnavailableError, EmberError, ExecutionError, InputError,
                          InvalidModelError, ModelLoadError, ResourceLimitError,
                          UnsupportedOpError)
from ember.golden import CheckReport, check
from ember.native.module import Module
from ember.runtime.ort_compat import (ExecutionMode, ExecutionOrder, GraphOptimizationLevel,
                                      InferenceSession, ModelMetadata, RunOptions,
                                      SessionOptions, disable_telemetry_events,
                                      enable_telemetry_events, get_all_providers,
                                      get_available_providers, get_device,
                                      set_default_logger_severity,
                                      set_default_logger_verbosity)
from ember.runtime.session import IOInfo, NodeArg, Session, load
from ember.runtime.values import IOBinding, OrtValue
from ember.simplifier.api import simplify_onnx as simplify

__version__ = "0.1.0"

_configure_logging()

__all__ = [
    "load", "check", "simplify", "CheckReport", "Module", "Session", "IOInfo",
    # onnxruntime's API (ember.runtime.ort_compat)
    "InferenceSession", "SessionOptions", "RunOptions", "GraphOptimizationLevel", "ExecutionMode",
    "ExecutionOrder", "ModelMetadata", "NodeArg", "OrtValue", "IOBinding",
    "get_available_providers", "get_all_providers", "get_device", "set_default_logger_severity",
    "set_default_logger_verbosity", "disable_telemetry_events", "enable_telemetry_events",
    "EmberError", "ModelLoadError", "UnsupportedOpError", "InvalidModelError", "InputError",
    "ExecutionError", "ResourceLimitError", "BackendUnavailableError", "__version__",
]
