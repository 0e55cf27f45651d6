"""Drafts for a request under a grammar (structured outputs, tool calls).

A draft the grammar refuses can never be kept (the step's mask refuses it at its position),
so it only costs a row: the drafter's proposal is cut at the first token the request's
matcher refuses. And where the grammar allows only one way on (a JSON key, the punctuation
between fields, a tool call's fixed frame), that text is certain: its tokens are appended
as drafts (jump-forward, xgrammar's `find_jump_forward_string`, as SGLang does), and the
verification keeps them where the model would write the same tokens; the tokenizer's own
split of the text is what the model writes nearly always. The matcher is advanced to look,
then rolled back: the scheduler advances it when tokens are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GrammarDrafts:
    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode  # text to token ids, no special tokens

    def check(self, matcher: Any, drafts: list[int], k: int) -> list[int]:
        """The drafts the grammar allows, in order, then the tokens of the text it forces,
        k at most."""
        kept = self._accept(matcher, drafts[:k])
        if len(kept) < k and not matcher.is_terminated():
            forced = matcher.find_jump_forward_string()
            if forced:
                kept += self._accept(matcher, self._encode(forced)[: k - len(kept)])
        if kept:
            matcher.rollback(len(kept))
        return kept

    @staticmethod
    def _accept(matcher: Any, tokens: list[int]) -> list[int]:
        """The tokens the matcher accepts, in order, up to the first it refuses."""
        kept = []
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            kept.append(token)
        return kept
