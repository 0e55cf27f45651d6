// The small ops around a bf16 decoder layer's matmuls, one call each instead of 5-10 torch
// ops: at a decode step's handful of rows every torch op costs more in dispatch than in
// arithmetic (about 40 ops per layer, 30 layers, per token).
//
// Each op rounds to bf16 exactly where the torch ops it replaces round, so its output
// equals theirs up to the fp32 summation order of the norm and silu's exp (AVX-512 here,
// with scalar tails for widths that are not a multiple of 16).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec.h"

#include <cmath>

namespace {

using bf16 = at::BFloat16;

inline float f(bf16 x) { return static_cast<float>(x); }

using pagedserve_vec::exp_ps;
using pagedserve_vec::kLanes;
using pagedserve_vec::load_bf16;
using pagedserve_vec::round_bf16;
using pagedserve_vec::store_bf16;

constexpr int64_t kRowsPerTask = 16;

}  // namespace

// residual (if given) += x, in bf16 as `hidden + y` rounds; then transformers' RMSNorm of
// the sum: normalise in fp32, round to bf16, scale by the weight, round again.
// Returns (normed, the new residual stream): with no residual, the stream is x itself.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous [T, H] bfloat16 tensor");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.numel() == x.size(1),
              "weight must be [H] bfloat16");
  const int64_t T = x.size(0), H = x.size(1);
  torch::Tensor stream = x;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kBFloat16 &&
                    residual->is_contiguous(),
                "residual must match x");
    stream = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* rp = residual ? residual->data_ptr<bf16>() : nullptr;
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  bf16* sp = stream.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* xr = xp + t * H;
      bf16* sr = sp + t * H;
      const bool vec = H % kLanes == 0;
      if (rp) {
        const bf16* rr = rp + t * H;
        if (vec) {
          for (int64_t i = 0; i < H; i += kLanes)
            store_bf16(sr + i, _mm512_add_ps(load_bf16(rr + i), load_bf16(xr + i)));
        } else {
          for (int64_t i = 0; i < H; ++i) sr[i] = bf16(f(rr[i]) + f(xr[i]));
        }
      }
      // Squares summed in 16 fp32 lanes (then across them), as torch's vectorised mean
      // does: a sequential fp32 sum over H terms drifts by ~H ulps instead of ~H/16.
      float ss = 0.f;
      if (vec) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += kLanes) {
          const __m512 v = load_bf16(sr + i);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
      } else {
        for (int64_t i = 0; i < H; ++i) ss += f(sr[i]) * f(sr[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + epsf);
      bf16* orow = op + t * H;
      if (vec) {
        const __m512 iv = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < H; i += kLanes)
          store_bf16(orow + i, _mm512_mul_ps(load_bf16(wp + i), round_bf16(_mm512_mul_ps(load_bf16(sr + i), iv))));
      } else {
        for (int64_t i = 0; i < H; ++i) orow[i] = bf16(f(wp[i]) * f(bf16(f(sr[i]) * inv)));
      }
    }
  });
  return {out, stream};
}

// Rotary embedding of the q and k heads of a fused [T, (H + 2 KVH) * D] QKV projection
// (`x * cos + rotate_half(x) * sin`, rounded per op as in bf16 torch), the rotated k and
// the v heads written to their cache slots, the rotated q returned as [T, H, D].
torch::Tensor rope_write_kv_bf16(const torch::Tensor& qkv, const torch::Tensor& cos,
                                 const torch::Tensor& sin, torch::Tensor& k_cache,
                                 torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                 int64_t num_heads, int64_t num_kv_heads) {
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "qkv must be a contiguous [T, (H + 2 KVH) * D] bfloat16 tensor");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
                  sin.numel() == T * D,
              "cos and sin must be contiguous [T, D] bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == num_kv_heads,
              "caches must be contiguous bfloat16 [blocks, block_size, KVH, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T &&
                  slot_mapping.is_contiguous(),
              "slot_mapping must be [T] int64");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  const bf16* in = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * D, half = D / 2;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* x = in + t * row;
      const bf16* c = cp + t * D;
      const bf16* s = sp + t * D;
      auto rotate = [&](const bf16* head, bf16* dst) {
        for (int64_t i = 0; i < D; ++i) {
          // rotate_half: [-x2, x1]; its negation is exact in bf16.
          const float r = i < half ? -f(head[i + half]) : f(head[i - half]);
          dst[i] = bf16(f(bf16(f(head[i]) * f(c[i]))) + f(bf16(r * f(s[i]))));
        }
      };
      for (int64_t h = 0; h < num_heads; ++h) rotate(x + h * D, qp + (t * num_heads + h) * D);
      const int64_t slot = slots[t] * num_kv_heads * D;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rotate(x + (num_heads + h) * D, kc + slot + h * D);
        const bf16* v = x + (num_heads + num_kv_heads + h) * D;
        std::copy(v, v + D, vc + slot + h * D);
      }
    }
  });
  return q;
}

// silu(gate) * up of a fused [T, 2I] gate/up projection, rounded per op as in bf16 torch.
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] bfloat16 tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const bf16* in = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = in + t * 2 * I;
      const bf16* u = g + I;
      bf16* o = op + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const __m512 x = load_bf16(g + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store_bf16(o + i, _mm512_mul_ps(silu, load_bf16(u + i)));
      }
      for (; i < I; ++i) {
        const float x = f(g[i]);
        o[i] = bf16(f(bf16(x / (1.f + std::exp(-x)))) * f(u[i]));
      }
    }
  });
  return out;
}
