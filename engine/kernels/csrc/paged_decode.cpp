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

// Attention of request r's query heads on KV head g over context tokens [begin, end).
void attend_chunk(const Problem& p, int64_t r, int64_t g, int64_t begin, int64_t end,
                  Partial out) {
  const int64_t D = p.dim, G = p.group, vecs = D / kLanes;
  const int64_t row_stride = p.kv_heads * D, block_stride = p.block_size * row_stride;
  __m512 q[kMaxGroup][kMaxDim / kLanes];
  const at::BFloat16* qr = p.q + (r * p.heads + g * G) * D;
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t j = 0; j < G; ++j)
    for (int64_t c = 0; c < vecs; ++c)
      q[j][c] = _mm512_mul_ps(load_bf16(qr + j * D + c * kLanes), scale);
  for (int64_t j = 0; j < G; ++j) {
    out.max[j] = -std::numeric_limits<float>::infinity();
    out.sum[j] = 0.f;
    std::fill(out.acc + j * D, out.acc + (j + 1) * D, 0.f);
  }
  const int32_t* table = p.tables + r * p.max_blocks;
  alignas(64) float scores[kMaxGroup][kLanes];
  // Walk the chunk 16 keys at a time (a block may hold more or fewer: index by token).
  for (int64_t t0 = begin; t0 < end; t0 += kLanes) {
    const int64_t n = std::min(kLanes, end - t0);
    const at::BFloat16* krow[kLanes];
    const at::BFloat16* vrow[kLanes];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tok = t0 + t;
      const int64_t base = int64_t(table[tok / p.block_size]) * block_stride +
                           (tok % p.block_size) * row_stride + g * D;
      krow[t] = p.k + base;
      vrow[t] = p.v + base;
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 kv[kMaxDim / kLanes];
      for (int64_t c = 0; c < vecs; ++c) kv[c] = load_bf16(krow[t] + c * kLanes);
      for (int64_t j = 0; j < G; ++j) {
        __m512 dot = _mm512_mul_ps(q[j][0], kv[0]);
        for (int64_t c = 1; c < vecs; ++c) dot = _mm512_fmadd_ps(q[j][c], kv[c], dot);
        scores[j][t] = _mm512_reduce_add_ps(dot);
      }
    }
    const __mmask16 valid = n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    alignas(64) float probs[kMaxGroup][kLanes];
    for (int64_t j = 0; j < G; ++j) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores[j]);
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
    for (int64_t c = 0; c < vecs; ++c) {
      __m512 acc[kMaxGroup];
      for (int64_t j = 0; j < G; ++j) acc[j] = _mm512_loadu_ps(out.acc + j * D + c * kLanes);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 vv = load_bf16(vrow[t] + c * kLanes);
        for (int64_t j = 0; j < G; ++j)
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[j][t]), vv, acc[j]);
      }
      for (int64_t j = 0; j < G; ++j) _mm512_storeu_ps(out.acc + j * D + c * kLanes, acc[j]);
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
      attend_chunk(p, r, g, start, std::min<int64_t>(start + kChunkTokens, p.seq_lens[r]),
                   Partial(parts.get() + task * part_floats, p.group));
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
