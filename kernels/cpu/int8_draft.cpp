// The cached forward of an int8 Llama-family model (a draft on the CPU) in C++: graphspec.kernels.cpu.int8_draft.
//
// Why: a small draft's step is mostly not its GEMMs. SmolLM2-135M in int8 runs 121 GEMMs a token, and around
// them some 25 torch ops a layer, each paying dispatch and allocation for a few hundred floats. The layers run
// as loops in place (layer_stack.h: scope, row-exactness, numerics) around graphspec's own int8 GEMM
// (int8_gemm.h) at this file's level. The result is a draft's: speculative decoding stays lossless whatever a
// draft computes.
//
// Weights: Int8Linear objects (one per GEMM weight, made by kernels.linear.Int8Weight for this level and shared
// with its eager linear): int8 values and per-row scales, packed once for the int8 GEMM, and on request
// rounded again to int4 (int4_gemm.h, avx512 and avx2). A prefill's products (kPrefillTokens) run on the prefill GEMM
// (int8_gemm.h: the same weights, activations rounded to bf16; avx512 and amx).

#include <torch/custom_class.h>
#include <torch/script.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "level.h"
#include "int4_gemm.h"
#include "int8_gemm.h"
#include "layer_stack.h"
#include "native_math.h"

namespace {

using graphspec_native::Int4Matrix;  // int4_gemm.h: graphspec's int4 GEMM (avx512, avx2)
using graphspec_native::Int8Matrix;  // int8_gemm.h: graphspec's int8 GEMM (every level)

// "int4" runs products of up to this many rows in 4 bits and larger ones (prefills) on the int8 GEMM: past 3
// rows the int4 loop is compute-bound and slower than the int8 one (perf/RESULTS.md).
constexpr int64_t kInt4Rows = 3;

// A forward of at least this many tokens of each sequence and no tree (a prompt's prefill, a catch-up) runs the
// layers' products on the prefill GEMM (int8_gemm.h: activations rounded to bf16, twice the products an
// instruction; avx512 and amx) where the level has it. Fewer rows (a decode step, a short catch-up) keep the fp32
// GEMM's bits; the 0.5B draft's products measured the two about even at 6 rows and the prefill GEMM 1.2-1.6x
// faster at 8, its weights' widening included (perf/RESULTS.md).
constexpr int64_t kPrefillTokens = 8;

// One int8 weight: q int8 [N, K] and fp32 scales [N] (symmetric per output row, as kernels.linear.quantize_weight
// makes them), packed for this level's int8 GEMM, and its int4 rounding once asked for.
struct Int8Linear : torch::CustomClassHolder {
  at::Tensor q, scales;
  Int8Matrix own;
  Int4Matrix own4;  // empty until ensure_int4

  Int8Linear(at::Tensor q_, at::Tensor scales_) : q(std::move(q_)), scales(std::move(scales_)) {
    TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat, "Int8Linear: scales must be 1-d fp32, got ",
                scales.scalar_type(), " ", scales.sizes());
    own = graphspec_native::pack_int8(q, scales);
  }
  int64_t out_features() const { return own.n; }
  int64_t in_features() const { return own.k; }
  // y [rows, N] fp32 = x [rows, K] fp32 times the weight (int8 GEMM).
  at::Tensor forward(at::Tensor x) const { return graphspec_native::int8_linear(x.contiguous(), own); }
  // The same on the prefill GEMM (activations rounded to bf16) where this level has one, else forward's.
  at::Tensor forward_prefill(at::Tensor x) const {
#if GS_HAVE_I8_PREFILL
    return graphspec_native::int8_linear_prefill(x.contiguous(), own);
#else
    return forward(std::move(x));
#endif
  }
  static bool has_prefill_gemm() { return GS_HAVE_I8_PREFILL != 0; }
  // The same through the int4 rounding (packed on first call; avx512 and avx2).
  at::Tensor forward4(at::Tensor x) {
    ensure_int4();
    return graphspec_native::int4_linear(x.contiguous(), own4);
  }
  void ensure_int4() {
    TORCH_CHECK(graphspec_native::have_int4(), "int8_native: the '", GS_LEVEL_NAME,
                "' level has no int4 GEMM (it needs the avx512 or avx2 level)");
    if (own4.n == 0) own4 = graphspec_native::pack_int4(q, scales);
  }
  void drop_int4() { own4 = Int4Matrix(); }
  bool has_int4() const { return own4.n != 0; }
};

using Linear = c10::intrusive_ptr<Int8Linear>;

// Which GEMM a forward's layers run (Int8Draft::set_gemm).
enum class Gemm { kInt8, kInt4 };

at::Tensor run_gemm(const Linear& w, const at::Tensor& x, Gemm g, bool prefill) {
#if GS_HAVE_I8_PREFILL
  if (prefill) return graphspec_native::int8_linear_prefill(x, w->own);
#endif
  if (g == Gemm::kInt4 && x.size(0) <= kInt4Rows) return graphspec_native::int4_linear(x, w->own4);
  return graphspec_native::int8_linear(x, w->own);
}

struct Int8Draft : torch::CustomClassHolder {
  graphspec_native::LayerStack<Linear> stack;
  Gemm layers_gemm = Gemm::kInt8;  // the layers' products

  Int8Draft(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size, double rms_eps,
            double attn_scale, at::Tensor final_norm)
      : stack("int8_native", num_heads, num_kv_heads, head_dim, hidden_size, rms_eps, attn_scale,
              std::move(final_norm)) {}

  void add_layer(Linear qkv, c10::optional<at::Tensor> b_qkv, Linear o, c10::optional<at::Tensor> b_o,
                 Linear gate_up, Linear down, at::Tensor n_in, at::Tensor n_post) {
    stack.add_layer(qkv, std::move(b_qkv), o, std::move(b_o), gate_up, down, std::move(n_in), std::move(n_post));
    if (layers_gemm == Gemm::kInt4)
      for (const Linear* w : {&qkv, &o, &gate_up, &down}) (*w)->ensure_int4();
  }

  int64_t num_layers() const { return stack.num_layers(); }

  // Which GEMM the layers run: "int8" (int8_gemm.h, every level) or "int4" (the layers' products of up to
  // kInt4Rows rows rounded again to 4 bits, int4_gemm.h, packed on the first switch; avx512 and avx2). The lm_head
  // always runs int8.
  std::string gemm() const { return layers_gemm == Gemm::kInt4 ? "int4" : "int8"; }
  void set_gemm(const std::string& name) {
    TORCH_CHECK(name == "int8" || name == "int4", "int8_native: gemm must be 'int8' or 'int4', got '", name, "'");
    if (name == "int4")
      for (auto* ws : {&stack.wqkv, &stack.wo, &stack.w13, &stack.w2})
        for (Linear& w : *ws) w->ensure_int4();
    layers_gemm = name == "int4" ? Gemm::kInt4 : Gemm::kInt8;
  }
  // Frees the int4 copies (the layers' products must not be running on them).
  void drop_int4() {
    TORCH_CHECK(layers_gemm != Gemm::kInt4, "int8_native: the forward runs the int4 GEMM; set_gemm('int8') first");
    for (auto* ws : {&stack.wqkv, &stack.wo, &stack.w13, &stack.w2})
      for (Linear& w : *ws) w->drop_int4();
  }

  // The layers' products on the GEMM chosen (in a prefill the prefill GEMM), the lm_head's on int8.
  at::Tensor product(const Linear& w, const at::Tensor& x, bool head, bool prefill) const {
    return run_gemm(w, x, head ? Gemm::kInt8 : layers_gemm, prefill && !head);
  }

  // LayerStack::forward and forward_many (layer_stack.h) on this model's GEMMs. forward_many (sequences of
  // different lengths in one product) stays on the fp32 GEMM, so a sequence's bits never depend on the others'.
  at::Tensor forward(at::Tensor h_in, at::Tensor cos_t, at::Tensor sin_t, int64_t start, std::vector<at::Tensor> kc,
                     std::vector<at::Tensor> vc, Linear head, c10::optional<at::Tensor> rows,
                     c10::optional<at::Tensor> mask) {
    const bool prefill = !mask.has_value() && h_in.dim() == 3 && h_in.size(1) >= kPrefillTokens;
    return stack.forward(h_in, cos_t, sin_t, start, kc, vc, head, rows, mask,
                         [this, prefill](const Linear& w, const at::Tensor& x, bool hd) {
                           return product(w, x, hd, prefill);
                         });
  }
  at::Tensor forward_many(at::Tensor h_in, at::Tensor cos_t, at::Tensor sin_t, std::vector<int64_t> starts,
                          std::vector<int64_t> lens, std::vector<at::Tensor> kc, std::vector<at::Tensor> vc,
                          Linear head, at::Tensor picked, std::vector<at::Tensor> masks) {
    return stack.forward_many(h_in, cos_t, sin_t, starts, lens, kc, vc, head, picked, masks,
                              [this](const Linear& w, const at::Tensor& x, bool hd) {
                                return product(w, x, hd, false);
                              });
  }
};

}  // namespace

GS_LIBRARY_FRAGMENT(m) {
  m.class_<Int8Linear>("Int8Linear")
      .def(torch::init<at::Tensor, at::Tensor>())
      .def("forward", &Int8Linear::forward)
      .def("forward4", &Int8Linear::forward4)
      .def("forward_prefill", &Int8Linear::forward_prefill)
      .def_static("has_prefill_gemm", &Int8Linear::has_prefill_gemm)
      .def("drop_int4", &Int8Linear::drop_int4)
      .def("has_int4", &Int8Linear::has_int4)
      .def("out_features", &Int8Linear::out_features)
      .def("in_features", &Int8Linear::in_features);
  m.class_<Int8Draft>("Int8Draft")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &Int8Draft::add_layer)
      .def("num_layers", &Int8Draft::num_layers)
      .def("gemm", &Int8Draft::gemm)
      .def("set_gemm", &Int8Draft::set_gemm)
      .def("drop_int4", &Int8Draft::drop_int4)
      .def("forward", &Int8Draft::forward)
      .def("forward_many", &Int8Draft::forward_many);
}
