"""Optional ops. An optional holding a value is that value (array or list); empty is None."""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register


@register("Optional", versions=[15, 28])
class Optional(OpImpl):
    def setup(self):
        if self.n_inputs == 0 and self.type is None:
            raise self.fail("an Optional without input needs the 'type' attribute")

    def run(self, value=None):
        return value


@register("OptionalGetElement", versions=[15, 18, 28])
class OptionalGetElement(OpImpl):
    def run(self, value=None):
        if value is None:
            raise self.fail("the optional input is empty")
        return value


@register("OptionalHasElement", versions=[15, 18, 28])
class OptionalHasElement(OpImpl):
    def run(self, value=None):
        return np.array(value is not None)
