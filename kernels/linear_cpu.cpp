// bf16 linear layers on the CPU with AVX-512 BF16: graphspec.kernels.linear's own CPU kernel (cpu_native.py).
//
// Why: a decode step reads every weight once, so its GEMMs should run at the memory bandwidth. oneDNN's bf16
// kernels do not on one core of the AMD EPYC (Zen 4) machines: the Qwen2.5-1.5B step's products took 150-210
// ms with one thread against the 128 ms that 3.09 GB at the measured 24 GB/s allows, and its 7- and 8-row
// kernels (a speculative verify of K = 6, 7) 240-276 ms (perf/RESULTS.md section S). This file's loop reads
// the weight once, as one stream per 16 outputs, and multiplies it with up to 8 rows of x in registers.
//
// Layout: a [N, K] weight becomes [ceil(N / 16), ceil(K / 2), 16, 2] bf16 (zero padded): for each block of 16
// outputs and each pair of inputs k, k + 1, the 16 outputs' two weights side by side, which is what
// vdpbf16ps multiplies with a broadcast pair of x (x[m, k], x[m, k + 1]) into 16 fp32 sums.
//
// Numerics: each output is one fp32 sum over k in a fixed order (pairs k, k + 1 in turn, each pair's two
// products added as vdpbf16ps does, denormals flushed, as in oneDNN's bf16 kernels), plus the bias, rounded to
// bf16 to nearest even. Nothing in that order depends on the number of rows, on which other rows share the
// product, or on the thread count: a row comes out bit-identical whether it is computed alone (a decode step),
// in a verify of K + 1 rows, or in a prefill. That is what keeps greedy speculative output equal to
// autoregressive output in bf16 without the row-count workarounds the oneDNN path needs (linear.py MIN_ROWS).
//
// Threads: torch's intra-op pool (at::parallel_for) over groups of blocks of outputs; each output is written by
// one thread.

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GS_HAVE_BF16 1
#else
#define GS_HAVE_BF16 0
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per block: one zmm of fp32 sums
constexpr int kMaxRows = 8;     // rows of x per register tile

bool supported() { return GS_HAVE_BF16 != 0; }

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "linear_cpu.pack: the weight must be 2-d [N, K], got ", w.dim(), " dimensions");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear_cpu.pack: the weight must be bf16, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "linear_cpu.pack: the weight must be on the CPU");
}

void check_packed(const at::Tensor& p, int64_t n, int64_t k) {
  TORCH_CHECK(p.dim() == 4 && p.size(2) == kBlock && p.size(3) == 2 && p.scalar_type() == at::kBFloat16 &&
                  p.is_contiguous() && p.device().is_cpu(),
              "linear_cpu: the packed weight must be a contiguous CPU bf16 [N/16, K/2, 16, 2] tensor from pack()");
  TORCH_CHECK(n > 0 && k > 0 && p.size(0) == (n + kBlock - 1) / kBlock && p.size(1) == (k + 1) / 2,
              "linear_cpu: packed weight of shape ", p.sizes(), " does not hold a [", n, ", ", k, "] weight");
}

at::Tensor pack(const at::Tensor& w) {
  check_weight(w);
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n > 0 && k > 0, "linear_cpu.pack: empty weight [", n, ", ", k, "]");
  const int64_t nb = (n + kBlock - 1) / kBlock, kp = (k + 1) / 2;
  at::Tensor padded = at::zeros({nb * kBlock, kp * 2}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({nb, kBlock, kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor unpack(const at::Tensor& p, int64_t n, int64_t k) {
  check_packed(p, n, k);
  const int64_t nb = p.size(0), kp = p.size(1);
  return p.permute({0, 2, 1, 3}).reshape({nb * kBlock, kp * 2}).narrow(0, 0, n).narrow(1, 0, k).contiguous();
}

#if GS_HAVE_BF16

// y[m, b*16 .. b*16 + 15] for M rows and NB consecutive blocks b0 .. b0 + NB - 1 (the last may be partial:
// `valid` outputs of it are stored). x: M rows of kp uint32 (bf16 pairs), row stride ldx; w: the packed weight.
template <int M, int NB>
inline void tile(const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict w, int64_t kp,
                 const float* __restrict bias, at::BFloat16* __restrict y, int64_t ldy, int64_t b0, int64_t n) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const uint32_t* wj[NB];
  for (int j = 0; j < NB; ++j) wj[j] = w + (b0 + j) * kp * kBlock;
  for (int64_t k = 0; k < kp; ++k) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wj[j] + k * kBlock);
    for (int m = 0; m < M; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[m * ldx + k]));
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)wv[j], (__m512bh)xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t first = (b0 + j) * kBlock;
    const int64_t valid = n - first < kBlock ? n - first : kBlock;
    const __mmask16 mask = valid == kBlock ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(acc[j][m], bv));
      _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + m * ldy + first), mask, (__m256i)o);
    }
  }
}

// One register tile: `rows` rows (1..8) x `width` blocks (1..4) of sums, at most 28 of the 32 zmm registers.
void tile_any(int rows, int width, const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t kp, const float* bias,
              at::BFloat16* y, int64_t ldy, int64_t b0, int64_t n) {
  switch (rows * 8 + width) {
#define GS_TILE(R, W) \
  case R * 8 + W: tile<R, W>(x, ldx, w, kp, bias, y, ldy, b0, n); return;
#define GS_ROWS(R) GS_TILE(R, 1) GS_TILE(R, 2) GS_TILE(R, 3) GS_TILE(R, 4)
    GS_ROWS(1) GS_ROWS(2) GS_ROWS(3) GS_ROWS(4) GS_ROWS(5) GS_ROWS(6)
    GS_TILE(7, 1) GS_TILE(7, 2) GS_TILE(7, 3) GS_TILE(8, 1) GS_TILE(8, 2) GS_TILE(8, 3)
#undef GS_ROWS
#undef GS_TILE
    default: TORCH_CHECK(false, "linear_cpu: internal error, a ", rows, " x ", width, " tile");
  }
}

#endif  // GS_HAVE_BF16

// y [M, N] = x [M, K] @ W^T (+ bias), bf16 in and out, fp32 sums; `p` from pack().
at::Tensor linear(const at::Tensor& x, const at::Tensor& p, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "linear_cpu: built without AVX-512 BF16 (this CPU or compiler lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "linear_cpu.linear: x must be a 2-d CPU bf16 tensor [M, K]");
  const int64_t rows = x.size(0), k = x.size(1);
  check_packed(p, n, k);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_cpu.linear: bias must have N = ", n, " elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
#if GS_HAVE_BF16
  const int64_t kp = p.size(1), nb = p.size(0);
  at::Tensor xp = x;
  if (k % 2 != 0 || !x.is_contiguous()) {  // pairs of k: pad an odd K with a zero column
    xp = at::zeros({rows, kp * 2}, x.options());
    xp.narrow(1, 0, k).copy_(x);
  }
  const auto* xs = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  const auto* ws = reinterpret_cast<const uint32_t*>(p.data_ptr());
  const float* bs = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* ys = y.data_ptr<at::BFloat16>();
  // Tasks of 12 blocks (192 outputs), a multiple of both tile widths. More than 8 rows (a wide verify, a prefill)
  // go in equal chunks (9 as 5 + 4, not 8 + 1: a 1-row chunk leaves the multipliers waiting on one sum), and a
  // tile multiplies every chunk in turn, so its weights are re-read from cache, not from memory.
  constexpr int64_t kGroup = 12;
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t step = (rows + chunks - 1) / chunks;
  const int64_t width = step <= 6 ? 4 : 3;
  at::parallel_for(0, (nb + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    const int64_t b_end = g1 * kGroup < nb ? g1 * kGroup : nb;
    for (int64_t b = g0 * kGroup; b < b_end; b += width) {
      const int w = static_cast<int>(b_end - b < width ? b_end - b : width);
      for (int64_t r = 0; r < rows; r += step) {
        const int chunk = static_cast<int>(rows - r < step ? rows - r : step);
        tile_any(chunk, w, xs + r * kp, kp, ws, kp, bs, ys + r * n, n, b, n);
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(graphspec_cpu, m) {
  m.def("supported() -> bool", &supported);
  m.def("pack(Tensor w) -> Tensor", &pack);
  m.def("unpack(Tensor p, int n, int k) -> Tensor", &unpack);
  m.def("linear(Tensor x, Tensor p, int n, Tensor? bias) -> Tensor", &linear);
}
