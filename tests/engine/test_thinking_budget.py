"""The thinking budget (engine/structured_output/thinking_budget.py): the matcher's states
on hand-fed tokens, its mask through the step's real bitmask, and a tiny model whose think
block is closed at the budget, through preemption and beside unbudgeted requests."""

from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams, ThinkingBudget
from engine.structured_output.bitmask import GrammarBitmask
from engine.structured_output.thinking_budget import ThinkingBudgetMatcher
from tests.engine.tiny_models import make_tiny_model_dir

VOCAB = 200
START, END = (7, 8), (9, 63)  # 63: bit 31 of the mask's second word, int32's sign bit


def allowed(matcher: ThinkingBudgetMatcher) -> list[int]:
    """The tokens whose logits survive the matcher's row of a real step bitmask."""
    buffer = xgr.allocate_token_bitmask(2, VOCAB)
    buffer.zero_()  # as a reused buffer may hold another row's bits
    logits = torch.zeros(2, VOCAB)
    if matcher.fill_next_token_bitmask(buffer, 1):  # applied only when needed, as the step does
        GrammarBitmask(buffer, [1]).apply_(logits)
    return torch.nonzero(logits[1] == 0).flatten().tolist()


def test_an_opened_block_is_closed_by_force_after_its_budget():
    m = ThinkingBudgetMatcher(ThinkingBudget(3, START, END, opened=True))
    for token in (20, 21, 22):
        assert m.state == "counting" and len(allowed(m)) == VOCAB
        assert m.accept_token(token) and not m.is_terminated()
    for token in END:  # every other token masked, eos too, one closing id at a time
        assert m.state == "forcing" and allowed(m) == [token]
        m.accept_token(token)
    assert m.state == "done" and len(allowed(m)) == VOCAB
    for token in START:  # only the first block is capped
        m.accept_token(token)
    assert m.state == "done"


def test_the_count_starts_when_the_block_opens_and_a_close_the_model_writes_ends_it():
    m = ThinkingBudgetMatcher(ThinkingBudget(4, START, END))
    for token in (30, 7, 31, 7):  # a start id, then not the rest of the tag: still waiting
        m.accept_token(token)
        assert m.state == "waiting"
    m.accept_token(8)
    assert m.state == "counting"
    for token in (40, 9, 63):  # the model closes the block within its budget
        m.accept_token(token)
    assert m.state == "done" and len(allowed(m)) == VOCAB


@pytest.mark.parametrize("opened", [True, False])
def test_a_zero_budget_closes_the_block_at_once(opened):
    m = ThinkingBudgetMatcher(ThinkingBudget(0, START, END, opened=opened))
    if not opened:
        for token in START:
            m.accept_token(token)
    assert allowed(m) == [END[0]]


@pytest.mark.parametrize(
    "fields",
    [(-1, START, END), (3, (), END), (3, START, ())],
    ids=["negative", "no-start", "no-end"],
)
def test_a_budget_that_cannot_be_enforced_is_refused(fields):
    with pytest.raises(ValueError):
        ThinkingBudget(*fields)


# ------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=1)
    # A small cache: four requests of 40 tokens preempt one another.
    return LLM(str(path), dtype="float32", num_blocks=12, block_size=4)


def test_a_tiny_models_block_is_closed_at_the_budget_and_the_rest_is_its_own(llm):
    """Greedy on a random model (it never writes the closing tag itself): the budgeted
    output is the free output's first `budget` tokens, the closing tag, then the model's
    own tokens again; unbudgeted requests in the same batches are untouched."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(12)] for _ in range(4)]
    end = (901, 902, 903)
    budgets = [ThinkingBudget(b, (5, 6), end, opened=True) for b in (0, 4, 9)]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    reference = [o.token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, thinking_budget=b) for b in budgets]
    outs = llm.generate(prompts, [*params, free], use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0  # the state survived recomputation
    for prompt, budget, out, ref in zip(prompts, budgets, outs, reference, strict=False):
        tokens, n = list(out.token_ids), budget.tokens
        assert tokens[:n] == list(ref[:n]) and tuple(tokens[n : n + 3]) == end
        # After the close, what a free request continuing from there writes.
        rest = SamplingParams(max_tokens=24 - n - 3, temperature=0.0)
        (own,) = llm.generate([prompt + tokens[: n + 3]], rest, use_tqdm=False)
        assert tokens[n + 3 :] == list(own.token_ids)
    assert list(outs[3].token_ids) == list(reference[3])
