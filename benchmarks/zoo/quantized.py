"""The zoo's post-processed and classical models: files as users make them with onnxruntime's
transformer optimizer and quantisers, onnxconverter-common's float16 converter, skl2onnx and
onnxmltools.

The float sources are benchmarks/cpu_models.py's architectures (BERT-base, MobileNetV2,
ResNet-50, ViT-S/16): an up-to-date export in bench_cpu's cache is reused, anything else is
exported into a temporary folder. The transformer optimizer is given BERT through the classic
TorchScript exporter (opset 17), the export its attention fusion matches; torch.onnx's dynamo
graph fuses only the norms and GELUs. Static quantisation calibrates on a few seeded random
batches. The tree ensembles are fitted on a seeded synthetic classification problem.

| name              | tool                        | what it exercises                            |
|-------------------|-----------------------------|----------------------------------------------|
| bert_ort_opt      | ort transformers optimizer  | Attention, SkipLayerNormalization, BiasGelu  |
| bert_int8_dynamic | ort quantize_dynamic        | QAttention, MatMulInteger, DynamicQuantize.. |
| mobilenetv2_qdq   | ort quantize_static (QDQ)   | per-channel Q/DQ around Conv, Add, Gemm      |
| mobilenetv2_qop   | ort quantize_static (QOp)   | QLinearConv, QLinearAdd, QGemm               |
| resnet50_qdq      | ort quantize_static (QDQ)   | per-channel Q/DQ, ResNet-50                  |
| vit_fp16          | onnxconverter-common fp16   | float16 attention, LayerNorm, Gelu           |
| random_forest     | skl2onnx                    | TreeEnsembleClassifier, 100 trees depth 10   |
| lightgbm          | onnxmltools                 | TreeEnsembleClassifier, 100 trees 31 leaves  |
| xgboost           | onnxmltools                 | TreeEnsembleClassifier, 100 trees depth 6    |
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Callable

import numpy as np

from . import ZooModel, quiet, written

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES, CLASSES = 20, 3
CALIBRATION_BATCHES = 4


def _cpu_models():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import cpu_models

    return cpu_models


def _float_source(name: str, work: str) -> str:
    """cpu_models' export of `name`: bench_cpu's cached copy when up to date, else a fresh
    export into `work`."""
    cpu_models = _cpu_models()
    import torch

    cache = os.path.join(cpu_models.REPO, ".cache", f"bench-models-{torch.__version__}")
    found = cpu_models.cached(name, cache)
    if found is not None:
        return found[0]
    cpu_models.export(name, work)
    return os.path.join(work, f"{name}.onnx")


def _classic_export(name: str, path: str) -> None:
    """cpu_models' `name` (same seed and weights as its export) through the TorchScript
    exporter at opset 17, batch dynamic."""
    cpu_models = _cpu_models()
    import torch

    torch.manual_seed(0)
    module = cpu_models._modules()[name]().eval()
    cpu_models._shared_models().randomize_batchnorm(module)
    example = cpu_models.make_inputs(name, 2)
    names, outputs = list(example), cpu_models.SPECS[name].outputs
    args = tuple(torch.from_numpy(v) for v in example.values())
    with quiet(), torch.no_grad():
        torch.onnx.export(module, args, path, dynamo=False, opset_version=17,
                          input_names=names, output_names=outputs,
                          dynamic_axes={n: {0: "batch"} for n in names + outputs})


def _torch_inputs(source: str) -> Callable[[int, np.random.Generator], dict]:
    def make(batch: int, rng: np.random.Generator) -> dict:
        return _cpu_models().SPECS[source].inputs(batch, rng)
    return make


# -- transformers: optimised, dynamically quantised, float16 ----------------------------------

def _optimized_bert(path: str) -> None:
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    with tempfile.TemporaryDirectory() as work:
        source = os.path.join(work, "bert_base.onnx")
        _classic_export("bert_base", source)
        with quiet():
            model = optimizer.optimize_model(source, model_type="bert", num_heads=12,
                                             hidden_size=768, opt_level=0, use_gpu=False,
                                             optimization_options=FusionOptions("bert"))
        model.save_model_to_file(path)


def _build_bert_ort_opt(out_dir: str) -> str:
    with written(out_dir, "bert_ort_opt") as tmp:
        _optimized_bert(tmp)
    return os.path.join(out_dir, "bert_ort_opt.onnx")


def _build_bert_int8_dynamic(out_dir: str) -> str:
    import onnx
    from onnxruntime import quantization

    with tempfile.TemporaryDirectory() as work, written(out_dir, "bert_int8_dynamic") as tmp:
        fused = os.path.join(work, "bert_ort_opt.onnx")
        _optimized_bert(fused)
        with quiet():
            quantization.quantize_dynamic(
                fused, tmp, weight_type=quantization.QuantType.QInt8,
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return os.path.join(out_dir, "bert_int8_dynamic.onnx")


def _build_vit_fp16(out_dir: str) -> str:
    import onnx
    from onnxconverter_common import float16

    with tempfile.TemporaryDirectory() as work, written(out_dir, "vit_fp16") as tmp:
        model = onnx.load(_float_source("vit_s16", work))
        with quiet():
            model = float16.convert_float_to_float16(model, keep_io_types=True)
        onnx.save(model, tmp)
    return os.path.join(out_dir, "vit_fp16.onnx")


# -- statically quantised CNNs ----------------------------------------------------------------

def _static(source: str, name: str, quant_format: str) -> Callable[[str], str]:
    def build(out_dir: str) -> str:
        from onnxruntime import quantization

        class Reader(quantization.CalibrationDataReader):
            def __init__(self):
                rng = np.random.default_rng(7)
                self.batches = iter([_cpu_models().SPECS[source].inputs(1, rng)
                                     for _ in range(CALIBRATION_BATCHES)])

            def get_next(self):
                return next(self.batches, None)

        with tempfile.TemporaryDirectory() as work, written(out_dir, name) as tmp:
            with quiet():
                quantization.quantize_static(
                    _float_source(source, work), tmp, Reader(),
                    quant_format=getattr(quantization.QuantFormat, quant_format),
                    per_channel=True, activation_type=quantization.QuantType.QUInt8,
                    weight_type=quantization.QuantType.QInt8)
        return os.path.join(out_dir, f"{name}.onnx")
    return build


# -- tree ensembles ---------------------------------------------------------------------------

def _tree_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=2000, n_features=FEATURES, n_informative=12,
                               n_classes=CLASSES, random_state=0)
    return x.astype(np.float32), y


def _tree_inputs(batch: int, rng: np.random.Generator) -> dict:
    return {"input": rng.standard_normal((batch, FEATURES)).astype(np.float32) * 2.0}


def _save(model, out_dir: str, name: str) -> str:
    with written(out_dir, name) as tmp:
        with open(tmp, "wb") as f:
            f.write(model.SerializeToString())
    return os.path.join(out_dir, f"{name}.onnx")


def _build_random_forest(out_dir: str) -> str:
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestClassifier

    x, y = _tree_data()
    forest = RandomForestClassifier(n_estimators=100, max_depth=10, random_state=0, n_jobs=1)
    forest.fit(x, y)
    with quiet():
        model = to_onnx(forest, initial_types=[("input", _float_tensor_type())],
                        options={"zipmap": False}, target_opset={"": 17, "ai.onnx.ml": 3})
    return _save(model, out_dir, "random_forest")


def _build_lightgbm(out_dir: str) -> str:
    import lightgbm
    import onnxmltools

    x, y = _tree_data()
    booster = lightgbm.LGBMClassifier(n_estimators=100, num_leaves=31, random_state=0,
                                      n_jobs=1, verbose=-1).fit(x, y)
    with quiet():
        model = onnxmltools.convert_lightgbm(
            booster, initial_types=[("input", _float_tensor_type(onnxmltools=True))],
            zipmap=False, target_opset=15)
    return _save(model, out_dir, "lightgbm")


def _build_xgboost(out_dir: str) -> str:
    import onnxmltools
    import xgboost

    x, y = _tree_data()
    booster = xgboost.XGBClassifier(n_estimators=100, max_depth=6, random_state=0,
                                    n_jobs=1).fit(x, y)
    with quiet():
        model = onnxmltools.convert_xgboost(
            booster, initial_types=[("input", _float_tensor_type(onnxmltools=True))],
            target_opset=15)
    return _save(model, out_dir, "xgboost")


def _float_tensor_type(onnxmltools: bool = False):
    if onnxmltools:
        from onnxmltools.convert.common.data_types import FloatTensorType
    else:
        from skl2onnx.common.data_types import FloatTensorType
    return FloatTensorType([None, FEATURES])


MODELS: list[ZooModel] = [
    ZooModel("bert_ort_opt", "transformer", "ort transformers optimizer",
             "BERT-base s128 fused: Attention, SkipLayerNormalization, BiasGelu",
             _build_bert_ort_opt, _torch_inputs("bert_base")),
    ZooModel("bert_int8_dynamic", "quantized", "ort quantize_dynamic",
             "BERT-base s128 optimised then int8: QAttention, MatMulInteger, "
             "DynamicQuantizeLinear", _build_bert_int8_dynamic, _torch_inputs("bert_base")),
    ZooModel("mobilenetv2_qdq", "quantized", "ort quantize_static QDQ",
             "MobileNetV2 224² static int8, QDQ per channel",
             _static("mobilenetv2", "mobilenetv2_qdq", "QDQ"), _torch_inputs("mobilenetv2")),
    ZooModel("mobilenetv2_qop", "quantized", "ort quantize_static QOperator",
             "MobileNetV2 224² static int8, QLinearConv / QLinearAdd / QGemm per channel",
             _static("mobilenetv2", "mobilenetv2_qop", "QOperator"),
             _torch_inputs("mobilenetv2")),
    ZooModel("resnet50_qdq", "quantized", "ort quantize_static QDQ",
             "ResNet-50 224² static int8, QDQ per channel",
             _static("resnet50", "resnet50_qdq", "QDQ"), _torch_inputs("resnet50")),
    ZooModel("vit_fp16", "transformer", "onnxconverter-common fp16",
             "ViT-S/16 224² in float16 (float32 inputs and outputs)",
             _build_vit_fp16, _torch_inputs("vit_s16")),
    ZooModel("random_forest", "trees", "skl2onnx",
             "random forest, 100 trees depth 10, 20 features, 3 classes",
             _build_random_forest, _tree_inputs),
    ZooModel("lightgbm", "trees", "onnxmltools",
             "LightGBM, 100 trees x 3 classes, 31 leaves, 20 features",
             _build_lightgbm, _tree_inputs),
    ZooModel("xgboost", "trees", "onnxmltools",
             "XGBoost, 100 trees x 3 classes, depth 6, 20 features",
             _build_xgboost, _tree_inputs),
]
