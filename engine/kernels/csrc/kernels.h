// The kernels' entry points, shared by the Python bindings and the decode stack.
#pragma once

#include <torch/extension.h>

#include <tuple>

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& scales,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor dequantize_int4(const torch::Tensor& packed, const torch::Tensor& scales,
                              const torch::Tensor& mins);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale);

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const c10::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, torch::Tensor& k_cache,
                            torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& bitmask,
                          const std::vector<int64_t>& rows);
