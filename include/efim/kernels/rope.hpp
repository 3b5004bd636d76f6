#pragma once
// Rotary position embedding.
#include <cstddef>

#include "efim/core/types.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/rope_table.hpp"
#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// Rotates x (tokens, heads, head_dim) in place with the table from rope_table.
inline void rope(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
                 const float* sin_t, rope_style style) noexcept {
  EFIM_KERNELS_DISPATCH(rope(x, tokens, heads, head_dim, cos_t, sin_t, style));
}

}  // namespace efim::kernels
