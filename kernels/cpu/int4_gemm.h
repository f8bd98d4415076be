// An int4 GEMM (4-bit weights in groups of 64 inputs, 8-bit activations) for small row counts at the avx512
// (AVX-512 VNNI) and avx2 levels: the int8 draft forward's layer products where a draft is asked to run in 4 bits
// (int8_draft.cpp, set_gemm("int4")). Header-only, beside int8_gemm.h, whose activation
// rounding it shares.
//
// Why: a draft forward on one core is a stream of its weights (each one-token step reads every weight once, so
// its time is its bytes over the memory bandwidth). In 4 bits, with one fp32 scale per 64 weights, the
// stream is 0.5625 bytes a weight instead of 1. A draft may compute anything without breaking losslessness;
// what 4 bits cost is acceptance (perf/RESULTS.md has both).
//
// Weights (pack_int4): made from the int8 weight (symmetric, one scale s_r per output row) by rounding each
// group of 64 inputs of a row again: m = max |q8| over the group, the group's scale s_r * m / 7, q4 =
// round(q8 * 7 / m) (halves away from zero, in integers) in [-7, 7], exact where a group's int8 values are
// already multiples of m / 7. Stored as w' = q4 + 8 in [0, 15], two to a byte. Layout: tiles of up to 2 blocks of 16 outputs; a tile of nb blocks
// holds, for each group g, for each pair p (0..7) of 4-input groups, for each block, 64 bytes: byte o * 4 + i
// has input g * 64 + 8p + i of output o in its low nibble and input g * 64 + 8p + 4 + i in its high nibble.
// Scales beside it, in the same tile order ([groups, nb * 16] a tile).
//
// Sums: with each row of x rounded as in int8_gemm.h (x ~ s_x * (u - z)),
//   y[m, n] = s_x * (sum_g s[g, n] * (A[g, m, n] - 8 * U[g, m]) - z * R[n]),
// A the int32 sum of u * w' over the group (vpdpbusd; at avx2 vpmaddubsw pair sums added in int16, then
// vpmaddwd: the same integers), U the sum of the row's u over the group, R[n] =
// sum_g s[g, n] * Q[g, n] with Q the sum of the group's q4. Each group's int32 sum is exact; the groups are
// added in fp32 in a fixed order, so a row's result does not depend on the other rows or the thread count.

#pragma once

#include <ATen/Parallel.h>

#include "int8_gemm.h"

namespace graphspec_native {

constexpr int64_t kI4Group = 64;       // inputs per scale
constexpr int64_t kI4TileBlocks = 2;   // blocks per tile (32 outputs)
#if GS_AVX512
constexpr int kI4MaxRows = 4;          // 4 rows x 2 blocks x (2 int32 + 1 fp32 sums) = 24 zmm, + 4 weights, 2 broadcasts
#else
constexpr int kI4MaxRows = 3;          // avx2, 8 outputs at a time: 3 rows x (int16, int32, fp32 sums) + 6 = 15 ymm
#endif

// A packed int4 weight (see the layout above).
struct Int4Matrix {
  at::Tensor data;    // uint8, the tiles back to back
  at::Tensor scales;  // fp32, [groups, nb * 16] a tile, tiles back to back; 0 past n
  at::Tensor zsum;    // fp32 [blocks * 16]: R above, 0 past n
  int64_t n = 0, k = 0;

  int64_t blocks() const { return (n + kI8Block - 1) / kI8Block; }
  int64_t groups() const { return (k + kI4Group - 1) / kI4Group; }
};

// q: int8 [N, K] (as pack_int8 takes it), scales: [N] per output row. Rounds again to 4 bits (above), one pass
// over the rows in plain loops, split between torch's threads (each output row is written by one thread).
inline Int4Matrix pack_int4(const at::Tensor& q, const at::Tensor& scales) {
  check_pack_input(q, scales, "pack_int4");
  Int4Matrix m;
  m.n = q.size(0);
  m.k = q.size(1);
  const int64_t nb = m.blocks(), G = m.groups(), rows = nb * kI8Block, n = m.n, k = m.k;
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  m.data = at::empty({rows * G * kI4Group / 2}, q.options().dtype(at::kByte));
  m.scales = at::empty({rows * G}, q.options().dtype(at::kFloat));
  m.zsum = at::empty({rows}, q.options().dtype(at::kFloat));
  uint8_t* dp = m.data.data_ptr<uint8_t>();
  float* gp = m.scales.data_ptr<float>();
  float* zp = m.zsum.data_ptr<float>();
  at::parallel_for(0, rows, kI8Block, [&](int64_t r0, int64_t r1) {
    int v[kI4Group], q4[kI4Group];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / kI8Block, t0 = b / kI4TileBlocks * kI4TileBlocks;  // its block and its tile's first
      const int64_t tb = std::min(kI4TileBlocks, nb - t0), tr = r - t0 * kI8Block;  // the tile's blocks, row in it
      uint8_t* tile = dp + t0 * kI8Block * G * kI4Group / 2;  // [G, 8 pairs, tb * 16 rows, 4 bytes]
      float* tsc = gp + t0 * kI8Block * G;                     // [G, tb * 16]
      const float s_r = r < n ? sp[r] : 0.0f;
      double z = 0.0;  // R, summed in double and rounded once: y subtracts z * R from the groups' sum
      for (int64_t g = 0; g < G; ++g) {
        int mx = 0;
        for (int i = 0; i < kI4Group; ++i) {
          const int64_t col = g * kI4Group + i;
          v[i] = r < n && col < k ? qp[r * k + col] : 0;
          mx = std::max(mx, std::abs(v[i]));
        }
        // q4 = round(q8 * 7 / m), halves away from zero, in integers (exact, so tests can redo it): |q4| <= 7
        const int den = 2 * std::max(mx, 1);
        int qsum = 0;
        for (int i = 0; i < kI4Group; ++i) {
          q4[i] = (std::abs(v[i]) * 14 + den / 2) / den * ((v[i] > 0) - (v[i] < 0));
          qsum += q4[i];
        }
        const float gs = s_r * static_cast<float>(mx) / 7.0f;  // the group's scale
        tsc[g * tb * kI8Block + tr] = gs;
        z += static_cast<double>(gs) * qsum;
        for (int p = 0; p < 8; ++p)
          for (int i = 0; i < 4; ++i)
            tile[((g * 8 + p) * tb * kI8Block + tr) * 4 + i] =
                static_cast<uint8_t>((q4[8 * p + i] + 8) | ((q4[8 * p + 4 + i] + 8) << 4));
      }
      zp[r] = static_cast<float>(z);  // 0 past n
    }
  });
  return m;
}

#if GS_HAVE_VNNI

// y[m, f0 .. f0 + NB*16) for M rows of u (groups * 16 uint32 each, row stride ldu; us: the rows' u sums per
// group, stride ldus) and a tile of NB blocks (its weights w, its scales sc).
template <int M, int NB>
inline void int4_tile(const uint32_t* u, int64_t ldu, const int32_t* us, int64_t ldus, const uint8_t* w,
                      const float* sc, int64_t groups, const float* xs, const int32_t* xz, const float* zs, float* y,
                      int64_t ldy, int64_t f0, int64_t n) {
  __m512 facc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < M; ++r) facc[j][r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i* wp = reinterpret_cast<const __m512i*>(w);
  for (int64_t g = 0; g < groups; ++g) {
    // low and high nibbles into separate sums: two chains of 8 vpdpbusd a group, not one of 16
    __m512i alo[NB][M], ahi[NB][M];
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < M; ++r) alo[j][r] = ahi[j][r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      __m512i lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_loadu_si512(wp + (g * 8 + p) * NB + j);
        lo[j] = _mm512_and_si512(v, nib);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int r = 0; r < M; ++r) {
        const uint32_t* ur = u + r * ldu + g * 16 + 2 * p;
        const __m512i ul = _mm512_set1_epi32(static_cast<int>(ur[0]));
        const __m512i uh = _mm512_set1_epi32(static_cast<int>(ur[1]));
        for (int j = 0; j < NB; ++j) {
          alo[j][r] = dpbusd(alo[j][r], ul, lo[j]);
          ahi[j][r] = dpbusd(ahi[j][r], uh, hi[j]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 s = _mm512_loadu_ps(sc + (g * NB + j) * kI8Block);
      for (int r = 0; r < M; ++r) {
        const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(alo[j][r], ahi[j][r]),
                                           _mm512_set1_epi32(8 * us[r * ldus + g]));
        facc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, facc[j][r]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t f = f0 + j * kI8Block;
    const __mmask16 mask = block_mask(f, n);
    const __m512 zv = _mm512_loadu_ps(zs + f);
    for (int r = 0; r < M; ++r) {
      const __m512 v = _mm512_fnmadd_ps(zv, _mm512_set1_ps(static_cast<float>(xz[r])), facc[j][r]);
      _mm512_mask_storeu_ps(y + r * ldy + f, mask, _mm512_mul_ps(v, _mm512_set1_ps(xs[r])));
    }
  }
}

inline void int4_tile_any(int rows, int nb, const uint32_t* u, int64_t ldu, const int32_t* us, int64_t ldus,
                          const uint8_t* w, const float* sc, int64_t groups, const float* xs, const int32_t* xz,
                          const float* zs, float* y, int64_t ldy, int64_t f0, int64_t n) {
  switch (rows * 8 + nb) {
#define GS_I4_TILE(R, B) \
  case R * 8 + B: int4_tile<R, B>(u, ldu, us, ldus, w, sc, groups, xs, xz, zs, y, ldy, f0, n); return;
#define GS_I4_ROWS(R) GS_I4_TILE(R, 1) GS_I4_TILE(R, 2)
    GS_I4_ROWS(1) GS_I4_ROWS(2) GS_I4_ROWS(3) GS_I4_ROWS(4)
#undef GS_I4_ROWS
#undef GS_I4_TILE
    default: TORCH_CHECK(false, "int4 GEMM: internal error, a ", rows, " x ", nb, " tile");
  }
}

#elif GS_AVX2

// avx2: 8 outputs (half a block) at a time. vpmaddubsw of u (unsigned) and w' (0..15) gives int16 pair sums of at
// most 2 * 255 * 15 = 7650; the low and high nibbles of two pairs p (4 x 7650 = 30600) add in int16, then vpmaddwd
// with ones widens them to int32: the group's exact A, so each output gets the avx512 level's fp32 operations on the
// same integers, and the same bits.
template <int M>
inline void int4_half(const uint32_t* u, int64_t ldu, const int32_t* us, int64_t ldus, const uint8_t* w, int nb,
                      int j, int h, const float* sc, int64_t groups, const float* xs, const int32_t* xz,
                      const float* zs, float* y, int64_t ldy, int64_t f, int64_t n) {
  __m256 facc[M];
  for (int r = 0; r < M; ++r) facc[r] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int pc = 0; pc < 8; pc += 2) {
      __m256i a16[M];
      for (int r = 0; r < M; ++r) a16[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int p = pc; p < pc + 2; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((g * 8 + p) * nb + j) * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int r = 0; r < M; ++r) {
          const uint32_t* ur = u + r * ldu + g * 16 + 2 * p;
          a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(_mm256_set1_epi32(static_cast<int>(ur[0])), lo));
          a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(_mm256_set1_epi32(static_cast<int>(ur[1])), hi));
        }
      }
      for (int r = 0; r < M; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(a16[r], ones));
    }
    const __m256 s = _mm256_loadu_ps(sc + (g * nb + j) * kI8Block + 8 * h);
    for (int r = 0; r < M; ++r) {
      const __m256i a = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(8 * us[r * ldus + g]));
      facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), s, facc[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(8, n - f);  // outputs f .. f + 7 that exist
  const __m256 zv = _mm256_loadu_ps(zs + f);           // zs has a value (0) up to the block's end
  for (int r = 0; r < M; ++r) {
    const __m256 v = _mm256_fnmadd_ps(zv, _mm256_set1_ps(static_cast<float>(xz[r])), facc[r]);
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_mul_ps(v, _mm256_set1_ps(xs[r])));
    for (int64_t i = 0; i < valid; ++i) y[r * ldy + f + i] = out[i];
  }
}

inline void int4_tile_any(int rows, int nb, const uint32_t* u, int64_t ldu, const int32_t* us, int64_t ldus,
                          const uint8_t* w, const float* sc, int64_t groups, const float* xs, const int32_t* xz,
                          const float* zs, float* y, int64_t ldy, int64_t f0, int64_t n) {
  for (int j = 0; j < nb; ++j)
    for (int h = 0; h < 2; ++h) {
      const int64_t f = f0 + j * kI8Block + 8 * h;
      if (f >= n) return;
      switch (rows) {
#define GS_I4_HALF(R) \
  case R: int4_half<R>(u, ldu, us, ldus, w, nb, j, h, sc, groups, xs, xz, zs, y, ldy, f, n); break;
        GS_I4_HALF(1) GS_I4_HALF(2) GS_I4_HALF(3)
#undef GS_I4_HALF
        default: TORCH_CHECK(false, "int4 GEMM: internal error, ", rows, " rows");
      }
    }
}

#endif  // GS_HAVE_VNNI / GS_AVX2

// y [rows, N] fp32 = x [rows, K] fp32 (contiguous) times the packed int4 weight, as described above.
inline at::Tensor int4_linear(const at::Tensor& x, const Int4Matrix& w) {
  TORCH_CHECK(have_int4(), "int4 GEMM: the ", GS_LEVEL_NAME, " level has no int4 GEMM (it needs the avx512 or avx2 "
              "level)");
  check_gemm_input(x, w.k, "int4 GEMM");
  const int64_t rows = x.size(0), n = w.n, G = w.groups(), nb = w.blocks(), kq = G * kI4Group / 4;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if GS_HAVE_INT4
  std::vector<uint32_t> u(static_cast<size_t>(rows * kq));
  std::vector<int32_t> us(static_cast<size_t>(rows * G));
  std::vector<float> xs(rows);
  std::vector<int32_t> xz(rows);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    uint8_t* um = reinterpret_cast<uint8_t*>(u.data() + m * kq);
    quantize_row(xp + m * w.k, w.k, kq * 4, um, &xs[m], &xz[m]);
    for (int64_t g = 0; g < G; ++g) {
      int32_t s = 0;
      for (int64_t i = 0; i < kI4Group; ++i) s += um[g * kI4Group + i];
      us[m * G + g] = s;
    }
  }
  const int64_t step = chunk_rows(rows, kI4MaxRows);  // a tile's weights: 32 outputs x K, at most 143 KB
  const uint8_t* wd = w.data.data_ptr<uint8_t>();
  const float* sd = w.scales.data_ptr<float>();
  const float* zs = w.zsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_tiles_and_chunks(nb, kI4TileBlocks, rows, step, [&](int64_t b0, int tb, int64_t r, int chunk) {
    int4_tile_any(chunk, tb, u.data() + r * kq, kq, us.data() + r * G, G, wd + b0 * kI8Block * G * kI4Group / 2,
                  sd + b0 * kI8Block * G, G, xs.data() + r, xz.data() + r, zs, yp + r * n, n, b0 * kI8Block, n);
  });
#endif
  return y;
}

}  // namespace graphspec_native
