// F16 and BF16 weights (F16 and BF16 GGUF files) multiplied in their 16 bits: 2 bytes a
// weight resident where float32 weights took 4 (the model's float32 activations on AVX2
// CPUs held every such file at twice its size).
//
// No int8 activations here: each weight converts exactly to float32 (F16C, or BF16's 16-bit
// shift) and multiplies the float32 activations (bf16 ones converted, exactly) by FMA, in
// float32 sums of kAcc lanes-wide chunks per row: the dense product within float rounding.
// 512 bits wide in the AVX-512 build, 256 in the AVX2 one; a row's sum is added in one order
// whatever tile it falls in. Rows in the file's layout, as 32-value "blocks" of 64 bytes.
#include "ggml_common.h"

namespace pagedserve_ggml {
namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kAcc = 2;  // kLanes * kAcc = 32 values a step
template <bool BF>
inline __m512 load_w(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return BF ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            : _mm512_cvtph_ps(h);
}
inline __m512 load_x(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 zero() { return _mm512_setzero_ps(); }
inline float total(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#else
using Vec = __m256;
constexpr int kLanes = 8, kAcc = 4;
template <bool BF>
inline __m256 load_w(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return BF ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            : _mm256_cvtph_ps(h);
}
inline __m256 load_x(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 zero() { return _mm256_setzero_ps(); }
inline float total(__m256 v) { return hsum(v); }
#endif

template <bool BF, int MT, typename Out>
void rows_dot_16(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x,
                 int64_t K, Out* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    Vec acc[kAcc][MT];
    for (int c = 0; c < kAcc; ++c)
      for (int m = 0; m < MT; ++m) acc[c][m] = zero();
    for (int64_t k = 0; k < K; k += kAcc * kLanes) {
      _mm_prefetch((const char*)(row + 2 * k + 512), _MM_HINT_T0);
      for (int c = 0; c < kAcc; ++c) {
        const Vec wv = load_w<BF>(row + 2 * (k + c * kLanes));
        for (int m = 0; m < MT; ++m) acc[c][m] = vfma(wv, load_x(x + m * K + k + c * kLanes), acc[c][m]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      Vec sum = acc[0][m];
      for (int c = 1; c < kAcc; ++c) sum = vadd(sum, acc[c][m]);
      y[m * ldy + n] = (Out)total(sum);
    }
  }
}

template <bool BF, typename Out>
void rows_16(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M, int64_t K,
             Out* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += kTile) {
    const float* x = a.xf.data() + m * K;
    Out* o = y + s.col0 + m * ldy;
    switch (std::min<int64_t>(kTile, M - m)) {
      case 1: rows_dot_16<BF, 1>(s.w, s.row_bytes, n0, n1, x, K, o, ldy); break;
      case 2: rows_dot_16<BF, 2>(s.w, s.row_bytes, n0, n1, x, K, o, ldy); break;
      case 3: rows_dot_16<BF, 3>(s.w, s.row_bytes, n0, n1, x, K, o, ldy); break;
      default: rows_dot_16<BF, 4>(s.w, s.row_bytes, n0, n1, x, K, o, ldy); break;
    }
  }
}

}  // namespace

void f16_dequantize_block(int64_t type, const uint8_t* b, float* y) {
  for (int l = 0; l < 32; ++l) {
    uint16_t h;
    std::memcpy(&h, b + 2 * l, 2);
    if (type == F16) {
      y[l] = _cvtsh_ss(h);
    } else {
      const uint32_t u = (uint32_t)h << 16;
      std::memcpy(y + l, &u, 4);
    }
  }
}

void f16_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M, int64_t K,
              float* y, int64_t ldy) {
  s.type == BF16 ? rows_16<true>(s, n0, n1, a, M, K, y, ldy) : rows_16<false>(s, n0, n1, a, M, K, y, ldy);
}
void f16_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M, int64_t K,
              at::BFloat16* y, int64_t ldy) {
  s.type == BF16 ? rows_16<true>(s, n0, n1, a, M, K, y, ldy) : rows_16<false>(s, n0, n1, a, M, K, y, ldy);
}

}  // namespace pagedserve_ggml
