// The 4-bit types whose values come from a table of 16 int8 levels, served from their blocks:
// ggml's non-linear IQ4_NL and IQ4_XS (kvalues_iq4nl) and MXFP4 (OCP microscaling FP4, gpt-oss'
// expert weights: e2m1 values, doubled to integers as ggml's kvalues_mxfp4).
//
// A value is a 4-bit index into the type's table times a float scale: IQ4_NL's block is Q4_0's
// (an f16 d, then 16 bytes of nibbles: values 0-15 the low nibbles, 16-31 the high), MXFP4's
// the same with a one-byte power-of-two scale (e8m0; ggml halves it, as its levels are doubled)
// in place of the f16 d, 17 bytes; IQ4_XS's super-block of 256 holds an f16 d and 8 sub-blocks
// of 32, each with a 6-bit scale ls (d * (ls - 32)) and IQ4_NL's 16 nibble bytes.
//
// Products run on 32-value int8 activation blocks (XBlock) for all three: IQ4_XS's sub-blocks
// are 32 values, and one activation scale per 32 (llama.cpp's q8_K takes one per 256) keeps
// more of the activations. The nibbles become levels with one byte shuffle (the table in
// each 128-bit lane), then:
//
// * with AVX512-VNNI: the levels plus 128 (1..241, unsigned) dotted with x by vpdpbusd, less
//   128 * (the sum of the x block): exact int32 sums.
// * AVX2: maddubs takes one unsigned side and its int16 pair sums saturate (241 * 127 * 2 >
//   32767), so |level| . sign(x, level), as llama.cpp does: pairs within 2 * 127 * 127.
//
// Regrouped at load by 8 rows (`table4_repack`), as ggml_quants.cpp's Q4_0x8:
// * IQ4_NLx8: exactly Q4_0x8's layout: per block column the 8 rows' f16 d (16 bytes), then
//   their 16 nibble bytes interleaved 4 at a time, bytes 4j..4j+3 of row r at 16 + 32 j + 4 r.
// * MXFP4x8: the same with the 8 rows' scale bytes (8 bytes) first: 136 bytes, the file's 8 x 17.
// * IQ4_XSx8: per super-block column the 8 rows' f16 d (16 bytes), the sub-block scales as
//   int8 ls - 32 (sub-block i of row r at 16 + 8 i + r), then per sub-block i at 80 + 128 i
//   its nibble bytes interleaved as IQ4_NLx8's: 1104 bytes where the file has 8 x 136.
// One integer dot then sums 4 values of 8 rows, one row per lane; a block's float work is one
// multiply-add for 8 rows.
#include <ATen/Parallel.h>

#include "ggml_common.h"

namespace pagedserve_ggml {
namespace {

enum class Kind { NL, XS, MX };  // IQ4_NL, IQ4_XS, MXFP4

alignas(16) constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr int8_t kMXFP4Levels[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int64_t kXSBytes = 136;             // an IQ4_XS super-block in the file
constexpr int64_t kNLColumn = 18 * kGroupRows;  // an IQ4_NLx8 block column
constexpr int64_t kMXColumn = 17 * kGroupRows;  // an MXFP4x8 block column

constexpr Kind kind_of(int64_t type) {
  return type == IQ4_XS || type == IQ4_XSx8 ? Kind::XS
         : type == MXFP4 || type == MXFP4x8 ? Kind::MX
                                            : Kind::NL;
}
constexpr const int8_t* levels_of(Kind k) { return k == Kind::MX ? kMXFP4Levels : kIQ4Levels; }
constexpr int64_t column_bytes(Kind k) {
  return k == Kind::XS ? kIQ4XSColumn : k == Kind::MX ? kMXColumn : kNLColumn;
}
constexpr int64_t block_bytes(Kind k) { return k == Kind::XS ? kXSBytes : k == Kind::MX ? 17 : 18; }
constexpr int subs(Kind k) { return k == Kind::XS ? 8 : 1; }  // 32-value sub-blocks a block
// Where a regrouped column's sub-block i of nibbles starts (after the 8 rows' scales).
constexpr int64_t quants_at(Kind k, int i) {
  return k == Kind::XS ? 80 + 128 * i : k == Kind::MX ? 8 : 16;
}

// MXFP4's scale byte as ggml reads it (ggml_e8m0_to_fp32_half): 2^(e - 128), the float's
// bits made directly (e < 2: a subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}
inline __m256 e8m0_half8(__m256i e) {  // the same for 8 int32 lanes
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

// IQ4_XS sub-block i's scale less 32, from the block's scales_h (bytes 2-3) and scales_l (4-7).
inline int xs_scale(const uint8_t* b, int i) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  return (((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((h >> (2 * i)) & 3) << 4)) - 32;
}

// 32 values: d times the levels of 16 nibble bytes, low nibbles first (ggml's order of products).
inline void dequantize_32(const int8_t* levels, float d, const uint8_t* qs, float* y) {
  for (int l = 0; l < 16; ++l) {
    y[l] = d * (float)levels[qs[l] & 0xF];
    y[l + 16] = d * (float)levels[qs[l] >> 4];
  }
}

inline __m128i levels128(Kind k, bool unsigned_levels) {  // plus 128 where VNNI reads it
  const __m128i t = _mm_load_si128((const __m128i*)levels_of(k));
  return unsigned_levels ? _mm_xor_si128(t, _mm_set1_epi8((char)0x80)) : t;
}

constexpr int x_at(int j) {  // activation bytes u[j] multiplies (low nibbles 0-15, high 16-31)
  return j < 4 ? 4 * j : 16 + 4 * (j - 4);
}

// The file's layout, one weight row at a time (rows not a multiple of 8): per 32 values the
// levels of one row against MT activation rows, two accumulator sets alternating by block
// as rows_dot's (ggml_common.h), so a row's sum is added in one order in every tile.
template <Kind KIND, int MT, typename Out>
void rows_dot_table4(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                     const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  const __m256i table = _mm256_broadcastsi128_si256(levels128(KIND, false));
  const int64_t blocks = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[2][MT];
    for (int s = 0; s < 2; ++s)
      for (int m = 0; m < MT; ++m) acc[s][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
      const uint8_t* qs;
      float d;
      if constexpr (KIND == Kind::XS) {
        const uint8_t* sb = row + (k / 8) * kXSBytes;
        qs = sb + 8 + 16 * (k % 8);
        d = fp16(sb) * (float)xs_scale(sb, (int)(k % 8));
      } else if constexpr (KIND == Kind::MX) {
        qs = row + k * 17 + 1;
        d = e8m0_half(row[k * 17]);
      } else {
        qs = row + k * 18 + 2;
        d = fp16(row + k * 18);
      }
      const __m256i v = _mm256_shuffle_epi8(table, nibbles(qs));
      const __m256i a = _mm256_sign_epi8(v, v);
      for (int m = 0; m < MT; ++m) {
        const XBlock* xb = x + m * xstride + k;
        const __m256i p = dot_us(a, _mm256_sign_epi8(load32(xb->q), v));
        add(acc[k % 2][m], p, d * xb->d);
      }
    }
    for (int m = 0; m < MT; ++m) y[m * ldy + n] = (Out)hsum(_mm256_add_ps(acc[0][m], acc[1][m]));
  }
}

// A regrouped column's 8 rows' block scales: f16 d (IQ4_NL, IQ4_XS) or MXFP4's e8m0 bytes.
template <Kind KIND>
inline __m256 group_d(const uint8_t* c) {
  if constexpr (KIND == Kind::MX)
    return e8m0_half8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)c)));
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
}

// ...and sub-block i's float scales: d, or IQ4_XS's d * (ls - 32).
template <Kind KIND>
inline __m256 group_scale(const uint8_t* c, __m256 d, int i) {
  if constexpr (KIND != Kind::XS) return d;
  const __m256i ls = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 16 + 8 * i)));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(ls));
}

// MXFP4 in the file's layout (a weight served from the mapped file, not regrouped), block
// column b of the 8 rows at rows, rows + stride, ...: their scales (group_d's) and nibble
// words as MXFP4x8 holds them, word j of row r in lane r of v[j] (table4_repack's layout),
// made in registers by a 4x4 transpose of 32-bit words in each 128-bit lane.
inline __m256 file_column_mx(const uint8_t* rows, int64_t stride, int64_t b, __m256i v[4]) {
  const uint8_t* p = rows + b * 17;
  if ((b & 3) == 0)  // 8 streams, one a row: each 16 blocks ahead, a cache line per 4 blocks
    for (int r = 0; r < kGroupRows; ++r)
      _mm_prefetch((const char*)(p + r * stride + 16 * 17), _MM_HINT_T0);
  __m256i a[4];  // rows r (low lane) and r + 4 (high lane): their 16 nibble bytes
  for (int r = 0; r < 4; ++r)
    a[r] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + r * stride + 1))),
        _mm_loadu_si128((const __m128i*)(p + (r + 4) * stride + 1)), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2);
  v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3);
  v[3] = _mm256_unpackhi_epi64(t1, t3);
  return e8m0_half8(_mm256_setr_epi32(p[0], p[stride], p[2 * stride], p[3 * stride],
                                      p[4 * stride], p[5 * stride], p[6 * stride], p[7 * stride]));
}

// Regrouped (IQ4_NLx8, IQ4_XSx8, MXFP4x8): MT activation rows against weight rows [n0, n1),
// 8 at a time, 256 bits wide (AVX2, or VNNI's 256-bit dot on AVX-512 below 4 rows). FROM_FILE
// (MXFP4 only): the same 8 rows read from the file's layout (group_bytes is then a row's
// bytes) through file_column_mx, so the same integer sums and float operations: the same
// bits as the regrouped copy gives.
template <Kind KIND, int MT, typename Out, bool FROM_FILE = false>
void groups_dot_table4(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                       const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  static_assert(!FROM_FILE || KIND == Kind::MX, "only MXFP4 is read in groups from the file");
  constexpr int64_t column = column_bytes(KIND);
  constexpr int SUBS = subs(KIND);
  const int64_t columns = K / (QK * SUBS);
  const __m256i table = _mm256_broadcastsi128_si256(levels128(KIND, kVNNI));
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const uint8_t* group = FROM_FILE ? w + n * group_bytes : w + (n / kGroupRows) * group_bytes;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < columns; ++b) {
      const uint8_t* c = group + b * column;
      __m256i words[4];  // FROM_FILE: the column's nibble words
      __m256 d;
      if constexpr (FROM_FILE) {
        d = file_column_mx(group, group_bytes, b, words);
      } else {
        for (int64_t k = 0; k < column; k += 64)
          _mm_prefetch((const char*)(c + (SUBS > 1 ? 2 : 4) * column + k), _MM_HINT_T0);
        d = group_d<KIND>(c);
      }
      for (int i = 0; i < SUBS; ++i) {
        const uint8_t* q = c + quants_at(KIND, i);
        __m256i u[8];  // VNNI: the levels + 128; AVX2: the signed levels
        for (int j = 0; j < 4; ++j) {
          const __m256i v = FROM_FILE ? words[j] : load32(q + 32 * j);
          u[j] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
          u[4 + j] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
        __m256i a[8];  // AVX2: their magnitudes
        if constexpr (!kVNNI)
          for (int j = 0; j < 8; ++j) a[j] = _mm256_sign_epi8(u[j], u[j]);
        const __m256 scale = group_scale<KIND>(c, d, i);
        for (int m = 0; m < MT; ++m) {
          const XBlock* xb = x + m * xstride + b * SUBS + i;
          __m256i sum;
          if constexpr (kVNNI) {
            sum = _mm256_set1_epi32(-128 * xb->qsum);
            for (int j = 0; j < 8; ++j) sum = dot4_add(sum, u[j], broadcast4(xb->q + x_at(j)));
          } else {
            sum = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j)
              sum = _mm256_add_epi32(
                  sum, dot_us(a[j], _mm256_sign_epi8(broadcast4(xb->q + x_at(j)), u[j])));
          }
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                   _mm256_mul_ps(scale, _mm256_set1_ps(xb->d)), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + n, acc[m]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Both groups' block scales in one vector (group_d's, 8 lanes each).
template <Kind KIND>
inline __m512 pair_d(const uint8_t* c0, const uint8_t* c1) {
  if constexpr (KIND == Kind::MX)
    return _mm512_castsi512_ps(_mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_castps_si256(group_d<KIND>(c0))),
        _mm256_castps_si256(group_d<KIND>(c1)), 1));
  return f16_pair(c0, c1);
}

// Two groups side by side in 512 bits (4+ activation rows): the same integer sums and float
// operations per row as groups_dot_table4's VNNI path, so the same bits in any tile.
template <Kind KIND, int MT, typename Out>
void pairs_dot_table4(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1,
                      const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  constexpr int64_t column = column_bytes(KIND);
  constexpr int SUBS = subs(KIND);
  const int64_t columns = K / (QK * SUBS);
  const __m512i table = _mm512_broadcast_i32x4(levels128(KIND, true));
  const __m512i low = _mm512_set1_epi8(0xF);
  int64_t n = n0;
  for (; n + 2 * kGroupRows <= n1; n += 2 * kGroupRows) {
    const uint8_t* g0 = w + (n / kGroupRows) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < columns; ++b) {
      const uint8_t* c0 = g0 + b * column;
      const uint8_t* c1 = g1 + b * column;
      prefetch_pair(c0, c1, column);
      const __m512 d = pair_d<KIND>(c0, c1);
      for (int i = 0; i < SUBS; ++i) {
        const int64_t q = quants_at(KIND, i);
        __m512i u[8];
        for (int j = 0; j < 4; ++j) {
          const __m512i v = load_pair(c0 + q + 32 * j, c1 + q + 32 * j);
          u[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
          u[4 + j] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        __m512 scale = d;
        if constexpr (KIND == Kind::XS) {
          const __m512i ls = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
              _mm_loadl_epi64((const __m128i*)(c0 + 16 + 8 * i)),
              _mm_loadl_epi64((const __m128i*)(c1 + 16 + 8 * i))));
          scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls));
        }
        for (int m = 0; m < MT; ++m) {
          const XBlock* xb = x + m * xstride + b * SUBS + i;
          __m512i sum = _mm512_set1_epi32(-128 * xb->qsum);
          for (int j = 0; j < 8; ++j) {
            int32_t q4;
            std::memcpy(&q4, xb->q + x_at(j), 4);
            sum = _mm512_dpbusd_epi32(sum, u[j], _mm512_set1_epi32(q4));
          }
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                   _mm512_mul_ps(scale, _mm512_set1_ps(xb->d)), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) store16(y + m * ldy + n, acc[m]);
  }
  if (n < n1) groups_dot_table4<KIND, MT>(w, group_bytes, n, n1, x, xstride, K, y, ldy);
}
#endif

// The file's layout: MXFP4 in whole groups of 8 rows as its regrouped copy computes them
// (a weight served from the mapped file gives the same bits), anything else a row at a time.
template <Kind KIND, int MT, typename Out>
void file_rows_table4(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                      const XBlock* x, int64_t xstride, int64_t K, Out* y, int64_t ldy) {
  if constexpr (KIND == Kind::MX)
    if (n0 % kGroupRows == 0 && (n1 - n0) % kGroupRows == 0)
      return groups_dot_table4<KIND, MT, Out, true>(w, row_bytes, n0, n1, x, xstride, K, y, ldy);
  rows_dot_table4<KIND, MT>(w, row_bytes, n0, n1, x, xstride, K, y, ldy);
}

template <Kind KIND, typename Out>
void rows_table4(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, Out* y, int64_t ldy) {
  const int64_t xstride = K / QK;
  const bool regrouped = s.type >= kRegrouped;
  int64_t m = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  for (; regrouped && M - m >= 4; m += 8) {  // tiles of 4-8 rows by pairs of groups
    const XBlock* x = a.x32.data() + m * xstride;
    Out* o = y + s.col0 + m * ldy;
#define PAIRS(MT) pairs_dot_table4<KIND, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy)
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
    Out* o = y + s.col0 + m * ldy;
#define ROWS(MT)                                                                              \
  regrouped ? groups_dot_table4<KIND, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy) \
            : file_rows_table4<KIND, MT>(s.w, s.row_bytes, n0, n1, x, xstride, K, o, ldy)
    switch (std::min<int64_t>(kTile, M - m)) {
      case 1: ROWS(1); break;
      case 2: ROWS(2); break;
      case 3: ROWS(3); break;
      default: ROWS(4); break;
    }
#undef ROWS
  }
}

template <typename Out>
void rows_any(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
              int64_t K, Out* y, int64_t ldy) {
  switch (kind_of(s.type)) {
    case Kind::XS: return rows_table4<Kind::XS>(s, n0, n1, a, M, K, y, ldy);
    case Kind::MX: return rows_table4<Kind::MX>(s, n0, n1, a, M, K, y, ldy);
    case Kind::NL: return rows_table4<Kind::NL>(s, n0, n1, a, M, K, y, ldy);
  }
}

}  // namespace

void table4_dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (kind_of(type)) {
    case Kind::NL: return dequantize_32(kIQ4Levels, fp16(b), b + 2, y);
    case Kind::MX: return dequantize_32(kMXFP4Levels, e8m0_half(b[0]), b + 1, y);
    case Kind::XS: {
      const float d = fp16(b);  // dl = d * (ls - 32), then dl * level, as ggml
      for (int i = 0; i < 8; ++i)
        dequantize_32(kIQ4Levels, d * (float)xs_scale(b, i), b + 8 + 16 * i, y + 32 * i);
    }
  }
}

void table4_dequantize_group_row(int64_t type, const uint8_t* group, int64_t r, int64_t cols,
                                 float* y) {
  const Kind k = kind_of(type);
  const int64_t column = column_bytes(k), values = QK * subs(k);
  uint8_t qs[16];
  for (int64_t b = 0; b < cols / values; ++b) {
    const uint8_t* c = group + b * column;
    const float d = k == Kind::MX ? e8m0_half(c[r]) : fp16(c + 2 * r);
    for (int i = 0; i < subs(k); ++i) {
      for (int j = 0; j < 4; ++j) std::memcpy(qs + 4 * j, c + quants_at(k, i) + 32 * j + 4 * r, 4);
      const float dl = k == Kind::XS ? d * (float)(int8_t)c[16 + 8 * i + r] : d;
      dequantize_32(levels_of(k), dl, qs, y + b * values + 32 * i);
    }
  }
}

void table4_repack(int64_t type, const uint8_t* src, int64_t stride, int64_t blocks,
                   uint8_t* group, int64_t g) {
  const Kind k = kind_of(type);
  const int64_t column = column_bytes(k), bytes = block_bytes(k);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* c = group + b * column;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = src + (g * kGroupRows + r) * stride + b * bytes;
      if (k == Kind::MX)
        c[r] = block[0];
      else
        std::memcpy(c + 2 * r, block, 2);
      for (int i = 0; i < subs(k); ++i) {
        if (k == Kind::XS) c[16 + 8 * i + r] = (uint8_t)(int8_t)xs_scale(block, i);
        const uint8_t* qs = block + (k == Kind::XS ? 8 + 16 * i : k == Kind::MX ? 1 : 2);
        for (int j = 0; j < 4; ++j) std::memcpy(c + quants_at(k, i) + 32 * j + 4 * r, qs + 4 * j, 4);
      }
    }
  }
}

void table4_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, float* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}
void table4_rows(const Segment& s, int64_t n0, int64_t n1, const Activations& a, int64_t M,
                 int64_t K, at::BFloat16* y, int64_t ldy) {
  rows_any(s, n0, n1, a, M, K, y, ldy);
}

}  // namespace pagedserve_ggml
