"""LLMEngine behaviour beyond greedy equivalence: stops, aborts, logprobs, seeds, limits, sizing."""

from __future__ import annotations

import pytest
import torch

import engine.core as engine_core_module
from engine import LLM, EngineConfig, LLMEngine, SamplingParams, StepError
from engine.config import GpuMemory
from engine.kernels import cpu_kernels_supported
from tests.engine.test_engine_golden import assert_all_blocks_free
from tests.engine.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", num_blocks=128, block_size=8)


PROMPT = list(range(100, 130))


def run_until_done(eng: LLMEngine) -> dict:
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_stop_string_truncates_text_and_finishes_with_stop(llm):
    free_run = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[
        0
    ]
    text = free_run.text
    assert len(text) > 6
    stop = text[3:6]  # a piece of what greedy decoding will produce
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 12
    assert_all_blocks_free(llm)


def test_length_finish_and_stop_token_ids(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    stop_id = out.token_ids[2]
    out2 = llm.generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out2.finish_reason == "stop"
    assert out2.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]


def test_abort_frees_blocks_in_every_state(llm):
    eng = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0)
    eng.add_request("running", PROMPT, params)
    eng.step()
    eng.add_request("waiting", PROMPT + [5], params)
    assert eng.core.kv_cache_manager.num_free_blocks < eng.core.num_blocks
    eng.abort_request(["running", "waiting"])
    assert not eng.has_unfinished_requests()
    assert_all_blocks_free(llm)
    assert eng.step() == []


def test_logprobs_are_reported_per_token(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    out = llm.generate([PROMPT], params)[0]
    assert len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id
        assert len(lp.top) == 3
        # greedy: the chosen token is the most likely one
        assert max(lp.top.values()) == pytest.approx(lp.logprob)
        assert lp.logprob <= 0.0


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPT], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=1.0) for _ in range(3)]
    batch = llm.generate(
        [PROMPT[:10], PROMPT, PROMPT[5:], PROMPT[:20]], [others[0], seeded, *others[1:]]
    )
    assert batch[1].token_ids == alone


def test_impossible_requests_are_refused_with_the_limits(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match=r"max_model_len \(512\)"):
        eng.add_request("too-long", PROMPT, SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("bad-id", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    assert not eng.has_unfinished_requests()


def test_stats_follow_the_steps(llm):
    eng = llm.engine
    before, prompt_before = eng.core.stats.generation_tokens, eng.core.stats.prompt_tokens
    hits_before = eng.core.stats.prefix_cache_hits
    llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=3, temperature=0))
    assert eng.core.stats.generation_tokens == before + 6
    assert eng.core.stats.prefix_cache_hits > hits_before  # the second copy hit the first's blocks
    # Every prompt token of both requests counts, the cached ones too (vLLM's prompt_tokens).
    assert eng.core.stats.prompt_tokens == prompt_before + 2 * len(PROMPT)
    assert eng.core.stats.num_running == 0 and eng.core.stats.num_waiting == 0


def test_block_counts_are_published_after_steps_aborts_and_resets(llm):
    """stats.kv_blocks is what /metrics shows between steps too: the pool changes on an
    abort or a cache reset with no step after it."""
    eng = llm.engine
    kv = eng.core.kv_cache_manager
    assert eng.core.stats.kv_blocks == kv.block_counts()
    eng.add_request("published", list(range(300, 340)), SamplingParams(max_tokens=50))
    eng.step()
    assert eng.core.stats.kv_blocks == kv.block_counts() and eng.core.stats.kv_blocks.in_use == 5
    eng.abort_request(["published"])
    assert eng.core.stats.kv_blocks == kv.block_counts() and eng.core.stats.kv_blocks.in_use == 0
    assert eng.core.stats.kv_blocks.cached >= 5  # the 40-token prompt's 5 blocks stay cached
    assert eng.reset_prefix_cache()
    assert eng.core.stats.kv_blocks == kv.block_counts() and eng.core.stats.kv_blocks.cached == 0
    assert eng.core.stats.kv_blocks.total == kv.num_blocks


def test_kv_cache_sized_from_a_profiled_peak(model_dir, monkeypatch):
    """The CUDA sizing path, run on this device: a profiling pass, then fake GPU figures."""
    monkeypatch.setattr(EngineConfig, "profiles_memory", lambda self, device: True)
    monkeypatch.setattr(
        engine_core_module,
        "measure_gpu_memory",
        lambda device: GpuMemory(total=10 * 2**30, peak_used=2 * 2**30),
    )
    llm = LLM(model=str(model_dir), dtype="float32", gpu_memory_utilization=0.5)
    eng = llm.engine
    per_block = eng.core.config.engine.kv_cache_bytes_per_block(
        eng.core.config.hf_config.num_hidden_layers,
        eng.core.model.num_kv_heads,
        eng.core.model.head_dim,
        4,
    )
    # The pass ran 2048 tokens as 256 sequences of 8: one 16-token block each, a scratch
    # KV cache that the engine subtracts from the peak because the real cache replaces it.
    scratch = 256 * per_block
    assert eng.core.num_blocks == (5 * 2**30 - (2 * 2**30 - scratch)) // per_block
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.token_ids) == 2


def test_a_failed_step_aborts_only_its_requests(model_dir, monkeypatch):
    # max_num_seqs=1: one request per step, so the poisoned one's step holds only it.
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64,
                                 block_size=8, max_num_seqs=1))  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0)
    alone = {}
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
        eng.add_request(rid, prompt, params)
        alone[rid] = run_until_done(eng)[rid].token_ids
    real_execute = eng.core.runner.execute

    def execute(sched_out):  # a fault injected for one request id
        if any(s.request_id == "poisoned" for s in sched_out.scheduled):
            raise RuntimeError("injected fault")
        return real_execute(sched_out)

    monkeypatch.setattr(eng.core.runner, "execute", execute)
    eng.add_request("a", PROMPT, params)
    eng.add_request("poisoned", PROMPT[:20], params)
    eng.add_request("b", PROMPT[::-1], params)
    finished, failures = {}, []
    while eng.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in eng.step() if o.finished})
        except StepError as exc:
            failures.append(exc)
    assert [f.request_ids for f in failures] == [["poisoned"]]
    assert "injected fault" in str(failures[0])
    assert isinstance(failures[0].__cause__, RuntimeError)
    assert {rid: out.token_ids for rid, out in finished.items()} == alone
    kv = eng.core.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == eng.core.num_blocks


# A near-tie: the lone run's two best log-probabilities this close. The tiny model's logits
# are bf16 over 49,152 tokens and nearly flat (each log-probability about -10.2), so exact
# ties occur: the int4 failure measured on a Xeon (Sapphire Rapids class) flipped a tie of 0.
NEAR_TIE = 0.01


@pytest.mark.skipif(not cpu_kernels_supported(), reason="quantized weights need AVX512-BF16")
@pytest.mark.parametrize(("quantization", "dtype"), [("int8", torch.int8), ("int4", torch.uint8)])
def test_quantized_engine_runs_on_its_weights_and_the_batch_moves_greedy_only_at_int4_near_ties(
    model_dir, quantization, dtype
):
    llm = LLM(model=str(model_dir), dtype="bfloat16", quantization=quantization, num_blocks=128)
    layers = llm.engine.core.model.layers
    assert all(lin.weight.dtype == dtype for layer in layers for lin in layer.linears())
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    alone = llm.generate([PROMPT], greedy)[0]
    # 1 row (kernel, in registers) alone; 9 rows (kernel, dequantized tile) in a batch.
    batched = llm.generate([PROMPT[i:] for i in range(9)], greedy)[0]
    assert len(alone.token_ids) == 12
    assert_all_blocks_free(llm)
    if quantization == "int8":
        # Both kernel paths multiply the same bf16-rounded weights in the same order per
        # row: the batch changes no bit (measured: every log-probability equal).
        assert batched.token_ids == alone.token_ids
        assert batched.logprobs == alone.logprobs
        return
    # int4 up to 4 rows multiplies the blocks exactly; more rows multiply them rounded to
    # bf16 (engine/quantization/int4.py), so the batch moves log-probabilities a little
    # (measured: at most 2e-5 here) and greedy may part only where two tokens nearly tie.
    for step, (a, b) in enumerate(zip(alone.logprobs, batched.logprobs, strict=True)):
        if a.token_id != b.token_id:
            best, second = sorted(a.top.values(), reverse=True)[:2]
            assert best - second < NEAR_TIE, (step, a, b)
            break
        assert abs(a.logprob - b.logprob) < 1e-3, (step, a, b)


@pytest.mark.skipif(not cpu_kernels_supported(), reason="cpu-paged needs AVX512-BF16")
def test_bf16_engine_on_this_cpu_runs_its_decodes_through_cpu_paged(model_dir):
    from engine.attention import CpuPagedBackend, SdpaBackend

    engine = LLM(model=str(model_dir), dtype="bfloat16", num_blocks=64).engine
    bf16 = engine.core.model
    assert isinstance(bf16.attn_backend, CpuPagedBackend)
    assert all(layer.self_attn.backend is bf16.attn_backend for layer in bf16.layers)
    # The start-up line names each path the plan chose (not its exact wording).
    summary = engine.core.compute_summary
    for path in ("attention cpu-paged", "CPU kernels AVX-512 BF16", "skinny GEMM",
                 "fused ops", "decode stack", "projections bfloat16 x8"):  # fmt: skip
        assert path in summary, (path, summary)
    fp32_engine = LLM(model=str(model_dir), dtype="float32", num_blocks=64).engine
    assert isinstance(fp32_engine.core.model.attn_backend, SdpaBackend)
    fp32_summary = fp32_engine.core.compute_summary
    assert "attention sdpa" in fp32_summary and "projections float32 x8" in fp32_summary
    assert "CPU kernels" not in fp32_summary and "decode stack" not in fp32_summary


def test_lpm_admission_changes_the_order_not_the_tokens(model_dir):
    """Cache-aware admission on the real model: the hot requests go first (their prefix is
    cached) and a cold one is chunked beside them, yet every greedy output equals
    first-come first-served's."""
    warm = list(range(200, 248))
    prompts = [list(range(300, 340)), warm + [7, 8], list(range(400, 437)), warm + [9]]
    params = SamplingParams(max_tokens=5, temperature=0)
    outputs, first_admitted = {}, {}
    for policy in ("fcfs", "lpm"):
        eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64,
                                     block_size=8, max_num_batched_tokens=24,
                                     scheduling_policy=policy))  # fmt: skip
        eng.add_request("warm", warm, params)
        run_until_done(eng)
        for i, ids in enumerate(prompts):
            eng.add_request(f"p{i}", ids, params)
        eng.step()
        first_admitted[policy] = [r.request_id for r in eng.core.scheduler.running]
        finished = run_until_done(eng)
        outputs[policy] = [finished[f"p{i}"].token_ids for i in range(4)]
        assert eng.core.kv_cache_manager.num_free_blocks == eng.core.num_blocks
    assert first_admitted == {"fcfs": ["p0"], "lpm": ["p1", "p3", "p0"]}
    assert outputs["lpm"] == outputs["fcfs"]


def test_a_retry_after_a_failed_step_does_not_hit_the_blocks_it_never_wrote(model_dir, monkeypatch):
    """Blocks are cached when allocated, before the step writes them: a step that fails
    must take its new blocks out of the prefix cache, or a retry of the same prompt would
    read KV that was never computed."""
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64,
                                 block_size=8))  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = list(range(500, 540))  # 5 full blocks
    eng.add_request("alone", prompt, params)
    expected = run_until_done(eng)["alone"].token_ids
    eng.reset_prefix_cache()
    real_execute = eng.core.runner.execute

    def execute(sched_out):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(eng.core.runner, "execute", execute)
    eng.add_request("first-try", prompt, params)
    with pytest.raises(StepError):
        eng.step()
    monkeypatch.setattr(eng.core.runner, "execute", real_execute)
    eng.add_request("retry", prompt, params)
    assert run_until_done(eng)["retry"].token_ids == expected
    assert eng.core.stats.prefix_cache_hits == 0
    eng.core.kv_cache_manager.check_invariants()
