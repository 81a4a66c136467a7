// Exact attention for training with short sequences and small heads, forward and backward:
// out_i = sum_j p_ij v_j with p_ij = softmax_j(scale q_i · k_j) over j <= i (causal) or all j.
//
// PyTorch's fused CPU kernel tiles for long sequences; at the sizes of a small model (T = 64,
// d_head = 32) its fixed costs dominate. Here each (batch, head) pair is one task: the keys
// and values are transposed once into (d_head, T) panels, so a query's T scores are d_head
// fused multiply-adds on 8 keys at a time. The forward pass keeps each query's log-sum-exp;
// the backward pass recomputes the probabilities from it (the flash-attention backward:
// D_i = dout_i · out_i, ds_ij = p_ij (dout_i · v_j - D_i) scale). Key/value heads shared by
// several query heads (GQA) are one task in the backward pass, so their gradients need no
// locks. q, k, v are (B, H or KV, T, D) with any strides but a contiguous last dimension
// (views of the fused qkv product); the output is stored (B, T, H, D), the layout in which
// the heads are merged next.

#include <omp.h>

#include <cmath>
#include <vector>

#include "glassformer.h"

namespace glassformer {

namespace {

constexpr int kQueries = 4;  // queries per tile: their products share each load

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

// panel[d * Tp + j] = x(b, h, j)[d] for j < T, zero for T <= j < Tp; D a multiple of 8.
// Blocks of 8 rows are transposed in registers.
void transpose_panel(const Rows& x, int64_t b, int64_t h, int64_t T, int64_t Tp, int64_t D,
                     float* panel) {
  const int64_t T8 = T / 8 * 8;
  for (int64_t j = 0; j < T8; j += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 r[8];
      for (int a = 0; a < 8; ++a) r[a] = _mm256_loadu_ps(x(b, h, j + a) + d);
      transpose8x8(r, panel + d * Tp + j, Tp);
    }
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t j = T8; j < T; ++j) panel[d * Tp + j] = x(b, h, j)[d];
    for (int64_t j = T; j < Tp; ++j) panel[d * Tp + j] = 0.f;
  }
}

// s[m][j] = scale (a_m · column j of the panel) for M rows a_m (lda apart) and j < n rounded
// up to 8; s rows ldS apart. Two columns of 8 for each of the M rows: 2 M independent chains
// of multiply-adds, each panel load shared by the M rows.
template <int M>
void dots(const float* a, int64_t lda, const float* panel, int64_t Tp, int64_t D, int64_t n,
          float scale, float* s, int64_t lds) {
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const bool two = j + 8 < n;  // a second column of 8 is needed (and inside the panel)
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const float* column = panel + d * Tp + j;
      const __m256 c0 = _mm256_loadu_ps(column);
      const __m256 c1 = two ? _mm256_loadu_ps(column + 8) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const __m256 am = _mm256_set1_ps(a[m * lda + d]);
        acc[m][0] = _mm256_fmadd_ps(am, c0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(am, c1, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(s + m * lds + j, _mm256_mul_ps(acc[m][0], scale8));
      if (two) _mm256_storeu_ps(s + m * lds + j + 8, _mm256_mul_ps(acc[m][1], scale8));
    }
  }
}

// The largest of s[0..n), n >= 1, 8 lanes at a time (s readable to n rounded up to 8).
float row_max(const float* s, int64_t n) {
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
// their sum.
float exponentials(const float* s, float shift, int64_t n, int64_t width, float* p) {
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

// out_m (D) = sum over j < n of w[m][j] rows(j), for M weight rows ldw apart and outputs ldo
// apart; D a multiple of 8. Each row of x is loaded once for the M outputs.
template <int M>
void weighted_rows(const float* w, int64_t ldw, const Rows& x, int64_t b, int64_t h, int64_t n,
                   int64_t D, float* out, int64_t ldo) {
  for (int64_t c = 0; c < D; c += 16) {
    const bool two = c + 8 < D;
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* row = x(b, h, j) + c;
      const __m256 r0 = _mm256_loadu_ps(row);
      const __m256 r1 = two ? _mm256_loadu_ps(row + 8) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const __m256 wm = _mm256_set1_ps(w[m * ldw + j]);
        acc[m][0] = _mm256_fmadd_ps(wm, r0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(wm, r1, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(out + m * ldo + c, acc[m][0]);
      if (two) _mm256_storeu_ps(out + m * ldo + c + 8, acc[m][1]);
    }
  }
}

// rows[j] += sum over m of w[m][j] a_m for j < n: M rows a_m (D, lda apart), w rows ldw apart,
// rows (n, D) contiguous.
template <int M>
void add_outer(const float* w, int64_t ldw, const float* a, int64_t lda, int64_t n, int64_t D,
               float* rows) {
  for (int64_t j = 0; j < n; ++j) {
    __m256 wj[M];
    for (int m = 0; m < M; ++m) wj[m] = _mm256_set1_ps(w[m * ldw + j]);
    float* row = rows + j * D;
    for (int64_t c = 0; c < D; c += 8) {
      __m256 acc = _mm256_loadu_ps(row + c);
      for (int m = 0; m < M; ++m) acc = _mm256_fmadd_ps(wj[m], _mm256_loadu_ps(a + m * lda + c), acc);
      _mm256_storeu_ps(row + c, acc);
    }
  }
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
    std::vector<float> panel(D * Tp), scores(kQueries * Tp), probs(kQueries * Tp);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * H; ++task) {
      const int64_t b = task / H, h = task % H, kv = h / group;
      transpose_panel(kr, b, kv, T, Tp, D, panel.data());
      for (int64_t i0 = 0; i0 < T; i0 += kQueries) {
        const int64_t rows = std::min<int64_t>(kQueries, T - i0);
        const int64_t n_last = causal ? i0 + rows : T;  // the columns the tile's last row sees
        const int64_t width = (n_last + 7) / 8 * 8;
        const float* query = qr(b, h, i0);  // rows qr.time apart
        if (rows == kQueries)
          dots<kQueries>(query, qr.time, panel.data(), Tp, D, n_last, s, scores.data(), Tp);
        else
          for (int64_t m = 0; m < rows; ++m)
            dots<1>(query + m * qr.time, D, panel.data(), Tp, D, n_last, s, scores.data() + m * Tp, Tp);
        float sums[kQueries];
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t n = causal ? i0 + m + 1 : T;
          const float* row = scores.data() + m * Tp;
          const float top = row_max(row, n);
          sums[m] = exponentials(row, top, n, width, probs.data() + m * Tp);
          lp[(b * H + h) * T + i0 + m] = top + std::log(sums[m]);
        }
        float* o = op + ((b * T + i0) * H + h) * D;  // rows H * D apart
        if (rows == kQueries)
          weighted_rows<kQueries>(probs.data(), Tp, vr, b, kv, n_last, D, o, H * D);
        else
          for (int64_t m = 0; m < rows; ++m)
            weighted_rows<1>(probs.data() + m * Tp, Tp, vr, b, kv, n_last, D, o + m * H * D, H * D);
        for (int64_t m = 0; m < rows; ++m) {
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
  auto dk = torch::empty({B, T, KV, D}, q.options());  // (B, T, KV, D)
  auto dv = torch::empty({B, T, KV, D}, q.options());
  const Rows qr = rows_of(q), kr = rows_of(k), vr = rows_of(v), gr = rows_of(grad),
             orow = rows_of(out);
  const float* lp = lse.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const float s = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> k_panel(D * Tp), v_panel(D * Tp), scores(kQueries * Tp), probs(kQueries * Tp),
        dprobs(kQueries * Tp), dk_rows(T * D), dv_rows(T * D);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * KV; ++task) {
      const int64_t b = task / KV, kv = task % KV;
      transpose_panel(kr, b, kv, T, Tp, D, k_panel.data());
      transpose_panel(vr, b, kv, T, Tp, D, v_panel.data());
      std::fill(dk_rows.begin(), dk_rows.end(), 0.f);
      std::fill(dv_rows.begin(), dv_rows.end(), 0.f);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        for (int64_t i0 = 0; i0 < T; i0 += kQueries) {
          const int64_t rows = std::min<int64_t>(kQueries, T - i0);
          const int64_t n_last = causal ? i0 + rows : T;
          const int64_t width = (n_last + 7) / 8 * 8;
          const float* query = qr(b, h, i0);  // rows qr.time apart
          const float* dout = gr(b, h, i0);   // rows gr.time apart
          if (rows == kQueries) {
            dots<kQueries>(query, qr.time, k_panel.data(), Tp, D, n_last, s, scores.data(), Tp);
            dots<kQueries>(dout, gr.time, v_panel.data(), Tp, D, n_last, 1.f, dprobs.data(), Tp);
          } else {
            for (int64_t m = 0; m < rows; ++m) {
              dots<1>(query + m * qr.time, D, k_panel.data(), Tp, D, n_last, s,
                      scores.data() + m * Tp, Tp);
              dots<1>(dout + m * gr.time, D, v_panel.data(), Tp, D, n_last, 1.f,
                      dprobs.data() + m * Tp, Tp);
            }
          }
          for (int64_t m = 0; m < rows; ++m) {
            const int64_t n = causal ? i0 + m + 1 : T;
            float* p = probs.data() + m * Tp;
            float* dp = dprobs.data() + m * Tp;  // dout_i · v_j, then ds_ij in place
            exponentials(scores.data() + m * Tp, lp[(b * H + h) * T + i0 + m], n, width, p);
            const __m256 Di = _mm256_set1_ps(dot(dout + m * gr.time, orow(b, h, i0 + m), D));
            const __m256 s8 = _mm256_set1_ps(s);
            for (int64_t j = 0; j < width; j += 8)  // zero past n, as p is
              _mm256_storeu_ps(dp + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), s8),
                                                     _mm256_sub_ps(_mm256_loadu_ps(dp + j), Di)));
          }
          float* dq_rows = dqp + ((b * T + i0) * H + h) * D;  // rows H * D apart
          if (rows == kQueries) {
            add_outer<kQueries>(probs.data(), Tp, dout, gr.time, n_last, D, dv_rows.data());
            add_outer<kQueries>(dprobs.data(), Tp, query, qr.time, n_last, D, dk_rows.data());
            weighted_rows<kQueries>(dprobs.data(), Tp, kr, b, kv, n_last, D, dq_rows, H * D);
          } else {
            for (int64_t m = 0; m < rows; ++m) {
              add_outer<1>(probs.data() + m * Tp, Tp, dout + m * gr.time, D, n_last, D,
                           dv_rows.data());
              add_outer<1>(dprobs.data() + m * Tp, Tp, query + m * qr.time, D, n_last, D,
                           dk_rows.data());
              weighted_rows<1>(dprobs.data() + m * Tp, Tp, kr, b, kv, n_last, D,
                               dq_rows + m * H * D, H * D);
            }
          }
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        std::copy_n(dk_rows.data() + j * D, D, dkp + ((b * T + j) * KV + kv) * D);
        std::copy_n(dv_rows.data() + j * D, D, dvp + ((b * T + j) * KV + kv) * D);
      }
    }
  }
  return {dq.permute({0, 2, 1, 3}), dk.permute({0, 2, 1, 3}), dv.permute({0, 2, 1, 3})};
}

}  // namespace glassformer
