// GEMMs on GGUF block-quantized weights (graphspec.kernels.qlinear.BlockWeight), fp32 activations, at every C++
// level of the CPU backend. Built as its own extension per level (graphspec_cpuq_<level>, kernels/cpu/__init__.py)
// so that it never changes the other extensions' build key.
//
// y[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]), where w[n, k] is the value gguf.quants.dequantize gives: each
// weight row is dequantized, block by block, with the gguf package's fp32 operations in its order (this file is
// built with -ffp-contract=off, so no multiply-add is fused behind our back), into a row buffer that stays in L1,
// and then multiplied with up to 8 rows of x at a time. The weight bytes are read once per call, whatever the
// number of rows.
//
// Order of the sums (what makes a row's result independent of the row count and the threads): each output is 32
// fp32 partial sums, lane l summing k = l, l + 32, l + 64, ... in increasing k (avx2 and avx512: one fused
// multiply-add per product, so those two levels give identical bits; generic: a product and an add), then the 32
// lanes added pairwise (l + 16, then + 8, + 4, + 2, + 1), then the bias. 32 lanes rather than one register's 16 so
// that a single row runs two independent FMA chains (one chain waits on the FMA latency). Nothing in it depends on M, on
// which rows share a call, or on the thread that computes it (at::parallel_for over output rows; each output is
// written by one thread).

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "level.h"

namespace {

constexpr int kLanes = 32;
constexpr int kMaxRows = 8;

// The type numbers of graphspec.kernels.qlinear.TYPE_IDS.
enum QType : int64_t { F32 = 0, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, kNumTypes };
constexpr int64_t kBlockSize[kNumTypes] = {1, 1, 1, 32, 32, 32, 32, 32, 256, 256, 256};
constexpr int64_t kTypeSize[kNumTypes] = {4, 2, 2, 18, 20, 22, 24, 34, 144, 176, 210};

// fp16 bits -> fp32, exactly (as numpy's astype(np.float32)): F16C where the level has it, else by the bits.
inline float h2f(const uint8_t* p) {
#if GS_AVX512 || GS_AVX2
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: mant * 2^-24, exact in fp32
      float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
      std::memcpy(&bits, &v, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Q4_K / Q5_K: the 8 sub-blocks' scales d * sc[j] and offsets dmin * m[j], fp32 (ggml's get_scale_min_k4).
inline void k_scales(const uint8_t* __restrict s, float d, float dmin, float* __restrict ds, float* __restrict dm) {
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
  for (int j = 0; j < 8; ++j) {
    ds[j] = d * static_cast<float>(sc[j]);
    dm[j] = dmin * static_cast<float>(mn[j]);
  }
}

// One weight row of K values (K / block_size blocks at `p`) -> out[K], fp32, as gguf.quants.dequantize.
template <int T>
void dequant_row(const uint8_t* __restrict p, int64_t k, float* __restrict out) {
  const int64_t nb = k / kBlockSize[T];
  for (int64_t b = 0; b < nb; ++b, p += kTypeSize[T]) {
    float* o = out + b * kBlockSize[T];
    if constexpr (T == F32) {
      std::memcpy(o, p, 4);
    } else if constexpr (T == F16) {
      o[0] = h2f(p);
    } else if constexpr (T == BF16) {
      const uint32_t bits = (static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8)) << 16;
      std::memcpy(o, &bits, 4);
    } else if constexpr (T == Q8_0) {
      const float d = h2f(p);
      const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
#pragma omp simd
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
    } else if constexpr (T == Q4_0 || T == Q4_1) {
      const float d = h2f(p);
      const uint8_t* qs = p + (T == Q4_0 ? 2 : 4);
      if constexpr (T == Q4_0) {
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>(static_cast<int>(qs[j] & 0xF) - 8);
          o[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
        }
      } else {
        const float m = h2f(p + 2);
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>(qs[j] & 0xF) + m;
          o[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
        }
      }
    } else if constexpr (T == Q5_0 || T == Q5_1) {
      const float d = h2f(p);
      const int off = T == Q5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, p + off, 4);
      const uint8_t* qs = p + off + 4;
      if constexpr (T == Q5_0) {
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
          const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
          o[j] = d * static_cast<float>(lo - 16);
          o[j + 16] = d * static_cast<float>(hi - 16);
        }
      } else {
        const float m = h2f(p + 2);
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
          const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
          o[j] = d * static_cast<float>(lo) + m;
          o[j + 16] = d * static_cast<float>(hi) + m;
        }
      }
    } else if constexpr (T == Q4_K || T == Q5_K) {
      const float d = h2f(p), dmin = h2f(p + 2);
      const uint8_t* sc = p + 4;
      const uint8_t* qh = p + 16;
      const uint8_t* qs = p + (T == Q4_K ? 16 : 48);
      float dss[8], dms[8];
      k_scales(sc, d, dmin, dss, dms);
      for (int s = 0; s < 8; ++s) {
        const float ds = dss[s], dm = dms[s];
        const uint8_t* q = qs + (s / 2) * 32;
        const int shift = (s % 2) * 4;
        float* os = o + s * 32;
        if constexpr (T == Q4_K) {
#pragma omp simd
          for (int j = 0; j < 32; ++j) os[j] = ds * static_cast<float>((q[j] >> shift) & 0xF) - dm;
        } else {
#pragma omp simd
          for (int j = 0; j < 32; ++j)
            os[j] = ds * static_cast<float>(((q[j] >> shift) & 0xF) | (((qh[j] >> s) & 1) << 4)) - dm;
        }
      }
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = h2f(p + 208);
      for (int g = 0; g < 8; ++g) {  // 8 groups of 32: half h, then ql nibble t / qh bit pair s
        const int h = g / 4, s = g % 4, t = s / 2;
        const uint8_t* l = ql + 64 * h + (s % 2) * 32;
        const uint8_t* hb = qh + 32 * h;
        float* og = o + g * 32;
        const float ds0 = d * static_cast<float>(scales[2 * g]), ds1 = d * static_cast<float>(scales[2 * g + 1]);
#pragma omp simd
        for (int j = 0; j < 32; ++j) {
          const int q = (((l[j] >> (4 * t)) & 0xF) | (((hb[j] >> (2 * s)) & 3) << 4)) - 32;
          og[j] = (j < 16 ? ds0 : ds1) * static_cast<float>(q);
        }
      }
    }
  }
}

// out[m] = the fixed-order dot of w[0..k) with x[m, 0..k), for M rows (see the top of the file).
template <int M>
inline void dot_rows(const float* __restrict w, const float* __restrict x, int64_t ldx, int64_t k,
                     float* __restrict out) {
  float acc[M][kLanes];
  for (int m = 0; m < M; ++m)
    for (int l = 0; l < kLanes; ++l) acc[m][l] = 0.0f;
  const int64_t body = k - k % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * ldx + i;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
#if GS_AVX512 || GS_AVX2
        acc[m][l] = std::fma(w[i + l], xm[l], acc[m][l]);
#else
        acc[m][l] = acc[m][l] + w[i + l] * xm[l];
#endif
      }
    }
  }
  for (int64_t i = body; i < k; ++i) {  // a K that is no multiple of 16 (F32 / F16 tensors only)
    const int l = static_cast<int>(i - body);
    for (int m = 0; m < M; ++m) {
#if GS_AVX512 || GS_AVX2
      acc[m][l] = std::fma(w[i], x[m * ldx + i], acc[m][l]);
#else
      acc[m][l] = acc[m][l] + w[i] * x[m * ldx + i];
#endif
    }
  }
  for (int m = 0; m < M; ++m) {
    float* a = acc[m];
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int l = 0; l < width; ++l) a[l] = a[l] + a[l + width];
    out[m] = a[0];
  }
}

#if GS_AVX512 || GS_AVX2
// 16 lanes of int32 / fp32: one zmm at avx512, two ymm at avx2; the same operations lane by lane, so both levels
// compute the same bits.
#if GS_AVX512
struct VI { __m512i v; };
struct VF { __m512 v; };
inline VI load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI load_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI srl(VI a, int s) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline VI sll(VI a, int s) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline VI and_(VI a, int m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
inline VI or_(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
inline VI sub(VI a, int b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline VI bits16(uint32_t v) {  // lane l: (v >> l) & 1
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(v)), iota), _mm512_set1_epi32(1))};
}
inline VF cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VF mul(VF a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
inline VF add(VF a, float b) { return {_mm512_add_ps(a.v, _mm512_set1_ps(b))}; }
inline VF sub(VF a, float b) { return {_mm512_sub_ps(a.v, _mm512_set1_ps(b))}; }
inline VF zero() { return {_mm512_setzero_ps()}; }
inline VF fma(VF w, const float* x, VF acc) { return {_mm512_fmadd_ps(w.v, _mm512_loadu_ps(x), acc.v)}; }
inline void store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
#else
struct VI { __m256i lo, hi; };
struct VF { __m256 lo, hi; };
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI load_u8(const uint8_t* p) { return {u8x8(p), u8x8(p + 8)}; }
inline VI load_i8(const uint8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline VI srl(VI a, int s) { const __m128i c = _mm_cvtsi32_si128(s); return {_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c)}; }
inline VI sll(VI a, int s) { const __m128i c = _mm_cvtsi32_si128(s); return {_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c)}; }
inline VI and_(VI a, int m) { const __m256i v = _mm256_set1_epi32(m); return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)}; }
inline VI or_(VI a, VI b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline VI sub(VI a, int b) { const __m256i v = _mm256_set1_epi32(b); return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)}; }
inline VI bits16(uint32_t v) {
  const __m256i x = _mm256_set1_epi32(static_cast<int>(v)), one = _mm256_set1_epi32(1);
  return {_mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), one),
          _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)), one)};
}
inline VF cvt(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline VF mul(VF a, float b) { const __m256 v = _mm256_set1_ps(b); return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)}; }
inline VF add(VF a, float b) { const __m256 v = _mm256_set1_ps(b); return {_mm256_add_ps(a.lo, v), _mm256_add_ps(a.hi, v)}; }
inline VF sub(VF a, float b) { const __m256 v = _mm256_set1_ps(b); return {_mm256_sub_ps(a.lo, v), _mm256_sub_ps(a.hi, v)}; }
inline VF zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF fma(VF w, const float* x, VF acc) {
  return {_mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), acc.lo), _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), acc.hi)};
}
inline void store(float* p, VF a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#endif

// acc[m] += the block's 16-weight chunk at offset `off` times x[m, off ..]: the weights dequantized in registers,
// with the same fp32 operations as dequant_row (so the same values), then one FMA per row.
// `acc` is the M sums of the chunks at k = 0 mod 32; the second chunk of each 32 adds into the next M (acc + M), so
// that a row has two independent FMA chains.
template <int M>
inline void chunk(VF w, const float* x, int64_t ldx, int off, VF* acc) {
  for (int m = 0; m < M; ++m) acc[m] = fma(w, x + m * ldx + off, acc[m]);
}

#if GS_AVX512
// 4-bit formats at avx512: a sub-block's 16 possible weights, computed once with the same fp32 operations as
// for each weight (so the same values), then looked up per weight with vpermps (which reads the low 4 bits of each
// index lane, so the low nibbles need no mask): one shuffle instead of a convert, a multiply and an add.
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline VF lookup(VI idx, __m512 table) { return {_mm512_permutexvar_ps(idx.v, table)}; }
inline VF q6(__m128i q, float ds) { return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(ds))}; }
#endif

template <int T, int M>
inline void block_dot(const uint8_t* __restrict p, const float* __restrict x, int64_t ldx, VF* acc) {
  if constexpr (T == Q8_0) {
    const float d = h2f(p);
    chunk<M>(mul(cvt(load_i8(p + 2)), d), x, ldx, 0, acc);
    chunk<M>(mul(cvt(load_i8(p + 18)), d), x, ldx, 16, acc + M);
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    const float d = h2f(p);
    const VI raw = load_u8(p + (T == Q4_0 ? 2 : 4));
#if GS_AVX512
    const __m512 q = T == Q4_0 ? _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)) : iota16();  // float(q) or float(q - 8)
    __m512 table = _mm512_mul_ps(_mm512_set1_ps(d), q);
    if constexpr (T == Q4_1) table = _mm512_add_ps(table, _mm512_set1_ps(h2f(p + 2)));
    chunk<M>(lookup(raw, table), x, ldx, 0, acc);
    chunk<M>(lookup(srl(raw, 4), table), x, ldx, 16, acc + M);
    return;
#endif
    const VI lo = and_(raw, 0xF), hi = srl(raw, 4);
    if constexpr (T == Q4_0) {
      chunk<M>(mul(cvt(sub(lo, 8)), d), x, ldx, 0, acc);
      chunk<M>(mul(cvt(sub(hi, 8)), d), x, ldx, 16, acc + M);
    } else {
      const float mn = h2f(p + 2);
      chunk<M>(add(mul(cvt(lo), d), mn), x, ldx, 0, acc);
      chunk<M>(add(mul(cvt(hi), d), mn), x, ldx, 16, acc + M);
    }
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    const float d = h2f(p);
    const int off = T == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, p + off, 4);
    const VI raw = load_u8(p + off + 4);
#if GS_AVX512
    {  // the block's 32 possible weights as two tables; the fifth bit set from qh as a mask, vpermt2ps looks up
      const __m512 iota = iota16(), dv = _mm512_set1_ps(d), sixteen = _mm512_set1_ps(16.0f);
      __m512 t0, t1;
      if constexpr (T == Q5_0) {
        t0 = _mm512_mul_ps(dv, _mm512_sub_ps(iota, sixteen));  // q = 0..15: d * (q - 16)
        t1 = _mm512_mul_ps(dv, iota);                          // q = 16..31
      } else {
        const __m512 mv = _mm512_set1_ps(h2f(p + 2));
        t0 = _mm512_add_ps(_mm512_mul_ps(dv, iota), mv);
        t1 = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_add_ps(iota, sixteen)), mv);
      }
      const __m512i lo = _mm512_and_si512(raw.v, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(raw.v, 4);
      const __m512i s16 = _mm512_set1_epi32(16);
      const __m512i i0 = _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh & 0xFFFF), lo, s16);
      const __m512i i1 = _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, s16);
      chunk<M>(VF{_mm512_permutex2var_ps(t0, i0, t1)}, x, ldx, 0, acc);
      chunk<M>(VF{_mm512_permutex2var_ps(t0, i1, t1)}, x, ldx, 16, acc + M);
      return;
    }
#endif
    const VI lo = or_(and_(raw, 0xF), sll(bits16(qh), 4)), hi = or_(srl(raw, 4), sll(bits16(qh >> 16), 4));
    if constexpr (T == Q5_0) {
      chunk<M>(mul(cvt(sub(lo, 16)), d), x, ldx, 0, acc);
      chunk<M>(mul(cvt(sub(hi, 16)), d), x, ldx, 16, acc + M);
    } else {
      const float mn = h2f(p + 2);
      chunk<M>(add(mul(cvt(lo), d), mn), x, ldx, 0, acc);
      chunk<M>(add(mul(cvt(hi), d), mn), x, ldx, 16, acc + M);
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const float d = h2f(p), dmin = h2f(p + 2);
    const uint8_t* sc = p + 4;
    const uint8_t* qs = p + (T == Q4_K ? 16 : 48);
    VI h0{}, h1{};
    if constexpr (T == Q5_K) {
      h0 = load_u8(p + 16);
      h1 = load_u8(p + 32);
    }
    float dss[8], dms[8];
    k_scales(sc, d, dmin, dss, dms);
    for (int i = 0; i < 4; ++i) {
      const VI r0 = load_u8(qs + 32 * i), r1 = load_u8(qs + 32 * i + 16);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * i + half;
        const float ds = dss[s], dm = dms[s];
#if GS_AVX512
        if constexpr (T == Q4_K) {
          const __m512 table = _mm512_sub_ps(_mm512_mul_ps(iota16(), _mm512_set1_ps(ds)), _mm512_set1_ps(dm));
          chunk<M>(lookup(half ? srl(r0, 4) : r0, table), x, ldx, 32 * s, acc);
          chunk<M>(lookup(half ? srl(r1, 4) : r1, table), x, ldx, 32 * s + 16, acc + M);
          continue;
        }
#endif
        VI q0 = half ? srl(r0, 4) : and_(r0, 0xF), q1 = half ? srl(r1, 4) : and_(r1, 0xF);
        if constexpr (T == Q5_K) {
          q0 = or_(q0, sll(and_(srl(h0, s), 1), 4));
          q1 = or_(q1, sll(and_(srl(h1, s), 1), 4));
        }
        chunk<M>(sub(mul(cvt(q0), ds), dm), x, ldx, 32 * s, acc);
        chunk<M>(sub(mul(cvt(q1), ds), dm), x, ldx, 32 * s + 16, acc + M);
      }
    }
  } else if constexpr (T == Q6_K) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    const float d = h2f(p + 208);
    float ds[16];
    for (int j = 0; j < 16; ++j) ds[j] = d * static_cast<float>(scales[j]);
#if GS_AVX512
    // 64 quants at a time in byte lanes (nibbles, the two high bits, minus 32), then 16 widened per chunk
    const __m512i m0f = _mm512_set1_epi8(0x0F), m03 = _mm512_set1_epi8(0x03), b32 = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(ql + 64 * h);
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), hb, 1);
      // groups s = 0, 1 (low nibbles of ql bytes 0..31, 32..63; qh bits 0-1, 2-3), then s = 2, 3 (high nibbles;
      // qh bits 4-5, 6-7): a 64-bit lane shift then & 3 keeps each byte's own two bits
      const __m512i hl = _mm512_and_si512(_mm512_srlv_epi64(hh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), m03);
      const __m512i hu = _mm512_and_si512(_mm512_srlv_epi64(hh, _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6)), m03);
      const __m512i qa = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(l, m0f), _mm512_slli_epi16(hl, 4)), b32);
      const __m512i qb = _mm512_sub_epi8(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f), _mm512_slli_epi16(hu, 4)), b32);
      const int g = 4 * h;
      chunk<M>(q6(_mm512_extracti32x4_epi32(qa, 0), ds[2 * g]), x, ldx, 32 * g, acc);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qa, 1), ds[2 * g + 1]), x, ldx, 32 * g + 16, acc + M);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qa, 2), ds[2 * g + 2]), x, ldx, 32 * g + 32, acc);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qa, 3), ds[2 * g + 3]), x, ldx, 32 * g + 48, acc + M);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qb, 0), ds[2 * g + 4]), x, ldx, 32 * g + 64, acc);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qb, 1), ds[2 * g + 5]), x, ldx, 32 * g + 80, acc + M);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qb, 2), ds[2 * g + 6]), x, ldx, 32 * g + 96, acc);
      chunk<M>(q6(_mm512_extracti32x4_epi32(qb, 3), ds[2 * g + 7]), x, ldx, 32 * g + 112, acc + M);
    }
    return;
#endif
    for (int h = 0; h < 2; ++h) {
      const VI hb0 = load_u8(qh + 32 * h), hb1 = load_u8(qh + 32 * h + 16);
      // groups in increasing k (each lane's sum runs in k order): group s of this half takes the low (s < 2) or
      // high nibbles of ql bytes 64h + 32 (s % 2) .. and bits 2s, 2s + 1 of the qh bytes
      for (int s = 0; s < 4; ++s) {
        const int g = 4 * h + s, t = s / 2;
        const VI l0 = load_u8(ql + 64 * h + 32 * (s % 2)), l1 = load_u8(ql + 64 * h + 32 * (s % 2) + 16);
        const VI q0 = sub(or_(t ? srl(l0, 4) : and_(l0, 0xF), sll(and_(srl(hb0, 2 * s), 3), 4)), 32);
        const VI q1 = sub(or_(t ? srl(l1, 4) : and_(l1, 0xF), sll(and_(srl(hb1, 2 * s), 3), 4)), 32);
        chunk<M>(mul(cvt(q0), ds[2 * g]), x, ldx, 32 * g, acc);
        chunk<M>(mul(cvt(q1), ds[2 * g + 1]), x, ldx, 32 * g + 16, acc + M);
      }
    }
  }
}

// One weight row times M rows of x, the weights dequantized in registers; the same sums as dot_rows on the
// dequantized row (lane l of acc[m] is dot_rows' lane l).
template <int T, int M>
void row_dot(const uint8_t* __restrict row, const float* __restrict x, int64_t ldx, int64_t k, float* __restrict out) {
  VF acc[2 * M];
  for (int m = 0; m < 2 * M; ++m) acc[m] = zero();
  const int64_t nb = k / kBlockSize[T];
  for (int64_t b = 0; b < nb; ++b) block_dot<T, M>(row + b * kTypeSize[T], x + b * kBlockSize[T], ldx, acc);
  for (int m = 0; m < M; ++m) {
    float a[kLanes];
    store(a, acc[m]);
    store(a + 16, acc[M + m]);
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int l = 0; l < width; ++l) a[l] = a[l] + a[l + width];
    out[m] = a[0];
  }
}

constexpr bool in_registers(int T) { return T >= Q4_0; }
#else
constexpr bool in_registers(int) { return false; }
#endif

using DotFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
constexpr DotFn kDot[kMaxRows + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
                                      dot_rows<5>, dot_rows<6>, dot_rows<7>, dot_rows<8>};

#if GS_AVX512 || GS_AVX2
using RowDotFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, float*);
template <int T>
constexpr RowDotFn kRowDot[kMaxRows + 1] = {nullptr, row_dot<T, 1>, row_dot<T, 2>, row_dot<T, 3>, row_dot<T, 4>,
                                            row_dot<T, 5>, row_dot<T, 6>, row_dot<T, 7>, row_dot<T, 8>};
#endif

template <int T>
void run(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias, float* y) {
  const int64_t row_bytes = k / kBlockSize[T] * kTypeSize[T];
  // About 256 KB of weights per task: enough to amortize the pool, small enough to share 1.5B's matrices.
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> wbuf(static_cast<size_t>(k));
    float out[kMaxRows];
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* row = blocks + j * row_bytes;
      const float b = bias ? bias[j] : 0.0f;
#if GS_AVX512 || GS_AVX2
      if constexpr (in_registers(T)) {
        if (m <= kMaxRows) {  // decode / verify: dequantized in registers, the weight row read once
          kRowDot<T>[m](row, x, k, k, out);
          for (int64_t i = 0; i < m; ++i) y[i * n + j] = bias ? out[i] + b : out[i];
          continue;
        }
      }
#endif
      // more rows (prefill), F32 / F16 / BF16, and the generic level: the row dequantized once into wbuf
      dequant_row<T>(row, k, wbuf.data());
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, m - r);
        kDot[rows](wbuf.data(), x + r * k, k, k, out);
        for (int64_t i = 0; i < rows; ++i) y[(r + i) * n + j] = bias ? out[i] + b : out[i];
      }
    }
  });
}

using RunFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*);
constexpr RunFn kRun[kNumTypes] = {run<F32>, run<F16>, run<BF16>, run<Q4_0>, run<Q4_1>, run<Q5_0>,
                                   run<Q5_1>, run<Q8_0>, run<Q4_K>, run<Q5_K>, run<Q6_K>};

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n, int64_t k,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(type >= 0 && type < kNumTypes, "qlinear: unknown block type ", type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              "qlinear: x must be a contiguous CPU float32 [M, ", k, "] tensor, got ", x.sizes());
  TORCH_CHECK(k % kBlockSize[type] == 0, "qlinear: K=", k, " is not a multiple of the block size ",
              kBlockSize[type]);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu() &&
                  blocks.numel() == n * (k / kBlockSize[type]) * kTypeSize[type],
              "qlinear: blocks must be a contiguous CPU uint8 tensor of ", n * (k / kBlockSize[type]) * kTypeSize[type],
              " bytes for a [", n, ", ", k, "] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "qlinear: bias must be a contiguous float32 [", n, "] tensor");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) kRun[type](x.data_ptr<float>(), m, k, blocks.data_ptr<uint8_t>(), n, b, y.data_ptr<float>());
  return y;
}

std::string level_name() { return GS_LEVEL_NAME; }

}  // namespace

GS_LIBRARY(m) {
  m.def("level", &level_name);
  m.def("qlinear(Tensor x, Tensor blocks, int type, int n, int k, Tensor? bias) -> Tensor", &qlinear);
}
