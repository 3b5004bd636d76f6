#pragma once
// The CUDA backend's integer decode product (kernels::products::int8): block-quantized weights as the
// file stores them against activations rounded to 8 bits, multiplied four at a time by DP4A, as
// llama.cpp's CUDA build multiplies them. Host and device code (EFIM_HOST_DEVICE), so that the host
// tests emulate the device's arithmetic bit for bit and compare it with the host's integer products.
//
// The activations are rounded as the host's int8 products round them (kernels::matmul with
// products::int8): per 32 for q8_0, q4_0, q5_0 and q5_1 (kquant::block_q8_32), per 256 for the
// k-quants (kquant::block_q8_k), so every integer sum is the host's. They are held planar (x8_rows):
// the quants of each row (16-byte aligned), one f32 scale per 32 or 256, and for q4_k and q5_k the
// sums of each 16 quants (for the mins).
//
// A lane of the warp that multiplies one weight row takes the decode product's chunks (quant_groups.hpp:
// the same loads) in the same order, and turns each into signed 8-bit weights (the quant less its bias:
// q8_0 as stored, q4_0 - 8, q5_0 - 16, q6_k - 32; q5_1, q4_k and q5_k unsigned, their mins apart):
//   32-weight chunks of q8_0, q4_0, q5_0, q5_1 (a block each): isum = DP4A over the 32; acc = fma(d *
//     dx, isum, acc), q5_1 then acc = fma(m * dx, sum(a), acc);
//   q6_k chunks (8 weights of each quarter of a half super-block): isum = the sum over the quarters of
//     their scale times DP4A over their 8; acc = fma(d * dx, isum, acc);
//   q4_k / q5_k chunks (16 weights of each of two sub-blocks): isum = sc0 * dot0 + sc1 * dot1 and
//     msum = mn0 * bsum0 + mn1 * bsum1; acc = fma(d * dx, isum, acc), then fma(-(dmin * dx), msum, acc).
// So each float step covers 32 weights where the host takes one per block or super-block: the
// integers are the host's, the float sums are not in its order (the tests bound the difference).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "efim/core/config.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/float16.hpp"
#include "efim/core/kquants.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"

namespace efim::kernels::quant {

// Weights that share an activation scale: 256 for the k-quants (q8_K), 32 for the rest (q8_0 / q8_1).
constexpr std::size_t x8_span(dtype t) noexcept {
  return t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k ? 256 : 32;
}

// m rows of activations rounded to 8 bits, `cols` apart (a multiple of 32): row i's quants at
// q + i * cols, its scales at d + i * (cols / x8_span), the sums of each 16 of its quants at
// sums + i * (cols / 16) (filled for the k-quants; q6_k does not read them).
struct x8_rows {
  const std::int8_t* q = nullptr;
  const float* d = nullptr;
  const std::int32_t* sums = nullptr;
  std::size_t cols = 0;
};

// Bytes of the planar arrays for m rows of cols (any type): the quants, then the scales (per 32, the
// most), then the sums, each 16-byte aligned.
constexpr std::size_t x8_bytes(std::size_t m, std::size_t cols) noexcept {
  const auto up16 = [](std::size_t n) { return (n + 15) / 16 * 16; };
  return up16(m * cols) + up16(m * (cols / 32) * 4) + up16(m * (cols / 16) * 4);
}
// Where the scales and the sums start in such a workspace (offsets from its start).
constexpr std::size_t x8_scales_at(std::size_t m, std::size_t cols) noexcept { return (m * cols + 15) / 16 * 16; }
constexpr std::size_t x8_sums_at(std::size_t m, std::size_t cols) noexcept {
  return x8_scales_at(m, cols) + (m * (cols / 32) * 4 + 15) / 16 * 16;
}

// The host's copy: x (m, cols) rounded as the host's int8 products round it for weights of type t
// (kquant::quantize into block_q8_32 or block_q8_k), in the planar arrays the device fills (the sums
// for the k-quants only, zero otherwise).
struct x8_host {
  std::vector<std::int8_t> q;
  std::vector<float> d;
  std::vector<std::int32_t> sums;
  std::size_t cols = 0;
  [[nodiscard]] x8_rows view() const noexcept { return {q.data(), d.data(), sums.data(), cols}; }
};

inline x8_host make_x8(dtype t, const float* x, std::size_t m, std::size_t cols) {
  const std::size_t span = x8_span(t), blocks = cols / span;
  x8_host r;
  r.cols = cols;
  r.q.resize(m * cols);
  r.d.resize(m * blocks);
  r.sums.resize(m * (cols / 16));
  for (std::size_t i = 0; i < m * blocks; ++i) {
    const float* xb = x + i * span;
    std::int8_t* qb = r.q.data() + i * span;
    if (span == 256) {
      kquant::block_q8_k b;
      kquant::quantize(xb, b);
      std::memcpy(qb, b.qs, 256);
      r.d[i] = b.d;
      for (std::size_t j = 0; j < 16; ++j) r.sums[16 * i + j] = b.bsums[j];
    } else {
      kquant::block_q8_32 b;
      kquant::quantize(xb, b);
      std::memcpy(qb, b.qs, 32);
      r.d[i] = b.d;
    }
  }
  return r;
}

namespace detail {

// Four signed bytes of a times those of b, added to c (DP4A on the device).
EFIM_HOST_DEVICE std::int32_t dp4a(std::uint32_t a, std::uint32_t b, std::int32_t c) noexcept {
#if defined(__CUDA_ARCH__)
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<std::int32_t>(static_cast<std::int8_t>(a >> (8 * i))) *
         static_cast<std::int8_t>(b >> (8 * i));
  return c;
#endif
}

// Each byte of a less the same byte of b, modulo 256 (no borrow between bytes).
EFIM_HOST_DEVICE std::uint32_t sub_bytes(std::uint32_t a, std::uint32_t b) noexcept {
#if defined(__CUDA_ARCH__)
  return __vsub4(a, b);
#else
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFFu) << (8 * i);
  return r;
#endif
}

// Bits 0..3 of `bits` as bit 4 of four bytes (q5_0 / q5_1's fifth bits).
EFIM_HOST_DEVICE std::uint32_t bits_to_bytes(std::uint32_t bits) noexcept {
  return ((bits & 1u) << 4) | ((bits & 2u) << 11) | ((bits & 4u) << 18) | ((bits & 8u) << 25);
}

// Eight activation quants (8-byte aligned) as two words; sixteen (16-byte aligned) as four.
EFIM_HOST_DEVICE void load_x8(const std::int8_t* p, std::uint32_t (&v)[2]) noexcept {
#if defined(__CUDA_ARCH__)
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = w.x, v[1] = w.y;
#else
  std::memcpy(v, p, sizeof v);
#endif
}
EFIM_HOST_DEVICE void load_x16(const std::int8_t* p, std::uint32_t (&v)[4]) noexcept {
#if defined(__CUDA_ARCH__)
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
#else
  std::memcpy(v, p, sizeof v);
#endif
}

EFIM_HOST_DEVICE std::uint32_t low_word(std::uint64_t v) noexcept { return static_cast<std::uint32_t>(v); }
EFIM_HOST_DEVICE std::uint32_t high_word(std::uint64_t v) noexcept { return static_cast<std::uint32_t>(v >> 32); }

}  // namespace detail

// A chunk's weights as signed bytes, and what its float steps need: a block of q8_0, q4_0, q5_0 or q5_1
// fills w[0..7] (weights 4 j .. 4 j + 3 in w[j]);
// q4_k / q5_k fill w[0..3] (sub-block 2 pair, its weights 16 half .. 16 half + 15) and w[4..7]
// (sub-block 2 pair + 1, the same weights); q6_k fills w[2 r], w[2 r + 1] with quarter r's 8. d: the
// scale (k-quants: d times nothing yet), m: q5_1's offset or the k-quants' dmin; sc / mn: the integer
// scales and mins (q4_k / q5_k: sc[0..1] and mn[0..1]; q6_k: sc[r] for quarter r).
struct chunk8 {
  std::uint32_t w[8] = {};
  float d = 0, m = 0;
  std::int32_t sc[4] = {}, mn[2] = {};
};

template <dtype T>
EFIM_HOST_DEVICE chunk8 int8_loaded(const chunk_bytes& b, std::size_t c) noexcept {
  using detail::high_word;
  using detail::low_word;
  using detail::sub_bytes;
  chunk8 k;
  if constexpr (T == dtype::q8_0) {  // a block: w[j] its quants 4 j .. 4 j + 3
    k.d = detail::half_to_float(static_cast<std::uint16_t>(b.s0));
    const std::uint64_t q[4] = {b.q0, b.q1, b.h0, b.h1};
    for (int j = 0; j < 4; ++j) k.w[2 * j] = low_word(q[j]), k.w[2 * j + 1] = high_word(q[j]);
  } else if constexpr (T == dtype::q4_0 || T == dtype::q5_0 || T == dtype::q5_1) {
    // a block: w[j] weights 4 j .. 4 j + 3 from the low nibbles of bytes 4 j .. (j < 4), w[4 + j] weights
    // 16 + 4 j .. from their high nibbles; q5: fifth bit i of s1 on weight i
    k.d = detail::half_to_float(static_cast<std::uint16_t>(b.s0 & 0xFFFFu));
    const std::uint32_t q[4] = {low_word(b.q0), high_word(b.q0), low_word(b.q1), high_word(b.q1)};
    for (int j = 0; j < 4; ++j) {
      std::uint32_t lo = q[j] & 0x0F0F0F0Fu, hi = (q[j] >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == dtype::q4_0) {
        k.w[j] = sub_bytes(lo, 0x08080808u), k.w[4 + j] = sub_bytes(hi, 0x08080808u);
      } else {
        lo |= detail::bits_to_bytes(b.s1 >> (4 * j)), hi |= detail::bits_to_bytes(b.s1 >> (16 + 4 * j));
        if constexpr (T == dtype::q5_0)
          k.w[j] = sub_bytes(lo, 0x10101010u), k.w[4 + j] = sub_bytes(hi, 0x10101010u);
        else
          k.w[j] = lo, k.w[4 + j] = hi;
      }
    }
    if constexpr (T == dtype::q5_1) k.m = detail::half_to_float(static_cast<std::uint16_t>(b.s0 >> 16));
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {
    const int pair = static_cast<int>(c % 8) / 2;
    const std::uint32_t words[3] = {b.s1, b.s2, b.s3};
    std::uint32_t sc, mn;
    detail::scale_min_pair(words, pair, sc, mn);
    k.sc[0] = static_cast<std::int32_t>(sc & 0xFFu), k.sc[1] = static_cast<std::int32_t>(sc >> 8);
    k.mn[0] = static_cast<std::int32_t>(mn & 0xFFu), k.mn[1] = static_cast<std::int32_t>(mn >> 8);
    k.d = detail::half_to_float(static_cast<std::uint16_t>(b.s0 & 0xFFFFu));
    k.m = detail::half_to_float(static_cast<std::uint16_t>(b.s0 >> 16));
    const std::uint32_t q[4] = {low_word(b.q0), high_word(b.q0), low_word(b.q1), high_word(b.q1)};
    const std::uint32_t h[4] = {low_word(b.h0), high_word(b.h0), low_word(b.h1), high_word(b.h1)};
    for (int i = 0; i < 4; ++i) {
      k.w[i] = q[i] & 0x0F0F0F0Fu;
      k.w[4 + i] = (q[i] >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == dtype::q5_k) {
        k.w[i] |= ((h[i] >> (2 * pair)) & 0x01010101u) << 4;
        k.w[4 + i] |= ((h[i] >> (2 * pair + 1)) & 0x01010101u) << 4;
      }
    }
  } else if constexpr (T == dtype::q6_k) {  // quarter r: low bits in q0 (r even) or q1, r < 2 the low nibbles
    const int l = static_cast<int>(c % 4) * 8;
    for (int r = 0; r < 4; ++r) {
      const std::uint64_t q = r % 2 == 0 ? b.q0 : b.q1;
      const std::uint64_t lo = r < 2 ? q & 0x0F0F0F0F0F0F0F0Full : (q >> 4) & 0x0F0F0F0F0F0F0F0Full;
      const std::uint64_t hi = ((b.h0 >> (2 * r)) & 0x0303030303030303ull) << 4;
      k.w[2 * r] = sub_bytes(low_word(lo | hi), 0x20202020u);
      k.w[2 * r + 1] = sub_bytes(high_word(lo | hi), 0x20202020u);
      k.sc[r] = static_cast<std::int8_t>(static_cast<std::uint8_t>(b.h1 >> (8 * (2 * r + l / 16))));
    }
    k.d = detail::half_to_float(static_cast<std::uint16_t>(b.s1));
  } else {
    static_assert(T == dtype::q8_0, "int8_loaded: not a type the device keeps quantized");
  }
  return k;
}

// The float steps of chunk k (weights from `first` on) against x row i, added to acc.
template <dtype T>
EFIM_HOST_DEVICE float int8_chunk_step(const chunk8& k, std::size_t first, const x8_rows& x, std::size_t i,
                                       float acc) noexcept {
  constexpr std::size_t span = x8_span(T);
  const std::int8_t* a = x.q + i * x.cols + first;
  const float dx = x.d[i * (x.cols / span) + first / span];
  if constexpr (block32_type<T>) {  // a block's 32 weights against its 32 activations
    std::uint32_t v0[4], v1[4];
    detail::load_x16(a, v0);
    detail::load_x16(a + 16, v1);
    std::int32_t isum = 0;
    for (int j = 0; j < 4; ++j) isum = detail::dp4a(k.w[j], v0[j], isum);
    for (int j = 0; j < 4; ++j) isum = detail::dp4a(k.w[4 + j], v1[j], isum);
    acc = fmaf(k.d * dx, static_cast<float>(isum), acc);
    if constexpr (T == dtype::q5_1) {
      std::int32_t asum = 0;
      for (int j = 0; j < 4; ++j) asum = detail::dp4a(0x01010101u, v0[j], asum);
      for (int j = 0; j < 4; ++j) asum = detail::dp4a(0x01010101u, v1[j], asum);
      acc = fmaf(k.m * dx, static_cast<float>(asum), acc);
    }
  } else if constexpr (T == dtype::q6_k) {  // 8 weights at first + 32 r for each quarter r: one integer sum
    // (|isum| <= 4 * 128 * 8 * 32 * 127 < 2^24: exact in the float step)
    std::int32_t isum = 0;
    for (int r = 0; r < 4; ++r) {
      std::uint32_t v[2];
      detail::load_x8(a + 32 * r, v);
      isum += k.sc[r] * detail::dp4a(k.w[2 * r + 1], v[1], detail::dp4a(k.w[2 * r], v[0], 0));
    }
    acc = fmaf(k.d * dx, static_cast<float>(isum), acc);
  } else {  // q4_k / q5_k: 16 weights at first, 16 at first + 32
    std::uint32_t v0[4], v1[4];
    detail::load_x16(a, v0);
    detail::load_x16(a + 32, v1);
    std::int32_t dot0 = 0, dot1 = 0;
    for (int j = 0; j < 4; ++j) {
      dot0 = detail::dp4a(k.w[j], v0[j], dot0);
      dot1 = detail::dp4a(k.w[4 + j], v1[j], dot1);
    }
    const std::int32_t* s = x.sums + i * (x.cols / 16) + first / 16;
    const std::int32_t isum = k.sc[0] * dot0 + k.sc[1] * dot1, msum = k.mn[0] * s[0] + k.mn[1] * s[2];
    acc = fmaf(k.d * dx, static_cast<float>(isum), acc);
    acc = fmaf(-(k.m * dx), static_cast<float>(msum), acc);
  }
  return acc;
}

// What lane `lane` of a warp of `lanes` adds to the integer dot products of one weight row with m x
// rows (m at most M; the CUDA backend's int8 decode product, one warp per weight row): the chunks
// lane_dots takes (for_lane_chunks), each turned into bytes once and stepped against every x row.
// acc holds the m sums, added to.
template <dtype T, int M>
EFIM_HOST_DEVICE void lane_idots(const std::uint8_t* row, const x8_rows& x, int m, int lane, int lanes,
                                 float* acc) noexcept {
  for_lane_chunks<T>(row, x.cols / (8 * chunk_groups<T>), lane, lanes, [&](const chunk_bytes& b, std::size_t c) {
    const chunk8 k = int8_loaded<T>(b, c);
    std::size_t first[chunk_groups<T>];
    chunk_first<T>(c, first);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < M; ++i) {
      if (i >= m) break;
      acc[i] = int8_chunk_step<T>(k, first[0], x, static_cast<std::size_t>(i), acc[i]);
    }
  });
}

// The int8 decode product of one weight row of type t with m (at most 8) x rows as the device
// computes it (lane_idots in 32 lanes, then the warp's sum), for the host's tests.
inline void warp_idots(dtype t, const std::uint8_t* row, const x8_rows& x, int m, float (&out)[8]) {
  visit_kept(t, [&](auto type) {
    emulate_warp(m, [&](int lane, float* sums) { lane_idots<decltype(type)::value, 8>(row, x, m, lane, 32, sums); },
                 out);
  });
}

}  // namespace efim::kernels::quant
