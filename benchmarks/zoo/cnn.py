"""The zoo's convolutional networks: image classifiers, a detector and segmentation networks,
written here in plain torch, the published ones at their published sizes (the two segmentation
networks are small ones of our own), with seeded random weights and trained-looking
normalisation statistics.

| name                  | model                                                          | input   |
|-----------------------|----------------------------------------------------------------|---------|
| efficientnet_b0       | EfficientNet-B0: MBConv, SiLU, squeeze-excitation, dw 3x3/5x5  | 224x224 |
| mobilenetv3_small     | MobileNetV3-Small: HardSwish, HardSigmoid SE, depthwise        | 224x224 |
| regnety_400mf         | RegNetY-400MF: grouped 3x3 (group width 8), SE, ReLU           | 224x224 |
| shufflenetv2_x1       | ShuffleNetV2 x1.0: channel split and shuffle, depthwise        | 224x224 |
| densenet121           | DenseNet-121: blocks [6,12,24,16], growth 32, concat-heavy     | 224x224 |
| yolov8n               | YOLOv8n: C2f, SPPF, PAN neck, decoupled head with DFL decode   | 640x640 |
| seg_unet_gn           | a UNet: GroupNorm, InstanceNorm, dilated conv, bilinear Resize | 256x256 |
| convtranspose_decoder | an autoencoder: stride-2 convs, ConvTranspose up, GroupNorm    | 128x128 |

Every model is exported by `export_torch`: torch.onnx.export(dynamo=True, opset 18) with a
dynamic batch axis (example batch 2), falling back to the classic exporter (dynamo=False,
opset 17). Which exporter wrote a file, and why, is in its metadata_props ("zoo.exporter",
"zoo.note").
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from typing import Callable

import numpy as np

from . import ZooModel

TOOL = "torch.onnx dynamo"


def _image(size: int) -> Callable[[int, np.random.Generator], dict]:
    return lambda batch, rng: {
        "image": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


# -- export ---------------------------------------------------------------------------------------

def _randomize_norms(module) -> None:
    """Trained-looking BatchNorm statistics (as the other zoos make them) and affine parameters
    of GroupNorm and InstanceNorm layers."""
    import torch
    from torch import nn

    models_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "models")
    if models_dir not in sys.path:
        sys.path.insert(0, models_dir)
    import export_torch_models

    export_torch_models.randomize_batchnorm(module)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (nn.GroupNorm, nn.InstanceNorm2d)) and layer.affine:
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)


def export_torch(module, example_inputs: tuple, names: list[str], outputs: list[str],
                 path: str) -> str:
    """Export `module` to `path` (atomically) with a dynamic batch axis on every input and
    output; returns the exporter used, "dynamo" or "classic"."""
    import onnx
    import torch
    from torch.export import Dim

    tmp = f"{path[:-len('.onnx')]}.{os.getpid()}.tmp.onnx"
    exporter, note = "dynamo", ""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            batch = Dim("batch", min=1, max=1024)
            program = torch.onnx.export(module, example_inputs, dynamo=True, opset_version=18,
                                        input_names=names, output_names=outputs,
                                        dynamic_shapes=tuple({0: batch} for _ in names),
                                        external_data=False)
            program.save(tmp, external_data=False)
        except Exception as exc:  # noqa: BLE001 - say why, fall back
            exporter, note = "classic", f"dynamo failed ({type(exc).__name__}: {str(exc)[:120]})"
            torch.onnx.export(module, example_inputs, tmp, dynamo=False, opset_version=17,
                              input_names=names, output_names=outputs,
                              dynamic_axes={n: {0: "batch"} for n in names + outputs})
    model = onnx.load(tmp)
    for key, value in (("zoo.exporter", exporter), ("zoo.note", note)):
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, tmp)
    os.replace(tmp, path)
    return exporter


def _builder(name: str, factory: Callable, size: int, outputs: list[str]) -> Callable:
    def build(out_dir: str) -> str:
        import torch

        torch.manual_seed(0)
        module = factory().eval()
        _randomize_norms(module)
        example = _image(size)(2, np.random.default_rng(0))
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}.onnx")
        export_torch(module, tuple(torch.from_numpy(v) for v in example.values()),
                     list(example), outputs, path)
        return path
    return build


# -- shared blocks --------------------------------------------------------------------------------

def _blocks():
    """ConvNormAct and SqueezeExcite, the pieces the classifiers share."""
    from types import SimpleNamespace

    from torch import nn

    class ConvNormAct(nn.Sequential):
        def __init__(self, cin, cout, k=1, stride=1, groups=1, act=nn.ReLU):
            layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                      nn.BatchNorm2d(cout)]
            super().__init__(*layers, *([act()] if act else []))

    class SqueezeExcite(nn.Module):
        def __init__(self, channels, squeeze, act=nn.ReLU, gate=nn.Sigmoid):
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
            self.act, self.gate = act(), gate()

        def forward(self, x):
            s = x.mean((2, 3), keepdim=True)
            return x * self.gate(self.fc2(self.act(self.fc1(s))))

    return SimpleNamespace(ConvNormAct=ConvNormAct, SqueezeExcite=SqueezeExcite)


def _classifier_head(features, channels: int, hidden: int = 0, classes: int = 1000):
    from torch import nn

    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if hidden:
        head += [nn.Linear(channels, hidden), nn.Hardswish()]
        channels = hidden
    return nn.Sequential(features, *head, nn.Dropout(0.2), nn.Linear(channels, classes))


# -- the architectures ----------------------------------------------------------------------------

def _efficientnet_b0():
    from torch import nn

    b = _blocks()

    class MBConv(nn.Module):
        def __init__(self, cin, cout, k, stride, expand):
            super().__init__()
            mid = cin * expand
            layers = [b.ConvNormAct(cin, mid, 1, act=nn.SiLU)] if expand != 1 else []
            layers += [b.ConvNormAct(mid, mid, k, stride, groups=mid, act=nn.SiLU),
                       b.SqueezeExcite(mid, max(1, cin // 4), act=nn.SiLU),
                       b.ConvNormAct(mid, cout, 1, act=None)]
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    # (expansion, kernel, first stride, channels, repeats), as in the paper
    cfg = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
           (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
    layers, cin = [b.ConvNormAct(3, 32, 3, 2, act=nn.SiLU)], 32
    for expand, k, stride, cout, repeats in cfg:
        for i in range(repeats):
            layers.append(MBConv(cin, cout, k, stride if i == 0 else 1, expand))
            cin = cout
    layers.append(b.ConvNormAct(cin, 1280, 1, act=nn.SiLU))
    return _classifier_head(nn.Sequential(*layers), 1280)


def _mobilenetv3_small():
    from torch import nn

    b = _blocks()

    class Bneck(nn.Module):
        def __init__(self, cin, k, mid, cout, se, act, stride):
            super().__init__()
            layers = [b.ConvNormAct(cin, mid, 1, act=act)] if mid != cin else []
            layers.append(b.ConvNormAct(mid, mid, k, stride, groups=mid, act=act))
            if se:
                squeeze = max(8, (mid // 4 + 4) // 8 * 8)
                layers.append(b.SqueezeExcite(mid, squeeze, gate=nn.Hardsigmoid))
            layers.append(b.ConvNormAct(mid, cout, 1, act=None))
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    re, hs = nn.ReLU, nn.Hardswish
    # (in, kernel, expanded, out, SE, activation, stride), torchvision's table
    cfg = [(16, 3, 16, 16, True, re, 2), (16, 3, 72, 24, False, re, 2),
           (24, 3, 88, 24, False, re, 1), (24, 5, 96, 40, True, hs, 2),
           (40, 5, 240, 40, True, hs, 1), (40, 5, 240, 40, True, hs, 1),
           (40, 5, 120, 48, True, hs, 1), (48, 5, 144, 48, True, hs, 1),
           (48, 5, 288, 96, True, hs, 2), (96, 5, 576, 96, True, hs, 1),
           (96, 5, 576, 96, True, hs, 1)]
    layers = [b.ConvNormAct(3, 16, 3, 2, act=hs), *(Bneck(*c) for c in cfg),
              b.ConvNormAct(96, 576, 1, act=hs)]
    return _classifier_head(nn.Sequential(*layers), 576, hidden=1024)


def _regnety_400mf():
    from torch import nn

    b = _blocks()

    class YBlock(nn.Module):
        def __init__(self, cin, cout, stride, group_width=8):
            super().__init__()
            self.body = nn.Sequential(
                b.ConvNormAct(cin, cout, 1),
                b.ConvNormAct(cout, cout, 3, stride, groups=cout // group_width),
                b.SqueezeExcite(cout, round(cin * 0.25)),
                b.ConvNormAct(cout, cout, 1, act=None))
            self.proj = (b.ConvNormAct(cin, cout, 1, stride, act=None)
                         if stride != 1 or cin != cout else nn.Identity())
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.proj(x) + self.body(x))

    layers, cin = [b.ConvNormAct(3, 32, 3, 2)], 32
    for depth, width in zip((1, 3, 6, 6), (48, 104, 208, 440)):
        for i in range(depth):
            layers.append(YBlock(cin, width, 2 if i == 0 else 1))
            cin = width
    return _classifier_head(nn.Sequential(*layers), cin)


def _shufflenetv2_x1():
    import torch
    from torch import nn

    b = _blocks()

    def shuffle(x, groups=2):
        _, c, h, w = x.shape
        x = x.reshape(-1, groups, c // groups, h, w).transpose(1, 2)
        return x.reshape(-1, c, h, w)

    class Unit(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            half = cout // 2
            self.stride = stride
            if stride > 1:
                self.branch1 = nn.Sequential(b.ConvNormAct(cin, cin, 3, stride, cin, act=None),
                                             b.ConvNormAct(cin, half, 1))
            self.branch2 = nn.Sequential(
                b.ConvNormAct(cin if stride > 1 else half, half, 1),
                b.ConvNormAct(half, half, 3, stride, half, act=None),
                b.ConvNormAct(half, half, 1))

        def forward(self, x):
            if self.stride == 1:
                x1, x2 = x.chunk(2, 1)
                out = torch.cat([x1, self.branch2(x2)], 1)
            else:
                out = torch.cat([self.branch1(x), self.branch2(x)], 1)
            return shuffle(out)

    layers, cin = [b.ConvNormAct(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)], 24
    for repeats, cout in zip((4, 8, 4), (116, 232, 464)):
        for i in range(repeats):
            layers.append(Unit(cin, cout, 2 if i == 0 else 1))
            cin = cout
    layers.append(b.ConvNormAct(cin, 1024, 1))
    return _classifier_head(nn.Sequential(*layers), 1024)


def _densenet121():
    import torch
    from torch import nn

    class DenseLayer(nn.Module):
        def __init__(self, cin, growth=32, bottleneck=4):
            super().__init__()
            self.body = nn.Sequential(
                nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, bottleneck * growth, 1, bias=False),
                nn.BatchNorm2d(bottleneck * growth), nn.ReLU(),
                nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False))

        def forward(self, features):
            return self.body(torch.cat(features, 1))

    class DenseBlock(nn.ModuleList):
        def forward(self, x):
            features = [x]
            for layer in self:
                features.append(layer(features))
            return torch.cat(features, 1)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, depth in enumerate((6, 12, 24, 16)):
        layers.append(DenseBlock(DenseLayer(cin + 32 * j) for j in range(depth)))
        cin += 32 * depth
        if i < 3:
            layers += [nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cin // 2, 1, bias=False),
                       nn.AvgPool2d(2, 2)]
            cin //= 2
    layers += [nn.BatchNorm2d(cin), nn.ReLU()]
    return _classifier_head(nn.Sequential(*layers), cin)


def _yolov8n():
    import math

    import torch
    from torch import nn
    from torch.nn import functional as F

    class Conv(nn.Sequential):
        def __init__(self, cin, cout, k=1, stride=1):
            super().__init__(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False),
                             nn.BatchNorm2d(cout, eps=1e-3), nn.SiLU())

    class Bottleneck(nn.Module):
        def __init__(self, c, shortcut):
            super().__init__()
            self.cv1, self.cv2, self.add = Conv(c, c, 3), Conv(c, c, 3), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        def __init__(self, cin, cout, n, shortcut):
            super().__init__()
            self.c = cout // 2
            self.cv1, self.cv2 = Conv(cin, 2 * self.c, 1), Conv((2 + n) * self.c, cout, 1)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x):
            y = list(self.cv1(x).split((self.c, self.c), 1))
            y.extend(m(y[-1]) for m in self.m)
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, cin, cout, k=5):
            super().__init__()
            self.cv1, self.cv2 = Conv(cin, cin // 2, 1), Conv(cin // 2 * 4, cout, 1)
            self.m = nn.MaxPool2d(k, 1, k // 2)

        def forward(self, x):
            y = [self.cv1(x)]
            y.extend(self.m(y[-1]) for _ in range(3))
            return self.cv2(torch.cat(y, 1))

    class Detect(nn.Module):
        """The decoupled head and ultralytics' export-time decode: DFL (a softmax over 16 bins
        per box side), anchor points, xywh boxes in pixels, sigmoid class scores."""

        def __init__(self, channels, classes=80, reg_max=16, strides=(8, 16, 32)):
            super().__init__()
            self.nc, self.reg_max, self.strides = classes, reg_max, strides
            c2, c3 = max(16, channels[0] // 4, 4 * reg_max), max(channels[0], min(classes, 100))
            self.cv2 = nn.ModuleList(nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3),
                                                   nn.Conv2d(c2, 4 * reg_max, 1)) for c in channels)
            self.cv3 = nn.ModuleList(nn.Sequential(Conv(c, c3, 3), Conv(c3, c3, 3),
                                                   nn.Conv2d(c3, classes, 1)) for c in channels)
            self.dfl = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(reg_max, dtype=torch.float32).view(
                1, reg_max, 1, 1)
            for box, cls, s in zip(self.cv2, self.cv3, strides):
                box[-1].bias.data[:] = 1.0
                cls[-1].bias.data[:] = math.log(5 / classes / (640 / s) ** 2)

        def forward(self, feats):
            outs = [torch.cat((box(x), cls(x)), 1) for x, box, cls in zip(feats, self.cv2,
                                                                            self.cv3)]
            points, strides = [], []
            for x, s in zip(outs, self.strides):
                h, w = x.shape[2:]
                sy, sx = torch.meshgrid(torch.arange(h, dtype=torch.float32) + 0.5,
                                        torch.arange(w, dtype=torch.float32) + 0.5, indexing="ij")
                points.append(torch.stack((sx, sy), -1).view(-1, 2))
                strides.append(torch.full((h * w, 1), float(s)))
            anchors = torch.cat(points).transpose(0, 1).unsqueeze(0)
            stride = torch.cat(strides).transpose(0, 1)
            x = torch.cat([o.flatten(2) for o in outs], 2)
            box, cls = x.split((4 * self.reg_max, self.nc), 1)
            a = box.shape[2]
            dist = self.dfl(box.reshape(-1, 4, self.reg_max, a).transpose(2, 1).softmax(1))
            lt, rb = dist.reshape(-1, 4, a).chunk(2, 1)
            x1y1, x2y2 = anchors - lt, anchors + rb
            xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * stride
            return torch.cat((xywh, cls.sigmoid()), 1)

    class YOLOv8n(nn.Module):
        def __init__(self):
            super().__init__()
            self.b1 = nn.Sequential(Conv(3, 16, 3, 2), Conv(16, 32, 3, 2), C2f(32, 32, 1, True),
                                    Conv(32, 64, 3, 2), C2f(64, 64, 2, True))
            self.b2 = nn.Sequential(Conv(64, 128, 3, 2), C2f(128, 128, 2, True))
            self.b3 = nn.Sequential(Conv(128, 256, 3, 2), C2f(256, 256, 1, True),
                                    SPPF(256, 256))
            self.up4, self.up3 = C2f(384, 128, 1, False), C2f(192, 64, 1, False)
            self.down3, self.out4 = Conv(64, 64, 3, 2), C2f(192, 128, 1, False)
            self.down4, self.out5 = Conv(128, 128, 3, 2), C2f(384, 256, 1, False)
            self.detect = Detect((64, 128, 256))

        def forward(self, image):
            p3 = self.b1(image)
            p4 = self.b2(p3)
            p5 = self.b3(p4)
            up = self.up4(torch.cat((F.interpolate(p5, scale_factor=2.0, mode="nearest"), p4), 1))
            n3 = self.up3(torch.cat((F.interpolate(up, scale_factor=2.0, mode="nearest"), p3), 1))
            n4 = self.out4(torch.cat((self.down3(n3), up), 1))
            n5 = self.out5(torch.cat((self.down4(n4), p5), 1))
            return self.detect([n3, n4, n5])

    return YOLOv8n()


def _seg_unet_gn():
    import torch
    from torch import nn
    from torch.nn import functional as F

    def stage(cin, cout, stride=1, dilation=1, norm="group", act=nn.SiLU):
        norm_layer = (nn.GroupNorm(8, cout) if norm == "group"
                      else nn.InstanceNorm2d(cout, affine=True))
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, dilation, dilation), norm_layer,
                             act())

    leaky = lambda: nn.LeakyReLU(0.1)  # noqa: E731

    class SegUNet(nn.Module):
        def __init__(self, classes=21):
            super().__init__()
            self.enc = nn.ModuleList([
                nn.Sequential(stage(3, 32), stage(32, 32)),
                nn.Sequential(stage(32, 64, 2), stage(64, 64, norm="instance", act=leaky)),
                nn.Sequential(stage(64, 128, 2), stage(128, 128, norm="instance", act=leaky)),
                nn.Sequential(stage(128, 256, 2), stage(256, 256, dilation=2),
                              stage(256, 256, dilation=2))])
            self.dec = nn.ModuleList([nn.Sequential(stage(256 + 128, 128), stage(128, 128)),
                                      nn.Sequential(stage(128 + 64, 64, act=leaky)),
                                      nn.Sequential(stage(64 + 32, 32), stage(32, 32))])
            self.head = nn.Conv2d(32, classes, 1)

        def forward(self, image):
            skips, x = [], image
            for block in self.enc:
                x = block(x)
                skips.append(x)
            for block, skip in zip(self.dec, skips[-2::-1]):
                x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
                x = block(torch.cat((x, skip), 1))
            return self.head(x)

    return SegUNet()


def _convtranspose_decoder():
    from torch import nn

    def down(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1), nn.GroupNorm(8, cout), nn.SiLU())

    def up(cin, cout):
        return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.GroupNorm(8, cout),
                             nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout),
                             nn.SiLU())

    class AutoEncoder(nn.Module):
        def __init__(self, latent=4):
            super().__init__()
            self.encoder = nn.Sequential(down(3, 64), down(64, 128), down(128, 256),
                                         nn.Conv2d(256, 2 * latent, 1))
            self.decoder = nn.Sequential(nn.Conv2d(latent, 256, 3, padding=1), up(256, 128),
                                         up(128, 64), up(64, 32), nn.Conv2d(32, 3, 3, padding=1),
                                         nn.Tanh())
            self.latent = latent

        def forward(self, image):
            mean = self.encoder(image)[:, :self.latent]
            return self.decoder(mean)

    return AutoEncoder()


# -- the catalogue --------------------------------------------------------------------------------

def _model(name, family, label, factory, size, outputs=("logits",)) -> ZooModel:
    return ZooModel(name, family, TOOL, label, _builder(name, factory, size, list(outputs)),
                    _image(size))


MODELS: list[ZooModel] = [
    _model("efficientnet_b0", "cnn",
           "EfficientNet-B0 224² (MBConv, SiLU, SE, dw 3x3/5x5, 5.3 M)", _efficientnet_b0, 224),
    _model("mobilenetv3_small", "cnn",
           "MobileNetV3-Small 224² (HardSwish, HardSigmoid SE, dw, 2.5 M)",
           _mobilenetv3_small, 224),
    _model("regnety_400mf", "cnn",
           "RegNetY-400MF 224² (grouped 3x3 width 8, SE, ReLU, 4.3 M)", _regnety_400mf, 224),
    _model("shufflenetv2_x1", "cnn",
           "ShuffleNetV2 x1.0 224² (channel split and shuffle, dw, 2.3 M)", _shufflenetv2_x1, 224),
    _model("densenet121", "cnn",
           "DenseNet-121 224² ([6,12,24,16], growth 32, concat-heavy, 8.0 M)", _densenet121, 224),
    _model("yolov8n", "detection",
           "YOLOv8n 640² (C2f, SPPF, PAN, DFL box decode, 80 classes, 3.2 M)", _yolov8n, 640,
           ("output0",)),
    _model("seg_unet_gn", "segmentation",
           "UNet 256² (GroupNorm, InstanceNorm, dilated and stride-2 convs, bilinear Resize)",
           _seg_unet_gn, 256),
    _model("convtranspose_decoder", "segmentation",
           "conv autoencoder 128² (stride-2 convs, ConvTranspose 4x4/2 up, GroupNorm, SiLU)",
           _convtranspose_decoder, 128, ("reconstruction",)),
]
