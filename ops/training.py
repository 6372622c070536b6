"""Optimizer steps of the ai.onnx.preview.training domain: Adagrad, Adam, Momentum.

Each takes the learning rate R and update count T, then n tensors to optimise followed by their
gradients and optimizer states (grouped by kind), and returns the new tensors then new states.
"""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register

TRAINING = "ai.onnx.preview.training"


def _scalar(v) -> float:
    return float(np.asarray(v).reshape(-1)[0])


class _Optimizer(OpImpl):
    groups = 0  # tensor groups after R and T: X, G and the states

    def setup(self):
        rest = self.n_inputs - 2
        if rest <= 0 or rest % self.groups:
            raise self.fail(f"expects R, T and {self.groups} equally long groups of tensors, "
                            f"got {self.n_inputs} inputs")
        self.n = rest // self.groups

    def split(self, inputs):
        n = self.n
        return [inputs[k * n:(k + 1) * n] for k in range(self.groups)]


@register("Adagrad", versions=[1], domain=TRAINING)
class Adagrad(_Optimizer):
    groups = 3

    def run(self, r, t, *inputs):
        xs, gs, hs = self.split(inputs)
        rate = _scalar(r) / (1.0 + _scalar(t) * self.decay_factor)
        new_x, new_h = [], []
        for x, g, h in zip(xs, gs, hs):
            g_reg = self.norm_coefficient * x.astype(np.float64) + g
            h_new = h + g_reg * g_reg
            x_new = x - rate * g_reg / (np.sqrt(h_new) + self.epsilon)
            new_x.append(x_new.astype(x.dtype))
            new_h.append(h_new.astype(h.dtype))
        return tuple(new_x + new_h)


@register("Adam", versions=[1], domain=TRAINING)
class Adam(_Optimizer):
    groups = 4

    def run(self, r, t, *inputs):
        xs, gs, vs, hs = self.split(inputs)
        a, b, step = self.alpha, self.beta, _scalar(t)
        rate = _scalar(r) * np.sqrt(1 - b ** step) / (1 - a ** step) if step > 0 else _scalar(r)
        new_x, new_v, new_h = [], [], []
        for x, g, v, h in zip(xs, gs, vs, hs):
            g_reg = self.norm_coefficient * x.astype(np.float64) + g
            v_new = a * v + (1 - a) * g_reg
            h_new = b * h + (1 - b) * g_reg * g_reg
            x_new = x - rate * v_new / (np.sqrt(h_new) + self.epsilon)
            x_new = (1 - self.norm_coefficient_post) * x_new
            new_x.append(x_new.astype(x.dtype))
            new_v.append(v_new.astype(v.dtype))
            new_h.append(h_new.astype(h.dtype))
        return tuple(new_x + new_v + new_h)


@register("Momentum", versions=[1], domain=TRAINING)
class Momentum(_Optimizer):
    groups = 3

    def setup(self):
        super().setup()
        if self.mode not in ("standard", "nesterov"):
            raise self.fail(f"mode must be 'standard' or 'nesterov', got {self.mode!r}")

    def run(self, r, t, *inputs):
        xs, gs, vs = self.split(inputs)
        rate = _scalar(r)
        beta = self.beta if _scalar(t) > 0 else 1.0
        new_x, new_v = [], []
        for x, g, v in zip(xs, gs, vs):
            g_reg = self.norm_coefficient * x.astype(np.float64) + g
            v_new = self.alpha * v + beta * g_reg
            if self.mode == "nesterov":
                x_new = x - rate * (g_reg + self.alpha * v_new)
            else:
                x_new = x - rate * v_new
            new_x.append(x_new.astype(x.dtype))
            new_v.append(v_new.astype(v.dtype))
        return tuple(new_x + new_v)
