// A Llama-family model's cached forward as loops in place around someone else's GEMMs: the layer machinery that
// the int8 draft (int8_draft.cpp) and GGUF block-weight models (block_model.cpp) share.
//
// Why: a decode step is mostly not its GEMMs' set-up but, outside them, some 25 torch ops a layer (norms, rope,
// cache writes, attention, activations, residual adds), each paying dispatch, allocation and Python for a few
// thousand floats. Here those are plain loops over the rows; each GEMM is the caller's (a functor).
//
// Scope: any batch B with one cache start for all rows, or several sequences with caches, starts and row counts
// of their own (forward_many: the batched engine), any number of new tokens T; attention over the cache causal
// (row t sees slots 0 .. start + t) or through a mask [T, start + T] (a draft tree: the row's cached prefix, its
// ancestors and itself); rope from the caller's cos / signed-sin tables, so any positions. Every row's result
// depends on its own row and its sequence's cache only (norms, rope and attention run per row, in one order;
// the GEMMs must be row-exact too), so a sequence gets the same bits alone, with more rows, and among others.
// Attention takes a sequence's rows together per kv head, each cached key and value read once for all of them
// (attend_rows: at avx512 and avx2 vec16.h's softmax and register-tiled p v), each row still by its own operations.
// The fp32 sums run in another order than torch's and exp is a polynomial (relative error < 3e-7): the logits
// are not the general (torch) forward's bits, and the tests compare them with a tolerance.
#pragma once

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "level.h"
#include "native_math.h"
#include "vec16.h"

namespace graphspec_native {
// Internal linkage: each extension (one per level and file set, some built with -ffp-contract=off) keeps its own
// copy, so no binary's loops are bound to another's at load time.
namespace {

// y = x * rsqrt(mean(x^2) + eps) * w over n floats (the residual stream's rms norm, fp32)
inline void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// q . k over D floats, in a fixed order per level.
inline float dot_f32(const float* q, const float* k, int64_t D) {
#if GS_AVX512
  if (D % 16 == 0) {  // one fp32 sum a lane, then one horizontal add
    __m512 v = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(k + j), v);
    return _mm512_reduce_add_ps(v);
  }
#elif GS_AVX2
  if (D % 8 == 0) {
    __m256 v = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), v);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < D; ++j) acc += q[j] * k[j];
  return acc;
}

// W: a handle to one GEMM weight (c10::intrusive_ptr of a class with in_features() and out_features()); the
// GEMM itself is the functor every forward takes: gemm(const W& w, const at::Tensor& x [rows, K] fp32,
// bool head) -> [rows, N] fp32, head true for the lm_head's product. `who` prefixes every error message.
template <class W>
struct LayerStack {
  std::vector<W> wqkv, wo, w13, w2;
  std::vector<c10::optional<at::Tensor>> bqkv, bo;
  std::vector<at::Tensor> in_norm, post_norm;
  at::Tensor norm;
  int64_t hq, hk, d, hidden;
  double eps, scale;
  std::string who;

  LayerStack(std::string who_, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
             double rms_eps, double attn_scale, at::Tensor final_norm)
      : norm(std::move(final_norm)), hq(num_heads), hk(num_kv_heads), d(head_dim), hidden(hidden_size),
        eps(rms_eps), scale(attn_scale), who(std::move(who_)) {
    TORCH_CHECK(hq > 0 && hk > 0 && hq % hk == 0, who, ": num_heads=", hq, " must be a positive multiple of ",
                "num_kv_heads=", hk);
    TORCH_CHECK(d > 0 && d % 2 == 0, who, ": head_dim=", d, " must be positive and even (rope)");
    check_float(norm, "the final norm");
    TORCH_CHECK(norm.numel() == hidden, who, ": the final norm has ", norm.numel(), " values, hidden_size is ",
                hidden);
  }

  void check_float(const at::Tensor& t, const char* what) const {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), who, ": ", what,
                " must be a contiguous fp32 CPU tensor, got ", t.scalar_type(), " on ", t.device(),
                t.is_contiguous() ? "" : " (not contiguous)");
  }

  void add_layer(W qkv, c10::optional<at::Tensor> b_qkv, W o, c10::optional<at::Tensor> b_o, W gate_up, W down,
                 at::Tensor n_in, at::Tensor n_post) {
    check_float(n_in, "an input norm");
    check_float(n_post, "a post-attention norm");
    TORCH_CHECK(n_in.numel() == hidden && n_post.numel() == hidden, who, ": a layer's norms must have ", hidden,
                " values");
    const int64_t qkv_cols = (hq + 2 * hk) * d;
    TORCH_CHECK(qkv->in_features() == hidden && qkv->out_features() == qkv_cols && o->in_features() == hq * d &&
                    o->out_features() == hidden && gate_up->in_features() == hidden &&
                    gate_up->out_features() % 2 == 0 && down->in_features() == gate_up->out_features() / 2 &&
                    down->out_features() == hidden,
                who, ": a layer's weights do not fit hidden_size=", hidden, ", ", hq, "/", hk, " heads of ", d);
    if (b_qkv) {
      check_float(*b_qkv, "a qkv bias");
      TORCH_CHECK(b_qkv->numel() == qkv_cols, who, ": the qkv bias must have ", qkv_cols, " values");
    }
    if (b_o) {
      check_float(*b_o, "an o_proj bias");
      TORCH_CHECK(b_o->numel() == hidden, who, ": the o_proj bias must have ", hidden, " values");
    }
    wqkv.push_back(std::move(qkv));
    bqkv.push_back(std::move(b_qkv));
    wo.push_back(std::move(o));
    bo.push_back(std::move(b_o));
    w13.push_back(std::move(gate_up));
    w2.push_back(std::move(down));
    in_norm.push_back(std::move(n_in));
    post_norm.push_back(std::move(n_post));
  }

  int64_t num_layers() const { return static_cast<int64_t>(wqkv.size()); }

  // Rows t0 .. t1 - 1 of segment sg: `shared`, the length of the slot list they all begin with (they attend to
  // those slots first, in that order), and `most`, the longest list.
  template <class Seg>
  void common_slots(const Seg& sg, int64_t t0, int64_t t1, int64_t& shared, int64_t& most) const {
    const int64_t* sl0 = sg.slots.data() + t0 * sg.len;
    shared = most = sg.counts[t0];
    for (int64_t t = t0 + 1; t < t1; ++t) {
      const int64_t* st = sg.slots.data() + t * sg.len;
      const int64_t c = std::min(shared, sg.counts[t]);
      int64_t j = 0;
      while (j < c && st[j] == sl0[j]) ++j;
      shared = j;
      most = std::max(most, sg.counts[t]);
    }
  }

  // Rows t0 .. t1 - 1 of segment sg with their g query heads of kv head kvh, layer i: each key and value row of
  // the slots the rows share is read once for all of them, then each row's own slots. Every query's operations,
  // and their order, are those of the row alone (each score by one fixed sum tree over the head, the softmax over
  // its slots in order, p v added key by key from its stored sums), so its bits do not depend on the other rows,
  // on g or on the thread that runs it. With head dims that are a multiple of 16 (up to 256) at avx512 / avx2:
  // vec16.h's lanes (fused multiply-adds over the head, then sums16 for 16 keys at once at avx512 or sum16 a key
  // at avx2; softmax16; p v in register tiles); else scalar loops.
  template <class Seg>
  void attend_rows(const Seg& sg, int64_t t0, int64_t t1, int64_t kvh, int64_t i, const float* qp, float* ap,
                   std::vector<float>& buf, std::vector<const float*>& pw, std::vector<float*>& po) const {
    const int64_t D = d, g = hq / hk, row = hk * D, len = sg.len, nq = (t1 - t0) * g;
    const float* kb = sg.k[i] + kvh * D;
    const float* vb = sg.v[i] + kvh * D;
    const int64_t* sl0 = sg.slots.data() + t0 * len;
    int64_t shared, most;
    common_slots(sg, t0, t1, shared, most);
    buf.resize(nq * most + D);  // the scores, and a row of zeros
    std::fill(buf.begin() + nq * most, buf.end(), 0.f);
    float* S = buf.data();
    const float sc = static_cast<float>(scale);
    auto head = [&](int64_t qi) { return ((sg.row0 + t0 + qi / g) * hq + kvh * g + qi % g) * D; };
#if GS_AVX512 || GS_AVX2
    constexpr int64_t kMaxChunks = 16;
    const bool vec = D % 16 == 0 && D / 16 <= kMaxChunks;
#else
    const bool vec = false;
#endif
    // the scores of keys slot[j0 .. j0 + nk) (nk <= 16) for queries q0 .. q1 - 1
    auto score = [&](const int64_t* slot, int64_t j0, int64_t nk, int64_t q0, int64_t q1) {
#if GS_AVX512
      if (vec) {  // each key's fused multiply-adds over the head, then the 16 keys' sums16 together
        const float* zero = S + nq * most;  // the keys past nk
        const float* kr[16];
        for (int64_t m = 0; m < 16; ++m) kr[m] = m < nk ? kb + slot[j0 + m] * row : zero;
        const __m512 scv = _mm512_set1_ps(sc);
        for (int64_t qi = q0; qi < q1; ++qi) {
          const float* q = qp + head(qi);
          __m512 acc[16];
          const __m512 q0v = _mm512_loadu_ps(q);
          for (int m = 0; m < 16; ++m) acc[m] = _mm512_mul_ps(_mm512_loadu_ps(kr[m]), q0v);
          for (int64_t x = 16; x < D; x += 16) {
            const __m512 qx = _mm512_loadu_ps(q + x);
            for (int m = 0; m < 16; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(kr[m] + x), qx, acc[m]);
          }
          _mm512_mask_storeu_ps(S + qi * most + j0, static_cast<__mmask16>((1u << nk) - 1),
                                _mm512_mul_ps(sums16(acc), scv));
        }
        return;
      }
#endif
      for (int64_t j = j0; j < j0 + nk; ++j) {
        const float* kr = kb + slot[j] * row;
#if GS_AVX2
        if (vec) {  // as attention.cpp's fp32 scores
          V16 kv[kMaxChunks];
          for (int64_t x = 0; x < D / 16; ++x) kv[x] = load16(kr + 16 * x);
          for (int64_t qi = q0; qi < q1; ++qi) S[qi * most + j] = dot16(kv, qp + head(qi), D / 16) * sc;
          continue;
        }
#endif
        for (int64_t qi = q0; qi < q1; ++qi) S[qi * most + j] = dot_f32(qp + head(qi), kr, D) * sc;
      }
    };
    for (int64_t j0 = 0; j0 < shared; j0 += 16) score(sl0, j0, std::min<int64_t>(16, shared - j0), 0, nq);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j0 = shared; j0 < sg.counts[t]; j0 += 16)
        score(sg.slots.data() + t * len, j0, std::min<int64_t>(16, sg.counts[t] - j0), (t - t0) * g, (t - t0 + 1) * g);
    for (int64_t qi = 0; qi < nq; ++qi) {
      float* sh = S + qi * most;
      const int64_t n = sg.counts[t0 + qi / g];
#if GS_AVX512 || GS_AVX2
      if (vec) {
        softmax16(sh, n);
        continue;
      }
#endif
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sh[j]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sh[j] = fast_exp(sh[j] - mx);
        sum += sh[j];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
    }
#if GS_AVX512 || GS_AVX2
    if (vec) {
      pw.resize(nq);
      po.resize(nq);
      for (int64_t qi = 0; qi < nq; ++qi) {
        pw[qi] = S + qi * most;
        po[qi] = ap + head(qi);
      }
      pv_queries<float>(vb, row, sl0, 0, shared, nq, pw.data(), po.data(), true, D);  // the common slots
      for (int64_t t = t0; t < t1; ++t)  // each row's own slots after them
        if (sg.counts[t] > shared)
          pv_queries<float>(vb, row, sg.slots.data() + t * len, shared, sg.counts[t], g, pw.data() + (t - t0) * g,
                            po.data() + (t - t0) * g, false, D);
      return;
    }
#endif
    for (int64_t qi = 0; qi < nq; ++qi) std::fill(ap + head(qi), ap + head(qi) + D, 0.f);
    auto add = [&](const float* vr, int64_t qi, int64_t j) {
      const float p = S[qi * most + j];
      float* oh = ap + head(qi);
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) oh[c] += p * vr[c];
    };
    for (int64_t j = 0; j < shared; ++j)
      for (int64_t qi = 0; qi < nq; ++qi) add(vb + sl0[j] * row, qi, j);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = shared; j < sg.counts[t]; ++j)
        for (int64_t qi = (t - t0) * g; qi < (t - t0 + 1) * g; ++qi) add(vb + sg.slots[t * len + j] * row, qi, j);
  }

  // One sequence of a forward: its new rows [row0, row0 + T) of the stacked rows, its caches (per layer, the
  // base of its [capacity, hk, D] slots), the first slot its rows take, and the slots each row attends to.
  struct Segment {
    std::vector<float*> k, v;
    int64_t start = 0, T = 0, row0 = 0, len = 0;
    std::vector<int64_t> slots, counts;  // [T * len], [T]
  };

  // A segment's slots per row: the causal prefix, or a mask's (bool [T, start + T]; an undefined or empty
  // tensor: causal).
  void set_slots(Segment& s, const at::Tensor* mask) const {
    const int64_t T = s.T, len = s.start + s.T;
    s.len = len;
    s.slots.assign(T * len, 0);
    s.counts.assign(T, 0);
    if (mask != nullptr && mask->defined() && mask->numel() > 0) {
      TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == T && mask->size(1) == len,
                  who, ": the mask must be bool [", T, ", ", len, "], got ", mask->scalar_type(), " ",
                  mask->sizes());
      const at::Tensor m = mask->contiguous();
      const bool* mp = m.data_ptr<bool>();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < len; ++j)
          if (mp[t * len + j]) s.slots[t * len + s.counts[t]++] = j;
        TORCH_CHECK(s.counts[t] > 0, who, ": mask row ", t, " attends to nothing");
      }
    } else {
      for (int64_t t = 0; t < T; ++t) {
        s.counts[t] = s.start + t + 1;
        for (int64_t j = 0; j < s.counts[t]; ++j) s.slots[t * len + j] = j;
      }
    }
  }

  // Checks a sequence's caches: L layers of [batch, >= need, hk, D] fp32, one capacity; returns the capacity.
  int64_t check_caches(const std::vector<at::Tensor>& kc, const std::vector<at::Tensor>& vc, size_t first,
                       int64_t batch, int64_t need) const {
    int64_t cap = 0;
    for (int64_t i = 0; i < num_layers(); ++i) {
      for (const at::Tensor* c : {&kc[first + i], &vc[first + i]}) {
        check_float(*c, "a KV cache");
        TORCH_CHECK(c->dim() == 4 && c->size(0) == batch && c->size(2) == hk && c->size(3) == d &&
                        c->size(1) >= need && (i == 0 || c->size(1) == cap),
                    who, ": a KV cache must be [", batch, ", >= ", need, ", ", hk, ", ", d, "], got ", c->sizes());
        cap = c->size(1);
      }
    }
    return cap;
  }

  // The layers and the head over the stacked rows h [N, H] of the segments; cos, sin hold [N, D] values;
  // picked: the rows (indices into N) whose logits are wanted.
  template <class Gemm>
  at::Tensor run(const at::Tensor& h_in, const at::Tensor& cos_t, const at::Tensor& sin_t, std::vector<Segment>& segs,
                 const W& head, const at::Tensor& picked, const Gemm& gemm) const {
    const int64_t H = hidden, D = d, half = D / 2, L = num_layers(), BT = h_in.size(0);
    at::Tensor h = h_in.to(at::kFloat).reshape({BT, H}).clone();  // the residual stream, updated in place
    at::Tensor xn = at::empty({BT, H}, h.options());
    at::Tensor att = at::empty({BT, hq * D}, h.options());
    at::Tensor qr = at::empty({BT, hq * D}, h.options());  // the rows' queries after rope
    float* qp = qr.data_ptr<float>();
    // attention's items: each sequence's rows per kv head, in as many parts as keep the threads busy and each
    // part's scores (rows x heads x slots) within kScoreFloats, so that a long prefill's scratch stays small.
    struct AttendItem {
      int64_t seg, kvh, t0, t1;
    };
    constexpr int64_t kScoreFloats = int64_t(1) << 20;
    std::vector<AttendItem> items;
    const int64_t threads = at::get_num_threads();
    for (size_t sgi = 0; sgi < segs.size(); ++sgi) {
      const int64_t T = segs[sgi].T, per_row = (hq / hk) * segs[sgi].len;
      const int64_t rows = std::max<int64_t>(1, kScoreFloats / per_row);
      const int64_t parts = std::min(T, std::max(hk >= threads ? 1 : (threads + hk - 1) / hk, (T + rows - 1) / rows));
      for (int64_t kvh = 0; kvh < hk; ++kvh)
        for (int64_t part = 0; part < parts; ++part)
          items.push_back({static_cast<int64_t>(sgi), kvh, T * part / parts, T * (part + 1) / parts});
    }
    // each thread's scratch for attend_rows, kept across the layers (grown once, not allocated and zeroed a layer)
    struct Scratch {
      std::vector<float> buf;
      std::vector<const float*> pw;
      std::vector<float*> po;
    };
    std::vector<Scratch> scratch(threads);
    float* hp = h.data_ptr<float>();
    float* xp = xn.data_ptr<float>();
    float* ap = att.data_ptr<float>();
    const at::Tensor cos_c = cos_t.contiguous(), sin_c = sin_t.contiguous();
    const float* cs = cos_c.data_ptr<float>();
    const float* sn = sin_c.data_ptr<float>();
    const float e = static_cast<float>(eps);
    const int64_t qkv_cols = (hq + 2 * hk) * D;
    for (int64_t i = 0; i < L; ++i) {
      const float* w_in = in_norm[i].data_ptr<float>();
      for (int64_t r = 0; r < BT; ++r) rms_norm(hp + r * H, w_in, xp + r * H, H, e);
      at::Tensor qkv = gemm(wqkv[i], xn, false);
      if (bqkv[i]) qkv.add_(*bqkv[i]);
      // rope q and k, write k and v of every row into its slot, then attend (a row's keys are all written first:
      // with a mask a row may see later new tokens' slots only if the mask says so, and those are written too)
      for (const Segment& sg : segs) {
        float* kb = sg.k[i];
        float* vb = sg.v[i];
        for (int64_t t = 0; t < sg.T; ++t) {
          const int64_t r = sg.row0 + t;
          const float* row = qkv.data_ptr<float>() + r * qkv_cols;
          const float* c = cs + r * D;
          const float* s = sn + r * D;
          float* kslot = kb + (sg.start + t) * hk * D;
          for (int64_t hh = hq; hh < hq + hk; ++hh) {
            const float* x = row + hh * D;
            float* y = kslot + (hh - hq) * D;
            for (int64_t j = 0; j < half; ++j) y[j] = x[j] * c[j] + x[j + half] * s[j];
            for (int64_t j = half; j < D; ++j) y[j] = x[j] * c[j] + x[j - half] * s[j];
          }
          std::memcpy(vb + (sg.start + t) * hk * D, row + (hq + hk) * D, sizeof(float) * hk * D);
        }
        for (int64_t t = 0; t < sg.T; ++t) {
          const int64_t r = sg.row0 + t;
          const float* row = qkv.data_ptr<float>() + r * qkv_cols;
          const float* c = cs + r * D;
          const float* s = sn + r * D;
          for (int64_t hh = 0; hh < hq; ++hh) {  // x * cos + roll(x, D/2) * signed_sin: rotate-half rope
            const float* x = row + hh * D;
            float* y = qp + r * hq * D + hh * D;
            for (int64_t j = 0; j < half; ++j) y[j] = x[j] * c[j] + x[j + half] * s[j];
            for (int64_t j = half; j < D; ++j) y[j] = x[j] * c[j] + x[j - half] * s[j];
          }
        }
      }
      // each sequence's rows per kv head (an item), the items split between the threads: a row's bits do not
      // depend on the split
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        Scratch& sc = scratch.at(at::get_thread_num());
        for (int64_t it = begin; it < end; ++it) {
          const AttendItem& a = items[it];
          attend_rows(segs[a.seg], a.t0, a.t1, a.kvh, i, qp, ap, sc.buf, sc.pw, sc.po);
        }
      });
      at::Tensor o = gemm(wo[i], att, false);
      if (bo[i]) o.add_(*bo[i]);
      const float* op = o.data_ptr<float>();
      const float* w_post = post_norm[i].data_ptr<float>();
      for (int64_t r = 0; r < BT; ++r) {
        float* hr = hp + r * H;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) hr[j] += op[r * H + j];
        rms_norm(hr, w_post, xp + r * H, H, e);
      }
      at::Tensor gu = gemm(w13[i], xn, false);  // [BT, 2I]: gate then up
      const int64_t I = gu.size(1) / 2;
      at::Tensor act = at::empty({BT, I}, h.options());
      float* gp = gu.data_ptr<float>();
      float* actp = act.data_ptr<float>();
      for (int64_t r = 0; r < BT; ++r) {
        const float* g = gp + r * 2 * I;
        float* a = actp + r * I;
#if GS_AVX512 || GS_AVX2
        // vec16.h's exp16: GCC leaves the loop below scalar at these flags (fast_exp's clamp, the division)
        silu_mul16(g, g + I, a, I);
#else
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) a[j] = g[j] / (1.f + fast_exp(-g[j])) * g[j + I];  // silu(gate) * up
#endif
      }
      at::Tensor dn = gemm(w2[i], act, false);
      const float* dp = dn.data_ptr<float>();
#pragma omp simd
      for (int64_t j = 0; j < BT * H; ++j) hp[j] += dp[j];
    }
    const at::Tensor last = h.index_select(0, picked.to(at::kLong)).contiguous();
    const int64_t n = last.size(0), V = head->out_features();
    if (n == 0) return at::empty({0, V}, h.options());  // no rows wanted (a caller's empty logits_for)
    at::Tensor out = at::empty({n, H}, h.options());
    for (int64_t r = 0; r < n; ++r)
      rms_norm(last.data_ptr<float>() + r * H, norm.data_ptr<float>(), out.data_ptr<float>() + r * H, H, e);
    return gemm(head, out, true);
  }

  void check_inputs(const at::Tensor& cos_t, const at::Tensor& sin_t, int64_t rows, const W& head) const {
    check_float(cos_t, "cos");
    check_float(sin_t, "sin");
    TORCH_CHECK(cos_t.numel() == rows * d && sin_t.numel() == rows * d, who, ": cos and sin must hold ", rows, " x ",
                d, " values, got ", cos_t.sizes(), " and ", sin_t.sizes());
    TORCH_CHECK(head->in_features() == hidden, who, ": the head takes ", head->in_features(), " inputs, not ", hidden);
  }

  // h [B, T, H] fp32 embeddings of the new tokens; cos, sin [B, T, 1, D] (sin signed: rope_tables); caches
  // [B, capacity, hk, D] fp32, slots start .. start+T-1 written here; head: the lm_head (or a pruned one);
  // rows: the rows of each sequence whose logits are wanted (None: all); mask: None (causal) or bool
  // [T, start + T], row t attending to slot s where mask[t, s]. Returns logits [B, n, V] fp32.
  template <class Gemm>
  at::Tensor forward(const at::Tensor& h_in, const at::Tensor& cos_t, const at::Tensor& sin_t, int64_t start,
                     const std::vector<at::Tensor>& kc, const std::vector<at::Tensor>& vc, const W& head,
                     const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& mask,
                     const Gemm& gemm) const {
    const int64_t H = hidden, L = num_layers();
    TORCH_CHECK(h_in.dim() == 3 && h_in.size(2) == H && h_in.size(0) >= 1, who, ": h must be [B, T, ", H, "], got ",
                h_in.sizes());
    const int64_t B = h_in.size(0), T = h_in.size(1), BT = B * T;
    TORCH_CHECK(T >= 1, who, ": no tokens to run");
    check_inputs(cos_t, sin_t, BT, head);
    TORCH_CHECK(static_cast<int64_t>(kc.size()) == L && static_cast<int64_t>(vc.size()) == L, who, ": ", L,
                " layers but ", kc.size(), " key and ", vc.size(), " value caches");
    TORCH_CHECK(start >= 0, who, ": start=", start);
    const int64_t cap = check_caches(kc, vc, 0, B, start + T), seq = cap * hk * d;
    std::vector<Segment> segs(B);
    for (int64_t b = 0; b < B; ++b) {  // each batch row a sequence of its own, sharing start, T and slots
      Segment& sg = segs[b];
      sg.start = start;
      sg.T = T;
      sg.row0 = b * T;
      if (b == 0) {
        set_slots(sg, mask ? &*mask : nullptr);
      } else {
        sg.len = segs[0].len;
        sg.slots = segs[0].slots;
        sg.counts = segs[0].counts;
      }
      for (int64_t i = 0; i < L; ++i) {
        sg.k.push_back(kc[i].data_ptr<float>() + b * seq);
        sg.v.push_back(vc[i].data_ptr<float>() + b * seq);
      }
    }
    at::Tensor per = rows ? rows->to(at::kLong).contiguous() : at::arange(T, at::kLong);
    const int64_t n = per.numel();
    at::Tensor picked = (at::arange(B, at::kLong).mul_(T).view({B, 1}) + per.view({1, n})).reshape({B * n});
    at::Tensor logits = run(h_in.reshape({BT, H}), cos_t, sin_t, segs, head, picked, gemm);
    return logits.view({B, n, head->out_features()});
  }

  // Several sequences in one forward (the batched engine): h [N, H], their new tokens stacked; cos, sin [N, D];
  // sequence s has lens[s] rows from slot starts[s] on, caches kc[s * L + l], vc[s * L + l] ([1, capacity, hk,
  // D]) and masks[s] (an empty tensor: causal); picked: the rows of N whose logits are wanted. Each sequence's
  // logits are the bits forward() gives it alone. Returns [n, V].
  template <class Gemm>
  at::Tensor forward_many(const at::Tensor& h_in, const at::Tensor& cos_t, const at::Tensor& sin_t,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                          const std::vector<at::Tensor>& kc, const std::vector<at::Tensor>& vc, const W& head,
                          const at::Tensor& picked, const std::vector<at::Tensor>& masks, const Gemm& gemm) const {
    const int64_t H = hidden, L = num_layers();
    const size_t S = starts.size();
    TORCH_CHECK(S >= 1 && lens.size() == S && masks.size() == S, who, ": starts, lens and masks must have one ",
                "entry per sequence (", S, ", ", lens.size(), ", ", masks.size(), ")");
    TORCH_CHECK(kc.size() == S * L && vc.size() == S * L, who, ": ", S, " sequences of ", L, " layers need ", S * L,
                " key and value caches, got ", kc.size(), " and ", vc.size());
    TORCH_CHECK(h_in.dim() == 2 && h_in.size(1) == H, who, ": h must be [N, ", H, "], got ", h_in.sizes());
    std::vector<Segment> segs(S);
    int64_t row0 = 0;
    for (size_t s = 0; s < S; ++s) {
      Segment& sg = segs[s];
      TORCH_CHECK(starts[s] >= 0 && lens[s] >= 1, who, ": sequence ", s, " has start ", starts[s], " and ", lens[s],
                  " rows");
      sg.start = starts[s];
      sg.T = lens[s];
      sg.row0 = row0;
      row0 += lens[s];
      check_caches(kc, vc, s * L, 1, sg.start + sg.T);
      set_slots(sg, &masks[s]);
      for (int64_t i = 0; i < L; ++i) {
        sg.k.push_back(kc[s * L + i].data_ptr<float>());
        sg.v.push_back(vc[s * L + i].data_ptr<float>());
      }
    }
    TORCH_CHECK(row0 == h_in.size(0), who, ": the sequences have ", row0, " rows but h has ", h_in.size(0));
    check_inputs(cos_t, sin_t, row0, head);
    return run(h_in, cos_t, sin_t, segs, head, picked, gemm);
  }
};

}  // namespace
}  // namespace graphspec_native
