#pragma once
// LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, row by row.
#include <cmath>
#include <cstddef>

#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// x, y: (rows, n); weight, bias: (n). y may alias x.
inline void layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows, std::size_t n,
                      float eps) noexcept {
  EFIM_KERNELS_DISPATCH(layernorm(x, weight, bias, y, rows, n, eps));
}

}  // namespace efim::kernels
