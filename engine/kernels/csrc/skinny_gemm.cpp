// Skinny GEMM for decode steps on AVX512-BF16 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// M small (a decode batch), activations bf16, fp32 accumulation, output bf16.
//
// Why: at a handful of rows a linear layer is a pass over its weights, so its speed is the
// memory bandwidth it reaches. torch's bf16 matmul reached about 18 GB/s of the 44 GB/s
// this kind of 2-core machine streams; this kernel streams each weight row once per step
// (all M activation rows reuse the tile while it sits in L1) and keeps NR rows in flight.
//
// Weights are bf16, or int8 with one float32 scale per `group` consecutive weights of a row
// (dequantized in registers: q * scale, rounded to bf16, then the same bf16 dot product),
// or int4: llama.cpp's Q4_1 shape, w = d * q + m with q in 0..15 and a float32 d and m per
// 32 weights of a row (see Int4Weights).
#include <torch/types.h>  // not torch/extension.h: pybind11 and Python triple a file's build time
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kStep = 32;       // bf16 pairs per _mm512_dpbf16_ps
constexpr int64_t kPrefetch = 512;  // bytes ahead of the weight stream

struct Bf16Weights {
  const at::BFloat16* w;
  int64_t K;
  inline const char* row(int64_t n) const { return (const char*)(w + n * K); }
  inline __m512bh load(int64_t n, int64_t k) const {
    _mm_prefetch(row(n) + (k * 2 + kPrefetch), _MM_HINT_T0);
    return (__m512bh)_mm512_loadu_si512(w + n * K + k);
  }
};

struct Int8Weights {
  const int8_t* w;
  const float* scales;  // [N, K / group]
  int64_t K, group;
  inline __m512bh load(int64_t n, int64_t k) const {
    const int8_t* p = w + n * K + k;
    if ((k & 63) == 0) _mm_prefetch((const char*)p + kPrefetch, _MM_HINT_T0);
    const __m512 s = _mm512_set1_ps(scales[n * (K / group) + k / group]);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
  }
};

// int4 weights, 64 to a 32-byte chunk of a row: byte j holds q[j] in its low nibble and
// q[32 + j] in its high one, so one chunk unpacks to two blocks of 32 in order.
//
// Up to 4 activation rows take the exact path (`micro_int4`): OR-ing a nibble into 0x4300
// gives the bf16 of 128 + q exactly, so a block's dot product is d * dot(128 + q, x) +
// (m - 128 d) * sum(x), with no rounding of the weights at all. Five integer ops unpack 64
// weights; the weights are 6 bits each, 2.7x fewer bytes than bf16, which is what a decode step reads.
struct Int4Weights {
  const uint8_t* w;     // [N, K / 2]
  const float* scales;  // [N, K / 32]: d
  const float* mins;    // [N, K / 32]: m
  int64_t K;
  inline const uint8_t* row(int64_t n) const { return w + n * (K / 2); }
  // The chunk at k (a multiple of 64) as bf16 of 128 + q: lo = k .. k+31, hi = k+32 .. k+63.
  inline void load_biased(int64_t n, int64_t k, __m512bh& lo, __m512bh& hi) const {
    const uint8_t* p = row(n) + k / 2;
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i nibble = _mm512_set1_epi16(0x000F), biased = _mm512_set1_epi16(0x4300);
    // (a & b) | c
    lo = (__m512bh)_mm512_ternarylogic_epi32(bytes, nibble, biased, 0xEA);
    hi = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 4), nibble, biased, 0xEA);
  }
  // 32 weights at k (a multiple of 32) dequantized, d * q + m rounded to bf16.
  inline __m512bh load(int64_t n, int64_t k) const {
    __m512bh lo, hi;
    load_biased(n, k & ~int64_t(63), lo, hi);
    const __m512i q = (__m512i)((k & 63) ? hi : lo);  // 32 x (0x4300 | q)
    const int64_t b = n * (K / 32) + k / 32;
    const __m512 d = _mm512_set1_ps(scales[b]);
    const __m512 m = _mm512_set1_ps(mins[b]);
    auto half = [&](__m256i h) {  // 16 bf16 of 128 + q -> 16 fp32 of q (exact) -> d * q + m
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      return _mm512_fmadd_ps(_mm512_sub_ps(v, _mm512_set1_ps(128.f)), d, m);
    };
    return _mm512_cvtne2ps_pbh(half(_mm512_extracti64x4_epi64(q, 1)),
                               half(_mm512_castsi512_si256(q)));
  }
};

struct Out {
  at::BFloat16* y;
  const at::BFloat16* bias;
  int64_t N;
};

// MR activation rows x NR weight rows, every accumulator in a register.
template <int MR, int NR, typename W>
inline void micro(const at::BFloat16* x, int64_t K, const W& w, int64_t n0, const Out& out) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = w.load(n0 + j, k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = _mm512_reduce_add_ps(acc[i][j]);
      if (out.bias) v += float(out.bias[n0 + j]);
      out.y[i * out.N + n0 + j] = at::BFloat16(v);
    }
}

// The exact int4 path: MR <= 4 activation rows x NR weight rows; `sums` holds each
// activation row's per-block sums [MR, K / 32].
constexpr int64_t kPrefetchTiles = 2;  // ahead of the tile being multiplied

template <int MR, int NR>
inline void micro_int4(const at::BFloat16* x, const float* sums, int64_t K,
                       const Int4Weights& w, int64_t n0, const Out& out) {
  const int64_t G = K / 32;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  // The scales and mins are streams of their own, read once per block and row: without
  // this they arrive late, and the step's projections took 1.45x as long.
  const int64_t ahead = (n0 + kPrefetchTiles * NR) * G;
  for (int64_t b = 0; b < NR * G; b += 16) {
    _mm_prefetch((const char*)(w.scales + ahead + b), _MM_HINT_T0);
    _mm_prefetch((const char*)(w.mins + ahead + b), _MM_HINT_T0);
  }
  for (int64_t k = 0; k < K; k += 64) {
    __m512bh lo[NR], hi[NR];
    // Rows are short (K / 2 bytes): fetch the tile after next while this one computes
    // (a prefetch past the end of the weights is a no-op, never a fault).
    if ((k & 127) == 0)
      for (int j = 0; j < NR; ++j)
        _mm_prefetch((const char*)w.row(n0 + kPrefetchTiles * NR + j) + k / 2, _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) w.load_biased(n0 + j, k, lo[j], hi[j]);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + i * K + k + 32);
      for (int j = 0; j < NR; ++j) {
        const float* d = w.scales + (n0 + j) * G + k / 32;
        const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo[j], xa);
        const __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), hi[j], xb);
        acc[i][j] = _mm512_fmadd_ps(a, _mm512_set1_ps(d[0]), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(b, _mm512_set1_ps(d[1]), acc[i][j]);
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const float* d = w.scales + (n0 + j) * G;
    const float* m = w.mins + (n0 + j) * G;
    for (int i = 0; i < MR; ++i) {
      // sum over blocks of (m - 128 d) * sum(x)
      __m512 corr = _mm512_setzero_ps();
      for (int64_t b = 0; b < G; b += 16) {
        const __mmask16 mask = G - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - b)) - 1);
        const __m512 dv = _mm512_maskz_loadu_ps(mask, d + b);
        const __m512 mv = _mm512_maskz_loadu_ps(mask, m + b);
        const __m512 sv = _mm512_maskz_loadu_ps(mask, sums + i * G + b);
        corr = _mm512_fmadd_ps(_mm512_fnmadd_ps(dv, _mm512_set1_ps(128.f), mv), sv, corr);
      }
      float v = _mm512_reduce_add_ps(acc[i][j]) + _mm512_reduce_add_ps(corr);
      if (out.bias) v += float(out.bias[n0 + j]);
      out.y[i * out.N + n0 + j] = at::BFloat16(v);
    }
  }
}

// One NR-row weight tile against all M activation rows, 4 at a time: after the first
// pass the tile is in L1, so the weights leave DRAM once whatever M is.
template <int NR, typename W>
inline void tile(const at::BFloat16* x, int64_t M, int64_t K, const W& w, int64_t n,
                 const Out& out) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) micro<4, NR>(x + m * K, K, w, n, {out.y + m * out.N, out.bias, out.N});
  const Out rest{out.y + m * out.N, out.bias, out.N};
  switch (M - m) {
    case 3: micro<3, NR>(x + m * K, K, w, n, rest); break;
    case 2: micro<2, NR>(x + m * K, K, w, n, rest); break;
    case 1: micro<1, NR>(x + m * K, K, w, n, rest); break;
    default: break;
  }
}

// Quantized weights against more than 4 rows: dequantize the tile once into an L1 buffer
// and run the bf16 tile over it, instead of dequantizing again for every 4 rows.
template <int NR, typename W>
inline void dequantized_tile(const at::BFloat16* x, int64_t M, int64_t K, const W& w, int64_t n,
                             const Out& out) {
  thread_local std::vector<at::BFloat16> buffer;
  buffer.resize(NR * K);
  for (int j = 0; j < NR; ++j)
    for (int64_t k = 0; k < K; k += kStep)
      _mm512_storeu_si512(buffer.data() + j * K + k, (__m512i)w.load(n + j, k));
  // The buffer holds rows n .. n+NR-1 as rows 0 .. NR-1: shift the output to match.
  const Out shifted{out.y + n, out.bias ? out.bias + n : nullptr, out.N};
  tile<NR, Bf16Weights>(x, M, K, Bf16Weights{buffer.data(), K}, 0, shifted);
}

template <int NR>
inline void tile(const at::BFloat16* x, int64_t M, int64_t K, const Int8Weights& w, int64_t n,
                 const Out& out) {
  if (M <= 4) return tile<NR, Int8Weights>(x, M, K, w, n, out);
  dequantized_tile<NR>(x, M, K, w, n, out);
}

// Per-block sums of the activation rows, [M, K / 32] (the exact int4 path's correction).
inline std::vector<float> block_sums(const at::BFloat16* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * (K / 32));
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += float(x[i * 32 + k]);
    sums[i] = s;
  }
  return sums;
}

// Up to this many rows int4 takes the exact path: 1.27x the dequantized tile at 2 rows,
// 1.4x at 3, equal at 4 (`python -m bench.skinny_gemm`).
constexpr int64_t kInt4ExactRows = 4;

void run_int4(const at::BFloat16* x, int64_t M, int64_t K, const Int4Weights& w, int64_t N,
              const Out& out) {
  const std::vector<float> sums =
      M <= kInt4ExactRows ? block_sums(x, M, K) : std::vector<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    if (M > kInt4ExactRows) {
      for (; n + 4 <= end; n += 4) dequantized_tile<4>(x, M, K, w, n, out);
      for (; n < end; ++n) dequantized_tile<1>(x, M, K, w, n, out);
      return;
    }
    auto rows = [&](auto nr, int64_t n) {
      constexpr int NR = decltype(nr)::value;
      switch (M) {
        case 4: micro_int4<4, NR>(x, sums.data(), K, w, n, out); break;
        case 3: micro_int4<3, NR>(x, sums.data(), K, w, n, out); break;
        case 2: micro_int4<2, NR>(x, sums.data(), K, w, n, out); break;
        default: micro_int4<1, NR>(x, sums.data(), K, w, n, out); break;
      }
    };
    if (M == 1)
      for (; n + 8 <= end; n += 8) rows(std::integral_constant<int, 8>(), n);
    for (; n + 4 <= end; n += 4) rows(std::integral_constant<int, 4>(), n);
    for (; n < end; ++n) rows(std::integral_constant<int, 1>(), n);
  });
}

template <typename W>
void run(const at::BFloat16* x, int64_t M, int64_t K, const W& w, int64_t N, const Out& out) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    if (M == 1) {  // 8 rows in flight: more independent loads and accumulator chains
      for (; n + 8 <= end; n += 8) micro<1, 8>(x, K, w, n, out);
    } else {
      for (; n + 4 <= end; n += 4) tile<4>(x, M, K, w, n, out);
    }
    for (; n < end; ++n) tile<1>(x, M, K, w, n, out);
  });
}

// Argument checks shared by the entry points.
void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 tensor");
}

const at::BFloat16* bias_data(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous());
  return bias->data_ptr<at::BFloat16>();
}

// packed [N, K / 2] uint8 (see Int4Weights); scales and mins [N, K / 32] float32.
Int4Weights int4_weights(const torch::Tensor& packed, const torch::Tensor& scales,
                         const torch::Tensor& mins) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2,
              "packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % 64 == 0, "K must be a multiple of 64");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) * 32 == K,
                "scales and mins must be contiguous float32 [N, K / 32] tensors");
  return Int4Weights{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                     K};
}

}  // namespace

// x [M, K] bf16; weight [N, K] bf16, or int8 with scales [N, K / group] float32;
// bias [N] bf16 or None. K must be a multiple of 32 (and of group).
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& scales,
                            const c10::optional<torch::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kStep == 0, "K must be a multiple of 32");
  auto y = torch::empty({M, N}, x.options());
  const Out out{y.data_ptr<at::BFloat16>(), bias_data(bias, N), N};
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!scales, "bf16 weights take no scales");
    run(xp, M, K, Bf16Weights{weight.data_ptr<at::BFloat16>(), K}, N, out);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kChar && scales, "int8 weights need scales");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 2 &&
                    scales->size(0) == N && scales->is_contiguous() && K % scales->size(1) == 0,
                "scales must be a contiguous float32 [N, K / group] tensor");
    const int64_t group = K / scales->size(1);
    TORCH_CHECK(group % kStep == 0, "the quantization group must be a multiple of 32");
    run(xp, M, K, Int8Weights{weight.data_ptr<int8_t>(), scales->data_ptr<float>(), K, group}, N,
        out);
  }
  return y;
}

// x [M, K] bf16; int4 blocks as `int4_weights` takes them; bias [N] bf16 or None.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& bias) {
  check_x(x);
  const Int4Weights w = int4_weights(packed, scales, mins);
  TORCH_CHECK(w.K == x.size(1), "x must have K = 2 * packed.size(1) columns");
  const int64_t M = x.size(0), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  run_int4(x.data_ptr<at::BFloat16>(), M, w.K, w, N,
           Out{y.data_ptr<at::BFloat16>(), bias_data(bias, N), N});
  return y;
}

// The bf16 weight [N, K] of int4 blocks (for prefill-sized matmuls, which torch runs).
torch::Tensor dequantize_int4(const torch::Tensor& packed, const torch::Tensor& scales,
                              const torch::Tensor& mins) {
  const Int4Weights w = int4_weights(packed, scales, mins);
  const int64_t N = packed.size(0), K = w.K;
  auto out = torch::empty({N, K}, packed.options().dtype(at::kBFloat16));
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += kStep)
        _mm512_storeu_si512(o + n * K + k, (__m512i)w.load(n, k));
  });
  return out;
}
