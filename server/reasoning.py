"""Reasoning separated from the answer: a `<think>...</think>` block at the start of the
output (DeepSeek-R1, Qwen3, QwQ and their distillations) becomes `reasoning_content` on
chat, a reasoning item on Responses and a `thinking` block on Messages.

The server's --reasoning-parser picks the parser: "think" for `<think>` blocks, "none" to
leave the text whole, "auto" (the default) for "think" where the chat template names
`<think>` or `</think>` and "none" elsewhere. Some templates open the block themselves
(the generation prompt ends in `<think>`): then the output starts inside it, and the
reasoning is all text up to `</think>` (all of it, if that never comes, since the model
never left it).

A request may cap its block (`thinking_budget`): after that many of the model's tokens
inside it, the engine writes `</think>` itself and the model goes on to its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import ThinkingBudget

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("auto", "none", "think")


def resolve_parser(name: str, chat_template: Any) -> str:
    """The parser "auto" stands for with this template: "think" or "none"."""
    if name != "auto":
        return name
    template = str(chat_template or "")
    # DeepSeek-R1's template names only the closing tag (it strips earlier turns' thinking).
    return "think" if THINK_OPEN in template or THINK_CLOSE in template else "none"


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is read: whether a think block is looked for, and whether
    the prompt already opened one."""

    enabled: bool = False
    opened: bool = False

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.opened) if self.enabled else None


NO_REASONING = ReasoningMode()


def reasoning_mode(parser: str, prompt_text: str) -> ReasoningMode:
    """The mode for a prompt rendered under `parser` (already resolved)."""
    if parser != "think":
        return NO_REASONING
    return ReasoningMode(True, prompt_text.rstrip().endswith(THINK_OPEN))


def thinking_budget(
    tokens: int | None, mode: ReasoningMode, tokenizer: Any
) -> ThinkingBudget | None:
    """The engine's cap for a request's thinking budget (None: none asked); ValueError
    when the output is read without think blocks (--reasoning-parser none), so there is
    no block to cap."""
    if tokens is None:
        return None
    if not mode.enabled:
        raise ValueError(
            "thinking_token_budget needs a reasoning model: this server reads no think "
            "blocks (--reasoning-parser none, or auto on a chat template without <think>)"
        )

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ThinkingBudget(tokens, ids(THINK_OPEN), ids(THINK_CLOSE), mode.opened)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could still grow into `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Output text, whole or streamed, split into (reasoning, content).

    feed(delta) -> the reasoning and the content safe to send now; finish() -> the rest.
    Only text that could still be a tag is held back: leading whitespace and a prefix of
    `<think>` at the start, a prefix of `</think>` inside the block. The whitespace the
    model writes after `</think>` is dropped, as the answer starts after it.
    """

    def __init__(self, opened: bool = False) -> None:
        self._state = "reasoning" if opened else "start"  # -> "after" -> "content"
        self._buf = ""
        self.entered = opened  # whether the output had a think block (even an empty one)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._state = head[len(THINK_OPEN) :], "reasoning"
                self.entered = True
            elif THINK_OPEN.startswith(head):
                return "", ""  # still may open a block: hold it
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buf.find(THINK_CLOSE)
            if end < 0:
                keep = len(self._buf) - partial_suffix(self._buf, THINK_CLOSE)
                reasoning, self._buf = self._buf[:keep], self._buf[keep:]
                return reasoning, ""
            reasoning = self._buf[:end]
            self._buf, self._state = self._buf[end + len(THINK_CLOSE) :], "after"
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def split_reasoning(text: str, splitter: ReasoningSplitter) -> tuple[str | None, str]:
    """The whole output's reasoning (None when there was no block) and its content."""
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if reasoning or splitter.entered else None), content
