// Small maths shared by graphspec's C++ files (kernels/attention_cpu.cpp, models/int8_native.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace graphspec_native {

// exp(x), vectorizable inside `omp simd` loops (std::exp is not, without -ffast-math, which graphspec avoids:
// linking it would set flush-to-zero for the whole process, the target included): 2^n * p(r) with
// r = x - n ln2 in [-ln2/2, ln2/2] and p the degree-6 Taylor polynomial (relative error < 3e-7). x is clamped
// to [-87, 88], where fp32 exp stays normal: softmax weights and sigmoids that far out are 0 or 1 either way.
#pragma omp declare simd
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace graphspec_native
