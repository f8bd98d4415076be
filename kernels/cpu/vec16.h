// 16 fp32 lanes of attention arithmetic, shared by the decode / verify attention (attention.cpp) and the cached
// forwards' layer loops (layer_stack.h): one zmm at avx512, two ymm at avx2 (`kVector` false elsewhere), the
// same operations lane by lane; at avx512 sums16 (16 keys' horizontal sums at once, each by the tree of
// _mm512_reduce_add_ps); exp16 and softmax16 (one query's scores to weights), and P @ V in register tiles
// (pv_queries); and the layer loops' silu(gate) * up (silu_mul16). Each level has its own fixed order of the sums,
// so a query's result depends only on its own scores and keys.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "level.h"
#include "native_math.h"

namespace graphspec_native {
// Internal linkage, as layer_stack.h: each extension (one per level) keeps its own copy.
namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }  // exact: bf16 is an fp32's top half

#if GS_AVX512
// 16 fp32 lanes: one zmm.
struct V16 {
  __m512 v;
};
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
// 16 consecutive bf16 as fp32 (widened exactly: a bf16's bits are the top half of an fp32's).
inline V16 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 div16(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 fmadd16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float sum16(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 max16(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 min16(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 fnmadd16(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline V16 floor16(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline V16 pow2i16(V16 n) {  // 2^n for integral n in [-126, 127]: the exponent field
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline float max_of16(V16 a) { return _mm512_reduce_max_ps(a.v); }
constexpr bool kVector = true;

// The 16 horizontal sums of a[0..15] in one vector, lane m = the sum of a[m], each by the very tree of
// _mm512_reduce_add_ps (lanes i + 8, then i + 4, i + 2, i + 1): a key's score does not depend on where it falls in
// a block of 16, and 15 adds serve 16 keys instead of 4 per key.
inline __m512 sums16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)  // b[m]: keys 2m, 2m+1, lanes i + (i + 8) in each 256-bit half
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // c[m]: 128-bit lane L holds key 4m + L, lanes i + (i + 4)
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // d[m], 128-bit lane L: key 8m + L's i + (i + 2), then key 8m + 4 + L's
    d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44), _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e's lane 4L + j holds key 4j + L: a 4x4 transpose puts the keys in order.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

#elif GS_AVX2
// 16 fp32 lanes: two ymm.
struct V16 {
  __m256 lo, hi;
};
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 load16(const at::BFloat16* p) {
  return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 div16(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 fmadd16(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float sum16(V16 a) {  // (lo + hi), then halves of halves: a fixed order
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline void store16(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 max16(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min16(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 fnmadd16(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 floor16(V16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
inline __m256 pow2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 pow2i16(V16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }  // 2^n for integral n in [-126, 127]
inline float max_of16(V16 a) {
  float t[16];
  store16(t, a);
  return *std::max_element(t, t + 16);
}
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
#endif

#if GS_AVX512 || GS_AVX2
// A query's score against one key whose head (c chunks of 16) is in kv: the chunks' products added by fused
// multiply-adds in order, then sum16's fixed tree.
inline float dot16(const V16* kv, const float* q, int64_t c) {
  V16 s = mul16(kv[0], load16(q));
  for (int64_t x = 1; x < c; ++x) s = fmadd16(kv[x], load16(q + 16 * x), s);
  return sum16(s);
}

// graphspec_native::fast_exp on 16 lanes, the same steps: clamp, n = floor(x log2 e + 1/2), r = x - n ln2 (two
// parts), the degree-6 polynomial, times 2^n.
inline V16 exp16(V16 x) {
  x = min16(max16(x, set16(-87.0f)), set16(88.0f));
  const V16 n = floor16(fmadd16(x, set16(1.44269504088896341f), set16(0.5f)));
  V16 r = fnmadd16(n, set16(0.693145751953125f), x);
  r = fnmadd16(n, set16(1.428606765330187e-06f), r);
  V16 p = set16(1.0f / 720.0f);
  p = fmadd16(p, r, set16(1.0f / 120.0f));
  p = fmadd16(p, r, set16(1.0f / 24.0f));
  p = fmadd16(p, r, set16(1.0f / 6.0f));
  p = fmadd16(p, r, set16(0.5f));
  p = fmadd16(p, r, set16(1.0f));
  p = fmadd16(p, r, set16(1.0f));
  return mul16(p, pow2i16(n));
}

// out[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u for j < n: 16 lanes at a time with exp16, the tail past the
// last 16 in scalar steps with fast_exp. Elementwise, so a row's values do not depend on the other rows.
inline void silu_mul16(const float* g, const float* u, float* out, int64_t n) {
  const int64_t n16 = n - n % 16;
  const V16 one = set16(1.f);
  for (int64_t j = 0; j < n16; j += 16) {
    const V16 x = load16(g + j);
    const V16 e = exp16(sub16(zero16(), x));
    store16(out + j, mul16(div16(x, add16(one, e)), load16(u + j)));
  }
  for (int64_t j = n16; j < n; ++j) out[j] = g[j] / (1.f + graphspec_native::fast_exp(-g[j])) * u[j];
}

// One head's scores -> softmax weights in place, 16 lanes at a time: a max over lanes, exp16, sums per lane then
// sum16, the tail past the last 16 in scalar steps. The order depends on n only.
inline void softmax16(float* sh, int64_t n) {
  const int64_t n16 = n - n % 16;
  float mx = sh[0];
  if (n16) {
    V16 m = load16(sh);
    for (int64_t i = 16; i < n16; i += 16) m = max16(m, load16(sh + i));
    mx = max_of16(m);
  }
  for (int64_t i = n16; i < n; ++i) mx = std::max(mx, sh[i]);
  const V16 mv = set16(mx);
  V16 sv = zero16();
  for (int64_t i = 0; i < n16; i += 16) {
    const V16 e = exp16(sub16(load16(sh + i), mv));
    store16(sh + i, e);
    sv = add16(sv, e);
  }
  float sum = n16 ? sum16(sv) : 0.f;
  for (int64_t i = n16; i < n; ++i) {
    sh[i] = graphspec_native::fast_exp(sh[i] - mx);
    sum += sh[i];
  }
  const V16 inv = set16(1.f / sum);
  for (int64_t i = 0; i < n16; i += 16) store16(sh + i, mul16(load16(sh + i), inv));
  const float invs = 1.f / sum;
  for (int64_t i = n16; i < n; ++i) sh[i] *= invs;
}

// P @ V for HN queries over chunks x0 .. x0 + XN of 16: HN x XN sums in registers, one pass over keys i0 .. i1 - 1
// (slot[i]), each V chunk widened once for all HN queries. p[h][i] is query h's weight of key i; out[h] its d
// outputs, which hold its sums over the keys before i0 unless `fresh`. Every sum adds its keys in order, whatever
// the tile and wherever the keys are split (a stored and reloaded fp32 sum is exact).
template <typename T, int HN, int XN>
void pv_tile(const T* v, int64_t key_stride, const int64_t* slot, int64_t i0, int64_t i1, const float* const* p,
             float* const* out, bool fresh, int64_t x0) {
  V16 ac[HN][XN];
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < XN; ++x) ac[h][x] = fresh ? zero16() : load16(out[h] + 16 * (x0 + x));
  for (int64_t i = i0; i < i1; ++i) {
    const T* vi = v + slot[i] * key_stride + 16 * x0;
    V16 ph[HN];
    for (int h = 0; h < HN; ++h) ph[h] = set16(p[h][i]);
    for (int x = 0; x < XN; ++x) {
      const V16 vx = load16(vi + 16 * x);
      for (int h = 0; h < HN; ++h) ac[h][x] = fmadd16(ph[h], vx, ac[h][x]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < XN; ++x) store16(out[h] + 16 * (x0 + x), ac[h][x]);
}

// Tiles of up to kTileHeads queries x kTileChunks chunks (24 sums: avx512 holds them in zmm registers).
constexpr int kTileHeads = GS_AVX512 ? 6 : 3, kTileChunks = GS_AVX512 ? 4 : 2;

template <typename T, int HN>
void pv_heads(const T* v, int64_t key_stride, const int64_t* slot, int64_t i0, int64_t i1, const float* const* p,
              float* const* out, bool fresh, int64_t d) {
  const int64_t c = d / 16;
  for (int64_t x0 = 0; x0 < c; x0 += kTileChunks) {
    switch (std::min<int64_t>(kTileChunks, c - x0)) {
      case 1: pv_tile<T, HN, 1>(v, key_stride, slot, i0, i1, p, out, fresh, x0); break;
      case 2: pv_tile<T, HN, 2>(v, key_stride, slot, i0, i1, p, out, fresh, x0); break;
#if GS_AVX512
      case 3: pv_tile<T, HN, 3>(v, key_stride, slot, i0, i1, p, out, fresh, x0); break;
      case 4: pv_tile<T, HN, 4>(v, key_stride, slot, i0, i1, p, out, fresh, x0); break;
#endif
    }
  }
}

// P @ V for nq queries (p[q], out[q] as in pv_tile) over keys i0 .. i1 - 1, d a multiple of 16.
template <typename T>
void pv_queries(const T* v, int64_t key_stride, const int64_t* slot, int64_t i0, int64_t i1, int64_t nq,
                const float* const* p, float* const* out, bool fresh, int64_t d) {
  for (int64_t h0 = 0; h0 < nq; h0 += kTileHeads) {
    const float* const* ph = p + h0;
    float* const* oh = out + h0;
    switch (std::min<int64_t>(kTileHeads, nq - h0)) {
      case 1: pv_heads<T, 1>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
      case 2: pv_heads<T, 2>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
      case 3: pv_heads<T, 3>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
#if GS_AVX512
      case 4: pv_heads<T, 4>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
      case 5: pv_heads<T, 5>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
      case 6: pv_heads<T, 6>(v, key_stride, slot, i0, i1, ph, oh, fresh, d); break;
#endif
    }
  }
}
#endif

}  // namespace
}  // namespace graphspec_native
