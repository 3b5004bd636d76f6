#pragma once
// SwiGLU: h = silu(gate) * up = gate / (1 + e^-gate) * up, elementwise, 16 at a time with exp16.
#include <cstddef>
#include <cstring>

#include "efim/kernels/simd.hpp"

namespace efim::kernels {

// gate, up, out: n elements; out may alias gate.
inline void swiglu(const float* gate, const float* up, float* out, std::size_t n) noexcept {
  using detail::lanes;
  float e[lanes];
  for (std::size_t i = 0; i < n; i += lanes) {
    const std::size_t m = n - i < lanes ? n - i : lanes;
    for (std::size_t j = 0; j < lanes; ++j) e[j] = j < m ? -gate[i + j] : 0.0f;
    detail::exp16(e);
    // Below -88, e^-gate is past what exp16 reaches, and silu(gate) is 0 to within 1e-36.
    for (std::size_t j = 0; j < m; ++j)
      out[i + j] = gate[i + j] < -88.0f ? 0.0f : gate[i + j] / (1.0f + e[j]) * up[i + j];
  }
}

}  // namespace efim::kernels
