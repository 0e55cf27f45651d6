// What the GGUF block kernels share across their files (ggml_quants.cpp: the legacy types,
// Q4_K, Q5_K, Q6_K and the entry points; ggml_table4.cpp: IQ4_NL, IQ4_XS and MXFP4;
// ggml_q23_k.cpp: Q2_K and Q3_K; ggml_iq_grid.cpp: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and
// IQ3_S; ggml_f16.cpp: F16 and BF16): the type ids, the int8
// activation blocks, the integer-dot helpers of both builds (AVX2, and AVX512-VNNI where
// compiled for), and the per-row kernel loop.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pagedserve_ggml {

// ggml_type ids (ggml.h), which GGUF stores per tensor; a regrouped layout's id is 1000 + its
// file type's (not ggml types: ids of our own, see ggml_quants.cpp's Q4_0x8).
enum GgmlType : int64_t {
  F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
  Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ4_NL = 20, IQ3_S = 21,
  IQ2_S = 22, IQ4_XS = 23, BF16 = 30, MXFP4 = 39
};
constexpr int64_t kRegrouped = 1000;
// IQ4_NL regrouped by 8 rows: Q4_0x8's layout (ggml_quants.cpp), whose block it shares (an f16
// d and 16 bytes of nibbles); IQ4_XS and MXFP4 regrouped (see ggml_table4.cpp), 1104 and 136
// bytes a column.
constexpr int64_t IQ4_NLx8 = kRegrouped + IQ4_NL;
constexpr int64_t IQ4_XSx8 = kRegrouped + IQ4_XS;
constexpr int64_t MXFP4x8 = kRegrouped + MXFP4;
constexpr int64_t kIQ4XSColumn = 1104;
// Q2_K and Q3_K regrouped (see ggml_q23_k.cpp): 672 and 912 bytes a super-block column.
constexpr int64_t Q2_Kx8 = kRegrouped + Q2_K;
constexpr int64_t Q3_Kx8 = kRegrouped + Q3_K;

constexpr int64_t kGroupRows = 8;

constexpr int64_t QK = 32;    // values per activation block and per legacy weight block
constexpr int64_t QKK = 256;  // values per K-quant super-block

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---------------------------------------------------------------- int8 activations
//
// Two layouts, as in llama.cpp: per 32 values for the 32-value formats (Q4_0, Q4_1, Q8_0,
// IQ4_NL, and IQ4_XS's sub-blocks), per 256 for the K-quants, whose integer sums then run
// over a whole super-block with one float multiply at its end.

// 32 activations as int8 with one scale (x ~= d * q), and d times the sum of q.
struct XBlock {
  float d, dsum;
  int32_t qsum;  // the sum of q (dsum = d * qsum)
  int8_t q[32];
};

// 256 activations as int8 with one scale, and the sums of q over each 16 and each 32.
struct XBlockK {
  float d;
  int16_t bsums[16];
  int16_t sums32[8];
  int8_t q[256];
};

// ---------------------------------------------------------------- integer dots

inline __m256i dot_us(__m256i u, __m256i s) {  // 8 int32 sums of u * s (u unsigned)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256i nibbles(const uint8_t* q16) {  // 16 bytes -> 32 values: low nibbles, then high
  const __m128i t = _mm_loadu_si128((const __m128i*)q16);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
}
inline void add(__m256& acc, __m256i p, float scale) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), acc);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
#endif

// 8 int32 sums of 4 u8 * s8 products each, added to acc (AVX512-VNNI where compiled for).
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_us(u, s));
#endif
}

// Without VNNI an integer dot is two multiplies (maddubs, then madd to widen its int16 pair
// sums) and an add, and the multiplies share two ports: at 4+ activation rows (batched
// decode, prefill) that is the bound. Where the weights' values are small, maddubs's pair
// sums are added as int16 first and widened once: a pair of 4-bit values times int8
// activations (within +-127) is within 2 x 15 x 127 = 3,810, so 8 of them fit an int16;
// 5-bit ones (7,874) 4, 6-bit ones (16,002) 2. Integer sums either way: the same bits.
inline __m256i dot4_16(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
inline __m256i dot4_16_add(__m256i acc16, __m256i u, __m256i s) {
  return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(u, s));
}
inline __m256i widen_add(__m256i acc, __m256i sum16) {  // acc + the int16 pairs' sums
  return _mm256_add_epi32(acc, _mm256_madd_epi16(sum16, _mm256_set1_epi16(1)));
}
// An int32 lane's value (within int16) in both its int16 halves, for madd to multiply a
// lane's int16 pair sums by it and add them: one multiply for the scale and the widening.
inline __m256i both_halves(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void store8(at::BFloat16* y, __m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < 8; ++i) y[i] = at::BFloat16(t[i]);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// _mm256_shuffle_epi8 masks: int16 lane `i` of each 128-bit half broadcast to that half
// (kBroadcast16[i]), and Q6_K's pair: int16 `2i` to the low half, `2i + 1` to the high.
alignas(32) constexpr int8_t kBroadcast16[8][32] = {
#define B16(i) {2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, \
                 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, \
                 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, \
                 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1}
    B16(0), B16(1), B16(2), B16(3), B16(4), B16(5), B16(6), B16(7)};
#undef B16
alignas(32) constexpr int8_t kPair16[4][32] = {
#define P16(i) {4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, \
                 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, \
                 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, \
                 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, \
                 4 * i + 2, 4 * i + 3}
    P16(0), P16(1), P16(2), P16(3)};
#undef P16
inline __m256i mask(const int8_t* m) { return _mm256_load_si256((const __m256i*)m); }

// MT activation rows (starting at x, xstride blocks apart) against weight rows [n0, n1).
// Two accumulator sets (vector and offset), alternating by block, so consecutive blocks'
// adds do not wait on each other: one set would chain every block on the latency of an
// add (3-4 cycles), longer than a block's other work at one activation row. The same two
// at every MT, so a row's sum is added in the same order whatever tile it falls in: a
// speculative verify's 1 + k rows then equal plain decode's single rows bit for bit. (Four
// sets at 1-2 rows measured the same speed, bench.kernel_ab: 0.98-1.05x a layer.)
template <typename B, int MT, typename Out>
void rows_dot(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
              const typename B::X* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  constexpr int SETS = 2;
  const int64_t blocks = K / B::values;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[SETS][MT];
    __m128 off[SETS][MT];
    const typename B::X* xs[MT];
    for (int s = 0; s < SETS; ++s)
      for (int m = 0; m < MT; ++m) {
        acc[s][m] = _mm256_setzero_ps();
        off[s][m] = _mm_setzero_ps();
      }
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch((const char*)(row + (b + 8) * B::bytes), _MM_HINT_T0);
      for (int m = 0; m < MT; ++m) xs[m] = x + m * xstride + b;
      B::template dot<MT>(row + b * B::bytes, xs, acc[b % SETS], off[b % SETS]);
    }
    for (int m = 0; m < MT; ++m) {
      __m256 total = acc[0][m];
      __m128 offset = off[0][m];
      for (int s = 1; s < SETS; ++s) {
        total = _mm256_add_ps(total, acc[s][m]);
        offset = _mm_add_ps(offset, off[s][m]);
      }  // lane 1 of `offset`: the blocks' offset terms
      y[m * ldy + n] = (Out)(hsum(total) + _mm_cvtss_f32(_mm_movehdup_ps(offset)));
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// AVX-512: two 8-row groups side by side in one 512-bit vector (see ggml_quants.cpp).
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each group
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}
inline __m512i load_pair16(const uint8_t* a, const uint8_t* b) {  // 16 bytes of each, widened
  return _mm512_castsi256_si512(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
      _mm_loadu_si128((const __m128i*)b), 1));
}
inline __m512 f16_pair(const uint8_t* a, const uint8_t* b) {  // 8 f16 of each group
  return _mm512_cvtph_ps(_mm512_castsi512_si256(load_pair16(a, b)));
}
inline __m512i bytes_pair(const uint8_t* a, const uint8_t* b) {  // 8 bytes of each -> int32
  return _mm512_cvtepu8_epi32(
      _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b)));
}
// The next block column of both groups, ahead of use: the hardware prefetcher follows one
// stream well, two interleaved ones less so.
inline void prefetch_pair(const uint8_t* c0, const uint8_t* c1, int64_t column) {
  for (int64_t k = 0; k < column; k += 64) {
    _mm_prefetch((const char*)(c0 + column + k), _MM_HINT_T0);
    _mm_prefetch((const char*)(c1 + column + k), _MM_HINT_T0);
  }
}
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::BFloat16* y, __m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int i = 0; i < 16; ++i) y[i] = at::BFloat16(t[i]);
}
#endif

// One weight of a fused projection: its blocks, type, and first output column.
struct Segment {
  const uint8_t* w;
  int64_t rows, row_bytes, type, col0;
};

constexpr int64_t kRowsPerTask = 16;  // weight rows a task streams (reused by every x tile)
constexpr int kTile = 4;              // activation rows per pass over a weight block

// Both activation layouts of x, each made only if a weight of the call needs it.
struct Activations {
  std::vector<XBlock> x32;
  std::vector<XBlockK> x256;
  std::vector<float> xf;  // x as float32, for F16 and BF16 weights (ggml_f16.cpp)
};

template <typename B, typename Out>
void segment_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                  int64_t K, Out* y, int64_t ldy) {
  using X = typename B::X;
  const X* xq;
  if constexpr (std::is_same<X, XBlock>::value) xq = a.x32.data(); else xq = a.x256.data();
  const int64_t xstride = K / B::values;
  Out* out = y + s.col0;
  for (int64_t m = 0; m < M; m += kTile) {
    const X* x = xq + m * xstride;
    Out* o = out + m * ldy;
    switch (std::min<int64_t>(kTile, M - m)) {
      case 1: rows_dot<B, 1>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      case 2: rows_dot<B, 2>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      case 3: rows_dot<B, 3>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
      default: rows_dot<B, 4>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy); break;
    }
  }
}

// ---------------------------------------------------------------- the other format files
// Each takes its file types and their regrouped ids (`kRegrouped` + type).

// ggml_table4.cpp: IQ4_NL, IQ4_XS and MXFP4 (values from a 16-entry int8 table, 32
// activations a block)
void table4_dequantize_block(int64_t type, const uint8_t* b, float* y);
void table4_dequantize_group_row(int64_t type, const uint8_t* group, int64_t r, int64_t cols,
                                 float* y);
void table4_repack(int64_t type, const uint8_t* src, int64_t stride, int64_t blocks,
                   uint8_t* group, int64_t g);
void table4_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, float* y, int64_t ldy);
void table4_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, at::BFloat16* y, int64_t ldy);

// ggml_f16.cpp: F16 and BF16 weights (32-value "blocks" of 64 bytes), on float32 activations
void f16_dequantize_block(int64_t type, const uint8_t* b, float* y);
void f16_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M, int64_t K,
              float* y, int64_t ldy);
void f16_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M, int64_t K,
              at::BFloat16* y, int64_t ldy);

// ggml_q23_k.cpp: Q2_K and Q3_K (16 sub-blocks of 16, 256 activations a block)
void q23_k_dequantize_block(int64_t type, const uint8_t* b, float* y);
void q23_k_dequantize_group_row(int64_t type, const uint8_t* group, int64_t r, int64_t cols,
                                float* y);
void q23_k_repack(int64_t type, const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group,
                  int64_t g);
void q23_k_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, float* y, int64_t ldy);
void q23_k_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, at::BFloat16* y, int64_t ldy);

// ggml_iq_grid.cpp: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (8 or 4 values at a time from
// a grid, with sign bits; 256 activations a block), in the file's layout only
void iq_grid_dequantize_block(int64_t type, const uint8_t* b, float* y);
void iq_grid_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                  int64_t K, float* y, int64_t ldy);
void iq_grid_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                  int64_t K, at::BFloat16* y, int64_t ldy);

}  // namespace pagedserve_ggml
