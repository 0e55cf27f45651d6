// A decode-only step's decoder layers in one call: the same kernels, in the same order, as
// `LlamaDecoderLayer.forward_fused` calls them from Python, so the result is bit for bit
// the same. Why: at a handful of rows the Python between the kernels (module calls,
// argument checks, 9 calls a layer) cost about a millisecond of a 5-6 ms step.
#include "decode_stack.h"

#include <stdexcept>

Projection::Projection(c10::optional<torch::Tensor> weight, c10::optional<torch::Tensor> scales,
                       c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias,
                       std::vector<torch::Tensor> ggml_blocks, std::vector<int64_t> ggml_types)
    : weight(std::move(weight)), scales(std::move(scales)), mins(std::move(mins)),
      bias(std::move(bias)), ggml_blocks(std::move(ggml_blocks)),
      ggml_types(std::move(ggml_types)) {
  TORCH_CHECK(!this->mins || this->scales, "int4 weights need scales and mins");
  TORCH_CHECK(this->ggml_blocks.size() == this->ggml_types.size(), "one ggml type per part");
  TORCH_CHECK(this->weight.has_value() != !this->ggml_blocks.empty(),
              "a projection has a dense weight or ggml blocks");
}

torch::Tensor Projection::operator()(const torch::Tensor& x) const {
  if (!ggml_blocks.empty()) {
    torch::Tensor y = ggml_linear(x, ggml_blocks, ggml_types);
    return bias ? y.add_(*bias) : y;
  }
#ifdef PAGEDSERVE_BF16_KERNELS
  if (mins) return int4_linear(x, *weight, *scales, *mins, bias);
  return skinny_linear(x, *weight, scales, bias);
#else
  throw std::invalid_argument("dense projections need a CPU with AVX512-BF16");
#endif
}

Experts::Experts(torch::Tensor router, std::vector<Projection> gate_up,
                 std::vector<Projection> down, int64_t top_k, bool norm_topk_prob)
    : router(std::move(router)), gate_up(std::move(gate_up)), down(std::move(down)),
      top_k(top_k), norm_topk_prob(norm_topk_prob) {
  TORCH_CHECK(this->gate_up.size() == this->down.size() &&
                  static_cast<int64_t>(this->gate_up.size()) == this->router.size(0),
              "a gate_up and a down projection per expert, one router row each");
  TORCH_CHECK(top_k >= 1 && top_k <= this->router.size(0), "top_k of 1 to the experts");
}

// Projections `used` of `ps`, each on its own rows: as each projection's own call would
// give them; where all are GGUF blocks, the calls in one parallel region (`ggml_linears`).
static std::vector<torch::Tensor> project_each(const std::vector<Projection>& ps,
                                               const std::vector<size_t>& used,
                                               const std::vector<torch::Tensor>& xs) {
  std::vector<torch::Tensor> ys;
  bool blocks = true;
  for (size_t e : used) blocks = blocks && !ps[e].ggml_blocks.empty();
  if (!blocks) {
    for (size_t i = 0; i < used.size(); ++i) ys.push_back(ps[used[i]](xs[i]));
    return ys;
  }
  std::vector<std::vector<torch::Tensor>> weights;
  std::vector<std::vector<int64_t>> types;
  for (size_t e : used) {
    weights.push_back(ps[e].ggml_blocks);
    types.push_back(ps[e].ggml_types);
  }
  ys = ggml_linears(xs, weights, types);
  for (size_t i = 0; i < used.size(); ++i)
    if (ps[used[i]].bias) ys[i].add_(*ps[used[i]].bias);
  return ys;
}

// Each token's top-k experts, then each chosen expert once on the tokens that chose it,
// its output weighted and added into theirs in ascending order of the experts.
torch::Tensor Experts::operator()(const torch::Tensor& x) const {
  const torch::Tensor probs = torch::softmax(torch::linear(x.to(torch::kFloat), router), -1);
  auto [weights, chosen] = torch::topk(probs, top_k, -1);
  if (norm_topk_prob) weights = weights / weights.sum({-1}, /*keepdim=*/true);
  weights = weights.to(x.scalar_type());
  const torch::Tensor flat = chosen.flatten();
  const torch::Tensor order = std::get<1>(flat.sort(c10::optional<bool>(true), 0));
  const torch::Tensor tokens = order.div(top_k, "floor");
  const torch::Tensor pair_weights = weights.flatten().index_select(0, order);
  const torch::Tensor counts = torch::bincount(flat, {}, router.size(0));
  const int64_t* count = counts.data_ptr<int64_t>();
  // The pairs' rows of x sorted by expert: each chosen expert's a contiguous run of them.
  const torch::Tensor sorted = x.index_select(0, tokens);
  std::vector<size_t> used;
  std::vector<torch::Tensor> xs;
  for (int64_t e = 0, start = 0; e < router.size(0); start += count[e++]) {
    if (!count[e]) continue;
    used.push_back(e);
    xs.push_back(sorted.narrow(0, start, count[e]));
  }
  std::vector<torch::Tensor> hidden = project_each(gate_up, used, xs);
  for (torch::Tensor& h : hidden) h = silu_mul(h);
  return moe_sum(project_each(down, used, hidden), tokens, pair_weights, x.size(0));
}

torch::Tensor DecoderLayer::mlp(const torch::Tensor& x) const {
  return experts ? (*experts)(x) : (*down)(silu_mul((*gate_up)(x)));
}

DecodeStack::DecodeStack(std::vector<DecoderLayer> layers, torch::Tensor final_norm,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

// The fused [T, (H + 2 KVH) * D] row with each head of q and k normed, v as it is: the
// calls `Attention._norm_qk` makes (engine/models/layers.py), so bit for bit the same.
static torch::Tensor norm_qk(const torch::Tensor& qkv, const DecoderLayer& layer, int64_t H,
                             int64_t KVH, int64_t D, double eps) {
  const int64_t T = qkv.size(0);
  const torch::Tensor heads = qkv.view({T, H + 2 * KVH, D});
  const auto none = c10::optional<torch::Tensor>();
  const torch::Tensor q =
      std::get<0>(add_rms_norm(heads.narrow(1, 0, H).reshape({-1, D}), none, *layer.q_norm, eps));
  const torch::Tensor k = std::get<0>(
      add_rms_norm(heads.narrow(1, H, KVH).reshape({-1, D}), none, *layer.k_norm, eps));
  return torch::cat({q.view({T, H, D}), k.view({T, KVH, D}), heads.narrow(1, H + KVH, KVH)}, 1)
      .view(qkv.sizes());
}

torch::Tensor DecodeStack::forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                                   const torch::Tensor& sin,
                                   const std::vector<KVCache>& kv_caches,
                                   const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens) const {
  const size_t n = layers_.size();
  TORCH_CHECK(kv_caches.size() == n, "one (K, V) cache per layer");
  const int64_t T = hidden.size(0);
  // The residual stream is carried apart from each layer's output (see forward_fused).
  torch::Tensor delta = hidden;
  c10::optional<torch::Tensor> residual;
  for (size_t i = 0; i < n; ++i) {
    const DecoderLayer& layer = layers_[i];
    torch::Tensor k_cache = kv_caches[i].first, v_cache = kv_caches[i].second;  // handles
    auto [x, stream] = add_rms_norm(delta, residual, layer.input_norm, eps_);
    torch::Tensor qkv = layer.qkv(x);
    if (layer.q_norm) qkv = norm_qk(qkv, layer, num_heads_, num_kv_heads_, head_dim_, eps_);
    const torch::Tensor q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                                          num_heads_, num_kv_heads_);
    const torch::Tensor attn =
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale_, 0);
    const torch::Tensor o = layer.o(attn.view({T, num_heads_ * head_dim_}));
    auto [y, stream2] = add_rms_norm(o, stream, layer.post_attention_norm, eps_);
    delta = layer.mlp(y);
    residual = stream2;
  }
  return std::get<0>(add_rms_norm(delta, residual, final_norm_, eps_));
}
