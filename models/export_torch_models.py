"""Export test models from PyTorch (when torch is installed; torch is never a runtime dependency).

    python models/export_torch_models.py [OUT_DIR] [--only NAME ...] [--full-size] [--raw]

Every architecture is written here in plain torch with seeded random weights, so nothing is
downloaded. Transformers and CNNs go through the dynamo exporter (opset 18); the recurrent model
through the classic TorchScript exporter (opset 17). Default sizes are small enough for tests;
`--full-size` builds ResNet-50 at 224x224 and BERT-base at sequence 128 for the benchmarks.
`--raw` turns the dynamo exporter's own graph optimiser off (`optimize=False`): the model keeps
its BatchNormalization layers and the exporter's shape plumbing, as an unsimplified model does
(the ONNX model zoo's ResNet-50 has its BatchNormalization layers too); it is written NAME_raw.
BatchNorm layers get seeded random statistics and affine parameters, as trained ones have: with
PyTorch's initial values (mean 0, variance 1, scale 1, shift 0) a folded BatchNorm would be
nearly the identity and a folding bug could go unnoticed.
Each model is written as NAME.onnx together with NAME.inputs.npz, the inputs to test it with.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import warnings

import numpy as np

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError:  # the tests skip when torch is absent
    torch = None
    nn = None

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           ".cache", "torch-models")

if nn is not None:

    # -- CNNs -----------------------------------------------------------------------------------
    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = F.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return F.relu(y + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        """ResNet-50 layout ([3, 4, 6, 3] bottlenecks); `base` scales the widths."""

        def __init__(self, layers=(3, 4, 6, 3), base: int = 64, classes: int = 1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], base
            for i, n in enumerate(layers):
                width = base * 2 ** i
                for j in range(n):
                    blocks.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                    cin = width * 4
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            mid = cin * expand
            self.use_res = stride == 1 and cin == cout
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                nn.Hardswish(),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.body(x)
            return x + y if self.use_res else y

    class MobileNet(nn.Module):
        """MobileNetV2/V3-style: depthwise-separable inverted residuals, ReLU6 and HardSwish."""

        def __init__(self, classes: int = 100):
            super().__init__()
            cfg = [(16, 24, 2, 4), (24, 24, 1, 4), (24, 40, 2, 4), (40, 40, 1, 6), (40, 80, 2, 6)]
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                      nn.Hardswish())
            self.blocks = nn.Sequential(*[InvertedResidual(*c) for c in cfg])
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                      nn.Linear(80, classes))

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)))

    # -- transformers ---------------------------------------------------------------------------
    class SelfAttention(nn.Module):
        def __init__(self, dim: int, heads: int):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.out = nn.Linear(dim, dim)

        def forward(self, x, bias=None):
            b, s, d = x.shape
            q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
            if bias is not None:
                scores = scores + bias
            ctx = scores.softmax(-1) @ v
            return self.out(ctx.transpose(1, 2).reshape(b, s, d))

    class EncoderLayer(nn.Module):
        def __init__(self, dim: int, heads: int, ff: int, pre_norm: bool, act: str = "gelu"):
            super().__init__()
            self.attn = SelfAttention(dim, heads)
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.ff = nn.Sequential(nn.Linear(dim, ff),
                                    nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none"),
                                    nn.Linear(ff, dim))
            self.pre_norm = pre_norm

        def forward(self, x, bias=None):
            if self.pre_norm:  # GPT-2 / ViT
                x = x + self.attn(self.ln1(x), bias)
                return x + self.ff(self.ln2(x))
            x = self.ln1(x + self.attn(x, bias))  # BERT
            return self.ln2(x + self.ff(x))

    class ViT(nn.Module):
        def __init__(self, image: int = 32, patch: int = 8, dim: int = 64, depth: int = 2,
                     heads: int = 4, classes: int = 10):
            super().__init__()
            self.patch = nn.Conv2d(3, dim, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
            self.layers = nn.ModuleList(EncoderLayer(dim, heads, 2 * dim, True) for _ in range(depth))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, classes)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x)[:, 0])

    class Bert(nn.Module):
        """BERT-style encoder: token + position + segment embeddings, padding mask, post-norm."""

        def __init__(self, vocab: int = 1000, dim: int = 64, depth: int = 2, heads: int = 4,
                     ff: int = 128, max_len: int = 64):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(max_len, dim)
            self.seg = nn.Embedding(2, dim)
            self.norm = nn.LayerNorm(dim)
            self.layers = nn.ModuleList(EncoderLayer(dim, heads, ff, False) for _ in range(depth))
            self.pool = nn.Linear(dim, dim)

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            positions = torch.arange(s, device=input_ids.device).unsqueeze(0)
            x = self.norm(self.tok(input_ids) + self.pos(positions)
                          + self.seg(torch.zeros_like(input_ids)))
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            return x, torch.tanh(self.pool(x[:, 0]))

    class GPT2(nn.Module):
        """GPT-2-style decoder: causal plus padding mask, pre-norm, tanh-GELU, tied LM head."""

        def __init__(self, vocab: int = 1000, dim: int = 64, depth: int = 2, heads: int = 4,
                     max_len: int = 64):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(max_len, dim)
            self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, True, "gelu_tanh")
                                        for _ in range(depth))
            self.norm = nn.LayerNorm(dim)

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            keep = causal[None, None] & attention_mask[:, None, None, :].bool()
            bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, -1e4)
            for layer in self.layers:
                x = layer(x, bias)
            return self.norm(x) @ self.tok.weight.T

    class Recurrent(nn.Module):
        """Bidirectional 2-layer LSTM followed by a GRU, as exported by the classic exporter."""

        def __init__(self, features: int = 16, hidden: int = 24):
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, num_layers=2, bidirectional=True, batch_first=True)
            self.gru = nn.GRU(2 * hidden, hidden, batch_first=True)
            self.head = nn.Linear(hidden, 4)

        def forward(self, x):
            y, _ = self.lstm(x)
            y, h = self.gru(y)
            return self.head(y[:, -1]), h


def _token_inputs(rng: np.random.Generator, batch: int, seq: int, vocab: int = 1000):
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq * 3 // 4:] = 0  # padding at the end of the first sequence
    return {"input_ids": ids, "attention_mask": mask}


def model_specs(full_size: bool = False) -> dict:
    """name -> (module factory, numpy inputs, output names, exporter)."""
    rng = np.random.default_rng(0)
    image = 224 if full_size else 64
    seq = 128 if full_size else 16
    bert_kw = dict(vocab=30522, dim=768, depth=12, heads=12, ff=3072, max_len=512) if full_size \
        else {}
    return {
        "resnet": (lambda: ResNet() if full_size else ResNet(layers=(1, 1, 1, 1), base=16, classes=10),
                   {"image": rng.standard_normal((1, 3, image, image)).astype(np.float32)},
                   ["logits"], "dynamo"),
        "mobilenet": (MobileNet, {"image": rng.standard_normal((1, 3, 64, 64)).astype(np.float32)},
                      ["logits"], "dynamo"),
        "vit": (ViT, {"image": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)},
                ["logits"], "dynamo"),
        "bert": (lambda: Bert(**bert_kw), _token_inputs(rng, 2, seq, 30522 if full_size else 1000),
                 ["hidden", "pooled"], "dynamo"),
        "gpt2": (GPT2, _token_inputs(rng, 2, 16), ["logits"], "dynamo"),
        "lstm_gru": (Recurrent, {"x": rng.standard_normal((2, 10, 16)).astype(np.float32)},
                     ["logits", "h"], "classic"),
    }


def randomize_batchnorm(module) -> None:
    """Seeded, trained-looking statistics and affine parameters for every BatchNorm layer."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.running_var.uniform_(0.5, 2.0)
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)


def export(name: str, out_dir: str, full_size: bool = False, raw: bool = False) -> str:
    factory, inputs, output_names, exporter = model_specs(full_size)[name]
    suffix = ("_full" if full_size else "") + ("_raw" if raw and exporter == "dynamo" else "")
    return export_module(factory, inputs, output_names, exporter, raw,
                         os.path.join(out_dir, f"{name}{suffix}.onnx"))


def export_module(factory, inputs: dict, output_names: list[str], exporter: str, raw: bool,
                  path: str) -> str:
    """Build `factory()` with seed 0, export it to `path` and its inputs next to it."""
    torch.manual_seed(0)
    module = factory().eval()
    randomize_batchnorm(module)
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(module, args, dynamo=True, opset_version=18,
                                        input_names=list(inputs), output_names=output_names,
                                        external_data=False, optimize=not raw)
            program.save(path, external_data=False)
        else:
            torch.onnx.export(module, args, path, dynamo=False, opset_version=17,
                              input_names=list(inputs), output_names=output_names)
    np.savez(path[:-len(".onnx")] + ".inputs.npz", **inputs)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="*", help="names to export (default: all)")
    parser.add_argument("--full-size", action="store_true")
    parser.add_argument("--raw", action="store_true",
                        help="dynamo models without the exporter's optimiser (NAME_raw)")
    args = parser.parse_args(argv)
    if torch is None:
        print("torch is not installed: pip install torch==2.13.0 onnxscript", file=sys.stderr)
        return 2
    for name in args.only or model_specs(args.full_size):
        print("wrote", export(name, args.out_dir, args.full_size, args.raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
