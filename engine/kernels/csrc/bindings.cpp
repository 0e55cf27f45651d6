// The CPU kernels as one Python module (engine/kernels/__init__.py builds and loads it): every
// kernel where PAGEDSERVE_BF16_KERNELS is defined (AVX512-BF16), else the GGUF kernels and
// the float32 layer ops and decode stack (AVX2).
#include <torch/extension.h>

#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they let go of the GIL, so the server's event
  // loop (streaming the last step's tokens) runs while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
#ifdef PAGEDSERVE_BF16_KERNELS
  m.def("skinny_linear", &skinny_linear, "y = x @ weight.T (+ bias) for a few rows of x", nogil);
  m.def("int4_linear", &int4_linear, "y = x @ W.T (+ bias) for a few rows of x, int4 W", nogil);
  m.def("dequantize_int4", &dequantize_int4, "the bf16 [N, K] weight of int4 blocks", nogil);
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "logits[row, t] = -inf where bit t of bitmask[row] is 0, for the given rows", nogil);
#endif
  // float32 or bf16 (bf16 where PAGEDSERVE_BF16_KERNELS is defined)
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per request against the paged KV cache (its last `window` keys "
        "when window > 0; `sinks` [H] float32: each head's sink logit in its softmax)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("sinks") = py::none(), nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)", nogil);
  m.def("rope_write_kv", &rope_write_kv, "rotary q/k of a fused QKV row, k/v to the cache", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up row", nogil);
  m.def("moe_sum", &moe_sum, "a mixture of experts' weighted sum of each token's pairs",
        py::arg("ys"), py::arg("tokens"), py::arg("weights"), py::arg("num_tokens"), nogil);

  m.def("gated_delta_decode", &gated_delta_decode,
        "one Gated DeltaNet decode step per request on its slots of the conv and state pools",
        py::arg("mixed_qkv"), py::arg("g"), py::arg("beta"), py::arg("conv_weight"),
        py::arg("conv_states"), py::arg("states"), py::arg("slots"), py::arg("num_k_heads"),
        nogil);

  m.def("ggml_dequantize", &ggml_dequantize, "float32 (or bf16) weights of ggml blocks",
        py::arg("w"), py::arg("type"), py::arg("cols"), py::arg("ids") = py::none(),
        py::arg("out") = py::none(), nogil);
  m.def("ggml_linear", &ggml_linear, "x @ W^T on ggml blocks, int8 activations", py::arg("x"),
        py::arg("weights"), py::arg("types"), nogil);
  m.def("ggml_linears", &ggml_linears, "several ggml_linear calls in one parallel region",
        py::arg("xs"), py::arg("weights"), py::arg("types"), nogil);
  m.def("ggml_repack", &ggml_repack, "(blocks, type) in the layout ggml_linear reads fastest",
        py::arg("w"), py::arg("type"), py::arg("cols"), nogil);

  // module_local: a second build of this module (another environment, a benchmark's
  // A/B copy) can be loaded next to this one.
  py::class_<Projection>(m, "Projection", py::module_local())
      .def(py::init<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<int64_t>>(),
           py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
           py::arg("ggml_blocks") = std::vector<torch::Tensor>(),
           py::arg("ggml_types") = std::vector<int64_t>());
  py::class_<Experts>(m, "Experts", py::module_local())
      .def(py::init<torch::Tensor, std::vector<Projection>, std::vector<Projection>, int64_t,
                    bool>(),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"),
           py::arg("norm_topk_prob"));
  py::class_<LinearAttention>(m, "LinearAttention", py::module_local())
      .def(py::init<Projection, Projection, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, int64_t, int64_t, int64_t, double>(),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("conv_weight"), py::arg("neg_exp_a"),
           py::arg("dt_bias"), py::arg("norm"), py::arg("num_k_heads"), py::arg("num_v_heads"),
           py::arg("head_v_dim"), py::arg("eps"));
  py::class_<DecoderLayer>(m, "DecoderLayer", py::module_local())
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<Projection>,
                    c10::optional<Projection>, c10::optional<Projection>,
                    c10::optional<Projection>, c10::optional<Experts>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<LinearAttention>>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("experts") = py::none(),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("linear") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<DecoderLayer>, torch::Tensor, int64_t, int64_t, int64_t, double,
                    double, bool, bool>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("output_gate") = false, py::arg("torch_ops") = false)
      .def("forward", &DecodeStack::forward, "a decode-only step's layers and final norm",
           py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("state_slots") = py::none(), nogil);
}
