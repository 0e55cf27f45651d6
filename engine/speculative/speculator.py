"""Which requests get draft tokens each step, and how many.

Drafts cost rows: a step verifying k drafts computes 1 + k positions for that request.
While a step reads every weight once whatever its rows (one request, a few), extra rows are
nearly free and every kept draft is a token without a step of its own; in a large batch
the step is compute-bound and drafts only slow it. So:
- a step's drafts are capped by a row budget (`max_rows`: running requests plus drafts),
  which a batch of unique requests fills with its own decodes, leaving no drafts;
- each request's draft length adapts to what it had accepted: doubled (up to
  `num_tokens`) after all were kept, cut to one past what was kept after a miss, and
  after repeated misses it stops proposing for a while (2, 4, ... up to 32 steps);
- a request under a grammar drafts only what its grammar allows, plus the tokens the
  grammar forces (`grammar.py`); one under a thinking budget (a matcher too) gets no
  drafts, nor one that opted out (`SamplingParams.speculative`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.speculative.grammar import GrammarDrafts
from engine.speculative.ngram import NgramDrafter
from engine.structured_output.thinking_budget import ThinkingBudgetMatcher
from scheduler import Request

MAX_BACKOFF_STEPS = 32


@dataclass
class SpecStats:
    """Cumulative counters under vLLM's names (`vllm:spec_decode_*`)."""

    num_drafts: int = 0  # verifications: a request's step with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Drafts kept at each position (index 0: the first draft).
    accepted_per_pos: list[int] = field(default_factory=list)


class Drafter(Protocol):
    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k tokens the request's output may continue with after its last token."""
        ...

    def finished(self, request: Request) -> None:
        """The request ended (its tokens are final): what the drafter keeps of it."""
        ...


class RequestSpec:
    """A request's drafting state (on `Request.spec`, so it goes with the request)."""

    __slots__ = ("drafter_state", "k", "misses", "skip")

    def __init__(self, k: int) -> None:
        self.drafter_state: object = None  # the drafter's own (the n-gram search's tokens)
        self.k = k  # its next draft's length cap
        self.misses = 0  # verifications in a row that kept nothing
        self.skip = 0  # steps left without proposing


class Speculator:
    def __init__(
        self,
        num_tokens: int,
        max_rows: int,
        drafter: Drafter | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        """`encode` (text to token ids) lets requests under a grammar draft the text it
        forces; without it they draft only what the drafter proposes."""
        if num_tokens < 1 or max_rows < 2:
            raise ValueError("speculative decoding needs num_tokens >= 1 and max_rows >= 2")
        self.num_tokens = num_tokens
        self.max_rows = max_rows
        self.drafter: Drafter = drafter if drafter is not None else NgramDrafter()
        self._grammar = GrammarDrafts(encode or (lambda _: []))
        self.stats = SpecStats(accepted_per_pos=[0] * num_tokens)

    def propose(self, running: list[Request]) -> None:
        """Set the next step's drafts (`Request.spec_token_ids`) of running requests that
        are decoding, within the step's row budget."""
        rows_left = self.max_rows - len(running)
        for request in running:
            if rows_left <= 0:
                return
            if not self._may_speculate(request):
                continue
            state = request.spec
            if state is None:
                state = request.spec = RequestSpec(self.num_tokens)
            if state.skip:
                state.skip -= 1
                continue
            k = min(state.k, rows_left)
            drafts = self.drafter.propose(request, k)
            if request.grammar is not None:
                # The text a grammar forces is certain, its tokens are not (the model may
                # split it otherwise): they adapt as any drafts do.
                drafts = self._grammar.check(request.grammar, drafts, k)
            request.spec_token_ids = drafts
            rows_left -= len(drafts)

    @staticmethod
    def _may_speculate(request: Request) -> bool:
        decoding = len(request.all_token_ids) - request.num_computed_tokens == 1
        budget = isinstance(request.grammar, ThinkingBudgetMatcher)
        return decoding and not budget and request.sampling_params.speculative

    def finished(self, requests: list[Request]) -> None:
        """Requests that ended this step, whatever the reason."""
        for request in requests:
            self.drafter.finished(request)

    def record(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """A verification's outcome: `num_emitted` tokens (the kept drafts and one more)."""
        kept = num_emitted - 1
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += kept
        for pos in range(kept):
            stats.accepted_per_pos[pos] += 1
        state = request.spec
        if state is None:
            return
        if kept == num_drafts:
            state.k = min(state.k * 2, self.num_tokens)
        else:
            state.k = kept + 1
        if kept:
            state.misses = 0
        else:
            state.misses += 1
            if state.misses >= 2:
                state.skip = min(2 ** (state.misses - 1), MAX_BACKOFF_STEPS)
