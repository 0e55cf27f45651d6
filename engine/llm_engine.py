"""The step loop: schedule, run the model, sample, detokenize, report.

One `LLMEngine` owns the model, the paged KV cache, the scheduler and the
per-request detokenizers. It is not thread-safe: one thread calls
`add_request`, `abort_request` and `step`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionMetadata, allocate_kv_cache
from engine.config import (
    EngineConfig,
    GpuMemory,
    measure_gpu_memory,
    reset_peak_memory_stats,
    synchronize,
)
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed import TensorParallel, broadcast_object
from engine.errors import StepError
from engine.kv_tier import move_blocks, open_tier, save_cached_blocks
from engine.loader import (
    default_cache_dir,
    iter_weights,
    load_generation_eos,
    load_hf_config,
    load_tokenizer,
    resolve_model_dir,
    source_gguf,
)
from engine.model_runner import ModelRunner, SampledToken
from engine.models import get_model_class
from engine.models.llama import sliding_window
from engine.outputs import RequestOutput, TokenLogprob
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager
from engine.tp_worker import start_workers, stop_workers
from scheduler import (
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    fits_context,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, kv_event_listener: Callable[[Any], None] | None = None
    ) -> None:
        """`kv_event_listener` hears the prefix cache's block events (`kv_cache`'s
        BlockStored / BlockRemoved / AllBlocksCleared), on the thread that steps."""
        self.config = config
        start = time.perf_counter()
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        self.hf_config = load_hf_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model_name = config.served_name(model_dir)
        self.eos_token_ids = load_generation_eos(model_dir, self.tokenizer)
        self.device = config.resolve_device()
        gguf = source_gguf(model_dir) is not None
        self.dtype = config.resolve_dtype(self.device, gguf)
        self.quantization = config.resolve_quantization(self.device, self.dtype, gguf)
        self.max_model_len = config.resolve_max_model_len(_context_limit(self.hf_config))
        torch.manual_seed(config.seed)

        tp_size = config.tensor_parallel_size
        tp = TensorParallel(0, tp_size) if tp_size > 1 else None
        self.model = model = build_model(
            config, model_dir, self.hf_config, self.device, self.dtype, self.quantization,
            self.max_model_len, tp,
        )  # fmt: skip

        self.num_blocks = self._num_kv_blocks()
        # Ranks 1..N-1 (engine/tp_worker.py): started once the cache size they share is known.
        self._tp_workers = start_workers(config, self.num_blocks) if tp is not None else []
        kv_caches = allocate_kv_cache(
            self.hf_config.num_hidden_layers,
            self.num_blocks,
            config.block_size,
            model.num_kv_heads,
            model.head_dim,
            self.dtype,
            self.device,
            config.kv_cache_quantized,
        )
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids
        )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            config.block_size,
            self.device,
            config.max_num_batched_tokens,
            self.structured_outputs,
        )
        tier = self._open_tier(kv_caches, Path(model_dir)) if config.kv_offload_bytes else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                num_blocks=self.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                # The tier's keys must mean the same in the next process: sha256.
                prefix_cache_hash="sha256" if tier is not None else config.prefix_cache_hash,
                scheduling_policy=config.scheduling_policy,
                age_bound_s=config.age_bound_s,
            ),
            kv_event_listener,
            tier=tier,
        )
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        # kv_blocks is published whenever the pool changes (steps, aborts, a cache reset), so
        # /metrics can read the latest from another thread (server/metrics.py).
        self.stats = EngineStats(kv_blocks=self.kv_cache_manager.block_counts())
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "loaded %s (%s, %s, %s; %s) in %.1fs; %s",
            self.model_name,
            self.hf_config.model_type,
            self.dtype,
            self.device,
            self.compute_summary,
            self.load_seconds,
            config.describe_kv_cache(self.num_blocks),
        )

    @property
    def compute_summary(self) -> str:
        """How the model computes here: attention backend, CPU kernels, quantization."""
        parts = [f"attention {self.model.attn_backend.name}"]
        if self.model.fused_ops is not None:  # bf16 (AVX512-BF16) or float32 on GGUF blocks
            gemm = "skinny GEMM, " if self.model.dtype == torch.bfloat16 else ""
            stack = ", decode stack" if self.model.decode_stack is not None else ""
            parts.append(f"CPU kernels ({gemm}fused ops{stack})")
        if self.quantization.layers == "gguf":
            parts.append("GGUF blocks through the GGUF kernels (int8 activations)")
        parts.append(f"weights: {self.model.weight_formats()}")
        return ", ".join(parts)

    def _num_kv_blocks(self) -> int:
        # Profiling runs a forward pass, which under tensor parallelism needs every rank.
        profiles = self.config.profiles_memory(self.device) and self.model.tp is None
        gpu_memory = self._profile_memory() if profiles else None
        return self.config.kv_cache_num_blocks(
            self.hf_config.num_hidden_layers,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype.itemsize,
            device=self.device,
            gpu_memory=gpu_memory,
        )

    @torch.inference_mode()
    def _profile_memory(self) -> GpuMemory:
        """Peak memory of the largest step (a full token budget over max_num_seqs requests),
        so the KV cache gets what is left of the device's share and no step runs out."""
        cfg, bs = self.config, self.config.block_size
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        per_seq = cfg.max_num_batched_tokens // num_seqs
        query_lens = [per_seq] * num_seqs
        blocks_per_seq = -(-per_seq // bs)
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)
        ]
        scratch = allocate_kv_cache(
            self.hf_config.num_hidden_layers, num_seqs * blocks_per_seq, bs,
            self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device,
            cfg.kv_cache_quantized,
        )  # fmt: skip
        reset_peak_memory_stats(self.device)
        meta = AttentionMetadata.build(query_lens, query_lens, tables, bs, self.device)
        self.model.attn_backend.prepare(meta)
        ids = torch.zeros(sum(query_lens), dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta.positions, scratch, meta)
        last = torch.tensor(meta.query_start_loc_list[1:], device=self.device) - 1
        torch.softmax(self.model.compute_logits(hidden[last]), dim=-1).sort(dim=-1)
        synchronize(self.device)
        scratch_bytes = sum(k.nbytes + v.nbytes for k, v in scratch)
        del scratch, hidden
        memory = measure_gpu_memory(self.device)
        return GpuMemory(memory.total, memory.peak_used - scratch_bytes)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> None:
        """Queue a request; ValueError (naming the limit) when it can never run.

        `priority`: lower is admitted (and kept from preemption) first. `queue_timeout`:
        seconds it may wait before its first step; past them it finishes unscheduled
        with finish_reason "queue_timeout".

        A request with structured outputs compiles its grammar here unless it is cached:
        the server compiles it beforehand on another thread, so the step never waits.
        """
        self._check_prompt(prompt_token_ids, params)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            priority=priority,
            queue_timeout=queue_timeout,
        )
        self.structured_outputs.add_request(request)  # GrammarError before anything is queued
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.structured_outputs.remove(request_id)
            raise
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params
        )
        if params.logprobs is not None:
            self._logprobs[request_id] = []

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if not fits_context(len(prompt_token_ids), params.max_tokens, self.max_model_len):
            total = len(prompt_token_ids) + params.max_tokens
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total}, more than max_model_len ({self.max_model_len})"
            )

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort in any state; the blocks are freed at once."""
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._detokenizers.pop(rid, None)
            self._logprobs.pop(rid, None)
            self.structured_outputs.remove(rid)
        self.stats.kv_blocks = self.kv_cache_manager.block_counts()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers; save the pool's cached blocks to the KV tier
        (so a restart finds them) and close it."""
        workers, self._tp_workers = self._tp_workers, []
        if workers:
            stop_workers(workers)
        tier = self.kv_cache_manager.tier
        if tier is not None:
            saved = save_cached_blocks(self.runner.kv_caches, self.kv_cache_manager)
            tier.close()
            logger.info("KV tier: saved %d cached blocks from the pool; closed", saved)

    def _open_tier(self, kv_caches, model_dir: Path):
        if self.model.tp is not None:
            raise ValueError("the KV tier (kv_offload_bytes) runs in one process, not under "
                             "tensor parallelism")  # fmt: skip
        if not self.config.enable_prefix_caching:
            raise ValueError("the KV tier (kv_offload_bytes) needs prefix caching")
        cache_dir = Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir()
        return open_tier(cache_dir, self.config.kv_offload_bytes, kv_caches, model_dir,
                         self.config.block_size)  # fmt: skip

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Compute a prefix's KV (a request for one token) and pin its full blocks resident
        (`KVCacheManager.pin`): a system prompt that requests share stays cached however
        much else passes through the pool. Returns the tokens pinned (whole blocks)."""
        request_id = f"pin-{self.kv_cache_manager.num_pinned_blocks}-{len(token_ids)}"
        self.add_request(request_id, list(token_ids), SamplingParams(max_tokens=1))
        while request_id in self.scheduler.requests:
            self.step()
        pinned = self.kv_cache_manager.pin(list(token_ids))
        self.stats.kv_blocks = self.kv_cache_manager.block_counts()
        return pinned

    def reset_prefix_cache(self) -> bool:
        done = self.kv_cache_manager.reset_prefix_cache()
        self.stats.kv_blocks = self.kv_cache_manager.block_counts()
        return done

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One step; raises `StepError` (its requests aborted) when running it fails.

        A failure is confined to the requests the step scheduled: they are aborted here,
        so their blocks and per-request state are freed, and the next step runs without
        them; the blocks the step was to write leave the prefix cache. A failure before
        anything was scheduled propagates as it is.
        """
        sched_out = self.scheduler.schedule()
        try:
            move_blocks(self.runner.kv_caches, self.kv_cache_manager)
            if self._tp_workers:  # every rank runs the same step
                broadcast_object(sched_out)
            sampled = self.runner.execute(sched_out)
            updated = self.scheduler.update_from_output(
                sched_out, {rid: s.token_id for rid, s in sampled.items()}
            )
            outputs = [self._make_output(req, sampled[req.request_id]) for req in updated]
            outputs += [self._timed_out_output(req) for req in sched_out.timed_out]
        except Exception as exc:
            ids = [s.request_id for s in sched_out.scheduled]
            self.scheduler.uncache_failed_step(sched_out)
            self.abort_request(ids)
            raise StepError(ids, exc) from exc
        self._update_stats(sched_out, updated)
        return outputs

    def _make_output(self, req: Request, sampled: SampledToken) -> RequestOutput:
        detok = self._detokenizers[req.request_id]
        # The scheduler already stopped it on eos or a stop token id: that token's text is left out.
        stop_token = req.status is RequestStatus.FINISHED_STOPPED
        new_text, hit_stop = detok.add_token(sampled.token_id, is_stop_token=stop_token)
        # A grammar that is complete (or that the token broke) ends the request as a stop;
        # unlike a stop string, it leaves the text held back so far in the output.
        grammar_done = self.structured_outputs.accept(req.request_id, sampled.token_id)
        if hit_stop and not req.is_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        else:
            if grammar_done and not req.is_finished:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            if req.is_finished and not stop_token:
                new_text += detok.finish()
        new_logprobs = self._record_logprob(req.request_id, sampled.logprob)
        output = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=detok.text,
            new_token_ids=[sampled.token_id],
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            logprobs=self._logprobs.get(req.request_id),
            new_logprobs=new_logprobs,
            stop_string=detok.stop_string if req.is_finished else None,
        )
        if req.is_finished:
            self._detokenizers.pop(req.request_id, None)
            self._logprobs.pop(req.request_id, None)
            self.structured_outputs.remove(req.request_id)
        return output

    def _timed_out_output(self, req: Request) -> RequestOutput:
        """The final output of a request whose queue deadline passed before it ran."""
        self._detokenizers.pop(req.request_id, None)
        self._logprobs.pop(req.request_id, None)
        self.structured_outputs.remove(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=[],
            text="",
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=req.finish_reason,
            num_cached_tokens=0,
        )

    def _record_logprob(
        self, request_id: str, logprob: TokenLogprob | None
    ) -> list[TokenLogprob] | None:
        if logprob is None:
            return None
        self._logprobs[request_id].append(logprob)
        return [logprob]

    def _update_stats(self, sched_out, updated: list[Request]) -> None:
        s = self.stats
        kv = self.kv_cache_manager
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.kv_cache_usage = kv.usage
        s.kv_blocks = kv.block_counts()
        s.prefix_cache_queries = kv.stats.queries
        s.prefix_cache_hits = kv.stats.hits
        s.tier_hits = kv.stats.tier_hits
        if kv.tier is not None:
            s.tier_blocks, s.tier_num_blocks = len(kv.tier), kv.tier.num_slots
        s.num_preemptions = self.scheduler.num_preemptions
        s.generation_tokens += len(updated)
        # A request's first token ends its prefill: its whole prompt counts once, however
        # much came from the prefix cache (a preempted request recomputes without recounting).
        s.prompt_tokens += sum(r.num_prompt_tokens for r in updated if r.num_output_tokens == 1)
        s.num_steps += 1
        s.last_step_tokens = sched_out.num_batched_tokens
        s.last_step_seqs = len(sched_out.scheduled)


def build_model(
    config: EngineConfig,
    model_dir: Any,
    hf_config: Any,
    device: torch.device,
    dtype: torch.dtype,
    quantization: Any,
    max_model_len: int,
    tp: TensorParallel | None = None,
) -> torch.nn.Module:
    """The model with its weights loaded and packed (this rank's shard under `tp`)."""
    model = get_model_class(hf_config)(
        hf_config,
        dtype=dtype,
        device=device,
        attn_backend=config.attention_backend,
        max_model_len=max_model_len,
        quantization=quantization.layers,
        tp=tp,
    )
    model.load_weights(iter_weights(model_dir))
    model.pack_weights()
    return model.eval()


def _context_limit(hf_config) -> int:
    """The longest context computed exactly. Sliding-window attention is not implemented,
    so a windowed model (Mistral v0.1) is capped at its window, where full attention equals it."""
    limit = int(hf_config.max_position_embeddings)
    window = sliding_window(hf_config)
    return min(limit, window) if window else limit
