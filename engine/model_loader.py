"""Building the model of a resolved config: the architecture, its weights, packed for the kernels."""

from __future__ import annotations

import torch

from engine.distributed import TensorParallel
from engine.loader import iter_weights
from engine.models.registry import get_model_class
from engine.resolved_config import ResolvedConfig


def load_model(config: ResolvedConfig, tp: TensorParallel | None = None) -> torch.nn.Module:
    """The model with its weights loaded and packed (this rank's shard under `tp`)."""
    model = get_model_class(config.hf_config)(
        config.hf_config, config.plan, max_model_len=config.max_model_len, tp=tp
    )
    model.load_weights(iter_weights(config.model_dir))
    model.pack_weights()
    return model.eval()
