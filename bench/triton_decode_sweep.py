"""The Triton paged decode attention under other launch settings than the backend's own:
split-K parts, warps and keys per tile, for a decode-only step.

    python3 -m bench.triton_decode_sweep --batch 1,64 --context 2000 [--out F.json]

One layer's `TritonBackend` call (the kernel, and the merge where split), in the 1B
stand-in's head layout by default (32 query heads, 4 KV heads, head_dim 64, bf16, block
size 16, shuffled block tables: bench/gpu_step.py's attention figure), timed as that
figure is (`time_ms`: replayed from a CUDA graph, median); GB/s counts the K and V rows
it must read. The first
line per batch is the backend's own choice (`decode_splits`, `attention_constexprs`); each
other line changes some of it. A setting that spills or fails to compile is reported, not
fatal. CUDA only: the figures are what a GPU's memory system makes of the settings.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.gpu_step import BLOCK_SIZE, copy_bandwidth_gbps, decode_inputs, gpu_line, time_ms
from bench.machine import machine_line


def settings(default_splits: int) -> list[dict]:
    """The backend's own first (empty overrides), then the grid."""
    grid = itertools.product(sorted({1, 2, 4, 8, 16, default_splits}), (4, 8), (32, 64))
    return [{}] + [{"splits": s, "num_warps": w, "BLOCK_N": n} for s, w, n in grid]


def sweep(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype, device: torch.device, hbm: float) -> list[dict]:  # fmt: skip
    from engine.attention import triton_paged as tp

    q, k_cache, v_cache, meta = decode_inputs(batch, context, heads, kv_heads, head_dim,
                                              dtype, device)  # fmt: skip
    backend = tp.TritonBackend(heads, kv_heads)
    backend.prepare(meta)
    own = backend._plan
    kv_bytes = batch * context * kv_heads * head_dim * k_cache.element_size() * 2
    scale = head_dim**-0.5
    rows = []
    for change in settings(own.num_splits):
        splits = change.get("splits", own.num_splits)
        plan = tp._Plan(own.tiles, batch * splits, 1, splits)
        consts = tp.attention_constexprs(plan, heads // kv_heads, head_dim, BLOCK_SIZE, dtype)
        consts |= {k: v for k, v in change.items() if k != "splits"}
        backend._plan, backend._consts = plan, consts
        row = {"batch": batch, "context": context, "splits": splits,
               **{k: consts[k] for k in ("num_warps", "BLOCK_N")},
               "own": not change}  # fmt: skip
        try:
            ms = time_ms(lambda: backend(q, k_cache, v_cache, meta, scale), device)
        except Exception as exc:  # a setting that does not compile (registers, shared memory)
            rows.append(row | {"error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            print(f"batch {batch} {row}: {rows[-1]['error']}", flush=True)
            continue
        gbps = kv_bytes / (ms / 1e3) / 1e9
        rows.append(row | {"ms": ms, "gbps": gbps, "fraction_of_hbm": gbps / hbm})
        print(f"batch {batch} splits {splits:2d} warps {consts['num_warps']} "
              f"BLOCK_N {consts['BLOCK_N']:3d}"
              f"{' (own)' if not change else ''}: {ms * 1e3:7.1f} us, {gbps:6.0f} GB/s, "
              f"{gbps / hbm:.0%}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--heads", default="32,4,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="a JSON file for every row")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    hbm = copy_bandwidth_gbps(device)
    print(machine_line(), gpu_line(device), f"HBM copy {hbm:.4g} GB/s", sep="\n", flush=True)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        rows += sweep(batch, args.context, heads, kv_heads, head_dim, dtype, device, hbm)
    best = {}
    for row in rows:
        if "ms" in row and (row["batch"] not in best or row["ms"] < best[row["batch"]]["ms"]):
            best[row["batch"]] = row
    for batch, row in best.items():
        own = next(r for r in rows if r["batch"] == batch and r["own"])
        print(f"batch {batch}: best {row}, {own.get('ms', float('nan')) / row['ms']:.2f}x "
              "the backend's own")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"hbm_gbps": hbm, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
