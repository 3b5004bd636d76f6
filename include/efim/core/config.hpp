#pragma once
// Compiler glue shared by host and device code.
#include <bit>
#include <cstring>

#if defined(__CUDACC__)
#define EFIM_HOST_DEVICE __host__ __device__ inline
#else
#define EFIM_HOST_DEVICE inline
#endif

// EFIM_SEPARATE_ROUNDING before a function and EFIM_SEPARATE_ROUNDING_BODY first in its body: every
// product and sum in it is rounded on its own, never fused into a multiply-add whatever -ffp-contract
// and the target say. The reference quantizers use it, whose bytes must equal those of tools built
// without FMA instructions.
#if defined(__clang__)
#define EFIM_SEPARATE_ROUNDING inline
#define EFIM_SEPARATE_ROUNDING_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define EFIM_SEPARATE_ROUNDING __attribute__((optimize("fp-contract=off"))) inline
#define EFIM_SEPARATE_ROUNDING_BODY
#else
#define EFIM_SEPARATE_ROUNDING inline
#define EFIM_SEPARATE_ROUNDING_BODY
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
