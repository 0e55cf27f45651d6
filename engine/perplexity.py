"""Perplexity of a text under an engine's model: the quality gate for faster modes.

A faster dtype or a compiled step must stay close to the float32 reference; the gate
compares perplexities on a fixed text (`tests/data/quality_text.txt`). The text runs
through the engine's own model and attention as chunked prefill over a scratch KV
cache, so neither the engine's cache nor its prefix-cache contents are touched; with
``chunk=1`` it runs one token per step, through the decode path and its kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from engine.attention import AttentionMetadata, allocate_kv_cache
from engine.llm_engine import LLMEngine


@torch.inference_mode()
def text_logits(
    engine: LLMEngine, token_ids: list[int], chunk: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits ``[n, V]``, the next tokens ``[n]``) for each chunk of the text: position i's
    logits predict ``token_ids[i + 1]``.

    ``chunk`` tokens per forward pass (default: the engine's max_num_batched_tokens);
    ``chunk=1`` runs the text through the decode path, one token per step.
    """
    if len(token_ids) < 2:
        raise ValueError("need at least two tokens")
    core = engine.core
    if len(token_ids) > core.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens do not fit max_model_len {core.max_model_len}")
    model, bs, config = core.model, core.block_size, core.config.engine
    blocks = list(range(-(-len(token_ids) // bs)))
    scratch = allocate_kv_cache(
        core.config.num_layers, len(blocks), bs, model.num_kv_heads,
        model.head_dim, core.dtype, core.device, config.kv_cache_quantized,
    )  # fmt: skip
    ids = torch.tensor(token_ids, device=core.device)
    chunk = chunk or config.max_num_batched_tokens
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        meta = AttentionMetadata.build([end - start], [end], [blocks], bs, core.device)
        model.prepare_attention(meta)
        yield model.compute_logits(model(ids[start:end], meta.positions, scratch, meta)), \
            ids[start + 1 : end + 1]  # fmt: skip


def token_logprobs(
    engine: LLMEngine, token_ids: list[int], chunk: int | None = None
) -> torch.Tensor:
    """``log p(token_ids[i + 1] | token_ids[: i + 1])`` for every i, float32 ``[len - 1]``."""
    out = [
        torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        for logits, targets in text_logits(engine, token_ids, chunk)
    ]
    return torch.cat(out).float()


def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int | None = None) -> float:
    """exp of the mean negative log-likelihood of each token after the first."""
    return math.exp(-token_logprobs(engine, token_ids, chunk).mean().item())
