"""Random-weight stand-ins of larger Llama-shaped models, as GGUF files llama.cpp made.

    .venv/bin/python -m bench.standin 1b --out /tmp/standins \\
        --llama-cpp /tmp/llama/llama.cpp --quantize /tmp/llama-build/bin/llama-quantize \\
        --types Q4_0,Q4_K_M,Q8_0

No model larger than SmolLM2-135M can be downloaded here, and a forward pass's speed does
not depend on the weights' values: this writes a Hugging Face directory of the named shape
with random bf16 weights and the default model's tokenizer, converts it with llama.cpp's
own ``convert_hf_to_gguf.py`` (to bf16) and quantizes that with ``llama-quantize``, so both
servers load the same file. Every result measured on one is a **random-weight stand-in**
and is labelled so; its text is gibberish (benches use ``ignore_eos``). The converter
imports ``sentencepiece`` before it looks for the tokenizer it would read:
``.venv/bin/pip install sentencepiece`` first (it is not a pagedserve dependency). 1B: a
minute or two on 2 cores; 8B: writes 16 GB of bf16 shards and a 16 GB bf16 GGUF first
(``--out`` on a disk with 40 GB free).

Without ``--quantize`` (no llama-quantize built) the converter writes each of ``--types``
itself, straight from the Hugging Face directory; it knows only Q8_0, BF16, F16 and F32:

    .venv/bin/python -m bench.standin 1b --out /tmp/standins \\
        --llama-cpp /tmp/llama/llama.cpp --types Q8_0

The shapes (vocabulary: the tokenizer's 49152, not the original's):

* ``360m``: SmolLM2-360M's; ``1b``: TinyLlama-1.1B's; ``3b``: Llama-3.2-3B's;
  ``8b``: Llama-3-8B's (32 layers of 4096, 14336 MLP, 8 KV heads).
* The families of 2026 (`FAMILY_SHAPES`), built by transformers' own model class from its
  config (its random initialisation, bf16): ``qwen3-0.6b``, ``qwen3-1.7b`` (q/k norms,
  head_dim 128), ``gemma3-1b`` (26 layers, one full layer in six, the others over a
  512-token window; one KV head of 256), ``qwen3.5-0.8b`` and ``qwen3.5-2b`` (24 layers,
  three Gated DeltaNet layers of 16 heads of 128 to one gated full-attention layer).
* Mixtures of experts (`MOE_SHAPES`, written a layer at a time): ``qwen3-moe-7b-a1b``
  (Qwen3-30B-A3B's layer with 64 experts over 24 layers: 7.7B parameters, 1.3B a token).
* gpt-oss in its own shape (`GPT_OSS_SHAPES`): ``gpt-oss-20b`` (24 layers of 2880, 32
  experts of 2880 in MXFP4, top-4, 64 query / 8 KV heads of 64, vocabulary 201088), written
  straight to GGUF (`write_gpt_oss_gguf`: its bf16 checkpoint would be 42 GB) after a tiny
  template the converter made; ``--types`` does not apply (MXFP4 experts, Q8_0 beside them,
  as ggml-org's file), about 12 GB:

    .venv/bin/python -m bench.standin gpt-oss-20b --out /tmp/standins \\
        --llama-cpp /tmp/llama/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

SHAPES = {
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)  # (transformers 5 keeps the template apart)
# name: (transformers' model_type, its config's shape); every other field is the config
# class's default (Gemma 3's rope bases, its five-to-one sliding layout, ...).
FAMILY_SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True)),
    "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912,
                                      num_hidden_layers=26, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=256, sliding_window=512,
                                      query_pre_attn_scalar=256, tie_word_embeddings=True)),
    # Qwen3.5 (linear-attention hybrids: three Gated DeltaNet layers to one full) in the
    # shapes of its 0.8B and 2B text models.
    "qwen3.5-0.8b": ("qwen3_5_text", dict(hidden_size=1024, intermediate_size=3584,
                                          num_hidden_layers=24, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=256,
                                          linear_num_key_heads=16, linear_num_value_heads=16,
                                          tie_word_embeddings=True)),
    "qwen3.5-2b": ("qwen3_5_text", dict(hidden_size=2048, intermediate_size=6144,
                                        num_hidden_layers=24, num_attention_heads=8,
                                        num_key_value_heads=2, head_dim=256,
                                        linear_num_key_heads=16, linear_num_value_heads=16,
                                        tie_word_embeddings=True)),
}  # fmt: skip
# Mixtures of experts, written one layer at a time (`write_moe_dir`: a 7B model in bf16 is
# 16 GB, more than transformers' initialisation and save can hold beside it here): a
# Qwen3-MoE of about 7.7B parameters reading about 1.3B a token (Qwen3-30B-A3B's layer,
# its experts' width and top-8, with 64 experts over 24 layers).
MOE_SHAPES = {
    "qwen3-moe-7b-a1b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144,
                                           num_hidden_layers=24, num_attention_heads=16,
                                           num_key_value_heads=4, head_dim=128,
                                           num_experts=64, num_experts_per_tok=8,
                                           moe_intermediate_size=768, norm_topk_prob=True,
                                           tie_word_embeddings=False)),
}  # fmt: skip
# The converter's extra arguments per model_type (Qwen3.5's multi-token prediction layers
# are not in a model transformers initialises).
CONVERTER_ARGS = {"qwen3_5_text": ["--no-mtp"]}


def write_family_dir(name: str, out: Path, seed: int, tokenizer_dir: Path) -> Path:
    """A `FAMILY_SHAPES` model's directory: transformers' class of its model_type, randomly
    initialised from its config in bf16, with the default model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = FAMILY_SHAPES[name]
    config = AutoConfig.for_model(model_type, vocab_size=49152, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=2, **shape)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out / file)
    return out


def write_hf_dir(size: str, out: Path, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """A LlamaForCausalLM directory of shape ``size``: random bf16 weights (normal, std
    0.02; norms 1), the tokenizer of ``tokenizer_dir`` (default: the default model's),
    one safetensors shard per layer; or a `FAMILY_SHAPES` model's (`write_family_dir`)."""
    from transformers import LlamaConfig

    from engine.loader import resolve_model_dir

    tokenizer_dir = tokenizer_dir or resolve_model_dir(None)
    if size in FAMILY_SHAPES:
        return write_family_dir(size, out, seed, tokenizer_dir)
    if size in MOE_SHAPES:
        return write_moe_dir(size, out, seed, tokenizer_dir)
    vocab = 49152
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, rope_theta=10000.0,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                         **SHAPES[size])  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    g = torch.Generator().manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    top = {"model.embed_tokens.weight": rand(vocab, h),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}  # fmt: skip
    if not config.tie_word_embeddings:
        top["lm_head.weight"] = rand(vocab, h)
    weight_map = _save(top, out / "model-top.safetensors")
    for i in range(config.num_hidden_layers):  # one layer in memory at a time (8B: 16 GB)
        p = f"model.layers.{i}."
        layer = {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }  # fmt: skip
        weight_map.update(_save(layer, out / f"model-layer{i:03d}.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def write_moe_dir(name: str, out: Path, seed: int, tokenizer_dir: Path) -> Path:
    """A `MOE_SHAPES` model's directory, one layer in memory at a time: random bf16 weights
    (normal, std 0.02; norms 1), every expert under its checkpoint name, the default
    model's tokenizer."""
    from transformers import AutoConfig

    model_type, shape = MOE_SHAPES[name]
    config = AutoConfig.for_model(model_type, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=2, architectures=["Qwen3MoeForCausalLM"],
                                  dtype="bfloat16", **shape)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out / file)
    g = torch.Generator().manual_seed(seed)
    h, d, inter = config.hidden_size, config.head_dim, config.moe_intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=g) * 0.02).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    top = {"model.embed_tokens.weight": rand(49152, h), "model.norm.weight": ones(h),
           "lm_head.weight": rand(49152, h)}  # fmt: skip
    weight_map = _save(top, out / "model-top.safetensors")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                 p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                 p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
                 p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                 p + "mlp.gate.weight": rand(config.num_experts, h)}  # fmt: skip
        for e in range(config.num_experts):
            x = f"{p}mlp.experts.{e}."
            layer |= {x + "gate_proj.weight": rand(inter, h), x + "up_proj.weight": rand(inter, h),
                      x + "down_proj.weight": rand(h, inter)}  # fmt: skip
        weight_map.update(_save(layer, out / f"model-layer{i:03d}.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def _save(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, str]:
    save_file(tensors, str(file))
    return dict.fromkeys(tensors, file.name)


# gpt-oss in its own shape, its experts in MXFP4 as the released checkpoints hold them (issue
# 66). Its bf16 checkpoint would be 42 GB, so the GGUF is written directly (`write_gpt_oss_gguf`),
# mirroring a file llama.cpp's converter made of a tiny MXFP4 gpt-oss (`gpt_oss_template`):
# the same keys and values (the sizes scaled), tensor names, order and types (`--outtype q8_0`:
# Q8_0 attention, embeddings and head, F32 norms, biases, sinks and router, as ggml-org's
# gpt-oss-20b GGUF holds them). The tokenizer is the template's: the default model's 49152
# tokens padded by the converter to the real vocabulary's 201088 (`[PAD49152]`...), not
# gpt-oss' o200k_harmony (no download here), so the embedding and head are full size.
GPT_OSS_SHAPES = {
    # openai/gpt-oss-20b's config.json (transformers' GptOssConfig defaults are the 120b's)
    "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        vocab_size=201088, max_position_embeddings=131072),
}  # fmt: skip
# The template's shape: every size distinct where the converter could confuse two (q's width
# is not the hidden size, the experts' width not either), so the mirrored shapes are checked.
GPT_OSS_TEMPLATE_SHAPE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                              num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                              vocab_size=201088, max_position_embeddings=131072)  # fmt: skip
MXFP4_CHECKPOINT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip


def write_gpt_oss_template_dir(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny GptOssForCausalLM directory as gpt-oss' checkpoints are: random bf16 tensors,
    the experts' projections as MXFP4 ``*_blocks`` / ``*_scales`` (random bytes: only the
    layout matters to the converter) and `quantization_config` saying so."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                  **GPT_OSS_TEMPLATE_SHAPE)  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    (file,) = out.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # [experts, in, out]: rows are out
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16),
                                                  generator=g, dtype=torch.uint8)  # fmt: skip
        tensors[name + "_scales"] = torch.full((experts, rows, cols // 32), 120, dtype=torch.uint8)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config.quantization_config = MXFP4_CHECKPOINT
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def gpt_oss_template(out: Path, llama_cpp: Path, tokenizer_dir: Path | None = None) -> Path:
    """llama.cpp's converter's GGUF of the tiny MXFP4 gpt-oss (`write_gpt_oss_template_dir`),
    ``--outtype q8_0``: the file `write_gpt_oss_gguf` mirrors at full size."""
    from engine.loader import resolve_model_dir

    hf = write_gpt_oss_template_dir(
        out / "gpt-oss-template-hf", tokenizer_dir or resolve_model_dir(None)
    )
    target = out / "gpt-oss-template.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                    "--outtype", "q8_0", "--outfile", str(target)], check=True)  # fmt: skip
    shutil.rmtree(hf)
    return target


def gpt_oss_keys(shape: dict) -> dict[str, int]:
    """The keys whose values are the model's sizes, as GptOssModel.set_gguf_parameters writes
    them (the rest of the template's keys hold at any size)."""
    a = "gpt-oss."
    return {a + "block_count": shape["num_hidden_layers"],
            a + "context_length": shape["max_position_embeddings"],
            a + "embedding_length": shape["hidden_size"],
            a + "feed_forward_length": shape["intermediate_size"],
            a + "expert_feed_forward_length": shape["intermediate_size"],
            a + "attention.head_count": shape["num_attention_heads"],
            a + "attention.head_count_kv": shape["num_key_value_heads"],
            a + "attention.key_length": shape["head_dim"],
            a + "attention.value_length": shape["head_dim"],
            a + "attention.sliding_window": shape["sliding_window"],
            a + "expert_count": shape["num_local_experts"],
            a + "expert_used_count": shape["num_experts_per_tok"]}  # fmt: skip


def gpt_oss_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in ggml's order (columns first) for layer 0 (``blk.0.``) and the
    ones outside the layers: the converter's names for gpt-oss."""
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    e, vocab = shape["num_local_experts"], shape["vocab_size"]
    layer = {"attn_norm.weight": (h,), "post_attention_norm.weight": (h,),
             "attn_q.weight": (h, q), "attn_q.bias": (q,), "attn_k.weight": (h, kv),
             "attn_k.bias": (kv,), "attn_v.weight": (h, kv), "attn_v.bias": (kv,),
             "attn_output.weight": (q, h), "attn_output.bias": (h,),
             "attn_sinks.weight": (shape["num_attention_heads"],),
             "ffn_gate_inp.weight": (h, e), "ffn_gate_inp.bias": (e,),
             "ffn_gate_exps.weight": (h, inter, e), "ffn_up_exps.weight": (h, inter, e),
             "ffn_down_exps.weight": (inter, h, e), "ffn_gate_exps.bias": (inter, e),
             "ffn_up_exps.bias": (inter, e), "ffn_down_exps.bias": (h, e)}  # fmt: skip
    return {"token_embd.weight": (h, vocab), "output.weight": (h, vocab),
            "output_norm.weight": (h,)} | {f"blk.0.{k}": v for k, v in layer.items()}  # fmt: skip


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def gpt_oss_tensor_plan(template: Path, shape: dict) -> list[tuple[str, object, tuple[int, ...]]]:
    """(name, GGML type, ggml shape) of every tensor of the full-size file, in the template's
    order: each run of per-layer tensors there (the converter writes every layer's experts
    first, then the rest) repeated over the full model's layers. Checks the template first:
    `gpt_oss_shapes` of its own size must give its tensors' shapes."""
    from gguf import GGUFReader

    tiny = {
        t.name: (t.tensor_type, tuple(int(n) for n in t.shape))
        for t in GGUFReader(template).tensors
    }
    rule = gpt_oss_shapes(GPT_OSS_TEMPLATE_SHAPE)
    for name, (_, dims) in tiny.items():
        key = name if _layer_of(name) is None else "blk.0." + name.split(".", 2)[2]
        if rule.get(key) != dims:
            raise ValueError(f"template {name}: {dims}, the rule says {rule.get(key)}")
    full, plan, run = gpt_oss_shapes(shape), [], []

    def flush() -> None:  # a run of blk.0's names, for every layer of the full model
        for i in range(shape["num_hidden_layers"]):
            plan.extend((f"blk.{i}.{n}", tiny[f"blk.0.{n}"][0], full[f"blk.0.{n}"]) for n in run)
        run.clear()

    for name in tiny:
        if _layer_of(name) is None:
            flush()
            plan.append((name, tiny[name][0], full[name]))
        elif _layer_of(name) == 0:
            run.append(name.split(".", 2)[2])
    flush()
    return plan


def _random_tensor(name: str, qtype, dims: tuple[int, ...], rng) -> np.ndarray:
    """Random values of a sane size: Q8_0 and MXFP4 blocks of weights of about std 0.02
    (int8 uniform times 2.7e-4; e2m1 levels times 2^-8..2^-6), F32 norms 1, other F32
    (biases, router, sinks) normal of std 0.02."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    count = int(np.prod(dims))
    if qtype == T.F32:
        if name.endswith("norm.weight"):
            return np.ones(count, dtype=np.float32)
        return (rng.standard_normal(count, dtype=np.float32) * 0.02).astype(np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.frombuffer(rng.bytes(count // block * size), dtype=np.uint8).reshape(-1, size).copy()
    if qtype == T.Q8_0:  # a float16 scale, then 32 int8
        data[:, :2] = np.frombuffer(np.float16(0.02 / 73.9).tobytes(), dtype=np.uint8)
    elif qtype == T.MXFP4:  # an e8m0 scale byte (2^(e-127)), then 32 e2m1 nibbles
        data[:, 0] = rng.integers(119, 122, len(data), dtype=np.uint8)
    else:
        raise ValueError(f"{name}: no random values for {qtype.name}")
    return data


def _size_label(plan: list, experts: int) -> str:
    """gguf's label as the converter computes it (experts x one expert's, e.g. 32x...)."""
    import gguf

    total = sum(int(np.prod(dims)) for _, _, dims in plan)
    expert = sum(int(np.prod(dims)) for n, _, dims in plan if "_exps." in n)
    return gguf.size_label(total, total - expert, expert // experts, experts)


def write_gpt_oss_gguf(template: Path, out: Path, shape: dict, name: str, seed: int = 0) -> Path:
    """The template's keys (the sizes `gpt_oss_keys` names set to ``shape``'s; the template's
    own must equal `gpt_oss_keys` of its size) and tensors (`gpt_oss_tensor_plan`) at
    ``shape``, random values (`_random_tensor`), written a tensor at a time: memory stays at
    the largest tensor (the embedding's 0.6 GB at gpt-oss-20b's size)."""
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(template)
    arch = reader.fields["general.architecture"].contents()
    sizes = gpt_oss_keys(shape)
    for key, value in gpt_oss_keys(GPT_OSS_TEMPLATE_SHAPE).items():
        if reader.fields[key].contents() != value:
            raise ValueError(f"template {key}: {reader.fields[key].contents()}, expected {value}")
    w = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = sizes.get(key, field.contents())
        if key == "general.name":
            value = f"{name} random-weight stand-in"
        elif key == "general.size_label":
            value = _size_label(gpt_oss_tensor_plan(template, shape), shape["num_local_experts"])
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub)
    plan = gpt_oss_tensor_plan(template, shape)
    for tensor_name, qtype, dims in plan:
        block, size = GGML_QUANT_SIZES[qtype]
        w.add_tensor_info(tensor_name, dims[::-1], np.dtype(np.float32),
                          int(np.prod(dims)) // block * size, raw_dtype=qtype)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, qtype, dims in plan:
        w.write_tensor_data(_random_tensor(tensor_name, qtype, dims, rng))
    w.close()
    return out


def make_gpt_oss_gguf(name: str, out: Path, llama_cpp: Path, tokenizer_dir: Path | None) -> Path:
    """``out/<name>-standin.MXFP4_MOE.gguf``: the converter's tiny template, then the full file."""
    out.mkdir(parents=True, exist_ok=True)
    template = gpt_oss_template(out, llama_cpp, tokenizer_dir)
    target = write_gpt_oss_gguf(template, out / f"{name}-standin.MXFP4_MOE.gguf",
                                GPT_OSS_SHAPES[name], name)  # fmt: skip
    template.unlink()
    return target


# The types convert_hf_to_gguf.py writes itself (its --outtype), no llama-quantize needed.
CONVERTER_TYPES = ("Q8_0", "BF16", "F16", "F32")


def make_ggufs(
    size: str, out: Path, llama_cpp: Path, quantize: Path | None, types: list[str]
) -> list[Path]:
    """``out/<size>-standin.<TYPE>.gguf`` for each type: HF dir -> bf16 GGUF -> quantized;
    without ``quantize``, HF dir -> each type by the converter itself (CONVERTER_TYPES)."""
    hf = write_hf_dir(size, out / f"{size}-standin-hf")
    extra = CONVERTER_ARGS.get(FAMILY_SHAPES[size][0], []) if size in FAMILY_SHAPES else []
    if quantize is None:
        files = []
        for qtype in types:
            target = out / f"{size}-standin.{qtype}.gguf"
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                            "--outtype", qtype.lower(), "--outfile", str(target), *extra],
                           check=True)  # fmt: skip
            files.append(target)
        shutil.rmtree(hf)
        return files
    bf16 = out / f"{size}-standin.BF16.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                    "--outtype", "bf16", "--outfile", str(bf16), *extra], check=True)  # fmt: skip
    shutil.rmtree(hf)  # the bf16 GGUF holds the same weights
    files = []
    for qtype in types:
        target = out / f"{size}-standin.{qtype}.gguf"
        subprocess.run([str(quantize), str(bf16), str(target), qtype], check=True)
        files.append(target)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "size",
        choices=sorted(SHAPES)
        + sorted(FAMILY_SHAPES)
        + sorted(MOE_SHAPES)
        + sorted(GPT_OSS_SHAPES),
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--hf-only",
        action="store_true",
        help="write only the Hugging Face directory (bf16 safetensors) to --out: a GPU "
        "host's stand-in (bench/gpu_run.sh), no llama.cpp needed",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a folder with the tokenizer files (default: the default model's)",
    )
    parser.add_argument(
        "--llama-cpp", type=Path, help="llama.cpp's source folder (has convert_hf_to_gguf.py)"
    )
    parser.add_argument(
        "--quantize",
        type=Path,
        help="the llama-quantize binary (without it the converter writes --types itself: "
        + ", ".join(CONVERTER_TYPES)
        + " only)",
    )
    parser.add_argument("--types", help="default: Q4_0,Q4_K_M,Q8_0 (without --quantize: Q8_0)")
    parser.add_argument("--keep-bf16", action="store_true")
    args = parser.parse_args(argv)
    if args.hf_only:
        hf = write_hf_dir(args.size, args.out, tokenizer_dir=args.tokenizer)
        print(f"{hf}: a random-weight stand-in of the {args.size} shape (Hugging Face, bf16)")
        return 0
    if args.llama_cpp is None:
        parser.error("--llama-cpp is needed for the GGUF files (or --hf-only)")
    if args.size in GPT_OSS_SHAPES:  # written directly, MXFP4 experts (no --types)
        f = make_gpt_oss_gguf(args.size, args.out, args.llama_cpp, args.tokenizer)
        print(f"{f} ({f.stat().st_size / 1e9:.2f} GB): a random-weight stand-in")
        return 0
    types = (args.types or ("Q4_0,Q4_K_M,Q8_0" if args.quantize else "Q8_0")).split(",")
    if args.quantize is None and set(types) - set(CONVERTER_TYPES):
        parser.error(f"without --quantize, --types must be among {', '.join(CONVERTER_TYPES)}")
    files = make_ggufs(args.size, args.out, args.llama_cpp, args.quantize, types)
    if args.quantize is not None and not args.keep_bf16:
        (args.out / f"{args.size}-standin.BF16.gguf").unlink()
    for f in files:
        print(f"{f} ({f.stat().st_size / 1e9:.2f} GB): a random-weight stand-in")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
