"""`--pin-system-prompt` / `--pin-prefix`: a prefix computed at start-up whose KV blocks stay
resident, so requests that open with it hit it however much else went through the pool."""

from __future__ import annotations

import pytest

from server.cli import build_parser, pin_prefixes
from tests.server.conftest import MODEL_NAME, make_engine, running_server

SYSTEM = "You are the ship's computer. Answer in one short sentence. " * 4


def test_a_pinned_system_prompt_is_hit_by_chats_after_the_pool_turned_over(tiny_model_dir):
    # 24 blocks of 16 tokens; the system prompt renders to ~60 tokens (3 full blocks).
    engine = pin_prefixes(make_engine(tiny_model_dir, num_blocks=24).core, [SYSTEM], [])
    pinned = engine.kv_cache_manager.num_pinned_blocks
    assert pinned >= 3
    with running_server(engine) as server:
        client = server.openai()
        for i in range(6):  # unrelated prompts of ~10 blocks each turn the pool over
            client.completions.create(model=MODEL_NAME, prompt=f"churn {i} " * 60, max_tokens=2)
        chat = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        )  # fmt: skip
    assert chat.usage.prompt_tokens_details.cached_tokens == pinned * 16
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - pinned


def test_a_raw_prefix_from_a_file_is_pinned_as_completions_encode_it(tiny_model_dir, tmp_path):
    preamble = tmp_path / "few-shot.txt"
    preamble.write_text("Q: two plus two\nA: four\n" * 8, encoding="utf-8")
    engine = pin_prefixes(make_engine(tiny_model_dir, num_blocks=32).core, [], [f"@{preamble}"])
    ids = engine.tokenizer.encode(preamble.read_text(encoding="utf-8"))
    assert engine.kv_cache_manager.num_pinned_blocks == len(ids) // 16
    with pytest.raises(ValueError, match="cannot read the prefix to pin"):
        pin_prefixes(engine, [], [f"@{tmp_path / 'missing.txt'}"])


def test_the_pin_flags_repeat():
    args = build_parser().parse_args(
        ["serve", "--pin-system-prompt", "a", "--pin-system-prompt", "@b.txt", "--pin-prefix", "c"]
    )
    assert args.pin_system_prompt == ["a", "@b.txt"] and args.pin_prefix == ["c"]
