// GGUF weights served from their own blocks: ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K
// and Q6_K (what Q4_0, Q4_K_M, Q5_K_M and Q8_0 files hold), and the entry points for every
// type: the other format families live in their own files (ggml_table4.cpp: IQ4_NL, IQ4_XS,
// MXFP4; ggml_q23_k.cpp: Q2_K, Q3_K; ggml_iq_grid.cpp: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S; ggml_f16.cpp: F16, BF16 weights), with what all share
// in ggml_common.h.
//
// Two things per format, both reading the file's block bytes (as they are, or for Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K regrouped 8 rows at a time at load, see Q4_0x8
// below):
//
// * `ggml_dequantize`: the float32 weights, computed exactly as ggml and the `gguf`
//   package define them (same products in the same order; this file is compiled with
//   -ffp-contract=off so the compiler never fuses them), so a test compares bit for bit.
// * `ggml_linear`: y = x @ W^T for one or more weights sharing x (fused q/k/v, gate/up),
//   as llama.cpp computes it: x is quantized to int8 per 32 values (a float scale and the
//   sums of each 16), and each block's dot product runs on integers
//   (`_mm256_maddubs_epi16`: unsigned 4/5/6-bit q times signed 8-bit x), the weights'
//   offsets (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q4_1's, Q5_1's and the K-quants' mins) applied once per block
//   through the activation sums. A decode step reads each weight byte once: it is a pass
//   over memory, and integer dots keep the arithmetic under the memory time.
//
// AVX2 + FMA + F16C only (every x86-64-v3 CPU), so one build serves the Xeon and the EPYC.
#include "ggml_quants.h"

#include <ATen/Parallel.h>

#include "ggml_common.h"
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace {

using namespace pagedserve_ggml;  // NOLINT: the format files' shared parts (ggml_common.h)

// Q4_0 repacked at load, 8 rows to a group (`ggml_repack`; not a ggml type, so an id of our
// own). Per block column b, a group holds its 8 rows' f16 scales (16 bytes), then their 16
// quant bytes interleaved 4 at a time: bytes 4j..4j+3 of row r at 16 + 32 j + 4 r. One
// 32-byte load then holds 4 bytes of each of the 8 rows, and an integer dot product with
// 4 activation bytes broadcast to every lane sums one row per lane: no horizontal sums,
// and one float multiply per block for 8 rows (the plain layout spends ~9 of its ~15
// vector ops per block and row on that float work, which keeps it under the memory time).
constexpr int64_t Q4_0x8 = 1000 + Q4_0;
// Q4_K the same way (Q4_Kx8). Per super-block column b, a group holds its 8 rows' f16 d
// (16 bytes) and dmin (16), their 6-bit scales unpacked to bytes, sub-block i's at 32 + 8 i
// + r, their mins the same way but in pairs of sub-blocks (2p, 2p + 1) at 96 + 16 p + 2 r,
// which one int16 multiply-add then applies to 8 rows at once, and at 160 their 128 quant
// bytes interleaved as Q4_0x8's: bytes 4t..4t+3 of chunk j (sub-blocks 2j and 2j + 1) of row
// r at 160 + 32 (8 j + t) + 4 r. 148 bytes a row where the file has 144: the scales' 6-bit
// packing is undone once here, not at every step.
constexpr int64_t Q4_Kx8 = 1000 + Q4_K;
// Q6_K too (Q6_Kx8), as large as the file's: per super-block column its 8 rows' f16 d (16
// bytes), their 16 int8 scales, sub-block s's at 16 + 8 s + r, then per half h (128 values)
// at 144 + 768 h the low-bit bytes ql (64 a row) interleaved 4 at a time, bytes 4k..4k+3 of
// row r at 32 k + 4 r, and the high-bit bytes qh (32 a row) the same way 512 bytes later.
constexpr int64_t Q6_Kx8 = 1000 + Q6_K;
// Q8_0 too (Q8_0x8), as Q4_0x8: per block column the 8 rows' f16 d (16 bytes), then their 32
// quant bytes interleaved 4 at a time, bytes 4j..4j+3 of row r at 16 + 32 j + 4 r, each
// stored plus 128 (its sign bit flipped) so the integer dot product, which takes one
// unsigned side, reads them as they are: (q + 128) . x - 128 sum x = q . x.
constexpr int64_t Q8_0x8 = 1000 + Q8_0;
// Q5_0 too (Q5_0x8), as Q4_0x8 with the fifth bits after the quant bytes: per block column
// the 8 rows' f16 d (16 bytes), their 16 quant bytes interleaved as Q4_0x8's, then at 144
// 4 bytes a row (144 + 4 r) of fifth bits laid out for the kernel's u[j] (values
// x_at(j)..x_at(j) + 3 of each row): bit j of byte k is the fifth bit of value x_at(j) + k,
// so one shift and one mask put it at 0x10 beside the nibble. As large as the file's.
constexpr int64_t Q5_0x8 = 1000 + Q5_0;
// Q4_1 and Q5_1 (Q4_1x8, Q5_1x8) as Q4_0x8 and Q5_0x8 with their 8 rows' f16 mins (16 bytes)
// after the scales: the quant bytes then start at 32 and Q5_1x8's fifth bits at 160. As large
// as the file's. (SmolLM2's default Q4_1 file: in the file's layout a row's dot took ~15
// vector ops a block, 4x Q4_0x8's time at one row and 6x at 8, bench.ggml_kernels.)
constexpr int64_t Q4_1x8 = 1000 + Q4_1;
constexpr int64_t Q5_1x8 = 1000 + Q5_1;
// Where value v (0-31) of a Q5_0 block sits in a Q5_0x8 column: in u[j], byte k.
struct FifthBitPlace {
  int j, k;
};
constexpr FifthBitPlace fifth_bit_place(int v) {
  return {v < 16 ? v / 4 : 4 + (v - 16) / 4, v % 4};
}
constexpr int64_t kQ4KColumn = 1184;  // bytes per super-block column of a Q4_Kx8 group
constexpr int64_t kQ6KColumn = 1680;  // and of a Q6_Kx8 group


struct Format {
  int64_t block_values, block_bytes;
};

Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case IQ2_XXS: return {256, 66};
    case IQ2_XS: return {256, 74};
    case IQ2_S: return {256, 82};
    case IQ3_XXS: return {256, 98};
    case IQ3_S: return {256, 110};
    case F16:
    case BF16: return {32, 64};  // no blocks: 32-value runs, so K's checks hold
    case IQ4_NL: return {32, 18};
    case IQ4_XS: return {256, 136};
    case IQ4_NLx8: return {32, 18 * kGroupRows};
    case IQ4_XSx8: return {256, kIQ4XSColumn};
    case MXFP4: return {32, 17};
    case MXFP4x8: return {32, 17 * kGroupRows};
    case Q2_Kx8: return {256, 672};
    case Q3_Kx8: return {256, 912};
    case Q4_0x8: return {32, 18 * kGroupRows};  // bytes per block column of a group
    case Q8_0x8: return {32, 34 * kGroupRows};
    case Q5_0x8: return {32, 22 * kGroupRows};
    case Q4_1x8: return {32, 20 * kGroupRows};
    case Q5_1x8: return {32, 24 * kGroupRows};
    case Q4_Kx8: return {256, kQ4KColumn};
    case Q6_Kx8: return {256, kQ6KColumn};
  }
  TORCH_CHECK(false, "ggml type ", type, " is not supported by pagedserve's GGUF kernels");
}

inline bool grouped(int64_t type) {
  return type == Q4_0x8 || type == Q4_1x8 || type == Q5_0x8 || type == Q5_1x8 ||
         type == Q8_0x8 || type == Q4_Kx8 || type == Q6_Kx8 || type == IQ4_NLx8 || type == IQ4_XSx8 ||
         type == MXFP4x8 || type == Q2_Kx8 || type == Q3_Kx8;
}

// Whether a type's products take the 256-value activation blocks (the K-quants'), not the
// 32-value ones (the legacy types', IQ4_NL's and IQ4_XS's, whose sub-blocks are 32 values).
inline bool k_activations(int64_t type) {
  return format_of(type).block_values == QKK && type != IQ4_XS && type != IQ4_XSx8;
}

// Rows of weights that `w`'s first dimension holds (groups of 8 once repacked).
int64_t rows_of(const torch::Tensor& w, int64_t type) {
  return w.size(0) * (grouped(type) ? kGroupRows : 1);
}

// Q4_K/Q5_K's twelve scale bytes -> 8 scales (bytes 0-7) and 8 mins (bytes 8-15), the
// 6-bit values of ggml's get_scale_min_k4 for all sub-blocks at once.
inline void unpack_scales_k4(const uint8_t* p, uint8_t* out) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);  // mins 4-7
  const uint32_t mins_low = u[1] & six;                       // mins 0-3
  u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);          // scales 4-7
  u[2] = mins_low;
  u[0] &= six;                                                // scales 0-3
  std::memcpy(out, u, 16);
}

// ---------------------------------------------------------------- exact dequantization

// A Q4_K or Q5_K super-block from its parts: d, dmin, the unpacked scales and mins, the 128
// quant bytes (sub-blocks of 32: low then high nibbles of 32 bytes) and Q5_K's fifth bits.
void dequantize_k(float d, float dmin, const uint8_t* sm, const uint8_t* qs, const uint8_t* qh,
                  float* y) {
  for (int i = 0; i < 8; ++i) {
    const float d1 = d * (float)sm[i], m1 = dmin * (float)sm[8 + i];
    const uint8_t* q = qs + 32 * (i / 2);
    for (int l = 0; l < 32; ++l) {
      int v = (i % 2) ? (q[l] >> 4) : (q[l] & 0xF);
      if (qh) v |= ((qh[l] >> i) & 1) << 4;
      y[32 * i + l] = d1 * (float)v - m1;
    }
  }
}

void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case IQ4_NL:
    case IQ4_XS:
    case MXFP4: return table4_dequantize_block(type, b, y);
    case Q2_K:
    case Q3_K: return q23_k_dequantize_block(type, b, y);
    case IQ2_XXS:
    case IQ2_XS:
    case IQ2_S:
    case IQ3_XXS:
    case IQ3_S: return iq_grid_dequantize_block(type, b, y);
    case F16:
    case BF16: return f16_dequantize_block(type, b, y);
    case Q4_0: {
      const float d = fp16(b);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * (float)((int)(b[2 + l] & 0xF) - 8);
        y[l + 16] = d * (float)((int)(b[2 + l] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const float d = fp16(b), m = fp16(b + 2);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * (float)(b[4 + l] & 0xF) + m;
        y[l + 16] = d * (float)(b[4 + l] >> 4) + m;
      }
      return;
    }
    case Q5_0:
    case Q5_1: {  // bit j of the 32-bit qh is value j's fifth bit
      const bool q51 = type == Q5_1;
      const float d = fp16(b), m = q51 ? fp16(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (q51 ? 4 : 2), 4);
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int l = 0; l < 16; ++l) {
        const int lo = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
        const int hi = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        if (q51) {
          y[l] = d * (float)lo + m;
          y[l + 16] = d * (float)hi + m;
        } else {
          y[l] = d * (float)(lo - 16);
          y[l + 16] = d * (float)(hi - 16);
        }
      }
      return;
    }
    case Q8_0: {
      const float d = fp16(b);
      for (int l = 0; l < 32; ++l) y[l] = d * (float)(int8_t)b[2 + l];
      return;
    }
    case Q4_K:
    case Q5_K: {
      uint8_t sm[16];
      unpack_scales_k4(b + 4, sm);
      dequantize_k(fp16(b), fp16(b + 2), sm, b + (type == Q4_K ? 16 : 48),
                   type == Q5_K ? b + 16 : nullptr, y);
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      const float d = fp16(b + 208);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32) {
        for (int l = 0; l < 32; ++l) {
          const int q[4] = {
              ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32,
              ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32,
              ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32,
              ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32,
          };
          for (int g = 0; g < 4; ++g) {
            const int e = 128 * half + 32 * g + l;
            y[e] = (d * (float)sc[e / 16]) * (float)q[g];
          }
        }
      }
      return;
    }
  }
  TORCH_CHECK(false, "ggml type ", type, " is not supported by pagedserve's GGUF kernels");
}

void dequantize_row(int64_t type, const uint8_t* row, int64_t cols, float* y) {
  const Format f = format_of(type);
  for (int64_t b = 0; b < cols / f.block_values; ++b)
    dequantize_block(type, row + b * f.block_bytes, y + b * f.block_values);
}

// Row r (0-7) of a repacked group: each block's parts gathered back from the group first.
void dequantize_group_row(int64_t type, const uint8_t* group, int64_t r, int64_t cols,
                          float* y) {
  if (type == IQ4_NLx8 || type == IQ4_XSx8 || type == MXFP4x8)
    return table4_dequantize_group_row(type, group, r, cols, y);
  if (type == Q2_Kx8 || type == Q3_Kx8) return q23_k_dequantize_group_row(type, group, r, cols, y);
  if (type == Q8_0x8) {
    uint8_t block[34];
    for (int64_t b = 0; b < cols / QK; ++b) {
      const uint8_t* column = group + b * 34 * kGroupRows;
      std::memcpy(block, column + 2 * r, 2);
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) block[2 + 4 * j + k] = column[16 + 32 * j + 4 * r + k] ^ 0x80;
      dequantize_block(Q8_0, block, y + b * QK);
    }
    return;
  }
  if (type == Q4_0x8 || type == Q4_1x8 || type == Q5_0x8 || type == Q5_1x8) {
    // The file's block back from the column: d, m (Q4_1, Q5_1), the fifth bits qh (Q5_0,
    // Q5_1), then the 16 quant bytes (see Q4_0x8, Q5_0x8 and Q4_1x8 for where each sits).
    const bool min = type == Q4_1x8 || type == Q5_1x8, five = type == Q5_0x8 || type == Q5_1x8;
    const int64_t file_type = type - 1000, bytes = format_of(file_type).block_bytes;
    const int64_t quants = min ? 32 : 16, qh_at = min ? 4 : 2, qs_at = qh_at + (five ? 4 : 0);
    uint8_t block[24];
    for (int64_t b = 0; b < cols / QK; ++b) {
      const uint8_t* column = group + b * bytes * kGroupRows;
      std::memcpy(block, column + 2 * r, 2);
      if (min) std::memcpy(block + 2, column + 16 + 2 * r, 2);
      if (five) {
        const uint8_t* fifth = column + quants + 128 + 4 * r;
        uint32_t qh = 0;
        for (int v = 0; v < 32; ++v) {
          const FifthBitPlace p = fifth_bit_place(v);
          qh |= (uint32_t)((fifth[p.k] >> p.j) & 1) << v;
        }
        std::memcpy(block + qh_at, &qh, 4);
      }
      for (int j = 0; j < 4; ++j)
        std::memcpy(block + qs_at + 4 * j, column + quants + 32 * j + 4 * r, 4);
      dequantize_block(file_type, block, y + b * QK);
    }
    return;
  }
  if (type == Q6_Kx8) {
    uint8_t block[210];
    for (int64_t b = 0; b < cols / QKK; ++b) {
      const uint8_t* column = group + b * kQ6KColumn;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* half = column + 144 + 768 * h;
        for (int k = 0; k < 16; ++k) std::memcpy(block + 64 * h + 4 * k, half + 32 * k + 4 * r, 4);
        for (int k = 0; k < 8; ++k)
          std::memcpy(block + 128 + 32 * h + 4 * k, half + 512 + 32 * k + 4 * r, 4);
      }
      for (int i = 0; i < 16; ++i) block[192 + i] = column[16 + 8 * i + r];
      std::memcpy(block + 208, column + 2 * r, 2);
      dequantize_block(Q6_K, block, y + b * QKK);
    }
    return;
  }
  uint8_t sm[16], qs[128];
  for (int64_t b = 0; b < cols / QKK; ++b) {  // Q4_Kx8
    const uint8_t* column = group + b * kQ4KColumn;
    for (int i = 0; i < 8; ++i) {
      sm[i] = column[32 + 8 * i + r];
      sm[8 + i] = column[96 + 16 * (i / 2) + 2 * r + i % 2];
    }
    for (int k = 0; k < 32; ++k) std::memcpy(qs + 4 * k, column + 160 + 32 * k + 4 * r, 4);
    dequantize_k(fp16(column + 2 * r), fp16(column + 16 + 2 * r), sm, qs, nullptr, y + b * QKK);
  }
}

void check_blocks(const torch::Tensor& w, int64_t type, int64_t cols) {
  const Format f = format_of(type);
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2, "ggml blocks must be uint8 [rows, bytes]");
  TORCH_CHECK(w.stride(1) == 1, "ggml block rows must be contiguous");
  TORCH_CHECK(cols % f.block_values == 0 && w.size(1) == cols / f.block_values * f.block_bytes,
              "a row of ", cols, " values of ggml type ", type, " takes ",
              cols / f.block_values * f.block_bytes, " bytes, not ", w.size(1));
}

// ---------------------------------------------------------------- int8 activations
//
// Two layouts, as in llama.cpp: per 32 values for the 32-value formats (Q4_0, Q4_1, Q8_0),
// per 256 for the K-quants, whose integer sums then run over a whole super-block with one
// float multiply at its end.

inline float load_value(const float* x, int64_t i) { return x[i]; }
inline float load_value(const at::BFloat16* x, int64_t i) { return (float)x[i]; }

// q = round(x / d) with d = amax / 127 over n values; returns d.
template <typename T>
float quantize_values(const T* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t l = 0; l < n; ++l) amax = std::max(amax, std::fabs(load_value(x, l)));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t l = 0; l < n; ++l) q[l] = (int8_t)std::nearbyint(load_value(x, l) * id);
  return amax / 127.f;
}

template <typename T>
void quantize_row(const T* x, int64_t K, XBlock* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    XBlock& o = out[b];
    o.d = quantize_values(x + b * QK, QK, o.q);
    int s = 0;
    for (int l = 0; l < 32; ++l) s += o.q[l];
    o.qsum = s;
    o.dsum = o.d * (float)s;
  }
}

template <typename T>
void quantize_row(const T* x, int64_t K, XBlockK* out) {
  for (int64_t b = 0; b < K / QKK; ++b) {
    XBlockK& o = out[b];
    o.d = quantize_values(x + b * QKK, QKK, o.q);
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += o.q[16 * j + l];
      o.bsums[j] = (int16_t)s;
    }
    for (int j = 0; j < 8; ++j) o.sums32[j] = (int16_t)(o.bsums[2 * j] + o.bsums[2 * j + 1]);
  }
}

// ---------------------------------------------------------------- block dot products
//
// Each format's `dot<MT>` adds one weight block's products with MT activation rows into
// acc[m] (8 float lanes, summed at the row's end) and off[m] (the scalar offset terms).
// xs[m] points at row m's activation block(s) under this weight block.

// A 32-value block's two float factors for one activation block, in vector lanes so no
// scalar work chains block to block: lane 0 scales the integer dot product (d_w * d_x),
// lane 1 is the block's offset term (its min, or -offset * d_w, times d_x * sum of q_x),
// which `off` collects. `dm`: the weight's f16 d in lane 0 and f16 m (or d) in lane 1.
inline void add_block(__m256& acc, __m128& off, __m256i p, __m128 dm, const XBlock* x) {
  const __m128 s = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double*)&x->d)));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(s), acc);
  off = _mm_add_ps(off, s);
}
inline __m128 f16_dm(const uint8_t* w) {  // [d, m]: a block's first two f16
  uint32_t dm;
  std::memcpy(&dm, w, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
}
inline __m128 f16_scaled(const uint8_t* w, __m128 factors) {  // [d, d] * factors
  uint16_t h;
  std::memcpy(&h, w, 2);
  return _mm_mul_ps(_mm_cvtph_ps(_mm_set1_epi16((short)h)), factors);
}

struct BlockQ4_0 {  // (q - 8) * d
  using X = XBlock;
  static constexpr int64_t values = 32;
  static constexpr int64_t bytes = 18;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128* off) {
    const __m128 dm = f16_scaled(w, _mm_setr_ps(1.f, -8.f, 0.f, 0.f));
    const __m256i u = nibbles(w + 2);
    for (int m = 0; m < MT; ++m) add_block(acc[m], off[m], dot_us(u, load32(xs[m]->q)), dm, xs[m]);
  }
};

struct BlockQ4_1 {  // q * d + m
  using X = XBlock;
  static constexpr int64_t values = 32;
  static constexpr int64_t bytes = 20;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128* off) {
    const __m128 dm = f16_dm(w);
    const __m256i u = nibbles(w + 4);
    for (int m = 0; m < MT; ++m) add_block(acc[m], off[m], dot_us(u, load32(xs[m]->q)), dm, xs[m]);
  }
};

// Q5_0/Q5_1's 32 fifth bits, as 0x10 in each value's byte.
inline __m256i fifth_bits(const uint8_t* qh4) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte j <- byte j / 8 of qh
      _mm256_set1_epi32((int)qh),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

template <bool Q51>
struct BlockQ5 {  // Q5_0: (q - 16) * d; Q5_1: q * d + m
  using X = XBlock;
  static constexpr int64_t values = 32;
  static constexpr int64_t bytes = Q51 ? 24 : 22;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128* off) {
    const __m128 dm = Q51 ? f16_dm(w) : f16_scaled(w, _mm_setr_ps(1.f, -16.f, 0.f, 0.f));
    const __m256i u = _mm256_or_si256(nibbles(w + (Q51 ? 8 : 6)), fifth_bits(w + (Q51 ? 4 : 2)));
    for (int m = 0; m < MT; ++m) add_block(acc[m], off[m], dot_us(u, load32(xs[m]->q)), dm, xs[m]);
  }
};

struct BlockQ8_0 {
  using X = XBlock;
  static constexpr int64_t values = 32;
  static constexpr int64_t bytes = 34;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const float d = fp16(w);
    const __m256i q = load32(w + 2);
    const __m256i aq = _mm256_sign_epi8(q, q);  // |q|, and x takes q's sign
    for (int m = 0; m < MT; ++m)
      add(acc[m], dot_us(aq, _mm256_sign_epi8(load32(xs[m]->q), q)), d * xs[m]->d);
  }
};


template <bool Q5>
struct BlockQxK {  // Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins
  using X = XBlockK;
  static constexpr int64_t values = 256;
  static constexpr int64_t bytes = Q5 ? 176 : 144;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const float d = fp16(w), dmin = fp16(w + 2);
    uint8_t sm[16];
    unpack_scales_k4(w + 4, sm);
    // 16 int16: the 8 scales, then the 8 mins (for all rows at once, against sums32).
    const __m256i scales_mins = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)sm));
    const __m256i scales = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x00);
    const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
    const uint8_t* qs = w + (Q5 ? 48 : 16);
    const __m256i low = _mm256_set1_epi8(0xF);
    __m256i qh = _mm256_setzero_si256();
    if (Q5) qh = load32(w + 16);
    __m256i sum[MT];
    for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(qs + 32 * j);
      __m256i u[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * j + h;
        if (Q5) {  // bit i of each qh byte, moved to 0x10
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, i), _mm256_set1_epi8(1));
          u[h] = _mm256_or_si256(u[h], _mm256_slli_epi16(bit, 4));
        }
        const __m256i scale = _mm256_shuffle_epi8(scales, mask(kBroadcast16[i]));
        for (int m = 0; m < MT; ++m) {
          const __m256i p = _mm256_maddubs_epi16(u[h], load32(xs[m]->q + 32 * i));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m128i mp = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)xs[m]->sums32));
      add(acc[m], sum[m], d * xs[m]->d);
      add(acc[m], _mm256_zextsi128_si256(mp), -dmin * xs[m]->d);
    }
  }
};

struct BlockQ6_K {  // 16 sub-blocks of 16 with int8 scales; q in 0..63, minus 32
  using X = XBlockK;
  static constexpr int64_t values = 256;
  static constexpr int64_t bytes = 210;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const float d = fp16(w + 208);
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192)));
    const __m256i sc_half[2] = {_mm256_permute2x128_si256(sc, sc, 0x00),
                                _mm256_permute2x128_si256(sc, sc, 0x11)};
    const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
    __m256i sum[MT];
    for (int m = 0; m < MT; ++m)  // the -32 offset: 32 * sum of scale * (sum of its 16 x)
      sum[m] = _mm256_slli_epi32(
          _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i*)xs[m]->bsums)), 5);
    for (int m = 0; m < MT; ++m) sum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), sum[m]);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = w + 64 * half;
      const __m256i a = load32(ql), b = load32(ql + 32), hb = load32(w + 128 + 32 * half);
      const __m256i lo4[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low),
                              _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
      for (int g = 0; g < 4; ++g) {
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), two);
        const __m256i u = _mm256_or_si256(lo4[g], _mm256_slli_epi16(hi, 4));
        const int i = 4 * half + g;  // the 32-value group: scales 2i and 2i + 1
        const __m256i scale = _mm256_shuffle_epi8(sc_half[half], mask(kPair16[g]));
        for (int m = 0; m < MT; ++m) {
          const __m256i p = _mm256_maddubs_epi16(u, load32(xs[m]->q + 32 * i));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int m = 0; m < MT; ++m) add(acc[m], sum[m], d * xs[m]->d);
  }
};

// Repacked Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 (see Q4_0x8, Q4_1x8, Q5_0x8, Q8_0x8): MT activation
// rows against weight rows [n0, n1), 8 at a time. u[j] holds 4 values of each row, the ones
// activation bytes `x_at<L>(j)` multiply: Q8_0's stored bytes as they are; Q4_0's low
// nibbles (values 4j..4j+3) for j < 4, high nibbles (16 + 4j..) after; Q5_0's the same with
// their fifth bits; Q4_1 and Q5_1 as Q4_0 and Q5_0, and each row's min times the activation
// block's sum added after the block's product.
enum class Legacy { Q4, Q5, Q8, Q4_1, Q5_1 };
template <Legacy L>
constexpr bool has_min() {  // Q4_1, Q5_1: q * d + m, the mins at 16 of a column
  return L == Legacy::Q4_1 || L == Legacy::Q5_1;
}
template <Legacy L>
constexpr bool five_bits() {
  return L == Legacy::Q5 || L == Legacy::Q5_1;
}
template <Legacy L>
constexpr int64_t column_bytes() {  // per block column of a group
  return (L == Legacy::Q8 ? 34 : 18 + (has_min<L>() ? 2 : 0) + (five_bits<L>() ? 4 : 0)) *
         kGroupRows;
}
template <Legacy L>
constexpr int64_t quants_at() {  // where a column's quant bytes start
  return has_min<L>() ? 32 : 16;
}
template <Legacy L>
constexpr int x_at(int j) {
  return L == Legacy::Q8 || j < 4 ? 4 * j : 16 + 4 * (j - 4);
}
template <Legacy L>
constexpr int32_t x_offset() {  // the stored values' offset: Q4_0's 8, Q5_0's 16, Q8_0's 128
  return L == Legacy::Q8 ? 128 : L == Legacy::Q5 ? 16 : L == Legacy::Q4 ? 8 : 0;
}
// Q5_0x8's fifth bits for u[j], at 0x10 of each byte (see Q5_0x8): bit j moved to bit 4.
// 16-bit shifts by at most 4 keep bit 4 of each byte within its own byte.
inline __m256i fifth_bits_of(__m256i h, int j) {
  const __m256i moved = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// Without VNNI the integer dot is maddubs, whose int16 pair sums saturate: Q8_0's bytes
// stored plus 128 reach 2 * 255 * 127. There they are taken back to signed values and
// multiplied by the sign trick (|q| . sign(x, q)), whose pairs stay within 2 * 128 * 127.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kSignedQ8 = false;
#else
constexpr bool kSignedQ8 = true;
#endif

template <Legacy L, int MT, typename Out>
void groups_dot_legacy(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                       const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  constexpr bool Q8 = L == Legacy::Q8;
  const int64_t blocks = K / QK, column = column_bytes<L>();
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const uint8_t* group = w + (n / kGroupRows) * group_bytes;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c = group + b * column;
      for (int64_t k = 0; k < column; k += 64)
        _mm_prefetch((const char*)(c + 4 * column + k), _MM_HINT_T0);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
      const __m256 mins = has_min<L>() ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16)))
                                       : _mm256_setzero_ps();
      constexpr bool signed_q = Q8 && kSignedQ8;
      __m256i u[8];  // signed_q: the values' magnitudes, with their signs in q[]
      __m256i q[signed_q ? 8 : 1];
      for (int j = 0; j < (Q8 ? 8 : 4); ++j) {
        const __m256i v = load32(c + quants_at<L>() + 32 * j);
        if constexpr (signed_q) {
          q[j] = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
          u[j] = _mm256_abs_epi8(q[j]);
        } else if (Q8) {
          u[j] = v;
        } else {
          u[j] = _mm256_and_si256(v, low);
          u[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      if constexpr (five_bits<L>()) {
        const __m256i h = load32(c + quants_at<L>() + 128);
        for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], fifth_bits_of(h, j));
      }
      for (int m = 0; m < MT; ++m) {
        const XBlock* xb = x + m * xstride + b;
        __m256i sum;
        if constexpr (signed_q) {
          sum = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j)
            sum = _mm256_add_epi32(sum, dot_us(u[j], _mm256_sign_epi8(broadcast4(xb->q + 4 * j), q[j])));
        } else if constexpr (kVNNI) {
          sum = _mm256_set1_epi32(-x_offset<L>() * xb->qsum);  // (q - o) . x
          for (int j = 0; j < 8; ++j) sum = dot4_add(sum, u[j], broadcast4(xb->q + x_at<L>(j)));
        } else {  // Q4 and Q5 (Q8 is signed_q here): int16 sums of 8 and 4 (see dot4_16)
          constexpr int fit = five_bits<L>() ? 4 : 8;
          sum = _mm256_set1_epi32(-x_offset<L>() * xb->qsum);
          for (int j0 = 0; j0 < 8; j0 += fit) {
            __m256i s16 = dot4_16(u[j0], broadcast4(xb->q + x_at<L>(j0)));
            for (int j = j0 + 1; j < j0 + fit; ++j)
              s16 = dot4_16_add(s16, u[j], broadcast4(xb->q + x_at<L>(j)));
            sum = widen_add(sum, s16);
          }
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                 _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[m]);
        if constexpr (has_min<L>()) acc[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xb->dsum), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + n, acc[m]);
  }
}

// Repacked Q4_K (see Q4_Kx8), as groups_dot_legacy: one int32 sum per row and sub-block from
// integer dots, times the row's scale for that sub-block (an int32 multiply per 8 rows),
// summed over the super-block; the mins against the activations' sums of 32 by int16
// multiply-adds; two float multiplies per super-block for 8 rows.
template <int MT, typename Out>
void groups_dot_q4_k(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                     const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  const int64_t blocks = K / QKK;
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const uint8_t* group = w + (n / kGroupRows) * group_bytes;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c = group + b * kQ4KColumn;
      const uint8_t* qs = c + 160;
      __m256i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {  // chunk j: sub-blocks 2j (low nibbles), 2j + 1 (high)
        // The column after next, every line of it (every other line: 1.24x slower).
        for (int k = 0; k < 256; k += 64)
          _mm_prefetch((const char*)(qs + 2 * kQ4KColumn + 256 * j + k), _MM_HINT_T0);
        // VNNI: int32 sums; else int16 pair sums (8 of 4-bit values fit, see dot4_16)
        __m256i lo_sum[MT], hi_sum[MT];
        for (int m = 0; m < MT; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
        auto add_lane = [&](int t) {
          const __m256i v = load32(qs + 32 * (8 * j + t));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = x[m * xstride + b].q + 64 * j + 4 * t;
            if constexpr (kVNNI) {
              lo_sum[m] = dot4_add(lo_sum[m], lo, broadcast4(xq));
              hi_sum[m] = dot4_add(hi_sum[m], hi, broadcast4(xq + 32));
            } else {
              lo_sum[m] = dot4_16_add(lo_sum[m], lo, broadcast4(xq));
              hi_sum[m] = dot4_16_add(hi_sum[m], hi, broadcast4(xq + 32));
            }
          }
        };
        if constexpr (MT >= 3) {
          // Unrolled, GCC reorders the int16 adds into a tree and spills every product
          // to the stack at 3-4 rows (1.2x slower); rolled, the sums stay in registers.
#pragma GCC unroll 1
          for (int t = 0; t < 8; ++t) add_lane(t);
        } else {
          for (int t = 0; t < 8; ++t) add_lane(t);
        }
        const __m256i sc_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(c + 32 + 16 * j)));
        const __m256i sc_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(c + 40 + 16 * j)));
        if constexpr (kVNNI) {
          for (int m = 0; m < MT; ++m)
            isum[m] = _mm256_add_epi32(isum[m],
                                       _mm256_add_epi32(_mm256_mullo_epi32(lo_sum[m], sc_lo),
                                                        _mm256_mullo_epi32(hi_sum[m], sc_hi)));
        } else {  // the 6-bit scales times the pair sums, widened by the same madd
          const __m256i sc_lo2 = both_halves(sc_lo), sc_hi2 = both_halves(sc_hi);
          for (int m = 0; m < MT; ++m)
            isum[m] = _mm256_add_epi32(isum[m],
                                       _mm256_add_epi32(_mm256_madd_epi16(lo_sum[m], sc_lo2),
                                                        _mm256_madd_epi16(hi_sum[m], sc_hi2)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16)));
      __m256i mins[4];  // pair p: row r's (min 2p, min 2p + 1) as int16 in lane r
      for (int p = 0; p < 4; ++p)
        mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(c + 96 + 16 * p)));
      for (int m = 0; m < MT; ++m) {
        const XBlockK* xb = x + m * xstride + b;
        __m256i msum = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          int32_t pair;
          std::memcpy(&pair, xb->sums32 + 2 * p, 4);
          msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pair)));
        }
        const __m256 xd = _mm256_set1_ps(xb->d);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, xd), acc[m]);
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, xd), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + n, acc[m]);
  }
}

// Repacked Q6_K (see Q6_Kx8), as groups_dot_q4_k: the 6-bit values put together from the
// low and high bits of 8 rows at once, one int32 sum per row and sub-block of 16, less the
// -32 offset's 32 * (the activations' sum), times the row's int8 scale for that sub-block.
//
// Values g (0-3) of a column's 4-byte lane t: from its low-bit bytes a (values 0-31 of the
// half) and bq (32-63) and high-bit byte hb.
inline __m256i q6_values(int g, __m256i a, __m256i bq, __m256i hb) {
  const __m256i low = _mm256_set1_epi8(0xF), high = _mm256_set1_epi8(0x30);
  switch (g) {
    case 0: return _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high));
    case 1: return _mm256_or_si256(_mm256_and_si256(bq, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high));
    case 2: return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, high));
    default: return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(hb, 2), high));
  }
}

// One super-block column's integer sums per row (isum[m]) with VNNI: int32 dots per
// sub-block, less the offset, times the scale.
template <int MT>
inline void q6_k_sums_vnni(const uint8_t* c, const XBlockK* x, int64_t xstride, int64_t b,
                           __m256i* isum) {
  for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = c + 144 + 768 * h;
    const uint8_t* qh = ql + 512;
    for (int k = 0; k < 768; k += 64) _mm_prefetch((const char*)(ql + kQ6KColumn + k), _MM_HINT_T0);
    for (int th = 0; th < 2; ++th) {  // values 0-15 of each 32 (t < 4), then 16-31
      __m256i sum[4][MT];  // per group of 32 values g: sub-block 8 h + 2 g + th
      for (int g = 0; g < 4; ++g)
        for (int m = 0; m < MT; ++m) sum[g][m] = _mm256_setzero_si256();
      for (int t = 4 * th; t < 4 * th + 4; ++t) {
        const __m256i a = load32(ql + 32 * t), bq = load32(ql + 32 * (8 + t));
        const __m256i hb = load32(qh + 32 * t);
        const __m256i u[4] = {q6_values(0, a, bq, hb), q6_values(1, a, bq, hb),
                              q6_values(2, a, bq, hb), q6_values(3, a, bq, hb)};
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = x[m * xstride + b].q + 128 * h + 4 * t;
          for (int g = 0; g < 4; ++g) sum[g][m] = dot4_add(sum[g][m], u[g], broadcast4(xq + 32 * g));
        }
      }
      for (int g = 0; g < 4; ++g) {
        const int sub = 8 * h + 2 * g + th;
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 16 + 8 * sub)));
        for (int m = 0; m < MT; ++m) {
          const __m256i offset = _mm256_set1_epi32(32 * x[m * xstride + b].bsums[sub]);
          isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(_mm256_sub_epi32(sum[g][m], offset), sc));
        }
      }
    }
  }
}

// The same sums without VNNI (see dot4_16): two 6-bit dots summed as int16, then one madd
// by the sub-block's scale (in both halves of each lane) adds them into isum; the -32
// offsets, 32 * sum over sub-blocks of scale * the activations' sum, come off first, two
// sub-blocks per madd. The same integers as q6_k_sums_vnni.
template <int MT>
inline void q6_k_sums_avx2(const uint8_t* c, const XBlockK* x, int64_t xstride, int64_t b,
                           __m256i* isum) {
  alignas(32) __m256i scale[16];  // sub-block s's scales, each in both int16 halves of its lane
  for (int s = 0; s < 16; ++s)
    scale[s] = both_halves(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 16 + 8 * s))));
  for (int m = 0; m < MT; ++m) {
    const XBlockK* xb = x + m * xstride + b;
    __m256i offset = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {  // lane r: (scale 2p, scale 2p + 1) of row r as int16
      const __m128i pair = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(c + 16 + 16 * p)),
                                             _mm_loadl_epi64((const __m128i*)(c + 24 + 16 * p)));
      int32_t sums;
      std::memcpy(&sums, xb->bsums + 2 * p, 4);
      offset = _mm256_add_epi32(offset, _mm256_madd_epi16(_mm256_cvtepi8_epi16(pair), _mm256_set1_epi32(sums)));
    }
    isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = c + 144 + 768 * h;
    const uint8_t* qh = ql + 512;
    for (int k = 0; k < 768; k += 64) _mm_prefetch((const char*)(ql + kQ6KColumn + k), _MM_HINT_T0);
#pragma GCC unroll 1
    for (int t = 0; t < 8; t += 2) {  // lanes t and t + 1: one sub-block per g (th = t / 4)
      const __m256i a0 = load32(ql + 32 * t), b0 = load32(ql + 32 * (8 + t)), h0 = load32(qh + 32 * t);
      const __m256i a1 = load32(ql + 32 * (t + 1)), b1 = load32(ql + 32 * (9 + t)),
                    h1 = load32(qh + 32 * (t + 1));
      for (int g = 0; g < 4; ++g) {
        const __m256i u0 = q6_values(g, a0, b0, h0), u1 = q6_values(g, a1, b1, h1);
        const __m256i sc = scale[8 * h + 2 * g + t / 4];
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = x[m * xstride + b].q + 128 * h + 4 * t + 32 * g;
          const __m256i s16 = dot4_16_add(dot4_16(u0, broadcast4(xq)), u1, broadcast4(xq + 4));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(s16, sc));
        }
      }
    }
  }
}

template <int MT, typename Out>
void groups_dot_q6_k(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                     const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  const int64_t blocks = K / QKK;
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const uint8_t* group = w + (n / kGroupRows) * group_bytes;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c = group + b * kQ6KColumn;
      __m256i isum[MT];
      if constexpr (kVNNI)
        q6_k_sums_vnni<MT>(c, x, xstride, b, isum);
      else
        q6_k_sums_avx2<MT>(c, x, xstride, b, isum);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]),
                                 _mm256_mul_ps(d, _mm256_set1_ps(x[m * xstride + b].d)), acc[m]);
    }
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + n, acc[m]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Prefill and batched decode on AVX-512: two 8-row groups side by side in one 512-bit vector
// (lanes 0-7 the first group's rows, 8-15 the next's), so each integer dot product does 64
// multiply-adds and an 8-row activation tile takes 24 of the 32 vector registers. Same sums
// in the same order as groups_dot_q4_k per row, so the results are identical.
template <int MT, typename Out>
void pairs_dot_q4_k(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                    const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  const int64_t blocks = K / QKK;
  const __m512i low = _mm512_set1_epi8(0xF);
  int64_t n = n0;
  for (; n + 2 * kGroupRows <= n1; n += 2 * kGroupRows) {
    const uint8_t* g0 = w + (n / kGroupRows) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c0 = g0 + b * kQ4KColumn;
      const uint8_t* c1 = g1 + b * kQ4KColumn;
      prefetch_pair(c0, c1, kQ4KColumn);
      __m512i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {  // sub-block i: chunk i / 2's low (even i) or high nibbles
        const int64_t chunk = 160 + 256 * (i / 2);
        __m512i sum[MT];
        for (int m = 0; m < MT; ++m) sum[m] = _mm512_setzero_si512();
        for (int t = 0; t < 8; ++t) {
          const __m512i v = load_pair(c0 + chunk + 32 * t, c1 + chunk + 32 * t);
          const __m512i u = _mm512_and_si512(i % 2 ? _mm512_srli_epi16(v, 4) : v, low);
          for (int m = 0; m < MT; ++m) {
            int32_t q;
            std::memcpy(&q, x[m * xstride + b].q + 32 * i + 4 * t, 4);
            sum[m] = _mm512_dpbusd_epi32(sum[m], u, _mm512_set1_epi32(q));
          }
        }
        const __m512i sc = bytes_pair(c0 + 32 + 8 * i, c1 + 32 + 8 * i);
        for (int m = 0; m < MT; ++m)
          isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[m], sc));
      }
      const __m512 d = f16_pair(c0, c1), dmin = f16_pair(c0 + 16, c1 + 16);
      __m512i mins[4];  // pair p: row r's (min 2p, min 2p + 1) as int16 in lane r
      for (int p = 0; p < 4; ++p)
        mins[p] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(
            load_pair16(c0 + 96 + 16 * p, c1 + 96 + 16 * p)));
      for (int m = 0; m < MT; ++m) {
        const XBlockK* xb = x + m * xstride + b;
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
          int32_t pair;
          std::memcpy(&pair, xb->sums32 + 2 * p, 4);
          msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(pair)));
        }
        const __m512 xd = _mm512_set1_ps(xb->d);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, xd), acc[m]);
        acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, xd), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) store16(y + m * ldy + n, acc[m]);
  }
  if (n < n1) groups_dot_q4_k<MT>(w, group_bytes, n, n1, x, xstride, K, y, ldy);
}

template <int MT, typename Out>
void pairs_dot_q6_k(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                    const XBlockK* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  const int64_t blocks = K / QKK;
  const __m512i low = _mm512_set1_epi8(0xF), high = _mm512_set1_epi8(0x30);
  int64_t n = n0;
  for (; n + 2 * kGroupRows <= n1; n += 2 * kGroupRows) {
    const uint8_t* g0 = w + (n / kGroupRows) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c0 = g0 + b * kQ6KColumn;
      const uint8_t* c1 = g1 + b * kQ6KColumn;
      prefetch_pair(c0, c1, kQ6KColumn);
      __m512i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
      // Sub-block s16 = 8 h + 2 g + th: values 16 th..16 th + 15 of the h-th half's 32-value
      // group g, whose low 4 bits are ql's (second 32 bytes for odd g, high nibbles for
      // g >= 2) and high 2 bits qh's bits 2 g, 2 g + 1.
#pragma GCC unroll 16
      for (int s16 = 0; s16 < 16; ++s16) {
        const int h = s16 / 8, g = s16 % 8 / 2, th = s16 % 2;
        const int64_t ql = 144 + 768 * h + 256 * (g % 2), qh = 144 + 768 * h + 512;
        __m512i sum[MT];
        for (int m = 0; m < MT; ++m)  // the -32 offset, through the activations' sum
          sum[m] = _mm512_set1_epi32(-32 * x[m * xstride + b].bsums[s16]);
        for (int t = 4 * th; t < 4 * th + 4; ++t) {
          const __m512i a = load_pair(c0 + ql + 32 * t, c1 + ql + 32 * t);
          const __m512i hb = load_pair(c0 + qh + 32 * t, c1 + qh + 32 * t);
          const __m512i hi = g == 0   ? _mm512_slli_epi16(hb, 4)
                             : g == 1 ? _mm512_slli_epi16(hb, 2)
                             : g == 2 ? hb
                                      : _mm512_srli_epi16(hb, 2);
          const __m512i u =
              _mm512_or_si512(_mm512_and_si512(g < 2 ? a : _mm512_srli_epi16(a, 4), low),
                              _mm512_and_si512(hi, high));
          for (int m = 0; m < MT; ++m) {
            int32_t q;
            std::memcpy(&q, x[m * xstride + b].q + 128 * h + 32 * g + 4 * t, 4);
            sum[m] = _mm512_dpbusd_epi32(sum[m], u, _mm512_set1_epi32(q));
          }
        }
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
            _mm_loadl_epi64((const __m128i*)(c0 + 16 + 8 * s16)),
            _mm_loadl_epi64((const __m128i*)(c1 + 16 + 8 * s16))));
        for (int m = 0; m < MT; ++m)
          isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[m], sc));
      }
      const __m512 d = f16_pair(c0, c1);
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                                 _mm512_mul_ps(d, _mm512_set1_ps(x[m * xstride + b].d)), acc[m]);
    }
    for (int m = 0; m < MT; ++m) store16(y + m * ldy + n, acc[m]);
  }
  if (n < n1) groups_dot_q6_k<MT>(w, group_bytes, n, n1, x, xstride, K, y, ldy);
}

template <Legacy L, int MT, typename Out>
void pairs_dot_legacy(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                      const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  constexpr bool Q8 = L == Legacy::Q8;
  const int64_t blocks = K / QK, column = column_bytes<L>();
  const __m512i low = _mm512_set1_epi8(0xF);
  int64_t n = n0;
  for (; n + 2 * kGroupRows <= n1; n += 2 * kGroupRows) {
    const uint8_t* g0 = w + (n / kGroupRows) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* c0 = g0 + b * column;
      const uint8_t* c1 = g1 + b * column;
      prefetch_pair(c0, c1, column);
      const __m512 d = f16_pair(c0, c1);
      const __m512 mins = has_min<L>() ? f16_pair(c0 + 16, c1 + 16) : _mm512_setzero_ps();
      __m512i u[8];  // as groups_dot_legacy's
      for (int j = 0; j < (Q8 ? 8 : 4); ++j) {
        const __m512i v = load_pair(c0 + quants_at<L>() + 32 * j, c1 + quants_at<L>() + 32 * j);
        if (Q8) {
          u[j] = v;
        } else {
          u[j] = _mm512_and_si512(v, low);
          u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      }
      if constexpr (five_bits<L>()) {  // as groups_dot_legacy's fifth_bits_of
        const __m512i h = load_pair(c0 + quants_at<L>() + 128, c1 + quants_at<L>() + 128);
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int j = 0; j < 8; ++j) {
          const __m512i moved = j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
          u[j] = _mm512_or_si512(u[j], _mm512_and_si512(moved, bit4));
        }
      }
      for (int m = 0; m < MT; ++m) {
        const XBlock* xb = x + m * xstride + b;
        __m512i sum = _mm512_set1_epi32(-x_offset<L>() * xb->qsum);
        for (int j = 0; j < 8; ++j) {
          int32_t q;
          std::memcpy(&q, xb->q + x_at<L>(j), 4);
          sum = _mm512_dpbusd_epi32(sum, u[j], _mm512_set1_epi32(q));
        }
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                 _mm512_mul_ps(d, _mm512_set1_ps(xb->d)), acc[m]);
        if constexpr (has_min<L>()) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xb->dsum), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) store16(y + m * ldy + n, acc[m]);
  }
  if (n < n1) groups_dot_legacy<L, MT>(w, group_bytes, n, n1, x, xstride, K, y, ldy);
}
#endif

template <typename Out>
void group_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                int64_t K, Out* y, int64_t ldy) {
  const int64_t xstride = K / (s.type == Q4_Kx8 || s.type == Q6_Kx8 ? QKK : QK);
  int64_t m = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // Tiles of 4-8 rows by pairs of groups; under 4 rows (decode) 8 lanes wide is faster:
  // there the latency of each row's chain of dependent dot products shows.
  for (; M - m >= 4; m += 8) {
    Out* o = y + s.col0 + m * ldy;
    const XBlock* x = a.x32.data() + m * xstride;
    const XBlockK* xk = a.x256.data() + m * xstride;
#define PAIRS(MT)                                                                              \
  s.type == Q4_0x8   ? pairs_dot_legacy<Legacy::Q4, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q5_0x8 ? pairs_dot_legacy<Legacy::Q5, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q4_1x8 ? pairs_dot_legacy<Legacy::Q4_1, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q5_1x8 ? pairs_dot_legacy<Legacy::Q5_1, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q8_0x8 ? pairs_dot_legacy<Legacy::Q8, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q4_Kx8 ? pairs_dot_q4_k<MT>(s.w, s.row_bytes, n0, n1, xk, xstride, K, o, ldy)         \
                     : pairs_dot_q6_k<MT>(s.w, s.row_bytes, n0, n1, xk, xstride, K, o, ldy)
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
    const XBlock* x = a.x32.data() + m * xstride;
    const XBlockK* xk = a.x256.data() + m * xstride;
    Out* o = y + s.col0 + m * ldy;
#define GROUPS(MT)                                                                              \
  s.type == Q4_0x8   ? groups_dot_legacy<Legacy::Q4, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q5_0x8 ? groups_dot_legacy<Legacy::Q5, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q4_1x8 ? groups_dot_legacy<Legacy::Q4_1, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q5_1x8 ? groups_dot_legacy<Legacy::Q5_1, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q8_0x8 ? groups_dot_legacy<Legacy::Q8, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
  : s.type == Q4_Kx8 ? groups_dot_q4_k<MT>(s.w, s.row_bytes, n0, n1, xk, xstride, K, o, ldy)         \
                     : groups_dot_q6_k<MT>(s.w, s.row_bytes, n0, n1, xk, xstride, K, o, ldy)
    switch (std::min<int64_t>(kTile, M - m)) {
      case 1: GROUPS(1); break;
      case 2: GROUPS(2); break;
      case 3: GROUPS(3); break;
      default: GROUPS(4); break;
    }
#undef GROUPS
  }
}

template <typename Out>
void run_segment(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, Out* y, int64_t ldy) {
  switch (s.type) {
    case Q4_0x8:
    case Q4_1x8:
    case Q5_0x8:
    case Q5_1x8:
    case Q8_0x8:
    case Q4_Kx8:
    case Q6_Kx8: return group_rows(s, n0, n1, a, M, K, y, ldy);
    case IQ4_NL:
    case IQ4_XS:
    case IQ4_NLx8:
    case IQ4_XSx8:
    case MXFP4:
    case MXFP4x8: return table4_rows(s, n0, n1, a, M, K, y, ldy);
    case Q2_K:
    case Q3_K:
    case Q2_Kx8:
    case Q3_Kx8: return q23_k_rows(s, n0, n1, a, M, K, y, ldy);
    case IQ2_XXS:
    case IQ2_XS:
    case IQ2_S:
    case IQ3_XXS:
    case IQ3_S: return iq_grid_rows(s, n0, n1, a, M, K, y, ldy);
    case F16:
    case BF16: return f16_rows(s, n0, n1, a, M, K, y, ldy);
    case Q4_0: return segment_rows<BlockQ4_0>(s, n0, n1, a, M, K, y, ldy);
    case Q4_1: return segment_rows<BlockQ4_1>(s, n0, n1, a, M, K, y, ldy);
    case Q5_0: return segment_rows<BlockQ5<false>>(s, n0, n1, a, M, K, y, ldy);
    case Q5_1: return segment_rows<BlockQ5<true>>(s, n0, n1, a, M, K, y, ldy);
    case Q8_0: return segment_rows<BlockQ8_0>(s, n0, n1, a, M, K, y, ldy);
    case Q4_K: return segment_rows<BlockQxK<false>>(s, n0, n1, a, M, K, y, ldy);
    case Q5_K: return segment_rows<BlockQxK<true>>(s, n0, n1, a, M, K, y, ldy);
    case Q6_K: return segment_rows<BlockQ6_K>(s, n0, n1, a, M, K, y, ldy);
  }
}

template <typename T>
Activations quantize_activations(const torch::Tensor& x, bool x32, bool x256, bool xf) {
  const int64_t M = x.size(0), K = x.size(1);
  Activations a;
  if (x32) a.x32.resize(M * (K / QK));
  if (x256) a.x256.resize(M * (K / QKK));
  if (xf) a.xf.resize(M * K);
  const T* data = x.data_ptr<T>();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (x32) quantize_row(data + m * K, K, a.x32.data() + m * (K / QK));
      if (x256) quantize_row(data + m * K, K, a.x256.data() + m * (K / QKK));
      if (xf)
        for (int64_t k = 0; k < K; ++k) a.xf[m * K + k] = load_value(data + m * K, k);
    }
  });
  return a;
}

}  // namespace

// The [rows, cols] weights of ggml blocks (rows of `w`, or only rows `ids`), in float32,
// or into `out` (float32 or bf16, rounded to nearest even from the exact float32 values).
torch::Tensor ggml_dequantize(torch::Tensor w, int64_t type, int64_t cols,
                              c10::optional<torch::Tensor> ids, c10::optional<torch::Tensor> out) {
  check_blocks(w, type, cols);
  torch::Tensor rows = ids.has_value() ? ids->to(torch::kLong).contiguous()
                                       : torch::arange(rows_of(w, type), torch::kLong);
  const int64_t n = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < rows_of(w, type), "row ", r[i], " out of range");
  torch::Tensor y = out.has_value() ? *out : torch::empty({n, cols}, torch::kFloat);
  const bool bf16 = y.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(y.dim() == 2 && y.size(0) == n && y.size(1) == cols && y.is_contiguous() &&
                  (bf16 || y.scalar_type() == torch::kFloat),
              "out must be a contiguous [", n, ", ", cols, "] float32 or bfloat16 tensor");
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t stride = w.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(bf16 ? cols : 0);
    for (int64_t i = i0; i < i1; ++i) {
      float* dst = bf16 ? row.data() : y.data_ptr<float>() + i * cols;
      if (grouped(type))
        dequantize_group_row(type, base + r[i] / kGroupRows * stride, r[i] % kGroupRows, cols,
                             dst);
      else
        dequantize_row(type, base + r[i] * stride, cols, dst);
      if (!bf16) continue;
      at::BFloat16* out_row = y.data_ptr<at::BFloat16>() + i * cols;
      for (int64_t c = 0; c < cols; ++c) out_row[c] = at::BFloat16(row[c]);
    }
  });
  return y;
}

// y[M, sum of rows] = x[M, K] @ [W_0; W_1; ...]^T, x float32 or bf16, y in x's dtype (x
// quantized to int8 for the block formats, as float32 for F16 and BF16 weights).
namespace {

// One `ggml_linear` call made ready: its weights as segments, x quantized as they need,
// the output allocated; its tasks (runs of kRowsPerTask weight rows) may then run on any
// thread, in any order, each writing its own output columns.
struct LinearCall {
  std::vector<Segment> segs;
  Activations xq;
  torch::Tensor y;
  int64_t M, K, cols;
  bool bf16;

  void run(size_t seg, int64_t n0) const {
    const Segment& s = segs[seg];
    const int64_t n1 = std::min(s.rows, n0 + kRowsPerTask);
    if (bf16)
      run_segment(s, n0, n1, xq, M, K, y.data_ptr<at::BFloat16>(), cols);
    else
      run_segment(s, n0, n1, xq, M, K, y.data_ptr<float>(), cols);
  }
};

LinearCall prepare_linear(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                          const std::vector<int64_t>& types) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "one type per weight");
  x = x.contiguous();
  LinearCall call;
  call.M = x.size(0);
  call.K = x.size(1);
  TORCH_CHECK(call.K % QK == 0, "K must be a multiple of 32");
  call.cols = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_blocks(weights[i], types[i], call.K);
    const int64_t rows = rows_of(weights[i], types[i]);
    call.segs.push_back(
        {weights[i].data_ptr<uint8_t>(), rows, weights[i].stride(0), types[i], call.cols});
    call.cols += rows;
  }
  call.bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(call.bf16 || x.scalar_type() == torch::kFloat, "x must be float32 or bfloat16");
  bool x32 = false, x256 = false, xf = false;
  for (const Segment& seg : call.segs)
    (seg.type == F16 || seg.type == BF16 ? xf : k_activations(seg.type) ? x256 : x32) = true;
  call.xq = call.bf16 ? quantize_activations<at::BFloat16>(x, x32, x256, xf)
                      : quantize_activations<float>(x, x32, x256, xf);
  call.y = torch::empty({call.M, call.cols}, x.options());
  return call;
}

// Every task of every call, split between threads in one parallel region.
void run_calls(const std::vector<LinearCall>& calls) {
  std::vector<std::tuple<size_t, size_t, int64_t>> tasks;  // (call, segment, first row)
  for (size_t c = 0; c < calls.size(); ++c)
    for (size_t i = 0; i < calls[c].segs.size(); ++i)
      for (int64_t n = 0; n < calls[c].segs[i].rows; n += kRowsPerTask) tasks.push_back({c, i, n});
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto& [c, i, n] = tasks[t];
      calls[c].run(i, n);
    }
  });
}

}  // namespace

torch::Tensor ggml_linear(torch::Tensor x, std::vector<torch::Tensor> weights,
                          std::vector<int64_t> types) {
  std::vector<LinearCall> calls;
  calls.push_back(prepare_linear(std::move(x), weights, types));
  run_calls(calls);
  return calls[0].y;
}

// Why several at once: a mixture of experts' step multiplies each chosen expert's rows by
// its own weights, and at a few rows a call's fork and join cost as much as its arithmetic.
// Each output is the one `ggml_linear` gives (the same tasks; a row's sums never depend on
// which thread or call runs them).
std::vector<torch::Tensor> ggml_linears(const std::vector<torch::Tensor>& xs,
                                        const std::vector<std::vector<torch::Tensor>>& weights,
                                        const std::vector<std::vector<int64_t>>& types) {
  TORCH_CHECK(xs.size() == weights.size() && xs.size() == types.size(),
              "one weight list and type list per x");
  std::vector<LinearCall> calls;
  for (size_t c = 0; c < xs.size(); ++c) calls.push_back(prepare_linear(xs[c], weights[c], types[c]));
  run_calls(calls);
  std::vector<torch::Tensor> ys;
  for (LinearCall& call : calls) ys.push_back(std::move(call.y));
  return ys;
}

namespace {

// Q4_0, Q4_1, Q5_0 or Q5_1 (`L`) regrouped: d, m, quant bytes and fifth bits where
// Q4_0x8, Q4_1x8 and Q5_0x8 say.
template <Legacy L>
void repack_legacy(const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group, int64_t g) {
  constexpr int64_t column = column_bytes<L>(), bytes = column / kGroupRows;
  constexpr int64_t qh_at = has_min<L>() ? 4 : 2, qs_at = qh_at + (five_bits<L>() ? 4 : 0);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * column;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * bytes;
      std::memcpy(c + 2 * r, block, 2);
      if (has_min<L>()) std::memcpy(c + 16 + 2 * r, block + 2, 2);
      for (int j = 0; j < 4; ++j)
        std::memcpy(c + quants_at<L>() + 32 * j + 4 * r, block + qs_at + 4 * j, 4);
      if (!five_bits<L>()) continue;
      uint32_t qh;
      std::memcpy(&qh, block + qh_at, 4);
      uint8_t* fifth = c + quants_at<L>() + 128 + 4 * r;
      std::memset(fifth, 0, 4);
      for (int v = 0; v < 32; ++v) {
        const FifthBitPlace p = fifth_bit_place(v);
        fifth[p.k] |= (uint8_t)(((qh >> v) & 1) << p.j);
      }
    }
  }
}

void repack_q8_0(const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group, int64_t g) {
  constexpr int64_t column = 34 * kGroupRows;
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * column;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * 34;
      std::memcpy(c + 2 * r, block, 2);
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) c[16 + 32 * j + 4 * r + k] = block[2 + 4 * j + k] ^ 0x80;
    }
  }
}

void repack_q4_k(const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group, int64_t g) {
  uint8_t sm[16];
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * kQ4KColumn;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * 144;
      std::memcpy(c + 2 * r, block, 2);
      std::memcpy(c + 16 + 2 * r, block + 2, 2);
      unpack_scales_k4(block + 4, sm);
      for (int i = 0; i < 8; ++i) {
        c[32 + 8 * i + r] = sm[i];
        c[96 + 16 * (i / 2) + 2 * r + i % 2] = sm[8 + i];
      }
      for (int k = 0; k < 32; ++k) std::memcpy(c + 160 + 32 * k + 4 * r, block + 16 + 4 * k, 4);
    }
  }
}

void repack_q6_k(const uint8_t* src, int64_t stride, int64_t blocks, uint8_t* group, int64_t g) {
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * kQ6KColumn;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * 210;
      std::memcpy(c + 2 * r, block + 208, 2);
      for (int i = 0; i < 16; ++i) c[16 + 8 * i + r] = block[192 + i];
      for (int h = 0; h < 2; ++h) {
        uint8_t* half = c + 144 + 768 * h;
        for (int k = 0; k < 16; ++k) std::memcpy(half + 32 * k + 4 * r, block + 64 * h + 4 * k, 4);
        for (int k = 0; k < 8; ++k)
          std::memcpy(half + 512 + 32 * k + 4 * r, block + 128 + 32 * h + 4 * k, 4);
      }
    }
  }
}

}  // namespace

// A weight's blocks in the layout its kernel reads fastest, and that layout's type: Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K of a multiple of 8 rows regrouped (Q4_0x8, Q4_1x8,
// Q5_0x8, Q5_1x8, Q8_0x8, Q4_Kx8, Q6_Kx8); anything else as it is.
std::tuple<torch::Tensor, int64_t> ggml_repack(torch::Tensor w, int64_t type, int64_t cols) {
  check_blocks(w, type, cols);
  const bool regroups = type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 ||
                        type == Q8_0 || type == Q4_K || type == Q6_K || type == IQ4_NL ||
                        type == IQ4_XS || type == MXFP4 || type == Q2_K || type == Q3_K;
  if (!regroups || w.size(0) % kGroupRows) return {w, type};
  const int64_t grouped_type = 1000 + type;
  const Format f = format_of(grouped_type);
  const int64_t groups = w.size(0) / kGroupRows, blocks = cols / f.block_values;
  torch::Tensor out = torch::empty({groups, blocks * f.block_bytes}, torch::kUInt8);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t stride = w.stride(0), group_bytes = out.size(1);
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (type == IQ4_NL || type == IQ4_XS || type == MXFP4) {
        table4_repack(type, src, stride, blocks, dst + g * group_bytes, g);
        continue;
      }
      if (type == Q2_K || type == Q3_K) {
        q23_k_repack(type, src, stride, blocks, dst + g * group_bytes, g);
        continue;
      }
      (type == Q4_0   ? repack_legacy<Legacy::Q4>
       : type == Q4_1 ? repack_legacy<Legacy::Q4_1>
       : type == Q5_0 ? repack_legacy<Legacy::Q5>
       : type == Q5_1 ? repack_legacy<Legacy::Q5_1>
       : type == Q8_0 ? repack_q8_0
       : type == Q4_K ? repack_q4_k
                      : repack_q6_k)(src, stride, blocks, dst + g * group_bytes, g);
    }
  });
  return {out, grouped_type};
}
