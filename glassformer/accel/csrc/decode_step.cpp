// One decode step of a pre-norm decoder, every layer in C++: no Python between the products.
//
// For one sequence and one new token at position `pos`, each layer computes
//   h = norm1(x);  q, k, v = split(W_qkv h);  q, k = rope(q, k)
//   cache[pos] = k, v;  a_i = softmax_t(q_i · k_t / sqrt(d_head) [- slope_i (pos - t)]) · v_t
//   x += W_o a;  h = norm2(x);  x += W_down act(W_up h)   (gated: act(gate) * up)
// exactly as glassformer/model/layers/*.py do for one row; Python (accel/fast_decode.py)
// embeds the token before and applies the final norm and head after.

#include <cmath>
#include <cstring>

#include "glassformer.h"

namespace glassformer {
namespace {

// The tensors each format stores: (weight), (qweight, scales), (qweight, scales, mins).
int tensors_of(WeightFormat format) {
  switch (format) {
    case WeightFormat::fp32:
    case WeightFormat::bf16: return 1;
    case WeightFormat::int8: return 2;
    case WeightFormat::int4: return 3;
  }
  TORCH_CHECK(false, "decode step: unknown weight format ", static_cast<int>(format));
}

WeightFormat weight_format(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 3, "decode step: unknown weight format ", code);
  return static_cast<WeightFormat>(code);
}

}  // namespace

torch::Tensor LinearWeights::operator()(const torch::Tensor& x) const {
  switch (format) {
    case WeightFormat::fp32: return linear_f32(x, tensors[0], bias);
    case WeightFormat::bf16: return linear_bf16(x, tensors[0], bias);
    case WeightFormat::int8: return linear_q8(x, tensors[0], tensors[1], bias);
    case WeightFormat::int4: return linear_q4(x, tensors[0], tensors[1], tensors[2], bias);
  }
  TORCH_CHECK(false, "decode step: unknown weight format ", static_cast<int>(format));
}

DecodeStep::DecodeStep(std::vector<int64_t> sizes, bool rmsnorm, bool gated, bool rope,
                       int64_t activation, double eps, std::vector<torch::Tensor> tensors,
                       std::vector<int64_t> layout, Bias alibi_slopes)
    : d_(sizes[0]), heads_(sizes[1]), kv_heads_(sizes[2]), d_head_(sizes[3]), d_ff_(sizes[4]),
      window_(sizes[5]), rmsnorm_(rmsnorm), gated_(gated), rope_(rope),
      activation_(activation), eps_(static_cast<float>(eps)), alibi_(alibi_slopes) {
  // layout, per layer: [norm has bias] then for each of qkv, out, up, down: [format, has bias];
  // tensors follow in the same order (norm1 w [b], norm2 w [b], then each linear's tensors).
  size_t t = 0, i = 0;
  while (i < layout.size()) {
    LayerWeights layer;
    const bool norm_bias = layout[i++];
    for (NormWeights* norm : {&layer.norm1, &layer.norm2}) {
      norm->weight = tensors.at(t++);
      if (norm_bias) norm->bias = tensors.at(t++);
    }
    for (LinearWeights* lin : {&layer.qkv, &layer.out, &layer.up, &layer.down}) {
      lin->format = weight_format(layout.at(i++));
      const bool has_bias = layout.at(i++);
      for (int j = 0; j < tensors_of(lin->format); ++j) lin->tensors.push_back(tensors.at(t++));
      if (has_bias) lin->bias = tensors.at(t++);
    }
    layers_.push_back(std::move(layer));
  }
  TORCH_CHECK(t == tensors.size(), "decode step: ", tensors.size() - t, " unused tensors");
}

torch::Tensor DecodeStep::step(torch::Tensor x, int64_t pos, const torch::Tensor& cos,
                   const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                   const std::vector<torch::Tensor>& values) {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
              "decode step: one cache tensor per layer");
  x = x.contiguous().clone();  // (1, d): updated in place layer by layer
  auto h = torch::empty_like(x);  // (1, d)
  auto context = torch::empty({1, heads_ * d_head_}, x.options());  // (1, H·d_head)
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& layer = layers_[l];
    normalize(x, layer.norm1, h);
    auto qkv = layer.qkv(h);  // (1, (H + 2 KV) d_head)
    float* q = qkv.data_ptr<float>();
    float* k = q + heads_ * d_head_;
    float* v = k + kv_heads_ * d_head_;
    if (rope_) {
      rotate(q, heads_, cos.data_ptr<float>(), sin.data_ptr<float>());
      rotate(k, kv_heads_, cos.data_ptr<float>(), sin.data_ptr<float>());
    }
    store(keys[l], values[l], k, v, pos);
    attend(q, keys[l], values[l], pos, context.data_ptr<float>());
    x.add_(layer.out(context));
    normalize(x, layer.norm2, h);
    x.add_(layer.down(activate(layer.up(h))));
  }
  return x;
}

void DecodeStep::normalize(const torch::Tensor& x, const NormWeights& norm,
                           torch::Tensor& out) const {
  const float* a = x.data_ptr<float>();
  const float* w = norm.weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  double mean = 0.0, square = 0.0;
  for (int64_t i = 0; i < d_; ++i) {
    mean += a[i];
    square += static_cast<double>(a[i]) * a[i];
  }
  mean /= d_;
  const double variance = rmsnorm_ ? square / d_ : square / d_ - mean * mean;
  const float inv = static_cast<float>(1.0 / std::sqrt(variance + eps_));
  const float centre = rmsnorm_ ? 0.f : static_cast<float>(mean);
  const float* b = norm.bias ? norm.bias->data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < d_; ++i) y[i] = (a[i] - centre) * inv * w[i] + (b ? b[i] : 0.f);
}

void DecodeStep::rotate(float* x, int64_t n_heads, const float* cos, const float* sin) const {
  const int64_t half = d_head_ / 2;
  for (int64_t head = 0; head < n_heads; ++head) {
    float* r = x + head * d_head_;
    for (int64_t i = 0; i < half; ++i) {
      const float a = r[i], b = r[i + half];
      r[i] = a * cos[i] - b * sin[i];
      r[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

void DecodeStep::store(const torch::Tensor& keys, const torch::Tensor& values, const float* k,
           const float* v, int64_t pos) const {
  const int64_t S = keys.size(2);
  TORCH_CHECK(pos < S, "decode step: position ", pos, " is past the cache (", S, ")");
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  for (int64_t g = 0; g < kv_heads_; ++g) {
    std::memcpy(kc + (g * S + pos) * d_head_, k + g * d_head_, d_head_ * sizeof(float));
    std::memcpy(vc + (g * S + pos) * d_head_, v + g * d_head_, d_head_ * sizeof(float));
  }
}

void DecodeStep::attend(const float* q, const torch::Tensor& keys, const torch::Tensor& values,
            int64_t pos, float* context) const {
  const int64_t S = keys.size(2), n_rep = heads_ / kv_heads_;
  const int64_t first = window_ > 0 ? std::max<int64_t>(0, pos - window_ + 1) : 0;
  const float scale = 1.f / std::sqrt(static_cast<float>(d_head_));
  const float* kc = keys.data_ptr<float>();
  const float* vc = values.data_ptr<float>();
  const float* slopes = alibi_ ? alibi_->data_ptr<float>() : nullptr;
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t head = 0; head < heads_; ++head) {
    const float* qh = q + head * d_head_;
    const int64_t g = head / n_rep;
    std::vector<float> p(pos - first + 1);
    float top = -INFINITY;
    for (int64_t t = first; t <= pos; ++t) {
      const float* kt = kc + (g * S + t) * d_head_;
      float s = dot(qh, kt, d_head_) * scale;
      if (slopes) s -= slopes[head] * static_cast<float>(pos - t);
      p[t - first] = s;
      top = std::max(top, s);
    }
    float total = 0.f;
    for (float& s : p) total += (s = std::exp(s - top));
    float* out = context + head * d_head_;
    std::fill(out, out + d_head_, 0.f);
    for (int64_t t = first; t <= pos; ++t) {
      const float* vt = vc + (g * S + t) * d_head_;
      const float w = p[t - first] / total;
      for (int64_t i = 0; i < d_head_; ++i) out[i] += w * vt[i];
    }
  }
}

torch::Tensor DecodeStep::activate(torch::Tensor up) const {
  const int64_t width = gated_ ? 2 * d_ff_ : d_ff_;
  TORCH_CHECK(up.size(1) == width, "decode step: feed-forward width ", up.size(1));
  float* u = up.data_ptr<float>();
  auto hidden = gated_ ? torch::empty({1, d_ff_}, up.options()) : up;  // (1, d_ff)
  float* y = hidden.data_ptr<float>();
  for (int64_t i = 0; i < d_ff_; ++i) {
    const float a = u[i];
    float f;
    switch (activation_) {
      case 0: f = a > 0.f ? a : 0.f; break;
      case 1: f = 0.5f * a * (1.f + std::erf(a * static_cast<float>(M_SQRT1_2))); break;
      case 2: f = 0.5f * a * (1.f + std::tanh(0.7978845608f * (a + 0.044715f * a * a * a))); break;
      default: f = a / (1.f + std::exp(-a)); break;
    }
    y[i] = gated_ ? f * u[d_ff_ + i] : f;
  }
  return hidden;
}

}  // namespace glassformer
