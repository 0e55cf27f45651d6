"""gpt-oss in its own shape as a random-weight stand-in GGUF (`python -m bench.standin
gpt-oss-20b`; bench/standin.py's other stand-ins go through transformers and the converter).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from bench.standin_tokenizer import copy_tokenizer

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
    copy_tokenizer(tokenizer_dir, out)
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
