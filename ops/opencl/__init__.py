"""OpenCL kernels, one module per op family, registered with backend="opencl".

Imported by the OpenCL backend when it starts (pyopencl is needed from here on).
"""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
