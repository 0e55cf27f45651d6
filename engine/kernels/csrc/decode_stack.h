// See decode_stack.cpp.
#pragma once

#include "ggml_quants.h"
#include "kernels.h"

#include <utility>
#include <vector>

// One projection as `engine.models.linear.Linear` packs it: bf16, int8 (+ scales), int4
// (+ scales and mins), or a GGUF's blocks (one tensor and ggml type per fused part, no
// dense weight), with an optional bias.
struct Projection {
  c10::optional<torch::Tensor> weight, scales, mins, bias;
  std::vector<torch::Tensor> ggml_blocks;
  std::vector<int64_t> ggml_types;
  Projection(c10::optional<torch::Tensor> weight, c10::optional<torch::Tensor> scales,
             c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias,
             std::vector<torch::Tensor> ggml_blocks, std::vector<int64_t> ggml_types);
  torch::Tensor operator()(const torch::Tensor& x) const;
};

// A mixture of experts in place of the MLP (Qwen3-MoE): the float32 router [experts,
// hidden] and each expert's projections; the calls `SparseMoE.forward` makes
// (engine/models/moe.py), so bit for bit the same.
struct Experts {
  torch::Tensor router;
  std::vector<Projection> gate_up, down;
  int64_t top_k;
  bool norm_topk_prob;
  Experts(torch::Tensor router, std::vector<Projection> gate_up, std::vector<Projection> down,
          int64_t top_k, bool norm_topk_prob);
  torch::Tensor operator()(const torch::Tensor& x) const;
};

// A Gated DeltaNet layer in place of the attention (Qwen3.5's linear attention): the calls
// `GatedDeltaNet.forward` makes at a decode step (engine/models/linear_attention.py), float32
// activations: the fused input projection, beta and g, the conv and delta-rule step on the
// requests' state slots (`gated_delta_decode`), the gated RMSNorm, the output projection.
struct LinearAttention {
  Projection in_proj, out_proj;
  torch::Tensor conv_weight;  // [C, K], the activations' dtype
  torch::Tensor neg_exp_a;    // [Hv] float32: -exp(A_log), as torch computes it
  torch::Tensor dt_bias;      // [Hv] float32
  torch::Tensor norm;         // [Dv] float32: the gated norm's weight (w, not 1 + w)
  int64_t num_k_heads, num_v_heads, head_v_dim;
  double eps;
  LinearAttention(Projection in_proj, Projection out_proj, torch::Tensor conv_weight,
                  torch::Tensor neg_exp_a, torch::Tensor dt_bias, torch::Tensor norm,
                  int64_t num_k_heads, int64_t num_v_heads, int64_t head_v_dim, double eps);
  // x [T, hidden], one decode token per row; conv_states, states: the layer's pools; slots
  // [T] int64: each row's slot -> [T, hidden]
  torch::Tensor operator()(const torch::Tensor& x, torch::Tensor& conv_states,
                           torch::Tensor& states, const torch::Tensor& slots) const;
};

struct DecoderLayer {
  torch::Tensor input_norm, post_attention_norm;
  // The attention's projections, or none where `linear` takes the attention's place.
  c10::optional<Projection> qkv, o;
  // The MLP: dense (gate_up and down) or a mixture of experts.
  c10::optional<Projection> gate_up, down;
  c10::optional<Experts> experts;
  // Qwen3's per-head RMSNorms of q and k, before rotary (both or neither).
  c10::optional<torch::Tensor> q_norm, k_norm;
  c10::optional<LinearAttention> linear;
  // torch_ops: silu(gate) * up in torch's ops (`TorchOps.silu_mul`), not the fused op
  torch::Tensor mlp(const torch::Tensor& x, bool torch_ops = false) const;
};

// A layer's (K, V) cache, as the model runner holds them; a linear-attention layer's
// (conv states, recurrent states) pools in its place.
using KVCache = std::pair<torch::Tensor, torch::Tensor>;

class DecodeStack {
 public:
  DecodeStack(std::vector<DecoderLayer> layers, torch::Tensor final_norm, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              bool output_gate = false, bool torch_ops = false);
  // hidden: the step's embedded tokens [T, hidden], each a row of the paged attention
  // (a decode, or one token of a short query with its own context length); cos, sin:
  // [T, rotary_dim] (rotary_dim < head_dim: partial rotary); state_slots [T]: each row's
  // state slot, for linear-attention layers (every row then a request's one decode token)
  // -> the final-normed hidden states [T, hidden].
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                        const torch::Tensor& sin, const std::vector<KVCache>& kv_caches,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens,
                        const c10::optional<torch::Tensor>& state_slots) const;

 private:
  std::vector<DecoderLayer> layers_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  // Each query head followed by its output gate in the q rows: the attention's output
  // times sigmoid(gate) (Qwen3.5's full-attention layers).
  bool output_gate_;
  // The model's Python layers run torch's ops (`TorchOps`: Qwen3.5's), not the native layer
  // ops: the norms, silu and the attention's inputs then in the same ATen ops, so the same
  // bits.
  bool torch_ops_;
};
