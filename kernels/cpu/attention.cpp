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

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "level.h"
#include "native_math.h"

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

// P @ V for `hn` heads from h0 over chunks x0 .. x0 + XN of 16: HN x XN sums in registers, one pass over the keys,
// each V chunk widened once for all HN heads. Every sum adds its keys in order 0..n-1, whatever the tile.
template <typename T, int HN, int XN>
void pv_tile(const T* v, int64_t key_stride, const int64_t* slot, int64_t n, const float* scores, int64_t h0,
             int64_t x0, int64_t d, float* acc) {
  V16 ac[HN][XN];
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < XN; ++x) ac[h][x] = zero16();
  for (int64_t i = 0; i < n; ++i) {
    const T* vi = v + slot[i] * key_stride + 16 * x0;
    V16 p[HN];
    for (int h = 0; h < HN; ++h) p[h] = set16(scores[(h0 + h) * n + i]);
    for (int x = 0; x < XN; ++x) {
      const V16 vx = load16(vi + 16 * x);
      for (int h = 0; h < HN; ++h) ac[h][x] = fmadd16(p[h], vx, ac[h][x]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < XN; ++x) store16(acc + (h0 + h) * d + 16 * (x0 + x), ac[h][x]);
}

// Tiles of up to kTileHeads heads x kTileChunks chunks (24 sums: avx512 holds them in zmm registers).
constexpr int kTileHeads = GS_AVX512 ? 6 : 3, kTileChunks = GS_AVX512 ? 4 : 2;

template <typename T, int HN>
void pv_heads(const T* v, int64_t key_stride, const int64_t* slot, int64_t n, const float* scores, int64_t h0,
              int64_t d, float* acc) {
  const int64_t c = d / 16;
  for (int64_t x0 = 0; x0 < c; x0 += kTileChunks) {
    switch (std::min<int64_t>(kTileChunks, c - x0)) {
      case 1: pv_tile<T, HN, 1>(v, key_stride, slot, n, scores, h0, x0, d, acc); break;
      case 2: pv_tile<T, HN, 2>(v, key_stride, slot, n, scores, h0, x0, d, acc); break;
#if GS_AVX512
      case 3: pv_tile<T, HN, 3>(v, key_stride, slot, n, scores, h0, x0, d, acc); break;
      case 4: pv_tile<T, HN, 4>(v, key_stride, slot, n, scores, h0, x0, d, acc); break;
#endif
    }
  }
}

template <typename T>
void pv16(const T* v, int64_t key_stride, const int64_t* slot, int64_t n, const float* scores, int64_t g, int64_t d,
          float* acc) {
  for (int64_t h0 = 0; h0 < g; h0 += kTileHeads) {
    switch (std::min<int64_t>(kTileHeads, g - h0)) {
      case 1: pv_heads<T, 1>(v, key_stride, slot, n, scores, h0, d, acc); break;
      case 2: pv_heads<T, 2>(v, key_stride, slot, n, scores, h0, d, acc); break;
      case 3: pv_heads<T, 3>(v, key_stride, slot, n, scores, h0, d, acc); break;
#if GS_AVX512
      case 4: pv_heads<T, 4>(v, key_stride, slot, n, scores, h0, d, acc); break;
      case 5: pv_heads<T, 5>(v, key_stride, slot, n, scores, h0, d, acc); break;
      case 6: pv_heads<T, 6>(v, key_stride, slot, n, scores, h0, d, acc); break;
#endif
    }
  }
}
#endif

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
      for (int64_t h = 0; h < g; ++h) {
        const float* qh = qf + h * d;
        V16 s = mul16(kv[0], load16(qh));
        for (int64_t x = 1; x < c; ++x) s = fmadd16(kv[x], load16(qh + 16 * x), s);
        scores[h * n + i] = sum16(s) * scale;
      }
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
    pv16<T>(v, key_stride, slot, n, scores, g, d, acc);
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
