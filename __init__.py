"""ember: ONNX import and inference with pluggable compute backends.

    import ember
    sess = ember.load("model.onnx")          # backend="cpu" by default
    out = sess.run({"x": x})                  # {output name: numpy array}
"""
from ember.errors import (BackendUnavailableError, EmberError, ExecutionError, InputError,
                          InvalidModelError, ModelLoadError, UnsupportedOpError)
from ember.golden import CheckReport, check
from ember.native.module import Module
from ember.runtime.session import InferenceSession, IOInfo, NodeArg, Session, load
from ember.runtime.values import IOBinding, OrtValue

__version__ = "0.1.0"

__all__ = [
    "load", "check", "CheckReport", "Module", "Session", "InferenceSession", "IOInfo", "NodeArg",
    "OrtValue", "IOBinding",
    "EmberError", "ModelLoadError", "UnsupportedOpError", "InvalidModelError", "InputError",
    "ExecutionError", "BackendUnavailableError", "__version__",
]
