// A decode-only step's decoder layers in one call: the same kernels, in the same order, as
// `LlamaDecoderLayer.forward_fused` calls them from Python, so the result is bit for bit
// the same. Why: at a handful of rows the Python between the kernels (module calls,
// argument checks, 9 calls a layer) cost about a millisecond of a 5-6 ms step.
//
// Qwen3.5's layers (float32 activations: its GGUFs on CPUs without AVX512-BF16) run here too:
// its Gated DeltaNet layers (`LinearAttention`) and its full-attention layers' output gate,
// (1 + w) q/k norms (the weights baked as float32 1 + w by engine/decode_stack.py: exact) and
// partial rotary (`attention_inputs`). Its Python layers run torch's ops (the native layer
// ops compute neither), so here (`torch_ops`) the norms, activations and gates are the same
// ATen calls from C++, the rest the same kernels: bit for bit the Python layers' result
// (tests/engine/test_qwen35_stack.py), without the Python between ~40 small ops a layer.
#include "decode_stack.h"

#include "kv_int8.h"

#include <cmath>
#include <stdexcept>

namespace {

void check_f32(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be contiguous float32");
}

}  // namespace

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
  // float32 weights (a GGUF's F32 tensors): torch's matmul, as `project` calls it
  if (weight->scalar_type() == at::kFloat) return torch::linear(x, *weight, bias);
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

LinearAttention::LinearAttention(Projection in_proj, Projection out_proj,
                                 torch::Tensor conv_weight, torch::Tensor neg_exp_a,
                                 torch::Tensor dt_bias, torch::Tensor norm, int64_t num_k_heads,
                                 int64_t num_v_heads, int64_t head_v_dim, double eps)
    : in_proj(std::move(in_proj)), out_proj(std::move(out_proj)),
      conv_weight(conv_weight.contiguous()), neg_exp_a(neg_exp_a.contiguous()),
      dt_bias(dt_bias.contiguous()), norm(norm.contiguous()), num_k_heads(num_k_heads),
      num_v_heads(num_v_heads), head_v_dim(head_v_dim), eps(eps) {
  for (const torch::Tensor* t : {&this->neg_exp_a, &this->dt_bias, &this->norm})
    check_f32(*t, "A, dt_bias and the gated norm's weight");
  TORCH_CHECK(this->neg_exp_a.numel() == num_v_heads && this->dt_bias.numel() == num_v_heads &&
                  this->norm.numel() == head_v_dim && this->conv_weight.dim() == 2,
              "A, dt_bias [Hv], norm [Dv], conv_weight [C, K]");
}

// x * rsqrt(ms + eps) * w, row by row, as torch's ops round it: ms [T, 1] the rows' mean
// square from torch (its order of the sum); then each step one IEEE rounding, as the ops'
// (rsqrt is 1 / sqrt in ATen, and the build's -ffp-contract=off keeps the products apart).
// w [D], or with z [T, D] (a view): ((w (x r)) silu(z)) in place of (x r) w.
static torch::Tensor scale_rows(const torch::Tensor& x, const torch::Tensor& ms,
                                const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  const int64_t D = x.size(-1), T = x.numel() / D;
  torch::Tensor out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *mp = ms.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  for (int64_t t = 0; t < T; ++t) {
    const float r = 1.f / std::sqrt(mp[t] + feps);
    const float* a = xp + t * D;
    float* o = op + t * D;
    for (int64_t i = 0; i < D; ++i) o[i] = (a[i] * r) * wp[i];
  }
  return out;
}

// torch's RMSNorm as the Python layers' op set computes it (`TorchOps.add_rms_norm` with
// `rms_norm_plus_one`, the weight baked as 1 + w; float32): the residual add and the mean
// square in torch's ops, the rest in `scale_rows`: the same bits.
static std::tuple<torch::Tensor, torch::Tensor> torch_add_rms_norm(
    const torch::Tensor& delta, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& weight, double eps) {
  const torch::Tensor stream = (residual ? *residual + delta : delta).contiguous();
  const torch::Tensor ms = stream.pow(2).mean({-1}, /*keepdim=*/true);
  return {scale_rows(stream, ms, weight, eps), stream};
}

// What `GatedDeltaNet.forward` computes for a step of decodes, in the same ops (torch's,
// and the native conv + delta-rule step `gdn_decode` calls), so the same bits: beta =
// sigmoid(b), g = -exp(A) softplus(a + dt_bias), the step on the rows' slots, each value
// head's RMSNorm times w times silu(z) (`_gated_norm`), out_proj.
torch::Tensor LinearAttention::operator()(const torch::Tensor& x, torch::Tensor& conv_states,
                                          torch::Tensor& states,
                                          const torch::Tensor& slots) const {
  const int64_t T = x.size(0), Hv = num_v_heads, Dv = head_v_dim, V = Hv * Dv;
  const int64_t C = conv_weight.size(0);
  const torch::Tensor proj = in_proj(x);  // [T, C | V (z) | Hv (b) | Hv (a)]
  check_f32(proj, "the linear attention's input projection");
  TORCH_CHECK(proj.size(1) == C + V + 2 * Hv, "in_proj must give [T, C + V + 2 Hv]");
  const torch::Tensor z = proj.narrow(1, C, V), b = proj.narrow(1, C + V, Hv);
  const torch::Tensor a = proj.narrow(1, C + V + Hv, Hv);
  const torch::Tensor beta = b.sigmoid().contiguous();
  const torch::Tensor g = (neg_exp_a * at::softplus(a + dt_bias)).contiguous();
  const torch::Tensor core = gated_delta_decode(proj.narrow(1, 0, C).contiguous(), g, beta,
                                                conv_weight, conv_states, states, slots,
                                                num_k_heads);  // [T, Hv, Dv]
  // w (x rsqrt(mean(x^2) + eps)) silu(z), each value head: w times (x r) is (x r) times w
  const torch::Tensor xw = scale_rows(core, core.pow(2).mean({-1}, /*keepdim=*/true), norm, eps);
  const torch::Tensor out = xw * at::silu(z.reshape({-1, Hv, Dv}));
  return out_proj(out.reshape({T, V}));
}

torch::Tensor DecoderLayer::mlp(const torch::Tensor& x, bool torch_ops) const {
  if (experts) return (*experts)(x);
  const torch::Tensor h = (*gate_up)(x);
  if (!torch_ops) return (*down)(silu_mul(h));
  const int64_t I = h.size(-1) / 2;  // `TorchOps.silu_mul`
  return (*down)(at::silu(h.narrow(-1, 0, I)) * h.narrow(-1, I, I));
}

DecodeStack::DecodeStack(std::vector<DecoderLayer> layers, torch::Tensor final_norm,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale, bool output_gate, bool torch_ops)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      output_gate_(output_gate), torch_ops_(torch_ops) {
  TORCH_CHECK(!output_gate || torch_ops, "the attention's output gate runs in torch_ops mode");
  for (const DecoderLayer& layer : layers_)
    TORCH_CHECK(layer.linear.has_value() != (layer.qkv.has_value() && layer.o.has_value()),
                "a layer has the attention's qkv and o projections or a linear attention");
}

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

// Qwen3.5's attention inputs, float32, as `Attention.forward` computes them with torch's
// ops (`_split_gate`, `_norm_qk`, `TorchOps.rope_write_kv`), so the same bits: from the
// projection [T, (H (x2 where gated) + 2 KVH) D] (where gated, each q head followed by its
// gate), each q and k head RMS-normed by q_norm and k_norm where the layer has them, rotated
// on its first R dims (R: cos's width; `apply_rotary`: x cos + rotate_half(x) sin, each
// product rounded, no FMA: the build's -ffp-contract=off), k and v written to their cache
// slots (float32, or int8 rows: kv_int8.h); returns q [T, H, D], and where gated the gates
// [T, H D] in `gate`.
static torch::Tensor attention_inputs(const torch::Tensor& proj, const DecoderLayer& layer,
                                      const torch::Tensor& cos, const torch::Tensor& sin,
                                      torch::Tensor& k_cache, torch::Tensor& v_cache,
                                      const torch::Tensor& slot_mapping, int64_t H, int64_t KVH,
                                      int64_t D, double eps, bool gated, torch::Tensor& gate) {
  check_f32(proj, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t T = proj.size(0), QH = gated ? 2 * H : H, R = cos.size(1), half = R / 2;
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t row_len = int8 ? D + kv_int8::kScaleBytes : D;
  TORCH_CHECK(proj.size(1) == (QH + 2 * KVH) * D, "qkv must be [T, (H (x2 gated) + 2 KVH) D]");
  TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && R % 2 == 0 && R <= D,
              "cos and sin must be [T, R], R even, at most head_dim");
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || int8) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == KVH &&
                  k_cache.size(3) == row_len && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [blocks, block_size, KVH, D] float32, or int8 "
              "[blocks, block_size, KVH, D + 2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T &&
                  slot_mapping.is_contiguous(), "slot_mapping must be [T] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  // q and k heads [T, heads, D], normed as `_norm_qk` norms them (rows of D)
  const torch::Tensor heads = proj.view({T, QH + 2 * KVH, D});
  torch::Tensor qs = gated ? heads.narrow(1, 0, QH).view({T, H, 2 * D}).narrow(2, 0, D)
                           : heads.narrow(1, 0, H);
  torch::Tensor ks = heads.narrow(1, QH, KVH);
  if (gated) gate = heads.narrow(1, 0, QH).view({T, H, 2 * D}).narrow(2, D, D).reshape({T, H * D});
  const auto none = c10::optional<torch::Tensor>();
  if (layer.q_norm) qs = std::get<0>(torch_add_rms_norm(qs.reshape({-1, D}), none, *layer.q_norm, eps));
  if (layer.k_norm) ks = std::get<0>(torch_add_rms_norm(ks.reshape({-1, D}), none, *layer.k_norm, eps));
  qs = qs.reshape({T, H, D}).contiguous();
  ks = ks.reshape({T, KVH, D}).contiguous();
  torch::Tensor q = torch::empty({T, H, D}, proj.options());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row_bytes = row_len * k_cache.element_size();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + t * R;
    const float* s = sin.data_ptr<float>() + t * R;
    auto rotate = [&](const float* y, float* dst) {
      for (int64_t i = 0; i < R; ++i) {
        const float r = i < half ? -y[i + half] : y[i - half];  // rotate_half
        dst[i] = y[i] * c[i] + r * s[i];
      }
      for (int64_t i = R; i < D; ++i) dst[i] = y[i];
    };
    for (int64_t h = 0; h < H; ++h)
      rotate(qs.data_ptr<float>() + (t * H + h) * D, q.data_ptr<float>() + (t * H + h) * D);
    float rotated[512];
    TORCH_CHECK(D <= 512, "head_dim at most 512");
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = (slots[t] * KVH + h) * row_bytes;
      const float* k = ks.data_ptr<float>() + (t * KVH + h) * D;
      const float* v = proj.data_ptr<float>() + t * proj.size(1) + (QH + KVH + h) * D;
      if (int8) {
        rotate(k, rotated);
        kv_int8::quantize_row(rotated, D, reinterpret_cast<int8_t*>(kc + at));
        kv_int8::quantize_row(v, D, reinterpret_cast<int8_t*>(vc + at));
      } else {
        rotate(k, reinterpret_cast<float*>(kc + at));
        std::copy(v, v + D, reinterpret_cast<float*>(vc + at));
      }
    }
  }
  return q;
}

torch::Tensor DecodeStack::forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                                   const torch::Tensor& sin,
                                   const std::vector<KVCache>& kv_caches,
                                   const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens,
                                   const c10::optional<torch::Tensor>& state_slots) const {
  const size_t n = layers_.size();
  TORCH_CHECK(kv_caches.size() == n, "one (K, V) cache per layer");
  const int64_t T = hidden.size(0);
  // The residual stream is carried apart from each layer's output (see forward_fused).
  torch::Tensor delta = hidden;
  c10::optional<torch::Tensor> residual;
  // The model's norm: the native op, or torch's where its Python layers run torch's ops.
  const auto norm = [&](const torch::Tensor& x, const c10::optional<torch::Tensor>& res,
                        const torch::Tensor& w) {
    return torch_ops_ ? torch_add_rms_norm(x, res, w, eps_) : add_rms_norm(x, res, w, eps_);
  };
  for (size_t i = 0; i < n; ++i) {
    const DecoderLayer& layer = layers_[i];
    torch::Tensor k_cache = kv_caches[i].first, v_cache = kv_caches[i].second;  // handles
    auto [x, stream] = norm(delta, residual, layer.input_norm);
    torch::Tensor o;
    if (layer.linear) {  // (k_cache, v_cache: its conv and recurrent state pools)
      TORCH_CHECK(state_slots, "linear-attention layers need the rows' state slots");
      o = (*layer.linear)(x, k_cache, v_cache, *state_slots);
    } else {
      torch::Tensor qkv = (*layer.qkv)(x), q, gate;
      if (torch_ops_) {  // Qwen3.5's
        q = attention_inputs(qkv, layer, cos, sin, k_cache, v_cache, slot_mapping, num_heads_,
                             num_kv_heads_, head_dim_, eps_, output_gate_, gate);
      } else {
        if (layer.q_norm) qkv = norm_qk(qkv, layer, num_heads_, num_kv_heads_, head_dim_, eps_);
        q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads_,
                          num_kv_heads_);
      }
      torch::Tensor attn =
          paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale_, 0)
              .view({T, num_heads_ * head_dim_});
      o = (*layer.o)(gate.defined() ? attn * gate.sigmoid() : attn);
    }
    auto [y, stream2] = norm(o, stream, layer.post_attention_norm);
    delta = layer.mlp(y, torch_ops_);
    residual = stream2;
  }
  return std::get<0>(norm(delta, residual, final_norm_));
}
