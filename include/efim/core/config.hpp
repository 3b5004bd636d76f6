#pragma once
// Compiler glue shared by host and device code.

#if defined(__CUDACC__)
#define EFIM_HOST_DEVICE __host__ __device__ inline
#else
#define EFIM_HOST_DEVICE inline
#endif

namespace efim {
// For static_assert in the primary template of a policy-dispatched function.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace efim
