// Exact attention for training, forward and backward:
// out_i = sum_j p_ij v_j with p_ij = softmax_j(scale q_i · k_j) over j <= i (causal) or all j.
//
// Each (batch, head) pair is one task on one thread. Its queries go in blocks of kBlock; a
// block's scores against the keys it may see are one matrix product, their softmax is taken
// in place, and the block's output is a second product with the values. The products are the
// BLAS's that PyTorch is built with (sgemm, called single-threaded inside the task), so the
// arithmetic runs at the machine's matrix-product rate; a causal block computes only the
// keys up to its last query (the scores above the diagonal inside it are masked to zero).
// The forward pass keeps each query's log-sum-exp; the backward pass recomputes the
// probabilities from it (the flash-attention backward: D_i = dout_i · out_i,
// ds_ij = p_ij (dout_i · v_j - D_i) scale), five products a block:
//   S = scale Q Kᵀ,  dP = dO Vᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q,  dQ = dS K.
// Key/value heads shared by several query heads (GQA) are one task in the backward pass, so
// their gradients need no locks. q, k, v are (B, H or KV, T, D) with any strides but a
// contiguous last dimension (views of the fused qkv product); the output is stored
// (B, T, H, D), the layout in which the heads are merged next.

#include <omp.h>

#include <cmath>
#include <vector>

#include "glassformer.h"

// The Fortran BLAS entry point of the library PyTorch links (column-major, 32-bit sizes).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace glassformer {

namespace {

constexpr int64_t kBlock = 64;  // queries a block: its (kBlock, T) scores stay in cache

// A (B, heads, T, D) tensor's rows.
struct Rows {
  float* data;
  int64_t batch, head, time;  // strides in floats
  float* operator()(int64_t b, int64_t h, int64_t t) const {
    return data + b * batch + h * head + t * time;
  }
};

Rows rows_of(const torch::Tensor& x) {
  return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
}

// Row-major C (M, N) = alpha op(A) op(B) + beta C, op(X) = X or Xᵀ as `ta`, `tb` say; each
// matrix's rows ld apart. As the column-major BLAS sees it: Cᵀ = op(B)ᵀ op(A)ᵀ.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  sgemm_(&opb, &opa, &m, &n, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
}

// The queries a block covers and the keys they see: rows i0 .. i0 + rows - 1, keys below n,
// the score rows `width` (n rounded up to 8) wide; row m sees keys below seen(m).
struct Block {
  int64_t i0, rows, n, width;
  bool causal;
  int64_t T;
  int64_t seen(int64_t m) const { return causal ? i0 + m + 1 : T; }
};

Block block_at(int64_t i0, int64_t T, bool causal) {
  const int64_t rows = std::min(kBlock, T - i0), n = causal ? i0 + rows : T;
  return {i0, rows, n, (n + 7) / 8 * 8, causal, T};
}

void check_heads(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.scalar_type() == torch::kFloat32,
              what, " must be a (B, heads, T, D) float32 tensor with a contiguous last dimension");
}

}  // namespace

std::vector<torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, bool causal, double scale) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == D &&
                  H % KV == 0 && D % 8 == 0 && D <= 128,
              "k and v must be (B, KV, T, D) with H a multiple of KV and D a multiple of 8, <= 128");
  const int64_t Tp = (T + 7) / 8 * 8, group = H / KV;
  auto out = torch::empty({B, T, H, D}, q.options());  // (B, T, H, D): heads merged next
  auto lse = torch::empty({B, H, T}, q.options());     // (B, H, T) log-sum-exp of each query
  const Rows qr = rows_of(q), kr = rows_of(k), vr = rows_of(v);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float s = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> probs(kBlock * Tp);  // (kBlock, Tp) a block's scores, then probabilities
    float sums[kBlock];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * H; ++task) {
      const int64_t b = task / H, h = task % H, kv = h / group;
      for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
        const Block blk = block_at(i0, T, causal);
        gemm(false, true, blk.rows, blk.n, D, s, qr(b, h, i0), qr.time, kr(b, kv, 0), kr.time,
             0.f, probs.data(), Tp);
        for (int64_t m = 0; m < blk.rows; ++m) {
          float* row = probs.data() + m * Tp;
          const float top = row_max(row, blk.seen(m));
          sums[m] = exponentials(row, top, blk.seen(m), blk.width, row);
          lp[(b * H + h) * T + i0 + m] = top + std::log(sums[m]);
        }
        float* o = op + ((b * T + i0) * H + h) * D;  // rows H * D apart
        gemm(false, false, blk.rows, D, blk.n, 1.f, probs.data(), Tp, vr(b, kv, 0), vr.time, 0.f,
             o, H * D);
        for (int64_t m = 0; m < blk.rows; ++m) {
          const __m256 inv = _mm256_set1_ps(1.f / sums[m]);
          for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(o + m * H * D + c, _mm256_mul_ps(_mm256_loadu_ps(o + m * H * D + c), inv));
        }
      }
    }
  }
  return {out.permute({0, 2, 1, 3}), lse};
}

std::vector<torch::Tensor> attention_backward(const torch::Tensor& grad, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v,
                                              const torch::Tensor& out, const torch::Tensor& lse,
                                              bool causal, double scale) {
  check_heads(grad, "the gradient");
  check_heads(out, "out");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1);
  const int64_t Tp = (T + 7) / 8 * 8, group = H / KV;
  auto dq = torch::empty({B, T, H, D}, q.options());   // (B, T, H, D)
  auto dk = torch::zeros({B, T, KV, D}, q.options());  // (B, T, KV, D), summed over the group
  auto dv = torch::zeros({B, T, KV, D}, q.options());
  const Rows qr = rows_of(q), kr = rows_of(k), vr = rows_of(v), gr = rows_of(grad),
             orow = rows_of(out);
  const float* lp = lse.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const float s = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    // (kBlock, Tp) each: a block's probabilities, and dout_i · v_j, then ds_ij in place
    std::vector<float> probs(kBlock * Tp), dprobs(kBlock * Tp);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * KV; ++task) {
      const int64_t b = task / KV, kv = task % KV;
      float* dk_rows = dkp + (b * T * KV + kv) * D;  // rows KV * D apart
      float* dv_rows = dvp + (b * T * KV + kv) * D;
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
          const Block blk = block_at(i0, T, causal);
          const float* query = qr(b, h, i0);  // rows qr.time apart
          const float* dout = gr(b, h, i0);   // rows gr.time apart
          gemm(false, true, blk.rows, blk.n, D, s, query, qr.time, kr(b, kv, 0), kr.time, 0.f,
               probs.data(), Tp);
          gemm(false, true, blk.rows, blk.n, D, 1.f, dout, gr.time, vr(b, kv, 0), vr.time, 0.f,
               dprobs.data(), Tp);
          for (int64_t m = 0; m < blk.rows; ++m) {
            float* p = probs.data() + m * Tp;
            float* dp = dprobs.data() + m * Tp;
            exponentials(p, lp[(b * H + h) * T + i0 + m], blk.seen(m), blk.width, p);
            const __m256 Di = _mm256_set1_ps(dot(dout + m * gr.time, orow(b, h, i0 + m), D));
            const __m256 s8 = _mm256_set1_ps(s);
            for (int64_t j = 0; j < blk.width; j += 8)  // zero where p is
              _mm256_storeu_ps(dp + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), s8),
                                                     _mm256_sub_ps(_mm256_loadu_ps(dp + j), Di)));
          }
          gemm(true, false, blk.n, D, blk.rows, 1.f, probs.data(), Tp, dout, gr.time, 1.f, dv_rows,
               KV * D);
          gemm(true, false, blk.n, D, blk.rows, 1.f, dprobs.data(), Tp, query, qr.time, 1.f,
               dk_rows, KV * D);
          gemm(false, false, blk.rows, D, blk.n, 1.f, dprobs.data(), Tp, kr(b, kv, 0), kr.time,
               0.f, dqp + ((b * T + i0) * H + h) * D, H * D);
        }
      }
    }
  }
  return {dq.permute({0, 2, 1, 3}), dk.permute({0, 2, 1, 3}), dv.permute({0, 2, 1, 3})};
}

}  // namespace glassformer
