#pragma once
// GELU in its tanh approximation (StarCoder2's gelu_pytorch_tanh):
//   gelu(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))),  tanh(u) = 1 - 2 / (e^(2u) + 1).
#include <cstddef>

#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// x, out: n elements; out may alias x.
inline void gelu(const float* x, float* out, std::size_t n) noexcept { EFIM_KERNELS_DISPATCH(gelu(x, out, n)); }

}  // namespace efim::kernels
