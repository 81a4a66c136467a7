// The Python module: every entry point of the kernel files, under the names Python calls.

#include <torch/extension.h>

#include "glassformer.h"

namespace gf = glassformer;

// The products and steps run without the GIL: another Python thread (a server's event loop)
// goes on while a step computes. Arguments are converted before and results after.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear_f32", &gf::linear_f32, NoGil(), "y = x @ W^T (+ bias), W float32 (N, K)");
  module.def("linear_bf16", &gf::linear_bf16, NoGil(), "y = x @ W^T (+ bias), W bfloat16 (N, K)");
  module.def("linear_q8", &gf::linear_q8, NoGil(), "y = x @ W^T (+ bias), W int8 blocks of 32");
  module.def("linear_q4", &gf::linear_q4, NoGil(), "y = x @ W^T (+ bias), W 4-bit blocks of 32 with min");
  // module_local: the native and the AVX2 builds may be loaded side by side (tests)
  pybind11::class_<gf::DecodeStep>(module, "DecodeStep", pybind11::module_local())
      .def(pybind11::init<std::vector<int64_t>, bool, bool, bool, int64_t, double,
                          std::vector<torch::Tensor>, std::vector<int64_t>, gf::Bias>())
      .def("step", &gf::DecodeStep::step, NoGil(), "one token through every layer (decode_step.cpp)")
      .def("step_paged", &gf::DecodeStep::step_paged, NoGil(),
           "one token of each of B sequences through every layer, caches in a paged pool");
  module.def("dequantize", &gf::dequantize, "q8 (mins None) or q4 blocks -> (N, K) float32");
  module.def("try_f32", &gf::try_f32, NoGil(), "linear_f32 for a small batch, else None");
  module.def("try_bf16", &gf::try_bf16, NoGil(), "linear_bf16 for a small batch, else None");
  module.def("try_q8", &gf::try_q8, NoGil(), "linear_q8 for a small batch of K features, else None");
  module.def("try_q4", &gf::try_q4, NoGil(), "linear_q4 for a small batch of K features, else None");
  module.def("rms_norm_forward", &gf::rms_norm_forward, "RMSNorm rows: (y, 1/rms) (train_ops.cpp)");
  module.def("rms_norm_backward", &gf::rms_norm_backward, "RMSNorm gradients (dx, dw)");
  module.def("layer_norm_forward", &gf::layer_norm_forward, "LayerNorm rows: (y, mean, 1/std)");
  module.def("layer_norm_backward", &gf::layer_norm_backward, "LayerNorm gradients (dx, dw, db)");
  module.def("rms_norm", &gf::rms_norm, "RMSNorm on the last dimension, a C++ autograd node");
  module.def("layer_norm", &gf::layer_norm, "LayerNorm on the last dimension, a C++ autograd node");
  module.def("rotary", &gf::rotary, "rope(x, cos, sin) as a C++ autograd node");
  module.def("swiglu", &gf::swiglu, "silu(g) u for h = [g | u], a C++ autograd node");
  module.def("gelu", &gf::gelu, "exact GELU, a C++ autograd node");
  module.def("clip_grad_norm", &gf::clip_grad_norm, "clip_grad_norm_ in place: the total norm");
  module.def("newton_schulz", &gf::newton_schulz, "Muon's iterations, float32, a matrix per task");
  module.def("muon_update", &gf::muon_update, NoGil(), "Muon's step in place, float32, a matrix per task");
  module.def("rope", &gf::rope, "rotary embedding of (B, H, T, D), inverse: the backward pass");
  module.def("swiglu_forward", &gf::swiglu_forward, "silu(g) u for h = [g | u] (R, 2F)");
  module.def("swiglu_backward", &gf::swiglu_backward, "SwiGLU gradient [dg | du] (R, 2F)");
  module.def("gelu_forward", &gf::gelu_forward, "x Φ(x), exact GELU, contiguous float32");
  module.def("gelu_backward", &gf::gelu_backward, "GELU gradient dy (Φ(x) + x φ(x))");
  module.def("attention_forward", &gf::attention_forward, "softmax(scale q k^T) v: (out, lse)");
  module.def("attention_backward", &gf::attention_backward, "its gradients (dq, dk, dv)");
  module.def("attention", &gf::attention, "attention_forward as a C++ autograd node");
  module.def("transpose", &gf::transpose, "(M, K) -> contiguous (K, M), float32");
  module.def("argmax_rows", &gf::argmax_rows, NoGil(), "torch.argmax(logits, -1) of (R, V) float32");
  module.attr("SMALL_BATCH") = gf::kSmallBatch;
}
