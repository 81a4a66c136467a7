// Muon's Newton–Schulz iterations in float32, one matrix per task.
//
// At a small model's sizes each product of the iteration is a few MFLOP: PyTorch's batched
// product splits every one across the threads, and the matrices' chain of products leaves
// each core's cache between them. Here each thread takes whole matrices (dynamically) and runs
// a matrix's chain alone, single-threaded products on operands that stay in its cache. The
// iterations are those of glassformer/training/optim.py, on a stack (n, short, long) of
// matrices already of Frobenius norm 1: on the Gram matrix A = X Xᵀ where long >= 2 short
// (P_k = a I + b A_k + c A_k², A_{k+1} = P_k A_k P_k, X = P_{steps-1} ··· P_0 X_0), else
// directly (X <- a X + (b A + c A²) X).

#include <atomic>

#include "glassformer.h"

namespace glassformer {

namespace {

torch::Tensor on_gram(const torch::Tensor& x, double a, double b, double c, int64_t steps) {
  auto gram = at::mm(x, x.t());  // (short, short)
  torch::Tensor product;         // P_k ··· P_0 (short, short)
  for (int64_t k = 0; k < steps; ++k) {
    auto polynomial = at::addmm(gram, gram, gram, b, c);  // b A + c A²
    polynomial.diagonal().add_(a);
    product = k == 0 ? polynomial : at::mm(polynomial, product);
    if (k < steps - 1) gram = at::mm(at::mm(polynomial, gram), polynomial);
  }
  return product.defined() ? at::mm(product, x) : x;
}

torch::Tensor direct(torch::Tensor x, double a, double b, double c, int64_t steps) {
  for (int64_t k = 0; k < steps; ++k) {
    const auto gram = at::mm(x, x.t());  // (short, short)
    const auto polynomial = at::addmm(gram, gram, gram, b, c);
    x = at::addmm(x, polynomial, x, a, 1.0);
  }
  return x;
}

}  // namespace

torch::Tensor newton_schulz(const torch::Tensor& stack, double a, double b, double c,
                            int64_t steps) {
  TORCH_CHECK(stack.dim() == 3 && stack.device().is_cpu() &&
                  stack.scalar_type() == torch::kFloat32 && stack.size(1) <= stack.size(2),
              "the stack must be (n, short, long) float32 on the CPU");
  const auto x = stack.contiguous();
  auto out = torch::empty_like(x);  // (n, short, long)
  const bool gram = x.size(2) >= 2 * x.size(1);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < x.size(0); i = next++)
      out[i].copy_(gram ? on_gram(x[i], a, b, c, steps) : direct(x[i], a, b, c, steps));
  });
  return out;
}

}  // namespace glassformer
