"""Llama-family decoder (Llama, Mistral, Qwen2) over flat token batches and a paged KV cache.

Numerically it follows transformers' implementation (RMSNorm in float32 cast back,
rotary cos/sin computed in float32 then cast to the model dtype, ``q*cos +
rotate_half(q)*sin``) so that float32 logits match it to ~1e-5. For speed the
q/k/v projections are one matmul and the MLP's gate/up projections another;
rotary embedding is applied to q and k in one go.

Not supported (documented, the model runner must respect it):
* positions >= ``max_position_embeddings`` (or the ``max_model_len`` given);
  "dynamic" rope therefore equals default rope, as in transformers below that length.
* sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``): attention is
  always full, so outputs are exact only for sequences up to ``model.sliding_window``.
* "longrope" (its frequencies depend on the whole sequence length) and partial rotary.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, get_attention_backend
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.kv_cache import is_quantized
from engine.distributed import TensorParallel
from engine.gguf_weights import GGUFTensor
from engine.kernels import ggml_kernels, layer_kernels
from engine.models.linear import (
    GGUF,
    Linear,
    check_shape,
    kernel_for,
    project,
    weight_rows,
)

__all__ = ["LlamaForCausalLM"]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings across transformers versions (``rope_parameters`` in v5, ``rope_scaling`` before)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, computed exactly as transformers does."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "longrope":
        raise ValueError("rope_type 'longrope' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    # linear, dynamic (below max_position_embeddings), llama3, yarn: static frequencies.
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_positions, head_dim]`` in the model dtype, indexed by position."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, dtype, device) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, 1, head_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = arch["hidden_size"], arch["intermediate_size"]
        self.num_heads, self.num_kv_heads = arch["num_heads"], arch["num_kv_heads"]
        self.head_dim = arch["head_dim"]
        self.eps = arch["eps"]
        self.scale = self.head_dim**-0.5
        self.attn = arch["attn_backend"]
        self.act = arch["act"]
        self.intermediate_size = inter
        self.tp: TensorParallel | None = arch["tp"]
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(hidden, **kw)
        self.post_attention_layernorm = _param(hidden, **kw)
        lw = {**kw, "quantization": arch["quantization"]}
        self.qkv_proj = Linear(hidden, qkv_rows, arch["qkv_bias"], **lw)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, arch["o_bias"], **lw)
        self.gate_up_proj = Linear(hidden, 2 * inter, arch["mlp_bias"], **lw)
        self.down_proj = Linear(inter, hidden, arch["mlp_bias"], **lw)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: every rank's partial sum, added up."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        x = rms_norm(hidden, self.input_layernorm, self.eps)
        qkv = self.qkv_proj(x).view(num_tokens, h + 2 * kvh, self.head_dim)
        qk = apply_rotary(qkv[:, : h + kvh], cos, sin)  # q and k heads rotated together
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
        k_cache, v_cache = kv_cache
        self.attn.write_kv(k_cache, v_cache, k, v, meta)
        attn = self.attn(q, k_cache, v_cache, meta, self.scale)
        hidden = hidden + self._reduce(self.o_proj(attn.view(num_tokens, h * self.head_dim)))

        x = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return hidden + self._reduce(self.down_proj(self.act(gate) * up))

    def forward_fused(
        self,
        ops: ModuleType,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` through the fused CPU ops (``ops``, see `engine.kernels`).

        The residual stream is carried apart from the layer's output, as in vLLM, so each
        residual add is fused into the norm that follows it: takes and returns (the
        previous layer's output, the stream before it is added). ``cos``/``sin``: [T, D].
        """
        num_tokens = delta.shape[0]
        x, residual = ops.add_rms_norm(delta, residual, self.input_layernorm, self.eps)
        k_cache, v_cache = kv_cache
        q = ops.rope_write_kv(
            self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping,
            self.num_heads, self.num_kv_heads,
        )  # fmt: skip
        attn = self.attn(q, k_cache, v_cache, meta, self.scale)
        o = self.o_proj(attn.view(num_tokens, self.num_heads * self.head_dim))
        x, residual = ops.add_rms_norm(o, residual, self.post_attention_layernorm, self.eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x))), residual


def _architecture(
    config: Any,
    attn_backend: str,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The few numbers and switches the layers need, read from a transformers config:
    this rank's share of the heads and MLP columns under tensor parallelism."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    intermediate_size = config.intermediate_size
    if tp is not None:
        num_heads = tp.shard(num_heads, "num_attention_heads")
        num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        intermediate_size = tp.shard(intermediate_size, "intermediate_size")
        tp.shard(config.vocab_size, "vocab_size")
    if getattr(config, "model_type", "") == "qwen2":  # q/k/v carry a bias, o_proj does not
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    act_name = getattr(config, "hidden_act", "silu")
    if act_name == "silu":
        act = F.silu
    else:
        from transformers.activations import ACT2FN

        act = ACT2FN[act_name]
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": intermediate_size,
        "tp": tp,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "eps": config.rms_norm_eps,
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        "act": act,
        "quantization": quantization,
        # One backend object for all layers: the runner prepares it once per step.
        "attn_backend": get_attention_backend(
            attn_backend,
            num_heads,
            num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            quantization=quantization,
        ),
    }


def sliding_window(config: Any) -> int | None:
    """The attention window the config asks for, or None (full attention)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") == "qwen2" and not getattr(
        config, "use_sliding_window", False
    ):
        return None
    return window


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM: ``forward`` -> final hidden states, ``compute_logits``."""

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,  # None: torch's default device
        attn_backend: str = "auto",
        max_model_len: int | None = None,
        # "int8", "int4": the decoder layers' projections, quantized from float weights;
        # "gguf": a GGUF's blocks kept as they are, for the embedding and head as well
        quantization: str | None = None,
        tp: TensorParallel | None = None,  # this rank's shard (engine/distributed.py)
    ) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.config = hf_config
        self.dtype = dtype
        self.device = device
        self.tp = tp
        arch = _architecture(hf_config, attn_backend, dtype, device, tp, quantization)
        self.num_layers = hf_config.num_hidden_layers
        self.num_heads, self.num_kv_heads = arch["num_heads"], arch["num_kv_heads"]
        self.head_dim = arch["head_dim"]
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size
        self.eps = arch["eps"]
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.sliding_window = sliding_window(hf_config)
        self.max_position_embeddings = max_model_len or hf_config.max_position_embeddings
        # Every layer calls it; `attn_backend.prepare(meta)` must run once before each step.
        self.attn_backend = arch["attn_backend"]
        # bf16 on a CPU with the kernels, or float32 on a GGUF's blocks: the layers' small
        # ops go through engine.kernels (one process's whole layers only: not under tensor
        # parallelism).
        self.fused_ops = (
            layer_kernels(dtype, device, quantization)
            if arch["act"] is F.silu and self.head_dim % 2 == 0 and tp is None
            else None
        )

        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = _param(self.vocab_size, self.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, device) for _ in range(self.num_layers)
        )
        self.norm = _param(self.hidden_size, **kw)
        # Under tensor parallelism each rank's head holds its share of the vocabulary.
        self.head_rows = tp.shard(self.vocab_size, "vocab_size") if tp else self.vocab_size
        self.lm_head = (
            self.embed_tokens
            if self.tie_word_embeddings
            else _param(self.head_rows, self.hidden_size, **kw)
        )
        self.head_kernel: ModuleType | None = None  # set by `pack_weights`
        # A decode-only step's layers in one native call (set by `pack_weights` where the
        # fused ops and the cpu-paged backend serve): (the stack, the most rows it takes).
        self.decode_stack: tuple[Any, int] | None = None
        if tp is not None and quantization:
            raise ValueError("tensor parallelism takes unquantized weights (quantization none)")
        self.quantization = quantization
        # gguf: the embedding's and the LM head's blocks (the same when tied), where kept
        self.embed_blocks: GGUFTensor | None = None
        self.head_blocks: GGUFTensor | None = None
        self.head_ggml: tuple[list[torch.Tensor], list[int]] | None = None  # set by pack
        self.rotary = RotaryEmbedding(
            hf_config, self.head_dim, self.max_position_embeddings, dtype, device
        )

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
        hidden = self.embed(input_ids)
        # The bf16 kernels write and read bf16 caches only: an int8 cache takes torch's
        # layer ops there (the float32 kernels read and write int8 rows).
        if self.fused_ops is not None and (
            hidden.dtype == torch.float32 or not is_quantized(kv_caches[0][0])
        ):
            return self._forward_fused(hidden, positions, kv_caches, meta)
        cos, sin = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return rms_norm(hidden, self.norm, self.eps)

    def _forward_fused(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        ops = self.fused_ops
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]  # [T, D]
        if self.decode_stack is not None and hidden.shape[0] <= self.decode_stack[1]:
            tables = self.attn_backend.decode_only_tables()
            if tables is not None:
                return self.decode_stack[0].forward(
                    hidden, cos, sin, kv_caches, meta.slot_mapping, *tables
                )
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer.forward_fused(ops, hidden, residual, cos, sin, kv_cache, meta)
        return ops.add_rms_norm(hidden, residual, self.norm, self.eps)[0]

    def weight_formats(self) -> str:
        """What each weight group runs as, for the start-up line: e.g. ``projections
        Q4_K x134 + Q6_K x20, embedding Q4_K, head Q6_K`` (a 1B Q4_K_M file)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for linear in layer.linears():
                for name in linear.formats():
                    counts[name] = counts.get(name, 0) + 1
        parts = " + ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
        dtype = str(self.dtype).removeprefix("torch.")
        embed = self.embed_blocks.type.name if self.embed_blocks is not None else dtype
        head = self.head_blocks.type.name if self.head_blocks is not None else dtype
        head = "= embedding" if self.tie_word_embeddings else head
        return f"projections {parts}, embedding {embed}, head {head}"

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows ``[T, H]`` (dequantized per token where kept in
        GGUF blocks)."""
        blocks = self.embed_blocks
        if blocks is None:
            return F.embedding(input_ids, self.embed_tokens)
        rows = ggml_kernels().ggml_dequantize(
            blocks.blocks, int(blocks.type), blocks.shape[1], input_ids
        )
        return rows.to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` hidden states -> ``[N, V]`` float32 logits."""
        head = self.head_blocks
        if head is not None:
            # float32 in, so float32 out: the logits are not rounded to the model dtype
            return ggml_kernels().ggml_linear(hidden.float(), *self.head_ggml)
        if self.tp is None:
            return project(hidden, self.lm_head, kernel=self.head_kernel).float()
        rows = self.head_rows
        head = self.lm_head.narrow(0, self.tp.rank * rows, rows) if self.tie_word_embeddings \
            else self.lm_head  # fmt: skip
        return self.tp.all_gather_last(project(hidden, head).float())

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy transformers-named tensors into our (fused) parameters.

        Call once with every tensor of the checkpoint; raises ``ValueError`` on an
        unknown name, a shape mismatch, or a parameter left unloaded. Returns the
        names consumed.
        """
        loaded: set[str] = set()
        filled: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding matrix is the head
            target, rows, shard, linear = self._route(name)
            try:
                self._load_tensor(name, tensor, target, rows, linear)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            loaded.add(name)
            filled.add(shard)
        missing = sorted(f"{p}[{s}]" if s else p for p, s in self._expected_shards() - filled)
        if missing:
            raise ValueError(f"weights missing for: {', '.join(missing[:10])}")
        return loaded

    def _load_tensor(
        self, name: str, tensor: Any, target: torch.Tensor, rows: tuple[int, int] | None,
        linear: Linear | None,
    ) -> None:  # fmt: skip
        """One checkpoint tensor into its place: a projection's weight through its own
        loader (`Linear.load`), a GGUF embedding or head kept in its blocks, anything else
        (this rank's part of it) copied into the parameter."""
        if linear is not None and self.tp is None:
            linear.load(tensor, rows)
            return
        if self._keep_blocks(target, tensor):
            return
        if isinstance(tensor, GGUFTensor):
            tensor = tensor.dequantize(torch.float32)
        dest = weight_rows(target, rows)
        tensor = self._tp_slice(name, tensor)
        check_shape(tensor, dest)
        dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))

    def _keep_blocks(self, target: torch.Tensor, tensor: Any) -> bool:
        """Keep a GGUF embedding's or head's blocks as they are (quantization gguf)."""
        keep = isinstance(tensor, GGUFTensor) and self.quantization == GGUF and tensor.native
        if keep and target is self.embed_tokens:
            check_shape(tensor, target)
            self.embed_blocks = tensor
            if self.tie_word_embeddings:
                self.head_blocks = tensor
        elif keep and target is self.lm_head:
            check_shape(tensor, target)
            self.head_blocks = tensor
        return keep

    def pack_weights(self) -> None:
        """After `load_weights`: lay each projection out for this device, dtype and
        quantization (see `engine.models.linear`). The LM head stays in the model dtype
        (it is the tied embedding, and int8/int4 on it cost greedy agreement: 31% vs 50%
        of tokens before the first divergence, for 20% of the weight bytes), unless it
        came in GGUF blocks that quantization gguf keeps."""
        for layer in self.layers:
            for linear in layer.linears():
                linear.pack()
        if self.embed_blocks is not None:  # its dense copy was never written: drop it
            self.embed_tokens = None
        if self.head_blocks is not None:
            self.lm_head = None
            self.head_ggml = self._pack_head(self.head_blocks)
        else:
            self.head_kernel = kernel_for(self.lm_head)
        self.decode_stack = self._build_decode_stack()

    def _pack_head(self, head: GGUFTensor) -> tuple[list[torch.Tensor], list[int]]:
        """The head's blocks as `ggml_linear` takes them, in the layout it reads fastest
        (regrouped as a projection's); an untied head's file pages are then given back."""
        blocks, qtype = ggml_kernels().ggml_repack(head.blocks, int(head.type), head.shape[1])
        if qtype != int(head.type) and not self.tie_word_embeddings:
            head.release()
        return [blocks], [qtype]

    def _build_decode_stack(self) -> tuple[Any, int] | None:
        """`forward_fused`'s layers as one native object, for decode-only steps of up to as
        many rows as every projection sends through its kernel; None where the fused ops,
        the cpu-paged backend or a kernel for every projection is missing."""
        ops = self.fused_ops
        linears = [linear for layer in self.layers for linear in layer.linears()]
        max_rows = min((linear.kernel_max_rows for linear in linears), default=0)
        if ops is None or not isinstance(self.attn_backend, CpuPagedBackend) or max_rows == 0:
            return None

        def projection(linear: Linear) -> Any:
            blocks, types = linear.ggml or ([], [])
            return ops.Projection(linear.weight, linear.scales, linear.mins, linear.bias,
                                  blocks, types)  # fmt: skip

        layers = [
            ops.DecoderLayer(
                layer.input_layernorm,
                layer.post_attention_layernorm,
                *(projection(linear) for linear in layer.linears()),
            )  # fmt: skip
            for layer in self.layers
        ]
        stack = ops.DecodeStack(
            layers, self.norm, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            self.head_dim**-0.5,  # as each layer's `scale`
        )  # fmt: skip
        return stack, max_rows

    def _route(
        self, name: str
    ) -> tuple[torch.Tensor, tuple[int, int] | None, tuple[str, str], Linear | None]:
        """Map a transformers name to (our tensor, (row offset, rows) or None, shard key,
        the `Linear` whose weight it is, which loads it itself, or None)."""
        top = {
            "model.embed_tokens.weight": "embed_tokens",
            "model.norm.weight": "norm",
            "lm_head.weight": "lm_head",
        }
        if name in top:
            return getattr(self, top[name]), None, (top[name], ""), None
        parts = name.split(".")
        if len(parts) not in (5, 6) or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise ValueError(f"unexpected weight name {name!r}")
        index = int(parts[2])
        if index >= self.num_layers:
            raise ValueError(f"unexpected weight name {name!r} (layer {index})")
        layer = self.layers[index]
        prefix = f"layers.{index}."
        if len(parts) == 5:  # model.layers.N.<norm>.weight
            module = parts[3]
            if (
                module not in ("input_layernorm", "post_attention_layernorm")
                or parts[4] != "weight"
            ):
                raise ValueError(f"unexpected weight name {name!r}")
            return getattr(layer, module), None, (prefix + module, ""), None
        module, proj, kind = parts[3], parts[4], parts[5]
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = layer.intermediate_size
        fused = {
            ("self_attn", "q_proj"): ("qkv", (0, q_rows)),
            ("self_attn", "k_proj"): ("qkv", (q_rows, kv_rows)),
            ("self_attn", "v_proj"): ("qkv", (q_rows + kv_rows, kv_rows)),
            ("self_attn", "o_proj"): ("o", None),
            ("mlp", "gate_proj"): ("gate_up", (0, inter)),
            ("mlp", "up_proj"): ("gate_up", (inter, inter)),
            ("mlp", "down_proj"): ("down", None),
        }
        if (module, proj) not in fused or kind not in ("weight", "bias"):
            raise ValueError(f"unexpected weight name {name!r}")
        ours, rows = fused[(module, proj)]
        linear = getattr(layer, f"{ours}_proj")
        target = getattr(linear, kind)
        if target is None:
            raise ValueError(f"unexpected weight name {name!r} (this config has no such bias)")
        attr = f"{ours}_proj" if kind == "weight" else f"{ours}_bias"
        owner = linear if kind == "weight" else None
        return target, rows, (prefix + attr, proj if rows else ""), owner

    def _tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor: rows of the column-parallel
        projections (q, k, v, gate, up: by heads and columns) and of the LM head, columns of
        the row-parallel ones (o, down), whose bias only rank 0 adds (the sum is reduced)."""
        tp = self.tp
        if tp is None:
            return tensor
        column_parallel = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        if any(f".{p}." in name for p in column_parallel) or name == "lm_head.weight":
            return tensor.chunk(tp.size, dim=0)[tp.rank]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return tensor.chunk(tp.size, dim=1)[tp.rank]
        if name.endswith(("o_proj.bias", "down_proj.bias")) and tp.rank:
            return torch.zeros_like(tensor)
        return tensor

    def _expected_shards(self) -> set[tuple[str, str]]:
        shards = {("embed_tokens", ""), ("norm", "")}
        if not self.tie_word_embeddings:
            shards.add(("lm_head", ""))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            shards |= {(p + "input_layernorm", ""), (p + "post_attention_layernorm", "")}
            shards |= {(p + "qkv_proj", s) for s in ("q_proj", "k_proj", "v_proj")}
            shards |= {(p + "gate_up_proj", s) for s in ("gate_proj", "up_proj")}
            shards |= {(p + "o_proj", ""), (p + "down_proj", "")}
            if layer.qkv_proj.bias is not None:
                shards |= {(p + "qkv_bias", s) for s in ("q_proj", "k_proj", "v_proj")}
            if layer.o_proj.bias is not None:
                shards.add((p + "o_bias", ""))
            if layer.gate_up_proj.bias is not None:
                shards |= {(p + "gate_up_bias", s) for s in ("gate_proj", "up_proj")}
                shards.add((p + "down_bias", ""))
        return shards
