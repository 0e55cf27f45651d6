"""Refuse a JSON schema the grammar compiler would silently get wrong.

xgrammar compiles most of JSON Schema, but it ignores a few keywords without a word
(measured with xgrammar 0.2.8: an instance that breaks `not`, `if`/`then`/`else` or the
second schema of an `allOf` is still generated), and it accepts schemas that are not
valid JSON Schema at all (`"minItems": -1`). Either would hand the client output that
fails its own validator, so both are a 400 naming the place in the schema.
"""

from __future__ import annotations

from typing import Any

import jsonschema

# Keywords whose value is a schema or a list of schemas (and below, _MAP: name -> schema):
# the walk follows only these, so a property *named* "not" is never mistaken for one.
_SCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
            "unevaluatedProperties", "not", "if", "then", "else", "prefixItems", "allOf",
            "anyOf", "oneOf")  # fmt: skip
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

UNSUPPORTED = {
    "not": "`not` is not supported",
    "if": "`if`/`then`/`else` are not supported",
    "then": "`if`/`then`/`else` are not supported",
    "else": "`if`/`then`/`else` are not supported",
    "$dynamicRef": "`$dynamicRef` is not supported",
}


def check_json_schema(schema: Any) -> None:
    """ValueError naming what is wrong: not valid JSON Schema, or a keyword not honoured."""
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _pointer(exc.path)
        raise ValueError(f"is not a valid JSON Schema: {exc.message} (at {where})") from None
    _check_supported(schema, ())


def _check_supported(schema: Any, path: tuple[str, ...]) -> None:
    if isinstance(schema, list):  # prefixItems, anyOf, ...; also draft 7's `items: [...]`
        for i, sub in enumerate(schema):
            _check_supported(sub, (*path, str(i)))
        return
    if not isinstance(schema, dict):
        return
    for keyword, reason in UNSUPPORTED.items():
        if keyword in schema:
            raise ValueError(f"{reason} (at {_pointer((*path, keyword))})")
    if len(schema.get("allOf", ())) > 1:
        raise ValueError(f"`allOf` with more than one schema is not supported (at "
                         f"{_pointer((*path, 'allOf'))})")  # fmt: skip
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"only local `$ref`s (\"#/...\") are supported, got {ref!r} "
                         f"(at {_pointer((*path, '$ref'))})")  # fmt: skip
    for keyword in _SCHEMAS:
        _check_supported(schema.get(keyword), (*path, keyword))
    for keyword in _MAP:
        for name, sub in (schema.get(keyword) or {}).items():
            _check_supported(sub, (*path, keyword, name))


def _pointer(path: Any) -> str:
    """A JSON Pointer ("#/properties/a") for an error message."""
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "#/" + "/".join(parts) if parts else "#"
