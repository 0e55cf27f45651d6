"""gpt-oss' own checkpoints: experts in MXFP4 blocks (``quantization_config.quant_method``
"mxfp4"), served from those blocks as its GGUFs are.

The checkpoint keeps each layer's experts stacked: ``mlp.experts.gate_up_proj_blocks``
``[E, 2I, H/32, 16]`` (two e2m1 values a byte, element 2k in byte k's low nibble),
``..._scales`` ``[E, 2I, H/32]`` (one e8m0 byte per 32 values), gate and up interleaved
row by row, likewise ``down_proj_*`` ``[E, H, I/32, ...]``, and float biases
``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj_bias`` ``[E, H]``. ggml's MXFP4 block is the
scale byte then 16 bytes holding elements j and j + 16 (llama.cpp's converter,
`transform_nibble_layout`, makes the same bytes): so each expert's gate, up and down
become `GGUFTensor`s of type MXFP4 under the per-expert names a GGUF's experts load as,
and the biases that expert's rows; everything after (the plan serving blocks natively,
dequantizing exactly for float32) is the GGUF path's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from engine.errors import ModelFileError
from engine.gguf_weights import GGUFTensor, QType

BLOCK = 32  # values per scale
_STACKS = ("gate_up_proj", "down_proj")


def is_mxfp4(config: Any) -> bool:
    """Whether a model's config says its experts are MXFP4 blocks."""
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    return method == "mxfp4"


def _stack_of(name: str) -> tuple[str, str, str] | None:
    """``(layer prefix, stack, part)`` of ``model.layers.N.mlp.experts.<stack>_<part>``
    (part blocks, scales or bias), else None."""
    head, sep, tail = name.partition(".mlp.experts.")
    for stack in _STACKS if sep else ():
        for part in ("blocks", "scales", "bias"):
            if tail == f"{stack}_{part}":
                return head + ".mlp.experts.", stack, part
    return None


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[rows, G, 16]`` checkpoint bytes and ``[rows, G]`` scales -> ``[rows, G * 17]``
    ggml MXFP4 blocks."""
    lo, hi = blocks & 0x0F, blocks >> 4
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [rows, G, 32], element order
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(1).contiguous()


def _experts(prefix: str, stack: str, blocks: torch.Tensor, scales: torch.Tensor, where: str):
    """Each expert's MXFP4 weights: gate and up (the even and odd rows), or down."""
    if (blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2
            or tuple(scales.shape) != tuple(blocks.shape[:3])):  # fmt: skip
        raise ModelFileError(f"{where}: {stack}_blocks {list(blocks.shape)} and _scales "
                             f"{list(scales.shape)} are not [E, rows, G, 16] and [E, rows, G]")  # fmt: skip
    cols = blocks.shape[2] * BLOCK
    rows = ((("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
            if stack == "gate_up_proj" else (("down_proj", slice(None)),))  # fmt: skip
    for e in range(blocks.shape[0]):
        for proj, sel in rows:
            b = ggml_blocks(blocks[e, sel], scales[e, sel])
            yield f"{prefix}{e}.{proj}.weight", GGUFTensor(b, QType.MXFP4, (b.shape[0], cols))


def _biases(prefix: str, stack: str, bias: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e, row in enumerate(bias):
        if stack == "gate_up_proj":
            yield f"{prefix}{e}.gate_proj.bias", row[0::2]
            yield f"{prefix}{e}.up_proj.bias", row[1::2]
        else:
            yield f"{prefix}{e}.down_proj.bias", row


def expert_weights(
    weights: Iterator[tuple[str, torch.Tensor]], where: str
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with its stacked MXFP4 experts as each expert's (see the
    module doc); blocks wait for their scales, whichever comes first."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stack = _stack_of(name)
        if stack is None:
            yield name, tensor
            continue
        prefix, kind, part = stack
        if part == "bias":
            yield from _biases(prefix, kind, tensor)
            continue
        pair = pending.setdefault((prefix, kind), {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[(prefix, kind)]
            yield from _experts(prefix, kind, pair["blocks"], pair["scales"], where)
    if pending:
        (prefix, kind), pair = next(iter(pending.items()))
        missing = ({"blocks", "scales"} - set(pair)).pop()
        raise ModelFileError(f"{where}: {prefix}{kind}_{missing} is missing")


def expert_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`weight_shapes` of such a checkpoint, its stacked tensors as each expert's."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        stack = _stack_of(name)
        if stack is None:
            out[name] = shape
            continue
        prefix, kind, part = stack
        if part == "scales" or len(shape) < 2:
            continue
        projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        rows = shape[1] // len(projs)
        for e in range(shape[0]):
            for proj in projs:
                key = f"{prefix}{e}.{proj}."
                if part == "bias":
                    out[key + "bias"] = (rows,)
                elif len(shape) == 4:
                    out[key + "weight"] = (rows, shape[2] * BLOCK)
    return out
