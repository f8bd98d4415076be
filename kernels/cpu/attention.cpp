// Decode and verify attention on the CPU, one query row at a time: graphspec.kernels.attention's CPU path for
// blocks of 1..EXACT_ROWS_MAX new tokens (a decode step, a speculative verify), in graphspec.kernels.cpu.
//
// Why: a verify's query row must come out bit-identical to the one-token step at its position, or bf16 greedy
// speculative output drifts from autoregressive. Torch's CPU SDPA rounds a row differently by how many rows
// share its call, so the torch path ran each verify row as its own SDPA call (graphspec.kernels._attention_cpu),
// a call per row that costs a noticeable share of a verify (perf/RESULTS.md).
// Here every (batch, kv head, row) is computed by the same loop over exactly the keys that row sees, in the
// order a one-token step's cache holds them: the cached keys, then the row's path through the new ones (with a
// tree: its ancestors and itself; a chain: new keys 0..j). Nothing depends on the other rows or on the thread
// count, so a row's output is the same bits in a decode step and in any verify.
//
// Maths, per query head: s_i = scale * q . k_i (fp32 sums over D), p_i = exp(s_i - max s) / sum_j exp(s_j - max s)
// (a polynomial exp, relative error < 3e-7, native_math.h), out = sum_i p_i v_i, rounded to the input dtype to
// nearest even. K and V are read in their storage dtype (bf16 or fp32) and widened to fp32. Head dims that are a
// multiple of 16 take the vector path: 16 lanes a step (one zmm at avx512, two ymm at avx2), each level with its
// own fixed order of the sums; other head dims, and the generic level, the scalar loop. On the vector path the
// softmax runs 16 lanes at a time and P @ V in register tiles of heads x chunks, V widened once a tile; at avx512
// bf16 scores take vdpbf16ps (exact bf16 products, fp32 sums, 32 elements an instruction) over blocks of 16 keys
// whose horizontal sums are done together (sums16).
// The amx level runs bf16 with head dims 32, 64, 96 and 128 on AMX tiles instead (run_amx below): all the rows
// of a kv head at once, scores and P @ V as tile products, the weights exp(s_i - max s) rounded to bf16 and the
// output divided by their fp32 sum; row-exact by the same argument, made there.

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "level.h"
#include "native_math.h"
#include "vec16.h"

namespace {

using namespace graphspec_native;  // vec16.h

#if GS_AVX512
// bf16 scores, 16 keys at a time: each (head, key) dot is vdpbf16ps over pairs of bf16 (exact products, fp32
// sums; 32 elements an instruction, no widening), then sums16. `qb` holds the g heads' q rows, each padded with
// zeros to `cp` blocks of 32; `zero` is such a padded row of zeros, read in place of the keys past n.
inline void scores_bf16(const uint16_t* qb, int64_t cp, const uint16_t* k, int64_t key_stride, const int64_t* slot,
                        int64_t n, int64_t g, int64_t d, float scale, float* scores, const uint16_t* zero) {
  const __mmask32 last = (d % 32) ? __mmask32(0xFFFF) : __mmask32(0xFFFFFFFF);  // the last block's real elements
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t kn = std::min<int64_t>(16, n - i0);
    const uint16_t* kp[16];
    for (int64_t m = 0; m < 16; ++m) kp[m] = m < kn ? k + slot[i0 + m] * key_stride : zero;
    for (int64_t h = 0; h < g; ++h) {
      const uint16_t* qh = qb + h * cp * 32;
      __m512 acc[16];
      for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t x = 0; x < cp; ++x) {
        const __mmask32 mask = x + 1 == cp ? last : __mmask32(0xFFFFFFFF);
        const __m512bh qx = (__m512bh)_mm512_loadu_si512(qh + 32 * x);
        for (int m = 0; m < 16; ++m)
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, kp[m] + 32 * x), qx);
      }
      const __m512 s = _mm512_mul_ps(sums16(acc), sc);
      _mm512_mask_storeu_ps(scores + h * n + i0, __mmask16((1u << kn) - 1), s);
    }
  }
}
#endif

#if GS_AMX
// The amx level's bf16 attention for head dims of 32, 64, 96 or 128, a (batch, kv head) at a time: all its query
// rows against the cache on AMX tiles.
// - Scores: a tile product of 16 keys (the first operand: the cache's rows as they lie, 32 dims a tile) with 16
//   queries (the second: the queries' pairs of dims side by side), then transposed to a row of scores a query.
// - Weights: exp(s_i - max s) (exp16), rounded to bf16 to nearest even (as flash attention does on a GPU); their
//   fp32 sum kept per query.
// - P @ V: 16 queries' weights (the first operand, 32 keys a tile) with V's pairs of keys side by side (the
//   second, repacked once a call), fp32 sums over blocks of 32 keys in order; then times 1 / the sum, rounded.
// Row exactness: every tile element is a sum over its own operands only, and a row's blocks of 32 keys are cut
// at the same logical positions (0, 32, 64, ... of the keys it sees) in a decode step and in any verify, so each
// block adds the same products to the row's sums. Keys a row does not see (later rows' keys, padding) enter with
// weight 0 and add exact zeros. A tree's rows share the cache's whole blocks, then each row's own blocks gather
// its path.
constexpr int64_t kAmxMaxD = 128;

using graphspec_amx::configure_tiles;

// cols[c] = column c of the 16 x 16 fp32 rows[]: unpacks in 128-bit lanes, then lanes exchanged twice.
inline void transpose16(const __m512* rows, __m512* cols) {
  __m512 t[16], s[4][4];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int gi = 0; gi < 4; ++gi) {  // s[gi][c], lane L: rows 4gi .. 4gi + 3 of column 4L + c
    const __m512d lo_ab = _mm512_castps_pd(t[4 * gi]), hi_ab = _mm512_castps_pd(t[4 * gi + 1]);
    const __m512d lo_cd = _mm512_castps_pd(t[4 * gi + 2]), hi_cd = _mm512_castps_pd(t[4 * gi + 3]);
    s[gi][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo_ab, lo_cd));
    s[gi][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo_ab, lo_cd));
    s[gi][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi_ab, hi_cd));
    s[gi][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi_ab, hi_cd));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 u0 = _mm512_shuffle_f32x4(s[0][c], s[1][c], 0x88), u1 = _mm512_shuffle_f32x4(s[0][c], s[1][c], 0xDD);
    const __m512 u2 = _mm512_shuffle_f32x4(s[2][c], s[3][c], 0x88), u3 = _mm512_shuffle_f32x4(s[2][c], s[3][c], 0xDD);
    cols[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    cols[c + 8] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    cols[c + 4] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    cols[c + 12] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
}

// The scores of 16 keys (kt: 16 rows, `kstride` bytes apart) with nqb blocks of 16 queries (qv: per block NP
// tiles of the queries' pairs) into ct[qb * 256 + key * 16 + query]. Tiles 0-3: the keys' 32-dim pieces;
// 4, 6: queries; 5: the sums.
template <int NP>
void amx_scores(const uint16_t* kt, int64_t kstride, const uint32_t* qv, int64_t nqb, float* ct) {
  _tile_loadd(0, kt, kstride);
  if constexpr (NP > 1) _tile_loadd(1, kt + 32, kstride);
  if constexpr (NP > 2) _tile_loadd(2, kt + 64, kstride);
  if constexpr (NP > 3) _tile_loadd(3, kt + 96, kstride);
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const uint32_t* qt = qv + qb * NP * 256;
    _tile_zero(5);
    _tile_loadd(4, qt, 64);
    _tile_dpbf16ps(5, 0, 4);
    if constexpr (NP > 1) {
      _tile_loadd(6, qt + 256, 64);
      _tile_dpbf16ps(5, 1, 6);
    }
    if constexpr (NP > 2) {
      _tile_loadd(4, qt + 512, 64);
      _tile_dpbf16ps(5, 2, 4);
    }
    if constexpr (NP > 3) {
      _tile_loadd(6, qt + 768, 64);
      _tile_dpbf16ps(5, 3, 6);
    }
    _tile_stored(5, ct + qb * 256, 64);
  }
}

// 16 rows of sums over NB blocks of 16 output columns: c_in (or zeros) plus, for key blocks 0 .. nkb - 1, the
// weights p[:, 32 kb ..] (rows ldp apart) times V's tiles vt + kb * vstep + b * 512; stored to c_out. Tiles 0-3:
// sums; 4: weights; 5, 6: V.
template <int NB>
void amx_pv(const uint16_t* p, int64_t ldp, const uint16_t* vt, int64_t vstep, int64_t nkb, const float* c_in,
            float* c_out, int64_t ldc) {
  if (c_in) {
    _tile_loadd(0, c_in, ldc * 4);
    if constexpr (NB > 1) _tile_loadd(1, c_in + 16, ldc * 4);
    if constexpr (NB > 2) _tile_loadd(2, c_in + 32, ldc * 4);
    if constexpr (NB > 3) _tile_loadd(3, c_in + 48, ldc * 4);
  } else {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (NB > 2) _tile_zero(2);
    if constexpr (NB > 3) _tile_zero(3);
  }
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const uint16_t* vb = vt + kb * vstep;
    _tile_loadd(4, p + kb * 32, ldp * 2);
    _tile_loadd(5, vb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, vb + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(5, vb + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NB > 3) {
      _tile_loadd(6, vb + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, c_out, ldc * 4);
  if constexpr (NB > 1) _tile_stored(1, c_out + 16, ldc * 4);
  if constexpr (NB > 2) _tile_stored(2, c_out + 32, ldc * 4);
  if constexpr (NB > 3) _tile_stored(3, c_out + 48, ldc * 4);
}

// P @ V for 16 rows over every output column: groups of up to 4 tiles of 16 columns.
void amx_pv_all(const uint16_t* p, int64_t ldp, const uint16_t* vt, int64_t nd, int64_t nkb, const float* c_in,
                float* c_out, int64_t ldc) {
  const int64_t vstep = nd * 512;
  for (int64_t b0 = 0; b0 < nd; b0 += 4) {
    const float* ci = c_in ? c_in + b0 * 16 : nullptr;
    switch (std::min<int64_t>(4, nd - b0)) {
      case 2: amx_pv<2>(p, ldp, vt + b0 * 512, vstep, nkb, ci, c_out + b0 * 16, ldc); break;
      case 4: amx_pv<4>(p, ldp, vt + b0 * 512, vstep, nkb, ci, c_out + b0 * 16, ldc); break;
      default: TORCH_CHECK(false, "attention_cpu: internal error, ", nd, " column tiles");
    }
  }
}

// V's keys 0 .. count - 1 (key i at v + slot(i) * stride) as the second operand of P @ V: per block of 32 keys and
// 32 dims, two tiles of 16 rows (pairs of keys) x 16 dwords (one dim of both keys). vpunpck{l,h}wd interleave
// in 128-bit lanes, so tile h of dims 32G.. holds in column c the dim 32G + 8 (c / 4) + 4h + c % 4 (amx_store_row
// puts them back in order).
// Keys past count are zeros.
template <typename Slot>
void amx_repack_v(const uint16_t* v, int64_t stride, int64_t count, Slot slot, int64_t d, const uint16_t* zero,
                  uint16_t* dst) {
  const int64_t ng = d / 32, nkb = (count + 31) / 32;
  for (int64_t kb = 0; kb < nkb; ++kb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t i0 = kb * 32 + 2 * r, i1 = i0 + 1;
      const uint16_t* a = i0 < count ? v + slot(i0) * stride : zero;
      const uint16_t* b = i1 < count ? v + slot(i1) * stride : zero;
      for (int64_t gi = 0; gi < ng; ++gi) {
        const __m512i za = _mm512_loadu_si512(a + 32 * gi), zb = _mm512_loadu_si512(b + 32 * gi);
        uint16_t* t = dst + ((kb * ng + gi) * 2) * 512 + r * 32;
        _mm512_storeu_si512(t, _mm512_unpacklo_epi16(za, zb));
        _mm512_storeu_si512(t + 512, _mm512_unpackhi_epi16(za, zb));
      }
    }
}

// A query's output: its sums (column order of the V tiles above) times 1 / (the sum of its weights), rounded to
// bf16 to nearest even, in head-dim order: dims 32G .. 32G + 31 interleave tiles 2G and 2G + 1 four columns at a time.
inline void amx_store_row(const float* sums, float inv, int64_t d, at::BFloat16* out) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 sv = _mm512_set1_ps(inv);
  for (int64_t gi = 0; gi < d / 32; ++gi) {
    const __m512 a = _mm512_loadu_ps(sums + 32 * gi), b = _mm512_loadu_ps(sums + 32 * gi + 16);
    const __m256bh x = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), sv));
    const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), sv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * gi), (__m256i)x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * gi + 16), (__m256i)y);
  }
}

// A query's scores s[0 .. n) -> its weights exp(s_i - max s) as bf16 in p[0 .. n), zeros in p[n .. ld); returns
// 1 / the fp32 sum of the weights, summed in 16 lanes by i % 16, then sum16: an order set by n alone.
inline float amx_weights(const float* s, int64_t n, uint16_t* p, int64_t ld) {
  const auto lanes = [n](int64_t i) {  // the lanes of s[i .. i + 16) before n
    return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
  };
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(i), s + i));
  const V16 mx = set16(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(i);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(sub16({_mm512_maskz_loadu_ps(k, s + i)}, mx)).v);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (int64_t i = (n + 15) / 16 * 16; i < ld; ++i) p[i] = 0;
  return 1.f / _mm512_reduce_add_ps(sum);
}

void run_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const int64_t* lengths,
             const int64_t* starts, const int64_t* nodes, at::Tensor& out) {
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t l = k.size(1), hk = k.size(2), g = hq / hk, base = l - t;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  graphspec_amx::require_tiles("attention_cpu");
  bool chain = true;  // row j sees keys 0 .. j of the new ones: its keys are the slots 0 .. base + j
  for (int64_t j = 0; j < t; ++j) chain = chain && lengths[j] == j + 1;
  const int64_t np = d / 32, nd = d / 16;
  const int64_t chunk_rows = std::max<int64_t>(1, 64 / g);  // rows whose scores are held at once (~64 queries)
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * hk, 1, [&](int64_t u0, int64_t u1) {
    configure_tiles();
    // Work space kept by each thread between calls (no zeroing, no fresh pages a call).
    static thread_local std::vector<uint16_t> kpad, vr, vt, pw;
    static thread_local std::vector<uint32_t> qv;
    static thread_local std::vector<float> s, acc, ct, tmp, inv;
    std::vector<uint16_t> zero(d, 0);
    kpad.resize(16 * d);
    tmp.resize(16 * d);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bi = u / hk, kh = u % hk;
      const uint16_t* kb = kp + bi * ks0 + kh * ks2;
      const uint16_t* vb = vp + bi * vs0 + kh * vs2;
      // V as tiles, once for every chunk of rows: a chain's rows read every slot in order; a tree's only the
      // cache's whole blocks of 32, each row's later keys gathered with it.
      const int64_t shared = chain ? l : base / 32 * 32;
      vr.resize(((shared + 31) / 32) * nd * 512);
      amx_repack_v(vb, vs1, shared, [](int64_t i) { return i; }, d, zero.data(), vr.data());
      for (int64_t j0 = 0; j0 < t; j0 += chunk_rows) {
        const int64_t j1 = std::min(t, j0 + chunk_rows), nq = (j1 - j0) * g, nqb = (nq + 15) / 16;
        const int64_t nk = base + j1, ld = (nk + 31) / 32 * 32;  // keys any row of the chunk sees; row stride
        qv.assign(nqb * np * 256, 0);
        for (int64_t qi = 0; qi < nq; ++qi) {  // the queries' pairs of dims as tiles: [block][piece][pair][query]
          const uint16_t* qr = qp + bi * qs0 + (j0 + qi / g) * qs1 + (kh * g + qi % g) * qs2;
          uint32_t* dst = qv.data() + (qi / 16) * np * 256 + qi % 16;
          for (int64_t e = 0; e < d / 2; ++e)
            dst[(e / 16) * 256 + (e % 16) * 16] = uint32_t(qr[2 * e]) | (uint32_t(qr[2 * e + 1]) << 16);
        }
        s.resize(nq * ld);
        ct.resize(nqb * 256);
        for (int64_t k0 = 0; k0 < nk; k0 += 16) {
          const uint16_t* kt = kb + k0 * ks1;
          int64_t kstride = ks1 * 2;
          if (k0 + 16 > l) {  // the last block runs past the cache's view: a zero-padded copy
            for (int64_t m = 0; m < 16; ++m)
              for (int64_t e = 0; e < d; ++e) kpad[m * d + e] = k0 + m < l ? kb[(k0 + m) * ks1 + e] : 0;
            kt = kpad.data();
            kstride = d * 2;
          }
          switch (np) {
            case 1: amx_scores<1>(kt, kstride, qv.data(), nqb, ct.data()); break;
            case 2: amx_scores<2>(kt, kstride, qv.data(), nqb, ct.data()); break;
            case 3: amx_scores<3>(kt, kstride, qv.data(), nqb, ct.data()); break;
            case 4: amx_scores<4>(kt, kstride, qv.data(), nqb, ct.data()); break;
          }
          const __m512 scv = _mm512_set1_ps(sc);
          for (int64_t qb = 0; qb < nqb; ++qb) {
            __m512 rows[16], cols[16];
            for (int m = 0; m < 16; ++m) rows[m] = _mm512_loadu_ps(ct.data() + qb * 256 + m * 16);
            transpose16(rows, cols);
            for (int64_t c = 0; c < 16 && qb * 16 + c < nq; ++c)
              _mm512_storeu_ps(s.data() + (qb * 16 + c) * ld + k0, _mm512_mul_ps(cols[c], scv));
          }
        }
        // Each query's weights over its own keys in order, bf16, zeros to the row's end; spare rows of zeros.
        const int64_t rows_p = nqb * 16 + 16;
        pw.resize(rows_p * ld);
        inv.resize(nq);
        for (int64_t qi = 0; qi < nq; ++qi) {
          const int64_t j = j0 + qi / g, n = base + lengths[j];
          float* sr = s.data() + qi * ld;
          if (!chain)
            for (int64_t p = 0; p < lengths[j]; ++p) sr[base + p] = sr[base + nodes[starts[j] + p]];
          inv[qi] = amx_weights(sr, n, pw.data() + qi * ld, ld);
        }
        std::fill(pw.begin() + nq * ld, pw.begin() + rows_p * ld, uint16_t(0));
        acc.resize(rows_p * d);
        for (int64_t qb = 0; qb < nqb; ++qb) {
          const int64_t last = std::min(nq, qb * 16 + 16) - 1;  // the block's last query sees the most keys
          const int64_t nkb = chain ? (base + lengths[j0 + last / g] + 31) / 32 : base / 32;
          amx_pv_all(pw.data() + qb * 16 * ld, ld, vr.data(), nd, nkb, nullptr, acc.data() + qb * 16 * d, d);
        }
        if (!chain) {  // each row's blocks past the cache's whole ones: its own keys, gathered
          for (int64_t j = j0; j < j1; ++j) {
            const int64_t n = base + lengths[j], from = base / 32 * 32, count = n - from;
            const int64_t* path = nodes + starts[j];
            vt.resize(((count + 31) / 32) * nd * 512);
            const auto slot = [&](int64_t i) { return from + i < base ? from + i : base + path[from + i - base]; };
            amx_repack_v(vb, vs1, count, slot, d, zero.data(), vt.data());
            for (int64_t w0 = 0; w0 < g; w0 += 16) {  // the row's queries, 16 at a time
              const int64_t q0 = (j - j0) * g + w0, nw = std::min<int64_t>(16, g - w0);
              amx_pv_all(pw.data() + q0 * ld + from, ld, vt.data(), nd, (count + 31) / 32, acc.data() + q0 * d,
                         tmp.data(), d);
              std::memcpy(acc.data() + q0 * d, tmp.data(), nw * d * sizeof(float));
            }
          }
        }
        for (int64_t qi = 0; qi < nq; ++qi) {
          at::BFloat16* orow = op + ((bi * t + j0 + qi / g) * hq + kh * g + qi % g) * d;
          amx_store_row(acc.data() + qi * d, inv[qi], d, orow);
        }
      }
    }
    _tile_release();
  });
}
#endif  // GS_AMX

constexpr int64_t kMaxChunks = 16;  // D up to 256 in registers on the vector path

// One (batch, kv head, row): G query heads over `n` keys whose slots are `slot[0..n)`; out[g * d ..] fp32.
// The vector path (avx512 / avx2, D a multiple of 16) and the scalar one each fix their order of the sums.
template <typename T>
void attend_row(const T* q, int64_t q_head_stride, const T* k, const T* v, int64_t key_stride, const int64_t* slot,
                int64_t n, int64_t g, int64_t d, float scale, float* scores, float* qf, float* acc, uint16_t* qb,
                const uint16_t* zero) {
  const bool vec = kVector && d % 16 == 0 && d / 16 <= kMaxChunks;
  const bool dp_bf16 = GS_AVX512 && std::is_same<T, at::BFloat16>::value && vec;  // scores_bf16 reads q as it is
  if (!dp_bf16)
    for (int64_t h = 0; h < g; ++h)
      for (int64_t e = 0; e < d; ++e) qf[h * d + e] = widen(q[h * q_head_stride + e]);
#if GS_AVX512
  if (dp_bf16) {
    const int64_t cp = (d + 31) / 32;
    for (int64_t h = 0; h < g; ++h) {
      std::memcpy(qb + h * cp * 32, q + h * q_head_stride, d * sizeof(uint16_t));
      std::fill(qb + h * cp * 32 + d, qb + (h + 1) * cp * 32, uint16_t(0));
    }
    scores_bf16(qb, cp, reinterpret_cast<const uint16_t*>(k), key_stride, slot, n, g, d, scale, scores, zero);
  } else
#endif
#if GS_AVX512 || GS_AVX2
  if (vec) {
    const int64_t c = d / 16;
    for (int64_t i = 0; i < n; ++i) {  // scores: each key widened once, dotted with every head
      const T* ki = k + slot[i] * key_stride;
      V16 kv[kMaxChunks];
      for (int64_t x = 0; x < c; ++x) kv[x] = load16(ki + 16 * x);
      for (int64_t h = 0; h < g; ++h) scores[h * n + i] = dot16(kv, qf + h * d, c) * scale;
    }
  } else
#endif
  {
    for (int64_t i = 0; i < n; ++i) {
      const T* ki = k + slot[i] * key_stride;
      for (int64_t h = 0; h < g; ++h) {
        const float* qh = qf + h * d;
        float s = 0.f;
        for (int64_t e = 0; e < d; ++e) s += qh[e] * widen(ki[e]);
        scores[h * n + i] = s * scale;
      }
    }
  }
#if GS_AVX512 || GS_AVX2
  if (vec) {
    for (int64_t h = 0; h < g; ++h) softmax16(scores + h * n, n);
    for (int64_t h0 = 0; h0 < g; h0 += kTileHeads) {  // the g heads' weights and sums, a tile of them at a time
      const int64_t hn = std::min<int64_t>(kTileHeads, g - h0);
      const float* ph[kTileHeads];
      float* oh[kTileHeads];
      for (int64_t h = 0; h < hn; ++h) {
        ph[h] = scores + (h0 + h) * n;
        oh[h] = acc + (h0 + h) * d;
      }
      pv_queries<T>(v, key_stride, slot, 0, n, hn, ph, oh, true, d);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < g; ++h) {  // scores -> softmax weights, in place
    float* sh = scores + h * n;
    float mx = sh[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = graphspec_native::fast_exp(sh[i] - mx);
      sum += sh[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
  }
  for (int64_t h = 0; h < g; ++h) {
    const float* sh = scores + h * n;
    float* ah = acc + h * d;
    for (int64_t e = 0; e < d; ++e) ah[e] = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const T* vi = v + slot[i] * key_stride;
      for (int64_t e = 0; e < d; ++e) ah[e] += sh[i] * widen(vi[e]);
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const int64_t* lengths,
         const int64_t* starts, const int64_t* nodes, at::Tensor& out) {
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t l = k.size(1), hk = k.size(2), g = hq / hk, base = l - t;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  TORCH_CHECK(ks1 == vs1, "attention_cpu: k and v must share their layout");
  const int64_t units = b * hk * t;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> slot(l);
    std::vector<float> scores(g * l), qf(g * d), acc(g * d);
    std::vector<uint16_t> qb(g * ((d + 31) / 32) * 32), zero(((d + 31) / 32) * 32, 0);  // scores_bf16's
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j = u % t, kh = (u / t) % hk, bi = u / (t * hk);
      int64_t n = 0;
      for (int64_t i = 0; i < base; ++i) slot[n++] = i;
      for (int64_t p = 0; p < lengths[j]; ++p) slot[n++] = base + nodes[starts[j] + p];
      const T* qrow = qp + bi * qs0 + j * qs1 + kh * g * qs2;
      attend_row<T>(qrow, qs2, kp + bi * ks0 + kh * ks2, vp + bi * vs0 + kh * vs2, ks1, slot.data(), n, g, d,
                    static_cast<float>(scale), scores.data(), qf.data(), acc.data(), qb.data(), zero.data());
      T* orow = op + ((bi * t + j) * hq + kh * g) * d;
      for (int64_t e = 0; e < g * d; ++e) orow[e] = static_cast<T>(acc[e]);
    }
  });
}

// q [B, T, Hq, D] (last dim contiguous), k, v [B, L, Hk, D] (the cache's views). Row j sees the L - T cached
// keys, then the new nodes nodes[sum(lengths[:j]) ..][:lengths[j]], in order, ending at itself (a chain: 0..j).
// Returns [B, T, Hq, D] contiguous in q's dtype.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                  c10::IntArrayRef lengths, c10::IntArrayRef nodes) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention_cpu: q, k, v must be 4-d");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention_cpu: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attention_cpu: q, k, v must share one dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attention_cpu: the head dim must be contiguous");
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3), l = k.size(1), hk = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && k.sizes() == v.sizes() && k.size(3) == d && hk > 0 && hq % hk == 0,
              "attention_cpu: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == t && t <= l, "attention_cpu: one path length per new token");
  std::vector<int64_t> starts(t);
  int64_t total = 0;
  for (int64_t j = 0; j < t; ++j) {
    starts[j] = total;
    total += lengths[j];
    TORCH_CHECK(lengths[j] >= 1 && total <= static_cast<int64_t>(nodes.size()) && nodes[total - 1] == j,
                "attention_cpu: row ", j, "'s path must be non-empty and end at itself");
    for (int64_t p = starts[j]; p < total; ++p)
      TORCH_CHECK(nodes[p] >= 0 && nodes[p] <= j && (p == starts[j] || nodes[p] > nodes[p - 1]),
                  "attention_cpu: row ", j, "'s path must rise through earlier nodes, got node ", nodes[p]);
  }
  TORCH_CHECK(total == static_cast<int64_t>(nodes.size()), "attention_cpu: ", nodes.size(), " nodes for paths of ",
              total);
  at::Tensor out = at::empty({b, t, hq, d}, q.options());
  if (b == 0 || t == 0) return out;
  if (q.scalar_type() == at::kBFloat16) {
#if GS_AMX
    if (d % 32 == 0 && d <= kAmxMaxD) {
      run_amx(q, k, v, scale, lengths.data(), starts.data(), nodes.data(), out);
      return out;
    }
#endif
    run<at::BFloat16>(q, k, v, scale, lengths.data(), starts.data(), nodes.data(), out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "attention_cpu: bf16 or fp32 only, got ", q.scalar_type());
    run<float>(q, k, v, scale, lengths.data(), starts.data(), nodes.data(), out);
  }
  return out;
}

}  // namespace

GS_LIBRARY_FRAGMENT(m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale, int[] lengths, int[] nodes) -> Tensor", &attend);
}
