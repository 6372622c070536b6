"""Recurrent ops: RNN, GRU, LSTM (one layer, forward / reverse / bidirectional).

All three share the same driver: inputs are brought to layout 0 ([seq, batch, ...]), the input
projection X·Wᵀ (+ Wb) is computed for all time steps at once, and a Python loop over time steps
applies the recurrence for the whole batch. `sequence_lens` is honoured per batch entry: steps past
an entry's length leave its state unchanged and write zeros to Y; the reverse direction runs over
each entry's own valid prefix, from its last valid step down to step 0.

Since-versions: 1 (output_sequence attribute, no layout; GRU-1 has no linear_before_reset),
3 (GRU only: linear_before_reset), 7 (output_sequence removed), 14 (layout), 22 (bfloat16 types).
Y is always computed (the v1 output_sequence flag only makes it optional for the node).
"""
from __future__ import annotations

import numpy as np

from ember.ops import _xp
from ember.ops.registry import OpImpl, register


# ---------------------------------------------------------------- activations
def _sigmoid(xp, x):
    # Numerically stable: exp of a non-positive argument only.
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def _softplus(xp, x):
    return (xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))).astype(x.dtype, copy=False)


# name (lower case) -> (function(xp, x, alpha, beta), number of alphas used, number of betas
#                       used, default alpha, default beta); defaults are those of the ONNX ops.
_ACTIVATIONS = {
    "relu": (lambda xp, x, a, b: xp.maximum(x, 0), 0, 0, None, None),
    "tanh": (lambda xp, x, a, b: xp.tanh(x), 0, 0, None, None),
    "sigmoid": (lambda xp, x, a, b: _sigmoid(xp, x), 0, 0, None, None),
    "affine": (lambda xp, x, a, b: a * x + b, 1, 1, 1.0, 0.0),
    "leakyrelu": (lambda xp, x, a, b: xp.where(x >= 0, x, a * x), 1, 0, 0.01, None),
    "thresholdedrelu": (lambda xp, x, a, b: xp.where(x > a, x, 0), 1, 0, 1.0, None),
    "scaledtanh": (lambda xp, x, a, b: a * xp.tanh(b * x), 1, 1, 1.0, 1.0),
    "hardsigmoid": (lambda xp, x, a, b: xp.clip(a * x + b, 0, 1), 1, 1, 0.2, 0.5),
    "elu": (lambda xp, x, a, b: xp.where(x >= 0, x, a * xp.expm1(xp.minimum(x, 0))), 1, 0,
            1.0, None),
    "softsign": (lambda xp, x, a, b: x / (1 + xp.abs(x)), 0, 0, None, None),
    "softplus": (lambda xp, x, a, b: _softplus(xp, x), 0, 0, None, None),
}


def _make_activation(xp, fn, alpha, beta, dtype):
    a = None if alpha is None else dtype.type(alpha)
    b = None if beta is None else dtype.type(beta)

    def act(x):
        return xp.asarray(fn(xp, x, a, b), dtype=dtype)

    return act


# ---------------------------------------------------------------- shared driver
class _RecurrentBase(OpImpl):
    n_gates = 1                       # rows of W per hidden unit
    default_activations: tuple[str, ...] = ()
    has_layout = False

    def setup(self):
        direction = self.direction or "forward"
        if isinstance(direction, bytes):
            direction = direction.decode()
        if direction == "foward":  # the GRU-1 schema's default, misspelt
            direction = "forward"
        if direction not in ("forward", "reverse", "bidirectional"):
            raise self.fail("direction must be forward, reverse or bidirectional, "
                            f"got {direction!r}")
        self.dir_name = direction
        self.num_directions = 2 if direction == "bidirectional" else 1
        self.lay = int(getattr(self, "layout", 0) or 0) if self.has_layout else 0
        if self.lay not in (0, 1):
            raise self.fail(f"layout must be 0 or 1, got {self.lay}")
        if self.hidden_size is not None and int(self.hidden_size) <= 0:
            raise self.fail(f"hidden_size must be positive, got {self.hidden_size}")
        if self.clip is not None and not float(self.clip) > 0:
            raise self.fail(f"clip must be positive, got {self.clip}")

        per_dir = len(self.default_activations)
        names = self.activations
        if names is None or len(names) == 0:
            names = list(self.default_activations) * self.num_directions
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        if len(names) == per_dir and self.num_directions == 2:
            names = names * 2
        # The RNN schema's default lists two activations even for one direction (and exporters
        # copy it): a single direction uses the first per_dir of them.
        keep = per_dir * self.num_directions
        if len(names) == 2 * per_dir and self.num_directions == 1:
            keep = per_dir
        elif len(names) != keep:
            raise self.fail(f"expected {per_dir * self.num_directions} activations, "
                            f"got {len(names)}")
        alphas = list(self.activation_alpha or [])
        betas = list(self.activation_beta or [])
        # Alphas / betas are consumed in order by the activations that take them.
        self.act_specs = []
        for name in names:
            key = name.lower()
            if key not in _ACTIVATIONS:
                raise self.fail(f"unsupported activation {name!r}")
            fn, n_a, n_b, da, db = _ACTIVATIONS[key]
            alpha = alphas.pop(0) if n_a and alphas else da
            beta = betas.pop(0) if n_b and betas else db
            self.act_specs.append((fn, alpha, beta))
        self.act_specs = self.act_specs[:keep]

    def _activations(self, d, dtype):
        per_dir = len(self.default_activations)
        return [_make_activation(self.xp, fn, a, b, dtype)
                for fn, a, b in self.act_specs[d * per_dir:(d + 1) * per_dir]]

    # --- helpers for run
    def _prepare(self, X, W, R, B, sequence_lens, initial_states):
        """Validate and normalise inputs. Returns the output and compute dtypes, X as
        [seq, batch, in], the lengths (None when all are full), the hidden size, and the initial
        states as [dirs, batch, hidden] arrays (None when absent)."""
        xp = self.xp
        if X.ndim != 3:
            raise self.fail(f"X must have rank 3, got shape {X.shape}")
        out_dtype = X.dtype
        cdt = out_dtype if out_dtype in (np.float32, np.float64) else np.dtype(np.float32)
        if self.lay == 1:
            X = X.transpose(1, 0, 2)
        seq, batch, input_size = X.shape
        D = self.num_directions
        if W.ndim != 3 or W.shape[0] != D or W.shape[2] != input_size:
            raise self.fail(f"W has shape {W.shape}, expected [{D}, {self.n_gates}*hidden, "
                            f"{input_size}]")
        H = int(self.hidden_size) if self.hidden_size is not None else R.shape[-1]
        if W.shape[1] != self.n_gates * H:
            raise self.fail(f"W has shape {W.shape}, expected [{D}, {self.n_gates * H}, "
                            f"{input_size}]")
        if R.shape != (D, self.n_gates * H, H):
            raise self.fail(f"R has shape {R.shape}, expected [{D}, {self.n_gates * H}, {H}]")
        if B is not None and B.shape != (D, 2 * self.n_gates * H):
            raise self.fail(f"B has shape {B.shape}, expected [{D}, {2 * self.n_gates * H}]")
        if sequence_lens is None:
            lens = None
        else:
            # read on the host: validated here, and the loop bound of the recurrence
            host_lens = _xp.to_host(xp, sequence_lens)
            lens = host_lens.astype(np.int64).reshape(-1)
            if lens.shape != (batch,):
                raise self.fail(f"sequence_lens has shape {host_lens.shape}, "
                                f"expected [{batch}]")
            if np.any(lens < 0) or np.any(lens > seq):
                raise self.fail(f"sequence_lens values must lie in [0, {seq}]")
            if np.all(lens == seq):
                lens = None
        states = []
        for s in initial_states:
            if s is None:
                states.append(None)
                continue
            if self.lay == 1:
                s = s.transpose(1, 0, 2)
            if s.shape != (D, batch, H):
                raise self.fail(f"initial state has shape {s.shape}, expected {(D, batch, H)} "
                                f"in layout 0 terms")
            states.append(xp.asarray(s, dtype=cdt))
        return out_dtype, cdt, xp.asarray(X, dtype=cdt), lens, H, states

    def _time_order(self, seq, batch, lens, reverse):
        """Per (step, batch) index into the time axis for this direction, or None for identity
        (`lens` an `xp` array, or None)."""
        xp = self.xp
        if not reverse:
            return None
        t = xp.arange(seq)[:, None]
        if lens is None:
            return xp.broadcast_to(seq - 1 - t, (seq, batch))
        L = lens[None, :]
        return xp.where(t < L, L - 1 - t, t)

    def _finish(self, Ys, finals, out_dtype):
        """Ys: list per direction of [seq, batch, H]; finals: list (per state) of lists per
        direction of [batch, H]. Returns outputs in the node's layout and dtype."""
        xp = self.xp
        Y = xp.stack(Ys, axis=1)                         # [seq, dirs, batch, H]
        states = [xp.stack(f, axis=0) for f in finals]   # [dirs, batch, H]
        if self.lay == 1:
            Y = Y.transpose(2, 0, 1, 3)
            states = [s.transpose(1, 0, 2) for s in states]
        return tuple(xp.ascontiguousarray(a).astype(out_dtype, copy=False)
                     for a in [Y, *states])

    def _clip(self, x):
        if self.clip is None:
            return x
        c = float(self.clip)
        return self.xp.clip(x, -c, c)

    def _run_all(self, X, W, R, B, lens, states, H, cdt, step_fn, n_state):
        """Run every direction. step_fn(d, xw_t, state, acts, P) -> new state tuple (H first).
        `lens` is a host array (or None)."""
        xp = self.xp
        seq, batch, _ = X.shape
        lens_x = None if lens is None else xp.asarray(lens)  # for the masks, in xp
        Ys, finals = [], [[] for _ in range(n_state)]
        ng = self.n_gates
        for d in range(self.num_directions):
            reverse = self.dir_name == "reverse" or d == 1
            order = self._time_order(seq, batch, lens_x, reverse)
            Xd = X if order is None else X[order, xp.arange(batch)[None, :]]
            Wd = xp.asarray(W[d], dtype=cdt)
            Rt = xp.ascontiguousarray(xp.asarray(R[d], dtype=cdt).T)   # [H, ng*H]
            if B is not None:
                Wb = xp.asarray(B[d, :ng * H], dtype=cdt)
                Rb = xp.asarray(B[d, ng * H:], dtype=cdt)
            else:
                Wb = xp.zeros(ng * H, cdt)
                Rb = xp.zeros(ng * H, cdt)
            XW = Xd @ Wd.T                                   # [seq, batch, ng*H]
            acts = self._activations(d, np.dtype(cdt))
            state = tuple(xp.zeros((batch, H), cdt) if s is None else s[d] for s in states)
            Y = xp.zeros((seq, batch, H), cdt)
            steps = seq if lens is None else int(lens.max(initial=0))
            for t in range(steps):
                new = step_fn(d, XW[t], Wb, Rt, Rb, state, acts)
                if lens is None:
                    state = new
                    Y[t] = new[0]
                else:
                    m = (t < lens_x)[:, None]
                    state = tuple(xp.where(m, n, s) for n, s in zip(new, state))
                    Y[t] = xp.where(m, new[0], 0)
            if order is not None:
                Y = Y[order, xp.arange(batch)[None, :]]      # the permutation is an involution
            Ys.append(Y)
            for i in range(n_state):
                finals[i].append(state[i])
        return Ys, finals


# ---------------------------------------------------------------- RNN
class _RNN(_RecurrentBase):
    n_gates = 1
    default_activations = ("Tanh",)

    def run(self, X, W, R, B=None, sequence_lens=None, initial_h=None):
        out_dtype, cdt, Xc, lens, H, states = self._prepare(X, W, R, B, sequence_lens,
                                                            [initial_h])

        def step(d, xw, wb, rt, rb, state, acts):
            (h,) = state
            return (acts[0](self._clip(xw + h @ rt + wb + rb)),)

        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 1)
        return self._finish(Ys, finals, out_dtype)


@register("RNN", versions=[1, 7])
class RNN1(_RNN):
    pass


@register("RNN", versions=[14, 22])
class RNN14(_RNN):
    has_layout = True


# ---------------------------------------------------------------- GRU
class _GRU(_RecurrentBase):
    n_gates = 3
    default_activations = ("Sigmoid", "Tanh")

    def run(self, X, W, R, B=None, sequence_lens=None, initial_h=None):
        out_dtype, cdt, Xc, lens, H, states = self._prepare(X, W, R, B, sequence_lens,
                                                            [initial_h])
        lbr = bool(getattr(self, "linear_before_reset", 0))

        def step(d, xw, wb, rt, rb, state, acts):
            (h,) = state
            f, g = acts
            xw = xw + wb
            if lbr:
                hr = h @ rt + rb                              # [batch, 3H]
                z = f(self._clip(xw[:, :H] + hr[:, :H]))
                r = f(self._clip(xw[:, H:2 * H] + hr[:, H:2 * H]))
                hh = g(self._clip(xw[:, 2 * H:] + r * hr[:, 2 * H:]))
            else:
                hr = h @ rt[:, :2 * H] + rb[:2 * H]
                z = f(self._clip(xw[:, :H] + hr[:, :H]))
                r = f(self._clip(xw[:, H:2 * H] + hr[:, H:2 * H]))
                hh = g(self._clip(xw[:, 2 * H:] + (r * h) @ rt[:, 2 * H:] + rb[2 * H:]))
            return ((1 - z) * hh + z * h,)

        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 1)
        return self._finish(Ys, finals, out_dtype)


@register("GRU", versions=[1])
class GRU1(_GRU):
    linear_before_reset = 0


@register("GRU", versions=[3, 7])
class GRU3(_GRU):
    pass


@register("GRU", versions=[14, 22])
class GRU14(_GRU):
    has_layout = True


# ---------------------------------------------------------------- LSTM
class _LSTM(_RecurrentBase):
    n_gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")

    def run(self, X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None):
        out_dtype, cdt, Xc, lens, H, states = self._prepare(X, W, R, B, sequence_lens,
                                                            [initial_h, initial_c])
        D = self.num_directions
        if P is not None and P.shape != (D, 3 * H):
            raise self.fail(f"P has shape {P.shape}, expected [{D}, {3 * H}]")
        Pc = None if P is None else self.xp.asarray(P, dtype=cdt)
        couple = bool(self.input_forget)

        def step(d, xw, wb, rt, rb, state, acts):
            h, c = state
            f, g, hf = acts
            gates = xw + h @ rt + wb + rb                     # [batch, 4H], order i o f c
            gi, go, gf, gc = (gates[:, k * H:(k + 1) * H] for k in range(4))
            if Pc is not None:
                pi, po, pf = Pc[d, :H], Pc[d, H:2 * H], Pc[d, 2 * H:]
                gi = gi + pi * c
                gf = gf + pf * c
            i = f(self._clip(gi))
            fg = (1 - i) if couple else f(self._clip(gf))
            cc = g(self._clip(gc))
            c_new = fg * c + i * cc
            if Pc is not None:
                go = go + po * c_new
            o = f(self._clip(go))
            return (o * hf(c_new), c_new)

        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 2)
        return self._finish(Ys, finals, out_dtype)


@register("LSTM", versions=[1, 7])
class LSTM1(_LSTM):
    pass


@register("LSTM", versions=[14, 22])
class LSTM14(_LSTM):
    has_layout = True
