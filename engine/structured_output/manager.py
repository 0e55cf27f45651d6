"""The engine's structured outputs: compiled grammars, and one matcher per constrained request.

A matcher tracks where its request's output stands in the grammar; the request holds it
(`Request.grammar`). Each step it fills its row of the step's bitmask (which tokens may
come next) and, once the token is sampled, the scheduler has it accept the token. The
matcher lives as long as its request and only ever moves forward with accepted tokens,
so preemption (the request's KV recomputed from its tokens) and prefix-cache hits leave
it right: the tokens it has accepted are exactly the request's output tokens, which
neither changes.

xgrammar is imported on first use, so engines that never see a grammar never load it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.structured_output.thinking_budget import ThinkingBudgetMatcher
from scheduler import Request, StructuredOutputs

if TYPE_CHECKING:
    from engine.structured_output.bitmask import GrammarBitmask
    from engine.structured_output.grammar_cache import CompileResult, GrammarCache


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache: GrammarCache | None = None
        self._cache_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None  # host buffer, grown to the largest batch

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache, built on first use (any thread: ~0.1 s of tokenizer work)."""
        with self._cache_lock:
            if self._cache is None:
                from engine.structured_output.grammar_cache import GrammarCache

                self._cache = GrammarCache(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._cache

    def compile(self, spec: StructuredOutputs) -> CompileResult:
        """Thread-safe; GrammarError (a ValueError) when the spec cannot be compiled."""
        return self.grammars.compile(spec)

    # -- the engine thread ------------------------------------------------------------

    def new_matcher(self, request: Request) -> Any | None:
        """The matcher of a constrained request (None otherwise), which the request holds
        for its life (`Request.grammar`). Compiles unless the grammar is cached. A thinking
        budget is a matcher too (structured_output/thinking_budget.py), where no grammar is."""
        spec = request.sampling_params.structured_outputs
        if spec is None:
            budget = request.sampling_params.thinking_budget
            return ThinkingBudgetMatcher(budget) if budget is not None else None
        import xgrammar as xgr

        grammar = self.compile(spec).grammar  # a cache hit when the server compiled it first
        stop = sorted(request.eos_token_ids) or None
        return xgr.GrammarMatcher(grammar, override_stop_tokens=stop)

    def bitmask(
        self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None
    ) -> GrammarBitmask | None:
        """The mask of a step's sampled rows (requests in row order); None if no row is
        constrained this step. A verifying request has a row per position, in order, and
        `drafts` gives each row its request's drafts this step: the matcher is advanced
        through them to fill each position's row, then rolled back (they are not yet kept)."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        from engine.structured_output.bitmask import GrammarBitmask

        buffer = self._buffer(len(requests))
        filled: list[int] = []
        i = rows[0]
        while i < len(requests):
            request = requests[i]
            end = i + 1  # the request's rows: i .. end - 1, one per position
            while end < len(requests) and requests[end] is request:
                end += 1
            if request.grammar is not None:
                request_drafts = drafts[i] if drafts else ()
                filled += self._fill(request.grammar, request_drafts, buffer, range(i, end))
            i = end
        return GrammarBitmask(buffer[: len(requests)], filled) if filled else None

    @staticmethod
    def _fill(grammar: Any, drafts: Sequence[int], buffer: torch.Tensor, rows: range) -> list[int]:
        """Fill a request's rows (position p after drafts[:p]); the rows that need applying.
        A matcher answers whether its row does (xgrammar's `need_apply`): an all-allowed row
        (a thinking budget while it counts) leaves that row's logits alone."""
        filled, accepted = [], 0
        for position, row in enumerate(rows):
            # A draft the grammar refuses was masked out at the row before, and one that ends
            # it (its stop token) ends the request: either way the verification keeps
            # nothing past it, so the rows after it need no mask.
            if position:
                if not grammar.accept_token(drafts[position - 1]):
                    break
                accepted += 1
                if grammar.is_terminated():
                    break
            if grammar.fill_next_token_bitmask(buffer, row):
                filled.append(row)
        if accepted:
            grammar.rollback(accepted)  # the drafts are kept later, by the scheduler
        return filled

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self._vocab_size)
        return self._bitmask
