"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, activations."""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register


@register("Add", versions=[7, 13, 14])
class Add(OpImpl):
    def run(self, a, b):
        return np.add(a, b)


@register("Relu", versions=[6, 13, 14])
class Relu(OpImpl):
    def run(self, x):
        return np.maximum(x, x.dtype.type(0))
