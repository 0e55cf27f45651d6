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

import engine.attention.sdpa as sdpa
from engine.attention import (
    DEFAULT_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    SdpaBackend,
    allocate_kv_cache,
    get_attention_backend,
    reference_paged_attention,
    write_kv,
)
from engine.attention.cpu_paged import CpuPagedBackend
from engine.kernels import cpu_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- scenarios


SHARED_GROUPS, SHARED_PREFIX = 4, 500


def scenario(name: str) -> tuple[list[int], list[int], list[int | None]]:
    """(query_lens, seq_lens, shared prefix group of each request or None) of a named step."""
    rng = random.Random(name)
    if name == "shared-decode64":  # 4 prefixes x 16 decodes, each with 16..144 own tokens
        seq_lens = [SHARED_PREFIX + rng.randint(16, 144) for _ in range(64)]
        return [1] * 64, seq_lens, [r % SHARED_GROUPS for r in range(64)]
    if name.startswith("decode"):
        batch = int(name.removeprefix("decode"))
        return [1] * batch, [rng.randint(560, 640) for _ in range(batch)], [None] * batch
    if name == "prefill500":
        return [500], [500], [None]
    if name == "prefill500+cached500":
        return [500], [1000], [None]
    if name == "mixed":  # 32 decodes riding along with a 256-token prefill chunk on a prefix
        seq_lens = [rng.randint(560, 640) for _ in range(32)] + [768]
        return [1] * 32 + [256], seq_lens, [None] * 33
    raise ValueError(name)


SCENARIOS = [
    "decode1",
    "decode8",
    "decode32",
    "decode64",
    "shared-decode64",
    "prefill500",
    "prefill500+cached500",
    "mixed",
]


def build_step(query_lens, seq_lens, dtype, seed=0, share=None):
    """q, caches filled with random K/V, and the metadata, over shuffled physical blocks.

    Requests with the same ``share`` group start with the same physical blocks: the
    full blocks of a SHARED_PREFIX-token prefix, as prefix caching hands them out.
    """
    rng = random.Random(seed)
    share = share or [None] * len(seq_lens)
    shared_blocks = SHARED_PREFIX // BLOCK_SIZE
    needed = [
        (s + BLOCK_SIZE - 1) // BLOCK_SIZE - (shared_blocks if g is not None else 0)
        for s, g in zip(seq_lens, share, strict=True)
    ]
    groups = sorted({g for g in share if g is not None})
    num_blocks = sum(needed) + shared_blocks * len(groups) + 16
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    prefix = {}
    for g in groups:
        prefix[g], physical = physical[:shared_blocks], physical[shared_blocks:]
    tables = []
    for n, g in zip(needed, share, strict=True):
        tables.append((prefix[g] if g is not None else []) + physical[:n])
        physical = physical[n:]
    ((k_cache, v_cache),) = allocate_kv_cache(
        1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu"
    )
    k_cache.normal_()
    v_cache.normal_()
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    return q, k_cache, v_cache, meta, tables


# --------------------------------------------------------------------------- alternative backends


def sdpa_per_request(q, k_cache, v_cache, meta, scale):
    """The obvious loop: one SDPA call per request, enable_gqa, fresh gathers."""
    out = torch.empty(q.shape, dtype=q.dtype)
    starts = meta.query_start_loc_list
    for r, q_len in enumerate(meta.query_lens):
        seq_len = meta.seq_lens_list[r]
        n = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        table = meta.block_tables[r, :n]
        keys = k_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        values = v_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        qh = q[starts[r] : starts[r + 1]].transpose(0, 1)[None]
        mask = None
        if q_len > 1:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1)
    return out


def sdpa_backend(decode_group: int | None = None, cascade: bool = True) -> SdpaBackend:
    return SdpaBackend(NUM_HEADS, NUM_KV_HEADS, decode_group, cascade)


class SdpaWithKernel(SdpaBackend):
    """The SDPA backend with one of its kernels (a function of engine.attention.sdpa) swapped."""

    def __init__(self, kernel: str, fn: Callable, **options) -> None:
        super().__init__(NUM_HEADS, NUM_KV_HEADS, **options)
        self.kernel, self.fn = kernel, fn

    def __call__(self, q, k_cache, v_cache, meta, scale):
        original = getattr(sdpa, self.kernel)
        setattr(sdpa, self.kernel, self.fn)
        try:
            return super().__call__(q, k_cache, v_cache, meta, scale)
        finally:
            setattr(sdpa, self.kernel, original)


def _with_decode_kernel(decode_fn, group_size: int = 1 << 30) -> SdpaWithKernel:
    """The default backend with its per-group decode kernel swapped for ``decode_fn``."""
    return SdpaWithKernel("_sdpa_decode_group", decode_fn, decode_group=group_size, cascade=False)


def cascade_explicit_merge():
    """The default backend with the cascade's suffix pass done by explicit matmuls.

    Each member's own blocks are attended with matmul + float32 softmax, keeping the
    log-sum-exp, and merged with the prefix result by the formula, instead of the
    default's single SDPA call that merges through pseudo keys.
    """

    def suffix(q, k_cache, v_cache, group, scale, prefix_out, prefix_lse):
        size, num_heads, head_dim = q.shape
        per_kv = num_heads // NUM_KV_HEADS
        keys, values = sdpa._gather_blocks(k_cache, v_cache, group.flat_block_table, size)
        keys, values = sdpa._as_float32(keys, values)
        own = slice(0, group.padded_len)
        qg = q.reshape(size, NUM_KV_HEADS, per_kv, head_dim).float() * scale
        scores = torch.empty(NUM_KV_HEADS, size, per_kv, group.padded_len)
        for j in range(NUM_KV_HEADS):
            torch.bmm(qg[:, j], keys[:, own, j].transpose(1, 2), out=scores[j])
        scores += group.mask[:, 0, :, own].unsqueeze(0)  # 0 / -inf for padding
        row_max = scores.amax(-1, keepdim=True)
        weights = scores.sub_(row_max).exp_()
        row_sum = weights.sum(-1, keepdim=True)
        out = torch.empty(NUM_KV_HEADS, size, per_kv, head_dim)
        for j in range(NUM_KV_HEADS):
            torch.bmm(weights[j], values[:, own, j], out=out[j])
        lse = (row_max + row_sum.log()).squeeze(-1).permute(1, 0, 2).reshape(size, num_heads)
        out = (out / row_sum).permute(1, 0, 2, 3).reshape(size, num_heads, head_dim)
        top = torch.maximum(lse, prefix_lse)
        w_own, w_prefix = (lse - top).exp()[..., None], (prefix_lse - top).exp()[..., None]
        merged = (out * w_own + prefix_out * w_prefix) / (w_own + w_prefix)
        return merged.to(q.dtype)

    return SdpaWithKernel("_sdpa_cascade_suffix", suffix)


def _gather_padded(cache, group, size):
    blocks = cache.index_select(0, group.flat_block_table)  # a fresh tensor per call
    return blocks.view(size, group.padded_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)


def decode_sdpa_enable_gqa(q, k_cache, v_cache, group, scale):
    """Decodes as [G, h, 1, d] queries with SDPA's own GQA broadcasting (fresh gathers)."""
    n = q.shape[0]
    out = F.scaled_dot_product_attention(
        q[:, :, None], _gather_padded(k_cache, group, n), _gather_padded(v_cache, group, n),
        attn_mask=group.mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[:, :, 0]


def decode_matmul(q, k_cache, v_cache, group, scale):
    """Decodes with explicit matmul / float32 softmax (fresh gathers)."""
    n = q.shape[0]
    keys, values = _gather_padded(k_cache, group, n), _gather_padded(v_cache, group, n)
    qg = q.reshape(n, NUM_KV_HEADS, -1, HEAD_DIM)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    if group.mask is not None:
        scores = scores.masked_fill(~group.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(n, NUM_HEADS, HEAD_DIM)


def decode_matmul_reused(q, k_cache, v_cache, group, scale):
    """Explicit matmul / float32 softmax over K/V gathered into the reused workspace."""
    n = q.shape[0]
    keys, values = sdpa._gather_blocks(k_cache, v_cache, group.flat_block_table, n)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [G, kvh, S, d], strided
    qg = q.reshape(n, NUM_KV_HEADS, -1, HEAD_DIM)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    if group.mask is not None:
        scores = scores.masked_fill(~group.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(n, NUM_HEADS, HEAD_DIM)


def make_flex_backend():
    """flex_attention compiled by inductor: padded batched decode + per-request prefill."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def decode(q, k_cache, v_cache, group, scale):
        d = q.shape[0]
        seq_lens = (
            group.mask.view(d, -1).sum(-1)
            if group.mask is not None
            else torch.full((d,), group.padded_len)
        )

        def key_valid(b, h, q_idx, kv_idx):
            return kv_idx < seq_lens[b]

        block_mask = create_block_mask(key_valid, d, None, 1, group.padded_len, device="cpu")
        out = flex(
            q[:, :, None], _gather_padded(k_cache, group, d), _gather_padded(v_cache, group, d),
            block_mask=block_mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return out[:, :, 0]

    class FlexBackend(SdpaWithKernel):
        """All decodes in one flex call (the swapped kernel), then the prefills redone by flex."""

        def __call__(self, q, k_cache, v_cache, meta, scale):
            out = super().__call__(q, k_cache, v_cache, meta, scale)
            return flex_prefills(out, q, k_cache, v_cache, meta, scale)

    def flex_prefills(out, q, k_cache, v_cache, meta, scale):
        starts = meta.query_start_loc_list
        for r, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            seq_len = meta.seq_lens_list[r]
            n = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
            table = meta.block_tables[r, :n]
            keys = k_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
            values = v_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
            offset = seq_len - q_len

            def causal(b, h, q_idx, kv_idx, offset=offset):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(causal, 1, None, q_len, seq_len, device="cpu")
            qh = q[starts[r] : starts[r + 1]].transpose(0, 1)[None]
            o = flex(qh, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
            out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1)
        return out

    return FlexBackend("_sdpa_decode_group", decode, decode_group=1 << 30, cascade=False)


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


MODEL_CASES = [
    "decode1",
    "decode8",
    "decode32",
    "decode64",
    "shared-decode64",
    "prefill500",
    "prefill500+cached500",
]


def bench_model(args) -> None:
    """One forward step of a random-weight SmolLM2-shaped model through our LlamaForCausalLM.

    Cases with shared prefixes also run with the cascade off (``sdpa-nocascade``).
    """
    from transformers import LlamaConfig

    from engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2)
    print("\n## SmolLM2-shaped model step (30 layers), median ms; x = bf16 / fp32")
    print("| case | fp32 | bf16 | x | fp32 no cascade | bf16 no cascade |")
    print("|---|---|---|---|---|---|")
    models = {}
    for name in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, dtype=DTYPES[name])
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
                backend = get_attention_backend(backend_name, NUM_HEADS, NUM_KV_HEADS)

                def step(model=model, meta=meta, kv=kv, ids=ids, last=last, backend=backend):
                    model.attn_backend = backend
                    for layer in model.layers:  # the backend each layer calls
                        layer.attn = backend
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
