// An int8 GEMM for small row counts on CPUs with AVX-512 VNNI: the int8 draft forward's products
// (models/int8_native.cpp). Header-only, so the extension that uses it inlines it.
//
// Why: fbgemm's dynamic int8 linear (what torch.ops.quantized.linear_dynamic and the draft forward called)
// read the draft's weights at 13-16 GB/s on one core of the AMD EPYC (Zen 4), where a plain stream reads
// 22-28 GB/s; its 6-row products cost 1.2-1.5x its 1-row ones. This loop reads each weight once, as one
// contiguous stream per tile of 64 outputs, and multiplies it with up to 6 rows held in registers
// (vpdpbusd: u8 x s8 -> int32, four products a lane). perf/RESULTS.md section R has the measurements.
//
// Layout (pack_int8): an int8 [N, K] weight (symmetric, one fp32 scale per output row) becomes tiles of up to
// 4 blocks of 16 outputs; a tile of nb blocks stores, for each group of 4 inputs k .. k+3, the nb * 16 outputs'
// 4 weights side by side ([ceil(K / 4), nb * 16, 4], zero padded), tiles back to back. Beside it: the row sums
// of the int8 weights (int32) and the scales, both padded to whole blocks.
//
// Numerics: each row of x is quantized on its own to u8 with a zero point, x ~ s * (u - z), over
// [min(x, 0), max(x, 0)] in 255 steps (8 bits; fbgemm's dynamic path uses one scale for all rows and 7 bits
// to keep its int16 pairs from saturating, which vpdpbusd's int32 sums do not need). Then
// y[m, n] = s_m * w_n * (sum_k u[m, k] * q[n, k] - z_m * rowsum_n), the int32 sum exact. A row's result
// does not depend on the other rows or the thread count. This is a draft's GEMM: approximate (int8), which
// speculative decoding allows; the tests check it against the same quantization done in torch.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GS_HAVE_VNNI 1
#else
#define GS_HAVE_VNNI 0
#endif

namespace graphspec_native {

constexpr int64_t kI8Block = 16;     // outputs per block: one zmm of int32 sums
constexpr int64_t kI8TileBlocks = 4;  // blocks per tile (64 outputs)
constexpr int kI8MaxRows = 6;        // rows per register tile: 6 x 4 sums + 4 weights + 1 broadcast = 29 zmm

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

// The checks both GEMMs (this file's, _int4_gemm.h's) make of x before running: what = "int8 GEMM" etc.
inline void check_gemm_input(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(have_vnni(), what, ": built without AVX-512 VNNI (this CPU or compiler lacks it)");
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
#if GS_HAVE_VNNI
  std::vector<uint32_t> u(static_cast<size_t>(rows * kq));
  std::vector<float> xs(rows);
  std::vector<int32_t> xz(rows);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    quantize_row(xp + m * w.k, w.k, kq * 4, reinterpret_cast<uint8_t*>(u.data() + m * kq), &xs[m], &xz[m]);
  // More than 6 rows (a prefill) go in equal chunks: a tile's weights (64 outputs x K, at most 570 KB for
  // K = 8960) stay in cache meanwhile.
  const int64_t step = chunk_rows(rows, kI8MaxRows);
  const int8_t* wd = w.data.data_ptr<int8_t>();
  const float* ws = w.scales.data_ptr<float>();
  const int32_t* rs = w.rowsums.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  for_tiles_and_chunks(nb, kI8TileBlocks, rows, step, [&](int64_t b0, int tb, int64_t r, int chunk) {
    int8_tile_any(chunk, tb, u.data() + r * kq, kq, wd + b0 * kI8Block * kq * 4, kq, xs.data() + r, xz.data() + r,
                  ws, rs, yp + r * n, n, b0 * kI8Block, n);
  });
#endif
  return y;
}

}  // namespace graphspec_native
