"""The engine core: scheduler, model runner and grammars; token ids in, token ids out.

One `EngineCore` owns the model, the paged KV cache, the scheduler (with its KV cache
manager) and the tensor-parallel workers. Everything it keeps for a request lives on
that request's `scheduler.Request` (its tokens, its blocks through the KV manager, its
random generator, its grammar matcher), so a request that ends, however it ends, leaves
nothing behind. The scheduler alone decides that a request finished on its own (eos and
stop token ids, length, a completed grammar); from outside, `abort_requests` ends one
(the output processor's stop strings arrive that way).

A step: `schedule()`, move the KV tier's blocks, (broadcast the step's diff to the
other ranks), run the model and sample, `update_from_output()`, report. Not
thread-safe: one thread calls `add_request`, `abort_requests` and `step`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AttentionMetadata, allocate_kv_cache
from engine.chat_template_check import chat_template_limits, check_chat_template
from engine.config import EngineConfig
from engine.cuda_graphs import CudaGraphRunner
from engine.decode_stack import DecodeStack
from engine.device import GpuMemory, measure_gpu_memory, reset_peak_memory_stats, synchronize
from engine.distributed import TensorParallel, broadcast_object
from engine.errors import StepError
from engine.execution_plan import ExecutionPlan
from engine.kv_tier import TierCopies, open_tiers
from engine.loader import load_generation_eos, load_tokenizer, source_gguf
from engine.model_loader import load_model
from engine.model_runner import ModelRunner, SampledTokens
from engine.outputs import EngineCoreOutput
from engine.resolved_config import ResolvedConfig
from engine.sampling_metadata import make_generator
from engine.speculative import DRAFTERS, Speculator
from engine.state_cache import StateTensors, allocate_state_cache
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager
from engine.tp_worker import start_workers, stop_workers, worker_step
from scheduler import Request, SamplingParams, Scheduler, SchedulerOutput, fits_context

if TYPE_CHECKING:  # types only: grammar_cache imports xgrammar, which loads on first use
    from engine.structured_output.grammar_cache import CompileResult
    from kv_cache import BlockCounts, PoolSnapshot
    from scheduler import StructuredOutputs

logger = logging.getLogger(__name__)

# Speculative decoding's row budget per step (running requests plus their drafts): past
# it a step is compute-bound on CPU and drafts would slow it (engine/speculative/).
SPEC_MAX_ROWS = 16


class EngineCore:
    def __init__(
        self,
        config: ResolvedConfig,
        kv_event_listener: Callable[[Any], None] | None = None,
        tokenizer: Any = None,
    ) -> None:
        """`kv_event_listener` hears the prefix cache's block events (`kv_cache`'s
        BlockStored / BlockRemoved / AllBlocksCleared), on the thread that steps.
        `tokenizer`: this model's, loaded before (a server of several models keeps it
        while the model is unloaded: reading it was most of a small model's load)."""
        start = time.perf_counter()
        engine = config.engine
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_dir)
        # The model's chat template is its file's code: rendered once now, under the bounds
        # its requests get, before any weight is read (engine/chat_template_check.py).
        self.chat_template_limits = chat_template_limits(
            self.tokenizer, config.max_model_len, engine.chat_template_timeout
        )
        check_chat_template(self.tokenizer, self.chat_template_limits,
                            source_gguf(config.model_dir) or config.model_dir)  # fmt: skip
        self.model_name = engine.served_name(config.model_dir)
        self.eos_token_ids = load_generation_eos(config.model_dir, self.tokenizer)
        torch.manual_seed(engine.seed)

        tp_size = engine.tensor_parallel_size
        self.model = model = load_model(config, TensorParallel(0, tp_size) if tp_size > 1 else None)
        stack = DecodeStack.build(model, config.plan)
        # The plan, completed with what packing the weights decided.
        plan = config.plan.with_weights(model.weight_formats(), stack.max_rows if stack else 0)
        self.config = config = config.with_plan(plan).with_num_blocks(*self._cache_size(config))
        # Ranks 1..N-1 (engine/tp_worker.py): started once the cache size they share is known.
        self._tp_workers = start_workers(config) if tp_size > 1 else []
        tensors = allocate_kv_cache(
            config.kv_cache_tensors, config.num_blocks, engine.block_size, model.num_kv_heads,
            model.head_dim, config.dtype, config.device, engine.kv_cache_quantized,
        )  # fmt: skip
        # Each layer's pair: its own, or in a hybrid model one its KV cache group shares
        # with a layer of each other group (kv_cache/groups.py); a linear-attention layer's
        # state slots in its place (engine/state_cache.py).
        states = self._allocate_states(config)
        next_state = iter(states)
        kv_caches = [tensors[slot] if slot >= 0 else next(next_state)
                     for slot in config.layer_kv_slots()]  # fmt: skip
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, config.vocab_size, self.eos_token_ids
        )
        self.runner = ModelRunner(
            model, kv_caches, engine.block_size, config.device, engine.max_num_batched_tokens,
            self.structured_outputs, decode_stack=stack,
        )  # fmt: skip
        if plan.cuda_graphs_off is None:
            self.runner.graphs = graphs = CudaGraphRunner(
                model, kv_caches, engine.block_size, config.max_model_len,
                engine.max_num_seqs, config.device,
            )  # fmt: skip
            graphs.capture()
        tier, state_tier = (open_tiers(config, tensors, states, model.tp is not None)
                            if engine.kv_offload_bytes else (None, None))  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler_config(tiered=tier is not None), kv_event_listener, tier=tier,
            state_tier=state_tier,
        )  # fmt: skip
        self.kv_cache_manager = kv = self.scheduler.kv_cache_manager
        # What each step copies between the pool's tensors and the tier files (kv_tier.py).
        self._tiers: list[TierCopies] = []
        if tier is not None:
            self._tiers.append(TierCopies(tier, tensors, kv.take_tier_moves, kv.cached_blocks))
        if state_tier is not None:
            self._tiers.append(TierCopies(state_tier, states, kv.take_state_tier_moves,
                                          kv.cached_snapshots))  # fmt: skip
        drafter = DRAFTERS.get(engine.speculative)
        self.speculator = (
            Speculator(engine.num_speculative_tokens, SPEC_MAX_ROWS, drafter(), self._encode_text)
            if drafter is not None
            else None
        )
        # kv_blocks is published whenever the pool changes (steps, aborts, a cache reset), so
        # /metrics can read the latest from another thread (server/metrics.py).
        self.stats = EngineStats(kv_blocks=self.kv_cache_manager.block_counts())
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "loaded %s (%s, %s, %s; %s) in %.1fs; %s",
            self.model_name, config.hf_config.model_type, config.dtype, config.device,
            self.compute_summary, self.load_seconds,
            engine.describe_kv_cache(config.num_blocks, config.num_state_slots),
        )  # fmt: skip

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        kv_event_listener: Callable[[Any], None] | None = None,
        tokenizer: Any = None,
    ) -> EngineCore:
        return cls(ResolvedConfig.resolve(config), kv_event_listener, tokenizer)

    # -- facts ----------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _encode_text(self, text: str) -> list[int]:
        """Text to token ids as the model would continue with it (no special tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def plan(self) -> ExecutionPlan:
        return self.config.plan

    @property
    def compute_summary(self) -> str:
        """How the model computes here: the execution plan, as the start-up line says it."""
        summary = self.plan.describe()
        sizes = self.runner.graphs.captured if self.runner.graphs is not None else []
        if sizes:  # the sizes captured, which the plan leaves to the graph runner
            summary += f" for decode batches {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
        return summary

    # -- the server's API -------------------------------------------------------------------
    # What the server (its engine thread, metrics, dashboard, start-up banner and replicas)
    # needs beyond the requests and the step below: it reaches no further into the core's
    # parts (scheduler, KV manager, grammars, config), so they can change behind these.

    @property
    def block_size(self) -> int:
        return self.config.engine.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def model_source(self) -> str:
        """The model as it was named (`--model`), or "default" for the default model."""
        return self.config.engine.model or "default"

    @property
    def kv_blocks(self) -> BlockCounts:
        """The pool's block counts as last published. Any thread: the core replaces this
        immutable object whenever the pool changes (steps, aborts, a cache reset)."""
        return self.stats.kv_blocks

    def refresh_stats(self) -> EngineStats:
        """`stats` with what changes between steps brought up to date (requests running and
        waiting, the pool's use, the prefix cache's counters): after aborts or a cache reset
        with nothing left to step, the last step's snapshot is stale. Engine thread only."""
        s, kv = self.stats, self.kv_cache_manager
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.kv_cache_usage = kv.usage
        s.kv_blocks = kv.block_counts()
        s.prefix_cache_queries = kv.stats.queries
        s.prefix_cache_hits = kv.stats.hits
        return s

    def pool_snapshot(self, max_prefixes: int) -> PoolSnapshot:
        """Every block's state and the `max_prefixes` prefixes holding the most blocks.
        O(blocks): for a dashboard's occasional look, not every step. Engine thread only."""
        return self.kv_cache_manager.snapshot(max_prefixes)

    def prepare_grammars(self) -> None:
        """Build the grammar compiler (~0.1 s of tokenizer work) before the first
        constrained request needs it. Any thread."""
        self.structured_outputs.grammars  # noqa: B018 - built on first access

    def compile_grammar(self, spec: StructuredOutputs) -> CompileResult:
        """Compile a request's grammar into the cache `add_request` reads, so that adding the
        request does not compile on the stepping thread. Any thread; GrammarError (a
        ValueError with the compiler's message) when the spec cannot be compiled."""
        return self.structured_outputs.compile(spec)

    # -- sizing the KV cache ---------------------------------------------------------------

    def _cache_size(self, config: ResolvedConfig) -> tuple[int, int]:
        """(KV blocks, state slots): a model with linear-attention layers splits the
        budget between them (`EngineConfig.split_for_states`)."""
        num_blocks = self._num_kv_blocks(config)
        if not config.state_layers:
            return num_blocks, 0
        engine, dtype_bytes = config.engine, config.dtype.itemsize
        per_block = engine.kv_cache_bytes_per_block(
            config.kv_cache_tensors, self.model.num_kv_heads, self.model.head_dim, dtype_bytes
        )
        shape = self.model.arch.linear_attention.state_shape()
        slot_bytes = shape.slot_bytes(dtype_bytes) * len(config.state_layers)
        return engine.split_for_states(num_blocks, per_block, slot_bytes)

    def _allocate_states(self, config: ResolvedConfig) -> list[StateTensors]:
        if not config.state_layers:
            return []
        shape = self.model.arch.linear_attention.state_shape()
        return allocate_state_cache(len(config.state_layers), config.num_state_slots, shape,
                                    config.dtype, config.device)  # fmt: skip

    def _num_kv_blocks(self, config: ResolvedConfig) -> int:
        # Profiling runs a forward pass, which under tensor parallelism needs every rank.
        # (Not yet with linear-attention layers, whose step needs state slots to run.)
        profiles = (config.engine.profiles_memory(config.device) and self.model.tp is None
                    and not config.state_layers)  # fmt: skip
        gpu_memory = self._profile_memory(config) if profiles else None
        return config.engine.kv_cache_num_blocks(
            config.kv_cache_tensors, self.model.num_kv_heads, self.model.head_dim,
            config.dtype.itemsize, device=config.device, gpu_memory=gpu_memory,
        )  # fmt: skip

    @torch.inference_mode()
    def _profile_memory(self, config: ResolvedConfig) -> GpuMemory:
        """Peak memory of the largest step (a full token budget over max_num_seqs requests),
        so the KV cache gets what is left of the device's share and no step runs out."""
        cfg, bs, device = config.engine, config.engine.block_size, config.device
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        per_seq = cfg.max_num_batched_tokens // num_seqs
        query_lens = [per_seq] * num_seqs
        blocks_per_seq = -(-per_seq // bs)
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)
        ]
        scratch = allocate_kv_cache(
            config.num_layers, num_seqs * blocks_per_seq, bs, self.model.num_kv_heads,
            self.model.head_dim, config.dtype, device, cfg.kv_cache_quantized,
        )  # fmt: skip
        reset_peak_memory_stats(device)
        meta = AttentionMetadata.build(query_lens, query_lens, tables, bs, device)
        self.model.prepare_attention(meta)
        ids = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
        hidden = self.model(ids, meta.positions, scratch, meta)
        last = torch.tensor(meta.query_start_loc_list[1:], device=device) - 1
        torch.softmax(self.model.compute_logits(hidden[last]), dim=-1).sort(dim=-1)
        synchronize(device)
        scratch_bytes = sum(k.nbytes + v.nbytes for k, v in scratch)
        del scratch, hidden
        memory = measure_gpu_memory(device)
        return GpuMemory(memory.total, memory.peak_used - scratch_bytes)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        queue_timeout: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; ValueError (naming the limit) when it can never run.

        `priority`: lower is admitted (and kept from preemption) first. `queue_timeout`:
        seconds it may wait before its first step, counted from `arrival_time` (a
        `time.monotonic()`, default now: the server passes when the request reached it,
        so time spent waiting for the engine thread counts); past them it finishes
        unscheduled with finish_reason "queue_timeout".

        A request with structured outputs compiles its grammar here unless it is cached:
        the server compiles it beforehand on another thread, so the step never waits.
        """
        self._check_prompt(prompt_token_ids, params)
        request = Request(
            request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt, priority=priority, queue_timeout=queue_timeout,
            arrival_time=arrival_time,
        )  # fmt: skip
        request.grammar = self.structured_outputs.new_matcher(request)  # GrammarError first
        if params.seed is not None and not params.greedy:
            request.generator = make_generator(params.seed, self.config.device)
        self.scheduler.add_request(request)

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The token prompt's own limits (the engine owns them: the vocabulary, the context)."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if not fits_context(len(prompt_token_ids), params.max_tokens, self.max_model_len):
            total = len(prompt_token_ids) + params.max_tokens
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total}, more than max_model_len ({self.max_model_len})"
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in any state (unknown ids are ignored); the blocks are freed at once."""
        self.scheduler.abort_requests(request_ids)
        self.stats.kv_blocks = self.kv_cache_manager.block_counts()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

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

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers; save the pool's cached blocks to the KV tier
        (so a restart finds them) and close it."""
        workers, self._tp_workers = self._tp_workers, []
        if workers:
            stop_workers(workers)
        for copies in self._tiers:
            saved = copies.save()
            copies.tier.close()
            logger.info("Tier %s: saved %d cached entries from the pool; closed",
                        copies.tier.path.name, saved)  # fmt: skip

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One step; raises `StepError` (its requests aborted) when running it fails.

        A failure is confined to the requests the step scheduled: they are aborted here,
        so their blocks and state are freed, and the next step runs without them; the
        blocks the step was to write leave the prefix cache. A failure before anything
        was scheduled propagates as it is.
        """
        sched_out = self.scheduler.schedule()
        try:
            for copies in self._tiers:
                copies.move()
            if self._tp_workers:  # every rank runs the same step
                broadcast_object(worker_step(sched_out))
            sampled = self.runner.execute(sched_out)
            # Output lengths before the update: a verification may add several tokens.
            verifying = {s.request_id: (s.request, s.request.num_output_tokens, s.num_draft_tokens)
                         for s in sched_out.scheduled if s.num_draft_tokens}  # fmt: skip
            updated = self.scheduler.update_from_output(
                sched_out, {rid: s.token_ids for rid, s in sampled.items()}
            )
        except Exception as exc:
            ids = [s.request_id for s in sched_out.scheduled]
            self.scheduler.uncache_failed_step(sched_out)
            self.abort_requests(ids)
            raise StepError(ids, exc) from exc
        num_new = self._num_new_tokens(verifying, sampled)
        outputs = [self._output(r, sampled[r.request_id], num_new.get(r.request_id, 1))
                   for r in updated]  # fmt: skip
        outputs += [
            EngineCoreOutput(r.request_id, [], r.finish_reason) for r in sched_out.timed_out
        ]
        self._update_stats(sched_out, sum(len(o.new_token_ids) for o in outputs), updated)
        if self.speculator is not None:
            self.speculator.finished([r for r in updated if r.is_finished])
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _num_new_tokens(self, verifying: dict, sampled: dict) -> dict[str, int]:
        """Tokens each verifying request gained (a stop inside its kept drafts ends it
        early), with the verification's outcome recorded for the speculator."""
        num_new = {}
        for request_id, (request, before, num_drafts) in verifying.items():
            got = sampled.get(request_id)
            if got is None:  # aborted since it was scheduled
                continue
            num_new[request_id] = request.num_output_tokens - before
            if self.speculator is not None:
                self.speculator.record(request, num_drafts, len(got.token_ids))
        return num_new

    @staticmethod
    def _output(request: Request, sampled: SampledTokens, num_new: int) -> EngineCoreOutput:
        logprobs = sampled.logprobs
        return EngineCoreOutput(
            request.request_id,
            request.output_token_ids[-num_new:],
            request.finish_reason,
            request.stop_reason,
            None if logprobs is None else logprobs[:num_new],
            max(request.num_cached_tokens, 0),
        )

    def _update_stats(
        self, sched_out: SchedulerOutput, num_new_tokens: int, updated: list[Request]
    ) -> None:
        s, kv = self.refresh_stats(), self.kv_cache_manager
        s.tier_hits = kv.stats.tier_hits
        if kv.tier is not None:
            s.tier_blocks, s.tier_num_blocks = len(kv.tier), kv.tier.num_slots
        s.num_preemptions = self.scheduler.num_preemptions
        s.generation_tokens += num_new_tokens
        # A request's first token ends its prefill: its whole prompt counts once, however
        # much came from the prefix cache (a preempted request recomputes without recounting).
        s.prompt_tokens += sum(r.num_prompt_tokens for r in updated if r.num_output_tokens == 1)
        if self.speculator is not None:
            spec = self.speculator.stats
            s.spec_num_drafts, s.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            s.spec_num_accepted_tokens = spec.num_accepted_tokens
            s.spec_accepted_per_pos = tuple(spec.accepted_per_pos)
        s.num_steps += 1
        s.last_step_tokens = sched_out.num_batched_tokens
        s.last_step_seqs = len(sched_out.scheduled)
