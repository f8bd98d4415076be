// silu(gate) * up on the CPU: graphspec.kernels.silu_mul's kernel for bf16 at amx, avx512 and avx2 (built at every
// C++ level; the generic level's scalar loop is slower than torch's, so it is not dispatched there).
//
// Why: the MLP's activation between its two GEMMs. Its torch path (fp32 silu, a multiply, a cast back) writes
// three fresh temporaries the size of the gate, and in a prefill of 1024 tokens took about a quarter of the
// forward (perf/RESULTS.md); here each row is read once and written once, in the input dtype.
//
// Maths, per element, in fp32: e = exp(-|g|) (graphspec_native::fast_exp, relative error < 3e-7; no overflow
// for any g), sigmoid = 1 / (1 + e) for g >= 0 and e / (1 + e) below, out = (g * sigmoid) * u, rounded to the
// input dtype to nearest even. Elementwise: a row's bits do not depend on the other rows or the thread count.

// Floating-point compares may be turned into blends here (the exception flags they could raise are never read):
// without this GCC keeps fast_exp's clamp and the sigmoid's branch as branches and the loop stays scalar. The
// values computed are the same IEEE results; only the exception flags, which nothing reads, may differ.
#pragma GCC optimize("no-trapping-math")

#include <torch/script.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "level.h"
#include "native_math.h"

namespace {

// bf16 <-> fp32 on the bits, so the loop vectorizes: widening is exact (a bf16 is an fp32's top half), narrowing
// rounds to nearest even as c10::BFloat16 does (NaN stays a NaN).
inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
inline float narrow(float x, float) { return x; }
inline uint16_t narrow(float x, uint16_t) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// One row of n (T: float, or uint16_t for bf16's bits); one loop the compiler vectorizes (fast_exp is
// `omp declare simd`).
template <typename T>
void row(const T* __restrict g, const T* __restrict u, T* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = widen(g[j]);
    const float e = graphspec_native::fast_exp(-std::fabs(x));
    const float s = (x >= 0.f ? 1.f : e) / (1.f + e);
    out[j] = narrow(x * s * widen(u[j]), T());
  }
}

template <typename T>
void run(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t m = gate.size(0), n = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  const T* g = static_cast<const T*>(gate.data_ptr());
  const T* u = static_cast<const T*>(up.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  // Rows per task: about 64K elements, so a decode step's one row runs inline and a prefill spreads.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1));
  at::parallel_for(0, m, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row<T>(g + r * gs, u + r * us, o + r * n, n);
  });
}

// gate, up: [M, N] CPU tensors of one dtype (bf16 or fp32), unit stride along N (any row stride: the halves of
// the fused gate/up product). Returns [M, N] contiguous in that dtype.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes(), "silu_mul_cpu: gate and up must be [M, N] alike");
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu(), "silu_mul_cpu: CPU tensors only");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "silu_mul_cpu: gate and up must share one dtype");
  TORCH_CHECK((gate.size(1) <= 1 || gate.stride(1) == 1) && (up.size(1) <= 1 || up.stride(1) == 1),
              "silu_mul_cpu: the last dim must be contiguous");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) return out;
  if (gate.scalar_type() == at::kBFloat16) {
    run<uint16_t>(gate, up, out);
  } else {
    TORCH_CHECK(gate.scalar_type() == at::kFloat, "silu_mul_cpu: bf16 or fp32 only, got ", gate.scalar_type());
    run<float>(gate, up, out);
  }
  return out;
}

}  // namespace

GS_LIBRARY_FRAGMENT(m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &silu_mul);
}
