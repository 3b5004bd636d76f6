#pragma once
// Block-quantized weight rows as the CUDA backend reads them: eight consecutive weights at a time
// (a "group"), decoded from the bytes the GGUF file stores (the device keeps them as they are). Host
// and device code (EFIM_HOST_DEVICE), so that the host tests check every group of every type against
// dequantize_row bit for bit: the same values, computed with the same single roundings (the products
// of a quant and a scale are exact in f32; q4_k and q5_k subtract the min, q5_1 adds the offset, with
// one rounding, as dequantize_row does, fused or not).
//
// Group g of a row holds weights 8g .. 8g + 7. A row of n weights has n / 8 groups; n is a whole
// number of blocks (row_bytes). Where the device reads the bytes:
//   q8_0   34-byte blocks of 32: the f16 scale, then 32 int8 quants         (2-byte loads)
//   q4_0   18-byte blocks of 32: the f16 scale, then 16 bytes of nibbles    (2-byte loads)
//   q5_0   22-byte blocks of 32: scale, 4 bytes of fifth bits, nibbles      (2-byte loads)
//   q5_1   24-byte blocks of 32: scale, offset, fifth bits, nibbles         (2-byte loads)
//   q4_k  144-byte blocks of 256: d, dmin, 12 bytes of 6-bit scales, nibbles  (4- and 8-byte loads)
//   q5_k  176-byte blocks of 256: as q4_k with 32 bytes of fifth bits      (4- and 8-byte loads)
//   q6_k  210-byte blocks of 256: low nibbles, high 2 bits, int8 scales, d (2-byte loads)
// The wider loads need the row's first byte aligned to 16 (a device allocation, rows of whole blocks of
// 144 or 176 bytes, both multiples of 16); the host reads through memcpy.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "efim/core/config.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/float16.hpp"

namespace efim::kernels::quant {

// The block-quantized types the device multiplies as the file stores them: all of them.
constexpr bool kept_quantized(dtype t) noexcept {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q5_0 || t == dtype::q5_1 || t == dtype::q4_k ||
         t == dtype::q5_k || t == dtype::q6_k;
}
consteval bool every_block_type_kept() {
  for (const dtype t : all_dtypes)
    if (info(t).block > 1 && !kept_quantized(t)) return false;
  return true;
}
static_assert(every_block_type_kept(), "a new block-quantized type needs its decode8 (and kept_quantized)");

// x rows up to which the device multiplies by decoding weights in registers (quant_matmul.cuh's
// default policy); above, it multiplies f16 slices of them on tensor cores.
inline constexpr std::size_t decode_rows = 8;

namespace detail {

// An unaligned-safe load on the host; on the device the caller guarantees sizeof(T) alignment.
template <class T>
EFIM_HOST_DEVICE T load(const std::uint8_t* p) noexcept {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// Eight bytes from a 2-byte aligned address, little-endian, as one 64-bit word.
EFIM_HOST_DEVICE std::uint64_t load8_16(const std::uint8_t* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint64_t>(load<std::uint16_t>(p + 2 * i)) << (16 * i);
  return v;
}

EFIM_HOST_DEVICE std::uint32_t byte_of(std::uint64_t v, int i) noexcept {
  return static_cast<std::uint32_t>(v >> (8 * i)) & 0xFFu;
}

// q4_k / q5_k: scale and min j (0..7) of the 12 scale bytes (kquant::scale_min), from three words.
EFIM_HOST_DEVICE void scale_min(const std::uint8_t* scales, int j, std::uint32_t& sc, std::uint32_t& m) noexcept {
  const std::uint32_t w[3] = {load<std::uint32_t>(scales), load<std::uint32_t>(scales + 4),
                              load<std::uint32_t>(scales + 8)};
  const auto byte = [&](int i) { return (w[i / 4] >> (8 * (i % 4))) & 0xFFu; };
  if (j < 4) {
    sc = byte(j) & 63u;
    m = byte(j + 4) & 63u;
  } else {
    sc = (byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4);
    m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
  }
}

}  // namespace detail

// Weights 8g .. 8g + 7 of a row of type T into w.
template <dtype T>
EFIM_HOST_DEVICE void decode8(const std::uint8_t* row, std::size_t g, float* w) noexcept {
  using detail::byte_of;
  using detail::load;
  if constexpr (T == dtype::q8_0) {
    const std::uint8_t* p = row + g / 4 * 34;
    const float d = f16_to_f32(load<std::uint16_t>(p));
    const std::uint64_t q = detail::load8_16(p + 2 + 8 * (g % 4));
    for (int i = 0; i < 8; ++i)
      w[i] = static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(byte_of(q, i)))) * d;
  } else if constexpr (T == dtype::q4_0) {
    const std::uint8_t* p = row + g / 4 * 18;
    const float d = f16_to_f32(load<std::uint16_t>(p));
    const std::uint64_t q = detail::load8_16(p + 2 + 8 * (g % 2));
    const int shift = g % 4 < 2 ? 0 : 4;
    for (int i = 0; i < 8; ++i) w[i] = static_cast<float>(static_cast<int>((byte_of(q, i) >> shift) & 15u) - 8) * d;
  } else if constexpr (T == dtype::q5_0 || T == dtype::q5_1) {
    constexpr std::size_t bytes = T == dtype::q5_0 ? 22 : 24, head = T == dtype::q5_0 ? 2 : 4;
    const std::uint8_t* p = row + g / 4 * bytes;
    const float d = f16_to_f32(load<std::uint16_t>(p));
    const std::uint32_t qh = static_cast<std::uint32_t>(load<std::uint16_t>(p + head)) |
                             static_cast<std::uint32_t>(load<std::uint16_t>(p + head + 2)) << 16;
    const std::uint64_t q = detail::load8_16(p + head + 4 + 8 * (g % 2));
    const int shift = g % 4 < 2 ? 0 : 4;
    const int first = static_cast<int>(8 * (g % 4));  // the weight index of w[0] within the block
    for (int i = 0; i < 8; ++i) {
      const int v = static_cast<int>(((byte_of(q, i) >> shift) & 15u) | (((qh >> (first + i)) & 1u) << 4));
      if constexpr (T == dtype::q5_0)
        w[i] = static_cast<float>(v - 16) * d;
      else
        w[i] = static_cast<float>(v) * d + f16_to_f32(load<std::uint16_t>(p + 2));
    }
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {
    constexpr std::size_t bytes = T == dtype::q4_k ? 144 : 176, qs_at = T == dtype::q4_k ? 16 : 48;
    const std::uint8_t* p = row + g / 32 * bytes;
    const std::uint32_t dd = load<std::uint32_t>(p);
    const float d = f16_to_f32(static_cast<std::uint16_t>(dd & 0xFFFFu));
    const float dmin = f16_to_f32(static_cast<std::uint16_t>(dd >> 16));
    const int l = static_cast<int>(g % 32), j = l / 4, o = (l % 4) * 8;  // sub-block j, weights o .. o + 7 of it
    std::uint32_t sc, m;
    detail::scale_min(p + 4, j, sc, m);
    const float ds = d * static_cast<float>(sc), mm = dmin * static_cast<float>(m);
    const std::uint64_t q = load<std::uint64_t>(p + qs_at + 32 * (j / 2) + o);
    const int shift = j % 2 == 0 ? 0 : 4;
    std::uint64_t qh = 0;
    if constexpr (T == dtype::q5_k) qh = load<std::uint64_t>(p + 16 + o);
    for (int i = 0; i < 8; ++i) {
      std::uint32_t v = (byte_of(q, i) >> shift) & 15u;
      if constexpr (T == dtype::q5_k) v |= ((byte_of(qh, i) >> j) & 1u) << 4;
      w[i] = ds * static_cast<float>(v) - mm;
    }
  } else if constexpr (T == dtype::q6_k) {
    const std::uint8_t* p = row + g / 32 * 210;
    const int i0 = static_cast<int>(g % 32) * 8;  // the weight index of w[0] within the super-block
    const int h = i0 / 128, r = i0 % 128 / 32, l = i0 % 32;
    const std::uint64_t low = detail::load8_16(p + 64 * h + 32 * (r % 2) + l);
    const std::uint64_t high = detail::load8_16(p + 128 + 32 * h + l);
    const float d = f16_to_f32(load<std::uint16_t>(p + 208));
    const std::uint16_t sc2 = load<std::uint16_t>(p + 192 + (i0 / 16) / 2 * 2);
    const auto sc = static_cast<std::int8_t>(static_cast<std::uint8_t>((i0 / 16) % 2 == 0 ? sc2 & 0xFFu : sc2 >> 8));
    const float ds = d * static_cast<float>(sc);
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t lo = r < 2 ? byte_of(low, i) & 15u : byte_of(low, i) >> 4;
      const std::uint32_t hi = (byte_of(high, i) >> (2 * r)) & 3u;
      w[i] = ds * static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32);
    }
  } else {
    static_assert(T == dtype::q8_0, "decode8: not a type the device keeps quantized");
  }
}

// What lane `lane` of a warp of `lanes` adds to the dot products of one weight row with m x rows (m at
// most M; the CUDA backend's decode product, kernels/cuda/quant_matmul.cuh, one warp per weight row):
// groups lane, lane + lanes, ... in turn, each decoded once and multiplied into every x row's sum,
// eight fused multiply-adds in order. x rows are `cols` floats apart (on the device, 16-byte aligned);
// acc holds the m sums, added to.
template <dtype T, int M>
EFIM_HOST_DEVICE void lane_dots(const std::uint8_t* row, std::size_t cols, const float* x, int m, int lane, int lanes,
                                float* acc) noexcept {
  for (std::size_t g = static_cast<std::size_t>(lane); g < cols / 8; g += static_cast<std::size_t>(lanes)) {
    float w[8];
    decode8<T>(row, g, w);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < M; ++i) {
      if (i >= m) break;
      const float* xi = x + static_cast<std::size_t>(i) * cols + 8 * g;
      float xv[8];
#if defined(__CUDA_ARCH__)
      const float4 lo = reinterpret_cast<const float4*>(xi)[0], hi = reinterpret_cast<const float4*>(xi)[1];
      xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w, xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z, xv[7] = hi.w;
#else
      std::memcpy(xv, xi, sizeof xv);
#endif
      float a = acc[i];
      for (int k = 0; k < 8; ++k) a = fmaf(w[k], xv[k], a);
      acc[i] = a;
    }
  }
}

// The warp's sum of one value per lane as the device adds it (five rounds of __shfl_xor_sync: each lane
// adds its partner's value at distance 16, 8, 4, 2, 1), lane 0's result: the host's copy, for the tests.
inline float warp_sum(const float (&v)[32]) noexcept {
  float s[32], t[32];
  for (int l = 0; l < 32; ++l) s[l] = v[l];
  for (int off = 16; off > 0; off /= 2) {
    for (int l = 0; l < 32; ++l) t[l] = s[l] + s[l ^ off];
    for (int l = 0; l < 32; ++l) s[l] = t[l];
  }
  return s[0];
}

// f(std::integral_constant<dtype, T>{}) for the kept type t known at run time: the one place that
// lists them for dispatch (the device products instantiate their kernels per type through it).
template <class F>
decltype(auto) visit_kept(dtype t, F&& f) {
  switch (t) {
    case dtype::q8_0:
      return f(std::integral_constant<dtype, dtype::q8_0>{});
    case dtype::q4_0:
      return f(std::integral_constant<dtype, dtype::q4_0>{});
    case dtype::q5_0:
      return f(std::integral_constant<dtype, dtype::q5_0>{});
    case dtype::q5_1:
      return f(std::integral_constant<dtype, dtype::q5_1>{});
    case dtype::q4_k:
      return f(std::integral_constant<dtype, dtype::q4_k>{});
    case dtype::q5_k:
      return f(std::integral_constant<dtype, dtype::q5_k>{});
    case dtype::q6_k:
      return f(std::integral_constant<dtype, dtype::q6_k>{});
    default:
      throw error(errc::invalid_argument, std::string(to_string(t)) + " is not a type the device keeps quantized");
  }
}

// decode8 for a type known at run time (host code and tests).
inline void decode8(dtype t, const std::uint8_t* row, std::size_t g, float* w) {
  visit_kept(t, [&](auto type) { decode8<decltype(type)::value>(row, g, w); });
}

}  // namespace efim::kernels::quant
