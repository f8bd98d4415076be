// bf16 linear layers on the CPU: graphspec.kernels.linear's own CPU kernel (graphspec.kernels.cpu), at the
// amx level (AMX tile products, tdpbf16ps), the avx512 level (vdpbf16ps) and the avx2 level (bf16 widened to
// fp32 in registers, FMA).
//
// Why: a decode step reads every weight once, so its GEMMs should run at the memory bandwidth, and torch's
// bf16 products do not on one core of the project's machines (oneDNN's on AVX-512, and without native bf16 it
// emulates). This file's loop reads the weight once, as one stream per 16 outputs, and multiplies it with
// several rows of x held in registers.
//
// Layout (every level; made by kernels.linear.NativeWeight.pack): a [N, K] weight becomes [ceil(N / 16), ceil(K / 2), 16, 2] bf16 (zero padded): for
// each block of 16 outputs and each pair of inputs k, k + 1, the 16 outputs' two weights side by side. avx512:
// what vdpbf16ps multiplies with a broadcast pair (x[m, k], x[m, k + 1]); amx: 16 pairs of it are one tile of
// tdpbf16ps's second operand. avx2: 8 outputs' pairs per ymm, whose
// even halves shifted left by 16 and odd halves masked are the fp32 weights of k and k + 1.
//
// Numerics: each output is one fp32 sum over k in a fixed order, plus the bias, rounded to bf16 to nearest
// even. avx512: pairs k, k + 1 in turn, each pair's two products added as vdpbf16ps does (denormals flushed,
// as in oneDNN's bf16 kernels). avx2: fma(w[k], x[k], acc) for k = 0, 1, 2, ... in turn (a bf16 x bf16 product
// is exact in fp32, so this is the plain sequential fp32 sum). Nothing in that order depends on the number
// of rows, on which other rows share the product, or on the thread count (amx: tdpbf16ps's sums over 16 pairs at
// a time, each row of a tile its own, then vdpbf16ps for the pairs past the last 16): a row comes out bit-identical
// whether it is computed alone (a decode step), in a verify of K + 1 rows, or in a prefill, which keeps greedy
// speculative output equal to autoregressive output in bf16. The levels round differently from each other.
//
// Threads: torch's intra-op pool (at::parallel_for) over groups of blocks of outputs; each output is written by
// one thread.

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "amx.h"
#include "level.h"

#define GS_HAVE_BF16 (GS_AVX512 || GS_AVX2)

namespace {

constexpr int64_t kBlock = 16;  // outputs per block: one zmm of fp32 sums
#if GS_AVX512
constexpr int kMaxRows = 8;  // rows of x per register tile: 8 x 3 or 6 x 4 sums of the 32 zmm
#else
constexpr int kMaxRows = 5;  // 5 rows x 2 halves of one block: 10 sums of the 16 ymm
#endif

bool supported() { return GS_HAVE_BF16 != 0; }

void check_packed(const at::Tensor& p, int64_t n, int64_t k) {
  TORCH_CHECK(p.dim() == 4 && p.size(2) == kBlock && p.size(3) == 2 && p.scalar_type() == at::kBFloat16 &&
                  p.is_contiguous() && p.device().is_cpu(),
              "linear_cpu: the packed weight must be a contiguous CPU bf16 [N/16, K/2, 16, 2] tensor from NativeWeight.pack");
  TORCH_CHECK(n > 0 && k > 0 && p.size(0) == (n + kBlock - 1) / kBlock && p.size(1) == (k + 1) / 2,
              "linear_cpu: packed weight of shape ", p.sizes(), " does not hold a [", n, ", ", k, "] weight");
}

#if GS_AVX512 && !GS_AMX

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

#endif  // GS_AVX512 && !GS_AMX

#if GS_AMX

// amx: the same packed weight is what a tile product wants as its second operand. For a block of 16 outputs,
// 16 consecutive pairs of k are 16 rows of 64 bytes (the 16 outputs' pairs), contiguous: one tile load with a
// 64-byte stride. x, in 16-row chunks of 32 bf16 (16 pairs) per row, is the first operand; tdpbf16ps adds
// their products into 16 x 16 fp32 sums held in a tile. Pairs past the last multiple of 16 (an odd-sized K)
// go on with vdpbf16ps on the stored sums. Every row runs the same instructions whatever the row count (a
// chunk is always 16 rows, padded with zeros), so a row's bits do not depend on the other rows or threads.

constexpr int64_t kChunk = 16;  // pairs of k per tile product: one 64-byte tile row of x
// 17 to 256 rows run k in pieces of kPiece chunks: every 16-row chunk multiplies a piece's weight tiles (32 KB for
// 4 blocks) while they sit in L1, its sums held in memory between pieces (a tile store and load are exact), so
// the weights come from memory once and from L1 after (the whole of k at a time re-read them from L2 for each
// chunk: 6-12% slower on 17 to 256 rows, perf/RESULTS.md). Past 256 rows the held sums and x outgrow the caches,
// and whole-k passes measured faster again.
constexpr int64_t kPiece = 8;
constexpr int64_t kHeldRows = 256;

// Tiles (amx.h: each 16 rows of 64 bytes) 0-3: the sums of up to 4 blocks; 4: 16 rows of x; 5, 6: weights.
using graphspec_amx::amx_permitted;
using graphspec_amx::configure_tiles;

// y[r .. r + rows) x blocks b0 .. b0 + NB - 1 (the last may be partial): chunks c0 .. c1 - 1 of k, the sums
// before them in `held` (NB tiles of 16 x 16 fp32; c0 = 0: none), the sums after them left there unless c1 is
// the last chunk, which adds the pairs past it and the bias and stores y. x: a 16-row chunk of kp uint32 pairs
// per row, row stride ldx (rows past `rows` are zeros); w: the packed weight.
template <int NB>
void amx_tile(const uint32_t* __restrict x, int64_t ldx, int rows, const uint32_t* __restrict w, int64_t kp,
              const float* __restrict bias, at::BFloat16* __restrict y, int64_t ldy, int64_t b0, int64_t n,
              int64_t c0, int64_t c1, float* __restrict held) {
  const int64_t full = kp / kChunk;
  const uint32_t* wb = w + b0 * kp * kBlock;
  const int64_t wstep = kp * kBlock;  // uint32 from one block to the next
  if (c0 == 0) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (NB > 2) _tile_zero(2);
    if constexpr (NB > 3) _tile_zero(3);
  } else {
    _tile_loadd(0, held, 64);
    if constexpr (NB > 1) _tile_loadd(1, held + 256, 64);
    if constexpr (NB > 2) _tile_loadd(2, held + 512, 64);
    if constexpr (NB > 3) _tile_loadd(3, held + 768, 64);
  }
  for (int64_t c = c0; c < c1; ++c) {
    const uint32_t* wc = wb + c * kChunk * kBlock;
    _tile_loadd(4, x + c * kChunk, ldx * 4);
    _tile_loadd(5, wc, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, wc + wstep, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(5, wc + 2 * wstep, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NB > 3) {
      _tile_loadd(6, wc + 3 * wstep, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, held, 64);
  if constexpr (NB > 1) _tile_stored(1, held + 256, 64);
  if constexpr (NB > 2) _tile_stored(2, held + 512, 64);
  if constexpr (NB > 3) _tile_stored(3, held + 768, 64);
  if (c1 < full) return;  // more of k to come: the sums wait in `held`
  const auto sums = reinterpret_cast<const float(*)[16][kBlock]>(held);
  for (int j = 0; j < NB; ++j) {
    const int64_t first = (b0 + j) * kBlock;
    const int64_t valid = n - first < kBlock ? n - first : kBlock;
    const __mmask16 mask = valid == kBlock ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    const uint32_t* wj = wb + j * wstep;
    for (int m = 0; m < rows; ++m) {
      __m512 acc = _mm512_load_ps(sums[j][m]);
      for (int64_t k = full * kChunk; k < kp; ++k)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wj + k * kBlock),
                               (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + k])));
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(acc, bv));
      _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + m * ldy + first), mask, (__m256i)o);
    }
  }
}

void amx_tile_any(int width, const uint32_t* x, int64_t ldx, int rows, const uint32_t* w, int64_t kp,
                  const float* bias, at::BFloat16* y, int64_t ldy, int64_t b0, int64_t n, int64_t c0, int64_t c1,
                  float* held) {
  switch (width) {
    case 1: amx_tile<1>(x, ldx, rows, w, kp, bias, y, ldy, b0, n, c0, c1, held); return;
    case 2: amx_tile<2>(x, ldx, rows, w, kp, bias, y, ldy, b0, n, c0, c1, held); return;
    case 3: amx_tile<3>(x, ldx, rows, w, kp, bias, y, ldy, b0, n, c0, c1, held); return;
    case 4: amx_tile<4>(x, ldx, rows, w, kp, bias, y, ldy, b0, n, c0, c1, held); return;
    default: TORCH_CHECK(false, "linear_cpu: internal error, a tile of ", width, " blocks");
  }
}

#endif  // GS_AMX

#if GS_AVX2

// 8 fp32 sums -> 8 bf16, rounded to nearest even as c10::BFloat16 does (NaN -> a quiet NaN), in the low 128 bits.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..3 r0..3 | r4..7 r4..7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // r0..3 r4..7
}

inline __m256 fma(__m256 acc, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, acc); }

// y[m, b*16 .. (b + NB)*16) for M rows and NB consecutive blocks from b (the last may be partial). x: M rows of
// fp32, row stride ldx (2 * kp, zero padded); w: the packed weight as uint32 pairs. Each output is one sum,
// fma(w[k], x[k], acc) for k = 0, 1, 2, ... in turn: a pair's even weight (its bits shifted left by 16) then its
// odd one (the pair masked). A tile holds 8 to 12 sums, two FMAs a pair of inputs each, enough chains to cover
// the FMA latency at two a cycle with nothing spilled from the 16 registers. Two loop orders, both measured on
// an AVX2-only AMD EPYC Zen 3 (perf/RESULTS.md): a tile of several blocks takes one half block (8 outputs) at a
// time for all its rows; a tile of one block (4 or 5 rows) takes every even product of the tile, then every odd
// one, so each broadcast of x feeds both halves.
template <int M, int NB>
inline void tile(const float* __restrict x, int64_t ldx, const uint32_t* __restrict w, int64_t kp,
                 const float* __restrict bias, at::BFloat16* __restrict y, int64_t ldy, int64_t b, int64_t n) {
  __m256 acc[M][NB][2];  // [row][block][half of the block]
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint32_t* wb = w + b * kp * kBlock;
  // Every loop over the sums fully unrolled (the pragmas): a sum indexed by a loop variable stays in memory,
  // stored every step and, short of registers, reloaded.
  for (int64_t k = 0; k < kp; ++k) {
    if constexpr (NB > 1) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const uint32_t* wk = wb + (j * kp + k) * kBlock;
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 8 * h));
          const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            acc[m][j][h] = fma(acc[m][j][h], e, _mm256_broadcast_ss(x + m * ldx + 2 * k));
            acc[m][j][h] = fma(acc[m][j][h], o, _mm256_broadcast_ss(x + m * ldx + 2 * k + 1));
          }
        }
      }
    } else {
      const uint32_t* wk = wb + k * kBlock;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 8));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * ldx + 2 * k);
        acc[m][0][0] = fma(acc[m][0][0], e0, xe);
        acc[m][0][1] = fma(acc[m][0][1], e1, xe);
      }
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256 xo = _mm256_broadcast_ss(x + m * ldx + 2 * k + 1);
        acc[m][0][0] = fma(acc[m][0][0], o0, xo);
        acc[m][0][1] = fma(acc[m][0][1], o1, xo);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const int64_t first = (b + j) * kBlock;
    const int64_t valid = n - first < kBlock ? n - first : kBlock;
    alignas(32) float bb[kBlock] = {0.f};
    if (bias) std::memcpy(bb, bias + first, sizeof(float) * valid);
    const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {  // sum + bias
      alignas(32) at::BFloat16 out[kBlock];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), to_bf16(_mm256_add_ps(acc[m][j][0], b0)));
      _mm_store_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16(_mm256_add_ps(acc[m][j][1], b1)));
      std::memcpy(y + m * ldy + first, out, sizeof(at::BFloat16) * valid);
    }
  }
}

// Blocks per tile for a chunk of `rows` rows: 1 x 4, 2 x 2, 3 x 2, 4 x 1 or 5 x 1.
inline int64_t tile_blocks(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

// One tile: `rows` rows (1..5) x `nb` blocks (at most tile_blocks(rows); fewer at the end of a task).
void tile_rows(int rows, int nb, const float* x, int64_t ldx, const uint32_t* w, int64_t kp, const float* bias,
               at::BFloat16* y, int64_t ldy, int64_t b, int64_t n) {
  switch (rows * 8 + nb) {
#define GS_TILE2(R, W) \
  case R * 8 + W: tile<R, W>(x, ldx, w, kp, bias, y, ldy, b, n); return;
    GS_TILE2(1, 1) GS_TILE2(1, 2) GS_TILE2(1, 3) GS_TILE2(1, 4) GS_TILE2(2, 1) GS_TILE2(2, 2) GS_TILE2(3, 1)
    GS_TILE2(3, 2) GS_TILE2(4, 1) GS_TILE2(5, 1)
#undef GS_TILE2
    default: TORCH_CHECK(false, "linear_cpu: internal error, a ", rows, " x ", nb, " tile");
  }
}

#endif  // GS_AVX2

// y [M, N] = x [M, K] @ W^T (+ bias), bf16 in and out, fp32 sums; `p` from pack().
at::Tensor linear(const at::Tensor& x, const at::Tensor& p, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "linear_cpu: the ", GS_LEVEL_NAME, " level has no bf16 linear (amx, avx512 and avx2 do)");
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
  const auto* ws = reinterpret_cast<const uint32_t*>(p.data_ptr());
  const float* bs = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* ys = y.data_ptr<at::BFloat16>();
  // Tasks of 12 blocks (192 outputs). avx512 / avx2: more than kMaxRows rows (a wide verify, a prefill) go in
  // equal chunks (9 as 5 + 4, not 8 + 1: a 1-row chunk leaves the multipliers waiting on one sum), and a tile
  // multiplies every chunk in turn, so its weights are re-read from cache, not from memory (amx: 16-row chunks).
  constexpr int64_t kGroup = 12;
#if !GS_AMX
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t step = (rows + chunks - 1) / chunks;
#endif
#if GS_AMX
  graphspec_amx::require_tiles("linear_cpu");
  // x as 16-row chunks of kp pairs (zero rows and a zero column pad it), so every tile load reads 16 rows; a
  // contiguous x of whole chunks and even K (a prefill's block) is that already and is read in place.
  const int64_t padded = (rows + 15) / 16 * 16;
  at::Tensor xp = x;
  if (padded != rows || k % 2 != 0 || !x.is_contiguous()) {
    xp = at::zeros({padded, kp * 2}, x.options());
    xp.narrow(0, 0, rows).narrow(1, 0, k).copy_(x);
  }
  const auto* xs = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  constexpr int64_t width = 4;  // blocks per tile pass: divides kGroup
  const int64_t full = kp / kChunk;
  const int64_t piece = rows > 16 && rows <= kHeldRows ? kPiece : std::max<int64_t>(full, 1);
  at::parallel_for(0, (nb + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles();  // per thread: the tile configuration is thread state
    const int64_t b_end = g1 * kGroup < nb ? g1 * kGroup : nb;
    // Sums between pieces of k, a tile per 16 rows and block (torch's CPU allocator aligns to 64 bytes).
    at::Tensor held_t = at::empty({std::min<int64_t>(padded, kHeldRows) * width * 16}, x.options().dtype(at::kFloat));
    float* held = held_t.data_ptr<float>();
    for (int64_t b = g0 * kGroup; b < b_end; b += width) {
      const int w = static_cast<int>(b_end - b < width ? b_end - b : width);
      for (int64_t g = 0; g < rows; g += kHeldRows) {
        const int64_t g_end = g + kHeldRows < rows ? g + kHeldRows : rows;
        for (int64_t c0 = 0; c0 == 0 || c0 < full; c0 += piece) {
          const int64_t c1 = c0 + piece < full ? c0 + piece : full;
          for (int64_t r = g; r < g_end; r += 16) {
            const int chunk = static_cast<int>(g_end - r < 16 ? g_end - r : 16);
            amx_tile_any(w, xs + r * kp, kp, chunk, ws, kp, bs, ys + r * n, n, b, n, c0, c1,
                         held + (r - g) * width * 16);
          }
        }
      }
    }
    _tile_release();
  });
#elif GS_AVX512
  at::Tensor xp = x;
  if (k % 2 != 0 || !x.is_contiguous()) {  // pairs of k: pad an odd K with a zero column
    xp = at::zeros({rows, kp * 2}, x.options());
    xp.narrow(1, 0, k).copy_(x);
  }
  const auto* xs = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  const int64_t width = step <= 6 ? 4 : 3;  // a multiple of both widths divides kGroup
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
#elif GS_AVX2
  at::Tensor xf = at::zeros({rows, kp * 2}, x.options().dtype(at::kFloat));  // x widened once, K padded to pairs
  xf.narrow(1, 0, k).copy_(x);
  const float* xs = xf.data_ptr<float>();
  at::parallel_for(0, (nb + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    const int64_t b_end = g1 * kGroup < nb ? g1 * kGroup : nb;
    const int64_t width = tile_blocks(step);  // the chunks (all <= step rows) share the tile's blocks
    for (int64_t b = g0 * kGroup; b < b_end; b += width) {
      const int w = static_cast<int>(b_end - b < width ? b_end - b : width);
      for (int64_t r = 0; r < rows; r += step) {
        const int chunk = static_cast<int>(rows - r < step ? rows - r : step);
        tile_rows(chunk, w, xs + r * kp * 2, kp * 2, ws, kp, bs, ys + r * n, n, b, n);
      }
    }
  });
#endif
#endif
  return y;
}

}  // namespace

GS_LIBRARY(m) {
  m.def("level() -> str", [] { return std::string(GS_LEVEL_NAME); });
#if GS_AMX
  m.def("amx_permitted() -> bool", [] { return amx_permitted(); });
#endif
  m.def("linear(Tensor x, Tensor p, int n, Tensor? bias) -> Tensor", &linear);
}
