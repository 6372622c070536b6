"""Extra PyTorch models for the simplifier benchmark, next to those of
models/export_torch_models.py: a ConvNeXt (depthwise 7x7 convs, channels-last LayerNorm,
layer scale) and a DistilBERT (BERT without segment embeddings or pooler, half the depth).

    python benchmarks/simplify_models.py [OUT_DIR] [--raw]

writes convnext.onnx and distilbert.onnx (+ .inputs.npz) with the same exporter settings
(dynamo, opset 18) into OUT_DIR (default .cache/torch-models-<torch version>).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))

import export_torch_models as base  # noqa: E402

torch, nn = base.torch, base.nn

if nn is not None:
    F = torch.nn.functional

    class ConvNeXtBlock(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = nn.LayerNorm(dim, eps=1e-6)
            self.pw1 = nn.Linear(dim, 4 * dim)
            self.pw2 = nn.Linear(4 * dim, dim)
            self.gamma = nn.Parameter(torch.full((dim,), 0.5))

        def forward(self, x):
            y = self.dw(x).permute(0, 2, 3, 1)
            y = self.pw2(F.gelu(self.pw1(self.norm(y)))) * self.gamma
            return x + y.permute(0, 3, 1, 2)

    class ConvNeXt(nn.Module):
        def __init__(self, dims=(16, 32, 64), classes: int = 10):
            super().__init__()
            self.stem = nn.Conv2d(3, dims[0], 4, 4)
            stages = []
            for i, dim in enumerate(dims):
                if i:
                    stages.append(nn.Conv2d(dims[i - 1], dim, 2, 2))
                stages += [ConvNeXtBlock(dim), ConvNeXtBlock(dim)]
            self.stages = nn.Sequential(*stages)
            self.norm = nn.LayerNorm(dims[-1])
            self.head = nn.Linear(dims[-1], classes)

        def forward(self, x):
            x = self.stages(self.stem(x))
            return self.head(self.norm(x.mean((2, 3))))

    class DistilBert(nn.Module):
        def __init__(self, vocab: int = 1000, dim: int = 64, depth: int = 2, heads: int = 4,
                     max_len: int = 64):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(max_len, dim)
            self.norm = nn.LayerNorm(dim)
            self.layers = nn.ModuleList(base.EncoderLayer(dim, heads, 4 * dim, False)
                                        for _ in range(depth))

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            x = self.norm(self.tok(input_ids) + self.pos(torch.arange(s)))
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            return x


def specs() -> dict:
    rng = np.random.default_rng(0)
    return {
        "convnext": (ConvNeXt, {"image": rng.standard_normal((1, 3, 64, 64)).astype(np.float32)},
                     ["logits"]),
        "distilbert": (DistilBert, base._token_inputs(rng, 2, 16), ["hidden"]),
    }


def export(name: str, out_dir: str, raw: bool = False) -> str:
    factory, inputs, output_names = specs()[name]
    path = os.path.join(out_dir, f"{name}{'_raw' if raw else ''}.onnx")
    return base.export_module(factory, inputs, output_names, "dynamo", raw, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--raw", action="store_true",
                        help="without the exporter's optimiser (NAME_raw), as in "
                             "models/export_torch_models.py")
    args = parser.parse_args(argv)
    if torch is None:
        print("torch is not installed", file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(REPO, ".cache", f"torch-models-{torch.__version__}")
    for name in specs():
        print("wrote", export(name, out_dir, args.raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
