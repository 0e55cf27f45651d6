// Paged decode attention in float32 on AVX2 (paged_decode.h: the shared part): the
// decode path of a GGUF served with float32 activations, on CPUs without AVX512-BF16.
// The caches are float32, or int8 rows (kv_int8.h) dequantized as they are read: a key's
// scale multiplies its score, a value's scale its probability, so the rows themselves
// are only widened to float.
#include <immintrin.h>

#include "kernels.h"
#include "kv_int8.h"
#include "paged_decode.h"
#include "vec_avx2.h"

namespace {

using paged_decode::kMaxGroup;
using paged_decode::Partial;
template <typename KV>
using Problem = paged_decode::Problem<float, KV>;
using pagedserve_avx2::exp_ps;
using pagedserve_avx2::hmax;
using pagedserve_avx2::hsum;
using pagedserve_avx2::kLanes;

constexpr int64_t kKeys = 8;  // keys per online-softmax update: one vector of scores

// 8 consecutive elements of a cache row as floats.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const int8_t* x) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)x)));
}

// The scales of the kKeys rows (int8), or nothing to scale by (float32: nullptr).
template <typename KV>
inline bool row_scales(const KV* const* rows, int64_t dim, __m256* scales) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    alignas(32) float s[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) s[t] = kv_int8::scale_of(rows[t], dim);
    *scales = _mm256_load_ps(s);
    return true;
  } else {
    return false;
  }
}

// The K and V rows of keys [t0, t0 + n) of request r's KV head g; past n (up to kKeys)
// the last row again, whose scores are masked.
template <typename KV>
inline void locate(const Problem<KV>& p, const int32_t* table, int64_t g, int64_t t0,
                   int64_t n, const KV** krow, const KV** vrow) {
  const int64_t row_stride = p.kv_heads * p.row, block_stride = p.block_size * row_stride;
  int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
  for (int64_t t = 0; t < kKeys; ++t) {
    const int64_t base = int64_t(table[block]) * block_stride + offset * row_stride + g * p.row;
    krow[t] = p.k + base;
    vrow[t] = p.v + base;
    if (t + 1 < n && ++offset == p.block_size) offset = 0, ++block;
  }
}

// out[t] = the sum of v[t]'s 8 lanes, for 8 vectors at once (9 shuffles and adds, where 8
// separate horizontal sums cost about five times that).
inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // s0123: [v0..v3 low-half sums | v0..v3 high-half sums], s4567 the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Attention of request r's query heads on KV head g over context tokens [begin, end).
template <typename KV, int kG>
void attend_chunk(const Problem<KV>& p, int64_t r, int64_t g, int64_t begin, int64_t end,
                  Partial out) {
  const int64_t D = p.dim, G = kG > 0 ? kG : p.group, vecs = D / kLanes;
  const float* q = p.q + (r * p.heads + g * G) * D;
  const int32_t* table = p.tables + r * p.max_blocks;
  out.clear(G, D);
  const KV *krow[kKeys], *vrow[kKeys], *knext[kKeys], *vnext[kKeys];
  const int64_t row_bytes = p.row * int64_t(sizeof(KV));
  locate(p, table, g, begin, std::min(kKeys, end - begin), knext, vnext);
  for (int64_t t0 = begin; t0 < end; t0 += kKeys) {
    const int64_t n = std::min(kKeys, end - t0);
    std::copy(knext, knext + kKeys, krow);
    std::copy(vnext, vnext + kKeys, vrow);
    // The next keys' rows are fetched while these compute: between two layers'
    // attention the step streams its weights, so the cache arrives from memory.
    if (t0 + kKeys < end) {
      const int64_t next = std::min(kKeys, end - t0 - kKeys);
      locate(p, table, g, t0 + kKeys, next, knext, vnext);  // past next: repeats, fetched once
      for (int64_t t = 0; t < next; ++t)
        for (int64_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch((const char*)knext[t] + b, _MM_HINT_T0);
          _mm_prefetch((const char*)vnext[t] + b, _MM_HINT_T0);
        }
    }
    // Keys past n score -inf, so their probabilities are 0.
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 key_scales = _mm256_set1_ps(p.scale), value_scales;
    if (row_scales(krow, D, &key_scales)) key_scales = _mm256_mul_ps(key_scales, _mm256_set1_ps(p.scale));
    const bool scaled_values = row_scales(vrow, D, &value_scales);
    alignas(32) float probs[kMaxGroup][kKeys];
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = q + j * D;
      __m256 dots[kKeys];  // 8 independent chains of multiply-adds, one per key
      for (int64_t t = 0; t < kKeys; ++t) dots[t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < vecs; ++c) {
        const __m256 qc = _mm256_loadu_ps(qj + c * kLanes);
        for (int64_t t = 0; t < kKeys; ++t)
          dots[t] = _mm256_fmadd_ps(qc, load8(krow[t] + c * kLanes), dots[t]);
      }
      const __m256 sv =
          _mm256_blendv_ps(minus_inf, _mm256_mul_ps(sum_lanes8(dots), key_scales), valid);
      const float new_max = std::max(out.max[j], hmax(sv));
      const float correction = std::exp(out.max[j] - new_max);  // 0 on the first keys
      const __m256 e = _mm256_and_ps(valid, exp_ps(_mm256_sub_ps(sv, _mm256_set1_ps(new_max))));
      // A value row's scale rides on its probability (the sum keeps the plain ones).
      _mm256_store_ps(probs[j], scaled_values ? _mm256_mul_ps(e, value_scales) : e);
      out.sum[j] = out.sum[j] * correction + hsum(e);
      out.max[j] = new_max;
      if (correction != 1.f) {
        const __m256 cv = _mm256_set1_ps(correction);
        for (int64_t c = 0; c < vecs; ++c) {
          float* a = out.acc + j * D + c * kLanes;
          _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_loadu_ps(a), cv));
        }
      }
    }
    // probs . V: each V row loaded once for the group's G heads, in kSets interleaved sums
    // per head so that few heads still keep several multiply-adds in flight (a padded
    // key's probability is 0: all kKeys rows are summed).
    constexpr int kSets = kG == 0 ? 1 : kG <= 2 ? 4 : kG <= 4 ? 2 : 1;
    for (int64_t c = 0; c < vecs; ++c) {
      __m256 acc[kSets][kG > 0 ? kG : kMaxGroup];
      for (int u = 0; u < kSets; ++u)
        for (int64_t j = 0; j < G; ++j)
          acc[u][j] = u ? _mm256_setzero_ps() : _mm256_loadu_ps(out.acc + j * D + c * kLanes);
      for (int64_t t = 0; t < kKeys; t += kSets)
        for (int u = 0; u < kSets; ++u) {
          const __m256 vv = load8(vrow[t + u] + c * kLanes);
          for (int64_t j = 0; j < G; ++j)
            acc[u][j] = _mm256_fmadd_ps(_mm256_set1_ps(probs[j][t + u]), vv, acc[u][j]);
        }
      for (int64_t j = 0; j < G; ++j) {
        __m256 sum = acc[0][j];
        for (int u = 1; u < kSets; ++u) sum = _mm256_add_ps(sum, acc[u][j]);
        _mm256_storeu_ps(out.acc + j * D + c * kLanes, sum);
      }
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention_f32(const torch::Tensor& q, const torch::Tensor& k_cache,
                                         const torch::Tensor& v_cache,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& seq_lens, double scale,
                                         int64_t window,
                                         const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  auto attend = [](const auto& p, int64_t r, int64_t g, int64_t begin, int64_t end,
                   Partial part) {
    using KV = std::remove_cv_t<std::remove_pointer_t<decltype(p.k)>>;
    paged_decode::with_group(p.group, [&](auto group) {
      attend_chunk<KV, decltype(group)::value>(p, r, g, begin, end, part);
    });
  };
  if (k_cache.scalar_type() == at::kChar)
    return paged_decode::run<float, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                            sinks, kLanes, attend);
  return paged_decode::run<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sinks,
                                  kLanes, attend);
}
