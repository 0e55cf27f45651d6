"""Attention sinks (gpt-oss): a learned logit per query head that joins the softmax of every
query beside its keys' scores, with no value. Its weight is taken from the keys': where the
attention over the keys alone gives ``out`` with log-sum-exp ``lse``, the attention with
the sink gives ``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``.

So a backend that computes the log-sum-exp of its scores adds sinks with one multiply after
its attention (transformers' eager attention concatenates the sink to the scores instead:
the same softmax, rounded in another order).
"""

from __future__ import annotations

import torch


def sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)``: each (query, head)'s share of the softmax its keys keep,
    float32, shaped as ``lse`` (whose head dimension is ``sinks``' one)."""
    return torch.sigmoid(lse.float() - sinks.float())
