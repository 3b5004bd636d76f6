#pragma once
// GELU in its tanh approximation (StarCoder2's gelu_pytorch_tanh):
//   gelu(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))),  tanh(u) = 1 - 2 / (e^(2u) + 1).
#include <cstddef>

#include "efim/kernels/simd.hpp"

namespace efim::kernels {

// x, out: n elements; out may alias x.
inline void gelu(const float* x, float* out, std::size_t n) noexcept {
  using detail::lanes;
  constexpr float sqrt_2_over_pi = 0.7978845608028654f, cubic = 0.044715f;
  float e[lanes];
  for (std::size_t i = 0; i < n; i += lanes) {
    const std::size_t m = n - i < lanes ? n - i : lanes;
    for (std::size_t j = 0; j < lanes; ++j) {
      const float v = j < m ? x[i + j] : 0.0f;
      e[j] = 2.0f * sqrt_2_over_pi * detail::fma(cubic * v, v * v, v);
    }
    detail::exp16(e);
    for (std::size_t j = 0; j < m; ++j) {
      const float tanh_u = 1.0f - 2.0f / (e[j] + 1.0f);
      out[i + j] = 0.5f * x[i + j] * (1.0f + tanh_u);
    }
  }
}

}  // namespace efim::kernels
