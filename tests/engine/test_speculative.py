"""Speculative decoding (`--speculative ngram|suffix`) changes the speed, never the output.

Each case runs the same requests with speculation on and off and the outputs must be
identical: greedy tokens (and transformers' greedy tokens, the float32 reference),
seeded samples, logprobs, penalties, stop strings and stop tokens; every block comes
back. Tiny random-weight models rarely repeat themselves, so there an oracle drafter
proposes each request's true continuation, often corrupted: every outcome (all drafts
kept, some, none) happens on the model's forward and sampler. The default model runs the
real n-gram drafter on a text to copy (its GGUF kernels and native decode stack verify).
Each case checks that drafts were kept, so none can pass with the drafter idle.
"""

from __future__ import annotations

import json
import math
import random

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputs
from engine.sampler import Sampler, SamplingMetadata
from engine.speculative import DRAFTERS, accept_drafts
from engine.speculative.grammar import GrammarDrafts
from engine.speculative.ngram import NgramDrafter, TokenHistory
from engine.speculative.speculator import RequestSpec
from engine.speculative.suffix import SuffixCorpus, SuffixDrafter
from engine.speculative.verify import rewind
from tests.engine.test_engine_golden import hf_greedy
from tests.engine.tiny_models import make_tiny_model_dir

TEXT = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "print(area(3, 4), perimeter(3, 4))\n"
)


class OracleDrafter:
    """Drafts from each prompt's output without speculation (`truth`), each draft corrupted
    with probability 0.35 at one position, and a random tail past the truth's end."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.truth = truth
        self.rng = random.Random(seed)

    def propose(self, request, k: int) -> list[int]:
        rng, n = self.rng, request.num_output_tokens
        drafts = self.truth[tuple(request.prompt_token_ids)][n : n + k]
        drafts += [rng.randrange(3, 1000) for _ in range(k - len(drafts))]
        if rng.random() < 0.35:
            drafts[rng.randrange(len(drafts))] = rng.randrange(3, 1000)
        return drafts

    def finished(self, request) -> None:
        pass


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    on = LLM(str(path), dtype="float32", speculative="ngram", num_speculative_tokens=5)
    return path, on, LLM(str(path), dtype="float32")


def tiny_prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def generate(llm: LLM, prompts, params: SamplingParams):
    return llm.generate(prompts, [params] * len(prompts), use_tqdm=False)


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.core.speculator.stats
    return stats.num_draft_tokens, stats.num_accepted_tokens


def assert_oracle_speculation_matches(path, prompts, expected, max_new_tokens: int) -> None:
    """ngram speculation whose drafter proposes the true tokens (`OracleDrafter`): the
    verified output is transformers' greedy tokens, most drafts kept, every block back."""
    from tests.engine.test_engine_golden import assert_all_blocks_free, engine_greedy

    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256,
              speculative="ngram", num_speculative_tokens=4)  # fmt: skip
    truth = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    llm.engine.core.speculator.drafter = OracleDrafter(truth)
    assert engine_greedy(llm, prompts, max_new_tokens) == expected
    drafted, kept = spec_counts(llm)
    assert kept >= 10 and drafted > kept
    assert_all_blocks_free(llm)


def assert_blocks_free(llm: LLM) -> None:
    kv = llm.engine.core.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == llm.engine.core.num_blocks


def assert_same_with_drafts_kept(on: LLM, off: LLM, prompts, params: SamplingParams):
    """Run `prompts` without speculation, then with it (the oracle drafting from the
    first run where the tiny models need it); the outputs must be identical."""
    want = generate(off, prompts, params)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, want, strict=True)}
    on.engine.core.speculator.drafter = OracleDrafter(truth)
    drafted, kept = spec_counts(on)
    got = generate(on, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    new_drafted, new_kept = spec_counts(on)
    assert new_kept - kept >= 10, "the drafter proposed nothing the model kept: no test"
    assert new_drafted - drafted > new_kept - kept  # and some were rejected
    assert_blocks_free(on)
    return got, want


def test_greedy_output_equals_transformers_with_speculation_on(tiny):
    path, on, off = tiny
    prompts = tiny_prompts()
    got, _ = assert_same_with_drafts_kept(on, off, prompts, SamplingParams(max_tokens=24,
                                                                          temperature=0.0))  # fmt: skip
    assert [o.token_ids for o in got] == hf_greedy(path, prompts, 24)


def test_logprobs_and_penalties_are_the_same_with_speculation_on(tiny):
    _, on, off = tiny
    params = SamplingParams(
        max_tokens=30, temperature=0.0, logprobs=3, frequency_penalty=0.5,
        repetition_penalty=1.2, min_tokens=5,
    )  # fmt: skip
    got, want = assert_same_with_drafts_kept(on, off, tiny_prompts(), params)
    for a, b in zip(got, want, strict=True):
        assert len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and set(x.top) == set(y.top)
            assert math.isclose(x.logprob, y.logprob, rel_tol=1e-3, abs_tol=1e-4)


def test_stop_strings_and_stop_tokens_cut_inside_kept_drafts(tiny):
    _, on, off = tiny
    prompts = tiny_prompts()
    # Stop on what the outputs hold halfway: each request stops partway, mostly inside
    # a verification's kept drafts.
    plain = generate(off, prompts, SamplingParams(max_tokens=30, temperature=0.0))
    stops = [o.token_ids[12] for o in plain]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=stops)
    assert all(o.finish_reason == "stop" for o in
               assert_same_with_drafts_kept(on, off, prompts, params)[0])  # fmt: skip
    texts = [o.text[len(o.text) // 2 :][:3] for o in plain]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[t for t in texts if t])
    assert_same_with_drafts_kept(on, off, prompts, params)


def test_a_request_can_opt_out(tiny):
    _, on, off = tiny
    drafted, _ = spec_counts(on)
    params = SamplingParams(max_tokens=20, temperature=0.0, speculative=False)
    got = generate(on, tiny_prompts(), params)
    assert spec_counts(on)[0] == drafted
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(off, tiny_prompts(),
                                                                       params)]  # fmt: skip


def test_the_default_model_copying_text_keeps_its_greedy_output_with_ngram_drafts():
    """The served path (the GGUF's own blocks, the native decode stack verifying up to 7
    rows) with the real drafter: identical tokens on and off."""
    on = LLM(speculative="ngram", num_speculative_tokens=6)
    assert isinstance(on.engine.core.speculator.drafter, NgramDrafter)
    off = LLM()
    prompt = on.engine.core.tokenizer.encode(f"Copy the code exactly.\n{TEXT}\nCopy:\n{TEXT[:12]}")
    params = SamplingParams(max_tokens=80, temperature=0.0)
    want = generate(off, [prompt], params)
    kept = spec_counts(on)[1]
    got = generate(on, [prompt], params)
    assert got[0].token_ids == want[0].token_ids
    assert spec_counts(on)[1] - kept >= 30
    assert_blocks_free(on)


def test_the_default_models_seeded_samples_are_identical_with_speculation_on():
    """The request's generator is rewound to one draw per token emitted, so a seed gives
    the same text at any temperature (the one thing vLLM's speculation does not keep), as
    long as a verify step's rows get the bits a decode step's row gets. The served path
    (the GGUF's blocks through the native kernels, which sum a row the same way in any
    tile: tests/engine/test_gguf.py) holds that on every CPU; the tiny models' float32
    path is torch's matmul, which does not on every CPU (docs/speculative-decoding.md), so
    the rule is checked on this path."""
    on, off = LLM(speculative="ngram", num_speculative_tokens=5), LLM()
    for seed in range(2):
        params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=seed)
        assert_same_with_drafts_kept(on, off, tiny_prompts(), params)


# -- the rules, without a model ----------------------------------------------------------


def test_accept_drafts_keeps_the_agreeing_prefix_and_one_token_more():
    assert accept_drafts([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept_drafts([5, 9, 7], [5, 6]) == [5, 9]
    assert accept_drafts([4, 6, 7], [5, 6]) == [4]


def test_sampled_verification_keeps_the_target_distribution():
    """Draft d at a position with distribution p: kept with probability p(d), and the
    token emitted in its place on a miss is distributed as p without d (speculative
    sampling's rule), checked by a chi-square over 20,000 draws."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().unsqueeze(0).repeat(20_000, 1)
    params = [SamplingParams(temperature=1.0)] * logits.shape[0]
    meta = SamplingMetadata.build(params, [[]] * len(params), [[]] * len(params),
                                  [None] * len(params), [frozenset()] * len(params), "cpu")  # fmt: skip
    draft = 1
    first = [accept_drafts([t, 0], [draft])[0] for t in Sampler()(logits, meta).token_ids.tolist()]
    kept = sum(1 for t in first if t == draft) / len(first)
    assert abs(kept - probs[draft].item()) < 0.01
    missed = [t for t in first if t != draft]
    residual = probs.clone()
    residual[draft] = 0
    residual /= residual.sum()
    counts = torch.bincount(torch.tensor(missed), minlength=5).double()
    expected = residual.double() * len(missed)
    chi2 = sum(((counts[i] - expected[i]) ** 2 / expected[i]).item()
               for i in range(5) if i != draft)  # fmt: skip
    assert counts[draft] == 0
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_rewind_leaves_the_generator_one_draw_per_emitted_token():
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    state = a.get_state()
    for _ in range(5):  # a verification of 4 drafts draws 5 numbers...
        torch.rand((), dtype=torch.float64, generator=a)
    rewind(a, state, 2)  # ...of which 2 tokens were kept
    for _ in range(2):
        torch.rand((), dtype=torch.float64, generator=b)
    assert torch.rand(4, generator=a).tolist() == torch.rand(4, generator=b).tolist()


def test_ngram_history_proposes_what_followed_the_last_occurrence():
    history = TokenHistory()
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    history.sync(tokens)
    assert history.propose(2, 4, 3) == [4, 5, 9]
    tokens += [7]
    history.sync(tokens)
    assert history.propose(2, 4, 3) == []  # [3, 7] never occurred before
    # Token ids past one byte, and a match only on 4-byte boundaries.
    rng = random.Random(0)
    tokens = [rng.randrange(70_000) for _ in range(300)]
    tokens += tokens[100:103]
    history = TokenHistory()
    history.sync(tokens)
    assert history.propose(3, 3, 5) == tokens[103:108]


# -- suffix drafting: earlier requests' outputs ------------------------------------------


def test_a_repeated_request_drafts_its_whole_answer_from_the_earlier_one(tmp_path):
    """`--speculative suffix`: the first request's output joins the corpus; the same
    request again drafts from it and keeps nearly every draft, with the same tokens as
    without speculation. Prompt lookup alone (`ngram`) has nothing to draft from there."""
    path = make_tiny_model_dir(tmp_path, "llama", seed=1)
    prompt = tiny_prompts(1)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (want,) = generate(LLM(str(path), dtype="float32"), [prompt], params)
    kept = {}
    for method in ("ngram", "suffix"):
        on = LLM(str(path), dtype="float32", speculative=method, num_speculative_tokens=8)
        assert isinstance(on.engine.core.speculator.drafter, DRAFTERS[method])
        (first,) = generate(on, [prompt], params)
        before = spec_counts(on)[1]
        (again,) = generate(on, [prompt], params)
        assert first.token_ids == again.token_ids == want.token_ids
        kept[method] = spec_counts(on)[1] - before
        assert_blocks_free(on)
    assert kept["suffix"] >= 30, kept  # of 39 tokens after the first
    assert kept["ngram"] < kept["suffix"] // 2, kept


def test_the_suffix_corpus_finds_the_longest_suffix_newest_first_and_stays_bounded():
    corpus = SuffixCorpus(max_tokens=20)
    corpus.add([1, 2, 3, 4, 5])
    corpus.add([7, 2, 3, 9])
    assert corpus.longest([2, 3], 2, 3) == (2, [9])  # the newest; cut at the output's end
    assert corpus.longest([1, 2, 3], 2, 3) == (3, [4, 5])  # the longest, though older
    assert corpus.longest([8, 3, 4], 1, 3) == (2, [5])
    assert corpus.longest([7, 3, 4], 3, 3) == (0, [])  # shorter than min_n
    assert corpus.longest([3, 9], 2, 3) == (0, [])  # occurs, but nothing follows it
    assert corpus.longest([5, 7], 2, 3) == (0, [])  # no match across two outputs
    corpus.add(list(range(100, 110)))  # 6 + 5 + 11 tokens: the oldest goes
    assert corpus.num_tokens <= 20
    assert corpus.longest([3, 4], 2, 3) == (0, [])
    assert corpus.longest([2, 3], 2, 3) == (2, [9])
    assert corpus.longest([101, 102], 2, 3) == (2, [103, 104, 105])
    corpus.add(list(range(30)))  # larger than the corpus: not kept, nothing dropped
    assert corpus.longest([2, 3], 2, 3) == (2, [9])
    corpus = SuffixCorpus()
    corpus.add([0x01020304, 0x05060708, 42])  # ids past 16 bits
    assert corpus.longest([0x01020304, 0x05060708], 2, 2) == (2, [42])


class _Request:
    """What a drafter reads of a request."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids = prompt, output
        self.all_token_ids = prompt + output
        self.num_prompt_tokens, self.num_output_tokens = len(prompt), len(output)
        self.spec = RequestSpec(8)


def test_the_suffix_drafter_takes_the_longest_match_own_tokens_first():
    drafter = SuffixDrafter(min_n=2, max_n=4, corpus=SuffixCorpus())
    drafter.finished(_Request([50, 51, 52, 53, 54, 1], [2, 3, 4, 60, 61]))
    # The corpus holds the prompt's last 4 tokens and the output.
    assert drafter.corpus.longest([51, 52], 2, 2) == (0, [])
    assert drafter.corpus.longest([52, 53], 2, 2) == (2, [54, 1])
    # Own tokens match [3, 4] (2 tokens), the corpus [2, 3, 4] (3): the longer wins.
    assert drafter.propose(_Request([3, 4, 8, 8, 2, 3, 4], []), 2) == [60, 61]
    # Equal lengths: the request's own continuation.
    assert drafter.propose(_Request([9, 3, 4, 70, 9, 3, 4], []), 2) == [70, 9]
    # The answer's first tokens match the end of the earlier prompt.
    assert drafter.propose(_Request([77, 53, 54, 1], []), 3) == [2, 3, 4]
    assert drafter.propose(_Request([5, 6, 7], []), 3) == []


# -- under a grammar ---------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "station_identifier": {"enum": ["north-ridge-observatory", "south-harbour-buoy"]},
        "temperature_celsius": {"type": "integer", "minimum": -40, "maximum": 60},
        "conditions": {"enum": ["clear", "overcast", "thunderstorm"]},
    },
    "required": ["station_identifier", "temperature_celsius", "conditions"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("knobs", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 3}],
                         ids=["greedy", "seeded"])  # fmt: skip
def test_under_a_grammar_forced_tokens_are_drafted_and_the_output_is_unchanged(tmp_path, knobs):
    """A JSON schema whose keys and enum values the grammar forces token by token: those
    are drafted (jump-forward) and kept; the output is the same tokens as without
    speculation, and valid."""
    path = make_tiny_model_dir(tmp_path, "llama", seed=1)
    spec = StructuredOutputs.json_schema(WEATHER)
    params = SamplingParams(max_tokens=120, structured_outputs=spec, **knobs)
    prompts = tiny_prompts(3)
    want = generate(LLM(str(path), dtype="float32"), prompts, params)
    on = LLM(str(path), dtype="float32", speculative="ngram", num_speculative_tokens=8)
    got = generate(on, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), WEATHER)
    drafted, kept = spec_counts(on)
    assert kept >= 20, (drafted, kept)  # the keys alone are ~20 forced tokens a request
    assert_blocks_free(on)


def test_grammar_drafts_stop_at_a_refused_token_then_add_the_forced_text():
    llm = LLM(dtype="float32", num_blocks=64)
    tok = llm.engine.core.tokenizer
    spec = StructuredOutputs("regex", "Answer: (yes|no), because [a-z ]{1,20}\\.")
    import xgrammar as xgr

    grammar = llm.engine.core.structured_outputs.compile(spec).grammar
    matcher = xgr.GrammarMatcher(grammar)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    checker = GrammarDrafts(encode)
    # A right draft is kept whole, and the text the grammar forces after it is added.
    answer = encode("Answer: yes")
    assert tok.decode(checker.check(matcher, answer, 8)) == "Answer: yes, because "
    assert tok.decode(checker.check(matcher, answer, 3)) == tok.decode(answer[:3])  # k caps it
    # A token the grammar refuses cuts the draft there; then the forced text again.
    assert tok.decode(checker.check(matcher, encode("Answer: maybe"), 8)) == "Answer: "
    # No draft at all: the forced start.
    assert tok.decode(checker.check(matcher, [], 8)) == "Answer: "
    assert matcher.accept_string("Answer: no, because x.")  # the matcher was left at the start
    # Without an encoder (no tokenizer), only the drafter's drafts.
    assert GrammarDrafts(lambda _: []).check(xgr.GrammarMatcher(grammar), [], 8) == []
