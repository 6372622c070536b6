"""Sequence ops. A sequence is a Python list of numpy arrays."""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register


def _position(op: OpImpl, pos, length: int, inclusive_end: bool) -> int:
    """A validated, non-negative sequence position (`inclusive_end`: `length` is allowed)."""
    p = int(np.asarray(pos).reshape(-1)[0])
    hi = length if inclusive_end else length - 1
    if p < -length or p > hi:
        raise op.fail(f"position {p} is out of range for a sequence of length {length}")
    return p + length if p < 0 else p


@register("SequenceEmpty", versions=[11])
class SequenceEmpty(OpImpl):
    def run(self):
        return []


@register("SequenceConstruct", versions=[11])
class SequenceConstruct(OpImpl):
    def run(self, *tensors):
        return list(tensors)


@register("SequenceLength", versions=[11])
class SequenceLength(OpImpl):
    def run(self, seq):
        return np.array(len(seq), dtype=np.int64)


@register("SequenceAt", versions=[11])
class SequenceAt(OpImpl):
    def run(self, seq, position):
        return seq[_position(self, position, len(seq), False)]


@register("SequenceInsert", versions=[11])
class SequenceInsert(OpImpl):
    def run(self, seq, tensor, position=None):
        out = list(seq)
        if position is None:
            out.append(tensor)
        else:
            out.insert(_position(self, position, len(seq), True), tensor)
        return out


@register("SequenceErase", versions=[11])
class SequenceErase(OpImpl):
    def run(self, seq, position=None):
        if not seq:
            raise self.fail("cannot erase from an empty sequence")
        out = list(seq)
        del out[-1 if position is None else _position(self, position, len(seq), False)]
        return out


@register("SplitToSequence", versions=[11, 24])
class SplitToSequence(OpImpl):
    def run(self, x, split=None):
        axis = self.axis
        if not -x.ndim <= axis < x.ndim:
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis %= x.ndim
        n = x.shape[axis]
        if split is None:
            parts = [np.take(x, [i], axis=axis) for i in range(n)]
            if not self.keepdims:
                parts = [np.squeeze(p, axis=axis) for p in parts]
            return parts
        split = np.asarray(split).astype(np.int64)
        if split.ndim == 0:
            size = int(split)
            if size <= 0:
                raise self.fail("split must be positive")
            bounds = list(range(size, n, size))
        else:
            if split.sum() != n or (split < 0).any():
                raise self.fail(f"split {split.tolist()} does not add up to dimension {n}")
            bounds = np.cumsum(split)[:-1].tolist()
        return [p.copy() for p in np.split(x, bounds, axis=axis)]


@register("ConcatFromSequence", versions=[11])
class ConcatFromSequence(OpImpl):
    def run(self, seq):
        if not seq:
            raise self.fail("cannot concatenate an empty sequence")
        rank = seq[0].ndim + (1 if self.new_axis else 0)
        axis = self.axis
        if not -rank <= axis < rank:
            raise self.fail(f"axis {axis} out of range for rank {rank}")
        if self.new_axis:
            return np.stack(seq, axis=axis % rank)
        return np.concatenate(seq, axis=axis % rank)


@register("SequenceMap", versions=[17])
class SequenceMap(OpImpl):
    def setup(self):
        if len(self.body.input_names) != self.n_inputs:
            raise self.fail(f"body takes {len(self.body.input_names)} inputs, node has "
                            f"{self.n_inputs}")

    def run(self, seq, *extra, scope=None):
        n = len(seq)
        for e in extra:
            if isinstance(e, list) and len(e) != n:
                raise self.fail(f"sequence inputs differ in length ({len(e)} vs {n})")
        n_out = len(self.body.output_names)
        outs: list[list] = [[] for _ in range(n_out)]
        for i in range(n):
            args = [seq[i]] + [e[i] if isinstance(e, list) else e for e in extra]
            res = self.body.run(args, scope)
            for k in range(n_out):
                v = res[k]
                outs[k].append(v if isinstance(v, np.ndarray) else np.asarray(v))
        return tuple(outs)
