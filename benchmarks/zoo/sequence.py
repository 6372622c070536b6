"""The zoo's sequence models: audio front-ends and encoders, a T5 encoder, a Llama-style decoder
(prefill, one KV-cache decoding step, and that step with 4-bit weights) and a streaming voice
activity detector with an If on its sample rate.

Every architecture is written here in plain torch with seeded random weights, at the sizes its
label states, and exported as cpu_models.py exports: torch.onnx.export(dynamo=True) at opset 18
with a dynamic batch axis (example batch 2), the classic exporter where dynamo fails. The VAD
goes through the classic exporter by design: the model is scripted, so that the branch on its
sample rate input becomes an ONNX If, and the exporter writes its recurrent layer as an LSTM.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import warnings

import numpy as np

from . import ZooModel, quiet, written

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEL_BINS, MEL_FRAMES = 80, 1500
AUDIO_SAMPLES = 16000
T5_VOCAB, T5_DIM, T5_HEADS, T5_LAYERS, T5_FF, T5_SEQ = 8000, 512, 8, 4, 1024, 128
LLAMA_VOCAB, LLAMA_DIM, LLAMA_LAYERS, LLAMA_FF = 8000, 512, 4, 1408
LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_SEQ, LLAMA_PAST = 8, 2, 128, 128
LLAMA_HEAD = LLAMA_DIM // LLAMA_HEADS
VAD_CHUNK, VAD_HIDDEN = 512, 128


# -- export -------------------------------------------------------------------------------------

def _cpu_models():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import cpu_models

    return cpu_models


def _export(name: str, make_module, example: dict, outputs: list[str], out_dir: str,
            dynamic: dict | None = None) -> str:
    """Export make_module() (seeded) to out_dir/NAME.onnx: dynamo at opset 18, the batch axis
    and `dynamic` (input -> {axis: "past" or "total"}) dynamic; the classic exporter at opset 17
    where dynamo fails, with a warning that says why. Returns the path."""
    import torch

    cpu_models = _cpu_models()
    torch.manual_seed(0)
    module = make_module().eval()
    spec = cpu_models.ModelSpec(name, name, None, outputs, extra_dynamic=dynamic or {})
    args = tuple(torch.from_numpy(v) for v in example.values())
    names = list(example)
    failure = None
    with written(out_dir, name) as tmp, quiet(), torch.no_grad():
        try:
            cpu_models._export_dynamo(module, args, names, spec, tmp)
        except Exception as exc:  # noqa: BLE001 - fall back, and say why below
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
            axes = {n: {0: "batch", **spec.extra_dynamic.get(n, {})} for n in names}
            axes.update({n: {0: "batch"} for n in outputs})
            torch.onnx.export(module, args, tmp, dynamo=False, opset_version=17,
                              input_names=names, output_names=outputs, dynamic_axes=axes)
    if failure:
        warnings.warn(f"{name}: dynamo export failed ({failure}); used the classic exporter")
    return os.path.join(out_dir, f"{name}.onnx")


def _example(make_inputs) -> dict:
    return make_inputs(2, np.random.default_rng(0))


# -- shared torch layers ------------------------------------------------------------------------

def _layers():
    """(PreNormBlock, RMSNorm): Whisper's layer, and the norm of T5 and Llama."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class PreNormBlock(nn.Module):
        """A pre-LayerNorm transformer layer (Whisper's): self-attention, then a GELU MLP."""

        def __init__(self, dim: int, heads: int, ff: int):
            super().__init__()
            self.heads, self.head = heads, dim // heads
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.q, self.v, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.k = nn.Linear(dim, dim, bias=False)
            self.fc1, self.fc2 = nn.Linear(dim, ff), nn.Linear(ff, dim)

        def split(self, t):
            b, s, _ = t.shape
            return t.reshape(b, s, self.heads, self.head).transpose(1, 2)

        def forward(self, x):
            h = self.ln1(x)
            q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head)
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
            x = x + self.out(ctx)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class RMSNorm(nn.Module):
        """T5LayerNorm / LlamaRMSNorm: scale by the root mean square, no centring, no bias."""

        def __init__(self, dim: int, eps: float = 1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

        def forward(self, x):
            return x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt() * self.weight

    return PreNormBlock, RMSNorm


# -- whisper_enc --------------------------------------------------------------------------------

def _whisper_encoder():
    import torch
    from torch import nn
    from torch.nn import functional as F

    block, _ = _layers()

    class WhisperEncoder(nn.Module):
        """Whisper's audio encoder: two Conv1d+GELU (the second halves the frames), fixed
        sinusoidal positions, pre-LN layers, a final LayerNorm."""

        def __init__(self, dim=384, heads=6, depth=4):
            super().__init__()
            self.conv1 = nn.Conv1d(MEL_BINS, dim, 3, padding=1)
            self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
            frames = MEL_FRAMES // 2
            scales = torch.exp(-math.log(10000) / (dim // 2 - 1) * torch.arange(dim // 2))
            angles = torch.arange(frames)[:, None] * scales[None]
            self.register_buffer("positions", torch.cat([angles.sin(), angles.cos()], 1))
            self.layers = nn.ModuleList(block(dim, heads, 4 * dim) for _ in range(depth))
            self.norm = nn.LayerNorm(dim)

        def forward(self, input_features):
            x = F.gelu(self.conv2(F.gelu(self.conv1(input_features))))
            x = x.transpose(1, 2) + self.positions
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    return WhisperEncoder()


def _mel_inputs(batch: int, rng: np.random.Generator) -> dict:
    return {"input_features":
            rng.standard_normal((batch, MEL_BINS, MEL_FRAMES)).astype(np.float32)}


def _build_whisper(out_dir: str) -> str:
    return _export("whisper_enc", _whisper_encoder, _example(_mel_inputs),
                   ["last_hidden_state"], out_dir)


# -- wav2vec_fe ---------------------------------------------------------------------------------

def _wav2vec_feature_extractor():
    from torch import nn
    from torch.nn import functional as F

    class Wav2Vec2FeatureExtractor(nn.Module):
        """wav2vec 2.0's convolutional feature encoder (the "group" norm variant): seven
        bias-free Conv1d of 512 channels, GroupNorm (one group per channel) after the first,
        GELU after each; 20 ms frames from raw 16 kHz audio (normalised to unit variance)."""

        KERNELS = (10, 3, 3, 3, 3, 2, 2)
        STRIDES = (5, 2, 2, 2, 2, 2, 2)

        def __init__(self, dim=512):
            super().__init__()
            self.convs = nn.ModuleList(
                nn.Conv1d(1 if i == 0 else dim, dim, k, s, bias=False)
                for i, (k, s) in enumerate(zip(self.KERNELS, self.STRIDES)))
            for conv in self.convs:
                nn.init.kaiming_normal_(conv.weight)
            self.norm = nn.GroupNorm(dim, dim)
            nn.init.normal_(self.norm.weight, 1.0, 0.1)
            nn.init.normal_(self.norm.bias, 0.0, 0.1)

        def forward(self, input_values):
            x = input_values[:, None]
            for i, conv in enumerate(self.convs):
                x = conv(x)
                x = F.gelu(self.norm(x) if i == 0 else x)
            return x.transpose(1, 2)

    return Wav2Vec2FeatureExtractor()


def _audio_inputs(batch: int, rng: np.random.Generator) -> dict:
    return {"input_values": rng.standard_normal((batch, AUDIO_SAMPLES)).astype(np.float32)}


def _build_wav2vec(out_dir: str) -> str:
    return _export("wav2vec_fe", _wav2vec_feature_extractor, _example(_audio_inputs),
                   ["extract_features"], out_dir)


# -- t5_enc -------------------------------------------------------------------------------------

def _t5_encoder():
    import torch
    from torch import nn
    from torch.nn import functional as F

    _, rms_norm = _layers()

    def relative_bucket(relative, buckets=32, max_distance=128):
        """T5's bidirectional bucketing: exact buckets for short distances, logarithmic ones up
        to max_distance, half of them for keys after the query."""
        buckets //= 2
        bucket = (relative > 0).long() * buckets
        distance = relative.abs()
        exact = buckets // 2
        far = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                       * (buckets - exact)).long()
        far = torch.clamp(far, max=buckets - 1)
        return bucket + torch.where(distance < exact, distance, far)

    class T5Layer(nn.Module):
        """Self-attention (no score scaling, no biases) and a gated-GELU FFN (T5 v1.1), each
        behind an RMSNorm with a residual."""

        def __init__(self, dim=T5_DIM, heads=T5_HEADS, ff=T5_FF):
            super().__init__()
            self.heads, self.head = heads, dim // heads
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.wi_0, self.wi_1 = nn.Linear(dim, ff, bias=False), nn.Linear(dim, ff, bias=False)
            self.wo = nn.Linear(ff, dim, bias=False)
            self.ln1, self.ln2 = rms_norm(dim), rms_norm(dim)

        def split(self, t):
            b, s, _ = t.shape
            return t.reshape(b, s, self.heads, self.head).transpose(1, 2)

        def forward(self, x, bias):
            h = self.ln1(x)
            q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
            ctx = ((q @ k.transpose(-1, -2) + bias).softmax(-1) @ v).transpose(1, 2).flatten(2)
            x = x + self.o(ctx)
            h = self.ln2(x)
            return x + self.wo(F.gelu(self.wi_0(h), approximate="tanh") * self.wi_1(h))

    class T5Encoder(nn.Module):
        """T5's encoder: token embeddings, a relative position bias bucketed in the graph and
        shared by all layers, padding mask, final RMSNorm."""

        def __init__(self, depth=T5_LAYERS):
            super().__init__()
            self.embed = nn.Embedding(T5_VOCAB, T5_DIM)
            self.relative_bias = nn.Embedding(32, T5_HEADS)
            self.layers = nn.ModuleList(T5Layer() for _ in range(depth))
            self.norm = rms_norm(T5_DIM)

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            pos = torch.arange(s, device=input_ids.device)
            buckets = relative_bucket(pos[None, :] - pos[:, None])
            bias = self.relative_bias(buckets).permute(2, 0, 1)[None]
            bias = bias + (1.0 - attention_mask[:, None, None, :].float()) * -1e9
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x, bias)
            return self.norm(x)

    return T5Encoder()


def _t5_inputs(batch: int, rng: np.random.Generator) -> dict:
    ids = rng.integers(0, T5_VOCAB, size=(batch, T5_SEQ), dtype=np.int64)
    mask = np.ones((batch, T5_SEQ), np.int64)
    mask[0, T5_SEQ * 3 // 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _build_t5(out_dir: str) -> str:
    return _export("t5_enc", _t5_encoder, _example(_t5_inputs), ["last_hidden_state"], out_dir)


# -- llama_prefill, llama_decode, llama_decode_4bit ---------------------------------------------

def _llama(decode: bool):
    import torch
    from torch import nn
    from torch.nn import functional as F

    _, rms_norm = _layers()

    def rotate(x, cos, sin):
        first, second = x.chunk(2, -1)
        return x * cos + torch.cat([-second, first], -1) * sin

    class LlamaLayer(nn.Module):
        """RMSNorm, grouped-query attention with rotary positions and a KV cache, RMSNorm,
        SwiGLU MLP; no biases."""

        def __init__(self):
            super().__init__()
            kv = LLAMA_KV_HEADS * LLAMA_HEAD
            self.q = nn.Linear(LLAMA_DIM, LLAMA_DIM, bias=False)
            self.k = nn.Linear(LLAMA_DIM, kv, bias=False)
            self.v = nn.Linear(LLAMA_DIM, kv, bias=False)
            self.o = nn.Linear(LLAMA_DIM, LLAMA_DIM, bias=False)
            self.gate = nn.Linear(LLAMA_DIM, LLAMA_FF, bias=False)
            self.up = nn.Linear(LLAMA_DIM, LLAMA_FF, bias=False)
            self.down = nn.Linear(LLAMA_FF, LLAMA_DIM, bias=False)
            self.attn_norm, self.mlp_norm = rms_norm(LLAMA_DIM), rms_norm(LLAMA_DIM)

        def forward(self, x, cos, sin, bias, past_k=None, past_v=None):
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q = self.q(h).reshape(b, s, LLAMA_HEADS, LLAMA_HEAD).transpose(1, 2)
            k = self.k(h).reshape(b, s, LLAMA_KV_HEADS, LLAMA_HEAD).transpose(1, 2)
            v = self.v(h).reshape(b, s, LLAMA_KV_HEADS, LLAMA_HEAD).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            if past_k is not None:
                k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
            present = (k, v)
            t, group = k.shape[2], LLAMA_HEADS // LLAMA_KV_HEADS
            k = k[:, :, None].expand(b, LLAMA_KV_HEADS, group, t, LLAMA_HEAD)
            v = v[:, :, None].expand(b, LLAMA_KV_HEADS, group, t, LLAMA_HEAD)
            k = k.reshape(b, LLAMA_HEADS, t, LLAMA_HEAD)
            v = v.reshape(b, LLAMA_HEADS, t, LLAMA_HEAD)
            scores = q @ k.transpose(-1, -2) / math.sqrt(LLAMA_HEAD) + bias
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, LLAMA_DIM)
            x = x + self.o(ctx)
            h = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h)), present

    class Llama(nn.Module):
        """Embeddings, LLAMA_LAYERS layers, final RMSNorm, an untied LM head; returns the logits
        and every layer's present key and value (batch, kv heads, total, head)."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(LLAMA_VOCAB, LLAMA_DIM)
            self.layers = nn.ModuleList(LlamaLayer() for _ in range(LLAMA_LAYERS))
            self.norm = rms_norm(LLAMA_DIM)
            self.lm_head = nn.Linear(LLAMA_DIM, LLAMA_VOCAB, bias=False)
            self.register_buffer(
                "inv_freq", 10000.0 ** (-torch.arange(0, LLAMA_HEAD, 2).float() / LLAMA_HEAD))

        def decoder(self, input_ids, bias, start, past):
            pos = torch.arange(input_ids.shape[1], device=input_ids.device) + start
            angles = pos.float()[:, None] * self.inv_freq[None]
            angles = torch.cat([angles, angles], -1)
            cos, sin = angles.cos(), angles.sin()
            x, presents = self.embed(input_ids), []
            for i, layer in enumerate(self.layers):
                x, present = layer(x, cos, sin, bias, *past[2 * i:2 * i + 2])
                presents += present
            return (self.lm_head(self.norm(x)), *presents)

    class LlamaPrefill(Llama):
        """The prompt: causal attention within it, padded positions masked."""

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            keep = causal[None, None] & attention_mask[:, None, None, :].bool()
            bias = torch.zeros(keep.shape).masked_fill(~keep, -1e4)
            return self.decoder(input_ids, bias, 0, ())

    class LlamaDecode(Llama):
        """One step: the new token attends to the cache and itself; the mask covers both."""

        def forward(self, input_ids, attention_mask, *past):
            bias = (1.0 - attention_mask[:, None, None, :].float()) * -1e4
            return self.decoder(input_ids, bias, past[0].shape[2], past)

    return LlamaDecode() if decode else LlamaPrefill()


_KV_NAMES = [f"{kind}_{i}" for i in range(LLAMA_LAYERS) for kind in ("key", "value")]
_LLAMA_OUTPUTS = ["logits"] + [f"present_{n}" for n in _KV_NAMES]


def _prefill_inputs(batch: int, rng: np.random.Generator) -> dict:
    ids = rng.integers(0, LLAMA_VOCAB, size=(batch, LLAMA_SEQ), dtype=np.int64)
    mask = np.ones((batch, LLAMA_SEQ), np.int64)
    mask[0, LLAMA_SEQ * 3 // 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _decode_inputs(batch: int, rng: np.random.Generator) -> dict:
    mask = np.ones((batch, LLAMA_PAST + 1), np.int64)
    mask[0, :LLAMA_PAST // 4] = 0  # a left-padded prompt in the batch
    feeds = {"input_ids": rng.integers(0, LLAMA_VOCAB, size=(batch, 1), dtype=np.int64),
             "attention_mask": mask}
    shape = (batch, LLAMA_KV_HEADS, LLAMA_PAST, LLAMA_HEAD)
    for name in _KV_NAMES:
        feeds[f"past_{name}"] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _build_prefill(out_dir: str) -> str:
    return _export("llama_prefill", lambda: _llama(False), _example(_prefill_inputs),
                   _LLAMA_OUTPUTS, out_dir)


def _export_decode(name: str, out_dir: str) -> str:
    dynamic = {"attention_mask": {1: "total"}, **{f"past_{n}": {2: "past"} for n in _KV_NAMES}}
    return _export(name, lambda: _llama(True), _example(_decode_inputs), _LLAMA_OUTPUTS,
                   out_dir, dynamic)


def _build_decode(out_dir: str) -> str:
    return _export_decode("llama_decode", out_dir)


def _build_decode_4bit(out_dir: str) -> str:
    """The decoding step's float model, its MatMuls (the projections and the LM head) then
    quantised to 4 bits by onnxruntime: symmetric, blocks of 32."""
    import onnx

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers  # importing it configured the root logger at INFO
    root.setLevel(level)

    with tempfile.TemporaryDirectory() as scratch:
        model = onnx.load(_export_decode("llama_decode_4bit", scratch))
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True,
                                     op_types_to_quantize=("MatMul",))
    with written(out_dir, "llama_decode_4bit") as tmp, quiet():
        quantizer.process()
        quantizer.model.save_model_to_file(tmp)
    return os.path.join(out_dir, "llama_decode_4bit.onnx")


# -- vad_stream ---------------------------------------------------------------------------------

def _vad():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class FrontEnd(nn.Module):
        """A fixed Fourier basis as a strided Conv1d (an STFT), magnitudes, then a small conv
        encoder pooled to one VAD_HIDDEN-wide vector per chunk."""

        def __init__(self, window: int, hop: int):
            super().__init__()
            self.bins, self.pad = window // 2 + 1, window // 4
            t = torch.arange(window).float()
            f = torch.arange(self.bins).float()[:, None]
            hann = 0.5 - 0.5 * torch.cos(2 * math.pi * t / window)
            basis = torch.cat([torch.cos(2 * math.pi * f * t / window),
                               -torch.sin(2 * math.pi * f * t / window)]) * hann
            self.stft = nn.Conv1d(1, 2 * self.bins, window, hop, bias=False)
            self.stft.weight.data.copy_(basis[:, None])
            self.stft.weight.requires_grad_(False)
            self.encoder = nn.Sequential(
                nn.Conv1d(self.bins, 128, 3, padding=1), nn.ReLU(),
                nn.Conv1d(128, 64, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv1d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv1d(64, VAD_HIDDEN, 3, padding=1), nn.ReLU())

        def forward(self, x):
            spec = self.stft(F.pad(x[:, None], (0, self.pad), mode="reflect"))
            re, im = spec[:, :self.bins], spec[:, self.bins:]
            return self.encoder(torch.sqrt(re * re + im * im)).mean(-1)

    class SampleRateSwitch(nn.Module):
        """The 16 kHz front-end or the 8 kHz one, by the sample rate fed (an ONNX If)."""

        def __init__(self):
            super().__init__()
            self.at_16k, self.at_8k = FrontEnd(256, 128), FrontEnd(128, 64)

        def forward(self, x, sr):
            if bool(sr == 16000):
                return self.at_16k(x)
            return self.at_8k(x)

    class StreamingVAD(nn.Module):
        """Silero-VAD-like: the chosen front-end, a one-step LSTM carrying (h, c) between
        chunks, a sigmoid speech probability."""

        def __init__(self):
            super().__init__()
            self.frontend = SampleRateSwitch()
            self.lstm = nn.LSTM(VAD_HIDDEN, VAD_HIDDEN)
            self.head = nn.Linear(VAD_HIDDEN, 1)

        def forward(self, chunk, h, c, sr):
            y, (h, c) = self.lstm(self.frontend(chunk, sr)[None], (h, c))
            return torch.sigmoid(self.head(F.relu(y[0]))), h, c

    return torch.jit.script(StreamingVAD())


def _vad_inputs(batch: int, rng: np.random.Generator) -> dict:
    state = (1, batch, VAD_HIDDEN)
    return {"input": (0.1 * rng.standard_normal((batch, VAD_CHUNK))).astype(np.float32),
            "h": (0.5 * rng.standard_normal(state)).astype(np.float32),
            "c": (0.5 * rng.standard_normal(state)).astype(np.float32),
            "sr": np.array(16000, np.int64)}


def _build_vad(out_dir: str) -> str:
    import torch

    torch.manual_seed(0)
    module = _vad().eval()
    example = _example(_vad_inputs)
    args = tuple(torch.from_numpy(v) for v in example.values())
    names, outputs = list(example), ["prob", "hn", "cn"]
    axes = {"input": {0: "batch"}, "h": {1: "batch"}, "c": {1: "batch"}, "prob": {0: "batch"},
            "hn": {1: "batch"}, "cn": {1: "batch"}}
    with written(out_dir, "vad_stream") as tmp, quiet(), torch.no_grad():
        torch.onnx.export(module, args, tmp, dynamo=False, opset_version=17, input_names=names,
                          output_names=outputs, dynamic_axes=axes)
    return os.path.join(out_dir, "vad_stream.onnx")


# -- the family ---------------------------------------------------------------------------------

DYNAMO = "torch.onnx dynamo"

MODELS: list[ZooModel] = [
    ZooModel("whisper_enc", "audio", DYNAMO,
             f"Whisper-style encoder: 2 Conv1d+GELU over {MEL_BINS} mel x {MEL_FRAMES} frames, "
             "4 pre-LN layers, 384 wide, 6 heads", _build_whisper, _mel_inputs),
    ZooModel("wav2vec_fe", "audio", DYNAMO,
             "wav2vec2 feature encoder: 7 Conv1d (512 ch, GroupNorm, GELU) over 1 s of 16 kHz",
             _build_wav2vec, _audio_inputs),
    ZooModel("t5_enc", "transformer", DYNAMO,
             f"T5-style encoder: RMSNorm, in-graph bucketed relative bias, gated GELU, "
             f"{T5_LAYERS} layers, {T5_DIM} wide, {T5_HEADS} heads, vocab {T5_VOCAB}, "
             f"{T5_SEQ} tokens", _build_t5, _t5_inputs),
    ZooModel("llama_prefill", "decoder", DYNAMO,
             f"Llama-style prefill: {LLAMA_LAYERS} layers, {LLAMA_DIM} wide, GQA "
             f"{LLAMA_HEADS}/{LLAMA_KV_HEADS} heads, RoPE, SwiGLU {LLAMA_FF}, vocab "
             f"{LLAMA_VOCAB}, {LLAMA_SEQ} tokens", _build_prefill, _prefill_inputs),
    ZooModel("llama_decode", "decoder", DYNAMO,
             f"that Llama, one decoding step, KV cache of past {LLAMA_PAST} (dynamic)",
             _build_decode, _decode_inputs),
    ZooModel("llama_decode_4bit", "decoder", "ort MatMulNBitsQuantizer",
             f"that decoding step, MatMuls as 4-bit MatMulNBits (symmetric, block 32), "
             f"past {LLAMA_PAST}", _build_decode_4bit, _decode_inputs),
    ZooModel("vad_stream", "control-flow", "torch.onnx classic (scripted: the If)",
             f"Silero-VAD-like stream step: {VAD_CHUNK}-sample chunk, If on the sample rate "
             f"between two STFT conv front-ends, LSTM h{VAD_HIDDEN}, sigmoid",
             _build_vad, _vad_inputs, batches=(1,)),
]
