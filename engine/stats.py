"""Counters the engine keeps for metrics and logs; read after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_cache import BlockCounts


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    # The pool's blocks by state; replaced whole (never mutated) whenever the pool changes,
    # so another thread reading it sees one consistent count.
    kv_blocks: BlockCounts = field(default_factory=BlockCounts)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # tokens found there (cumulative)
    # The second tier (--kv-offload-bytes): prompt tokens brought back from it (then
    # served as hits; cumulative), and its blocks held and slots (0, 0 without a tier).
    tier_hits: int = 0
    tier_blocks: int = 0
    tier_num_blocks: int = 0
    num_preemptions: int = 0  # cumulative
    # Cumulative whole prompts (cache hits included) of requests whose prefill completed,
    # counted once per request as vLLM counts them; the hits have their own counters.
    prompt_tokens: int = 0
    generation_tokens: int = 0  # cumulative sampled tokens
    # Speculative decoding (cumulative, vLLM's spec_decode_* counters): verifications (a
    # request's step with drafts), draft tokens verified, drafts kept, and kept per
    # draft position (a tuple, replaced whole).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    num_steps: int = 0
    last_step_tokens: int = 0  # tokens in the last step's batch
    last_step_seqs: int = 0  # requests in the last step's batch
