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
//   q8_0   34-byte blocks of 32: the f16 scale, then 32 int8 quants         (2- and 4-byte loads)
//   q4_0   18-byte blocks of 32: the f16 scale, then 16 bytes of nibbles    (2- and 4-byte loads)
//   q5_0   22-byte blocks of 32: scale, 4 bytes of fifth bits, nibbles      (2- and 4-byte loads)
//   q5_1   24-byte blocks of 32: scale, offset, fifth bits, nibbles         (4- and 8-byte loads)
//   q4_k  144-byte blocks of 256: d, dmin, 12 bytes of 6-bit scales, nibbles  (4- and 8-byte loads)
//   q5_k  176-byte blocks of 256: as q4_k with 32 bytes of fifth bits      (4- and 8-byte loads)
//   q6_k  210-byte blocks of 256: low nibbles, high 2 bits, int8 scales, d (2- and 4-byte loads)
// and the dense types, whose decode product reads them the same way (rows of whole groups, 16-byte
// aligned: dense_decodes):
//   f16, bf16  a group from one 16-byte load;  f32  a group from two
// The wider loads need the row's first byte aligned to 16 (a device allocation, rows of whole blocks of
// 144 or 176 bytes, both multiples of 16); the host reads through memcpy. The decode product reads
// q4_k and q5_k a chunk of 16 quant bytes (32 weights) at a time, in one 16-byte load (decode_chunk);
// q6_k a chunk of 32 weights (8 of each of the four quarters of a half super-block that share their
// bytes of high bits) from four 8-byte reads: two of low bits, one of high bits, one of scales; q8_0,
// q4_0, q5_0 and q5_1 a whole block of 32 a chunk (its scale read once, its quants in 4-byte words).
// Small integers become floats through their bits on the device (small_float): the same values as a
// conversion, exactly, in two full-rate instructions where the conversion runs at a quarter rate.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "efim/core/config.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/float16.hpp"

namespace efim::kernels::quant {

// Pairs of types whose int8 decode products share one launch (quant_decode_int8_pair): a mix's base
// type for the first parts and its type of more bits for the last (q, k and v of llama.cpp's Q4_K_M and
// Q5_K_M, and of their fallbacks where rows are not whole super-blocks), one activation span each.
constexpr bool int8_pair(dtype first, dtype second) noexcept {
  return (second == dtype::q6_k && (first == dtype::q4_k || first == dtype::q5_k)) ||
         (second == dtype::q8_0 && (first == dtype::q5_0 || first == dtype::q5_1));
}

// The block-quantized types the device multiplies as the file stores them: all of them.
constexpr bool kept_quantized(dtype t) noexcept {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q5_0 || t == dtype::q5_1 || t == dtype::q4_k ||
         t == dtype::q5_k || t == dtype::q6_k;
}
// The types whose decode product (up to decode_rows x rows) reads the weights into registers, a lane
// eight at a time: the kept quantized types, and f16, bf16 and f32 (a chunk of 8 weights from one or two
// 16-byte loads; their rows must be whole chunks, dense_decodes). Above decode_rows, and for dense rows
// of other widths, cuBLAS multiplies.
constexpr bool dense_type(dtype t) noexcept { return t == dtype::f16 || t == dtype::bf16 || t == dtype::f32; }
constexpr bool register_decoded_type(dtype t) noexcept { return kept_quantized(t) || dense_type(t); }
// Whether a dense matrix of `cols` inputs is whole chunks, each row then 16-byte aligned after the first.
constexpr bool dense_decodes(dtype t, std::size_t cols) noexcept { return dense_type(t) && cols % 8 == 0; }

consteval bool every_block_type_kept() {
  for (const dtype t : all_dtypes)
    if (info(t).block > 1 && !kept_quantized(t)) return false;
  return true;
}
static_assert(every_block_type_kept(), "a new block-quantized type needs its decode8 (and kept_quantized)");

// x rows up to which the device multiplies by decoding weights in registers (quant_matmul.cuh's
// default policy); above, it multiplies f16 slices of them on tensor cores. (More rows in passes of 8
// ran slower than the slices: each pass reads every x row from L1 once per weight row, 32 bytes per
// weight at 8 rows; H200, 7B shape, batch 16: 80.7 ms a step against 32.5.)
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

// The same from an address that is 4-byte aligned for every lane of a warp or for none, as the decode
// walk arranges it (walk_chunk; where it cannot, a warp takes both ways): two 4-byte loads, or a 2-, a
// 4- and a 2-byte load.
EFIM_HOST_DEVICE std::uint64_t load8_16_uniform(const std::uint8_t* p) noexcept {
#if defined(__CUDA_ARCH__)
  if (reinterpret_cast<std::uintptr_t>(p) % 4 == 0)
    return static_cast<std::uint64_t>(load<std::uint32_t>(p)) | static_cast<std::uint64_t>(load<std::uint32_t>(p + 4))
                                                                    << 32;
  return static_cast<std::uint64_t>(load<std::uint16_t>(p)) |
         static_cast<std::uint64_t>(load<std::uint32_t>(p + 2)) << 16 |
         static_cast<std::uint64_t>(load<std::uint16_t>(p + 6)) << 48;
#else
  return load8_16(p);
#endif
}

// N 4-byte little-endian words from a 2-byte aligned address that is 4-byte aligned for every lane of a
// warp or for none (the decode walk's blocks, walk_chunk): N 4-byte loads, or a 2-byte load, N - 1
// 4-byte loads and a 2-byte load, stitched.
// (The second way, host and device code so that the host tests check the stitching: p + 2 is 4-byte
// aligned on the device.)
template <int N>
EFIM_HOST_DEVICE void load_words_split(const std::uint8_t* p, std::uint32_t (&w)[N]) noexcept {
  static_assert(N >= 2, "at least two words");
  std::uint32_t mid[N - 1];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < N - 1; ++i) mid[i] = load<std::uint32_t>(p + 2 + 4 * i);
  const std::uint32_t first = load<std::uint16_t>(p), last = load<std::uint16_t>(p + 4 * N - 2);
  w[0] = first | mid[0] << 16;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 1; i < N - 1; ++i) w[i] = mid[i - 1] >> 16 | mid[i] << 16;
  w[N - 1] = mid[N - 2] >> 16 | last << 16;
}

template <int N>
EFIM_HOST_DEVICE void load_words_uniform(const std::uint8_t* p, std::uint32_t (&w)[N]) noexcept {
#if defined(__CUDA_ARCH__)
  if (reinterpret_cast<std::uintptr_t>(p) % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = load<std::uint32_t>(p + 4 * i);
    return;
  }
  load_words_split(p, w);
#else
  std::memcpy(w, p, sizeof w);
#endif
}

// Sixteen bytes from a 16-byte aligned address (on the device one load), as two little-endian words.
EFIM_HOST_DEVICE void load16(const std::uint8_t* p, std::uint64_t& lo, std::uint64_t& hi) noexcept {
#if defined(__CUDA_ARCH__)
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  lo = static_cast<std::uint64_t>(v.x) | static_cast<std::uint64_t>(v.y) << 32;
  hi = static_cast<std::uint64_t>(v.z) | static_cast<std::uint64_t>(v.w) << 32;
#else
  std::memcpy(&lo, p, 8);
  std::memcpy(&hi, p + 8, 8);
#endif
}

EFIM_HOST_DEVICE std::uint32_t byte_of(std::uint64_t v, int i) noexcept {
  return static_cast<std::uint32_t>(v >> (8 * i)) & 0xFFu;
}

// A scale stored as f16, as a float: f16_to_f32's value; on the device the conversion instruction (the
// same value for every finite and infinite scale), not f16_to_f32's branches.
EFIM_HOST_DEVICE float half_to_float(std::uint16_t h) noexcept {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return f16_to_f32(h);
#endif
}

// The float of these bits.
EFIM_HOST_DEVICE float bits_float(std::uint32_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(v);
#else
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
#endif
}

// v - Bias as a float, for 0 <= v < 2^16 and a small Bias: exact either way; on the device from the
// bits of 2^23 + v (one OR, one add).
template <int Bias = 0>
EFIM_HOST_DEVICE float small_float(std::uint32_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(0x4B000000u | v) - (8388608.0f + static_cast<float>(Bias));
#else
  return static_cast<float>(static_cast<int>(v) - Bias);
#endif
}

// q4_k / q5_k: scale and min j (0..7) of the 12 scale bytes (kquant::scale_min), held as three words.
// (The word a byte is in is chosen among constant indices: indexed by j, the three would be copied to
// the thread's stack first.)
EFIM_HOST_DEVICE void scale_min(const std::uint32_t (&w)[3], int j, std::uint32_t& sc, std::uint32_t& m) noexcept {
  const auto byte = [&](int i) { return ((i >= 8 ? w[2] : i >= 4 ? w[1] : w[0]) >> (8 * (i % 4))) & 0xFFu; };
  if (j < 4) {
    sc = byte(j) & 63u;
    m = byte(j + 4) & 63u;
  } else {
    sc = (byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4);
    m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
  }
}

// The same for sub-blocks 2 pair and 2 pair + 1 together (pair 0..3), without a branch on the pair (a
// warp's lanes hold different pairs): the two sub-blocks' 6-bit fields lie in the same 16 bits of each
// of the three words (bits 16 (pair % 2) on), both layouts' pairs of fields are computed 16 bits at a
// time and one is selected. sc, m: the first sub-block's in bits 0..7, the second's in bits 8..15.
EFIM_HOST_DEVICE void scale_min_pair(const std::uint32_t (&w)[3], int pair, std::uint32_t& sc,
                                     std::uint32_t& m) noexcept {
  const int shift = 16 * (pair % 2);
  const std::uint32_t x = (w[0] >> shift) & 0xFFFFu, y = (w[1] >> shift) & 0xFFFFu, z = (w[2] >> shift) & 0xFFFFu;
  const bool high = pair >= 2;  // sub-blocks 4..7: low 4 bits in bytes 8..11, high 2 in the top of 0..7
  sc = high ? (z & 0x0F0Fu) | ((x >> 2) & 0x3030u) : x & 0x3F3Fu;
  m = high ? ((z >> 4) & 0x0F0Fu) | ((y >> 2) & 0x3030u) : y & 0x3F3Fu;
}

EFIM_HOST_DEVICE void scale_words(const std::uint8_t* scales, std::uint32_t (&w)[3]) noexcept {
  w[0] = load<std::uint32_t>(scales), w[1] = load<std::uint32_t>(scales + 4), w[2] = load<std::uint32_t>(scales + 8);
}

// Both sub-blocks of a pair (scale_min_pair): sub_block_scale's values for 2 pair and 2 pair + 1.
EFIM_HOST_DEVICE void pair_scales(std::uint32_t dd, const std::uint32_t (&words)[3], int pair, float (&ds)[2],
                                  float (&mm)[2]) noexcept {
  std::uint32_t sc, m;
  scale_min_pair(words, pair, sc, m);
  const float d = half_to_float(static_cast<std::uint16_t>(dd & 0xFFFFu));
  const float dmin = half_to_float(static_cast<std::uint16_t>(dd >> 16));
  ds[0] = d * small_float(sc & 0xFFu), ds[1] = d * small_float(sc >> 8);
  mm[0] = dmin * small_float(m & 0xFFu), mm[1] = dmin * small_float(m >> 8);
}

// q4_k / q5_k: sub-block j's weight of quant v is ds * v - mm; ds = d * scale and mm = dmin * min (both
// exact in f32), from the block's d/dmin word and its three scale words.
EFIM_HOST_DEVICE void sub_block_scale(std::uint32_t dd, const std::uint32_t (&words)[3], int j, float& ds,
                                      float& mm) noexcept {
  std::uint32_t sc, m;
  scale_min(words, j, sc, m);
  ds = half_to_float(static_cast<std::uint16_t>(dd & 0xFFFFu)) * small_float(sc);
  mm = half_to_float(static_cast<std::uint16_t>(dd >> 16)) * small_float(m);
}

}  // namespace detail

// The groups a lane decodes at a time in the decode product (a "chunk"): for q4_k and q5_k the 32
// weights of 16 quant bytes (16 weights of each of two sub-blocks: 4 groups), read in one load; for
// q6_k the 32 weights l .. l + 7 of each quarter (32 weights) of a half super-block: the low bits of
// quarters 0 and 2 share bytes, those of 1 and 3 too, and all four share the bytes of high bits, so a
// chunk reads 8 bytes of each kind once (where 8-weight chunks read the high bits four times); for the
// types of 32-weight blocks (q8_0, q4_0, q5_0, q5_1) a whole block, its scale read once; one group of
// the dense types (16 bytes).
template <dtype T>
inline constexpr int chunk_groups = T == dtype::q4_k || T == dtype::q5_k || T == dtype::q6_k || T == dtype::q8_0 ||
                                            T == dtype::q4_0 || T == dtype::q5_0 || T == dtype::q5_1
                                        ? 4
                                        : 1;

// The types of 32-weight blocks, read a block a chunk.
template <dtype T>
inline constexpr bool block32_type = T == dtype::q8_0 || T == dtype::q4_0 || T == dtype::q5_0 || T == dtype::q5_1;

// The bytes of one chunk as loaded (load_chunk), before they are decoded (decode_loaded): the decode
// product loads several chunks before it decodes the first, so that their loads are in flight together.
// Which words hold what depends on the type (load_chunk); unused ones stay zero.
struct chunk_bytes {
  std::uint64_t q0 = 0, q1 = 0, h0 = 0, h1 = 0;
  std::uint32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
};

// Chunk c of a row's bytes.
template <dtype T>
EFIM_HOST_DEVICE chunk_bytes load_chunk(const std::uint8_t* row, std::size_t c) noexcept {
  using detail::load;
  chunk_bytes b;
  const auto word64 = [](std::uint32_t lo, std::uint32_t hi) {
    return static_cast<std::uint64_t>(lo) | static_cast<std::uint64_t>(hi) << 32;
  };
  if constexpr (T == dtype::q8_0) {  // chunk c: block c. s0: scale; q0, q1, h0, h1: the 32 quants
    const std::uint8_t* p = row + c * 34;
    b.s0 = load<std::uint16_t>(p);
    std::uint32_t w[8];
    detail::load_words_uniform(p + 2, w);
    b.q0 = word64(w[0], w[1]), b.q1 = word64(w[2], w[3]), b.h0 = word64(w[4], w[5]), b.h1 = word64(w[6], w[7]);
  } else if constexpr (T == dtype::q4_0) {  // s0: scale; q0, q1: the 16 bytes of nibbles
    const std::uint8_t* p = row + c * 18;
    b.s0 = load<std::uint16_t>(p);
    std::uint32_t w[4];
    detail::load_words_uniform(p + 2, w);
    b.q0 = word64(w[0], w[1]), b.q1 = word64(w[2], w[3]);
  } else if constexpr (T == dtype::q5_0) {  // s0: scale; s1: fifth bits; q0, q1: nibbles
    const std::uint8_t* p = row + c * 22;
    b.s0 = load<std::uint16_t>(p);
    std::uint32_t w[5];
    detail::load_words_uniform(p + 2, w);
    b.s1 = w[0], b.q0 = word64(w[1], w[2]), b.q1 = word64(w[3], w[4]);
  } else if constexpr (T == dtype::q5_1) {  // s0: scale, offset above; s1: fifth bits; q0, q1: nibbles
    const std::uint8_t* p = row + c * 24;   // (8-byte aligned: rows of 24-byte blocks from an aligned start)
    b.s0 = load<std::uint32_t>(p);
    b.s1 = load<std::uint32_t>(p + 4);
    b.q0 = load<std::uint64_t>(p + 8), b.q1 = load<std::uint64_t>(p + 16);
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {  // s0: d, dmin; s1..s3: scales; q: quants; h: fifth bits
    constexpr std::size_t bytes = T == dtype::q4_k ? 144 : 176, qs_at = T == dtype::q4_k ? 16 : 48;
    const std::uint8_t* p = row + c / 8 * bytes;
    const std::size_t pair = c % 8 / 2, half = c % 2;
    b.s0 = load<std::uint32_t>(p);
    std::uint32_t w[3];
    detail::scale_words(p + 4, w);
    b.s1 = w[0], b.s2 = w[1], b.s3 = w[2];
    detail::load16(p + qs_at + 32 * pair + 16 * half, b.q0, b.q1);
    if constexpr (T == dtype::q5_k) detail::load16(p + 16 + 16 * half, b.h0, b.h1);
  } else if constexpr (T == dtype::f16 || T == dtype::bf16) {  // q0, q1: 8 values
    detail::load16(row + 16 * c, b.q0, b.q1);
  } else if constexpr (T == dtype::f32) {  // q0, q1, h0, h1: 8 values
    detail::load16(row + 32 * c, b.q0, b.q1);
    detail::load16(row + 32 * c + 16, b.h0, b.h1);
  } else if constexpr (T == dtype::q6_k) {  // q0, q1: low bits (quarters 0, 2; 1, 3); h0: high bits;
    // h1: the half's 8 int8 scales; s1: d. Chunk c: half h = c % 8 / 4 of super-block c / 8, weights l ..
    // l + 7 (l = 8 (c % 4)) of each of its quarters.
    const std::uint8_t* p = row + c / 8 * 210;
    const std::size_t h = c % 8 / 4, l = c % 4 * 8;
    b.q0 = detail::load8_16_uniform(p + 64 * h + l);
    b.q1 = detail::load8_16_uniform(p + 64 * h + 32 + l);
    b.h0 = detail::load8_16_uniform(p + 128 + 32 * h + l);
    b.h1 = detail::load8_16_uniform(p + 192 + 8 * h);
    b.s1 = load<std::uint16_t>(p + 208);
  } else {
    static_assert(T == dtype::q8_0, "load_chunk: not a type the device decodes in registers");
  }
  return b;
}

// Where each group of chunk c starts in its row (the weight index).
template <dtype T>
EFIM_HOST_DEVICE void chunk_first(std::size_t c, std::size_t* first) noexcept {
  if constexpr (chunk_groups<T> == 1) {
    first[0] = 8 * c;
  } else if constexpr (block32_type<T>) {  // block c's groups in order
    first[0] = 32 * c, first[1] = 32 * c + 8, first[2] = 32 * c + 16, first[3] = 32 * c + 24;
  } else if constexpr (T == dtype::q6_k) {  // weights l .. l + 7 of each quarter of half c % 8 / 4
    const std::size_t base = c / 8 * 256 + 128 * (c % 8 / 4) + 8 * (c % 4);
    first[0] = base, first[1] = base + 32, first[2] = base + 64, first[3] = base + 96;
  } else {  // q4_k, q5_k: weights 16 half .. 16 half + 15 of sub-blocks 2 pair and 2 pair + 1
    const std::size_t base = c / 8 * 256 + 64 * (c % 8 / 2) + 16 * (c % 2);
    first[0] = base, first[1] = base + 8, first[2] = base + 32, first[3] = base + 40;
  }
}

// Chunk c's 8 * chunk_groups<T> weights from its bytes into w (each the value dequantize_row gives),
// and where each of its groups starts in the row (the weight index) into first.
template <dtype T>
EFIM_HOST_DEVICE void decode_loaded(const chunk_bytes& b, std::size_t c, float* w, std::size_t* first) noexcept {
  using detail::byte_of;
  using detail::half_to_float;
  using detail::small_float;
  if constexpr (T == dtype::q8_0) {
    const float d = half_to_float(static_cast<std::uint16_t>(b.s0));
    const std::uint64_t q[4] = {b.q0, b.q1, b.h0, b.h1};
    for (int i = 0; i < 32; ++i) w[i] = small_float<128>(byte_of(q[i / 8], i % 8) ^ 0x80u) * d;  // the int8, exactly
  } else if constexpr (T == dtype::q4_0) {  // weight i: the low nibble of byte i, weight 16 + i its high one
    const float d = half_to_float(static_cast<std::uint16_t>(b.s0));
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t q = byte_of(i < 8 ? b.q0 : b.q1, i % 8);
      w[i] = small_float<8>(q & 15u) * d;
      w[16 + i] = small_float<8>(q >> 4) * d;
    }
  } else if constexpr (T == dtype::q5_0 || T == dtype::q5_1) {  // as q4_0, fifth bit i of the 32 bits above
    const float d = half_to_float(static_cast<std::uint16_t>(b.s0 & 0xFFFFu));
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t q = byte_of(i < 8 ? b.q0 : b.q1, i % 8);
      const std::uint32_t lo = (q & 15u) | (((b.s1 >> i) & 1u) << 4), hi = (q >> 4) | (((b.s1 >> (16 + i)) & 1u) << 4);
      if constexpr (T == dtype::q5_0) {
        w[i] = small_float<16>(lo) * d;
        w[16 + i] = small_float<16>(hi) * d;
      } else {
        const float m = half_to_float(static_cast<std::uint16_t>(b.s0 >> 16));
        w[i] = small_float(lo) * d + m;
        w[16 + i] = small_float(hi) * d + m;
      }
    }
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {
    const int pair = static_cast<int>(c % 8) / 2;  // sub-blocks 2 pair and 2 pair + 1
    const std::uint32_t words[3] = {b.s1, b.s2, b.s3};
    float ds[2], mm[2];
    detail::pair_scales(b.s0, words, pair, ds, mm);
    const float ds0 = ds[0], mm0 = mm[0], ds1 = ds[1], mm1 = mm[1];
    for (int t = 0; t < 16; ++t) {  // quant byte t: weight 16 half + t of both sub-blocks
      const std::uint32_t q = byte_of(t < 8 ? b.q0 : b.q1, t % 8);
      std::uint32_t lo = q & 15u, hi = q >> 4;
      if constexpr (T == dtype::q5_k) {
        const std::uint32_t h = byte_of(t < 8 ? b.h0 : b.h1, t % 8);
        lo |= ((h >> (2 * pair)) & 1u) << 4;
        hi |= ((h >> (2 * pair + 1)) & 1u) << 4;
      }
      w[t] = ds0 * small_float(lo) - mm0;
      w[16 + t] = ds1 * small_float(hi) - mm1;
    }
  } else if constexpr (T == dtype::f16 || T == dtype::bf16) {
    for (int i = 0; i < 8; ++i) {
      const auto h = static_cast<std::uint16_t>((i < 4 ? b.q0 : b.q1) >> (16 * (i % 4)));
      if constexpr (T == dtype::f16)
        w[i] = half_to_float(h);
      else
        w[i] = detail::bits_float(static_cast<std::uint32_t>(h) << 16);  // bf16_to_f32, exactly
    }
  } else if constexpr (T == dtype::f32) {
    const std::uint64_t words[4] = {b.q0, b.q1, b.h0, b.h1};
    for (int i = 0; i < 8; ++i) w[i] = detail::bits_float(static_cast<std::uint32_t>(words[i / 2] >> (32 * (i % 2))));
  } else if constexpr (T == dtype::q6_k) {  // w[8 r ..]: weights l .. l + 7 of quarter r
    const int l = static_cast<int>(c % 4) * 8;
    const float d = half_to_float(static_cast<std::uint16_t>(b.s1));
    for (int r = 0; r < 4; ++r) {
      const auto sc = static_cast<std::int8_t>(byte_of(b.h1, 2 * r + l / 16));  // (16 weights a scale)
      const float ds = d * static_cast<float>(sc);
      const std::uint64_t q = r % 2 == 0 ? b.q0 : b.q1;
      for (int i = 0; i < 8; ++i) {
        const std::uint32_t lo = r < 2 ? byte_of(q, i) & 15u : byte_of(q, i) >> 4;
        const std::uint32_t hi = (byte_of(b.h0, i) >> (2 * r)) & 3u;
        w[8 * r + i] = ds * small_float<32>(lo | (hi << 4));
      }
    }
  } else {
    static_assert(T == dtype::q8_0, "decode_loaded: not a type the device decodes in registers");
  }
  chunk_first<T>(c, first);
}

// Chunk c of a row: decode_loaded of load_chunk.
template <dtype T>
EFIM_HOST_DEVICE void decode_chunk(const std::uint8_t* row, std::size_t c, float* w, std::size_t* first) noexcept {
  decode_loaded<T>(load_chunk<T>(row, c), c, w, first);
}

// Weights 8g .. 8g + 7 of a row of type T into w.
template <dtype T>
EFIM_HOST_DEVICE void decode8(const std::uint8_t* row, std::size_t g, float* w) noexcept {
  using detail::byte_of;
  using detail::half_to_float;
  using detail::load;
  using detail::small_float;
  if constexpr (chunk_groups<T> == 1) {
    std::size_t first;
    decode_chunk<T>(row, g, w, &first);
  } else if constexpr (T == dtype::q8_0) {  // the group alone: quants 8 (g % 4) .. of block g / 4
    const std::uint8_t* p = row + g / 4 * 34;
    const float d = half_to_float(load<std::uint16_t>(p));
    const std::uint64_t q = detail::load8_16(p + 2 + 8 * (g % 4));
    for (int i = 0; i < 8; ++i) w[i] = small_float<128>(byte_of(q, i) ^ 0x80u) * d;
  } else if constexpr (T == dtype::q4_0) {  // the 8 bytes holding the group's nibbles
    const std::uint8_t* p = row + g / 4 * 18;
    const float d = half_to_float(load<std::uint16_t>(p));
    const std::uint64_t q = detail::load8_16(p + 2 + 8 * (g % 2));
    const int shift = g % 4 < 2 ? 0 : 4;
    for (int i = 0; i < 8; ++i) w[i] = small_float<8>((byte_of(q, i) >> shift) & 15u) * d;
  } else if constexpr (T == dtype::q5_0 || T == dtype::q5_1) {
    constexpr std::size_t bytes = T == dtype::q5_0 ? 22 : 24, head = T == dtype::q5_0 ? 2 : 4;
    const std::uint8_t* p = row + g / 4 * bytes;
    const float d = half_to_float(load<std::uint16_t>(p));
    const std::uint32_t bits = static_cast<std::uint32_t>(load<std::uint16_t>(p + head)) |
                               static_cast<std::uint32_t>(load<std::uint16_t>(p + head + 2)) << 16;
    const std::uint64_t q = detail::load8_16(p + head + 4 + 8 * (g % 2));
    const int shift = g % 4 < 2 ? 0 : 4, at = static_cast<int>(8 * (g % 4));  // (w[0]'s index in the block)
    const float m = T == dtype::q5_1 ? half_to_float(load<std::uint16_t>(p + 2)) : 0.0f;  // q5_1's offset
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t v = ((byte_of(q, i) >> shift) & 15u) | (((bits >> (at + i)) & 1u) << 4);
      if constexpr (T == dtype::q5_0)
        w[i] = small_float<16>(v) * d;
      else
        w[i] = small_float(v) * d + m;
    }
  } else if constexpr (T == dtype::q6_k) {  // the group alone: weights i0 .. i0 + 7 of its super-block
    const std::uint8_t* p = row + g / 32 * 210;
    const std::size_t i0 = g % 32 * 8, h = i0 / 128, r = i0 % 128 / 32, l = i0 % 32;
    const std::uint64_t q = detail::load8_16(p + 64 * h + 32 * (r % 2) + l),
                        qh = detail::load8_16(p + 128 + 32 * h + l);
    const auto sc = static_cast<std::int8_t>(p[192 + i0 / 16]);
    const float ds = half_to_float(load<std::uint16_t>(p + 208)) * static_cast<float>(sc);
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t lo = r < 2 ? byte_of(q, i) & 15u : byte_of(q, i) >> 4;
      const std::uint32_t hi = (byte_of(qh, i) >> (2 * r)) & 3u;
      w[i] = ds * small_float<32>(lo | (hi << 4));
    }
  } else {  // q4_k, q5_k: the group alone (sub-block j, its weights o .. o + 7)
    constexpr std::size_t bytes = T == dtype::q4_k ? 144 : 176, qs_at = T == dtype::q4_k ? 16 : 48;
    const std::uint8_t* p = row + g / 32 * bytes;
    const int l = static_cast<int>(g % 32), j = l / 4, o = (l % 4) * 8;
    std::uint32_t words[3];
    detail::scale_words(p + 4, words);
    float ds, mm;
    detail::sub_block_scale(load<std::uint32_t>(p), words, j, ds, mm);
    const std::uint64_t q = load<std::uint64_t>(p + qs_at + 32 * (j / 2) + o);
    const int shift = j % 2 == 0 ? 0 : 4;
    std::uint64_t qh = 0;
    if constexpr (T == dtype::q5_k) qh = load<std::uint64_t>(p + 16 + o);
    for (int i = 0; i < 8; ++i) {
      std::uint32_t v = (byte_of(q, i) >> shift) & 15u;
      if constexpr (T == dtype::q5_k) v |= ((byte_of(qh, i) >> j) & 1u) << 4;
      w[i] = ds * detail::small_float(v) - mm;
    }
  }
}

// Up to three matrices of one type and shape that one decode launch multiplies by the same x rows (q,
// k and v of a layer; one matrix is one part): part k's rows[k] weight rows start at w[k], its products
// go to y[k] (m, rows[k]) with bias[k] (or none).
struct decode_parts {
  static constexpr int max = 3;
  const std::uint8_t* w[max] = {};
  float* y[max] = {};
  const float* bias[max] = {};
  std::size_t rows[max] = {};
  unsigned first_block[max] = {};  // part k's first block of `warps` warps (one a row) in the launch
  int count = 0;
  int warps = 0;  // a block's (the kernel's policy)
  // Parts from `second` on are of a launch's second weight type (quant_decode_int8_pair: q, k of one
  // k-quant and v of q6_k, as llama.cpp's mixes give half the layers); `max`: none.
  int second = max;

  // Part `count`: its blocks of `block_warps` rows follow the earlier parts'.
  void add(const void* weights, std::size_t n, float* out, const float* b, int block_warps) {
    require(count < max, errc::invalid_argument, "decode_parts: at most three matrices a launch");
    require(block_warps > 0 && (count == 0 || block_warps == warps), errc::invalid_argument,
            "decode_parts: blocks of one size");
    warps = block_warps;
    const std::size_t first = blocks();
    require(n <= (0x7FFFFFFFull - first) * static_cast<std::size_t>(warps), errc::invalid_argument,
            "decode_parts: too many rows for the grid (2^31 - 1 blocks)");
    w[count] = static_cast<const std::uint8_t*>(weights), y[count] = out, bias[count] = b, rows[count] = n;
    first_block[count] = static_cast<unsigned>(first);
    ++count;
  }
  // The part block b of the launch works in (its warps take rows (b - first_block[part]) * warps + 0,
  // 1, ... of it): the last whose first block is at most b.
  EFIM_HOST_DEVICE int part_of(unsigned b) const noexcept { return last_started<max - 1>(b); }
  // Element `part` of one of the arrays, chosen by comparing part with each index in turn. (In a
  // kernel, the parts are a parameter: indexed by a value known only at run time, an array of them is
  // first copied to the thread's stack, 120 bytes a thread in the decode kernels (ptxas -v); a chain of
  // choices among constant indices reads the parameter where it is.)
  template <int K = max - 1, class V>
  EFIM_HOST_DEVICE static V pick(const V (&a)[max], int part) noexcept {
    if constexpr (K == 0)
      return a[0];
    else
      return part == K ? a[K] : pick<K - 1>(a, part);
  }
  // The row of `part` that warp `warp` of block b takes (past the part's rows: none, the warp idles),
  // for parts added with blocks of Warps warps (the kernel's policy, a constant to it).
  template <int Warps>
  EFIM_HOST_DEVICE std::size_t row_of(unsigned b, int part, unsigned warp) const noexcept {
    return static_cast<std::size_t>(b - pick(first_block, part)) * static_cast<std::size_t>(Warps) + warp;
  }
  // The launch's blocks.
  [[nodiscard]] std::size_t blocks() const noexcept {
    if (count == 0) return 0;
    const auto per = static_cast<std::size_t>(warps);
    return first_block[count - 1] + (rows[count - 1] + per - 1) / per;
  }

 private:
  // part_of: the last of parts 0 .. K whose first block is at most b (constant indices, as pick).
  template <int K>
  EFIM_HOST_DEVICE int last_started(unsigned b) const noexcept {
    if constexpr (K == 0)
      return 0;
    else
      return K < count && b >= first_block[K] ? K : last_started<K - 1>(b);
  }
};

// How the tensor-core tiles (quant_tiles.cuh) stage a step of K columns of a block of Rows weight rows
// with Threads threads: thread t's chunk j (j < chunks) is chunk chunk(t, j) of the step in the block's
// row row(t, j) (consecutive threads, consecutive chunks of a row), the row's chunk in_row(k0, t, j);
// decoded (decode_loaded), group g goes to column first[g] - k0 of the step. A chunk not `live` (its
// row past the matrix's, or its columns past cols) stages zeros at columns span * chunk(t, j) on.
// Host and device: the host tests check that a step stages every weight once, as dequantize_row.
template <dtype T, int K, int Rows, int Threads>
struct tile_staging {
  static constexpr int span = 8 * chunk_groups<T>;  // weights a chunk
  static constexpr int per_row = K / span, chunks = Rows * per_row / Threads;
  static_assert(K % 128 == 0, "steps of whole chunks of every type (q4_k's four cover 128 weights)");
  static_assert(Rows * per_row % Threads == 0, "every thread the same number of chunks a step");

  EFIM_HOST_DEVICE static constexpr int row(int t, int j) noexcept { return (t + j * Threads) / per_row; }
  EFIM_HOST_DEVICE static constexpr int chunk(int t, int j) noexcept { return (t + j * Threads) % per_row; }
  EFIM_HOST_DEVICE static constexpr std::size_t in_row(std::size_t k0, int t, int j) noexcept {
    return k0 / span + static_cast<std::size_t>(chunk(t, j));
  }
  // For a block whose first row is r0 of a matrix of `rows` rows and `cols` columns.
  EFIM_HOST_DEVICE static constexpr bool live(std::size_t r0, std::size_t rows, std::size_t k0, std::size_t cols, int t,
                                              int j) noexcept {
    return r0 + static_cast<std::size_t>(row(t, j)) < rows && k0 + static_cast<std::size_t>(span * chunk(t, j)) < cols;
  }
};

// Chunks whose bytes a lane of the decode product loads before it decodes the first of them.
inline constexpr int chunks_in_flight = 4;

// The chunk of a row that step v of the decode products' walk reads (a row of `chunks` chunks): v
// itself, but for the types whose blocks alternate between 4- and 2-byte aligned starts (in a row of an
// even number of them: q6_k's 210 bytes, q8_0's 34, q4_0's 18, q5_0's 22; walk_block_chunks: a block's
// chunks): each run of 64 chunks is walked even blocks first, then odd ones (q6_k: super-blocks 0, 2, 4
// and 6 of a run of 8, then 1, 3, 5 and 7), so that the 32 lanes of a warp read blocks of one alignment
// together (load8_16_uniform, load_words_uniform) in a whole run, and in a last, shorter run in all its
// steps but the one where its even blocks end.
template <dtype T>
inline constexpr std::size_t walk_block_chunks = T == dtype::q6_k                                           ? 8
                                                 : T == dtype::q8_0 || T == dtype::q4_0 || T == dtype::q5_0 ? 1
                                                                                                            : 0;

template <dtype T>
EFIM_HOST_DEVICE std::size_t walk_chunk(std::size_t v, std::size_t chunks) noexcept {
  constexpr std::size_t P = walk_block_chunks<T>;  // chunks a block (0: in order)
  if constexpr (P != 0) {
    const std::size_t run = v / 64, w = v % 64;
    const std::size_t blocks = ((run + 1) * 64 > chunks ? chunks - run * 64 : 64) / P;  // the run's
    const std::size_t even = (blocks + 1) / 2 * P;  // chunks of its even blocks, walked first
    return run * 64 + (w < even ? 2 * (w / P) * P + w % P : (2 * ((w - even) / P) + 1) * P + w % P);
  } else {
    (void)chunks;
    return v;
  }
}

// A lane's walk over a row of `chunks` chunks in the decode products: steps lane, lane + lanes, ... in
// turn, each reading chunk c = walk_chunk(step), use(bytes, c) for each; the bytes of chunks_in_flight
// of them are loaded before the first is handed on (so that on the device their loads are in flight
// together), the order stays this one.
template <dtype T, class F>
EFIM_HOST_DEVICE void for_lane_chunks(const std::uint8_t* row, std::size_t chunks, int lane, int lanes,
                                      F&& use) noexcept {
  constexpr int U = chunks_in_flight;
  const std::size_t stride = static_cast<std::size_t>(lanes);
  for (std::size_t c0 = static_cast<std::size_t>(lane); c0 < chunks; c0 += U * stride) {
    chunk_bytes b[U];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < U; ++u)
      if (c0 + u * stride < chunks) b[u] = load_chunk<T>(row, walk_chunk<T>(c0 + u * stride, chunks));
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < U; ++u) {
      const std::size_t v = c0 + u * stride;
      if (v >= chunks) break;
      use(b[u], walk_chunk<T>(v, chunks));
    }
  }
}

// What lane `lane` of a warp of `lanes` adds to the dot products of one weight row with m x rows (m at
// most M; the CUDA backend's decode product, kernels/cuda/quant_matmul.cuh, one warp per weight row):
// its chunks (for_lane_chunks), each decoded once, then each of its groups multiplied into every x
// row's sum, eight fused multiply-adds in order. x rows are `cols` floats apart (on the device,
// 16-byte aligned); acc holds the m sums, added to.
template <dtype T, int M>
EFIM_HOST_DEVICE void lane_dots(const std::uint8_t* row, std::size_t cols, const float* x, int m, int lane, int lanes,
                                float* acc) noexcept {
  constexpr int C = chunk_groups<T>;
  for_lane_chunks<T>(row, cols / (8 * C), lane, lanes, [&](const chunk_bytes& b, std::size_t c) {
    float w[8 * C];
    std::size_t first[C];
    decode_loaded<T>(b, c, w, first);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int g = 0; g < C; ++g) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int i = 0; i < M; ++i) {
        if (i >= m) break;
        const float* xi = x + static_cast<std::size_t>(i) * cols + first[g];
        float xv[8];
#if defined(__CUDA_ARCH__)
        const float4 lo = reinterpret_cast<const float4*>(xi)[0], hi = reinterpret_cast<const float4*>(xi)[1];
        xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w, xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z,
        xv[7] = hi.w;
#else
        std::memcpy(xv, xi, sizeof xv);
#endif
        float a = acc[i];
        for (int k = 0; k < 8; ++k) a = fmaf(w[8 * g + k], xv[k], a);
        acc[i] = a;
      }
    }
  });
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

// visit_kept, and f16, bf16 and f32 too: the types decoded in registers (register_decoded_type).
template <class F>
decltype(auto) visit_decoded(dtype t, F&& f) {
  switch (t) {
    case dtype::f16:
      return f(std::integral_constant<dtype, dtype::f16>{});
    case dtype::bf16:
      return f(std::integral_constant<dtype, dtype::bf16>{});
    case dtype::f32:
      return f(std::integral_constant<dtype, dtype::f32>{});
    default:
      return visit_kept(t, std::forward<F>(f));
  }
}

// A warp's result as the device computes it, for the host's tests: lane_sums(lane, sums) adds lane
// `lane`'s part of the m (at most 8) x rows' sums into sums, and the 32 lanes' parts are added as
// warp_sum adds them, into out.
template <class F>
void emulate_warp(int m, F&& lane_sums, float (&out)[8]) {
  float lanes[8][32] = {};
  for (int lane = 0; lane < 32; ++lane) {
    float sums[8] = {};
    lane_sums(lane, sums);
    for (int i = 0; i < m; ++i) lanes[i][lane] = sums[i];
  }
  for (int i = 0; i < m; ++i) out[i] = warp_sum(lanes[i]);
}

// The decode product of one weight row of type t (register_decoded_type) with m (at most 8) x rows as
// the device computes it (lane_dots in 32 lanes, then the warp's sum), for the host's tests.
inline void warp_dots(dtype t, const std::uint8_t* row, std::size_t cols, const float* x, int m, float (&out)[8]) {
  visit_decoded(t, [&](auto type) {
    emulate_warp(m, [&](int lane, float* sums) { lane_dots<decltype(type)::value, 8>(row, cols, x, m, lane, 32, sums); },
                 out);
  });
}

// decode8 for a type known at run time (host code and tests).
inline void decode8(dtype t, const std::uint8_t* row, std::size_t g, float* w) {
  visit_decoded(t, [&](auto type) { decode8<decltype(type)::value>(row, g, w); });
}

}  // namespace efim::kernels::quant
