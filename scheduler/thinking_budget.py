"""A cap on a reasoning model's think block: at most `tokens` of the model's own tokens
inside it, then the block is closed by force and the model goes on to its answer.

Pure Python, like the rest of a request's sampling settings: the server builds it from
the API's field (chat's `thinking_token_budget`, Messages' `thinking.budget_tokens`) with
the ids its tokenizer gives the block's tags, and the engine enforces it one token at a
time (engine/structured_output/thinking_budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    tokens: int  # the model's own tokens allowed inside the block
    start_ids: tuple[int, ...]  # what opens a block (`<think>`)
    end_ids: tuple[int, ...]  # what closes one (`</think>`): the model's, or forced
    opened: bool = False  # the prompt opened the block: the output starts inside it

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {self.tokens}")
        if not (self.start_ids and self.end_ids):
            raise ValueError("a thinking budget needs the ids of the block's tags")
