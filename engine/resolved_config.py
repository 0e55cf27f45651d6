"""The engine's configuration resolved once, against the model and this machine.

`EngineConfig` is what the user asked for ("auto" dtype, no context length...);
`ResolvedConfig` is what the engine runs: the model's directory and config,
the execution plan (device, dtype, quantization, attention backend, kernels: see
engine/execution_plan.py), the context length and, once the model is loaded and measured,
the number of KV blocks and the plan's facts about the packed weights. It is frozen and picklable: the engine core builds
from it, the tensor-parallel workers receive it whole (they resolve nothing themselves),
and the scheduler's own config is derived from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.execution_plan import ExecutionPlan, Quantization, resolve_plan
from engine.loader import holds_blocks, load_hf_config, resolve_model_dir
from engine.models.registry import get_model_class
from kv_cache.groups import KVCacheGroup, group_size, kv_cache_groups, layer_slots
from kv_cache.state_group import StateGroup
from scheduler import SchedulerConfig


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # as the user gave it
    model_dir: Path
    hf_config: Any  # the model's config.json: engine/model_config.py's `ModelConfig`
    plan: ExecutionPlan
    max_model_len: int
    # 0 until the model is loaded: the budget is what is left beside it (`with_num_blocks`).
    num_blocks: int = 0
    num_state_slots: int = 0  # a model with linear-attention layers: its state slots

    @classmethod
    def resolve(cls, config: EngineConfig) -> ResolvedConfig:
        """Resolve everything that needs no loaded model; ValueError naming what is wrong."""
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        hf_config = load_hf_config(model_dir)
        gguf = holds_blocks(model_dir)  # a GGUF, or gpt-oss' MXFP4 experts
        return cls(
            engine=config,
            model_dir=Path(model_dir),
            hf_config=hf_config,
            plan=resolve_plan(config, hf_config, config.resolve_device(), gguf),
            max_model_len=config.resolve_max_model_len(context_limit(hf_config)),
        )

    def with_num_blocks(self, num_blocks: int, num_state_slots: int = 0) -> ResolvedConfig:
        return dataclasses.replace(self, num_blocks=num_blocks, num_state_slots=num_state_slots)

    def with_plan(self, plan: ExecutionPlan) -> ResolvedConfig:
        return dataclasses.replace(self, plan=plan)

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def quantization(self) -> Quantization:
        return self.plan.quantization

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @cached_property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers by attention kind (kv_cache/groups.py): one group unless the model mixes
        sliding-window and full layers."""
        model = get_model_class(self.hf_config)
        return kv_cache_groups(model.layer_windows(self.hf_config), self.state_layers)

    @cached_property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a state, not a KV cache (linear attention)."""
        return get_model_class(self.hf_config).state_layers(self.hf_config)

    @property
    def state_group(self) -> StateGroup | None:
        """The state group of a model with linear-attention layers (once sized), or None."""
        if not self.state_layers:
            return None
        return StateGroup(self.state_layers, self.num_state_slots,
                          self.engine.state_snapshot_interval)  # fmt: skip

    @property
    def kv_cache_tensors(self) -> int:
        """The K/V tensor pairs the cache allocates: one per layer of a group, each shared by
        one layer of every group, so a block costs memory in this many layers."""
        return group_size(self.kv_cache_groups)

    def layer_kv_slots(self) -> list[int]:
        """Which of the cache's tensor pairs each layer reads and writes."""
        return [
            slot for _, slot in layer_slots(self.kv_cache_groups, self.num_layers)
        ]  # -1: a state's

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def scheduler_config(self, tiered: bool = False) -> SchedulerConfig:
        """The scheduler's share; `tiered`: the prefix cache has a second tier, whose keys
        must mean the same in the next process (sha256)."""
        c = self.engine
        return SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=c.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=c.enable_prefix_caching,
            prefix_cache_hash="sha256" if tiered else c.prefix_cache_hash,
            scheduling_policy=c.scheduling_policy,
            age_bound_s=c.age_bound_s,
            kv_cache_groups=self.kv_cache_groups,
            state_group=self.state_group,
        )


def context_limit(hf_config: Any) -> int:
    """The longest context computed exactly: the rotary table's (sliding windows are
    attended as such, kv_cache/groups.py)."""
    return int(hf_config.max_position_embeddings)
