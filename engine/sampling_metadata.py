"""Per-step sampling state of a batch, gathered from its requests' `SamplingParams`.

The model runner builds one `SamplingMetadata` per step; `engine.sampler.Sampler`
consumes it. Everything optional is `None` when no request in the batch uses it,
so the common all-greedy batch costs one pass over the params and no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.bitmask import GrammarBitmask


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream: the runner keeps it across steps for a seeded request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class RandomRows:
    """Settings of the rows that sample (temperature > 0), indexed within that subset."""

    rows: torch.Tensor | None  # [R] int64 batch rows; None when every row samples
    temperature: torch.Tensor  # [R, 1] float32
    top_k: torch.Tensor | None  # [R] int64, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [R, 1] float32; None when no row uses top-p
    min_p: torch.Tensor | None  # [R, 1] float32; None when no row uses min-p
    generators: dict[int, torch.Generator]  # subset index -> the request's own generator


@dataclass
class Penalties:
    repetition: torch.Tensor  # [B, 1] float32, 1.0 = off
    presence: torch.Tensor  # [B, 1] float32
    frequency: torch.Tensor  # [B, 1] float32
    # Token ids padded with -1; rows without that penalty have only padding.
    prompt_token_ids: torch.Tensor | None  # [B, Lp]; None when no repetition penalty
    output_token_ids: torch.Tensor  # [B, Lo]
    any_frequency: bool
    any_presence: bool


@dataclass
class SparseLogitEdits:
    """(row, token) pairs of a batch with a value each: logit_bias, or the min_tokens mask."""

    rows: torch.Tensor  # [E] int64
    token_ids: torch.Tensor  # [E] int64
    values: torch.Tensor  # [E] float32


@dataclass
class SamplingMetadata:
    batch_size: int
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    greedy_rows: torch.Tensor | None  # [G] int64; None unless the batch mixes both kinds
    random: RandomRows | None  # None when all_greedy
    penalties: Penalties | None  # None when no_penalties
    logit_bias: SparseLogitEdits | None
    min_tokens_mask: SparseLogitEdits | None  # tokens forced to -inf this step
    # Top-N width for logprobs (max over the batch); None when no request wants logprobs.
    max_num_logprobs: int | None
    # The tokens each constrained row's grammar allows next; None when no row has a grammar.
    grammar: GrammarBitmask | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[frozenset[int]],
        device: torch.device | str,
        grammar: GrammarBitmask | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's settings; row i is request i.

        `generators[i]` is request i's own generator (from `make_generator`) when it has a
        seed, else None. `eos_token_ids[i]` is request i's end-of-sequence ids (a frozenset,
        as the request carries them); they are masked under `min_tokens` unless the request
        ignores eos (then eos never stops it).
        """
        batch_size = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == batch_size):
            raise ValueError("params, token ids and generators must have one entry per row")
        if len(eos_token_ids) != batch_size:
            raise ValueError(
                f"eos_token_ids has {len(eos_token_ids)} entries for {batch_size} rows"
            )
        greedy = [p.greedy for p in params]
        penalised = [has_penalties(p) for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy, all_random = all(greedy), not any(greedy)
        mixed = not (all_greedy or all_random)
        greedy_rows = [i for i, g in enumerate(greedy) if g] if mixed else None
        return cls(
            batch_size=batch_size,
            all_greedy=all_greedy,
            all_random=all_random,
            no_penalties=not any(penalised),
            greedy_rows=torch.tensor(greedy_rows, device=device) if mixed else None,
            random=_random_rows(params, greedy, generators, device),
            penalties=_penalties(params, penalised, prompt_token_ids, output_token_ids, device),
            logit_bias=_logit_bias(params, device),
            min_tokens_mask=_min_tokens_mask(params, output_token_ids, eos_token_ids, device),
            max_num_logprobs=max(wanted) if wanted else None,
            grammar=grammar,
        )


def _random_rows(
    params: Sequence[SamplingParams],
    greedy: list[bool],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
) -> RandomRows | None:
    rows = [i for i, g in enumerate(greedy) if not g]
    if not rows:
        return None
    chosen = [params[i] for i in rows]
    own_generators: dict[int, torch.Generator] = {}
    for j, i in enumerate(rows):
        if generators[i] is not None:
            own_generators[j] = generators[i]
        elif params[i].seed is not None:
            # A fresh generator per step would replay the same noise every step.
            raise ValueError(f"row {i} has a seed but no generator: use make_generator once")
    top_k = [p.top_k if p.top_k > 0 else 0 for p in chosen]
    top_p = [p.top_p for p in chosen]
    min_p = [p.min_p for p in chosen]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return RandomRows(
        rows=None if len(rows) == len(params) else torch.tensor(rows, device=device),
        temperature=column([p.temperature for p in chosen]),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if any(top_k) else None,
        top_p=column(top_p) if any(p < 1.0 for p in top_p) else None,
        min_p=column(min_p) if any(p > 0.0 for p in min_p) else None,
        generators=own_generators,
    )


def _padded(lists: list[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64, padded with -1 (the sampler maps -1 to a dropped extra column)."""
    tensors = [torch.as_tensor(list(ids), dtype=torch.int64) for ids in lists]
    padded = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=-1)
    return padded.to(device)


def _penalties(
    params: Sequence[SamplingParams],
    penalised: list[bool],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
) -> Penalties | None:
    if not any(penalised):
        return None
    # Only penalised rows pay for turning their (possibly long) token lists into tensors.
    repeating = [p.repetition_penalty != 1.0 for p in params]
    prompts = [ids if r else () for ids, r in zip(prompt_token_ids, repeating, strict=True)]
    outputs = [ids if pen else () for ids, pen in zip(output_token_ids, penalised, strict=True)]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        prompt_token_ids=_padded(prompts, device) if any(repeating) else None,
        output_token_ids=_padded(outputs, device),
        any_frequency=any(p.frequency_penalty != 0.0 for p in params),
        any_presence=any(p.presence_penalty != 0.0 for p in params),
    )


def _sparse(
    entries: list[tuple[int, int, float]], device: torch.device | str
) -> SparseLogitEdits | None:
    if not entries:
        return None
    rows, token_ids, values = zip(*entries, strict=True)
    return SparseLogitEdits(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _logit_bias(params: Sequence[SamplingParams], device: torch.device | str):
    entries = [
        (i, int(token), float(bias))
        for i, p in enumerate(params)
        for token, bias in p.logit_bias.items()
    ]
    return _sparse(entries, device)


def _min_tokens_mask(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[frozenset[int]],
    device: torch.device | str,
):
    entries = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        # With ignore_eos, eos does not end the request, so there is nothing to prevent.
        blocked = set(p.stop_token_ids)
        if not p.ignore_eos:
            blocked |= eos_token_ids[i]
        entries.extend((i, token, float("-inf")) for token in sorted(blocked))
    return _sparse(entries, device)
