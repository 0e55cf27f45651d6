// Paged decode attention, the part both element types share (paged_decode.cpp: bf16 on
// AVX-512; paged_decode_f32.cpp: float32 on AVX2): one query token per request, read
// straight from the paged K/V cache (no gathered copy), online softmax in float32.
//
// q [N, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D], all of one dtype, or
// int8 rows of D + 2 (kv_int8.h); block_tables [N, max_blocks] int32; seq_lens [N] int32
// -> out [N, H, D] in q's dtype.
// Query head h reads KV head h / (H / KVH).
//
// Why: a decode step's attention is little arithmetic, and the SDPA path spent it on a
// gather of each request's blocks, a padded mask and a kernel launch per layer. Here each
// task is one (request, KV head, chunk of the context): its H / KVH query heads walk the
// chunk's blocks together, so every K and V row is read once per step, and the context
// is split into chunks so that a single request still keeps every thread busy. Chunks
// are merged exactly through their log-sum-exp, as flash-decoding does.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and Python triple a file's build time
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace paged_decode {

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxGroup = 16;      // query heads per KV head
constexpr int64_t kChunkTokens = 256;  // context tokens per task

// One chunk's result for its G query heads, before normalisation: a view of its slice of
// one flat buffer (G maxima, G sums, G x D accumulators).
struct Partial {
  float* max;
  float* sum;
  float* acc;
  static int64_t floats(int64_t G, int64_t D) { return G * (D + 2); }
  Partial(float* base, int64_t G) : max(base), sum(base + G), acc(base + 2 * G) {}
  void clear(int64_t G, int64_t D) {
    std::fill(max, max + G, -std::numeric_limits<float>::infinity());
    std::fill(sum, sum + G, 0.f);
    std::fill(acc, acc + G * D, 0.f);
  }
};

// KV: the caches' element type, T's own or int8_t (rows of dim + 2: values, then scale).
template <typename T, typename KV = T>
struct Problem {
  const T* q;
  const KV *k, *v;
  const int32_t *tables, *seq_lens;
  int64_t heads, kv_heads, dim, group, block_size, max_blocks;
  float scale;
  int64_t row;  // elements per (token, KV head) row of the caches
};

// f(std::integral_constant<int, G>) for the common grouped-query shapes (query heads per
// KV head 1-8), compiled for their group size so that per-head accumulators live in
// registers; G = 0 (read p.group at run time) for the others.
template <typename F>
void with_group(int64_t group, F f) {
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

// The first key a query at position len - 1 attends: its last `window` keys (a sliding-window
// layer: transformers' mask keeps key k for query q when q - k < window), or all (window 0).
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// One task: request r's query heads on KV head g over context tokens [start, stop).
struct Task {
  int64_t r, g, start, stop;
};

// The order to run `tasks` in: those that start on the same cached block (requests that
// share a prefix, on one KV head) one after the other, so that the chunk's rows come from
// memory once and from the core's cache for the others. In request order, requests on two
// prefixes alternate and each prefix's rows (about 1 MB a layer for 500 tokens of a 1B
// model's float32 cache) fall out of L2 before the next request reads them. Order only: a
// task's arithmetic, and so the output, does not change.
template <typename T, typename KV>
std::vector<int64_t> shared_reads_first(const Problem<T, KV>& p, const std::vector<Task>& tasks) {
  std::vector<int64_t> order(tasks.size());
  std::vector<int64_t> key(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    const int64_t block = p.tables[t.r * p.max_blocks + t.start / p.block_size];
    key[i] = block * p.kv_heads + t.g;
    order[i] = int64_t(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  return order;
}

// Checks the arguments, runs attend(problem, request, KV head, begin, end, partial) on
// every (request, KV head, chunk) in parallel, and merges each request's chunks into out.
// `sinks` ([H] float32, gpt-oss' attention sinks): each head's sink logit joins the merge
// as one more term of the softmax's sum, with no value. `lanes`: the head_dim multiple
// the caller's vectors need.
template <typename T, typename KV = T, typename Attend>
torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, double scale, int64_t window,
                  const c10::optional<torch::Tensor>& sinks, int64_t lanes, Attend attend) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [N, H, D] and caches [blocks, block_size, KVH, D] expected");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == (kInt8 ? at::kChar : q.scalar_type()),
              "the caches must have q's dtype, or be int8 rows");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const int64_t row = k_cache.size(3);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup && row == D + (kInt8 ? 2 : 0),
              "head layout: H a multiple of KVH, at most 16 query heads per KV head, cache "
              "rows of head_dim (+ 2 bytes of scale for int8)");
  TORCH_CHECK(D % lanes == 0 && D <= kMaxDim, "head_dim must be a multiple of ", lanes,
              ", <= 256");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.size(0) == N && seq_lens.size(0) == N, "one row per query");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == H),
              "sinks must be [H] contiguous float32");
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const Problem<T, KV> p{q.data_ptr<T>(), static_cast<const KV*>(k_cache.data_ptr()),
                         static_cast<const KV*>(v_cache.data_ptr()),
                         block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         H, KVH, D, H / KVH, k_cache.size(1), block_tables.size(1),
                         static_cast<float>(scale), row};
  // Tasks: (request, KV head, chunk); a request's chunks are consecutive.
  std::vector<int64_t> first_task(N + 1, 0);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t len = p.seq_lens[r];
    TORCH_CHECK(len > 0 && len <= p.max_blocks * p.block_size, "seq_len out of range");
    const int64_t keys = len - first_key(len, window);
    first_task[r + 1] = first_task[r] + KVH * ((keys + kChunkTokens - 1) / kChunkTokens);
  }
  const int64_t part_floats = Partial::floats(p.group, D);
  std::unique_ptr<float[]> parts(new float[first_task[N] * part_floats]);  // not zeroed
  std::vector<Task> tasks(first_task[N]);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t chunks = (first_task[r + 1] - first_task[r]) / KVH;
    for (int64_t local = 0; local < first_task[r + 1] - first_task[r]; ++local) {
      const int64_t g = local / chunks, c = local % chunks;
      const int64_t start = first_key(p.seq_lens[r], window) + c * kChunkTokens;
      const int64_t stop = std::min<int64_t>(start + kChunkTokens, p.seq_lens[r]);
      tasks[first_task[r] + local] = {r, g, start, stop};
    }
  }
  const std::vector<int64_t> order = shared_reads_first(p, tasks);
  // Each thread a run of `order` of about equal keys (sorted by block, the short last chunks
  // of the requests come together: an equal count of tasks would leave one thread idle).
  std::vector<int64_t> keys_before(order.size() + 1, 0);
  for (size_t i = 0; i < order.size(); ++i)
    keys_before[i + 1] = keys_before[i] + tasks[order[i]].stop - tasks[order[i]].start + kChunkTokens / 16;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), order.size()));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    const auto at_share = [&](int64_t w) {
      return std::lower_bound(keys_before.begin(), keys_before.end() - 1,
                              keys_before.back() * w / workers) - keys_before.begin();
    };
    for (int64_t i = at_share(w0); i < at_share(w1); ++i) {
      const int64_t task = order[i];
      const Task& t = tasks[task];
      attend(p, t.r, t.g, t.start, t.stop, Partial(parts.get() + task * part_floats, p.group));
    }
  });
  // Merge each (request, KV head)'s chunks and normalise (in parallel: a step of prefill
  // rows holds hundreds).
  auto out = torch::empty_like(q);
  T* o = out.data_ptr<T>();
  const int64_t G = p.group;
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t chunks = (first_task[r + 1] - first_task[r]) / KVH;
      for (int64_t g = 0; g < KVH; ++g) {
        float* first = parts.get() + (first_task[r] + g * chunks) * part_floats;
        for (int64_t j = 0; j < G; ++j) {
          const int64_t h = g * G + j;
          float m = sink ? sink[h] : -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < chunks; ++c)
            m = std::max(m, Partial(first + c * part_floats, G).max[j]);
          float total = sink ? std::exp(sink[h] - m) : 0.f;
          float acc[kMaxDim] = {0.f};
          for (int64_t c = 0; c < chunks; ++c) {
            const Partial part(first + c * part_floats, G);
            const float w = std::exp(part.max[j] - m);
            total += part.sum[j] * w;
            for (int64_t d = 0; d < D; ++d) acc[d] += part.acc[j * D + d] * w;
          }
          T* dst = o + (r * H + h) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = T(acc[d] / total);
        }
      }
    }
  });
  return out;
}

}  // namespace paged_decode
