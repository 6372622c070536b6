"""The broad benchmark's model zoo (issue 45): architectures of many families, each made here by
the tool users make such files with (torch.onnx, onnxruntime's optimiser and quantisers,
onnxconverter-common, skl2onnx / onnxmltools), with seeded random weights. Nothing is downloaded.

Each family module (cnn, sequence, quantized) lists its models as `MODELS`; `models()` gathers
them. A model's `build(out_dir)` writes its .onnx file there and returns its path (torch and
the tools are imported inside `build`, so listing the zoo needs only numpy); `inputs(batch,
rng)` makes its feeds with numpy.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

FAMILY_MODULES = ("cnn", "sequence", "quantized")


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str     # cnn, detection, segmentation, audio, transformer, decoder, quantized, trees, control-flow
    tool: str       # what made the file: "torch.onnx dynamo", "ort quantize_dynamic", "skl2onnx"...
    label: str      # one line: the architecture and what it exercises
    build: Callable[[str], str]                                   # out_dir -> .onnx path
    inputs: Callable[[int, np.random.Generator], dict]            # batch, rng -> feeds
    batches: tuple[int, ...] = (1, 8)                             # () where the model does not batch


def models() -> dict[str, ZooModel]:
    """name -> ZooModel, over the family modules that import."""
    found: dict[str, ZooModel] = {}
    for module in FAMILY_MODULES:
        try:
            family = importlib.import_module(f"zoo.{module}")
        except ImportError:
            continue
        for model in family.MODELS:
            found[model.name] = model
    return found


def source_digest() -> str:
    """A digest of the zoo's code and cpu_models.py (which some zoo models export from): a
    cached file made from other code is built again."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, f) for f in sorted(os.listdir(here)) if f.endswith(".py")]
    files.append(os.path.join(os.path.dirname(here), "cpu_models.py"))
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def written(out_dir: str, name: str):
    """Yields a temporary path in out_dir; on success it becomes out_dir/NAME.onnx, so that
    a build that fails half-way leaves no file a later run would take for a model."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.onnx")
    tmp = os.path.join(out_dir, f"{name}.{os.getpid()}.tmp.onnx")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def quiet():
    """No warnings, prints or log records below ERROR while a tool builds a file (the
    exporters and the quantisers log their passes and advice)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
