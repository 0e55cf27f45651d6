"""A GGUF file's tensors under transformers' names, read in place (memory-mapped).

Quantized weights stay in their ggml blocks (`GGUFTensor`): the model keeps them as they
are where `engine.kernels.ggml_kernels` multiplies that format (`NATIVE_TYPES`), and
dequantizes them otherwise. 2-D F16/BF16 weights come the same way (their bytes as
blocks); other float tensors (norms, F32 weights) come as torch tensors. Nothing is copied
but what llama.cpp's converter changed and transformers' layout needs back: llama's q/k
rows, which GGUF stores permuted for llama.cpp's rotary layout (as transformers' own GGUF
loader undoes them), the norms some families store plus one, and Qwen3.5's
linear-attention tensors (`_qwen35_tensor`).
"""

from __future__ import annotations

import ctypes
import mmap
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from engine.errors import ModelFileError
from engine.gguf_file import GGUFFile
from engine.kernels import ggml_kernels

QType = GGMLQuantizationType
_libc = ctypes.CDLL(None, use_errno=True)
# The block formats `ggml_linear` multiplies: what Q4_0, Q4_1, Q5_K_M, Q4_K_M, Q8_0 files hold,
# and Q2_K, Q3_K_S/M/L, IQ2_*, IQ3_*, IQ4_NL and IQ4_XS files, MXFP4 (gpt-oss' experts); and F16
# and BF16 weights, kept in their 16 bits (float32 weights made an F16 file's model twice its
# size on AVX2 CPUs).
NATIVE_TYPES = frozenset(
    {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q2_K, QType.Q3_K,
     QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S,
     QType.IQ3_XXS, QType.IQ3_S, QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4, QType.F16, QType.BF16}
)  # fmt: skip
FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})
# 16-bit float weights: a 2-D one comes as a `GGUFTensor` (its bytes, as a block format's),
# which `ggml_linear` multiplies where its rows are whole runs of 32 values.
HALF_TYPES = frozenset({QType.F16, QType.BF16})

_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# What the newer families add or name differently (llama.cpp's gguf-py constants.py).
_ARCH_LAYER_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "gemma3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # fused: q, k and v rows in one tensor; gate then up rows in `ffn_up`
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Qwen3.5: the Gated DeltaNet (linear attention) layers' tensors under llama.cpp's SSM
    # names; `attn_qkv` is their fused q, k, v, `attn_gate` their z (the full-attention
    # layers' output gate stays inside `attn_q`, per head after its query, as in HF)
    "qwen35": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "post_attention_norm": "post_attention_layernorm",
               "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
               "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
               "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
               "ssm_out": "linear_attn.out_proj"},
}  # fmt: skip
# Qwen3-MoE: the router, and each projection of all experts stacked in one 3-D tensor
# [experts, rows, columns], which `read_tensors` hands on one expert at a time
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_ARCH_LAYER_NAMES["qwen3moe"] = {**_ARCH_LAYER_NAMES["qwen3"], **_EXPERTS}
# gpt-oss: its router is transformers' `mlp.router` (a bias beside it), and each expert
# projection's biases are stacked too ([experts, rows], `ffn_gate_exps.bias`)
_ARCH_LAYER_NAMES["gpt-oss"] = {**_EXPERTS, "ffn_gate_inp": "mlp.router",
                                "post_attention_norm": "post_attention_layernorm"}  # fmt: skip
# Parameters the converter names without a .weight of their own: Qwen3.5's A (`ssm_a`,
# stored as -exp(A_log)) and dt_bias (renamed dt_proj.bias: `ssm_dt.bias`)
_ARCH_PARAMETERS = {
    "qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks"},  # (transformers' has no .weight)
}
# convert_hf_to_gguf permutes q/k rows for llama.cpp's rotary layout in its LlamaModel and
# the converters built on it (SmolLM3) only; Qwen, Gemma and Phi-3 rows are as in HF.
PERMUTED_QK_ARCHS = frozenset({"llama", "smollm3"})
# Gemma's converters store an RMSNorm weight w as 1 + w (llama.cpp multiplies by it
# as it is); transformers' Gemma norms multiply by (1 + w): w is given back.
NORM_PLUS_ONE_ARCHS = frozenset({"gemma3", "qwen35"})
# ... all of them but Qwen3.5's gated norm of the linear attention, which multiplies by w
# (Qwen3NextModel.modify_tensors leaves `linear_attn.norm` as it is)
_NORMS_AS_THEY_ARE = (".linear_attn.norm.weight",)
# llama 3's rope factors (the config has them), Phi-3's LongRoPE factors (likewise)
_SKIPPED = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                      "rope_factors_short.weight"})  # fmt: skip
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")
# Qwen3.5's multi-token-prediction block (`blk.{layers}.nextn.*` and the layer beside it):
# the converter writes it after the model's layers unless told --no-mtp; nothing loads it
_NEXTN = re.compile(r"blk\.\d+\.nextn\.")


@dataclass(frozen=True)
class GGUFTensor:
    """A 2-D weight in its ggml blocks: ``blocks`` is uint8 ``[rows, bytes per row]``
    (a view of the memory-mapped file where ``mapped``, else a copy), ``shape`` the
    logical ``(rows, cols)``."""

    blocks: torch.Tensor
    type: GGMLQuantizationType
    shape: tuple[int, int]
    mapped: bool = False

    @staticmethod
    def type_name(qtype: int) -> str:
        return GGMLQuantizationType(qtype).name

    @property
    def native(self) -> bool:
        """Whether `ggml_linear` multiplies these blocks here."""
        whole = self.type not in HALF_TYPES or self.shape[1] % 32 == 0
        return self.type in NATIVE_TYPES and whole and ggml_kernels() is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[rows, cols]`` weights, exactly as ggml dequantizes them, in ``dtype``."""
        kernels = ggml_kernels()
        if self.native and kernels is not None:
            dense = kernels.ggml_dequantize(self.blocks, int(self.type), self.shape[1])
        else:  # the gguf package's numpy reference: slower, every format it knows
            dense = torch.from_numpy(quants.dequantize(self.blocks.numpy(), self.type))
        return dense.view(self.shape).to(dtype)

    def release(self) -> None:
        """Give the file's pages under a mapped ``blocks`` back once a repacked copy serves
        them, so resident memory holds each weight once (the pages are the file's, never
        written: should anything touch them again they are read back from it)."""
        if not self.mapped:
            return
        start, size = self.blocks.data_ptr(), self.blocks.numel()
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the blocks
        last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                          mmap.MADV_DONTNEED)  # fmt: skip

    def select_rows(self, index: torch.Tensor) -> GGUFTensor:
        """A copy holding rows ``index`` (whole rows of blocks, so exact)."""
        return GGUFTensor(self.blocks.index_select(0, index), self.type, self.shape)

    def select_columns(self, index: torch.Tensor) -> GGUFTensor | torch.Tensor:
        """Columns ``index`` of every row: a copy of whole blocks where ``index`` moves
        blocks as they are (each run of a block's width is one aligned block), exact; else
        the dequantized float32 ``[rows, cols]`` with the columns gathered."""
        width, size = GGML_QUANT_SIZES[self.type]
        runs = index.view(-1, width) if index.numel() % width == 0 else None
        if (
            runs is not None
            and bool((runs[:, 0] % width == 0).all())
            and bool((runs == runs[:, :1] + torch.arange(width, device=index.device)).all())
        ):
            rows = self.shape[0]
            blocks = self.blocks.view(rows, -1, size).index_select(1, runs[:, 0] // width)
            return GGUFTensor(blocks.reshape(rows, -1), self.type, self.shape)
        return self.dequantize().index_select(1, index)


def hf_name(
    gguf_name: str,
    path: str | Path = "the GGUF file",
    arch: str = "llama",
    layers: int | None = None,
) -> str | None:
    """transformers' name for a GGUF tensor name of architecture ``arch``; None for one the
    model does not load (with ``layers``, the model's layer count: the blocks after them,
    Qwen3.5's multi-token prediction), `ModelFileError` for one it does not have."""
    if gguf_name in _SKIPPED or (arch == "qwen35" and _NEXTN.match(gguf_name)):
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    block = _BLOCK.match(gguf_name)
    if block is not None and layers is not None and int(block.group(1)) >= layers:
        return None
    parameters = _ARCH_PARAMETERS.get(arch, {})
    if block is not None and block.group(2) in parameters:
        return f"model.layers.{block.group(1)}.{parameters[block.group(2)]}"
    match = _LAYER.match(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if match is None or match.group(2) not in names:
        raise ModelFileError(f"{path}: tensor {gguf_name} is not part of a supported model")
    index, module, kind = match.groups()
    return f"model.layers.{index}.{names[module]}.{kind}"


def gguf_arch(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture")
    return arch if isinstance(arch, str) else "llama"


def qk_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row gather that undoes convert_hf_to_gguf's q/k permutation: per head, GGUF
    interleaves the two rotary halves (llama.cpp's layout), transformers keeps them apart."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def v_head_order(key_heads: int, value_heads: int, head_dim: int) -> torch.Tensor:
    """The gather that undoes convert_hf_to_gguf's `_reorder_v_heads` (Qwen3.5, where a key
    head serves several value heads): GGUF tiles the value heads over the key heads (K0 K1
    ... K0 K1 ..., for ggml's broadcast), transformers groups them by key head (K0's value
    heads, then K1's ...); ``head_dim`` rows (or columns) a head."""
    per_key = value_heads // key_heads
    order = torch.arange(value_heads * head_dim).view(per_key, key_heads, head_dim)
    return order.transpose(0, 1).reshape(-1)


def qwen35_orders(gguf: GGUFFile) -> dict[str, tuple[int, torch.Tensor]]:
    """Qwen3.5's linear-attention tensors whose value heads the converter reordered
    (`v_head_order`): name suffix -> (the dimension, the gather that gives transformers'
    order); empty when there are as many key as value heads (nothing was moved)."""
    meta = gguf.metadata.get
    key_heads, value_heads = meta("qwen35.ssm.group_count"), meta("qwen35.ssm.time_step_rank")
    head_k, inner = meta("qwen35.ssm.state_size"), meta("qwen35.ssm.inner_size")
    sizes = (key_heads, value_heads, head_k, inner)
    if (
        not all(type(v) is int and v > 0 for v in sizes)
        or value_heads % key_heads
        or (inner % value_heads)
    ):
        raise ModelFileError(f"{gguf.path}: the linear attention's sizes (qwen35.ssm.*: "
                             f"groups, time step rank, state, inner) {sizes} do not fit "
                             "together")  # fmt: skip
    if key_heads == value_heads:
        return {}
    head_v, qk = inner // value_heads, 2 * head_k * key_heads
    values = v_head_order(key_heads, value_heads, head_v)
    qkv = torch.cat([torch.arange(qk), qk + values])
    heads = v_head_order(key_heads, value_heads, 1)
    return {"linear_attn.in_proj_qkv.weight": (0, qkv), "linear_attn.conv1d.weight": (0, qkv),
            "linear_attn.in_proj_z.weight": (0, values), "linear_attn.out_proj.weight": (1, values),
            "linear_attn.in_proj_a.weight": (0, heads), "linear_attn.in_proj_b.weight": (0, heads),
            "linear_attn.A_log": (0, heads), "linear_attn.dt_bias": (0, heads)}  # fmt: skip


def _qwen35_tensor(
    name: str,
    tensor: torch.Tensor | GGUFTensor,
    orders: dict[str, tuple[int, torch.Tensor]],
    where: str,
) -> torch.Tensor | GGUFTensor:
    """A Qwen3.5 tensor as transformers holds it, undoing convert_hf_to_gguf's
    `_LinearAttentionVReorderBase` and `Qwen3NextModel.modify_tensors`: the value heads back
    in transformers' order (rows of blocks moved as they are; out_proj's columns as whole
    blocks where a head is whole blocks, else dequantized), A_log from the stored
    A = -exp(A_log), the conv1d kernel's squeezed middle dimension back. (The norms' +1 is
    undone with Gemma's.)"""
    for suffix, (dim, order) in orders.items():
        if not name.endswith(suffix):
            continue
        if tensor.shape[dim] != len(order):
            raise ModelFileError(f"{where} has {tensor.shape[dim]:,} along dimension {dim}, "
                                 f"the linear attention's sizes need {len(order):,}")  # fmt: skip
        if isinstance(tensor, GGUFTensor):
            tensor = tensor.select_rows(order) if dim == 0 else tensor.select_columns(order)
        else:
            tensor = tensor.index_select(dim, order)
    if name.endswith(".A_log"):  # in float64: exp then log, as close as float32 allows
        dense = _dense(tensor)
        tensor = torch.log(-dense.double()).to(dense.dtype)
    elif name.endswith(".conv1d.weight"):  # [channels, 1, kernel], as nn.Conv1d holds it
        tensor = _dense(tensor).unsqueeze(1)
    return tensor


def _dense(tensor: torch.Tensor | GGUFTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, GGUFTensor) else tensor


def _float_tensor(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple) -> torch.Tensor:
    dtype = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
    return torch.from_numpy(data).view(dtype[qtype]).view(shape)


def read_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(transformers name, dense tensor or `GGUFTensor`) for every tensor the model loads."""
    gguf = GGUFFile(path)
    arch = gguf_arch(gguf)
    heads = gguf.metadata.get(f"{arch}.attention.head_count")
    kv_heads = gguf.metadata.get(f"{arch}.attention.head_count_kv") or heads
    permuted = arch in PERMUTED_QK_ARCHS
    layers = gguf.metadata.get(f"{arch}.block_count")
    extra = gguf.metadata.get(f"{arch}.nextn_predict_layers")  # Qwen3.5's MTP blocks
    layers = layers - extra if type(layers) is int and type(extra) is int else None
    orders = qwen35_orders(gguf) if arch == "qwen35" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy -> torch of a memmap
        for t in gguf.tensors:
            name = hf_name(t.name, gguf.path, arch, layers)
            if name is None:
                continue
            shape, qtype = t.shape, t.type
            if expert_stacks(name, len(shape)):
                yield from _experts(gguf, t, name)
                continue
            if qtype in HALF_TYPES and len(shape) == 2 and not name.endswith("norm.weight"):
                blocks = torch.from_numpy(gguf.array(t)).view(shape[0], -1)
                tensor = GGUFTensor(blocks, qtype, (shape[0], shape[1]), mapped=True)
            elif qtype in FLOAT_TYPES:
                tensor: torch.Tensor | GGUFTensor = _float_tensor(gguf.array(t), qtype, shape)
                if (arch in NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight")
                        and not name.endswith(_NORMS_AS_THEY_ARE)):  # fmt: skip
                    tensor = tensor - 1  # a copy: the file's pages stay as they are
            elif len(shape) == 2:
                blocks = torch.from_numpy(gguf.array(t)).view(shape[0], -1)
                tensor = GGUFTensor(blocks, qtype, (shape[0], shape[1]), mapped=True)
            else:
                raise ModelFileError(f"{gguf.path}: tensor {t.name} of type {qtype.name} is "
                                     f"{len(shape)}-D, not a 2-D weight")  # fmt: skip
            if permuted and name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
            ):
                heads_of = heads if "q_proj" in name else kv_heads
                if type(heads_of) is not int or heads_of < 1 or shape[0] % (2 * heads_of):
                    raise ModelFileError(f"{gguf.path}: tensor {t.name} has {shape[0]:,} rows, "
                                         f"not {heads_of} heads of rotary pairs")  # fmt: skip
                order = qk_row_order(shape[0], heads_of)
                tensor = tensor.select_rows(order) if isinstance(tensor, GGUFTensor) \
                    else tensor.index_select(0, order)  # fmt: skip
            if orders is not None:
                tensor = _qwen35_tensor(name, tensor, orders, f"{gguf.path}: tensor {t.name}")
            yield name, tensor


def expert_stacks(name: str, dims: int) -> bool:
    """Whether ``name`` (a tensor of ``dims`` dimensions) is a mixture's stacked tensor
    (``...mlp.experts.gate_proj.weight``, llama.cpp's ``ffn_gate_exps``: 3-D; gpt-oss'
    biases ``...gate_proj.bias``: 2-D), which stands for every expert's (`expert_names`)."""
    stacked_dims = 2 if name.endswith(".bias") else 3
    return ".mlp.experts." in name and name.count(".") == 6 and dims == stacked_dims


def expert_names(name: str, experts: int) -> list[str]:
    """A stacked expert tensor's name -> each expert's, as transformers' checkpoints name
    them (``...mlp.experts.0.gate_proj.weight``, ...)."""
    head, _, tail = name.partition(".mlp.experts.")
    return [f"{head}.mlp.experts.{e}.{tail}" for e in range(experts)]


def _experts(gguf: GGUFFile, t: Any, name: str) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """A 3-D ``[experts, rows, columns]`` tensor as each expert's 2-D weight: float32
    slices, or its blocks (rows of the mapped file, in place; F16 and BF16 too, as 2-D
    weights of those types are kept); a 2-D float32 one (biases) as each expert's row."""
    experts = t.shape[0]
    if t.type == QType.F32:
        stacked = _float_tensor(gguf.array(t), t.type, t.shape)
        yield from zip(expert_names(name, experts), stacked, strict=True)
        return
    if len(t.shape) != 3:
        raise ModelFileError(f"{gguf.path}: tensor {t.name} of type {t.type.name} is a stack "
                             "of biases, not float32")  # fmt: skip
    _, rows, cols = t.shape
    blocks = torch.from_numpy(gguf.array(t)).view(experts * rows, -1)
    for e, expert in enumerate(expert_names(name, experts)):
        yield expert, GGUFTensor(blocks[e * rows : (e + 1) * rows], t.type, (rows, cols), True)


def weight_types(path: str | Path) -> dict[str, int]:
    """How many of the file's weight tensors each GGUF type holds, e.g. ``{"Q4_K": 97}``."""
    counts: dict[str, int] = {}
    for t in GGUFFile(path).tensors:
        if len(t.shape) == 2:
            name = t.type.name
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
