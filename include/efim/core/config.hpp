#pragma once
// Compiler glue shared by host and device code.
#include <bit>
#include <cstring>

#if defined(__CUDACC__)
#define EFIM_HOST_DEVICE __host__ __device__ inline
#else
#define EFIM_HOST_DEVICE inline
#endif

namespace efim {
// std::bit_cast where host and device code share a function: nvcc's device pass has no constexpr
// std::bit_cast, and memcpy of a register is what it compiles to anyway.
template <class To, class From>
EFIM_HOST_DEVICE To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
#if defined(__CUDA_ARCH__)
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
#else
  return std::bit_cast<To>(from);
#endif
}

// For static_assert in the primary template of a policy-dispatched function.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace efim
