"""Suffix drafting: prompt lookup, plus the text of earlier requests.

An agent that repeats a step, a client that retries, an eval that asks again: their answers
repeat answers the server already wrote for other requests, which the request's own prompt
does not hold. So finished requests leave their output here (with the last tokens of their
prompt, so an answer's first tokens have a context to match), in one corpus shared by every
request; a request's draft is what followed the longest recurring suffix of its tokens, in
its own prompt and output (as `ngram.py`) or in the corpus, its own on a tie.

This is suffix decoding's idea (vLLM's and Snowflake's ArcticInference's `suffix` method),
kept small: the corpus is one array of the latest outputs' tokens, and a lookup compares the
request's last tokens against every position at once (numpy: about a millisecond for a full
corpus on a 2-core Zen 3), newest match first, not a suffix tree with frequencies. Memory
is bounded: at most `CORPUS_TOKENS` tokens (4 bytes each, 256 KiB), the oldest outputs
dropped whole when a new one would not fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from engine.speculative.ngram import NgramDrafter
from scheduler import Request

CORPUS_TOKENS = 1 << 16
# Between two outputs in the corpus: no token id is this large, so no match crosses it.
SEPARATOR = 0xFFFFFFFF


class SuffixCorpus:
    """The latest finished outputs, each followed by SEPARATOR, oldest first."""

    def __init__(self, max_tokens: int = CORPUS_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._tokens = np.empty(max_tokens, dtype=np.uint32)
        self.num_tokens = 0
        self._lengths: deque[int] = deque()  # each stored output's tokens (+ SEPARATOR)

    def add(self, token_ids: Sequence[int]) -> None:
        """Keep token_ids (an output and its context), dropping the oldest to fit."""
        size = len(token_ids) + 1
        if size > self.max_tokens:
            return
        drop = 0
        while self._lengths and self.num_tokens - drop + size > self.max_tokens:
            drop += self._lengths.popleft()
        tokens, kept = self._tokens, self.num_tokens - drop
        if drop:
            tokens[:kept] = tokens[drop : self.num_tokens].copy()
        tokens[kept : kept + size - 1] = token_ids
        tokens[kept + size - 1] = SEPARATOR
        self.num_tokens = kept + size
        self._lengths.append(size)

    def longest(self, context: Sequence[int], min_n: int, k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens): the longest suffix of context, of at least min_n tokens,
        that occurs here with a token after it, and what followed its newest occurrence;
        (0, []) where none does."""
        corpus = self._tokens[: self.num_tokens]
        # Positions whose token is context's last and that a token (not SEPARATOR) follows.
        ends = np.flatnonzero(corpus[:-1] == context[-1])
        ends = ends[corpus[ends + 1] != SEPARATOR]
        best_n, best_end = 0, -1
        for n in range(1, len(context) + 1):
            if n > 1:
                back = ends - (n - 1)
                ends = ends[back >= 0]
                ends = ends[corpus[ends - (n - 1)] == context[-n]]
            if not len(ends):
                break
            if n >= min_n:
                best_n, best_end = n, int(ends[-1])
        if not best_n:
            return 0, []
        follow = corpus[best_end + 1 : best_end + 1 + k].tolist()
        if SEPARATOR in follow:
            follow = follow[: follow.index(SEPARATOR)]
        return best_n, follow


class SuffixDrafter(NgramDrafter):
    """The longest recurring suffix (max_n down to min_n tokens) in the request's own
    tokens or in the corpus, the request's own on a tie; its continuation is the draft."""

    def __init__(self, min_n: int = 2, max_n: int = 8, corpus: SuffixCorpus | None = None) -> None:
        super().__init__(min_n, max_n)
        self.corpus = corpus if corpus is not None else SuffixCorpus()

    def propose(self, request: Request, k: int) -> list[int]:
        history = self._history(request)
        context = request.all_token_ids[-self.max_n :]
        corpus_n, drafts = self.corpus.longest(context, self.min_n, k)
        # The request's own match wins where it is as long (one scan per length tried).
        own = history.propose(max(corpus_n, self.min_n), self.max_n, k)
        return own or drafts

    def finished(self, request: Request) -> None:
        """A finished request's output, after its prompt's last max_n tokens, joins the
        corpus."""
        if request.num_output_tokens:
            start = max(request.num_prompt_tokens - self.max_n, 0)
            self.corpus.add(request.all_token_ids[start:])
