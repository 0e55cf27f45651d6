// A mixture of experts' weighted sum: each token's output is its chosen experts' outputs,
// each times the router's weight for it, added up. torch's `index_add_` does this with one
// dispatch per pair and, for bf16, a scalar loop (138 us a layer of a batch-1 step of
// Qwen3-MoE, more than the experts' arithmetic); here it is one pass, parallel over tokens.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

template <typename T>
float as_float(T v) {
  return static_cast<float>(v);
}

// A product as torch's mul rounds it: to y's dtype (round to nearest even for bf16).
template <typename T>
float rounded(float v) {
  return static_cast<float>(T(v));
}

template <typename T>
torch::Tensor sum_pairs(const std::vector<torch::Tensor>& ys, const int64_t* tokens,
                        const T* weights, int64_t num_tokens, int64_t H) {
  // The pairs' rows, and each token's pairs in the pairs' order (a counting sort).
  std::vector<const T*> rows;
  for (const torch::Tensor& y : ys)
    for (int64_t r = 0; r < y.size(0); ++r) rows.push_back(y.data_ptr<T>() + r * H);
  const int64_t P = static_cast<int64_t>(rows.size());
  std::vector<int64_t> first(num_tokens + 1, 0), pairs(P);
  for (int64_t p = 0; p < P; ++p) ++first[tokens[p] + 1];
  for (int64_t t = 0; t < num_tokens; ++t) first[t + 1] += first[t];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < P; ++p) pairs[next[tokens[p]]++] = p;
  torch::Tensor out = torch::empty({num_tokens, H}, ys[0].options());
  T* o = out.data_ptr<T>();
  at::parallel_for(0, num_tokens, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = first[t]; i < first[t + 1]; ++i) {
        const int64_t p = pairs[i];
        const T* y = rows[p];
        const float w = as_float(weights[p]);
        for (int64_t h = 0; h < H; ++h) acc[h] += rounded<T>(as_float(y[h]) * w);
      }
      for (int64_t h = 0; h < H; ++h) o[t * H + h] = T(acc[h]);
    }
  });
  return out;
}

}  // namespace

torch::Tensor moe_sum(const std::vector<torch::Tensor>& ys, const torch::Tensor& tokens,
                      const torch::Tensor& weights, int64_t num_tokens) {
  TORCH_CHECK(!ys.empty(), "at least one expert's rows");
  const auto dtype = ys[0].scalar_type();
  const int64_t H = ys[0].size(1);
  int64_t P = 0;
  for (const torch::Tensor& y : ys) {
    TORCH_CHECK(y.dim() == 2 && y.size(1) == H && y.scalar_type() == dtype && y.is_contiguous(),
                "each expert's rows a contiguous [n, H] tensor of one dtype");
    P += y.size(0);
  }
  TORCH_CHECK(tokens.scalar_type() == torch::kLong && tokens.numel() == P && tokens.is_contiguous(),
              "a token id per pair");
  TORCH_CHECK(weights.scalar_type() == dtype && weights.numel() == P && weights.is_contiguous(),
              "a weight per pair, in the rows' dtype");
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(t[p] >= 0 && t[p] < num_tokens, "token id out of range");
  if (dtype == torch::kFloat)
    return sum_pairs<float>(ys, t, weights.data_ptr<float>(), num_tokens, H);
  TORCH_CHECK(dtype == torch::kBFloat16, "float32 or bfloat16 rows");
  return sum_pairs<at::BFloat16>(ys, t, weights.data_ptr<at::BFloat16>(), num_tokens, H);
}
