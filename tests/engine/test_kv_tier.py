"""The KV cache's second tier on a real model (float32, token-exact): blocks the pool
evicted come back from the tier bit for bit, a restarted engine starts warm, and an engine
killed mid-write never leaves a block that would be served wrong."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_tier import block_nbytes, read_blocks, write_blocks
from tests.engine.tiny_models import make_tiny_model_dir

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFIXES = [list(range(1000 + 97 * g, 1000 + 97 * g + 96)) for g in range(3)]  # 12 blocks each


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tier-model"), arch="llama", seed=5)


def engine(model_dir, cache_dir, **fields) -> LLMEngine:
    fields = {"dtype": "float32", "block_size": 8, "num_blocks": 28, **fields}
    return LLMEngine(EngineConfig(model=str(model_dir), cache_dir=str(cache_dir), **fields))


def run(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    eng.add_request(rid, prompt, PARAMS)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.num_cached_tokens
    raise AssertionError("no output")


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    """Every prompt's tokens from an engine without a tier and with room for everything."""
    eng = engine(model_dir, tmp_path_factory.mktemp("plain"), num_blocks=400)
    return {g: run(eng, f"ref{g}", p + [7, g])[0] for g, p in enumerate(PREFIXES)}


def test_a_block_goes_out_and_comes_back_bit_for_bit(model_dir, tmp_path):
    eng = engine(model_dir, tmp_path, kv_cache_dtype="int8")
    run(eng, "a", PREFIXES[0] + [1])
    caches = eng.core.runner.kv_caches
    assert block_nbytes(caches) == 2 * len(caches) * 8 * caches[0][0].shape[2] * (16 + 2)
    out = read_blocks(caches, [0, 3])
    write_blocks(caches, {5: out[0], 6: out[1]})
    assert read_blocks(caches, [5, 6]) == out


def test_evicted_prefixes_come_back_from_the_tier_with_the_same_tokens(
    model_dir, tmp_path, expected
):
    # 28 blocks hold two 13-block prompts: each prompt evicts the oldest prefix.
    eng = engine(model_dir, tmp_path, kv_offload_bytes=4 << 20)
    for _ in range(2):
        for g, prefix in enumerate(PREFIXES):
            tokens, _ = run(eng, f"r{g}-{time.monotonic_ns()}", prefix + [7, g])
            assert tokens == expected[g]
    assert eng.core.kv_cache_manager.stats.tier_hits > 0
    assert eng.core.kv_cache_manager.hash_algo == "sha256"  # the tier's keys must outlive us
    eng.core.kv_cache_manager.check_invariants()


def test_a_restarted_engine_prefills_only_the_new_tokens(model_dir, tmp_path, expected):
    first = engine(model_dir, tmp_path, kv_offload_bytes=4 << 20)
    run(first, "warm", PREFIXES[1] + [7, 1])
    first.shutdown()  # saves the pool's cached blocks to the tier
    again = engine(model_dir, tmp_path, kv_offload_bytes=4 << 20)
    assert again.core.kv_cache_manager.tier.reopened_entries >= 12
    tokens, cached = run(again, "after", PREFIXES[1] + [7, 1])
    assert tokens == expected[1] and cached == 96
    # Another model (or layout) never reads this file's blocks.
    other = make_tiny_model_dir(tmp_path / "other", arch="llama", seed=6)
    stranger = engine(other, tmp_path, kv_offload_bytes=4 << 20)
    assert stranger.core.kv_cache_manager.tier.reopened_entries == 0


KILLED_WRITER = textwrap.dedent("""
    import sys
    from engine import EngineConfig, LLMEngine, SamplingParams
    model_dir, cache_dir = sys.argv[1:3]
    eng = LLMEngine(EngineConfig(model=model_dir, dtype="float32", block_size=8, num_blocks=28,
                                 cache_dir=cache_dir, kv_offload_bytes=1 << 20))
    prefixes = [list(range(1000 + 97 * g, 1000 + 97 * g + 96)) for g in range(3)]
    print("ready", flush=True)
    i = 0
    while True:  # churn: every prompt evicts another prefix's blocks into the tier
        eng.add_request(str(i), prefixes[i % 3] + [7, i % 3], SamplingParams(max_tokens=6))
        while eng.has_unfinished_requests():
            eng.step()
        i += 1
        print(i, flush=True)  # requests done: from the third on, the tier holds blocks
""")


def test_an_engine_killed_mid_write_leaves_no_wrong_block(model_dir, tmp_path, expected):
    cache = tmp_path / "cache"
    # A kill mid-churn, once the tier holds blocks however slow the machine (a fixed sleep
    # raced it); the tier file's own test kills a writer between each of a put's stores.
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(model_dir), str(cache)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    while int(proc.stdout.readline() or 0) < 4:  # (0: the writer died, and the test fails)
        assert proc.poll() is None, "the writer died before it churned"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    eng = engine(model_dir, cache, kv_offload_bytes=1 << 20)
    assert eng.core.kv_cache_manager.tier.reopened_entries > 0
    for g, prefix in enumerate(PREFIXES):  # whatever the tier gives back is right
        tokens, _ = run(eng, f"after{g}", prefix + [7, g])
        assert tokens == expected[g]
