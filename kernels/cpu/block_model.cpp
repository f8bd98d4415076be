// The cached forward of a model whose GEMM weights are GGUF blocks (weights="gguf" or "gguf-a8") in C++:
// graphspec.kernels.cpu.block_model.
//
// Why: a 1.5B target's decode step on its Q4_K_M file reads about 1 GB, 50 ms at 20 GB/s; the general forward
// spent another 10-15 ms a step outside its GEMMs (some 30 torch ops a layer and the Python between them). Here
// the layers run as loops in place (layer_stack.h: scope, row-exactness, numerics) around qgemm.cpp's block
// GEMMs, built into the same extension (graphspec_cpuq_<level>) with the same -ffp-contract=off.
//
// Weights: BlockLinear objects (one per GEMM weight, made by kernels.qlinear.BlockWeight.native for this level):
// one or more parts stacked along N, each a block format's bytes (fp32 activations: qlinear) or pack_a8's tiles
// (int8 activations: qlinear_a8), sharing K. The tensors are the BlockWeights' own: no second copy.

#include <torch/custom_class.h>
#include <torch/script.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "layer_stack.h"
#include "level.h"

namespace GS_NS {
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& data, int64_t type, int64_t n, int64_t k, bool a8);
}  // namespace GS_NS

namespace {

// One GEMM weight: parts [n_i, K] stacked along N.
struct BlockLinear : torch::CustomClassHolder {
  std::vector<at::Tensor> data;
  std::vector<int64_t> types, rows, a8;
  int64_t k = 0, n = 0;

  // data[i]: part i's bytes (a8[i] 0: GGUF blocks; 1: pack_a8 tiles) of block type types[i] with rows[i] rows.
  BlockLinear(std::vector<at::Tensor> data_, std::vector<int64_t> types_, std::vector<int64_t> rows_,
              std::vector<int64_t> a8_, int64_t k_)
      : data(std::move(data_)), types(std::move(types_)), rows(std::move(rows_)), a8(std::move(a8_)), k(k_) {
    TORCH_CHECK(!data.empty() && types.size() == data.size() && rows.size() == data.size() &&
                    a8.size() == data.size(),
                "block_native: a BlockLinear needs one type, row count and activation flag per part, got ",
                data.size(), " parts, ", types.size(), " types, ", rows.size(), " row counts, ", a8.size(), " flags");
    const at::Tensor none = at::empty({0, k}, at::kFloat);
    for (size_t i = 0; i < data.size(); ++i) {
      TORCH_CHECK(a8[i] == 0 || a8[i] == 1, "block_native: activation flag ", a8[i], " is not 0 or 1");
      GS_NS::block_gemm(none, data[i], types[i], rows[i], k, a8[i] != 0);  // checks the part's bytes and shape
      n += rows[i];
    }
  }
  int64_t out_features() const { return n; }
  int64_t in_features() const { return k; }

  // y [rows, N] fp32 = x [rows, K] fp32 times the weight.
  at::Tensor forward(const at::Tensor& x) const {
    if (data.size() == 1) return GS_NS::block_gemm(x, data[0], types[0], rows[0], k, a8[0] != 0);
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    int64_t off = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      y.narrow(1, off, rows[i]).copy_(GS_NS::block_gemm(x, data[i], types[i], rows[i], k, a8[i] != 0));
      off += rows[i];
    }
    return y;
  }
};

using Linear = c10::intrusive_ptr<BlockLinear>;

// The model: layer_stack.h's forward on BlockLinear weights.
struct BlockModel : torch::CustomClassHolder {
  graphspec_native::LayerStack<Linear> stack;

  BlockModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size, double rms_eps,
             double attn_scale, at::Tensor final_norm)
      : stack("block_native", num_heads, num_kv_heads, head_dim, hidden_size, rms_eps, attn_scale,
              std::move(final_norm)) {}

  void add_layer(Linear qkv, c10::optional<at::Tensor> b_qkv, Linear o, c10::optional<at::Tensor> b_o,
                 Linear gate_up, Linear down, at::Tensor n_in, at::Tensor n_post) {
    stack.add_layer(std::move(qkv), std::move(b_qkv), std::move(o), std::move(b_o), std::move(gate_up),
                    std::move(down), std::move(n_in), std::move(n_post));
  }
  int64_t num_layers() const { return stack.num_layers(); }

  static at::Tensor product(const Linear& w, const at::Tensor& x, bool) { return w->forward(x.contiguous()); }

  at::Tensor forward(at::Tensor h_in, at::Tensor cos_t, at::Tensor sin_t, int64_t start, std::vector<at::Tensor> kc,
                     std::vector<at::Tensor> vc, Linear head, c10::optional<at::Tensor> rows,
                     c10::optional<at::Tensor> mask) {
    return stack.forward(h_in, cos_t, sin_t, start, kc, vc, head, rows, mask, product);
  }
  at::Tensor forward_many(at::Tensor h_in, at::Tensor cos_t, at::Tensor sin_t, std::vector<int64_t> starts,
                          std::vector<int64_t> lens, std::vector<at::Tensor> kc, std::vector<at::Tensor> vc,
                          Linear head, at::Tensor picked, std::vector<at::Tensor> masks) {
    return stack.forward_many(h_in, cos_t, sin_t, starts, lens, kc, vc, head, picked, masks, product);
  }
};

}  // namespace

GS_LIBRARY_FRAGMENT(m) {
  m.class_<BlockLinear>("BlockLinear")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       int64_t>())
      .def("forward", &BlockLinear::forward)
      .def("out_features", &BlockLinear::out_features)
      .def("in_features", &BlockLinear::in_features);
  m.class_<BlockModel>("BlockModel")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &BlockModel::add_layer)
      .def("num_layers", &BlockModel::num_layers)
      .def("forward", &BlockModel::forward)
      .def("forward_many", &BlockModel::forward_many);
}
