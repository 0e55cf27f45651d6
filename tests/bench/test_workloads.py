"""Workload prompts: exact token lengths, deterministic for a seed, real shared prefixes."""

from __future__ import annotations

import random

import pytest

from bench.workloads import (
    WorkloadSpec,
    build_conversations,
    build_prompts,
    count_tokens,
    shared_prefixes,
    text_of_tokens,
)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 16, 63, 200, 500])
def test_text_of_tokens_has_exactly_the_token_count(tokenizer, num_tokens):
    for seed in range(5):
        text = text_of_tokens(tokenizer, random.Random(seed), num_tokens)
        assert count_tokens(tokenizer, text) == num_tokens


def test_same_seed_same_prompts_other_seed_other_prompts(tokenizer):
    spec = WorkloadSpec("shared-prefix", num_requests=8, prefix_len=40, num_prefixes=2, seed=3)
    first = build_prompts(spec, tokenizer)
    assert build_prompts(spec, tokenizer) == first
    other = build_prompts(WorkloadSpec(**{**vars(spec), "seed": 4}), tokenizer)
    assert not {p.text for p in other} & {p.text for p in first}


def test_shared_prefix_groups_share_their_first_prefix_len_tokens(tokenizer):
    spec = WorkloadSpec("shared-prefix", num_requests=12, prefix_len=64, num_prefixes=3)
    prompts = build_prompts(spec, tokenizer)
    prefixes = [encode(tokenizer, p) for p in shared_prefixes(spec, tokenizer)]
    assert [len(p) for p in prefixes] == [64, 64, 64]
    assert [p.group for p in prompts] == [i % 3 for i in range(12)]
    for prompt in prompts:
        ids = encode(tokenizer, prompt.text)
        assert ids[:64] == prefixes[prompt.group]
        assert len(ids) > 64  # a question follows
    assert len({p.text for p in prompts}) == 12  # every question is distinct
    assert len({tuple(p[:8]) for p in prefixes}) == 3  # the groups share nothing


def test_zipf_prefix_groups_are_skewed_and_share_their_prefixes(tokenizer):
    spec = WorkloadSpec("zipf-prefix", num_requests=400, prefix_len=24, num_prefixes=16)
    prompts = build_prompts(spec, tokenizer)
    prefixes = [encode(tokenizer, p) for p in shared_prefixes(spec, tokenizer)]
    counts = [sum(p.group == g for p in prompts) for g in range(16)]
    # Weight 1 / (g + 1): group 0 about 30% of requests, group 15 about 2%.
    assert counts[0] > 3 * counts[15] and counts[0] > max(counts[8:])
    assert sum(c > 0 for c in counts) >= 12  # the tail is there too
    for prompt in prompts[:40]:
        assert encode(tokenizer, prompt.text)[:24] == prefixes[prompt.group]
    assert build_prompts(spec, tokenizer) == prompts  # deterministic for the seed


def test_unique_prompts_share_nothing_but_have_the_same_lengths(tokenizer):
    shared = build_prompts(WorkloadSpec("shared-prefix", num_requests=6, prefix_len=48), tokenizer)
    unique = build_prompts(WorkloadSpec("unique", num_requests=6, prefix_len=48), tokenizer)
    heads = {tuple(encode(tokenizer, p.text)[:8]) for p in unique}
    assert len(heads) == 6
    shared_lens = sorted(count_tokens(tokenizer, p.text) for p in shared)
    unique_lens = sorted(count_tokens(tokenizer, p.text) for p in unique)
    assert abs(sum(shared_lens) - sum(unique_lens)) <= len(unique_lens)  # same lengths +-1
    assert min(unique_lens) > 48


def test_repeat_prompts_ask_again_word_for_word(tokenizer):
    spec = WorkloadSpec("repeat", num_requests=7, prefix_len=32, num_prefixes=3)
    prompts = build_prompts(spec, tokenizer)
    assert len({p.text for p in prompts}) == 3
    for i, prompt in enumerate(prompts):
        assert prompt == prompts[i % 3]
    # The distinct prompts are unique-workload prompts: nothing shared between them.
    unique = build_prompts(WorkloadSpec("unique", num_requests=3, prefix_len=32), tokenizer)
    assert [p.text for p in prompts[:3]] == [p.text for p in unique]


def test_conversations_split_the_requests_and_resend_the_history(tokenizer):
    spec = WorkloadSpec("multi-turn", num_requests=10, prefix_len=30, turns=4)
    conversations = build_conversations(spec, tokenizer)
    assert [len(c.questions) for c in conversations] == [4, 4, 2]
    assert build_conversations(spec, tokenizer)[0].questions == conversations[0].questions
    conv = conversations[0]
    assert count_tokens(tokenizer, conv.context) == 30
    conv.answers = ["first answer", "second answer"]
    prompt = conv.completion_prompt(2)
    assert prompt.startswith(conv.context)
    for k, answer in enumerate(conv.answers):
        assert prompt.index(conv.questions[k]) < prompt.index(answer)
    assert prompt.endswith(conv.questions[2] + "\nAssistant:")
    assert conv.completion_prompt(1) in prompt  # turn k+1 extends turn k's prompt
    messages = conv.chat_messages(2)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"].startswith(conv.context)
    assert messages[3]["content"] == "second answer"


@pytest.mark.parametrize(
    "fields", [{"name": "nope"}, {"num_requests": 0}, {"prefix_len": -1}, {"turns": 0}]
)
def test_bad_specs_are_refused(fields):
    with pytest.raises(ValueError):
        WorkloadSpec(**fields)


def test_bursty_prefix_groups_are_equal_and_interleaved(tokenizer):
    spec = WorkloadSpec("bursty-prefix", num_requests=24, prefix_len=24, num_prefixes=4)
    prompts = build_prompts(spec, tokenizer)
    groups = [p.group for p in prompts]
    assert sorted(groups) == sorted(i % 4 for i in range(24))
    assert groups != sorted(groups) and groups != [i % 4 for i in range(24)]  # shuffled
    prefixes = [encode(tokenizer, p) for p in shared_prefixes(spec, tokenizer)]
    for prompt in prompts:
        assert encode(tokenizer, prompt.text)[:24] == prefixes[prompt.group]
    assert build_prompts(spec, tokenizer) == prompts
