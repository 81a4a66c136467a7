// The integer arithmetic of the AVX2 product kernels alone (accel/csrc/quantized.cpp's
// half_rows), with no weight to load or unpack: what one core can do at best with the
// kernel's instructions, for benchmarks/int8_peak.py to set the kernels against.
// Each call runs `blocks` blocks of 4 activation rows (x: 16 blocks of 4 rows of 32 int8,
// f: 16 blocks of 4 scales and 4 sums, all in the L1 cache) against 8 weight registers (one
// half tile: 8 output rows, a lane each, 32 inputs a block), as the kernel's tiles of 4 rows do.
//   q4: per row and dword, broadcast, maddubs, int16 add; a madd per row and block.
//   q8: per row and dword, broadcast, two signs, maddubs, madd, int32 add (the sign trick).
// With `epilogue`, each row and block also takes the kernel's float work: a conversion, a
// scale product and two FMAs. Returns a sum of every lane, so that nothing is left out.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static __m256i weights(int u) { return _mm256_set1_epi32(0x01030507 * (u + 1) & 0x0F0F0F0F); }

float q4_blocks(const int8_t* x, const float* f, long blocks, int epilogue) {
  __m256i w[8];
  for (int u = 0; u < 8; ++u) w[u] = weights(u);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                     _mm256_setzero_si256()};
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 scale = _mm256_set1_ps(0.5f), minimum = _mm256_set1_ps(0.25f);
  for (long b = 0; b < blocks; ++b) {
    const int8_t* xb = x + (b & 15) * 128;  // 4 rows of 32 bytes, in the L1 cache
    const float* fb = f + (b & 15) * 8;  // their scales, then their sums
    __asm__ volatile("" : "+r"(xb), "+r"(fb));
    for (int m = 0; m < 4; ++m) {
      __m256i pairs = _mm256_setzero_si256();
      for (int u = 0; u < 8; ++u) {
        int32_t d;
        memcpy(&d, xb + 32 * m + 4 * u, 4);
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[u], _mm256_set1_epi32(d)));
      }
      const __m256i sum = _mm256_madd_epi16(pairs, ones);
      if (epilogue) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_broadcast_ss(fb + m));
        acc[m] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sum), acc[m]);
        acc[m] = _mm256_fmadd_ps(minimum, _mm256_broadcast_ss(fb + m + 4), acc[m]);
      } else {
        sums[m] = _mm256_add_epi32(sums[m], sum);
      }
    }
  }
  float out[8], total = 0;
  __m256 all = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  all = _mm256_add_ps(all, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]),
                                                              _mm256_add_epi32(sums[2], sums[3]))));
  _mm256_storeu_ps(out, all);
  for (int i = 0; i < 8; ++i) total += out[i];
  return total;
}

float q8_blocks(const int8_t* x, const float* f, long blocks, int epilogue) {
  __m256i w[8];
  for (int u = 0; u < 8; ++u) w[u] = _mm256_sub_epi8(weights(u), _mm256_set1_epi8(7));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                     _mm256_setzero_si256()};
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 scale = _mm256_set1_ps(0.5f);
  for (long b = 0; b < blocks; ++b) {
    const int8_t* xb = x + (b & 15) * 128;
    const float* fb = f + (b & 15) * 8;
    __asm__ volatile("" : "+r"(xb), "+r"(fb));
    for (int m = 0; m < 4; ++m) {
      __m256i sum = _mm256_setzero_si256();
      for (int u = 0; u < 8; ++u) {
        int32_t d;
        memcpy(&d, xb + 32 * m + 4 * u, 4);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[u], w[u]),
                                               _mm256_sign_epi8(_mm256_set1_epi32(d), w[u]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
      }
      if (epilogue) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_broadcast_ss(fb + m));
        acc[m] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sum), acc[m]);
      } else {
        sums[m] = _mm256_add_epi32(sums[m], sum);
      }
    }
  }
  float out[8], total = 0;
  __m256 all = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  all = _mm256_add_ps(all, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]),
                                                              _mm256_add_epi32(sums[2], sums[3]))));
  _mm256_storeu_ps(out, all);
  for (int i = 0; i < 8; ++i) total += out[i];
  return total;
}
