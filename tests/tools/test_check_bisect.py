"""`ember check --bisect` names the node that adds the error, not the first rounding.

The case of issue 43: a float16 ViT (exported from PyTorch, converted by onnxconverter-common's
float16 converter with keep_io_types=True), where every node differs from onnxruntime by an
ulp or so, and one rewrite of ember's simplifier computes worse than the graph it replaced.
The lossy rewrite is reproduced here by swapping, for one test at a time, the CPU kernel of
LayerNormalization (which the simplifier's fuse_layernorm makes out of the exported
ReduceMean / Sub / Pow / ... / Div chain) for one that computes the variance in one pass in
float16, E[x^2] - E[x]^2: it cancels where the mean is far from zero, as in a residual stream.
Oracles: onnxruntime (the reference), and the float32 model run by onnxruntime, to show that
the named node is what makes ember's output worse than onnxruntime's float16 run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import ember
from backends import unavailable_reason
from ember import golden
from ember.cli import main as cli_main
from ember.importer import import_model
from ember.ops import registry
from ember.runtime.session import Session
from ember.simplifier import PASSES

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
float16 = pytest.importorskip("onnxconverter_common.float16")
onnx = pytest.importorskip("onnx")

@pytest.fixture(scope="module", autouse=True)
def literal_float16():
    """The graph computed as written, in float16: these tests bisect its float16 roundings,
    which compute_float16_in_float32 (the CPU's default) would replace by float32 ones."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_WIDEN_HALF", "0")
        yield


LAYERNORM = "/norm1/Div"  # the fused LayerNormalization keeps the name of the Div it ends in
CONV = "/patch/Conv"
TIGHT = {"atol": 0.0, "rtol": 1e-4}  # every ulp-level difference counts as a divergence


class TinyViT(torch.nn.Module):
    """Patch embedding, one pre-norm transformer block, mean pooling and a head."""

    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.patch = torch.nn.Conv2d(3, dim, 8, stride=8)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(x.mean(dim=1))


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """(float32 path, float16 path, feeds): opset 14, so LayerNorm is exported written out and
    the simplifier fuses it. The patch embedding's bias is raised so the normalised rows have
    a mean far from zero, as a residual stream's rows have."""
    folder = tmp_path_factory.mktemp("vit16")
    torch.manual_seed(0)
    model = TinyViT().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(3.0)
        model.patch.bias.add_(4.0)
    feeds = {"image": np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    path32, path16 = str(folder / "vit32.onnx"), str(folder / "vit16.onnx")
    torch.onnx.export(model, (torch.from_numpy(feeds["image"]),), path32,
                      input_names=["image"], output_names=["y"], opset_version=14, dynamo=False)
    onnx.save(float16.convert_float_to_float16(onnx.load(path32), keep_io_types=True), path16)
    return path32, path16, feeds


def make_layernorm_lossy(monkeypatch) -> None:
    """The CPU LayerNormalization computes its variance as E[x^2] - E[x]^2 in float16."""
    correct = registry.lookup("", "LayerNormalization", 17, "cpu")

    class OnePassFloat16(correct):
        def run(self, x, scale, b=None):
            h = np.float16
            mean = np.mean(x, axis=-1, keepdims=True, dtype=h)
            var = (np.mean(x * x, axis=-1, keepdims=True, dtype=h) - mean * mean).astype(h)
            y = ((x - mean) / np.sqrt(np.maximum(var, 0) + h(self.epsilon))).astype(h) * scale
            return y if b is None else (y + b).astype(h)

    key = ("cpu", "", "LayerNormalization")
    monkeypatch.setitem(registry._TABLE, key, {v: OnePassFloat16 for v in registry._TABLE[key]})


def relative_error(got, want) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def test_the_injected_rewrite_is_what_loses_float16_accuracy(vit, monkeypatch):
    """The premise, against the float32 model: with the lossy kernel ember's float16 error is
    many times onnxruntime's; simplify=False (no fused LayerNormalization) it is not."""
    path32, path16, feeds = vit
    want = ort.InferenceSession(path32, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    floor = relative_error(
        ort.InferenceSession(path16, providers=["CPUExecutionProvider"]).run(None, feeds)[0], want)
    make_layernorm_lossy(monkeypatch)
    assert relative_error(ember.load(path16).run(feeds)["y"], want) > 4 * floor
    assert relative_error(ember.load(path16, simplify=False).run(feeds)["y"], want) < 2 * floor


def test_bisect_names_the_lossy_rewrite_not_the_first_conv(vit, monkeypatch):
    _, path16, feeds = vit
    make_layernorm_lossy(monkeypatch)
    report = golden.check(path16, "cpu", ref="onnxruntime", inputs=feeds, bisect=True,
                          simplify=True, **TIGHT)
    bisect = report.backends[0].bisect
    assert bisect.found and (bisect.node_name, bisect.op_type) == (CONV, "Conv")  # rounding
    cause = bisect.added_error
    assert (cause.node_name, cause.op_type, cause.domain) == (LAYERNORM, "LayerNormalization", "")
    assert cause.simplifier.startswith("made by the simplifier (pass fuse_layernorm)")
    assert "Div" in cause.simplifier  # what the original graph has there
    assert cause.isolated_ulps >= 16 and cause.next_ulps <= 2
    assert cause.input_ulps <= 2 and cause.output_ulps >= 16  # the error starts at this node
    assert cause.dtype == "float16" and cause.nodes_isolated > 20


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_without_the_fault_no_node_adds_more_than_rounding(vit, backend):
    """On OpenCL the nodes placed on the device get the reference's values uploaded."""
    reason = unavailable_reason(backend)
    if reason:
        pytest.skip(reason)
    _, path16, feeds = vit
    report = golden.check(path16, backend, ref="onnxruntime", inputs=feeds, bisect=True,
                          simplify=True, **TIGHT)
    bisect = report.backends[0].bisect
    assert bisect.found and bisect.op_type == "Conv"
    assert bisect.added_error.isolated_ulps <= 2 and bisect.added_error.nodes_isolated > 20
    assert "bisect: no node adds more than rounding" in report.format()


def test_cli_reports_both_findings(vit, tmp_path, capsys, monkeypatch):
    """`ember check` checks the graph ember runs, simplified: no flag is needed to find the
    simplifier's rewrite."""
    _, path16, feeds = vit
    np.save(tmp_path / "image.npy", feeds["image"])
    make_layernorm_lossy(monkeypatch)
    json_path = tmp_path / "report.json"
    rc = cli_main(["check", path16, "--ref", "onnxruntime", "--bisect",
                   "-i", f"image={tmp_path / 'image.npy'}", "--atol", "0", "--rtol", "1e-4",
                   "--json", str(json_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"bisect: first divergence at node '{CONV}' (Conv, opset 17)" in out
    assert (f"bisect: error grows most at node '{LAYERNORM}' (LayerNormalization, opset 17), "
            "node 5 in topological order, made by the simplifier (pass fuse_layernorm)") in out
    data = json.loads(json_path.read_text())
    assert data["simplified"] is True
    finding = data["backends"][0]["bisect"]
    assert finding["node_name"] == CONV  # the first divergence keeps its place and keys
    assert finding["added_error"]["node_name"] == LAYERNORM
    assert finding["added_error"]["isolated_ulps"] >= 16
    # the one command, as it is: random inputs, the default tolerances
    assert cli_main(["check", path16, "--ref", "onnxruntime", "--bisect"]) == 1
    out = capsys.readouterr().out
    assert (f"bisect: error grows most at node '{LAYERNORM}' (LayerNormalization, opset 17), "
            "node 5 in topological order, made by the simplifier (pass fuse_layernorm)") in out
    assert "graph as imported" not in out
    # --no-simplify: the graph as imported has no fused LayerNormalization, and no node of it
    # adds more than float16 rounding
    cli_main(["check", path16, "--ref", "onnxruntime", "--bisect", "--no-simplify",
              "--json", str(json_path)])
    out = capsys.readouterr().out
    assert "graph as imported" in out and "made by the simplifier" not in out
    data = json.loads(json_path.read_text())
    assert data["simplified"] is False
    assert data["backends"][0]["bisect"]["added_error"]["isolated_ulps"] <= 2


def test_isolation_in_lockstep_with_another_ember_plan(vit):
    """Against an ember backend both plans run side by side: one broken kernel instance of the
    candidate's, and only it, is named, while every other node agrees to the bit."""
    _, path16, feeds = vit
    candidate = ember.load(path16)
    reference = Session(candidate.model, "cpu")
    step = next(s for s in candidate._plan.steps if s.node.name == LAYERNORM)
    correct = step.kernel.run
    step.kernel.run = lambda x, scale, b=None: (correct(x, scale, b) * np.float16(1.01)) \
        .astype(np.float16)
    finding = golden.find_divergence(candidate, reference, feeds, golden.Tolerances(),
                                     original=import_model(path16))
    assert finding.found and finding.node_name == LAYERNORM
    assert finding.added_error.node_name == LAYERNORM and finding.added_error.next_ulps == 0
    # check(simplify=True) against an ember backend: the reference runs the simplified graph
    # too, so the same kernels agree to the bit, outputs and every node alike
    report = golden.check(path16, "cpu", ref="cpu", inputs=feeds, bisect=True, simplify=True,
                          atol=0.0, rtol=0.0)
    assert report.passed and not report.backends[0].bisect.found
    assert report.backends[0].bisect.added_error.isolated_ulps == 0


def test_marked_value_fused_away_says_so(vit):
    _, path16, feeds = vit
    fused_away = next(n.output[0] for n in onnx.load(path16).graph.node
                      if n.name == "/norm1/Sqrt")
    report = golden.check(path16, "cpu", ref="onnxruntime", inputs=feeds, simplify=True,
                          marks=[fused_away], rtol=1e-2)
    marked = next(c for c in report.backends[0].outputs if c.name == f"mark:{fused_away}")
    assert not marked.passed and "simplified graph does not compute it" in marked.note


def test_error_in_ulps():
    one = np.array([1.0, 2.0, -4.0], np.float16)
    assert golden.error_in_ulps(one, one) == (0.0, 0.0)
    off = one.copy()
    off[2] = np.nextafter(off[2], np.float16(0))  # one step at 4 (the largest): 1 ulp of 4
    assert golden.error_in_ulps(off, one)[1] == pytest.approx(0.5)  # spacing below 4 is half
    off = one.copy()
    off[0] = np.float16(1.0 + 2 ** -10)  # an ulp of 1 is a quarter of an ulp at 4
    assert golden.error_in_ulps(off, one)[1] == pytest.approx(0.25)
    assert golden.error_in_ulps(np.array([3, 7]), np.array([3, 5])) == (2.0, 2.0)
    nan = np.array([np.nan, 1.0], np.float32)
    assert golden.error_in_ulps(nan, nan) == (0.0, 0.0)
    assert golden.error_in_ulps(nan, np.ones(2, np.float32))[1] == float("inf")
    assert golden.error_in_ulps(np.ones(2), np.ones(3)) is None


def test_the_passes_named_exist():
    assert set(golden.bisect._MADE_BY.values()) <= set(PASSES)
