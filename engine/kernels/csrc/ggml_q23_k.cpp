// Q2_K and Q3_K, the 2- and 3-bit K-quants (Q2_K, Q3_K_S/M/L files), served from their blocks.
//
// Both hold 256 values in 16 sub-blocks of 16, each value's low 2 bits in `qs` (values
// 128 n + 32 j + l at bits 2j of byte 32 n + l):
// * Q2_K (84 bytes): 16 scale bytes (low nibble the sub-block's scale, high its min), qs
//   (64), f16 d and dmin: value = d * scale * q - dmin * min.
// * Q3_K (110 bytes): hmask (32), qs (64), 12 bytes of 6-bit scales, f16 d: a value's third
//   bit is bit 4 n + j of hmask[l], value = d * (scale - 32) * (q - 4 * (1 - bit)).
//
// Products as llama.cpp's: 256-value int8 activation blocks (XBlockK), each sub-block's
// integer dot times its integer scale summed over the super-block, one float multiply at
// its end; Q2_K's mins and Q3_K's -4 offset applied through the activations' sums of 16.
// The values are unsigned (0-3, 0-7) and small, so maddubs's int16 pairs never saturate.
// Rows in the file's layout (rows_dot, ggml_common.h).
#include <ATen/Parallel.h>

#include "ggml_common.h"

namespace pagedserve_ggml {
namespace {

// Q3_K's twelve scale bytes -> 16 scales, less 32 (ggml's dequantize_row_q3_K).
inline void unpack_scales_q3(const uint8_t* p, int8_t* out) {
  uint32_t aux[4];
  std::memcpy(aux, p, 12);
  const uint32_t tmp = aux[2], two = 0x03030303, four = 0x0f0f0f0f;
  aux[2] = ((aux[0] >> 4) & four) | (((tmp >> 4) & two) << 4);
  aux[3] = ((aux[1] >> 4) & four) | (((tmp >> 6) & two) << 4);
  aux[0] = (aux[0] & four) | (((tmp >> 0) & two) << 4);
  aux[1] = (aux[1] & four) | (((tmp >> 2) & two) << 4);
  uint8_t u[16];
  std::memcpy(u, aux, 16);
  for (int i = 0; i < 16; ++i) out[i] = (int8_t)(u[i] - 32);
}

void dequantize_q2_k(const uint8_t* b, float* y) {
  const float d = fp16(b + 80), dmin = fp16(b + 82);
  for (int v = 0; v < 256; ++v) {
    const int n = v / 128, j = v % 128 / 32, l = v % 32;
    const int q = (b[16 + 32 * n + l] >> (2 * j)) & 3;
    const uint8_t s = b[v / 16];
    y[v] = (d * (float)(s & 0xF)) * (float)q - dmin * (float)(s >> 4);
  }
}

void dequantize_q3_k(const uint8_t* b, float* y) {
  int8_t sc[16];
  unpack_scales_q3(b + 96, sc);
  const float d = fp16(b + 108);
  for (int v = 0; v < 256; ++v) {
    const int n = v / 128, j = v % 128 / 32, l = v % 32;
    const int q = ((b[32 + 32 * n + l] >> (2 * j)) & 3) - (((b[l] >> (4 * n + j)) & 1) ? 0 : 4);
    y[v] = (d * (float)sc[v / 16]) * (float)q;
  }
}

// The 16 scales as int16, in both 128-bit lanes per half: half h's 8 (sub-blocks 8 h..8 h + 7).
struct HalfScales {
  __m256i half[2];
  explicit HalfScales(__m256i s16)
      : half{_mm256_permute2x128_si256(s16, s16, 0x00), _mm256_permute2x128_si256(s16, s16, 0x11)} {}
  // 32-value group g of half h: sub-block 8 h + 2 g's scale in the low lane, 8 h + 2 g + 1's high
  __m256i pair(int h, int g) const { return _mm256_shuffle_epi8(half[h], mask(kPair16[g])); }
};

struct BlockQ2_K {
  using X = XBlockK;
  static constexpr int64_t values = 256;
  static constexpr int64_t bytes = 84;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const float d = fp16(w + 80), dmin = fp16(w + 82);
    const __m128i sm = _mm_loadu_si128((const __m128i*)w);
    const __m128i nib = _mm_set1_epi8(0xF);
    const HalfScales scales(_mm256_cvtepu8_epi16(_mm_and_si128(sm, nib)));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), nib));
    const __m256i three = _mm256_set1_epi8(3);
    __m256i sum[MT];
    for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i q = load32(w + 16 + 32 * h);
      for (int g = 0; g < 4; ++g) {
        const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), three);
        const __m256i scale = scales.pair(h, g);
        for (int m = 0; m < MT; ++m) {
          const __m256i p = _mm256_maddubs_epi16(u, load32(xs[m]->q + 128 * h + 32 * g));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i msum = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)xs[m]->bsums));
      add(acc[m], sum[m], d * xs[m]->d);
      add(acc[m], msum, -dmin * xs[m]->d);
    }
  }
};

struct BlockQ3_K {
  using X = XBlockK;
  static constexpr int64_t values = 256;
  static constexpr int64_t bytes = 110;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const float d = fp16(w + 108);
    alignas(16) int8_t sc[16];
    unpack_scales_q3(w + 96, sc);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i*)sc));
    const HalfScales scales(sc16);
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hm = load32(w);
    __m256i sum[MT];
    for (int m = 0; m < MT; ++m)  // values stored plus 4: 4 * sum of scale * (sum of its 16 x)
      sum[m] = _mm256_sub_epi32(
          _mm256_setzero_si256(),
          _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)xs[m]->bsums)), 2));
    for (int h = 0; h < 2; ++h) {
      const __m256i q = load32(w + 32 + 32 * h);
      for (int g = 0; g < 4; ++g) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + g), one);
        const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * g), three),
                                          _mm256_slli_epi16(bit, 2));
        const __m256i scale = scales.pair(h, g);
        for (int m = 0; m < MT; ++m) {
          const __m256i p = _mm256_maddubs_epi16(u, load32(xs[m]->q + 128 * h + 32 * g));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int m = 0; m < MT; ++m) add(acc[m], sum[m], d * xs[m]->d);
  }
};

template <typename Out>
void rows_any(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
              int64_t K, Out* y, int64_t ldy) {
  if (s.type == Q2_K)
    segment_rows<BlockQ2_K>(s, n0, n1, a, M, K, y, ldy);
  else
    segment_rows<BlockQ3_K>(s, n0, n1, a, M, K, y, ldy);
}

}  // namespace

void q23_k_dequantize_block(int64_t type, const uint8_t* b, float* y) {
  if (type == Q2_K)
    dequantize_q2_k(b, y);
  else
    dequantize_q3_k(b, y);
}

void q23_k_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, float* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}
void q23_k_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, at::BFloat16* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}

}  // namespace pagedserve_ggml
