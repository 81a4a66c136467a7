// Matrix-vector and small-batch products y = x @ W^T (+ bias) with float weights, and the
// checks every entry point makes on the tensors Python passes.
//
// x is (M, K) float32 (decode: 1 row per sequence; any number of rows, each computed alike).
// W is stored row-major (N, K) so that each output reads one contiguous weight row; four rows
// are processed per iteration so every activation load is shared by four rows, and each of
// them meets a tile of kTileRows activation rows while it is in the L1 cache. The four rows
// come from four distant parts of the matrix (see for_row_groups): one core then streams four
// regions at once, which keeps more memory reads in flight than one stream. The kernels are
// bound by how fast weights stream from memory, so every format is read once per call.
//
// Float formats (rows contiguous; the block formats q8 and q4 are in quantized.cpp):
//   f32   W (N, K) float
//   bf16  W (N, K) bfloat16, widened to float in registers

#include <cstring>

#include "glassformer.h"

namespace glassformer {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float: shift into the high half
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// The first len < 8 values from p, zeros after, through a zeroed buffer: the tail of a row
// goes through the same vector arithmetic as its body, whatever tile the row is in.
template <typename T>
inline __m256 load_tail(const T* p, int64_t len) {
  T v[8] = {};
  std::memcpy(v, p, len * sizeof(T));
  return load8(v);
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
  if (k < K) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load_tail(x + m * ldx + k, K - k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load_tail(w + r * ld * K + k, K - k);
      for (int m = 0; m < MB; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r * ld] = hsum(acc[m][r]) + (bias ? bias[r * ld] : 0.0f);
}

template <int R, typename T>
inline void rows_float(const T* w, int64_t K, int64_t ld, const float* x, int64_t M, float* y,
                       int64_t N, const float* bias) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile_float<R, kTileRows>(w, K, ld, x + m * K, K, y + m * N, N, bias);
  for (; m < M; ++m) tile_float<R, 1>(w, K, ld, x + m * K, K, y + m * N, N, bias);
}

template <typename T>
void linear_float(const T* w, const float* x, const float* bias, float* y, int64_t M,
                  int64_t N, int64_t K) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {  // panels of rows, a pass over W each
    const int64_t rows = std::min(kPanel, M - p0);
    const float* xp = x + p0 * K;
    float* yp = y + p0 * N;
    const int64_t work =
        K * static_cast<int64_t>(sizeof(T)) * std::max<int64_t>(rows / kTileRows, 1);
    for_row_groups(N, work, [&](int64_t n0, int64_t group, int64_t ld) {
      const float* b = bias ? bias + n0 : nullptr;
      if (group == kRows) rows_float<kRows>(w + n0 * K, K, ld, xp, rows, yp + n0, N, b);
      else rows_float<1>(w + n0 * K, K, 1, xp, rows, yp + n0, N, b);
    });
  }
}

}  // namespace

// ------------------------------------------------------------------------ entry points

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

bool small_batch(const torch::Tensor& x, int64_t K) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() >= 1 &&
         x.size(-1) == K && x.numel() > 0 && x.numel() <= kRowTile * K &&
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

}  // namespace glassformer
