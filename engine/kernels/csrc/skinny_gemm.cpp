// Skinny GEMM for decode steps on AVX512-BF16 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// M small (a decode batch), activations bf16, fp32 accumulation, output bf16.
//
// Why: at a handful of rows a linear layer is a pass over its weights, so its speed is the
// memory bandwidth it reaches. torch's bf16 matmul reached about 18 GB/s of the 44 GB/s
// this kind of 2-core machine streams; this kernel streams each weight row once per step
// (all M activation rows reuse the tile while it sits in L1) and keeps NR rows in flight.
//
// Weights are bf16, or int8 with one float32 scale per `group` consecutive weights of a row
// (dequantized in registers: q * scale, rounded to bf16, then the same bf16 dot product).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

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

// int8 weights against more than 4 rows: dequantize the tile once into an L1 buffer and
// run the bf16 tile over it, instead of dequantizing again for every 4 rows.
template <int NR>
inline void tile(const at::BFloat16* x, int64_t M, int64_t K, const Int8Weights& w, int64_t n,
                 const Out& out) {
  if (M <= 4) return tile<NR, Int8Weights>(x, M, K, w, n, out);
  thread_local std::vector<at::BFloat16> buffer;
  buffer.resize(NR * K);
  for (int j = 0; j < NR; ++j)
    for (int64_t k = 0; k < K; k += kStep)
      _mm512_storeu_si512(buffer.data() + j * K + k, (__m512i)w.load(n + j, k));
  // The buffer holds rows n .. n+NR-1 as rows 0 .. NR-1: shift the output to match.
  const Out shifted{out.y + n, out.bias ? out.bias + n : nullptr, out.N};
  tile<NR, Bf16Weights>(x, M, K, Bf16Weights{buffer.data(), K}, 0, shifted);
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

}  // namespace

// x [M, K] bf16; weight [N, K] bf16, or int8 with scales [N, K / group] float32;
// bias [N] bf16 or None. K must be a multiple of 32 (and of group).
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& scales,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kStep == 0, "K must be a multiple of 32");
  const at::BFloat16* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous());
    b = bias->data_ptr<at::BFloat16>();
  }
  auto y = torch::empty({M, N}, x.options());
  const Out out{y.data_ptr<at::BFloat16>(), b, N};
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
