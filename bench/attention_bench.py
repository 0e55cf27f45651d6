"""Paged-attention options, matmul throughput and a model step on SmolLM2 shapes.

    .venv/bin/python -m bench.attention_bench                 # attention options, fp32 + bf16
    .venv/bin/python -m bench.attention_bench --flex          # + compiled flex_attention (slow to compile)
    .venv/bin/python -m bench.attention_bench --matmul --model --no-attention

Shapes: 9 query heads, 3 KV heads, head_dim 64, block_size 16, physical blocks
shuffled. ``shared-decode64`` is the product's shared-prefix load: 64 decodes in 4
groups of 16 whose block tables start with the same 31 physical blocks (a
500-token prefix; its last partial block is private), each with 16..144 tokens of
its own. Every number is a median over interleaved repeats (the backends of one
case take turns, so machine noise hits them alike); "x" columns are ratios to
the default backend measured in the same run. Attention times are per layer call
with the step's metadata built and each backend prepared (the per-step costs of
both are printed apart).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.attention_steps import (
    BLOCK_SIZE,
    DTYPES,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    SCALE,
    SCENARIOS,
    build_step,
    scenario,
)
from bench.attention_variants import (
    _with_decode_kernel,
    cascade_explicit_merge,
    decode_matmul,
    decode_matmul_reused,
    decode_sdpa_enable_gqa,
    make_flex_backend,
    sdpa_backend,
    sdpa_per_request,
)
from engine.attention import (
    DEFAULT_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    allocate_kv_cache,
    get_attention_backend,
    reference_paged_attention,
    write_kv,
)
from engine.attention.cpu_paged import CpuPagedBackend
from engine.kernels import cpu_kernels

# --------------------------------------------------------------------------- timing


CLOCK = time.perf_counter


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn; the fns take turns so drift in machine load hits all alike."""
    for fn in fns.values():  # warm-up (and compile, for flex)
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = random.Random(len(names))
    for _ in range(repeats):
        # A fresh order every round: a call inherits its predecessor's cache footprint
        # (a rotation keeps the predecessor fixed, which biased the first column by 20-40%).
        order.shuffle(names)
        for name in names:
            start = CLOCK()
            fns[name]()
            times[name].append(CLOCK() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_attention(args) -> None:
    backends: dict[str, Callable] = {
        DEFAULT_BACKEND: get_attention_backend(DEFAULT_BACKEND, NUM_HEADS, NUM_KV_HEADS),
        "sdpa-nocascade": get_attention_backend("sdpa-nocascade", NUM_HEADS, NUM_KV_HEADS),
        "cascade-explicit-merge": cascade_explicit_merge(),
        "sdpa-group1": sdpa_backend(1),
        "sdpa-group8": sdpa_backend(8),
        "sdpa-group16": sdpa_backend(16),
        "sdpa-group-all": sdpa_backend(1 << 30),
        "sdpa-per-request": sdpa_per_request,
        "sdpa-enable_gqa-all": _with_decode_kernel(decode_sdpa_enable_gqa),
        "matmul-all": _with_decode_kernel(decode_matmul),
        "matmul-reused": _with_decode_kernel(decode_matmul_reused, group_size=4),
        "reference": reference_paged_attention,
    }
    if args.flex:
        backends["flex (compiled)"] = make_flex_backend()
    if cpu_kernels() is not None:  # bf16 only: fp32 rows show "-"
        backends["cpu-paged"] = CpuPagedBackend(NUM_HEADS, NUM_KV_HEADS)
    names = list(backends)
    default = backends[names[0]]
    print(f"\n## paged attention, ms per layer call (median of {args.repeats}); x = / default")
    header = "| dtype | case | metadata build ms | prepare ms | " + " | ".join(names) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for case in args.scenarios:
            q_lens, s_lens, share = scenario(case)
            step = build_step(q_lens, s_lens, dtype, share=share)
            q, k_cache, v_cache, meta, tables = step
            for backend in backends.values():
                if isinstance(backend, AttentionBackend):
                    backend.prepare(meta)  # once per step, as the model runner does
            fns = {
                n: (lambda fn=fn, s=step: fn(s[0], s[1], s[2], s[3], SCALE))
                for n, fn in backends.items()
            }
            if dtype != torch.bfloat16:
                fns.pop("cpu-paged", None)
            if "decode" in case or case == "mixed":
                fns.pop("reference")  # seconds per call at these batch sizes; see prefill rows
            medians = interleaved_medians(fns, args.repeats)
            build = interleaved_medians(
                {
                    "b": lambda a=(q_lens, s_lens, step[4]): AttentionMetadata.build(
                        *a, BLOCK_SIZE, "cpu"
                    )
                },
                args.repeats,
            )["b"]
            plan = interleaved_medians({"p": lambda m=meta: default.prepare(m)}, args.repeats)["p"]
            base = medians[names[0]]
            cells = []
            for n in names:
                if n in medians:
                    cells.append(f"{medians[n] * 1e3:.3f} ({medians[n] / base:.2f}x)")
                else:
                    cells.append("-")
            row = f"| {dtype_name} | {case} | {build * 1e3:.3f} | {plan * 1e3:.3f} | "
            print(row + " | ".join(cells) + " |")


def bench_write_kv(args) -> None:
    print("\n## write_kv, ms per layer call")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for case in ("decode64", "prefill500"):
            q_lens, s_lens, _ = scenario(case)
            _, k_cache, v_cache, meta, _ = build_step(q_lens, s_lens, dtype)
            k = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
            args_ = (k_cache, v_cache, k, torch.randn_like(k), meta.slot_mapping)
            med = interleaved_medians({"w": lambda a=args_: write_kv(*a)}, args.repeats)["w"]
            print(f"{dtype_name} {case}: {med * 1e3:.3f} ms")


# --------------------------------------------------------------------------- matmuls and model


SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def bench_matmul(args) -> None:
    """Projection throughput for SmolLM2's shapes: F.linear fp32 vs bf16, and the
    model's layout (weight stored ``[in, out]``, ``x @ w``) in fp32."""
    h, inter, vocab = SMOLLM2["hidden_size"], SMOLLM2["intermediate_size"], SMOLLM2["vocab_size"]
    shapes = {
        "qkv": (15 * HEAD_DIM, h),
        "o": (h, h),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (vocab, h),
    }
    variants = ("fp32", "bf16", "fp32 [in,out]")
    print("\n## Projections, median ms (GFLOP/s; weight GB/s); x = time / F.linear fp32 time")
    print("| proj | tokens | F.linear fp32 | F.linear bf16 | x | x @ w[in,out] fp32 | x |")
    print("|---|---|---|---|---|---|---|")
    for proj, (out_f, in_f) in shapes.items():
        for tokens in (1, 8, 32, 64, 512):
            w32, x32 = torch.randn(out_f, in_f), torch.randn(tokens, in_f)
            w16, x16 = w32.bfloat16(), x32.bfloat16()
            wt = w32.t().contiguous()
            fns = {
                "fp32": lambda x=x32, w=w32: F.linear(x, w),
                "bf16": lambda x=x16, w=w16: F.linear(x, w),
                "fp32 [in,out]": lambda x=x32, w=wt: x @ w,
            }
            med = interleaved_medians(fns, args.repeats)
            cells = []
            for name, w in zip(variants, (w32, w16, wt), strict=True):
                gflops = 2 * tokens * out_f * in_f / med[name] / 1e9
                gbs = w.numel() * w.element_size() / med[name] / 1e9
                cells.append(f"{med[name] * 1e3:.3f} ({gflops:.0f}; {gbs:.1f})")
            ratio = [med[name] / med["fp32"] for name in variants[1:]]
            print(
                f"| {proj} | {tokens} | {cells[0]} | {cells[1]} | {ratio[0]:.2f} "
                f"| {cells[2]} | {ratio[1]:.2f} |"
            )


MODEL_CASES = [case for case in SCENARIOS if case != "mixed"]


def bench_model(args) -> None:
    """One forward step of a random-weight SmolLM2-shaped model through our LlamaForCausalLM.

    Cases with shared prefixes also run with the cascade off (``sdpa-nocascade``).
    """
    from transformers import LlamaConfig

    from engine.config import EngineConfig
    from engine.execution_plan import ModelShape, manual_plan, resolve_attention
    from engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2)
    print("\n## SmolLM2-shaped model step (30 layers), median ms; x = bf16 / fp32")
    print("| case | fp32 | bf16 | x | fp32 no cascade | bf16 no cascade |")
    print("|---|---|---|---|---|---|")
    models = {}
    for name in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, manual_plan(DTYPES[name], "cpu"))
        for p in model.parameters():
            p.normal_(0, 0.02)
        models[name] = model
    backends = {"": "auto", " nc": "sdpa-nocascade"}
    for case in args.model_cases:
        q_lens, s_lens, share = scenario(case)
        fns = {}
        for name, model in models.items():
            _, _, _, meta, tables = build_step(q_lens, s_lens, model.dtype, share=share)
            kv = allocate_kv_cache(
                model.num_layers, max(max(t) for t in tables) + 1, BLOCK_SIZE,
                NUM_KV_HEADS, HEAD_DIM, model.dtype, "cpu",
            )  # fmt: skip
            ids = torch.randint(0, SMOLLM2["vocab_size"], (meta.num_tokens,))
            last = torch.tensor(meta.query_start_loc_list[1:]) - 1
            for suffix, backend_name in backends.items():
                if suffix and not any(g is not None for g in share):
                    continue  # no shared prefix: the same path as the default
                if backend_name == "auto":  # what the execution plan picks for this dtype
                    shape = ModelShape(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, silu=True)
                    cpu = torch.device("cpu")
                    backend_name = resolve_attention(EngineConfig(), cpu, model.dtype, None, shape)
                backend = get_attention_backend(backend_name, NUM_HEADS, NUM_KV_HEADS)

                def step(model=model, meta=meta, kv=kv, ids=ids, last=last, backend=backend):
                    model.attn_backend = model.ops.attn = backend  # torch's ops write the KV
                    for layer in model.layers:  # the backend each layer calls
                        layer.self_attn.backend = backend
                    backend.prepare(meta)  # per-step work included, as in serving
                    hidden = model(ids, meta.positions, kv, meta)
                    return model.compute_logits(hidden[last])

                fns[name + suffix] = step
        with torch.inference_mode():
            med = interleaved_medians(fns, max(3, args.repeats // 4))
        cells = [f"{med[n] * 1e3:.1f}" if n in med else "-" for n in ("fp32 nc", "bf16 nc")]
        print(
            f"| {case} | {med['fp32'] * 1e3:.1f} | {med['bf16'] * 1e3:.1f} | "
            f"{med['bf16'] / med['fp32']:.2f} | " + " | ".join(cells) + " |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu = process CPU time: steadier on a shared machine, meaningful with --threads 1",
    )
    parser.add_argument("--flex", action="store_true", help="also compiled flex_attention")
    parser.add_argument("--no-attention", action="store_true")
    parser.add_argument("--matmul", action="store_true", help="fp32 vs bf16 F.linear throughput")
    parser.add_argument("--model", action="store_true", help="SmolLM2-shaped model step times")
    parser.add_argument("--model-cases", nargs="+", default=MODEL_CASES, choices=MODEL_CASES)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, clock {args.clock}, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    with torch.inference_mode():
        if not args.no_attention:
            bench_attention(args)
            bench_write_kv(args)
        if args.matmul:
            bench_matmul(args)
    if args.model:
        bench_model(args)


if __name__ == "__main__":
    main()
