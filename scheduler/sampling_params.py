"""How one request wants its tokens chosen and when it wants to stop.

Pure Python: the scheduler reads the stop conditions, the engine's sampler and
detokenizer read the rest. `engine` re-exports it as `engine.SamplingParams`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from scheduler.structured_outputs import StructuredOutputs
from scheduler.thinking_budget import ThinkingBudget

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; N: the sampled token's plus the top N
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this (a JSON schema, a regex, ...); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # False: never verify draft tokens for this request (speculative decoding, where the
    # server runs it; the output is the same either way, only its speed differs).
    speculative: bool = True
    # At most this many tokens inside a think block, then it is closed by force; None: no cap.
    thinking_budget: ThinkingBudget | None = None

    # The sampler divides or multiplies float32 logits by the penalty: far outside this
    # range a logit overflows to inf (1e-300 is 0 in float32) and sampling returns garbage,
    # while within it 0.01 and 100 already all but force or forbid a repeat.
    REPETITION_PENALTY_RANGE: ClassVar[tuple[float, float]] = (0.01, 100.0)
    _FLOAT_FIELDS: ClassVar[tuple[str, ...]] = (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.verify()

    # Temperatures below this are greedy (vLLM does the same): sampling is numerically
    # greedy there anyway, and dividing float32 logits by them could overflow.
    GREEDY_TEMPERATURE: ClassVar[float] = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_TEMPERATURE

    def verify(self) -> None:
        """Raise ValueError naming the offending field; the server turns it into a 400."""
        for name in self._FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        low, high = self.REPETITION_PENALTY_RANGE
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                f"must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                f"must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                low <= self.repetition_penalty <= high,
                "repetition_penalty",
                f"must be in [{low}, {high}], got {self.repetition_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (all(s for s in self.stop), "stop", "strings must be non-empty"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}")
