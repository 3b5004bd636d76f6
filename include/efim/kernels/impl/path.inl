// Included by targets.hpp once per instruction-set path: the kernel bodies in namespace
// efim::kernels::detail::EFIM_K_NAMESPACE, compiled with what EFIM_K_AVX512, EFIM_K_AVX2, EFIM_K_FMA
// and EFIM_K_F16C allow; those macros are undefined afterwards.
namespace efim::kernels::detail::EFIM_K_NAMESPACE {
// The bodies in this order: each uses what the ones before it define.
// clang-format off
#include "efim/kernels/impl/simd.inl"
#include "efim/kernels/impl/matmul.inl"
#include "efim/kernels/impl/matmul_q8.inl"
#include "efim/kernels/impl/matmul_q8_32.inl"
#include "efim/kernels/impl/matmul_amx.inl"
#include "efim/kernels/impl/attention.inl"
#include "efim/kernels/impl/ops.inl"
// clang-format on
}  // namespace efim::kernels::detail::EFIM_K_NAMESPACE
#undef EFIM_K_NAMESPACE
#undef EFIM_K_AVX512
#undef EFIM_K_AVX2
#undef EFIM_K_FMA
#undef EFIM_K_F16C
