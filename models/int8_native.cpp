// The cached forward of an int8 Llama-family model (a draft on the CPU) in C++: graphspec.models.int8_native.
//
// Why: a small draft's step is mostly not its GEMMs. SmolLM2-135M in int8 runs 121 int8 GEMMs a token
// (about 7-8 ms on one core of the AMD EPYC), and around them some 25 torch ops a layer (norms, rope, cache
// writes, SDPA, activations, residual adds), each paying dispatch, allocation and TensorIterator set-up for a
// few hundred floats; from TorchScript those cost about 3-4 ms a forward (perf/RESULTS.md section T). Here they are
// plain loops over the row in place, and the GEMMs are the same fbgemm calls (LinearPackedParamsBase::
// apply_dynamic, what torch.ops.quantized.linear_dynamic runs).
//
// Scope: batch 1, any number of new tokens T, causal attention over the cache (row t sees cache slots
// 0 .. start + t); rope from the caller's cos / signed-sin tables, so any positions. Draft trees (a mask) and
// batches take the TorchScript path (graphspec.models.lean_int8). The result is a draft's: fp32 sums in
// another order than torch's and an exp polynomial (relative error < 3e-7), so logits are not the TorchScript
// path's bits: within 1e-3 on the tests' small models (tests/models/test_int8_native.py); on a real draft the
// int8 rounding of activations amplifies the difference as it does a 1e-6 nudge of that path's own inputs.
// Speculative decoding stays lossless whatever a draft computes.

#include <torch/custom_class.h>
#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "_int4_gemm.h"
#include "_int8_gemm.h"
#include "_native_math.h"

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

using graphspec_native::fast_exp;  // kernels/_native_math.h: a polynomial exp, vectorizable, no -ffast-math
using graphspec_native::Int4Matrix;  // kernels/_int4_gemm.h: graphspec's int4 GEMM (AVX-512 VNNI)
using graphspec_native::Int8Matrix;  // kernels/_int8_gemm.h: graphspec's int8 GEMM (AVX-512 VNNI)

// fbgemm's packed weight unpacked: its int8 values [N, K] and per-row scales (symmetric, as kernels/linear.py
// quantize_weight makes them; anything else is refused, not approximated).
std::pair<at::Tensor, at::Tensor> unpack_int8(const Packed& p) {
  auto unpacked = p->unpack();
  const at::Tensor& wq = std::get<0>(unpacked);
  TORCH_CHECK(wq.is_quantized() && wq.scalar_type() == at::kQInt8, "int8_native: a packed weight that is not qint8");
  at::Tensor scales;
  if (wq.qscheme() == at::kPerChannelAffine || wq.qscheme() == at::kPerChannelSymmetric) {
    TORCH_CHECK(wq.q_per_channel_axis() == 0 && wq.q_per_channel_zero_points().eq(0).all().item<bool>(),
                "int8_native: a packed weight with zero points or scales along axis ", wq.q_per_channel_axis(),
                "; graphspec's int8 weights are symmetric per output row");
    scales = wq.q_per_channel_scales();
  } else {
    TORCH_CHECK(wq.qscheme() == at::kPerTensorAffine && wq.q_zero_point() == 0,
                "int8_native: a packed weight of an unsupported quantization scheme");
    scales = at::full({wq.size(0)}, wq.q_scale(), at::kDouble);
  }
  return {wq.int_repr().contiguous(), scales};
}

Int8Matrix repack(const Packed& p) {
  const auto [q, scales] = unpack_int8(p);
  return graphspec_native::pack_int8(q, scales);
}

Int4Matrix repack4(const Packed& p) {
  const auto [q, scales] = unpack_int8(p);
  return graphspec_native::pack_int4(q, scales);
}

// Which GEMM a forward runs (Int8Draft::set_gemm).
enum class Gemm { kFbgemm, kVnni, kInt4 };

// "int4" runs products of up to this many rows in 4 bits and larger ones (prefills) on the int8 GEMM: on the
// AMD EPYC (Zen 4, 1 thread), all of the pruned Qwen2.5-0.5B's layer products took 10.7 / 11.8 / 14.6 / 16.1 /
// 21.5 ms in int4 for 1-5 rows against 16.7-20.0 in int8 (perf/RESULTS.md).
constexpr int64_t kInt4Rows = 3;

// A packed weight held two or three ways: fbgemm's (the TorchScript path's, and this file's without VNNI),
// graphspec's int8 (empty without VNNI) and, once a forward asks for it, graphspec's int4.
struct Weight {
  Packed fb;
  Int8Matrix own;
  Int4Matrix own4;  // empty until ensure_int4
  explicit Weight(Packed p) : fb(std::move(p)) {
    if (graphspec_native::have_vnni()) own = repack(fb);
  }
  void ensure_int4() {
    if (own4.n == 0) own4 = repack4(fb);
  }
  void drop_int4() { own4 = Int4Matrix(); }
  at::Tensor apply(const at::Tensor& x, Gemm g) const {
    switch (g) {  // kVnni, kInt4: set_gemm made sure own (and own4) are packed
      case Gemm::kInt4:  // past kInt4Rows the int4 loop is compute-bound and slower than the int8 one
        return x.size(0) <= kInt4Rows ? graphspec_native::int4_linear(x, own4) : graphspec_native::int8_linear(x, own);
      case Gemm::kVnni: return graphspec_native::int8_linear(x, own);
      default: return fb->apply_dynamic(x, false);
    }
  }
};

// y = x * rsqrt(mean(x^2) + eps) * w over n floats (the residual stream's rms norm, fp32)
inline void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "int8_native: ", what,
              " must be a contiguous fp32 CPU tensor, got ", t.scalar_type(), " on ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

struct Int8Draft : torch::CustomClassHolder {
  std::vector<Weight> wqkv, wo, w13, w2;
  std::vector<Weight> heads;  // the lm_heads seen (the full one, a pruned one), repacked once each
  Gemm layers_gemm = graphspec_native::have_vnni() ? Gemm::kVnni : Gemm::kFbgemm;  // the layers' products
  std::vector<c10::optional<at::Tensor>> bqkv, bo;
  std::vector<at::Tensor> in_norm, post_norm;
  at::Tensor norm;
  int64_t hq, hk, d, hidden;
  double eps, scale;

  Int8Draft(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size, double rms_eps,
            double attn_scale, at::Tensor final_norm)
      : norm(final_norm), hq(num_heads), hk(num_kv_heads), d(head_dim), hidden(hidden_size), eps(rms_eps),
        scale(attn_scale) {
    TORCH_CHECK(hq > 0 && hk > 0 && hq % hk == 0, "int8_native: num_heads=", hq, " must be a positive multiple of ",
                "num_kv_heads=", hk);
    TORCH_CHECK(d > 0 && d % 2 == 0, "int8_native: head_dim=", d, " must be positive and even (rope)");
    check_float(norm, "the final norm");
    TORCH_CHECK(norm.numel() == hidden, "int8_native: the final norm has ", norm.numel(), " values, hidden_size is ",
                hidden);
  }

  void add_layer(Packed qkv, c10::optional<at::Tensor> b_qkv, Packed o, c10::optional<at::Tensor> b_o, Packed gate_up,
                 Packed down, at::Tensor n_in, at::Tensor n_post) {
    check_float(n_in, "an input norm");
    check_float(n_post, "a post-attention norm");
    TORCH_CHECK(n_in.numel() == hidden && n_post.numel() == hidden, "int8_native: a layer's norms must have ",
                hidden, " values");
    if (b_qkv) check_float(*b_qkv, "a qkv bias");
    if (b_o) check_float(*b_o, "an o_proj bias");
    wqkv.emplace_back(std::move(qkv));
    bqkv.push_back(b_qkv);
    wo.emplace_back(std::move(o));
    bo.push_back(b_o);
    w13.emplace_back(std::move(gate_up));
    w2.emplace_back(std::move(down));
    in_norm.push_back(n_in);
    post_norm.push_back(n_post);
  }

  int64_t num_layers() const { return static_cast<int64_t>(wqkv.size()); }

  // Which GEMM the forward runs: "vnni" (graphspec's int8, kernels/_int8_gemm.h; the default where built with
  // AVX-512 VNNI), "fbgemm" (torch's, the TorchScript path's GEMM) or "int4" (the layers' products rounded
  // again to 4 bits, kernels/_int4_gemm.h, packed on the first switch; the lm_head stays on the int8 GEMM).
  std::string gemm() const {
    return layers_gemm == Gemm::kInt4 ? "int4" : layers_gemm == Gemm::kVnni ? "vnni" : "fbgemm";
  }
  void set_gemm(const std::string& name) {
    TORCH_CHECK(name == "vnni" || name == "fbgemm" || name == "int4",
                "int8_native: gemm must be 'vnni', 'int4' or 'fbgemm', got '", name, "'");
    TORCH_CHECK(name == "fbgemm" || graphspec_native::have_vnni(), "int8_native: the '", name,
                "' GEMM needs AVX-512 VNNI, which this build lacks");
    if (name == "int4")
      for (auto* ws : {&wqkv, &wo, &w13, &w2})
        for (Weight& w : *ws) w.ensure_int4();
    layers_gemm = name == "int4" ? Gemm::kInt4 : name == "vnni" ? Gemm::kVnni : Gemm::kFbgemm;
  }
  // Frees the int4 copies (the layers' products must not be running on them).
  void drop_int4() {
    TORCH_CHECK(layers_gemm != Gemm::kInt4, "int8_native: the forward runs the int4 GEMM; set_gemm another first");
    for (auto* ws : {&wqkv, &wo, &w13, &w2})
      for (Weight& w : *ws) w.drop_int4();
  }
  Gemm head_gemm() const { return layers_gemm == Gemm::kInt4 ? Gemm::kVnni : layers_gemm; }

  const Weight& head_for(const Packed& p) {
    for (const Weight& w : heads)
      if (w.fb.get() == p.get()) return w;
    if (heads.size() >= 4) heads.erase(heads.begin());  // a bounded cache: a draft has one or two heads
    heads.emplace_back(p);
    return heads.back();
  }

  // Row t's attention: one query per q head over cache slots 0 .. len-1 ([S, hk, D] rows of k and v).
  void attend(const float* q, const float* kb, const float* vb, float* out, float* scores, int64_t len) const {
    const int64_t D = d, group = hq / hk, row = hk * D;
    const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
    // Head dims of whole zmm (64, 128): one fp32 sum a lane, then one horizontal add. (The omp simd
    // reduction below compiled to a store and 16 dependent scalar adds per dot product: about 1 ms of
    // SmolLM2's 8 ms forward after 200 cached tokens.)
    const bool wide = D % 16 == 0;
#else
    const bool wide = false;
#endif
    for (int64_t s = 0; s < len; ++s) {  // scores [hq, len]: each cached key row read once, in slot order
      const float* kr = kb + s * row;
      for (int64_t h = 0; h < hq; ++h) {
        const float* kh = kr + (h / group) * D;
        const float* qh = q + h * D;
        float acc = 0.f;
        if (wide) {
#if defined(__AVX512F__)
          __m512 v = _mm512_setzero_ps();
          for (int64_t j = 0; j < D; j += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j), _mm512_loadu_ps(kh + j), v);
          acc = _mm512_reduce_add_ps(v);
#endif
        } else {
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < D; ++j) acc += qh[j] * kh[j];
        }
        scores[h * len + s] = acc * sc;
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* sr = scores + h * len;
      float mx = -INFINITY;
      for (int64_t s = 0; s < len; ++s) mx = std::max(mx, sr[s]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < len; ++s) {
        sr[s] = fast_exp(sr[s] - mx);
        sum += sr[s];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t s = 0; s < len; ++s) sr[s] *= inv;
      std::fill(out + h * D, out + (h + 1) * D, 0.f);
    }
    for (int64_t s = 0; s < len; ++s) {
      const float* vr = vb + s * row;
      for (int64_t h = 0; h < hq; ++h) {
        const float p = scores[h * len + s];
        const float* vh = vr + (h / group) * D;
        float* o = out + h * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) o[j] += p * vh[j];
      }
    }
  }

  // h [1, T, H] fp32 embeddings of the new tokens; cos, sin [1, T, 1, D] (sin signed: rope_tables); caches
  // [1, capacity, hk, D] fp32, slots start .. start+T-1 written here; rows: the rows whose logits are wanted
  // (None: all). Returns logits [1, n, V] fp32.
  at::Tensor forward(at::Tensor h_in, at::Tensor cos_t, at::Tensor sin_t, int64_t start, std::vector<at::Tensor> kc,
                     std::vector<at::Tensor> vc, Packed head, c10::optional<at::Tensor> rows) {
    const int64_t H = hidden, D = d, half = D / 2, L = num_layers();
    TORCH_CHECK(h_in.dim() == 3 && h_in.size(0) == 1 && h_in.size(2) == H, "int8_native: h must be [1, T, ", H,
                "], got ", h_in.sizes());
    const int64_t T = h_in.size(1);
    TORCH_CHECK(T >= 1, "int8_native: no tokens to run");
    check_float(cos_t, "cos");
    check_float(sin_t, "sin");
    TORCH_CHECK(cos_t.numel() == T * D && sin_t.numel() == T * D, "int8_native: cos and sin must hold [T, ", D,
                "] values for T=", T, ", got ", cos_t.sizes(), " and ", sin_t.sizes());
    TORCH_CHECK(static_cast<int64_t>(kc.size()) == L && static_cast<int64_t>(vc.size()) == L, "int8_native: ", L,
                " layers but ", kc.size(), " key and ", vc.size(), " value caches");
    TORCH_CHECK(start >= 0, "int8_native: start=", start);
    for (int64_t i = 0; i < L; ++i) {
      for (const at::Tensor* c : {&kc[i], &vc[i]}) {
        check_float(*c, "a KV cache");
        TORCH_CHECK(c->dim() == 4 && c->size(0) == 1 && c->size(2) == hk && c->size(3) == D &&
                        c->size(1) >= start + T,
                    "int8_native: a KV cache must be [1, >= ", start + T, ", ", hk, ", ", D, "], got ", c->sizes());
      }
    }
    at::Tensor h = h_in.to(at::kFloat).reshape({T, H}).clone();  // the residual stream, updated in place
    at::Tensor xn = at::empty({T, H}, h.options());
    at::Tensor att = at::empty({T, hq * D}, h.options());
    std::vector<float> q(hq * D), scores(hq * (start + T));
    float* hp = h.data_ptr<float>();
    float* xp = xn.data_ptr<float>();
    float* ap = att.data_ptr<float>();
    const float* cs = cos_t.data_ptr<float>();
    const float* sn = sin_t.data_ptr<float>();
    const float e = static_cast<float>(eps);
    const int64_t qkv_cols = (hq + 2 * hk) * D;
    for (int64_t i = 0; i < L; ++i) {
      const float* w_in = in_norm[i].data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) rms_norm(hp + t * H, w_in, xp + t * H, H, e);
      at::Tensor qkv = wqkv[i].apply(xn, layers_gemm);
      TORCH_CHECK(qkv.is_contiguous() && qkv.numel() == T * qkv_cols, "int8_native: layer ", i, "'s qkv weight gave ",
                  qkv.sizes(), ", expected [", T, ", ", qkv_cols, "]");
      if (bqkv[i]) qkv.add_(*bqkv[i]);
      float* kb = kc[i].data_ptr<float>();
      float* vb = vc[i].data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {  // rope q and k, write k and v into slot start + t, attend
        const float* row = qkv.data_ptr<float>() + t * qkv_cols;
        const float* c = cs + t * D;
        const float* s = sn + t * D;
        float* kslot = kb + (start + t) * hk * D;
        for (int64_t hh = 0; hh < hq + hk; ++hh) {
          const float* x = row + hh * D;
          float* y = hh < hq ? q.data() + hh * D : kslot + (hh - hq) * D;
          // x * cos + roll(x, D/2) * signed_sin: rotate-half rope, as lean_int8 and rope_rotate
          for (int64_t j = 0; j < half; ++j) y[j] = x[j] * c[j] + x[j + half] * s[j];
          for (int64_t j = half; j < D; ++j) y[j] = x[j] * c[j] + x[j - half] * s[j];
        }
        std::memcpy(vb + (start + t) * hk * D, row + (hq + hk) * D, sizeof(float) * hk * D);
        attend(q.data(), kb, vb, ap + t * hq * D, scores.data(), start + t + 1);
      }
      at::Tensor o = wo[i].apply(att, layers_gemm);
      if (bo[i]) o.add_(*bo[i]);
      const float* op = o.data_ptr<float>();
      const float* w_post = post_norm[i].data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        float* hr = hp + t * H;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) hr[j] += op[t * H + j];
        rms_norm(hr, w_post, xp + t * H, H, e);
      }
      at::Tensor gu = w13[i].apply(xn, layers_gemm);  // [T, 2I]: gate then up
      const int64_t I = gu.size(1) / 2;
      at::Tensor act = at::empty({T, I}, h.options());
      float* gp = gu.data_ptr<float>();
      float* actp = act.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        const float* g = gp + t * 2 * I;
        float* a = actp + t * I;
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) a[j] = g[j] / (1.f + fast_exp(-g[j])) * g[j + I];  // silu(gate) * up
      }
      at::Tensor dn = w2[i].apply(act, layers_gemm);
      const float* dp = dn.data_ptr<float>();
#pragma omp simd
      for (int64_t j = 0; j < T * H; ++j) hp[j] += dp[j];
    }
    at::Tensor last = rows ? h.index_select(0, rows->to(at::kLong)) : h;
    const int64_t n = last.size(0);
    at::Tensor out = at::empty({n, H}, h.options());
    for (int64_t r = 0; r < n; ++r) rms_norm(last.data_ptr<float>() + r * H, norm.data_ptr<float>(),
                                             out.data_ptr<float>() + r * H, H, e);
    const Weight& hw = head_for(head);
    if (n == 0) {  // no rows wanted (a caller's empty logits_for): the head's width from one dummy row
      const at::Tensor one = hw.apply(at::zeros({1, H}, h.options()), head_gemm());
      return one.narrow(0, 0, 0).view({1, 0, one.size(1)});
    }
    const at::Tensor logits = hw.apply(out, head_gemm());
    return logits.view({1, n, logits.size(1)});
  }
};

// One packed weight through graphspec's int8 GEMM, for tests and benchmarks: Int8Linear(packed).forward(x).
struct Int8Linear : torch::CustomClassHolder {
  Int8Matrix w;
  explicit Int8Linear(Packed p) : w(repack(p)) {}
  at::Tensor forward(at::Tensor x) const { return graphspec_native::int8_linear(x.contiguous(), w); }
};

// The same through graphspec's int4 GEMM (the weight rounded again to 4 bits): Int4Linear(packed).forward(x).
struct Int4Linear : torch::CustomClassHolder {
  Int4Matrix w;
  explicit Int4Linear(Packed p) : w(repack4(p)) {}
  at::Tensor forward(at::Tensor x) const { return graphspec_native::int4_linear(x.contiguous(), w); }
};

}  // namespace

TORCH_LIBRARY(graphspec_int8_native, m) {
  m.class_<Int8Draft>("Int8Draft")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &Int8Draft::add_layer)
      .def("num_layers", &Int8Draft::num_layers)
      .def("gemm", &Int8Draft::gemm)
      .def("set_gemm", &Int8Draft::set_gemm)
      .def("drop_int4", &Int8Draft::drop_int4)
      .def("forward", &Int8Draft::forward);
  m.class_<Int8Linear>("Int8Linear").def(torch::init<Packed>()).def("forward", &Int8Linear::forward);
  m.class_<Int4Linear>("Int4Linear").def(torch::init<Packed>()).def("forward", &Int4Linear::forward);
  m.def("have_vnni() -> bool", [] { return graphspec_native::have_vnni(); });
}
