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
// own fixed order of the sums; other head dims, and the generic level, the scalar loop.

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
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
constexpr bool kVector = true;
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
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
#endif

constexpr int64_t kMaxChunks = 16;  // D up to 256 in registers on the vector path
constexpr int64_t kHeadsPerPass = 3;  // query heads whose outputs (D/16 zmm each) accumulate together

// One (batch, kv head, row): G query heads over `n` keys whose slots are `slot[0..n)`; out[g * d ..] fp32.
// The vector path (avx512 / avx2, D a multiple of 16) and the scalar one each fix their order of the sums.
template <typename T>
void attend_row(const T* q, int64_t q_head_stride, const T* k, const T* v, int64_t key_stride, const int64_t* slot,
                int64_t n, int64_t g, int64_t d, float scale, float* scores, float* qf, float* acc) {
  for (int64_t h = 0; h < g; ++h)
    for (int64_t e = 0; e < d; ++e) qf[h * d + e] = widen(q[h * q_head_stride + e]);
  const bool vec = kVector && d % 16 == 0 && d / 16 <= kMaxChunks;
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
#if GS_AVX512 || GS_AVX2
  if (vec) {
    const int64_t c = d / 16;
    for (int64_t h0 = 0; h0 < g; h0 += kHeadsPerPass) {  // a few heads at a time: their sums stay in registers
      const int64_t hn = std::min(kHeadsPerPass, g - h0);
      V16 ac[kHeadsPerPass][kMaxChunks];
      for (int64_t h = 0; h < hn; ++h)
        for (int64_t x = 0; x < c; ++x) ac[h][x] = zero16();
      for (int64_t i = 0; i < n; ++i) {
        const T* vi = v + slot[i] * key_stride;
        for (int64_t x = 0; x < c; ++x) {
          const V16 vx = load16(vi + 16 * x);
          for (int64_t h = 0; h < hn; ++h) ac[h][x] = fmadd16(set16(scores[(h0 + h) * n + i]), vx, ac[h][x]);
        }
      }
      for (int64_t h = 0; h < hn; ++h)
        for (int64_t x = 0; x < c; ++x) store16(acc + (h0 + h) * d + 16 * x, ac[h][x]);
    }
    return;
  }
#endif
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
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j = u % t, kh = (u / t) % hk, bi = u / (t * hk);
      int64_t n = 0;
      for (int64_t i = 0; i < base; ++i) slot[n++] = i;
      for (int64_t p = 0; p < lengths[j]; ++p) slot[n++] = base + nodes[starts[j] + p];
      const T* qrow = qp + bi * qs0 + j * qs1 + kh * g * qs2;
      attend_row<T>(qrow, qs2, kp + bi * ks0 + kh * ks2, vp + bi * vs0 + kh * vs2, ks1, slot.data(), n, g, d,
                    static_cast<float>(scale), scores.data(), qf.data(), acc.data());
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
