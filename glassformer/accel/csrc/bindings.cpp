// The Python module: every entry point of the kernel files, under the names Python calls.

#include <omp.h>
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
  // module_local: the native and the AVX2 builds may be loaded side by side (tests). The
  // enumerators are bound by their names, the names Python knows them by.
  pybind11::enum_<gf::WeightFormat>(module, "WeightFormat", pybind11::module_local())
      .value("fp32", gf::WeightFormat::fp32).value("bf16", gf::WeightFormat::bf16)
      .value("int8", gf::WeightFormat::int8).value("int4", gf::WeightFormat::int4)
      .value("q4_k", gf::WeightFormat::q4_k).value("q5_k", gf::WeightFormat::q5_k)
      .value("q6_k", gf::WeightFormat::q6_k).value("q3_k", gf::WeightFormat::q3_k)
      .value("q5_0", gf::WeightFormat::q5_0).value("q5_1", gf::WeightFormat::q5_1);
  pybind11::enum_<gf::Norm>(module, "Norm", pybind11::module_local())
      .value("layernorm", gf::Norm::layernorm).value("rmsnorm", gf::Norm::rmsnorm);
  pybind11::enum_<gf::Activation>(module, "Activation", pybind11::module_local())
      .value("relu", gf::Activation::relu).value("gelu", gf::Activation::gelu)
      .value("gelu_tanh", gf::Activation::gelu_tanh).value("silu", gf::Activation::silu);
  pybind11::enum_<gf::QkNorm>(module, "QkNorm", pybind11::module_local())
      .value("none", gf::QkNorm::none).value("head", gf::QkNorm::head).value("all", gf::QkNorm::all);
  pybind11::class_<gf::DecodeConfig>(module, "DecodeConfig", pybind11::module_local())
      .def(pybind11::init<>())
      .def_readwrite("d_model", &gf::DecodeConfig::d_model)
      .def_readwrite("n_heads", &gf::DecodeConfig::n_heads)
      .def_readwrite("n_kv_heads", &gf::DecodeConfig::n_kv_heads)
      .def_readwrite("d_head", &gf::DecodeConfig::d_head)
      .def_readwrite("d_ff", &gf::DecodeConfig::d_ff)
      .def_readwrite("windows", &gf::DecodeConfig::windows)
      .def_readwrite("norm", &gf::DecodeConfig::norm)
      .def_readwrite("norm_offset", &gf::DecodeConfig::norm_offset)
      .def_readwrite("qk_norm", &gf::DecodeConfig::qk_norm)
      .def_readwrite("activation", &gf::DecodeConfig::activation)
      .def_readwrite("gated", &gf::DecodeConfig::gated)
      .def_readwrite("rope", &gf::DecodeConfig::rope)
      .def_readwrite("rope_kinds", &gf::DecodeConfig::rope_kinds)
      .def_readwrite("rotary_dim", &gf::DecodeConfig::rotary_dim)
      .def_readwrite("parallel", &gf::DecodeConfig::parallel)
      .def_readwrite("norm_eps", &gf::DecodeConfig::norm_eps)
      .def_readwrite("score_scale", &gf::DecodeConfig::score_scale)
      .def_readwrite("softcap", &gf::DecodeConfig::softcap);
  pybind11::class_<gf::NormWeights>(module, "NormWeights", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, gf::Bias>(), pybind11::arg("weight"), pybind11::arg("bias"));
  pybind11::class_<gf::LinearWeights>(module, "LinearWeights", pybind11::module_local())
      .def(pybind11::init<gf::WeightFormat, std::vector<torch::Tensor>, gf::Bias,
                          std::vector<gf::LinearWeights>>(),
           pybind11::arg("format"), pybind11::arg("tensors"), pybind11::arg("bias"),
           pybind11::arg("parts") = std::vector<gf::LinearWeights>{});
  using Norm = std::optional<gf::NormWeights>;  // None: the block has no such norm
  pybind11::class_<gf::LayerWeights>(module, "LayerWeights", pybind11::module_local())
      .def(pybind11::init<Norm, gf::LinearWeights, gf::LinearWeights, Norm, gf::LinearWeights,
                          gf::LinearWeights, Norm, Norm, Norm, Norm>(),
           pybind11::arg("norm1"), pybind11::arg("qkv"), pybind11::arg("out"),
           pybind11::arg("norm2"), pybind11::arg("up"), pybind11::arg("down"),
           pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("attn_out_norm"),
           pybind11::arg("mlp_out_norm"));
  pybind11::class_<gf::LoRAUpdate>(module, "LoRAUpdate", pybind11::module_local())
      .def(pybind11::init<>())
      .def(pybind11::init<torch::Tensor, std::vector<int64_t>, std::vector<torch::Tensor>>(),
           pybind11::arg("down"), pybind11::arg("starts"), pybind11::arg("ups"));
  pybind11::class_<gf::LoRALayer>(module, "LoRALayer", pybind11::module_local())
      .def(pybind11::init<gf::LoRAUpdate, gf::LoRAUpdate, gf::LoRAUpdate, gf::LoRAUpdate>(),
           pybind11::arg("qkv"), pybind11::arg("out"), pybind11::arg("up"), pybind11::arg("down"));
  // held by a shared pointer: a step's list of adapters passes pointers, not copies
  pybind11::class_<gf::AdapterWeights, std::shared_ptr<gf::AdapterWeights>>(
      module, "AdapterWeights", pybind11::module_local())
      .def(pybind11::init<std::vector<gf::LoRALayer>>(), pybind11::arg("layers"));
  pybind11::class_<gf::DecodeStep>(module, "DecodeStep", pybind11::module_local())
      .def(pybind11::init<gf::DecodeConfig, std::vector<gf::LayerWeights>, gf::Bias>(),
           pybind11::arg("config"), pybind11::arg("layers"), pybind11::arg("alibi_slopes"))
      .def("step", &gf::DecodeStep::step, NoGil(), "one token through every layer (decode_step.cpp)")
      .def("step_paged", &gf::DecodeStep::step_paged, NoGil(),
           "one token of each of B sequences through every layer, caches in a paged pool, "
           "each row with its LoRA adapter or none");
  module.def("dequantize", &gf::dequantize, "q8 (mins None) or q4 blocks -> (N, K) float32");
  module.def("linear_gguf", &gf::linear_gguf, NoGil(),
             "y = x @ W^T (+ bias), W rows of GGUF blocks (q4_k, q5_k, q6_k, q5_0, q5_1)");
  module.def("dequantize_gguf", &gf::dequantize_gguf, NoGil(), "rows of GGUF blocks -> (N, K) float32");
  module.def("try_f32", &gf::try_f32, NoGil(), "linear_f32 for a small batch, else None");
  module.def("try_bf16", &gf::try_bf16, NoGil(), "linear_bf16 for a small batch, else None");
  module.def("try_q8", &gf::try_q8, NoGil(), "linear_q8 for a small batch of K features, else None");
  module.def("try_q4", &gf::try_q4, NoGil(), "linear_q4 for a small batch of K features, else None");
  module.def("rms_norm", &gf::rms_norm, "RMSNorm on the last dimension, a C++ autograd node");
  module.def("layer_norm", &gf::layer_norm, "LayerNorm on the last dimension, a C++ autograd node");
  module.def("rotary", &gf::rotary, "rope(x, cos, sin) as a C++ autograd node");
  module.def("swiglu", &gf::swiglu, "silu(g) u for h = [g | u], a C++ autograd node");
  module.def("gelu", &gf::gelu, "exact GELU, a C++ autograd node");
  module.def("clip_grad_norm", &gf::clip_grad_norm, "clip_grad_norm_ in place: the total norm");
  module.def("newton_schulz", &gf::newton_schulz, "Muon's iterations, float32, a matrix per task");
  module.def("muon_update", &gf::muon_update, NoGil(), "Muon's step in place, float32, a matrix per task");
  module.def("attention", &gf::attention, "attention_forward as a C++ autograd node");
  module.def("transpose", &gf::transpose, "(M, K) -> contiguous (K, M), float32");
  module.def("release_thread_pool", [] { return omp_pause_resource_all(omp_pause_soft) == 0; },
             "end the worker threads of the calling thread's OpenMP team (they return at its "
             "next parallel region); false where the runtime refused");
  module.def("argmax_rows", &gf::argmax_rows, NoGil(), "torch.argmax(logits, -1) of (R, V) float32");
}
