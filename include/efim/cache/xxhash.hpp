#pragma once
// xxHash, used header-only: its functions are inlined into the including translation unit, so
// efim needs only the header of Debian's libxxhash-dev and nothing to link.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define EFIM_DEFINED_XXH_INLINE_ALL
#endif
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own AVX-512 intrinsics as maybe-uninitialized when inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <xxhash.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#ifdef EFIM_DEFINED_XXH_INLINE_ALL
#undef XXH_INLINE_ALL
#undef EFIM_DEFINED_XXH_INLINE_ALL
#endif
