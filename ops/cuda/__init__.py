"""CUDA kernels (cupy), one module per op family, registered with backend="cuda".

Imported by the CUDA backend when it starts (cupy is needed from here on).
"""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
