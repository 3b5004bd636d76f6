#pragma once
// The host kernels' instruction-set paths, compiled in this file for a program built with
// EFIM_KERNELS_SEPARATE (targets.hpp): include it in exactly one of the program's source files, before
// any other efim header, with the same compiler flags as the rest of the program. The other files then
// compile declarations of the paths' entry points only, a small part of their compile time:
//
//   // kernels.cpp, the whole file; every file of the program compiled with -DEFIM_KERNELS_SEPARATE
//   #include <efim/kernels/compiled.hpp>
//
// Results are the same bits as in the default build (every file compiling every path inline): the same
// bodies, compiled with the same flags.
#if defined(EFIM_KERNELS_TARGETS_INCLUDED) && !defined(EFIM_KERNELS_IMPLEMENTATION)
#error "efim/kernels/compiled.hpp must come before any other efim header in its file"
#endif
#define EFIM_KERNELS_IMPLEMENTATION 1

#include <cstddef>
#include <span>
#include <utility>

#include "efim/core/float16.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/targets.hpp"
#include "efim/kv/layout.hpp"

// The attention entry point for both element types the KV cache holds, on every path compiled.
#define EFIM_K_INSTANTIATE_ATTENTION(path, E)                                                     \
  template void efim::kernels::detail::path::attend_rows_n(                                      \
      std::size_t, std::make_index_sequence<efim::kernels::detail::max_rows>,                    \
      const efim::kv::paged_layout&, const E*, const E*, std::span<const efim::block_id>,         \
      std::size_t, const efim::kernels::detail::attention_row*, float, float*, std::size_t) noexcept;
EFIM_K_INSTANTIATE_ATTENTION(isa_generic, float)
EFIM_K_INSTANTIATE_ATTENTION(isa_generic, efim::half)
#if EFIM_KERNELS_DISPATCHED
EFIM_K_INSTANTIATE_ATTENTION(isa_avx2, float)
EFIM_K_INSTANTIATE_ATTENTION(isa_avx2, efim::half)
EFIM_K_INSTANTIATE_ATTENTION(isa_avx512, float)
EFIM_K_INSTANTIATE_ATTENTION(isa_avx512, efim::half)
#endif
#undef EFIM_K_INSTANTIATE_ATTENTION
