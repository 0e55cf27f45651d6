"""Turns one scheduler decision into one forward pass and the sampled tokens.

The scheduler speaks in token ids and block ids; the runner flattens the
step's requests into one token batch (no padding), builds the paged-attention
metadata, runs the model, and samples only the positions whose next token is
wanted: each decoding request's last token and the last prompt token of a
prefill that completes this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import CudaGraphRunner
from engine.decode_stack import DecodeStack
from engine.device import uses_pinned_memory
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingMetadata, to_token_logprobs
from engine.structured_output import StructuredOutputManager
from scheduler import SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # only when the request asked for logprobs


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
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        if not out.scheduled:
            return {}
        sampled = [s for s in out.scheduled if s.sample]
        hidden = self._forward(out)
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden)
        return self._sample(sampled, logits) if self.samples else {}

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The hidden states of the step's sampled positions: each sampled request's last."""
        graphs = self.graphs
        hidden = graphs.run(out.scheduled) if graphs is not None else None
        if hidden is not None:  # a decode-only step, replayed: row r is request r
            rows = [r for r, s in enumerate(out.scheduled) if s.sample]
            if len(rows) == len(out.scheduled):
                return hidden
            return hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        # Eager: prefills, large batches, or no graphs; the native stack or the model's forward.
        input_ids, meta = self._prepare_inputs(out)
        # The step's host-side attention planning, once: the layers then only run tensor work.
        self.model.attn_backend.prepare(meta)
        stack = self.decode_stack
        hidden = stack.run(input_ids, meta.positions, self.kv_caches, meta) if stack else None
        if hidden is None:
            hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        return hidden[self._sample_indices(out, meta)]

    def _prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        scheduled = out.scheduled
        query_lens = [len(s.token_ids) for s in scheduled]
        seq_lens = [s.num_computed_tokens + q for s, q in zip(scheduled, query_lens, strict=True)]
        meta = AttentionMetadata.build(
            query_lens, seq_lens, [s.block_ids for s in scheduled], self.block_size, self.device
        )
        host = self._host_ids[: meta.num_tokens]
        host.numpy()[:] = [t for s in scheduled for t in s.token_ids]
        return host.to(self.device, non_blocking=True), meta

    @staticmethod
    def _sample_indices(out: SchedulerOutput, meta: AttentionMetadata) -> torch.Tensor:
        """Each sampled request's last position in the flat batch."""
        ends = meta.query_start_loc_list[1:]
        rows = [end - 1 for end, s in zip(ends, out.scheduled, strict=True) if s.sample]
        return torch.tensor(rows, dtype=torch.long, device=meta.slot_mapping.device)

    def _sample(self, sampled: list, logits: torch.Tensor) -> dict[str, SampledToken]:
        requests = [s.request for s in sampled]
        params = [r.sampling_params for r in requests]
        # A seeded request's own generator (`Request.generator`), kept for its whole life,
        # so its tokens do not depend on which other requests share the batch.
        generators = [r.generator for r in requests]
        meta = SamplingMetadata.build(
            params,
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            generators,
            [r.eos_token_ids for r in requests],
            self.device,
            grammar=self.structured_outputs.bitmask(requests) if self.structured_outputs else None,
        )
        result = self.sampler(logits, meta)
        token_ids = result.token_ids.tolist()
        logprobs = to_token_logprobs(result, [p.logprobs for p in params])
        return {
            r.request_id: SampledToken(tok, lp)
            for r, tok, lp in zip(requests, token_ids, logprobs, strict=True)
        }
