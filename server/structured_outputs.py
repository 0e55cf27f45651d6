"""A request's output constraint: its `response_format`, vLLM's `structured_outputs` or the
older `guided_*` fields translated to the engine's `StructuredOutputs`.

Each constraint travels with the request field it came from (`Constraint`), so that a
400 (two constraints given, one that does not compile) names that field. A chat
request's tools give their constraint in server/tool_calls.py; `at_most_one_constraint`
is where the two meet.
"""

from __future__ import annotations

from typing import Any

from engine import StructuredOutputs
from server import json_body
from server.errors import bad_request
from server.protocol import (
    JsonSchemaValue,
    ResponseFormat,
    SamplingFields,
    StructuredOutputsParam,
)

# A constraint and the request field it came from.
Constraint = tuple[StructuredOutputs, str]

_GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The output constraint and the field it came from; 400 when more than one is set."""
    found = []
    if req.response_format is not None:
        found.append(_from_response_format(req.response_format))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    for kind in _GUIDED_KINDS:
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((_spec(kind, value, f"guided_{kind}"), f"guided_{kind}"))
    return at_most_one_constraint([f for f in found if f is not None])


def at_most_one_constraint(found: list[Constraint]) -> Constraint | None:
    """The one constraint found, if any; 400 naming the second when there are more."""
    if len(found) > 1:
        names = " and ".join(f"`{param}`" for _, param in found)
        raise bad_request(f"Only one output constraint may be given; got {names}.",
                          param=found[1][1])  # fmt: skip
    return found[0] if found else None


def _json_schema_value(value: JsonSchemaValue | str, param: str) -> JsonSchemaValue:
    """vLLM accepts a schema as an object or as JSON text."""
    if not isinstance(value, str):
        return value
    parsed = json_body.loads_field(value, param)
    if not isinstance(parsed, dict | bool):
        raise bad_request(f"`{param}` must be a JSON schema object.", param=param)
    return parsed


def _from_structured_outputs(so: StructuredOutputsParam) -> Constraint:
    given = [
        (name, value)
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None))
        if value is not None
    ]  # fmt: skip
    if len(given) != 1:
        raise bad_request(
            "`structured_outputs` takes exactly one of json, regex, choice, grammar and "
            f"json_object; got {len(given)}.",
            param="structured_outputs",
        )
    name, value = given[0]
    param = f"structured_outputs.{name}"
    return _spec(name, value, param), param


def _spec(kind: str, value: Any, param: str, strict: bool = True) -> StructuredOutputs:
    """The engine's constraint of one kind (json, regex, choice, grammar, json_object)."""
    if kind == "json":
        return StructuredOutputs.json_schema(_json_schema_value(value, param), strict)
    if kind == "choice":
        return StructuredOutputs.choices(list(value))
    if kind == "json_object":
        return StructuredOutputs("json_object")
    return StructuredOutputs(kind, value)  # type: ignore[arg-type]


def _from_response_format(rf: ResponseFormat) -> Constraint | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputs("json_object"), "response_format"
    param = "response_format.json_schema"
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("`response_format` of type json_schema needs `json_schema.schema`.",
                          param=param)  # fmt: skip
    strict = rf.json_schema.strict is not False
    param = f"{param}.schema"
    return _spec("json", rf.json_schema.schema_, param, strict), param
