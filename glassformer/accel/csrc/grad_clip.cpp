// Gradient clipping by the global norm in two passes over every gradient, as
// torch.nn.utils.clip_grad_norm_ computes it: total = ‖(‖g_1‖, ‖g_2‖, …)‖, each g scaled by
// min(1, max_norm / (total + 1e-6)).
//
// PyTorch's foreach path falls back to one norm and one multiplication per tensor on a CPU:
// a small model's step pays two dozen of each. Here the tensors are cut into pieces that the
// threads share, for the sum of squares and for the scaling.

#include <omp.h>

#include <cmath>

#include "glassformer.h"

namespace glassformer {

namespace {

constexpr int64_t kPiece = 16384;  // elements per piece of work

struct Piece {
  float* data;
  int64_t n;
};

std::vector<Piece> pieces_of(const std::vector<torch::Tensor>& grads) {
  std::vector<Piece> pieces;
  for (const auto& g : grads) {
    TORCH_CHECK(g.device().is_cpu() && g.scalar_type() == torch::kFloat32 && g.is_contiguous(),
                "gradients must be contiguous float32 CPU tensors");
    float* p = g.data_ptr<float>();
    for (int64_t start = 0; start < g.numel(); start += kPiece)
      pieces.push_back({p + start, std::min(kPiece, g.numel() - start)});
  }
  return pieces;
}

}  // namespace

// Scales `grads` in place; returns the total norm before clipping (a float32 scalar).
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm) {
  const auto pieces = pieces_of(grads);
  const int64_t count = static_cast<int64_t>(pieces.size());
  double squares = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : squares) num_threads(at::get_num_threads())
  for (int64_t k = 0; k < count; ++k) {
    const float* p = pieces[k].data;
    squares += static_cast<double>(dot(p, p, pieces[k].n));
  }
  const float total = static_cast<float>(std::sqrt(squares));
  const float coef = std::min(static_cast<float>(max_norm) / (total + 1e-6f), 1.f);
  const __m256 coef8 = _mm256_set1_ps(coef);
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t k = 0; k < count; ++k) {
    float* p = pieces[k].data;
    const int64_t n = pieces[k].n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), coef8));
    for (; i < n; ++i) p[i] *= coef;
  }
  return torch::tensor(total);
}

}  // namespace glassformer
