// Integer products (products::int8, see matmul.hpp) for the types of 32-weight blocks: q8_0, q4_0,
// q5_0 and q5_1 weights against activations rounded to 8 bits per 32 (kquant::block_q8_32, llama.cpp's
// q8_0 / q8_1 rounding). Each block's sum is an integer, exact in any order; then one float step per
// block (two for q5_1), in the order of k, the same on every path (q32_step), so the bits do not depend
// on the path, the tile or the thread.
//
// A block's weights are taken as unsigned bytes u and a bias: the weight is u - bias (q8_0: its byte
// with the sign bit flipped, bias 128; q4_0: the nibble, bias 8; q5_0: 5 bits, bias 16; q5_1: 5 bits,
// no bias, its min m added as m * sum(a)). The block's integer is sum(u a) - bias * sum(a).

template <dtype T>
inline constexpr bool block32_int8 = T == dtype::q8_0 || T == dtype::q4_0 || T == dtype::q5_0 || T == dtype::q5_1;

template <dtype T>
inline constexpr std::int32_t q32_bias = T == dtype::q8_0   ? 128
                                         : T == dtype::q4_0 ? 8
                                         : T == dtype::q5_0 ? 16
                                                            : 0;

// Where a block keeps its quants (qs) and, for q5_0 / q5_1, their fifth bits (qh, bit j for weight j).
template <dtype T>
inline constexpr std::size_t q32_qs = T == dtype::q5_0   ? 6
                                      : T == dtype::q5_1 ? 8
                                                         : 2;
template <dtype T>
inline constexpr std::size_t q32_qh = T == dtype::q5_0 ? 2 : 4;

// The float steps of one block with integer sum(u a) = dot: the same on every path.
template <dtype T>
inline float q32_step(float acc, float d, float mn, const kquant::block_q8_32& a, std::int32_t dot) noexcept {
  acc = std::fma(d * a.d, static_cast<float>(dot - q32_bias<T> * a.sum), acc);
  if constexpr (T == dtype::q5_1) acc = std::fma(mn * a.d, static_cast<float>(a.sum), acc);
  return acc;
}

// A block's u (32 bytes in the order of k), its scale d and (q5_1) its min.
template <dtype T>
inline void q32_unpack(const std::byte* blk, std::uint8_t* u, float& d, float& mn) noexcept {
  std::uint16_t h[2];
  std::memcpy(h, blk, sizeof h);
  d = f16_to_f32(h[0]);
  mn = T == dtype::q5_1 ? f16_to_f32(h[1]) : 0.0f;
  if constexpr (T == dtype::q8_0) {
    for (std::size_t j = 0; j < 32; ++j)
      u[j] = static_cast<std::uint8_t>(std::to_integer<unsigned>(blk[2 + j]) ^ 0x80u);
  } else {
    std::uint32_t qh = 0;
    if constexpr (T != dtype::q4_0) std::memcpy(&qh, blk + q32_qh<T>, sizeof qh);
    for (std::size_t j = 0; j < 16; ++j) {
      const unsigned q = std::to_integer<unsigned>(blk[q32_qs<T> + j]);
      u[j] = static_cast<std::uint8_t>((q & 15u) | (((qh >> j) & 1u) << 4));
      u[j + 16] = static_cast<std::uint8_t>((q >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    }
  }
}

// Rows [r0, r1) of y = x w^T, one output at a time (the reference every path is tested against).
template <dtype T>
inline void matmul_q32_reference(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                                 std::size_t r1, float* y, accumulate acc) {
  const std::size_t nb = w.cols / 32, rb = row_bytes(T, w.cols);
  std::uint8_t u[32];
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t i = 0; i < m; ++i) {
      float sum = 0;
      for (std::size_t b = 0; b < nb; ++b) {
        float d, mn;
        q32_unpack<T>(w.data + r * rb + b * info(T).bytes, u, d, mn);
        const kquant::block_q8_32& a = xq[i * nb + b];
        std::int32_t dot = 0;
        for (std::size_t j = 0; j < 32; ++j) dot += u[j] * a.qs[j];
        sum = q32_step<T>(sum, d, mn, a, dot);
      }
      float& out = y[i * w.rows + r];
      out = acc == accumulate::yes ? out + sum : sum;
    }
}

#if EFIM_K_AVX512 || EFIM_K_AVX2
// AVX2, and AVX-512 with or without VNNI, in 256-bit registers. Few x rows (decode): 8 weight rows at a
// time are streamed as stored, each block unpacked in registers and multiplied by each x row's block
// (VPDPBUSD, or VPMADDUBSW + VPMADDWD); the 8 rows' lanes are summed across in one transpose-and-add
// network, so every further step (bias, scales, the float steps) is one instruction for 8 outputs.
// Many x rows (prefill): panels of 8 rows packed once per thread, 4 weights of each row side by side,
// so that each 32-bit lane sums one output and a tile of x rows costs one product per 4 weights of 8
// rows and x row.

// Without VNNI, q8_0's weights stay signed (VPMADDUBSW's pairs of 255 * 127 would saturate): the
// products are |w| times a with w's sign (VPSIGNB), and there is no bias.
template <dtype T, bool Vnni>
inline constexpr std::int32_t q32_simd_bias = T == dtype::q8_0 && !Vnni ? 0 : q32_bias<T>;

// A block's 32 weights in the order of k: u as above (q8_0 without VNNI: the signed quants).
template <dtype T, bool Vnni>
[[gnu::always_inline]] inline __m256i q32_weights(const std::byte* blk) noexcept {
  if constexpr (T == dtype::q8_0) {
    const __m256i q = load(blk + 2);
    return Vnni ? _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))) : q;
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + q32_qs<T>));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    if constexpr (T != dtype::q4_0) {
      // Byte j takes byte j / 8 of qh, keeps bit j % 8 and becomes 16 where it is set.
      std::uint32_t qh;
      std::memcpy(&qh, blk + q32_qh<T>, sizeof qh);
      const __m256i spread =
          _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                              _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
      const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return u;
  }
}

// acc + the 8 lanes' sums of 4 products of w (q32_weights) by the activations a.
template <dtype T, int8_dot D>
[[gnu::always_inline]] inline __m256i q32_dot(__m256i acc, __m256i w, __m256i a) noexcept {
  if constexpr (uses_vpdpbusd(D)) {
    return dpbusd<D>(acc, w, a);
  } else if constexpr (T == dtype::q8_0) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
  }
}

[[gnu::always_inline]] inline __m256i load_qs(const kquant::block_q8_32& a) noexcept {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs));
}

// The float steps of a block for 8 outputs: dot holds the 8 integer sums sum(u a), x's block a.
template <dtype T, bool Vnni>
[[gnu::always_inline]] inline __m256 q32_steps(__m256 acc, __m256 d, __m256 mn, const kquant::block_q8_32& a,
                                               __m256i dot) noexcept {
  if constexpr (q32_simd_bias<T, Vnni> != 0)
    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(q32_simd_bias<T, Vnni> * a.sum));
  const __m256 da = _mm256_set1_ps(a.d);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(dot), acc);
  if constexpr (T == dtype::q5_1)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(mn, da), _mm256_set1_ps(static_cast<float>(a.sum)), acc);
  return acc;
}

// out[i * 8 + r] for x rows xs[0 .. MR) and the 8 weight rows rows[0 .. 8), nb blocks each.
template <dtype T, std::size_t MR, int8_dot D>
[[gnu::always_inline]] inline void q32_stream8(const std::byte* const* rows, std::size_t nb,
                                               const kquant::block_q8_32* const* xs, float* out,
                                               prefetch_plan* pf) noexcept {
  constexpr std::size_t bytes = info(T).bytes;
  __m256 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (std::size_t b = 0; b < nb; ++b) {
    prefetch_step<2>(pf);
    const std::size_t at = b * bytes;
    if constexpr (T == dtype::q4_0) {
      // Two rows per register: row 2 p's 16 bytes of quants in the low half, row 2 p + 1's in the high,
      // so one register holds the low nibbles (weights 0-15) of both and one the high (16-31), against
      // x's 16 and 16 activations in both halves; lanes 0-3 then sum row 2 p, lanes 4-7 row 2 p + 1, and
      // three VPHADDD sum the 8 rows into lanes in the order 0 2 4 6 1 3 5 7.
      const __m256i low4 = _mm256_set1_epi8(15);
      __m256i pair[MR][4];
      #pragma GCC unroll 8
      for (std::size_t p = 0; p < 4; ++p) {
        const __m256i v = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + at + 2))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + at + 2)), 1);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) {
          const auto* qs = reinterpret_cast<const __m128i*>(xs[i][b].qs);
          const __m256i alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs));
          const __m256i ahi = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs + 1));
          if constexpr (uses_vpdpbusd(D)) {
            pair[i][p] = q32_dot<T, D>(q32_dot<T, D>(zero, lo, alo), hi, ahi);
          } else {  // pairs of at most 2 * 15 * 127, two of them added in 16 bits
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
            pair[i][p] = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
          }
        }
      }
      const std::byte* const order[8] = {rows[0], rows[2], rows[4], rows[6], rows[1], rows[3], rows[5], rows[7]};
      const __m256 d = halves8(order, at);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m256i dot =
            _mm256_hadd_epi32(_mm256_hadd_epi32(pair[i][0], pair[i][1]), _mm256_hadd_epi32(pair[i][2], pair[i][3]));
        acc[i] = q32_steps<T, uses_vpdpbusd(D)>(acc[i], d, d, xs[i][b], dot);
      }
      continue;
    }
    // Rows 4 h .. 4 h + 3: half[i][h] holds their lanes summed in pairs twice (hadd), each 128-bit half
    // of it 4 partial sums, row by row.
    __m256i half[MR][2];
    #pragma GCC unroll 8
    for (std::size_t h = 0; h < 2; ++h) {
      __m256i pair[MR][2];
      #pragma GCC unroll 8
      for (std::size_t p = 0; p < 2; ++p) {
        const __m256i w0 = q32_weights<T, uses_vpdpbusd(D)>(rows[4 * h + 2 * p] + at);
        const __m256i w1 = q32_weights<T, uses_vpdpbusd(D)>(rows[4 * h + 2 * p + 1] + at);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) {
          const __m256i a = load_qs(xs[i][b]);
          pair[i][p] = _mm256_hadd_epi32(q32_dot<T, D>(zero, w0, a), q32_dot<T, D>(zero, w1, a));
        }
      }
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) half[i][h] = _mm256_hadd_epi32(pair[i][0], pair[i][1]);
    }
    const __m256 d = halves8(rows, at);
    const __m256 mn = T == dtype::q5_1 ? halves8(rows, at + 2) : d;
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) {
      // Low halves of rows 0-3 and 4-7 plus their high halves: lane r the sum of row r.
      const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(half[i][0], half[i][1], 0x20),
                                           _mm256_permute2x128_si256(half[i][0], half[i][1], 0x31));
      acc[i] = q32_steps<T, uses_vpdpbusd(D)>(acc[i], d, mn, xs[i][b], dot);
    }
  }
  if constexpr (T == dtype::q4_0) {  // lanes back in the order of the rows
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i)
      acc[i] = _mm256_permutevar8x32_ps(acc[i], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
}

template <dtype T, int8_dot D>
struct q32_kernel {
  template <std::size_t MR>
  static void run(const std::byte* const* rows, std::size_t nb, const kquant::block_q8_32* const* xs, float* out,
                  prefetch_plan* pf) noexcept {
    q32_stream8<T, MR, D>(rows, nb, xs, out, pf);
  }
};

template <dtype T, int8_dot D>
inline void q32_rows(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1,
                     float* y, accumulate acc) {
  stream_rows<q32_kernel<T, D>>(xq, m, w, w.cols / 32, r0, r1, y, acc);
}

// Decode on 8 rows interleaved (kernels/interleave.hpp, il8_rows in matmul_q8.inl): a block of the 8
// rows is their 8 scales, then their quants 4 bytes a row in turn; the same integers and float steps
// (q32_steps) as q32_stream8.

// out[i * 8 + r] for x rows xs[0 .. MR) and the group of 8 rows at g (nb blocks), prefetching from
// g + il8_prefetch_ahead up to `end`.
template <dtype T, std::size_t MR, int8_dot D>
[[gnu::always_inline]] inline void q32_il8(const std::byte* g, std::size_t nb, const kquant::block_q8_32* const* xs,
                                           float* out, std::uintptr_t end) noexcept {
  constexpr std::size_t bytes = 8 * info(T).bytes;  // a block of the 8 rows
  constexpr bool vnni = uses_vpdpbusd(D);
  __m256 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(g) + il8_prefetch_ahead;
  for (std::size_t b = 0; b < nb; ++b, g += bytes) {
    il8_prefetch(ahead, bytes, end);
    __m256i dot[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
    if constexpr (T == dtype::q8_0) {
      #pragma GCC unroll 8
      for (std::size_t q = 0; q < 8; ++q) {
        __m256i w = load(g + 16 + 32 * q);
        if constexpr (vnni) w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) dot[i] = q32_dot<T, D>(dot[i], w, broadcast4(xs[i][b].qs + 4 * q));
      }
    } else {  // q4_0: byte c of a row holds weights c (low nibble) and c + 16
      const __m256i low4 = _mm256_set1_epi8(15);
      __m256i pairs[MR];  // without VNNI: 16-bit pair sums, 8 of at most 2 * 15 * 127 each
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) pairs[i] = _mm256_setzero_si256();
      #pragma GCC unroll 4
      for (std::size_t q = 0; q < 4; ++q) {
        const __m256i v = load(g + 16 + 32 * q);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) {
          const __m256i alo = broadcast4(xs[i][b].qs + 4 * q), ahi = broadcast4(xs[i][b].qs + 16 + 4 * q);
          if constexpr (vnni)
            dot[i] = dpbusd<D>(dpbusd<D>(dot[i], lo, alo), hi, ahi);
          else
            pairs[i] = _mm256_add_epi16(pairs[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi)));
        }
      }
      if constexpr (!vnni) {
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm256_madd_epi16(pairs[i], _mm256_set1_epi16(1));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) acc[i] = q32_steps<T, vnni>(acc[i], d, d, xs[i][b], dot[i]);
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
}

template <dtype T, int8_dot D>
struct q32_il8_kernel {
  static constexpr std::size_t tile = 4;
  template <std::size_t MR>
  static void run(const std::byte* g, std::size_t nb, const kquant::block_q8_32* const* xs, float* out,
                  std::uintptr_t end) noexcept {
    q32_il8<T, MR, D>(g, nb, xs, out, end);
  }
  static void tail(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1,
                   float* y, accumulate acc) {
    q32_rows<T, D>(xq, m, w, r0, r1, y, acc);
  }
};

#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
// AVX-512 with VNNI: two groups of 8 rows side by side (the second starts where the first ends), a quad
// of each in one zmm register (the first group's in the low half), so that 4 weights of 16 rows and x
// row take one VPDPBUSD where q32_il8 takes one for 8 rows; x's 4 bytes are broadcast to all 16 lanes.
// Each block's sums start at -bias * sum(a) (q32_tile512), then q32_steps' float steps per output in
// the same order: the same bits as q32_il8.
template <dtype T, std::size_t MR>
EFIM_K_TARGET_VNNI inline void q32_il8x2(const std::byte* g, std::size_t nb, const kquant::block_q8_32* const* xs,
                                         float* out, std::uintptr_t end) noexcept {
  static_assert(T == dtype::q8_0 || T == dtype::q4_0);
  constexpr std::size_t bytes = 8 * info(T).bytes;  // a block of 8 rows
  const std::byte* h = g + nb * bytes;               // the second group
  __m512 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(g) + il8_prefetch_ahead;
  std::uintptr_t ahead_h = reinterpret_cast<std::uintptr_t>(h) + il8_prefetch_ahead;
  for (std::size_t b = 0; b < nb; ++b, g += bytes, h += bytes) {
    il8_prefetch(ahead, bytes, end);
    il8_prefetch(ahead_h, bytes, end);
    __m512i dot[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(-q32_bias<T> * xs[i][b].sum);
    if constexpr (T == dtype::q8_0) {
      #pragma GCC unroll 8
      for (std::size_t q = 0; q < 8; ++q) {
        const __m512i w = _mm512_xor_si512(pair256(g + 16 + 32 * q, h + 16 + 32 * q), _mm512_set1_epi8(-128));
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], w, broadcast4x16(xs[i][b].qs + 4 * q));
      }
    } else {  // q4_0: byte c of a row holds weights c (low nibble) and c + 16
      const __m512i low4 = _mm512_set1_epi8(15);
      #pragma GCC unroll 4
      for (std::size_t q = 0; q < 4; ++q) {
        const __m512i v = pair256(g + 16 + 32 * q, h + 16 + 32 * q);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          dot[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[i], lo, broadcast4x16(xs[i][b].qs + 4 * q)), hi,
                                       broadcast4x16(xs[i][b].qs + 16 + 4 * q));
      }
    }
    const __m512 d = halves16(g, h);
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[i][b].d)), _mm512_cvtepi32_ps(dot[i]), acc[i]);
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm512_store_ps(out + 16 * i, acc[i]);
}

// x rows from which the two groups are faster: on Zen 4 (one thread, 2,048 x 768 from memory) q8_0's
// fewer rows are bound by the memory, and q4_0's from 4 rows by the products.
template <dtype T>
inline constexpr std::size_t q32_il8x2_rows = T == dtype::q8_0 ? 6 : 4;

template <dtype T>
struct q32_il8x2_kernel {
  static constexpr std::size_t tile = 8, groups = 2;
  using single = q32_il8_kernel<T, int8_dot::evex>;
  template <std::size_t MR>
  static void run(const std::byte* g, std::size_t nb, const kquant::block_q8_32* const* xs, float* out,
                  std::uintptr_t end) noexcept {
    q32_il8x2<T, MR>(g, nb, xs, out, end);
  }
};
#endif

// Rows [r0, r1) (r0 a multiple of 8) of y for m x rows and w interleaved (il8_rows): on the AVX-512
// path with VNNI two groups at a time (q32_il8x2), else one.
template <dtype T, int8_dot D>
inline void q32_il8_rows(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                         std::size_t r1, float* y, accumulate acc) {
#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
  if constexpr (D == int8_dot::evex) {
    if (m >= q32_il8x2_rows<T>) return il8_rows<q32_il8x2_kernel<T>>(xq, m, w, w.cols / 32, r0, r1, y, acc);
  }
#endif
  il8_rows<q32_il8_kernel<T, D>>(xq, m, w, w.cols / 32, r0, r1, y, acc);
}

// A panel slice: R rows' u, [block][quad][row][4 bytes], and their scales (and q5_1's mins) [block][row]
// (R = 8: a 256-bit register's lanes; 16: an AMX B tile, matmul_amx.inl).
struct q32_slice {
  std::uint8_t* q;
  float* d;
  float* mn;
};

// The 8 rows of an interleaved group (q8_0, q4_0) at g into rows r8 .. r8 + 8 of a slice of R: a
// block of the group is already a slice's block (its quads 4 bytes a row in turn, 32 bytes a quad;
// q4_0's chunk c holds quads c and c + 4 as low and high nibbles), so it is copied, not gathered row by
// row; the 8 scales are one conversion.
template <dtype T, bool Vnni, std::size_t R>
inline void q32_pack_group(const std::byte* g, std::size_t nb, q32_slice& p, std::size_t r8) noexcept {
  constexpr std::size_t bytes = 8 * info(T).bytes;  // a block of the 8 rows
  for (std::size_t b = 0; b < nb; ++b, g += bytes) {
    _mm256_storeu_ps(p.d + b * R + r8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))));
    const auto quad_at = [&](std::size_t quad) { return reinterpret_cast<__m256i*>(p.q + ((b * 8 + quad) * R + r8) * 4); };
    if constexpr (T == dtype::q8_0) {
      #pragma GCC unroll 8
      for (std::size_t quad = 0; quad < 8; ++quad) {
        __m256i v = load(g + 16 + 32 * quad);
        if constexpr (Vnni) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
        _mm256_storeu_si256(quad_at(quad), v);
      }
    } else {
      static_assert(T == dtype::q4_0);
      const __m256i low4 = _mm256_set1_epi8(15);
      #pragma GCC unroll 4
      for (std::size_t c = 0; c < 4; ++c) {
        const __m256i v = load(g + 16 + 32 * c);
        _mm256_storeu_si256(quad_at(c), _mm256_and_si256(v, low4));
        _mm256_storeu_si256(quad_at(c + 4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      }
    }
  }
}

// Rows p0 .. p0 + nc of w (nc <= R * slices; past nc the last row repeats, not stored) into slices of R
// rows: whole interleaved groups copied (q32_pack_group), other rows a block at a time.
template <dtype T, bool Vnni, std::size_t R = 8>
inline void q32_pack(const weight_view& w, std::size_t p0, std::size_t nc, std::size_t nb, q32_slice* s) {
  static_assert(R % 8 == 0);
  const std::size_t slices = (nc + R - 1) / R, rb = row_bytes(T, w.cols);
  alignas(32) std::byte tmp[64];  // q32_weights reads 32 bytes from 2 past the block's start (q8_0)
  const std::size_t per_slice = nb * R * 32 / 4 + 2 * nb * R;  // in floats
  float* base = panel_scratch(slices * per_slice);
  for (std::size_t k = 0; k < slices; ++k) {
    q32_slice& p = s[k];
    p.q = reinterpret_cast<std::uint8_t*>(base + k * per_slice);
    p.d = base + k * per_slice + nb * R * 32 / 4;
    p.mn = p.d + nb * R;
    for (std::size_t r = 0; r < R; ++r) {
      if constexpr (interleavable(T)) {
        const std::size_t first = p0 + k * R + r;  // (after a group copied, r goes on 8 rows later)
        if (r % 8 == 0 && k * R + r + 8 <= nc && il8_whole_group(w, first)) {
          q32_pack_group<T, Vnni, R>(w.data + first * rb, nb, p, r);
          r += 7;
          continue;
        }
      }
      const std::size_t row = p0 + std::min(k * R + r, nc - 1);
      for (std::size_t b = 0; b < nb; ++b) {
        const std::byte* blk = block_as_stored<T>(w, rb, row, b, tmp);
        alignas(32) std::uint8_t u[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(u), q32_weights<T, Vnni>(blk));
        for (std::size_t quad = 0; quad < 8; ++quad) std::memcpy(p.q + ((b * 8 + quad) * R + r) * 4, u + 4 * quad, 4);
        p.d[b * R + r] = f16_at(blk);
        if constexpr (T == dtype::q5_1) p.mn[b * R + r] = f16_at(blk + 2);
      }
    }
  }
}

// Quads whose VPMADDUBSW pair sums add up in 16 bits (without VNNI): q4_0's pairs are at most
// 2 * 15 * 127 = 3,810 (8 of them), q5's 7,874 (4); q8_0's (|w| times a) 32,512, so one.
template <dtype T>
inline constexpr std::size_t q32_run = T == dtype::q4_0   ? 8
                                       : T == dtype::q8_0 ? 1
                                                          : 4;

// out[i * 8 + r] for x rows xs[0 .. MR) against the slice's 8 rows.
template <dtype T, std::size_t MR, int8_dot D>
[[gnu::always_inline]] inline void q32_tile(const q32_slice& p, std::size_t nb, const kquant::block_q8_32* const* xs,
                                            float* out) noexcept {
  __m256 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* q = p.q + b * 8 * 32;
    __m256i dot[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
    if constexpr (uses_vpdpbusd(D)) {
      #pragma GCC unroll 8
      for (std::size_t quad = 0; quad < 8; ++quad) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * quad));
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) dot[i] = q32_dot<T, D>(dot[i], wv, broadcast4(xs[i][b].qs + 4 * quad));
      }
    } else {
      constexpr std::size_t run = q32_run<T>;
      for (std::size_t q0 = 0; q0 < 8; q0 += run) {
        __m256i s[MR];
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (std::size_t quad = q0; quad < q0 + run; ++quad) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * quad));
          const __m256i uw = T == dtype::q8_0 ? _mm256_abs_epi8(wv) : wv;
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) {
            __m256i a = broadcast4(xs[i][b].qs + 4 * quad);
            if constexpr (T == dtype::q8_0) a = _mm256_sign_epi8(a, wv);
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(uw, a));
          }
        }
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s[i], ones));
      }
    }
    const __m256 d = _mm256_load_ps(p.d + b * 8), mn = T == dtype::q5_1 ? _mm256_load_ps(p.mn + b * 8) : d;
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) acc[i] = q32_steps<T, uses_vpdpbusd(D)>(acc[i], d, mn, xs[i][b], dot[i]);
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
}

inline constexpr std::size_t q32_panel_slices = 4;  // a panel of 32 rows, reused by every tile of x rows

#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
// AVX-512 with VNNI, many x rows (prefill), as the k-quants' panels (int8_tile): a panel of 32 rows in
// one slice (q32_pack<.., 32>), so that a quad of its rows is two zmm registers and every tile of 4 x
// rows multiplies 4 weights of 32 rows per two VPDPBUSD and x row, where q32_tile's 256-bit registers
// take four. The same integers and float steps as q32_tile (q32_steps), so the same bits; each
// block's sums start at -bias * sum(a) rather than subtracting it after.
inline constexpr std::size_t q32_nr = 8 * q32_panel_slices;

// out[i * 32 + j] for x rows xs[0 .. MR) against the panel's 32 rows.
template <dtype T, std::size_t MR>
EFIM_K_TARGET_VNNI inline void q32_tile512(const q32_slice& p, std::size_t nb, const kquant::block_q8_32* const* xs,
                                           float* out) {
  __m512 acc[MR][2];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* q = p.q + b * 8 * 4 * q32_nr;
    __m512i dot[MR][2];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) dot[i][0] = dot[i][1] = _mm512_set1_epi32(-q32_bias<T> * xs[i][b].sum);
    #pragma GCC unroll 8
    for (std::size_t quad = 0; quad < 8; ++quad) {
      const __m512i w0 = _mm512_load_si512(q + quad * 4 * q32_nr), w1 = _mm512_load_si512(q + quad * 4 * q32_nr + 64);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m512i a = broadcast4x16(xs[i][b].qs + 4 * quad);
        dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], w0, a);
        dot[i][1] = _mm512_dpbusd_epi32(dot[i][1], w1, a);
      }
    }
    #pragma GCC unroll 2
    for (std::size_t h = 0; h < 2; ++h) {
      const __m512 d = _mm512_load_ps(p.d + b * q32_nr + 16 * h);
      const __m512 mn = T == dtype::q5_1 ? _mm512_load_ps(p.mn + b * q32_nr + 16 * h) : d;
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m512 da = _mm512_set1_ps(xs[i][b].d);
        acc[i][h] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(dot[i][h]), acc[i][h]);
        if constexpr (T == dtype::q5_1)
          acc[i][h] =
              _mm512_fmadd_ps(_mm512_mul_ps(mn, da), _mm512_set1_ps(static_cast<float>(xs[i][b].sum)), acc[i][h]);
      }
    }
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) {
    _mm512_store_ps(out + i * q32_nr, acc[i][0]);
    _mm512_store_ps(out + i * q32_nr + 16, acc[i][1]);
  }
}

template <dtype T>
inline void q32_panels512(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                          std::size_t r1, float* y, accumulate acc) {
  const std::size_t nb = w.cols / 32;
  for (std::size_t p0 = r0; p0 < r1; p0 += q32_nr) {
    const std::size_t nc = std::min(q32_nr, r1 - p0);
    q32_slice s;
    q32_pack<T, true, q32_nr>(w, p0, nc, nb, &s);
    x_tiles4(xq, m, nb, [&]<std::size_t MR>(const kquant::block_q8_32* const* xs, std::size_t i0) {
      alignas(64) float out[MR * q32_nr];
      q32_tile512<T, MR>(s, nb, xs, out);
      store_tile(out, q32_nr, y + i0 * w.rows + p0, w.rows, MR, nc, acc);
    });
  }
}
#endif

// Rows [r0, r1) of y for m x rows, panel by panel (panels of 32 rows): slices of 8 rows in 256-bit
// registers (q32_tile), or on the AVX-512 path with VNNI the 512-bit panels above.
template <dtype T, int8_dot D>
inline void q32_panels(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                       std::size_t r1, float* y, accumulate acc) {
#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
  if constexpr (D == int8_dot::evex) return q32_panels512<T>(xq, m, w, r0, r1, y, acc);
#endif
  constexpr std::size_t panel = 8 * q32_panel_slices;
  const std::size_t nb = w.cols / 32;
  for (std::size_t p0 = r0; p0 < r1; p0 += panel) {
    const std::size_t nc = std::min(panel, r1 - p0), slices = (nc + 7) / 8;
    q32_slice s[q32_panel_slices];
    q32_pack<T, uses_vpdpbusd(D)>(w, p0, nc, nb, s);
    x_tiles4(xq, m, nb, [&]<std::size_t MR>(const kquant::block_q8_32* const* xs, std::size_t i0) {
      for (std::size_t k = 0; k < slices; ++k) {
        alignas(32) float out[MR * 8];
        q32_tile<T, MR, D>(s[k], nb, xs, out);
        store_tile(out, 8, y + i0 * w.rows + p0 + 8 * k, w.rows, MR, std::min<std::size_t>(8, nc - 8 * k), acc);
      }
    });
  }
}

template <dtype T, int8_dot D>
inline void matmul_q32_simd(thread_pool& pool, const kquant::block_q8_32* xq, const weight_view& w, float* y,
                            std::size_t m, accumulate acc) {
  if constexpr (interleavable(T)) {
    if (w.layout == weight_layout::interleaved8 && m <= il8_stream_rows<T>(D)) {  // (more: q32_pack reads them)
      const std::size_t units = (w.rows + 7) / 8;
      pool.parallel_for(
          units,
          [&](std::size_t b, std::size_t e) {
            q32_il8_rows<T, D>(xq, m, w, b * 8, std::min(e * 8, w.rows), y, acc);
          },
          (units + pool.size() - 1) / pool.size());
      return;
    }
  }
  if (m > int8_stream_rows) {
    constexpr std::size_t panel = 8 * q32_panel_slices;
    const std::size_t units = (w.rows + panel - 1) / panel;
    pool.parallel_for(units, [&](std::size_t b, std::size_t e) {
      q32_panels<T, D>(xq, m, w, b * panel, std::min(e * panel, w.rows), y, acc);
    });
    return;
  }
  const std::size_t units = (w.rows + 7) / 8;
  pool.parallel_for(
      units, [&](std::size_t b, std::size_t e) { q32_rows<T, D>(xq, m, w, b * 8, std::min(e * 8, w.rows), y, acc); },
      (units + pool.size() - 1) / pool.size());
}
#endif

// x[0 .. 32 n) rounded to 8 bits per 32 into out[0 .. n): kquant::quantize's bytes.
EFIM_K_ENTRY void quantize_q8_32(const float* x, std::size_t n, kquant::block_q8_32* out) noexcept {
#if EFIM_K_AVX512 || EFIM_K_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  for (std::size_t b = 0; b < n; ++b, x += 32) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (std::size_t j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);  // a NaN lane keeps m (the second operand)
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    kquant::block_q8_32& o = out[b];
    o.d = f16_to_f32(f32_to_f16(amax / 127.0f));
    const __m256 id = _mm256_set1_ps(amax != 0 ? 127.0f / amax : 0.0f);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (std::size_t j = 0; j < 4; ++j) {
      __m256 s = _mm256_mul_ps(v[j], id);
      s = _mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q));  // NaN to 0
      q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(s, bottom), top));
      sum = _mm256_add_epi32(sum, q[j]);
    }
    // packs interleave the 128-bit halves: 32-bit groups 0, 4, 1, 5, 2, 6, 3, 7 back in order.
    const __m256i bytes =
        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs), bytes);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    o.sum = _mm_cvtsi128_si32(t);
  }
#else
  for (std::size_t b = 0; b < n; ++b) kquant::quantize(x + 32 * b, out[b]);
#endif
}

// With AMX, the x rows up to which q8_0 and q4_0 with their rows interleaved still stream (the EVEX
// two-group streams, q32_il8x2) rather than go to the AMX panels. Below 16 x rows the AMX panels have no
// whole tile and are the VNNI panels; from 17 to 31 they pack the weights twice (for the tiles and for
// the VNNI panels of the rest). Emerald Rapids, one thread, 2,048 x 768 from memory, two runs
// (efim-kernels-bench 1 crossover, "amx panels"): the streams 1.53-1.57x the AMX panels' speed at 13 x
// rows, 1.11-1.37x at 16, 1.30-1.40x at 24; at 32 q8_0 0.84-0.85x, q4_0 1.02-1.18x; 0.75-0.89x at 64.
// Rows as stored keep int8_stream_rows.
inline constexpr std::size_t amx_il8_stream_rows = 24;

// Form d as this path takes it: the AVX2 path each form as asked; the AVX-512 path AMX (prefill, in
// matmul_amx.inl; its decode EVEX), EVEX, else VPMADDUBSW (int8_dot_for never asks it for VEX: its
// registers reach ymm31, which VEX cannot name).
template <dtype T>
inline void matmul_q32_typed(thread_pool& pool, const kquant::block_q8_32* xq, const weight_view& w, float* y,
                             std::size_t m, accumulate acc, int8_dot d) {
#if EFIM_K_AVX512
#if defined(EFIM_K_AVX2_PATH_DEFINED)
  const bool il = w.layout == weight_layout::interleaved8;
  if (d == int8_dot::amx && m > (il ? amx_il8_stream_rows : int8_stream_rows)) {
    const std::size_t units = (w.rows + 15) / 16;
    pool.parallel_for(units, [&](std::size_t b, std::size_t e) {
      q32_amx_panels<T>(xq, m, w, b * 16, std::min(e * 16, w.rows), y, acc);
    });
    return;
  }
#endif
  if (d == int8_dot::evex || d == int8_dot::amx) return matmul_q32_simd<T, int8_dot::evex>(pool, xq, w, y, m, acc);
#elif EFIM_K_AVX2
  if (d == int8_dot::vex) return matmul_q32_simd<T, int8_dot::vex>(pool, xq, w, y, m, acc);
  if (d == int8_dot::evex) return matmul_q32_simd<T, int8_dot::evex>(pool, xq, w, y, m, acc);
#endif
  (void)d;
#if EFIM_K_AVX512 || EFIM_K_AVX2
  return matmul_q32_simd<T, int8_dot::madd>(pool, xq, w, y, m, acc);
#endif
  pool.parallel_for((w.rows + 7) / 8, [&](std::size_t b, std::size_t e) {
    matmul_q32_reference<T>(xq, m, w, b * 8, std::min(e * 8, w.rows), y, acc);
  });
}

// y (m, rows) = [y +] x w^T for x rounded to 8 bits per 32 (xq: m rows of cols / 32 blocks) and w of
// q8_0, q4_0, q5_0 or q5_1, on this path.
// Interleaved rows (interleave.hpp) as they are on the AVX2 and AVX-512 paths (decode streams them,
// the panels' packing copies their groups); on the others as stored, in a buffer of the calling
// thread's.
EFIM_K_ENTRY void matmul_int8_32(thread_pool& pool, const kquant::block_q8_32* xq, const weight_view& w, float* y,
                                 std::size_t m, accumulate acc, int8_dot d) {
  if (w.layout == weight_layout::interleaved8 && !(EFIM_K_AVX512 || EFIM_K_AVX2))
    return matmul_int8_32(pool, xq, as_stored(pool, w), y, m, acc, d);
  switch (w.type) {
    case dtype::q8_0:
      return matmul_q32_typed<dtype::q8_0>(pool, xq, w, y, m, acc, d);
    case dtype::q4_0:
      return matmul_q32_typed<dtype::q4_0>(pool, xq, w, y, m, acc, d);
    case dtype::q5_0:
      return matmul_q32_typed<dtype::q5_0>(pool, xq, w, y, m, acc, d);
    case dtype::q5_1:
      return matmul_q32_typed<dtype::q5_1>(pool, xq, w, y, m, acc, d);
    default:
      return;  // matmul.hpp sends only these types here
  }
}
