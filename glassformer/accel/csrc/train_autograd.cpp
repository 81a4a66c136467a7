// RMSNorm, LayerNorm, rotary embeddings, SwiGLU, GELU and attention for training as autograd
// functions written in C++, around the passes of train_ops.cpp and attention_train.cpp.
//
// A Python autograd function costs tens of microseconds a call on each pass (its context, and
// the engine taking the GIL to run its backward), more than ATen's LayerNorm spends on a small
// model's rows. These nodes are C++ through and through: the backward pass never enters Python.

#include <torch/autograd.h>

#include "glassformer.h"

namespace glassformer {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, const Bias& b, double eps) {
    const auto rows = x.reshape({-1, x.size(-1)}).contiguous();  // (R, d)
    // y (R, d), mu (R), r (R)
    auto out = glassformer::layer_norm_forward(rows, w, b ? *b : torch::Tensor(), eps);
    ctx->save_for_backward({rows, w, out[1], out[2]});
    ctx->saved_data["has_bias"] = b.has_value();
    return out[0].view(x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& rows = saved[0];
    const auto g = grads[0].reshape(rows.sizes()).contiguous();  // (R, d)
    auto out = glassformer::layer_norm_backward(g, rows, saved[1], saved[2], saved[3],
                                                ctx->saved_data["has_bias"].toBool());
    return {out[0].view(grads[0].sizes()), out[1], out[2], torch::Tensor()};
  }
};

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, double eps) {
    const auto rows = x.reshape({-1, x.size(-1)}).contiguous();  // (R, d)
    auto out = glassformer::rms_norm_forward(rows, w, eps);       // y (R, d), 1/rms (R)
    ctx->save_for_backward({rows, w, out[1]});
    return out[0].view(x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto g = grads[0].reshape(saved[0].sizes()).contiguous();  // (R, d)
    auto out = glassformer::rms_norm_backward(g, saved[0], saved[1], saved[2]);
    return {out[0].view(grads[0].sizes()), out[1], torch::Tensor()};
  }
};

struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return glassformer::rope(x, cos, sin, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto g = grads[0].stride(-1) == 1 ? grads[0] : grads[0].contiguous();
    return {glassformer::rope(g, saved[0], saved[1], true), torch::Tensor(), torch::Tensor()};
  }
};

struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h) {
    const auto rows = h.reshape({-1, h.size(-1)}).contiguous();  // (R, 2F)
    ctx->save_for_backward({rows});
    auto shape = h.sizes().vec();
    shape.back() /= 2;
    return glassformer::swiglu_forward(rows).view(shape);  // (..., F)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto rows = ctx->get_saved_variables()[0];
    const auto g = grads[0].reshape({rows.size(0), -1}).contiguous();  // (R, F)
    auto shape = grads[0].sizes().vec();
    shape.back() *= 2;
    return {glassformer::swiglu_backward(g, rows).view(shape)};
  }
};

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, bool causal,
                               double scale) {
    auto out = glassformer::attention_forward(q, k, v, causal, scale);  // (B, H, T, D), (B, H, T)
    ctx->save_for_backward({q, k, v, out[0], out[1]});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return out[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto g = grads[0].stride(-1) == 1 ? grads[0] : grads[0].contiguous();
    auto d = glassformer::attention_backward(g, s[0], s[1], s[2], s[3], s[4],
                                             ctx->saved_data["causal"].toBool(),
                                             ctx->saved_data["scale"].toDouble());
    return {d[0], d[1], d[2], torch::Tensor(), torch::Tensor()};
  }
};

struct GeluFunction : public torch::autograd::Function<GeluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x) {
    const auto input = x.contiguous();
    ctx->save_for_backward({input});
    return glassformer::gelu_forward(input);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {glassformer::gelu_backward(grads[0].contiguous(), ctx->get_saved_variables()[0])};
  }
};

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& w, const Bias& b,
                         double eps) {
  return LayerNormFunction::apply(x, w, b, eps);
}

torch::Tensor gelu(const torch::Tensor& x) { return GeluFunction::apply(x); }

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return RmsNormFunction::apply(x, w, eps);
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return RotaryFunction::apply(x, cos, sin);
}

torch::Tensor swiglu(const torch::Tensor& h) { return SwiGluFunction::apply(h); }

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double scale) {
  return AttentionFunction::apply(q, k, v, causal, scale);
}

}  // namespace glassformer
