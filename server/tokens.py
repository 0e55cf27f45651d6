"""Tokenizer-side helpers: prompts to ids, chat templates, and per-token text and bytes.

Per-token strings feed the logprobs formats; they are cached because a long
stream asks for the same token ids again and again.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

from engine.chat_template_check import chat_template_source
from engine.gguf_chat_template import render_chat
from engine.template_bounds import RenderLimits, TemplateBoundError
from server.errors import bad_request
from server.protocol import RESERVED_TEMPLATE_KWARGS
from server.validation import check_token_ids


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token chars -> raw bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    byte_values, chars = list(printable), list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        return type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    except AttributeError:
        return False


def token_id_string(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` writes it: its id, which names it
    exactly where texts do not (two ids can decode to the same text, or to U+FFFD)."""
    return f"token_id:{token_id}"


class TokenStrings:
    """Each token id's own text (as logprobs show it) and its exact UTF-8 bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def name(self, token_id: int, as_id: bool) -> str:
        """The token as logprobs write it: `token_id_string` if `as_id`, else its text."""
        return token_id_string(token_id) if as_id else self.text(token_id)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        # A token can hold part of a multi-byte character: its text is then U+FFFD, but
        # its bytes are exact, so a client can join bytes across tokens.
        if self._byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in _BYTE_DECODER for ch in piece):
                return [_BYTE_DECODER[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))


def encode_prompt(
    tokenizer: Any, prompt: str | list[int], vocab_size: int, param: str
) -> list[int]:
    """A completion prompt as token ids; 400 when empty or outside the vocabulary."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        # The engine refuses such ids too (it owns the vocabulary range); this, the server's
        # one check of a prompt's ids, answers in the OpenAI shape before any prompt of the
        # request is submitted.
        check_token_ids(ids, vocab_size, param, what="prompt token id")
    if not ids:
        raise bad_request("prompt must not be empty.", param=param)
    return ids


# The most of a template's own error message (`raise_exception(...)`) a 400 repeats.
MAX_REASON_CHARS = 1000


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> str:
    """The conversation (and any tools) rendered by the model's chat template within
    ``limits`` (engine/template_bounds.py; None: the defaults), with the request's
    `chat_template_kwargs` as extra variables; 400 when the template refuses them, a
    `TemplateBoundError` past a bound (server/chat_renderer.py answers it). Every model's
    template, a Hugging Face tokenizer's too, renders in the bounded sandbox, as
    transformers' `apply_chat_template(tokenize=False)` renders it."""
    source = chat_template_source(tokenizer, tools)
    if source is None:
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    extra = check_template_kwargs(tokenizer, template_kwargs)
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    try:
        return render_chat(source, conversation, special, tools, None, add_generation_prompt,
                           limits=limits, **extra)  # fmt: skip
    except TemplateBoundError:
        raise
    except Exception as exc:  # jinja errors: the template refused these messages
        reason = str(exc)  # (the template wrote it: as long as a value may be)
        if len(reason) > MAX_REASON_CHARS:
            reason = f"{reason[:MAX_REASON_CHARS]}... ({len(reason):,} characters)"
        raise bad_request(f"The chat template rejected the messages: {reason}", "messages") \
            from exc  # fmt: skip


def check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's template variables; 400 naming the first that is one of the
    renderer's own names (RESERVED_TEMPLATE_KWARGS, this tokenizer's special tokens and
    its apply_chat_template's arguments): it must not replace what the server passes."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or key in _own_names(tokenizer):
            raise bad_request(
                f"chat_template_kwargs must not set {key!r}: it is the chat template "
                "renderer's own.",
                param=f"chat_template_kwargs.{key}",
            )
    return kwargs


def _own_names(tokenizer: Any) -> set[str]:
    names = set(getattr(tokenizer, "special_tokens_map", None) or ())
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):
        return names
    return names | {p.name for p in params if p.kind is not p.VAR_KEYWORD}


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote any BOS it wants; do not add special tokens twice.
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise bad_request("messages render to an empty prompt.", param="messages")
    return ids
