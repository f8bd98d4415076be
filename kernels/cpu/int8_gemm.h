// An int8 GEMM for small row counts, at every level of graphspec's CPU backend: the int8 draft forward's
// products (int8_draft.cpp) and kernels.linear's Int8Weight. Header-only, so the extension that uses it
// inlines it.
//
// Why: torch's dynamic int8 linear (fbgemm) read the draft's weights well below the memory bandwidth, and on
// CPUs without VNNI it multiplies u8 x s8 pairs with vpmaddubsw, whose 16-bit pair sums saturate: real drafts
// computed garbage there. This loop reads each weight once, as one contiguous stream per tile, and multiplies
// it with a few rows held in registers. avx512: vpdpbusd (u8 x s8 -> int32, four products a lane), tiles of 64
// outputs, up to 6 rows. avx2: weights and activations widened to int16 and multiplied by vpmaddwd (int16 pairs
// -> int32: no saturation), tiles of 16 outputs, up to 2 rows. generic: plain int32 loops.
//
// Layout (pack_int8): an int8 [N, K] weight (symmetric, one fp32 scale per output row) becomes tiles of up to
// kI8TileBlocks blocks of 16 outputs; a tile of nb blocks stores, for each group of 4 inputs k .. k+3, the
// nb * 16 outputs' 4 weights side by side ([ceil(K / 4), nb * 16, 4], zero padded), tiles back to back. Beside
// it: the row sums of the int8 weights (int32) and the scales, both padded to whole blocks.
//
// Numerics: each row of x is quantized on its own to u8 with a zero point, x ~ s * (u - z), over
// [min(x, 0), max(x, 0)] in 255 steps. Then y[m, n] = s_m * w_n * (sum_k u[m, k] * q[n, k] - z_m * rowsum_n)
// with the int32 sum exact and the same fp32 operations after it at every level, so every level gives the same
// bits, and a row's result does not depend on the other rows or the thread count. This is a draft's GEMM:
// approximate (int8), which speculative decoding allows; the tests check it against the same quantization done
// in torch (kernels.linear.int8_linear_ref), bit for bit.

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

constexpr int64_t kI8Block = 16;     // outputs per block: one zmm of int32 sums
#if GS_AVX512
constexpr int64_t kI8TileBlocks = 4;  // blocks per tile (64 outputs)
constexpr int kI8MaxRows = 6;         // rows per register tile: 6 x 4 sums + 4 weights + 1 broadcast = 29 zmm
#elif GS_AVX2
constexpr int64_t kI8TileBlocks = 1;  // one block of 16 outputs: 4 ymm of pair sums a row
constexpr int kI8MaxRows = 2;         // 2 x 4 sums + 2 broadcasts + 1 weight of the 16 ymm
#else
constexpr int64_t kI8TileBlocks = 1;
constexpr int kI8MaxRows = 4;
#endif

inline bool have_vnni() { return GS_HAVE_VNNI != 0; }

// A packed int8 weight (see the layout above).
struct Int8Matrix {
  at::Tensor data;      // int8, the tiles back to back
  at::Tensor scales;    // fp32 [nb * 16], 0 past n
  at::Tensor rowsums;   // int32 [nb * 16], 0 past n
  int64_t n = 0, k = 0;

  int64_t blocks() const { return (n + kI8Block - 1) / kI8Block; }
  int64_t groups() const { return (k + 3) / 4; }  // groups of 4 inputs
};

// What pack_int8 and pack_int4 (_int4_gemm.h) take: q int8 [N, K] (contiguous or not), N, K > 0, and N scales.
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
  const int64_t nb = m.blocks(), kq = m.groups();
  at::Tensor padded = at::zeros({nb * kI8Block, kq * 4}, q.options());
  padded.narrow(0, 0, m.n).narrow(1, 0, m.k).copy_(q);
  m.data = at::empty({nb * kI8Block * kq * 4}, q.options());
  for (int64_t b0 = 0, off = 0; b0 < nb; b0 += kI8TileBlocks) {
    const int64_t tb = std::min(kI8TileBlocks, nb - b0);
    const at::Tensor t = padded.narrow(0, b0 * kI8Block, tb * kI8Block).view({tb * kI8Block, kq, 4}).permute({1, 0, 2});
    m.data.narrow(0, off, t.numel()).view({kq, tb * kI8Block, 4}).copy_(t);
    off += t.numel();
  }
  m.scales = at::zeros({nb * kI8Block}, q.options().dtype(at::kFloat));
  m.scales.narrow(0, 0, m.n).copy_(scales.to(at::kFloat));
  m.rowsums = at::zeros({nb * kI8Block}, q.options().dtype(at::kInt));
  m.rowsums.narrow(0, 0, m.n).copy_(q.to(at::kInt).sum(1));
  return m;
}

// Row m of x [rows, K] fp32 -> u8 [groups * 4] (padding: the zero point) and (scale, zero point).
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

// acc += u8 x s8 in place. The intrinsic (_mm512_dpbusd_epi32) returns a new value, and GCC 12 then copies
// the 24 accumulators of a 6-row tile through the stack every step (measured: 6-row products at half speed);
// the asm keeps each sum in its register.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// The outputs f .. f + 15 that exist (< n), as a store mask.
inline __mmask16 block_mask(int64_t f, int64_t n) {
  const int64_t valid = std::min<int64_t>(kI8Block, n - f);
  return valid == kI8Block ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

// y[m, f0 .. f0 + NB*16) for M rows of u (kq uint32 groups each, row stride ldu) and a tile of NB blocks.
template <int M, int NB>
inline void int8_tile(const uint32_t* u, int64_t ldu, const int8_t* w, int64_t kq, const float* xs,
                      const int32_t* xz, const float* ws, const int32_t* rs, float* y, int64_t ldy, int64_t f0,
                      int64_t n) {
  __m512i acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_si512();
  const __m512i* wp = reinterpret_cast<const __m512i*>(w);
  for (int64_t g = 0; g < kq; ++g) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wp + g * NB + j);
    for (int m = 0; m < M; ++m) {
      const __m512i ub = _mm512_set1_epi32(static_cast<int>(u[m * ldu + g]));
      for (int j = 0; j < NB; ++j) acc[j][m] = dpbusd(acc[j][m], ub, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    const __mmask16 mask = block_mask(f, n);
    const __m512 wsv = _mm512_loadu_ps(ws + f);
    const __m512i rsv = _mm512_loadu_si512(rs + f);
    for (int m = 0; m < M; ++m) {
      const __m512i zr = _mm512_mullo_epi32(rsv, _mm512_set1_epi32(xz[m]));
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j][m], zr));
      _mm512_mask_storeu_ps(y + m * ldy + f, mask, _mm512_mul_ps(_mm512_mul_ps(v, wsv), _mm512_set1_ps(xs[m])));
    }
  }
}

inline void int8_tile_any(int rows, int nb, const uint32_t* u, int64_t ldu, const int8_t* w, int64_t kq,
                          const float* xs, const int32_t* xz, const float* ws, const int32_t* rs, float* y,
                          int64_t ldy, int64_t f0, int64_t n) {
  switch (rows * 8 + nb) {
#define GS_I8_TILE(R, B) \
  case R * 8 + B: int8_tile<R, B>(u, ldu, w, kq, xs, xz, ws, rs, y, ldy, f0, n); return;
#define GS_I8_ROWS(R) GS_I8_TILE(R, 1) GS_I8_TILE(R, 2) GS_I8_TILE(R, 3) GS_I8_TILE(R, 4)
    GS_I8_ROWS(1) GS_I8_ROWS(2) GS_I8_ROWS(3) GS_I8_ROWS(4) GS_I8_ROWS(5) GS_I8_ROWS(6)
#undef GS_I8_ROWS
#undef GS_I8_TILE
    default: TORCH_CHECK(false, "int8 GEMM: internal error, a ", rows, " x ", nb, " tile");
  }
}

#endif  // GS_HAVE_VNNI

// The float work after the exact integer sums, the same operations at every level: v = acc - z * rowsum as
// fp32 (nearest even), then (v * w_scale) * x_scale.
inline float int8_epilogue(int32_t acc, int32_t z, int32_t rowsum, float w_scale, float x_scale) {
  return (static_cast<float>(acc - z * rowsum) * w_scale) * x_scale;
}

#if GS_AVX2

// y[m, f0 .. f0 + 16) for M rows and one block: u16 holds each row's groups of 4 u8 widened to 4 int16 (ldu a
// row); w the block's [kq, 16, 4] int8 weights.
template <int M>
inline void int8_tile_avx2(const uint64_t* u16, int64_t ldu, const int8_t* w, int64_t kq, const float* xs,
                           const int32_t* xz, const float* ws, const int32_t* rs, float* y, int64_t ldy, int64_t f0,
                           int64_t n) {
  __m256i acc[M][4];  // acc[m][q]: outputs 4q .. 4q + 3, two partial sums each
#pragma GCC unroll 2
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_setzero_si256();
  // Fully unrolled (the pragmas): a sum indexed by a loop variable stays in memory (a load and a store a step).
  for (int64_t g = 0; g < kq; ++g) {
    __m256i ub[M];
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m) ub[m] = _mm256_set1_epi64x(static_cast<long long>(u16[m * ldu + g]));
    const int8_t* wg = w + g * kI8Block * 4;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256i wq = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16 * q)));
#pragma GCC unroll 2
      for (int m = 0; m < M; ++m) acc[m][q] = _mm256_add_epi32(acc[m][q], _mm256_madd_epi16(wq, ub[m]));
    }
  }
  const int64_t valid = std::min<int64_t>(kI8Block, n - f0);
#pragma GCC unroll 2
  for (int m = 0; m < M; ++m) {
    alignas(32) float out[kI8Block];
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      // hadd within 128-bit lanes gives outputs (0 1 4 5 | 2 3 6 7) of these 8; the permute puts them in order
      const __m256i s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m][2 * half], acc[m][2 * half + 1]), 0xD8);
      const int64_t f = f0 + 8 * half;
      const __m256i zr = _mm256_mullo_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs + f)),
                                            _mm256_set1_epi32(xz[m]));
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(s, zr));
      _mm256_store_ps(out + 8 * half, _mm256_mul_ps(_mm256_mul_ps(v, _mm256_loadu_ps(ws + f)), _mm256_set1_ps(xs[m])));
    }
    std::memcpy(y + m * ldy + f0, out, sizeof(float) * valid);
  }
}

#endif  // GS_AVX2

// The generic level: the same sums as plain loops.
template <int M>
inline void int8_tile_generic(const uint8_t* u, int64_t ldu, const int8_t* w, int64_t kq, const float* xs,
                              const int32_t* xz, const float* ws, const int32_t* rs, float* y, int64_t ldy, int64_t f0,
                              int64_t n) {
  int32_t acc[M][kI8Block] = {};
  for (int64_t g = 0; g < kq; ++g) {
    const int8_t* wg = w + g * kI8Block * 4;
    for (int m = 0; m < M; ++m) {
      const uint8_t* ug = u + m * ldu + 4 * g;
      for (int64_t o = 0; o < kI8Block; ++o)
        for (int j = 0; j < 4; ++j) acc[m][o] += static_cast<int32_t>(ug[j]) * static_cast<int32_t>(wg[o * 4 + j]);
    }
  }
  const int64_t valid = std::min<int64_t>(kI8Block, n - f0);
  for (int m = 0; m < M; ++m)
    for (int64_t o = 0; o < valid; ++o)
      y[m * ldy + f0 + o] = int8_epilogue(acc[m][o], xz[m], rs[f0 + o], ws[f0 + o], xs[m]);
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
  const int64_t rows = x.size(0), n = w.n, kq = w.groups(), nb = w.blocks();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  std::vector<uint32_t> u(static_cast<size_t>(rows * kq));
  std::vector<float> xs(rows);
  std::vector<int32_t> xz(rows);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    quantize_row(xp + m * w.k, w.k, kq * 4, reinterpret_cast<uint8_t*>(u.data() + m * kq), &xs[m], &xz[m]);
  // More rows than a register tile holds (a prefill) go in equal chunks: a tile's weights (16 or 64 outputs x K)
  // stay in cache meanwhile.
  const int64_t step = chunk_rows(rows, kI8MaxRows);
  const int8_t* wd = w.data.data_ptr<int8_t>();
  const float* ws = w.scales.data_ptr<float>();
  const int32_t* rs = w.rowsums.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
#if GS_HAVE_VNNI
  for_tiles_and_chunks(nb, kI8TileBlocks, rows, step, [&](int64_t b0, int tb, int64_t r, int chunk) {
    int8_tile_any(chunk, tb, u.data() + r * kq, kq, wd + b0 * kI8Block * kq * 4, kq, xs.data() + r, xz.data() + r,
                  ws, rs, yp + r * n, n, b0 * kI8Block, n);
  });
#elif GS_AVX2
  std::vector<uint64_t> u16(static_cast<size_t>(rows * kq));  // each group's 4 u8 as 4 int16
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(u.data());
  for (int64_t i = 0; i < rows * kq; ++i)
    u16[i] = static_cast<uint64_t>(ub[4 * i]) | static_cast<uint64_t>(ub[4 * i + 1]) << 16 |
             static_cast<uint64_t>(ub[4 * i + 2]) << 32 | static_cast<uint64_t>(ub[4 * i + 3]) << 48;
  for_tiles_and_chunks(nb, kI8TileBlocks, rows, step, [&](int64_t b0, int, int64_t r, int chunk) {
    const int8_t* wt = wd + b0 * kI8Block * kq * 4;
    const uint64_t* ur = u16.data() + r * kq;
    float* yr = yp + r * n;
    if (chunk == 2)
      int8_tile_avx2<2>(ur, kq, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, b0 * kI8Block, n);
    else
      int8_tile_avx2<1>(ur, kq, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, b0 * kI8Block, n);
  });
#else
  for_tiles_and_chunks(nb, kI8TileBlocks, rows, step, [&](int64_t b0, int, int64_t r, int chunk) {
    const int8_t* wt = wd + b0 * kI8Block * kq * 4;
    const uint8_t* ur = reinterpret_cast<const uint8_t*>(u.data() + r * kq);
    const int64_t ldu = kq * 4, f0 = b0 * kI8Block;
    float* yr = yp + r * n;
    switch (chunk) {
      case 4: int8_tile_generic<4>(ur, ldu, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, f0, n); break;
      case 3: int8_tile_generic<3>(ur, ldu, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, f0, n); break;
      case 2: int8_tile_generic<2>(ur, ldu, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, f0, n); break;
      default: int8_tile_generic<1>(ur, ldu, wt, kq, xs.data() + r, xz.data() + r, ws, rs, yr, n, f0, n); break;
    }
  });
#endif
  return y;
}

}  // namespace graphspec_native
