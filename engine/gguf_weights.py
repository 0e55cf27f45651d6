"""A GGUF file's tensors under transformers' names, read in place (memory-mapped).

Quantized weights stay in their ggml blocks (`GGUFTensor`): the model keeps them as they
are where `engine.kernels.ggml_kernels` multiplies that format (`NATIVE_TYPES`), and
dequantizes them otherwise. 2-D F16/BF16 weights come the same way (their bytes as
blocks); other float tensors (norms, F32 weights) come as torch tensors. Nothing is copied
but llama's q/k rows, which GGUF stores permuted for llama.cpp's rotary layout and
transformers' layout needs back (as transformers' own GGUF loader does).
"""

from __future__ import annotations

import ctypes
import mmap
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from engine.errors import ModelFileError
from engine.gguf_file import GGUFFile
from engine.kernels import ggml_kernels

QType = GGMLQuantizationType
_libc = ctypes.CDLL(None, use_errno=True)
# The block formats `ggml_linear` multiplies: what Q4_0, Q4_1, Q5_K_M, Q4_K_M, Q8_0 files hold,
# and Q2_K, Q3_K_S/M/L, IQ4_NL and IQ4_XS files; and F16 and BF16 weights, kept in their 16
# bits (float32 weights made an F16 file's model twice its size on AVX2 CPUs).
NATIVE_TYPES = frozenset(
    {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q2_K, QType.Q3_K,
     QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.F16, QType.BF16}
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
}  # fmt: skip
# convert_hf_to_gguf permutes q/k rows for llama.cpp's rotary layout in its LlamaModel and
# the converters built on it (SmolLM3) only; Qwen, Gemma and Phi-3 rows are as in HF.
PERMUTED_QK_ARCHS = frozenset({"llama", "smollm3"})
# Gemma's converters store an RMSNorm weight w as 1 + w (llama.cpp multiplies by it
# as it is); transformers' Gemma norms multiply by (1 + w): w is given back.
NORM_PLUS_ONE_ARCHS = frozenset({"gemma3"})
# llama 3's rope factors (the config has them), Phi-3's LongRoPE factors (likewise)
_SKIPPED = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                      "rope_factors_short.weight"})  # fmt: skip
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


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


def hf_name(gguf_name: str, path: str | Path = "the GGUF file", arch: str = "llama") -> str | None:
    """transformers' name for a GGUF tensor name of architecture ``arch``; None for one the
    model does not load, `ModelFileError` for one it does not have."""
    if gguf_name in _SKIPPED:
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy -> torch of a memmap
        for t in gguf.tensors:
            name = hf_name(t.name, gguf.path, arch)
            if name is None:
                continue
            shape, qtype = t.shape, t.type
            if qtype in HALF_TYPES and len(shape) == 2 and not name.endswith("norm.weight"):
                blocks = torch.from_numpy(gguf.array(t)).view(shape[0], -1)
                tensor = GGUFTensor(blocks, qtype, (shape[0], shape[1]), mapped=True)
            elif qtype in FLOAT_TYPES:
                tensor: torch.Tensor | GGUFTensor = _float_tensor(gguf.array(t), qtype, shape)
                if arch in NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
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
            yield name, tensor


def weight_types(path: str | Path) -> dict[str, int]:
    """How many of the file's weight tensors each GGUF type holds, e.g. ``{"Q4_K": 97}``."""
    counts: dict[str, int] = {}
    for t in GGUFFile(path).tensors:
        if len(t.shape) == 2:
            name = t.type.name
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
