"""The Triton backend: paged attention read straight from the block table, for CUDA.

Three kernels, and no gathered copy of any request's K/V:
- `_write_kv_kernel`: the step's new K/V rows into the paged cache at their flat slots
  (`slot_mapping`), one program per token;
- `_paged_attention_kernel`: query tokens against their request's blocks, causal by
  position, with an online softmax over a tile of `BLOCK_N` keys at a time. Each key finds
  its block in the block table on its own, so a tile spans several small KV blocks (or
  part of a large one): the tile is sized for the GPU (64 keys for decodes), the block
  for the cache, any power of two. One program per (tile of up to `BLOCK_M` query tokens
  of one request, KV head): the query heads of that KV head (GQA) share every K/V tile it
  loads. Decodes and prefill chunks over a cached prefix go in one launch (mixed steps
  included);
- split-K for decode-only steps with few requests: each decode's context is cut into
  `num_splits` parts, one program each, which write a partial output and its
  log-sum-exp; `_merge_splits_kernel` combines them. Long contexts then keep the GPU
  busy at batch 1.

A sliding window (the backend's `window`, a compile-time constant of the kernel) starts
each program's keys at its first query's window and masks the band within the tiles: a
long decode reads `window` keys, not its context, and its splits share those. Keys before
the window are never read, nor their block table entries, which a sliding-window group
may leave as placeholders (block 0).

The plan (which tile is whose, where it starts, the splits) is made once per step on the
host in `prepare`; a layer call only launches kernels. A decode-only step's plan is a
few integers and no tensor (`DECODE`: each program's request and split follow from its
id), and what it reads per request (context length, block table, slot) is in the
metadata's tensors: so a decode step is captured in a CUDA graph once per batch size
and replayed over new contents of the same tensors (engine/cuda_graphs.py). A padded
row of such a batch has context length 0 and slot -1: it reads nothing and writes
nothing. Under `TRITON_INTERPRET=1` the
same kernels run on CPU tensors through Triton's interpreter: that is how `make test`
checks them against the reference backend on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import is_quantized
from engine.attention.metadata import AttentionMetadata

BLOCK_M = 16  # query tokens per prefill tile
MIN_ROWS = 16  # tl.dot's smallest M on a GPU: a tile's (token, head) rows are padded to it
TILE_FIELDS = ("req", "start", "len", "pos")  # a prefill tile's fields, one tensor each
SPLIT_KEYS = 256  # a decode's keys per split, at least
MAX_SPLITS = 16
# Decode programs (requests x KV heads) that keep a GPU busy without splits. A constant,
# so the plan stays device-free; a GPU's SM count would be the finer figure. On an H200
# (132 SMs), batch 64 x 2,000-token contexts with 4 KV heads, 64-key tiles, each setting
# timed from a CUDA graph: 256 programs (no split) read K/V at 48% of the HBM copy
# bandwidth, 2-8 splits at 60-64%, 16 at 56% (`python -m bench.triton_decode_sweep`,
# bench/README.md "The GPU run").
ENOUGH_PROGRAMS = 1024


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row_elems,
                     BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # Slot -1 (a CUDA graph batch's padding row) writes nothing.
    mask = offs < tl.where(slot >= 0, row_elems, 0)
    src = token.to(tl.int64) * row_elems + offs
    tl.store(k_cache_ptr + slot * row_elems + offs, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * row_elems + offs, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr,
    tile_req_ptr, tile_start_ptr, tile_len_ptr, tile_pos_ptr,
    scale, num_heads, head_dim,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    DECODE: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # one token per request, request r is token r: nothing to look up
        req = tile // NUM_SPLITS
        seq_len = tl.load(seq_lens_ptr + req)
        q_start = req
        q_len = 1
        pos0 = seq_len - 1
        split = tile % NUM_SPLITS
        out_row0 = tile if NUM_SPLITS > 1 else req
    else:  # a tile of up to TOKENS query tokens of one request, never split
        req = tl.load(tile_req_ptr + tile)
        seq_len = tl.load(seq_lens_ptr + req)
        q_start = tl.load(tile_start_ptr + tile)  # the tile's first token in the flat batch
        q_len = tl.load(tile_len_ptr + tile)  # its tokens (<= TOKENS)
        pos0 = tl.load(tile_pos_ptr + tile)  # the position of its first token
        split = 0
        out_row0 = q_start  # its first row of out

    # Rows: (token t, head g of the KV head's group), padded to ROWS (a power of two).
    rows = tl.arange(0, ROWS)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (t < q_len) & (rows < TOKENS * GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + (q_start + t)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
        + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    q_pos = pos0 + t

    # This program's keys: its split's share of the keys its queries see, never past its
    # last query. A sliding window (WINDOW > 0) starts them at the first query's window:
    # keys before it are never read, nor their block table entries (a windowed group's
    # table may hold placeholders there), and the splits share the window, not the context.
    k_first = tl.maximum(pos0 - WINDOW + 1, 0) if WINDOW > 0 else 0
    k_last = tl.minimum(seq_len, pos0 + q_len)
    per_split = tl.cdiv(tl.cdiv(k_last - k_first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_begin = k_first + split * per_split
    k_end = tl.minimum(k_last, k_begin + per_split)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(k_begin, k_end, BLOCK_N):
        k_pos = start + n
        in_range = k_pos < k_end
        # Each key's block (PAGE keys each) from the request's row of the block table.
        block = tl.load(block_tables_ptr + req * stride_bt + k_pos // PAGE, mask=in_range,
                        other=0).to(tl.int64)  # fmt: skip
        kv_ok = in_range[:, None] & d_ok[None, :]
        offs = (block[:, None] * stride_kb + (k_pos % PAGE)[:, None] * stride_ks
                + kv_head * stride_kh + d[None, :])  # fmt: skip
        # Multiplied in float32: TF32 for a bf16 / fp16 cache, whose values TF32 holds
        # exactly (so only the probabilities round, to 10 bits rather than bf16's 7); IEEE
        # float32 for a float32 model, whose tokens must equal transformers'. (Triton's
        # interpreter also multiplies bf16 operands wrongly; float32 it gets right.)
        k = tl.load(k_cache_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < k_end)[None, :]
        if WINDOW > 0:  # transformers' sliding mask: 0 <= q - k < WINDOW
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no key allowed yet keeps -inf: exp(-inf - -inf) must not be NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = (out_row0 + t).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )  # fmt: skip
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + out_rows * num_heads + head, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, head_dim,
    stride_pt, stride_ph, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    part_rows = req * NUM_SPLITS + s
    lse = tl.load(lse_ptr + part_rows * num_heads + head, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padded row's splits all read nothing
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    parts = tl.load(
        part_ptr + part_rows[:, None] * stride_pt + head * stride_ph + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    token = req.to(tl.int64)  # splits are decode-only steps: request r is token r
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)  # fmt: skip


@dataclass
class _Plan:
    """One step's launch."""

    # req, start, len, pos: [num_tiles] int32 on the step's device. A decode-only step's
    # tiles follow from program ids: any int32 tensor of the step stands in for each.
    tiles: dict[str, torch.Tensor]
    num_tiles: int
    tokens: int  # query tokens per tile (BLOCK_M, or 1 for a decode-only step)
    num_splits: int

    @property
    def decode(self) -> bool:
        return self.tokens == 1


def decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Parts of each context for a decode-only step: a power of 2, more than one only when
    the requests alone would leave the GPU idle and the contexts are long enough."""
    if num_reqs * num_kv_heads >= ENOUGH_PROGRAMS:
        return 1
    wanted = min(-(-max_seq_len // SPLIT_KEYS), MAX_SPLITS)
    return min(1 << max(0, wanted - 1).bit_length(), MAX_SPLITS)


def plan_step(meta: AttentionMetadata, num_kv_heads: int, window: int | None = None) -> _Plan:
    """The step's tiles: decode-only steps one token a tile (split over the keys each reads,
    at most `window`, when the requests alone would leave the GPU idle), other steps up to
    BLOCK_M tokens.

    A decode-only step's plan reads only host integers (the batch size, the longest
    context, the window) and makes no tensor, so it is valid inside a CUDA graph capture."""
    if meta.num_decodes == meta.num_reqs:
        keys = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
        splits = decode_splits(meta.num_reqs, num_kv_heads, keys)
        unread = dict.fromkeys(TILE_FIELDS, meta.seq_lens)  # no tensor made: capturable
        return _Plan(unread, meta.num_reqs * splits, 1, splits)
    starts = meta.query_start_loc_list
    fields: dict[str, list[int]] = {k: [] for k in TILE_FIELDS}
    for r, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list, strict=True)):
        for offset in range(0, q_len, BLOCK_M):
            fields["req"].append(r)
            fields["start"].append(starts[r] + offset)
            fields["len"].append(min(BLOCK_M, q_len - offset))
            fields["pos"].append(seq_len - q_len + offset)
    device = meta.seq_lens.device
    tiles = {
        k: torch.from_numpy(np.asarray(v, dtype=np.int32)).to(device) for k, v in fields.items()
    }
    return _Plan(tiles, len(fields["req"]), BLOCK_M, 1)


def attention_constexprs(
    plan: _Plan, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
    window: int | None = None,
) -> dict[str, object]:  # fmt: skip
    """`_paged_attention_kernel`'s compile-time arguments for a step's plan, and its warps:
    one compiled kernel per distinct value (tests/engine/test_triton_compile.py compiles
    them for GPUs). The window is one of them: a backend's is fixed, and full attention
    compiles without its mask."""
    rows = max(MIN_ROWS, triton.next_power_of_2(plan.tokens * group))
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot: K and N of 16 at least
    tile = 4096 if plan.decode else 2048  # elements of a [keys, BLOCK_D] tile
    return {
        "GROUP": group,
        "TOKENS": plan.tokens,
        "ROWS": rows,
        # Keys per tile: as many as keep the float32 K and V tiles ([BLOCK_N, BLOCK_D]) and
        # the scores ([ROWS, BLOCK_N]) in registers: sm_90's ptxas -v reports no spills for
        # the 135M, 1B, 8B and Qwen layouts (about 100-250 registers), prefill tiles of 64
        # keys spilled. A decode's 16 rows leave room for twice the keys: on an H200 its
        # tiles read K/V 1.1-1.4x as fast with 64 keys as with 32 at every split count
        # (head_dim 64; triton 3.6 spills 8-12 bytes in two unsplit variants, 3.9 none).
        "BLOCK_N": max(16, min(tile // rows, tile // block_d)),  # tl.dot: 16 at least
        "PAGE": block_size,
        "BLOCK_D": block_d,
        "NUM_SPLITS": plan.num_splits,
        "DECODE": plan.decode,
        "WINDOW": window or 0,  # 0: full attention
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # Large prefill tiles' [ROWS, BLOCK_D] float32 accumulators over 8 warps rather than
        # 4, at most 64 values a thread (128 x 64 rows spilled in float32 on 4 warps).
        "num_warps": 8 if rows * block_d >= 8192 else 4,
    }


def triton_write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """`write_kv` as one kernel launch: rows `[T, kvh, d]` to their flat slots."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row_elems = k.shape[1] * k.shape[2]
    k = k.to(k_cache.dtype).contiguous()
    v = v.to(v_cache.dtype).contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, row_elems,
        BLOCK=triton.next_power_of_2(row_elems),
    )  # fmt: skip


class TritonBackend(AttentionBackend):
    cuda_graphs = True  # a decode-only plan is integers; the kernels read meta's tensors
    sliding_windows = True  # the window is a compile-time constant of the backend's kernels

    def __init__(self, num_heads: int, num_kv_heads: int, window: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, window)
        self._plan: _Plan | None = None
        # The step's compile-time arguments, made by its first layer call (they need the
        # query's head_dim and dtype) and reused by the others.
        self._consts: dict[str, object] | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._plan = plan_step(meta, self.num_kv_heads, self.window)
        self._consts = None

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping: torch.Tensor) -> None:
        if is_quantized(k_cache):
            raise ValueError("the triton attention backend does not read int8 KV rows")
        triton_write_kv(k_cache, v_cache, k, v, slot_mapping)

    def __call__(self, q, k_cache, v_cache, meta, scale):
        plan = self._plan
        if plan is None:
            raise RuntimeError("TritonBackend.prepare(meta) must run before the step's layers")
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        if plan.num_tiles == 0:
            return out
        splits = plan.num_splits
        if splits > 1:
            target = torch.empty(meta.num_reqs * splits, num_heads, head_dim,
                                 dtype=torch.float32, device=q.device)  # fmt: skip
            lse = torch.empty(meta.num_reqs * splits, num_heads, dtype=torch.float32,
                              device=q.device)  # fmt: skip
        else:
            target, lse = out, out  # lse is not written without splits
        t = plan.tiles
        consts = self._consts
        if consts is None:
            consts = attention_constexprs(plan, group, head_dim, meta.block_size, q.dtype,
                                          self.window)  # fmt: skip
            self._consts = consts
        _paged_attention_kernel[(plan.num_tiles, self.num_kv_heads)](
            q, k_cache, v_cache, target, lse, meta.block_tables, meta.seq_lens,
            t["req"], t["start"], t["len"], t["pos"],
            scale, num_heads, head_dim,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            target.stride(0), target.stride(1), meta.block_tables.stride(0), **consts,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(meta.num_reqs, num_heads)](
                target, lse, out, num_heads, head_dim,
                target.stride(0), target.stride(1), out.stride(0), out.stride(1),
                NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_D=consts["BLOCK_D"],
            )  # fmt: skip
        return out
