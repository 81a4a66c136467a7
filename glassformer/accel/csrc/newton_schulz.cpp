// Muon's Newton–Schulz iterations in float32, one matrix per task.
//
// At a small model's sizes each product of the iteration is a few MFLOP: PyTorch's batched
// product splits every one across the threads, and the matrices' chain of products leaves
// each core's cache between them. Here each thread takes whole matrices (dynamically) and runs
// a matrix's chain alone, single-threaded products on operands that stay in its cache. The
// iterations are those of glassformer/training/optim.py, on a stack (n, short, long) of
// matrices already of Frobenius norm 1: on the Gram matrix A = X Xᵀ where long >= 2 short
// (P_k = a I + b A_k + c A_k², A_{k+1} = P_k A_k P_k, X = P_{steps-1} ··· P_0 X_0), else
// directly (X <- a X + (b A + c A²) X). `muon_update` is the whole Muon step of a list of
// matrices in one call, a matrix per task: momentum, the iterations, weight decay, update.

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

torch::Tensor orthogonalized(const torch::Tensor& x, double a, double b, double c, int64_t steps) {
  return x.size(1) >= 2 * x.size(0) ? on_gram(x, a, b, c, steps) : direct(x, a, b, c, steps);
}

// task(i) for i in [0, n), each call on one thread, the threads taking the next i as they
// finish (matrices of several sizes balance), with gradient recording off.
template <typename Task>
void each_matrix(int64_t n, const Task& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const at::NoGradGuard no_grad;  // each pool thread has its own grad mode
    for (int64_t i = next++; i < n; i = next++) task(i);
  });
}

}  // namespace

torch::Tensor newton_schulz(const torch::Tensor& stack, double a, double b, double c,
                            int64_t steps) {
  TORCH_CHECK(stack.dim() == 3 && stack.device().is_cpu() &&
                  stack.scalar_type() == torch::kFloat32 && stack.size(1) <= stack.size(2),
              "the stack must be (n, short, long) float32 on the CPU");
  const auto x = stack.contiguous();
  auto out = torch::empty_like(x);  // (n, short, long)
  each_matrix(x.size(0), [&](int64_t i) { out[i].copy_(orthogonalized(x[i], a, b, c, steps)); });
  return out;
}

void muon_update(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& buffers, const std::vector<double>& rates,
                 double momentum, bool nesterov, double a, double b, double c, int64_t steps,
                 double eps, double decay) {
  const auto n = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(buffers.size()) == n &&
                  static_cast<int64_t>(rates.size()) == n,
              "muon_update: one gradient, buffer and rate per parameter");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(params[i].dim() == 2 && params[i].device().is_cpu() &&
                    params[i].scalar_type() == torch::kFloat32 &&
                    grads[i].sizes() == params[i].sizes() &&
                    buffers[i].sizes() == params[i].sizes(),
                "muon_update takes float32 CPU matrices, each with its gradient and buffer");
  each_matrix(n, [&](int64_t i) {
    auto buffer = buffers[i];
    buffer.lerp_(grads[i], 1 - momentum);
    const auto update = nesterov ? grads[i].lerp(buffer, momentum) : buffer;
    const bool tall = update.size(0) > update.size(1);
    const auto wide = tall ? update.t() : update;       // (short, long)
    auto x = torch::empty(wide.sizes(), wide.options());  // contiguous, norm 1
    at::div_out(x, wide, wide.norm().clamp_min(eps));
    const auto ortho = orthogonalized(x, a, b, c, steps);
    auto param = params[i];
    param.mul_(decay).add_(tall ? ortho.t() : ortho, -rates[i]);
  });
}

}  // namespace glassformer
