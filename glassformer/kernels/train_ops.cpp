// Fused forward and backward passes of RMSNorm and rotary position embeddings for training.
//
// Included into matvec.cpp. Each function is one pass over its tensors where the plain
// PyTorch expressions (glassformer/layers/norm.py, positions.py) take several elementwise
// ops, each with its own autograd record, on every step. glassformer/kernels/fused.py wraps
// them as autograd functions; the plain expressions remain the reference the tests use.

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
  for (int64_t i = 0; i < R; ++i) {
    const float* __restrict a = xp + i * d;
    const float inv = 1.f / std::sqrt(dot(a, a, d) / d + static_cast<float>(eps));
    rp[i] = inv;
    float* __restrict y_row = yp + i * d;
    const __m256 inv8 = _mm256_set1_ps(inv);
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
      _mm256_storeu_ps(y_row + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + j), inv8),
                                                _mm256_loadu_ps(wp + j)));
    for (; j < d; ++j) y_row[j] = a[j] * inv * wp[j];
  }
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

// y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) on the halves of the last
// dimension, for x (B, H, T, D) with any strides but a contiguous last dimension and cos, sin
// (B or 1, T, D) contiguous. With `inverse` the rotation by minus the angles, which is the
// backward pass (the transpose of a rotation). Returns a contiguous (B, H, T, D) tensor.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   bool inverse) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a (B, H, T, D) float32 tensor with a contiguous last dimension");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
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
  const __m256 signs = _mm256_set1_ps(sign);
#pragma omp parallel for collapse(2) schedule(static) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* __restrict a = xp + b * sb + h * sh + t * st;
        const float* __restrict c = cp + b * angle_batch + t * D;
        const float* __restrict s = sp + b * angle_batch + t * D;
        float* __restrict out = yp + ((b * H + h) * T + t) * D;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 first = _mm256_loadu_ps(a + i), second = _mm256_loadu_ps(a + i + half);
          const __m256 s1 = _mm256_mul_ps(signs, _mm256_loadu_ps(s + i));
          const __m256 s2 = _mm256_mul_ps(signs, _mm256_loadu_ps(s + i + half));
          _mm256_storeu_ps(out + i, _mm256_fnmadd_ps(second, s1,
                                                     _mm256_mul_ps(first, _mm256_loadu_ps(c + i))));
          _mm256_storeu_ps(out + i + half,
                           _mm256_fmadd_ps(first, s2,
                                           _mm256_mul_ps(second, _mm256_loadu_ps(c + i + half))));
        }
        for (; i < half; ++i) {
          out[i] = a[i] * c[i] - sign * a[i + half] * s[i];
          out[i + half] = a[i + half] * c[i + half] + sign * a[i] * s[i + half];
        }
      }
  return y;
}
