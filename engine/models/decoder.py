"""A decoder-only causal LM over flat token batches and a paged KV cache, assembled from the
shared blocks (engine/models/layers.py): the embedding, the decoder layers, the final norm
and the LM head. A model file (llama.py, qwen3.py, gemma3.py, ...) states only its
`Architecture`, read from its config (engine/model_config.py, or transformers' own).

How it computes comes from the `ExecutionPlan`: its dtype, device, weight formats,
attention backend and layer ops. It has one forward; whether a step runs it or the native
decode stack, or replays it in a CUDA graph, is the model runner's choice.

Not supported (documented, the model runner must respect it): positions past the rotary
table (see engine/models/rotary.py). Each layer's `Attention.sliding_window` says whether it
attends over a window (`Architecture.layer_types`); where the attention backend does not
apply it, outputs are exact only for sequences up to the model's `sliding_window` (the
engine caps the context there).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, get_attention_backend
from engine.distributed import TensorParallel
from engine.execution_plan import TRITON_OPS, ExecutionPlan, batch_variant_error, manual_plan
from engine.gguf_weights import GGUFTensor
from engine.kernels import ggml_kernels
from engine.models.layer_ops import TorchOps, activation, rms_norm, rms_norm_plus_one
from engine.models.layers import Architecture, DecoderLayer, _param
from engine.models.linear import SKINNY_MAX_ROWS, kernel_for, project
from engine.models.rotary import rope_tables
from engine.models.weight_loading import load_weights
from kv_cache.groups import kv_cache_groups, layer_slots


class DecoderForCausalLM(nn.Module):
    """``forward`` -> final hidden states, ``compute_logits`` -> float32 logits."""

    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        raise NotImplementedError

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        """The attention window the config asks for, or None (full attention)."""
        return getattr(hf_config, "sliding_window", None)

    @classmethod
    def layer_windows(cls, hf_config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention, as are all layers of an
        architecture that states no `layer_types`), which sorts the layers into KV cache
        groups (kv_cache/groups.py)."""
        arch = cls.architecture(hf_config)
        types = arch.layer_types or ("full_attention",) * arch.num_layers
        return [arch.sliding_window if t == "sliding_attention" else None for t in types]

    @classmethod
    def state_layers(cls, hf_config: Any) -> tuple[int, ...]:
        """The layers that keep a state instead of a KV cache (linear attention)."""
        arch = cls.architecture(hf_config)
        return tuple(i for i in range(arch.num_layers) if arch.is_linear(i))

    def __init__(
        self,
        hf_config: Any,
        plan: ExecutionPlan | None = None,  # None: `manual_plan()`, float32 torch ops
        max_model_len: int | None = None,  # None: the config's max_position_embeddings
        tp: TensorParallel | None = None,  # this rank's shard (engine/distributed.py)
    ) -> None:
        super().__init__()
        plan = plan if plan is not None else manual_plan()
        arch = self.architecture(hf_config)
        if tp is not None:  # (the plan refuses quantized weights under tensor parallelism)
            arch = _shard(arch, tp)
        self.config, self.arch, self.plan, self.tp = hf_config, arch, plan, tp
        self.dtype, self.device = plan.dtype, plan.device
        # Gemma's sqrt(hidden_size) rounded to the model dtype, as transformers multiplies
        # it; a Python number, so a decode step captured in a CUDA graph copies nothing.
        self.embed_scale = (
            None if arch.embed_scale is None
            else torch.tensor(arch.embed_scale).to(self.dtype).item()
        )  # fmt: skip
        self.quantization = plan.quantization.layers
        self.num_layers, self.vocab_size = arch.num_layers, arch.vocab_size
        self.num_kv_heads, self.head_dim = arch.num_kv_heads, arch.head_dim
        self.max_position_embeddings = max_model_len or hf_config.max_position_embeddings
        # One backend object for all layers: the runner prepares it once per step.
        # A backend per KV cache group (one, unless sliding-window and full layers mix): each
        # plans the step over its group's tables, with its group's window; the runner
        # prepares each once per step (`prepare_attention`).
        groups = kv_cache_groups(self.layer_windows(hf_config), self.state_layers(hf_config))
        # Batch-invariant: every query token a row of the paged kernel (the plan chose it).
        options = {"every_query_as_rows": True} if plan.batch_invariant else {}
        if arch.attn_sinks:
            options["sinks"] = True
        self.attn_backends = [
            get_attention_backend(
                plan.attention, arch.num_heads, arch.num_kv_heads, g.window, **options
            )
            for g in groups
        ]
        for index, backend in enumerate(self.attn_backends):
            backend.kv_group = index
        self.attn_backend = self.attn_backends[0]
        group_of = [group for group, _ in layer_slots(groups, arch.num_layers)]
        # The layers' small ops: a native build or Triton's where the plan says so, else torch's.
        norm = rms_norm_plus_one if arch.norm_plus_one else rms_norm
        self.ops: Any = plan.layer_kernels() or _torch_or_triton_ops(plan)(
            self.attn_backend, activation(arch.act), norm
        )
        kw = {"dtype": self.dtype, "device": self.device}
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(
                arch,
                self.attn_backends[group_of[i]],
                tp,
                quantization=self.quantization,
                index=i,
                **kw,
            )  # fmt: skip
            for i in range(arch.num_layers)
        )
        self.norm = _param(arch.hidden_size, **kw)
        # Under tensor parallelism each rank's head holds its share of the vocabulary.
        self.head_rows = tp.shard(arch.vocab_size, "vocab_size") if tp else arch.vocab_size
        self.lm_head = (self.embed_tokens if arch.tie_word_embeddings
                        else _param(self.head_rows, arch.hidden_size, **kw))  # fmt: skip
        self.head_kernel: ModuleType | None = None  # set by `pack_weights`
        self.head_kernel_rows = SKINNY_MAX_ROWS  # rows through it; any under batch invariance
        # gguf: the embedding's and the LM head's blocks (the same when tied), where kept
        self.embed_blocks: GGUFTensor | None = None
        self.head_blocks: GGUFTensor | None = None
        self.head_ggml: tuple[list[torch.Tensor], list[int]] | None = None  # set by pack
        # One table per rotary kind the layers use (engine/models/rotary.py); `rotary` is
        # the first layer's (the only one where the native decode stack runs).
        kinds = {arch.rope_of(i) for i in range(arch.num_layers)}
        self.rope_tables = rope_tables(
            hf_config, kinds, arch.head_dim, self.max_position_embeddings, self.dtype, self.device
        )
        self.rotary = self.rope_tables[arch.rope_of(0)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Flat tokens ``[T]`` at ``positions [T]`` -> final-normed hidden states ``[T, H]``.

        ``self.attn_backend.prepare(meta)`` must have run for this step.
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        ops, arch = self.ops, self.arch
        tables = {kind: table.lookup(positions) for kind, table in self.rope_tables.items()}
        hidden, residual = self.embed(input_ids), None
        # (A linear-attention layer's "KV cache" is its state slots: engine/state_cache.py.)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = tables[arch.rope_of(i)]
            hidden, residual = layer(ops, hidden, residual, cos, sin, kv_cache, meta)
        return ops.add_rms_norm(hidden, residual, self.norm, self.arch.eps)[0]

    def prepare_attention(self, meta: AttentionMetadata) -> None:
        """Plan the step on every KV cache group's backend (before the first layer)."""
        for group, backend in enumerate(self.attn_backends):
            backend.prepare(meta.for_group(group))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows ``[T, H]`` (dequantized per token where kept in
        GGUF blocks)."""
        blocks = self.embed_blocks
        if blocks is None:
            rows = F.embedding(input_ids, self.embed_tokens)
        else:
            rows = (
                ggml_kernels()
                .ggml_dequantize(blocks.blocks, int(blocks.type), blocks.shape[1], input_ids)
                .to(self.dtype)
            )
        return rows if self.embed_scale is None else rows * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` hidden states -> ``[N, V]`` float32 logits."""
        if self.head_blocks is not None:
            # float32 in, so float32 out: the logits are not rounded to the model dtype
            return _softcap(ggml_kernels().ggml_linear(hidden.float(), *self.head_ggml),
                            self.arch.final_logit_softcap)  # fmt: skip
        if self.tp is None:
            logits = project(
                hidden, self.lm_head, kernel=self.head_kernel, max_rows=self.head_kernel_rows
            )
            return _softcap(logits, self.arch.final_logit_softcap).float()
        rows = self.head_rows
        head = self.lm_head.narrow(0, self.tp.rank * rows, rows) \
            if self.arch.tie_word_embeddings else self.lm_head  # fmt: skip
        logits = self.tp.all_gather_last(project(hidden, head).float())
        return _softcap(logits, self.arch.final_logit_softcap)

    def weight_formats(self) -> str:
        """What each weight group runs as, for the plan: e.g. ``projections Q4_K x134 +
        Q6_K x20, embedding Q4_K, head Q6_K`` (a 1B Q4_K_M file)."""
        counts: dict[str, int] = {}
        for linear in self.linears():
            for name in linear.formats():
                counts[name] = counts.get(name, 0) + 1
        parts = " + ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
        dtype = str(self.dtype).removeprefix("torch.")
        embed = self.embed_blocks.type.name if self.embed_blocks is not None else dtype
        head = self.head_blocks.type.name if self.head_blocks is not None else dtype
        head = "= embedding" if self.arch.tie_word_embeddings else head
        return f"projections {parts}, embedding {embed}, head {head}"

    def linears(self) -> list[Any]:
        return [linear for layer in self.layers for linear in layer.linears()]

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Every tensor of a checkpoint, by transformers' names (engine/models/weight_loading.py)."""
        return load_weights(self, weights)

    def pack_weights(self) -> None:
        """After `load_weights`: lay each projection out for its format and kernel. The LM
        head stays in the model dtype (it is the tied embedding, and int8/int4 on it cost
        greedy agreement: 31% vs 50% of tokens before the first divergence, for 20% of the
        weight bytes), unless it came in GGUF blocks that quantization gguf keeps."""
        for linear in self.linears():
            linear.pack()
            if self.plan.batch_invariant and not linear.method.use_kernel_at_every_size():
                raise batch_variant_error(f"{linear.formats()[0]} projections go through "
                                          "torch's matmul, which rounds by call size")  # fmt: skip
        if self.embed_blocks is not None:  # its dense copy was never written: drop it
            self.embed_tokens = None
        if self.head_blocks is not None:
            self.lm_head = None
            self.head_ggml = self._pack_head(self.head_blocks)
        else:
            self.head_kernel = kernel_for(self.lm_head)
            if self.plan.batch_invariant:  # (the plan allowed it: bf16 with the skinny kernel)
                self.head_kernel_rows = sys.maxsize

    def _pack_head(self, head: GGUFTensor) -> tuple[list[torch.Tensor], list[int]]:
        """The head's blocks as `ggml_linear` takes them, in the layout it reads fastest
        (regrouped as a projection's); an untied head's file pages are then given back."""
        blocks, qtype = ggml_kernels().ggml_repack(head.blocks, int(head.type), head.shape[1])
        if qtype != int(head.type) and not self.arch.tie_word_embeddings:
            head.release()
        return [blocks], [qtype]


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma's final soft-capping), in the logits' dtype."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _torch_or_triton_ops(plan: ExecutionPlan) -> type[TorchOps]:
    """The op set in Python where no native build serves: Triton's where the plan chose it."""
    if plan.layer_ops != TRITON_OPS:
        return TorchOps
    from engine.models.triton_ops import TritonOps  # CUDA only: triton loads here, not on CPU

    return TritonOps


def _shard(arch: Architecture, tp: TensorParallel) -> Architecture:
    """This rank's share of the heads and MLP columns (the vocabulary must divide too)."""
    tp.shard(arch.vocab_size, "vocab_size")
    return dataclasses.replace(
        arch,
        num_heads=tp.shard(arch.num_heads, "num_attention_heads"),
        num_kv_heads=tp.shard(arch.num_kv_heads, "num_key_value_heads"),
        intermediate_size=tp.shard(arch.intermediate_size, "intermediate_size"),
    )
