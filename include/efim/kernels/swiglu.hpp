#pragma once
// SwiGLU: h = silu(gate) * up, elementwise.
#include <cmath>
#include <cstddef>

namespace efim::kernels {

// gate, up, out: n elements; out may alias gate.
inline void swiglu(const float* gate, const float* up, float* out, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace efim::kernels
