"""Turn a request's output tokens into text as they arrive, and find its stop strings.

Two rules shape this module:
- Never emit broken UTF-8. A character may span several byte-level tokens; the
  text of a token is only emitted once the decoded tail no longer ends in
  U+FFFD (the "prefix/read offset" scheme of vLLM and TGI). The prompt's last
  few tokens are decoded as context, so the first output token keeps the leading
  space that sentencepiece-style decoders strip at the start of a text.
- Never emit text that is later retracted. While a request streams, the tail
  of the text that could be the start of a stop string is held back; it is
  released when it turns out not to be one, dropped (or kept, with
  include_stop_str_in_output) when it is one, and flushed by `finish()` when the
  request ends for another reason.

Decoding never applies `clean_up_tokenization_spaces`: that rewrite is not
incremental (it looks at neighbouring characters) and loses information.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from scheduler.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    # A fast tokenizer's Rust backend decodes a few ids about 5x faster than the Python
    # wrapper, which matters at two decodes per token per request.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def decode_logprob_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own, special tokens included (for logprobs' `tokens`).

    A token holding part of a multi-byte character decodes to U+FFFD.
    """
    return _make_decode(tokenizer, skip_special_tokens=False)([token_id])


class IncrementalDetokenizer:
    """One request's output text. Feed it every output token, in order.

    `add_token` returns the text that became final with that token and whether a stop
    string ended the request. After that, or after `finish()`, further tokens are ignored.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._decode = _make_decode(tokenizer, params.skip_special_tokens)
        self._stop_strings = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self.output_token_ids: list[int] = []
        self.stopped = False  # ended by a stop string
        self.stop_string: str | None = None  # the stop string that ended it
        self.finished = False
        # Tokens from the prefix offset on; the first `_read` of them are already emitted
        # (or are prompt context), so the text of window[:_read] is the known prefix.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window: list[int] = context
        self._read = len(context)
        self._pending = ""  # decoded, but held back while it may start a stop string
        self._chunks: list[str] = []  # everything emitted
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the stop string removed unless asked to keep it)."""
        if self._text is None:
            self._text = "".join(self._chunks)
        return self._text

    def add_token(self, token_id: int, *, is_stop_token: bool = False) -> tuple[str, bool]:
        """Append one output token; return (newly final text, stopped by a stop string).

        `is_stop_token`: the scheduler ended the request on this token (eos or one of
        stop_token_ids). Like vLLM, its text is then left out unless
        include_stop_str_in_output, and the held-back text is flushed as by `finish()`.
        """
        if self.finished:
            return "", self.stopped
        self.output_token_ids.append(token_id)
        if is_stop_token:
            if self._include_stop:
                self._pending += self._decode_next(token_id)
            return self.finish(), self.stopped
        self._pending += self._decode_next(token_id)
        return self._release(final=False), self.stopped

    def add_tokens(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        """Append several tokens; stops early (ignoring the rest) when a stop string matches."""
        pieces = []
        for token_id in token_ids:
            new_text, stopped = self.add_token(token_id)
            pieces.append(new_text)
            if stopped:
                break
        return "".join(pieces), self.stopped

    def finish(self) -> str:
        """End the request (length, eos, abort...): return the text still held back.

        That includes bytes of an unfinished character, as U+FFFD, the way a full decode
        of the output would show them.
        """
        if self.finished:
            return ""
        self._pending += self._decode_rest()
        return self._release(final=True)

    def _decode_next(self, token_id: int) -> str:
        """The text `token_id` completes, or "" while it ends in a partial character."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        # Slide: what was read becomes the new context prefix.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return full_text[len(prefix_text) :]

    def _decode_rest(self) -> str:
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return full_text[len(prefix_text) :]

    def _release(self, final: bool) -> str:
        """Emit what can no longer become part of a stop string; detect a complete one."""
        pending = self._pending
        # Like vLLM, a stop string only counts once min_tokens tokens came before it.
        checking = bool(self._stop_strings) and len(self.output_token_ids) > self._min_tokens
        hold = 0
        if checking:
            match = self._find_stop(pending)
            if match is not None:
                start, stop = match
                pending = pending[: start + len(stop) if self._include_stop else start]
                self.stopped = True
                self.stop_string = stop
                final = True
            elif not final:
                hold = self._stop_prefix_length(pending)
        out = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        if final:
            self.finished = True
            self._pending = ""
        if out:
            self._chunks.append(out)
            self._text = None
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (the shorter one on a tie).

        Only the un-emitted text is searched: emitted text was checked when it arrived,
        and anything that could have started a stop string was held back, not emitted.
        """
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or (start, len(stop)) < (best[0], len(best[1])):
                best = (start, stop)
        return best

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
