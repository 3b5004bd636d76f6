#pragma once
// Element types of weight and KV tensors: f32, f16, bf16, the block-quantized q8_0, q4_0, q5_0 and q5_1,
// and ggml's k-quants q4_k, q5_k and q6_k (kquants.hpp), with the byte layouts GGUF files use (ggml
// type ids), conversions, and reference quantizers whose bytes equal llama.cpp's.
//
// Dequantization gives one f32 value per weight that does not depend on how it is computed: exact for
// every type but q4_k, q5_k and q5_1 (an integer times an f16 scale needs at most 24 significant bits), and
// for those one rounding of an exact product minus an exact product, the same with or without a fused
// multiply-add. So a kernel that dequantizes on the fly computes the same products as one that reads
// dequantized f32 weights.
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
#include "efim/core/float16.hpp"
#include "efim/core/kquants.hpp"

namespace efim {

// Values are ggml's type ids, as stored in GGUF tensor directories.
enum class dtype : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  bf16 = 30,
};

inline constexpr dtype all_dtypes[] = {dtype::f32,  dtype::f16,  dtype::bf16, dtype::q8_0, dtype::q4_0,
                                       dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k};

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
    case dtype::q5_0:
      return {"q5_0", 32, 22};
    case dtype::q5_1:
      return {"q5_1", 32, 24};
    case dtype::q4_k:
      return {"q4_k", 256, 144};
    case dtype::q5_k:
      return {"q5_k", 256, 176};
    case dtype::q6_k:
      return {"q6_k", 256, 210};
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
  throw error(errc::invalid_argument, "unknown tensor type '" + std::string(name) +
                                          "' (f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q4_k, q5_k, q6_k)");
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

namespace detail {
template <class Block>
void dequantize_blocks(const std::byte* src, float* dst, std::size_t n) {
  for (std::size_t b = 0; b < n / Block::weights; ++b) {
    Block blk;
    std::memcpy(&blk, src + b * sizeof blk, sizeof blk);
    kquant::dequantize(blk, dst + b * Block::weights);
  }
}
template <class Block>
void quantize_blocks(const float* src, std::byte* dst, std::size_t n) {
  for (std::size_t b = 0; b < n / Block::weights; ++b) {
    Block blk;
    kquant::quantize(src + b * Block::weights, blk);
    std::memcpy(dst + b * sizeof blk, &blk, sizeof blk);
  }
}
}  // namespace detail

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
    case dtype::q5_0:
      return detail::dequantize_blocks<block_q5_0>(src, dst, n);
    case dtype::q5_1:
      return detail::dequantize_blocks<block_q5_1>(src, dst, n);
    case dtype::q4_k:
      return detail::dequantize_blocks<block_q4_k>(src, dst, n);
    case dtype::q5_k:
      return detail::dequantize_blocks<block_q5_k>(src, dst, n);
    case dtype::q6_k:
      return detail::dequantize_blocks<block_q6_k>(src, dst, n);
  }
}

// The reference quantizers GGUF tools use (so a file written here has the bytes theirs would have):
// q8_0 scales each block by max|x| / 127 and rounds half away from zero; q4_0 scales by the element of
// largest magnitude / -8 and truncates x / d + 8.5, at most 15; q5_0 and the k-quants as kquants.hpp
// says (llama.cpp's reference quantizers, without an importance matrix).
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
        const float d = kquant::largest_magnitude(x, 32) / -8.0f;
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
    case dtype::q5_0:
      return detail::quantize_blocks<block_q5_0>(src, dst, n);
    case dtype::q5_1:
      return detail::quantize_blocks<block_q5_1>(src, dst, n);
    case dtype::q4_k:
      return detail::quantize_blocks<block_q4_k>(src, dst, n);
    case dtype::q5_k:
      return detail::quantize_blocks<block_q5_k>(src, dst, n);
    case dtype::q6_k:
      return detail::quantize_blocks<block_q6_k>(src, dst, n);
  }
}

}  // namespace efim
