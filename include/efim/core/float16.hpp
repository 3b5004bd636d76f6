#pragma once
// IEEE half and bfloat16 conversions, rounded to nearest even (what F16C and ggml do), for host and
// device code.
#include <cstdint>

#include "efim/core/config.hpp"

namespace efim {

// IEEE half and bfloat16, rounded to nearest even (what F16C and ggml do).
EFIM_HOST_DEVICE float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  const std::uint32_t bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  return efim::bit_cast<float>(bits);
}

EFIM_HOST_DEVICE std::uint16_t f32_to_f16(float f) noexcept {
  const std::uint32_t x = efim::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // 65520 and up round to infinity
  if (ax < 0x38800000u) {
    // Below 2^-14: a multiple of 2^-24. Adding 0.5 puts 2^-24 at the f32 ulp, so the hardware rounds it.
    const float r = efim::bit_cast<float>(ax) + 0.5f;
    return static_cast<std::uint16_t>(sign | (efim::bit_cast<std::uint32_t>(r) - 0x3f000000u));
  }
  const std::uint32_t rounded = ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

EFIM_HOST_DEVICE float bf16_to_f32(std::uint16_t h) noexcept {
  return efim::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

EFIM_HOST_DEVICE std::uint16_t f32_to_bf16(float f) noexcept {
  const std::uint32_t x = efim::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 64u);  // NaN, quiet
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// An f16 value as stored (KV caches in f16 hold these).
struct half {
  std::uint16_t bits;
};

}  // namespace efim
