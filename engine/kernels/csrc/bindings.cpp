// The CPU kernels as one Python module (engine/kernels/__init__.py builds and loads it).
#include <torch/extension.h>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they let go of the GIL, so the server's event
  // loop (streaming the last step's tokens) runs while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("skinny_linear", &skinny_linear, "y = x @ weight.T (+ bias) for a few rows of x", nogil);
  m.def("int4_linear", &int4_linear, "y = x @ W.T (+ bias) for a few rows of x, int4 W", nogil);
  m.def("dequantize_int4", &dequantize_int4, "the bf16 [N, K] weight of int4 blocks", nogil);
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per request against the paged bf16 KV cache", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x), bf16", nogil);
  m.def("rope_write_kv", &rope_write_kv, "rotary q/k of a fused QKV row, k/v to the cache", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up row, bf16", nogil);
}
