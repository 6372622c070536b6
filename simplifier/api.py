"""`ember.simplify`: an ONNX model in, a simplified ONNX model out (what `ember simplify`
writes), as onnx-simplifier's `simplify` does.

    import ember
    simplified = ember.simplify("model.onnx")                        # portable ONNX
    simplified = ember.simplify(proto, input_shapes={"x": [1, 3, 224, 224]})
    fused = ember.simplify("model.onnx", target="ember:opencl")      # ember's fused ops kept

target "onnx" (the default) keeps standard ONNX at the model's own opsets, for any runtime;
"ember" or "ember:BACKEND" lets the simplifier use ember's fused ops for that backend (ember
loads them; other runtimes do not).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import onnx

from ember.errors import InputError
from ember.importer import ModelSource, import_model
from ember.importer.onnx_export import export_model
from ember.ir import Model, TensorType, ValueInfo
from ember.ops.registry import BACKENDS


def parse_target(target: str) -> tuple[bool, str]:
    """(portable, backend) for a target: "onnx", "ember" or "ember:BACKEND"."""
    if target == "onnx":
        return True, "cpu"
    kind, _, backend = target.partition(":")
    backend = backend or "cpu"
    if kind != "ember" or backend not in BACKENDS:
        raise InputError(f"target {target!r}: expected onnx, ember or ember:BACKEND with a "
                         f"backend of {', '.join(BACKENDS)}")
    return False, backend


def fix_input_shapes(model: Model, shapes: Mapping[str, Sequence[int]]) -> None:
    """Give graph inputs these fixed shapes (before folding, so shape arithmetic folds)."""
    inputs = {v.name: i for i, v in enumerate(model.graph.inputs)}
    for name, dims in shapes.items():
        if name not in inputs:
            raise InputError(f"--input-shape {name}: the model has no input {name!r}; its "
                             f"inputs are {', '.join(inputs) or 'none'}")
        info = model.graph.inputs[inputs[name]]
        if not isinstance(info.type, TensorType):
            raise InputError(f"--input-shape {name}: the input is not a tensor")
        dims = [int(d) for d in dims]
        if any(d < 0 for d in dims):
            raise InputError(f"--input-shape {name}: sizes must be >= 0, got {dims}")
        declared = info.type.shape
        if declared is not None and len(declared) != len(dims):
            raise InputError(f"--input-shape {name}: the input has rank {len(declared)}, "
                             f"got {len(dims)} sizes")
        for axis, (want, got) in enumerate(zip(declared or (), dims)):
            if isinstance(want, int) and want > 0 and want != got:
                raise InputError(f"--input-shape {name}: dimension {axis} is fixed at {want}, "
                                 f"got {got}")
        model.graph.inputs[inputs[name]] = ValueInfo(
            name, TensorType(info.type.dtype, tuple(dims)), info.doc)


def parse_input_shapes(specs: Iterable[str]) -> dict[str, list[int]]:
    """NAME:D1,D2,... (the CLI's --input-shape) -> {NAME: [D1, D2, ...]}."""
    shapes = {}
    for spec in specs:
        name, sep, dims = spec.rpartition(":")
        try:
            values = [int(d) for d in dims.split(",")] if dims else []
        except ValueError:
            values = None
        if not sep or not name or values is None:
            raise InputError(f"--input-shape {spec!r}: expected NAME:D1,D2,... "
                             "(e.g. x:1,3,224,224)")
        shapes[name] = values
    return shapes


def simplify_model(source: ModelSource | Model, target: str = "onnx",
                   input_shapes: Mapping[str, Sequence[int]] | None = None,
                   skip: Iterable[str] = (), stats: dict | None = None) -> Model:
    """The simplified IR of `source` (a path, bytes, a ModelProto or ember IR, never
    modified)."""
    from ember.simplifier import copy_structure, simplify

    portable, backend = parse_target(target)
    model = copy_structure(source) if isinstance(source, Model) else import_model(source)
    if input_shapes:
        fix_input_shapes(model, input_shapes)
    return simplify(model, backend=backend, skip=skip, stats=stats, portable=portable)


def simplify_onnx(source: ModelSource | Model, target: str = "onnx",
                  input_shapes: Mapping[str, Sequence[int]] | None = None,
                  skip: Iterable[str] = ()) -> onnx.ModelProto:
    """`ember.simplify`: see the module docstring."""
    return export_model(simplify_model(source, target, input_shapes, skip))
