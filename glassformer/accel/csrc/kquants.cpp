// GGUF's K-quants (Q3_K, Q4_K, Q5_K, Q6_K) and 5-bit blocks (Q5_0, Q5_1) read in the file's own
// layout: products with int8 activations, and dequantization.
//
// A weight row is its GGUF blocks as the file stores them (accel/kquants.py lists the byte
// layouts), read through one decoder per format (below) that yields, for each block of 32
// weights j of a group of 8 (a K-quant super-block of 256, or 8 blocks of Q5_0 / Q5_1):
//   quants(j)       32 unsigned quants, in element order (0..63)
//   multipliers(j)  16 int16 lanes: the integer scale of elements 0..15 (lanes 0..7) and of
//                   elements 16..31 (lanes 8..15): a K-quant's sub-block scale, 1 for Q5_x
//   factors()       8 float lanes: block j's float scale (the super-block's d, or the block's)
//   offsets()       8 float lanes: what block j adds to each weight (-dmin m, Q5_1's m, 0)
// so that w = factor_j · multiplier · (quant - kOffset) + offset_j, the products exact in
// float32 (an fp16 d times at most 8 + 6 bits of integers), as gguf's dequantization does.
//
// The product takes the activations quantized per block of 32 as the int8 / int4 kernels do
// (quantize_activations: q, d = amax / 127, s = d · sum(q)). For each weight row and block j:
//   integer part   madd(maddubs(quants, x_q) [- maddubs(kOffset, x_q)], multipliers): eight
//                  int32 sums, exact (maddubs cannot saturate: quants <= 63, |x_q| <= 127)
//   float part     acc += (factor_j · d_x) · float(integer part), in two accumulators
//                  alternating over the blocks; the offsets add offset_j · s_j once per group.
// Q5_0's offset of 16 quants goes into the float part as -16 d · s_j (no second maddubs).
// Every row's float operations are the same in any tile of activation rows and at any place in
// it, so each row's result is bitwise the same whatever the number of rows; the integer sums
// are exact on every target.
//
// AVX-512 builds take two blocks a step in 512-bit registers, with a decoder's pair(j) (the 64
// quants of blocks j, j + 1, unpacked from the file's bytes in a few whole-register steps) and
// scales() (d times each integer scale, exact): integer part vpdpbusd(quants, x_q) (maddubs
// and madd without VNNI), started from -kOffset · sum(x_q) for Q6_K and Q3_K; float part
// acc += (d sc · d_x) · float(integer part), the integer scales in the float factor. So their
// float sums go in another order than the AVX2 build's.

#include <cstring>
#include <type_traits>

#include "glassformer.h"

namespace glassformer {
namespace {

// Where the compiler targets AVX-512 (BW, DQ: -march=native on such a CPU) the products take
// two blocks a step in 512-bit registers; elsewhere one, in 256-bit AVX2 ones.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define GLASSFORMER_KQ_WIDE 1
#endif


inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i low4() { return _mm256_set1_epi8(0x0F); }

#ifdef GLASSFORMER_KQ_WIDE
// acc + the sums of each 4 products of unsigned bytes u and signed bytes s (vpdpbusd; without
// VNNI, maddubs then madd: exact, as u <= 63 and |s| <= 127 cannot saturate the pairs).
inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// 32 bytes in both halves of a 512-bit register.
inline __m512i twice(const uint8_t* p) { return _mm512_broadcast_i64x4(load32(p)); }

// Each 16-bit lane of v shifted right (negative: left) by `low` in the low 256 bits, by `high`
// in the high 256 bits.
inline __m512i shift_halves(__m512i v, int low, int high) {
  const __m512i right = _mm512_inserti64x4(_mm512_set1_epi16(std::max(low, 0)), _mm256_set1_epi16(std::max(high, 0)), 1);
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(std::max(-low, 0)), _mm256_set1_epi16(std::max(-high, 0)), 1);
  return _mm512_sllv_epi16(_mm512_srlv_epi16(v, right), left);
}

// a | (b & mask), bytewise.
inline __m512i or_masked(__m512i a, __m512i b, int mask) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(static_cast<char>(mask)), 0xF8);
}

inline __m512i low4_512() { return _mm512_set1_epi8(0x0F); }
#endif

// The 8 six-bit scales and 8 six-bit minimums packed in 12 bytes (Q4_K, Q5_K): bytes 0-3 hold
// scales 0-3 in their low 6 bits, bytes 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of
// scales 4-7 (low nibble) and of minimums 4-7 (high nibble), whose top 2 bits are the top
// bits of bytes 0-3 (scales) and 4-7 (minimums). Worked on as three little-endian words.
inline void unpack_scales(const uint8_t* p, uint8_t* scales, uint8_t* mins) {
  uint32_t w[3];
  std::memcpy(w, p, 12);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, top = 0x30303030;
  const uint32_t s[2] = {w[0] & six, (w[2] & four) | ((w[0] >> 2) & top)};
  const uint32_t m[2] = {w[1] & six, ((w[2] >> 4) & four) | ((w[1] >> 2) & top)};
  std::memcpy(scales, s, 8);
  std::memcpy(mins, m, 8);
}

// 8 bytes as 8 floats.
inline __m256 bytes_to_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Q4_K (144 bytes a super-block): fp16 d, fp16 dmin, 12 bytes of scales and minimums, 128
// bytes of nibbles: byte l of the 32 at 32 i holds element l of block 2 i (low nibble) and of
// block 2 i + 1 (high). w = d sc_j q - dmin m_j.
struct Q4K {
  static constexpr int64_t kGroupBytes = 144, kBlocks = 8, kUnit = 256, kUnitBytes = kGroupBytes;
  static constexpr int kOffset = 0;
  static constexpr bool kOffsets = true;
  const uint8_t* qs;
  float d, dmin;
  alignas(8) uint8_t sc[8], mn[8];

  Q4K(const uint8_t* g, int) : qs(g + 16), d(half(g)), dmin(half(g + 2)) { unpack_scales(g + 4, sc, mn); }
  __m256 factors() const { return _mm256_set1_ps(d); }
  __m256 offsets() const {  // -(dmin m_j), the sign flipped (so -(+0) is -0, as gguf subtracts)
    return _mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(_mm256_set1_ps(dmin), bytes_to_floats(mn)));
  }
  __m256i quants(int j) const {
    const __m256i raw = load32(qs + 32 * (j / 2));
    return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4());
  }
  __m256i multipliers(int j) const { return _mm256_set1_epi16(sc[j]); }
#ifdef GLASSFORMER_KQ_WIDE
  static constexpr bool kHalves = false;  // an integer scale per block of 32
  __m512 scales() const {  // lane j: d sc_j (exact)
    return _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_set1_ps(d), bytes_to_floats(sc)));
  }
  __m512i pair(int j) const {  // blocks j, j + 1 (j even): the low and high nibbles of 32 bytes
    const __m256i raw = load32(qs + 16 * j);
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                            low4_512());
  }
#endif
};

// Q5_K (176 bytes): Q4_K's d, dmin and scales, then 32 bytes of high bits (bit j of byte l:
// element l of block j), then Q4_K's 128 bytes of nibbles. w = d sc_j (q + 16 h) - dmin m_j.
struct Q5K : Q4K {
  static constexpr int64_t kGroupBytes = 176, kUnitBytes = kGroupBytes;
  __m256i high;

  Q5K(const uint8_t* g, int len) : Q4K(g, len), high(load32(g + 16)) { qs = g + 48; }
  __m256i quants(int j) const {
    __m256i bit = _mm256_and_si256(high, _mm256_set1_epi8(static_cast<char>(1 << j)));
    // bit j of each byte to bit 4 (16-bit shifts: the one set bit stays within its byte)
    if (j < 4) bit = _mm256_slli_epi16(bit, 4 - j);
    if (j > 4) bit = _mm256_srli_epi16(bit, j - 4);
    return _mm256_or_si256(Q4K::quants(j), bit);
  }
#ifdef GLASSFORMER_KQ_WIDE
  __m512i pair(int j) const {  // bits j and j + 1 of the high bytes to bit 4 of each half
    return or_masked(Q4K::pair(j), shift_halves(_mm512_broadcast_i64x4(high), j - 4, j - 3), 0x10);
  }
#endif
};

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, fp16
// d. Block j = 4 h + k (h the half of 128 elements): element l's low 4 bits are byte
// 64 h + 32 (k % 2) + l of the nibbles (low nibble for k < 2, high for k >= 2), its high 2 bits
// bits 2 k, 2 k + 1 of byte 32 h + l of the pairs; elements 0-15 of block j take scale 2 j,
// 16-31 scale 2 j + 1. w = d sc (q - 32).
struct Q6K {
  static constexpr int64_t kGroupBytes = 210, kBlocks = 8, kUnit = 256, kUnitBytes = kGroupBytes;
  static constexpr int kOffset = 32;
  static constexpr bool kOffsets = false;
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* sc;
  float d;

  Q6K(const uint8_t* g, int)
      : ql(g), qh(g + 128), sc(reinterpret_cast<const int8_t*>(g + 192)), d(half(g + 208)) {}
  __m256 factors() const { return _mm256_set1_ps(d); }
  __m256 offsets() const { return _mm256_setzero_ps(); }
  __m256i quants(int j) const {
    const int h = j / 4, k = j % 4;
    const __m256i low = load32(ql + 64 * h + 32 * (k % 2));
    const __m256i nibble = _mm256_and_si256(k < 2 ? low : _mm256_srli_epi16(low, 4), low4());
    const __m256i pair = _mm256_and_si256(_mm256_srli_epi16(load32(qh + 32 * h), 2 * k),
                                          _mm256_set1_epi8(3));
    return _mm256_or_si256(nibble, _mm256_slli_epi16(pair, 4));
  }
  __m256i multipliers(int j) const {
    return _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
  }
#ifdef GLASSFORMER_KQ_WIDE
  static constexpr bool kHalves = true;  // an integer scale per 16 quants
  __m512 scales() const {  // lane i: d sc_i (exact)
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
  }
  __m512i pair(int j) const {  // blocks j, j + 1 = 4 h + k, k 0 or 2
    const int h = j / 4, k = j % 4;
    const __m512i low = _mm512_loadu_si512(ql + 64 * h);  // blocks 4 h, 4 h + 1 low, the next two high
    const __m512i nibble = _mm512_and_si512(k ? _mm512_srli_epi16(low, 4) : low, low4_512());
    // bits 2 k, 2 k + 1 (low half) and 2 k + 2, 2 k + 3 (high half) to bits 4, 5
    return or_masked(nibble, shift_halves(twice(qh + 32 * h), 2 * k - 4, 2 * k - 2), 0x30);
  }
#endif
};

// Q3_K (110 bytes): 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes packing 16
// six-bit scales (stored plus 32: bytes 0-7 hold the low 4 bits of scales 0-7 and 8-15 in
// their low and high nibbles, bytes 8-11 the top 2 bits, scale i in bits 2 (i / 4) of byte
// 8 + i % 4), fp16 d. Block j = 4 h + k: element l's low 2 bits are bits 2 k of byte
// 32 h + l of the quants, its high bit bit j of byte l of the high bits; elements 0-15 take
// scale 2 j, 16-31 scale 2 j + 1. w = d (sc - 32) (q - 4).
struct Q3K {
  static constexpr int64_t kGroupBytes = 110, kBlocks = 8, kUnit = 256, kUnitBytes = kGroupBytes;
  static constexpr int kOffset = 4;
  static constexpr bool kOffsets = false;
  const uint8_t* g;
  float d;
  alignas(16) int8_t sc[16];

  Q3K(const uint8_t* group, int) : g(group), d(half(group + 108)) {
    const uint8_t* p = group + 96;
    for (int i = 0; i < 16; ++i) {
      const int low = (p[i % 8] >> (4 * (i / 8))) & 15, top = (p[8 + i % 4] >> (2 * (i / 4))) & 3;
      sc[i] = static_cast<int8_t>((low | (top << 4)) - 32);
    }
  }
  __m256 factors() const { return _mm256_set1_ps(d); }
  __m256 offsets() const { return _mm256_setzero_ps(); }
  __m256i quants(int j) const {
    const int h = j / 4, k = j % 4;
    const __m256i two = _mm256_and_si256(_mm256_srli_epi16(load32(g + 32 + 32 * h), 2 * k),
                                         _mm256_set1_epi8(3));
    __m256i bit = _mm256_and_si256(load32(g), _mm256_set1_epi8(static_cast<char>(1 << j)));
    if (j < 2) bit = _mm256_slli_epi16(bit, 2 - j);  // bit j of each byte to bit 2
    if (j > 2) bit = _mm256_srli_epi16(bit, j - 2);
    return _mm256_or_si256(two, bit);
  }
  __m256i multipliers(int j) const {
    return _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
  }
#ifdef GLASSFORMER_KQ_WIDE
  static constexpr bool kHalves = true;
  __m512 scales() const {
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_load_si128(reinterpret_cast<const __m128i*>(sc)))));
  }
  __m512i pair(int j) const {  // blocks j, j + 1 = 4 h + k, k 0 or 2: two bits to bits 0, 1, one to 2
    const int h = j / 4, k = j % 4;
    const __m512i two = _mm512_and_si512(shift_halves(twice(g + 32 + 32 * h), 2 * k, 2 * k + 2),
                                         _mm512_set1_epi8(3));
    return or_masked(two, shift_halves(twice(g), j - 2, j - 1), 0x04);
  }
#endif
};

// All ones in the first len <= 8 32-bit lanes, zeros after.
inline __m256i first_lanes(int len) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(len), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 fp16 values, one in the low 16 bits of each 32-bit lane (the high bits zero), as floats.
inline __m256 halves(__m256i v) {
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// 32 bits as 32 bytes: byte i is 0xFF where bit i is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i: byte i / 8 of the word
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// Q5_0 (22 bytes a block of 32: fp16 d, 32 high bits, 16 bytes of nibbles: byte l holds
// element l low and l + 16 high) and Q5_1 (24: fp16 d, fp16 m, the same): w = d (q - 16), or
// d q + m, q = nibble + 16 (bit i of the high bits). A group is `len` <= 8 consecutive blocks.
template <bool kMin>
struct Q5 {
  static constexpr int64_t kBlockBytes = kMin ? 24 : 22, kBlocks = 8;
  static constexpr int64_t kGroupBytes = 8 * kBlockBytes, kUnit = 32, kUnitBytes = kBlockBytes;
  static constexpr int kOffset = kMin ? 0 : 16;  // the dequantization's; the product folds it in
  static constexpr bool kOffsets = true;
  const uint8_t* g;
  int len;
  __m256 d, m;  // lane j: block j's d, and m (Q5_0: -16 d, exact); zero past len

  Q5(const uint8_t* group, int blocks) : g(group), len(blocks) {
    constexpr int64_t s = kBlockBytes;  // each block's first 4 bytes: d (and Q5_1's m)
    const __m256i head = _mm256_mask_i32gather_epi32(
        _mm256_setzero_si256(), reinterpret_cast<const int*>(group),
        _mm256_setr_epi32(0, s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s), first_lanes(len), 1);
    d = halves(_mm256_and_si256(head, _mm256_set1_epi32(0xFFFF)));
    m = kMin ? halves(_mm256_srli_epi32(head, 16)) : _mm256_mul_ps(_mm256_set1_ps(-16.f), d);
  }
  __m256 factors() const { return d; }
  __m256 offsets() const { return m; }
  __m256i quants(int j) const {
    const uint8_t* block = g + j * kBlockBytes + (kMin ? 4 : 2);
    uint32_t bits;
    std::memcpy(&bits, block, 4);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4());
    return _mm256_or_si256(nibbles, _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(16)));
  }
  __m256i multipliers(int) const { return _mm256_set1_epi16(1); }
#ifdef GLASSFORMER_KQ_WIDE
  static constexpr bool kHalves = false;
  __m512 scales() const { return _mm512_zextps256_ps512(d); }
  __m512i pair(int j) const {  // blocks j, j + 1: 128-bit lanes of nibbles, the fifth bits by mask
    const uint8_t* first = g + j * kBlockBytes + (kMin ? 4 : 2);
    const uint8_t* second = first + kBlockBytes;
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first + 4))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(second + 4)), 1);
    // lanes [first, second, first >> 4, second >> 4] -> [first, first >> 4, second, second >> 4]
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    const __m512i nibbles = _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)), low4_512());
    uint32_t low, high;
    std::memcpy(&low, first, 4);
    std::memcpy(&high, second, 4);
    const __mmask64 fifth = static_cast<__mmask64>(low) | static_cast<__mmask64>(high) << 32;
    return _mm512_mask_add_epi8(nibbles, fifth, nibbles, _mm512_set1_epi8(16));
  }
#endif
};

// The first len <= 8 floats from p, zeros after.
inline __m256 load_part(const float* p, int len) {
  return len == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(len));
}

struct Activations {  // quantize_activations' q (M, nb · 32), d and s (M, nb)
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> c;  // (AVX-512, Q6_K and Q3_K) -kOffset · each 4 q's sum (M, nb · 8)
};

#ifdef GLASSFORMER_KQ_WIDE
// The same products two blocks at a time in 512-bit registers (AVX-512 builds): each pair's 64
// quants (F::pair) against the activations' two blocks (64 contiguous bytes) by vpdpbusd, 16
// int32 sums of 4 products each, exact; for Q6_K and Q3_K started from a.c, the offset's
// part. The integer scales go into the float factors: lane l's is d sc · d_x of its block, one
// of the group's 8 (F::kHalves false: sc per block of 32) or 16 (true: per 16 quants) picked by
// a permutation. A last odd block (Q5_x) goes through a 256-bit step.
template <typename F, int MB>  // inlined: a row's few blocks would not pay for a call
__attribute__((always_inline)) inline void row_tile(const uint8_t* row, int64_t nb, const Activations& a,
                                                    int64_t m0, float* y, int64_t ldy, float bias) {
  __m512 acc[MB][2];
  __m256 rest[MB];  // the offsets' terms and an odd last block
  for (int m = 0; m < MB; ++m) {
    acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    rest[m] = _mm256_setzero_ps();
  }
  constexpr bool kFold = F::kOffsets, kCounts = !F::kOffsets && F::kOffset != 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i unit_of = _mm512_srli_epi32(lane, F::kHalves ? 2 : 3);  // a pair's lane -> its scale
  const __m512i block_of = _mm512_srli_epi32(lane, 1);  // run of 16 -> its block
  for (int64_t b0 = 0, g = 0; b0 < nb; b0 += F::kBlocks, ++g) {
    const int len = static_cast<int>(std::min<int64_t>(F::kBlocks, nb - b0));
    const uint8_t* at = row + g * F::kGroupBytes;
    for (int64_t line = 0; line < F::kGroupBytes; line += 64) prefetch(at + line);
    const F f(at, len);
    const __m512 scales = f.scales();
    __m512 scale[MB];
    for (int m = 0; m < MB; ++m) {
      const int64_t first = (m0 + m) * nb + b0;
      const __m512 dx = _mm512_zextps256_ps512(load_part(a.d.data() + first, len));
      scale[m] = _mm512_mul_ps(scales, F::kHalves ? _mm512_permutexvar_ps(block_of, dx) : dx);
      if constexpr (kFold)
        rest[m] = _mm256_fmadd_ps(f.offsets(), load_part(a.s.data() + first, len), rest[m]);
    }
    const auto pair = [&](int j, int k) {  // blocks j, j + 1 into accumulators k
      const __m512i q = f.pair(j);
      const __m512i pick = _mm512_add_epi32(unit_of, _mm512_set1_epi32(F::kHalves ? 2 * j : j));
      for (int m = 0; m < MB; ++m) {
        const int64_t block = (m0 + m) * nb + b0 + j;
        const __m512i x = _mm512_loadu_si512(a.q.data() + block * 32);
        const __m512i start = kCounts ? _mm512_loadu_si512(a.c.data() + block * 8) : _mm512_setzero_si512();
        const __m512 sums = _mm512_cvtepi32_ps(dot4(start, q, x));
        acc[m][k] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, scale[m]), sums, acc[m][k]);
      }
    };
    int j = 0;
    if (len == F::kBlocks) {  // a whole group: unrolled, the pairs alternating accumulators
      for (; j < F::kBlocks; j += 4) {
        pair(j, 0);
        pair(j + 2, 1);
      }
    } else {  // (Q5_x) a row's last group
      for (; j + 2 <= len; j += 2) pair(j, 0);
    }
    if (j < len) {  // (Q5_x only: a scale per block, no offset in the integers)
      const __m256i q = f.quants(j);
      for (int m = 0; m < MB; ++m) {
        const __m256i x = load32(reinterpret_cast<const uint8_t*>(a.q.data() + ((m0 + m) * nb + b0 + j) * 32));
        const __m256 sums = _mm256_cvtepi32_ps(dot4(_mm256_setzero_si256(), q, x));
        const __m512 factor = _mm512_permutexvar_ps(_mm512_set1_epi32(j), scale[m]);
        rest[m] = _mm256_fmadd_ps(_mm512_castps512_ps256(factor), sums, rest[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    const __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
    const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
    y[m * ldy] = hsum(_mm256_add_ps(folded, rest[m])) + bias;
  }
}

// a.c for F where its offset stays in the integer sums (Q6_K, Q3_K; nb a multiple of 8).
template <typename F>
void offset_sums(Activations& a, int64_t M, int64_t nb) {
  if constexpr (!F::kOffsets && F::kOffset != 0) {
    a.c.resize(M * nb * 8);
    const __m512i offset = _mm512_set1_epi8(F::kOffset);
    for (int64_t b = 0; b < M * nb; b += 2) {
      const __m512i x = _mm512_loadu_si512(a.q.data() + b * 32);
      _mm512_storeu_si512(a.c.data() + b * 8,
                          _mm512_sub_epi32(_mm512_setzero_si512(), dot4(_mm512_setzero_si512(), offset, x)));
    }
  }
}
#else
// acc[m] (two accumulators) += weight row `row` (its groups) times activation rows m0 + m,
// m < MB. Each row's operations are those of MB = 1 (see the top of the file).
template <typename F, int MB>  // inlined: a row's few blocks would not pay for a call
__attribute__((always_inline)) inline void row_tile(const uint8_t* row, int64_t nb, const Activations& a,
                                                    int64_t m0, float* y, int64_t ldy, float bias) {
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i offset = _mm256_set1_epi8(F::kOffset);
  constexpr bool kFold = F::kOffsets;  // the offsets (Q5_0's quants' included) go to the float part
  for (int64_t b0 = 0, g = 0; b0 < nb; b0 += F::kBlocks, ++g) {
    const int len = static_cast<int>(std::min<int64_t>(F::kBlocks, nb - b0));
    const uint8_t* at = row + g * F::kGroupBytes;
    for (int64_t line = 0; line < F::kGroupBytes; line += 64) prefetch(at + line);
    const F f(at, len);
    const __m256 factors = f.factors();
    alignas(32) float scale[MB][8];
    for (int m = 0; m < MB; ++m) {
      const int64_t first = (m0 + m) * nb + b0;
      _mm256_store_ps(scale[m], _mm256_mul_ps(factors, load_part(a.d.data() + first, len)));
      if constexpr (kFold)
        acc[m][0] = _mm256_fmadd_ps(f.offsets(), load_part(a.s.data() + first, len), acc[m][0]);
    }
    for (int j = 0; j < len; ++j) {
      const __m256i q = f.quants(j), mult = f.multipliers(j);
      for (int m = 0; m < MB; ++m) {
        const __m256i x = load32(reinterpret_cast<const uint8_t*>(a.q.data() + ((m0 + m) * nb + b0 + j) * 32));
        __m256i p = _mm256_maddubs_epi16(q, x);
        if constexpr (!kFold && F::kOffset != 0) p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(offset, x));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, mult));
        acc[m][j % 2] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[m][j]), sums, acc[m][j % 2]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + bias;
}
#endif

constexpr int kTile = 4;  // activation rows sharing each decoded block

// y (M, N) = x_q (M, nb blocks) times the N weight rows w (row_bytes apart): panels of kPanel
// activation rows, each a pass over the weights; threads take runs of weight rows.
template <typename F>
void linear_blocks(const uint8_t* w, int64_t row_bytes, const Activations& a, const float* bias,
                   float* y, int64_t M, int64_t N, int64_t nb) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = std::min(kPanel, M - p0);
    const int threads = N * row_bytes * std::max<int64_t>(rows / kTile, 1) >= (64 << 10)
                            ? at::get_num_threads() : 1;
    const int64_t run = std::max<int64_t>(1, N / (4 * threads));
#pragma omp parallel for schedule(dynamic, run) if (threads > 1) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* row = w + n * row_bytes;
      const float b = bias ? bias[n] : 0.f;
      int64_t m = 0;
      for (; m + kTile <= rows; m += kTile)
        row_tile<F, kTile>(row, nb, a, p0 + m, y + (p0 + m) * N + n, N, b);
      for (; m < rows; ++m) row_tile<F, 1>(row, nb, a, p0 + m, y + (p0 + m) * N + n, N, b);
    }
  }
}

// Row `row` of the float weight (K = nb · 32 values): w = (factor_j multiplier) (q - kOffset)
// (+ offset_j), the products exact; the one addition rounds as gguf's does.
template <typename F>
void dequantize_row(const uint8_t* row, int64_t nb, float* out) {
  for (int64_t b0 = 0, g = 0; b0 < nb; b0 += F::kBlocks, ++g) {
    const int len = static_cast<int>(std::min<int64_t>(F::kBlocks, nb - b0));
    const F f(row + g * F::kGroupBytes, len);
    alignas(32) float factor[8], offset[8];
    _mm256_store_ps(factor, f.factors());
    _mm256_store_ps(offset, f.offsets());
    for (int j = 0; j < len; ++j) {
      alignas(32) uint8_t q[32];
      alignas(32) int16_t mult[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), f.quants(j));
      _mm256_store_si256(reinterpret_cast<__m256i*>(mult), f.multipliers(j));
      float* dst = out + (b0 + j) * 32;
      for (int i = 0; i < 4; ++i) {  // 8 elements, all under multiplier i / 2
        const __m256 scale = _mm256_set1_ps(factor[j] * static_cast<float>(mult[8 * (i / 2)]));
        const __m256i wide = _mm256_sub_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))),
            _mm256_set1_epi32(F::kOffset));
        __m256 v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(wide));
        if (F::kOffset == 0) v = _mm256_add_ps(v, _mm256_set1_ps(offset[j]));
        _mm256_storeu_ps(dst + 8 * i, v);
      }
    }
  }
}

// Calls body(F{}) for format's decoder type.
template <typename Body>
void with_format(WeightFormat format, Body&& body) {
  switch (format) {
    case WeightFormat::q4_k: return body(static_cast<Q4K*>(nullptr));
    case WeightFormat::q5_k: return body(static_cast<Q5K*>(nullptr));
    case WeightFormat::q6_k: return body(static_cast<Q6K*>(nullptr));
    case WeightFormat::q3_k: return body(static_cast<Q3K*>(nullptr));
    case WeightFormat::q5_0: return body(static_cast<Q5<false>*>(nullptr));
    case WeightFormat::q5_1: return body(static_cast<Q5<true>*>(nullptr));
    default: TORCH_CHECK(false, "not a GGUF block format: ", static_cast<int>(format));
  }
}

// The bytes a row of K weights takes in `format` (checked: K a whole number of its blocks).
int64_t row_bytes(WeightFormat format, int64_t K) {
  int64_t bytes = 0;
  with_format(format, [&](auto* type) {
    using F = std::remove_pointer_t<decltype(type)>;
    TORCH_CHECK(K % F::kUnit == 0, "K = ", K, " is not a whole number of blocks of ", F::kUnit);
    bytes = K / F::kUnit * F::kUnitBytes;
  });
  return bytes;
}

}  // namespace

torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& qs, WeightFormat format,
                          const Bias& bias) {
  const int64_t K = x.dim() ? x.size(-1) : 0, N = qs.size(0), nb = K / 32;
  const int64_t M = rows_of(x, K);
  check_weight(qs, torch::kUInt8, N, row_bytes(format, K), "qweight");
  thread_local Activations a;
  a.q.resize(M * nb * 32);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  quantize_activations(x.data_ptr<float>(), M, K, nb, a.q.data(), a.d.data(), a.s.data(), nullptr);
  auto y = output_like(x, N);  // (..., N)
  with_format(format, [&](auto* type) {
    using F = std::remove_pointer_t<decltype(type)>;
#ifdef GLASSFORMER_KQ_WIDE
    offset_sums<F>(a, M, nb);
#endif
    linear_blocks<F>(qs.data_ptr<uint8_t>(), qs.size(1), a, bias_ptr(bias, N), y.data_ptr<float>(),
                     M, N, nb);
  });
  return y;
}

torch::Tensor dequantize_gguf(const torch::Tensor& qs, WeightFormat format, int64_t K) {
  const int64_t N = qs.size(0), nb = K / 32;
  check_weight(qs, torch::kUInt8, N, row_bytes(format, K), "qweight");
  auto w = torch::empty({N, K}, qs.options().dtype(torch::kFloat32));  // (N, K)
  const uint8_t* q = qs.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  with_format(format, [&](auto* type) {
    using F = std::remove_pointer_t<decltype(type)>;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16)) num_threads(at::get_num_threads())
    for (int64_t n = 0; n < N; ++n) dequantize_row<F>(q + n * qs.size(1), nb, out + n * K);
  });
  return w;
}

}  // namespace glassformer
