"""What shape a request's output must have: a JSON schema, any JSON object, a regex, one of
a list of strings, an EBNF grammar, or an xgrammar structural tag (free text in which
tagged parts, such as tool calls, must match their JSON schemas).

Pure Python: the server builds it from `response_format`, `structured_outputs` or tools,
the engine compiles it (xgrammar) and masks each step's logits with it. Frozen, it is
itself the key the engine caches compiled grammars by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutputs:
    kind: Kind
    # json: the schema as canonical JSON text; regex / grammar: the pattern or EBNF text;
    # choice: the choices as a JSON list; structural_tag: xgrammar's structural tag as JSON
    # text; json_object: "".
    spec: str = ""
    # json only: properties and items the schema does not name are not allowed (OpenAI's
    # `strict`, xgrammar's strict mode); False follows JSON Schema's open default.
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in get_args(Kind):
            raise ValueError(f"structured_outputs kind must be one of {get_args(Kind)}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_outputs.{self.kind} must not be empty")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, strict: bool = True) -> StructuredOutputs:
        # Key order kept: the grammar writes properties in the schema's order, and clients
        # rely on it (a "reasoning" field before the "answer" it leads to).
        return cls("json", json.dumps(schema, ensure_ascii=False), strict)

    @classmethod
    def choices(cls, options: list[str]) -> StructuredOutputs:
        if not options:
            raise ValueError("structured_outputs.choice must list at least one string")
        return cls("choice", json.dumps(options, ensure_ascii=False))
