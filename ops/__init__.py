"""Op semantics and kernels, one module per op family.

Importing this package registers every op (see ops/registry.py for the declaration API).
"""
import importlib
import pkgutil

# Every module in this package except the registry and helpers declares ops; import them all so
# their @register decorators run. A family is added by dropping a module here. Device kernels
# (the opencl/ and cuda/ subpackages) are imported by their backend when it starts.
for _info in pkgutil.iter_modules(__path__):
    if not _info.ispkg and not _info.name.startswith("_") and _info.name != "registry":
        importlib.import_module(f"{__name__}.{_info.name}")
importlib.import_module(f"{__name__}.microsoft")  # onnxruntime's com.microsoft ops
