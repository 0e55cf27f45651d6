// The small ops around a float32 decoder layer's matmuls (fused_ops.cpp's, for CPUs
// without AVX512-BF16, whose GGUF models run float32 activations): one call each instead
// of 5-10 torch ops. They compute what the torch ops they replace compute, up to the
// order of the norm's float32 sum and silu's exp (AVX2 here, scalar tails for widths that
// are not a multiple of 8).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "kv_int8.h"
#include "vec_avx2.h"

#include <cmath>

namespace {

using pagedserve_avx2::exp_ps;
using pagedserve_avx2::hsum;
using pagedserve_avx2::kLanes;

constexpr int64_t kRowsPerTask = 16;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be a contiguous 2-D float32 tensor");
}

}  // namespace

// residual (if given) += x; then transformers' RMSNorm of the sum, scaled by the weight.
// Returns (normed, the new residual stream): with no residual, the stream is x itself.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_f32(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1),
              "weight must be [H] float32");
  const int64_t T = x.size(0), H = x.size(1), body = H - H % kLanes;
  torch::Tensor stream = x;
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
    stream = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const torch::Tensor w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  float* sp = stream.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* s = sp + t * H;
      if (rp) {
        const float *a = rp + t * H, *b = xp + t * H;
        int64_t i = 0;
        for (; i < body; i += kLanes)
          _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        for (; i < H; ++i) s[i] = a[i] + b[i];
      }
      // Squares summed in 8 lanes, then across them: a sequential sum over H terms
      // drifts by ~H ulps instead of ~H/8.
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i < body; i += kLanes) {
        const __m256 v = _mm256_loadu_ps(s + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float ss = hsum(acc);
      for (; i < H; ++i) ss += s[i] * s[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      float* o = op + t * H;
      const __m256 iv = _mm256_set1_ps(inv);
      for (i = 0; i < body; i += kLanes)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(wp + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(s + i), iv)));
      for (; i < H; ++i) o[i] = wp[i] * (s[i] * inv);
    }
  });
  return {out, stream};
}

// Rotary embedding of the q and k heads of a fused [T, (H + 2 KVH) * D] QKV projection
// (`x * cos + rotate_half(x) * sin`), the rotated k and the v heads written to their cache
// slots (float32, or quantized into int8 rows: kv_int8.h), the rotated q returned as
// [T, H, D].
torch::Tensor rope_write_kv_f32(const torch::Tensor& qkv, const torch::Tensor& cos,
                                const torch::Tensor& sin, torch::Tensor& k_cache,
                                torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (num_heads + 2 * num_kv_heads), half = D / 2;
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t row_len = int8 ? D + kv_int8::kScaleBytes : D;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv must be [T, (H + 2 KVH) * D]");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos and sin must be [T, D]");
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || int8) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == num_kv_heads &&
                  k_cache.size(3) == row_len && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [blocks, block_size, KVH, D] float32, or int8 "
              "[blocks, block_size, KVH, D + 2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T &&
                  slot_mapping.is_contiguous(),
              "slot_mapping must be [T] int64");
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim must be even, at most 512");
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row_bytes = row_len * k_cache.element_size();
  const int64_t row = (num_heads + 2 * num_kv_heads) * D;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = in + t * row;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      auto rotate = [&](const float* head, float* dst) {
        for (int64_t i = 0; i < D; ++i) {
          const float r = i < half ? -head[i + half] : head[i - half];  // rotate_half
          dst[i] = head[i] * c[i] + r * s[i];
        }
      };
      for (int64_t h = 0; h < num_heads; ++h) rotate(x + h * D, qp + (t * num_heads + h) * D);
      float rotated[512];  // a head's rotated k before it is quantized (D <= 256 is checked)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t at = (slots[t] * num_kv_heads + h) * row_bytes;
        const float* v = x + (num_heads + num_kv_heads + h) * D;
        if (int8) {
          rotate(x + (num_heads + h) * D, rotated);
          kv_int8::quantize_row(rotated, D, reinterpret_cast<int8_t*>(kc + at));
          kv_int8::quantize_row(v, D, reinterpret_cast<int8_t*>(vc + at));
        } else {
          rotate(x + (num_heads + h) * D, reinterpret_cast<float*>(kc + at));
          std::copy(v, v + D, reinterpret_cast<float*>(vc + at));
        }
      }
    }
  });
  return q;
}

// silu(gate) * up of a fused [T, 2I] gate/up projection.
torch::Tensor silu_mul_f32(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = in + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}
