"""Real-size models on the OpenCL backend, compared with onnxruntime (the `realsize` tier).

Skipped unless selected: `python -m pytest -m realsize` (or EMBER_REALSIZE=1; see conftest.py).
Every model runs in a child process (sys.executable -c WORKER), so a segfault inside PoCL,
which runs kernels in the host process, fails that one test instead of killing pytest:
- plain: fresh, empty EMBER_CACHE_DIR and POCL_CACHE_DIR (a cold cache: every program is
  compiled from source, the case in which PoCL's huge work-groups used to overflow the worker
  stack), then a second run of the same session (warm);
- checked: EMBER_OPENCL_CHECK=1, the bounds-checked mode (canary guard bands around every
  device buffer, checked after each launch: runtime/backends/opencl_guard.py), outputs compared
  as in the plain run. It reuses the caches the plain run filled (the kernels are the same
  binaries; that halves the tier's time) and then asserts that the load compiled nothing, as
  docs/backends.md promises for a second load; run on its own it starts from empty caches.

Models, built here with seeded weights (nothing is downloaded) and cached under
`.cache/realsize-*` keyed by the source of this file and of models/export_torch_models.py:
1. `yolo`: a YOLOX-like detector (CSP backbone of Conv+BN+SiLU with stride-2 downsampling,
   SPPF, an upsample/concat FPN neck, a decoupled head with sigmoids) at 1x3x640x640;
2. `whisper`: a Whisper-style audio encoder (two Conv1d + GELU on 1x80x3000 mel frames, the
   second of stride 2; sinusoidal positions; 2 pre-norm transformer layers, d=256, 4 heads);
3. `unet`: a UNet-style segmenter (ConvTranspose and bilinear Resize upsampling, skip concats,
   per-pixel class logits) at 1x3x640x640;
4. `resnet50`: models/export_torch_models.py's ResNet-50 at its full size, 1x3x224x224;
and the 9 models of the onnx wheel's `light` zoo (tests/onnx_suites.py), compared with their
stored outputs at the suite's tolerance. (Their weights are ConstantOfShape fills, 0.02
everywhere, so all but densenet121 end in a uniform softmax: they test that real-size graphs
compile and run from a cold cache without crashing more than they test numerics.)
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.realsize

from backends import unavailable_reason  # noqa: E402
from onnx_suites import CACHE, light_models  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "models"))

# Tolerance, float32 against onnxruntime: |ember - ort| <= RTOL*|ort| + ATOL*max|ort|.
# Both sides round every product and sum to float32 (eps 1.2e-7) but sum in different orders
# (ember's blocked GEMM and im2col vs MLAS); a dot product of length K (up to 4608 here, 3x3x512)
# differs by ~sqrt(K)*eps ~ 1e-5 relative, and these differences compound through 50+ layers
# (ResNet-50), BatchNorm with random statistics, softmax over 1500 keys and the sigmoids, to a
# few 1e-5..1e-4 of the output's scale. 1e-3 relative leaves room for that; an indexing bug, a
# wrong tile edge or a race gives errors of the order of the values themselves. The absolute
# part is scaled to the output's largest magnitude: entries that cancel to near zero carry the
# rounding of their large terms and cannot be held to a relative error of their own.
RTOL, ATOL = 1e-3, 1e-4
# Ops that must run on the device (not fall back to the CPU) in these models.
DEVICE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "BatchNormalization",
              "LayerNormalization", "Attention", "FusedConv", "FusedGemm", "FusedMatMul",
              "Softmax", "Resize", "MaxPool")
TIMEOUT_S = 600  # per child process; a hang fails the test instead of stalling CI

# The child: loads one model on OpenCL, runs it twice, writes timings and outputs.
# argv[1] is a JSON job: {"kind": "torch"|"light", "model", "inputs", "outputs", "result"}.
WORKER = r"""
import json, sys, time
import numpy as np
job = json.loads(sys.argv[1])
sys.path.insert(0, job["tests"])
import ember
from ember.runtime.backends import get_backend
res = {}
if job["kind"] == "light":
    from onnx_suites import assert_outputs_match, load_light_case, run_case
    case = load_light_case(job["model"])
    t = time.perf_counter()
    session = run_case(case, backend="opencl")  # load + first run, checked on the way
    res["cold_s"] = time.perf_counter() - t
    feeds, expected = case.data_sets[0]
    t = time.perf_counter()
    out = session.run(feeds)
    res["warm_s"] = time.perf_counter() - t
    got = [out[o.name] for o in session.outputs]
    assert_outputs_match(expected, got, case.rtol, case.atol)
    res["max_abs_err"] = max(float(np.max(np.abs(g.astype(np.float64) - e)))
                             for g, e in zip(got, expected))
    res["max_abs_ref"] = max(float(np.max(np.abs(e))) for e in expected)
else:
    feeds = dict(np.load(job["inputs"]))
    t = time.perf_counter()
    session = ember.load(job["model"], backend="opencl")
    res["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    session.run(feeds)
    res["first_run_s"] = time.perf_counter() - t
    res["cold_s"] = res["load_s"] + res["first_run_s"]
    t = time.perf_counter()
    out = session.run(feeds)
    res["warm_s"] = time.perf_counter() - t
    np.savez(job["outputs"], *[out[o.name] for o in session.outputs])
be = get_backend("opencl")
res["device"] = be.describe()
res["bounds_checked"] = be.guard is not None
res["compiled_from_source"] = be.compiled_from_source
res["cpu_kernel_fallbacks"] = be.fallbacks
res["placement"] = session.placement_summary()
res["not_on_device"] = [f"{n} ({op}: {w})" for n, op, w in session.placement
                        if op in job["device_ops"] and w != "device"]
with open(job["result"], "w") as f:
    json.dump(res, f)
"""

REPORT: list[dict] = []  # one row per child run, printed at the end of the module
_CACHES: dict[str, dict[str, str]] = {}  # model -> the cache folders its plain run filled


def _requirements() -> str | None:
    """Why the OpenCL backend cannot run here (pyopencl missing, no device), or None."""
    return unavailable_reason("opencl")


class _Summary:
    """Prints REPORT in the terminal summary (registered as a plugin when the tier runs)."""

    def pytest_terminal_summary(self, terminalreporter):
        if not REPORT:
            return
        write = terminalreporter.write_line
        write("OpenCL real-size models: 1st = load + first run (cache cold or warm), "
              "warm = second run of the same session")
        for row in REPORT:
            err = "" if row.get("max_abs_err") is None else \
                f"max|err| {row['max_abs_err']:.3g} (max|ref| {row['max_abs_ref']:.3g})"
            write(f"  {row['name']:<20} {row['mode']:<7} {row['status']:<7} {row['cache']} cache: "
                  f"1st {row.get('cold_s', float('nan')):6.2f}s  "
                  f"warm {row.get('warm_s', float('nan')):6.2f}s  "
                  f"compiled {row.get('compiled_from_source', '-')!s:>2}  {err}")


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    manager = request.config.pluginmanager
    if manager.get_plugin("ember-realsize-report") is None:
        manager.register(_Summary(), "ember-realsize-report")


def _run_child(name: str, mode: str, job: dict, tmp_path) -> dict:
    """Run WORKER on `job` in a fresh process: the result dict, or a test failure saying how
    the child died. Plain runs start from empty ember and PoCL caches; checked runs reuse the
    plain run's caches of the same model (see the module docstring)."""
    reason = _requirements()
    if reason:
        pytest.skip(f"OpenCL unavailable: {reason}")
    env = dict(os.environ)
    env.pop("EMBER_OPENCL_CHECK", None)
    caches = _CACHES.get(name) if mode == "checked" else None
    warm_cache = caches is not None
    if caches is None:
        caches = {var: str(tmp_path / var.lower()) for var in ("EMBER_CACHE_DIR", "POCL_CACHE_DIR")}
        for folder in caches.values():
            os.makedirs(folder)
        if mode == "plain":
            _CACHES[name] = caches
    env.update(caches)
    if mode == "checked":
        env["EMBER_OPENCL_CHECK"] = "1"
    job = dict(job, tests=HERE, result=str(tmp_path / "result.json"),
               device_ops=list(DEVICE_OPS))
    row = {"name": name, "mode": mode, "cache": "warm" if warm_cache else "cold", "status": "FAIL"}
    REPORT.append(row)
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        row["status"] = "HANG"
        pytest.fail(f"{name} ({mode}) ran past {TIMEOUT_S}s: {exc.stderr or ''!s:.3000}",
                    pytrace=False)
    row["wall_s"] = time.perf_counter() - t
    if proc.returncode != 0:
        how = f"exit status {proc.returncode}"
        if proc.returncode < 0:
            how = f"killed by {signal.Signals(-proc.returncode).name}"
            row["status"] = signal.Signals(-proc.returncode).name
        pytest.fail(f"{name} ({mode}) child process {how}:\n{proc.stdout[-2000:]}\n"
                    f"{proc.stderr[-6000:]}", pytrace=False)
    with open(job["result"]) as f:
        res = json.load(f)
    row.update(res)
    assert res["bounds_checked"] == (mode == "checked"), "EMBER_OPENCL_CHECK did not take effect"
    if warm_cache:
        assert res["compiled_from_source"] == 0, \
            "a load with the program cache filled compiled programs again"
    else:
        assert res["compiled_from_source"] > 0, "the cache was not cold: nothing was compiled"
    assert not res["not_on_device"], f"ran on the CPU: {res['not_on_device']}"
    return row


# -- models ------------------------------------------------------------------------------------
def _define_modules():
    """The torch modules (defined on first use: torch is imported only when the tier runs)."""
    import math

    import torch
    from torch import nn
    from torch.nn import functional as F

    from export_torch_models import EncoderLayer

    class ConvBnSiLU(nn.Sequential):
        def __init__(self, cin, cout, k=1, s=1):
            super().__init__(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout),
                             nn.SiLU())

    class CSP(nn.Module):
        """YOLOv5/YOLOX C3 block: two 1x1 branches, bottlenecks on one, concat, 1x1."""

        def __init__(self, cin, cout, n=1, shortcut=True):
            super().__init__()
            mid = cout // 2
            self.a, self.b = ConvBnSiLU(cin, mid), ConvBnSiLU(cin, mid)
            self.m = nn.ModuleList(nn.Sequential(ConvBnSiLU(mid, mid), ConvBnSiLU(mid, mid, 3))
                                   for _ in range(n))
            self.shortcut = shortcut
            self.out = ConvBnSiLU(2 * mid, cout)

        def forward(self, x):
            y = self.a(x)
            for m in self.m:
                y = y + m(y) if self.shortcut else m(y)
            return self.out(torch.cat([y, self.b(x)], 1))

    class SPPF(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.a, self.out = ConvBnSiLU(c, c // 2), ConvBnSiLU(c * 2, c)
            self.pool = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            x = self.a(x)
            p1 = self.pool(x)
            p2 = self.pool(p1)
            return self.out(torch.cat([x, p1, p2, self.pool(p2)], 1))

    class YoloX(nn.Module):
        """Strides 8/16/32 from a 640x640 image; (1, 8400, 4 + 1 + classes) predictions."""

        def __init__(self, w=16, classes=80):
            super().__init__()
            self.stem = ConvBnSiLU(3, w, 3, 2)                                         # 320
            self.s2 = nn.Sequential(ConvBnSiLU(w, 2 * w, 3, 2), CSP(2 * w, 2 * w))      # 160
            self.s3 = nn.Sequential(ConvBnSiLU(2 * w, 4 * w, 3, 2), CSP(4 * w, 4 * w, 2))  # 80
            self.s4 = nn.Sequential(ConvBnSiLU(4 * w, 8 * w, 3, 2), CSP(8 * w, 8 * w, 2))  # 40
            self.s5 = nn.Sequential(ConvBnSiLU(8 * w, 16 * w, 3, 2), CSP(16 * w, 16 * w),
                                    SPPF(16 * w))                                      # 20
            self.lat5 = ConvBnSiLU(16 * w, 8 * w)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.td4 = CSP(16 * w, 8 * w, shortcut=False)
            self.lat4 = ConvBnSiLU(8 * w, 4 * w)
            self.td3 = CSP(8 * w, 4 * w, shortcut=False)                                # P3
            self.down3 = ConvBnSiLU(4 * w, 4 * w, 3, 2)
            self.bu4 = CSP(8 * w, 8 * w, shortcut=False)                                # P4
            self.down4 = ConvBnSiLU(8 * w, 8 * w, 3, 2)
            self.bu5 = CSP(16 * w, 16 * w, shortcut=False)                              # P5
            hw = 4 * w
            self.stems = nn.ModuleList(ConvBnSiLU(c, hw) for c in (4 * w, 8 * w, 16 * w))
            self.cls = nn.ModuleList(nn.Sequential(ConvBnSiLU(hw, hw, 3), nn.Conv2d(hw, classes, 1))
                                     for _ in range(3))
            self.reg = nn.ModuleList(nn.Sequential(ConvBnSiLU(hw, hw, 3), nn.Conv2d(hw, 5, 1))
                                     for _ in range(3))

        def forward(self, x):
            c3 = self.s3(self.s2(self.stem(x)))
            c4 = self.s4(c3)
            c5 = self.s5(c4)
            l5 = self.lat5(c5)
            t4 = self.td4(torch.cat([self.up(l5), c4], 1))
            l4 = self.lat4(t4)
            p3 = self.td3(torch.cat([self.up(l4), c3], 1))
            p4 = self.bu4(torch.cat([self.down3(p3), l4], 1))
            p5 = self.bu5(torch.cat([self.down4(p4), l5], 1))
            outs = []
            for i, p in enumerate((p3, p4, p5)):
                h = self.stems[i](p)
                reg = self.reg[i](h)  # 4 box offsets + objectness
                y = torch.cat([reg[:, :4], reg[:, 4:].sigmoid(), self.cls[i](h).sigmoid()], 1)
                outs.append(y.flatten(2))
            return torch.cat(outs, 2).transpose(1, 2)

    def sinusoids(length, channels):
        scale = math.log(10000) / (channels // 2 - 1)
        inv = torch.exp(-scale * torch.arange(channels // 2, dtype=torch.float32))
        t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
        return torch.cat([torch.sin(t), torch.cos(t)], 1)

    class WhisperEncoder(nn.Module):
        def __init__(self, mels=80, frames=3000, dim=256, heads=4, depth=2):
            super().__init__()
            self.conv1 = nn.Conv1d(mels, dim, 3, padding=1)
            self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
            self.register_buffer("pos", sinusoids(frames // 2, dim))
            self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, True)
                                        for _ in range(depth))
            self.ln_post = nn.LayerNorm(dim)

        def forward(self, mel):
            x = F.gelu(self.conv1(mel))
            x = F.gelu(self.conv2(x)).transpose(1, 2) + self.pos
            for layer in self.layers:
                x = layer(x)
            return self.ln_post(x)

    class Block(nn.Sequential):
        def __init__(self, cin, cout):
            super().__init__(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU())

    class UNet(nn.Module):
        """Encoder 640->320->160->80 (max-pool), decoder back up with ConvTranspose (x2) and
        bilinear Resize, skip concats at every level, 1x1 head to per-pixel class logits."""

        def __init__(self, w=8, classes=6):
            super().__init__()
            self.e1, self.e2 = Block(3, w), Block(w, 2 * w)
            self.e3, self.e4 = Block(2 * w, 4 * w), Block(4 * w, 8 * w)
            self.pool = nn.MaxPool2d(2)
            self.up3 = nn.ConvTranspose2d(8 * w, 4 * w, 2, 2)
            self.d3 = Block(8 * w, 4 * w)
            self.red2 = nn.Conv2d(4 * w, 2 * w, 1)
            self.d2 = Block(4 * w, 2 * w)
            self.up1 = nn.ConvTranspose2d(2 * w, w, 2, 2)
            self.d1 = Block(2 * w, w)
            self.head = nn.Conv2d(w, classes, 1)

        def forward(self, x):
            x1 = self.e1(x)
            x2 = self.e2(self.pool(x1))
            x3 = self.e3(self.pool(x2))
            x4 = self.e4(self.pool(x3))
            y = self.d3(torch.cat([self.up3(x4), x3], 1))
            y = F.interpolate(self.red2(y), scale_factor=2.0, mode="bilinear", align_corners=False)
            y = self.d2(torch.cat([y, x2], 1))
            y = self.d1(torch.cat([self.up1(y), x1], 1))
            return self.head(y)

    return YoloX, WhisperEncoder, UNet


def _specs() -> dict:
    """name -> (module factory, inputs, output names); the same seeded inputs every run."""
    rng = np.random.default_rng(0)
    image = rng.standard_normal((1, 3, 640, 640)).astype(np.float32)
    mel = (0.5 * rng.standard_normal((1, 80, 3000))).astype(np.float32)
    YoloX, WhisperEncoder, UNet = _define_modules()
    import export_torch_models
    resnet_factory, resnet_inputs, resnet_outputs, _ = \
        export_torch_models.model_specs(full_size=True)["resnet"]
    return {
        "yolo": (YoloX, {"image": image}, ["predictions"]),
        "whisper": (WhisperEncoder, {"mel": mel}, ["hidden"]),
        "unet": (UNet, {"image": image}, ["logits"]),
        "resnet50": (resnet_factory, resnet_inputs, resnet_outputs),
    }


TORCH_MODELS = ("yolo", "whisper", "unet", "resnet50")


def _model_cache() -> str:
    """Exports are reused across runs while this file and the shared exporter are unchanged."""
    import torch

    digest = hashlib.sha256()
    for path in (os.path.abspath(__file__), os.path.join(REPO, "models", "export_torch_models.py")):
        with open(path, "rb") as f:
            digest.update(f.read())
    return os.path.join(CACHE, f"realsize-torch-{torch.__version__}-{digest.hexdigest()[:12]}")


@pytest.fixture(scope="module", params=TORCH_MODELS)
def exported(request):
    """(name, model path, inputs path, onnxruntime's outputs) of one model, exported once."""
    reason = _requirements()
    if reason:
        pytest.skip(f"OpenCL unavailable: {reason}")
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    import export_torch_models

    name = request.param
    cache = _model_cache()
    path = os.path.join(cache, f"{name}.onnx")
    inputs_path = path[:-len(".onnx")] + ".inputs.npz"
    if not (os.path.exists(path) and os.path.exists(inputs_path)):
        factory, inputs, output_names = _specs()[name]
        tmp = os.path.join(cache, f"{name}.{os.getpid()}.tmp.onnx")
        export_torch_models.export_module(factory, inputs, output_names, "dynamo", False, tmp)
        os.replace(tmp[:-len(".onnx")] + ".inputs.npz", inputs_path)
        os.replace(tmp, path)
    inputs = dict(np.load(inputs_path))
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)
    return name, path, inputs_path, want


@pytest.mark.parametrize("mode", ["plain", "checked"])
def test_torch_model_matches_onnxruntime(exported, mode, tmp_path):
    name, path, inputs_path, want = exported
    out_path = str(tmp_path / "outputs.npz")
    row = _run_child(name, mode, {"kind": "torch", "model": path, "inputs": inputs_path,
                                  "outputs": out_path}, tmp_path)
    with np.load(out_path) as npz:
        got = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    assert len(got) == len(want)
    row["max_abs_err"] = max(float(np.max(np.abs(g.astype(np.float64) - w)))
                             for g, w in zip(got, want))
    row["max_abs_ref"] = max(float(np.max(np.abs(w))) for w in want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.all(np.isfinite(w)), "the reference itself overflowed: rescale the model"
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL * float(np.max(np.abs(w))))
    row["status"] = "ok"


@pytest.mark.parametrize("mode", ["plain", "checked"])
@pytest.mark.parametrize("model_path", light_models(),
                         ids=lambda p: os.path.splitext(os.path.basename(p))[0])
def test_light_model_cold_cache(model_path, mode, tmp_path):
    name = os.path.splitext(os.path.basename(model_path))[0]
    row = _run_child(name, mode, {"kind": "light", "model": model_path}, tmp_path)
    row["status"] = "ok"
