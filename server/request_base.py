"""What every request schema of the server is built on, whichever API it belongs to
(OpenAI's in server/protocol.py, Anthropic's Messages in server/messages.py, OpenAI's
Responses in server/responses.py).

The request models are the request schemas of /openapi.json, so every rule that can be
said in JSON Schema is said in them: single-field bounds as pydantic constraints, rules
between fields as `json_schema_extra` (`only_with`, `schema_extra`). Limits only the
running server knows (vocabulary, context, served model name) are marked with
`server_limit` and filled in by server/openapi.py. Every model is strict about JSON types
and keeps unknown fields (`OpenAIBaseModel`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

LIMIT_KEY = "x-pagedserve-limit"


def server_limit(name: str) -> dict[str, Any]:
    """A field's json_schema_extra marking a limit only the running server knows."""
    return {LIMIT_KEY: name}


NonEmptyStr = Annotated[str, Field(min_length=1)]
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra=server_limit("max_tokens"))]
# OpenAI's rule for function names (Anthropic's tool names follow it too).
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]

# What `validation.reject_unsupported` lets through: the empty values.
UNSET_SCHEMA: dict[str, Any] = {
    "description": "Not supported by this server: only an empty value is accepted.",
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"const": ""},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
    ],
}


def only_with(field: str, schema: dict[str, Any], needs: str, value: Any) -> dict[str, Any]:
    """JSON Schema for "`field`, when it matches `schema`, needs `needs` == `value`"."""
    return {
        "if": {"required": [field], "properties": {field: schema}},
        "then": {"required": [needs], "properties": {needs: {"const": value}}},
    }


def schema_extra(unsupported: tuple[str, ...] = (), rules: tuple[dict[str, Any], ...] = ()) -> Any:
    """A model's json_schema_extra: its unsupported fields and its rules between fields."""

    def extra(schema: dict[str, Any]) -> None:
        schema.setdefault("properties", {}).update(dict.fromkeys(unsupported, UNSET_SCHEMA))
        if rules:
            schema["allOf"] = list(rules)

    return extra


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (and reported by unknown_fields), not rejected. NaN and
    # infinity (Python's json parses them) are refused: no sampling option means them.
    # Strict: JSON types only, as OpenAI does; "yes" is not true and "5" is not 5.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, data: Any) -> Any:
        # JSON has one number type, and JSON Schema counts 5.0 as an integer; Python's json
        # reads it as a float, which strict validation would refuse for an integer field.
        return integral_floats_as_ints(data)


def integral_floats_as_ints(value: Any) -> Any:
    """A copy of a parsed JSON value with every integral float an int. Iterative: the body
    reader bounds the nesting, but pydantic also validates plain Python values."""
    if not isinstance(value, dict | list):
        return _integral(value)
    root: Any = {} if isinstance(value, dict) else [None] * len(value)
    stack = [(value, root)]
    while stack:
        source, copy = stack.pop()
        for key, item in source.items() if isinstance(source, dict) else enumerate(source):
            if isinstance(item, dict | list):
                copy[key] = {} if isinstance(item, dict) else [None] * len(item)
                stack.append((item, copy[key]))
            else:
                copy[key] = _integral(item)
    return root


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value
