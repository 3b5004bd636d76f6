#pragma once
// Element types of weight and KV tensors: f32, f16, bf16 and the block-quantized q8_0 and q4_0, with
// the byte layouts GGUF files use (ggml type ids), conversions, and plain reference quantizers.
//
// Dequantization is exact in f32 for every type here (an int8 or int4 times an f16 scale needs at most
// 19 significant bits), so a kernel that dequantizes on the fly computes the same products as one that
// reads dequantized f32 weights.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "efim/core/config.hpp"
#include "efim/core/error.hpp"

namespace efim {

// Values are ggml's type ids, as stored in GGUF tensor directories.
enum class dtype : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q8_0 = 8,
  bf16 = 30,
};

inline constexpr dtype all_dtypes[] = {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0};

struct dtype_info {
  std::string_view name;
  std::size_t block = 1;  // elements per block
  std::size_t bytes = 4;  // bytes per block
};

constexpr dtype_info info(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return {"f32", 1, 4};
    case dtype::f16:
      return {"f16", 1, 2};
    case dtype::bf16:
      return {"bf16", 1, 2};
    case dtype::q8_0:
      return {"q8_0", 32, 34};
    case dtype::q4_0:
      return {"q4_0", 32, 18};
  }
  return {"?", 0, 0};
}

constexpr std::string_view to_string(dtype t) noexcept { return info(t).name; }

// The dtype of a ggml type id, if it is one of the supported ones.
constexpr std::optional<dtype> dtype_of_ggml(std::uint32_t ggml_type) noexcept {
  for (const dtype t : all_dtypes)
    if (static_cast<std::uint32_t>(t) == ggml_type) return t;
  return std::nullopt;
}

inline dtype parse_dtype(std::string_view name) {
  for (const dtype t : all_dtypes)
    if (info(t).name == name) return t;
  throw error(errc::invalid_argument, "unknown tensor type '" + std::string(name) + "' (f32, f16, bf16, q8_0, q4_0)");
}

// Bytes of a row of n elements; n must be a whole number of blocks.
inline std::size_t row_bytes(dtype t, std::size_t n) {
  const auto i = info(t);
  if (i.block == 0)  // (messages only on failure: this runs per matrix product)
    throw error(errc::invalid_argument, "not a tensor type: " + std::to_string(static_cast<std::uint32_t>(t)));
  if (n % i.block != 0)
    throw error(errc::invalid_argument, "a row of " + std::to_string(n) + " elements is not a whole number of " +
                                            std::string(i.name) + " blocks of " + std::to_string(i.block));
  return n / i.block * i.bytes;
}

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

// Block layouts (ggml's): a scale in f16, then the quants.
struct block_q8_0 {
  std::uint16_t d;
  std::int8_t qs[32];  // element j = qs[j] * d
};
struct block_q4_0 {
  std::uint16_t d;
  std::uint8_t qs[16];  // element j = ((qs[j] & 15) - 8) * d, element j + 16 = ((qs[j] >> 4) - 8) * d
};
static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q4_0) == 18);

// Plain conversions of one row (n elements, a whole number of blocks), the reference for the kernels.
inline void dequantize_row(dtype t, const std::byte* src, float* dst, std::size_t n) {
  (void)row_bytes(t, n);
  switch (t) {
    case dtype::f32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case dtype::f16:
    case dtype::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = t == dtype::f16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      return;
    case dtype::q8_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        block_q8_0 blk;
        std::memcpy(&blk, src + b * sizeof blk, sizeof blk);
        const float d = f16_to_f32(blk.d);
        for (std::size_t j = 0; j < 32; ++j) dst[b * 32 + j] = static_cast<float>(blk.qs[j]) * d;
      }
      return;
    case dtype::q4_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        block_q4_0 blk;
        std::memcpy(&blk, src + b * sizeof blk, sizeof blk);
        const float d = f16_to_f32(blk.d);
        for (std::size_t j = 0; j < 16; ++j) {
          dst[b * 32 + j] = static_cast<float>((blk.qs[j] & 15) - 8) * d;
          dst[b * 32 + j + 16] = static_cast<float>((blk.qs[j] >> 4) - 8) * d;
        }
      }
      return;
  }
}

// The reference quantizers GGUF tools use (so a file written here has the bytes theirs would have):
// q8_0 scales each block by max|x| / 127 and rounds half away from zero; q4_0 scales by the element of
// largest magnitude / -8 and truncates x / d + 8.5, at most 15.
inline void quantize_row(dtype t, const float* src, std::byte* dst, std::size_t n) {
  (void)row_bytes(t, n);
  switch (t) {
    case dtype::f32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case dtype::f16:
    case dtype::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = t == dtype::f16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case dtype::q8_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        const float* x = src + b * 32;
        float amax = 0.0f;
        for (std::size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        block_q8_0 blk;
        blk.d = f32_to_f16(d);
        for (std::size_t j = 0; j < 32; ++j) blk.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
        std::memcpy(dst + b * sizeof blk, &blk, sizeof blk);
      }
      return;
    case dtype::q4_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        const float* x = src + b * 32;
        float amax = 0.0f, max = 0.0f;
        for (std::size_t j = 0; j < 32; ++j)
          if (amax < std::fabs(x[j])) {
            amax = std::fabs(x[j]);
            max = x[j];
          }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        block_q4_0 blk;
        blk.d = f32_to_f16(d);
        const auto level = [&](float v) {
          // Rounded product, then rounded sum, as the format defines it: a fused multiply-add could give
          // another level, so the product is kept from being contracted into one.
          volatile float scaled = v * id;
          return static_cast<std::uint8_t>(std::min(15, static_cast<int>(static_cast<std::int8_t>(scaled + 8.5f))));
        };
        for (std::size_t j = 0; j < 16; ++j)
          blk.qs[j] = static_cast<std::uint8_t>(level(x[j]) | (level(x[j + 16]) << 4));
        std::memcpy(dst + b * sizeof blk, &blk, sizeof blk);
      }
      return;
  }
}

}  // namespace efim
