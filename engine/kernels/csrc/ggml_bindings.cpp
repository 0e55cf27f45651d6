// The GGUF kernels alone, for CPUs with AVX2 but not the AVX-512 module's instructions.
#include "ggml_quants.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("ggml_dequantize", &ggml_dequantize, "float32 (or bf16) weights of ggml blocks",
        py::arg("w"), py::arg("type"), py::arg("cols"), py::arg("ids") = py::none(),
        py::arg("out") = py::none(), nogil);
  m.def("ggml_linear", &ggml_linear, "x @ W^T on ggml blocks, int8 activations", py::arg("x"),
        py::arg("weights"), py::arg("types"), nogil);
  m.def("ggml_repack", &ggml_repack, "(blocks, type) in the layout ggml_linear reads fastest",
        py::arg("w"), py::arg("type"), py::arg("cols"), nogil);
}
