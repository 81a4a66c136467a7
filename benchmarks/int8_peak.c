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

// One activation row's block against the 8 weight registers: its 8 lanes' int32 sums.
static inline __attribute__((always_inline)) __m256i row_block(const __m256i w[8], const int8_t* xr,
                                                               int q4) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_setzero_si256(), pairs = _mm256_setzero_si256();
  for (int u = 0; u < 8; ++u) {
    int32_t d;
    memcpy(&d, xr + 4 * u, 4);
    if (q4) {  // nibbles times int8, summed in int16 over the block
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[u], _mm256_set1_epi32(d)));
    } else {  // |w| times x with w's sign, each dword's pairs widened
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[u], w[u]),
                                             _mm256_sign_epi8(_mm256_set1_epi32(d), w[u]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
    }
  }
  return q4 ? _mm256_madd_epi16(pairs, ones) : sum;
}

static inline __attribute__((always_inline)) float run_blocks(const int8_t* x, const float* f, long blocks,
                                                              int epilogue, int q4) {
  __m256i w[8], sums[4];
  __m256 acc[4];
  for (int u = 0; u < 8; ++u) w[u] = q4 ? weights(u) : _mm256_sub_epi8(weights(u), _mm256_set1_epi8(7));
  for (int m = 0; m < 4; ++m) sums[m] = _mm256_setzero_si256(), acc[m] = _mm256_setzero_ps();
  const __m256 scale = _mm256_set1_ps(0.5f), minimum = _mm256_set1_ps(0.25f);
  for (long b = 0; b < blocks; ++b) {
    const int8_t* xb = x + (b & 15) * 128;  // 4 rows of 32 bytes, in the L1 cache
    const float* fb = f + (b & 15) * 8;  // their scales, then their sums
    __asm__ volatile("" : "+r"(xb), "+r"(fb));
    for (int m = 0; m < 4; ++m) {
      const __m256i sum = row_block(w, xb + 32 * m, q4);
      if (epilogue) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_broadcast_ss(fb + m));
        acc[m] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sum), acc[m]);
        if (q4) acc[m] = _mm256_fmadd_ps(minimum, _mm256_broadcast_ss(fb + m + 4), acc[m]);
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

float q4_blocks(const int8_t* x, const float* f, long blocks, int epilogue) {
  return run_blocks(x, f, blocks, epilogue, 1);
}

float q8_blocks(const int8_t* x, const float* f, long blocks, int epilogue) {
  return run_blocks(x, f, blocks, epilogue, 0);
}
