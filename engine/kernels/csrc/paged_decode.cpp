// Paged decode attention in bf16 on AVX-512 CPUs (paged_decode.h: the shared part).
// q . k in bf16 dot products, the softmax and p . V in float32, output bf16.
#include <immintrin.h>

#include "kernels.h"
#include "paged_decode.h"
#include "vec.h"

namespace {

using paged_decode::kMaxDim;
using paged_decode::kMaxGroup;
using paged_decode::Partial;
using Problem = paged_decode::Problem<at::BFloat16>;
using pagedserve_vec::exp_ps;
using pagedserve_vec::kLanes;
using pagedserve_vec::load_bf16;

// out[t] = the sum of v[t]'s 16 lanes, for 16 vectors at once: a transpose by halving
// (45 shuffles and adds), where 16 separate reductions cost about three times that.
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: tokens 4i .. 4i+3, a quarter of each
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], kEven),
                                   _mm512_shuffle_f32x4(b[0], b[1], kOdd));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], kEven),
                                   _mm512_shuffle_f32x4(b[2], b[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, kEven), _mm512_shuffle_f32x4(x01, x23, kOdd));
}

// 32 bf16 of a head vector at c (a multiple of 32): the last piece of a D that is an odd
// multiple of 16 reads 16 and zeros.
inline __m512bh load_pairs(const at::BFloat16* p, int64_t c, int64_t D) {
  const __mmask32 mask = D - c >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32(0xFFFFu);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + c);
}

// Attention of request r's query heads on KV head g over context tokens [begin, end).
// kG: the query heads per KV head when known at compile time (0: p.group), so that the
// per-head accumulators live in registers rather than on the stack.
template <int kG>
void attend_chunk(const Problem& p, int64_t r, int64_t g, int64_t begin, int64_t end,
                  Partial out) {
  const int64_t D = p.dim, G = kG > 0 ? kG : p.group, vecs = D / kLanes, pairs = (D + 31) / 32;
  const int64_t row_stride = p.kv_heads * D, block_stride = p.block_size * row_stride;
  // q . k with bf16 dot products (each product exact, sums in fp32), scaled afterwards.
  __m512bh q[kMaxGroup][kMaxDim / 32];
  const at::BFloat16* qr = p.q + (r * p.heads + g * G) * D;
  for (int64_t j = 0; j < G; ++j)
    for (int64_t c = 0; c < pairs; ++c) q[j][c] = load_pairs(qr + j * D, c * 32, D);
  const __m512 scale = _mm512_set1_ps(p.scale);
  out.clear(G, D);
  const int32_t* table = p.tables + r * p.max_blocks;
  // The K and V rows of keys [t0, t0 + n) (past n: the last row again, masked below).
  // One division per 16 keys, not two per key (an integer division costs tens of cycles).
  auto locate = [&](int64_t t0, int64_t n, const at::BFloat16** krow, const at::BFloat16** vrow) {
    int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
    for (int64_t t = 0; t < kLanes; ++t) {
      const int64_t base = int64_t(table[block]) * block_stride + offset * row_stride + g * D;
      krow[t] = p.k + base;
      vrow[t] = p.v + base;
      if (t + 1 < n && ++offset == p.block_size) offset = 0, ++block;
    }
  };
  const at::BFloat16* krow[kLanes];
  const at::BFloat16* vrow[kLanes];
  const at::BFloat16* knext[kLanes];
  const at::BFloat16* vnext[kLanes];
  locate(begin, std::min(kLanes, end - begin), knext, vnext);
  // Walk the chunk 16 keys at a time (a block may hold more or fewer: index by token),
  // fetching the next 16 keys' rows while these compute: between two layers' attention
  // the step streams its weights, so the cache arrives from memory (1.45x slower unfetched).
  for (int64_t t0 = begin; t0 < end; t0 += kLanes) {
    const int64_t n = std::min(kLanes, end - t0);
    std::copy(knext, knext + kLanes, krow);
    std::copy(vnext, vnext + kLanes, vrow);
    if (t0 + kLanes < end) {
      locate(t0 + kLanes, std::min(kLanes, end - t0 - kLanes), knext, vnext);
      for (int64_t t = 0; t < kLanes; ++t)
        for (int64_t b = 0; b < D * 2; b += 64) {
          _mm_prefetch((const char*)knext[t] + b, _MM_HINT_T0);
          _mm_prefetch((const char*)vnext[t] + b, _MM_HINT_T0);
        }
    }
    const __mmask16 valid = n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    alignas(64) float probs[kMaxGroup][kLanes];
    for (int64_t j = 0; j < G; ++j) {
      __m512 dots[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < pairs; ++c)
          dot = _mm512_dpbf16_ps(dot, q[j][c], load_pairs(krow[t], c * 32, D));
        dots[t] = dot;
      }
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, sum_lanes16(dots), scale);
      const float new_max = std::max(out.max[j], _mm512_reduce_max_ps(s));
      const float correction = std::exp(out.max[j] - new_max);  // 0 on the first keys
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(probs[j], e);
      out.sum[j] = out.sum[j] * correction + _mm512_reduce_add_ps(e);
      out.max[j] = new_max;
      if (correction != 1.f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int64_t c = 0; c < vecs; ++c) {
          float* a = out.acc + j * D + c * kLanes;
          _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), cv));
        }
      }
    }
    // probs . V: kSets interleaved sums per head, so the fused multiply-adds do not wait
    // on each other (one chain of 16 was latency-bound).
    constexpr int kSets = kG == 0 ? 1 : kG <= 3 ? 4 : kG <= 6 ? 2 : 1;
    for (int64_t c = 0; c < vecs; ++c) {
      __m512 acc[kSets][kG > 0 ? kG : kMaxGroup];
      for (int u = 0; u < kSets; ++u)
        for (int64_t j = 0; j < G; ++j)
          acc[u][j] = u ? _mm512_setzero_ps() : _mm512_loadu_ps(out.acc + j * D + c * kLanes);
      for (int64_t t = 0; t < n; t += kSets)
        for (int u = 0; u < kSets && t + u < n; ++u) {
          const __m512 vv = load_bf16(vrow[t + u] + c * kLanes);
          for (int64_t j = 0; j < G; ++j)
            acc[u][j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[j][t + u]), vv, acc[u][j]);
        }
      for (int64_t j = 0; j < G; ++j) {
        __m512 sum = acc[0][j];
        for (int u = 1; u < kSets; ++u) sum = _mm512_add_ps(sum, acc[u][j]);
        _mm512_storeu_ps(out.acc + j * D + c * kLanes, sum);
      }
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache,
                                          const torch::Tensor& block_tables,
                                          const torch::Tensor& seq_lens, double scale,
                                          int64_t window,
                                          const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q and the caches must be bfloat16");
  auto attend = [](const Problem& p, int64_t r, int64_t g, int64_t begin, int64_t end,
                   Partial part) {
    paged_decode::with_group(p.group, [&](auto group) {
      attend_chunk<decltype(group)::value>(p, r, g, begin, end, part);
    });
  };
  return paged_decode::run<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                         sinks, kLanes, attend);
}
