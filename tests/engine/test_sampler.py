"""Sampler: greedy, seeded reproducibility, truncation masks, penalties, bias, min_tokens,
logprobs and the sampled distribution, each against a direct reference computation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    draw_from,
    make_generator,
    to_token_logprobs,
)
from scheduler.sampling_params import SamplingParams

DEVICE = torch.get_default_device()
EOS = 2


def build(params, prompts=None, outputs=None, generators=None, eos=None):
    """Metadata for `params`; `eos` is one frozenset per row (default: {EOS} for every row)."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [frozenset({EOS})] * n,
        DEVICE,
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, device=DEVICE) * scale


# --- greedy and the cheap path ----------------------------------------------------------


def test_all_greedy_batch_is_argmax_and_builds_nothing():
    params = [SamplingParams(temperature=0.0) for _ in range(4)]
    meta = build(params, prompts=[[1, 2, 3]] * 4, outputs=[[4]] * 4)
    assert meta.all_greedy and meta.no_penalties and not meta.all_random
    assert meta.random is None and meta.penalties is None
    assert meta.logit_bias is None and meta.min_tokens_mask is None
    assert meta.max_num_logprobs is None
    logits = random_logits(4, 50)
    out = Sampler()(logits, meta)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_sampler_does_not_modify_the_callers_logits():
    params = [
        SamplingParams(
            temperature=0.7,
            top_k=5,
            top_p=0.8,
            min_p=0.1,
            logit_bias={3: 5.0},
            repetition_penalty=1.3,
            presence_penalty=0.5,
            min_tokens=2,
            stop_token_ids=[7],
            seed=1,
        )
    ]
    logits = random_logits(1, 30)
    before = logits.clone()
    Sampler()(logits, build(params, [[1, 4]], [[5]], [make_generator(1, DEVICE)]))
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_take_argmax_of_processed_logits():
    params = [
        SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
    ]
    logits = random_logits(4, 40, seed=1)
    gens = [None, None, None, make_generator(3, DEVICE)]
    out = Sampler()(logits, build(params, generators=gens))
    tokens = out.token_ids.tolist()
    assert tokens[0] == 11
    assert tokens[2] == int(logits[2].argmax())
    assert all(0 <= t < 40 for t in tokens)


def test_tiny_temperature_is_greedy():
    meta = build([SamplingParams(temperature=1e-7)])
    assert meta.all_greedy


# --- seeded sampling --------------------------------------------------------------------


def run_steps(batch_params, seeded_row, steps_logits, other_logits_seed):
    """Sample `len(steps_logits)` steps; row `seeded_row` gets steps_logits[s] each step."""
    gens = [make_generator(p.seed, DEVICE) if p.seed is not None else None for p in batch_params]
    sampler = Sampler()
    tokens = []
    for step, row_logits in enumerate(steps_logits):
        logits = random_logits(
            len(batch_params), row_logits.shape[0], seed=other_logits_seed + step
        )
        logits[seeded_row] = row_logits
        meta = build(batch_params, generators=gens)
        tokens.append(int(sampler(logits, meta).token_ids[seeded_row]))
    return tokens


def test_seeded_request_is_reproducible_whatever_the_batch():
    vocab = 200
    steps = [random_logits(1, vocab, seed=100 + s, scale=1.0)[0] for s in range(6)]
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = run_steps([target], 0, steps, other_logits_seed=0)
    again = run_steps([target], 0, steps, other_logits_seed=50)
    assert alone == again
    batch_a = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        target,
        SamplingParams(temperature=0.5, seed=99),
    ]
    batch_b = [target, SamplingParams(temperature=1.2, top_k=3), SamplingParams(seed=7)]
    assert run_steps(batch_a, 2, steps, other_logits_seed=10) == alone
    assert run_steps(batch_b, 0, steps, other_logits_seed=20) == alone
    # The seed matters: a flat-ish distribution over 200 tokens gives another sequence.
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=4321)
    assert run_steps([other], 0, steps, other_logits_seed=0) != alone
    # The generator advances across steps: the same logits each step do not repeat the token.
    repeated = run_steps([target], 0, [steps[0]] * 6, other_logits_seed=0)
    assert len(set(repeated)) > 1


def test_seed_without_generator_is_refused():
    with pytest.raises(ValueError, match="seed"):
        build([SamplingParams(seed=5)], generators=[None])


# --- truncation masks -------------------------------------------------------------------


def reference_keep(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    kept = sorted(keep, key=lambda i: -probs[i])
    total = sum(probs[i] for i in kept)
    renorm = [probs[i] / total for i in kept]
    nucleus, mass = set(), 0.0
    for i, p in zip(kept, renorm, strict=True):
        nucleus.add(i)
        mass += p
        if mass >= top_p:
            break
    top = max(probs)
    return {i for i in nucleus if probs[i] >= min_p * top}


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (8, 0.7, 0.0), (4, 0.9, 0.05), (1, 1.0, 0.0)],
)
def test_masks_match_reference(top_k, top_p, min_p):
    logits = random_logits(6, 25, seed=top_k + int(top_p * 10), scale=2.0)
    rows = logits.shape[0]
    k = torch.full((rows,), top_k, device=DEVICE) if top_k else None
    p = torch.full((rows, 1), top_p, device=DEVICE) if top_p < 1.0 else None
    masked = apply_top_k_top_p(logits, k, p)
    if min_p:
        masked = apply_min_p(masked, torch.full((rows, 1), min_p, device=DEVICE))
    for r in range(rows):
        probs = logits[r].softmax(-1).tolist()
        expected = reference_keep(probs, top_k, top_p, min_p)
        kept = set(torch.nonzero(masked[r] > float("-inf")).flatten().tolist())
        assert kept == expected
        assert torch.equal(masked[r][list(kept)], logits[r][list(kept)])


def test_per_row_settings_with_some_rows_off():
    logits = random_logits(3, 30, seed=5)
    k = torch.tensor([3, 0, 10], device=DEVICE)
    p = torch.tensor([[1.0], [0.5], [1.0]], device=DEVICE)
    masked = apply_top_k_top_p(logits, k, p)
    only_k = apply_top_k_top_p(logits, k, None)
    for r, (top_k, top_p) in enumerate([(3, 1.0), (0, 0.5), (10, 1.0)]):
        expected = reference_keep(logits[r].softmax(-1).tolist(), top_k, top_p, 0.0)
        assert set(torch.nonzero(masked[r].isfinite()).flatten().tolist()) == expected
        if top_p == 1.0:  # the top-k-only path agrees with the sorting path
            assert set(torch.nonzero(only_k[r].isfinite()).flatten().tolist()) == expected
    assert only_k[1].isfinite().all()  # top_k 0 is off


def reference_top_p(logits_row: torch.Tensor, top_p: float) -> set[int]:
    """Sort the whole vocabulary (float64): keep while the mass ranked above is below p."""
    probs = logits_row.double().softmax(-1)
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(-1) - ordered) < top_p
    keep[0] = True
    return set(order[keep].tolist())


def test_top_p_finds_small_medium_and_wide_nuclei():
    # Row scales chosen so the nuclei fall in each of the mask's candidate stages.
    vocab = 6000
    scales = [8.0, 4.0, 1.5, 0.3, 2.0]
    top_ps = [0.9, 0.9, 0.9, 0.9, 1.0]
    logits = torch.cat(
        [random_logits(1, vocab, seed=20 + i, scale=s) for i, s in enumerate(scales)]
    )
    p = torch.tensor(top_ps, device=DEVICE).unsqueeze(1)
    masked = apply_top_k_top_p(logits, None, p)
    sizes = []
    for r, top_p in enumerate(top_ps):
        kept = set(torch.nonzero(masked[r].isfinite()).flatten().tolist())
        expected = reference_top_p(logits[r], top_p) if top_p < 1.0 else set(range(vocab))
        assert kept == expected
        sizes.append(len(kept))
    assert sizes[0] < 64 < sizes[1] < 512 < sizes[2] < sizes[3] < vocab == sizes[4]


def test_inverse_cdf_draw_hits_every_interval_and_never_a_zero_probability_token():
    vocab = 700  # not a multiple of the 256-token chunks
    positive = {3: 0.1, 255: 0.2, 256: 0.05, 511: 0.3, 600: 1e-6, 699: 0.35}
    probs = torch.zeros(vocab, dtype=torch.float32, device=DEVICE)
    for token, p in positive.items():
        probs[token] = p
    tokens = sorted(positive)
    total = sum(positive.values())
    # Midpoints of each token's interval of the cumulative distribution, and both ends.
    cuts, expected = [], []
    below = 0.0
    for token in tokens:
        cuts.append((below + positive[token] / 2) / total)
        expected.append(token)
        below += positive[token]
    cuts += [0.0, math.nextafter(1.0, 0.0)]
    expected += [tokens[0], tokens[-1]]
    uniform = torch.tensor(cuts, dtype=torch.float64, device=DEVICE)
    rows = probs.unsqueeze(0).expand(len(cuts), -1).contiguous()
    assert draw_from(rows, uniform).tolist() == expected
    one_hot = torch.zeros(2, 300, device=DEVICE)
    one_hot[:, 150] = 1.0  # the zero tail includes a whole chunk
    # 1.0 is outside [0, 1): it stands for rounding putting the target at the very end.
    ends = torch.tensor([0.0, 1.0], dtype=torch.float64, device=DEVICE)
    assert draw_from(one_hot, ends).tolist() == [150, 150]


def sample_many(params: SamplingParams, logits_row: torch.Tensor, n: int, seed: int) -> list[int]:
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Sampler()(logits, build([params] * n)).token_ids.tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.5, min_p=0.3),
    ],
)
def test_sampling_only_draws_allowed_tokens(params):
    logits_row = random_logits(1, 40, seed=9, scale=1.5)[0]
    scaled = (logits_row / params.temperature).softmax(-1).tolist()
    allowed = reference_keep(scaled, params.top_k, params.top_p, params.min_p)
    drawn = set(sample_many(params, logits_row, 4000, seed=0))
    assert drawn == allowed  # nothing outside, and every allowed token shows up


# --- penalties, bias, min_tokens --------------------------------------------------------


def reference_penalties(logits, params, prompts, outputs):
    rows = logits.tolist()
    for r, p in enumerate(params):
        seen = set(prompts[r]) | set(outputs[r])
        for t, x in enumerate(rows[r]):
            if t in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[r].count(t)
            rows[r][t] = x - (p.frequency_penalty * count + p.presence_penalty * (count > 0))
    return torch.tensor(rows, device=logits.device)


def test_penalties_match_per_element_reference():
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(temperature=0.0),  # no penalty: untouched
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
    ]
    prompts = [[1, 3, 3, 9], [2, 4], [5, 6, 7], [0, 8, 8]]
    outputs = [[4, 4, 11], [4, 4, 4, 10, 0], [1, 2], [8, 12, 12, 13]]
    logits = random_logits(4, 15, seed=3)
    meta = build(params, prompts, outputs)
    assert not meta.no_penalties
    got = Sampler.process_logits(logits, meta)
    expected = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[2], logits[2])


def test_greedy_token_changes_under_repetition_penalty():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]], device=DEVICE)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    out = Sampler()(logits, build(params, prompts=[[1]], outputs=[[]]))
    assert out.token_ids.tolist() == [2]  # 5/2 < 4


def test_logit_bias_adds_per_row_and_ignores_unknown_ids():
    params = [
        SamplingParams(temperature=0.0, logit_bias={1: 2.5, 4: -100.0, 999: 3.0}),
        SamplingParams(temperature=0.0),
    ]
    logits = random_logits(2, 6, seed=4)
    got = Sampler.process_logits(logits, build(params))
    expected = logits.clone()
    expected[0, 1] += 2.5
    expected[0, 4] -= 100.0
    torch.testing.assert_close(got, expected)
    forced = [SamplingParams(temperature=0.0, logit_bias={5: 1000.0})]
    assert Sampler()(random_logits(1, 6), build(forced)).token_ids.tolist() == [5]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4, 6]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]),  # reached
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[6]),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[9, 9], [9, 9], [], []]
    logits = random_logits(4, 10, seed=6)
    eos = [frozenset({EOS})] * 3 + [frozenset({3})]
    got = Sampler.process_logits(logits, build(params, outputs=outputs, eos=eos))
    masked = {r: set(torch.nonzero(got[r].isinf()).flatten().tolist()) for r in range(4)}
    assert masked == {0: {EOS, 4, 6}, 1: set(), 2: {6}, 3: set()}
    # The eos would have won greedily: with the mask the argmax is elsewhere.
    logits[0, EOS] = 50.0
    row0 = build(params[:1], outputs=outputs[:1])
    assert Sampler()(logits[:1], row0).token_ids.tolist() != [EOS]


def test_min_tokens_masks_every_eos_of_a_multi_eos_model():
    # Llama 3 / Qwen2.5-Instruct name two eos ids; a raw set here once crashed the step.
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=1),  # reached
    ]
    eos = [frozenset({EOS, 7})] * 3
    logits = random_logits(3, 10, seed=3)
    logits[:, 7] = 50.0  # the second eos would win greedily
    meta = build(params, outputs=[[], [], [9]], eos=eos)
    got = Sampler.process_logits(logits, meta)
    masked = {r: set(torch.nonzero(got[r].isinf()).flatten().tolist()) for r in range(3)}
    assert masked == {0: {EOS, 7}, 1: set(), 2: set()}
    assert Sampler()(logits, meta).token_ids.tolist() != [7, 7, 7]
    assert Sampler()(logits, meta).token_ids.tolist()[1:] == [7, 7]


def test_eos_ids_must_be_one_per_row():
    with pytest.raises(ValueError, match="eos_token_ids"):
        build([SamplingParams()] * 2, eos=[frozenset({EOS})])


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution():
    vocab = 20  # == MAX_LOGPROBS, so the top-N covers the whole vocabulary
    params = [
        SamplingParams(
            temperature=0.5, top_k=3, logit_bias={0: 4.0}, presence_penalty=1.0, logprobs=20
        ),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=2),
        SamplingParams(temperature=1.0),
    ]
    gens = [None] * 3
    logits = random_logits(3, vocab, seed=8)
    meta = build(params, [[1, 2]] * 3, [[5, 6]] * 3, gens)
    assert meta.max_num_logprobs == 20
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    tokens = out.token_ids
    torch.testing.assert_close(out.logprobs, raw.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert out.top_token_ids.shape == (3, 20)
    torch.testing.assert_close(out.top_logprobs.exp().sum(dim=-1), torch.ones(3))
    expected_values, expected_ids = raw.sort(dim=-1, descending=True)
    torch.testing.assert_close(out.top_logprobs, expected_values)
    assert torch.equal(out.top_token_ids, expected_ids)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())

    per_request = to_token_logprobs(out, [p.logprobs for p in params])
    assert per_request[2] is None
    second = per_request[1]
    assert second.token_id == int(tokens[1])
    assert math.isclose(second.logprob, float(raw[1, tokens[1]]), rel_tol=1e-6)
    assert list(second.top) == expected_ids[1, :2].tolist()
    assert len(per_request[0].top) == 20


def test_zero_logprobs_gives_only_the_sampled_token():
    meta = build([SamplingParams(temperature=0.0, logprobs=0)])
    logits = random_logits(1, 12)
    out = Sampler()(logits, meta)
    assert out.top_token_ids.shape == (1, 0)
    (entry,) = to_token_logprobs(out, [0])
    assert entry.top == {}
    assert math.isclose(entry.logprob, float(torch.log_softmax(logits, -1).max()), rel_tol=1e-6)


# --- the sampled distribution -----------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


# df = 5: 20.5 is the 0.999 quantile; the draws are seeded, so this is deterministic.
CHI2_LIMIT = 20.5


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_samples_follow_softmax_over_temperature(temperature):
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2], device=DEVICE)
    n = 20000
    drawn = sample_many(SamplingParams(temperature=temperature), logits_row, n, seed=1)
    counts = [drawn.count(t) for t in range(6)]
    probs = (logits_row / temperature).softmax(-1).tolist()
    assert chi_square(counts, probs) < CHI2_LIMIT
    # And the temperature is really applied: T=1 probabilities would not fit at T=0.7/2.
    if temperature != 1.0:
        assert chi_square(counts, logits_row.softmax(-1).tolist()) > 10 * CHI2_LIMIT


def test_seeded_draws_follow_the_distribution_too():
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2], device=DEVICE)
    n = 3000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    gens = [make_generator(s, DEVICE) for s in range(n)]
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    drawn = Sampler()(logits, build(params, generators=gens)).token_ids.tolist()
    counts = [drawn.count(t) for t in range(6)]
    assert chi_square(counts, (logits_row / 0.8).softmax(-1).tolist()) < CHI2_LIMIT
