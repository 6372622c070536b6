"""float16 models stay as accurate as onnxruntime's own float16 run, simplified or not.

Each model is exported from PyTorch in float32 (the reference, run by onnxruntime) and converted
with onnxconverter-common's float16 converter (keep_io_types=True), as users convert models.
The float16 model then runs on onnxruntime, on ember unsimplified and on ember simplified (where
the simplifier fuses GELU, LayerNorm and attention into single ops). Oracle: the float32 model;
onnxruntime's float16 error against it is the noise floor. ember must be within twice that
floor (simplified on the CPU and OpenCL; unsimplified, see _ROUNDS_ITS_OUTPUT), and the fusions
must not be less accurate than the graph they replaced.

Inputs are scaled so that pre-activations reach below -3, where GELU's `1 + erf(x)` cancels
if erf is evaluated in float16 (the fault that motivated this test: gelu(-3) came out 0).
"""
from __future__ import annotations

import numpy as np
import pytest

import ember
from backends import unavailable_reason
from ember.importer import import_model
from ember.simplifier import simplify

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
float16 = pytest.importorskip("onnxconverter_common.float16")


class _Block(torch.nn.Module):
    """A pre-norm transformer block with eager attention and an exact-GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class ViT(torch.nn.Module):
    def __init__(self, dim=64, heads=4, depth=2):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, 8, stride=8)
        self.blocks = torch.nn.Sequential(*[_Block(dim, heads) for _ in range(depth)])
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)
        return self.head(self.blocks(x).mean(dim=1))


class Bert(torch.nn.Module):
    def __init__(self, vocab=100, dim=64, heads=4, depth=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.blocks = torch.nn.Sequential(*[_Block(dim, heads) for _ in range(depth)])

    def forward(self, tokens):
        return self.blocks(self.norm(self.embed(tokens)))


class ResNet(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, width, 3, padding=1)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(), torch.nn.Conv2d(width, width, 3, padding=1),
            torch.nn.BatchNorm2d(width))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, image):
        x = torch.relu(self.stem(image))
        x = torch.relu(x + self.body(x))
        return self.head(x.mean(dim=(2, 3)))


def _scale_up(model: torch.nn.Module, factor: float) -> None:
    """Larger weights, so activations span GELU's whole range (down to x < -3)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(factor)


# Unsimplified, ember follows the graph's roundings literally. The float16 converter leaves the
# output as Cast<float>(Gemm(...)); onnxruntime computes that Gemm in float32 and drops its
# float16 rounding, which the simplifier's widen_output_cast does too, but not an
# unsimplified run.
_ROUNDS_ITS_OUTPUT = pytest.mark.xfail(strict=True, reason=(
    "unsimplified, the float16 Gemm before the output Cast is rounded to float16 as the graph "
    "says (4.74e-4); onnxruntime computes it in float32 and skips that rounding (1.95e-4), as "
    "ember's simplifier does (widen_output_cast)"))


def _models(unsimplified_marks=()):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    yield "vit", ViT(), {"image": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
    torch.manual_seed(1)
    yield "bert", Bert(), {"tokens": rng.integers(0, 100, (2, 16)).astype(np.int64)}
    torch.manual_seed(2)
    yield pytest.param(
        "resnet", ResNet(), {"image": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)},
        marks=unsimplified_marks)


def _export(tmp_path, name, model, feeds):
    model.eval()
    _scale_up(model, 3.0)
    path32 = str(tmp_path / f"{name}32.onnx")
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    torch.onnx.export(model, args, path32, input_names=list(feeds), output_names=["y"],
                      opset_version=17, dynamo=False)
    import onnx

    model16 = float16.convert_float_to_float16(onnx.load(path32), keep_io_types=True)
    path16 = str(tmp_path / f"{name}16.onnx")
    onnx.save(model16, path16)
    return path32, path16


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def _errors(tmp_path, name, model, feeds, simplify, backend="cpu"):
    """(onnxruntime's float16 error, ember's) against the float32 model run by onnxruntime."""
    path32, path16 = _export(tmp_path, name, model, feeds)
    cpu = ["CPUExecutionProvider"]
    reference = ort.InferenceSession(path32, providers=cpu).run(None, feeds)[0].astype(np.float64)
    floor = _relative_error(ort.InferenceSession(path16, providers=cpu).run(None, feeds)[0],
                            reference)
    got = _relative_error(ember.load(path16, backend, simplify=simplify).run(feeds)["y"],
                          reference)
    return floor, got


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize("name, model, feeds", list(_models()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_float16_model_is_as_accurate_as_onnxruntime(tmp_path, name, model, feeds, backend):
    reason = unavailable_reason(backend)
    if reason:
        pytest.skip(reason)
    floor, simplified = _errors(tmp_path, name, model, feeds, simplify=True, backend=backend)
    assert simplified <= 2 * floor, (f"{name} on {backend}: relative error vs float32: "
                                     f"onnxruntime float16 {floor:.2e}, ember {simplified:.2e}")


@pytest.mark.parametrize("name, model, feeds", list(_models(_ROUNDS_ITS_OUTPUT)),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_unsimplified_float16_model_is_as_accurate_as_onnxruntime(tmp_path, name, model, feeds):
    floor, raw = _errors(tmp_path, name, model, feeds, simplify=False)
    assert raw <= 2 * floor, \
        f"{name}: relative error vs float32: onnxruntime float16 {floor:.2e}, ember {raw:.2e}"


@pytest.mark.parametrize("name, model, feeds", list(_models()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_fusing_never_costs_float16_accuracy(tmp_path, name, model, feeds):
    path32, path16 = _export(tmp_path, name, model, feeds)
    cpu = ["CPUExecutionProvider"]
    reference = ort.InferenceSession(path32, providers=cpu).run(None, feeds)[0].astype(np.float64)
    raw = _relative_error(ember.load(path16, simplify=False).run(feeds)["y"], reference)
    # the fusions alone: widening the output is a separate, deliberate change of rounding
    fused = simplify(import_model(path16), skip=("widen_output_cast",))
    error = _relative_error(ember.Session(fused).run(feeds)["y"], reference)
    assert error <= 1.5 * raw + 1e-3, f"{name}: unsimplified {raw:.2e}, fused {error:.2e}"
