"""docs/reference.md's routes and request bodies (server/reference.py writes the file), read
from the app's own OpenAPI schema (`GET /openapi.json`), so a route or field added to the
app is in the reference once it is regenerated.

The app is built over `StandInEngine`, which holds only the facts `/openapi.json` reads
(the default model's name, vocabulary and context length): no model is loaded. It has the
routes of a server of several models too (server/model_routes.py), over a router of that
one stand-in model, which never loads.
"""

from __future__ import annotations

import json
from typing import Any

# The default model's facts (SmolLM2-135M-Instruct), which fill in the schema's limits.
STAND_IN_FACTS = {"model_name": "SmolLM2-135M-Instruct", "vocab_size": 49152,
                  "max_model_len": 8192}  # fmt: skip
REF = "#/components/schemas/"


def cell(text: object) -> str:
    """`text` fit for one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


class StandInEngine:
    """What `build_app` and `/openapi.json` read of an engine client; nothing runs."""

    tokenizer = None
    metrics = None
    model_name = STAND_IN_FACTS["model_name"]
    vocab_size = STAND_IN_FACTS["vocab_size"]
    max_model_len = STAND_IN_FACTS["max_model_len"]


def app_and_schema() -> tuple[Any, dict[str, Any]]:
    from server.app import build_app
    from server.model_registry import ModelEntry, ModelRegistry
    from server.model_router import ModelRouter

    stand_in = ModelRegistry([ModelEntry(StandInEngine.model_name, "", 0)])
    router = ModelRouter(stand_in, loader=StandInEngine)  # type: ignore[arg-type]
    app = build_app(StandInEngine(), models=router)  # type: ignore[arg-type]
    return app, app.openapi()


# -- types -----------------------------------------------------------------------------


def type_text(node: dict[str, Any]) -> str:
    """A JSON schema in a few words: `integer in [1, 128]`, `string | array of string`."""
    if "$ref" in node:
        return node["$ref"].removeprefix(REF)
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " | ".join(f"`{json.dumps(value)}`" for value in node["enum"])
    for combinator in ("anyOf", "oneOf"):
        if combinator in node:
            options = [type_text(option) for option in node[combinator]]
            return " | ".join(dict.fromkeys(options))
    kind = node.get("type", "any")
    if kind == "array":
        return f"array of {type_text(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"object of {type_text(node['additionalProperties'])}"
    return kind + _bounds(node)


def _bounds(node: dict[str, Any]) -> str:
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if low is None and high is None:
        return ""
    left = "(" if "exclusiveMinimum" in node else "["
    right = ")" if "exclusiveMaximum" in node else "]"
    return f" in {left}{_number(low, '-inf')}, {_number(high, 'inf')}{right}"


def _number(value: float | None, unbounded: str) -> str:
    if value is None:
        return unbounded
    if abs(value) >= 2**53:
        return f"{'-' if value < 0 else ''}2^{round(abs(value)).bit_length() - 1}"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def refs(node: Any) -> list[str]:
    """The component names `node` refers to, in order of first mention."""
    found: list[str] = []
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            found.append(node["$ref"].removeprefix(REF))
        for value in node.values():
            found += refs(value)
    elif isinstance(node, list):
        for value in node:
            found += refs(value)
    return list(dict.fromkeys(found))


# -- routes ----------------------------------------------------------------------------


def _body_name(operation: dict[str, Any]) -> str:
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema", {})
    name = schema.get("$ref", "").removeprefix(REF)
    return f"[{name}](#{name.lower()})" if name else ""


def _answer(operation: dict[str, Any]) -> str:
    ok = operation.get("responses", {}).get("200", {}).get("content", {})
    parts = []
    for media, body in ok.items():
        name = body.get("schema", {}).get("$ref", "").removeprefix(REF)
        parts.append(f"{name} ({media})" if name else media)
    return "; ".join(parts)


def routes_section() -> list[str]:
    app, schema = app_and_schema()
    lines = [
        "## HTTP routes",
        "",
        "From the app's OpenAPI schema (`GET /openapi.json`; built by `server/app.py`). "
        "Errors come in the OpenAI shape (Anthropic's on `/v1/messages`); the running "
        "server's schema fills in its own model's limits.",
        "",
        "| method | path | request body | 200 answer | errors | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            errors = ", ".join(code for code in op.get("responses", {}) if code != "200")
            about = (op.get("description") or op.get("summary", "")).split("\n\n")[0]
            row = (method.upper(), f"`{path}`", _body_name(op), _answer(op), errors, cell(about))
            lines.append("| " + " | ".join(row) + " |")
    hidden = sorted(
        f"`{method} {route.path}`"
        for route in app.routes
        if not getattr(route, "include_in_schema", True)
        for method in sorted(getattr(route, "methods", ()) - {"HEAD"})
    )
    lines += ["", "Also served, outside the schema: " + ", ".join(hidden) + "."]
    return lines


# -- request bodies --------------------------------------------------------------------


def request_components(schema: dict[str, Any]) -> list[str]:
    """Every component a request body uses, the bodies first, then what they refer to."""
    bodies = [
        operation["requestBody"]
        for operations in schema["paths"].values()
        for operation in operations.values()
        if "requestBody" in operation
    ]
    todo = refs(bodies)
    components = schema["components"]["schemas"]
    seen: list[str] = []
    while todo:
        name = todo.pop(0)
        if name not in seen:
            seen.append(name)
            todo += [n for n in refs(components[name]) if n not in seen]
    return seen


def _field_row(name: str, node: dict[str, Any], required: bool) -> str:
    default = json.dumps(node["default"]) if "default" in node else ""
    row = (f"`{name}`", cell(type_text(node)), "yes" if required else "",
           cell(f"`{default}`" if default else ""), cell(node.get("description", "")))  # fmt: skip
    return "| " + " | ".join(row) + " |"


def component_lines(name: str, node: dict[str, Any]) -> list[str]:
    lines = [f"### {name}", ""]
    if node.get("description"):
        lines += [" ".join(node["description"].split()), ""]
    properties = node.get("properties", {})
    if not properties:
        return [*lines, f"Type: {cell(type_text(node))}."]
    required = set(node.get("required", ()))
    lines += ["| field | type | required | default | note |", "| --- | --- | --- | --- | --- |"]
    return lines + [_field_row(f, p, f in required) for f, p in properties.items()]


def bodies_section() -> list[str]:
    _, schema = app_and_schema()
    lines = [
        "## Request bodies",
        "",
        "Every field of every request body and of the objects inside them, from the same "
        f"schema. Limits are shown for the default model ({STAND_IN_FACTS['model_name']}: "
        f"vocabulary {STAND_IN_FACTS['vocab_size']}, context {STAND_IN_FACTS['max_model_len']}"
        " tokens) and the default `--max-seqs-per-request`. Unknown fields are ignored with a "
        'logged warning; a field noted "Not supported" takes only an empty value.',
    ]
    components = schema["components"]["schemas"]
    for name in request_components(schema):
        lines += ["", *component_lines(name, components[name])]
    return lines
