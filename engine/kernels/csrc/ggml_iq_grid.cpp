// The i-quants whose values come 8 (or 4) at a time from a grid, with sign bits: IQ2_XXS,
// IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (the IQ2_*/IQ3_* files), served from their blocks.
//
// Each holds 256 values in 8 sub-blocks of 32, after an f16 d (ggml-common.h's block_iq*):
// * IQ2_XXS (66 bytes): per sub-block 8 bytes, four grid indices (8 values each, into
//   iq2xxs_grid) then a uint32 of four 7-bit sign indices and a 4-bit scale s (bits 28-31):
//   value = d * (0.5 + s) / 4 * grid * sign.
// * IQ2_XS (74 bytes): 32 uint16 (a 9-bit index into iq2xs_grid, a 7-bit sign index), then 8
//   scale bytes (low nibble the sub-block's first 16 values, high its last 16): as IQ2_XXS.
// * IQ2_S (82 bytes): 32 index bytes, 32 sign bytes (one bit a value), 8 bytes of the indices'
//   2 high bits (iq2s_grid has 1024 entries), 8 scale bytes as IQ2_XS's.
// * IQ3_XXS (98 bytes): 64 index bytes (4 values each, iq3xxs_grid), then per sub-block a
//   uint32 of four sign indices and a scale as IQ2_XXS's: value = d * (0.5 + s) / 2 * grid * sign.
// * IQ3_S (110 bytes): 64 index bytes, 8 bytes of their ninth bits (iq3s_grid: 512), 32 sign
//   bytes, 4 scale bytes (a nibble a sub-block): value = d * (1 + 2 s) * grid * sign.
// A 7-bit sign index is a byte of sign bits whose eighth makes their count even (ggml's
// ksigns_iq2xs).
//
// Products as llama.cpp's (ggml_vec_dot_iq2_xxs_q8_K etc.): 256-value int8 activation blocks
// (XBlockK); per sub-block the grid values (non-negative, at most 62) gathered into a vector
// from the table, the weights' signs applied to the activations (`_mm256_sign_epi8`; they are
// never -128), `maddubs` (pairs within 2 x 62 x 127, no saturation) and one `madd` by the
// sub-block's integer scale (2 s + 1: the format's factor times 8, 4 or 1), summed over the
// super-block with one float multiply at its end. AVX512-VNNI would not help here: a
// sub-block's scale still takes a multiply after `vpdpbusd`, as many as maddubs and madd.
// Rows in the file's layout only (rows_dot, ggml_common.h): llama.cpp does not regroup these.
#include <ATen/Parallel.h>

#include "ggml_common.h"
#include "iq_grids.h"

namespace pagedserve_ggml {
namespace {

// ggml's ksigns_iq2xs as 8 bytes of +1 / -1 (for _mm256_sign_epi8): entry i's byte j is -1
// where bit j of i, plus a parity bit 7, is set (llama.cpp's keven_signs_q2xs).
struct SignTable {
  uint64_t v[128];
  constexpr SignTable() : v{} {
    for (int i = 0; i < 128; ++i) {
      int bits = i, ones = 0;
      for (int j = 0; j < 7; ++j) ones += (i >> j) & 1;
      bits |= (ones & 1) << 7;
      uint64_t e = 0;
      for (int j = 0; j < 8; ++j) e |= (uint64_t)(((bits >> j) & 1) ? 0xFF : 0x01) << (8 * j);
      v[i] = e;
    }
  }
};
constexpr SignTable kSigns;

inline uint8_t sign_byte(uint32_t index) {  // ksigns_iq2xs[index]
  return (uint8_t)((index & 127) | ((__builtin_popcount(index & 127) & 1) << 7));
}
inline float sign_of(uint8_t bits, int j) { return (bits >> j) & 1 ? -1.f : 1.f; }

// Four entries of the sign table for four 7-bit indices (bits 0, 7, 14, 21 of `packed`).
inline __m256i signs_of_indices(uint32_t packed) {
  return _mm256_set_epi64x((int64_t)kSigns.v[(packed >> 21) & 127], (int64_t)kSigns.v[(packed >> 14) & 127],
                           (int64_t)kSigns.v[(packed >> 7) & 127], (int64_t)kSigns.v[packed & 127]);
}

// 32 sign bits (value k's at bit k % 8 of byte k / 8) as +1 / -1 bytes.
alignas(32) constexpr int8_t kByteOf8[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
inline __m256i signs_of_bits(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), mask(kByteOf8));
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(set, _mm256_set1_epi8(1));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IQ2_XS's and IQ2_S's 8 scale bytes as 2 s + 1, int16 (sub-block b's first-16 scale at 2 b,
// last-16 at 2 b + 1), for one madd per sub-block: its two in the low and high 128 bits.
struct NibbleScales {
  __m256i half[2];
  explicit NibbleScales(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)p), nib = _mm_set1_epi8(0xF);
    const __m128i s = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    const __m256i s16 = _mm256_cvtepu8_epi16(_mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1)));
    half[0] = _mm256_permute2x128_si256(s16, s16, 0x00);
    half[1] = _mm256_permute2x128_si256(s16, s16, 0x11);
  }
  __m256i of(int b) const { return _mm256_shuffle_epi8(half[b / 4], mask(kPair16[b % 4])); }
};

inline __m256i odd_scale(uint32_t s) { return _mm256_set1_epi16((short)(2 * s + 1)); }

// Each format: `factor` (d's multiplier over the integer scale 2 s + 1), and per sub-block
// `sub(b, u, s, scale)`: its 32 grid values (unsigned), signs (+1 / -1) and int16 scales.
struct IQ2XXS {
  static constexpr int64_t bytes = 66;
  static constexpr float factor = 0.125f;
  const uint8_t* w;
  explicit IQ2XXS(const uint8_t* w) : w(w) {}
  void sub(int b, __m256i& u, __m256i& s, __m256i& scale) const {
    const uint8_t* q = w + 2 + 8 * b;
    const uint32_t aux = u32_at(q + 4);
    u = _mm256_set_epi64x((int64_t)iq2xxs_grid[q[3]], (int64_t)iq2xxs_grid[q[2]],
                          (int64_t)iq2xxs_grid[q[1]], (int64_t)iq2xxs_grid[q[0]]);
    s = signs_of_indices(aux);
    scale = odd_scale(aux >> 28);
  }
};

struct IQ2XS {
  static constexpr int64_t bytes = 74;
  static constexpr float factor = 0.125f;
  const uint8_t* w;
  NibbleScales scales;
  explicit IQ2XS(const uint8_t* w) : w(w), scales(w + 66) {}
  void sub(int b, __m256i& u, __m256i& s, __m256i& scale) const {
    const uint8_t* q = w + 2 + 8 * b;
    const uint16_t v0 = u16_at(q), v1 = u16_at(q + 2), v2 = u16_at(q + 4), v3 = u16_at(q + 6);
    u = _mm256_set_epi64x((int64_t)iq2xs_grid[v3 & 511], (int64_t)iq2xs_grid[v2 & 511],
                          (int64_t)iq2xs_grid[v1 & 511], (int64_t)iq2xs_grid[v0 & 511]);
    s = _mm256_set_epi64x((int64_t)kSigns.v[v3 >> 9], (int64_t)kSigns.v[v2 >> 9],
                          (int64_t)kSigns.v[v1 >> 9], (int64_t)kSigns.v[v0 >> 9]);
    scale = scales.of(b);
  }
};

struct IQ2S {
  static constexpr int64_t bytes = 82;
  static constexpr float factor = 0.125f;
  const uint8_t* w;
  NibbleScales scales;
  explicit IQ2S(const uint8_t* w) : w(w), scales(w + 74) {}
  void sub(int b, __m256i& u, __m256i& s, __m256i& scale) const {
    const uint8_t* q = w + 2 + 4 * b;
    const uint32_t h = w[66 + b];
    u = _mm256_set_epi64x((int64_t)iq2s_grid[q[3] | ((h << 2) & 0x300)],
                          (int64_t)iq2s_grid[q[2] | ((h << 4) & 0x300)],
                          (int64_t)iq2s_grid[q[1] | ((h << 6) & 0x300)],
                          (int64_t)iq2s_grid[q[0] | ((h << 8) & 0x300)]);
    s = signs_of_bits(w + 34 + 4 * b);
    scale = scales.of(b);
  }
};

struct IQ3XXS {
  static constexpr int64_t bytes = 98;
  static constexpr float factor = 0.25f;
  const uint8_t* w;
  explicit IQ3XXS(const uint8_t* w) : w(w) {}
  void sub(int b, __m256i& u, __m256i& s, __m256i& scale) const {
    const uint8_t* q = w + 2 + 8 * b;
    const uint32_t aux = u32_at(w + 66 + 4 * b);
    u = _mm256_set_epi32((int)iq3xxs_grid[q[7]], (int)iq3xxs_grid[q[6]], (int)iq3xxs_grid[q[5]],
                         (int)iq3xxs_grid[q[4]], (int)iq3xxs_grid[q[3]], (int)iq3xxs_grid[q[2]],
                         (int)iq3xxs_grid[q[1]], (int)iq3xxs_grid[q[0]]);
    s = signs_of_indices(aux);
    scale = odd_scale(aux >> 28);
  }
};

struct IQ3S {
  static constexpr int64_t bytes = 110;
  static constexpr float factor = 1.f;
  const uint8_t* w;
  explicit IQ3S(const uint8_t* w) : w(w) {}
  void sub(int b, __m256i& u, __m256i& s, __m256i& scale) const {
    const uint8_t* q = w + 2 + 8 * b;
    const uint32_t h = w[66 + b];
#define G(k) (int)iq3s_grid[q[k] | ((h << (8 - k)) & 256)]
    u = _mm256_set_epi32(G(7), G(6), G(5), G(4), G(3), G(2), G(1), G(0));
#undef G
    s = signs_of_bits(w + 74 + 4 * b);
    scale = odd_scale((w[106 + b / 2] >> (4 * (b % 2))) & 0xF);
  }
};

template <typename F>
struct BlockIQ {
  using X = XBlockK;
  static constexpr int64_t values = 256;
  static constexpr int64_t bytes = F::bytes;
  template <int MT>
  static inline void dot(const uint8_t* w, const X* const* xs, __m256* acc, __m128*) {
    const F f(w);
    __m256i sum[MT];
    for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      __m256i u, s, scale;
      f.sub(b, u, s, scale);
      for (int m = 0; m < MT; ++m) {
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(load32(xs[m]->q + 32 * b), s));
        sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
      }
    }
    const float d = fp16(w) * F::factor;
    for (int m = 0; m < MT; ++m) add(acc[m], sum[m], d * xs[m]->d);
  }
};

// ---------------------------------------------------------------- prefill: rows expanded
// At a few activation rows the kernel above is bound by its decoding (a sub-block's table
// loads, inserts and sign lookups: several times its rows' dots at 4 rows). From
// kExpandRows a task's weight rows are decoded once per call instead, each block to its 256
// signed int8 values (grid * sign, within +-62), its sub-blocks' madd scales and d, and every
// tile of activation rows runs on them: per row and sub-block one xor, maddubs, madd and add.
// maddubs takes its unsigned side from the activations, x + 128 (1..255; x is never -128):
// pairs within 2 x 255 x 62 = 31,620, no saturation. That adds 128 x the weights' sums,
// which `corr` holds per block (the same madd by the scales), subtracted once per block and
// row. So each int32 lane holds exactly the integers BlockIQ::dot sums (the same 4 values
// of each sub-block times the same scale), and the float operations per row are rows_dot's
// (d * x.d, one fmadd a block into two sets alternating by block): the same bits either way.
constexpr int64_t kExpandRows = 8;  // activation rows from which a call expands its weights
constexpr int kExpandTile = 8;      // activation rows per pass over an expanded block (4: as fast)

struct alignas(32) Expanded {
  int8_t w[256];      // the values, grid * sign
  __m256i scale[8];   // sub-block b's int16 scales as madd takes them (BlockIQ's `scale`)
  __m256i corr;       // sum over b of madd(maddubs(128, w_b), scale_b)
  float d;            // fp16(d) * the format's factor
};

template <typename F>
void expand_block(const uint8_t* blk, Expanded* e) {
  const F f(blk);
  const __m256i bias = _mm256_set1_epi8((char)0x80);
  __m256i corr = _mm256_setzero_si256();
  for (int b = 0; b < 8; ++b) {
    __m256i u, s, scale;
    f.sub(b, u, s, scale);
    const __m256i v = _mm256_sign_epi8(u, s);
    _mm256_store_si256((__m256i*)(e->w + 32 * b), v);
    e->scale[b] = scale;
    corr = _mm256_add_epi32(corr, _mm256_madd_epi16(_mm256_maddubs_epi16(bias, v), scale));
  }
  e->corr = corr;
  e->d = fp16(blk) * F::factor;
}

// MT activation rows against `nrows` expanded rows. x + 128 made as it is loaded (one xor,
// which measured free: a copy of the tile's activations made once per task was no faster).
template <int MT, typename Out>
void expanded_dot(const Expanded* e, int64_t nrows, int64_t blocks, const XBlockK* x,
                  int64_t xstride, Out* y, int64_t ldy) {
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  for (int64_t n = 0; n < nrows; ++n, e += blocks) {
    __m256 acc[2][MT];
    for (int s = 0; s < 2; ++s)
      for (int m = 0; m < MT; ++m) acc[s][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
      const Expanded& blk = e[k];
      __m256i sum[MT];
      for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int b = 0; b < 8; ++b) {
        const __m256i v = _mm256_load_si256((const __m256i*)(blk.w + 32 * b));
        const __m256i scale = blk.scale[b];
        for (int m = 0; m < MT; ++m) {
          const __m256i xb = _mm256_xor_si256(load32(x[m * xstride + k].q + 32 * b), flip);
          const __m256i p = _mm256_maddubs_epi16(xb, v);
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        }
      }
      for (int m = 0; m < MT; ++m)
        add(acc[k % 2][m], _mm256_sub_epi32(sum[m], blk.corr), blk.d * x[m * xstride + k].d);
    }
    // rows_dot's sum: the two sets, then its offset term (zero here, still added: x + 0.f
    // is not x for x = -0.f)
    for (int m = 0; m < MT; ++m)
      y[m * ldy + n] = (Out)(hsum(_mm256_add_ps(acc[0][m], acc[1][m])) + 0.f);
  }
}

template <typename F, typename Out>
void expanded_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                   int64_t K, Out* y, int64_t ldy) {
  const int64_t blocks = K / 256, nrows = n1 - n0;
  thread_local std::vector<Expanded> rows;
  rows.resize(nrows * blocks);
  for (int64_t n = 0; n < nrows; ++n)
    for (int64_t k = 0; k < blocks; ++k)
      expand_block<F>(s.w + (n0 + n) * s.row_bytes + k * F::bytes, &rows[n * blocks + k]);
  Out* out = y + s.col0 + n0;
  for (int64_t m = 0; m < M;) {
    const int MT = (int)std::min<int64_t>(kExpandTile, M - m);
    const XBlockK* x = a.x256.data() + m * blocks;
    Out* o = out + m * ldy;
#define DOT(T) expanded_dot<T>(rows.data(), nrows, blocks, x, blocks, o, ldy)
    switch (MT) {
      case 1: DOT(1); break;
      case 2: DOT(2); break;
      case 3: DOT(3); break;
      case 4: DOT(4); break;
      case 5: DOT(5); break;
      case 6: DOT(6); break;
      case 7: DOT(7); break;
      default: DOT(8); break;
    }
#undef DOT
    m += MT;
  }
}

template <typename F, typename Out>
void grid_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
               int64_t K, Out* y, int64_t ldy) {
  if (M >= kExpandRows) return expanded_rows<F>(s, n0, n1, a, M, K, y, ldy);
  segment_rows<BlockIQ<F>>(s, n0, n1, a, M, K, y, ldy);
}

// ---------------------------------------------------------------- exact dequantization
// As ggml's dequantize_row_iq2_xxs etc. (and the gguf package's): db * grid * sign, db as ggml
// rounds it; this file is compiled with -ffp-contract=off, so nothing is fused.

void dequantize_iq2_xxs(const uint8_t* b, float* y) {
  const float d = fp16(b);
  for (int ib = 0; ib < 8; ++ib, y += 32) {
    const uint8_t* q = b + 2 + 8 * ib;
    const uint32_t aux = u32_at(q + 4);
    const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      const uint64_t g = iq2xxs_grid[q[l]];
      const uint8_t signs = sign_byte(aux >> (7 * l));
      for (int j = 0; j < 8; ++j) y[8 * l + j] = db * (float)(uint8_t)(g >> (8 * j)) * sign_of(signs, j);
    }
  }
}

// IQ2_XS and IQ2_S: the index and sign byte of group l (8 values) of sub-block ib.
void dequantize_iq2_xs_s(bool s_type, const uint8_t* b, float* y) {
  const float d = fp16(b);
  const uint8_t* scales = b + (s_type ? 74 : 66);
  for (int ib = 0; ib < 8; ++ib, y += 32) {
    const float db[2] = {d * (0.5f + (float)(scales[ib] & 0xF)) * 0.25f,
                         d * (0.5f + (float)(scales[ib] >> 4)) * 0.25f};
    for (int l = 0; l < 4; ++l) {
      uint64_t g;
      uint8_t signs;
      if (s_type) {
        g = iq2s_grid[b[2 + 4 * ib + l] | ((b[66 + ib] << (8 - 2 * l)) & 0x300)];
        signs = b[34 + 4 * ib + l];
      } else {
        const uint16_t v = u16_at(b + 2 + 8 * ib + 2 * l);
        g = iq2xs_grid[v & 511];
        signs = sign_byte(v >> 9);
      }
      for (int j = 0; j < 8; ++j) y[8 * l + j] = db[l / 2] * (float)(uint8_t)(g >> (8 * j)) * sign_of(signs, j);
    }
  }
}

void dequantize_iq3_xxs(const uint8_t* b, float* y) {
  const float d = fp16(b);
  for (int ib = 0; ib < 8; ++ib, y += 32) {
    const uint8_t* q = b + 2 + 8 * ib;
    const uint32_t aux = u32_at(b + 66 + 4 * ib);
    const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
    for (int k = 0; k < 8; ++k) {  // 4 values a grid entry; sign byte k / 2
      const uint32_t g = iq3xxs_grid[q[k]];
      const uint8_t signs = sign_byte(aux >> (7 * (k / 2)));
      for (int j = 0; j < 4; ++j)
        y[4 * k + j] = db * (float)(uint8_t)(g >> (8 * j)) * sign_of(signs, 4 * (k % 2) + j);
    }
  }
}

void dequantize_iq3_s(const uint8_t* b, float* y) {
  const float d = fp16(b);
  for (int ib = 0; ib < 8; ++ib, y += 32) {
    const float db = d * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF));
    const uint8_t* q = b + 2 + 8 * ib;
    const uint32_t h = b[66 + ib];
    for (int k = 0; k < 8; ++k) {
      const uint32_t g = iq3s_grid[q[k] | ((h << (8 - k)) & 256)];
      const uint8_t signs = b[74 + 4 * ib + k / 2];
      for (int j = 0; j < 4; ++j)
        y[4 * k + j] = db * (float)(uint8_t)(g >> (8 * j)) * sign_of(signs, 4 * (k % 2) + j);
    }
  }
}

template <typename Out>
void rows_any(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
              int64_t K, Out* y, int64_t ldy) {
  switch (s.type) {
    case IQ2_XXS: return grid_rows<IQ2XXS>(s, n0, n1, a, M, K, y, ldy);
    case IQ2_XS: return grid_rows<IQ2XS>(s, n0, n1, a, M, K, y, ldy);
    case IQ2_S: return grid_rows<IQ2S>(s, n0, n1, a, M, K, y, ldy);
    case IQ3_XXS: return grid_rows<IQ3XXS>(s, n0, n1, a, M, K, y, ldy);
    default: return grid_rows<IQ3S>(s, n0, n1, a, M, K, y, ldy);
  }
}

}  // namespace

void iq_grid_dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case IQ2_XXS: return dequantize_iq2_xxs(b, y);
    case IQ2_XS: return dequantize_iq2_xs_s(false, b, y);
    case IQ2_S: return dequantize_iq2_xs_s(true, b, y);
    case IQ3_XXS: return dequantize_iq3_xxs(b, y);
    default: return dequantize_iq3_s(b, y);
  }
}

void iq_grid_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                  int64_t K, float* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}
void iq_grid_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                  int64_t K, at::BFloat16* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}

}  // namespace pagedserve_ggml
