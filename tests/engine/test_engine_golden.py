"""Greedy tokens from the engine equal transformers' `generate(do_sample=False)`.

The correctness reference of DESIGN.md: float32 on CPU, every prompt of a
batch, also when the batch mixes prefix-cache hits, chunked prefill and
preemption (forced with a tiny KV pool and a small token budget).

On `--device cuda` both run on the GPU, the engine on each CUDA attention backend that
takes the model (triton's decode steps replay CUDA graphs), and the families of 2026 join
llama and qwen2 (`CUDA_ARCHS`): sliding windows, linear attention's states and their
snapshots, experts and attention sinks through the CUDA paths. On the CPU those families
have their own golden files (test_model_families.py, test_qwen3_5.py, ...).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import load_reference_model
from tests.engine.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.device

NEW_TOKENS = 24


CPU_ARCHS = ["llama", "qwen2"]
CUDA_ARCHS = CPU_ARCHS + ["qwen3", "gemma3_text", "qwen3_5_text", "qwen3_moe", "gpt_oss"]
# Config changes that make a family's own layer kind act within the tests' 30-60-token
# prompts: gemma3's window (the tiny config's is longer than any test's sequence); and
# gpt-oss' SwiGLU limit as real checkpoints have it (transformers before 5.2x, as on the GPU
# host, hard-codes 7.0; test_gpt_oss.py's lower limit checks the clamps on the CPU).
ARCH_OVERRIDES = {"gemma3_text": {"sliding_window": 8}, "gpt_oss": {"swiglu_limit": 7.0}}
# ...and the engine's: Qwen3.5's state slots for snapshots every block, so a 48-token
# shared prefix (6 blocks of 8) resumes from one.
ENGINE_ARGS = {"qwen3_5_text": {"state_slots": 32, "state_snapshot_interval": 1}}
# A windowed model's request holds blocks in both its groups: the smallest pool that still
# preempts takes more of them.
EXTRA_BLOCKS = {"gemma3_text": 8, "gpt_oss": 8}


def cuda_backends(arch: str) -> list[str]:
    """The CUDA attention backends that take `arch` (triton has no attention sinks)."""
    return ["sdpa"] if arch == "gpt_oss" else ["sdpa", "triton"]


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        on_cuda = metafunc.config.getoption("--device").startswith("cuda")
        cases = (
            [(arch, backend) for arch in CUDA_ARCHS for backend in cuda_backends(arch)]
            if on_cuda
            else [(arch, "auto") for arch in CPU_ARCHS]
        )
        metafunc.parametrize(("arch", "backend"), cases, scope="module")


def hf_greedy(
    model_dir, prompts: list[list[int]], max_new_tokens: int, hf=None, device="cpu"
) -> list[list[int]]:
    """Reference tokens (of `hf`, else the directory's model on `device`), one prompt at a
    time so no padding enters the comparison."""
    hf = hf if hf is not None else load_reference_model(model_dir, torch.float32).to(device)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=hf.generation_config.eos_token_id or 0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def random_prompts(seed: int, n: int, vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def engine_greedy(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.core.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == llm.engine.core.num_blocks


def assert_preempted_and_chunked_match(path, prompts, expected, max_new_tokens: int) -> None:
    """A pool too small for the batch (40 blocks of 4) and 16-token steps: transformers'
    greedy tokens through preemption and chunked prefill, every block back."""
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=40,
              max_num_batched_tokens=16)  # fmt: skip
    assert engine_greedy(llm, prompts, max_new_tokens) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_model(arch, tmp_path_factory):
    overrides = ARCH_OVERRIDES.get(arch, {})
    return make_tiny_model_dir(tmp_path_factory.mktemp(arch), arch=arch, seed=1, **overrides)


@pytest.fixture(scope="module")
def engine_args(arch, device, backend) -> dict:
    """What every engine of a test takes beside its pool and budget."""
    return {"dtype": "float32", "device": str(device), "attention_backend": backend,
            **ENGINE_ARGS.get(arch, {})}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_reference(tiny_model, device):
    prompts = random_prompts(seed=7, n=10, vocab=1000)
    return prompts, hf_greedy(tiny_model, prompts, NEW_TOKENS, device=device)


def test_batch_matches_transformers(tiny_model, tiny_reference, engine_args):
    prompts, expected = tiny_reference
    llm = LLM(model=str(tiny_model), num_blocks=256, **engine_args)
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert_all_blocks_free(llm)


def test_preemption_and_chunking_keep_tokens_identical(tiny_model, tiny_reference, engine_args):
    prompts, expected = tiny_reference
    # 12 blocks of 4 tokens cannot hold ten 30-60-token requests at once: the
    # scheduler must preempt; a 16-token budget chunks every longer prompt.
    llm = LLM(
        model=str(tiny_model), block_size=4, num_blocks=24, max_num_batched_tokens=16, **engine_args
    )
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0
    assert llm.engine.core.stats.num_steps > NEW_TOKENS + 2  # chunked prefill took extra steps
    assert_all_blocks_free(llm)


def test_prefix_hits_keep_tokens_identical(tiny_model, device, engine_args):
    prompts = random_prompts(seed=11, n=8, vocab=1000, shared_prefix=48)
    expected = hf_greedy(tiny_model, prompts, NEW_TOKENS, device=device)
    llm = LLM(model=str(tiny_model), block_size=8, num_blocks=128, **engine_args)
    # Warm the cache with the first prompt, then run the batch that shares its prefix.
    assert engine_greedy(llm, prompts[:1], NEW_TOKENS) == expected[:1]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False
    )
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 48 for o in outs)
    assert llm.engine.core.kv_cache_manager.stats.hits > 0
    assert_all_blocks_free(llm)


def test_all_three_mechanisms_at_once(tiny_model, arch, device, engine_args):
    prompts = random_prompts(seed=13, n=8, vocab=1000, shared_prefix=20)
    expected = hf_greedy(tiny_model, prompts, NEW_TOKENS, device=device)
    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        num_blocks=26 + EXTRA_BLOCKS.get(arch, 0),
        max_num_batched_tokens=12,
        **engine_args,
    )
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_cache_manager.stats.hits > 0
    assert_all_blocks_free(llm)
