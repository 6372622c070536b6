"""The model zoo of benchmarks/bench_cpu.py: real-size architectures written here in plain torch.

    python benchmarks/cpu_models.py [NAME ...] [--out DIR]     # export (default: all) and print

Nothing is downloaded: transformers and torchvision are not used; every architecture is written
here at its published size, with seeded random weights (BatchNorm layers get trained-looking
statistics, as in models/export_torch_models.py). Each model is exported once with a dynamic
batch axis (the example batch is 2, so that torch.export does not specialise it to 1) and run
at any batch; the benchmark makes its inputs with `make_inputs(name, batch)`, which needs only
numpy. Exports go through torch.onnx.export(dynamo=True) at opset 18, as
models/export_torch_models.py does, with the classic TorchScript exporter (dynamo=False, opset
17) where dynamo fails and for the recurrent model (which the classic exporter writes as ONNX
LSTM and GRU nodes, as recurrent models in the wild are). Which exporter wrote a model, and why,
is stored next to it in NAME.meta.json together with a digest of this file, so that a changed
architecture is exported again.

| name        | model                                                        | inputs         |
|-------------|--------------------------------------------------------------|----------------|
| resnet50    | ResNet-50 v1.5 ([3,4,6,3] bottlenecks, 25.6 M parameters)    | image 224x224  |
| mobilenetv2 | MobileNetV2 (width 1.0, ReLU6, 3.5 M parameters)             | image 224x224  |
| convnext_t  | ConvNeXt-T ([3,3,9,3] blocks, 96..768 wide, 7x7 dw, 28.6 M)  | image 224x224  |
| vit_s16     | ViT-S/16 (12 layers, 384 wide, 6 heads, 22 M parameters)     | image 224x224  |
| bert_base   | BERT-base (12 layers, 768 wide, 12 heads, vocab 30522, 110M) | 128 tokens     |
| bert_small  | BERT-small (4 layers, 512 wide, 8 heads)                     | 128 tokens     |
| distilbert  | DistilBERT-style, 3 layers as issue 12 asks (768, 12 heads)  | 128 tokens     |
| gpt2        | GPT-2, 4 layers (768 wide, 12 heads, vocab 50257, tied head) | 128 tokens     |
| lstm_gru    | 2-layer LSTM then a GRU, hidden 256, 128 features in         | 64 steps       |
| unet        | a small UNet (32..256 channels, 3 poolings, ConvTranspose)   | image 128x128  |
| gpt2_decode | that GPT-2, one KV-cache decoding step, past length 128      | 1 token + past |
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@dataclass
class ModelSpec:
    name: str
    label: str  # as the report prints it
    inputs: Callable[[int, np.random.Generator], dict]  # batch, rng -> {name: array}
    outputs: list[str]
    exporter: str = "dynamo"  # the one tried first
    exporter_note: str = ""  # why it is not dynamo
    tokens_per_item: int = 0  # a decoding step: tokens per batch item per run (for tokens/s)
    # dynamic axes besides the batch: input name -> {axis: dim name}
    extra_dynamic: dict = field(default_factory=dict)


VOCAB_BERT = 30522
VOCAB_GPT2 = 50257
SEQ = 128
PAST = 128
GPT2_LAYERS, GPT2_DIM, GPT2_HEADS = 4, 768, 12


def _image(size: int) -> Callable:
    return lambda batch, rng: {
        "image": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


def _tokens(vocab: int, token_types: bool) -> Callable:
    def make(batch: int, rng: np.random.Generator) -> dict:
        ids = rng.integers(0, vocab, size=(batch, SEQ), dtype=np.int64)
        mask = np.ones((batch, SEQ), np.int64)
        mask[0, SEQ * 3 // 4:] = 0  # padding at the end of the first sequence
        feeds = {"input_ids": ids, "attention_mask": mask}
        if token_types:
            types = np.zeros((batch, SEQ), np.int64)
            types[:, SEQ // 2:] = 1  # a sentence pair
            feeds["token_type_ids"] = types
        return feeds
    return make


def _decode_inputs(batch: int, rng: np.random.Generator) -> dict:
    head = GPT2_DIM // GPT2_HEADS
    feeds = {"input_ids": rng.integers(0, VOCAB_GPT2, size=(batch, 1), dtype=np.int64),
             "attention_mask": np.ones((batch, PAST + 1), np.int64)}
    for i in range(GPT2_LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = \
                rng.standard_normal((batch, GPT2_HEADS, PAST, head)).astype(np.float32)
    return feeds


def _recurrent_inputs(batch: int, rng: np.random.Generator) -> dict:
    return {"x": rng.standard_normal((batch, 64, 128)).astype(np.float32)}


SPECS: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec("resnet50", "ResNet-50 224²", _image(224), ["logits"]),
    ModelSpec("mobilenetv2", "MobileNetV2 224²", _image(224), ["logits"]),
    ModelSpec("convnext_t", "ConvNeXt-T 224²", _image(224), ["logits"]),
    ModelSpec("vit_s16", "ViT-S/16 224²", _image(224), ["logits"]),
    ModelSpec("bert_base", "BERT-base s128", _tokens(VOCAB_BERT, True),
              ["last_hidden_state", "pooler_output"]),
    ModelSpec("bert_small", "BERT-small s128", _tokens(VOCAB_BERT, True),
              ["last_hidden_state", "pooler_output"]),
    ModelSpec("distilbert", "DistilBERT-3L s128", _tokens(VOCAB_BERT, False),
              ["last_hidden_state"]),
    ModelSpec("gpt2", "GPT-2 4L s128", _tokens(VOCAB_GPT2, False), ["logits"]),
    ModelSpec("lstm_gru", "LSTM+GRU h256 s64", _recurrent_inputs, ["y", "h"], exporter="classic",
              exporter_note="the classic exporter, for ONNX LSTM/GRU nodes"),
    ModelSpec("unet", "UNet 128²", _image(128), ["logits"]),
    ModelSpec("gpt2_decode", "GPT-2 4L decode p128",
              _decode_inputs, ["logits"] + [f"present_{k}_{i}" for i in range(GPT2_LAYERS)
                                            for k in ("key", "value")],
              tokens_per_item=1,
              extra_dynamic={"attention_mask": {1: "total"},
                             **{f"past_{k}_{i}": {2: "past"} for i in range(GPT2_LAYERS)
                                for k in ("key", "value")}}),
]}
DEFAULT_MODELS = [n for n in SPECS]


def make_inputs(name: str, batch: int) -> dict:
    """The benchmark's inputs for `name` at `batch` (seeded, numpy only)."""
    return SPECS[name].inputs(batch, np.random.default_rng(1234 + batch))


def source_digest() -> str:
    """A digest of what decides an export: the architectures, the export code and the models'
    sizes, outputs, exporters and dynamic axes (not labels, notes or docs)."""
    import inspect

    parts = [inspect.getsource(f) for f in (_modules, export, _export_dynamo)]
    with open(SHARED_MODELS) as f:  # read, not imported: the parent never imports torch
        parts.append(f.read())
    parts.append(repr([VOCAB_BERT, VOCAB_GPT2, SEQ, PAST, GPT2_LAYERS, GPT2_DIM, GPT2_HEADS]))
    parts += [repr((s.name, s.outputs, s.exporter, s.extra_dynamic)) for s in SPECS.values()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


# -- the architectures (torch is imported only here: the benchmark's parent never needs it) ----

# The test models' exporter: its Bottleneck and randomize_batchnorm serve here too.
SHARED_MODELS = os.path.join(REPO, "models", "export_torch_models.py")


def _shared_models():
    if os.path.dirname(SHARED_MODELS) not in sys.path:
        sys.path.insert(0, os.path.dirname(SHARED_MODELS))
    import export_torch_models

    return export_torch_models


def _modules() -> dict[str, Callable]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    etm = _shared_models()

    # ---- CNNs ----
    class ResNet50(nn.Module):
        def __init__(self, layers=(3, 4, 6, 3), classes: int = 1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for i, n in enumerate(layers):
                width = 64 * 2 ** i
                for j in range(n):
                    blocks.append(etm.Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                    cin = width * 4
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def conv_bn(cin, cout, k, stride=1, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            mid = cin * expand
            layers = [conv_bn(cin, mid, 1)] if expand != 1 else []
            layers += [conv_bn(mid, mid, 3, stride, groups=mid), conv_bn(mid, cout, 1, act=False)]
            self.body = nn.Sequential(*layers)
            self.use_res = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.use_res else self.body(x)

    class MobileNetV2(nn.Module):
        # (expansion t, channels c, repeats n, first stride s), as in the paper
        CFG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
               (6, 160, 3, 2), (6, 320, 1, 1)]

        def __init__(self, classes: int = 1000):
            super().__init__()
            layers, cin = [conv_bn(3, 32, 3, 2)], 32
            for t, c, n, s in self.CFG:
                for i in range(n):
                    layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers.append(conv_bn(cin, 1280, 1))
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    class LayerNorm2d(nn.LayerNorm):
        """LayerNorm over the channels of an NCHW tensor (as torchvision's ConvNeXt does it)."""

        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class ConvNeXtBlock(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = nn.LayerNorm(dim, eps=1e-6)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            # layer scale: trained values, not the 1e-6 it starts from
            self.gamma = nn.Parameter(torch.empty(dim).uniform_(0.05, 0.5))

        def forward(self, x):
            y = self.norm(self.dw(x).permute(0, 2, 3, 1))
            y = self.fc2(F.gelu(self.fc1(y)))
            return x + (self.gamma * y).permute(0, 3, 1, 2)

    class ConvNeXtT(nn.Module):
        def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), classes: int = 1000):
            super().__init__()
            stages = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))]
            for i, (depth, dim) in enumerate(zip(depths, dims)):
                if i:
                    stages.append(nn.Sequential(LayerNorm2d(dims[i - 1], eps=1e-6),
                                                nn.Conv2d(dims[i - 1], dim, 2, 2)))
                stages.append(nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)]))
            self.features = nn.Sequential(*stages)
            self.norm = LayerNorm2d(dims[-1], eps=1e-6)
            self.head = nn.Linear(dims[-1], classes)

        def forward(self, x):
            x = self.norm(F.adaptive_avg_pool2d(self.features(x), 1))
            return self.head(torch.flatten(x, 1))

    class DoubleConv(nn.Sequential):
        def __init__(self, cin: int, cout: int):
            super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self, widths=(32, 64, 128, 256), classes: int = 4):
            super().__init__()
            self.down = nn.ModuleList()
            cin = 3
            for w in widths:
                self.down.append(DoubleConv(cin, w))
                cin = w
            self.up = nn.ModuleList(nn.ConvTranspose2d(w, w // 2, 2, 2) for w in widths[:0:-1])
            self.dec = nn.ModuleList(DoubleConv(w, w // 2) for w in widths[:0:-1])
            self.out = nn.Conv2d(widths[0], classes, 1)

        def forward(self, x):
            skips = []
            for i, block in enumerate(self.down):
                x = block(x if i == 0 else F.max_pool2d(x, 2))
                skips.append(x)
            for up, dec, skip in zip(self.up, self.dec, skips[-2::-1]):
                x = dec(torch.cat([up(x), skip], 1))
            return self.out(x)

    # ---- transformers ----
    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int, fused_qkv: bool):
            super().__init__()
            self.heads, self.head = heads, dim // heads
            if fused_qkv:  # ViT / GPT-2
                self.qkv = nn.Linear(dim, 3 * dim)
            else:  # BERT: three projections
                self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
            self.out = nn.Linear(dim, dim)

        def split(self, t):
            b, s, _ = t.shape
            return t.reshape(b, s, self.heads, self.head).transpose(1, 2)

        def project(self, x):
            if hasattr(self, "qkv"):
                q, k, v = self.qkv(x).split(self.heads * self.head, dim=-1)
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            return self.split(q), self.split(k), self.split(v)

        def attend(self, q, k, v, bias):
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head)
            if bias is not None:
                scores = scores + bias
            ctx = scores.softmax(-1) @ v
            b, _, s, _ = ctx.shape
            return self.out(ctx.transpose(1, 2).reshape(b, s, self.heads * self.head))

        def forward(self, x, bias=None):
            return self.attend(*self.project(x), bias)

    class Block(nn.Module):
        def __init__(self, dim, heads, ff, pre_norm, eps, act="gelu", fused_qkv=False):
            super().__init__()
            self.attn = Attention(dim, heads, fused_qkv)
            self.ln1, self.ln2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
            self.fc1, self.fc2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
            self.approx = "tanh" if act == "gelu_tanh" else "none"
            self.pre_norm = pre_norm

        def mlp(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate=self.approx))

        def forward(self, x, bias=None):
            if self.pre_norm:  # ViT, GPT-2
                x = x + self.attn(self.ln1(x), bias)
                return x + self.mlp(self.ln2(x))
            x = self.ln1(x + self.attn(x, bias))  # BERT, DistilBERT
            return self.ln2(x + self.mlp(x))

    class ViT(nn.Module):
        def __init__(self, image=224, patch=16, dim=384, depth=12, heads=6, classes=1000):
            super().__init__()
            self.patch = nn.Conv2d(3, dim, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
            self.layers = nn.ModuleList(Block(dim, heads, 4 * dim, True, 1e-6, fused_qkv=True)
                                        for _ in range(depth))
            self.norm = nn.LayerNorm(dim, eps=1e-6)
            self.head = nn.Linear(dim, classes)

        def forward(self, image):
            x = self.patch(image).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x)[:, 0])

    class Bert(nn.Module):
        """BERT (token types, pooler) or, with token_types=False, DistilBERT (neither)."""

        def __init__(self, dim=768, depth=12, heads=12, ff=3072, token_types=True):
            super().__init__()
            self.tok = nn.Embedding(VOCAB_BERT, dim)
            self.pos = nn.Embedding(512, dim)
            self.seg = nn.Embedding(2, dim) if token_types else None
            self.norm = nn.LayerNorm(dim, eps=1e-12)
            self.layers = nn.ModuleList(Block(dim, heads, ff, False, 1e-12) for _ in range(depth))
            self.pool = nn.Linear(dim, dim) if token_types else None

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            s = input_ids.shape[1]
            x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
            if self.seg is not None:
                x = x + self.seg(token_type_ids)
            x = self.norm(x)
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            if self.pool is None:
                return x
            return x, torch.tanh(self.pool(x[:, 0]))

    class GPT2(nn.Module):
        """GPT-2: pre-norm, tanh-GELU, causal plus padding mask, LM head tied to the embedding."""

        def __init__(self, dim=GPT2_DIM, depth=GPT2_LAYERS, heads=GPT2_HEADS):
            super().__init__()
            self.tok = nn.Embedding(VOCAB_GPT2, dim)
            self.pos = nn.Embedding(1024, dim)
            self.layers = nn.ModuleList(Block(dim, heads, 4 * dim, True, 1e-5, "gelu_tanh", True)
                                        for _ in range(depth))
            self.norm = nn.LayerNorm(dim, eps=1e-5)

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            keep = causal[None, None] & attention_mask[:, None, None, :].bool()
            bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, -1e4)
            for layer in self.layers:
                x = layer(x, bias)
            return self.norm(x) @ self.tok.weight.T

    class GPT2Decode(GPT2):
        """One decoding step with a KV cache: the new token attends to the past and itself."""

        def forward(self, input_ids, attention_mask, *past):
            past_len = past[0].shape[2]
            pos = torch.arange(past_len, past_len + input_ids.shape[1], device=input_ids.device)
            x = self.tok(input_ids) + self.pos(pos)
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
            presents = []
            for i, layer in enumerate(self.layers):
                attn = layer.attn
                q, k, v = attn.project(layer.ln1(x))
                k = torch.cat([past[2 * i], k], 2)
                v = torch.cat([past[2 * i + 1], v], 2)
                presents += [k, v]
                x = x + attn.attend(q, k, v, bias)
                x = x + layer.mlp(layer.ln2(x))
            return (self.norm(x) @ self.tok.weight.T, *presents)

    class Recurrent(nn.Module):
        def __init__(self, features=128, hidden=256, classes=32):
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
            self.gru = nn.GRU(hidden, hidden, batch_first=True)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x):
            y, _ = self.lstm(x)
            y, h = self.gru(y)
            return self.head(y), h

    return {
        "resnet50": ResNet50, "mobilenetv2": MobileNetV2, "convnext_t": ConvNeXtT,
        "vit_s16": ViT, "unet": UNet,
        "bert_base": lambda: Bert(),
        "bert_small": lambda: Bert(dim=512, depth=4, heads=8, ff=2048),
        "distilbert": lambda: Bert(depth=3, token_types=False),
        "gpt2": GPT2, "gpt2_decode": GPT2Decode, "lstm_gru": Recurrent,
    }


def export(name: str, out_dir: str) -> dict:
    """Export `name` to out_dir/NAME.onnx (written atomically) with NAME.meta.json beside it;
    returns the meta: {"exporter", "note", "digest", "torch"}."""
    import torch

    spec = SPECS[name]
    torch.manual_seed(0)
    module = _modules()[name]().eval()
    _shared_models().randomize_batchnorm(module)
    example = make_inputs(name, 2)
    args = tuple(torch.from_numpy(v) for v in example.values())
    names = list(example)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.onnx")
    tmp = os.path.join(out_dir, f"{name}.{os.getpid()}.tmp.onnx")
    meta = {"exporter": spec.exporter, "note": spec.exporter_note, "digest": source_digest(),
            "torch": torch.__version__}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        with torch.no_grad():
            if spec.exporter == "dynamo":
                try:
                    _export_dynamo(module, args, names, spec, tmp)
                except Exception as exc:  # noqa: BLE001 - say why, fall back
                    meta["exporter"] = "classic"
                    meta["note"] = f"dynamo failed ({type(exc).__name__}: {str(exc)[:120]})"
            if meta["exporter"] == "classic":
                axes = {n: {0: "batch", **spec.extra_dynamic.get(n, {})} for n in names}
                axes.update({n: {0: "batch"} for n in spec.outputs})
                torch.onnx.export(module, args, tmp, dynamo=False, opset_version=17,
                                  input_names=names, output_names=spec.outputs,
                                  dynamic_axes=axes)
    os.replace(tmp, path)
    with open(os.path.join(out_dir, f"{name}.meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _export_dynamo(module, args, names: list[str], spec: ModelSpec, path: str) -> None:
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1, max=1024)
    dims = {"past": Dim("past", min=1, max=1000)}
    dims["total"] = dims["past"] + 1
    shapes = []
    for n in names:
        axes = {0: batch}
        axes.update({a: dims[d] for a, d in spec.extra_dynamic.get(n, {}).items()})
        shapes.append(axes)
    # A varargs forward (the decoder's past) takes its dynamic shapes as one tuple per *past.
    import inspect
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        fixed = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        shapes = tuple(shapes[:fixed]) + (tuple(shapes[fixed:]),)
    else:
        shapes = tuple(shapes)
    program = torch.onnx.export(module, args, dynamo=True, opset_version=18,
                                input_names=names, output_names=spec.outputs,
                                dynamic_shapes=shapes, external_data=False)
    program.save(path, external_data=False)


def cached(name: str, cache_dir: str) -> tuple[str, dict] | None:
    """(path, meta) of an up-to-date export of `name` in cache_dir, or None."""
    path = os.path.join(cache_dir, f"{name}.onnx")
    meta_path = os.path.join(cache_dir, f"{name}.meta.json")
    if not (os.path.exists(path) and os.path.exists(meta_path)):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    return (path, meta) if meta.get("digest") == source_digest() else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="export the CPU benchmark's models")
    parser.add_argument("names", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for name in args.names:
        meta = export(name, args.out)
        print(json.dumps({"name": name, **meta}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
