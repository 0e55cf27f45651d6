"""Turns one scheduler decision into one forward pass and the sampled tokens.

The scheduler speaks in token ids and block ids; the runner flattens the
step's requests into one token batch (no padding), builds the paged-attention
metadata, runs the model, and samples only the positions whose next token is
wanted: each decoding request's last token and the last prompt token of a
prefill that completes this step. A request with k draft tokens (speculative decoding)
is 1 + k decode rows over its block table, row i seeing the cache up to its own
position: every backend, the native decode stack included, runs a verification as it
runs decodes. All 1 + k rows are sampled as decodes would be, and `accept_drafts`
keeps the drafts the samples agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import CudaGraphRunner
from engine.decode_stack import DecodeStack
from engine.device import uses_pinned_memory
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingMetadata, to_token_logprobs
from engine.speculative.verify import accept_drafts, rewind
from engine.state_cache import StateMetadata, prepare_states
from engine.structured_output import StructuredOutputManager
from scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engine.structured_output.bitmask import GrammarBitmask


@dataclass
class SampledTokens:
    token_ids: list[int]  # one, or with draft tokens the kept ones and one more
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked for them


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        max_num_batched_tokens: int,
        structured_outputs: StructuredOutputManager | None = None,
        samples: bool = True,
        decode_stack: DecodeStack | None = None,
    ) -> None:
        self.model = model
        # Decode-only steps of up to its rows run as one native call (the plan's choice).
        self.decode_stack = decode_stack
        self.structured_outputs = structured_outputs  # the grammar mask of constrained rows
        self.kv_caches = kv_caches
        # The linear-attention layers' state slots (their entries of kv_caches).
        self.state_caches = [kv_caches[i] for i in model.state_layers(model.config)]
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # False on tensor-parallel ranks 1..N-1: they compute their share of each step
        # (the logits' all-gather included) and rank 0 samples.
        self.samples = samples
        # One host staging buffer for the step's token ids, reused every step. Pinned where
        # that makes the non_blocking copy to the device asynchronous (CUDA).
        self._host_ids = torch.empty(
            max_num_batched_tokens, dtype=torch.long, pin_memory=uses_pinned_memory(device)
        )
        # Set once captured (EngineCore): decode-only steps replay a CUDA graph.
        self.graphs: CudaGraphRunner | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledTokens]:
        if not out.scheduled:
            return {}
        sampled = [s for s in out.scheduled if s.sample]
        hidden = self._forward(out)
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden)
        return self._sample(sampled, logits) if self.samples else {}

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The hidden states of the step's sampled rows (`_prepare_inputs`), in order."""
        graphs = self.graphs
        hidden = graphs.run(out.scheduled) if graphs is not None else None
        if hidden is not None:  # a decode-only step, replayed: row r is request r
            rows = [r for r, s in enumerate(out.scheduled) if s.sample]
            if len(rows) == len(out.scheduled):
                return hidden
            return hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        # Eager: prefills, large batches, or no graphs; the native stack or the model's forward.
        input_ids, meta, sample_rows = self._prepare_inputs(out)
        # The step's host-side attention planning, once per KV cache group's backend: the
        # layers then only run tensor work.
        self.model.prepare_attention(meta)
        if meta.states is not None:  # snapshots copied in, new requests' states cleared
            prepare_states(self.state_caches, meta.states)
        stack = self.decode_stack
        hidden = stack.run(input_ids, meta.positions, self.kv_caches, meta) if stack else None
        if hidden is None:
            hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        return hidden[torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)]

    def _prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """The step's token ids, its attention metadata, and the rows to sample: each
        sampled request's last, or all 1 + k of a request verifying k drafts."""
        query_lens: list[int] = []
        seq_lens: list[int] = []
        rows_of: list[int] = []  # each row's request in out.scheduled
        sample_rows: list[int] = []
        row = 0
        for i, s in enumerate(out.scheduled):
            q, start = len(s.token_ids), s.num_computed_tokens
            if s.num_draft_tokens:  # a decode row per position, each up to its own
                query_lens += [1] * q
                seq_lens += range(start + 1, start + q + 1)
                rows_of += [i] * q
                sample_rows += range(row, row + q)
            else:
                query_lens.append(q)
                seq_lens.append(start + q)
                rows_of.append(i)
                if s.sample:
                    sample_rows.append(row + q - 1)
            row += q
        scheduled = out.scheduled
        tables = [scheduled[i].block_ids for i in rows_of]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        if scheduled[0].group_block_ids:  # a hybrid model: each other group's view of the step
            meta.group_metas = tuple(
                AttentionMetadata.build(
                    query_lens,
                    seq_lens,
                    [scheduled[i].group_block_ids[g] for i in rows_of],
                    self.block_size,
                    self.device,
                )  # fmt: skip
                for g in range(len(scheduled[0].group_block_ids))
            )
        if scheduled[0].state is not None:  # a model with linear-attention layers
            meta.states = StateMetadata.build(
                [s.state for s in scheduled], [s.num_computed_tokens for s in scheduled],
                [len(s.token_ids) for s in scheduled], self.device,
            )  # fmt: skip
        host = self._host_ids[: meta.num_tokens]
        host.numpy()[:] = [t for s in out.scheduled for t in s.token_ids]
        return host.to(self.device, non_blocking=True), meta, sample_rows

    def _sample(self, sampled: list, logits: torch.Tensor) -> dict[str, SampledTokens]:
        """Sample each row (a request's, or each of a verifying request's 1 + k rows with
        the drafts before it as its output so far), then keep the agreeing drafts."""
        rows = [_Row(s.request, s.token_ids[len(s.token_ids) - s.num_draft_tokens :], i)
                for s in sampled for i in range(s.num_draft_tokens + 1)]  # fmt: skip
        # A seeded, sampling request's generator draws once per row; rewound below to
        # once per token kept.
        states = {id(s.request): s.request.generator.get_state() for s in sampled
                  if s.num_draft_tokens and _draws(s.request)}  # fmt: skip
        requests = [r.request for r in rows]
        params = [r.sampling_params for r in requests]
        # A seeded request's own generator (`Request.generator`), kept for its whole life,
        # so its tokens do not depend on which other requests share the batch.
        meta = SamplingMetadata.build(
            params,
            [r.prompt_token_ids for r in requests],
            [r.output_so_far() for r in rows],
            [r.generator for r in requests],
            [r.eos_token_ids for r in requests],
            self.device,
            grammar=self._grammar_bitmask(rows, requests),
        )
        result = self.sampler(logits, meta)
        token_ids = result.token_ids.tolist()
        logprobs = to_token_logprobs(result, [p.logprobs for p in params])
        tokens: dict[str, SampledTokens] = {}
        row = 0
        for s in sampled:
            request, n = s.request, s.num_draft_tokens + 1
            kept = accept_drafts(token_ids[row : row + n], rows[row].drafts) if n > 1 else [
                token_ids[row]]  # fmt: skip
            if id(request) in states:
                rewind(request.generator, states[id(request)], len(kept))
            lps = logprobs[row : row + len(kept)]
            tokens[request.request_id] = SampledTokens(kept, None if lps[0] is None else lps)
            row += n
        return tokens

    def _grammar_bitmask(self, rows: list[_Row], requests: list) -> GrammarBitmask | None:
        """The constrained rows' mask, each position after the drafts before it."""
        if self.structured_outputs is None:
            return None
        drafts = [r.drafts for r in rows] if any(r.drafts for r in rows) else None
        return self.structured_outputs.bitmask(requests, drafts)


@dataclass(slots=True)
class _Row:
    """One sampled row: a request's next token, or one position of a verification."""

    request: Any
    drafts: list[int]  # the request's draft tokens this step ([] without)
    position: int  # which of its 1 + k positions: the drafts before it are its context

    def output_so_far(self) -> list[int]:
        """The output as this position sees it (penalties and min_tokens count it)."""
        output = self.request.output_token_ids
        return output + self.drafts[: self.position] if self.position else output


def _draws(request: Any) -> bool:
    """True when the sampler draws from the request's own generator (seeded, not greedy)."""
    return request.generator is not None and not request.sampling_params.greedy
