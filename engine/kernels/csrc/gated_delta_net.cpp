// One decode step of a Gated DeltaNet layer (Qwen3.5's linear attention) for B requests in one
// call: engine/models/gated_delta_net.py's `decode_torch` (about 20 torch ops, each a pass over
// the requests' states) as two passes over each request's float32 state. Per request: the
// causal conv's step on its conv state (float32 sums), silu, rounded to the activations' dtype
// as the torch ops round; q and k l2-normalised, q scaled by Dk^-0.5; then per value head
//   S = exp(g) S;  delta = beta (v - k^T S);  S += k delta^T;  o = q^T S.
// Float32 or bf16 activations (conv weight and conv states in the same dtype), float32 state;
// AVX2 and scalar code only, so both builds (AVX2, AVX512-BF16) have it. The results equal
// the torch ops' up to the order of float32 sums and silu's exp.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec_avx2.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using pagedserve_avx2::exp_ps;
using pagedserve_avx2::hsum;
using pagedserve_avx2::kLanes;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// silu over n floats in place, then rounded to T (silu(conv).to(dtype) in the torch ops).
template <typename T>
void silu_rounded(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  }
  for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
  if constexpr (std::is_same_v<T, at::BFloat16>)
    for (i = 0; i < n; ++i) x[i] = static_cast<float>(at::BFloat16(x[i]));
}

// x *= scale / sqrt(sum(x^2) + eps), n a multiple of 8 (transformers' l2norm, then q's scale).
void l2norm(float* x, int64_t n, float scale) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 f = _mm256_set1_ps(1.f / std::sqrt(hsum(acc) + 1e-6f) * scale);
  for (int64_t i = 0; i < n; i += kLanes)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), f));
}

// Columns [j, j + 8 NB) of one head's state S [Dk, Dv]: the delta rule's step in two passes over
// the rows (the second needs k^T S over all of them), out[j..] = q^T S.
template <int NB>
void delta_tile(float* S, const float* q, const float* k, const float* v, float* out, int64_t Dk,
                int64_t Dv, int64_t j, float decay, float beta) {
  const __m256 d = _mm256_set1_ps(decay);
  __m256 acc[NB], delta[NB];
  for (int r = 0; r < NB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < Dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]);
    const float* row = S + i * Dv + j;
    for (int r = 0; r < NB; ++r)
      acc[r] = _mm256_fmadd_ps(ki, _mm256_mul_ps(d, _mm256_loadu_ps(row + r * kLanes)), acc[r]);
  }
  const __m256 b = _mm256_set1_ps(beta);
  for (int r = 0; r < NB; ++r)
    delta[r] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j + r * kLanes), acc[r]), b);
  for (int r = 0; r < NB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < Dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    float* row = S + i * Dv + j;
    for (int r = 0; r < NB; ++r) {
      const __m256 old = _mm256_mul_ps(d, _mm256_loadu_ps(row + r * kLanes));
      const __m256 s = _mm256_fmadd_ps(ki, delta[r], old);
      _mm256_storeu_ps(row + r * kLanes, s);
      acc[r] = _mm256_fmadd_ps(qi, s, acc[r]);
    }
  }
  for (int r = 0; r < NB; ++r) _mm256_storeu_ps(out + j + r * kLanes, acc[r]);
}

// The conv step on channels [c0, c1) of request b (each channel's state shifted left by one
// input), silu, rounded to T, into buf.
template <typename T>
void conv_step(const T* x, const T* w, T* conv, float* buf, int64_t C, int64_t K, int64_t c0,
               int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    T* cs = conv + c * (K - 1);
    const T* wc = w + c * K;
    const T xc = x[c];
    float acc = 0.f;
    for (int64_t j = 0; j < K - 1; ++j) acc += to_float(wc[j]) * to_float(cs[j]);
    buf[c] = acc + to_float(wc[K - 1]) * to_float(xc);
    for (int64_t j = 0; j + 1 < K - 1; ++j) cs[j] = cs[j + 1];
    cs[K - 2] = xc;
  }
  silu_rounded<T>(buf + c0, c1 - c0);
}

// One parallel region, a task per (request, key head): the conv channels of its q, its k
// and its value heads' v, its q and k normalised, then its value heads' steps. No task
// reads what another writes, so a step forks and joins the threads once (three regions
// cost more than the arithmetic at batch 1: each join waits for the slowest thread).
template <typename T>
void decode(const torch::Tensor& mixed_qkv, const torch::Tensor& g, const torch::Tensor& beta,
            const torch::Tensor& conv_weight, torch::Tensor& conv_states, torch::Tensor& states,
            const torch::Tensor& slots, int64_t num_k_heads, torch::Tensor& out) {
  const int64_t B = mixed_qkv.size(0), C = mixed_qkv.size(1), K = conv_weight.size(1);
  const int64_t Hv = states.size(1), Dk = states.size(2), Dv = states.size(3);
  const int64_t key_dim = num_k_heads * Dk, rep = Hv / num_k_heads;
  const T* x = mixed_qkv.data_ptr<T>();
  const T* w = conv_weight.data_ptr<T>();
  T* conv = conv_states.data_ptr<T>();
  float* st = states.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto qkv = torch::empty({B, C}, mixed_qkv.options().dtype(torch::kFloat));
  float* buf = qkv.data_ptr<float>();
  torch::Tensor out_f = std::is_same_v<T, float> ? out : torch::empty({B, Hv, Dv}, qkv.options());
  float* op = out_f.template data_ptr<float>();

  at::parallel_for(0, B * num_k_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_k_heads, kh = task % num_k_heads;
      const T* xb = x + b * C;
      T* cb = conv + sp[b] * C * (K - 1);
      float* qkv_b = buf + b * C;
      const int64_t q0 = kh * Dk, k0 = key_dim + kh * Dk, v0 = 2 * key_dim + kh * rep * Dv;
      for (const int64_t c0 : {q0, k0}) conv_step<T>(xb, w, cb, qkv_b, C, K, c0, c0 + Dk);
      conv_step<T>(xb, w, cb, qkv_b, C, K, v0, v0 + rep * Dv);
      float* q = qkv_b + q0;
      float* k = qkv_b + k0;
      l2norm(q, Dk, 1.f / std::sqrt(static_cast<float>(Dk)));
      l2norm(k, Dk, 1.f);
      for (int64_t h = kh * rep; h < (kh + 1) * rep; ++h) {
        float* S = st + (sp[b] * Hv + h) * Dk * Dv;
        const float* v = qkv_b + 2 * key_dim + h * Dv;
        const float decay = std::exp(gp[b * Hv + h]), bt = bp[b * Hv + h];
        float* o = op + (b * Hv + h) * Dv;
        int64_t j = 0;
        for (; j + 8 * kLanes <= Dv; j += 8 * kLanes)
          delta_tile<8>(S, q, k, v, o, Dk, Dv, j, decay, bt);
        for (; j < Dv; j += kLanes) delta_tile<1>(S, q, k, v, o, Dk, Dv, j, decay, bt);
      }
    }
  });
  if constexpr (!std::is_same_v<T, float>) out.copy_(out_f);
}

}  // namespace

torch::Tensor gated_delta_decode(const torch::Tensor& mixed_qkv, const torch::Tensor& g,
                                 const torch::Tensor& beta, const torch::Tensor& conv_weight,
                                 torch::Tensor& conv_states, torch::Tensor& states,
                                 const torch::Tensor& slots, int64_t num_k_heads) {
  const auto dtype = mixed_qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "mixed_qkv: float32 or bf16");
  for (const torch::Tensor& t : {mixed_qkv, g, beta, conv_weight, conv_states, states, slots})
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "contiguous CPU tensors expected");
  TORCH_CHECK(conv_weight.scalar_type() == dtype && conv_states.scalar_type() == dtype,
              "conv_weight and conv_states must have mixed_qkv's dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  states.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong,
              "g, beta, states float32, slots int64");
  TORCH_CHECK(mixed_qkv.dim() == 2 && states.dim() == 4 && conv_states.dim() == 3 &&
                  conv_weight.dim() == 2, "mixed_qkv [B, C], states [S, Hv, Dk, Dv], "
              "conv_states [S, C, K-1], conv_weight [C, K]");
  const int64_t B = mixed_qkv.size(0), C = mixed_qkv.size(1), K = conv_weight.size(1);
  const int64_t S = states.size(0), Hv = states.size(1), Dk = states.size(2), Dv = states.size(3);
  TORCH_CHECK(num_k_heads > 0 && Hv % num_k_heads == 0, "Hv must be a multiple of Hk");
  TORCH_CHECK(Dk % kLanes == 0 && Dv % kLanes == 0, "head dims must be multiples of 8");
  TORCH_CHECK(K >= 2 && C == 2 * num_k_heads * Dk + Hv * Dv && conv_weight.size(0) == C &&
                  conv_states.size(0) == S && conv_states.size(1) == C &&
                  conv_states.size(2) == K - 1, "shapes disagree");
  TORCH_CHECK(g.numel() == B * Hv && beta.numel() == B * Hv && slots.numel() == B,
              "g, beta [B, Hv], slots [B]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<bool> taken(S);  // two requests on one slot would race on its state
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "slot ", sp[b], " out of range");
    TORCH_CHECK(!taken[sp[b]], "slot ", sp[b], " given twice");
    taken[sp[b]] = true;
  }
  auto out = torch::empty({B, Hv, Dv}, mixed_qkv.options());
  if (dtype == at::kFloat)
    decode<float>(mixed_qkv, g, beta, conv_weight, conv_states, states, slots, num_k_heads, out);
  else
    decode<at::BFloat16>(mixed_qkv, g, beta, conv_weight, conv_states, states, slots,
                         num_k_heads, out);
  return out;
}
