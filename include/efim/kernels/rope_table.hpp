#pragma once
// Rotary position embedding's angle table, computed on the host for every backend.
#include <cmath>
#include <cstddef>
#include <span>

#include "efim/core/types.hpp"

namespace efim::kernels {

// The angle table for some positions: (token, pair) cosines and sines, computed in double. Pair i of
// position p turns by (p / scale) * theta^(-2i / head_dim); scale > 1 is linear RoPE scaling.
inline void rope_table(std::span<const position> positions, std::size_t head_dim, double theta, float* cos_out,
                       float* sin_out, double scale = 1.0) {
  const std::size_t pairs = head_dim / 2;
  for (std::size_t t = 0; t < positions.size(); ++t)
    for (std::size_t i = 0; i < pairs; ++i) {
      const double freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      const double angle = static_cast<double>(positions[t]) / scale * freq;
      cos_out[t * pairs + i] = static_cast<float>(std::cos(angle));
      sin_out[t * pairs + i] = static_cast<float>(std::sin(angle));
    }
}

}  // namespace efim::kernels
