"""The layer ops as Triton kernels, for a bf16 / fp16 model on CUDA: one launch each.

Torch's ops (engine/models/layer_ops.py) spend 6-10 small kernels on each of a layer's
norms, its rotary and its silu: on an H200 a batch-1 decode step of the 1B stand-in ran
several hundred such kernels of 1-2 us, about as much device time as its matmuls
(`python -m bench.gpu_step_profile`, bench/README.md "The GPU run"). These do the same
arithmetic in one launch per op, rounding where torch's bf16 ops round (after the
residual add, the normalised row, silu, each rotary product), so they agree with torch's
to an ulp (tests/engine/test_triton_ops.py, on an H200 too). The KV write stays the
attention backend's (the Triton backend's own kernel). A float32 model keeps torch's
ops: its tokens must be transformers' (`TorchOps`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.models.layer_ops import TorchOps

SILU_BLOCK = 1024  # columns of gate (and of up) per program


def norm_warps(block: int) -> int:
    """Warps for a norm row of `block` elements: 4 to 16, 16 values a thread at most."""
    return min(16, max(4, block // 512))


@triton.jit
def _add_rms_norm_kernel(delta_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
                         stride_d, stride_r, stride_o, stride_ro,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0)
    if HAS_RES:  # residual + delta, rounded to the stream's dtype as torch's add is
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, half, stride_t, stride_c, stride_s,
                 stride_o, HALF: tl.constexpr):  # fmt: skip
    """One (token, head) of q and k: ``x * cos + rotate_half(x) * sin``, each product and
    the sum rounded to the model's dtype as torch's ops round them."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF)
    ok = i < half
    src = qkv_ptr + t * stride_t + head * 2 * half
    dst = out_ptr + t * stride_o + head * 2 * half
    dt = out_ptr.dtype.element_ty
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_c + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_s + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_s + half + i, mask=ok, other=0.0).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + i, o1.to(dt), mask=ok)
    tl.store(dst + half + i, o2.to(dt), mask=ok)


class TritonOps(TorchOps):
    """`TorchOps`' interface, each op one Triton kernel (the MLP's activation is silu)."""

    @staticmethod
    def add_rms_norm(
        delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, n = delta.shape
        out = torch.empty_like(delta)
        stream = delta if residual is None else torch.empty_like(delta)
        res = delta if residual is None else residual  # not read without a residual
        block = triton.next_power_of_2(n)
        if rows:
            _add_rms_norm_kernel[(rows,)](
                delta, res, weight, out, stream, n, eps,
                delta.stride(0), res.stride(0), out.stride(0), stream.stride(0),
                HAS_RES=residual is not None, BLOCK=block, num_warps=norm_warps(block),
            )  # fmt: skip
        return out, stream

    def rope_write_kv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
    ) -> torch.Tensor:  # fmt: skip
        h, kvh = num_heads, num_kv_heads
        tokens = qkv.shape[0]
        qkv = qkv.view(tokens, h + 2 * kvh, -1)
        half = qkv.shape[-1] // 2
        qk = torch.empty(tokens, h + kvh, 2 * half, dtype=qkv.dtype, device=qkv.device)
        if tokens:
            _rope_kernel[(tokens, h + kvh)](
                qkv, cos, sin, qk, half, qkv.stride(0), cos.stride(0), sin.stride(0),
                qk.stride(0), HALF=triton.next_power_of_2(half), num_warps=1,
            )  # fmt: skip
        self.attn.write_kv(k_cache, v_cache, qk[:, h:], qkv[:, h + kvh :], slot_mapping)
        return qk[:, :h]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape[0], gate_up.shape[-1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](
                gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK,
            )  # fmt: skip
        return out
