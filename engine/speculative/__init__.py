"""Speculative decoding without a draft model: draft tokens from what a request has seen,
verified in one step, kept where the model agrees.

- `ngram.py`: the `ngram` drafter (prompt lookup: the tokens that followed the last
  occurrence of the request's last n tokens);
- `suffix.py`: the `suffix` drafter: prompt lookup, then the same search over a bounded
  corpus of earlier requests' outputs (an answer another request already wrote);
- `speculator.py`: which requests get drafts each step and how many (adaptive, from the
  acceptance measured so far and the batch's size);
- `verify.py`: which drafts a step keeps, given the token the model sampled at each
  position.
The scheduler schedules a request's drafts after its last token (`Request.spec_token_ids`),
and the model runner computes the 1 + k positions as decode rows over the same block table.
"""

from engine.speculative.ngram import NgramDrafter
from engine.speculative.speculator import SpecStats, Speculator
from engine.speculative.suffix import SuffixDrafter
from engine.speculative.verify import accept_drafts

# `--speculative`'s choices (besides off), each a drafter.
DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}

__all__ = ["DRAFTERS", "SpecStats", "Speculator", "accept_drafts"]
