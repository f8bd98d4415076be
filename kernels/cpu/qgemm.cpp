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

// Q4_K / Q5_K: the 12 bytes of 6-bit fields -> the 8 sub-blocks' scales sc[0..7] (bytes 0-7 of `out`) and mins
// m[0..7] (bytes 8-15), as ggml's get_scale_min_k4; four fields at a time in 32-bit words.
inline void k_fields(const uint8_t* __restrict s, uint8_t* __restrict out) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t words[4] = {a & 0x3F3F3F3Fu, (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u),   // sc 0-3, 4-7
                             b & 0x3F3F3F3Fu, ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)};  // m 0-3, 4-7
  std::memcpy(out, words, 16);
}

// Q4_K / Q5_K: the 8 sub-blocks' scales d * sc[j] and offsets dmin * m[j], fp32.
inline void k_scales(const uint8_t* __restrict s, float d, float dmin, float* __restrict ds, float* __restrict dm) {
  uint8_t f[16];
  k_fields(s, f);
  for (int j = 0; j < 8; ++j) {
    ds[j] = d * static_cast<float>(f[j]);
    dm[j] = dmin * static_cast<float>(f[8 + j]);
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
inline void store(float* p, VF a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#endif

#define GS_INLINE __attribute__((always_inline)) inline

inline VF loadx(const float* p) {
#if GS_AVX512
  return {_mm512_loadu_ps(p)};
#else
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
#endif
}
GS_INLINE VF fma(VF w, VF x, VF acc) {
#if GS_AVX512
  return {_mm512_fmadd_ps(w.v, x.v, acc.v)};
#else
  return {_mm256_fmadd_ps(w.lo, x.lo, acc.lo), _mm256_fmadd_ps(w.hi, x.hi, acc.hi)};
#endif
}
// 16 int8 lanes of an xmm, sign-extended to 16 int32 lanes.
GS_INLINE VI widen_i8(__m128i q) {
#if GS_AVX512
  return {_mm512_cvtepi8_epi32(q)};
#else
  return {_mm256_cvtepi8_epi32(q), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))};
#endif
}

#if GS_AVX512
// 4-bit formats at avx512: a sub-block's 16 possible weights, computed once with the same fp32 operations as
// for each weight (so the same values), then looked up per weight with vpermps (which reads the low 4 bits of each
// index lane, so the low nibbles need no mask): one shuffle instead of a convert, a multiply and an add.
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
GS_INLINE VF lookup(VI idx, __m512 table) { return {_mm512_permutexvar_ps(idx.v, table)}; }
#endif

// The weights of one weight row's block, dequantized in registers 32 at a time: block(p) reads the block's scales
// once; part(s, w) gives the weights k = 32 s .. 32 s + 31 of the block as two 16-lane chunks, with the same fp32
// operations as dequant_row (so the same values).
template <int T>
struct Dec {
  static constexpr int kSubs = kBlockSize[T] / 32;
  const uint8_t* p;
  float d, mn;
  float ds[16], dm[8];
#if GS_AVX512
  __m512 t0, t1;  // Q4_0 / Q4_1: the block's 16 values; Q5_0 / Q5_1: its 32 values as two tables
#endif

  GS_INLINE void block(const uint8_t* q) {
    p = q;
    if constexpr (T == Q8_0) {
      d = h2f(q);
    } else if constexpr (T == Q4_0 || T == Q4_1) {
      d = h2f(q);
#if GS_AVX512
      const __m512 v = T == Q4_0 ? _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)) : iota16();  // float(q) or (q - 8)
      t0 = _mm512_mul_ps(_mm512_set1_ps(d), v);
      if constexpr (T == Q4_1) t0 = _mm512_add_ps(t0, _mm512_set1_ps(h2f(q + 2)));
#else
      if constexpr (T == Q4_1) mn = h2f(q + 2);
#endif
    } else if constexpr (T == Q5_0 || T == Q5_1) {
      d = h2f(q);
#if GS_AVX512
      const __m512 iota = iota16(), dv = _mm512_set1_ps(d), sixteen = _mm512_set1_ps(16.0f);
      if constexpr (T == Q5_0) {
        t0 = _mm512_mul_ps(dv, _mm512_sub_ps(iota, sixteen));  // q = 0..15: d * (q - 16)
        t1 = _mm512_mul_ps(dv, iota);                          // q = 16..31
      } else {
        const __m512 mv = _mm512_set1_ps(h2f(q + 2));
        t0 = _mm512_add_ps(_mm512_mul_ps(dv, iota), mv);
        t1 = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_add_ps(iota, sixteen)), mv);
      }
#else
      if constexpr (T == Q5_1) mn = h2f(q + 2);
#endif
    } else if constexpr (T == Q4_K || T == Q5_K) {
      // k_scales with the 8 scales and the 8 mins each converted in one register
      uint8_t f[16];
      k_fields(q + 4, f);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f));
      _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(h2f(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
      _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(h2f(q + 2)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
    } else if constexpr (T == Q6_K) {
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 192));
      const __m256 dd = _mm256_set1_ps(h2f(q + 208));
      _mm256_storeu_ps(ds, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
      _mm256_storeu_ps(ds + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
  }

  // Q4_0 / Q5_0: d * (q - 8 or 16); Q4_1 / Q5_1: d * q + m (dequant_row's operations).
  GS_INLINE VF affine(VI q) const {
    if constexpr (T == Q4_0 || T == Q5_0) return mul(cvt(sub(q, T == Q4_0 ? 8 : 16)), d);
    else return add(mul(cvt(q), d), mn);
  }

  GS_INLINE void part(int s, VF* w) const {
    if constexpr (T == Q8_0) {
      w[0] = mul(cvt(load_i8(p + 2)), d);
      w[1] = mul(cvt(load_i8(p + 18)), d);
    } else if constexpr (T == Q4_0 || T == Q4_1) {
      const VI raw = load_u8(p + (T == Q4_0 ? 2 : 4));
#if GS_AVX512
      w[0] = lookup(raw, t0);
      w[1] = lookup(srl(raw, 4), t0);
#else
      w[0] = affine(and_(raw, 0xF));
      w[1] = affine(srl(raw, 4));
#endif
    } else if constexpr (T == Q5_0 || T == Q5_1) {
      const int off = T == Q5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, p + off, 4);
      const VI raw = load_u8(p + off + 4);
#if GS_AVX512
      // the fifth bit set from qh as a mask, vpermt2ps looks up the block's 32 values
      const __m512i lo = _mm512_and_si512(raw.v, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(raw.v, 4);
      const __m512i s16 = _mm512_set1_epi32(16);
      const __m512i i0 = _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh & 0xFFFF), lo, s16);
      const __m512i i1 = _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, s16);
      w[0] = VF{_mm512_permutex2var_ps(t0, i0, t1)};
      w[1] = VF{_mm512_permutex2var_ps(t0, i1, t1)};
#else
      w[0] = affine(or_(and_(raw, 0xF), sll(bits16(qh), 4)));
      w[1] = affine(or_(srl(raw, 4), sll(bits16(qh >> 16), 4)));
#endif
    } else if constexpr (T == Q4_K || T == Q5_K) {
      // sub-block s: the low (even s) or high nibbles of qs bytes 32 (s / 2) .., and bit s of the qh bytes
      const uint8_t* qs = p + (T == Q4_K ? 16 : 48) + 32 * (s / 2);
      const VI r0 = load_u8(qs), r1 = load_u8(qs + 16);
      const int half = s & 1;
#if GS_AVX512
      if constexpr (T == Q4_K) {
        const __m512 table = _mm512_sub_ps(_mm512_mul_ps(iota16(), _mm512_set1_ps(ds[s])), _mm512_set1_ps(dm[s]));
        w[0] = lookup(half ? srl(r0, 4) : r0, table);
        w[1] = lookup(half ? srl(r1, 4) : r1, table);
        return;
      }
#endif
      VI q0 = half ? srl(r0, 4) : and_(r0, 0xF), q1 = half ? srl(r1, 4) : and_(r1, 0xF);
      if constexpr (T == Q5_K) {
        q0 = or_(q0, sll(and_(srl(load_u8(p + 16), s), 1), 4));
        q1 = or_(q1, sll(and_(srl(load_u8(p + 32), s), 1), 4));
      }
      w[0] = sub(mul(cvt(q0), ds[s]), dm[s]);
      w[1] = sub(mul(cvt(q1), ds[s]), dm[s]);
    } else if constexpr (T == Q6_K) {
      // group s = 4 h + g: the low (g < 2) or high nibbles of ql bytes 64 h + 32 (g % 2) .., bits 2 g, 2 g + 1 of
      // the qh bytes 32 h .., minus 32; in byte lanes (a 16-bit shift, then a mask that keeps each byte's own bits)
      const int h = s / 4, g = s % 4;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (g % 2)));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      const __m256i lo4 = _mm256_and_si256(g / 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
      const __m256i hi2 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(0x03));
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo4, _mm256_slli_epi16(hi2, 4)), _mm256_set1_epi8(32));
      w[0] = mul(cvt(widen_i8(_mm256_castsi256_si128(q))), ds[2 * s]);
      w[1] = mul(cvt(widen_i8(_mm256_extracti128_si256(q, 1))), ds[2 * s + 1]);
    }
  }
};

// One weight row times M rows of x, the weights dequantized in registers and read once. The same sums as dot_rows
// on the dequantized row: chunk c (k = 32 s + 16 c ..) of every 32 goes to acc[c][m], whose lane l is dot_rows'
// lane 16 c + l, so a row's bits do not depend on M.
template <int T, int M>
void row_dot(const uint8_t* __restrict row, const float* __restrict x, int64_t ldx, int64_t k, float* __restrict out) {
  VF acc[2][M];
  for (int c = 0; c < 2; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = zero();
  const int64_t nb = k / kBlockSize[T];
  for (int64_t b = 0; b < nb; ++b) {
    Dec<T> dec;
    dec.block(row + b * kTypeSize[T]);
    const float* xb = x + b * kBlockSize[T];
#pragma GCC unroll 8
    for (int s = 0; s < Dec<T>::kSubs; ++s) {
      VF w[2];
      dec.part(s, w);
      for (int c = 0; c < 2; ++c)
        for (int m = 0; m < M; ++m) acc[c][m] = fma(w[c], loadx(xb + m * ldx + 32 * s + 16 * c), acc[c][m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float a[kLanes];
    store(a, acc[0][m]);
    store(a + 16, acc[1][m]);
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int l = 0; l < width; ++l) a[l] = a[l] + a[l + width];
    out[m] = a[0];
  }
}

// Weight rows n0 .. n1 times the M rows of x into y (row stride n), bias added.
template <int T, int M>
void rows_range(const uint8_t* blocks, int64_t row_bytes, const float* x, int64_t k, int64_t n0, int64_t n1,
                int64_t n, const float* bias, float* y) {
  float out[M];
  for (int64_t j = n0; j < n1; ++j) {
    row_dot<T, M>(blocks + j * row_bytes, x, k, k, out);
    for (int m = 0; m < M; ++m) y[m * n + j] = bias ? out[m] + bias[j] : out[m];
  }
}

constexpr bool in_registers(int T) { return T >= Q4_0; }
#else
constexpr bool in_registers(int) { return false; }
#endif


// ---------------------------------------------------------------------------------------------------------------
// a8: the k-quants (Q4_K, Q5_K, Q6_K) times activations rounded to int8 per super-block of 256, integer dot products
// (llama.cpp's arithmetic for these formats; graphspec.kernels.qlinear, "Activations rounded to int8").
//
// Each row of x, each super-block b of 256: amax = max |x|, dx = amax / 127, q = round-half-even(x * (127 / amax))
// (|q| <= 127; all zeros where amax is 0; a NaN or infinity makes dx NaN, so the outputs are NaN, as in fp32).
// The weights are the GGUF's values in their factored form: Q4_K / Q5_K w = d sc_s q - dmin m_s, Q6_K
// w = d sc_g (q - 32), so
//     y = sum_b dx_b d_b S_b  -  sum_b sum_s (dmin_b m_s) (dx_b xsum_s)          (the second term Q4_K / Q5_K only)
// with S_b = sum_s sc_s (q_w . q_x)_s (Q6_K: minus 32 sum_g sc_g xsum_g) an exact integer. The only roundings are
// fp32's in the combination, in one fixed order: S_b is kept as 16 int32 lanes (lane l: the products of bytes
// 4l .. 4l + 3 of each of the super-block's four 64-weight units; Q6_K's offset term in lanes 0-7), converted
// and fused-multiply-added with the fp32 product d * dx into 16 fp32 lanes, then (Q4_K / Q5_K) the mins term of
// sub-block s fused-multiply-subtracted from lane s; at the end the 16 lanes are added pairwise (8, 4, 2, 1
// apart). Every
// level computes these same bits (avx512 in zmm, avx2 in pairs of ymm, generic lane by lane).
//
// The 64 weights of unit u are unsigned (0..15, 0..31, 0..63) in byte lanes; maddubs (u8 x s8 -> pairs summed in
// int16, at most 2 * 63 * 127, so never saturated) and a multiply-add of int16 pairs with the sub-block scales
// (vpdpwssd at avx512, vpmaddwd + add at avx2) accumulate them. Q4_K / Q5_K units take their nibbles from 64 bytes
// at once, so unit u holds sub-blocks kUnitK[u] (two of 32): x is stored in that order when it is quantized.

constexpr int kUnitK[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

constexpr bool is_k(int64_t T) { return T == Q4_K || T == Q5_K || T == Q6_K; }

// The activations of M rows, quantized per super-block (see above).
struct XA8 {
  std::vector<int8_t> q;     // [M, K]: super-block b's 256 values, Q4_K / Q5_K in unit order
  std::vector<float> dx;     // [M, K / 256]
  std::vector<float> mt;     // Q4_K / Q5_K: [M, K / 256, 8]: dx * (sum of sub-block s's 32 q), s in natural order
  std::vector<int16_t> xs;   // Q6_K: [M, K / 256, 16]: sums of each 16 q
};

template <int T>
void quantize_a8(const float* __restrict x, int64_t m, int64_t k, XA8& a) {
  const int64_t nsb = k / 256;
  a.q.resize(static_cast<size_t>(m * k));
  a.dx.resize(static_cast<size_t>(m * nsb));
  if constexpr (T == Q6_K) a.xs.resize(static_cast<size_t>(m * nsb * 16));
  else a.mt.resize(static_cast<size_t>(m * nsb * 8));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nsb; ++b) {
      const float* xb = x + r * k + b * 256;
      float amax = 0.0f, probe = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : probe)
      for (int j = 0; j < 256; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        probe += xb[j] * 0.0f;  // NaN where any value is NaN or infinite
      }
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float dx = amax / 127.0f + probe;
      a.dx[r * nsb + b] = dx;
      int8_t* qb = a.q.data() + r * k + b * 256;
      int32_t sums[8];
      for (int slot = 0; slot < 8; ++slot) {
        const int s = T == Q6_K ? slot : kUnitK[slot / 2][slot % 2];
        const float* src = xb + 32 * s;
        int8_t* dst = qb + 32 * slot;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < 32; ++j) {
          const int v = static_cast<int>(std::nearbyint(src[j] * id));
          dst[j] = static_cast<int8_t>(v);
          sum += v;
        }
        sums[s] = sum;
      }
      if constexpr (T == Q6_K) {
        int16_t* xs = a.xs.data() + (r * nsb + b) * 16;
        for (int g = 0; g < 16; ++g) {
          int32_t s = 0;
          for (int j = 0; j < 16; ++j) s += qb[16 * g + j];
          xs[g] = static_cast<int16_t>(s);
        }
      } else {
        float* mt = a.mt.data() + (r * nsb + b) * 8;
        for (int s = 0; s < 8; ++s) mt[s] = dx * static_cast<float>(sums[s]);
      }
    }
  }
}

// Which of the super-block's scales multiplies int16 lane i (bytes 2i, 2i + 1) of unit u: Q4_K / Q5_K lanes 0-15
// sub-block kUnitK[u][0], 16-31 kUnitK[u][1]; Q6_K (sixteen scales of 16 weights) lanes 8j .. 8j + 7 scale 4u + j.
template <int T>
constexpr int unit_scale_index(int u, int i) { return T == Q6_K ? 4 * u + i / 8 : kUnitK[u][i / 16]; }

// The same as shuffle indices: int16 lanes (vpermw) and byte lanes of each 16-lane half (vpshufb).
template <int T>
struct UnitIndex {
  alignas(64) int16_t w[4][32] = {};
  alignas(16) int8_t b[4][32] = {};
  constexpr UnitIndex() {
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < 32; ++i) {
        w[u][i] = static_cast<int16_t>(unit_scale_index<T>(u, i));
        b[u][i] = static_cast<int8_t>(unit_scale_index<T>(u, i));
      }
  }
};
template <int T>
constexpr UnitIndex<T> kUnitIndex{};

// The integer and fp32 lanes a8 needs, per level. U8V: 64 bytes; I16V: 32 int16; I32V / F32V: 16 lanes.
#if GS_AVX512
struct U8V { __m512i v; };
struct I16V { __m512i v; };
struct I32V { __m512i v; };
struct F32V { __m512 v; };
GS_INLINE U8V u8_load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
GS_INLINE U8V lo4(U8V a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
GS_INLINE U8V hi4(U8V a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
GS_INLINE U8V or8(U8V a, U8V b) { return {_mm512_or_si512(a.v, b.v)}; }
// bytes 0-31: ((h[l] >> s0) & mask) << 4, bytes 32-63: the same with s1 (h: 32 bytes)
GS_INLINE U8V high_bits(const uint8_t* h, int s0, int s1, int mask) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(s0)), _mm256_set1_epi16(static_cast<int16_t>(s1)), 1);
  return {_mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8(static_cast<char>(mask))), 4)};
}
GS_INLINE I16V maddubs(U8V w, const int8_t* x) { return {_mm512_maddubs_epi16(w.v, _mm512_loadu_si512(x))}; }
GS_INLINE I32V i32_zero() { return {_mm512_setzero_si512()}; }
GS_INLINE I32V dpwssd(I32V acc, I16V a, I16V b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
// int16 lane i of unit u's scales = scale idx[u][i] of the super-block (one vpermw each)
template <int T>
GS_INLINE void unit_scales(const uint8_t* sc, I16V* out) {
  __m512i v;
  if constexpr (T == Q6_K) v = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
  else v = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
  for (int u = 0; u < 4; ++u) out[u] = {_mm512_permutexvar_epi16(_mm512_load_si512(kUnitIndex<T>.w[u]), v)};
}
// lanes 0-7 -= 32 * (sc[2l] xs[2l] + sc[2l + 1] xs[2l + 1])
GS_INLINE I32V sub_offset(I32V acc, const int8_t* sc, const int16_t* xs) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  const __m256i c = _mm256_slli_epi32(_mm256_madd_epi16(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs))), 5);
  return {_mm512_sub_epi32(acc.v, _mm512_zextsi256_si512(c))};
}
GS_INLINE F32V f32_zero() { return {_mm512_setzero_ps()}; }
GS_INLINE F32V fma_cvt(I32V a, float t, F32V acc) { return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(a.v), _mm512_set1_ps(t), acc.v)}; }
GS_INLINE void f32_store(float* p, F32V a) { _mm512_storeu_ps(p, a.v); }
#define GS_F8_AVX 1
#elif GS_AVX2
struct U8V { __m256i lo, hi; };
struct I16V { __m256i lo, hi; };
struct I32V { __m256i lo, hi; };
struct F32V { __m256 lo, hi; };
GS_INLINE U8V u8_load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
GS_INLINE U8V lo4(U8V a) { const __m256i m = _mm256_set1_epi8(0x0F); return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)}; }
GS_INLINE U8V hi4(U8V a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}
GS_INLINE U8V or8(U8V a, U8V b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
GS_INLINE U8V high_bits(const uint8_t* h, int s0, int s1, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  const __m256i mk = _mm256_set1_epi8(static_cast<char>(mask));
  return {_mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s0)), mk), 4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s1)), mk), 4)};
}
GS_INLINE I16V maddubs(U8V w, const int8_t* x) {
  return {_mm256_maddubs_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
          _mm256_maddubs_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)))};
}
GS_INLINE I32V i32_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
GS_INLINE I32V dpwssd(I32V acc, I16V a, I16V b) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
template <int T>
GS_INLINE void unit_scales(const uint8_t* sc, I16V* out) {
  // the scale bytes picked per int16 lane with vpshufb, then widened: 16 lanes a half
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  for (int u = 0; u < 4; ++u) {
    const __m128i a = _mm_shuffle_epi8(v, _mm_load_si128(reinterpret_cast<const __m128i*>(kUnitIndex<T>.b[u])));
    const __m128i b = _mm_shuffle_epi8(v, _mm_load_si128(reinterpret_cast<const __m128i*>(kUnitIndex<T>.b[u] + 16)));
    if constexpr (T == Q6_K) out[u] = {_mm256_cvtepi8_epi16(a), _mm256_cvtepi8_epi16(b)};
    else out[u] = {_mm256_cvtepu8_epi16(a), _mm256_cvtepu8_epi16(b)};
  }
}
GS_INLINE I32V sub_offset(I32V acc, const int8_t* sc, const int16_t* xs) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  const __m256i c = _mm256_slli_epi32(_mm256_madd_epi16(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs))), 5);
  return {_mm256_sub_epi32(acc.lo, c), acc.hi};
}
GS_INLINE F32V f32_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
GS_INLINE F32V fma_cvt(I32V a, float t, F32V acc) {
  const __m256 tv = _mm256_set1_ps(t);
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(a.lo), tv, acc.lo), _mm256_fmadd_ps(_mm256_cvtepi32_ps(a.hi), tv, acc.hi)};
}
GS_INLINE void f32_store(float* p, F32V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#define GS_F8_AVX 1
#else
#define GS_INLINE inline
struct U8V { uint8_t v[64]; };
struct I16V { int16_t v[32]; };
struct I32V { int32_t v[16]; };
struct F32V { float v[16]; };
inline U8V u8_load(const uint8_t* p) { U8V r; std::memcpy(r.v, p, 64); return r; }
inline U8V lo4(U8V a) { for (auto& b : a.v) b &= 0x0F; return a; }
inline U8V hi4(U8V a) { for (auto& b : a.v) b = static_cast<uint8_t>(b >> 4); return a; }
inline U8V or8(U8V a, U8V b) { for (int i = 0; i < 64; ++i) a.v[i] |= b.v[i]; return a; }
inline U8V high_bits(const uint8_t* h, int s0, int s1, int mask) {
  U8V r;
  for (int i = 0; i < 32; ++i) {
    r.v[i] = static_cast<uint8_t>(((h[i] >> s0) & mask) << 4);
    r.v[32 + i] = static_cast<uint8_t>(((h[i] >> s1) & mask) << 4);
  }
  return r;
}
inline I16V maddubs(U8V w, const int8_t* x) {
  I16V r;
  for (int i = 0; i < 32; ++i) r.v[i] = static_cast<int16_t>(w.v[2 * i] * x[2 * i] + w.v[2 * i + 1] * x[2 * i + 1]);
  return r;
}
inline I32V i32_zero() { return I32V{}; }
inline I32V dpwssd(I32V acc, I16V a, I16V b) {
  for (int l = 0; l < 16; ++l) acc.v[l] += a.v[2 * l] * b.v[2 * l] + a.v[2 * l + 1] * b.v[2 * l + 1];
  return acc;
}
template <int T>
inline void unit_scales(const uint8_t* sc, I16V* out) {
  for (int u = 0; u < 4; ++u)
    for (int i = 0; i < 32; ++i) {
      const int j = unit_scale_index<T>(u, i);
      out[u].v[i] = T == Q6_K ? static_cast<int16_t>(static_cast<int8_t>(sc[j])) : static_cast<int16_t>(sc[j]);
    }
}
inline I32V sub_offset(I32V acc, const int8_t* sc, const int16_t* xs) {
  for (int l = 0; l < 8; ++l) acc.v[l] -= 32 * (sc[2 * l] * xs[2 * l] + sc[2 * l + 1] * xs[2 * l + 1]);
  return acc;
}
inline F32V f32_zero() { return F32V{}; }
inline F32V fma_cvt(I32V a, float t, F32V acc) {
  for (int l = 0; l < 16; ++l) acc.v[l] = std::fma(static_cast<float>(a.v[l]), t, acc.v[l]);
  return acc;
}
inline void f32_store(float* p, F32V a) { std::memcpy(p, a.v, 64); }
#endif

// 8 fp32 lanes: the Q4_K / Q5_K mins of a super-block, lane s for sub-block s, subtracted from lanes 0-7.
#ifdef GS_F8_AVX
struct F8V { __m256 v; };
GS_INLINE F8V f8_zero() { return {_mm256_setzero_ps()}; }
GS_INLINE F8V f8_scaled(const uint8_t* m, float d) {  // d * m[s], the mins' bytes
  return {_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)))))};
}
// lanes 0-7 of acc minus a * b[0..8) (one rounding each), lanes 8-15 unchanged
GS_INLINE F32V fnma8(F8V a, const float* b, F32V acc) {
#if GS_AVX512
  return {_mm512_mask3_fnmadd_ps(_mm512_castps256_ps512(a.v), _mm512_castps256_ps512(_mm256_loadu_ps(b)), acc.v, 0x00FF)};
#else
  return {_mm256_fnmadd_ps(a.v, _mm256_loadu_ps(b), acc.lo), acc.hi};
#endif
}
#else
struct F8V { float v[8]; };
inline F8V f8_zero() { return F8V{}; }
inline F8V f8_scaled(const uint8_t* m, float d) { F8V r; for (int s = 0; s < 8; ++s) r.v[s] = d * static_cast<float>(m[s]); return r; }
inline F32V fnma8(F8V a, const float* b, F32V acc) {
  for (int s = 0; s < 8; ++s) acc.v[s] = std::fma(-a.v[s], b[s], acc.v[s]);
  return acc;
}
#endif

// One weight row of a k-quant times M rows of quantized x (see the top of this section).
template <int T, int M>
void row_dot_a8(const uint8_t* __restrict row, const XA8& a, int64_t k, const int64_t* rows, float* __restrict out) {
  const int64_t nsb = k / 256;
  F32V acc[M];
  const int8_t* xq[M];
  for (int m = 0; m < M; ++m) {
    xq[m] = a.q.data() + rows[m] * k;
    acc[m] = f32_zero();
  }
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* p = row + b * kTypeSize[T];
    U8V w[4];
    I16V sc[4];
    float d;
    F8V dm = f8_zero();
    const int8_t* sc6 = nullptr;
    if constexpr (T == Q6_K) {
      d = h2f(p + 208);
      sc6 = reinterpret_cast<const int8_t*>(p + 192);
      for (int h = 0; h < 2; ++h) {
        const U8V l = u8_load(p + 64 * h);
        w[2 * h] = or8(lo4(l), high_bits(p + 128 + 32 * h, 0, 2, 3));
        w[2 * h + 1] = or8(hi4(l), high_bits(p + 128 + 32 * h, 4, 6, 3));
      }
      unit_scales<T>(p + 192, sc);
    } else {
      d = h2f(p);
      const float dmin = h2f(p + 2);
      uint8_t f[16];
      k_fields(p + 4, f);
      dm = f8_scaled(f + 8, dmin);
      const uint8_t* qs = p + (T == Q4_K ? 16 : 48);
      for (int h = 0; h < 2; ++h) {
        const U8V l = u8_load(qs + 64 * h);
        w[2 * h] = lo4(l);
        w[2 * h + 1] = hi4(l);
      }
      if constexpr (T == Q5_K)
        for (int u = 0; u < 4; ++u) w[u] = or8(w[u], high_bits(p + 16, kUnitK[u][0], kUnitK[u][1], 1));
      unit_scales<T>(f, sc);
    }
    // up to 4 rows at a time, unit by unit: the rows' independent chains side by side for the scheduler, and
    // few enough live registers that nothing spills at 8 rows
    for (int m0 = 0; m0 < M; m0 += 4) {
      constexpr int kGroup = M < 4 ? M : 4;
      const int g = M - m0 < kGroup ? M - m0 : kGroup;
      I32V s[kGroup];
      for (int i = 0; i < kGroup; ++i) s[i] = i32_zero();
      for (int u = 0; u < 4; ++u)
        for (int i = 0; i < kGroup; ++i)
          if (i < g) s[i] = dpwssd(s[i], maddubs(w[u], xq[m0 + i] + b * 256 + 64 * u), sc[u]);
      for (int i = 0; i < kGroup; ++i) {
        if (i >= g) break;
        const int m = m0 + i;
        const int64_t r = rows[m];
        if constexpr (T == Q6_K) s[i] = sub_offset(s[i], sc6, a.xs.data() + (r * nsb + b) * 16);
        acc[m] = fma_cvt(s[i], d * a.dx[r * nsb + b], acc[m]);
        if constexpr (T != Q6_K) acc[m] = fnma8(dm, a.mt.data() + (r * nsb + b) * 8, acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float l[16];
    f32_store(l, acc[m]);
    for (int width = 8; width >= 1; width /= 2)
      for (int i = 0; i < width; ++i) l[i] = l[i] + l[i + width];
    out[m] = l[0];
  }
}

template <int T, int M>
void rows_range_a8(const uint8_t* blocks, int64_t row_bytes, const XA8& a, int64_t k, const int64_t* rows,
                   int64_t n0, int64_t n1, int64_t n, const float* bias, float* y) {
  float out[M];
  for (int64_t j = n0; j < n1; ++j) {
    row_dot_a8<T, M>(blocks + j * row_bytes, a, k, rows, out);
    for (int m = 0; m < M; ++m) y[rows[m] * n + j] = bias ? out[m] + bias[j] : out[m];
  }
}

using RangeA8Fn = void (*)(const uint8_t*, int64_t, const XA8&, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                           const float*, float*);
template <int T>
constexpr RangeA8Fn kRangeA8[kMaxRows + 1] = {nullptr, rows_range_a8<T, 1>, rows_range_a8<T, 2>, rows_range_a8<T, 3>,
                                              rows_range_a8<T, 4>, rows_range_a8<T, 5>, rows_range_a8<T, 6>,
                                              rows_range_a8<T, 7>, rows_range_a8<T, 8>};

template <int T>
void run_a8(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias, float* y) {
  XA8 a;
  quantize_a8<T>(x, m, k, a);
  const int64_t row_bytes = k / 256 * kTypeSize[T];
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, row_bytes));
  std::vector<int64_t> rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    // up to 8 rows of x a pass: the weight rows are read and unpacked once a pass (decode, verify: once a call)
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t cnt = std::min<int64_t>(kMaxRows, m - r);
      kRangeA8<T>[cnt](blocks, row_bytes, a, k, rows.data() + r, n0, n1, n, bias, y);
    }
  });
}

using DotFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
constexpr DotFn kDot[kMaxRows + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
                                      dot_rows<5>, dot_rows<6>, dot_rows<7>, dot_rows<8>};

#if GS_AVX512 || GS_AVX2
using RangeFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, const float*,
                         float*);
template <int T>
constexpr RangeFn kRange[kMaxRows + 1] = {nullptr, rows_range<T, 1>, rows_range<T, 2>, rows_range<T, 3>,
                                          rows_range<T, 4>, rows_range<T, 5>, rows_range<T, 6>, rows_range<T, 7>,
                                          rows_range<T, 8>};
#endif

template <int T>
void run(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias, float* y) {
  const int64_t row_bytes = k / kBlockSize[T] * kTypeSize[T];
  // About 256 KB of weights per task: enough to amortize the pool, small enough to share 1.5B's matrices.
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
#if GS_AVX512 || GS_AVX2
    if constexpr (in_registers(T)) {
      if (m <= kMaxRows) {  // decode / verify: dequantized in registers, the weight rows read once
        kRange<T>[m](blocks, row_bytes, x, k, n0, n1, n, bias, y);
        return;
      }
    }
#endif
    std::vector<float> wbuf(static_cast<size_t>(k));
    float out[kMaxRows];
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* row = blocks + j * row_bytes;
      const float b = bias ? bias[j] : 0.0f;
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

// The a8 GEMMs by block type; nullptr where a format has none.
constexpr RunFn kRunA8[kNumTypes] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      run_a8<Q4_K>, run_a8<Q5_K>, run_a8<Q6_K>};

// Both ops: check the arguments (naming the op), then run y = x w^T (+ bias) with `run` of the block type.
at::Tensor checked_run(const char* op, const RunFn* runs, const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(type >= 0 && type < kNumTypes, op, ": unknown block type ", type);
  TORCH_CHECK(runs[type] != nullptr, op, ": int8 activations run Q4_K, Q5_K and Q6_K weights, got block type ", type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              op, ": x must be a contiguous CPU float32 [M, ", k, "] tensor, got ", x.sizes());
  TORCH_CHECK(k % kBlockSize[type] == 0, op, ": K=", k, " is not a multiple of the block size ", kBlockSize[type]);
  const int64_t nbytes = n * (k / kBlockSize[type]) * kTypeSize[type];
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu() &&
                  blocks.numel() == nbytes,
              op, ": blocks must be a contiguous CPU uint8 tensor of ", nbytes, " bytes for a [", n, ", ", k, "] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                op, ": bias must be a contiguous float32 [", n, "] tensor");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) runs[type](x.data_ptr<float>(), m, k, blocks.data_ptr<uint8_t>(), n, b, y.data_ptr<float>());
  return y;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n, int64_t k,
                   const c10::optional<at::Tensor>& bias) {
  return checked_run("qlinear", kRun, x, blocks, type, n, k, bias);
}

at::Tensor qlinear_a8(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias) {
  return checked_run("qlinear_a8", kRunA8, x, blocks, type, n, k, bias);
}

std::string level_name() { return GS_LEVEL_NAME; }

}  // namespace

GS_LIBRARY(m) {
  m.def("level", &level_name);
  m.def("qlinear(Tensor x, Tensor blocks, int type, int n, int k, Tensor? bias) -> Tensor", &qlinear);
  m.def("qlinear_a8(Tensor x, Tensor blocks, int type, int n, int k, Tensor? bias) -> Tensor", &qlinear_a8);
}
