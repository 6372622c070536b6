"""Recurrent ops: RNN, GRU, LSTM (one layer, forward / reverse / bidirectional).

All three share the same driver: inputs are brought to layout 0 ([seq, batch, ...]), the input
projection X·Wᵀ (+ Wb) is computed for all time steps at once, and a Python loop over time steps
applies the recurrence for the whole batch. `sequence_lens` is honoured per batch entry: steps past
an entry's length leave its state unchanged and write zeros to Y; the reverse direction runs over
each entry's own valid prefix, from its last valid step down to step 0.

Since-versions: 1 (output_sequence attribute, no layout; GRU-1 has no linear_before_reset),
3 (GRU only: linear_before_reset), 7 (output_sequence removed), 14 (layout), 22 (bfloat16 types).
Y is always computed (the v1 output_sequence flag only makes it optional for the node).

With the default activations and no clip (what exporters write), each op runs a tight
recurrence instead (`_fast`): one GEMM projects the inputs of every time step and direction at
once, with the biases folded in; the sigmoid gates' columns of W, R and the biases are negated
once (cached while they are the same constants), so a sigmoid is exp, +1, reciprocal in place;
each step is then one matmul into a preallocated gate buffer plus a dozen in-place ufunc calls
(`out=`) on fixed views, writing h straight into Y. Other activations and clip take the
general per-step driver (`_run_all`).

With numba (ops/cpu/compiled.py), a float32 LSTM, or GRU with linear_before_reset (what PyTorch
exports), on the CPU without sequence_lens, peepholes or coupled gates runs each direction as
one compiled call (`_lstm_steps_loops`, `_gru_lbr_steps_loops`) on a team of threads that
split the hidden units and wait for one another after each step: no Python and no hand-off to
a pool between steps, and each thread's share of R stays in its core's cache: a step is much
cheaper than BLAS's matmul plus a compiled cell. A GRU without
linear_before_reset computes each step's gates in compiled passes (`_gru_*_loops`) between
BLAS's two products, with _compiled's vectorised exp and tanh.
"""
from __future__ import annotations

import numpy as np

from ember.ops.cpu import blas as _blas, compiled as _compiled, tiles as _tiles, tuning
from ember.ops import _xp
from ember.ops.cpu.compiled import chunk_done, exp_float32, tanh_float32, take_chunk, wait_step
from ember.ops.cpu.tiles import columns_from_blocks
from ember.ops.linalg import dot_columns_loops
from ember.ops._lowering import numba_serves
from ember.ops.registry import Lowering, PORTABLE, OpImpl, register


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


# ---------------------------------------------------------------- compiled recurrences (numba)
# A whole direction of a float32 LSTM, or GRU with linear_before_reset, is one compiled call,
# run by threads in lockstep (_compiled.run_in_lockstep): a thread takes a chunk of hidden
# units [u0, u1), computes their gate columns of h R (`_recurrent_product`: from R packed in
# column blocks as vector code on an AVX-512 or AVX2 CPU, else as dot products with the rows of R,
# linalg's few-row kernel), updates their cells, and waits for every chunk before the next
# step reads the new h. The sigmoid gates' rows of R and columns of XW arrive negated (see
# `_prepared`), so a sigmoid is 1 / (1 + exp(g)). Each element is computed by the same
# expression whichever thread takes its chunk: one thread or several give the same bits.
@_compiled.kernel_math(fastmath={"contract"}, error_model="numpy")
def _lstm_cell_units(G, xw, c, y, u0, u1):  # pragma: no cover - numba
    """G = h R (batch, 4H: i o f c), xw this step's input projection; the units [u0, u1) of
    c updated in place and of the new h written to y. (Row slices, not offset indices: LLVM
    vectorises the loop over them.)"""
    batch, H = c.shape
    for b in range(batch):
        gi, go, gf, gc = (G[b, u0:u1], G[b, H + u0:H + u1], G[b, 2 * H + u0:2 * H + u1],
                          G[b, 3 * H + u0:3 * H + u1])
        xi, xo, xf, xc = (xw[b, u0:u1], xw[b, H + u0:H + u1], xw[b, 2 * H + u0:2 * H + u1],
                          xw[b, 3 * H + u0:3 * H + u1])
        cb, yb = c[b, u0:u1], y[b, u0:u1]
        for j in range(u1 - u0):
            i = np.float32(1) / (np.float32(1) + exp_float32(gi[j] + xi[j]))
            o = np.float32(1) / (np.float32(1) + exp_float32(go[j] + xo[j]))
            f = np.float32(1) / (np.float32(1) + exp_float32(gf[j] + xf[j]))
            g = tanh_float32(gc[j] + xc[j])
            cn = f * cb[j] + i * g
            cb[j] = cn
            yb[j] = o * tanh_float32(cn)


@_compiled.kernel_math(fastmath={"contract"}, error_model="numpy")
def _gru_lbr_cell_units(G, xw, Rbn, h, y, u0, u1):  # pragma: no cover - numba
    """linear_before_reset: G = h R (batch, 3H: z r n); n = tanh(xn + r (hRn + Rbn)),
    y = n + z (h - n) for the units [u0, u1)."""
    batch, H = h.shape
    rb = Rbn[u0:u1]
    for b in range(batch):
        gz, gr, gn = G[b, u0:u1], G[b, H + u0:H + u1], G[b, 2 * H + u0:2 * H + u1]
        xz, xr, xn = xw[b, u0:u1], xw[b, H + u0:H + u1], xw[b, 2 * H + u0:2 * H + u1]
        hb, yb = h[b, u0:u1], y[b, u0:u1]
        for j in range(u1 - u0):
            z = np.float32(1) / (np.float32(1) + exp_float32(gz[j] + xz[j]))
            r = np.float32(1) / (np.float32(1) + exp_float32(gr[j] + xr[j]))
            n = tanh_float32(xn[j] + r * (gn[j] + rb[j]))
            yb[j] = n + z * (hb[j] - n)


@_compiled.kernel_math
def _recurrent_product(h, R, P, G, n0, n1):  # pragma: no cover - numba
    """G[:, n0:n1] = h R^T: from R^T in column blocks P as vector code where the recurrence
    takes it (`_tiles.recurrence_by_rows`: P given, else an empty array), else as dot
    products with the rows of R (G, H)."""
    if P.shape[0]:
        columns_from_blocks(h, P, G, n0, n1)
    else:
        dot_columns_loops(h, R, G, n0, n1)


@_compiled.kernel_math(fastmath={"contract"})
def _lstm_steps_loops(XW, R, P, Y, h0, c, G, reverse, cuts, rank,
                      sync):  # pragma: no cover
    """Every step of one direction: XW (seq, batch, 4H), R (4H, H) and P (R^T in column
    blocks, or empty: `_recurrent_product`), Y (seq, batch, H) written, h0 the initial h, c the cell
    state (updated), G scratch; the hidden units cut into chunks at `cuts`, taken by the
    threads in lockstep (_compiled.run_in_lockstep)."""
    seq, H, chunks = XW.shape[0], c.shape[1], cuts.size - 1
    for i in range(seq):
        t = seq - 1 - i if reverse else i
        h = h0 if i == 0 else Y[t + 1 if reverse else t - 1]
        for k in range(chunks):
            chunk = (rank + k) % chunks  # this thread's own first
            if take_chunk(sync, i, chunk, chunks):
                u0, u1 = cuts[chunk], cuts[chunk + 1]
                for g in range(4):
                    _recurrent_product(h, R, P, G, g * H + u0, g * H + u1)
                _lstm_cell_units(G, XW[t], c, Y[t], u0, u1)
                chunk_done(sync, i, chunks)
        wait_step(sync, i, chunks)


@_compiled.kernel_math(fastmath={"contract"})
def _gru_lbr_steps_loops(XW, R, P, Rbn, Y, h0, G, reverse, cuts, rank,
                         sync):  # pragma: no cover
    """As `_lstm_steps_loops`, for a GRU with linear_before_reset (R (3H, H))."""
    seq, H, chunks = XW.shape[0], h0.shape[1], cuts.size - 1
    for i in range(seq):
        t = seq - 1 - i if reverse else i
        h = h0 if i == 0 else Y[t + 1 if reverse else t - 1]
        for k in range(chunks):
            chunk = (rank + k) % chunks
            if take_chunk(sync, i, chunk, chunks):
                u0, u1 = cuts[chunk], cuts[chunk + 1]
                for g in range(3):
                    _recurrent_product(h, R, P, G, g * H + u0, g * H + u1)
                _gru_lbr_cell_units(G, XW[t], Rbn, h, Y[t], u0, u1)
                chunk_done(sync, i, chunks)
        wait_step(sync, i, chunks)


# The team kernels' piece functions (ops/cpu/compiled.py's run_in_lockstep: the helpers run their
# part without Python), the rank as row0, the arguments rebuilt from the block.
def _lstm_steps_piece(block, rank, _):  # pragma: no cover
    v = _compiled.array_at(block, (29,), np.int64)
    f32 = np.float32
    _lstm_steps_loops(_compiled.array_at(v[0], (v[1], v[2], v[3]), f32),
                      _compiled.array_at(v[4], (v[5], v[6]), f32),
                      _compiled.array_at(v[7], (v[8], v[9], v[10]), f32),
                      _compiled.array_at(v[11], (v[12], v[13], v[14]), f32),
                      _compiled.array_at(v[15], (v[16], v[17]), f32),
                      _compiled.array_at(v[18], (v[19], v[20]), f32),
                      _compiled.array_at(v[21], (v[22], v[23]), f32), v[24] != 0,
                      _compiled.array_at(v[25], (v[26],), np.int64), rank,
                      _compiled.array_at(v[27], (v[28],), np.int64))


def _gru_lbr_steps_piece(block, rank, _):  # pragma: no cover
    v = _compiled.array_at(block, (28,), np.int64)
    f32 = np.float32
    _gru_lbr_steps_loops(_compiled.array_at(v[0], (v[1], v[2], v[3]), f32),
                         _compiled.array_at(v[4], (v[5], v[6]), f32),
                         _compiled.array_at(v[7], (v[8], v[9], v[10]), f32),
                         _compiled.array_at(v[11], (v[12],), f32),
                         _compiled.array_at(v[13], (v[14], v[15], v[16]), f32),
                         _compiled.array_at(v[17], (v[18], v[19]), f32),
                         _compiled.array_at(v[20], (v[21], v[22]), f32), v[23] != 0,
                         _compiled.array_at(v[24], (v[25],), np.int64), rank,
                         _compiled.array_at(v[26], (v[27],), np.int64))


# ---------------------------------------------------------------- compiled cells (numba)
# Without linear_before_reset, a GRU step is two products with the reset gate between them:
# each step is BLAS's matmul plus these compiled passes. `h` (the previous state) is read
# only; the new one goes to `y` (a step of Y), so the two never overlap.
def _gru_gates_loops(Gzr, XWt, h, rh):  # pragma: no cover - numba
    """Without linear_before_reset, before the candidate's matmul: z and r into Gzr (in
    place), r * h into rh."""
    batch, H = h.shape
    for b in range(batch):
        for j in range(H):
            z = np.float32(1) / (np.float32(1) + exp_float32(Gzr[b, j] + XWt[b, j]))
            r = np.float32(1) / (np.float32(1) + exp_float32(Gzr[b, H + j] + XWt[b, H + j]))
            Gzr[b, j] = z
            Gzr[b, H + j] = r
            rh[b, j] = r * h[b, j]


def _gru_out_loops(n, XWt, Gzr, h, y):  # pragma: no cover - numba
    """After it: n = tanh(n + xn), y = n + z (h - n)."""
    batch, H = h.shape
    for b in range(batch):
        for j in range(H):
            nn = tanh_float32(n[b, j] + XWt[b, 2 * H + j])
            y[b, j] = nn + Gzr[b, j] * (h[b, j] - nn)


# ---------------------------------------------------------------- shared driver
_FLOAT32 = np.dtype(np.float32)
_RECURRENCE_BY_DTYPE = Lowering("by geometry", "float32: compiled recurrences; other dtypes: "
                                "numpy steps (the input's dtype is known in the run)")
_RECURRENCE_TEAM = Lowering("cpu.recurrence", "each direction in one compiled call: threads in "
                            "lockstep, each a chunk of the hidden units, the step's product in "
                            "register tiles where they serve")


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
        keys = [n.lower() for n in names[:keep]]
        self.fast = self.clip is None and keys == [n.lower() for n in self.default_activations] \
            * self.num_directions
        self._prep_key = None
        self._prep_val = None

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

    # --- the fast path (default activations, no clip)
    # Per op: which of the n_gates column blocks of W / R go through a sigmoid (negated), and
    # which parts of the recurrence bias Rb fold into the input projection's bias (all of it
    # except GRU's with linear_before_reset, whose candidate part is scaled by the reset gate).
    sigmoid_gates: tuple[int, ...] = ()

    def _rb_folded(self, H):
        return slice(0, self.n_gates * H)

    def _recurrence_weights(self, xp, Rt, H):
        """What `_recur` multiplies h by, from Rt (H, ng*H)."""
        return Rt

    def _prepared(self, W, R, B, cdt, H):
        """(Wt, bias, Rs, Rts, Rbs): the input projection (input, dirs*ng*H) and its bias (the
        folded Rb included), per direction R (ng*H, H), R transposed (H, ng*H) and the unfolded
        part of Rb (or None); sigmoid gate rows and columns negated. Cached while W, R, B are
        the same read-only numpy constants."""
        key = (W, R, B, np.dtype(cdt))
        if self._prep_key is not None and all(a is b for a, b in zip(key, self._prep_key)):
            return self._prep_val
        xp = self.xp
        D, ng = self.num_directions, self.n_gates
        G = ng * H
        sign = np.ones(G, cdt)
        for k in self.sigmoid_gates:
            sign[k * H:(k + 1) * H] = -1
        sign = xp.asarray(sign)
        Wt = xp.empty((W.shape[2], D * G), cdt)
        bias = xp.zeros(D * G, cdt)
        Rs, Rts, Rbs = [], [], []
        fold = self._rb_folded(H)
        for d in range(D):
            Wt[:, d * G:(d + 1) * G] = (xp.asarray(W[d], dtype=cdt) * sign[:, None]).T
            Rs.append(xp.asarray(R[d], dtype=cdt) * sign[:, None])
            Rts.append(self._recurrence_weights(xp, xp.ascontiguousarray(Rs[d].T), H))
            if B is not None:
                Bd = xp.asarray(B[d], dtype=cdt)
                b = Bd[:G].copy()
                b[fold] += Bd[G:][fold]
                bias[d * G:(d + 1) * G] = b * sign
                rest = Bd[G:].copy()
                rest[fold] = 0
                Rbs.append(None if fold == slice(0, G) else rest * sign)
            else:
                Rbs.append(None if fold == slice(0, G) else xp.zeros(G, cdt))
        value = (Wt, bias, Rs, Rts, Rbs)
        # (device arrays have no read-only flag: recomputed on each run there)
        if xp is np and all(not a.flags.writeable for a in key[:3] if a is not None):
            self._prep_key, self._prep_val = key, value
        return value

    def _fast(self, X, W, R, B, lens, states, H, cdt, extra=None):
        """Every direction through `_recur`. Returns (Y [seq, dirs, batch, H], final states,
        each [dirs, batch, H])."""
        xp = self.xp
        seq, batch, _ = X.shape
        D, G = self.num_directions, self.n_gates * H
        Wt, bias, Rs, Rts, Rbs = self._prepared(W, R, B, cdt, H)
        XW = _blas.product(xp, X.reshape(seq * batch, X.shape[2]), Wt).reshape(seq, batch, D * G)
        XW += bias
        # each direction's steps contiguous (seq, batch, H), seen as (seq, dirs, batch, H)
        Y = (xp.empty if lens is None else xp.zeros)((D, seq, batch, H), cdt).transpose(
            1, 0, 2, 3)
        team_kernel = self._team_kernel(cdt, lens is None, extra)
        lens_x = None if lens is None else xp.asarray(lens)
        masks = None if lens is None else (xp.arange(seq)[:, None] < lens_x[None, :])[:, :, None]
        finals = [[] for _ in range(len(states))]
        for d in range(D):
            reverse = self.dir_name == "reverse" or d == 1
            XWd = XW[:, :, d * G:(d + 1) * G]
            Yd = Y[:, d]
            order = None
            if lens is None:
                ts = range(seq - 1, -1, -1) if reverse else range(seq)
            else:
                ts = range(int(lens.max(initial=0)))
                if reverse:  # each entry's valid prefix, last step first
                    order = self._time_order(seq, batch, lens_x, True)
                    XWd = XWd[order, xp.arange(batch)[None, :]]
                    Yd = xp.zeros((seq, batch, H), cdt)
            init = [None if s is None else s[d] for s in states]
            if team_kernel is not None:
                final = self._recur_team(team_kernel, XWd, Yd, reverse, init, Rs[d], Rbs[d],
                                         Rts[d])
            else:
                # on BLAS's own threading: one thread was never faster for these products
                # on an idle machine
                final = self._recur(d, XWd, Yd, ts, init, Rts[d], Rbs[d], masks, H, cdt,
                                    extra)
            if order is not None:
                Y[:, d] = Yd[order, xp.arange(batch)[None, :]]  # the permutation is an involution
            for i, f in enumerate(final):
                finals[i].append(f)
        # one direction: its state as a view with the axis added (np.stack would copy it)
        return Y, [f[0][None] if D == 1 else xp.stack(f, axis=0) for f in finals]

    # The compiled whole-direction kernel (see `_lstm_steps_loops`), where the op has one.
    team_loops = None
    team_piece = None  # its piece function (ops/cpu/compiled.py)

    def _team_kernel(self, cdt, no_masks, extra):
        """`team_loops` compiled, where it serves (numba, the CPU, float32, no sequence_lens,
        `_team_applies`); else None."""
        if self.team_loops is None or not self._team_applies(extra):
            return None
        return self._compiled_cell(self.team_loops, cdt, no_masks)

    def _team_applies(self, extra) -> bool:
        return True

    def _team_lowers(self, inputs) -> bool:
        """`_team_applies`, from the node's inputs and attributes at plan time."""
        return True

    def lower(self, inputs):
        x = inputs[0]
        if x is None or x.dtype is None:
            return _RECURRENCE_BY_DTYPE
        if x.dtype != np.float32:
            return PORTABLE
        no_lens = len(inputs) < 5 or inputs[4] is None
        if self.team_loops is not None and no_lens and self._team_lowers(inputs) \
                and numba_serves():
            return _RECURRENCE_TEAM
        return Lowering("numpy", "a BLAS product a step, its gates in numpy or compiled passes")

    @staticmethod
    def _team_start(XW, init, H):
        """XW contiguous (one direction of a bidirectional op: a copy) and the initial h."""
        h0 = init[0]
        h0 = np.zeros((XW.shape[1], H), np.float32) if h0 is None else np.ascontiguousarray(h0)
        return np.ascontiguousarray(XW), h0

    def _by_rows(self, Rt, H):
        """The recurrent weights in column blocks for the team's product
        (`_recurrent_product`), kept while Rt (H, gates * H) is the same array, where the
        vector code takes it; else an empty array (kept too: asking `recurrence_by_rows`
        reads the environment, a good part of a one-step recurrence's time)."""
        kept = getattr(self, "_column_blocks", ())  # ((Rt, blocks), ...), one a direction
        for source, packed in kept:
            if source is Rt:
                return packed
        packed = _tiles.pack_columns(Rt) if _tiles.recurrence_by_rows(H) \
            else np.empty((0, 0, 0), np.float32)
        # replaced in one assignment: a thread sees whole pairs
        self._column_blocks = (kept + ((Rt, packed),))[-self.num_directions:]
        return packed

    def _team_run(self, kernel, XW, H, *args, cuts=None):
        """The team kernel over one direction; `cuts` (a kept route's, `_team_route`): one
        thread's chunk bounds, the kernel then called here as run_in_lockstep calls it on one
        thread, without working its split out again."""
        seq, batch, G = XW.shape
        if cuts is not None:
            kernel(XW, *args, cuts, 0, np.zeros(seq * 2, np.int64))
            return
        _compiled.run_in_lockstep(kernel, H, seq, XW, *args,
                                  min_units=self._team_min_units(batch, G),
                                  piece=self.team_piece)

    @staticmethod
    def _team_min_units(batch, G):
        return -(-tuning.RNN_TEAM_MIN_MACS // (batch * G))

    # --- a kept route for the team kernels: a model's node gets inputs of the same shapes and
    # the same weights run after run, and checking them, choosing the kernel and setting up
    # its one thread again is a large share of a small recurrence's time
    def _team_route(self, X, W, R, B, states, extra):
        """The route of `_fast_team` for these inputs, or None where the team kernel does not
        take them (then `run`'s checks and general path as before). Kept while X and the
        initial states keep their shapes, strides and dtypes, the run its thread count, and
        W, R and B are the same read-only arrays (constants); one tuple, replaced whole."""
        signature = [type(X), X.shape, X.strides, X.dtype, _compiled.run_threads()]
        for s in states:
            signature.append(None if s is None else (type(s), s.shape, s.strides, s.dtype))
        signature = tuple(signature)
        kept = self.__dict__.get("_kept_team_route")
        if kept is not None and kept[0] == signature and kept[1] is W and kept[2] is R \
                and kept[3] is B:
            return kept[4]
        if type(X) is not np.ndarray or self.xp is not np or X.dtype != np.float32 \
                or not all(s is None or (type(s) is np.ndarray and s.dtype == np.float32)
                           for s in states):
            return None
        route = self._new_team_route(X, W, R, B, states, extra)
        if route is not None and all(isinstance(a, np.ndarray) and not a.flags.writeable
                                     for a in (W, R, B) if a is not None):
            self._kept_team_route = (signature, W, R, B, route)
        return route

    def _new_team_route(self, X, W, R, B, states, extra):
        if not self.fast:
            return None
        # the general path's checks (its errors where the inputs are wrong)
        out_dtype, cdt, Xc, lens, H, _ = self._prepare(X, W, R, B, None, list(states))
        kernel = self._team_kernel(cdt, True, extra)
        if kernel is None or out_dtype != np.float32:
            return None
        seq, batch, _ = Xc.shape
        G = self.n_gates * H
        Wt, bias, Rs, Rts, Rbs = self._prepared(W, R, B, cdt, H)
        min_units = self._team_min_units(batch, G)
        # run_in_lockstep's split: one thread (its cuts then [0, H]) where the run's threads
        # or the units do not make two chunks
        one = min(_compiled.run_threads(), H // max(1, min_units)) <= 1
        cuts = np.array([0, H], np.int64) if one else None
        directions = tuple((self.dir_name == "reverse" or d == 1,
                            self._team_weights(Rs[d], Rbs[d], Rts[d], H))
                           for d in range(self.num_directions))
        return (H, G, Wt, bias, kernel, directions, cuts)

    def _fast_team(self, route, X, states):
        """`_fast` and `_finish_fast` on a kept route (`_team_route`): the same steps, without
        the checks and choices made when it was kept."""
        H, G, Wt, bias, kernel, directions, cuts = route
        if self.lay == 1:
            X = X.transpose(1, 0, 2)
            states = [None if s is None else s.transpose(1, 0, 2) for s in states]
        seq, batch, width = X.shape
        D = len(directions)
        XW = _blas.product(np, X.reshape(seq * batch, width), Wt).reshape(seq, batch, D * G)
        XW += bias
        Y = np.empty((D, seq, batch, H), np.float32).transpose(1, 0, 2, 3)
        if D == 1:  # the whole of XW and Y, their single state as views with the axis added
            reverse, weights = directions[0]
            final = self._team_direction(kernel, XW, Y[:, 0], reverse,
                                         [None if s is None else s[0] for s in states],
                                         weights, cuts, H)
            if self.lay == 0:  # `_finish_fast`: its arrays are C-ordered float32 already
                return (Y, *(f[None] for f in final))
            return self._finish_fast(Y, [f[None] for f in final], _FLOAT32)
        finals = [[] for _ in range(len(states))]
        for d, (reverse, weights) in enumerate(directions):
            final = self._team_direction(kernel, XW[:, :, d * G:(d + 1) * G], Y[:, d], reverse,
                                         [None if s is None else s[d] for s in states],
                                         weights, cuts, H)
            for i, f in enumerate(final):
                finals[i].append(f)
        return self._finish_fast(Y, [np.stack(f, axis=0) for f in finals], _FLOAT32)

    def _recur_team(self, kernel, XW, Y, reverse, init, R, Rb, Rt):
        H = R.shape[1]
        return self._team_direction(kernel, XW, Y, reverse, init,
                                    self._team_weights(R, Rb, Rt, H), None, H)

    @staticmethod
    def _last_h(Y, h0, reverse):
        if Y.shape[0] == 0:
            return h0
        return Y[0] if reverse else Y[-1]

    def _compiled_cell(self, loops, cdt, applicable):
        """`loops` compiled, where it serves: numba installed, the CPU, float32, and
        `applicable` (no masks, peepholes or coupled gates); else None. (fastmath: only
        multiply-adds contracted into FMAs.)"""
        if not applicable or self.xp is not np or np.dtype(cdt) != np.float32:
            return None
        return _compiled.jit(loops, fastmath={"contract"})

    def _finish_fast(self, Y, states, out_dtype):
        xp = self.xp
        if self.lay == 1:
            Y = Y.transpose(2, 0, 1, 3)
            states = [s.transpose(1, 0, 2) for s in states]
        return tuple(xp.ascontiguousarray(a).astype(out_dtype, copy=False)
                     for a in [Y, *states])

    @staticmethod
    def _state(xp, s, batch, H, cdt):
        """A fresh (owned, writable) state buffer: a copy of `s`, or zeros."""
        return xp.zeros((batch, H), cdt) if s is None else xp.array(s, dtype=cdt, copy=True)


# ---------------------------------------------------------------- RNN
class _RNN(_RecurrentBase):
    n_gates = 1
    default_activations = ("Tanh",)

    def run(self, X, W, R, B=None, sequence_lens=None, initial_h=None):
        self.settle_lowering(X, W, R, B, sequence_lens, initial_h)
        out_dtype, cdt, Xc, lens, H, states = self._prepare(X, W, R, B, sequence_lens,
                                                            [initial_h])

        def step(d, xw, wb, rt, rb, state, acts):
            (h,) = state
            return (acts[0](self._clip(xw + h @ rt + wb + rb)),)

        if self.fast:
            Y, finals = self._fast(Xc, W, R, B, lens, states, H, cdt)
            return self._finish_fast(Y, finals, out_dtype)
        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 1)
        return self._finish(Ys, finals, out_dtype)

    def _recur(self, d, XW, Y, ts, init, Rt, Rb, masks, H, cdt, extra):
        """h_t = tanh(xw_t + h_{t-1} Rt) over the steps `ts`, into Y; returns (h,)."""
        xp = self.xp
        batch = XW.shape[1]
        matmul, add, tanh, copyto = xp.matmul, xp.add, xp.tanh, xp.copyto
        if masks is None:
            h = xp.zeros((batch, H), cdt) if init[0] is None else init[0]
            for t in ts:
                y = Y[t]
                matmul(h, Rt, out=y)
                add(y, XW[t], out=y)
                tanh(y, out=y)
                h = y
            return (h,)
        h = self._state(xp, init[0], batch, H, cdt)
        T = xp.empty((batch, H), cdt)
        for t in ts:
            matmul(h, Rt, out=T)
            add(T, XW[t], out=T)
            tanh(T, out=T)
            copyto(Y[t], T, where=masks[t])
            copyto(h, T, where=masks[t])
        return (h,)


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
        self.settle_lowering(X, W, R, B, sequence_lens, initial_h)
        if sequence_lens is None and self.team_loops is not None:
            route = self._team_route(X, W, R, B, (initial_h,), None)
            if route is not None:
                return self._fast_team(route, X, [initial_h])
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

        if self.fast:
            Y, finals = self._fast(Xc, W, R, B, lens, states, H, cdt)
            return self._finish_fast(Y, finals, out_dtype)
        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 1)
        return self._finish(Ys, finals, out_dtype)

    sigmoid_gates = (0, 1)  # z, r
    team_loops = staticmethod(_gru_lbr_steps_loops)
    team_piece = staticmethod(_gru_lbr_steps_piece)

    def _team_applies(self, extra) -> bool:
        return self._lbr()  # without it, two products a step: `_recur_compiled`

    def _team_lowers(self, inputs) -> bool:
        return self._lbr()

    def _team_weights(self, R, Rb, Rt, H):
        return R, self._by_rows(Rt, H), np.ascontiguousarray(Rb[2 * H:])

    def _team_direction(self, kernel, XW, Y, reverse, init, weights, cuts, H):
        XW, h0 = self._team_start(XW, init, H)
        G = np.empty(XW.shape[1:], np.float32)
        self._team_run(kernel, XW, H, *weights, Y, h0, G, reverse, cuts=cuts)
        return (self._last_h(Y, h0, reverse),)

    def _lbr(self):
        return bool(getattr(self, "linear_before_reset", 0))

    def _rb_folded(self, H):
        # with linear_before_reset the candidate's Rb is inside r * (h Rh + Rbh)
        return slice(0, 2 * H) if self._lbr() else slice(0, 3 * H)

    def _recurrence_weights(self, xp, Rt, H):
        if self._lbr():
            return Rt
        # without: h Rzr for the gates, then (r * h) Rh for the candidate
        return xp.ascontiguousarray(Rt[:, :2 * H]), xp.ascontiguousarray(Rt[:, 2 * H:])

    def _recur(self, d, XW, Y, ts, init, Rt, Rb, masks, H, cdt, extra):
        """z, r = sigmoid(.) (negated pre-activations), n = tanh(.), h = n + z * (h - n)."""
        xp = self.xp
        batch = XW.shape[1]
        lbr = self._lbr()
        if not lbr and masks is None \
                and self._compiled_cell(_gru_gates_loops, cdt, True) is not None:
            h = xp.zeros((batch, H), cdt) if init[0] is None else init[0]
            return self._recur_compiled(XW, Y, ts, h, Rt, Rb, H, cdt)
        matmul, add, subtract, multiply = xp.matmul, xp.add, xp.subtract, xp.multiply
        exp, reciprocal, tanh, copyto = xp.exp, xp.reciprocal, xp.tanh, xp.copyto
        XWzr, XWn = XW[:, :, :2 * H], XW[:, :, 2 * H:]
        if lbr:
            G = xp.empty((batch, 3 * H), cdt)
            Gzr, n = G[:, :2 * H], G[:, 2 * H:]
            Rbn = Rb[2 * H:]
        else:
            Rzr, Rn = Rt
            Gzr = xp.empty((batch, 2 * H), cdt)
            n = xp.empty((batch, H), cdt)
        z, r = Gzr[:, :H], Gzr[:, H:]
        T = xp.empty((batch, H), cdt)
        if masks is None:
            h = xp.zeros((batch, H), cdt) if init[0] is None else init[0]
        else:
            h = self._state(xp, init[0], batch, H, cdt)
            hn = xp.empty((batch, H), cdt)
        with np.errstate(over="ignore"):  # exp(-x) -> inf: the sigmoid's limit 0, exactly
            for t in ts:
                if lbr:
                    matmul(h, Rt, out=G)
                else:
                    matmul(h, Rzr, out=Gzr)
                add(Gzr, XWzr[t], out=Gzr)
                exp(Gzr, out=Gzr)
                add(Gzr, 1, out=Gzr)
                reciprocal(Gzr, out=Gzr)
                if lbr:
                    add(n, Rbn, out=n)
                    multiply(n, r, out=n)
                else:
                    multiply(r, h, out=T)
                    matmul(T, Rn, out=n)
                add(n, XWn[t], out=n)
                tanh(n, out=n)
                subtract(h, n, out=T)
                multiply(T, z, out=T)
                if masks is None:
                    y = Y[t]
                    add(n, T, out=y)
                    h = y
                else:
                    add(n, T, out=hn)
                    copyto(Y[t], hn, where=masks[t])
                    copyto(h, hn, where=masks[t])
        return (h,)


    def _recur_compiled(self, XW, Y, ts, h, Rt, Rb, H, cdt):
        """`_recur` without linear_before_reset or masks, each step's gates in compiled
        passes."""
        matmul, batch = np.matmul, XW.shape[1]
        gates = self._compiled_cell(_gru_gates_loops, cdt, True)
        out = self._compiled_cell(_gru_out_loops, cdt, True)
        (Rzr, Rn), Gzr = Rt, np.empty((batch, 2 * H), cdt)
        rh, n = np.empty((batch, H), cdt), np.empty((batch, H), cdt)
        for t in ts:
            matmul(h, Rzr, out=Gzr)
            gates(Gzr, XW[t], h, rh)
            matmul(rh, Rn, out=n)
            y = Y[t]
            out(n, XW[t], Gzr, h, y)
            h = y
        return (h,)


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
        self.settle_lowering(X, W, R, B, sequence_lens, initial_h, initial_c, P)
        if sequence_lens is None and P is None:
            route = self._team_route(X, W, R, B, (initial_h, initial_c),
                                     (None, bool(self.input_forget)))
            if route is not None:
                return self._fast_team(route, X, [initial_h, initial_c])
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

        if self.fast:
            # peepholes, negated like the sigmoid pre-activations they join (i, o, f)
            negP = None if Pc is None else -Pc
            Y, finals = self._fast(Xc, W, R, B, lens, states, H, cdt, (negP, couple))
            return self._finish_fast(Y, finals, out_dtype)
        Ys, finals = self._run_all(Xc, W, R, B, lens, states, H, cdt, step, 2)
        return self._finish(Ys, finals, out_dtype)

    sigmoid_gates = (0, 1, 2)  # i, o, f
    team_loops = staticmethod(_lstm_steps_loops)
    team_piece = staticmethod(_lstm_steps_piece)

    def _team_applies(self, extra) -> bool:
        negP, couple = extra
        return negP is None and not couple

    def _team_lowers(self, inputs) -> bool:
        return (len(inputs) < 8 or inputs[7] is None) and not self.input_forget

    def _team_weights(self, R, Rb, Rt, H):
        return R, self._by_rows(Rt, H)

    def _team_direction(self, kernel, XW, Y, reverse, init, weights, cuts, H):
        XW, h0 = self._team_start(XW, init, H)
        c = self._state(np, init[1], XW.shape[1], H, np.float32)
        G = np.empty(XW.shape[1:], np.float32)
        self._team_run(kernel, XW, H, *weights, Y, h0, c, G, reverse, cuts=cuts)
        return (self._last_h(Y, h0, reverse), c)

    def _recur(self, d, XW, Y, ts, init, Rt, Rb, masks, H, cdt, extra):
        """Gates i, o, f = sigmoid(.) (negated pre-activations), g = tanh(.),
        c = f * c + i * g, h = o * tanh(c)."""
        xp = self.xp
        negP, couple = extra
        batch = XW.shape[1]
        matmul, add, subtract, multiply = xp.matmul, xp.add, xp.subtract, xp.multiply
        exp, reciprocal, tanh, copyto = xp.exp, xp.reciprocal, xp.tanh, xp.copyto
        G = xp.empty((batch, 4 * H), cdt)
        gi, go, gf, gc = (G[:, k * H:(k + 1) * H] for k in range(4))
        sig = G[:, :3 * H] if negP is None else None   # i, o, f at once without peepholes
        if negP is not None:
            pi, po, pf = negP[d, :H], negP[d, H:2 * H], negP[d, 2 * H:]
        T = xp.empty((batch, H), cdt)
        c = self._state(xp, init[1], batch, H, cdt)
        if masks is None:
            h = xp.zeros((batch, H), cdt) if init[0] is None else init[0]
            cn = c
        else:
            h = self._state(xp, init[0], batch, H, cdt)
            cn = xp.empty((batch, H), cdt)

        def sigmoid(v):
            exp(v, out=v)
            add(v, 1, out=v)
            reciprocal(v, out=v)

        with np.errstate(over="ignore"):  # exp(-x) -> inf: the sigmoid's limit 0, exactly
            for t in ts:
                matmul(h, Rt, out=G)
                add(G, XW[t], out=G)
                if negP is None:
                    sigmoid(sig)
                else:
                    multiply(c, pi, out=T)
                    add(gi, T, out=gi)
                    sigmoid(gi)
                    if not couple:
                        multiply(c, pf, out=T)
                        add(gf, T, out=gf)
                        sigmoid(gf)
                tanh(gc, out=gc)
                if couple:
                    subtract(1, gi, out=gf)
                multiply(c, gf, out=cn)
                multiply(gc, gi, out=gc)
                add(cn, gc, out=cn)
                if negP is not None:
                    multiply(cn, po, out=T)
                    add(go, T, out=go)
                    sigmoid(go)
                tanh(cn, out=T)
                if masks is None:
                    y = Y[t]
                    multiply(T, go, out=y)
                    h = y
                else:
                    multiply(T, go, out=T)
                    copyto(Y[t], T, where=masks[t])
                    copyto(h, T, where=masks[t])
                    copyto(c, cn, where=masks[t])
        return (h, c)


@register("LSTM", versions=[1, 7])
class LSTM1(_LSTM):
    pass


@register("LSTM", versions=[14, 22])
class LSTM14(_LSTM):
    has_layout = True
