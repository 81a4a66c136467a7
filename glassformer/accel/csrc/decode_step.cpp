// One decode step of a pre-norm decoder, every layer in C++: no Python between the products.
//
// For one sequence and one new token at position `pos`, each layer computes
//   h = norm1(x);  q, k, v = split(W_qkv h);  q, k = rope(q, k)
//   cache[pos] = k, v;  a_i = softmax_t(q_i · k_t / sqrt(d_head) [- slope_i (pos - t)]) · v_t
//   x += W_o a;  h = norm2(x);  x += W_down act(W_up h)   (gated: act(gate) * up)
// exactly as glassformer/model/layers/*.py do for one row; Python (accel/fast_decode.py)
// embeds the token before and applies the final norm and head after. step_paged does the
// same for one new token of each of B sequences, their caches in a paged pool (the serving
// engine's): each row with its own position and block table, never mixed with another row.

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
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "decode step: x must be (1, d)");
  for (size_t l = 0; l < layers_.size(); ++l) {
    TORCH_CHECK(pos < keys[l].size(2) && pos < values[l].size(2), "decode step: position ",
                pos, " is past the cache (", keys[l].size(2), ")");
  }
  auto view_of = [&](size_t l, int64_t) {  // (1, KV, S, d_head): heads S tokens apart
    const int64_t S = keys[l].size(2);
    return KVView{keys[l].data_ptr<float>(), values[l].data_ptr<float>(), S * d_head_, d_head_,
                  nullptr};
  };
  return layers(x, &pos, rope_ ? cos.data_ptr<float>() : nullptr,
                rope_ ? sin.data_ptr<float>() : nullptr, view_of);
}

torch::Tensor DecodeStep::step_paged(torch::Tensor x, const torch::Tensor& positions,
                                     const torch::Tensor& slots, const torch::Tensor& cos,
                                     const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& keys,
                                     const std::vector<torch::Tensor>& values) {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
              "decode step: one pool tensor per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == d_, "decode step: x must be (B, d_model)");
  const int64_t B = x.size(0);
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == B, "decode step: positions must be (B,) int64");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.size(0) == B, "decode step: slots must be (B, S) int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* table = slots.data_ptr<int64_t>();
  const int64_t S = slots.size(1);
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (const auto* t : {&keys[l], &values[l]}) {
      TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 &&
                      t->size(1) == kv_heads_ && t->size(2) == d_head_,
                  "decode step: the pool must be float32 (slots, KV, d_head) per layer");
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < S, "decode step: position ", pos[b], " is past the "
                "slot table (", S, ")");
    for (int64_t t = 0; t <= pos[b]; ++t) {
      TORCH_CHECK(table[b * S + t] >= 0 && table[b * S + t] < keys[0].size(0),
                  "decode step: slot ", table[b * S + t], " is outside the pool");
    }
  }
  if (rope_) {
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * d_head_ &&
                    sin.numel() == B * d_head_, "decode step: cos, sin must be (B, d_head)");
  }
  auto view_of = [&](size_t l, int64_t b) {  // (slots, KV, d_head): heads d_head apart
    return KVView{keys[l].data_ptr<float>(), values[l].data_ptr<float>(), d_head_,
                  kv_heads_ * d_head_, table + b * S};
  };
  return layers(x, pos, rope_ ? cos.data_ptr<float>() : nullptr,
                rope_ ? sin.data_ptr<float>() : nullptr, view_of);
}

// Every layer for the B rows of x; row b at position pos[b], its angles at cos + b * d_head,
// its cache in layer l at view_of(l, b).
template <typename ViewOf>
torch::Tensor DecodeStep::layers(torch::Tensor x, const int64_t* pos, const float* cos,
                                 const float* sin, ViewOf view_of) {
  const int64_t B = x.size(0), width = (heads_ + 2 * kv_heads_) * d_head_;
  x = x.contiguous().clone();  // (B, d): updated in place layer by layer
  auto h = torch::empty_like(x);  // (B, d)
  auto context = torch::empty({B, heads_ * d_head_}, x.options());  // (B, H·d_head)
  std::vector<KVView> views(B);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& layer = layers_[l];
    normalize(x, layer.norm1, h);
    auto qkv = layer.qkv(h);  // (B, (H + 2 KV) d_head)
    for (int64_t b = 0; b < B; ++b) {
      float* q = static_cast<float*>(qkv.data_ptr()) + b * width;
      float* k = q + heads_ * d_head_;
      float* v = k + kv_heads_ * d_head_;
      if (rope_) {
        rotate(q, heads_, cos + b * d_head_, sin + b * d_head_);
        rotate(k, kv_heads_, cos + b * d_head_, sin + b * d_head_);
      }
      views[b] = view_of(l, b);
      store(views[b], k, v, pos[b]);
    }
    const float* q0 = static_cast<float*>(qkv.data_ptr());
    float* c0 = static_cast<float*>(context.data_ptr());
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
    for (int64_t i = 0; i < B * heads_; ++i) {
      const int64_t b = i / heads_, head = i % heads_;
      attend(q0 + b * width + head * d_head_, views[b], head, pos[b],
             c0 + b * heads_ * d_head_ + head * d_head_);
    }
    x.add_(layer.out(context));
    normalize(x, layer.norm2, h);
    x.add_(layer.down(activate(layer.up(h))));
  }
  return x;
}

void DecodeStep::normalize(const torch::Tensor& x, const NormWeights& norm,
                           torch::Tensor& out) const {
  const float* w = norm.weight.data_ptr<float>();
  const float* b = norm.bias ? norm.bias->data_ptr<float>() : nullptr;
  for (int64_t row = 0; row < x.size(0); ++row) {
    const float* a = x.data_ptr<float>() + row * d_;
    float* y = out.data_ptr<float>() + row * d_;
    double mean = 0.0, square = 0.0;
    for (int64_t i = 0; i < d_; ++i) {
      mean += a[i];
      square += static_cast<double>(a[i]) * a[i];
    }
    mean /= d_;
    const double variance = rmsnorm_ ? square / d_ : square / d_ - mean * mean;
    const float inv = static_cast<float>(1.0 / std::sqrt(variance + eps_));
    const float centre = rmsnorm_ ? 0.f : static_cast<float>(mean);
    for (int64_t i = 0; i < d_; ++i) y[i] = (a[i] - centre) * inv * w[i] + (b ? b[i] : 0.f);
  }
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

void DecodeStep::store(const KVView& kv, const float* k, const float* v, int64_t pos) const {
  for (int64_t g = 0; g < kv_heads_; ++g) {
    std::memcpy(kv.keys + kv.offset(g, pos), k + g * d_head_, d_head_ * sizeof(float));
    std::memcpy(kv.values + kv.offset(g, pos), v + g * d_head_, d_head_ * sizeof(float));
  }
}

// One query head over its sequence's tokens first..pos: softmax(q · k_t / sqrt(d_head)
// [- slope (pos - t)]) · v_t into out (d_head).
void DecodeStep::attend(const float* q, const KVView& kv, int64_t head, int64_t pos,
                        float* out) const {
  const int64_t first = window_ > 0 ? std::max<int64_t>(0, pos - window_ + 1) : 0;
  const int64_t g = head / (heads_ / kv_heads_);
  const float scale = 1.f / std::sqrt(static_cast<float>(d_head_));
  const float slope = alibi_ ? alibi_->data_ptr<float>()[head] : 0.f;
  std::vector<float> p(pos - first + 1);
  float top = -INFINITY;
  for (int64_t t = first; t <= pos; ++t) {
    float s = dot(q, kv.keys + kv.offset(g, t), d_head_) * scale;
    if (alibi_) s -= slope * static_cast<float>(pos - t);
    p[t - first] = s;
    top = std::max(top, s);
  }
  float total = 0.f;
  for (float& s : p) total += (s = std::exp(s - top));
  std::fill(out, out + d_head_, 0.f);
  for (int64_t t = first; t <= pos; ++t) {
    const float* vt = kv.values + kv.offset(g, t);
    const float w = p[t - first] / total;
    for (int64_t i = 0; i < d_head_; ++i) out[i] += w * vt[i];
  }
}

torch::Tensor DecodeStep::activate(const torch::Tensor& up) const {
  const int64_t width = gated_ ? 2 * d_ff_ : d_ff_;
  TORCH_CHECK(up.size(1) == width, "decode step: feed-forward width ", up.size(1));
  auto hidden = gated_ ? torch::empty({up.size(0), d_ff_}, up.options()) : up;  // (B, d_ff)
  for (int64_t row = 0; row < up.size(0); ++row) {
    const float* u = up.data_ptr<float>() + row * width;
    float* y = hidden.data_ptr<float>() + row * d_ff_;
    int64_t i = 0;
    if (activation_ == 3) {  // silu a / (1 + e^-a), 8 lanes at a time
      for (; i + 8 <= d_ff_; i += 8) {
        const __m256 a = _mm256_loadu_ps(u + i);
        const __m256 one = _mm256_set1_ps(1.f);
        __m256 f = _mm256_div_ps(a, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
        if (gated_) f = _mm256_mul_ps(f, _mm256_loadu_ps(u + d_ff_ + i));
        _mm256_storeu_ps(y + i, f);
      }
    }
    for (; i < d_ff_; ++i) {
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
  }
  return hidden;
}

}  // namespace glassformer
