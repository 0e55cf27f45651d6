"""Aborts and external finishes in every state, refusals, stop rules, freeing."""

import pytest

from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

from .scheduler_harness import (
    Harness,
    assert_outputs_match_reference,
    fake_next_token,
    make_config,
    prompt,
    reference_generate,
)


def only_request_aborted_frees_everything(h: Harness, rid: str) -> None:
    h.sched.abort_requests([rid])
    request = h.requests[rid]
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert request.finish_reason == "abort"
    assert rid not in h.sched.requests
    assert all(r.request_id != rid for r in (*h.sched.running, *h.sched.waiting))
    h.check_state()
    assert rid in h.sched.schedule().finished_ids
    assert rid not in h.sched.schedule().finished_ids  # reported once


def test_abort_a_waiting_request():
    h = Harness(make_config())
    h.add("w", prompt(1, 9))
    only_request_aborted_frees_everything(h, "w")
    h.check_all_free()


def test_abort_a_request_in_the_middle_of_its_prefill():
    h = Harness(make_config(max_num_seqs=4, max_num_batched_tokens=16))
    h.add("p", prompt(2, 40))
    h.step()
    assert h.mgr.num_free_blocks < h.config.num_blocks
    only_request_aborted_frees_everything(h, "p")
    h.check_all_free()


def test_abort_a_decoding_request_frees_its_blocks_at_once():
    h = Harness(make_config())
    h.add("d", prompt(3, 9), max_tokens=50)
    h.add("other", prompt(4, 9), max_tokens=3)
    for _ in range(3):
        h.step()
    used_by_d = len(h.mgr.get_block_ids("d"))
    free_before = h.mgr.num_free_blocks
    h.sched.abort_requests("d")  # a bare id works too
    assert h.mgr.num_free_blocks == free_before + used_by_d
    h.check_state()
    h.run()
    assert h.requests["other"].finish_reason == "length"


def test_abort_a_preempted_request():
    h = Harness(make_config(num_blocks=6))
    for rid, seed in (("a", 11), ("b", 12), ("c", 13)):
        h.add(rid, prompt(seed, 7), max_tokens=10)
    for _ in range(3):
        h.step()
    assert h.requests["c"].status is RequestStatus.PREEMPTED
    h.sched.abort_requests(["c", "no-such-request"])
    assert h.requests["c"].finish_reason == "abort"
    assert "c" not in h.sched.requests and all(r.request_id != "c" for r in h.sched.waiting)
    h.check_state()
    h.run()
    assert h.requests["a"].finish_reason == h.requests["b"].finish_reason == "length"


def test_abort_between_schedule_and_update_drops_the_token():
    h = Harness(make_config())
    h.add("x", prompt(5, 6), max_tokens=5)
    h.add("y", prompt(6, 6), max_tokens=5)
    out = h.sched.schedule()
    h.sched.abort_requests(["x"])
    sampled = h.model.run(out)
    got = h.sched.update_from_output(out, sampled)
    assert [r.request_id for r in got] == ["y"]
    assert h.requests["x"].output_token_ids == []
    h.check_state()
    h.run()


def test_finish_requests_is_how_the_engine_stops_on_a_stop_string():
    h = Harness(make_config())
    h.add("s", prompt(7, 6), max_tokens=50)
    h.step()
    h.step()
    h.sched.finish_requests(["s"], RequestStatus.FINISHED_STOPPED)
    assert h.requests["s"].finish_reason == "stop"
    assert "s" in h.sched.schedule().finished_ids
    h.check_all_free()
    with pytest.raises(ValueError, match="finished status"):
        h.sched.finish_requests(["s"], RequestStatus.RUNNING)


def test_a_prompt_without_room_for_one_output_token_is_refused():
    sched = Scheduler(make_config(max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len=16"):
        sched.add_request(Request("r", list(range(16)), SamplingParams()))
    sched.add_request(Request("ok", list(range(15)), SamplingParams()))
    assert sched.num_waiting == 1


def test_a_request_that_can_never_fit_the_pool_is_refused():
    sched = Scheduler(make_config(num_blocks=4, block_size=4))
    # 10 + 8 - 1 = 17 tokens of KV at the end: 5 blocks.
    with pytest.raises(ValueError, match=r"num_blocks=4") as info:
        sched.add_request(Request("r", list(range(10)), SamplingParams(max_tokens=8)))
    assert "5 KV blocks" in str(info.value) and "block_size=4" in str(info.value)
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "max_model_len", "reason"),
    [(10, 7, 256, "length"), (10, 100, 17, "length"), (1, 16, 256, "length")],
)
def test_a_request_that_needs_the_whole_pool_runs_to_completion(
    prompt_len, max_tokens, max_model_len, reason
):
    # Exactly num_blocks at the end: it must progress alone, never stall or thrash.
    h = Harness(make_config(num_blocks=4, block_size=4, max_model_len=max_model_len))
    request = h.add("big", prompt(8, prompt_len), max_tokens=max_tokens)
    h.add("small", prompt(9, 3), max_tokens=3)
    h.run(max_steps=200)
    assert request.finish_reason == reason
    assert_outputs_match_reference(h)


def test_a_duplicate_request_id_is_refused():
    sched = Scheduler(make_config())
    sched.add_request(Request("r", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("r", [3], SamplingParams()))


def test_a_missing_sampled_token_is_an_error():
    sched = Scheduler(make_config())
    sched.add_request(Request("r", [1, 2], SamplingParams()))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no or too many sampled tokens"):
        sched.update_from_output(out, {})


# Stop rules, with a scripted model: the token at each position is fixed.
EOS, STOP = 2, 3
PROMPT = [50, 51, 52, 53]
SCRIPT_OUTPUTS = [10, 11, EOS, 12, STOP, 13, EOS, 14, 15, 16, 17, 18]


def scripted(tokens):
    return SCRIPT_OUTPUTS[len(tokens) - len(PROMPT)]


@pytest.mark.parametrize(
    ("params", "eos", "max_model_len", "expected", "reason"),
    [
        ({"max_tokens": 10}, {EOS}, 64, [10, 11, EOS], "stop"),
        ({"max_tokens": 10}, {12, 99}, 64, [10, 11, EOS, 12], "stop"),  # several eos ids
        ({"max_tokens": 10}, set(), 64, SCRIPT_OUTPUTS[:10], "length"),
        ({"max_tokens": 6, "ignore_eos": True}, {EOS}, 64, SCRIPT_OUTPUTS[:6], "length"),
        ({"max_tokens": 10, "stop_token_ids": [STOP]}, set(), 64, SCRIPT_OUTPUTS[:5], "stop"),
        ({"max_tokens": 10, "min_tokens": 3}, {EOS}, 64, [10, 11, EOS], "stop"),
        ({"max_tokens": 10, "min_tokens": 4}, {EOS}, 64, SCRIPT_OUTPUTS[:7], "stop"),
        (
            {"max_tokens": 10, "min_tokens": 6, "stop_token_ids": [STOP]},
            set(),
            64,
            SCRIPT_OUTPUTS[:10],
            "length",
        ),
        ({"max_tokens": 2}, {EOS}, 64, [10, 11], "length"),
        ({"max_tokens": 10}, set(), 7, [10, 11, EOS], "length"),  # 4 + 3 = max_model_len
        ({"max_tokens": 3}, {EOS}, 64, [10, 11, EOS], "stop"),  # a stop token wins over length
    ],
)
def test_stop_rules(params, eos, max_model_len, expected, reason):
    h = Harness(make_config(max_model_len=max_model_len), next_token=scripted)
    request = h.add("r", PROMPT, eos_token_ids=eos, **params)
    h.run()
    assert request.output_token_ids == expected
    assert request.finish_reason == reason
    ref = reference_generate(PROMPT, request.sampling_params, eos, max_model_len, scripted)
    assert ref == (expected, reason)
    if reason == "stop":
        assert request.stop_reason == expected[-1]


def test_finished_requests_free_their_blocks_in_the_same_step():
    h = Harness(make_config())
    h.add("short", prompt(10, 9), max_tokens=2)
    h.add("long", prompt(11, 9), max_tokens=20)
    h.step()
    h.step()  # short gets its 2nd token and finishes here
    assert h.requests["short"].finish_reason == "length"
    assert [r.request_id for r in h.sched.running] == ["long"]
    assert h.mgr.num_free_blocks == h.config.num_blocks - len(h.mgr.get_block_ids("long"))
    assert "short" in h.sched.schedule().finished_ids


def test_config_is_checked_when_the_scheduler_is_built():
    cfg = SchedulerConfig()
    cfg.num_blocks = 0
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(cfg)


@pytest.mark.parametrize("written_steps", [0, 1])
def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(written_steps):
    # Blocks are cached when allocated; a step that never ran must take them back out, or
    # the retry below hits slots nobody wrote (the fake model refuses to read those).
    h = Harness(make_config(max_num_batched_tokens=16, block_size=4))
    tokens = prompt(5, 40)
    h.add("a", tokens, max_tokens=3)
    for _ in range(written_steps):
        h.step()  # its first chunk is written and stays cached
    failed = h.sched.schedule()  # the model never runs this step
    h.sched.uncache_failed_step(failed)
    h.sched.abort_requests(["a"])
    h.check_state()
    assert len(h.mgr.cached_block_ids()) == 4 * written_steps
    h.add("retry", tokens, max_tokens=3)
    h.run()
    assert h.requests["retry"].num_cached_tokens == 16 * written_steps
    assert_outputs_match_reference(h)


def test_a_request_that_fits_only_in_pinned_blocks_is_refused_naming_them():
    h = Harness(make_config(num_blocks=6, block_size=4))
    system = prompt(9, 8)
    h.add("warm", system + [1], max_tokens=1)
    h.run()
    assert h.mgr.pin(system) == 8
    with pytest.raises(ValueError, match="2 of them pinned"):
        h.add("big", prompt(3, 20), max_tokens=1)  # 5 blocks > 6 - 2
    h.add("fits", prompt(3, 16), max_tokens=1)  # 4 blocks
    h.run()
    assert_outputs_match_reference(h)


class CountingGrammar:
    """A grammar complete after `length` tokens that accepts every token but `banned`."""

    def __init__(self, length: int, banned: int = -1) -> None:
        self.length, self.banned, self.accepted = length, banned, []

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.banned:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_the_scheduler_finishes_a_request_whose_grammar_completed():
    h = Harness(make_config())
    request = h.add("g", prompt(30, 9), max_tokens=20)
    request.grammar = CountingGrammar(length=3)
    h.run()
    assert request.finish_reason == "stop" and request.stop_reason is None
    assert request.grammar.accepted == request.output_token_ids  # every token, in order
    assert request.num_output_tokens == 3


def test_a_token_the_grammar_rejects_stops_the_request():
    h = Harness(make_config())
    first = fake_next_token(prompt(31, 9))
    request = h.add("g", prompt(31, 9), max_tokens=20)
    request.grammar = CountingGrammar(length=10, banned=first)
    h.run()
    assert request.finish_reason == "stop" and request.output_token_ids == [first]


def test_a_stop_token_or_length_wins_over_the_grammar():
    h = Harness(make_config())
    first = fake_next_token(prompt(32, 9))
    eos = fake_next_token([*prompt(32, 9), first])
    stopped = h.add("eos", prompt(32, 9), eos_token_ids={eos}, max_tokens=20)
    stopped.grammar = CountingGrammar(length=2)
    long = h.add("len", prompt(33, 9), max_tokens=2)
    long.grammar = CountingGrammar(length=2)
    h.run()
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos  # the token's text goes
    assert long.finish_reason == "length"
