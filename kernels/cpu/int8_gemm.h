// An int8 GEMM for small row counts, at every level of graphspec's CPU backend: the int8 draft forward's
// products (int8_draft.cpp) and kernels.linear's Int8Weight. Header-only, so the extension that uses it
// inlines it. Also the helpers that the int4 GEMM (int4_gemm.h) shares: the activation rounding, the input
// checks, the row chunks and the tile loop.
//
// What it computes: int8 weights (symmetric, one fp32 scale per output row) times fp32 activations, each weight
// widened to fp32 in registers: y[m, n] = s_n * sum_k q[n, k] * x[m, k], fp32 sums. The activations are not rounded
// (int8_linear_prefill, at the end of this file, rounds a prefill's to bf16). Why: rounding them to 8 bits a row
// (what this GEMM did before, and what fbgemm does per call) made SmolLM2-135M a poor draft (its greedy choice
// agreed with its float self clearly less often), because real activations have outlier channels, far above the
// rest, that take a row's whole range; with the weights alone in int8 it stays a good draft
// (tests/models/test_draft_quality.py; figures in perf/RESULTS.md). A decode step reads one byte a weight either
// way, which is what bounds it; products of several rows cost more arithmetic than with 8-bit activations, a small
// part of a draft's time (its steps are mostly one row).
//
// Layout (pack_int8): an int8 [N, K] weight becomes blocks of 16 outputs, each [K, 16] (for each input k, the
// 16 outputs' weights side by side), zero padded to whole blocks; beside it the scales, padded the same way.
//
// Sums: each output is one fp32 sum over k = 0, 1, 2, ... in turn, then times its scale: nothing in that order
// depends on the other rows or the thread count. avx512 (16 lanes) and avx2 (8) add each product by an FMA, so
// they give the same bits; generic multiplies and adds (no FMA at its flags). None is torch's order, so the
// tests check each against kernels.linear.int8_linear_ref with a tolerance, and avx512 against avx2 exactly.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "level.h"

namespace graphspec_native {

constexpr int64_t kI8Block = 16;  // outputs per block
#if GS_AVX512
constexpr int kI8MaxRows = 6;  // rows per register tile: 6 x 1, 4 x 2, 2 x 4 or 1 x 8 zmm sums
#elif GS_AVX2
constexpr int kI8MaxRows = 4;  // 4 x 1, 2 x 2 or 1 x 4 blocks of two ymm sums
#else
constexpr int kI8MaxRows = 1;  // measured: GCC vectorizes the one-row loop at the baseline flags, not the others
#endif

inline bool have_int4() { return GS_HAVE_INT4 != 0; }  // int4_gemm.h at this level

// A packed int8 weight (see the layout above).
struct Int8Matrix {
  at::Tensor data;    // int8 [nb, K, 16]
  at::Tensor scales;  // fp32 [nb * 16], 0 past n
  int64_t n = 0, k = 0;

  int64_t blocks() const { return (n + kI8Block - 1) / kI8Block; }
};

// What pack_int8 and pack_int4 (int4_gemm.h) take: q int8 [N, K] (contiguous or not), N, K > 0, and N scales.
inline void check_pack_input(const at::Tensor& q, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(), what,
              ": the weight must be a 2-d int8 CPU tensor, got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == q.size(0), what, ": ", q.size(0), " rows but ",
              scales.numel(), " scales");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0, what, ": empty weight ", q.sizes());
}

// q: int8 [N, K] (contiguous or not), scales: [N] (any float dtype).
inline Int8Matrix pack_int8(const at::Tensor& q, const at::Tensor& scales) {
  check_pack_input(q, scales, "pack_int8");
  Int8Matrix m;
  m.n = q.size(0);
  m.k = q.size(1);
  const int64_t nb = m.blocks();
  at::Tensor padded = at::zeros({nb * kI8Block, m.k}, q.options());
  padded.narrow(0, 0, m.n).copy_(q);
  m.data = padded.view({nb, kI8Block, m.k}).permute({0, 2, 1}).contiguous();
  m.scales = at::zeros({nb * kI8Block}, q.options().dtype(at::kFloat));
  m.scales.narrow(0, 0, m.n).copy_(scales.to(at::kFloat));
  return m;
}

// Row m of x [rows, K] fp32 -> u8 [groups * 4] (padding: the zero point) and (scale, zero point): the int4 GEMM's
// activations, x ~ s * (u - z) over [min(x, 0), max(x, 0)] in 255 steps.
inline void quantize_row(const float* x, int64_t k, int64_t kpad, uint8_t* u, float* scale, int32_t* zero) {
  float lo = 0.f, hi = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float s = hi > lo ? (hi - lo) / 255.f : 1.f;
  const float inv = 1.f / s;
  const int32_t z = static_cast<int32_t>(std::nearbyint(-lo * inv));  // in [0, 255]: lo <= 0 <= hi
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(x[i] * inv) + static_cast<float>(z);
    u[i] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, v)));
  }
  for (int64_t i = k; i < kpad; ++i) u[i] = static_cast<uint8_t>(z);
  *scale = s;
  *zero = z;
}

#if GS_HAVE_VNNI

// acc += u8 x s8 in place (the int4 GEMM). The intrinsic (_mm512_dpbusd_epi32) returns a new value, and GCC 12
// then copied a tile's accumulators through the stack every step; the asm keeps each sum in its register.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// The outputs f .. f + 15 that exist (< n), as a store mask.
inline __mmask16 block_mask(int64_t f, int64_t n) {
  const int64_t valid = std::min<int64_t>(kI8Block, n - f);
  return valid == kI8Block ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

#endif  // GS_HAVE_VNNI

// y[m, f0 .. f0 + NB*16) for M rows of x (row stride ldx) and NB blocks from w (each [K, 16]), all loops over the
// sums fully unrolled (the pragmas): GCC keeps a sum indexed by a loop variable in memory, storing it every step.
template <int M, int NB>
inline void int8_tile(const float* __restrict x, int64_t ldx, const int8_t* __restrict w, int64_t k,
                      const float* __restrict ws, float* __restrict y, int64_t ldy, int64_t f0, int64_t n) {
#if GS_AVX512
  __m512 acc[M][NB];
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (j * k + i) * kI8Block));
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + i]), acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    if (f >= n) break;
    const __mmask16 mask = block_mask(f, n);
    const __m512 s = _mm512_loadu_ps(ws + f);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy + f, mask, _mm512_mul_ps(acc[m][j], s));
  }
#elif GS_AVX2
  __m256 acc[M][NB][2];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int8_t* wi = w + (j * k + i) * kI8Block;
      __m128i q0, q1;
      std::memcpy(&q0, wi, 8);  // the low 8 bytes of each (vmovq)
      std::memcpy(&q1, wi + 8, 8);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + i);
        acc[m][j][0] = _mm256_fmadd_ps(w0, xb, acc[m][j][0]);
        acc[m][j][1] = _mm256_fmadd_ps(w1, xb, acc[m][j][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    if (f >= n) break;
    const int64_t valid = std::min<int64_t>(kI8Block, n - f);
    const __m256 s0 = _mm256_loadu_ps(ws + f), s1 = _mm256_loadu_ps(ws + f + 8);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      alignas(32) float out[kI8Block];
      _mm256_store_ps(out, _mm256_mul_ps(acc[m][j][0], s0));
      _mm256_store_ps(out + 8, _mm256_mul_ps(acc[m][j][1], s1));
      std::memcpy(y + m * ldy + f, out, sizeof(float) * valid);
    }
  }
#else
  float acc[M][NB * kI8Block] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int j = 0; j < NB; ++j) {
      const int8_t* wi = w + (j * k + i) * kI8Block;
      float wf[kI8Block];  // widened once for all rows (the baseline instruction sets widen int8 slowly)
      for (int64_t o = 0; o < kI8Block; ++o) wf[o] = static_cast<float>(wi[o]);
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * ldx + i];
        float* a = acc[m] + j * kI8Block;
        for (int64_t o = 0; o < kI8Block; ++o) a[o] += wf[o] * xv;  // no FMA at this level
      }
    }
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    for (int64_t o = 0; o < kI8Block && f + o < n; ++o)
      for (int m = 0; m < M; ++m) y[m * ldy + f + o] = acc[m][j * kI8Block + o] * ws[f + o];
  }
#endif
}

// Blocks per tile for `rows` rows: enough independent sums to cover the FMA latency, few enough for the registers.
constexpr int64_t int8_tile_blocks(int64_t rows) {
#if GS_AVX512
  return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;
#else
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
#endif
}

inline void int8_tile_any(int rows, int nb, const float* x, int64_t ldx, const int8_t* w, int64_t k, const float* ws,
                          float* y, int64_t ldy, int64_t f0, int64_t n) {
  switch (rows * 16 + nb) {
#define GS_I8_TILE(R, B) \
  case R * 16 + B: int8_tile<R, B>(x, ldx, w, k, ws, y, ldy, f0, n); return;
    GS_I8_TILE(1, 1) GS_I8_TILE(1, 2) GS_I8_TILE(1, 3) GS_I8_TILE(1, 4) GS_I8_TILE(2, 1) GS_I8_TILE(2, 2)
    GS_I8_TILE(3, 1) GS_I8_TILE(4, 1)
#if GS_AVX512
    GS_I8_TILE(1, 5) GS_I8_TILE(1, 6) GS_I8_TILE(1, 7) GS_I8_TILE(1, 8) GS_I8_TILE(2, 3) GS_I8_TILE(2, 4)
    GS_I8_TILE(3, 2) GS_I8_TILE(4, 2) GS_I8_TILE(5, 1) GS_I8_TILE(6, 1)
#endif
#undef GS_I8_TILE
    default: TORCH_CHECK(false, "int8 GEMM: internal error, a ", rows, " x ", nb, " tile");
  }
}

// The checks both GEMMs (this file's, int4_gemm.h's) make of x before running: what = "int8 GEMM" etc.
inline void check_gemm_input(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), what,
              ": x must be a contiguous 2-d fp32 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == k, what, ": x has ", x.size(1), " columns, the weight ", k, " inputs");
}

// Rows per pass when a product has more rows than a register tile holds: equal chunks of at most max_rows,
// each tile multiplying every chunk in turn, so its weights are re-read from cache, not from memory.
inline int64_t chunk_rows(int64_t rows, int64_t max_rows) {
  const int64_t chunks = (rows + max_rows - 1) / max_rows;
  return (rows + chunks - 1) / chunks;
}

// fn(b0, tb, r, chunk) for every tile of the output (tb blocks from block b0; tiles split over torch's
// threads) and, within a tile, every chunk of rows r .. r + chunk - 1 in turn.
template <typename F>
inline void for_tiles_and_chunks(int64_t nb, int64_t tile_blocks, int64_t rows, int64_t step, const F& fn) {
  const int64_t tiles = (nb + tile_blocks - 1) / tile_blocks;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * tile_blocks;
      const int tb = static_cast<int>(std::min(tile_blocks, nb - b0));
      for (int64_t r = 0; r < rows; r += step) fn(b0, tb, r, static_cast<int>(std::min(step, rows - r)));
    }
  });
}

// y [rows, N] fp32 = x [rows, K] fp32 (contiguous) times the packed weight, as described above.
inline at::Tensor int8_linear(const at::Tensor& x, const Int8Matrix& w) {
  check_gemm_input(x, w.k, "int8 GEMM");
  const int64_t rows = x.size(0), n = w.n, k = w.k, nb = w.blocks();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // More rows than a register tile holds (a prefill) go in equal chunks; a tile's weights (a few blocks of
  // 16 outputs x K) stay in cache meanwhile.
  const int64_t step = chunk_rows(rows, kI8MaxRows);
  const int64_t width = int8_tile_blocks(step);
  const float* xp = x.data_ptr<float>();
  const int8_t* wd = w.data.data_ptr<int8_t>();
  const float* ws = w.scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A chunk has at most `step` rows, and int8_tile_blocks does not grow with the rows, so every chunk's tile
  // of tb <= width blocks exists.
  for_tiles_and_chunks(nb, width, rows, step, [&](int64_t b0, int tb, int64_t r, int chunk) {
    int8_tile_any(chunk, tb, xp + r * k, k, wd + b0 * k * kI8Block, k, ws, yp + r * n, n, b0 * kI8Block, n);
  });
  return y;
}


#if GS_AVX512
#define GS_HAVE_I8_PREFILL 1

// A prefill's int8 GEMM (int8_linear_prefill; the avx512 and amx levels): the same weights and scales, the
// activations rounded to bf16 (to nearest even) and the products added by vdpbf16ps, two inputs a step. Why: the
// fp32 GEMM above widens each weight to fp32 for an FMA, 16 products an instruction, so a product of more than
// two rows is bound by arithmetic, not by its bytes, and a draft's prefill of a long prompt took about twice as
// long a token as the same model's bf16 prefill. vdpbf16ps makes 32 products an instruction; an int8 weight is
// exact in bf16, and a bf16 x int8 product exact in fp32, so the only new rounding is x's (8 significant bits,
// as a bf16 model's activations). A draft may compute anything without breaking losslessness; its forward takes
// this path for a whole prefill only (int8_draft.cpp), so a sequence's bits still depend on its own rows alone.
//
// How: each tile of up to kI8PrefillBlocks blocks widens its weights once into a buffer of bf16 pairs in the
// bf16 linear's layout ([blocks, K/2, 16, 2]; linear.cpp), then multiplies every chunk of up to
// kI8PrefillRows rows of x with it from cache: the bf16 linear's register tile, fp32 sums per output in k order.
constexpr int kI8PrefillRows = 6;    // rows per register tile: 6 x 4 zmm sums
constexpr int kI8PrefillBlocks = 4;  // blocks per tile

// Rows of x [rows, k] fp32 -> [rows, kp] bf16 pairs (kp = ceil(k / 2), the last pair's odd half 0 for an odd k),
// rounded to nearest even by vcvtneps2bf16.
inline void round_rows_bf16(const float* x, int64_t rows, int64_t k, uint16_t* out, int64_t kp) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      const float* xr = x + m * k;
      uint16_t* o = out + m * 2 * kp;
      for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mask = block_mask(i, k);  // the inputs i .. i + 15 that exist
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, xr + i));
        _mm256_mask_storeu_epi16(o + i, mask, (__m256i)b);
      }
      if (k & 1) o[k] = 0;
    }
  });
}

// Blocks b0 .. b0 + tb - 1 of the packed int8 weight ([K, 16] each) -> bf16 pairs [tb, kp, 16] (uint32: input 2p
// in the low half, 2p + 1 in the high half, 0 past K). An int8 value's fp32 form has 16 zero low bits, so its
// top 16 bits are its exact bf16.
inline void widen_blocks_bf16(const int8_t* w, int64_t k, int64_t kp, int tb, uint32_t* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < tb; ++j) {
    const int8_t* wb = w + j * k * kI8Block;
    uint32_t* ob = out + j * kp * kI8Block;
    for (int64_t p = 0; p < kp; ++p) {
      const int8_t* w0 = wb + 2 * p * kI8Block;
      const __m512i e = _mm512_castps_si512(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0)))));
      __m512i o = _mm512_setzero_si512();
      if (2 * p + 1 < k)
        o = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + kI8Block)))));
      _mm512_storeu_si512(ob + p * kI8Block, _mm512_or_si512(_mm512_srli_epi32(e, 16), _mm512_and_si512(o, high)));
    }
  }
}

// y[m, f0 .. f0 + NB*16) for M rows of x (bf16 pairs, row stride ldx) and NB blocks of widened weights (each
// [kp, 16] pairs), times the scales.
template <int M, int NB>
inline void int8_prefill_tile(const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict w, int64_t kp,
                              const float* __restrict ws, float* __restrict y, int64_t ldy, int64_t f0, int64_t n) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + (j * kp + p) * kI8Block);
    for (int m = 0; m < M; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[m * ldx + p]));
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)wv[j], (__m512bh)xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    if (f >= n) break;
    const __mmask16 mask = block_mask(f, n);
    const __m512 s = _mm512_loadu_ps(ws + f);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy + f, mask, _mm512_mul_ps(acc[j][m], s));
  }
}

inline void int8_prefill_tile_any(int rows, int nb, const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t kp,
                                  const float* ws, float* y, int64_t ldy, int64_t f0, int64_t n) {
  switch (rows * 8 + nb) {
#define GS_I8P_TILE(R, B) \
  case R * 8 + B: int8_prefill_tile<R, B>(x, ldx, w, kp, ws, y, ldy, f0, n); return;
#define GS_I8P_ROWS(R) GS_I8P_TILE(R, 1) GS_I8P_TILE(R, 2) GS_I8P_TILE(R, 3) GS_I8P_TILE(R, 4)
    GS_I8P_ROWS(1) GS_I8P_ROWS(2) GS_I8P_ROWS(3) GS_I8P_ROWS(4) GS_I8P_ROWS(5) GS_I8P_ROWS(6)
#undef GS_I8P_ROWS
#undef GS_I8P_TILE
    default: TORCH_CHECK(false, "int8 prefill GEMM: internal error, a ", rows, " x ", nb, " tile");
  }
}

// y [rows, N] fp32 = x [rows, K] fp32 (contiguous), rounded to bf16, times the packed weight, as described above.
inline at::Tensor int8_linear_prefill(const at::Tensor& x, const Int8Matrix& w) {
  check_gemm_input(x, w.k, "int8 prefill GEMM");
  const int64_t rows = x.size(0), n = w.n, k = w.k, nb = w.blocks(), kp = (k + 1) / 2;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  std::vector<uint32_t> xb(static_cast<size_t>(rows * kp));
  round_rows_bf16(x.data_ptr<float>(), rows, k, reinterpret_cast<uint16_t*>(xb.data()), kp);
  const int64_t step = chunk_rows(rows, kI8PrefillRows);
  const int8_t* wd = w.data.data_ptr<int8_t>();
  const float* ws = w.scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (nb + kI8PrefillBlocks - 1) / kI8PrefillBlocks;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> wb(static_cast<size_t>(kI8PrefillBlocks * kp * kI8Block));  // this thread's tile
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * kI8PrefillBlocks;
      const int tb = static_cast<int>(std::min<int64_t>(kI8PrefillBlocks, nb - b0));
      widen_blocks_bf16(wd + b0 * k * kI8Block, k, kp, tb, wb.data());
      for (int64_t r = 0; r < rows; r += step)
        int8_prefill_tile_any(static_cast<int>(std::min(step, rows - r)), tb, xb.data() + r * kp, kp, wb.data(), kp,
                              ws, yp + r * n, n, b0 * kI8Block, n);
    }
  });
  return y;
}
#else
#define GS_HAVE_I8_PREFILL 0
#endif  // GS_AVX512

}  // namespace graphspec_native
