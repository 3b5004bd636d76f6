#pragma once
// LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, row by row.
#include <cmath>
#include <cstddef>

#include "efim/kernels/simd.hpp"

namespace efim::kernels {

// x, y: (rows, n); weight, bias: (n). y may alias x.
inline void layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows, std::size_t n,
                      float eps) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float sum = 0.0f;
    for (std::size_t i = 0; i < n; ++i) sum += xr[i];
    const float mean = sum / static_cast<float>(n);
    float squares = 0.0f;
    for (std::size_t i = 0; i < n; ++i) squares = detail::fma(xr[i] - mean, xr[i] - mean, squares);
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (std::size_t i = 0; i < n; ++i) yr[i] = detail::fma((xr[i] - mean) * scale, weight[i], bias[i]);
  }
}

}  // namespace efim::kernels
