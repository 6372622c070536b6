"""onnxruntime's com.microsoft ops, by family: attention, fused (norms, GELU and bias fusions),
quantized (integer and QLinear ops), lowbit (4-bit and block-quantized weights), text
(Tokenizer and string ops) and misc (the rest). Their semantics are onnxruntime's CPU kernels'.

Importing this package registers every op in it, as ember.ops does for its own modules."""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.ispkg and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
