// The CPU kernels as one Python module (engine/kernels/__init__.py builds and loads it).
#include <torch/extension.h>

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& scales,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y = x @ weight.T (+ bias) for a few rows of x");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per request against the paged bf16 KV cache");
}
