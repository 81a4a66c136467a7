// One decode step of a decoder, every layer in C++: no Python between the products.
//
// For one sequence and one new token at position `pos`, each layer computes
//   h = norm1(x);  q, k, v = split(W_qkv h);  q, k = norm_q(q), norm_k(k)  (qk_norm: RMSNorm
//   over each head, or over all heads);  q, k = rope(q, k)  (each head's first rotary_dim, by
//   the angles of the layer's kind: every layer's, or the sliding layers' own base)
//   cache[pos] = k, v;  s_t = scale q_i · k_t, soft-capped to c tanh(s_t / c) where c is set;
//   a_i = softmax_t(s_t [- slope_i (pos - t)]) · v_t over the layer's window
//   x += norm_a(W_o a);  h = norm2(x);  x += norm_m(W_down act(W_up h))   (gated: act(gate) * up)
// each norm where the block has it: the input norms norm1, norm2 (pre, sandwich), the output
// norms norm_a, norm_m (out, sandwich); a block without input norms reads x itself. Parallel
// (pre-norm), h = norm2(x) is read before W_o a is added: x += W_o a, then x += W_down act(W_up h)
// as glassformer/model/layers/*.py do for one row, with the row kernels training uses too
// (glassformer.h); Python (accel/fast_decode.py) embeds the token before and applies the
// final norm and head after, and refuses the configurations this does not compute. step_paged does the
// same for one new token of each of B sequences, their caches in a paged pool (the serving
// engine's): each row with its own position and block table, never mixed with another row.
// There a row may carry a LoRA adapter: each product's output gets that adapter's low-rank
// update on that row alone, y += scale B (A x) per target slice (serving/adapters.py), after
// the base product, so a row without one is computed exactly as without adapters.
// step_paged also copies out, for the rows a caller names (ResidualRows), the residual stream
// it carries between layers: after the embedding and after each layer, and, if asked, each
// layer's attention and feed-forward outputs (before their output norms: the attn.out and
// mlp.out sites; the engine's capture and logit lens of those sites); with no row named it
// copies nothing.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "glassformer.h"

namespace glassformer {
namespace {

// The tensors each format stores: (weight), (qweight, scales), (qweight, scales, mins), or
// (qweight) for GGUF's blocks as the file has them.
size_t tensors_of(WeightFormat format) {
  switch (format) {
    case WeightFormat::fp32:
    case WeightFormat::bf16: return 1;
    case WeightFormat::int8: return 2;
    case WeightFormat::int4: return 3;
    case WeightFormat::q4_k:
    case WeightFormat::q5_k:
    case WeightFormat::q6_k:
    case WeightFormat::q3_k:
    case WeightFormat::q5_0:
    case WeightFormat::q5_1: return 1;
  }
  TORCH_CHECK(false, "decode step: unknown weight format ", static_cast<int>(format));
}

// t[j * stride] = dot(a, xs[j], K) for M rows xs: each row's sum as dot() makes it (one
// accumulator), so a row's value does not depend on the rows beside it; a is read once.
template <int M>
void down_rows(const float* a, const float* const* xs, int64_t K, float* t, int64_t stride) {
  __m256 acc[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256 w = _mm256_loadu_ps(a + i);
    for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[j] + i), acc[j]);
  }
  for (int j = 0; j < M; ++j) {
    float s = hsum(acc[j]);
    for (int64_t k = i; k < K; ++k) s += a[k] * xs[j][k];
    t[j * stride] = s;
  }
}

// outs[j][o] += Σ_k ts[j][k] up_t[k, o] for o in [o0, o1) and M rows: up_t (r, width) is
// (scale · B)ᵀ, so 8 outputs go together; each output's sum runs over k in order, the same
// whatever the rows beside it or the o range (o0 a multiple of 8).
template <int M>
void up_rows(const float* up_t, int64_t r, int64_t width, int64_t o0, int64_t o1,
             const float* const* ts, float* const* outs) {
  int64_t o = o0;
  for (; o + 8 <= o1; o += 8) {
    __m256 acc[M];
    for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < r; ++k) {
      const __m256 w = _mm256_loadu_ps(up_t + k * width + o);
      for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(ts[j][k]), w, acc[j]);
    }
    for (int j = 0; j < M; ++j)
      _mm256_storeu_ps(outs[j] + o, _mm256_add_ps(_mm256_loadu_ps(outs[j] + o), acc[j]));
  }
  for (; o < o1; ++o) {
    for (int j = 0; j < M; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < r; ++k) s = std::fma(ts[j][k], up_t[k * width + o], s);
      outs[j][o] += s;
    }
  }
}

// Rows taken 4 at a time (the last few fewer): f<M>(first row, M) for each group.
template <typename F>
void by_fours(int64_t m, F&& f) {
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) f(std::integral_constant<int, 4>{}, j);
  switch (m - j) {
    case 3: f(std::integral_constant<int, 3>{}, j); break;
    case 2: f(std::integral_constant<int, 2>{}, j); break;
    case 1: f(std::integral_constant<int, 1>{}, j); break;
    default: break;
  }
}

// y[b] += the update of `product` in layer l of row b's adapter, x[b] its input, for each row
// with an adapter (LoRAUpdate): t = A x for each A row, then each block of 64 outputs of each
// target from t, both shared among the threads in one parallel region. Each of an adapter's
// factors is read once per step, by one thread (they outweigh the arithmetic), and each row's
// sums are in one fixed order, whatever the thread count or the rows beside it.
void add_updates(const int64_t* adapter_of, const Adapters& adapters, size_t l,
                 LoRAUpdate LoRALayer::*product, const torch::Tensor& x, torch::Tensor& y) {
  if (adapter_of == nullptr) return;
  const int64_t B = x.size(0), K = x.size(1), N = y.size(1);
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "decode step: LoRA rows must be contiguous");
  const float* x0 = x.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  constexpr int64_t kBlock = 64;  // outputs per work item of the up products
  struct Group {
    const LoRAUpdate* update;
    std::vector<const float*> xs;  // (m): its rows' inputs
    std::vector<float*> ys;        // (m): its rows' outputs
    std::vector<float> t;          // (m, n r): its rows through every target's A
  };
  std::vector<Group> groups;
  std::vector<std::pair<int64_t, int64_t>> downs;                // (group, A row)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> ups;       // (group, target, first output)
  for (size_t a = 0; a < adapters.size(); ++a) {
    const LoRAUpdate& update = adapters[a]->layers[l].*product;
    if (update.ups.empty()) continue;
    Group group{&update, {}, {}, {}};
    for (int64_t b = 0; b < B; ++b) {
      if (adapter_of[b] != static_cast<int64_t>(a)) continue;
      group.xs.push_back(x0 + b * K);
      group.ys.push_back(y0 + b * N);
    }
    if (group.xs.empty()) continue;
    const int64_t g = static_cast<int64_t>(groups.size()), nr = update.down.size(0);
    group.t.resize(nr * group.xs.size());
    for (int64_t i = 0; i < nr; ++i) downs.emplace_back(g, i);
    for (size_t target = 0; target < update.ups.size(); ++target) {
      for (int64_t o = 0; o < update.ups[target].size(1); o += kBlock) ups.emplace_back(g, target, o);
    }
    groups.push_back(std::move(group));
  }
  const int64_t n_downs = static_cast<int64_t>(downs.size()), n_ups = static_cast<int64_t>(ups.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_downs; ++item) {
      Group& group = groups[downs[item].first];
      const int64_t i = downs[item].second, m = static_cast<int64_t>(group.xs.size());
      const int64_t nr = group.update->down.size(0);
      const float* a = group.update->down.data_ptr<float>() + i * K;
      by_fours(m, [&](auto rows, int64_t j) {
        down_rows<decltype(rows)::value>(a, group.xs.data() + j, K, group.t.data() + j * nr + i, nr);
      });
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_ups; ++item) {
      const auto [g, target, o] = ups[item];
      Group& group = groups[g];
      const torch::Tensor& up_t = group.update->ups[target];  // (r, width)
      const int64_t r = up_t.size(0), width = up_t.size(1), m = static_cast<int64_t>(group.xs.size());
      const int64_t start = group.update->starts[target];
      by_fours(m, [&](auto rows, int64_t j) {
        constexpr int M = decltype(rows)::value;
        const float* ts[M];
        float* outs[M];
        for (int k = 0; k < M; ++k) {
          ts[k] = group.t.data() + (j + k) * group.update->down.size(0) + target * r;
          outs[k] = group.ys[j + k] + start;
        }
        up_rows<M>(up_t.data_ptr<float>(), r, width, o, std::min(o + kBlock, width), ts, outs);
      });
    }
  }
}

// Heads of one key group in one row: `heads` query heads from `head`, attended in one call
// (each key and value read once for them).
struct HeadPiece {
  int64_t row, head, heads;
};

// The attention's work in a step, the same in every layer: shares that threads take as they
// come, each a list of pieces. Where the B·H/G key groups share out evenly among the threads,
// or are many, a share is one whole group. Otherwise (one stream's 3 groups on 2 threads would
// leave a thread idle a third of the time) the B·H heads are cut into one contiguous run per
// thread, each run into pieces of its groups: a group is read by at most two threads. A head's
// numbers do not depend on the piece it is in.
std::vector<std::vector<HeadPiece>> attention_shares(int64_t B, int64_t H, int64_t G, int64_t threads) {
  const int64_t groups = B * H / G;
  std::vector<std::vector<HeadPiece>> shares;
  if (groups % threads == 0 || groups >= 4 * threads) {
    for (int64_t i = 0; i < groups; ++i) shares.push_back({{i * G / H, i * G % H, G}});
    return shares;
  }
  for (int64_t t = 0; t < threads; ++t) {
    std::vector<HeadPiece>& run = shares.emplace_back();
    for (int64_t i = B * H * t / threads, end = B * H * (t + 1) / threads; i < end;) {
      const int64_t next = std::min(end, (i / G + 1) * G);  // the end of head i's group, or of the run
      run.push_back({i / H, i % H, next - i});
      i = next;
    }
  }
  return shares;
}

}  // namespace

torch::Tensor LinearWeights::operator()(const torch::Tensor& x) const {
  if (!parts.empty()) {
    std::vector<torch::Tensor> outputs;
    for (const LinearWeights& part : parts) outputs.push_back(part(x));
    return torch::cat(outputs, -1);
  }
  switch (format) {
    case WeightFormat::fp32: return linear_f32(x, tensors[0], bias);
    case WeightFormat::bf16: return linear_bf16(x, tensors[0], bias);
    case WeightFormat::int8: return linear_q8(x, tensors[0], tensors[1], bias);
    case WeightFormat::int4: return linear_q4(x, tensors[0], tensors[1], tensors[2], bias);
    case WeightFormat::q4_k:
    case WeightFormat::q5_k:
    case WeightFormat::q6_k:
    case WeightFormat::q3_k:
    case WeightFormat::q5_0:
    case WeightFormat::q5_1: return linear_gguf(x, tensors[0], format, bias);
  }
  TORCH_CHECK(false, "decode step: unknown weight format ", static_cast<int>(format));
}

DecodeStep::DecodeStep(DecodeConfig config, std::vector<LayerWeights> layers,
                       Bias alibi_slopes)
    : config_(config), alibi_(alibi_slopes), layers_(std::move(layers)) {
  TORCH_CHECK(config_.n_kv_heads > 0 && config_.n_heads % config_.n_kv_heads == 0,
              "decode step: n_heads must be a multiple of n_kv_heads");
  TORCH_CHECK(!alibi_ || alibi_->numel() == config_.n_heads,
              "decode step: one ALiBi slope per head");
  TORCH_CHECK(config_.windows.size() == layers_.size(), "decode step: one window per layer");
  TORCH_CHECK(config_.rope_kinds.size() == layers_.size(), "decode step: one RoPE kind per layer");
  for (const int64_t kind : config_.rope_kinds) {
    TORCH_CHECK(kind >= 0, "decode step: a RoPE kind is a set's index, got ", kind);
    rope_sets_ = std::max(rope_sets_, kind + 1);
  }
  const int64_t d = config_.d_model, D = config_.d_head;
  const bool all_heads = config_.qk_norm == QkNorm::all;
  for (const LayerWeights& layer : layers_) {
    for (const LinearWeights* layer_weights : {&layer.qkv, &layer.out, &layer.up, &layer.down}) {
      std::vector<const LinearWeights*> held{layer_weights};
      for (const LinearWeights& part : layer_weights->parts) held.push_back(&part);
      for (const LinearWeights* lin : held) {
        if (lin == layer_weights && !lin->parts.empty()) continue;  // a layer in parts holds none itself
        TORCH_CHECK(lin->parts.empty() && lin->tensors.size() == tensors_of(lin->format),
                    "decode step: a ", static_cast<int>(lin->format), " layer takes ",
                    tensors_of(lin->format), " tensors, got ", lin->tensors.size());
      }
    }
    TORCH_CHECK(layer.norm1.has_value() == layer.norm2.has_value() &&
                    layer.attn_out_norm.has_value() == layer.mlp_out_norm.has_value(),
                "decode step: a block has both input norms or neither, both output norms or neither");
    TORCH_CHECK(layer.q_norm.has_value() == (config_.qk_norm != QkNorm::none) &&
                    layer.k_norm.has_value() == layer.q_norm.has_value(),
                "decode step: query and key norms go with qk_norm");
    for (const auto& [norm, width] : {std::pair{&layer.norm1, d}, std::pair{&layer.norm2, d},
                                      std::pair{&layer.attn_out_norm, d},
                                      std::pair{&layer.mlp_out_norm, d},
                                      std::pair{&layer.q_norm, all_heads ? config_.n_heads * D : D},
                                      std::pair{&layer.k_norm, all_heads ? config_.n_kv_heads * D : D}}) {
      TORCH_CHECK(!*norm || ((*norm)->weight.dtype() == torch::kFloat32 &&
                             (*norm)->weight.is_contiguous() && (*norm)->weight.numel() == width),
                  "decode step: a norm's weight must be float32 (", width, ")");
    }
  }
}

torch::Tensor DecodeStep::step(torch::Tensor x, int64_t pos, const torch::Tensor& cos,
                   const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                   const std::vector<torch::Tensor>& values) {
  const int64_t D = config_.d_head;
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
              "decode step: one cache tensor per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "decode step: x must be (1, d)");
  check_angles(cos, sin, 1);
  for (size_t l = 0; l < layers_.size(); ++l) {
    TORCH_CHECK(pos < keys[l].size(2) && pos < values[l].size(2), "decode step: position ",
                pos, " is past the cache (", keys[l].size(2), ")");
  }
  auto view_of = [&](size_t l, int64_t) {  // (1, KV, S, d_head): heads S tokens apart
    const int64_t S = keys[l].size(2);
    return KVView{keys[l].data_ptr<float>(), values[l].data_ptr<float>(), S * D, D, nullptr};
  };
  return layers(x, &pos, config_.rope ? cos.data_ptr<float>() : nullptr,
                config_.rope ? sin.data_ptr<float>() : nullptr, view_of, nullptr, {});
}

torch::Tensor DecodeStep::step_paged(torch::Tensor x, const torch::Tensor& positions,
                                     const torch::Tensor& slots, const torch::Tensor& cos,
                                     const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& keys,
                                     const std::vector<torch::Tensor>& values,
                                     const torch::Tensor& adapter_of, const Adapters& adapters,
                                     const torch::Tensor& emit, torch::Tensor residuals,
                                     torch::Tensor writes) {
  const int64_t KV = config_.n_kv_heads, D = config_.d_head;
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
              "decode step: one pool tensor per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == config_.d_model,
              "decode step: x must be (B, d_model)");
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
                      t->size(1) == KV && t->size(2) == D,
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
  check_angles(cos, sin, B);
  const int64_t* adapter = nullptr;  // null: no row has an adapter
  if (adapter_of.numel() > 0) {
    TORCH_CHECK(adapter_of.dtype() == torch::kInt64 && adapter_of.is_contiguous() &&
                    adapter_of.numel() == B, "decode step: adapter_of must be (B,) int64");
    const int64_t* of = adapter_of.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(of[b] >= -1 && of[b] < static_cast<int64_t>(adapters.size()),
                  "decode step: row ", b, " names adapter ", of[b], " of ", adapters.size());
      if (of[b] >= 0) adapter = of;
    }
    for (const auto& weights : adapters) check(*weights);
  }
  auto view_of = [&](size_t l, int64_t b) {  // (slots, KV, d_head): heads d_head apart
    return KVView{keys[l].data_ptr<float>(), values[l].data_ptr<float>(), D, KV * D,
                  table + b * S};
  };
  return layers(x, pos, config_.rope ? cos.data_ptr<float>() : nullptr,
                config_.rope ? sin.data_ptr<float>() : nullptr, view_of, adapter, adapters,
                residual_rows(emit, residuals, writes, B));
}

// cos, sin (kinds, B, rotary_dim) float32, where there is RoPE: a set of angles per kind of
// layer the model has (a layer of each kind or not), at least one per kind a layer names.
void DecodeStep::check_angles(const torch::Tensor& cos, const torch::Tensor& sin, int64_t B) const {
  if (!config_.rope) return;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) >= rope_sets_ && t->size(1) == B &&
                    t->size(2) == config_.rotary_dim && t->sizes() == cos.sizes(),
                "decode step: cos, sin must be float32 (kinds >= ", rope_sets_, ", ", B, ", ",
                config_.rotary_dim, "): a set of angles per kind of layer");
  }
}

ResidualRows DecodeStep::residual_rows(const torch::Tensor& emit, torch::Tensor& residuals,
                                       torch::Tensor& writes, int64_t B) const {
  if (emit.numel() == 0) return {};
  const int64_t M = emit.numel(), L = static_cast<int64_t>(layers_.size()), sites = L + 1;
  TORCH_CHECK(emit.dtype() == torch::kInt64 && emit.is_contiguous() && emit.dim() == 1,
              "decode step: emit must be (M,) int64");
  TORCH_CHECK(residuals.dtype() == torch::kFloat32 && residuals.is_contiguous() &&
                  residuals.dim() == 3 && residuals.size(0) == M && residuals.size(1) == sites &&
                  residuals.size(2) == config_.d_model,
              "decode step: residuals must be float32 (M, n_layers + 1, d_model)");
  const int64_t* rows = emit.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < B, "decode step: emit row ", rows[i], " of ", B);
  }
  if (writes.numel() == 0) return {rows, M, residuals.data_ptr<float>()};
  TORCH_CHECK(writes.dtype() == torch::kFloat32 && writes.is_contiguous() &&
                  writes.sizes() == torch::IntArrayRef({M, L, 2, config_.d_model}),
              "decode step: writes must be float32 (M, n_layers, 2, d_model)");
  return {rows, M, residuals.data_ptr<float>(), writes.data_ptr<float>()};
}

void ResidualRows::keep(const torch::Tensor& x, float* to, int64_t site, int64_t sites) const {
  if (to == nullptr) return;
  const int64_t d = x.size(1);
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(to + (i * sites + site) * d, x.data_ptr<float>() + rows[i] * d, d * sizeof(float));
  }
}

// Every product of every layer: the widths an adapter's updates read and write, and their
// tensors float32, contiguous, one rank for all targets.
void DecodeStep::check(const AdapterWeights& adapter) const {
  const int64_t d = config_.d_model, HD = config_.n_heads * config_.d_head;
  const int64_t qkv = (config_.n_heads + 2 * config_.n_kv_heads) * config_.d_head;
  const int64_t ff = config_.d_ff, up = config_.gated ? 2 * ff : ff;
  TORCH_CHECK(adapter.layers.size() == layers_.size(), "decode step: an adapter has ",
              adapter.layers.size(), " layers, the model ", layers_.size());
  for (const LoRALayer& layer : adapter.layers) {
    for (const auto& [update, in, out] : {std::tuple{&layer.qkv, d, qkv}, std::tuple{&layer.out, HD, d},
                                          std::tuple{&layer.up, d, up}, std::tuple{&layer.down, ff, d}}) {
      const size_t n = update->ups.size();
      if (n == 0) continue;
      const auto& a = update->down;
      TORCH_CHECK(update->starts.size() == n && a.dtype() == torch::kFloat32 && a.is_contiguous() &&
                      a.dim() == 2 && a.size(1) == in && a.size(0) % static_cast<int64_t>(n) == 0,
                  "decode step: a LoRA down must be float32 (n r, ", in, ")");
      const int64_t r = a.size(0) / static_cast<int64_t>(n);
      for (size_t j = 0; j < n; ++j) {
        const auto& b = update->ups[j];
        TORCH_CHECK(b.dtype() == torch::kFloat32 && b.is_contiguous() && b.dim() == 2 &&
                        b.size(0) == r && update->starts[j] >= 0 &&
                        update->starts[j] + b.size(1) <= out,
                    "decode step: a LoRA up must be float32 (", r, ", rows) inside ", out, " rows");
      }
    }
  }
}

// Every layer for the B rows of x; row b at position pos[b], its angles in layer l at
// cos + (rope_kinds[l] B + b) rotary_dim, its cache in layer l at view_of(l, b), its adapter
// adapters[adapter_of[b]] (none where -1, or where adapter_of is null).
template <typename ViewOf>
torch::Tensor DecodeStep::layers(torch::Tensor x, const int64_t* pos, const float* cos,
                                 const float* sin, ViewOf view_of, const int64_t* adapter_of,
                                 const Adapters& adapters, const ResidualRows& emit) {
  const int64_t H = config_.n_heads, KV = config_.n_kv_heads, D = config_.d_head;
  const int64_t R = config_.rotary_dim;  // the dimensions of a head RoPE turns
  const int64_t B = x.size(0), width = (H + 2 * KV) * D, G = H / KV;
  const std::vector<std::vector<HeadPiece>> shares = attention_shares(B, H, G, at::get_num_threads());
  x = x.contiguous().clone();  // (B, d): updated in place layer by layer
  const int64_t sites = static_cast<int64_t>(layers_.size()) + 1;
  emit.keep(x, emit.out, 0, sites);
  auto h = torch::empty_like(x);  // (B, d)
  auto context = torch::empty({B, H * D}, x.options());  // (B, H·d_head)
  std::vector<KVView> views(B);
  // a sublayer's input: norm(x) in h, or x itself where the block has no input norms
  auto input = [&](const std::optional<NormWeights>& norm) -> const torch::Tensor& {
    if (!norm) return x;
    normalize(x, *norm, h);
    return h;
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& layer = layers_[l];
    const torch::Tensor& attn_in = input(layer.norm1);
    auto qkv = layer.qkv(attn_in);  // (B, (H + 2 KV) d_head)
    add_updates(adapter_of, adapters, l, &LoRALayer::qkv, attn_in, qkv);
    for (int64_t b = 0; b < B; ++b) {
      float* q = static_cast<float*>(qkv.data_ptr()) + b * width;
      float* k = q + H * D;
      float* v = k + KV * D;
      if (layer.q_norm) normalize_heads(q, k, layer);
      if (config_.rope) {
        const int64_t angles = (config_.rope_kinds[l] * B + b) * R;  // the layer's kind's, row b's
        for (int64_t head = 0; head < H + KV; ++head)  // the query heads, then the key heads
          rope_row(q + head * D, cos + angles, sin + angles, R, 1.f, q + head * D);
      }
      views[b] = view_of(l, b);
      store(views[b], k, v, pos[b]);
    }
    const float* q0 = static_cast<float*>(qkv.data_ptr());
    float* c0 = static_cast<float*>(context.data_ptr());
#pragma omp parallel for schedule(dynamic) num_threads(at::get_num_threads())
    for (size_t i = 0; i < shares.size(); ++i) {
      for (const auto [b, head, heads] : shares[i])
        attend(q0 + b * width + head * D, views[b], head, heads, pos[b], config_.windows[l],
               c0 + (b * H + head) * D);
    }
    auto attended = layer.out(context);  // (B, d)
    add_updates(adapter_of, adapters, l, &LoRALayer::out, context, attended);
    emit.keep(attended, emit.writes, 2 * static_cast<int64_t>(l), 2 * (sites - 1));
    if (layer.attn_out_norm) normalize(attended, *layer.attn_out_norm, attended);
    if (!config_.parallel) x.add_(attended);
    const torch::Tensor& mlp_in = input(layer.norm2);
    auto up = layer.up(mlp_in);  // (B, d_ff or 2 d_ff)
    add_updates(adapter_of, adapters, l, &LoRALayer::up, mlp_in, up);
    auto hidden = activate(up);  // (B, d_ff)
    auto down = layer.down(hidden);  // (B, d)
    add_updates(adapter_of, adapters, l, &LoRALayer::down, hidden, down);
    emit.keep(down, emit.writes, 2 * static_cast<int64_t>(l) + 1, 2 * (sites - 1));
    if (layer.mlp_out_norm) normalize(down, *layer.mlp_out_norm, down);
    if (config_.parallel) x.add_(attended);  // the module path's order: (x + attn) + ffn
    x.add_(down);
    emit.keep(x, emit.out, static_cast<int64_t>(l) + 1, sites);
  }
  return x;
}

void DecodeStep::normalize(const torch::Tensor& x, const NormWeights& norm,
                           torch::Tensor& out) const {
  const int64_t d = config_.d_model;
  const float* w = norm.weight.data_ptr<float>();
  const float* b = norm.bias ? norm.bias->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(config_.norm_eps);
  for (int64_t row = 0; row < x.size(0); ++row) {
    const float* a = x.data_ptr<float>() + row * d;
    float* y = out.data_ptr<float>() + row * d;
    if (config_.norm == Norm::rmsnorm) {
      rms_norm_row(a, w, d, eps, y, static_cast<float>(config_.norm_offset));
    } else {
      layer_norm_row(a, w, b, d, eps, y);
    }
  }
}

// The query heads q (H d_head) and key heads k (KV d_head) of one row through the layer's
// RMSNorms, in place: each head on its own (QkNorm::head, one weight for every head) or all
// heads side by side as one row (QkNorm::all); scaled by offset + w as the block norms are.
void DecodeStep::normalize_heads(float* q, float* k, const LayerWeights& layer) const {
  const int64_t D = config_.d_head;
  const float eps = static_cast<float>(config_.norm_eps), offset = static_cast<float>(config_.norm_offset);
  for (const auto& [x, heads, norm] : {std::tuple{q, config_.n_heads, &layer.q_norm},
                                       std::tuple{k, config_.n_kv_heads, &layer.k_norm}}) {
    const float* w = (*norm)->weight.data_ptr<float>();
    if (config_.qk_norm == QkNorm::all) {
      rms_norm_row(x, w, heads * D, eps, x, offset);
      continue;
    }
    for (int64_t head = 0; head < heads; ++head)
      rms_norm_row(x + head * D, w, D, eps, x + head * D, offset);
  }
}

void DecodeStep::store(const KVView& kv, const float* k, const float* v, int64_t pos) const {
  const int64_t D = config_.d_head;
  for (int64_t g = 0; g < config_.n_kv_heads; ++g) {
    std::memcpy(kv.keys + kv.offset(g, pos), k + g * D, D * sizeof(float));
    std::memcpy(kv.values + kv.offset(g, pos), v + g * D, D * sizeof(float));
  }
}

namespace {

// Lane i: the sum of r[i]'s 8 lanes, for i < 8 (a transpose by horizontal adds).
inline __m256 lane_sums(const __m256 r[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// The attention's float vectors: 8 lanes (AVX2), and 16 where the build targets AVX-512. fold
// adds a vector's 8-lane halves.
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t n = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold(V v) { return v; }
};
#ifdef __AVX512F__
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t n = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#endif

// tanh(y) for 8 floats: 1 - 2 / (e^2|y| + 1), its sign restored (within about 1e-7 of it:
// exp8's error, and 1's rounding near 0).
inline __m256 tanh8(__m256 y) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  const __m256 e = exp8(_mm256_add_ps(_mm256_andnot_ps(sign, y), _mm256_andnot_ps(sign, y)));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  return _mm256_or_ps(t, _mm256_and_ps(y, sign));
}

// The scores s soft-capped: c tanh(s / c) (Gemma 2's attention logits), as the module path
// computes it (a division, then a product); c <= 0: s as it is.
inline __m256 soft_cap8(__m256 s, float c) {
  if (c <= 0.f) return s;
  const __m256 c8 = _mm256_set1_ps(c);
  return _mm256_mul_ps(c8, tanh8(_mm256_div_ps(s, c8)));
}

inline float soft_cap(float s, float c) { return c > 0.f ? c * std::tanh(s / c) : s; }

// s[h ld + i] = cap(scale q_h · k_i) - slope_h (n - 1 - i) for the query heads q_h = q + h D,
// h < heads, and the n keys k_i = keys + offset(g, first + i), D a multiple of the vector's
// lanes (slopes: ALiBi's, or null; cap: soft_cap8 by softcap). Eight keys at a time, met by
// every head while they are in the L1 cache: eight sums in flight, summed across lanes
// together. The last eight repeat key n - 1 past n (s is readable to n rounded up to 8), so
// every score takes the same operations.
template <typename L>
void key_scores(const float* q, int64_t heads, const KVView& kv, int64_t g, int64_t first,
                int64_t n, int64_t D, float scale, float softcap, const float* slopes, float* s,
                int64_t ld) {
  const __m256 scale8 = _mm256_set1_ps(scale), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = 0; i < n; i += 8) {
    const float* k[8];
    for (int j = 0; j < 8; ++j) k[j] = kv.keys + kv.offset(g, first + std::min(i + j, n - 1));
    const __m256 distance = _mm256_sub_ps(_mm256_set1_ps(static_cast<float>(n - 1 - i)), lane);
    for (int64_t h = 0; h < heads; ++h) {
      typename L::V acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = L::zero();
      for (int64_t d = 0; d < D; d += L::n) {
        const typename L::V qd = L::load(q + h * D + d);
        for (int j = 0; j < 8; ++j) acc[j] = L::fma(qd, L::load(k[j] + d), acc[j]);
      }
      __m256 folded[8];
      for (int j = 0; j < 8; ++j) folded[j] = L::fold(acc[j]);
      __m256 scores = soft_cap8(_mm256_mul_ps(lane_sums(folded), scale8), softcap);
      if (slopes) scores = _mm256_fnmadd_ps(_mm256_set1_ps(slopes[h]), distance, scores);
      _mm256_storeu_ps(s + h * ld + i, scores);
    }
  }
}

// out_h[d0, d0 + C lanes) += Σ_i w_h[i] v_i[d0, d0 + C lanes) for J heads h, their weights
// w_h = w + h ld and outputs out_h = out + h D, and the values v_i = values + offset(g,
// first + i), i0 <= i < i1 in order of i: J C sums in registers, each value loaded once for
// the J heads.
template <typename L, int J, int C>
void values_pass(const float* w, int64_t ld, const KVView& kv, int64_t g, int64_t first,
                 int64_t i0, int64_t i1, int64_t D, int64_t d0, float* out) {
  typename L::V acc[J][C];
  for (int h = 0; h < J; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = L::load(out + h * D + d0 + L::n * c);
  for (int64_t i = i0; i < i1; ++i) {
    const float* v = kv.values + kv.offset(g, first + i) + d0;
    for (int h = 0; h < J; ++h) {
      const typename L::V wi = L::set1(w[h * ld + i]);
      for (int c = 0; c < C; ++c) acc[h][c] = L::fma(wi, L::load(v + L::n * c), acc[h][c]);
    }
  }
  for (int h = 0; h < J; ++h)
    for (int c = 0; c < C; ++c) L::store(out + h * D + d0 + L::n * c, acc[h][c]);
}

// out_h (D) += Σ_i w_h[i] v_i for J heads h (as values_pass) over the n values from first, D a
// multiple of the vector's lanes: 64 values at a time, which stay in the L1 cache while 4
// vectors of each head's out at a time are summed (values_pass), so each value is read from
// memory once for the J heads.
template <typename L, int J>
void weighted_values(const float* w, int64_t ld, const KVView& kv, int64_t g, int64_t first,
                     int64_t n, int64_t D, float* out) {
  constexpr int64_t kValues = 64;
  for (int64_t i0 = 0; i0 < n; i0 += kValues) {
    const int64_t i1 = std::min(n, i0 + kValues);
    int64_t d0 = 0;
    for (; d0 + 4 * L::n <= D; d0 += 4 * L::n)
      values_pass<L, J, 4>(w, ld, kv, g, first, i0, i1, D, d0, out);
    switch ((D - d0) / L::n) {
      case 3: values_pass<L, J, 3>(w, ld, kv, g, first, i0, i1, D, d0, out); break;
      case 2: values_pass<L, J, 2>(w, ld, kv, g, first, i0, i1, D, d0, out); break;
      case 1: values_pass<L, J, 1>(w, ld, kv, g, first, i0, i1, D, d0, out); break;
      default: break;
    }
  }
}

// out_h += Σ_i w_h[i] v_i (weighted_values, w_h = w + h ld, out_h = out + h D) for heads
// h < heads, three at a time: 12 vectors summed in registers.
template <typename L>
void weighted_values(const float* w, int64_t ld, int64_t heads, const KVView& kv, int64_t g,
                     int64_t first, int64_t n, int64_t D, float* out) {
  for (int64_t h = 0; h < heads; h += 3) {
    const int64_t J = std::min<int64_t>(3, heads - h);
    if (J == 3) weighted_values<L, 3>(w + h * ld, ld, kv, g, first, n, D, out + h * D);
    if (J == 2) weighted_values<L, 2>(w + h * ld, ld, kv, g, first, n, D, out + h * D);
    if (J == 1) weighted_values<L, 1>(w + h * ld, ld, kv, g, first, n, D, out + h * D);
  }
}

// Calls f with the widest vectors whose lanes divide D (Lanes16 where the build targets
// AVX-512, Lanes8); false where none does.
template <typename F>
bool with_lanes(int64_t D, F&& f) {
#ifdef __AVX512F__
  if (D % Lanes16::n == 0) return f(Lanes16{}), true;
#endif
  if (D % Lanes8::n == 0) return f(Lanes8{}), true;
  return false;
}

}  // namespace

// Query heads head0 .. head0 + heads - 1, all of one key group (their queries and outputs
// d_head apart), over their sequence's tokens first..pos (the last `window`, 0: all):
// softmax_t(cap(scale q · k_t) [- slope (pos - t)]) · v_t into out. Each head's arithmetic is
// the same however many heads share the call, and each row reads its own keys only, so a
// row's result depends on neither.
void DecodeStep::attend(const float* q, const KVView& kv, int64_t head0, int64_t heads,
                        int64_t pos, int64_t window, float* out) const {
  const int64_t D = config_.d_head;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t n = pos - first + 1, width = (n + 7) / 8 * 8;
  const int64_t g = head0 / (config_.n_heads / config_.n_kv_heads);
  const float scale = static_cast<float>(config_.score_scale);
  const float softcap = static_cast<float>(config_.softcap);
  const float* slopes = alibi_ ? alibi_->data_ptr<float>() + head0 : nullptr;
  // (heads, width) the scores, then their exponentials; 1 / each head's sum
  thread_local std::vector<float> p, inverse;
  p.resize(heads * width);
  inverse.resize(heads);
  const bool vector = with_lanes(D, [&](auto lanes) {
    key_scores<decltype(lanes)>(q, heads, kv, g, first, n, D, scale, softcap, slopes, p.data(),
                                width);
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = p.data() + h * width;
    if (!vector) {
      for (int64_t i = 0; i < n; ++i) {
        s[i] = soft_cap(scale * dot(q + h * D, kv.keys + kv.offset(g, first + i), D), softcap);
        if (slopes) s[i] -= slopes[h] * static_cast<float>(n - 1 - i);
      }
    }
    inverse[h] = 1.f / exponentials(s, row_max(s, n), n, width, s);
  }
  std::fill(out, out + heads * D, 0.f);
  const bool summed = with_lanes(D, [&](auto lanes) {
    weighted_values<decltype(lanes)>(p.data(), width, heads, kv, g, first, n, D, out);
  });
  for (int64_t h = 0; h < heads; ++h) {
    const float* w = p.data() + h * width;
    float* o = out + h * D;
    if (!summed) {
      for (int64_t i = 0; i < n; ++i) {
        const float* v = kv.values + kv.offset(g, first + i);
        for (int64_t d = 0; d < D; ++d) o[d] += w[i] * v[d];
      }
    }
    for (int64_t d = 0; d < D; ++d) o[d] *= inverse[h];
  }
}

torch::Tensor DecodeStep::activate(const torch::Tensor& up) const {
  const int64_t d_ff = config_.d_ff, width = config_.gated ? 2 * d_ff : d_ff;
  TORCH_CHECK(up.size(1) == width, "decode step: feed-forward width ", up.size(1));
  auto hidden = torch::empty({up.size(0), d_ff}, up.options());  // (B, d_ff)
  for (int64_t row = 0; row < up.size(0); ++row) {
    const float* u = up.data_ptr<float>() + row * width;
    activate_row(config_.activation, u, config_.gated ? u + d_ff : nullptr, d_ff,
                 hidden.data_ptr<float>() + row * d_ff);
  }
  return hidden;
}

}  // namespace glassformer
