#pragma once
// SwiGLU: h = silu(gate) * up = gate / (1 + e^-gate) * up, elementwise, 16 at a time with exp16.
#include <cstddef>
#include <cstring>

#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// gate, up, out: n elements; out may alias gate.
inline void swiglu(const float* gate, const float* up, float* out, std::size_t n) noexcept {
  EFIM_KERNELS_DISPATCH(swiglu(gate, up, out, n));
}

}  // namespace efim::kernels
