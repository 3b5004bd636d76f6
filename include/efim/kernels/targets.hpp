#pragma once
// The host kernels' bodies (impl/*.inl), compiled once per instruction-set path into its own
// namespace (impl/path.inl), and the dispatch that calls the active path (isa.hpp):
//   detail::isa_generic  the compiler's flags (portable vector code; AVX-512 or AVX2 code where the
//                        flags already allow it, NEON on AArch64)
//   detail::isa_avx2     AVX2 + FMA + F16C (x86-64-v3), whatever the flags
//   detail::isa_avx512   AVX-512 (F, BW, DQ, VL) with the same, whatever the flags
// On x86 the last two are compiled under `#pragma GCC target` (GCC) or `#pragma clang attribute`
// (Clang), so a program built for baseline x86-64 runs the fast paths on the CPUs that have them.
//
// In the bodies, EFIM_K_AVX512, EFIM_K_AVX2, EFIM_K_FMA and EFIM_K_F16C say what the path being
// compiled may use; the compiler's own macros (__AVX2__, ...) must not be read there.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/interleave.hpp"
#include "efim/kernels/isa.hpp"
#include "efim/kv/layout.hpp"

#if EFIM_KERNELS_X86
#include <immintrin.h>
#endif

// ---- generic: what the compiler flags allow ----
#if EFIM_KERNELS_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
#define EFIM_K_AVX512 1
#else
#define EFIM_K_AVX512 0
#endif
#if EFIM_KERNELS_X86 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EFIM_K_AVX2 1
#else
#define EFIM_K_AVX2 0
#endif
#if defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA)
#define EFIM_K_FMA 1
#else
#define EFIM_K_FMA 0
#endif
#if EFIM_KERNELS_X86 && defined(__F16C__)
#define EFIM_K_F16C 1
#else
#define EFIM_K_F16C 0
#endif
// EFIM_KERNELS_SEPARATE, defined for a whole program, compiles the paths once, in the one source file
// that includes efim/kernels/compiled.hpp (first, before any other efim header): every other file
// declares the entry points the public kernels dispatch to (impl/entry.inl) and compiles none of
// their bodies, which are most of the library's compile time. Without it (the default), every file
// that includes a kernel compiles every path, inline.
#define EFIM_KERNELS_TARGETS_INCLUDED 1
#if defined(EFIM_KERNELS_SEPARATE) && !defined(EFIM_KERNELS_IMPLEMENTATION)
#undef EFIM_K_AVX512
#undef EFIM_K_AVX2
#undef EFIM_K_FMA
#undef EFIM_K_F16C
#define EFIM_K_NAMESPACE isa_generic
#include "efim/kernels/impl/entry.inl"
#if EFIM_KERNELS_DISPATCHED
#define EFIM_K_NAMESPACE isa_avx2
#include "efim/kernels/impl/entry.inl"
#define EFIM_K_NAMESPACE isa_avx512
#include "efim/kernels/impl/entry.inl"
#endif
#else
// The entry points are inline functions where every file compiles the paths, external ones in
// compiled.hpp's file.
#if defined(EFIM_KERNELS_IMPLEMENTATION)
#define EFIM_K_ENTRY
#else
#define EFIM_K_ENTRY inline
#endif
#if EFIM_KERNELS_X86
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its -W(maybe-)uninitialized
// reports once they are inlined (GCC bug 105593, fixed in 13): in the AVX-512 path, and in the
// generic one where the flags have AVX-512 (-march=native on such a CPU).
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#define EFIM_K_NAMESPACE isa_generic
#include "efim/kernels/impl/path.inl"

#if EFIM_KERNELS_DISPATCHED
// ---- AVX2 + FMA + F16C ----
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define EFIM_K_AVX512 0
#define EFIM_K_AVX2 1
#define EFIM_K_FMA 1
#define EFIM_K_F16C 1
#define EFIM_K_NAMESPACE isa_avx2
#include "efim/kernels/impl/path.inl"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
// The AVX-512 path below borrows some of these kernels (the generic path, compiled before, cannot).
#define EFIM_K_AVX2_PATH_DEFINED 1

// ---- AVX-512 ----
#if defined(__clang__)
#pragma clang attribute push(                                                                          \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define EFIM_K_AVX512 1
#define EFIM_K_AVX2 0
#define EFIM_K_FMA 1
#define EFIM_K_F16C 1
// A function of this path that also uses AVX-512 VNNI (chosen at run time, has_avx512_vnni()) names
// the whole path's features with it, so that both compilers inline the path's helpers into it (Clang
// refuses where the caller's target is not a superset of the callee's).
#define EFIM_K_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")))
#define EFIM_K_NAMESPACE isa_avx512
#include "efim/kernels/impl/path.inl"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#undef EFIM_K_AVX2_PATH_DEFINED
#undef EFIM_K_TARGET_VNNI
#endif  // EFIM_KERNELS_DISPATCHED

#if EFIM_KERNELS_X86
#pragma GCC diagnostic pop
#endif
#endif  // the paths compiled here

#if EFIM_KERNELS_DISPATCHED
// Calls detail::<path>::call on the active path (a statement; the call's result is dropped).
#define EFIM_KERNELS_DISPATCH(call)                 \
  do {                                              \
    switch (::efim::kernels::active_isa()) {        \
      case ::efim::kernels::isa::avx512:            \
        ::efim::kernels::detail::isa_avx512::call;  \
        break;                                      \
      case ::efim::kernels::isa::avx2:              \
        ::efim::kernels::detail::isa_avx2::call;    \
        break;                                      \
      case ::efim::kernels::isa::generic:           \
        ::efim::kernels::detail::isa_generic::call; \
        break;                                      \
    }                                               \
  } while (false)
// The same, for a call with a result, assigned to `out`.
#define EFIM_KERNELS_DISPATCH_TO(out, call)               \
  do {                                                    \
    switch (::efim::kernels::active_isa()) {              \
      case ::efim::kernels::isa::avx512:                  \
        out = ::efim::kernels::detail::isa_avx512::call;  \
        break;                                            \
      case ::efim::kernels::isa::avx2:                    \
        out = ::efim::kernels::detail::isa_avx2::call;    \
        break;                                            \
      case ::efim::kernels::isa::generic:                 \
        out = ::efim::kernels::detail::isa_generic::call; \
        break;                                            \
    }                                                     \
  } while (false)
#else
#define EFIM_KERNELS_DISPATCH(call) ::efim::kernels::detail::isa_generic::call
#define EFIM_KERNELS_DISPATCH_TO(out, call) out = ::efim::kernels::detail::isa_generic::call
#endif
