"""Choose each request's next token from the step's logits, vectorised over the batch.

Order of operations (vLLM's):
1. raw logprobs, if any request wants logprobs: log_softmax of the logits as the
   model produced them, before bias, penalties, temperature or truncation. They
   report the model's own distribution, so they do not depend on sampling knobs.
2. logit_bias; 3. min_tokens (eos and stop_token_ids to -inf);
4. penalties: repetition (HF), then frequency and presence (OpenAI);
5. the grammar mask of constrained rows (tokens their grammar forbids to -inf);
6. greedy rows: argmax. Sampling rows: temperature, top-k, top-p, min-p, then an
   inverse-CDF draw from one uniform number per row; a seeded request takes its
   number from its own generator, so its token does not depend on the rest of the batch.

The common all-greedy batch without penalties, bias, min_tokens or logprobs is one
argmax. Masks avoid sorting the vocabulary (topk over few candidates instead): on
CPU a full sort of [32, 49152] costs ~60 argmaxes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_metadata import (
    Penalties,
    RandomRows,
    SamplingMetadata,
    SparseLogitEdits,
    make_generator,
)

__all__ = [
    "Sampler",
    "draw_uniform",
    "SamplerOutput",
    "SamplingMetadata",
    "make_generator",
    "to_token_logprobs",
]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Raw-distribution logprobs; all four are None when no request wants logprobs.
    logprobs: torch.Tensor | None = None  # [B] float32, of the sampled token
    top_token_ids: torch.Tensor | None = None  # [B, N] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, N] float32


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32; the caller's tensor is not modified."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        logits = self.process_logits(logits, meta)
        token_ids = self._choose(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs, top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
        return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Bias, min_tokens, penalties and grammars: the logits greedy rows take the argmax of.

        One copy of the logits at most; everything else is sparse or per row, in place on
        the copy.
        """
        if meta.penalties is not None:
            # An extra column absorbs the -1 padding of the penalties' token id lists.
            work = torch.nn.functional.pad(logits, (0, 1))
        elif (
            meta.logit_bias is not None
            or meta.min_tokens_mask is not None
            or meta.grammar is not None
        ):
            work = logits.clone()
        else:
            return logits
        vocab_size = logits.shape[-1]
        if meta.logit_bias is not None:
            _apply_sparse_(work, meta.logit_bias, vocab_size, add=True)
        if meta.min_tokens_mask is not None:
            _apply_sparse_(work, meta.min_tokens_mask, vocab_size, add=False)
        if meta.penalties is not None:
            apply_penalties_(work, meta.penalties, vocab_size)
            work = work[:, :vocab_size]
        if meta.grammar is not None:
            meta.grammar.apply_(work)
        return work

    @staticmethod
    def _choose(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        random = meta.random
        assert random is not None
        if meta.all_random:
            return sample(logits, random)
        assert meta.greedy_rows is not None and random.rows is not None
        tokens = torch.empty(meta.batch_size, dtype=torch.int64, device=logits.device)
        tokens[meta.greedy_rows] = logits[meta.greedy_rows].argmax(dim=-1)
        tokens[random.rows] = sample(logits[random.rows], random)
        return tokens


def _apply_sparse_(
    logits: torch.Tensor, edits: SparseLogitEdits, vocab_size: int, add: bool
) -> None:
    # Ids outside the vocabulary are ignored rather than failing the whole batch's step.
    valid = (edits.token_ids >= 0) & (edits.token_ids < vocab_size)
    index = (edits.rows[valid], edits.token_ids[valid])
    logits.index_put_(index, edits.values[valid], accumulate=add)


def apply_penalties_(logits: torch.Tensor, pen: Penalties, vocab_size: int) -> None:
    """In place on logits [B, V + 1]; token ids padded with -1 land in the last column.

    Sparse: only the positions of the rows' prompt/output tokens are read and written.
    Repeated ids are harmless: each copy writes the same value (computed from values
    gathered before the write), except frequency, which is meant to add up per copy.
    """
    output_ids = pen.output_token_ids.masked_fill(pen.output_token_ids < 0, vocab_size)
    if pen.prompt_token_ids is not None:
        # HF semantics: any token seen in the prompt or the output is penalised, by sign.
        prompt_ids = pen.prompt_token_ids.masked_fill(pen.prompt_token_ids < 0, vocab_size)
        seen = torch.cat([prompt_ids, output_ids], dim=1)
        values = logits.gather(1, seen)
        penalised = torch.where(values > 0, values / pen.repetition, values * pen.repetition)
        logits.scatter_(1, seen, penalised)
    # OpenAI semantics, over output tokens only: frequency once per occurrence...
    if pen.any_frequency:
        logits.scatter_add_(1, output_ids, (-pen.frequency).expand(output_ids.shape))
    # ...presence once per distinct token.
    if pen.any_presence:
        logits.scatter_(1, output_ids, logits.gather(1, output_ids) - pen.presence)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf what top-k (0 = off) and top-p (1.0 = off) drop, row by row.

    Top-k keeps the tokens whose logit is at least the k-th largest (ties at the k-th are
    kept). Then top-p keeps the smallest set of most likely tokens whose probability
    (renormalised after top-k) reaches p.
    """
    if top_k is not None:
        logits = _apply_top_k(logits, top_k)
    if top_p is not None:
        logits = _apply_top_p(logits, top_p)
    return logits


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # topk(max k) instead of a sort: a full sort of the vocabulary costs ~30x more on CPU.
    vocab_size = logits.shape[-1]
    k = top_k.clamp(max=vocab_size)
    top_values = logits.topk(int(k.max()), dim=-1).values
    kth = top_values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))
    kth = kth.masked_fill((k <= 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


# Candidate counts tried, per row, before falling back to the bound below: most rows'
# nucleus is a handful of tokens, and a topk over k tokens costs far less than a sort.
TOP_P_CANDIDATES = (64, 512)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus mask without sorting the whole vocabulary.

    If a row's top-k tokens (by topk, most likely first) weigh at least p, its nucleus
    lies among them; rows where k = 64, then 512, is not enough try the bound: tokens
    with prob <= (1 - p) / V are always dropped (even all V of them together weigh at
    most 1 - p), so the tokens above that floor always hold the nucleus.
    """
    vocab_size = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    drop = torch.zeros_like(logits, dtype=torch.bool)
    rows = torch.nonzero(top_p.squeeze(1) < 1.0).squeeze(1)  # p = 1 rows keep everything
    for k in (*TOP_P_CANDIDATES, None):
        if rows.numel() == 0:
            break
        row_probs, row_p = probs[rows], top_p[rows]
        if k is None:
            k = int((row_probs > (1.0 - row_p) / vocab_size).sum(dim=-1).max())
        k = max(min(k, vocab_size), 1)
        top_probs, top_ids = row_probs.topk(k, dim=-1)
        cumulative = top_probs.cumsum(dim=-1)
        last_try = k == vocab_size or k > TOP_P_CANDIDATES[-1]
        covered = (cumulative[:, -1:] >= row_p).squeeze(1) | last_try
        # Keep a token while the mass of the tokens ranked above it is still below p.
        keep = (cumulative - top_probs) < row_p
        keep[:, 0] = True  # always keep the most likely token
        kept = torch.zeros_like(row_probs[covered], dtype=torch.bool)
        drop[rows[covered]] = ~kept.scatter_(1, top_ids[covered], keep[covered])
        rows = rows[~covered]
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * max prob, i.e. logit >= max logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sample(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """Draw one token per row of `logits` (the sampling rows only)."""
    logits = logits / random.temperature
    logits = apply_top_k_top_p(logits, random.top_k, random.top_p)
    if random.min_p is not None:
        logits = apply_min_p(logits, random.min_p)
    probs = logits.softmax(dim=-1)
    # One uniform per row: unseeded rows share one vectorised draw; a seeded row's comes
    # only from its own generator, so its token does not depend on the rest of the batch.
    # (An exponential race would need V random numbers per row: ~10x the cost on CPU.)
    uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    for row, generator in random.generators.items():
        uniform[row] = draw_uniform(generator)
    return draw_from(probs, uniform)


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's one number per token: [0, 1) float64 on the generator's device.
    (Speculative decoding rewinds a generator by redrawing these, so the two must agree.)"""
    return torch.rand((), dtype=torch.float64, device=generator.device, generator=generator)


# Tokens per chunk of the two-level inverse CDF below.
CDF_CHUNK = 256


def draw_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: per row, the first token whose cumulative probability exceeds
    uniform * total; uniform [R] float64 in [0, 1). A zero-probability token is never drawn.

    Two levels keep float32 rounding negligible: a cumulative sum over the whole
    vocabulary would blur the tail's tiny probabilities, so chunk masses are summed in
    float64 and the fine cumulative sum spans only the chosen chunk's 256 tokens.
    """
    rows, vocab_size = probs.shape
    pad = -vocab_size % CDF_CHUNK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    chunks = probs.view(rows, -1, CDF_CHUNK)
    mass = chunks.sum(dim=-1).double()  # [R, n]
    chunk, within = _invert(mass, uniform.unsqueeze(1))
    inner = chunks.gather(1, chunk.unsqueeze(-1).expand(-1, -1, CDF_CHUNK)).squeeze(1)
    position, _ = _invert(inner.double(), within)
    token_ids = (chunk * CDF_CHUNK + position).squeeze(1)
    return token_ids.clamp_(max=vocab_size - 1)


def _invert(weights: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [R, n] float64, uniform [R, 1] in [0, 1) -> (index [R, 1], where in [0, 1)
    the draw falls within that index's own weight)."""
    cumulative = weights.cumsum(dim=-1)
    target = uniform * cumulative[:, -1:]
    # right=True: the first index whose cumulative weight is > target, so an index of
    # zero weight (same cumulative as the one before it) can never be chosen...
    index = torch.searchsorted(cumulative, target, right=True)
    # ...except past the end, when rounding puts target at the total: take the last
    # index with positive weight.
    n = weights.shape[-1]
    last_positive = n - 1 - (weights.flip(-1) > 0).to(torch.uint8).argmax(-1, keepdim=True)
    index = torch.minimum(index, last_positive)
    weight = weights.gather(1, index)
    start = cumulative.gather(1, index) - weight
    within = ((target - start) / weight).clamp(0.0, 1.0)
    return index, within


def to_token_logprobs(
    output: SamplerOutput, num_logprobs: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Per row: the sampled token's logprob and its request's own top-N, or None if not asked."""
    if output.logprobs is None:
        return [None] * len(num_logprobs)
    assert output.top_token_ids is not None and output.top_logprobs is not None
    token_ids = output.token_ids.tolist()
    logprobs = output.logprobs.tolist()
    top_ids = output.top_token_ids.tolist()
    top_logprobs = output.top_logprobs.tolist()
    result: list[TokenLogprob | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            result.append(None)
            continue
        top = dict(zip(top_ids[i][:n], top_logprobs[i][:n], strict=True))
        result.append(TokenLogprob(token_id=token_ids[i], logprob=logprobs[i], top=top))
    return result
