// Matrix-vector and small-batch products y = x @ W^T (+ bias) for AVX2 + FMA CPUs (and
// AVX-512 VNNI ones, where the quantized kernels take twice the bytes per instruction).
//
// x is (M, K) float32 with M small (decode: 1 row per sequence). W is stored row-major
// (N, K) so that each output reads one contiguous weight row; four rows are processed per
// iteration so every activation load is shared by four rows. The four rows come from four
// distant parts of the matrix (see for_row_groups): one core then streams four regions at
// once, which keeps more memory reads in flight than one stream. The kernels are bound by
// how fast weights stream from memory, so every format is read exactly once per call.
//
// Formats (all rows contiguous, blocks of 32 along K for the quantized ones):
//   f32   W (N, K) float
//   bf16  W (N, K) bfloat16, widened to float in registers
//   q8    qs (N, K32) int8, d (N, K32/32) fp16:            w = d * q            (like Q8_0)
//   q4    qs (N, K32/2) uint8 nibbles, d, m (N, K32/32) fp16: w = d * q + m, q in 0..15
//         (like Q4_1; Q4_0 is the case m = -8 d). Byte j of a block holds element j in its
//         low nibble and element j + 16 in its high nibble, as in GGUF.
// The quantized kernels quantize x per block of 32 to int8 (scale amax / 127, round half to
// even) and take integer dot products with maddubs/madd (vpdpbusd with VNNI), as llama.cpp's
// Q8_0 dot does.
// K32 is K rounded up to a multiple of 32; the padding columns of W are zero and the
// activation tail is padded with zeros.

#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Built with -march=native: where the CPU has AVX-512 VNNI, the quantized kernels take 64
// weight bytes per instruction with vpdpbusd (kWide); elsewhere 32 with AVX2 maddubs.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GLASSFORMER_WIDE 1
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

constexpr int kRows = 4;  // weight rows per iteration
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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float: shift into the high half
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline float load1(const float* p) { return *p; }

inline float load1(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float half(const uint16_t* p) { return _cvtsh_ss(*p); }

// Runs body(n0, rows, stride) over tiles of rows n0 + j * stride, j < rows (kRows or 1). The
// N rows are cut into a few chunks per thread, taken dynamically (a thread slowed down by
// another process leaves its chunks to the others). A tile takes one row from each quarter
// of its chunk, so a thread reads kRows distant streams at once: a core keeps more reads in
// flight that way than with one stream (about 1.3x the bandwidth here).
template <typename Body>
void for_row_groups(int64_t N, int64_t bytes_per_row, Body body) {
  const int threads = N * bytes_per_row >= (64 << 10) ? at::get_num_threads() : 1;
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

// ---------------------------------------------------------------- float weights (f32, bf16)

// y[m, r ld] = sum_k w[r ld, k] x[m, k] for R weight rows ld rows apart and MB activation rows.
template <int R, int MB, typename T>
inline void tile_float(const T* w, int64_t K, int64_t ld, const float* x, int64_t ldx, float* y,
                       int64_t ldy, const float* bias) {
  __m256 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      if ((k * sizeof(T)) % 64 == 0) prefetch(w + r * ld * K + k);  // once per 64-byte line
      const __m256 wv = load8(w + r * ld * K + k);
      for (int m = 0; m < MB; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t t = k; t < K; ++t) s += load1(w + r * ld * K + t) * x[m * ldx + t];
      y[m * ldy + r * ld] = s + (bias ? bias[r * ld] : 0.0f);
    }
}

template <int R, typename T>
inline void rows_float(const T* w, int64_t K, int64_t ld, const float* x, int64_t M, float* y,
                       int64_t N, const float* bias) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile_float<R, 2>(w, K, ld, x + m * K, K, y + m * N, N, bias);
  if (m < M) tile_float<R, 1>(w, K, ld, x + m * K, K, y + m * N, N, bias);
}

template <typename T>
void linear_float(const T* w, const float* x, const float* bias, float* y, int64_t M,
                  int64_t N, int64_t K) {
  for_row_groups(N, K * static_cast<int64_t>(sizeof(T)), [&](int64_t n0, int64_t rows,
                                                             int64_t ld) {
    const float* b = bias ? bias + n0 : nullptr;
    if (rows == kRows) rows_float<kRows>(w + n0 * K, K, ld, x, M, y + n0, N, b);
    else rows_float<1>(w + n0 * K, K, 1, x, M, y + n0, N, b);
  });
}

#include "quantized.cpp"

// ------------------------------------------------------------------------ entry points

constexpr int64_t kSmallBatch = 8;  // most rows the try_* entry points take (ops.SMALL_BATCH)

// x is (..., K): checks it and returns its number of rows M.
int64_t rows_of(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() >= 1 &&
                  x.is_contiguous(),
              "x must be a contiguous (..., K) float32 CPU tensor");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  return K == 0 ? 0 : x.numel() / K;
}

torch::Tensor output_like(const torch::Tensor& x, int64_t N) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return torch::empty(shape, x.options());  // (..., N)
}

// Whether the try_* entry points take x: a few float32 rows on the CPU, no gradient needed.
bool small_batch(const torch::Tensor& x, int64_t K) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() >= 1 &&
         x.size(-1) == K && x.numel() > 0 && x.numel() <= kSmallBatch * K &&
         x.is_contiguous() && !(x.requires_grad() && at::GradMode::is_enabled());
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                  bias->numel() == N,
              "bias must be a contiguous float32 tensor of ", N, " elements");
  return bias->data_ptr<float>();
}

void check_weight(const torch::Tensor& t, torch::ScalarType dtype, int64_t rows, int64_t cols,
                  const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2 &&
                  t.is_contiguous() && t.size(0) == rows && t.size(1) == cols,
              name, " must be a contiguous CPU tensor of shape (", rows, ", ", cols,
              ") and dtype ", dtype);
}

torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w,
                         const c10::optional<torch::Tensor>& bias) {
  const int64_t N = w.size(0), K = w.size(1), M = rows_of(x, K);
  check_weight(w, torch::kFloat32, N, K, "weight");
  auto y = output_like(x, N);  // (..., N)
  linear_float(w.data_ptr<float>(), x.data_ptr<float>(), bias_ptr(bias, N),
               y.data_ptr<float>(), M, N, K);
  return y;
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias) {
  const int64_t N = w.size(0), K = w.size(1), M = rows_of(x, K);
  check_weight(w, torch::kBFloat16, N, K, "weight");
  auto y = output_like(x, N);  // (..., N)
  linear_float(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
               x.data_ptr<float>(), bias_ptr(bias, N), y.data_ptr<float>(), M, N, K);
  return y;
}

torch::Tensor linear_q8(const torch::Tensor& x, const torch::Tensor& qs,
                        const torch::Tensor& d, const c10::optional<torch::Tensor>& bias) {
  const int64_t N = qs.size(0), nb = d.size(1), K = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK(K > (nb - 1) * 32 && K <= nb * 32,
              "x has ", K, " features, the weight ", nb, " blocks of 32");
  const int64_t M = rows_of(x, K);
  check_weight(qs, torch::kInt8, N, nb * 32, "qweight");
  check_weight(d, torch::kFloat16, N, nb, "scales");
  const Activations& a = quantized(x, M, K, nb, false);
  auto y = output_like(x, N);  // (..., N)
  linear_quant<false>(reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()),
                      reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), nullptr, a,
                      bias_ptr(bias, N), y.data_ptr<float>(), M, N, nb);
  return y;
}

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& qs,
                        const torch::Tensor& d, const torch::Tensor& m,
                        const c10::optional<torch::Tensor>& bias) {
  const int64_t N = qs.size(0), nb = d.size(1), K = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK(K > (nb - 1) * 32 && K <= nb * 32,
              "x has ", K, " features, the weight ", nb, " blocks of 32");
  const int64_t M = rows_of(x, K);
  check_weight(qs, torch::kUInt8, N, nb * 16, "qweight");
  check_weight(d, torch::kFloat16, N, nb, "scales");
  check_weight(m, torch::kFloat16, N, nb, "mins");
  const Activations& a = quantized(x, M, K, nb, true);
  auto y = output_like(x, N);  // (..., N)
  linear_quant<true>(qs.data_ptr<uint8_t>(),
                     reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                     reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), a,
                     bias_ptr(bias, N), y.data_ptr<float>(), M, N, nb);
  return y;
}

// The try_* entry points compute the product when small_batch(x) holds and return None
// otherwise (the caller then takes the PyTorch path): one call per layer from Python.
c10::optional<torch::Tensor> try_f32(const torch::Tensor& x, const torch::Tensor& w,
                                     const c10::optional<torch::Tensor>& bias) {
  if (!small_batch(x, w.size(1))) return c10::nullopt;
  return linear_f32(x, w, bias);
}

c10::optional<torch::Tensor> try_bf16(const torch::Tensor& x, const torch::Tensor& w,
                                      const c10::optional<torch::Tensor>& bias) {
  if (!small_batch(x, w.size(1))) return c10::nullopt;
  return linear_bf16(x, w, bias);
}

c10::optional<torch::Tensor> try_q8(const torch::Tensor& x, const torch::Tensor& qs,
                                    const torch::Tensor& d,
                                    const c10::optional<torch::Tensor>& bias, int64_t K) {
  if (!small_batch(x, K)) return c10::nullopt;
  return linear_q8(x, qs, d, bias);
}

c10::optional<torch::Tensor> try_q4(const torch::Tensor& x, const torch::Tensor& qs,
                                    const torch::Tensor& d, const torch::Tensor& m,
                                    const c10::optional<torch::Tensor>& bias, int64_t K) {
  if (!small_batch(x, K)) return c10::nullopt;
  return linear_q4(x, qs, d, m, bias);
}

torch::Tensor dequantize(const torch::Tensor& qs, const torch::Tensor& d,
                         const c10::optional<torch::Tensor>& m, int64_t K) {
  const int64_t N = qs.size(0), nb = d.size(1);
  const bool q4 = m.has_value();
  TORCH_CHECK(K > (nb - 1) * 32 && K <= nb * 32, "K = ", K, " does not fit ", nb, " blocks");
  check_weight(qs, q4 ? torch::kUInt8 : torch::kInt8, N, nb * (q4 ? 16 : 32), "qweight");
  check_weight(d, torch::kFloat16, N, nb, "scales");
  if (q4) check_weight(*m, torch::kFloat16, N, nb, "mins");
  auto w = torch::empty({N, K}, d.options().dtype(torch::kFloat32));  // (N, K)
  const auto* q = static_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = q4 ? reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>()) : nullptr;
  float* out = w.data_ptr<float>();
  const int64_t row_bytes = qs.size(1);
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t n = 0; n < N; ++n) {
    if (q4) dequantize_row<true>(q + n * row_bytes, dp + n * nb, mp + n * nb, nb, K, out + n * K);
    else dequantize_row<false>(q + n * row_bytes, dp + n * nb, nullptr, nb, K, out + n * K);
  }
  return w;
}

#include "decode_step.cpp"
#include "train_ops.cpp"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear_f32", &linear_f32, "y = x @ W^T (+ bias), W float32 (N, K)");
  module.def("linear_bf16", &linear_bf16, "y = x @ W^T (+ bias), W bfloat16 (N, K)");
  module.def("linear_q8", &linear_q8, "y = x @ W^T (+ bias), W int8 blocks of 32");
  module.def("linear_q4", &linear_q4, "y = x @ W^T (+ bias), W 4-bit blocks of 32 with min");
  pybind11::class_<DecodeStep>(module, "DecodeStep")
      .def(pybind11::init<std::vector<int64_t>, bool, bool, bool, int64_t, double,
                          std::vector<torch::Tensor>, std::vector<int64_t>,
                          c10::optional<torch::Tensor>>())
      .def("step", &DecodeStep::step, "one token through every layer (decode_step.cpp)");
  module.def("dequantize", &dequantize, "q8 (mins None) or q4 blocks -> (N, K) float32");
  module.def("try_f32", &try_f32, "linear_f32 for a small batch, else None");
  module.def("try_bf16", &try_bf16, "linear_bf16 for a small batch, else None");
  module.def("try_q8", &try_q8, "linear_q8 for a small batch of K features, else None");
  module.def("try_q4", &try_q4, "linear_q4 for a small batch of K features, else None");
  module.def("rms_norm_forward", &rms_norm_forward, "RMSNorm rows: (y, 1/rms) (train_ops.cpp)");
  module.def("rms_norm_backward", &rms_norm_backward, "RMSNorm gradients (dx, dw)");
  module.def("rope", &rope, "rotary embedding of (B, H, T, D), inverse: the backward pass");
  module.def("swiglu_forward", &swiglu_forward, "silu(g) u for h = [g | u] (R, 2F)");
  module.def("swiglu_backward", &swiglu_backward, "SwiGLU gradient [dg | du] (R, 2F)");
  module.def("transpose", &transpose, "(M, K) -> contiguous (K, M), float32");
  module.attr("SMALL_BATCH") = kSmallBatch;
}
