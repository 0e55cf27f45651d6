"""Suffix drafting: prompt lookup, plus the text of earlier requests.

An agent that repeats a step, a client that retries, an eval that asks again: their answers
repeat answers the server already wrote for other requests, which the request's own prompt
does not hold. So finished requests leave their output here (with the last tokens of their
prompt, so an answer's first tokens have a context to match), in one corpus shared by every
request; a request's draft is what followed the longest recurring suffix of its tokens, in
its own prompt and output first (as `ngram.py`), else in the corpus.

This is suffix decoding's idea (vLLM's and Snowflake's ArcticInference's `suffix` method),
kept small: the corpus is the packed tokens of the latest outputs, searched with the same
C-speed `rfind` as a request's own history, newest match first, not a suffix tree with
frequencies. Memory is bounded: at most `CORPUS_TOKENS` tokens (4 bytes each, 1 MiB), the
oldest outputs dropped whole when a new one would not fit. A miss costs one scan of it.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from engine.speculative.ngram import TOKEN_BYTES, NgramDrafter
from scheduler import Request

CORPUS_TOKENS = 1 << 18
# Between two outputs in the corpus: no token id is this large, so no match crosses it.
SEPARATOR = array("I", [0xFFFFFFFF]).tobytes()


class SuffixCorpus:
    """The latest finished outputs, packed 4 bytes a token, each followed by SEPARATOR."""

    def __init__(self, max_tokens: int = CORPUS_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._buf = bytearray()
        self._lengths: deque[int] = deque()  # each stored output's tokens, oldest first

    @property
    def num_tokens(self) -> int:
        return len(self._buf) // TOKEN_BYTES

    def add(self, token_ids: Sequence[int]) -> None:
        """Keep token_ids (an output and its context), dropping the oldest to fit."""
        size = len(token_ids) + 1
        if size > self.max_tokens:
            return
        drop = 0
        while self._lengths and self.num_tokens - drop + size > self.max_tokens:
            drop += self._lengths.popleft()
        if drop:
            del self._buf[: drop * TOKEN_BYTES]
        self._buf += array("I", token_ids).tobytes() + SEPARATOR
        self._lengths.append(size)

    def follow(self, pattern: bytes, k: int) -> list[int] | None:
        """Up to k tokens after the newest occurrence of pattern (packed tokens); None
        where it does not occur, [] where only the end of an output follows it."""
        buf, end = self._buf, len(self._buf)
        while (pos := buf.rfind(pattern, 0, end)) >= 0:
            if pos % TOKEN_BYTES == 0:
                start = pos + len(pattern)
                follow = array("I", bytes(buf[start : start + k * TOKEN_BYTES])).tolist()
                if 0xFFFFFFFF in follow:
                    follow = follow[: follow.index(0xFFFFFFFF)]
                return follow
            end = pos + len(pattern) - 1  # misaligned: look further left
        return None


class SuffixDrafter(NgramDrafter):
    """For n from max_n down to min_n: the request's own tokens, then the corpus; the
    first non-empty continuation found is the draft."""

    def __init__(self, min_n: int = 2, max_n: int = 8, corpus: SuffixCorpus | None = None) -> None:
        super().__init__(min_n, max_n)
        self.corpus = corpus if corpus is not None else SuffixCorpus()

    def propose(self, request: Request, k: int) -> list[int]:
        history = self._history(request)
        suffix = history.suffix(self.max_n)
        # The shortest suffix first: where it occurs nowhere, no longer one does (one scan).
        shortest = suffix[-self.min_n * TOKEN_BYTES :]
        in_corpus = self.corpus.follow(shortest, k) is not None
        for n in range(min(self.max_n, len(suffix) // TOKEN_BYTES), self.min_n - 1, -1):
            if drafts := history.propose(n, n, k):
                return drafts
            if in_corpus and (drafts := self.corpus.follow(suffix[-n * TOKEN_BYTES :], k)):
                return drafts
        return []

    def finished(self, request: Request) -> None:
        """A finished request's output, after its prompt's last max_n tokens, joins the
        corpus."""
        if request.num_output_tokens:
            start = max(request.num_prompt_tokens - self.max_n, 0)
            self.corpus.add(request.all_token_ids[start:])
