#pragma once
// ggml's k-quants (q4_k, q5_k, q6_k: super-blocks of 256 weights), q5_0 and q5_1 (blocks of 32: what
// llama.cpp falls back to where a q4_k or q5_k row is not a whole number of super-blocks), as GGUF
// files store them: the block layouts, exact dequantizers, and reference quantizers whose bytes equal llama.cpp's
// (its `quantize` without an importance matrix) for the same f32 input.
//
// - q4_k: 8 sub-blocks of 32 weights, each with a 6-bit scale and a 6-bit min, times the super-block's
//   f16 d and dmin: w = (d * sc) * q - (dmin * m), q in 0..15.
// - q5_k: the same with 5-bit quants (a fifth bit per weight in qh), q in 0..31.
// - q6_k: 16 sub-blocks of 16 weights, each with an 8-bit signed scale, times the f16 d:
//   w = (d * sc) * q, q in -32..31.
// - q5_0: one f16 scale per 32 weights, w = d * (q - 16), q in 0..31.
// - q5_1: an f16 scale and an f16 offset per 32 weights, w = d * q + m, q in 0..31.
//
// Every product here is exact in f32 (at most 11 + 7 + 6 significant bits), so q6_k and q5_0
// dequantize exactly; q4_k, q5_k and q5_1 add the min or offset with one rounding, the same whether a
// kernel computes (d * sc) * q - dmin * m as written or fuses it into one multiply-add (the product is
// exact).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "efim/core/config.hpp"
#include "efim/core/float16.hpp"

namespace efim {

inline constexpr std::size_t qk_k = 256;  // weights per k-quant super-block

struct block_q4_k {
  static constexpr std::size_t weights = qk_k;
  std::uint16_t d, dmin;
  std::uint8_t scales[12];  // 8 scales and 8 mins of 6 bits (scale_min_k4)
  std::uint8_t qs[128];     // 64 weights per 32 bytes: low nibbles the first 32, high nibbles the next
};
struct block_q5_k {
  static constexpr std::size_t weights = qk_k;
  std::uint16_t d, dmin;
  std::uint8_t scales[12];
  std::uint8_t qh[32];   // bit 2i (2i + 1) of qh[l]: the fifth bit of weight l of sub-block 2i (2i + 1)
  std::uint8_t qs[128];  // the low 4 bits, as in q4_k
};
struct block_q6_k {
  static constexpr std::size_t weights = qk_k;
  std::uint8_t ql[128];   // low 4 bits
  std::uint8_t qh[64];    // high 2 bits
  std::int8_t scales[16];
  std::uint16_t d;
};
struct block_q5_0 {
  static constexpr std::size_t weights = 32;
  std::uint16_t d;
  std::uint8_t qh[4];   // bit j: the fifth bit of weight j
  std::uint8_t qs[16];  // weight j low nibble of qs[j], weight j + 16 high nibble
};
struct block_q5_1 {
  static constexpr std::size_t weights = 32;
  std::uint16_t d, m;
  std::uint8_t qh[4];   // as in q5_0
  std::uint8_t qs[16];
};
static_assert(sizeof(block_q4_k) == 144 && sizeof(block_q5_k) == 176 && sizeof(block_q6_k) == 210 &&
              sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24);

namespace kquant {

// Scale and min j (0..7) of a q4_k / q5_k super-block: j < 4 in the low 6 bits of bytes j and j + 4;
// j >= 4 in the nibbles of byte j + 4, with their top 2 bits in the top bits of bytes j - 4 and j.
inline void scale_min(const std::uint8_t* scales, std::size_t j, std::uint8_t& sc, std::uint8_t& m) noexcept {
  if (j < 4) {
    sc = scales[j] & 63;
    m = scales[j + 4] & 63;
  } else {
    sc = static_cast<std::uint8_t>((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
    m = static_cast<std::uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

// Rounds to the nearest integer, ties to even, for |x| < 2^22 (adding 1.5 * 2^23 leaves the integer in
// the low mantissa bits).
inline int nearest_int(float x) noexcept {
  const float shifted = x + 12582912.0f;
  std::int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

// ---- dequantizers (256 or 32 weights) ----

// q4_k and q5_k (qh: the fifth bits, or null): w = (d * sc) * q - (dmin * m) per sub-block.
inline void dequantize_scale_min(std::uint16_t d16, std::uint16_t dmin16, const std::uint8_t* scales,
                                 const std::uint8_t* qs, const std::uint8_t* qh, float* y) noexcept {
  const float d = f16_to_f32(d16), dmin = f16_to_f32(dmin16);
  for (std::size_t j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    scale_min(scales, j, sc, m);
    const float ds = d * static_cast<float>(sc), mm = dmin * static_cast<float>(m);
    const std::uint8_t* q = qs + 32 * (j / 2);
    for (std::size_t l = 0; l < 32; ++l) {
      int v = j % 2 == 0 ? q[l] & 0xF : q[l] >> 4;
      if (qh != nullptr) v |= ((qh[l] >> j) & 1) << 4;
      y[32 * j + l] = ds * static_cast<float>(v) - mm;
    }
  }
}

inline void dequantize(const block_q4_k& b, float* y) noexcept {
  dequantize_scale_min(b.d, b.dmin, b.scales, b.qs, nullptr, y);
}

inline void dequantize(const block_q5_k& b, float* y) noexcept {
  dequantize_scale_min(b.d, b.dmin, b.scales, b.qs, b.qh, y);
}

// Weight i of a q6_k super-block, as a quant in -32..31: 128-weight halves h, each of four runs of 32;
// run r's low nibbles are ql[64h + l] (r 0, 1: low nibble of bytes 0..63; r 2, 3: high nibble) and its
// high 2 bits are bits 2r, 2r + 1 of qh[32h + l].
inline int q6_quant(const block_q6_k& b, std::size_t i) noexcept {
  const std::size_t h = i / 128, r = i % 128 / 32, l = i % 32;
  const std::uint8_t low = b.ql[64 * h + 32 * (r % 2) + l];
  const int lo = r < 2 ? low & 0xF : low >> 4;
  const int hi = (b.qh[32 * h + l] >> (2 * r)) & 3;
  return (lo | (hi << 4)) - 32;
}

inline void dequantize(const block_q6_k& b, float* y) noexcept {
  const float d = f16_to_f32(b.d);
  for (std::size_t i = 0; i < qk_k; ++i)
    y[i] = d * static_cast<float>(b.scales[i / 16]) * static_cast<float>(q6_quant(b, i));
}

inline void dequantize(const block_q5_0& b, float* y) noexcept {
  const float d = f16_to_f32(b.d);
  std::uint32_t qh;
  std::memcpy(&qh, b.qh, sizeof qh);
  for (std::size_t j = 0; j < 16; ++j) {
    const int lo = (b.qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo - 16) * d;
    y[j + 16] = static_cast<float>(hi - 16) * d;
  }
}

inline void dequantize(const block_q5_1& b, float* y) noexcept {
  const float d = f16_to_f32(b.d), m = f16_to_f32(b.m);
  std::uint32_t qh;
  std::memcpy(&qh, b.qh, sizeof qh);
  for (std::size_t j = 0; j < 16; ++j) {
    const int lo = (b.qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo) * d + m;
    y[j + 16] = static_cast<float>(hi) * d + m;
  }
}

// ---- reference quantizers (llama.cpp's arithmetic, operation by operation) ----

// The weight of largest magnitude among n (the first of equals), signed.
inline float largest_magnitude(const float* x, std::size_t n) noexcept {
  float amax = 0, max = 0;
  for (std::size_t j = 0; j < n; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

// Below this a group is all zeros.
inline constexpr float group_max_eps = 1e-15f;

// Fits x (n weights, importance `w`) as scale * L + min with L in 0..nmax and min <= 0: first the
// range (min, max), then nstep + 1 trial scales (rmin + rdelta * is + nmax) / (max - min), each
// refined by weighted least squares, keeping the smallest weighted squared error. Returns the scale;
// `neg_min` gets -min. L gets the levels, aux is scratch (n).
EFIM_SEPARATE_ROUNDING float fit_scale_min(std::size_t n, int nmax, const float* x, const float* w,
                                           std::uint8_t* L, float& neg_min, std::uint8_t* aux, float rmin,
                                           float rdelta, int nstep) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (std::size_t i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (std::size_t i = 0; i < n; ++i) L[i] = 0;
    neg_min = -min;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<std::uint8_t>(l < 0 ? 0 : l > nmax ? nmax : l);
    const float diff = scale * static_cast<float>(L[i]) + min - x[i];
    best_error += w[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (std::size_t i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = l < 0 ? 0 : l > nmax ? nmax : l;
      aux[i] = static_cast<std::uint8_t>(l);
      const float wl = w[i] * static_cast<float>(l);
      sum_l += wl;
      sum_l2 += wl * static_cast<float>(l);
      sum_xl += wl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float error = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float diff = this_scale * static_cast<float>(aux[i]) + this_min - x[i];
        error += w[i] * (diff * diff);
      }
      if (error < best_error) {
        for (std::size_t i = 0; i < n; ++i) L[i] = aux[i];
        best_error = error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  neg_min = -min;
  return scale;
}

// Fits x (n weights) as scale * (L - nmax) with L - nmax in -nmax..nmax-1, importance x^2: the scale
// -nmax / max (max the weight of largest magnitude) refined by least squares, then 18 nearby trial
// scales, keeping the one whose fit explains most. L gets the levels (L - nmax + nmax).
EFIM_SEPARATE_ROUNDING float fit_symmetric(std::size_t n, int nmax, const float* x, std::int8_t* L) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  const float max = largest_magnitude(x, n);
  if (std::fabs(max) < group_max_eps) {
    for (std::size_t i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  const auto level = [nmax](float v) {
    const int l = nearest_int(v);
    return l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
  };
  float iscale = static_cast<float>(-nmax) / max;
  float sum_lx = 0, sum_l2 = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int l = level(iscale * x[i]);
    L[i] = static_cast<std::int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sum_lx += w * x[i] * static_cast<float>(l);
    sum_l2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  float scale = sum_l2 != 0 ? sum_lx / sum_l2 : 0.0f;
  float best = scale * sum_lx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sum_lx = sum_l2 = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const int l = level(iscale * x[i]);
      const float w = x[i] * x[i];
      sum_lx += w * x[i] * static_cast<float>(l);
      sum_l2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
    if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
      for (std::size_t i = 0; i < n; ++i) L[i] = static_cast<std::int8_t>(level(iscale * x[i]) + nmax);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  return scale;
}

// q4_k and q5_k: each sub-block of 32 fit with importance sqrt(mean x^2) + |x|, the 8 scales and 8
// mins quantized to 6 bits against the largest of each, then every weight requantized against its
// sub-block's rounded scale and min. Returns the levels in L (256).
EFIM_SEPARATE_ROUNDING void quantize_scales_mins(const float* x, int nmax, float rmin, float rdelta, int nstep,
                                                 std::uint16_t& d_out, std::uint16_t& dmin_out,
                                                 std::uint8_t* scales_out, std::uint8_t* L) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  float scales[8], mins[8], weights[32];
  std::uint8_t aux[32];
  float max_scale = 0, max_min = 0;
  for (std::size_t j = 0; j < 8; ++j) {
    const float* xj = x + 32 * j;
    float sum_x2 = 0;
    for (std::size_t l = 0; l < 32; ++l) sum_x2 += xj[l] * xj[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (std::size_t l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xj[l]);
    scales[j] = fit_scale_min(32, nmax, xj, weights, L + 32 * j, mins[j], aux, rmin, rdelta, nstep);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  std::memset(scales_out, 0, 12);
  for (std::size_t j = 0; j < 8; ++j) {
    // (The level is taken modulo 256 before the clamp, as a uint8_t would.)
    std::uint8_t ls = static_cast<std::uint8_t>(nearest_int(inv_scale * scales[j]));
    std::uint8_t lm = static_cast<std::uint8_t>(nearest_int(inv_min * mins[j]));
    ls = ls < 63 ? ls : 63;
    lm = lm < 63 ? lm : 63;
    if (j < 4) {
      scales_out[j] = ls;
      scales_out[j + 4] = lm;
    } else {
      scales_out[j + 4] = static_cast<std::uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      scales_out[j - 4] |= static_cast<std::uint8_t>((ls >> 4) << 6);
      scales_out[j] |= static_cast<std::uint8_t>((lm >> 4) << 6);
    }
  }
  d_out = f32_to_f16(max_scale / 63.0f);
  dmin_out = f32_to_f16(max_min / 63.0f);
  for (std::size_t j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    scale_min(scales_out, j, sc, m);
    const float d = f16_to_f32(d_out) * static_cast<float>(sc);
    if (d == 0) continue;  // the sub-block keeps its fit's levels
    const float dm = f16_to_f32(dmin_out) * static_cast<float>(m);
    for (std::size_t l = 0; l < 32; ++l) {
      const int q = nearest_int((x[32 * j + l] + dm) / d);
      L[32 * j + l] = static_cast<std::uint8_t>(q < 0 ? 0 : q > nmax ? nmax : q);
    }
  }
}

inline void quantize(const float* x, block_q4_k& b) noexcept {
  std::uint8_t L[qk_k];
  quantize_scales_mins(x, 15, -1.0f, 0.1f, 20, b.d, b.dmin, b.scales, L);
  for (std::size_t h = 0; h < 4; ++h)
    for (std::size_t l = 0; l < 32; ++l)
      b.qs[32 * h + l] = static_cast<std::uint8_t>(L[64 * h + l] | (L[64 * h + 32 + l] << 4));
}

inline void quantize(const float* x, block_q5_k& b) noexcept {
  std::uint8_t L[qk_k];
  quantize_scales_mins(x, 31, -0.5f, 0.1f, 15, b.d, b.dmin, b.scales, L);
  std::memset(b.qh, 0, sizeof b.qh);
  for (std::size_t h = 0; h < 4; ++h)
    for (std::size_t l = 0; l < 32; ++l) {
      const std::uint8_t lo = L[64 * h + l], hi = L[64 * h + 32 + l];
      b.qs[32 * h + l] = static_cast<std::uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
      b.qh[l] |= static_cast<std::uint8_t>(((lo >> 4) << (2 * h)) | ((hi >> 4) << (2 * h + 1)));
    }
}

// q6_k: each sub-block of 16 fit symmetrically (fit_symmetric, 32 levels each way), the 16 scales
// quantized to 8 bits against the one of largest magnitude (as -128), then every weight requantized.
EFIM_SEPARATE_ROUNDING void quantize(const float* x, block_q6_k& b) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  std::int8_t L[qk_k];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (std::size_t s = 0; s < 16; ++s) {
    scales[s] = fit_symmetric(16, 32, x + 16 * s, L + 16 * s);
    if (std::fabs(scales[s]) > max_abs_scale) {
      max_abs_scale = std::fabs(scales[s]);
      max_scale = scales[s];
    }
  }
  if (max_abs_scale < group_max_eps) {
    std::memset(&b, 0, sizeof b);
    return;
  }
  const float iscale = -128.0f / max_scale;
  b.d = f32_to_f16(1 / iscale);
  for (std::size_t s = 0; s < 16; ++s) {
    const int q = nearest_int(iscale * scales[s]);
    b.scales[s] = static_cast<std::int8_t>(q < 127 ? q : 127);
  }
  for (std::size_t s = 0; s < 16; ++s) {
    const float d = f16_to_f32(b.d) * static_cast<float>(b.scales[s]);
    if (d == 0) continue;
    for (std::size_t l = 0; l < 16; ++l) {
      const int q = nearest_int(x[16 * s + l] / d);
      L[16 * s + l] = static_cast<std::int8_t>((q < -32 ? -32 : q > 31 ? 31 : q) + 32);
    }
  }
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t l = 0; l < 32; ++l) {
      const std::int8_t* q = L + 128 * h + l;  // runs 0..3 at q[0], q[32], q[64], q[96]
      b.ql[64 * h + l] = static_cast<std::uint8_t>((q[0] & 0xF) | ((q[64] & 0xF) << 4));
      b.ql[64 * h + 32 + l] = static_cast<std::uint8_t>((q[32] & 0xF) | ((q[96] & 0xF) << 4));
      b.qh[32 * h + l] =
          static_cast<std::uint8_t>((q[0] >> 4) | ((q[32] >> 4) << 2) | ((q[64] >> 4) << 4) | ((q[96] >> 4) << 6));
    }
}

// q5_0: the scale is the weight of largest magnitude / -16; each weight x / d + 16.5 truncated, at most 31.
EFIM_SEPARATE_ROUNDING void quantize(const float* x, block_q5_0& b) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  const float d = largest_magnitude(x, 32) / -16;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  b.d = f32_to_f16(d);
  std::uint32_t qh = 0;
  for (std::size_t j = 0; j < 16; ++j) {
    const float scaled_lo = x[j] * id + 16.5f, scaled_hi = x[j + 16] * id + 16.5f;
    const auto lo = static_cast<std::uint8_t>(std::min(31, static_cast<int>(static_cast<std::int8_t>(scaled_lo))));
    const auto hi = static_cast<std::uint8_t>(std::min(31, static_cast<int>(static_cast<std::int8_t>(scaled_hi))));
    b.qs[j] = static_cast<std::uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
    qh |= static_cast<std::uint32_t>((lo >> 4) & 1) << j;
    qh |= static_cast<std::uint32_t>((hi >> 4) & 1) << (j + 16);
  }
  std::memcpy(b.qh, &qh, sizeof qh);
}

// q5_1: d = (max - min) / 31, m = min; each weight (x - min) / d + 0.5 truncated.
EFIM_SEPARATE_ROUNDING void quantize(const float* x, block_q5_1& b) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  float min = x[0], max = x[0];
  for (std::size_t j = 1; j < 32; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  const float d = (max - min) / 31;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  b.d = f32_to_f16(d);
  b.m = f32_to_f16(min);
  std::uint32_t qh = 0;
  for (std::size_t j = 0; j < 16; ++j) {
    const auto lo = static_cast<std::uint8_t>((x[j] - min) * id + 0.5f);
    const auto hi = static_cast<std::uint8_t>((x[j + 16] - min) * id + 0.5f);
    b.qs[j] = static_cast<std::uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
    qh |= static_cast<std::uint32_t>((lo >> 4) & 1) << j;
    qh |= static_cast<std::uint32_t>((hi >> 4) & 1) << (j + 16);
  }
  std::memcpy(b.qh, &qh, sizeof qh);
}

// ---- 8-bit activations (llama.cpp's q8_K), for the integer products ----

// 256 activations as 8-bit integers times one f32 scale: x ~ d * qs[i], with the sums of each 16.
struct block_q8_k {
  float d;
  std::int8_t qs[qk_k];
  std::int16_t bsums[qk_k / 16];
};

// llama.cpp's quantize_row_q8_K for one super-block: the activation of largest magnitude (the first
// of them) maps to -127 (d = its value / -127), the others round to nearest; an all-zero block gets
// d = 0 and zero quants.
EFIM_SEPARATE_ROUNDING void quantize(const float* x, block_q8_k& b) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  float amax = 0, max = 0;
  for (std::size_t j = 0; j < qk_k; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  if (amax == 0) {
    b = {};
    return;
  }
  const float iscale = -127.0f / max;
  for (std::size_t j = 0; j < qk_k; ++j) b.qs[j] = static_cast<std::int8_t>(std::min(127, nearest_int(iscale * x[j])));
  for (std::size_t j = 0; j < qk_k / 16; ++j) {
    int sum = 0;
    for (std::size_t i = 0; i < 16; ++i) sum += b.qs[16 * j + i];
    b.bsums[j] = static_cast<std::int16_t>(sum);
  }
  b.d = 1 / iscale;
}

// 32 activations as 8-bit integers times one scale (llama.cpp's q8_0 and q8_1, for the integer products
// of q8_0, q4_0, q5_0 and q5_1): x ~ d * qs[i]; d is an f16 value (held widened), sum the quants' sum.
struct block_q8_32 {
  float d;
  std::int32_t sum;
  std::int8_t qs[32];
};

// llama.cpp's quantize_row_q8_0 / q8_1 as its x86 builds round (AVX2, AVX-512): amax the largest
// magnitude, d = f16(amax / 127), each x * (127 / amax) rounded to nearest even. An all-zero block
// gets d = 0 and zero quants. Where llama.cpp's bytes depend on its instruction set (inputs not finite,
// or amax so small that 127 / amax overflows): NaN is left out of amax and rounds to 0, the rest is
// clamped to +-127.
EFIM_SEPARATE_ROUNDING void quantize(const float* x, block_q8_32& b) noexcept {
  EFIM_SEPARATE_ROUNDING_BODY
  float amax = 0;
  for (std::size_t j = 0; j < 32; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) amax = ax;
  }
  b.d = f16_to_f32(f32_to_f16(amax / 127.0f));
  const float id = amax != 0 ? 127.0f / amax : 0.0f;
  b.sum = 0;
  for (std::size_t j = 0; j < 32; ++j) {
    float v = x[j] * id;
    v = v == v ? std::min(127.0f, std::max(-127.0f, v)) : 0.0f;
    b.qs[j] = static_cast<std::int8_t>(nearest_int(v));
    b.sum += b.qs[j];
  }
}

}  // namespace kquant
}  // namespace efim
