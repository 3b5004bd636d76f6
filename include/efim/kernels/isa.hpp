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
#include <cstddef>
#include <cstdlib>
#include <string_view>

#include "efim/core/dtype.hpp"

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
#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif
#if EFIM_KERNELS_DISPATCHED && defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
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

// What the CPU and the operating system let a program use, read once from CPUID and XGETBV (the
// same with every compiler: __builtin_cpu_supports does not know every feature name in every
// compiler, "f16c" with Clang 14 for one). AVX features count only where the OS saves the YMM state,
// AVX-512 ones only where it saves the ZMM and mask state (XCR0), as a VM may advertise what it does
// not enable.
struct cpu_features {
  bool avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, avx512vnni = false;
  bool avxvnni = false;  // VPDPBUSD in its VEX form (AVX-VNNI: Alder Lake, Sapphire Rapids, Sierra Forest, Zen 5)
  // AMX-TILE and AMX-INT8 with the OS saving their state (XCR0 bits 17 and 18) and palette 1 as the
  // kernels configure it (8 tiles of 16 rows of 64 bytes); a process must still ask Linux for the
  // tile data's permission before its first tile instruction (amx_ready()).
  bool amx_int8 = false;
  bool amd = false;
};

#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
namespace detail {
inline void cpuid(unsigned leaf, unsigned sub, unsigned (&r)[4]) noexcept {
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}
inline unsigned long long xgetbv0() noexcept {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
}  // namespace detail
#endif

inline const cpu_features& cpu() noexcept {
  static const cpu_features f = [] {
    cpu_features c;
#if EFIM_KERNELS_DISPATCHED && (defined(__GNUC__) || defined(__clang__))
    unsigned r[4];
    detail::cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    c.amd = r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u;  // "AuthenticAMD"
    if (max_leaf < 1) return c;
    detail::cpuid(1, 0, r);
    const bool osxsave = (r[2] >> 27) & 1u, avx = (r[2] >> 28) & 1u;
    const unsigned long long xcr0 = osxsave ? detail::xgetbv0() : 0;
    const bool ymm = avx && (xcr0 & 0x6u) == 0x6u;      // SSE and AVX state
    const bool zmm = ymm && (xcr0 & 0xE0u) == 0xE0u;     // opmask, ZMM0-15 upper halves, ZMM16-31
    c.fma = ymm && ((r[2] >> 12) & 1u);
    c.f16c = ymm && ((r[2] >> 29) & 1u);
    if (max_leaf < 7) return c;
    detail::cpuid(7, 0, r);
    const unsigned max_sub7 = r[0];
    c.avx2 = ymm && ((r[1] >> 5) & 1u);
    c.bmi2 = (r[1] >> 8) & 1u;
    c.avx512f = zmm && ((r[1] >> 16) & 1u);
    c.avx512dq = zmm && ((r[1] >> 17) & 1u);
    c.avx512bw = zmm && ((r[1] >> 30) & 1u);
    c.avx512vl = zmm && ((r[1] >> 31) & 1u);
    c.avx512vnni = zmm && ((r[2] >> 11) & 1u);
    const bool amx = zmm && ((r[3] >> 24) & 1u) && ((r[3] >> 25) & 1u) && (xcr0 & 0x60000u) == 0x60000u;
    if (max_sub7 >= 1) {
      detail::cpuid(7, 1, r);
      c.avxvnni = ymm && ((r[0] >> 4) & 1u);
    }
    if (amx && max_leaf >= 0x1D) {
      detail::cpuid(0x1D, 0, r);
      if (r[0] >= 1) {
        detail::cpuid(0x1D, 1, r);  // palette 1: bytes per row, tile names, rows
        c.amx_int8 = (r[1] & 0xFFFFu) >= 64 && (r[1] >> 16) >= 8 && (r[2] & 0xFFFFu) >= 16;
      }
    }
#endif
    return c;
  }();
  return f;
}

// The best path this CPU runs.
inline isa detected_isa() noexcept {
#if EFIM_KERNELS_DISPATCHED
  const auto& c = cpu();
  const bool v3 = c.avx2 && c.fma && c.f16c && c.bmi2;
  // The AVX-512 path is compiled for F, BW, DQ and VL (every AVX-512 CPU since Skylake-SP has them).
  if (v3 && c.avx512f && c.avx512bw && c.avx512dq && c.avx512vl) return isa::avx512;
  if (v3) return isa::avx2;
#endif
  return isa::generic;
}

// Whether the CPU has AVX-512 VNNI (the integer products' fast tiles).
inline bool has_avx512_vnni() noexcept { return cpu().avx512vnni; }

// Whether this process may run AMX tile instructions: the CPU and the OS have them (cpu().amx_int8),
// Linux granted the tile data's permission (ARCH_REQ_XCOMP_PERM, asked once here: without it the first
// tile instruction kills the process with SIGILL, as where a VM advertises AMX it does not enable), and
// EFIM_AMX is not "off" or "0" in the environment. Read once.
inline bool amx_ready() noexcept {
  static const bool ready = [] {
    const char* env = std::getenv("EFIM_AMX");
    if (env != nullptr && (std::string_view(env) == "off" || std::string_view(env) == "0")) return false;
    if (!cpu().amx_int8) return false;
#if EFIM_KERNELS_DISPATCHED && defined(__linux__) && defined(__x86_64__)
    constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

// How the integer products of the types of 32-weight blocks (q8_0, q4_0, q5_0, q5_1) multiply bytes:
// VPMADDUBSW + VPMADDWD (AVX2), or VPDPBUSD on 256-bit registers in its EVEX encoding (AVX-512 VNNI
// with VL) or its VEX encoding (AVX-VNNI); amx: prefill (more than int8_stream_rows x rows, 24 for rows
// interleaved) on AMX tiles (TDPBSSD / TDPBSUD), decode as evex. All give the same integers, so the
// same bits. (The k-quants take amx as evex.)
enum class int8_dot : int { madd = 0, evex = 1, vex = 2, amx = 3 };

constexpr bool uses_vpdpbusd(int8_dot d) noexcept { return d != int8_dot::madd; }

constexpr std::string_view int8_dot_name(int8_dot d) noexcept {
  switch (d) {
    case int8_dot::evex:
      return "vnni";
    case int8_dot::vex:
      return "avx-vnni";
    case int8_dot::amx:
      return "amx";
    case int8_dot::madd:
      break;
  }
  return "madd";
}

// Whether this CPU runs form d.
inline bool runs(int8_dot d) noexcept {
  switch (d) {
    case int8_dot::evex:
      return cpu().avx512vnni && cpu().avx512vl;
    case int8_dot::vex:
      return cpu().avxvnni;
    case int8_dot::amx:
      return cpu().avx512vnni && cpu().avx512vl && amx_ready();
    case int8_dot::madd:
      break;
  }
  return true;
}

// Whether the CPU is AMD's (some decode tiles are chosen per vendor, by measurement).
inline bool amd_cpu() noexcept { return cpu().amd; }

// Which tiles the AVX-512 path reads a decode product's weight rows with where two kinds serve (one x
// row of f32, f16, bf16 or q8_0 with exact products: has_decode_tiles_choice): the AVX2 path's (four
// streams of rows, no software prefetch) or its own (8-row tiles, the next block prefetched). Same
// bits either way; which is faster depends on the CPU's memory system (Zen 4: the streams, 1.0-1.4x;
// Emerald Rapids: the tiles read twice what one stream without prefetch read; docs/benchmarks.md).
// `automatic` (the default) takes for each type the kind tune_decode_tiles chose on this machine: the
// vendor's kind unless the other was more than 3% faster (kernels/decode_tuning.hpp; the programs time
// both once per type when they load a model), and until then, or for a type not timed, the first on
// AMD CPUs and the second elsewhere. `streams` and `prefetched` take one kind on any CPU, so that one
// process can time both (EFIM_DECODE_TILES=streams|prefetched, read once, or select_decode_tiles).
enum class decode_tiles : int { automatic, streams, prefetched };

inline const char* decode_tiles_name(decode_tiles t) noexcept {
  switch (t) {
    case decode_tiles::streams:
      return "streams";
    case decode_tiles::prefetched:
      return "prefetched";
    case decode_tiles::automatic:
      break;
  }
  return "automatic";
}

// The types whose one-row decode takes either kind of decode tiles (those that unpack no nibbles).
constexpr bool has_decode_tiles_choice(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16 || t == dtype::q8_0;
}

namespace detail {
inline std::atomic<int>& decode_tiles_choice() noexcept {
  static std::atomic<int> choice{[] {
    const char* env = std::getenv("EFIM_DECODE_TILES");
    const std::string_view want = env == nullptr ? std::string_view{} : std::string_view(env);
    return static_cast<int>(want == "streams"      ? decode_tiles::streams
                            : want == "prefetched" ? decode_tiles::prefetched
                                                   : decode_tiles::automatic);
  }()};
  return choice;
}
// The kind chosen by timing for f32, f16, bf16 and q8_0 (decode_tiles::automatic where not timed).
inline std::atomic<int>& measured_kind(dtype t) noexcept {
  static std::atomic<int> kinds[4]{};
  return kinds[t == dtype::f32 ? 0 : t == dtype::f16 ? 1 : t == dtype::bf16 ? 2 : 3];
}
}  // namespace detail

// The choice now, and a new one (returned); not meant to change while kernels run.
inline decode_tiles active_decode_tiles() noexcept {
  return static_cast<decode_tiles>(detail::decode_tiles_choice().load(std::memory_order_relaxed));
}
inline decode_tiles select_decode_tiles(decode_tiles t) noexcept {
  detail::decode_tiles_choice().store(static_cast<int>(t), std::memory_order_relaxed);
  return t;
}

// The kind chosen by timing for type t on this machine (automatic: not timed, or not a type with the
// choice), and a new timing's choice (tune_decode_tiles records it; automatic forgets it).
inline decode_tiles measured_decode_tiles(dtype t) noexcept {
  if (!has_decode_tiles_choice(t)) return decode_tiles::automatic;
  return static_cast<decode_tiles>(detail::measured_kind(t).load(std::memory_order_relaxed));
}
inline void record_decode_tiles(dtype t, decode_tiles faster) noexcept {
  if (has_decode_tiles_choice(t)) detail::measured_kind(t).store(static_cast<int>(faster), std::memory_order_relaxed);
}

// The kind the CPU's vendor suggests (AMD: the streams, others: the prefetched tiles; above).
inline decode_tiles vendor_decode_tiles() noexcept {
  return amd_cpu() ? decode_tiles::streams : decode_tiles::prefetched;
}
// The kind a one-row decode of type t takes now (above): streams or prefetched.
inline decode_tiles decode_tiles_for(dtype t) noexcept {
  const decode_tiles chosen = active_decode_tiles();
  if (chosen != decode_tiles::automatic) return chosen;
  const decode_tiles measured = measured_decode_tiles(t);
  if (measured != decode_tiles::automatic) return measured;
  return vendor_decode_tiles();
}
// A timing of both kinds over a model's matrices of one type (kernels/decode_tuning.hpp).
struct decode_tiles_timing {
  dtype type = dtype::f32;
  std::size_t matrices = 0, bytes = 0;     // what one pass read
  double streams_s = 0, prefetched_s = 0;  // the best pass of each kind, seconds
  decode_tiles chosen = decode_tiles::streams;

  // How much faster the streams read than the prefetched tiles (below 1: slower; 0 if not timed).
  [[nodiscard]] double streams_over_prefetched() const { return streams_s > 0 ? prefetched_s / streams_s : 0; }
};

// Whether the AVX-512 path takes the AVX2 path's streams for type t where both kinds serve (above).
inline bool decode_streams(dtype t) noexcept { return decode_tiles_for(t) == decode_tiles::streams; }

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

// The form of the integer products on path p: the best that path can take on this CPU (the AVX-512
// path AMX where amx_ready(), else EVEX; the AVX2 path VEX where the CPU has AVX-VNNI, else EVEX on
// 256-bit registers where it has AVX-512 VNNI, as under EFIM_ISA=avx2 on such a CPU), or VPMADDUBSW
// where EFIM_VNNI=off (read once: the code an AVX2-only CPU runs, on any CPU).
inline int8_dot int8_dot_for(isa p) noexcept {
  static const bool off = [] {
    const char* env = std::getenv("EFIM_VNNI");
    return env != nullptr && (std::string_view(env) == "off" || std::string_view(env) == "0");
  }();
  if (off || p == isa::generic) return int8_dot::madd;
  if (p == isa::avx2 && runs(int8_dot::vex)) return int8_dot::vex;
  if (p == isa::avx512 && runs(int8_dot::amx)) return int8_dot::amx;
  return runs(int8_dot::evex) ? int8_dot::evex : int8_dot::madd;
}

}  // namespace efim::kernels
