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

import torch
from safetensors.torch import save_file

from bench.standin_gpt_oss import GPT_OSS_SHAPES, make_gpt_oss_gguf
from bench.standin_tokenizer import copy_tokenizer

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
    copy_tokenizer(tokenizer_dir, out)
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
    copy_tokenizer(tokenizer_dir, out)
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
    copy_tokenizer(tokenizer_dir, out)
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
