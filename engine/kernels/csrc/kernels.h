// The kernels' entry points, shared by the Python bindings and the decode stack.
//
// Two builds (engine/kernels/__init__.py): on CPUs with AVX512-BF16 every file, with
// PAGEDSERVE_BF16_KERNELS defined; elsewhere (AVX2) the GGUF kernels and the float32 ops
// alone. The layer ops below take float32 or bf16 and run the kernel for that dtype
// (dispatch.cpp); bf16 in the AVX2 build is an error.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and Python triple a file's build time

#include <tuple>

// --- by dtype (dispatch.cpp) ---
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window,
    const c10::optional<torch::Tensor>& sinks = c10::nullopt);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const c10::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, torch::Tensor& k_cache,
                            torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
// out[t] = the sum, in the pairs' order, of y[p] * weights[p] over the pairs of token t
// (tokens[p] == t; ys: the pairs' rows, expert by expert), each product rounded to the
// rows' dtype, the sum in float32 (moe_sum.cpp).
torch::Tensor moe_sum(const std::vector<torch::Tensor>& ys, const torch::Tensor& tokens,
                      const torch::Tensor& weights, int64_t num_tokens);

// --- float32, AVX2 (fused_ops_f32.cpp, paged_decode_f32.cpp) ---
torch::Tensor paged_decode_attention_f32(const torch::Tensor& q, const torch::Tensor& k_cache,
                                         const torch::Tensor& v_cache,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& seq_lens, double scale,
                                     int64_t window,
    const c10::optional<torch::Tensor>& sinks);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_f32(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& weight, double eps);
torch::Tensor rope_write_kv_f32(const torch::Tensor& qkv, const torch::Tensor& cos,
                                const torch::Tensor& sin, torch::Tensor& k_cache,
                                torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul_f32(const torch::Tensor& gate_up);

// --- Gated DeltaNet (gated_delta_net.cpp): float32 or bf16 activations, both builds ---
torch::Tensor gated_delta_decode(const torch::Tensor& mixed_qkv, const torch::Tensor& g,
                                 const torch::Tensor& beta, const torch::Tensor& conv_weight,
                                 torch::Tensor& conv_states, torch::Tensor& states,
                                 const torch::Tensor& slots, int64_t num_k_heads);

#ifdef PAGEDSERVE_BF16_KERNELS
// --- bf16 and int8/int4 weights, AVX-512 (skinny_gemm.cpp, fused_ops.cpp, paged_decode.cpp,
// token_bitmask.cpp) ---
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& scales,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor dequantize_int4(const torch::Tensor& packed, const torch::Tensor& scales,
                              const torch::Tensor& mins);
torch::Tensor paged_decode_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache,
                                          const torch::Tensor& block_tables,
                                          const torch::Tensor& seq_lens, double scale,
                                     int64_t window,
    const c10::optional<torch::Tensor>& sinks);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& weight, double eps);
torch::Tensor rope_write_kv_bf16(const torch::Tensor& qkv, const torch::Tensor& cos,
                                 const torch::Tensor& sin, torch::Tensor& k_cache,
                                 torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                 int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up);
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& bitmask,
                          const std::vector<int64_t>& rows);
#endif
