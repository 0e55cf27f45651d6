"""GGUF blocks and files for the tests: random blocks of any ggml type (finite scales), and
a few-layer copy of the default model whose projections mix every format the kernels
multiply, plus one they do not (`UNSERVED`: served dequantized)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter, quants
from gguf import GGMLQuantizationType as T

from engine.gguf_file import ArrayInfo, _Cursor, _value
from engine.gguf_weights import GGUFFile
from engine.loader import default_gguf_path

# Byte offsets of a block's f16 scales (the rest of a block is quants and 6-bit scales,
# any byte of which is valid): d, and dmin for the types that have one.
_F16_SCALES = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
               T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ1_S: (0,), T.F16: (0,), T.IQ2_XXS: (0,),
               T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,)}  # fmt: skip
# A type no kernel multiplies (served dequantized to the dtype): the mixed file's one such
# projection. (IQ1_S: any bytes after its f16 d are valid, as for the types above.)
UNSERVED = T.IQ1_S
# The types `_write_gguf` writes as random blocks (the gguf package quantizes the legacy ones).
_RANDOM_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS,
                 T.IQ2_S, T.IQ3_XXS, T.IQ3_S, UNSERVED)  # fmt: skip


def text_logits_of(llm, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of ``ids``, fed as one text (`text_logits`)."""
    from engine.perplexity import text_logits

    return torch.cat([logits for logits, _ in text_logits(llm.engine, ids)]).float()


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got.float() - reference).norm() / reference.norm()).item()


def random_blocks(
    qtype: T, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05
) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random quants and 6-bit scales, f16 scales drawn in
    ``[-scale, scale]`` (random bytes there could be inf or NaN), MXFP4's power-of-two scale
    bytes near ``scale`` / 12."""
    if qtype == T.BF16:  # the top halves of float32 values in [-scale, scale]
        dense = rng.uniform(-scale, scale, size=(rows, cols)).astype(np.float32)
        return (dense.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    values, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    if qtype == T.MXFP4:  # byte 0, a power of two 2^(e - 128), times levels up to 12
        top = 128 + int(np.floor(np.log2(scale / 12)))
        blocks[..., 0] = rng.integers(top - 3, top + 1, size=blocks.shape[:2], dtype=np.uint8)
    for offset in _F16_SCALES.get(qtype, ()):
        d = rng.uniform(-scale, scale, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


# Layer -> projection -> type. SmolLM2's hidden size (576) is not a multiple of 256, so the
# K-quants (and `UNSERVED`) can only hold the down projections (1536 columns), as in llama.cpp's
# own Q4_K_M files of it.
MIXED_LAYERS = (
    {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1,
     "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_K},
    {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q5_1, "ffn_down": T.Q6_K},
    {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_1, "attn_output": T.Q4_1,
     "ffn_gate": T.Q5_0, "ffn_up": T.Q4_0, "ffn_down": T.Q5_K},
    {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_1, "attn_output": T.Q4_1,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": UNSERVED},
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
    ``layers=3``: none served dequantized."""
    return write_layers_gguf(path, MIXED_LAYERS[:layers], seed)


def write_layers_gguf(
    path: Path, layers: tuple[dict[str, T], ...], seed: int = 0, embedding: T = MIXED_EMBEDDING
) -> Path:
    """The default model's metadata, embedding (in ``embedding``) and first ``len(layers)``
    layers, projection p of layer i in type ``layers[i][p]`` (as it is where not named): the
    legacy types re-quantized from the real weights, the others random blocks."""

    def layer_type(name: str) -> T | None:
        if name == "token_embd.weight":
            return embedding
        layer, _, rest = name.removeprefix("blk.").partition(".")
        return layers[int(layer)].get(rest.removesuffix(".weight")) \
            if name.startswith("blk.") else None  # fmt: skip

    return _write_gguf(path, len(layers), layer_type, np.random.default_rng(seed))


@lru_cache(maxsize=2)
def _metadata(path: Path) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """A GGUF file's metadata as GGUFWriter takes it: key -> (value, type, array element type).
    Read with the engine's own parser (gguf's GGUFReader took 15-30 s over SmolLM2's 49,152
    tokens and merges, on every file the tests write), each key's type by a walk of the same
    bytes."""
    table = GGUFFile(path)
    cursor = _Cursor(memoryview(table.data), table.path)
    cursor.pos = 4
    _, _, kvs = cursor.unpack("<IQQ", "the header")
    fields = {}
    for _ in range(kvs):
        key = cursor.string("a key")
        (vtype,) = cursor.unpack("<I", "a type")
        value = _value(cursor, vtype, key)
        if isinstance(value, ArrayInfo):
            items = table.read_array(key)
            items = items if isinstance(items, list) else items.tolist()
            fields[key] = (items, GGUFValueType.ARRAY, GGUFValueType(value.type))
        else:
            fields[key] = (value, GGUFValueType(vtype), None)
    return fields


def _write_gguf(
    path: Path,
    layers: int | None,
    type_of: Callable[[str], T | None],
    rng: np.random.Generator | None = None,
) -> Path:
    """The default model's metadata and tensors (its first ``layers`` layers; None: all),
    each quantized tensor in ``type_of(name)`` (None: as it is)."""
    source = default_gguf_path()
    fields = _metadata(source)
    arch = str(fields["general.architecture"][0])
    writer = GGUFWriter(str(path), arch)
    for name, (value, vtype, sub) in fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count" and layers is not None:
            value = layers
        writer.add_key_value(name, value, vtype, sub_type=sub)
    table = GGUFFile(source)
    for info in table.tensors:
        layer, _, _ = info.name.removeprefix("blk.").partition(".")
        if info.name.startswith("blk.") and layers is not None and int(layer) >= layers:
            continue
        data = np.array(table.array(info))
        qtype = type_of(info.name) if info.type not in (T.F32, T.F16) else None
        if qtype is not None and qtype != info.type:
            rows, cols = info.shape
            if qtype in _RANDOM_TYPES:
                data = random_blocks(qtype, rows, cols, rng, scale=2e-5)
            else:
                data = _requantized(info.name, qtype)
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


@lru_cache(maxsize=32)
def _requantized(name: str, qtype: T) -> np.ndarray:
    """The default model's tensor ``name`` re-quantized to ``qtype`` by the gguf package
    (seconds for the embedding; the files the tests write share them)."""
    table = GGUFFile(default_gguf_path())
    info = next(i for i in table.tensors if i.name == name)
    dense = quants.dequantize(np.array(table.array(info)).reshape(info.shape[0], -1), info.type)
    return quants.quantize(dense, qtype)


# -- tiny random models of each family, written as llama.cpp's converter writes them ---------

# transformers' model_type -> llama.cpp's architecture
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
              "smollm3": "smollm3", "phi3": "phi3", "qwen3_5_text": "qwen35",
              "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}  # fmt: skip
_PERMUTED = ("llama", "smollm3")  # convert_hf_to_gguf's LlamaModel and its subclasses
# Gemma3Model.norm_shift; Qwen3NextModel.modify_tensors (all norms but linear_attn's)
_PLUS_ONE_NORMS = ("gemma3", "qwen35")
# What convert_hf_to_gguf keeps in F32 in a quantized file (beside every 1-D tensor)
_KEPT_F32 = ("linear_attn.conv1d.weight",)


def bpe_vocab(pre: str = "smollm") -> dict:
    """The default model's byte-level BPE vocabulary (SmolLM2's, 49,152 tokens) as a GGUF
    holds it, under pre-tokenizer name ``pre``."""
    table = GGUFFile(default_gguf_path())
    return {"model": "gpt2", "pre": pre, "tokens": table.read_array("tokenizer.ggml.tokens"),
            "merges": table.read_array("tokenizer.ggml.merges"),
            "types": [int(t) for t in table.read_array("tokenizer.ggml.token_type")],
            "bos": 1, "eos": 2, "unk": 0, "pad": 2, "add_bos": False}  # fmt: skip


def spm_vocab(size: int = 600) -> dict:
    """A small SentencePiece-style vocabulary (control tokens, the 256 byte tokens, pieces
    with U+2581 for a space, scores falling with the rank), learned from the quality text
    with the `tokenizers` trainer: Gemma's and Phi-3's kind of vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = (Path(__file__).resolve().parents[1] / "data" / "quality_text.txt").read_text()
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    learner.train_from_iterator(text.splitlines(), trainer)
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["  ", "   "]
    pieces = [t for t, _ in learned if t not in tokens]
    tokens += pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1, 1] + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces) + 2)]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types,
            "bos": 2, "eos": 1, "unk": 3, "pad": 0, "add_bos": True}  # fmt: skip


def write_family_gguf(
    path: Path,
    model,
    vocab: dict,
    template: str | None = None,
    qtype: T | None = None,
    mtp: bool = False,
    expert_qtype: T | None = None,
) -> Path:
    """``model`` (a tiny transformers CausalLM) as an F32 GGUF with ``vocab``'s tokenizer,
    the keys and tensors as llama.cpp's convert_hf_to_gguf writes them for its family:
    names from gguf-py's own tensor map, q/k rows permuted for llama and SmolLM3, Gemma's
    and Qwen3.5's norms stored plus one, Phi-3's LongRoPE factors as tensors, Qwen3.5's
    linear attention as `_qwen35_tensor` says. ``qtype``: its 2-D weights in that type
    (the gguf package quantizes the legacy types), as ``--outtype`` has them. ``mtp``
    (Qwen3.5): a multi-token-prediction block after the layers, as the converter writes a
    checkpoint's `mtp.*` without --no-mtp (random values: transformers' model has none).
    ``expert_qtype``: a mixture's expert tensors in that type instead (MXFP4 experts beside
    Q8_0 weights: llama-quantize's MXFP4_MOE)."""
    import gguf

    config = model.config
    arch = GGUF_ARCHS[config.model_type]
    w = GGUFWriter(str(path), arch)
    # llama.cpp writes Mistral as llama; transformers' reader knows it by this name
    w.add_name("mistral" if config.model_type == "mistral" else f"tiny-{arch}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers + mtp)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch != "phi3" and getattr(config, "head_dim", None):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "smollm3"):  # LlamaModel: the rotary width, the vocabulary's size
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            w.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
                w.add_tensor(f"rope_factors_{kind}.weight", factors)
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if arch == "qwen35":
        _qwen35_keys(w, config, head_dim, mtp)
    if arch == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gpt-oss":  # TextModel's and GptOssModel's set_gguf_parameters
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.intermediate_size)
        w.add_sliding_window(config.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    _write_vocab(w, vocab, template, arch)
    arch_id = gguf.MODEL_ARCH[arch.upper().replace("-", "_")]
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "qwen35":
            tensor, name = _qwen35_tensor(tensor.detach().float(), name, config)
        if name.endswith("self_attn.sinks"):  # GptOssModel.filter_tensors: + ".weight"
            w.add_tensor(f"blk.{name.split('.')[2]}.attn_sinks.weight", tensor.float().numpy())
            continue
        moe_tensors = {"qwen3moe": _qwen3moe_tensors, "gpt-oss": _gpt_oss_tensors}.get(arch)
        if ".mlp." in name and moe_tensors:  # the router, each projection stacked
            for gguf_name, data in moe_tensors(tensor.detach().float().numpy(), name):
                experts = expert_qtype or qtype
                quantize = experts is not None and data.ndim == 3
                w.add_tensor(gguf_name, quants.quantize(data, experts) if quantize else data,
                             raw_dtype=experts if quantize else None)  # fmt: skip
            continue
        data = tensor.detach().float().numpy().copy()
        stem, _, kind = name.rpartition(".")
        if arch in _PERMUTED and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if "q_proj" in stem else config.num_key_value_heads
            data = _permute(data, heads)
        if (arch in _PLUS_ONE_NORMS and name.endswith("norm.weight")
                and not name.endswith("linear_attn.norm.weight")):  # fmt: skip
            data = data + 1
        # A_log has no .weight: its name is the whole of it (blk.N.ssm_a)
        gguf_name = f"{names.get_name(stem)}.{kind}" if kind in ("weight", "bias") \
            else names.get_name(name)  # fmt: skip
        if qtype is not None and data.ndim == 2 and not name.endswith(_KEPT_F32):
            w.add_tensor(gguf_name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data)
    if mtp:
        _qwen35_mtp_block(w, model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _qwen3moe_tensors(data: np.ndarray, name: str) -> list[tuple[str, np.ndarray]]:
    """Qwen2MoeModel.modify_tensors: the router as `ffn_gate_inp`, every expert's gate, up
    and down stacked into one [experts, rows, columns] tensor each (transformers holds gate
    and up of all experts as one `gate_up_proj` [experts, 2 * columns, hidden])."""
    block = name.split(".")[2]
    if name.endswith("mlp.gate.weight"):
        return [(f"blk.{block}.ffn_gate_inp.weight", data.copy())]
    if name.endswith("experts.gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        return [(f"blk.{block}.ffn_gate_exps.weight", gate.copy()),
                (f"blk.{block}.ffn_up_exps.weight", up.copy())]  # fmt: skip
    assert name.endswith("experts.down_proj"), name
    return [(f"blk.{block}.ffn_down_exps.weight", data.copy())]


def _gpt_oss_tensors(data: np.ndarray, name: str) -> list[tuple[str, np.ndarray]]:
    """GptOssModel.modify_tensors on float weights: the router (and its bias) as
    `ffn_gate_inp`; each stacked projection transposed to [experts, rows, columns], gate and
    up (interleaved by column in transformers' `gate_up_proj`) apart, biases likewise."""
    block = name.split(".")[2]
    exps = f"blk.{block}.ffn_{{}}_exps.{{}}"
    if ".mlp.router." in name:
        return [(f"blk.{block}.ffn_gate_inp.{name.rpartition('.')[2]}", data.copy())]
    if name.endswith("gate_up_proj_bias"):
        return [(exps.format("gate", "bias"), data[..., ::2].copy()),
                (exps.format("up", "bias"), data[..., 1::2].copy())]  # fmt: skip
    if name.endswith("gate_up_proj"):
        data = data.swapaxes(-1, -2)
        return [(exps.format("gate", "weight"), data[:, ::2].copy()),
                (exps.format("up", "weight"), data[:, 1::2].copy())]  # fmt: skip
    if name.endswith("down_proj_bias"):
        return [(exps.format("down", "bias"), data.copy())]
    assert name.endswith("experts.down_proj"), name
    return [(exps.format("down", "weight"), data.swapaxes(-1, -2).copy())]


def _qwen35_keys(w: GGUFWriter, config, head_dim: int, mtp: bool) -> None:
    """Qwen3NextModel.set_gguf_parameters and _Qwen35MRopeMixin's: the linear attention's
    sizes under llama.cpp's SSM keys, which layers are linear (an MTP block: not), the
    rotary width and the M-RoPE sections (the default when the config has none)."""
    rope = config.rope_parameters
    value_heads = config.linear_num_value_heads
    w.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0])
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(config.linear_num_key_heads)
    w.add_ssm_time_step_rank(value_heads)
    w.add_ssm_inner_size(config.linear_value_head_dim * value_heads)
    w.add_array(f"{w.arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in config.layer_types] + [False] * mtp)  # fmt: skip
    w.add_full_attention_interval(4)  # the config's full_attention_interval, 4 by default
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if mtp:
        w.add_nextn_predict_layers(1)


def _qwen35_mtp_block(w: GGUFWriter, model) -> None:
    """_QwenMtpMixin's block `blk.{layers}`: a full-attention layer's tensors (random, shaped
    as the last full-attention layer's) and its nextn.* projection and norms."""
    import gguf

    config = model.config
    block, hidden = config.num_hidden_layers, config.hidden_size
    full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, block + 1)
    shapes = {"nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
              "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,)}  # fmt: skip
    for name, tensor in model.state_dict().items():
        if name.startswith(f"model.layers.{full}."):
            stem, _, kind = name.replace(f".{full}.", f".{block}.", 1).rpartition(".")
            shapes[f"{names.get_name(stem)}.{kind}".removeprefix(f"blk.{block}.")] = tensor.shape
    rng = np.random.default_rng(1)
    for name, shape in shapes.items():
        w.add_tensor(f"blk.{block}.{name}", rng.standard_normal(shape).astype(np.float32))


def _qwen35_tensor(tensor, name: str, config) -> tuple:
    """convert_hf_to_gguf's `_LinearAttentionVReorderBase.modify_tensors` (value heads from
    grouped by key head to tiled over the key heads, where there are more value than key
    heads) then `Qwen3NextModel.modify_tensors` (A stored as -exp(A_log), dt_bias renamed
    dt_proj.bias, conv1d's kernel squeezed to [channels, kernel]) on one tensor; the norms'
    +1 is the caller's. Returns (tensor, its name for the tensor map)."""
    import torch

    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if "linear_attn." in name and key_heads != value_heads:
        qk = 2 * config.linear_key_head_dim * key_heads
        head_v = config.linear_value_head_dim

        def tiled(t, dim: int, head_dim: int):  # _reorder_v_heads
            shape = list(t.shape)
            grouped = t.reshape(*shape[:dim], key_heads, value_heads // key_heads, head_dim,
                                *shape[dim + 1 :])  # fmt: skip
            return grouped.transpose(dim, dim + 1).reshape(shape)

        if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            tensor = torch.cat([tensor[:qk], tiled(tensor[qk:], 0, head_v)])
        elif name.endswith(".in_proj_z.weight"):
            tensor = tiled(tensor, 0, head_v)
        elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            tensor = tiled(tensor, 0, 1)
        elif name.endswith(".out_proj.weight"):
            tensor = tiled(tensor, 1, head_v)
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif name.endswith(".conv1d.weight"):
        tensor = tensor.squeeze()
    return tensor, name


def _llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a "llama3" rope: per frequency, 1 where the
    wavelength is short, the factor where long, interpolated between."""
    import math

    import torch

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves interleaved."""
    shape = weights.shape
    return (weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))  # fmt: skip


def _write_vocab(w: GGUFWriter, vocab: dict, template: str | None, arch: str) -> None:
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_unk_token_id(vocab["unk"])
    w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(vocab["add_bos"])
    if arch == "gemma3":
        w.add_add_space_prefix(False)  # Gemma3Model.set_vocab
    if template is not None:
        w.add_chat_template(template)


# -- the default model with another chat template ------------------------------------------


@lru_cache(maxsize=1)
def _file_bytes(path: Path) -> bytes:
    return path.read_bytes()


def write_with_chat_template(
    path: Path, template: str, source: Path | None = None, weights: bool = True
) -> Path:
    """The default GGUF (or ``source``) with ``template`` as its `tokenizer.chat_template`: the
    key's value spliced into the header's bytes, the data section moved to the next aligned
    offset (tensor offsets count from there), every other byte as it was. ``weights=False``:
    the data section left a hole of zeros, for a test that never reads a weight (the file
    is written in milliseconds rather than ~0.2 s)."""
    source = source or default_gguf_path()
    raw = _file_bytes(source)
    table = GGUFFile(source)
    last = table.tensors[-1]  # the table's last entry ends the header
    name = last.name.encode()
    entry = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    header_end = entry + 4 + 8 * len(last.shape) + 4 + 8
    alignment = table.metadata.get("general.alignment", 32)
    data_start = -(-header_end // alignment) * alignment
    key = b"tokenizer.chat_template"
    value_at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # after its type
    (length,) = struct.unpack_from("<Q", raw, value_at)
    text = template.encode("utf-8")
    header = (raw[:value_at] + struct.pack("<Q", len(text)) + text
              + raw[value_at + 8 + length : header_end])  # fmt: skip
    header += b"\0" * (-len(header) % alignment)
    with open(path, "wb") as f:
        f.write(header)
        if weights:
            f.write(memoryview(raw)[data_start:])
        else:
            f.truncate(len(header) + len(raw) - data_start)
    return path
