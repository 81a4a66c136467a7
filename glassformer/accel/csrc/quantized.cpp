// The quantized weight formats (q8, q4): activation quantization, the integer-dot kernels,
// and dequantization for large batches.
//
// Formats (rows contiguous, blocks of 32 along K):
//   q8    qs (N, K32) int8, d (N, K32/32) fp16:            w = d * q            (like Q8_0)
//   q4    qs (N, K32/2) uint8 nibbles, d, m (N, K32/32) fp16: w = d * q + m, q in 0..15
//         (like Q4_1; Q4_0 is the case m = -8 d). Byte j of a block holds element j in its
//         low nibble and element j + 16 in its high nibble, as in GGUF.
// The kernels quantize x per block of 32 to int8 (scale amax / 127, round half to even) and
// take integer dot products with maddubs/madd (vpdpbusd with VNNI), as llama.cpp's Q8_0 dot
// does. K32 is K rounded up to a multiple of 32; the padding columns of W are zero and the
// activation tail is padded with zeros.
//
// Many rows (a batched decode step, a prefill) are one GEMM whose weight blocks are each loaded
// and unpacked once for a tile of activation rows, so a call reads the weights from memory
// once whatever the number of rows. Weight rows go in tiles of 16, stored in tile order
// (tile_order.py to_tile_order, done once when a layer is built): for each block, its dword t
// of the tile's rows side by side (one plain load puts row r's in lane r), and the scales (and
// minimums) of the tile's rows side by side per block. Each output row is a lane: no sum
// across lanes and no partial tail, whatever K.
//   AVX-512 VNNI: each activation row's block takes 8 vpdpbusd against its dwords broadcast,
//     then one conversion, one scale multiply and FMA (q4: one more for the minimum) into 16
//     outputs at once. Tiles of 8 activation rows (then 4, 2, 1) share each weight load.
//   AVX2: the tile in two halves of 8 lanes; maddubs (q4: summed in int16 over the block) and
//     one madd per block instead of vpdpbusd, then the same float operations. Tiles of 4
//     activation rows (then 2, 1): a half's unpacked weights take 8 of the 16 registers.
// Each row's float operations are the same in any tile and at any place in it (the integer
// sums are exact whatever their order), so its result is bitwise the same whatever the
// number of rows and its place among them.

#include <cstring>

#include "glassformer.h"

namespace glassformer {
namespace {

// Where the compiler targets AVX-512 VNNI (-march=native on such a CPU), the kernels take 64
// weight bytes per instruction with vpdpbusd (kWide); elsewhere 32 with AVX2 maddubs.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GLASSFORMER_WIDE 1
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

inline float half(const uint16_t* p) { return _cvtsh_ss(*p); }

}  // namespace

// ------------------------------------------------------------ activation quantization (Q8)

// Quantizes each row of x (M, K) in blocks of 32: q = round(x * 127 / amax), d = amax / 127,
// s = d * sum(q) (used by the q4 minimum term). The tail past K is zero.
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t nb, int8_t* q, float* d,
                          float* s, int32_t* c) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16)) num_threads(at::get_num_threads())
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      alignas(32) float buf[32];
      const float* src = x + m * K + b * 32;
      const int64_t len = std::min<int64_t>(32, K - b * 32);
      if (len < 32) {
        for (int i = 0; i < 32; ++i) buf[i] = i < len ? src[i] : 0.0f;
        src = buf;
      }
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      a = _mm_max_ss(a, _mm_movehdup_ps(a));
      const float max_abs = _mm_cvtss_f32(a);
      const float dm = max_abs / 127.0f;
      const __m256 id = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
      const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                             _mm256_add_epi32(qi[2], qi[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32),
                                 _mm256_extracti128_si256(sum32, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      // packs interleave 128-bit lanes; the permutation restores element order
      const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
      const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (m * nb + b) * 32), p);
      d[m * nb + b] = dm;
      s[m * nb + b] = dm * static_cast<float>(_mm_cvtsi128_si32(s4));
      if (c) c[m * nb + b] = -128 * _mm_cvtsi128_si32(s4);
    }
  }
}

namespace {

// Quantized activations: q (M, nb * 32) in block order, d and s (M, nb), and for the AVX-512
// q8 kernel c = -128 sum(q) (M, nb).
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> c;
};

// Quantized activations in buffers reused across calls (no allocation per call), for q4 or q8
// weights.
const Activations& quantized(const torch::Tensor& x, int64_t M, int64_t K, int64_t nb, bool q4) {
  thread_local Activations a;
  a.q.resize(M * nb * 32);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  const bool sums = kWide && !q4;  // c: the AVX-512 q8 kernel's start (q4 weights need none)
  a.c.resize(sums ? M * nb : 0);
  quantize_activations(x.data_ptr<float>(), M, K, nb, a.q.data(), a.d.data(), a.s.data(),
                       sums ? a.c.data() : nullptr);
  return a;
}

constexpr int64_t kTile = 16;  // weight rows a tile (accel/tile_order.py)
// Activation rows sharing each unpacked weight block: AVX-512 has 32 vector registers, AVX2 16
// (a half tile's 8 weight vectors take half of them).
constexpr int kActivationRows = kWide ? 8 : 4;

#ifdef GLASSFORMER_WIDE
// y[m, r] = sum_b dw[r, b] dx[m, b] (q[r, b] · qx[m, b]) (+ for q4 the minimum term
// mw[r, b] sx[m, b]) for the R <= 16 weight rows of a tile, lane r each, and MB activation
// rows from m0, block by block. In tile order a block's dword t of the R rows is 4 R bytes
// (one load puts row r's in lane r), its scales R halves: each load and unpacking serves the
// MB rows. A row's block takes 8 vpdpbusd against its activation dwords broadcast (exact
// integer sums; q4: nibbles times x, q8: w + 128 times x started from -128 sum(x)), then one
// conversion, one scale multiply and one FMA (q4: one more for the minimum): the same float
// operations, in block order, whatever MB and the row's place among the rows, so a row's
// result does not depend on them. No sum across lanes, and no tail: the lanes are outputs.
template <bool Q4, int MB>
inline void tile_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int R,
                      int64_t nb, const Activations& a, int64_t m0, float* y, int64_t ldy,
                      const float* bias) {
  constexpr int kDwords = Q4 ? 4 : 8;  // weight dwords per row and block
  constexpr int kChains = MB >= 2 ? 1 : 2;  // independent integer sums per row: few rows, short chains
  const __mmask16 lanes = static_cast<__mmask16>((1u << R) - 1);
  const __m512i low4 = _mm512_set1_epi8(0x0F), shift = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kDwords * R * 4;
    prefetch(dw + b * R);
    if constexpr (Q4) prefetch(mw + b * R);
    __m512i wv[8];  // the weight bytes meeting activation dword u (q4: low nibbles, then high)
    for (int t = 0; t < kDwords; ++t) {
      prefetch(wb + t * R * 4);
      const __m512i raw = _mm512_maskz_loadu_epi32(lanes, wb + t * R * 4);
      if constexpr (Q4) {
        wv[t] = _mm512_and_si512(raw, low4);
        wv[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      } else {
        wv[t] = _mm512_xor_si512(raw, shift);
      }
    }
    const __m512 wd = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, dw + b * R));
    const __m512 wm = Q4 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, mw + b * R)) : wd;
    __m512i dot[MB][kChains];
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < kChains; ++h)
        dot[m][h] = Q4 || h ? _mm512_setzero_si512() : _mm512_set1_epi32(a.c[(m0 + m) * nb + b]);
    for (int u = 0; u < 8; ++u)
      for (int m = 0; m < MB; ++m) {
        int32_t xd;  // dword u of row m's block b
        std::memcpy(&xd, a.q.data() + ((m0 + m) * nb + b) * 32 + 4 * u, 4);
        dot[m][u % kChains] = _mm512_dpbusd_epi32(dot[m][u % kChains], wv[u], _mm512_set1_epi32(xd));
      }
    for (int m = 0; m < MB; ++m) {
      __m512i sum = dot[m][0];
      for (int h = 1; h < kChains; ++h) sum = _mm512_add_epi32(sum, dot[m][h]);
      const int64_t at = (m0 + m) * nb + b;
      const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(a.d[at]));
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[m]);
      if constexpr (Q4) acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.s[at]), acc[m]);
    }
  }
  const __m512 add = bias ? _mm512_maskz_loadu_ps(lanes, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m)
    _mm512_mask_storeu_ps(y + m * ldy, lanes, bias ? _mm512_add_ps(acc[m], add) : acc[m]);
}
#else
// The same for AVX2 without VNNI: a tile's 16 rows in two halves of 8, one per 32-bit lane of
// a 256-bit register (rows 0-7 are a unit's first 32 bytes in tile order, rows 8-15 the next).
// For each block, the half's weight bytes meeting activation dword u (q4: dword u's low
// nibbles for u < 4, dword u - 4's high nibbles after) are unpacked once for the MB rows; each
// row then takes, per dword, one maddubs against that dword broadcast: q4 nibbles (0..15) times
// int8 sum in int16 without saturation over the whole block (8 · 2 · 15 · 127 < 2^15), then one
// madd widens them; q8 weights go through the sign trick (|w| times x with w's sign), each
// dword's pairs widened by its own madd. Then, as on AVX-512, one conversion, one scale
// multiply and FMA (q4: one more for the minimum) per block, in block order.
// The first `lanes` <= 8 fp16 values at p as floats, zeros after.
inline __m256 scales_of(const uint16_t* p, int lanes) {
  if (lanes == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t v[8] = {};
  for (int i = 0; i < lanes; ++i) v[i] = p[i];
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
}

template <bool Q4, int MB>
inline void half_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int R, int h,
                      int64_t nb, const Activations& a, int64_t m0, float* y, int64_t ldy,
                      const float* bias) {
  constexpr int kDwords = Q4 ? 4 : 8;  // weight dwords per row and block
  const int lanes = std::min(8, R - 8 * h);  // this half's rows
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kDwords * R * 4 + 32 * h;
    prefetch(wb);
    __m256i wv[8];  // the weight bytes meeting activation dword u (q4: low nibbles, then high)
    for (int t = 0; t < kDwords; ++t) {
      const __m256i raw = _mm256_maskload_epi32(reinterpret_cast<const int*>(wb + t * R * 4), mask);
      if constexpr (Q4) {
        wv[t] = _mm256_and_si256(raw, low4);
        wv[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      } else {
        wv[t] = raw;
      }
    }
    const __m256 wd = scales_of(dw + b * R + 8 * h, lanes);
    const __m256 wm = Q4 ? scales_of(mw + b * R + 8 * h, lanes) : wd;
    for (int m = 0; m < MB; ++m) {
      const int64_t at = (m0 + m) * nb + b;
      const int8_t* xb = a.q.data() + at * 32;
      __m256i sum;
      if constexpr (Q4) {
        __m256i pairs = _mm256_setzero_si256();
        for (int u = 0; u < 8; ++u) {
          int32_t xd;  // dword u of row m's block b
          std::memcpy(&xd, xb + 4 * u, 4);
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[u], _mm256_set1_epi32(xd)));
        }
        sum = _mm256_madd_epi16(pairs, ones);
      } else {
        sum = _mm256_setzero_si256();
        for (int u = 0; u < 8; ++u) {
          int32_t xd;
          std::memcpy(&xd, xb + 4 * u, 4);
          const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv[u], wv[u]),
                                                 _mm256_sign_epi8(_mm256_set1_epi32(xd), wv[u]));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
        }
      }
      const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(a.d[at]));
      acc[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum), acc[m]);
      if constexpr (Q4) acc[m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(a.s[at]), acc[m]);
    }
  }
  const __m256 add = bias ? _mm256_maskload_ps(bias + 8 * h, mask) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m)
    _mm256_maskstore_ps(y + m * ldy + 8 * h, mask, bias ? _mm256_add_ps(acc[m], add) : acc[m]);
}

template <bool Q4, int MB>
inline void tile_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int R,
                      int64_t nb, const Activations& a, int64_t m0, float* y, int64_t ldy,
                      const float* bias) {
  for (int h = 0; h * 8 < R; ++h) half_rows<Q4, MB>(w, dw, mw, R, h, nb, a, m0, y, ldy, bias);
}
#endif

// y (M, N) for weights in tile order: tile by tile (threads take tiles), each tile's blocks,
// while in the L1 cache, meeting every activation row in tiles of kActivationRows rows, then
// halves down to 1. A call reads the weights from memory once whatever the number of rows.
template <bool Q4>
void linear_quant(const uint8_t* w, const uint16_t* dw, const uint16_t* mw,
                  const Activations& a, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t nb) {
  const int64_t row_bytes = nb * (Q4 ? 16 : 32), tiles = (N + kTile - 1) / kTile;
  auto run = [&](int64_t i) {
    const int64_t n0 = i * kTile;
    const int R = static_cast<int>(std::min(kTile, N - n0));
    const uint8_t* wt = w + n0 * row_bytes;
    const uint16_t* dt = dw + n0 * nb;
    const uint16_t* mt = Q4 ? mw + n0 * nb : nullptr;
    const float* bt = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + kActivationRows <= M; m += kActivationRows)
      tile_rows<Q4, kActivationRows>(wt, dt, mt, R, nb, a, m, y + m * N + n0, N, bt);
    if (kActivationRows > 4 && M - m >= 4) {
      tile_rows<Q4, 4>(wt, dt, mt, R, nb, a, m, y + m * N + n0, N, bt);
      m += 4;
    }
    if (M - m >= 2) {
      tile_rows<Q4, 2>(wt, dt, mt, R, nb, a, m, y + m * N + n0, N, bt);
      m += 2;
    }
    if (M - m >= 1) tile_rows<Q4, 1>(wt, dt, mt, R, nb, a, m, y + m * N + n0, N, bt);
  };
  // threads take runs of tiles as they come (a thread slowed by another process leaves its
  // share to the others). A run starts its reads cold (the prefetches reach within it): for
  // few activation rows, 2 runs a thread; with 8, one stream's decode was 6-16% slower and an
  // 8-row engine step 9% (SmolLM2 int4 and Q4_1, 2 threads, Xeon model 207). From 16 rows a
  // tile holds enough arithmetic that balancing pays: 8 runs a thread (2 were 6% slower)
  const int threads = N * row_bytes * std::max<int64_t>(M / 8, 1) >= (64 << 10) ? at::get_num_threads() : 1;
  const int64_t runs = M < 16 ? 2 : 8;
  const int64_t run_length = std::max<int64_t>(1, tiles / (runs * threads));
#pragma omp parallel for schedule(dynamic, run_length) if (threads > 1) num_threads(threads)
  for (int64_t i = 0; i < tiles; ++i) run(i);
}

// ---------------------------------------------------------- dequantization (large batches)

// Row n of the float weight: w[k] = d[k / 32] * q[k] (+ m[k / 32]) for k < K.
template <bool Q4>
void dequantize_row(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t nb, int64_t K,
                    float* out) {
  alignas(32) float block[32];
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 scale = _mm256_set1_ps(half(d + b));
    const __m256 shift = Q4 ? _mm256_set1_ps(half(m + b)) : _mm256_setzero_ps();
    __m256i bytes;  // 32 quantized values, in element order
    if constexpr (Q4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      bytes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                               _mm256_set1_epi8(0x0F));
    } else {
      bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
    }
    float* dst = (b + 1) * 32 <= K ? out + b * 32 : block;
    for (int i = 0; i < 4; ++i) {
      const __m128i eight = i < 2 ? _mm256_castsi256_si128(bytes)
                                  : _mm256_extracti128_si256(bytes, 1);
      const __m128i part = (i & 1) ? _mm_srli_si128(eight, 8) : eight;
      const __m256i wide = Q4 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
      _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(wide), shift));
    }
    if (dst == block) std::memcpy(out + b * 32, block, (K - b * 32) * sizeof(float));
  }
}

}  // namespace

// ------------------------------------------------------------------------ entry points

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

}  // namespace glassformer
