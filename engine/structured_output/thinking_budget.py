"""A thinking budget enforced one token at a time, as a request's output matcher.

It takes the place of a grammar matcher (`Request.grammar`, the same three calls), so the
step's bitmask carries it and the scheduler advances it with each accepted token; a
request has one or the other, never both: under an output constraint the answer is the
constrained text from its first token, with no think block to cap.

The states follow llama.cpp's reasoning-budget sampler: waiting for the block to open
(unless the prompt opened it), counting the model's tokens inside it (a close the model
writes itself ends the count), forcing the closing tag token by token once the count
reaches the budget (every other token masked, end-of-sequence too), then passing
everything through. Only the first block is capped: the server reads only a block at the start.
"""

from __future__ import annotations

from enum import Enum

import torch

from scheduler import ThinkingBudget


class _State(Enum):
    WAITING = "waiting"
    COUNTING = "counting"
    FORCING = "forcing"
    DONE = "done"


class _SequenceMatch:
    """Whether a token stream has just ended with `ids` (short tag sequences only)."""

    def __init__(self, ids: tuple[int, ...]) -> None:
        self._ids, self._pos = ids, 0

    def advance(self, token: int) -> bool:
        if token == self._ids[self._pos]:
            self._pos += 1
        else:  # restart, where this token may begin the sequence again
            self._pos = 1 if token == self._ids[0] else 0
        if self._pos == len(self._ids):
            self._pos = 0
            return True
        return False


class ThinkingBudgetMatcher:
    def __init__(self, budget: ThinkingBudget) -> None:
        self._budget = budget
        self._start = _SequenceMatch(budget.start_ids)
        self._end = _SequenceMatch(budget.end_ids)
        self._left = budget.tokens
        self._forced = 0  # closing ids already forced
        self._state = _State.WAITING
        if budget.opened:
            self._enter_block()

    @property
    def state(self) -> str:
        return self._state.value

    def _enter_block(self) -> None:
        self._state = _State.COUNTING if self._left > 0 else _State.FORCING

    def accept_token(self, token: int) -> bool:
        """Advance past an accepted token; always True (the matcher never stops a request)."""
        if self._state is _State.WAITING:
            if self._start.advance(token):
                self._enter_block()
        elif self._state is _State.COUNTING:
            if self._end.advance(token):
                self._state = _State.DONE
            else:
                self._left -= 1
                if self._left == 0:
                    self._state = _State.FORCING
        elif self._state is _State.FORCING:
            self._forced += 1
            if self._forced == len(self._budget.end_ids):
                self._state = _State.DONE
        return True

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Row `row` of an int32 [B, ceil(V / 32)] token bitmask: only the next forced id
        while forcing. Whether the row needs applying (xgrammar's `need_apply`): outside
        forcing every token is allowed, and the row is left as it is."""
        if self._state is not _State.FORCING:
            return False
        token = self._budget.end_ids[self._forced]
        word, bit = divmod(token, 32)
        bitmask[row].zero_()
        bitmask[row, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit
        return True
