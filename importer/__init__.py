"""ONNX -> ember IR."""
from ember.importer.onnx_import import ModelSource, import_model, read_model_proto

__all__ = ["ModelSource", "import_model", "read_model_proto"]
