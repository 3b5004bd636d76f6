#pragma once
// Which instruction set the host kernels run on, chosen at run time.
//
// The library is header-only, so it is compiled with its user's flags, which for a distribution or a
// runtime are a baseline (x86-64, x86-64-v2), never -march=native. Every host kernel is therefore
// compiled three times into its own namespace (see targets.hpp): for AVX-512, for AVX2 + FMA + F16C
// (x86-64-v3) and for whatever the compiler flags allow (generic: portable vector code). Each call picks
// the best path the CPU has, once per process; EFIM_ISA=avx512|avx2|generic in the environment, or
// select_isa(), asks for a lower one (never a higher one than the CPU runs).
//
// Bits: the AVX-512 and AVX2 paths give the same bits (both fuse every multiply-add and sum in the
// canonical 16-lane order); the generic path gives those bits too where the compiler flags have FMA
// instructions (or the target always has them), and bits of its own otherwise (products and sums
// rounded separately). Within one path results never depend on batch, chunking, block placement or
// thread count.
#include <atomic>
#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define EFIM_KERNELS_X86 1
#else
#define EFIM_KERNELS_X86 0
#endif
// EFIM_KERNELS_GENERIC_ONLY, defined for a whole program, compiles the generic path alone (about a
// third of the kernels' compile time): for a program built for its CPU (-march=native), which needs no
// other path, and for test builds whose point is elsewhere (the sanitizer builds of the servers).
#if EFIM_KERNELS_X86 && !defined(EFIM_KERNELS_GENERIC_ONLY)
#define EFIM_KERNELS_DISPATCHED 1
#else
#define EFIM_KERNELS_DISPATCHED 0
#endif

namespace efim::kernels {

enum class isa : int { generic = 0, avx2 = 2, avx512 = 3 };

constexpr std::string_view isa_name(isa i) noexcept {
  switch (i) {
    case isa::avx512:
      return "avx512";
    case isa::avx2:
      return "avx2";
    case isa::generic:
      break;
  }
  return "generic";
}

// The best path this CPU runs.
inline isa detected_isa() noexcept {
#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("bmi2");
  // The AVX-512 path is compiled for F, BW, DQ and VL (every AVX-512 CPU since Skylake-SP has them).
  if (v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return isa::avx512;
  if (v3) return isa::avx2;
#endif
  return isa::generic;
}

// Whether the CPU has AVX-512 VNNI (the integer products' fast tiles); once per process.
inline bool has_avx512_vnni() noexcept {
#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return vnni;
#else
  return false;
#endif
}

// Whether the CPU is AMD's (some decode tiles are chosen per vendor, by measurement); once per process.
inline bool amd_cpu() noexcept {
#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

namespace detail {

constexpr isa lower(isa a, isa b) noexcept { return static_cast<int>(a) < static_cast<int>(b) ? a : b; }

// What EFIM_ISA asks for, or the detected path; never above the detected one.
inline isa initial_isa() noexcept {
  const isa best = detected_isa();
  const char* env = std::getenv("EFIM_ISA");
  if (env == nullptr) return best;
  const std::string_view want = env;
  isa asked = best;
  if (want == "generic")
    asked = isa::generic;
  else if (want == "avx2")
    asked = isa::avx2;
  else if (want == "avx512")
    asked = isa::avx512;
  return lower(asked, best);
}

inline std::atomic<int>& isa_choice() noexcept {
  static std::atomic<int> choice{static_cast<int>(initial_isa())};
  return choice;
}

}  // namespace detail

// The path the kernels take now.
inline isa active_isa() noexcept { return static_cast<isa>(detail::isa_choice().load(std::memory_order_relaxed)); }

// Asks for path `want` (lowered to what the CPU runs) and returns the one taken; for tests and
// benchmarks that compare paths in one process. Not meant to change while kernels run.
inline isa select_isa(isa want) noexcept {
  const isa taken = detail::lower(want, detected_isa());
  detail::isa_choice().store(static_cast<int>(taken), std::memory_order_relaxed);
  return taken;
}

}  // namespace efim::kernels
