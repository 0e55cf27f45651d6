"""GGUF blocks and files for the tests: random blocks of any ggml type (finite scales), and
a few-layer copy of the default model whose projections mix every format the kernels
multiply, plus one they do not (Q2_K: served dequantized)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf import GGMLQuantizationType as T

from engine.gguf_weights import GGUFFile
from engine.loader import default_gguf_path

# Byte offsets of a block's f16 scales (the rest of a block is quants and 6-bit scales,
# any byte of which is valid): d, and dmin for the types that have one.
_F16_SCALES = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
               T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # fmt: skip


def random_blocks(
    qtype: T, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05
) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random quants and 6-bit scales, f16 scales drawn in
    ``[-scale, scale]`` (random bytes there could be inf or NaN)."""
    values, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for offset in _F16_SCALES[qtype]:
        d = rng.uniform(-scale, scale, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


# Layer -> projection -> type. SmolLM2's hidden size (576) is not a multiple of 256, so the
# K-quants (and Q2_K) can only hold the down projections (1536 columns), as in llama.cpp's
# own Q4_K_M files of it.
MIXED_LAYERS = (
    {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1,
     "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_K},
    {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q5_1, "ffn_down": T.Q6_K},
    {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_1, "attn_output": T.Q4_1,
     "ffn_gate": T.Q5_0, "ffn_up": T.Q4_0, "ffn_down": T.Q5_K},
    {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_1, "attn_output": T.Q4_1,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q2_K},
)  # fmt: skip
# The (tied) embedding re-quantized to Q4_0: a head of 49,152 rows, which its kernel regroups.
MIXED_EMBEDDING = T.Q4_0


def write_requantized_gguf(path: Path, qtype: T) -> Path:
    """The default model with every quantized weight (projections, tied embedding)
    re-quantized to ``qtype`` from its own dequantized values: a whole real-weight model
    in a format the default file does not hold (the gguf package quantizes the legacy
    types only)."""
    return _write_gguf(path, None, lambda name: qtype)


def write_mixed_gguf(path: Path, seed: int = 0, layers: int = len(MIXED_LAYERS)) -> Path:
    """The default model's metadata, embedding (in `MIXED_EMBEDDING`) and first ``layers``
    layers, each projection in its `MIXED_LAYERS` type: the legacy types re-quantized from
    the real weights, the K-quants random blocks (the gguf package cannot quantize them).
    ``layers=3``: every type the kernels multiply, none served dequantized."""

    def mixed_type(name: str) -> T | None:
        if name == "token_embd.weight":
            return MIXED_EMBEDDING
        layer, _, rest = name.removeprefix("blk.").partition(".")
        return MIXED_LAYERS[int(layer)].get(rest.removesuffix(".weight")) \
            if name.startswith("blk.") else None  # fmt: skip

    return _write_gguf(path, layers, mixed_type, np.random.default_rng(seed))


def _write_gguf(
    path: Path,
    layers: int | None,
    type_of: Callable[[str], T | None],
    rng: np.random.Generator | None = None,
) -> Path:
    """The default model's metadata and tensors (its first ``layers`` layers; None: all),
    each quantized tensor in ``type_of(name)`` (None: as it is)."""
    source = default_gguf_path()
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == f"{arch}.block_count" and layers is not None:
            value = layers
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    table = GGUFFile(source)
    for info in table.tensors:
        layer, _, _ = info.name.removeprefix("blk.").partition(".")
        if info.name.startswith("blk.") and layers is not None and int(layer) >= layers:
            continue
        data = np.array(table.array(info))
        qtype = type_of(info.name) if info.type not in (T.F32, T.F16) else None
        if qtype is not None and qtype != info.type:
            rows, cols = info.shape
            if qtype in (T.Q2_K, T.Q4_K, T.Q5_K, T.Q6_K):
                data = random_blocks(qtype, rows, cols, rng, scale=2e-5)
            else:
                dense = quants.dequantize(data.reshape(rows, -1), info.type)
                data = quants.quantize(dense, qtype)
        else:
            qtype = info.type
        if qtype in (T.F32,):
            writer.add_tensor(info.name, data.view(np.float32).reshape(info.shape))
        else:
            writer.add_tensor(info.name, data.reshape(info.shape[0], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
