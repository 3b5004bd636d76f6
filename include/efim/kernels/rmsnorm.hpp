#pragma once
// RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, row by row.
#include <cmath>
#include <cstddef>

#include "efim/kernels/simd.hpp"

namespace efim::kernels {

// x, y: (rows, n); weight: (n). y may alias x.
inline void rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n,
                    float eps) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    const float mean_square = detail::dot(xr, xr, n) / static_cast<float>(n);
    const float scale = 1.0f / std::sqrt(mean_square + eps);
    for (std::size_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * weight[i];
  }
}

}  // namespace efim::kernels
