"""The ONNX schemas an op's node is read against: its domain's canonical name, the schema in
force at an opset, and the attribute defaults it declares. The importer validates with them and
the op registry binds with them; they depend on onnx's schema tables only."""
from __future__ import annotations

import functools
from typing import Any

import onnx
from onnx import defs

from ember.importer.onnx_values import decode_attribute

_DEFAULT_DOMAINS = ("", "ai.onnx")


def normalize_domain(domain: str) -> str:
    return "" if domain in _DEFAULT_DOMAINS else domain


@functools.lru_cache(maxsize=None)
def schema_for(domain: str, op_type: str, opset: int) -> defs.OpSchema | None:
    """The ONNX schema in force for this op at this opset, or None for unknown/custom ops."""
    try:
        return defs.get_schema(op_type, opset, domain)
    except (defs.SchemaError, TypeError, OverflowError):  # unknown op; opset past int32
        return None


@functools.lru_cache(maxsize=None)
def attribute_defaults(domain: str, op_type: str, opset: int) -> tuple[dict[str, Any], frozenset[str]]:
    """Defaults declared by the ONNX schema, and the names of required attributes."""
    schema = schema_for(domain, op_type, opset)
    if schema is None:
        return {}, frozenset()
    defaults: dict[str, Any] = {}
    required = set()
    for name, attr in schema.attributes.items():
        if attr.required:
            required.add(name)
        elif attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            defaults[name] = decode_attribute(attr.default_value)
        else:
            defaults[name] = None
    return defaults, frozenset(required)
