// Fused forward and backward passes of RMSNorm, LayerNorm, rotary position embeddings, SwiGLU
// and GELU for training, and a tiled transpose.
//
// Each function is one pass over its tensors where the plain PyTorch expressions
// (glassformer/model/layers/norm.py, positions.py, feedforward.py) take several elementwise
// ops, each with its own autograd record, on every step. The forward passes run the row
// kernels of glassformer.h, which the decode step runs too; train_autograd.cpp makes them
// autograd nodes. The plain expressions remain the reference the tests use.

#include <omp.h>

#include <cmath>

#include "glassformer.h"

namespace glassformer {

// y = x r w with r = 1 / sqrt(mean(x²) + eps) for each row of x (R, d); returns y and r (R).
std::vector<torch::Tensor> rms_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                            double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous (R, d) float32 tensor");
  const int64_t R = x.size(0), d = x.size(1);
  check_weight(w.view({1, -1}), torch::kFloat32, 1, d, "weight");
  auto y = torch::empty_like(x);           // (R, d)
  auto r = torch::empty({R}, x.options());  // (R,)
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict wp = w.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
  float* __restrict rp = r.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < R; ++i)
    rp[i] = rms_norm_row(xp + i * d, wp, d, static_cast<float>(eps), yp + i * d);
  return {y, r};
}

// The gradients of rms_norm_forward for the output gradient g (R, d): with n = x r,
//   dx = r (g w - n mean(g w n)),   dw = sum over rows of g n.
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& g, const torch::Tensor& x,
                                             const torch::Tensor& w, const torch::Tensor& r) {
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && g.scalar_type() == torch::kFloat32,
              "the gradient must be a contiguous float32 tensor shaped like x");
  const int64_t R = x.size(0), d = x.size(1);
  const int threads = at::get_num_threads();
  auto dx = torch::empty_like(x);                           // (R, d)
  auto partial = torch::zeros({threads, d}, x.options());  // (threads, d): dw per thread
  const float* __restrict gp = g.data_ptr<float>();
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict wp = w.data_ptr<float>();
  const float* __restrict rp = r.data_ptr<float>();
  float* __restrict dxp = dx.data_ptr<float>();
  float* __restrict pp = partial.data_ptr<float>();
#pragma omp parallel num_threads(threads)
  {
    float* __restrict dw = pp + omp_get_thread_num() * d;
    std::vector<float> gw(d);  // g w for the current row
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R; ++i) {
      const float* __restrict gi = gp + i * d;
      const float* __restrict xi = xp + i * d;
      const float ri = rp[i];
      const __m256 r8 = _mm256_set1_ps(ri);
      int64_t j = 0;
      for (; j + 8 <= d; j += 8) {
        const __m256 g8 = _mm256_loadu_ps(gi + j), n8 = _mm256_mul_ps(_mm256_loadu_ps(xi + j), r8);
        _mm256_storeu_ps(gw.data() + j, _mm256_mul_ps(g8, _mm256_loadu_ps(wp + j)));
        _mm256_storeu_ps(dw + j, _mm256_fmadd_ps(g8, n8, _mm256_loadu_ps(dw + j)));
      }
      for (; j < d; ++j) {
        gw[j] = gi[j] * wp[j];
        dw[j] += gi[j] * xi[j] * ri;
      }
      const float mean = dot(gw.data(), xi, d) * ri / d;  // mean(g w n)
      float* __restrict dx_row = dxp + i * d;
      const __m256 scaled_mean = _mm256_set1_ps(ri * mean);
      for (j = 0; j + 8 <= d; j += 8) {
        const __m256 centred = _mm256_fnmadd_ps(_mm256_loadu_ps(xi + j), scaled_mean,
                                                _mm256_loadu_ps(gw.data() + j));
        _mm256_storeu_ps(dx_row + j, _mm256_mul_ps(r8, centred));
      }
      for (; j < d; ++j) dx_row[j] = ri * (gw[j] - xi[j] * ri * mean);
    }
  }
  return {dx, partial.sum(0)};
}

// y = (x - mu) r w (+ b) with mu = mean(x), r = 1 / sqrt(mean((x - mu)²) + eps) for each row of
// x (R, d); b may be undefined (no bias). Returns y, mu (R) and r (R).
std::vector<torch::Tensor> layer_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                              const torch::Tensor& b, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous (R, d) float32 tensor");
  const int64_t R = x.size(0), d = x.size(1);
  check_weight(w.view({1, -1}), torch::kFloat32, 1, d, "weight");
  if (b.defined()) check_weight(b.view({1, -1}), torch::kFloat32, 1, d, "bias");
  auto y = torch::empty_like(x);             // (R, d)
  auto mu = torch::empty({R}, x.options());  // (R,)
  auto r = torch::empty({R}, x.options());   // (R,)
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict wp = w.data_ptr<float>();
  const float* __restrict bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* __restrict yp = y.data_ptr<float>();
  float* __restrict mp = mu.data_ptr<float>();
  float* __restrict rp = r.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < R; ++i) {
    const RowMoments row = layer_norm_row(xp + i * d, wp, bp, d, static_cast<float>(eps), yp + i * d);
    mp[i] = row.mean;
    rp[i] = row.inv;
  }
  return {y, mu, r};
}

// The gradients of layer_norm_forward for the output gradient g (R, d): with n = (x - mu) r,
//   dx = r (g w - mean(g w) - n mean(g w n)),  dw = sum over rows of g n,  db = sum of g.
// Returns dx, dw and db (undefined without `has_bias`).
std::vector<torch::Tensor> layer_norm_backward(const torch::Tensor& g, const torch::Tensor& x,
                                               const torch::Tensor& w, const torch::Tensor& mu,
                                               const torch::Tensor& r, bool has_bias) {
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && g.scalar_type() == torch::kFloat32,
              "the gradient must be a contiguous float32 tensor shaped like x");
  const int64_t R = x.size(0), d = x.size(1);
  const int threads = at::get_num_threads();
  auto dx = torch::empty_like(x);  // (R, d)
  std::vector<float> partial(threads * 2 * d, 0.f);  // (threads, 2, d): dw, db per thread
  const float* __restrict gp = g.data_ptr<float>();
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict wp = w.data_ptr<float>();
  const float* __restrict mp = mu.data_ptr<float>();
  const float* __restrict rp = r.data_ptr<float>();
  float* __restrict dxp = dx.data_ptr<float>();
#pragma omp parallel num_threads(threads)
  {
    float* __restrict dw = partial.data() + omp_get_thread_num() * 2 * d;
    float* __restrict db = dw + d;
    std::vector<float> n(d), gw(d);  // the current row's n and g w
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R; ++i) {
      const float* __restrict gi = gp + i * d;
      const float* __restrict xi = xp + i * d;
      const float mean = mp[i], ri = rp[i];
      const __m256 mean8 = _mm256_set1_ps(mean), r8 = _mm256_set1_ps(ri);
      __m256 acc_gw = _mm256_setzero_ps(), acc_gwn = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= d; j += 8) {
        const __m256 g8 = _mm256_loadu_ps(gi + j);
        const __m256 n8 = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xi + j), mean8), r8);
        const __m256 gw8 = _mm256_mul_ps(g8, _mm256_loadu_ps(wp + j));
        _mm256_storeu_ps(n.data() + j, n8);
        _mm256_storeu_ps(gw.data() + j, gw8);
        acc_gw = _mm256_add_ps(acc_gw, gw8);
        acc_gwn = _mm256_fmadd_ps(gw8, n8, acc_gwn);
        _mm256_storeu_ps(dw + j, _mm256_fmadd_ps(g8, n8, _mm256_loadu_ps(dw + j)));
        _mm256_storeu_ps(db + j, _mm256_add_ps(g8, _mm256_loadu_ps(db + j)));
      }
      float sum_gw = hsum(acc_gw), sum_gwn = hsum(acc_gwn);
      for (; j < d; ++j) {
        n[j] = (xi[j] - mean) * ri;
        gw[j] = gi[j] * wp[j];
        sum_gw += gw[j];
        sum_gwn += gw[j] * n[j];
        dw[j] += gi[j] * n[j];
        db[j] += gi[j];
      }
      const __m256 mean_gw8 = _mm256_set1_ps(sum_gw / d), mean_gwn8 = _mm256_set1_ps(sum_gwn / d);
      float* __restrict dx_row = dxp + i * d;
      for (j = 0; j + 8 <= d; j += 8) {
        const __m256 centred = _mm256_fnmadd_ps(
            _mm256_loadu_ps(n.data() + j), mean_gwn8,
            _mm256_sub_ps(_mm256_loadu_ps(gw.data() + j), mean_gw8));
        _mm256_storeu_ps(dx_row + j, _mm256_mul_ps(r8, centred));
      }
      for (; j < d; ++j) dx_row[j] = ri * (gw[j] - sum_gw / d - n[j] * sum_gwn / d);
    }
  }
  auto sums = torch::zeros({2, d}, x.options());  // (2, d): dw, db
  float* __restrict sp = sums.data_ptr<float>();
  for (int t = 0; t < threads; ++t)
    for (int64_t j = 0; j < 2 * d; ++j) sp[j] += partial[t * 2 * d + j];
  return {dx, sums[0], has_bias ? sums[1] : torch::Tensor()};
}

// y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) on the halves of the last
// dimension, for x (B, H, T, D) with any strides but a contiguous last dimension and cos, sin
// (B or 1, T, D) contiguous. With `inverse` the rotation by minus the angles, which is the
// backward pass (the transpose of a rotation). Returns a contiguous (B, H, T, D) tensor.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   bool inverse) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a (B, H, T, D) float32 tensor with a contiguous last dimension");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && (cos.size(0) == 1 || cos.size(0) == B) &&
                  cos.size(1) == T && cos.size(2) == D && D % 2 == 0,
              "cos and sin must be contiguous (B or 1, T, D) tensors, D even");
  auto y = torch::empty({B, H, T, D}, x.options());  // (B, H, T, D)
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict cp = cos.data_ptr<float>();
  const float* __restrict sp = sin.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t angle_batch = cos.size(0) == 1 ? 0 : T * D;
  const float sign = inverse ? -1.f : 1.f;
#pragma omp parallel for collapse(2) schedule(static) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        rope_row(xp + b * sb + h * sh + t * st, cp + b * angle_batch + t * D,
                 sp + b * angle_batch + t * D, D, sign, yp + ((b * H + h) * T + t) * D);
  return y;
}

static void check_gated(const torch::Tensor& h) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat32 &&
                  h.size(1) % 2 == 0,
              "h must be a contiguous (R, 2F) float32 tensor");
}

// SwiGLU: y = silu(g) u = g σ(g) u for h = [g | u] (R, 2F); returns y (R, F).
torch::Tensor swiglu_forward(const torch::Tensor& h) {
  check_gated(h);
  const int64_t R = h.size(0), F = h.size(1) / 2;
  auto y = torch::empty({R, F}, h.options());  // (R, F)
  const float* __restrict hp = h.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < R; ++i)
    activate_row(Activation::silu, hp + i * 2 * F, hp + i * 2 * F + F, F, yp + i * F);
  return y;
}

// The gradient of swiglu_forward for the output gradient dy (R, F), as one (R, 2F) tensor
// [dg | du]: du = dy silu(g), dg = dy u σ(g) (1 + g (1 - σ(g))).
torch::Tensor swiglu_backward(const torch::Tensor& dy, const torch::Tensor& h) {
  check_gated(h);
  const int64_t R = h.size(0), F = h.size(1) / 2;
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == R && dy.size(1) == F && dy.is_contiguous() &&
                  dy.scalar_type() == torch::kFloat32,
              "the gradient must be a contiguous (R, F) float32 tensor");
  auto dh = torch::empty_like(h);  // (R, 2F)
  const float* __restrict hp = h.data_ptr<float>();
  const float* __restrict dyp = dy.data_ptr<float>();
  float* __restrict dhp = dh.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < R; ++i) {
    const float* __restrict g = hp + i * 2 * F;
    const float* __restrict u = g + F;
    const float* __restrict d = dyp + i * F;
    float* __restrict dg = dhp + i * 2 * F;
    float* __restrict du = dg + F;
    const __m256 one = _mm256_set1_ps(1.f);
    int64_t j = 0;
    for (; j + 8 <= F; j += 8) {
      const __m256 g8 = _mm256_loadu_ps(g + j), d8 = _mm256_loadu_ps(d + j);
      const __m256 s8 = sigmoid8(g8);
      const __m256 silu8 = _mm256_mul_ps(g8, s8);
      _mm256_storeu_ps(du + j, _mm256_mul_ps(d8, silu8));
      const __m256 slope = _mm256_mul_ps(s8, _mm256_fmadd_ps(g8, _mm256_sub_ps(one, s8), one));
      _mm256_storeu_ps(dg + j, _mm256_mul_ps(_mm256_mul_ps(d8, _mm256_loadu_ps(u + j)), slope));
    }
    for (; j < F; ++j) {
      const float s = 1.f / (1.f + std::exp(-g[j]));
      du[j] = d[j] * g[j] * s;
      dg[j] = d[j] * u[j] * s * (1.f + g[j] * (1.f - s));
    }
  }
  return dh;
}

static void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, what,
              " must be a contiguous float32 tensor");
}

// GELU (exact, as F.gelu): y = x Φ(x), elementwise over a contiguous tensor of any shape.
torch::Tensor gelu_forward(const torch::Tensor& x) {
  check_rows(x, "x");
  auto y = torch::empty_like(x);
  const float* __restrict xp = x.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
  const int64_t n = x.numel(), chunk = 1024;  // a multiple of 8: only the last is partial
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t start = 0; start < n; start += chunk)
    activate_row(Activation::gelu, xp + start, nullptr, std::min(chunk, n - start), yp + start);
  return y;
}

// The gradient of gelu_forward for the output gradient dy: dx = dy (Φ(x) + x φ(x)).
torch::Tensor gelu_backward(const torch::Tensor& dy, const torch::Tensor& x) {
  check_rows(x, "x");
  check_rows(dy, "the gradient");
  TORCH_CHECK(dy.sizes() == x.sizes(), "the gradient must have the input's shape");
  auto dx = torch::empty_like(x);
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict dyp = dy.data_ptr<float>();
  float* __restrict dxp = dx.data_ptr<float>();
  const float inv_sqrt_2pi = 0.39894228f;
  const int64_t n = x.numel(), vectors = n / 8;
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t v = 0; v < vectors; ++v) {
    __m256 gauss;
    const __m256 x8 = _mm256_loadu_ps(xp + 8 * v);
    const __m256 cdf = normal_cdf8(x8, &gauss);
    const __m256 slope = _mm256_fmadd_ps(_mm256_mul_ps(x8, gauss), _mm256_set1_ps(inv_sqrt_2pi), cdf);
    _mm256_storeu_ps(dxp + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(dyp + 8 * v), slope));
  }
  for (int64_t j = 8 * vectors; j < n; ++j) {
    const float cdf = 0.5f * (1.f + std::erf(xp[j] * 0.70710678f));
    dxp[j] = dyp[j] * (cdf + xp[j] * inv_sqrt_2pi * std::exp(-0.5f * xp[j] * xp[j]));
  }
  return dx;
}

// The transpose of a contiguous (M, K) float32 matrix, as a contiguous (K, M) one: 8 × 8 tiles
// transposed in registers (training's weight gradients read their operands transposed).
torch::Tensor transpose(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous (M, K) float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({K, M}, x.options());  // (K, M)
  const float* __restrict xp = x.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
  const int64_t M8 = M / 8 * 8, K8 = K / 8 * 8;
  // Each thread takes a band of 8 output rows at a time and fills it left to right, so the
  // writes stream; the reads gather 8 rows of x.
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t j = 0; j < K8; j += 8) {
    for (int64_t i = 0; i < M8; i += 8) {
      __m256 r[8];
      for (int a = 0; a < 8; ++a) r[a] = _mm256_loadu_ps(xp + (i + a) * K + j);
      transpose8x8(r, yp + j * M + i, M);
    }
    for (int64_t c = j; c < j + 8; ++c)
      for (int64_t i = M8; i < M; ++i) yp[c * M + i] = xp[i * K + c];
  }
  for (int64_t c = K8; c < K; ++c)
    for (int64_t i = 0; i < M; ++i) yp[c * M + i] = xp[i * K + c];
  return y;
}

}  // namespace glassformer
