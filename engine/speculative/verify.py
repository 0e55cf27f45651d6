"""Which draft tokens a verification step keeps.

The runner samples every one of a request's 1 + k positions exactly as a decode step would
(the same logits processing and sampling rule, each position's context holding the drafts
before it): position i's token is the model's choice given the drafts 0..i-1. Draft i is
kept while it equals that choice; the first position where they differ gives the model's
own token, and if all k are kept, position k gives one more. So every token emitted is the
one plain decoding would have sampled in its place:
- greedy: the same tokens as without speculation;
- sampling: the same distribution. For a draft proposed with certainty (n-gram drafts),
  "keep draft d with probability p(d), else sample from p without d" is the
  rejection-sampling rule of speculative sampling, and sampling t ~ p then keeping d
  iff t == d is that rule: P(keep) = p(d), and on a miss t is distributed as p with d
  removed;
- seeded sampling: the same text, because the request's generator is rewound to draw
  exactly one number per token emitted (`rewind`).
"""

from __future__ import annotations

import torch

from engine.sampler import draw_uniform


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a request emits: drafts while each equals the token sampled at its
    position, then the first sampled token that differs (or the one after the last draft).
    `sampled` has one token per position: len(drafts) + 1."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return sampled


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int) -> None:
    """Put a seeded request's generator where plain decoding would leave it: from its state
    before the step, `num_draws` numbers drawn (one per token emitted), not one per
    position verified."""
    generator.set_state(state)
    for _ in range(num_draws):
        draw_uniform(generator)
