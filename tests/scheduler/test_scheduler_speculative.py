"""Speculative decoding in the scheduler: draft tokens ride after a decode's last token, the
fake model keeps the ones it agrees with, and the rejected tail's blocks come back.

The drafter here knows each request's true continuation and proposes it, right or with
one token corrupted, so every outcome (all kept, some kept, none kept, a stop token
inside the kept drafts) happens; outputs must equal the request run alone, token for
token, and every block must come back.
"""

from __future__ import annotations

import random

from scheduler import Request
from tests.scheduler.scheduler_harness import (
    VOCAB,
    Harness,
    assert_outputs_match_reference,
    make_config,
    prompt,
    reference_generate,
)


def truth_drafter(h: Harness, rng: random.Random, max_drafts: int = 5, wrong: float = 0.4):
    """Drafts from each request's reference output: the next 1..max_drafts tokens after
    the last one sampled, one of them replaced by a wrong token with probability `wrong`."""

    def draft(request: Request) -> list[int]:
        truth, _ = reference_generate(
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            h.config.max_model_len,
        )
        n = len(request.output_token_ids)
        drafts = truth[n : n + rng.randint(1, max_drafts)]
        # Past the reference's end: drafts the request can never emit (it stops first).
        drafts += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 2))]
        if drafts and rng.random() < wrong:
            i = rng.randrange(len(drafts))
            drafts[i] = (drafts[i] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        return drafts

    return draft


def kept_drafts(h: Harness) -> tuple[int, int]:
    """(draft tokens scheduled, steps whose request got more than one token)."""
    scheduled = sum(item.num_draft_tokens for out in h.outputs for item in out.scheduled)
    return scheduled, h.multi_token_steps


class CountingHarness(Harness):
    multi_token_steps = 0

    def step(self):
        before = {r.request_id: r.num_output_tokens for r in self.sched.running}
        out = super().step()
        for request_id, n in before.items():
            request = self.requests[request_id]
            if request.num_output_tokens - n > 1:
                self.multi_token_steps += 1
        return out


def test_random_traffic_with_drafts_keeps_every_output_and_every_block():
    rng = random.Random(0)
    h = CountingHarness(make_config(num_blocks=120, max_num_batched_tokens=48))
    h.drafter = truth_drafter(h, rng)
    for i in range(24):
        eos = {rng.randrange(VOCAB)} if i % 3 == 0 else frozenset()
        h.add(f"r{i}", prompt(i % 5, rng.randint(3, 30)), eos, max_tokens=rng.randint(1, 40))
        if i % 4 == 0:
            h.step()
    h.run()
    assert_outputs_match_reference(h)
    scheduled, multi = kept_drafts(h)
    assert scheduled > 100 and multi > 20, (scheduled, multi)


def test_a_stop_token_inside_the_kept_drafts_ends_the_request_there():
    h = Harness(make_config())
    r = h.add("s", prompt(3, 8), max_tokens=30)
    truth, _ = reference_generate(r.prompt_token_ids, r.sampling_params, (), 256)
    eos = truth[6]
    h.requests.clear()
    h.sched.abort_requests("s")
    h.drafter = truth_drafter(h, random.Random(1), max_drafts=8, wrong=0.0)
    h.add("t", prompt(3, 8), {eos}, max_tokens=30)
    h.run()
    assert_outputs_match_reference(h)
    assert h.requests["t"].finish_reason == "stop"
    assert h.requests["t"].output_token_ids[-1] == eos


def test_drafts_never_pass_max_tokens_nor_max_model_len():
    h = Harness(make_config(max_model_len=24))
    h.drafter = lambda request: [1] * 50  # far more than either limit leaves
    h.add("a", prompt(1, 10), max_tokens=6)
    h.add("b", prompt(2, 16), max_tokens=100)
    h.run()  # check_schedule asserts every step's drafts fit what the request may emit
    assert_outputs_match_reference(h)
    assert any(item.num_draft_tokens for out in h.outputs for item in out.scheduled)


def test_when_blocks_run_short_the_drafts_go_before_any_request_is_preempted():
    """Drafts never cost a preemption: with drafts that are always wrong (their blocks are
    allocated when free, then trimmed), a pool too small for both requests preempts
    exactly as often as without speculation."""

    def preemptions(drafter) -> int:
        h = Harness(make_config(num_blocks=7, block_size=4, max_num_seqs=2), drafter=drafter)
        h.add("a", prompt(1, 7), max_tokens=9)
        h.add("b", prompt(2, 7), max_tokens=9)
        h.run()
        assert_outputs_match_reference(h)
        return h.sched.num_preemptions

    baseline = preemptions(None)
    assert baseline >= 1  # the pool is short: the test means something
    assert preemptions(lambda request: [VOCAB + 1] * 3) == baseline


def test_a_prefix_cached_after_speculation_holds_only_verified_tokens():
    """Blocks are cached as they fill with known tokens; a rejected draft's KV must never
    be served to a later request that hits the same prefix."""
    rng = random.Random(2)
    h = Harness(make_config(block_size=4))
    h.drafter = truth_drafter(h, rng, wrong=0.8)
    first = h.add("first", prompt(4, 9), max_tokens=30)
    h.run()
    # The second request's prompt is the first one's whole sequence: it hits its blocks.
    h.drafter = None
    h.add("second", first.all_token_ids[:-1], max_tokens=5)
    h.run()
    assert h.requests["second"].num_cached_tokens >= 32
    assert_outputs_match_reference(h)
