#pragma once
// The canonical dot product and exponential on the active instruction-set path (the bodies are in
// impl/simd.inl, one copy per path): what tests and benchmarks compare the kernels with.
#include <cstddef>

#include "efim/kernels/targets.hpp"

namespace efim::kernels::detail {

// sum over k of x[k] * w[k] in the canonical order: lane l sums the products at k = l, l + 16, ... in
// turn, the tail past the last full vector in order, and reduce_lanes joins them.
inline float dot(const float* x, const float* w, std::size_t n) noexcept {
  float out = 0.0f;
  EFIM_KERNELS_DISPATCH_TO(out, dot(x, w, n));
  return out;
}

// e^x for 16 floats in place (see impl/simd.inl).
inline void exp16(float* x) noexcept { EFIM_KERNELS_DISPATCH(exp16(x)); }

}  // namespace efim::kernels::detail
