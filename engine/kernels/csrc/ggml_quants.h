// The GGUF block kernels' entry points (ggml_quants.cpp), in both builds of the module
// (bindings.cpp); the decode stack calls them for a GGUF's projections.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and Python triple a file's build time

#include <tuple>
#include <vector>

// The [rows, cols] weights of ggml blocks (rows of `w`, or only rows `ids`), exact, in
// float32 or into `out` (float32, or bf16 rounded from them).
torch::Tensor ggml_dequantize(torch::Tensor w, int64_t type, int64_t cols,
                              c10::optional<torch::Tensor> ids, c10::optional<torch::Tensor> out);
// y[M, sum of rows] = x[M, K] @ [W_0; W_1; ...]^T on int8-quantized x; y in x's dtype.
torch::Tensor ggml_linear(torch::Tensor x, std::vector<torch::Tensor> weights,
                          std::vector<int64_t> types);
// Several `ggml_linear` calls (x[i] through weights[i] of types[i]) in one parallel region,
// each output the same as its own call's.
std::vector<torch::Tensor> ggml_linears(const std::vector<torch::Tensor>& xs,
                                        const std::vector<std::vector<torch::Tensor>>& weights,
                                        const std::vector<std::vector<int64_t>>& types);
// The blocks in the layout `ggml_linear` reads fastest, and that layout's type id: Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K and Q6_K of a multiple of 8 rows regrouped 8 rows at a time (ids
// of our own).
std::tuple<torch::Tensor, int64_t> ggml_repack(torch::Tensor w, int64_t type, int64_t cols);
