#pragma once
// RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, row by row.
#include <cmath>
#include <cstddef>

#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// x, y: (rows, n); weight: (n). y may alias x.
inline void rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n,
                    float eps) noexcept {
  EFIM_KERNELS_DISPATCH(rmsnorm(x, weight, y, rows, n, eps));
}

}  // namespace efim::kernels
