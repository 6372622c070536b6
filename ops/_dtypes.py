"""dtype helpers shared by the op families (not an op family itself: the leading underscore
keeps ops/__init__ from importing it as one)."""
from __future__ import annotations

import numpy as np


def is_narrow_float(dtype: np.dtype) -> bool:
    """float16 and the ml_dtypes floats (bfloat16, float8/6/4 kinds; numpy kind 'V')."""
    if dtype.kind == "f":
        return dtype.itemsize < 4
    return dtype.kind == "V" and dtype.name.startswith(("bfloat", "float"))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to run a multi-step float formula in: narrow floats widen to float32."""
    return np.dtype(np.float32) if is_narrow_float(dtype) else np.dtype(dtype)


def widen(x: np.ndarray) -> np.ndarray:
    """`x` in its work dtype (a copy only for narrow floats)."""
    return x.astype(np.float32) if is_narrow_float(x.dtype) else x
