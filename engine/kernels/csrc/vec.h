// AVX-512 helpers the kernels share: bf16 <-> fp32 and a vectorised exp.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace pagedserve_vec {

constexpr int64_t kLanes = 16;

// 16 bf16 -> 16 fp32 (exact).
inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> nearest bf16 (ties to even, as at::BFloat16(float) rounds; no NaNs here),
// kept in fp32 lanes: where a bf16 torch op rounds its result.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// 16 fp32 -> 16 bf16, rounded as `round_bf16`.
inline void store_bf16(at::BFloat16* p, __m512 v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(high));
}

// exp(x), relative error ~2e-7, inputs clamped to [-87, 88]: 2^(x log2 e) split into an
// integer (applied by scalef) and a fraction in [-0.5, 0.5] (a degree-6 polynomial).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pagedserve_vec
