"""The engine's configuration resolved once, against the model and this machine.

`EngineConfig` is what the user asked for ("auto" dtype, no context length...);
`ResolvedConfig` is what the engine runs: the model's directory and transformers config,
the device, dtype, quantization, context length and, once the model is loaded and
measured, the number of KV blocks. It is frozen and picklable: the engine core builds
from it, the tensor-parallel workers receive it whole (they resolve nothing themselves),
and the scheduler's own config is derived from it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, Quantization, is_cuda
from engine.loader import load_hf_config, resolve_model_dir, source_gguf
from engine.models.llama import sliding_window
from scheduler import SchedulerConfig


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # as the user gave it
    model_dir: Path
    hf_config: Any  # transformers' PretrainedConfig of the model
    device: torch.device
    dtype: torch.dtype
    quantization: Quantization
    max_model_len: int
    # 0 until the model is loaded: the budget is what is left beside it (`with_num_blocks`).
    num_blocks: int = 0

    @classmethod
    def resolve(cls, config: EngineConfig) -> ResolvedConfig:
        """Resolve everything that needs no loaded model; ValueError naming what is wrong."""
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        hf_config = load_hf_config(model_dir)
        device = config.resolve_device()
        gguf = source_gguf(model_dir) is not None
        dtype = config.resolve_dtype(device, gguf)
        return cls(
            engine=config,
            model_dir=Path(model_dir),
            hf_config=hf_config,
            device=device,
            dtype=dtype,
            quantization=config.resolve_quantization(device, dtype, gguf),
            max_model_len=config.resolve_max_model_len(context_limit(hf_config)),
        )

    def with_num_blocks(self, num_blocks: int) -> ResolvedConfig:
        return dataclasses.replace(self, num_blocks=num_blocks)

    @property
    def attention_backend(self) -> str:
        """The backend the model is built with: "auto" is triton on CUDA where it applies
        (`triton_applies`): paged attention from the block table, decode steps in CUDA
        graphs. Any other "auto" the registry resolves per head layout (cpu-paged or sdpa)."""
        asked = self.engine.attention_backend
        if asked == "auto" and triton_applies(self.device, self.engine.kv_cache_quantized):
            return "triton"
        return asked

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

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
        )


def triton_applies(device: torch.device, kv_cache_quantized: bool) -> bool:
    """Whether the triton backend serves here: a CUDA device with triton installed (it comes
    with torch's CUDA build) and a float KV cache (it reads no int8 rows)."""
    return (
        is_cuda(device)
        and not kv_cache_quantized
        and importlib.util.find_spec("triton") is not None
    )


def context_limit(hf_config: Any) -> int:
    """The longest context computed exactly. Sliding-window attention is not implemented,
    so a windowed model (Mistral v0.1) is capped at its window, where full attention equals it."""
    limit = int(hf_config.max_position_embeddings)
    window = sliding_window(hf_config)
    return min(limit, window) if window else limit
