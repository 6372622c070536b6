"""Native modules: ONNX models as readable Python packages over ember's own ops.

    from ember.native import convert, Module
    convert("resnet50.onnx", "resnet50/")        # __init__.py, model.py, weights.safetensors
    from resnet50 import Model
    y = Model(backend="cpu")(x)

See `module.py` (the `Module` base, custom kernels), `codegen.py` (what the generated code
looks like and why it is safe) and `safetensors.py` (the weights format).
"""
from ember.native.convert import add_convert_parser, cmd_convert, convert
from ember.native.module import Module, Op, Weight

__all__ = ["Module", "Op", "Weight", "convert", "add_convert_parser", "cmd_convert"]
