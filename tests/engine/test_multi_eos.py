"""Models whose generation config names several eos ids (Llama 3, Qwen2.5-Instruct).

A request with `min_tokens` once crashed the engine step on such a model (the sampler got
the raw set). Every sampling option runs here, in one batch, on a llama and a qwen2 tiny
model whose second eos id is a token greedy decoding reaches third.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.engine.test_engine_golden import assert_all_blocks_free
from tests.engine.tiny_models import MULTI_EOS_PROMPT, make_multi_eos_model_dir, second_eos_id

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def multi_eos_llm(request, tmp_path_factory):
    path = make_multi_eos_model_dir(tmp_path_factory.mktemp(f"eos-{request.param}"), request.param)
    return LLM(model=str(path), dtype="float32", num_blocks=128, block_size=8), path


def test_engine_loads_both_eos_ids(multi_eos_llm):
    llm, path = multi_eos_llm
    assert llm.engine.core.eos_token_ids == frozenset({2, second_eos_id(path)})


def test_greedy_stops_at_the_second_eos_as_transformers_does(multi_eos_llm):
    llm, path = multi_eos_llm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([MULTI_EOS_PROMPT])
        gen = hf.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
    expected = gen[0, len(MULTI_EOS_PROMPT) :].tolist()
    out = llm.generate([MULTI_EOS_PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert out.token_ids == expected
    assert out.token_ids[-1] == second_eos_id(path) and len(out.token_ids) == 3
    assert out.finish_reason == "stop"


def test_min_tokens_holds_back_every_eos(multi_eos_llm):
    llm, path = multi_eos_llm
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=5)
    out = llm.generate([MULTI_EOS_PROMPT], params)[0]
    assert len(out.token_ids) >= 5
    assert not set(out.token_ids[:5]) & llm.engine.core.eos_token_ids
    ignoring = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, min_tokens=2)
    out = llm.generate([MULTI_EOS_PROMPT], ignoring)[0]
    assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
    assert out.token_ids[2] == second_eos_id(path)  # produced, and it did not stop the request
    assert_all_blocks_free(llm)


def test_every_sampling_option_in_one_batch(multi_eos_llm):
    llm, _ = multi_eos_llm
    base = {"max_tokens": MAX_TOKENS, "min_tokens": 3}
    variants = [
        SamplingParams(**base, temperature=0),
        SamplingParams(**base, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1),
        # n choices of one prompt, as the server makes them: seed + i each.
        *(SamplingParams(**base, temperature=1.0, seed=2 + i) for i in range(3)),
        SamplingParams(**base, temperature=0, stop_token_ids=[5, 7]),
        SamplingParams(**base, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(**base, temperature=0, frequency_penalty=1.0, logit_bias={9: 2.0}),
        SamplingParams(**base, temperature=0.5, logprobs=5, seed=3),
        SamplingParams(**base, temperature=0, ignore_eos=True, stop=["zz"]),
    ]
    prompts = [MULTI_EOS_PROMPT[: 10 + i] for i in range(len(variants))]
    prompts[3] = prompts[4] = prompts[2]  # the n choices share their prompt's blocks
    outs = llm.generate(prompts, variants, use_tqdm=False)
    eos = llm.engine.core.eos_token_ids
    for params, out in zip(variants, outs, strict=True):
        assert out.finished and len(out.token_ids) >= 3
        assert not set(out.token_ids[:3]) & eos  # min_tokens held back both ids
        if params.logprobs is not None:
            assert len(out.logprobs) == len(out.token_ids)
    # Seeded sampling is reproducible on a multi-eos model too.
    again = llm.generate(prompts[1:2], variants[1:2])[0]
    assert again.token_ids == outs[1].token_ids
    assert_all_blocks_free(llm)
