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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "level.h"

#if GS_AMX && !defined(__AMX_INT8__)
#error "the amx level is built with -mamx-int8 (graphspec.kernels.cpu._FLAGS)"
#endif

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
// x: each row, each super-block b of 256: amax = max |x|, dx = amax / 127, q = round-half-even(x * (127 / amax))
// (|q| <= 127; all zeros where amax is 0; a NaN or infinity makes dx NaN, so the outputs are NaN, as in fp32).
//
// The weights are read from tiles (graphspec.kernels.qlinear.pack_a8): 16 weight rows interleaved per super-block,
// decoded. The quants' low 4 bits are in 32 runs of 64 bytes: run j, bytes 4r .. 4r + 3 hold quad j (weights
// 4j .. 4j + 3) of row r in their low nibbles and quad j + 32 in their high ones. Q5_K's fifth bits are in 8 runs
// (bit t of run h: quad h + 8t), Q6_K's top two bits in 16 (bits 2t, 2t + 1 of run h: quad h + 16t). The scales,
// mins, d and dmin of the 16 rows lie side by side. So one vector of the tile times the broadcast int8 quad of x
// (vpdpbusd) makes 4 products for each of 16 rows, and nothing is reduced across lanes: lane r is output row r.
// The runs and scales are stored in the order the kernels read them (sub-block pair by pair), so a tile row is
// one sequential stream, which the hardware prefetchers follow (Q6_K read its regions alternately at first and
// streamed from memory at half the speed).
//
// Per output row and super-block, exact integers:
//   Q4_K / Q5_K  S = sum_s sc_s D_s,  Mn = sum_s m_s X_s    (D_s = sum of sub-block s's 32 products, X_s = sum of
//                                                            its 32 q; sc, m the six-bit scales and mins)
//   Q6_K         S = sum_g sc_g (D_g - 32 X_g)               (g: the 16 groups of 16; sc signed int8)
// then, in fp32 and in this order (fused multiply-adds, one rounding each):
//   acc = fma(float(S), d * dx, acc);   Q4_K / Q5_K: acc = fma(-float(Mn), dmin * dx, acc)
// over b = 0, 1, ..., and y = acc (+ bias). float(S) is exact while |S| < 2^24. Every level computes these bits
// (avx512 with vpdpbusd + vpmulld on 16 rows, avx2 with vpmaddubsw + vpmaddwd on 8, generic row by row), and a
// row's bits do not depend on the other rows, the row count or the threads.

#ifndef GS_INLINE
#define GS_INLINE inline
#endif

constexpr int kTileRows = 16;
template <int T>
constexpr int64_t kTileBytes = T == Q4_K ? 2368 : T == Q5_K ? 2880 : 3360;  // 16 rows of one super-block
template <int T>
constexpr int kHighBase = T == Q5_K ? 512 : 0;  // Q5_K's 8 high runs come first: every pass reads them
// Byte offsets in a tile. Q4_K / Q5_K: pass s (0..3) = runs 8s .. 8s + 7, then the scales of sub-blocks s and
// s + 4; then the mins, d, dmin. Q6_K: pass p (0..3) = runs 4p .. 4p + 3, runs 4p + 16 .. 4p + 19, high runs
// 4p .. 4p + 3, the scales of groups p, p + 8, p + 4, p + 12; then d.
template <int T>
constexpr int nib_off(int j) {
  return T == Q6_K ? 832 * ((j % 16) / 4) + 256 * (j / 16) + 64 * (j % 4) : kHighBase<T> + 544 * (j / 8) + 64 * (j % 8);
}
template <int T>
constexpr int high_off(int h) { return T == Q6_K ? 832 * (h / 4) + 512 + 64 * (h % 4) : 64 * h; }
constexpr int kQ6Slot[4] = {0, 2, 1, 3};  // a Q6_K pass's scale slot for groups 4a .. 4a + 3
template <int T>
constexpr int sc_off(int s) {  // the 16 rows' scales of sub-block (Q6_K: group) s
  return T == Q6_K ? 832 * (s % 4) + 768 + 16 * kQ6Slot[s / 4] : kHighBase<T> + 544 * (s % 4) + 512 + 16 * (s / 4);
}
template <int T>
constexpr int kMnOff = kHighBase<T> + 2176;  // Q4_K / Q5_K mins: [4 pairs][16 rows][sub-blocks 2p, 2p + 1]
template <int T>
constexpr int kDOff = T == Q6_K ? 3328 : kHighBase<T> + 2304;  // d: [16 rows] fp16, then (Q4_K / Q5_K) dmin
template <int T>
constexpr int kSums = T == Q6_K ? 16 : 8;  // the sums of q per super-block the weights need (X above)

// The activations of M rows, quantized per super-block (see above).
struct XA8 {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> dx;    // [M, K / 256]
  std::vector<int16_t> xs;  // [M, K / 256, kSums]: the sums of each 32 (Q4_K / Q5_K) or 16 (Q6_K) q
};

template <int T>
void quantize_a8(const float* __restrict x, int64_t m, int64_t k, XA8& a) {
  const int64_t nsb = k / 256;
  constexpr int span = 256 / kSums<T>;
  a.q.resize(static_cast<size_t>(m * k));
  a.dx.resize(static_cast<size_t>(m * nsb));
  a.xs.resize(static_cast<size_t>(m * nsb * kSums<T>));
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
      a.dx[r * nsb + b] = amax / 127.0f + probe;
      int8_t* qb = a.q.data() + r * k + b * 256;
      int16_t* xs = a.xs.data() + (r * nsb + b) * kSums<T>;
      for (int s = 0; s < kSums<T>; ++s) {
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < span; ++j) {
          const int v = static_cast<int>(std::nearbyint(xb[span * s + j] * id));
          qb[span * s + j] = static_cast<int8_t>(v);
          sum += v;
        }
        xs[s] = static_cast<int16_t>(sum);
      }
    }
  }
}

GS_INLINE int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if GS_AVX512
// keep(v) is v, and the compiler may not regroup the running sums across this point (as the avx2 keep below): at 4-6
// rows of x GCC otherwise spills 60-360 vectors a super-block.
GS_INLINE __m512i keep(__m512i v) {
  asm("" : "+v"(v));
  return v;
}
// Q5_K: bit `bit` of each byte of h moved to bit 4 (16-bit shifts; the mask drops what crosses between bytes).
template <int bit>
GS_INLINE __m512i bit_to4(__m512i h) {
  const __m512i m = _mm512_set1_epi8(0x10);
  if constexpr (bit < 4) return _mm512_and_si512(_mm512_slli_epi16(h, 4 - bit), m);
  else if constexpr (bit > 4) return _mm512_and_si512(_mm512_srli_epi16(h, bit - 4), m);
  else return _mm512_and_si512(h, m);
}

// Q6_K: quad i of groups p, p + 8, p + 4, p + 12 (j = 4p + i; the low and high nibbles of runs j and j + 16 with
// their high run's bit pairs), 16 rows' quants 0 .. 63.
GS_INLINE void q6_quads(const uint8_t* __restrict t, int j, __m512i* w) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i va = _mm512_loadu_si512(t + nib_off<Q6_K>(j)), vb = _mm512_loadu_si512(t + nib_off<Q6_K>(j + 16));
  const __m512i h = _mm512_loadu_si512(t + high_off<Q6_K>(j));
  w[0] = _mm512_or_si512(_mm512_and_si512(va, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
  w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(va, 4), m4), _mm512_and_si512(h, m30));
  w[2] = _mm512_or_si512(_mm512_and_si512(vb, m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(vb, 4), m4),
                         _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
}

// Q4_K / Q5_K: quad 8s + i of sub-blocks s (lo) and s + 4 (hi), 16 rows' quants (Q5_K: with their fifth bits).
template <int T>
GS_INLINE void k_quads(const uint8_t* __restrict t, int s, int i, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(t + nib_off<T>(8 * s + i));
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  if constexpr (T == Q5_K) {  // high run i: bit s (quad 8s + i), bit s + 4 (quad 8s + i + 32)
    const __m512i h = _mm512_loadu_si512(t + high_off<T>(i));
    switch (s) {
      case 0: lo = _mm512_or_si512(lo, bit_to4<0>(h)); hi = _mm512_or_si512(hi, bit_to4<4>(h)); break;
      case 1: lo = _mm512_or_si512(lo, bit_to4<1>(h)); hi = _mm512_or_si512(hi, bit_to4<5>(h)); break;
      case 2: lo = _mm512_or_si512(lo, bit_to4<2>(h)); hi = _mm512_or_si512(hi, bit_to4<6>(h)); break;
      default: lo = _mm512_or_si512(lo, bit_to4<3>(h)); hi = _mm512_or_si512(hi, bit_to4<7>(h)); break;
    }
  }
}

// One tile row (16 weight rows, nsb super-blocks) times G rows of x; acc[m] lane r: output row r of x row m.
template <int T, int G>
GS_INLINE void tile_a8(const uint8_t* __restrict t, int64_t nsb, const int8_t* const* xq, const float* const* dx,
                       const int16_t* const* xs, __m512* acc) {
  for (int64_t b = 0; b < nsb; ++b, t += kTileBytes<T>) {
    __m512i S[G];
    for (int m = 0; m < G; ++m) S[m] = _mm512_setzero_si512();
    if constexpr (T == Q6_K) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // groups p, p + 8 (runs 4p.., low and high nibbles), p + 4, p + 12 (4p + 16..)
        __m512i D[G][4];
        for (int m = 0; m < G; ++m) D[m][0] = D[m][1] = D[m][2] = D[m][3] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const int j = 4 * p + i;
          __m512i w[4];
          q6_quads(t, j, w);
          for (int m = 0; m < G; ++m) {
            const int8_t* x = xq[m] + b * 256 + 4 * j;  // quads j, j + 32, j + 16, j + 48
            D[m][0] = keep(_mm512_dpbusd_epi32(D[m][0], w[0], _mm512_set1_epi32(load_i32(x))));
            D[m][1] = keep(_mm512_dpbusd_epi32(D[m][1], w[1], _mm512_set1_epi32(load_i32(x + 128))));
            D[m][2] = keep(_mm512_dpbusd_epi32(D[m][2], w[2], _mm512_set1_epi32(load_i32(x + 64))));
            D[m][3] = keep(_mm512_dpbusd_epi32(D[m][3], w[3], _mm512_set1_epi32(load_i32(x + 192))));
          }
        }
        const int grp[4] = {p, p + 8, p + 4, p + 12};
        for (int q = 0; q < 4; ++q) {
          const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + sc_off<T>(grp[q]))));
          for (int m = 0; m < G; ++m) {
            const __m512i e = _mm512_sub_epi32(D[m][q], _mm512_set1_epi32(32 * xs[m][b * 16 + grp[q]]));
            S[m] = keep(_mm512_add_epi32(S[m], _mm512_mullo_epi32(e, c)));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kDOff<T>)));
      for (int m = 0; m < G; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[m]), _mm512_mul_ps(d, _mm512_set1_ps(dx[m][b])), acc[m]);
    } else {
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {  // sub-blocks s (low nibbles of runs 8s ..) and s + 4 (their high nibbles)
        __m512i D0[G], D1[G];
        for (int m = 0; m < G; ++m) D0[m] = D1[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const int j = 8 * s + i;
          __m512i lo, hi;
          k_quads<T>(t, s, i, lo, hi);
          for (int m = 0; m < G; ++m) {
            D0[m] = keep(_mm512_dpbusd_epi32(D0[m], lo, _mm512_set1_epi32(load_i32(xq[m] + b * 256 + 4 * j))));
            D1[m] = keep(_mm512_dpbusd_epi32(D1[m], hi, _mm512_set1_epi32(load_i32(xq[m] + b * 256 + 128 + 4 * j))));
          }
        }
        const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + sc_off<T>(s))));
        const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + sc_off<T>(s + 4))));
        for (int m = 0; m < G; ++m)
          S[m] = keep(_mm512_add_epi32(S[m], _mm512_add_epi32(_mm512_mullo_epi32(D0[m], c0), _mm512_mullo_epi32(D1[m], c1))));
      }
      __m512i Mn[G];
      for (int m = 0; m < G; ++m) Mn[m] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {  // mins of sub-blocks 2p, 2p + 1 (int16 pairs) times their sums of q
        const __m512i mz = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kMnOff<T> + 32 * p)));
        for (int m = 0; m < G; ++m)
          Mn[m] = keep(_mm512_dpwssd_epi32(Mn[m], mz, _mm512_set1_epi32(load_i32(xs[m] + b * 8 + 2 * p))));
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kDOff<T>)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kDOff<T> + 32)));
      for (int m = 0; m < G; ++m) {
        const __m512 x = _mm512_set1_ps(dx[m][b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[m]), _mm512_mul_ps(d, x), acc[m]);
        acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Mn[m]), _mm512_mul_ps(dmin, x), acc[m]);
      }
    }
  }
}

#elif GS_AVX2
template <int bit>
GS_INLINE __m256i bit_to4(__m256i h) {
  const __m256i m = _mm256_set1_epi8(0x10);
  if constexpr (bit < 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - bit), m);
  else if constexpr (bit > 4) return _mm256_and_si256(_mm256_srli_epi16(h, bit - 4), m);
  else return _mm256_and_si256(h, m);
}

// The 8 rows' scales of one sub-block (16 bytes at p, rows from `rh`) in both int16 halves of each row's lane, so
// that vpmaddwd of a quad's pair sums with them is sc * (the quad's sum).
template <bool is_signed>
GS_INLINE __m256i scale_pairs(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i c = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  return _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(c, 16));
}

// keep(v) is v, and the compiler may not move the sums into it across this point. Without it GCC regroups the integer
// sums of a fully unrolled super-block into trees, computes the products first and spills them (Q6_K: 278 stack
// accesses per super-block at one row of x), which costs more than the loads they save.
GS_INLINE __m256i keep(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// How many super-blocks ahead the avx2 a8 GEMM asks for its tiles (a prefetch past the weight's end is harmless).
constexpr int kPrefetch = 2;
template <int T>
GS_INLINE void prefetch_tile(const uint8_t* tile) {  // every cache line of one tile, into L1
  for (int l = 0; l < kTileBytes<T>; l += 64) _mm_prefetch(reinterpret_cast<const char*>(tile + l), _MM_HINT_T0);
}
// The most rows of x for which the avx2 a8 GEMM runs both halves of a tile super-block by super-block (below).
constexpr int kInterleave = 1;

// Quads (4 weights of a row) whose vpmaddubsw pair sums are added in int16 before vpmaddwd applies the scales:
// as many as keep every int16 lane within 32767 with |x| <= 127. Q4_K: 8 (a sub-block, 8 * 2 * 15 * 127 = 30480),
// Q5_K: 4 (4 * 2 * 31 * 127 = 31496), Q6_K: 2 (2 * 2 * 63 * 127 = 32004). Integer sums, so S is the same whatever
// the chunk; it halves to an eighth the vpmaddwd and int32 adds per row of x, the part that grows with the rows.
template <int T>
constexpr int kChunk = T == Q4_K ? 8 : T == Q5_K ? 4 : 2;

// avx2: 8 rows of the tile a ymm, its halves (rows 0-7, 8-15) H at a time from half h0: super-block b of the tile
// row at t (its tile at t + b * kTileBytes); acc[h * G + m] is half h0 + h's sums for row m of x. With H = 2 each
// broadcast quad of x serves both halves. No vpdpbusd: vpmaddubsw (pairs in int16, at most 2 * 63 * 127, never
// saturated) summed over kChunk quads, then vpmaddwd with scale_pairs: the same integer S as the avx512 path.
template <int T, int G, int H>
GS_INLINE void tile_a8_avx2(const uint8_t* __restrict t, int h0, int64_t b, const int8_t* const* xq,
                            const float* const* dx, const int16_t* const* xs, __m256* acc) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  (void)m30;
  t += b * kTileBytes<T>;
  __m256i S[H][G];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < G; ++m) S[h][m] = _mm256_setzero_si256();
  if constexpr (T == Q6_K) {
    // Group by group (q outer) so that a row of x holds one int16 accumulator: quads j, j + 32, j + 16, j + 48
    // of j = 4p .. 4p + 3 are groups p, p + 8, p + 4, p + 12 (low and high nibbles of runs j and j + 16).
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const int g = q == 0 ? p : q == 1 ? p + 8 : q == 2 ? p + 4 : p + 12;
        const int xoff = q == 0 ? 0 : q == 1 ? 128 : q == 2 ? 64 : 192;
        __m256i c[H];
        for (int h = 0; h < H; ++h) c[h] = scale_pairs<true>(t + sc_off<T>(g) + 8 * (h0 + h));
#pragma GCC unroll 2
        for (int i0 = 0; i0 < 4; i0 += kChunk<T>) {
          __m256i A[H][G];
          for (int h = 0; h < H; ++h)
            for (int m = 0; m < G; ++m) A[h][m] = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int i = i0; i < i0 + kChunk<T>; ++i) {
            const int j = 4 * p + i;
            __m256i xb[G];
            for (int m = 0; m < G; ++m) xb[m] = _mm256_set1_epi32(load_i32(xq[m] + b * 256 + 4 * j + xoff));
            for (int h = 0; h < H; ++h) {
              const int hb = 32 * (h0 + h);  // byte offset of the half in a 64-byte run
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + nib_off<T>(q < 2 ? j : j + 16) + hb));
              const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + high_off<T>(j) + hb));
              __m256i w;
              if (q == 0) w = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30));
              else if (q == 1) w = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(hv, m30));
              else if (q == 2) w = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30));
              else w = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30));
              for (int m = 0; m < G; ++m) A[h][m] = keep(_mm256_add_epi16(A[h][m], _mm256_maddubs_epi16(w, xb[m])));
            }
          }
          for (int h = 0; h < H; ++h)
            for (int m = 0; m < G; ++m) S[h][m] = keep(_mm256_add_epi32(S[h][m], _mm256_madd_epi16(A[h][m], c[h])));
        }
        // minus 32 sc_g X_g, the offset of the six-bit quants
        for (int h = 0; h < H; ++h) {
          const __m256i e = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + sc_off<T>(g) + 8 * (h0 + h))));
          for (int m = 0; m < G; ++m)
            S[h][m] = keep(_mm256_sub_epi32(S[h][m], _mm256_mullo_epi32(e, _mm256_set1_epi32(32 * xs[m][b * 16 + g]))));
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kDOff<T> + 16 * (h0 + h))));
      for (int m = 0; m < G; ++m)
        acc[h * G + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[h][m]), _mm256_mul_ps(d, _mm256_set1_ps(dx[m][b])), acc[h * G + m]);
    }
  } else {
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {  // sub-blocks s (low nibbles of runs 8s ..) and s + 4 (their high nibbles)
#pragma GCC unroll 2
      for (int i0 = 0; i0 < 8; i0 += kChunk<T>) {
        __m256i A0[H][G], A1[H][G];
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < G; ++m) A0[h][m] = A1[h][m] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = i0; i < i0 + kChunk<T>; ++i) {
          const int j = 8 * s + i;
          __m256i xl[G], xh[G];
          for (int m = 0; m < G; ++m) {
            xl[m] = _mm256_set1_epi32(load_i32(xq[m] + b * 256 + 4 * j));
            xh[m] = _mm256_set1_epi32(load_i32(xq[m] + b * 256 + 128 + 4 * j));
          }
          for (int h = 0; h < H; ++h) {
            const int hb = 32 * (h0 + h);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + nib_off<T>(j) + hb));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if constexpr (T == Q5_K) {  // high run i: bit s (quad j), bit s + 4 (quad j + 32)
              const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + high_off<T>(i) + hb));
              switch (s) {
                case 0: lo = _mm256_or_si256(lo, bit_to4<0>(hv)); hi = _mm256_or_si256(hi, bit_to4<4>(hv)); break;
                case 1: lo = _mm256_or_si256(lo, bit_to4<1>(hv)); hi = _mm256_or_si256(hi, bit_to4<5>(hv)); break;
                case 2: lo = _mm256_or_si256(lo, bit_to4<2>(hv)); hi = _mm256_or_si256(hi, bit_to4<6>(hv)); break;
                default: lo = _mm256_or_si256(lo, bit_to4<3>(hv)); hi = _mm256_or_si256(hi, bit_to4<7>(hv)); break;
              }
            }
            for (int m = 0; m < G; ++m) {
              A0[h][m] = keep(_mm256_add_epi16(A0[h][m], _mm256_maddubs_epi16(lo, xl[m])));
              A1[h][m] = keep(_mm256_add_epi16(A1[h][m], _mm256_maddubs_epi16(hi, xh[m])));
            }
          }
        }
        for (int h = 0; h < H; ++h) {
          const int rh = 8 * (h0 + h);
          const __m256i c0 = scale_pairs<false>(t + sc_off<T>(s) + rh), c1 = scale_pairs<false>(t + sc_off<T>(s + 4) + rh);
          for (int m = 0; m < G; ++m)
            S[h][m] = keep(_mm256_add_epi32(S[h][m], _mm256_add_epi32(_mm256_madd_epi16(A0[h][m], c0), _mm256_madd_epi16(A1[h][m], c1))));
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int rh = 8 * (h0 + h);
      __m256i Mn[G];
      for (int m = 0; m < G; ++m) Mn[m] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i mz = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kMnOff<T> + 32 * p + 2 * rh)));
        for (int m = 0; m < G; ++m)
          Mn[m] = _mm256_add_epi32(Mn[m], _mm256_madd_epi16(mz, _mm256_set1_epi32(load_i32(xs[m] + b * 8 + 2 * p))));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kDOff<T> + 2 * rh)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kDOff<T> + 32 + 2 * rh)));
      for (int m = 0; m < G; ++m) {
        const __m256 x = _mm256_set1_ps(dx[m][b]);
        __m256& a = acc[h * G + m];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[h][m]), _mm256_mul_ps(d, x), a);
        a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(Mn[m]), _mm256_mul_ps(dmin, x), a);
      }
    }
  }
}
#endif

// Quant J (0..63: weights 4J .. 4J + 3) of row r, byte i, of a tile: its full value (0..15, 0..31, 0..63).
template <int T>
inline int tile_quant(const uint8_t* t, int quad, int r, int i) {
  const uint8_t byte = t[nib_off<T>(quad % 32) + 4 * r + i];
  int w = quad < 32 ? byte & 0x0F : byte >> 4;
  if constexpr (T == Q5_K) w |= ((t[high_off<T>(quad % 8) + 4 * r + i] >> (quad / 8)) & 1) << 4;
  if constexpr (T == Q6_K) w |= ((t[high_off<T>(quad % 16) + 4 * r + i] >> (2 * (quad / 16))) & 3) << 4;
  return w;
}

#if !GS_AVX512 && !GS_AVX2
// One weight row (row r of each tile) times one row of x, lane by lane: the generic level. The same integers and
// the same fp32 operations as above.
template <int T>
float row_a8(const uint8_t* __restrict t, int r, int64_t nsb, const int8_t* xq, const float* dx, const int16_t* xs) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nsb; ++b, t += kTileBytes<T>) {
    constexpr int span = T == Q6_K ? 16 : 32;  // weights per sub-block
    int32_t D[256 / span] = {};
    for (int quad = 0; quad < 64; ++quad)
      for (int i = 0; i < 4; ++i) D[4 * quad / span] += tile_quant<T>(t, quad, r, i) * xq[b * 256 + 4 * quad + i];
    int32_t S = 0;
    if constexpr (T == Q6_K) {
      for (int g = 0; g < 16; ++g) S += static_cast<int8_t>(t[sc_off<T>(g) + r]) * (D[g] - 32 * xs[b * 16 + g]);
    } else {
      for (int s = 0; s < 8; ++s) S += t[sc_off<T>(s) + r] * D[s];
    }
    const float dxb = dx[b];
    acc = std::fma(static_cast<float>(S), h2f(t + kDOff<T> + 2 * r) * dxb, acc);
    if constexpr (T != Q6_K) {
      int32_t Mn = 0;
      for (int s = 0; s < 8; ++s) Mn += t[kMnOff<T> + 32 * (s / 2) + 2 * r + s % 2] * xs[b * 8 + s];
      acc = std::fma(-static_cast<float>(Mn), h2f(t + kDOff<T> + 32 + 2 * r) * dxb, acc);
    }
  }
  return acc;
}
#endif

// sums ([rows][16], tile row g's outputs for rows r0 .. r0 + rows - 1 of x) plus the bias, to y.
GS_INLINE void store_tile_row(const float* sums, int64_t rows, int64_t r0, int64_t g, int64_t n, const float* bias,
                              float* y) {
  const int64_t cols = std::min<int64_t>(kTileRows, n - g * kTileRows);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t r = 0; r < cols; ++r) {
      const int64_t j = g * kTileRows + r;
      const float v = sums[i * kTileRows + r];
      y[(r0 + i) * n + j] = bias ? v + bias[j] : v;
    }
}

// Tile row g (16 weight rows) times rows r0 .. r0 + G - 1 of x.
template <int T, int G>
void tiles_pass(const uint8_t* tiles, int64_t nsb, const XA8& a, int64_t k, int64_t r0, int64_t g, int64_t n,
                const float* bias, float* y) {
  const int8_t* xq[G];
  const float* dx[G];
  const int16_t* xs[G];
  for (int m = 0; m < G; ++m) {
    xq[m] = a.q.data() + (r0 + m) * k;
    dx[m] = a.dx.data() + (r0 + m) * nsb;
    xs[m] = a.xs.data() + (r0 + m) * nsb * kSums<T>;
  }
  const uint8_t* t = tiles + g * nsb * kTileBytes<T>;
  float out[G][kTileRows];
#if GS_AVX512
  __m512 acc[G];
  for (int m = 0; m < G; ++m) acc[m] = _mm512_setzero_ps();
  tile_a8<T, G>(t, nsb, xq, dx, xs, acc);
  for (int m = 0; m < G; ++m) _mm512_storeu_ps(out[m], acc[m]);
#elif GS_AVX2
  // The tile kPrefetch super-blocks on is asked for ahead (the next tile row's past the end of this one: tile rows
  // follow each other); a tile is read in runs that jump around its bytes, which the hardware prefetchers follow
  // late. Up to kInterleave rows of x, where a step waits on memory, both halves of a super-block's tile run
  // together (the second finds it in L1), so the weights stream the whole time; with more rows, where the
  // arithmetic bounds a step, the accumulators of both halves would not fit the 16 registers: half by half.
  __m256 acc[2 * G];  // [half][row of x]
  for (int i = 0; i < 2 * G; ++i) acc[i] = _mm256_setzero_ps();
  if constexpr (G <= kInterleave) {
    for (int64_t b = 0; b < nsb; ++b) {
      prefetch_tile<T>(t + (b + kPrefetch) * kTileBytes<T>);
      if constexpr (T == Q6_K) {  // measured: reads memory faster half by half than with shared broadcasts
        tile_a8_avx2<T, G, 1>(t, 0, b, xq, dx, xs, acc);
        tile_a8_avx2<T, G, 1>(t, 1, b, xq, dx, xs, acc + G);
      } else {
        tile_a8_avx2<T, G, 2>(t, 0, b, xq, dx, xs, acc);
      }
    }
  } else {
    for (int h = 0; h < 2; ++h)
      for (int64_t b = 0; b < nsb; ++b) {
        if (h == 0) prefetch_tile<T>(t + (b + kPrefetch) * kTileBytes<T>);
        tile_a8_avx2<T, G, 1>(t, h, b, xq, dx, xs, acc + h * G);
      }
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < G; ++m) _mm256_storeu_ps(out[m] + 8 * h, acc[h * G + m]);
#else
  for (int m = 0; m < G; ++m)
    for (int r = 0; r < kTileRows; ++r) out[m][r] = row_a8<T>(t, r, nsb, xq[m], dx[m], xs[m]);
#endif
  store_tile_row(&out[0][0], G, r0, g, n, bias, y);
}

// The most rows of x one pass over a tile row takes: at avx512, 6 (Q4_K / Q5_K) or 5 (Q6_K), past which the
// accumulators spill and one pass costs more than two; avx2 (16 vector registers) and generic, 4.
template <int T>
#if GS_AVX512
constexpr int64_t kMaxPass = T == Q6_K ? 5 : 6;
#else
constexpr int64_t kMaxPass = 4;
#endif

// Rows r0 .. r1 - 1 of x times tile row g, in passes over the tile row, which stays in cache between passes
// (nsb * kTileBytes bytes). One pass takes up to kMaxPass<T> rows; more rows are split into passes of about equal
// size (8: 4 + 4). Each output is the same sum whatever the pass, so a row's result does not depend on the row count.
template <int T>
void vector_passes(const uint8_t* tiles, int64_t nsb, const XA8& a, int64_t k, int64_t r0, int64_t r1, int64_t g,
                   int64_t n, const float* bias, float* y) {
  const int64_t passes = (r1 - r0 + kMaxPass<T> - 1) / kMaxPass<T>;
  for (int64_t p = 0, r = r0; p < passes; ++p) {
    const int64_t rows = (r1 - r) / (passes - p);  // the rows left, shared evenly by the passes left
    switch (rows) {
      case 1: tiles_pass<T, 1>(tiles, nsb, a, k, r, g, n, bias, y); break;
      case 2: tiles_pass<T, 2>(tiles, nsb, a, k, r, g, n, bias, y); break;
      case 3: tiles_pass<T, 3>(tiles, nsb, a, k, r, g, n, bias, y); break;
      case 4: tiles_pass<T, 4>(tiles, nsb, a, k, r, g, n, bias, y); break;
      case 5: tiles_pass<T, 5>(tiles, nsb, a, k, r, g, n, bias, y); break;
      default: tiles_pass<T, (kMaxPass<T> >= 6 ? 6 : 5)>(tiles, nsb, a, k, r, g, n, bias, y); break;
    }
    r += rows;
  }
}

#if GS_AMX
// amx: many rows of x (wide verifies, prefills) on AMX int8 tiles. Per output and super-block, S = sum_s sc_s D_s
// is x . p over the 256 quants with p = sc q per weight (Q4_K / Q5_K: 0 .. 1953; Q6_K: sc (q - 32), -4096 .. 4064).
// Each p is split into bytes, p = 256 H + L (L unsigned, H unsigned or, for Q6_K, signed), so S = x . L + 256 x . H:
// eight tile products of 64 quants a super-block (tdpbsud; Q6_K's H tdpbssd), and no sums per sub-block to scale.
// Every integer is exact (|x . L| <= 256 * 127 * 255), so S, and with tile_a8's fp32 steps every output, has the
// avx512 bits whatever the row count. The second operands (L, H of 16 outputs, VNNI's layout, as the tiles hold the
// quants) are built once per super-block and tile row, then multiply every 16-row chunk of x.
// Measured on an Intel Xeon with AMX, whole verifies of the Q4_K_M 1.5B (perf/RESULTS.md): the tiles pay from 12
// rows of x; a last part chunk of 4 rows or more costs less padded than on vectors.
constexpr int64_t kAmxMinRows = 12;
constexpr int64_t kAmxMinTail = 4;
constexpr int64_t kAmxPrefetch = 1;  // super-blocks ahead

// The scales of 16 outputs (16 bytes at p, int8 if is_signed) for a quad row's 64 bytes, whose bytes 4o .. 4o + 3
// are output o's: each sc as the byte multiplying the even bytes (se) and the odd ones (so) of vpmaddubsw's pairs,
// and (Q6_K) 32 sc in the 16-bit lanes (sub).
template <bool is_signed>
GS_INLINE void scale_bytes(const uint8_t* p, __m512i& se, __m512i& so, __m512i& sub) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i d = is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  const __m512i b = _mm512_and_si512(d, _mm512_set1_epi32(0xFF));
  se = _mm512_or_si512(b, _mm512_slli_epi32(b, 16));
  so = _mm512_slli_epi16(se, 8);
  if constexpr (is_signed) {  // sc as a 16-bit lane in both halves of each dword, times 32
    const __m512i w = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16));
    sub = _mm512_slli_epi16(w, 5);
  }
}

// One quad row q (64 quants 0 .. 63) times its scales: p = sc q (q6: sc q - 32 sc = sc (q - 32)) for the even and
// the odd bytes (vpmaddubsw with the other byte's scale 0), the low bytes of the products to l, the high ones to h.
template <bool q6>
GS_INLINE void split_products(__m512i q, __m512i se, __m512i so, __m512i sub, uint8_t* l, uint8_t* h) {
  __m512i pe = _mm512_maddubs_epi16(q, se), po = _mm512_maddubs_epi16(q, so);
  if constexpr (q6) {
    pe = _mm512_sub_epi16(pe, sub);
    po = _mm512_sub_epi16(po, sub);
  }
  const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
  _mm512_store_si512(l, _mm512_mask_blend_epi8(odd, pe, _mm512_slli_epi16(po, 8)));
  _mm512_store_si512(h, _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(pe, 8), po));
}

// Super-block t of a tile as the second operands: wl, wh [64 quads][16 outputs][4 bytes].
template <int T>
GS_INLINE void amx_weights(const uint8_t* __restrict t, uint8_t* __restrict wl, uint8_t* __restrict wh) {
  if constexpr (T == Q6_K) {
    __m512i se[16], so[16], sub[16];
    for (int g = 0; g < 16; ++g) scale_bytes<true>(t + sc_off<T>(g), se[g], so[g], sub[g]);
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 4; ++i) {
        __m512i q[4];
        q6_quads(t, 4 * p + i, q);
        const int grp[4] = {p, p + 8, p + 4, p + 12};
        for (int e = 0; e < 4; ++e) {
          const int row = 4 * grp[e] + i, g = grp[e];
          split_products<true>(q[e], se[g], so[g], sub[g], wl + 64 * row, wh + 64 * row);
        }
      }
  } else {
    for (int s = 0; s < 4; ++s) {  // sub-blocks s (low nibbles of runs 8s ..) and s + 4 (their high nibbles)
      __m512i se0, so0, se1, so1, none = _mm512_setzero_si512();
      scale_bytes<false>(t + sc_off<T>(s), se0, so0, none);
      scale_bytes<false>(t + sc_off<T>(s + 4), se1, so1, none);
      for (int i = 0; i < 8; ++i) {
        __m512i lo, hi;
        k_quads<T>(t, s, i, lo, hi);
        split_products<false>(lo, se0, so0, none, wl + 64 * (8 * s + i), wh + 64 * (8 * s + i));
        split_products<false>(hi, se1, so1, none, wl + 64 * (8 * (s + 4) + i), wh + 64 * (8 * (s + 4) + i));
      }
    }
  }
}

// One or two 16-row chunks of x (xa, xb: a super-block of each, in run_a8_amx's order of x) times wl, wh: the
// int32 sums x . L and x . H, 16 rows x 16 outputs each, to c (xa's at c, c + 256; xb's at c + 512, c + 768).
// Each weight tile is loaded once for both chunks.
template <int T, bool two>
GS_INLINE void amx_products(const int8_t* xa, const int8_t* xb, const uint8_t* wl, const uint8_t* wh, int32_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int kk = 0; kk < 4; ++kk) {
    _tile_loadd(4, wl + 1024 * kk, 64);
    _tile_loadd(5, wh + 1024 * kk, 64);
    _tile_loadd(2, xa + 1024 * kk, 64);
    _tile_dpbsud(0, 2, 4);
    if constexpr (T == Q6_K) _tile_dpbssd(1, 2, 5); else _tile_dpbsud(1, 2, 5);
    if constexpr (two) {
      _tile_loadd(3, xb + 1024 * kk, 64);
      _tile_dpbsud(6, 3, 4);
      if constexpr (T == Q6_K) _tile_dpbssd(7, 3, 5); else _tile_dpbsud(7, 3, 5);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (two) {
    _tile_stored(6, c + 512, 64);
    _tile_stored(7, c + 768, 64);
  }
}

// Tile row t (16 outputs) times all mpad (a multiple of 16) rows of x (xt, in run_a8_amx's order) into acc ([mpad][16]
// fp32 sums); wl, wh, c: scratch. The products of the next two chunks are issued before the sums of these two are
// finished, so the tile unit and the vector units work at the same time.
template <int T>
void amx_tile_row(const uint8_t* __restrict t, int64_t nsb, const XA8& a, const int8_t* xt, int64_t mpad,
                  uint8_t* __restrict wl, uint8_t* __restrict wh, int32_t* __restrict c, float* __restrict acc) {
  std::fill(acc, acc + mpad * kTileRows, 0.0f);
  const int64_t chunks = mpad / 16, pairs = (chunks + 1) / 2;
  for (int64_t b = 0; b < nsb; ++b, t += kTileBytes<T>) {
    // The tile kAmxPrefetch super-blocks on (past the row's end: the next tile row's) is asked for now: the work
    // between two tile reads is long enough that with the hardware prefetchers alone each read waited on memory.
    for (int64_t o = 0; o < kTileBytes<T>; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(t + kAmxPrefetch * kTileBytes<T> + o), _MM_HINT_T0);
    amx_weights<T>(t, wl, wh);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kDOff<T>)));
    __m512 dmin = d;
    __m512i mz[4];  // Q4_K / Q5_K: the mins of sub-blocks 2p, 2p + 1 as int16 pairs
    if constexpr (T != Q6_K) {
      dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kDOff<T> + 32)));
      for (int p = 0; p < 4; ++p)
        mz[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kMnOff<T> + 32 * p)));
    }
    const int8_t* xb = xt + b * mpad * 256;
    auto issue = [&](int64_t p) {
      const int8_t* x0 = xb + 2 * p * 4096;
      int32_t* cp = c + (p % 2) * 1024;
      if (2 * p + 1 < chunks) amx_products<T, true>(x0, x0 + 4096, wl, wh, cp);
      else amx_products<T, false>(x0, nullptr, wl, wh, cp);
    };
    issue(0);
    for (int64_t p = 0; p < pairs; ++p) {
      if (p + 1 < pairs) issue(p + 1);
      const int32_t* cp = c + (p % 2) * 1024;
      for (int64_t ch = 2 * p; ch < std::min(2 * p + 2, chunks); ++ch)
        for (int r = 0; r < 16; ++r) {
          const int64_t row = 16 * ch + r;
          const int32_t* cr = cp + (ch - 2 * p) * 512 + 16 * r;
          const __m512i S = _mm512_add_epi32(_mm512_load_si512(cr), _mm512_slli_epi32(_mm512_load_si512(cr + 256), 8));
          const __m512 x = _mm512_set1_ps(a.dx[row * nsb + b]);
          __m512 v = _mm512_loadu_ps(acc + row * kTileRows);
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(d, x), v);
          if constexpr (T != Q6_K) {
            const int16_t* xs = a.xs.data() + (row * nsb + b) * kSums<T>;
            __m512i Mn = _mm512_setzero_si512();
            for (int q = 0; q < 4; ++q) Mn = _mm512_dpwssd_epi32(Mn, mz[q], _mm512_set1_epi32(load_i32(xs + 2 * q)));
            v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(dmin, x), v);
          }
          _mm512_storeu_ps(acc + row * kTileRows, v);
        }
    }
  }
}

// The rows of x the tiles take (from kAmxMinRows): whole 16-row chunks, and a last, part chunk of kAmxMinTail rows
// or more (padded); the rows after them take vector_passes, right after the tiles on the same tile row, which is
// then in cache.
inline int64_t amx_rows(int64_t m) {
  if (m < kAmxMinRows) return 0;
  return m % 16 >= kAmxMinTail ? m : m - m % 16;
}

template <int T>
void run_a8_amx(XA8& a, int64_t m, int64_t mt, int64_t k, const uint8_t* tiles, int64_t n, const float* bias,
                float* y) {
  graphspec_amx::require_tiles("qlinear_a8");
  const int64_t nsb = k / 256, mpad = (mt + 15) / 16 * 16;
  if (mpad > m) {  // zero rows pad x to whole 16-row chunks (their outputs are dropped)
    a.q.resize(static_cast<size_t>(mpad * k));
    a.dx.resize(static_cast<size_t>(mpad * nsb));
    a.xs.resize(static_cast<size_t>(mpad * nsb * kSums<T>));
  }
  // x in the order the tiles read it: [super-block][16-row chunk][64 quants][row][64 bytes], so that a tile load
  // reads 1 KiB in a row and every tile row streams x in order.
  std::vector<int8_t> xt(static_cast<size_t>(mpad * k));
  for (int64_t b = 0; b < nsb; ++b)
    for (int64_t r = 0; r < mpad; ++r)
      for (int kk = 0; kk < 4; ++kk)
        std::memcpy(xt.data() + (b * mpad + r / 16 * 16) * 256 + 1024 * kk + 64 * (r % 16),
                    a.q.data() + r * k + b * 256 + 64 * kk, 64);
  const int64_t groups = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    graphspec_amx::configure_tiles();  // per thread: the tile configuration is thread state
    alignas(64) uint8_t wl[4096], wh[4096];
    alignas(64) int32_t c[2 * 1024];
    std::vector<float> acc(static_cast<size_t>(mpad * kTileRows));
    for (int64_t g = g0; g < g1; ++g) {
      amx_tile_row<T>(tiles + g * nsb * kTileBytes<T>, nsb, a, xt.data(), mpad, wl, wh, c, acc.data());
      store_tile_row(acc.data(), mt, 0, g, n, bias, y);
      if (mt < m) vector_passes<T>(tiles, nsb, a, k, mt, m, g, n, bias, y);
    }
    _tile_release();
  });
}
#endif  // GS_AMX

template <int T>
void run_a8(const float* x, int64_t m, int64_t k, const uint8_t* tiles, int64_t n, const float* bias, float* y) {
  XA8 a;
  quantize_a8<T>(x, m, k, a);
#if GS_AMX
  if (const int64_t mt = amx_rows(m); mt > 0) return run_a8_amx<T>(a, m, mt, k, tiles, n, bias, y);
#endif
  const int64_t nsb = k / 256;
  const int64_t groups = (n + kTileRows - 1) / kTileRows;
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, nsb * kTileBytes<T>));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) vector_passes<T>(tiles, nsb, a, k, 0, m, g, n, bias, y);
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

// graphspec.kernels.qlinear.pack_a8 in C++ (the same bytes; its docstring has the layout): a k-quant weight's GGUF
// blocks [n, row_bytes] -> tiles [ceil(n / 16), k / 256 * kTileBytes].
template <int T>
void pack_tiles(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* tiles) {
  const int64_t nsb = k / 256, groups = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nsb; ++b) {
        uint8_t* t = tiles + (g * nsb + b) * kTileBytes<T>;
        std::memset(t, 0, kTileBytes<T>);
        for (int r = 0; r < kTileRows && g * kTileRows + r < n; ++r) {
          const uint8_t* p = blocks + ((g * kTileRows + r) * nsb + b) * kTypeSize[T];
          uint8_t q[256];
          if constexpr (T == Q6_K) {
            for (int h = 0; h < 2; ++h)
              for (int l = 0; l < 64; ++l) {
                q[128 * h + l] = p[64 * h + l] & 0x0F;
                q[128 * h + 64 + l] = p[64 * h + l] >> 4;
              }
            for (int h = 0; h < 2; ++h)
              for (int sh = 0; sh < 4; ++sh)
                for (int l = 0; l < 32; ++l) q[128 * h + 32 * sh + l] |= ((p[128 + 32 * h + l] >> (2 * sh)) & 3) << 4;
            for (int s = 0; s < 16; ++s) t[sc_off<T>(s) + r] = p[192 + s];
            t[kDOff<T> + 2 * r] = p[208];
            t[kDOff<T> + 2 * r + 1] = p[209];
          } else {
            const uint8_t* qs = p + (T == Q4_K ? 16 : 48);
            for (int i = 0; i < 4; ++i)
              for (int l = 0; l < 32; ++l) {
                q[64 * i + l] = qs[32 * i + l] & 0x0F;
                q[64 * i + 32 + l] = qs[32 * i + l] >> 4;
              }
            if constexpr (T == Q5_K)
              for (int i = 0; i < 8; ++i)
                for (int l = 0; l < 32; ++l) q[32 * i + l] |= ((p[16 + l] >> i) & 1) << 4;
            uint8_t f[16];
            k_fields(p + 4, f);
            for (int s = 0; s < 8; ++s) {
              t[sc_off<T>(s) + r] = f[s];
              t[kMnOff<T> + 32 * (s / 2) + 2 * r + s % 2] = f[8 + s];
            }
            for (int i = 0; i < 2; ++i) {
              t[kDOff<T> + 2 * r + i] = p[i];
              t[kDOff<T> + 32 + 2 * r + i] = p[2 + i];
            }
          }
          for (int quad = 0; quad < 64; ++quad)
            for (int i = 0; i < 4; ++i) {
              const uint8_t v = q[4 * quad + i];
              t[nib_off<T>(quad % 32) + 4 * r + i] |= (v & 0x0F) << (quad < 32 ? 0 : 4);
              if constexpr (T == Q5_K) t[high_off<T>(quad % 8) + 4 * r + i] |= ((v >> 4) & 1) << (quad / 8);
              if constexpr (T == Q6_K) t[high_off<T>(quad % 16) + 4 * r + i] |= ((v >> 4) & 3) << (2 * (quad / 16));
            }
        }
      }
  });
}

at::Tensor pack_a8(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(type == Q4_K || type == Q5_K || type == Q6_K, "pack_a8: int8 activations run Q4_K, Q5_K and Q6_K, got "
              "block type ", type);
  TORCH_CHECK(n >= 0 && k >= 0 && k % 256 == 0, "pack_a8: K=", k, " is not a multiple of 256");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu() &&
                  blocks.numel() == n * (k / 256) * kTypeSize[type],
              "pack_a8: blocks must be a contiguous CPU uint8 tensor of ", n * (k / 256) * kTypeSize[type], " bytes");
  const int64_t tb = type == Q4_K ? kTileBytes<Q4_K> : type == Q5_K ? kTileBytes<Q5_K> : kTileBytes<Q6_K>;
  at::Tensor tiles = at::empty({(n + kTileRows - 1) / kTileRows, k / 256 * tb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  if (type == Q4_K) pack_tiles<Q4_K>(src, n, k, dst);
  else if (type == Q5_K) pack_tiles<Q5_K>(src, n, k, dst);
  else pack_tiles<Q6_K>(src, n, k, dst);
  return tiles;
}

// Both ops: check the arguments (naming the op), then run y = x w^T (+ bias) with `run` of the block type.
at::Tensor checked_run(const char* op, const RunFn* runs, const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       int64_t n, int64_t k, const c10::optional<at::Tensor>& bias, bool tiles = false) {
  TORCH_CHECK(type >= 0 && type < kNumTypes, op, ": unknown block type ", type);
  TORCH_CHECK(runs[type] != nullptr, op, ": int8 activations run Q4_K, Q5_K and Q6_K weights, got block type ", type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              op, ": x must be a contiguous CPU float32 [M, ", k, "] tensor, got ", x.sizes());
  TORCH_CHECK(k % kBlockSize[type] == 0, op, ": K=", k, " is not a multiple of the block size ", kBlockSize[type]);
  const int64_t tile_bytes = type == Q4_K ? kTileBytes<Q4_K> : type == Q5_K ? kTileBytes<Q5_K> : kTileBytes<Q6_K>;
  const int64_t nbytes = tiles ? (n + kTileRows - 1) / kTileRows * (k / 256) * tile_bytes
                               : n * (k / kBlockSize[type]) * kTypeSize[type];
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu() &&
                  blocks.numel() == nbytes,
              op, ": ", tiles ? "tiles" : "blocks", " must be a contiguous CPU uint8 tensor of ", nbytes,
              " bytes for a [", n, ", ", k, "] weight", tiles ? " (graphspec.kernels.qlinear.pack_a8)" : "");
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

at::Tensor qlinear_a8(const at::Tensor& x, const at::Tensor& tiles, int64_t type, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias) {
  return checked_run("qlinear_a8", kRunA8, x, tiles, type, n, k, bias, true);
}

std::string level_name() { return GS_LEVEL_NAME; }

}  // namespace

// block_model.cpp (the same extension) calls the two GEMMs directly; the op namespace names the C++ one, so each
// level's binary keeps its own.
namespace GS_NS {
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& data, int64_t type, int64_t n, int64_t k, bool a8) {
  return a8 ? qlinear_a8(x, data, type, n, k, c10::nullopt) : qlinear(x, data, type, n, k, c10::nullopt);
}
}  // namespace GS_NS

GS_LIBRARY(m) {
  m.def("level", &level_name);
  m.def("qlinear(Tensor x, Tensor blocks, int type, int n, int k, Tensor? bias) -> Tensor", &qlinear);
  m.def("pack_a8(Tensor blocks, int type, int n, int k) -> Tensor", &pack_a8);
  m.def("qlinear_a8(Tensor x, Tensor tiles, int type, int n, int k, Tensor? bias) -> Tensor", &qlinear_a8);
}
