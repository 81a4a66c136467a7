// What crosses the kernel files: the weight formats, the SIMD helpers several files use, the
// checks on tensors from Python, and the entry points that one file calls in another.
//
//   matvec.cpp       float weights (f32, bf16) and the checks on tensors from Python
//   (this header)    the row kernels training and decode share: RMSNorm, LayerNorm, RoPE and
//                    the activations, one row at a time
//   quantized.cpp    the block formats (q8, q4): products and dequantization, and the
//                    activations' int8 quantization
//   kquants.cpp      GGUF's K-quant and 5-bit blocks as the file stores them: products and
//                    dequantization
//   decode_step.cpp  one decode step through every layer (calls the linear_* entry points)
//   greedy.cpp       each row's argmax, the greedy pick of a decode step
//   attention_train.cpp  training's exact attention, forward and backward
//   train_ops.cpp    training's fused RMSNorm, LayerNorm, RoPE, SwiGLU, GELU passes and a
//                    tiled transpose
//   train_autograd.cpp  the training passes as autograd nodes in C++ (no Python backward)
//   grad_clip.cpp    gradient clipping by the global norm, all tensors in one call
//   newton_schulz.cpp  Muon's float32 Newton–Schulz iterations and whole step, a matrix per thread
//   bindings.cpp     the Python module
//
// Built for AVX2 + FMA + F16C; the quantized products also have AVX-512 VNNI paths, taken
// where the compiler targets them (quantized.cpp).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

// The row tile is defined once, in Python (glassformer/accel/build.py ROW_TILE), and compiled
// in with -DGLASSFORMER_ROW_TILE.
#ifndef GLASSFORMER_ROW_TILE
#error "GLASSFORMER_ROW_TILE is not defined: build through glassformer/accel/build.py"
#endif

namespace glassformer {

// The names Python passes these by are the enumerators' own (bindings.cpp binds them by
// name): a weight's storage format (accel/weight_formats.py), a norm and an activation
// (ModelConfig's `norm` and `activation`).
// q4_k ... q5_1: GGUF's blocks in the file's own layout (kquants.cpp).
enum class WeightFormat : int { fp32, bf16, int8, int4, q4_k, q5_k, q6_k, q3_k, q5_0, q5_1 };
enum class Norm : int { layernorm, rmsnorm };
enum class Activation : int { relu, gelu, gelu_tanh, silu };
enum class QkNorm : int { none, head, all };  // RMSNorm of q and k: none, each head, all heads

constexpr int kRows = 4;  // weight rows per iteration
// Activation rows per register tile: a tile of kTileRows × kRows accumulators, each weight
// load shared by its rows. AVX-512 has 32 vector registers (4 × 4 accumulators fit beside the
// operands), AVX2 16. A row's arithmetic is the same whichever tile it is in, or its place
// there, so each row's result is independent of the number of rows.
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int kTileRows = 4;
#else
constexpr int kTileRows = 2;
#endif
// Activation rows per pass over the weights: a weight group meets them while it is in the L1
// cache, and they stay in the L2 cache across the groups (a prefill's hundreds of rows would
// not). Past decode sizes the products are bound by arithmetic, so the extra passes cost little.
constexpr int64_t kPanel = 64;
// Most rows the try_* entry points take in one call: the row tile.
constexpr int64_t kRowTile = GLASSFORMER_ROW_TILE;
// Software prefetch distance in bytes along the weights. The hardware prefetcher alone keeps
// too few reads in flight, most of all for the quantized kernels (more work per byte).
constexpr int kPrefetch = 8192;

inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 × 8 block whose rows are r[0..8) transposed in registers: its column c stored at
// out + c * ldo. Pairs of rows are interleaved, then quadruples; r[0..3] then hold columns
// {0, 2, 1, 3} of rows 0-3 (low halves) and {4, 6, 5, 7} (high), r[4..7] the same for rows
// 4-7, whose 128-bit halves are joined last.
inline void transpose8x8(__m256 r[8], float* out, int64_t ldo) {
  __m256 t[8];
  for (int a = 0; a < 8; a += 2) {
    t[a] = _mm256_unpacklo_ps(r[a], r[a + 1]);
    t[a + 1] = _mm256_unpackhi_ps(r[a], r[a + 1]);
  }
  for (int a = 0; a < 8; a += 4)
    for (int b = 0; b < 2; ++b) {
      r[a + b] = _mm256_shuffle_ps(t[a + b], t[a + b + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[a + b + 2] = _mm256_shuffle_ps(t[a + b], t[a + b + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  static constexpr int order[4] = {0, 2, 1, 3};
  for (int c = 0; c < 4; ++c) {
    const __m256 top = r[order[c]], bottom = r[4 + order[c]];
    _mm256_storeu_ps(out + c * ldo, _mm256_permute2f128_ps(top, bottom, 0x20));
    _mm256_storeu_ps(out + (c + 4) * ldo, _mm256_permute2f128_ps(top, bottom, 0x31));
  }
}

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (the
// Cephes coefficients, within 2 ulp of expf), 2^n put in the exponent bits; x is clamped to
// [-87.3, 88.3].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// The largest of s[0..n), n >= 1, 8 lanes at a time (s readable to n rounded up to 8).
inline float row_max(const float* s, int64_t n) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int t = 1; t < 8; ++t) best = std::max(best, lanes[t]);
  for (; j < n; ++j) best = std::max(best, s[j]);
  return best;
}

// p[j] = e^(s[j] - shift) for j < n, zero from n to `width` (a multiple of 8); returns
// their sum. p may be s.
inline float exponentials(const float* s, float shift, int64_t n, int64_t width, float* p) {
  const __m256 shift8 = _mm256_set1_ps(shift);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < width; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift8));
    if (j + 8 > n) {  // the columns past n are masked
      const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 keep = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
      e = _mm256_and_ps(e, keep);
    }
    _mm256_storeu_ps(p + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  return hsum(sum8);
}

// sum_i a[i] b[i], 8 lanes at a time (a plain loop is one serial chain of adds).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ------------------------------------------------ row kernels (training and decode share them)

// σ(x) = 1 / (1 + e^-x) for 8 floats.
inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// e^w for 8 floats w in [-81, 0], the Gaussian's range in normal_cdf8: w = n ln2 + r with
// |r| <= ln2 / 2, e^r by a degree-5 polynomial fitted here for relative error (1.1e-7; exp8's
// degree 7 buys accuracy that erf's 1.5e-7 does not keep), n rounded by adding 1.5 2^23,
// whose low mantissa bits then hold n: shifted into the exponent, they make 2^n.
inline __m256 exp_gauss8(__m256 w) {
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 shifted = _mm256_fmadd_ps(w, _mm256_set1_ps(1.44269504f), magic);
  const __m256 n = _mm256_sub_ps(shifted, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), w);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(8.31253e-3f);
  for (const float c : {4.189011e-2f, 1.6667114e-1f, 4.999923e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// Φ(x) = (1 + erf(x / √2)) / 2 for 8 floats, and e^(-x² / 2) for the caller's φ(x): erf by
// Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7) on z = |x| / √2, its sign restored.
// Its t = 1 / (1 + p z) is a reciprocal estimate and one Newton step (relative error ~2e-7)
// where a division would hold up the pipeline; z stops at 9, where erfc(z) is below 1e-36.
inline __m256 normal_cdf8(__m256 x, __m256* gauss) {
  const __m256 z = _mm256_min_ps(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x),
                                               _mm256_set1_ps(0.70710678f)),
                                 _mm256_set1_ps(9.f));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 den = _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), z, one);
  const __m256 guess = _mm256_rcp_ps(den);
  const __m256 t = _mm256_fmadd_ps(guess, _mm256_fnmadd_ps(den, guess, one), guess);
  __m256 p = _mm256_set1_ps(1.061405429f);
  for (const float c : {-1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f})
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(c));
  p = _mm256_mul_ps(p, t);
  *gauss = exp_gauss8(_mm256_fnmadd_ps(z, z, _mm256_setzero_ps()));
  const __m256 erf_abs = _mm256_fnmadd_ps(p, *gauss, one);
  const __m256 erf = _mm256_or_ps(erf_abs, _mm256_and_ps(x, _mm256_set1_ps(-0.f)));
  return _mm256_fmadd_ps(erf, _mm256_set1_ps(0.5f), _mm256_set1_ps(0.5f));
}

// RMSNorm of one row x (d): y = x r w with r = 1 / sqrt(mean(x²) + eps), or with an offset
// (Gemma's 1) y = x r (offset + w), the scale summed in float32 first; returns r. y may be x.
inline float rms_norm_row(const float* x, const float* w, int64_t d, float eps, float* y,
                          float offset = 0.f) {
  const float inv = 1.f / std::sqrt(dot(x, x, d) / d + eps);
  const __m256 inv8 = _mm256_set1_ps(inv), offset8 = _mm256_set1_ps(offset);
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    const __m256 w8 = offset != 0.f ? _mm256_add_ps(offset8, _mm256_loadu_ps(w + j))
                                    : _mm256_loadu_ps(w + j);
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), inv8), w8));
  }
  for (; j < d; ++j) y[j] = x[j] * inv * (offset != 0.f ? offset + w[j] : w[j]);
  return inv;
}

struct RowMoments {
  float mean, inv;  // the row's mean and 1 / sqrt(variance + eps)
};

// LayerNorm of one row x (d): y = (x - mean) r w (+ b, where b is not null), the variance
// summed over the centred row (a second pass: no cancellation).
inline RowMoments layer_norm_row(const float* x, const float* w, const float* b, int64_t d,
                                 float eps, float* y) {
  const int64_t d8 = d / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < d8; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
  float sum = hsum(acc);
  for (int64_t j = d8; j < d; ++j) sum += x[j];
  const float mean = sum / d;
  const __m256 mean8 = _mm256_set1_ps(mean);
  acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < d8; j += 8) {
    const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(x + j), mean8);
    acc = _mm256_fmadd_ps(c, c, acc);
  }
  float squares = hsum(acc);
  for (int64_t j = d8; j < d; ++j) squares += (x[j] - mean) * (x[j] - mean);
  const float inv = 1.f / std::sqrt(squares / d + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < d8; j += 8) {
    const __m256 n8 = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mean8), inv8);
    const __m256 b8 = b ? _mm256_loadu_ps(b + j) : _mm256_setzero_ps();
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(n8, _mm256_loadu_ps(w + j), b8));
  }
  for (int64_t j = d8; j < d; ++j) y[j] = (x[j] - mean) * inv * w[j] + (b ? b[j] : 0.f);
  return {mean, inv};
}

// Rotary embedding of one head x (D, even): y = x cos + rotate_half(x) sin, rotate_half(x) =
// (-x2, x1) on the halves; sign -1 rotates by minus the angles (the backward pass). y may be x.
inline void rope_row(const float* x, const float* cos, const float* sin, int64_t D, float sign,
                     float* y) {
  const int64_t half = D / 2;
  const __m256 signs = _mm256_set1_ps(sign);
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 first = _mm256_loadu_ps(x + i), second = _mm256_loadu_ps(x + i + half);
    const __m256 s1 = _mm256_mul_ps(signs, _mm256_loadu_ps(sin + i));
    const __m256 s2 = _mm256_mul_ps(signs, _mm256_loadu_ps(sin + i + half));
    _mm256_storeu_ps(y + i, _mm256_fnmadd_ps(second, s1, _mm256_mul_ps(first, _mm256_loadu_ps(cos + i))));
    _mm256_storeu_ps(y + i + half,
                     _mm256_fmadd_ps(first, s2, _mm256_mul_ps(second, _mm256_loadu_ps(cos + i + half))));
  }
  for (; i < half; ++i) {
    const float first = x[i], second = x[i + half];
    y[i] = first * cos[i] - sign * second * sin[i];
    y[i + half] = second * cos[i + half] + sign * first * sin[i + half];
  }
}

// y = act(g) for a row of n, or gated (up not null): act(g) * up. silu and the exact GELU
// 8 lanes at a time (GELU's erf within 1.5e-7, normal_cdf8), the rest one by one.
inline void activate_row(Activation act, const float* g, const float* up, int64_t n, float* y) {
  int64_t j = 0;
  if (act == Activation::silu || act == Activation::gelu) {
    for (; j + 8 <= n; j += 8) {
      const __m256 g8 = _mm256_loadu_ps(g + j);
      __m256 gauss;
      __m256 f = act == Activation::silu ? _mm256_mul_ps(g8, sigmoid8(g8))
                                         : _mm256_mul_ps(g8, normal_cdf8(g8, &gauss));
      if (up) f = _mm256_mul_ps(f, _mm256_loadu_ps(up + j));
      _mm256_storeu_ps(y + j, f);
    }
  }
  for (; j < n; ++j) {
    const float a = g[j];
    float f = 0.f;
    switch (act) {
      case Activation::relu: f = a > 0.f ? a : 0.f; break;
      case Activation::gelu: f = 0.5f * a * (1.f + std::erf(a * 0.70710678f)); break;
      case Activation::gelu_tanh:
        f = 0.5f * a * (1.f + std::tanh(0.7978845608f * (a + 0.044715f * a * a * a)));
        break;
      case Activation::silu: f = a / (1.f + std::exp(-a)); break;
    }
    y[j] = up ? f * up[j] : f;
  }
}

// Runs body(n0, rows, stride) over tiles of rows n0 + j * stride, j < rows (kRows or 1). The
// N rows are cut into a few chunks per thread, taken dynamically (a thread slowed down by
// another process leaves its chunks to the others). A tile takes one row from each quarter
// of its chunk, so a thread reads kRows distant streams at once: a core keeps more reads in
// flight that way than with one stream (about 1.3x the bandwidth here). `work_per_row` (a
// weight row's bytes, times the tiles of activation rows it meets) decides whether threads pay.
template <typename Body>
void for_row_groups(int64_t N, int64_t work_per_row, Body body) {
  const int threads = N * work_per_row >= (64 << 10) ? at::get_num_threads() : 1;
  const int64_t chunks = std::clamp<int64_t>(N / (4 * kRows), 1, 4 * threads);
  auto run = [&](int64_t c) {
    const int64_t first = N * c / chunks, end = N * (c + 1) / chunks;
    const int64_t stride = (end - first) / kRows;
    for (int64_t i = 0; i < stride; ++i) body(first + i, kRows, stride);
    for (int64_t n = first + kRows * stride; n < end; ++n) body(n, 1, 1);
  };
  if (threads == 1 || chunks == 1) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) run(c);
}

// ------------------------------------------------ checks on tensors from Python (matvec.cpp)

// x is (..., K): checks it and returns its number of rows M.
int64_t rows_of(const torch::Tensor& x, int64_t K);
// An empty (..., N) tensor for the output of x (..., K).
torch::Tensor output_like(const torch::Tensor& x, int64_t N);
// Whether the try_* entry points take x: a few float32 rows on the CPU, no gradient needed.
bool small_batch(const torch::Tensor& x, int64_t K);
const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N);
void check_weight(const torch::Tensor& t, torch::ScalarType dtype, int64_t rows, int64_t cols,
                  const char* name);

// ------------------------------------------------------------------------ entry points

using Bias = c10::optional<torch::Tensor>;

// y = x @ W^T (+ bias) for x (..., K) float32 and W in each format (matvec.cpp, quantized.cpp).
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w, const Bias& bias);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const Bias& bias);
torch::Tensor linear_q8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const Bias& bias);
torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m, const Bias& bias);

// The same for a small batch (small_batch(x)), else None: the caller takes the PyTorch path.
c10::optional<torch::Tensor> try_f32(const torch::Tensor& x, const torch::Tensor& w,
                                     const Bias& bias);
c10::optional<torch::Tensor> try_bf16(const torch::Tensor& x, const torch::Tensor& w,
                                      const Bias& bias);
c10::optional<torch::Tensor> try_q8(const torch::Tensor& x, const torch::Tensor& qs,
                                    const torch::Tensor& d, const Bias& bias, int64_t K);
c10::optional<torch::Tensor> try_q4(const torch::Tensor& x, const torch::Tensor& qs,
                                    const torch::Tensor& d, const torch::Tensor& m,
                                    const Bias& bias, int64_t K);
// Each row of x (M, K) quantized per block of 32 (nb blocks, the tail past K zero) into
// q (M, nb * 32) int8, d = amax / 127 and s = d * sum(q) (M, nb), and, where c is not null,
// c = -128 sum(q) (M, nb) (quantized.cpp).
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t nb, int8_t* q, float* d,
                          float* s, int32_t* c);
// y = x @ W^T (+ bias) for W (N, row bytes) uint8 rows of GGUF blocks in `format` (q4_k ...
// q5_1), and those rows as the (N, K) float32 weight (kquants.cpp).
torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& qs, WeightFormat format,
                          const Bias& bias);
torch::Tensor dequantize_gguf(const torch::Tensor& qs, WeightFormat format, int64_t K);
// q8 (no mins) or q4 blocks in block order -> the (N, K) float32 weight.
torch::Tensor dequantize(const torch::Tensor& qs, const torch::Tensor& d, const Bias& m,
                         int64_t K);

// The first index of each row's maximum, as torch.argmax (greedy.cpp).
torch::Tensor argmax_rows(const torch::Tensor& logits);

// Training passes (train_ops.cpp), each with its gradient; the autograd nodes below call them.
std::vector<torch::Tensor> rms_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                            double eps);
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& g, const torch::Tensor& x,
                                             const torch::Tensor& w, const torch::Tensor& r);
std::vector<torch::Tensor> layer_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                              const torch::Tensor& b, double eps);
std::vector<torch::Tensor> layer_norm_backward(const torch::Tensor& g, const torch::Tensor& x,
                                               const torch::Tensor& w, const torch::Tensor& mu,
                                               const torch::Tensor& r, bool has_bias);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   bool inverse);
torch::Tensor swiglu_forward(const torch::Tensor& h);
torch::Tensor swiglu_backward(const torch::Tensor& dy, const torch::Tensor& h);
torch::Tensor gelu_forward(const torch::Tensor& x);
torch::Tensor gelu_backward(const torch::Tensor& dy, const torch::Tensor& x);
// A contiguous (M, K) float32 matrix as a contiguous (K, M) one.
torch::Tensor transpose(const torch::Tensor& x);

// RMSNorm, LayerNorm, rotary embeddings, SwiGLU, GELU and attention with their gradients as
// autograd nodes in C++ (train_autograd.cpp).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& w, const Bias& b,
                         double eps);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor swiglu(const torch::Tensor& h);
torch::Tensor gelu(const torch::Tensor& x);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double scale);

// Muon's Newton–Schulz iterations on a float32 stack (n, short, long) of matrices of norm 1,
// one matrix per thread at a time (newton_schulz.cpp).
torch::Tensor newton_schulz(const torch::Tensor& stack, double a, double b, double c,
                            int64_t steps);
// torch.optim.Muon's step on float32 matrices in one call, a matrix per task: the momentum
// buffer (and Nesterov's look-ahead), the iterations, weight decay `decay` = 1 - lr · wd and
// the update at each matrix's own rate (newton_schulz.cpp).
void muon_update(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& buffers, const std::vector<double>& rates,
                 double momentum, bool nesterov, double a, double b, double c, int64_t steps,
                 double eps, double decay);

// clip_grad_norm_ over float32 gradients, in place; the total norm (grad_clip.cpp).
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm);

// Training's exact attention (attention_train.cpp): (out, lse) and
// (dq, dk, dv).
std::vector<torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, bool causal, double scale);
std::vector<torch::Tensor> attention_backward(const torch::Tensor& grad, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v,
                                              const torch::Tensor& out, const torch::Tensor& lse,
                                              bool causal, double scale);

// ------------------------------------------------------------------ decode step

// One linear layer of the decode step: its format and its tensors, (weight),
// (qweight, scales), (qweight, scales, mins) or (qweight); or, where `parts` is not empty, a
// layer whose outputs are held in parts of their own formats (a GGUF file's q, k and v in
// different block types), each part's outputs after the previous part's (format, tensors and
// bias then unused).
struct LinearWeights {
  WeightFormat format;
  std::vector<torch::Tensor> tensors;
  Bias bias;
  std::vector<LinearWeights> parts;

  torch::Tensor operator()(const torch::Tensor& x) const;
};

struct NormWeights {
  torch::Tensor weight;
  Bias bias;  // LayerNorm only
};

// One block. Its norms as the block has them: the input norms norm1, norm2 (pre, sandwich)
// and the output norms attn_out_norm, mlp_out_norm (out, sandwich), (d_model) each; the query
// and key norms (DecodeConfig::qk_norm), (d_head) for each head or (heads · d_head) for all.
struct LayerWeights {
  std::optional<NormWeights> norm1;
  LinearWeights qkv, out;
  std::optional<NormWeights> norm2;
  LinearWeights up, down;
  std::optional<NormWeights> q_norm, k_norm, attn_out_norm, mlp_out_norm;
};

// A LoRA adapter's update of one product in one layer: for an input row x, t = down x, then
// y[starts[j] + o] += ups[j][o] · t[j r : (j + 1) r] for each target j, its scale folded into
// ups[j]. No targets: the adapter leaves the product as it is.
struct LoRAUpdate {
  torch::Tensor down;              // (n r, d_in) float32: the n targets' A stacked
  std::vector<int64_t> starts;     // (n): each target's first output row
  std::vector<torch::Tensor> ups;  // (n) of (r, rows_j) float32: (scale · B_j)ᵀ
};

struct LoRALayer {
  LoRAUpdate qkv, out, up, down;
};

// One adapter as the decode step reads it: built once when it is loaded, passed by reference.
struct AdapterWeights {
  std::vector<LoRALayer> layers;
};
using Adapters = std::vector<std::shared_ptr<AdapterWeights>>;

// What the decode step computes, by name (fast_decode.py fills it from a ModelConfig).
struct DecodeConfig {
  int64_t d_model = 0, n_heads = 0, n_kv_heads = 0, d_head = 0, d_ff = 0;
  // per layer: attend to at most this many most recent positions; 0: all
  std::vector<int64_t> windows;
  Norm norm = Norm::layernorm;
  double norm_offset = 0.0;  // the RMSNorms (block, query, key) scale by norm_offset + w (Gemma: 1)
  QkNorm qk_norm = QkNorm::none;  // q and k after the product, before RoPE
  Activation activation = Activation::gelu;
  bool gated = false;  // act(gate) * up for up's output [gate | up]
  bool rope = false;   // rotate q and k by the angles the caller passes
  // with rope, per layer: which of the caller's sets of angles it turns by (0: every layer's;
  // 1: the sliding layers' own base, rope_local_theta)
  std::vector<int64_t> rope_kinds;
  int64_t rotary_dim = 0;  // with rope: the first dimensions of each head it turns (the rest pass)
  bool parallel = false;   // the feed-forward reads the layer's input: x += attn + ffn
  double norm_eps = 1e-5;
  double score_scale = 1.0;  // scores are q · k times this
  double softcap = 0.0;  // then softcap tanh(scores / softcap) (Gemma 2), before ALiBi; 0: none
};

// Where one sequence's keys and values sit in one layer's storage: token t of KV head g at
// g * head_stride + slot(t) * token_stride floats from the base, slot(t) = slots[t] (a paged
// pool's block table) or t (a contiguous cache) where slots is null.
struct KVView {
  float* keys;
  float* values;
  int64_t head_stride, token_stride;
  const int64_t* slots;

  int64_t offset(int64_t g, int64_t t) const {
    return g * head_stride + (slots ? slots[t] : t) * token_stride;
  }
};

// The rows whose residual stream step_paged writes out: for i < n, row rows[i]'s stream after
// the embedding (site 0) and after each layer l (site l + 1) at out + (i sites + site) d_model,
// out (n, n_layers + 1, d_model) float32; where writes is given, what layer l's attention
// (site 2 l) and feed-forward (site 2 l + 1) add to the stream, writes (n, n_layers, 2,
// d_model) float32. n = 0: none, the plain step.
struct ResidualRows {
  const int64_t* rows = nullptr;
  int64_t n = 0;
  float* out = nullptr;
  float* writes = nullptr;

  // the rows of x (B, d) into `to` at site of sites, as above; nothing where `to` is null
  void keep(const torch::Tensor& x, float* to, int64_t site, int64_t sites) const;
};

// New tokens through every layer of a decoder (decode_step.cpp): one token of one
// sequence (step), or one token of each of B sequences whose keys and values live in a paged
// pool (step_paged). Each row is computed on its own, with the same arithmetic either way.
class DecodeStep {
 public:
  // alibi_slopes (n_heads) float32: scores minus slope_h (pos - t), where given.
  DecodeStep(DecodeConfig config, std::vector<LayerWeights> layers, Bias alibi_slopes);

  // x (1, d) the embedded token; cos, sin (kinds, rotary_dim) for its position, a set per
  // kind of layer (DecodeConfig::rope_kinds; ignored without rope);
  // keys, values per layer (1, KV, S, d_head) float32. Returns the residual stream (1, d).
  torch::Tensor step(torch::Tensor x, int64_t pos, const torch::Tensor& cos,
                     const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                     const std::vector<torch::Tensor>& values);

  // x (B, d) the embedded tokens; slots (B, S) int64: row b's token t is at pool slot
  // slots[b, t] for t <= positions[b], its new token's slot last; cos, sin (kinds, B,
  // rotary_dim), a set per kind of layer;
  // keys, values per layer (n_slots, KV, d_head) float32. adapter_of (B,) int64 (or empty:
  // none): row b adds the updates of adapters[adapter_of[b]], -1 none. emit (M,) int64 rows
  // (or empty: none) whose residual streams after the embedding and each layer go to residuals
  // (M, n_layers + 1, d) float32, and each layer's attention and feed-forward outputs to
  // writes (M, n_layers, 2, d) float32 (or empty: not asked). Returns the residual streams
  // (B, d).
  torch::Tensor step_paged(torch::Tensor x, const torch::Tensor& positions,
                           const torch::Tensor& slots, const torch::Tensor& cos,
                           const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                           const std::vector<torch::Tensor>& values,
                           const torch::Tensor& adapter_of, const Adapters& adapters,
                           const torch::Tensor& emit, torch::Tensor residuals,
                           torch::Tensor writes);

 private:
  template <typename ViewOf>
  torch::Tensor layers(torch::Tensor x, const int64_t* pos, const float* cos, const float* sin,
                       ViewOf view_of, const int64_t* adapter_of, const Adapters& adapters,
                       const ResidualRows& emit = {});
  ResidualRows residual_rows(const torch::Tensor& emit, torch::Tensor& residuals,
                             torch::Tensor& writes, int64_t B) const;
  void check(const AdapterWeights& adapter) const;
  void check_angles(const torch::Tensor& cos, const torch::Tensor& sin, int64_t B) const;
  void normalize(const torch::Tensor& x, const NormWeights& norm, torch::Tensor& out) const;
  void normalize_heads(float* q, float* k, const LayerWeights& layer) const;
  void store(const KVView& kv, const float* k, const float* v, int64_t pos) const;
  void attend(const float* q, const KVView& kv, int64_t head0, int64_t heads, int64_t pos,
              int64_t window, float* out) const;
  torch::Tensor activate(const torch::Tensor& up) const;

  DecodeConfig config_;
  int64_t rope_sets_ = 1;  // the fewest sets of angles a step takes: 1 + the largest of rope_kinds
  Bias alibi_;
  std::vector<LayerWeights> layers_;
};

}  // namespace glassformer
