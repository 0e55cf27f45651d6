"""Schemathesis fuzzes a live server from its own /openapi.json: the spec must be the truth.

Schemathesis's own run (what `st run` does, through its Python API) goes through its
examples, coverage, fuzzing and stateful phases with every default check: no server
errors; documented status codes, content types and response schemas; schema-valid
requests accepted; schema-invalid ones rejected; unsupported methods answered 405. A fixed
seed and a few examples per operation keep it repeatable and short (~20 s, mostly the
coverage phase's ~1,500 requests). (Not `schemathesis.pytest.from_fixture`: with pytest
9.2 it fails setting a test node's private `_nodeid`.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from pydantic import ValidationError
from schemathesis.core import NOT_SET
from schemathesis.engine import Status, events

from engine.structured_output.grammar_cache import GrammarCache
from server.errors import OpenAIError
from server.protocol import (
    SEED_MAX,
    SEED_MIN,
    ChatCompletionRequest,
    CompletionRequest,
)
from server.tokens import apply_chat_template, encode_chat, encode_prompt
from server.tool_calls import output_constraint, template_tools
from tests.engine.tiny_models import VOCAB_SIZE, default_tokenizer
from tests.server.conftest import RunningServer, make_engine, running_server

# A short context and few sequences per request keep every generated request cheap.
FUZZ_MAX_MODEL_LEN = 64
FUZZ_MAX_SEQS = 8
SEED = 20240611
MAX_EXAMPLES = 10


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir) -> Iterator[RunningServer]:
    engine = make_engine(tiny_model_dir, max_model_len=FUZZ_MAX_MODEL_LEN)
    with running_server(engine, max_seqs_per_request=FUZZ_MAX_SEQS) as s:
        yield s


@pytest.mark.timeout(300)
def test_schemathesis_finds_no_failure(fuzz_server: RunningServer) -> None:
    config = schemathesis.Config.from_dict(
        {"seed": SEED, "generation": {"max-examples": MAX_EXAMPLES}}
    )
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=config)

    @schema.hook
    def filter_case(_: Any, case: schemathesis.Case) -> bool:
        if case.meta is None or not case.meta.generation.mode.is_positive:
            return True
        # Its own tokenizer: the server's is busy in other threads.
        return not breaks_an_unstated_rule(case.operation.path, case.body, default_tokenizer())

    problems, num_cases = run_schemathesis(schema)
    assert num_cases > 0
    assert not problems, "\n\n".join(problems)


def run_schemathesis(schema: Any) -> tuple[list[str], int]:
    """Every failed check and error of a whole schemathesis run, and how many cases ran."""
    problems: list[str] = []
    num_cases = 0
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            num_cases += len(event.recorder.cases)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        case = event.recorder.cases[case_id].value
                        problems.append(_describe(event.recorder.label, check, case))
        elif isinstance(event, events.NonFatalError):
            problems.append(f"{event.label}: error: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            problems.append(f"schemathesis failed: {event.exception!r}")
    return problems, num_cases


def _describe(label: str, check: Any, case: schemathesis.Case) -> str:
    failure = check.failure_info.failure
    phase = "?"
    if case.meta is not None:
        description = getattr(case.meta.phase.data, "description", None)
        phase = f"{case.meta.phase.name.value}: {description}"
    # The body as sent: the report's curl masks fields that look like secrets (`tokens`).
    body = json.dumps(case.body, ensure_ascii=True)[:2000] if case.body is not NOT_SET else ""
    return f"{label} [{check.name}, {phase}] {failure.title}: {failure.message}\n{body}"


def breaks_an_unstated_rule(path: str, body: Any, tokenizer: Any) -> bool:
    """Whether a schema-valid body breaks a rule JSON Schema cannot state.

    These rules relate two fields, or a field to the prompt's length in tokens; the server
    answers 400 to a request that breaks one, and the spec states them in its request
    descriptions only.
    """
    model = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    if path not in model or not isinstance(body, dict):
        return False
    # Not a rule but schemathesis's rounding: it reads the int64 bound 2**63 - 1 through a
    # float (9223372036854776000) and sends a "near-boundary" seed past it.
    if isinstance(body.get("seed"), int) and not SEED_MIN <= body["seed"] <= SEED_MAX:
        return True
    try:
        req = model[path].model_validate(body)
    except ValidationError:
        return False  # refused for a stated rule: schemathesis reports it
    if not _constraint_compiles(req, tokenizer):
        return True
    try:
        lengths, max_tokens = _prompt_lengths(req, tokenizer)
    except OpenAIError:
        return False
    n = req.num_choices
    if getattr(req, "best_of", None) not in (None, n) or len(lengths) * n > FUZZ_MAX_SEQS:
        return True
    room = FUZZ_MAX_MODEL_LEN - max(lengths)
    wanted = max(room, 1) if max_tokens is None else max_tokens
    return wanted > room or (req.min_tokens or 0) > wanted


def _constraint_compiles(req: Any, tokenizer: Any) -> bool:
    """Whether the request's output constraint is one (at most) that compiles, and its tools
    (if any) can be used with this template: the rules JSON Schema cannot state for them."""
    try:
        if isinstance(req, ChatCompletionRequest):
            req.check_tools()
            constraint = output_constraint(req)
            template_tools(req, tokenizer.chat_template)
        else:
            constraint = req.structured_output()
        if constraint is not None:
            _grammars(tokenizer).compile(constraint[0])
    except (OpenAIError, ValueError):
        return False
    return True


@functools.cache
def _grammars(tokenizer: Any) -> GrammarCache:
    return GrammarCache(tokenizer, VOCAB_SIZE, [])


def _prompt_lengths(req: Any, tokenizer: Any) -> tuple[list[int], int | None]:
    """Each prompt's length in tokens, and the max_tokens asked for, as the server counts."""
    if isinstance(req, CompletionRequest):
        lengths = [
            len(encode_prompt(tokenizer, p, VOCAB_SIZE, "prompt")) for p in req.prompt_list()
        ]
        return lengths, req.max_tokens
    tools = template_tools(req, tokenizer.chat_template)
    text = apply_chat_template(
        tokenizer, req.conversation(), req.add_generation_prompt is not False, tools
    )
    return [len(encode_chat(tokenizer, text))], req.requested_max_tokens()
