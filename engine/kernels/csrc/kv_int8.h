// The int8 KV cache's rows (engine/attention/kv_cache.py says why): head_dim values
// quantized symmetrically, then their scale as float16 bytes. value = int8 * scale, with
// scale = max |x| / 127 rounded to float16 first; the values are quantized with that
// rounded scale, multiplying by its inverse, exactly as `quantize_kv` in torch does, so
// the kernels and the torch path write the same bytes.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kv_int8 {

constexpr int64_t kScaleBytes = 2;

inline float scale_of(const int8_t* row, int64_t dim) {
  uint16_t bits;
  std::memcpy(&bits, row + dim, sizeof bits);
  return _cvtsh_ss(bits);
}

// x[0, dim) -> row[0, dim + 2).
inline void quantize_row(const float* x, int64_t dim, int8_t* row) {
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t bits = _cvtss_sh(std::min(amax / 127.f, 65504.f), _MM_FROUND_TO_NEAREST_INT);
  const float scale = _cvtsh_ss(bits);
  const float inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    // nearbyint: round half to even under the default rounding mode, as torch.round.
    const float q = std::nearbyint(x[i] * inverse);
    row[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  std::memcpy(row + dim, &bits, sizeof bits);
}

}  // namespace kv_int8
