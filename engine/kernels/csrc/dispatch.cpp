// The layer ops by dtype (kernels.h): float32 to the AVX2 kernels, bf16 to the AVX-512 ones
// where this build has them.
#include "kernels.h"

#include <stdexcept>

namespace {

bool is_f32(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 expected, got ", x.scalar_type());
  return x.scalar_type() == at::kFloat;
}

}  // namespace

#ifdef PAGEDSERVE_BF16_KERNELS
#define BF16(call) return call
#else
#define BF16(call) throw std::invalid_argument("bfloat16 kernels need a CPU with AVX512-BF16")
#endif

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window, const c10::optional<torch::Tensor>& sinks) {
  if (is_f32(q))
    return paged_decode_attention_f32(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                      sinks);
  BF16(paged_decode_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                   sinks));
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const c10::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps) {
  if (is_f32(x)) return add_rms_norm_f32(x, residual, weight, eps);
  BF16(add_rms_norm_bf16(x, residual, weight, eps));
}

torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, torch::Tensor& k_cache,
                            torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t num_heads, int64_t num_kv_heads) {
  if (is_f32(qkv))
    return rope_write_kv_f32(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                             num_kv_heads);
  BF16(rope_write_kv_bf16(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                          num_kv_heads));
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  if (is_f32(gate_up)) return silu_mul_f32(gate_up);
  BF16(silu_mul_bf16(gate_up));
}
