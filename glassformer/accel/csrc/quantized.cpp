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
// Many rows (a batched decode step, a prefill) are one GEMM: weight rows are walked in groups
// of kRows as in matvec.cpp (for_row_groups), and a group's blocks, while in the L1 cache,
// meet every activation row in tiles of rows, each block load and unpacking shared by the
// tile. A call thus reads the weights from memory once whatever the number of rows.
//   AVX-512 VNNI: blocks go in chunks of 16, one per 32-bit lane, and the weight rows are
//     stored in chunk order (chunk_order.py to_chunk_order, done once when a layer is built):
//     the t-th 64 bytes of a chunk hold bytes 4t..4t+3 of each of its 16 blocks, so that one
//     plain load puts block j's in lane j; the activations are laid out alike when quantized.
//     A chunk of a weight row is loaded once per tile (kWideTileRows = 16 rows, then tiles of
//     8, 4, 2, 1). Each row of the tile then takes 8 vpdpbusd (exact integer sums), one
//     conversion and one scale multiply and FMA (q4: one more for the minimum) per chunk of
//     16 blocks, not per block. Tiles of 8 and 16 rows take each weight dword across all
//     their rows before the next (tile_deep): one independent vpdpbusd sum per row in flight.
//     A tail of up to one 64-byte load (4 q4 or 2 q8 blocks) stays in block order and is
//     taken as loaded, 4 or 8 lanes per block.
//   AVX2: weight rows in block order (GGUF's), kTileRows rows a tile, the group's scales
//     widened to float once, maddubs/madd per block (q4: per pair of blocks).
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

// ------------------------------------------------------------ activation quantization (Q8)

// Quantizes each row of x (M, K) in blocks of 32: q = round(x * 127 / amax), d = amax / 127,
// s = d * sum(q) (used by the q4 minimum term). The tail past K is zero.
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t nb, int8_t* q, float* d,
                          float* s) {
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
    }
  }
}

// n blocks of 32 from p reordered as [elements 0..15 of each block][elements 16..31 of each].
inline void interleave_halves(int8_t* p, int n) {
  alignas(32) int8_t tmp[2 * 32];
  for (int i = 0; i < n; ++i) {
    std::memcpy(tmp + i * 16, p + i * 32, 16);
    std::memcpy(tmp + (n + i) * 16, p + i * 32 + 16, 16);
  }
  std::memcpy(p, tmp, n * 32);
}

// Quantized activations. AVX2: q (M, nb * 32) in block order (q4: pairs interleaved), d and s
// (M, nb). AVX-512 (kWide): rows in chunks of 16 blocks (kChunk), the rows of a chunk side by
// side: q (chunks, M, 8, 16, 4) holds element 4t + i of the chunk's block j at [t][j][i], so
// that 32-bit lane j of the t-th 64 bytes belongs to block j; d, s and, for q8's unsigned
// weights, c = -128 sum(q) are (chunks, M, 16), lane j block j's. A last chunk of at most one
// 64-byte weight load (tail_blocks) is laid out as that load: lane l of its 64-byte part p
// holds dword 4p + l % 4 of block l / 4 (q4, 4 blocks) or dword l % 8 of block l / 8 (q8, 2
// blocks); d spread over the block's lanes, s and c in its first lane, zeros elsewhere. The
// rest of a last chunk is zero blocks.
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> c;
  int64_t rows = 0;
};

constexpr int64_t kChunk = 16;  // blocks per chunk of the AVX-512 kernels: one per 32-bit lane

// The blocks past the last whole chunk when one 64-byte weight load holds them (q4: up to 4,
// q8: up to 2), else 0 (then they make a chunk padded with zero blocks).
inline int64_t tail_blocks(int64_t nb, bool q4) {
  const int64_t tail = nb % kChunk;
  return tail <= (q4 ? 4 : 2) ? tail : 0;
}

#ifdef GLASSFORMER_WIDE
// quantize_activations' arithmetic for one block of `len` <= 32 floats from x (zeros after),
// 32 floats at a time: q the 32 values in element order, d the scale; returns sum(q). The
// maximum, products and roundings are those of the 8-lane code, so the results are the same.
inline int32_t quantize_block(const float* x, int64_t len, int8_t* q, float* d) {
  const auto first = [](int64_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  };
  const __m512 v0 = _mm512_maskz_loadu_ps(first(len), x);
  const __m512 v1 = _mm512_maskz_loadu_ps(first(len - 16), x + 16);
  const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *d = max_abs / 127.0f;
  const __m512 id = _mm512_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

// The chunk layout of Activations (kWide) for x (M, K), each block quantized where it goes.
void quantize_chunks(const float* x, int64_t M, int64_t K, int64_t nb, bool paired,
                     Activations& a) {
  const int64_t stride = (nb + kChunk - 1) / kChunk * kChunk;  // blocks per padded row
  a.rows = M;
  a.q.resize(M * stride * 32);
  a.d.resize(M * stride);
  a.s.resize(M * stride);
  a.c.resize(M * stride);
  // only the last chunk has lanes that no block fills: zeros there
  const int64_t last = (stride - kChunk) * M;  // its first lane
  std::fill(a.q.begin() + last * 32, a.q.end(), 0);
  std::fill(a.d.begin() + last, a.d.end(), 0.0f);
  std::fill(a.s.begin() + last, a.s.end(), 0.0f);
  std::fill(a.c.begin() + last, a.c.end(), 0);
  const int64_t tail = tail_blocks(nb, paired), lanes = paired ? 4 : 8;  // lanes per block
  // the buffers may be a thread's own (thread_local): the loop's other threads get pointers
  int8_t* out_q = a.q.data();
  float* out_d = a.d.data();
  float* out_s = a.s.data();
  auto* out_c = a.c.data();
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16)) num_threads(at::get_num_threads())
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(32) int8_t src[32];
      float d;
      const int32_t sum = quantize_block(x + m * K + b * 32, K - b * 32, src, &d);
      const int64_t first = (b / kChunk * M + m) * kChunk;  // [chunk][m] lane 0
      int8_t* chunk = out_q + first * 32;
      const int64_t j = b % kChunk;
      const bool in_tail = b >= nb - tail;
      for (int t = 0; t < 8; ++t) {
        const int64_t lane = in_tail ? j * lanes + t % lanes : j;
        const int64_t part = in_tail ? t / lanes : t;  // the 64-byte part
        std::memcpy(chunk + part * 64 + lane * 4, src + 4 * t, 4);
      }
      const int64_t at = first + (in_tail ? j * lanes : j);
      for (int64_t l = 0; l < (in_tail ? lanes : 1); ++l) out_d[at + l] = d;
      out_s[at] = d * static_cast<float>(sum);
      out_c[at] = -128 * sum;
    }
}
#endif

// Quantized activations in buffers reused across calls (no allocation per call). With
// `paired` (for q4 weights, AVX2), blocks are interleaved in pairs ([elements 0..15 of each
// block][elements 16..31 of each block], the order in which one load of q4 nibbles unpacks).
const Activations& quantized(const torch::Tensor& x, int64_t M, int64_t K, int64_t nb,
                             bool paired) {
  thread_local Activations a;
#ifdef GLASSFORMER_WIDE
  quantize_chunks(x.data_ptr<float>(), M, K, nb, paired, a);
#else
  a.q.resize(M * nb * 32);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  quantize_activations(x.data_ptr<float>(), M, K, nb, a.q.data(), a.d.data(), a.s.data());
  if (paired) {
    for (int64_t m = 0; m < M; ++m) {
      int8_t* row = a.q.data() + m * nb * 32;
      for (int64_t b = 0; b + 2 <= nb; b += 2) interleave_halves(row + b * 32, 2);
    }
  }
#endif
  return a;
}

#ifdef GLASSFORMER_WIDE
// The first n <= 64 bytes of a 64-byte load.
inline __mmask64 first_bytes(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << std::max<int64_t>(n, 0)) - 1;
}

// Weight row w's chunk of `len` <= 16 blocks from block b0, stored in chunk order (bytes
// [t][j][4]: dword t of the chunk's block j at 4 (t len + j)), as registers: out[t] holds
// dword t of block j in 32-bit lane j, zeros past `len`. Plain loads, one per dword index.
template <bool Q4>
inline void chunk_dwords(const uint8_t* w, int64_t b0, int len, __m512i (&out)[Q4 ? 4 : 8]) {
  constexpr int kDwords = Q4 ? 4 : 8;
  const uint8_t* p = w + b0 * 4 * kDwords;
  for (int t = 0; t < kDwords; ++t) {
    prefetch(p + t * 64);
    out[t] = len == kChunk ? _mm512_loadu_si512(p + t * 64)
                           : _mm512_maskz_loadu_epi8(first_bytes(4 * len), p + t * 4 * len);
  }
}

// The `len` <= 16 fp16 values from p as floats, zeros after.
inline __m512 load_halves16(const uint16_t* p, int len) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << len) - 1), p));
}

// The sum of v's 16 lanes in a fixed order: lanes i and i + 8, then i and i + 4 of those,
// i and i + 2, then the last two (the order of _mm512_reduce_add_ps, written out so that
// lane_sums below repeats it exactly).
inline float lane_sum(__m512 v) {
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // lanes 0, 1: c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// out[i] = lane_sum(v[i]) for the n <= 16 vectors v, bit for bit, the 16 sums computed side
// by side (15 adds instead of 4 per vector): each level adds the same lanes as lane_sum,
// moving the rows' partial sums together.
inline void lane_sums(const __m512* v, int n, float (&out)[16]) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 b[8];  // rows 2k, 2k + 1: lanes i + (i + 8), in the lower and upper 8 lanes
  for (int k = 0; k < 8; ++k) {
    const __m512 p = 2 * k < n ? v[2 * k] : zero, q = 2 * k + 1 < n ? v[2 * k + 1] : zero;
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));
  }
  __m512 c[4];  // rows 4k..4k + 3, one per 128-bit block: lanes i + (i + 4)
  for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  __m512 d[2];  // block j: lanes i + (i + 2) of row j of c[2k], then of c[2k + 1]
  for (int k = 0; k < 2; ++k)
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float t[16];  // lane 4 j + k: row 4 k + j
  _mm512_store_ps(t, s);
  for (int i = 0; i < 16; ++i) out[i] = t[4 * (i % 4) + i / 4];
}

// y[m, r ld] = sum_b dw[r, b] dx[m, b] (q[r, b] · qx[m, b]) (+ for q4 the minimum term
// mw[r, b] sx[m, b]) for R weight rows ld rows apart and MB activation rows from m0, in
// chunks of 16 blocks: lane j of a row pair's accumulator takes block j of each chunk. A
// weight row's chunk is loaded once for the tile (q4: its nibbles split once); each row pair
// then needs 8 vpdpbusd for the chunk's exact integer products (q4: nibbles times x; q8:
// w + 128 times x, started from -128 sum(x)), one conversion, one multiply of the scales
// and one or two FMAs. A short tail (tail_blocks) is one weight load as it is, its blocks 4
// (q4) or 8 (q8) lanes each: 2 or 1 vpdpbusd. Integer sums are exact and each row's float
// operations are the same in any tile, so a row's result does not depend on MB or its place.
template <bool Q4, int R, int MB>
inline void tile_wide(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                      int64_t ld, const Activations& a, int64_t m0, float* y, int64_t ldy,
                      const float* bias) {
  constexpr int kChains = MB * R >= 4 ? 1 : 2;  // independent vpdpbusd sums per row pair
  const int64_t row_bytes = nb * (Q4 ? 16 : 32);
  const int64_t tail = tail_blocks(nb, Q4), body = nb - tail;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), shift = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b0 = 0; b0 < body; b0 += kChunk) {
    const int len = static_cast<int>(std::min<int64_t>(kChunk, body - b0));
    const int64_t at = (b0 / kChunk * a.rows + m0) * kChunk;  // the tile's rows in the chunk
    const int8_t* xq = a.q.data() + at * 32;
    const float* dx = a.d.data() + at;
    const float* sx = a.s.data() + at;
    const int32_t* cx = a.c.data() + at;
    for (int r = 0; r < R; ++r) {
      __m512i wv[8];  // q4: low nibbles of dwords 0-3, then high; q8: w + 128
      if constexpr (Q4) {
        __m512i raw[4];
        chunk_dwords<true>(w + r * ld * row_bytes, b0, len, raw);
        for (int t = 0; t < 4; ++t) {
          wv[t] = _mm512_and_si512(raw[t], low4);
          wv[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[t], 4), low4);
        }
      } else {
        chunk_dwords<false>(w + r * ld * row_bytes, b0, len, wv);
        for (int t = 0; t < 8; ++t) wv[t] = _mm512_xor_si512(wv[t], shift);
      }
      const __m512 wd = load_halves16(dw + r * ld * nb + b0, len);
      const __m512 wm = Q4 ? load_halves16(mw + r * ld * nb + b0, len) : wd;
      for (int m = 0; m < MB; ++m) {
        __m512i dot[kChains];  // kChains parts: short dependency chains where rows are few
        for (int h = 0; h < kChains; ++h)
          dot[h] = Q4 || h ? _mm512_setzero_si512() : _mm512_loadu_si512(cx + m * kChunk);
        for (int t = 0; t < 8 / kChains; ++t)
          for (int h = 0; h < kChains; ++h) {
            const int u = h * (8 / kChains) + t;
            dot[h] = _mm512_dpbusd_epi32(dot[h], wv[u], _mm512_loadu_si512(xq + m * 512 + u * 64));
          }
        const __m512i sum = kChains == 1 ? dot[0] : _mm512_add_epi32(dot[0], dot[kChains - 1]);
        const __m512 scale = _mm512_mul_ps(wd, _mm512_loadu_ps(dx + m * kChunk));
        acc[m][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[m][r]);
        if constexpr (Q4)
          acc[m][r] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(sx + m * kChunk), acc[m][r]);
      }
    }
  }
  if (tail) {
    const int64_t at = (body / kChunk * a.rows + m0) * kChunk;
    const int8_t* xq = a.q.data() + at * 32;
    const float* dx = a.d.data() + at;
    const float* sx = a.s.data() + at;
    const int32_t* cx = a.c.data() + at;
    // lane l belongs to block l / 4 (q4) or l / 8 (q8): the weight scales spread so
    const __m512i idx = Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w + r * ld * row_bytes + body * (Q4 ? 16 : 32);
      const __m512i raw = _mm512_maskz_loadu_epi8(first_bytes(tail * (Q4 ? 16 : 32)), p);
      const int len = static_cast<int>(tail);
      const __m512 wd = _mm512_permutexvar_ps(idx, load_halves16(dw + r * ld * nb + body, len));
      const __m512 wm =
          Q4 ? _mm512_permutexvar_ps(idx, load_halves16(mw + r * ld * nb + body, len)) : wd;
      for (int m = 0; m < MB; ++m) {
        __m512i dot;
        if constexpr (Q4) {
          dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(raw, low4),
                                    _mm512_loadu_si512(xq + m * 512));
          dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                    _mm512_loadu_si512(xq + m * 512 + 64));
        } else {
          dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(cx + m * kChunk),
                                    _mm512_xor_si512(raw, shift), _mm512_loadu_si512(xq + m * 512));
        }
        const __m512 scale = _mm512_mul_ps(wd, _mm512_loadu_ps(dx + m * kChunk));
        acc[m][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[m][r]);
        if constexpr (Q4)
          acc[m][r] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(sx + m * kChunk), acc[m][r]);
      }
    }
  }
  alignas(64) float sums[16];  // lane_sum(acc[m][r]) at m R + r
  if constexpr (MB * R >= 8) {
    static_assert(MB * R <= 16, "one lane_sums call per tile");
    lane_sums(&acc[0][0], MB * R, sums);
  } else {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) sums[m * R + r] = lane_sum(acc[m][r]);
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + r * ld] = sums[m * R + r] + (bias ? bias[r * ld] : 0.0f);
}

// The same for one weight row and a deep tile of MB >= 8 rows, the loops turned around: each
// dword of the weight chunk (q4: low and high nibbles) is unpacked once and taken by the MB rows
// in turn, so MB independent vpdpbusd sums are in flight (a row's 8 dependent ones would leave
// the unit waiting on its latency), held in MB registers while the float sums wait in memory.
// Each row's float operations are those of tile_wide, in the same order.
template <bool Q4, int MB>
inline void tile_deep(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                      const Activations& a, int64_t m0, float* y, int64_t ldy, const float* bias) {
  static_assert(MB <= 16, "one lane_sums call per tile");
  constexpr int kDwords = Q4 ? 4 : 8;
  const int64_t tail = tail_blocks(nb, Q4), body = nb - tail;
  alignas(64) float acc[MB][16];  // the rows' float sums, lane j block j of each chunk
  bool first = true;  // the first chunk starts the sums from zero (no store of zeros to wait on)
  const __m512i low4 = _mm512_set1_epi8(0x0F), shift = _mm512_set1_epi8(static_cast<char>(0x80));
  // dot[m] += the chunk's dword(s) `raw` (q4: low nibbles at part u, high at u + 4) times row
  // m's activation parts
  auto take = [&](__m512i (&dot)[MB], __m512i raw, const int8_t* xq, int u) {
    if constexpr (Q4) {
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_loadu_si512(xq + m * 512 + u * 64));
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_loadu_si512(xq + m * 512 + u * 64 + 256));
    } else {
      const __m512i wv = _mm512_xor_si512(raw, shift);
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbusd_epi32(dot[m], wv, _mm512_loadu_si512(xq + m * 512 + u * 64));
    }
  };
  // acc[m] += wd dx[m] dot[m] (q4: + wm sx[m]) for the chunk at `at`
  auto scale = [&](const __m512i (&dot)[MB], __m512 wd, __m512 wm, int64_t at) {
    const float* dx = a.d.data() + at;
    const float* sx = a.s.data() + at;
    for (int m = 0; m < MB; ++m) {
      const __m512 s = _mm512_mul_ps(wd, _mm512_loadu_ps(dx + m * kChunk));
      const __m512 sum = first ? _mm512_setzero_ps() : _mm512_load_ps(acc[m]);
      __m512 v = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[m]), sum);
      if constexpr (Q4) v = _mm512_fmadd_ps(wm, _mm512_loadu_ps(sx + m * kChunk), v);
      _mm512_store_ps(acc[m], v);
    }
    first = false;
  };
  auto start = [&](__m512i (&dot)[MB], int64_t at) {
    for (int m = 0; m < MB; ++m)
      dot[m] = Q4 ? _mm512_setzero_si512() : _mm512_loadu_si512(a.c.data() + at + m * kChunk);
  };
  for (int64_t b0 = 0; b0 < body; b0 += kChunk) {
    const int len = static_cast<int>(std::min<int64_t>(kChunk, body - b0));
    const int64_t at = (b0 / kChunk * a.rows + m0) * kChunk;  // the tile's rows in the chunk
    const int8_t* xq = a.q.data() + at * 32;
    const uint8_t* p = w + b0 * 4 * kDwords;
    __m512i dot[MB];
    start(dot, at);
    for (int t = 0; t < kDwords; ++t) {
      prefetch(p + t * 64);
      take(dot, len == kChunk ? _mm512_loadu_si512(p + t * 64)
                              : _mm512_maskz_loadu_epi8(first_bytes(4 * len), p + t * 4 * len),
           xq, t);
    }
    scale(dot, load_halves16(dw + b0, len), Q4 ? load_halves16(mw + b0, len) : __m512{}, at);
  }
  if (tail) {
    const int64_t at = (body / kChunk * a.rows + m0) * kChunk;
    const __m512i idx = Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int len = static_cast<int>(tail);
    __m512i dot[MB];
    start(dot, at);
    if constexpr (Q4) {  // the tail's low and high nibbles meet activation parts 0 and 1
      const __m512i raw = _mm512_maskz_loadu_epi8(first_bytes(tail * 16), w + body * 16);
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      const int8_t* xq = a.q.data() + at * 32;
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_loadu_si512(xq + m * 512));
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_loadu_si512(xq + m * 512 + 64));
    } else {
      take(dot, _mm512_maskz_loadu_epi8(first_bytes(tail * 32), w + body * 32),
           a.q.data() + at * 32, 0);
    }
    const __m512 wd = _mm512_permutexvar_ps(idx, load_halves16(dw + body, len));
    scale(dot, wd, Q4 ? _mm512_permutexvar_ps(idx, load_halves16(mw + body, len)) : wd, at);
  }
  alignas(64) float sums[16];
  lane_sums(reinterpret_cast<const __m512*>(acc), MB, sums);
  for (int m = 0; m < MB; ++m) y[m * ldy] = sums[m] + (bias ? bias[0] : 0.0f);
}

// Activation rows per tile of the AVX-512 kernels: tiles of 16 or 8 rows take the weight rows
// one at a time (tile_deep), smaller tiles all R rows at once (tile_wide: more independent
// sums in flight).
constexpr int kWideTileRows = 16;

// One tile of MB rows from m0 against the R weight rows.
template <bool Q4, int R, int MB>
inline void tile_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                      int64_t ld, const Activations& a, int64_t m0, float* y, int64_t N,
                      const float* bias) {
  if constexpr (MB < 8) {
    tile_wide<Q4, R, MB>(w, dw, mw, nb, ld, a, m0, y, N, bias);
  } else {
    const int64_t row_bytes = nb * (Q4 ? 16 : 32);
    for (int r = 0; r < R; ++r)
      tile_deep<Q4, MB>(w + r * ld * row_bytes, dw + r * ld * nb, Q4 ? mw + r * ld * nb : mw,
                        nb, a, m0, y + r * ld, N, bias ? bias + r * ld : nullptr);
  }
}

// The M activation rows from m0 against R weight rows ld rows apart (y: output row m0): tiles
// of kWideTileRows rows, then the rest in tiles of 8, 4, 2 and 1 (its binary digits).
template <bool Q4, int R>
inline void rows_quant(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                       int64_t ld, const Activations& a, int64_t m0, int64_t M, float* y,
                       int64_t N, const float* bias) {
  int64_t m = 0;
  for (; m + kWideTileRows <= M; m += kWideTileRows)
    tile_rows<Q4, R, kWideTileRows>(w, dw, mw, nb, ld, a, m0 + m, y + m * N, N, bias);
  if (M - m >= 8) {
    tile_rows<Q4, R, 8>(w, dw, mw, nb, ld, a, m0 + m, y + m * N, N, bias);
    m += 8;
  }
  if (M - m >= 4) {
    tile_rows<Q4, R, 4>(w, dw, mw, nb, ld, a, m0 + m, y + m * N, N, bias);
    m += 4;
  }
  if (M - m >= 2) {
    tile_rows<Q4, R, 2>(w, dw, mw, nb, ld, a, m0 + m, y + m * N, N, bias);
    m += 2;
  }
  if (M - m >= 1) tile_rows<Q4, R, 1>(w, dw, mw, nb, ld, a, m0 + m, y + m * N, N, bias);
}
#else
// Sum over 8 int32 lanes of the 32 products of signed int8 w and x, as float.
inline __m256 dot_q8(__m256i w, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// The first len <= 8 values from p as floats, zeros after: an element-wise copy (copying
// through memcpy costs a call and a stalled load).
inline __m256 load_floats(const float* p, int len) {
  if (len == 8) return _mm256_loadu_ps(p);
  alignas(32) float v[8] = {};
  for (int i = 0; i < len; ++i) v[i] = p[i];
  return _mm256_load_ps(v);
}

inline __m256 load_halves(const uint16_t* p, int len) {  // fp16 values
  if (len == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t v[8] = {};
  for (int i = 0; i < len; ++i) v[i] = p[i];
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
}

// Scales as stored (fp16) or widened once per weight group (float): the same values.
inline __m256 load_scales(const uint16_t* p, int len) { return load_halves(p, len); }
inline __m256 load_scales(const float* p, int len) { return load_floats(p, len); }

// For the `len` <= 8 blocks b = b0 + j: s[m][r][j] = dw[r, b] dx[m, b], the scale of each
// integer block product, computed 8 at a time instead of once per block; for q4 also
// add(m, r, mw[r, b] sx[m, b] over the 8 lanes), the minimum's term (sx = dx * sum of the
// block's qx). Weight row r's scales and minimums start at r * stride.
template <bool Q4, int R, int MB, typename S, typename Add>
inline void block_scales(const S* dw, const S* mw, int64_t stride, const float* dx,
                         const float* sx, int64_t nb, int64_t b0, int len, float (&s)[MB][R][8],
                         Add&& add) {
  __m256 wd[R], wm[R];
  for (int r = 0; r < R; ++r) {
    wd[r] = load_scales(dw + r * stride + b0, len);
    wm[r] = Q4 ? load_scales(mw + r * stride + b0, len) : wd[r];
  }
  for (int m = 0; m < MB; ++m) {
    const __m256 xd = load_floats(dx + m * nb + b0, len);
    const __m256 xs = Q4 ? load_floats(sx + m * nb + b0, len) : xd;
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(s[m][r], _mm256_mul_ps(wd[r], xd));
      if constexpr (Q4) add(m, r, _mm256_mul_ps(wm[r], xs));
    }
  }
}

// ------------------------------------------------------------- quantized weights (q8, q4)

// acc[m][r] += s[m][r][j] * (q8 block b of row r · activation block b of row m).
template <int R, int MB>
inline void step_q8(__m256 (&acc)[MB][R], const int8_t* w, const int8_t* xq, int64_t nb,
                    int64_t ld, int64_t b, const float (&s)[MB][R][8], int j) {
  __m256i xv[MB];
  for (int m = 0; m < MB; ++m)
    xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m * nb + b) * 32));
  for (int r = 0; r < R; ++r) {
    prefetch(w + (r * ld * nb + b) * 32);
    const __m256i wv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r * ld * nb + b) * 32));
    for (int m = 0; m < MB; ++m)
      acc[m][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[m][r][j]), dot_q8(wv, xv[m]), acc[m][r]);
  }
}

// The same for the q4 blocks b and b + 1 (chunk positions j, j + 1) at once: one 32-byte load
// holds both blocks' nibbles, and the paired activation layout puts their low and high halves
// where the masked nibbles land, so each half needs a single maddubs.
template <int R, int MB>
inline void step_q4_pair(__m256 (&acc)[MB][R], const uint8_t* w, const int8_t* xq, int64_t nb,
                         int64_t ld, int64_t b, const float (&s)[MB][R][8], int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i xlo[MB], xhi[MB];
  for (int m = 0; m < MB; ++m) {
    const int8_t* xb = xq + (m * nb + b) * 32;
    xlo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
    xhi[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32));
  }
  for (int r = 0; r < R; ++r) {
    prefetch(w + (r * ld * nb + b) * 16);
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r * ld * nb + b) * 16));
    const __m256i lo = _mm256_and_si256(raw, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    for (int m = 0; m < MB; ++m) {
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo[m]),
                                         _mm256_maddubs_epi16(hi, xhi[m]));
      const __m256 scale = _mm256_blend_ps(_mm256_broadcast_ss(&s[m][r][j]),
                                           _mm256_broadcast_ss(&s[m][r][j + 1]), 0xF0);
      acc[m][r] =
          _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), acc[m][r]);
    }
  }
}

// One unpaired q4 block (the last of an odd count).
template <int R, int MB>
inline void step_q4_single(__m256 (&acc)[MB][R], const uint8_t* w, const int8_t* xq, int64_t nb,
                           int64_t ld, int64_t b, const float (&s)[MB][R][8], int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (r * ld * nb + b) * 16));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
    for (int m = 0; m < MB; ++m) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m * nb + b) * 32));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
      acc[m][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[m][r][j]), dot, acc[m][r]);
    }
  }
}

// y[m, r] = sum_b d[r, b] dx[m, b] (q[r, b] · qx[m, b]) (+ for q4 the minimum term
// sum_b m[r, b] dx[m, b] sum(qx[m, b])) for R weight rows ld rows apart and MB activation rows
// from m0; the scales and minimums of weight row r start at r * stride. Blocks go in chunks
// of 8 so that their scales are multiplied 8 at a time.
template <bool Q4, int R, int MB, typename S>
inline void tile_quant(const uint8_t* w, const S* dw, const S* mw, int64_t stride, int64_t nb,
                       int64_t ld, const Activations& a, int64_t m0, float* y, int64_t ldy,
                       const float* bias) {
  const int8_t* xq = a.q.data() + m0 * nb * 32;
  const float* dx = a.d.data() + m0 * nb;
  const float* sx = a.s.data() + m0 * nb;
  const int8_t* wq = reinterpret_cast<const int8_t*>(w);
  __m256 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  alignas(32) float s[MB][R][8];
  auto add = [&](int m, int r, __m256 term) { acc[m][r] = _mm256_add_ps(acc[m][r], term); };
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    block_scales<Q4, R, MB>(dw, mw, stride, dx, sx, nb, b0, 8, s, add);
    for (int j = 0; j < 8; j += Q4 ? 2 : 1) {
      if constexpr (Q4) step_q4_pair<R, MB>(acc, w, xq, nb, ld, b0 + j, s, j);
      else step_q8<R, MB>(acc, wq, xq, nb, ld, b0 + j, s, j);
    }
  }
  if (b0 < nb) {  // the last chunk of fewer than 8 blocks
    const int len = static_cast<int>(nb - b0);
    block_scales<Q4, R, MB>(dw, mw, stride, dx, sx, nb, b0, len, s, add);
    int j = 0;
    for (; Q4 && j + 2 <= len; j += 2) step_q4_pair<R, MB>(acc, w, xq, nb, ld, b0 + j, s, j);
    for (; j < len; ++j) {
      if constexpr (Q4) step_q4_single<R, MB>(acc, w, xq, nb, ld, b0 + j, s, j);
      else step_q8<R, MB>(acc, wq, xq, nb, ld, b0 + j, s, j);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r * ld] = hsum(acc[m][r]) + (bias ? bias[r * ld] : 0.0f);
}

// The M activation rows from m0 against R weight rows ld rows apart (y: output row m0): tiles
// of kTileRows rows, then the rest one row at a time. Where there is a tile, the group's fp16
// scales (and minimums) are widened to float once for all of them (exactly: the same values).
template <bool Q4, int R>
inline void rows_quant(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb,
                       int64_t ld, const Activations& a, int64_t m0, int64_t M, float* y,
                       int64_t N, const float* bias) {
  if (M < kTileRows) {
    for (int64_t m = 0; m < M; ++m)
      tile_quant<Q4, R, 1>(w, dw, mw, ld * nb, nb, ld, a, m0 + m, y + m * N, N, bias);
    return;
  }
  const int64_t stride = (nb + 7) / 8 * 8;
  thread_local std::vector<float> widened;
  widened.resize(2 * R * stride);
  float* dwf = widened.data();     // (R, stride) scales
  float* mwf = dwf + R * stride;   // (R, stride) minimums (q4)
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; b += 8) {
      const int len = static_cast<int>(std::min<int64_t>(8, nb - b));
      _mm256_storeu_ps(dwf + r * stride + b, load_halves(dw + r * ld * nb + b, len));
      if constexpr (Q4)
        _mm256_storeu_ps(mwf + r * stride + b, load_halves(mw + r * ld * nb + b, len));
    }
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile_quant<Q4, R, kTileRows>(w, dwf, mwf, stride, nb, ld, a, m0 + m, y + m * N, N, bias);
  for (; m < M; ++m)
    tile_quant<Q4, R, 1>(w, dwf, mwf, stride, nb, ld, a, m0 + m, y + m * N, N, bias);
}

#endif

// The rows go in panels of kPanel, each a pass over the weights (for_row_groups).
template <bool Q4>
void linear_quant(const uint8_t* w, const uint16_t* dw, const uint16_t* mw,
                  const Activations& a, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t nb) {
  const int64_t row_bytes = nb * (Q4 ? 16 : 32);
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = std::min(kPanel, M - p0);
    float* yp = y + p0 * N;
    for_row_groups(N, row_bytes * std::max<int64_t>(rows / kTileRows, 1),
                   [&](int64_t n0, int64_t group, int64_t ld) {
      const float* b = bias ? bias + n0 : nullptr;
      const uint16_t* m0 = Q4 ? mw + n0 * nb : nullptr;
      if (group == kRows)
        rows_quant<Q4, kRows>(w + n0 * row_bytes, dw + n0 * nb, m0, nb, ld, a, p0, rows,
                              yp + n0, N, b);
      else
        rows_quant<Q4, 1>(w + n0 * row_bytes, dw + n0 * nb, m0, nb, 1, a, p0, rows, yp + n0,
                          N, b);
    });
  }
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

bool chunk_order() { return kWide; }

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
