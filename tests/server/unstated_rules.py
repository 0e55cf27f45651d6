"""The request rules JSON Schema cannot state, written here from the API's documented
behaviour rather than with the server's own validators, so that schemathesis's "valid
data is accepted" check can catch a validator that wrongly answers 400.

Each rule relates two fields, or a field to the prompt's length in tokens, or to the
server's limits; the server's request descriptions (docs/reference.md) state them in
words. A body is parsed by the route's request model first: that is the stated schema,
which schemathesis checks on its own. Two rules lean on another component by nature, and
say so: whether a grammar compiles is the engine's grammar compiler's answer, and how
many tokens a prompt holds is the tokenizer's (counted on the prompt the chat template
renders). Every rule has a test of its own against the live server
(tests/server/test_server_fuzz.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.structured_output.grammar_cache import GrammarCache
from server.chat_rendering import conversation
from server.errors import OpenAIError
from server.generic_tools import declares_tools
from server.messages import CountTokensRequest, MessagesRequest, chat_request
from server.protocol import SEED_MAX, SEED_MIN, ChatCompletionRequest, CompletionRequest
from server.responses import ResponsesRequest, conversation_of
from server.responses import chat_request as responses_chat_request
from server.structured_outputs import request_constraint
from server.tokens import apply_chat_template, encode_chat
from server.tool_calls import output_constraint, template_input
from tests.engine.tiny_models import VOCAB_SIZE


@dataclass(frozen=True)
class Limits:
    """The running server's limits the rules compare against."""

    max_model_len: int
    max_seqs_per_request: int


@dataclass(frozen=True)
class Rule:
    name: str
    broken: Callable[[Any, Any, Limits], bool]  # (parsed request, tokenizer, limits)


# ------------------------------------------------------------------- the rules, by field

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _answer_constraints(req: Any) -> int:
    """How many of the structured-output fields give the answer a shape."""
    fmt = req.response_format
    return (
        int(fmt is not None and fmt.type != "text")
        + int(req.structured_outputs is not None)
        + sum(getattr(req, name) is not None for name in _GUIDED)
    )


def _forces_calls(req: Any) -> bool:
    return isinstance(req, ChatCompletionRequest) and req.tool_mode in ("required", "named")


def more_than_one_constraint(req: Any, _tok: Any, _lim: Limits) -> bool:
    """At most one output constraint: a structured-output field or forced tool calls."""
    return _answer_constraints(req) + int(_forces_calls(req)) > 1


def structured_outputs_not_one_kind(req: Any, _tok: Any, _lim: Limits) -> bool:
    """`structured_outputs` names exactly one kind (json, regex, choice, grammar,
    json_object: true)."""
    so = req.structured_outputs
    if so is None:
        return False
    kinds = [so.json_, so.regex, so.choice, so.grammar, so.json_object or None]
    return sum(k is not None for k in kinds) != 1


def tool_names_repeat(req: Any, _tok: Any, _lim: Limits) -> bool:
    names = [t.function.name for t in getattr(req, "tools", None) or ()]
    return len(set(names)) != len(names)


def named_tool_missing(req: Any, _tok: Any, _lim: Limits) -> bool:
    """A named tool_choice names a function in `tools`."""
    if not isinstance(req, ChatCompletionRequest) or req.tool_mode != "named":
        return False
    return req.tool_choice.function.name not in {t.function.name for t in req.tools or ()}


def too_many_sequences(req: Any, _tok: Any, lim: Limits) -> bool:
    """Prompts x n at most --max-seqs-per-request; best_of, where given, equal to n."""
    prompts = len(req.prompt_list()) if isinstance(req, CompletionRequest) else 1
    best_of = getattr(req, "best_of", None)
    return prompts * req.num_choices > lim.max_seqs_per_request or best_of not in (
        None,
        req.num_choices,
    )


def budget_without_think_block(req: Any, tokenizer: Any, _lim: Limits) -> bool:
    """thinking_token_budget needs a think block to cap: a template that names `<think>`
    (or `</think>`) and no output constraint (whose text starts outside any block)."""
    if getattr(req, "thinking_token_budget", None) is None:
        return False
    template = str(tokenizer.chat_template)
    if "<think>" in template or "</think>" in template:
        return False
    return _answer_constraints(req) == 0 and not _forces_calls(req)


def constraint_does_not_compile(req: Any, tokenizer: Any, _lim: Limits) -> bool:
    """The output constraint compiles: the engine's grammar compiler decides (a schema it
    cannot honour, a regex it cannot read). The constraint is built as the server builds
    it, since the grammar a set of tools means is the server's design (only where the
    tools' own rules hold: there is no grammar for a call to a function not given)."""
    if tool_names_repeat(req, tokenizer, _lim) or named_tool_missing(req, tokenizer, _lim):
        return False
    try:
        if isinstance(req, ChatCompletionRequest):
            constraint = output_constraint(req, not declares_tools(tokenizer.chat_template))
        else:
            constraint = request_constraint(req)
        if constraint is not None:
            _grammars(tokenizer).compile(constraint[0])
    except (OpenAIError, ValueError):
        return True
    return False


def does_not_fit(req: Any, tokenizer: Any, lim: Limits) -> bool:
    """Each prompt holds at least one token, and with max_tokens (or, unset, the room the
    context leaves, at least 1) fits max_model_len; min_tokens is at most that budget. The
    tokens are the tokenizer's, on the prompt the chat template renders (a template that
    refuses the messages breaks the rule too)."""
    try:
        lengths, max_tokens = _prompt_lengths(req, tokenizer)
    except OpenAIError:
        return True
    if 0 in lengths:
        return True
    room = lim.max_model_len - max(lengths)
    wanted = max(room, 1) if max_tokens is None else max_tokens
    return wanted > room or (req.min_tokens or 0) > wanted


def over_the_context(req: Any, tokenizer: Any, lim: Limits) -> bool:
    """The rendered prompt holds at most max_model_len tokens: a render is bounded to the
    bytes the context could take (engine/template_bounds.py), so past that a count_tokens
    request may be refused (400) as a chat request is."""
    try:
        lengths, _ = _prompt_lengths(req, tokenizer)
    except OpenAIError:
        return True
    return max(lengths) > lim.max_model_len


SAMPLING_RULES = (
    Rule("more than one output constraint", more_than_one_constraint),
    Rule("structured_outputs names not one kind", structured_outputs_not_one_kind),
    Rule("the constraint does not compile", constraint_does_not_compile),
    Rule("too many sequences", too_many_sequences),
    Rule("the prompt and its budget do not fit", does_not_fit),
)
TOOL_RULES = (
    Rule("tool names repeat", tool_names_repeat),
    Rule("a named tool_choice names no tool", named_tool_missing),
)
CHAT_RULES = (
    *SAMPLING_RULES,
    *TOOL_RULES,
    Rule("a thinking budget without a think block", budget_without_think_block),
)


# ------------------------------------------------------------------------------ routes


def broken_rules(path: str, body: Any, tokenizer: Any, limits: Limits) -> list[str]:
    """The names of the unstated rules a body breaks ([] for one the schema refuses: that
    is schemathesis's own check, or for a route without such rules)."""
    if not isinstance(body, dict):
        return []
    # Not a rule but schemathesis's rounding: it reads the int64 bound 2**63 - 1 through a
    # float (9223372036854776000) and sends a "near-boundary" seed past it as valid.
    seed = body.get("seed")
    if isinstance(seed, int) and not SEED_MIN <= seed <= SEED_MAX:
        return ["seed rounded past int64"]
    if path in MESSAGES_MODELS:
        return _messages_rules(path, body, tokenizer, limits)
    if path == "/v1/responses":
        return _responses_rules(body, tokenizer, limits)
    model, rules = {"/v1/completions": (CompletionRequest, SAMPLING_RULES),
                    "/v1/chat/completions": (ChatCompletionRequest, CHAT_RULES)}.get(
        path, (None, ()))  # fmt: skip
    if model is None:
        return []
    try:
        req = model.model_validate(body)
    except ValidationError:
        return []
    return [rule.name for rule in rules if rule.broken(req, tokenizer, limits)]


MESSAGES_MODELS = {"/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest}


def _messages_rules(path: str, body: dict[str, Any], tokenizer: Any, limits: Limits) -> list[str]:
    """A Messages request's own rule, then the chat request it means (server/messages.py
    translates it; the translation is the API's mapping, not a validator) on chat's."""
    try:
        req = MESSAGES_MODELS[path].model_validate(body)
    except ValidationError:
        return []
    thinking = req.thinking
    if (
        isinstance(req, MessagesRequest)
        and thinking is not None
        and thinking.type == "enabled"
        and (thinking.budget_tokens or 0) >= req.max_tokens
    ):
        return ["thinking.budget_tokens not under max_tokens"]
    chat = chat_request(req)
    if path == "/v1/messages":
        return broken_rules("/v1/chat/completions", chat.model_dump(), tokenizer, limits)
    # count_tokens renders the prompt only: its tools' rules and the render's bound, not
    # the budget's.
    rules = (*TOOL_RULES, Rule("the rendered prompt is past the context", over_the_context))
    return [r.name for r in rules if r.broken(chat, tokenizer, limits)]


def _responses_rules(body: dict[str, Any], tokenizer: Any, limits: Limits) -> list[str]:
    """A Responses request is the chat request it means (server/responses.py); one with a
    previous_response_id gets a 404: the fuzz run stores none it could name."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError:
        return []
    messages = conversation_of(req, [])
    if not messages:  # reasoning items only: they are taken and left out of the prompt
        return ["input holds no message"]
    try:
        chat = responses_chat_request(req, messages)
    except OpenAIError:  # (e.g. a text.format schema name the chat request's pattern refuses)
        return ["the chat request it means is invalid"]
    return broken_rules("/v1/chat/completions", chat.model_dump(), tokenizer, limits)


# ----------------------------------------------------------------------------- helpers


@functools.cache
def _grammars(tokenizer: Any) -> GrammarCache:
    return GrammarCache(tokenizer, VOCAB_SIZE, [])


def _prompt_lengths(req: Any, tokenizer: Any) -> tuple[list[int], int | None]:
    """Each prompt's length in tokens, and the max_tokens asked for."""
    if isinstance(req, CompletionRequest):
        lengths = [
            len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in req.prompt_list()
        ]
        return lengths, req.max_tokens
    messages, tools = template_input(req, conversation(req.messages), tokenizer.chat_template)
    text = apply_chat_template(tokenizer, messages, req.add_generation_prompt is not False, tools)
    return [len(encode_chat(tokenizer, text))], req.requested_max_tokens()
