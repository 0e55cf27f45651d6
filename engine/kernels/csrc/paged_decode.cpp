// Paged decode attention on AVX512 CPUs: one query token per request, read straight from
// the bf16 paged K/V cache (no gathered copy), online softmax in float32, output bf16.
//
// q [N, H, D] bf16; k_cache, v_cache [num_blocks, block_size, KVH, D] bf16;
// block_tables [N, max_blocks] int32; seq_lens [N] int32 -> out [N, H, D] bf16.
// Query head h reads KV head h / (H / KVH). D must be a multiple of 16 and at most 256.
//
// Why: a decode step's attention is little arithmetic, and the SDPA path spent it on a
// gather of each request's blocks, a padded mask and a kernel launch per layer. Here each
// task is one (request, KV head, chunk of the context): its H / KVH query heads walk the
// chunk's blocks together, so every K and V row is read once per step, and the context
// is split into chunks so that a single request still keeps every thread busy. Chunks
// are merged exactly through their log-sum-exp, as flash-decoding does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

using pagedserve_vec::exp_ps;
using pagedserve_vec::kLanes;
using pagedserve_vec::load_bf16;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxGroup = 16;        // query heads per KV head
constexpr int64_t kChunkTokens = 256;    // context tokens per task

// One chunk's result for its G query heads, before normalisation: a view of its slice of
// one flat buffer (G maxima, G sums, G x D accumulators).
struct Partial {
  float* max;
  float* sum;
  float* acc;
  static int64_t floats(int64_t G, int64_t D) { return G * (D + 2); }
  Partial(float* base, int64_t G) : max(base), sum(base + G), acc(base + 2 * G) {}
};

struct Problem {
  const at::BFloat16 *q, *k, *v;
  const int32_t *tables, *seq_lens;
  int64_t heads, kv_heads, dim, group, block_size, max_blocks;
  float scale;
};

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
  for (int64_t j = 0; j < G; ++j) {
    out.max[j] = -std::numeric_limits<float>::infinity();
    out.sum[j] = 0.f;
    std::fill(out.acc + j * D, out.acc + (j + 1) * D, 0.f);
  }
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

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [N, H, D] and caches [blocks, block_size, KVH, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "q and the caches must be bfloat16");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup && k_cache.size(3) == D,
              "head layout: H a multiple of KVH, at most 16 query heads per KV head");
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxDim, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.size(0) == N && seq_lens.size(0) == N, "one row per query");
  const Problem p{q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                  v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int32_t>(),
                  seq_lens.data_ptr<int32_t>(), H, KVH, D, H / KVH, k_cache.size(1),
                  block_tables.size(1), static_cast<float>(scale)};
  // Tasks: (request, KV head, chunk); a request's chunks are consecutive.
  std::vector<int64_t> first_task(N + 1, 0);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t len = p.seq_lens[r];
    TORCH_CHECK(len > 0 && len <= p.max_blocks * p.block_size, "seq_len out of range");
    first_task[r + 1] = first_task[r] + KVH * ((len + kChunkTokens - 1) / kChunkTokens);
  }
  const int64_t part_floats = Partial::floats(p.group, D);
  std::unique_ptr<float[]> parts(new float[first_task[N] * part_floats]);  // not zeroed
  at::parallel_for(0, first_task[N], 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = std::upper_bound(first_task.begin(), first_task.end(), task) -
                        first_task.begin() - 1;
      const int64_t chunks = (first_task[r + 1] - first_task[r]) / KVH;
      const int64_t local = task - first_task[r], g = local / chunks, c = local % chunks;
      const int64_t start = c * kChunkTokens;
      const int64_t end = std::min<int64_t>(start + kChunkTokens, p.seq_lens[r]);
      const Partial part(parts.get() + task * part_floats, p.group);
      switch (p.group) {  // the common grouped-query shapes, compiled for their group size
        case 1: attend_chunk<1>(p, r, g, start, end, part); break;
        case 2: attend_chunk<2>(p, r, g, start, end, part); break;
        case 3: attend_chunk<3>(p, r, g, start, end, part); break;
        case 4: attend_chunk<4>(p, r, g, start, end, part); break;
        case 5: attend_chunk<5>(p, r, g, start, end, part); break;
        case 6: attend_chunk<6>(p, r, g, start, end, part); break;
        case 7: attend_chunk<7>(p, r, g, start, end, part); break;
        case 8: attend_chunk<8>(p, r, g, start, end, part); break;
        default: attend_chunk<0>(p, r, g, start, end, part); break;
      }
    }
  });
  // Merge each (request, KV head)'s chunks and normalise.
  auto out = torch::empty_like(q);
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t G = p.group;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t chunks = (first_task[r + 1] - first_task[r]) / KVH;
    for (int64_t g = 0; g < KVH; ++g) {
      float* first = parts.get() + (first_task[r] + g * chunks) * part_floats;
      for (int64_t j = 0; j < G; ++j) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c)
          m = std::max(m, Partial(first + c * part_floats, G).max[j]);
        float total = 0.f;
        float acc[kMaxDim] = {0.f};
        for (int64_t c = 0; c < chunks; ++c) {
          const Partial part(first + c * part_floats, G);
          const float w = std::exp(part.max[j] - m);
          total += part.sum[j] * w;
          for (int64_t d = 0; d < D; ++d) acc[d] += part.acc[j * D + d] * w;
        }
        at::BFloat16* dst = o + (r * H + g * G + j) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = at::BFloat16(acc[d] / total);
      }
    }
  }
  return out;
}
