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
// Rows in the file's layout (rows_dot, ggml_common.h), or regrouped by 8 rows at load (below).
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

// The same 16 scales less 32 in one vector, without the scalar round trip (whose 16-byte
// reload of four 4-byte stores cannot be forwarded: a stall per super-block and row). Scale
// i's low 4 bits: byte i's low nibble (i < 8), byte i - 8's high one; its high 2 bits: bits
// 2 (i / 4) of byte 8 + i % 4, which one variable shift per 32-bit lane brings down.
inline __m128i scales_q3(const uint8_t* p) {
  uint32_t high;
  std::memcpy(&high, p + 8, 4);
  const __m128i low8 = _mm_loadl_epi64((const __m128i*)p), nib = _mm_set1_epi8(0xF);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(low8, nib),
                                         _mm_and_si128(_mm_srli_epi16(low8, 4), nib));
  const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)high), _mm_setr_epi32(0, 2, 4, 6)),
                                   _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
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

// From its parts: d, the 16 scales less 32, hmask (32 bytes) and qs (64).
void dequantize_q3_parts(float d, const int8_t* sc, const uint8_t* hm, const uint8_t* qs, float* y) {
  for (int v = 0; v < 256; ++v) {
    const int n = v / 128, j = v % 128 / 32, l = v % 32;
    const int q = ((qs[32 * n + l] >> (2 * j)) & 3) - (((hm[l] >> (4 * n + j)) & 1) ? 0 : 4);
    y[v] = (d * (float)sc[v / 16]) * (float)q;
  }
}

void dequantize_q3_k(const uint8_t* b, float* y) {
  int8_t sc[16];
  unpack_scales_q3(b + 96, sc);
  dequantize_q3_parts(fp16(b + 108), sc, b, b + 32, y);
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
    const __m256i sc16 = _mm256_cvtepi8_epi16(scales_q3(w + 96));
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

// ---------------------------------------------------------------- regrouped by 8 rows
//
// As ggml_quants.cpp's Q4_Kx8, per super-block column of an 8-row group:
// * Q2_Kx8 (672 bytes, the file's 8 x 84): the rows' f16 d (16 bytes) and dmin (16), their
//   scale bytes as the file has them (sub-block s of row r at 32 + 8 s + r), then their 64
//   quant bytes interleaved 4 at a time (bytes 4t..4t+3 of row r at 160 + 32 t + 4 r).
// * Q3_Kx8 (912 bytes, the file's 880): f16 d (16), the scales unpacked to int8 less 32 (at
//   16 + 8 s + r), the quant bytes as Q2_Kx8's at 144, then hmask likewise at 656.
// One integer dot sums 4 values of each of 8 rows (a row per lane); per sub-block an int32
// multiply by the rows' scales, per super-block two float multiply-adds for 8 rows.
template <bool Q3>
struct Column {
  static constexpr int64_t bytes = Q3 ? 912 : 672, scales = Q3 ? 16 : 32, quants = Q3 ? 144 : 160;
  static constexpr int64_t hmask = 656;
};

// Sub-block s's scales of the 8 rows, int32 a lane (Q2_K's low nibbles; Q3_K's int8).
template <bool Q3>
inline __m256i sub_scales(const uint8_t* c, int s) {
  const __m128i b = _mm_loadl_epi64((const __m128i*)(c + Column<Q3>::scales + 8 * s));
  return Q3 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0xF)));
}
// Sub-blocks 2p and 2p + 1's scales (Q3) or mins (Q2) of the 8 rows as int16 pairs, for one
// madd against the activations' sums of those two sub-blocks.
template <bool Q3>
inline __m256i pair_terms(const uint8_t* c, int p) {
  const uint8_t* at = c + Column<Q3>::scales + 16 * p;
  const __m128i pair = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)at),
                                         _mm_loadl_epi64((const __m128i*)(at + 8)));
  return Q3 ? _mm256_cvtepi8_epi16(pair) : _mm256_srli_epi16(_mm256_cvtepu8_epi16(pair), 4);
}
inline __m256i pair_sums(const XBlockK* xb, int p) {  // bsums 2p, 2p + 1 in every lane
  int32_t v;
  std::memcpy(&v, xb->bsums + 2 * p, 4);
  return _mm256_set1_epi32(v);
}

template <bool Q3, int MT, typename Out>
void groups_dot_q23(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                    const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  using C = Column<Q3>;
  const int64_t blocks = K / QKK;
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const uint8_t* group = w + (n / kGroupRows) * group_bytes;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c = group + b * C::bytes;
      for (int64_t k = 0; k < C::bytes; k += 64)
        _mm_prefetch((const char*)(c + 2 * C::bytes + k), _MM_HINT_T0);
      __m256i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
      if (Q3 && !kVNNI) {  // the -4 offset: 4 * sum over sub-blocks of scale * (sum of its x)
        __m256i pairs[8];
        for (int p = 0; p < 8; ++p) pairs[p] = pair_terms<true>(c, p);
        for (int m = 0; m < MT; ++m) {
          __m256i offset = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p)
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pairs[p], pair_sums(x + m * xstride + b, p)));
          isum[m] = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(offset, 2));
        }
      }
      for (int h = 0; h < 2; ++h) {
        for (int th = 0; th < 2; ++th) {  // sub-blocks 8 h + 2 g + th, g = 0..3
          __m256i sum[4][MT];  // VNNI: int32; AVX2: int16 pair sums (4 lanes of 0-7 values fit)
          for (int g = 0; g < 4; ++g)
            for (int m = 0; m < MT; ++m)
              sum[g][m] = Q3 && kVNNI ? _mm256_set1_epi32(-4 * x[m * xstride + b].bsums[8 * h + 2 * g + th])
                                      : _mm256_setzero_si256();
          for (int tt = 0; tt < 4; ++tt) {
            const int l4 = 4 * th + tt;  // lane of hmask; the quant lane is 8 h + l4
            const __m256i v = load32(c + C::quants + 32 * (8 * h + l4));
            __m256i hv = _mm256_setzero_si256();
            if (Q3) hv = load32(c + C::hmask + 32 * l4);
            for (int g = 0; g < 4; ++g) {
              __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 2 * g), three);
              if (Q3) {
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hv, 4 * h + g), one);
                u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 2));
              }
              for (int m = 0; m < MT; ++m) {
                const __m256i xq = broadcast4(x[m * xstride + b].q + 128 * h + 32 * g + 4 * l4);
                sum[g][m] = kVNNI ? dot4_add(sum[g][m], u, xq) : dot4_16_add(sum[g][m], u, xq);
              }
            }
          }
          for (int g = 0; g < 4; ++g) {
            const __m256i sc = sub_scales<Q3>(c, 8 * h + 2 * g + th);
            if (kVNNI) {
              for (int m = 0; m < MT; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(sum[g][m], sc));
            } else {
              const __m256i sc2 = both_halves(sc);
              for (int m = 0; m < MT; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(sum[g][m], sc2));
            }
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
      if (Q3) {
        for (int m = 0; m < MT; ++m)
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]),
                                   _mm256_mul_ps(d, _mm256_set1_ps(x[m * xstride + b].d)), acc[m]);
      } else {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16)));
        __m256i mins[8];
        for (int p = 0; p < 8; ++p) mins[p] = pair_terms<false>(c, p);
        for (int m = 0; m < MT; ++m) {
          const XBlockK* xb = x + m * xstride + b;
          __m256i msum = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], pair_sums(xb, p)));
          const __m256 xd = _mm256_set1_ps(xb->d);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, xd), acc[m]);
          acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, xd), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + n, acc[m]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Two groups side by side in 512 bits (4+ activation rows), a sub-block at a time (as
// pairs_dot_q6_k: its quant lanes read once per sub-block, so 8 rows' sums fit in registers).
// The same integer sums and float operations per row as groups_dot_q23's VNNI path.
template <bool Q3>
inline __m512i sub_scales_pair(const uint8_t* c0, const uint8_t* c1, int s) {
  const int64_t at = Column<Q3>::scales + 8 * s;
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(c0 + at)),
                                       _mm_loadl_epi64((const __m128i*)(c1 + at)));
  return Q3 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0xF)));
}

template <bool Q3, int MT, typename Out>
void pairs_dot_q23(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                   const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  using C = Column<Q3>;
  const int64_t blocks = K / QKK;
  const __m512i three = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
  int64_t n = n0;
  for (; n + 2 * kGroupRows <= n1; n += 2 * kGroupRows) {
    const uint8_t* g0 = w + (n / kGroupRows) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c0 = g0 + b * C::bytes;
      const uint8_t* c1 = g1 + b * C::bytes;
      prefetch_pair(c0, c1, C::bytes);
      __m512i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int s = 0; s < 16; ++s) {  // sub-block s = 8 h + 2 g + th
        const int h = s / 8, g = s % 8 / 2, th = s % 2;
        __m512i sum[MT];
        for (int m = 0; m < MT; ++m)
          sum[m] = Q3 ? _mm512_set1_epi32(-4 * x[m * xstride + b].bsums[s]) : _mm512_setzero_si512();
        for (int tt = 0; tt < 4; ++tt) {
          const int l4 = 4 * th + tt;
          const int64_t q = C::quants + 32 * (8 * h + l4);
          __m512i u = _mm512_and_si512(_mm512_srli_epi16(load_pair(c0 + q, c1 + q), 2 * g), three);
          if (Q3) {
            const int64_t hq = C::hmask + 32 * l4;
            const __m512i hv = load_pair(c0 + hq, c1 + hq);
            u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 4 * h + g), one), 2));
          }
          for (int m = 0; m < MT; ++m) {
            int32_t q4;
            std::memcpy(&q4, x[m * xstride + b].q + 128 * h + 32 * g + 4 * l4, 4);
            sum[m] = _mm512_dpbusd_epi32(sum[m], u, _mm512_set1_epi32(q4));
          }
        }
        const __m512i sc = sub_scales_pair<Q3>(c0, c1, s);
        for (int m = 0; m < MT; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[m], sc));
      }
      const __m512 d = f16_pair(c0, c1);
      if (Q3) {
        for (int m = 0; m < MT; ++m)
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                                   _mm512_mul_ps(d, _mm512_set1_ps(x[m * xstride + b].d)), acc[m]);
      } else {
        const __m512 dmin = f16_pair(c0 + 16, c1 + 16);
        __m512i mins[8];
        for (int p = 0; p < 8; ++p)
          mins[p] = _mm512_inserti64x4(_mm512_castsi256_si512(pair_terms<false>(c0, p)),
                                       pair_terms<false>(c1, p), 1);
        for (int m = 0; m < MT; ++m) {
          const XBlockK* xb = x + m * xstride + b;
          __m512i msum = _mm512_setzero_si512();
          for (int p = 0; p < 8; ++p) {
            int32_t v;
            std::memcpy(&v, xb->bsums + 2 * p, 4);
            msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(v)));
          }
          const __m512 xd = _mm512_set1_ps(xb->d);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, xd), acc[m]);
          acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, xd), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) store16(y + m * ldy + n, acc[m]);
  }
  if (n < n1) groups_dot_q23<Q3, MT>(w, group_bytes, n, n1, x, xstride, K, y, ldy);
}
#endif

template <bool Q3, typename Out>
void groups_q23(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, Out* y, int64_t ldy) {
  const int64_t xstride = K / QKK;
  int64_t m = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  for (; M - m >= 4; m += 8) {  // tiles of 4-8 rows by pairs of groups
    const XBlockK* x = a.x256.data() + m * xstride;
    Out* o = y + s.col0 + m * ldy;
#define PAIRS(MT) pairs_dot_q23<Q3, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy)
    switch (std::min<int64_t>(8, M - m)) {
      case 4: PAIRS(4); break;
      case 5: PAIRS(5); break;
      case 6: PAIRS(6); break;
      case 7: PAIRS(7); break;
      default: PAIRS(8); break;
    }
#undef PAIRS
  }
#endif
  for (; m < M; m += kTile) {
    const XBlockK* x = a.x256.data() + m * xstride;
    Out* o = y + s.col0 + m * ldy;
    switch (std::min<int64_t>(kTile, M - m)) {
      case 1: groups_dot_q23<Q3, 1>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      case 2: groups_dot_q23<Q3, 2>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      case 3: groups_dot_q23<Q3, 3>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      default: groups_dot_q23<Q3, 4>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
    }
  }
}

template <typename Out>
void rows_any(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
              int64_t K, Out* y, int64_t ldy) {
  switch (s.type) {
    case Q2_K: return segment_rows<BlockQ2_K>(s, n0, n1, a, M, K, y, ldy);
    case Q3_K: return segment_rows<BlockQ3_K>(s, n0, n1, a, M, K, y, ldy);
    case Q2_Kx8: return groups_q23<false>(s, n0, n1, a, M, K, y, ldy);
    default: return groups_q23<true>(s, n0, n1, a, M, K, y, ldy);
  }
}

}  // namespace

void q23_k_dequantize_block(int64_t type, const uint8_t* b, float* y) {
  if (type == Q2_K)
    dequantize_q2_k(b, y);
  else
    dequantize_q3_k(b, y);
}

void q23_k_dequantize_group_row(int64_t type, const uint8_t* group, int64_t r, int64_t cols,
                                float* y) {
  const bool q3 = type == Q3_Kx8;
  const int64_t column = q3 ? Column<true>::bytes : Column<false>::bytes;
  uint8_t block[84], hm[32], qs[64];
  int8_t sc[16];
  for (int64_t b = 0; b < cols / QKK; ++b) {
    const uint8_t* c = group + b * column;
    const int64_t quants = q3 ? Column<true>::quants : Column<false>::quants;
    for (int t = 0; t < 16; ++t) std::memcpy(qs + 4 * t, c + quants + 32 * t + 4 * r, 4);
    if (q3) {
      for (int t = 0; t < 8; ++t) std::memcpy(hm + 4 * t, c + Column<true>::hmask + 32 * t + 4 * r, 4);
      for (int s = 0; s < 16; ++s) sc[s] = (int8_t)c[16 + 8 * s + r];
      dequantize_q3_parts(fp16(c + 2 * r), sc, hm, qs, y + b * QKK);
    } else {
      for (int s = 0; s < 16; ++s) block[s] = c[32 + 8 * s + r];
      std::memcpy(block + 16, qs, 64);
      std::memcpy(block + 80, c + 2 * r, 2);
      std::memcpy(block + 82, c + 16 + 2 * r, 2);
      dequantize_q2_k(block, y + b * QKK);
    }
  }
}

void q23_k_repack(int64_t type, const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group,
                  int64_t g) {
  const bool q3 = type == Q3_K;
  const int64_t column = q3 ? Column<true>::bytes : Column<false>::bytes, bytes = q3 ? 110 : 84;
  int8_t sc[16];
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * column;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * bytes;
      if (q3) {
        std::memcpy(c + 2 * r, block + 108, 2);
        unpack_scales_q3(block + 96, sc);
        for (int s = 0; s < 16; ++s) c[16 + 8 * s + r] = (uint8_t)sc[s];
        for (int t = 0; t < 16; ++t) std::memcpy(c + 144 + 32 * t + 4 * r, block + 32 + 4 * t, 4);
        for (int t = 0; t < 8; ++t) std::memcpy(c + 656 + 32 * t + 4 * r, block + 4 * t, 4);
      } else {
        std::memcpy(c + 2 * r, block + 80, 2);
        std::memcpy(c + 16 + 2 * r, block + 82, 2);
        for (int s = 0; s < 16; ++s) c[32 + 8 * s + r] = block[s];
        for (int t = 0; t < 16; ++t) std::memcpy(c + 160 + 32 * t + 4 * r, block + 16 + 4 * t, 4);
      }
    }
  }
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
