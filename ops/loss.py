"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both gather -input[n, target[n, d...], d...] (optionally times weight[target]), zero it where the
target equals `ignore_index`, then reduce: 'none', 'sum', or 'mean' (divided by the summed
weights of the non-ignored elements, or by their count when there are no weights).
"""
from __future__ import annotations

import numpy as np

from ember.ops import _xp
from ember.ops.reduction import log_softmax
from ember.ops._dtypes import widen
from ember.ops.registry import OpImpl, register


class _LossBase(OpImpl):
    def setup(self):
        red = self.reduction
        if isinstance(red, bytes):
            red = red.decode()
        if red not in ("none", "sum", "mean"):
            raise self.fail(f"unknown reduction '{red}'")
        self.red = red

    def nll(self, logp, target, weight):
        """logp: (N, C, d...) in a working float dtype; returns the reduced loss there."""
        xp = self.xp
        if logp.ndim < 2:
            raise self.fail(f"input must have shape (N, C, ...), got {logp.shape}")
        n_classes = logp.shape[1]
        expected = (logp.shape[0],) + logp.shape[2:]
        if target.shape != expected:
            raise self.fail(f"target shape {target.shape} does not match input {logp.shape}")
        target = target.astype(np.int64)
        if self.ignore_index is not None:
            keep = target != int(self.ignore_index)
        else:
            keep = xp.ones(target.shape, bool)
        bad = keep & ((target < 0) | (target >= n_classes))
        if _xp.to_host(xp, bad.any()):
            raise self.fail(f"target value out of range [0, {n_classes})")
        safe = xp.where(keep, target, 0)
        picked = xp.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
        if weight is not None:
            w = weight.astype(logp.dtype)[safe] * keep
        else:
            w = keep.astype(logp.dtype)
        loss = -picked * w
        if self.red == "none":
            return loss
        if self.red == "sum":
            return xp.sum(loss)
        with np.errstate(divide="ignore", invalid="ignore"):
            return xp.sum(loss) / xp.sum(w)


@register("NegativeLogLikelihoodLoss", versions=[12, 13, 22])
class NegativeLogLikelihoodLoss(_LossBase):
    def run(self, x, target, weight=None):
        work = widen(x)
        return self.xp.asarray(self.nll(work, target, weight)).astype(x.dtype, copy=False)


@register("SoftmaxCrossEntropyLoss", versions=[12, 13])
class SoftmaxCrossEntropyLoss(_LossBase):
    def run(self, scores, labels, weights=None):
        work = widen(scores)
        if work.ndim < 2:
            raise self.fail(f"scores must have shape (N, C, ...), got {scores.shape}")
        logp = log_softmax(self.xp, work, 1)
        loss = self.xp.asarray(self.nll(logp, labels, weights)).astype(scores.dtype, copy=False)
        if self.n_outputs > 1:
            return loss, logp.astype(scores.dtype, copy=False)
        return loss
