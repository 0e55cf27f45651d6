// AVX2 helpers the float32 kernels share: a horizontal sum and a vectorised exp.
#pragma once

#include <immintrin.h>

namespace pagedserve_avx2 {

constexpr long kLanes = 8;

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// exp(x), relative error ~2e-7, inputs clamped to [-87, 88]: the AVX-512 kernels' exp
// (vec.h), with 2^n built in the exponent bits since AVX2 has no scalef.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // n in [-126, 127] after the clamp: 2^n is a normal float with exponent bits n + 127.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace pagedserve_avx2
