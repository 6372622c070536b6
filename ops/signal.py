"""Signal-processing ops: DFT, STFT, the Blackman / Hamming / Hann windows, MelWeightMatrix.

Complex values travel as real tensors with a trailing dimension of 2 (real, imaginary); a real
signal has a trailing dimension of 1. Transforms are computed with xp.fft (numpy's, or cupy's on
CUDA) in float32 (float64 for double inputs) and cast back to the input's dtype. Sizes, lengths,
steps and axes are shape inputs (host arrays, read by `_scalar_int` / `_scalar_float`).
"""
from __future__ import annotations

import numpy as np

from ember import limits
from ember.ops.registry import OpImpl, register

_FLOAT_OUT = ("float16", "float32", "float64", "bfloat16")
_NUMERIC_OUT = _FLOAT_OUT + ("uint8", "uint16", "uint32", "uint64",
                             "int8", "int16", "int32", "int64")


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _scalar_int(op: OpImpl, value, name: str) -> int:
    arr = np.asarray(value)
    if arr.size != 1:
        raise op.fail(f"{name} must be a scalar, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise op.fail(f"{name} must be an integer, got {arr.dtype}")
    return int(arr.reshape(()))


def _scalar_float(op: OpImpl, value, name: str) -> float:
    arr = np.asarray(value)
    if arr.size != 1:
        raise op.fail(f"{name} must be a scalar, got shape {arr.shape}")
    return float(arr.reshape(()).astype(np.float64))


def _output_dtype(op: OpImpl, allowed) -> np.dtype:
    from ember.importer.onnx_values import onnx_to_np_dtype  # dtype table only

    try:
        dt = onnx_to_np_dtype(int(op.output_datatype))
    except Exception:
        dt = None
    if dt is None or dt.name not in allowed:
        raise op.fail(f"unsupported output_datatype {op.output_datatype}")
    return dt


def _as_complex(xp, op: OpImpl, x, name: str):
    """[..., 1] real or [..., 2] complex tensor -> (array without the last dim, is_complex)."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise op.fail(f"{name} must end in a dimension of 1 (real) or 2 (complex), "
                      f"got shape {x.shape}")
    cdt = _compute_dtype(x.dtype)
    xc = xp.asarray(x, dtype=cdt)
    if x.shape[-1] == 1:
        return xc[..., 0], False
    return xc[..., 0] + 1j * xc[..., 1], True


def _pack(xp, y, dtype: np.dtype):
    """Complex array -> [..., 2] real tensor of `dtype`."""
    return xp.stack((y.real, y.imag), axis=-1).astype(dtype)


# ---------------------------------------------------------------- DFT
class _DFT(OpImpl):
    def setup(self):
        if self.onesided not in (0, 1):
            raise self.fail(f"onesided must be 0 or 1, got {self.onesided}")
        if self.inverse not in (0, 1):
            raise self.fail(f"inverse must be 0 or 1, got {self.inverse}")

    def _dft(self, x, dft_length, axis):
        xp = self.xp
        r = x.ndim
        if r < 2:
            raise self.fail(f"input must have rank >= 2, got shape {x.shape}")
        a = axis + r if axis < 0 else axis
        if not 0 <= a <= r - 2:
            raise self.fail(f"axis {axis} out of range for input of rank {r} (the last "
                            "dimension holds real/imaginary parts)")
        sig, is_complex = _as_complex(xp, self, x, "input")
        if self.onesided and self.inverse and not is_complex:
            raise self.fail("an inverse one-sided DFT (IRFFT) needs complex input (last dim 2)")
        if self.onesided and not self.inverse and is_complex:
            raise self.fail("a forward one-sided DFT (RFFT) needs real input (last dim 1)")
        n = None
        if dft_length is not None:
            n = _scalar_int(self, dft_length, "dft_length")
            if n <= 0:
                raise self.fail(f"dft_length must be positive, got {n}")
            limits.check_shape(sig.shape[:a] + (n,) + sig.shape[a + 1:], np.complex128)
        if self.inverse and self.onesided:           # IRFFT: one-sided spectrum -> real signal
            if n is None:
                n = 2 * (sig.shape[a] - 1)
                if n <= 0:
                    raise self.fail("IRFFT needs at least 2 frequency bins to infer dft_length")
            y = xp.fft.irfft(sig, n=n, axis=a)
            return y[..., None].astype(x.dtype)
        if self.inverse:
            y = xp.fft.ifft(sig, n=n, axis=a)
        elif self.onesided:
            y = xp.fft.rfft(sig, n=n, axis=a)
        else:
            y = xp.fft.fft(sig, n=n, axis=a)
        return _pack(xp, y, x.dtype)


@register("DFT", versions=[17])
class DFT17(_DFT):
    """The axis is an attribute (default 1)."""

    shape_inputs = (1,)  # dft_length

    def run(self, x, dft_length=None):
        return self._dft(x, dft_length, int(self.axis))


@register("DFT", versions=[20])
class DFT20(_DFT):
    """The axis is an optional scalar input (default -2)."""

    shape_inputs = (1, 2)  # dft_length, axis

    def run(self, x, dft_length=None, axis=None):
        a = -2 if axis is None else _scalar_int(self, axis, "axis")
        return self._dft(x, dft_length, a)


# ---------------------------------------------------------------- STFT
@register("STFT", versions=[17])
class STFT17(OpImpl):
    shape_inputs = (1, 3)  # frame_step, frame_length

    def setup(self):
        if self.onesided not in (0, 1):
            raise self.fail(f"onesided must be 0 or 1, got {self.onesided}")

    def run(self, signal, frame_step, window=None, frame_length=None):
        xp = self.xp
        if signal.ndim != 3:
            raise self.fail(f"signal must have rank 3 [batch, length, 1|2], got {signal.shape}")
        sig, is_complex = _as_complex(xp, self, signal, "signal")  # [batch, length]
        length = sig.shape[1]
        step = _scalar_int(self, frame_step, "frame_step")
        if step <= 0:
            raise self.fail(f"frame_step must be positive, got {step}")
        if window is not None and window.ndim != 1:
            raise self.fail(f"window must be 1-D, got shape {window.shape}")
        if frame_length is not None:
            fl = _scalar_int(self, frame_length, "frame_length")
            if window is not None and window.shape[0] != fl:
                raise self.fail(f"window length {window.shape[0]} differs from frame_length {fl}")
        elif window is not None:
            fl = window.shape[0]
        else:
            fl = length
        if fl <= 0 or fl > length:
            raise self.fail(f"frame_length {fl} must lie in [1, signal length {length}]")
        n_frames = (length - fl) // step + 1
        # frames overlap: [batch, frames, fl] can be far larger than the signal
        limits.check_shape((sig.shape[0], n_frames, fl), np.complex128, "frames")
        idx = xp.arange(n_frames)[:, None] * step + xp.arange(fl)[None, :]
        frames = sig[:, idx]                                          # [batch, frames, fl]
        if window is not None:
            frames = frames * xp.asarray(window, dtype=_compute_dtype(signal.dtype))
        if self.onesided and not is_complex:
            y = xp.fft.rfft(frames, axis=-1)
        else:
            y = xp.fft.fft(frames, axis=-1)
            if self.onesided:  # the spec says impossible for complex input; keep the first half
                y = y[..., :fl // 2 + 1]                # as onnxruntime does
        return _pack(xp, y, signal.dtype)


# ---------------------------------------------------------------- windows
class _Window(OpImpl):
    # Cosine-sum coefficients: w[n] = sum_k a_k cos(2 pi k n / N)
    coefficients: tuple[float, ...] = ()
    shape_inputs = (0,)  # size

    def setup(self):
        if self.periodic not in (0, 1):
            raise self.fail(f"periodic must be 0 or 1, got {self.periodic}")
        self.out_dtype = _output_dtype(self, _NUMERIC_OUT)

    def run(self, size):
        xp = self.xp
        n = _scalar_int(self, size, "size")
        if n < 0:
            raise self.fail(f"size must be non-negative, got {n}")
        limits.check_shape((n,), np.float64)
        denom = n if self.periodic else n - 1
        if denom <= 0:  # a symmetric window of one point: [1], as numpy / scipy (not 0/0)
            return xp.ones(n, dtype=self.out_dtype)
        phase = xp.arange(n, dtype=np.float64) * (2.0 * np.pi / denom)
        w = xp.zeros(n, dtype=np.float64)
        for j, a in enumerate(self.coefficients):
            w += a * xp.cos(j * phase)
        if self.out_dtype.kind in "iu":
            # Values lie in [0, 1] and truncate; a peak of exactly 1 must not become 0 through
            # rounding noise (onnxruntime gives 1 there too).
            w = xp.floor(w + 1e-9)
        return w.astype(self.out_dtype)


@register("HannWindow", versions=[17])
class HannWindow17(_Window):
    coefficients = (0.5, -0.5)


@register("HammingWindow", versions=[17])
class HammingWindow17(_Window):
    coefficients = (25.0 / 46.0, -21.0 / 46.0)


@register("BlackmanWindow", versions=[17])
class BlackmanWindow17(_Window):
    coefficients = (0.42, -0.5, 0.08)


# ---------------------------------------------------------------- MelWeightMatrix
@register("MelWeightMatrix", versions=[17])
class MelWeightMatrix17(OpImpl):
    """Triangular filters (peak 1) on the mel scale mel(f) = 2595 log10(1 + f/700).

    The band edges follow the ONNX definition (and onnxruntime): num_mel_bins + 2 points spaced
    by (mel(upper) - mel(lower)) / (num_mel_bins + 2), mapped to spectrogram bins as
    floor((dft_length + 1) * f / sample_rate).
    """

    shape_inputs = (0, 1, 2, 3, 4)  # every input is a scalar read on the host

    def setup(self):
        self.out_dtype = _output_dtype(self, _NUMERIC_OUT)

    def run(self, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):
        xp = self.xp
        n_mel = _scalar_int(self, num_mel_bins, "num_mel_bins")
        n_fft = _scalar_int(self, dft_length, "dft_length")
        rate = _scalar_int(self, sample_rate, "sample_rate")
        low = _scalar_float(self, lower_edge_hertz, "lower_edge_hertz")
        high = _scalar_float(self, upper_edge_hertz, "upper_edge_hertz")
        if n_mel <= 0 or n_fft <= 0 or rate <= 0:
            raise self.fail("num_mel_bins, dft_length and sample_rate must be positive")
        if not 0 <= low < high:
            raise self.fail(f"need 0 <= lower_edge_hertz < upper_edge_hertz, got {low}, {high}")
        n_spec = n_fft // 2 + 1
        limits.check_shape((n_spec, n_mel), np.float64)
        low_mel = 2595.0 * np.log10(1.0 + low / 700.0)
        high_mel = 2595.0 * np.log10(1.0 + high / 700.0)
        step = (high_mel - low_mel) / (n_mel + 2)
        mel = np.arange(n_mel + 2, dtype=np.float64) * step + low_mel
        hz = 700.0 * (np.power(10.0, mel / 2595.0) - 1.0)
        edges = np.floor((n_fft + 1) * hz / rate).astype(np.int64)
        if edges[0] < 0 or edges[-1] >= n_spec:
            raise self.fail(f"upper_edge_hertz {high} puts a mel filter past the last of the "
                            f"{n_spec} spectrogram bins (dft_length {n_fft}, sample_rate {rate})")
        edges = xp.asarray(edges)  # the band edges (host, checked above) meet xp's arrays
        left, center, right = edges[:-2], edges[1:-1], edges[2:]       # one per mel bin
        j = xp.arange(n_spec, dtype=np.int64)[:, None]
        rise_den = xp.maximum(center - left, 1)
        rise = xp.where((j >= left) & (j <= center),
                        xp.where(center > left, (j - left) / rise_den, 1.0), 0.0)
        fall_den = xp.maximum(right - center, 1)
        fall_mask = (j >= center) & (j < right)
        w = xp.where(fall_mask, (right - j) / fall_den, rise)
        return w.astype(self.out_dtype)
