// Integer products (products::int8, see matmul.hpp): q4_k, q5_k and q6_k weights against activations
// rounded to 8 bits per 256 (kquant::block_q8_k), as llama.cpp computes them. Every sum inside a
// super-block is an integer, exact in any order; the floating-point steps are the same on every path,
// in the same order (int8_step), so the bits do not depend on the path, the tile or the thread.

// x rows up to which weights are streamed (kq_rows, q32_rows: each block of 8 weight rows read once for
// all x rows), not packed into panels. On Zen 4, one thread, 2048 x 768 from memory, streaming is as
// fast as the panels at 12-16 x rows with VPMADDUBSW and 12-32 with VNNI, depending on the type (it
// was 6 when the streaming read the weights once per 4 x rows: on a Sapphire Rapids Xeon the panels
// were then 1.0-2.3x as fast from 7 or 8 rows up).
inline constexpr std::size_t int8_stream_rows = 12;

// The same bound for weights with 8 rows interleaved (interleave.hpp, the host model's default), whose
// groups stream faster (il8_rows: the 8 rows' blocks in one sequential read): on Zen 4, 2 threads,
// 2,048 x 768 and 4,096 x 4,096, the streams were 1.0-1.5x the panels' speed up to these counts with VNNI
// (EVEX on the AVX-512 and AVX2 paths alike; VEX untried) and with VPMADDUBSW (madd), and 2-5x at 16
// rows: q8_0 and q4_0 up to 256 (384: 1.00-1.18x; 512: 0.92-1.03x), q4_k 96 with VNNI (128:
// 0.94-1.09x) and 48 with madd (64: 0.95x), q5_k 48 and 64 (96: 0.92-0.96x with VNNI), q6_k 32 and 16
// (48 with VNNI on the AVX2 path and 32 with madd: 0.91-0.94x). Those panels gathered each row's blocks
// from its group; since they copy a group's quants as they are (q32_pack_group, int8_pack_group), the
// same sweep puts the crossovers lower (q8_0 48-64, q4_0 24-48, q6_k 16-24, q4_k 64 in the AVX-512
// path's 512-bit panels, q5_k 32 there), but the whole model (q8_0 and q4_0, prompts of 64 and 128
// tokens in one batch) was 4-10% slower at those bounds than at these, so these stay. Except where
// q8_0 and q4_0 have the AVX-512 path's 512-bit VNNI panels (q32_panels512, 1.3x the 256-bit ones)
// and streams (q32_il8x2, two groups at a time, 1.2-1.45x the 256-bit ones from 8 x rows): there the
// lab's streams are 1.10-1.12x the panels' speed at 64 x rows and 1.0-1.13x at 96 (with the 256-bit
// streams they fell under the panels between 16 and 32), and the whole model's prefill of 64 tokens
// was faster at a bound of 64 than at 32 (1.0-1.4x in this machine's noise). So is q6_k there, whose
// two-group streams (kq_il8x2) were 1.13-1.19x the 512-bit panels' speed at 64 x rows, 1.04-1.08x at 96
// and 0.99-1.00x at 128. With AMX (Xeons), q8_0 and q4_0 stream up to amx_il8_stream_rows
// (matmul_q8_32.inl), then go to the AMX panels.
template <dtype T>
constexpr std::size_t il8_stream_rows(int8_dot d) noexcept {
  const bool vnni = d != int8_dot::madd;
#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
  if ((T == dtype::q8_0 || T == dtype::q4_0 || T == dtype::q6_k) && d == int8_dot::evex) return 64;
#endif
  if (T == dtype::q8_0 || T == dtype::q4_0) return 256;
  if (T == dtype::q4_k) return vnni ? 96 : 48;
  if (T == dtype::q5_k) return vnni ? 48 : 64;
  if (T == dtype::q6_k) return vnni ? 32 : 16;
  return int8_stream_rows;
}

// f.template operator()<MR>() for MR = mr, 1 <= mr <= N (a tile's x rows as a template argument).
template <std::size_t N, class F>
[[gnu::always_inline]] inline void with_mr(std::size_t mr, F&& f) {
  if constexpr (N > 1) {
    if (mr < N) return with_mr<N - 1>(mr, f);
  }
  f.template operator()<N>();
}

// The panels' loop over x rows: tile.template operator()<MR>(xs, i0) for each tile of MR <= 4 rows of
// xq (nb blocks a row) from row i0, xs[0 .. 4) their blocks (past m the last row repeats, not stored).
template <class Block, class Tile>
inline void x_tiles4(const Block* xq, std::size_t m, std::size_t nb, Tile&& tile) {
  for (std::size_t i0 = 0; i0 < m; i0 += 4) {
    const Block* xs[4];
    for (std::size_t i = 0; i < 4; ++i) xs[i] = xq + std::min(i0 + i, m - 1) * nb;
    with_mr<4>(std::min<std::size_t>(4, m - i0), [&]<std::size_t MR>() { tile.template operator()<MR>(xs, i0); });
  }
}

// Scale groups per super-block: q6_k scales 16 weights at a time, q4_k and q5_k 32.
template <dtype T>
inline constexpr std::size_t q8_groups = T == dtype::q6_k ? 16 : 8;

// A weight row's super-block as unsigned quants (q4_k 0..15, q5_k 0..31, q6_k 0..63, its stored
// value: the weight's quant plus 32), its integer scales sc[g] and subtrahends mn[g] per scale group,
// and its float factors: a row's integer sum against activations a is
//   q4_k, q5_k: isum = sum_g sc[g] * sum_{i in g} q_i a_i,  msum = sum_g mn[g] * sum_{i in g} a_i
//               (mn: the 6-bit mins), and the super-block adds d * da * isum - dmin * da * msum;
//   q6_k:       isum = sum_g sc[g] * sum_{i in g} q_i a_i,  msum = sum_g (32 sc[g]) * sum_{i in g} a_i,
//               and the super-block adds d * da * (isum - msum).
template <dtype T>
inline void q8_unpack(const std::byte* blk, std::uint8_t* q, std::int32_t* sc, std::int32_t* mn, float& d,
                      float& dmin) noexcept {
  if constexpr (T == dtype::q6_k) {
    block_q6_k b;
    std::memcpy(&b, blk, sizeof b);
    for (std::size_t i = 0; i < qk_k; ++i) q[i] = static_cast<std::uint8_t>(kquant::q6_quant(b, i) + 32);
    for (std::size_t g = 0; g < 16; ++g) {
      sc[g] = b.scales[g];
      mn[g] = 32 * b.scales[g];
    }
    d = f16_to_f32(b.d);
    dmin = 0;
  } else {
    using block = std::conditional_t<T == dtype::q4_k, block_q4_k, block_q5_k>;
    block b;
    std::memcpy(&b, blk, sizeof b);
    for (std::size_t g = 0; g < 8; ++g) {
      std::uint8_t s, m;
      kquant::scale_min(b.scales, g, s, m);
      sc[g] = s;
      mn[g] = m;
      const std::uint8_t* qs = b.qs + 32 * (g / 2);
      for (std::size_t l = 0; l < 32; ++l) {
        int v = g % 2 == 0 ? qs[l] & 0xF : qs[l] >> 4;
        if constexpr (T == dtype::q5_k) v |= ((b.qh[l] >> g) & 1) << 4;
        q[32 * g + l] = static_cast<std::uint8_t>(v);
      }
    }
    d = f16_to_f32(b.d);
    dmin = f16_to_f32(b.dmin);
  }
}

// The floating-point step of one super-block, the same on every path: acc + (d * da) * isum, then for
// q4_k and q5_k - (dmin * da) * msum, each a fused multiply-add (q6_k: d * da * (isum - msum)).
template <dtype T>
inline float int8_step(float acc, float d, float dmin, float da, std::int32_t isum, std::int32_t msum) noexcept {
  if constexpr (T == dtype::q6_k) return std::fma(d * da, static_cast<float>(isum - msum), acc);
  acc = std::fma(d * da, static_cast<float>(isum), acc);
  return std::fma(-(dmin * da), static_cast<float>(msum), acc);
}

// Rows [r0, r1) of y = x w^T, one output at a time (the reference every path is tested against).
template <dtype T>
inline void matmul_int8_reference(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0,
                                  std::size_t r1, float* y, accumulate acc) {
  constexpr std::size_t G = q8_groups<T>, L = qk_k / G;
  const std::size_t nsb = w.cols / qk_k, rb = row_bytes(T, w.cols);
  std::uint8_t q[qk_k];
  std::int32_t sc[G], mn[G];
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t i = 0; i < m; ++i) {
      float sum = 0;
      for (std::size_t b = 0; b < nsb; ++b) {
        float d, dmin;
        q8_unpack<T>(w.data + r * rb + b * info(T).bytes, q, sc, mn, d, dmin);
        const kquant::block_q8_k& a = xq[i * nsb + b];
        std::int32_t isum = 0, msum = 0;
        for (std::size_t g = 0; g < G; ++g) {
          std::int32_t s = 0, bs = 0;
          for (std::size_t l = 0; l < L; ++l) {
            s += q[g * L + l] * a.qs[g * L + l];
            bs += a.qs[g * L + l];
          }
          isum += sc[g] * s;
          msum += mn[g] * bs;
        }
        sum = int8_step<T>(sum, d, dmin, a.d, isum, msum);
      }
      float& out = y[i * w.rows + r];
      out = acc == accumulate::yes ? out + sum : sum;
    }
}

#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
// The AMX panels (matmul_amx.inl), for the dispatch in matmul_q8_32.inl.
template <dtype T>
inline void q32_amx_panels(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                           std::size_t r1, float* y, accumulate acc);

// AVX-512 with VNNI, many x rows (prefill; decode is the 256-bit kq_rows below, on every path): each 32-bit lane of a
// VPDPBUSD sums 4 consecutive weights, so a register of 64 weights holds two q4_k / q5_k groups or four q6_k groups.

// 64 weights of super-block `blk` as bytes in the order of k: z = 0..3 covers k in [64 z, 64 z + 64).
// (Read through il8_runs{g, c}: the low half is quad 16 z + c / 4 of the 8 rows, the high half quad
// 16 z + 8 + c / 4.)
template <dtype T, class Runs>
[[gnu::always_inline]] inline __m512i int8_weights_at(Runs at, std::size_t z) noexcept {
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256i lo, hi;
  if constexpr (T == dtype::q6_k) {
    // ql[64 h ..] low nibbles: k 128 h + [0, 32) and [32, 64) from bytes 0-31 and 32-63; high
    // nibbles the next 64; qh[32 h + l] holds the top 2 bits of the four, 2 bits each.
    const std::size_t h = z / 2;
    const __m256i a = at(64 * h), b = at(64 * h + 32), q = at(128 + 32 * h);
    const __m256i top = _mm256_set1_epi8(0x30);
    if (z % 2 == 0) {
      lo = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(q, 4), top));
      hi = _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(q, 2), top));
    } else {
      lo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(q, top));
      hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(q, 2), top));
    }
  } else {
    // qs[32 z ..]: low nibbles group 2 z, high nibbles group 2 z + 1; q5_k's fifth bits: bit g of qh[l].
    const std::size_t qs = T == dtype::q4_k ? 16 : 48;
    const __m256i v = at(qs + 32 * z);
    lo = _mm256_and_si256(v, low4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (T == dtype::q5_k) {
      const __m256i qh = at(16), bit4 = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, to_bit4(qh, static_cast<int>(2 * z), bit4));
      hi = _mm256_or_si256(hi, to_bit4(qh, static_cast<int>(2 * z + 1), bit4));
    }
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
template <dtype T>
[[gnu::always_inline]] inline __m512i int8_weights(const std::byte* blk, std::size_t z) noexcept {
  return int8_weights_at<T>(block_runs{blk}, z);
}

// Super-block blk's scales: scale[z] the per-lane scale of int8_weights(blk, z), sub the subtrahend
// factor of each 16 weights (q4_k, q5_k: the group's min, twice; q6_k: 32 times the scale), and d, dmin.
template <dtype T>
[[gnu::always_inline]] inline void int8_scales(const std::byte* blk, __m512i* scale, __m512i& sub, float& d,
                                               float& dmin) noexcept {
  if constexpr (T == dtype::q6_k) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    #pragma GCC unroll 8
    for (std::size_t z = 0; z < 4; ++z) {
      const int g = static_cast<int>(4 * z);
      scale[z] = _mm512_permutexvar_epi32(_mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2,
                                                            g + 2, g + 3, g + 3, g + 3, g + 3),
                                          sc);
    }
    sub = _mm512_slli_epi32(sc, 5);  // 32 sc: the quants are stored plus 32
    d = f16_at(blk + 208);
    dmin = 0;
  } else {
    const __m512i sm = _mm512_cvtepu8_epi32(k_scale_bytes(blk));  // lanes 0-7: the 8 scales; 8-15: the 8 mins
    #pragma GCC unroll 8
    for (std::size_t z = 0; z < 4; ++z) {
      const int a = static_cast<int>(2 * z), c = a + 1;
      scale[z] = _mm512_permutexvar_epi32(_mm512_setr_epi32(a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c), sm);
    }
    sub = _mm512_permutexvar_epi32(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), sm);
    d = f16_at(blk);
    dmin = f16_at(blk + 2);
  }
}

// Many x rows (prefill): a panel of 32 weight rows is unpacked once into a per-thread scratch, quants
// laid out for VPDPBUSD (for each 4 consecutive weights of a row, 4 bytes; 32 rows side by side, so a
// zmm register holds 16 rows' and each of its 32-bit lanes sums a different output), scales widened;
// every tile of 4 x rows then multiplies 4 weights of 32 rows per two instructions and x row.
inline constexpr std::size_t int8_nr = 32;

struct int8_panel {
  std::uint8_t* q;   // [super-block][64 quads][32 rows][4]
  std::int32_t* sc;  // [super-block][group][32 rows]
  std::int32_t* mn;  // [super-block][group][32 rows]
  float* d;          // [super-block][32 rows]
  float* dmin;       // [super-block][32 rows]
};

// The quads of a whole group of interleaved rows (il8_whole_group) at g into rows r8 .. r8 + 8 of the
// panel's: each 32 bytes of the group's quants hold 4 bytes of each of its rows, unpacked as a row's
// are (int8_weights_at) into a quad of the 8 rows.
template <dtype T>
inline void int8_pack_group(const std::byte* g, std::size_t nsb, std::uint8_t* q, std::size_t r8) noexcept {
  for (std::size_t b = 0; b < nsb; ++b) {
    const std::byte* blk = g + 8 * b * info(T).bytes;
    std::uint8_t* at = q + b * qk_k * int8_nr + 4 * r8;
    #pragma GCC unroll 4
    for (std::size_t z = 0; z < 4; ++z)
      #pragma GCC unroll 8
      for (std::size_t c = 0; c < 32; c += 4) {
        const __m512i v = int8_weights_at<T>(il8_runs{blk, c}, z);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + (16 * z + c / 4) * 4 * int8_nr), _mm512_castsi512_si256(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + (16 * z + 8 + c / 4) * 4 * int8_nr),
                            _mm512_extracti64x4_epi64(v, 1));
      }
  }
}

template <dtype T>
inline int8_panel int8_pack(const weight_view& w, std::size_t p0, std::size_t nc, std::size_t nsb) {
  constexpr std::size_t G = q8_groups<T>;
  const std::size_t quant_bytes = nsb * qk_k * int8_nr, ints = nsb * G * int8_nr, floats = nsb * int8_nr;
  // One f32 scratch holds the lot (quant bytes first, a multiple of 64 bytes).
  float* base = panel_scratch(quant_bytes / 4 + 2 * ints + 2 * floats);
  int8_panel p{reinterpret_cast<std::uint8_t*>(base), reinterpret_cast<std::int32_t*>(base + quant_bytes / 4), nullptr,
               nullptr, nullptr};
  p.mn = p.sc + ints;
  p.d = reinterpret_cast<float*>(p.mn + ints);
  p.dmin = p.d + floats;
  const std::size_t rb = row_bytes(T, w.cols);
  // Lane l of int8_weights(blk, z) (weights 64 z + 4 l ..) goes to quad 16 z + l of the row.
  const __m512i quad_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(4 * int8_nr)));
  alignas(32) std::byte tmp[info(T).bytes];  // a block of interleaved rows, gathered
  for (std::size_t r = 0; r < int8_nr; ++r) {
    const std::size_t row = p0 + std::min(r, nc - 1);  // past nc: repeat, not stored
    // A whole group of interleaved rows: its quads copied with its first row, each row's scales gathered.
    const bool grouped = r - r % 8 + 8 <= nc && il8_whole_group(w, p0 + r - r % 8);
    if (grouped && r % 8 == 0) int8_pack_group<T>(w.data + row * rb, nsb, p.q, r);
    for (std::size_t b = 0; b < nsb; ++b) {
      const std::byte* blk = tmp;
      if (grouped) {
        il8_gather(il8_scale_layout(T), w.data + (row - r % 8) * rb + 8 * b * info(T).bytes, tmp, r % 8);
      } else {
        blk = block_as_stored<T>(w, rb, row, b, tmp);
        std::uint8_t* dst = p.q + b * qk_k * int8_nr + 4 * r;
        #pragma GCC unroll 8
        for (std::size_t z = 0; z < 4; ++z)
          _mm512_i32scatter_epi32(dst + z * 16 * 4 * int8_nr, quad_at, int8_weights<T>(blk, z), 1);
      }
      __m512i scale[4], sub;
      int8_scales<T>(blk, scale, sub, p.d[b * int8_nr + r], p.dmin[b * int8_nr + r]);
      alignas(64) std::int32_t sc[16], mn[16];
      if constexpr (T == dtype::q6_k) {
        _mm512_store_si512(sc, _mm512_srai_epi32(sub, 5));
        _mm512_store_si512(mn, sub);
      } else {
        // scale[z] lanes 0 and 8: groups 2 z and 2 z + 1; sub lanes 2 g: group g's min
        #pragma GCC unroll 8
        for (std::size_t z = 0; z < 4; ++z) {
          alignas(64) std::int32_t lanes[16];
          _mm512_store_si512(lanes, scale[z]);
          sc[2 * z] = lanes[0];
          sc[2 * z + 1] = lanes[8];
        }
        alignas(64) std::int32_t lanes[16];
        _mm512_store_si512(lanes, sub);
        for (std::size_t g = 0; g < 8; ++g) mn[g] = lanes[2 * g];
      }
      for (std::size_t g = 0; g < G; ++g) {
        p.sc[(b * G + g) * int8_nr + r] = sc[g];
        p.mn[(b * G + g) * int8_nr + r] = mn[g];
      }
    }
  }
  return p;
}

// out[i][j] for x rows xs[0..MR) against the panel's 32 rows.
template <dtype T, std::size_t MR>
EFIM_K_TARGET_VNNI inline void int8_tile(const int8_panel& p, std::size_t nsb, const kquant::block_q8_k* const* xs,
                                         float* out) {
  constexpr std::size_t G = q8_groups<T>, quads = qk_k / G / 4;
  __m512 f[MR][2];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) f[i][0] = f[i][1] = _mm512_setzero_ps();
  for (std::size_t b = 0; b < nsb; ++b) {
    __m512i is[MR][2], ms[MR][2];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) is[i][0] = is[i][1] = ms[i][0] = ms[i][1] = _mm512_setzero_si512();
    const std::uint8_t* wq = p.q + b * qk_k * int8_nr;
    for (std::size_t g = 0; g < G; ++g) {
      __m512i s[MR][2];
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) s[i][0] = s[i][1] = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (std::size_t u = 0; u < quads; ++u) {
        const std::size_t quad = g * quads + u;
        const __m512i w0 = _mm512_load_si512(wq + quad * 4 * int8_nr);
        const __m512i w1 = _mm512_load_si512(wq + quad * 4 * int8_nr + 64);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) {
          std::int32_t four;
          std::memcpy(&four, xs[i][b].qs + 4 * quad, sizeof four);
          const __m512i a = _mm512_set1_epi32(four);
          s[i][0] = _mm512_dpbusd_epi32(s[i][0], w0, a);
          s[i][1] = _mm512_dpbusd_epi32(s[i][1], w1, a);
        }
      }
      const std::int32_t* sc = p.sc + (b * G + g) * int8_nr;
      const std::int32_t* mn = p.mn + (b * G + g) * int8_nr;
      const __m512i c0 = _mm512_load_si512(sc), c1 = _mm512_load_si512(sc + 16);
      const __m512i n0 = _mm512_load_si512(mn), n1 = _mm512_load_si512(mn + 16);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const std::int16_t* bsums = xs[i][b].bsums;
        const __m512i bs = _mm512_set1_epi32(G == 16 ? bsums[g] : bsums[2 * g] + bsums[2 * g + 1]);
        is[i][0] = _mm512_add_epi32(is[i][0], _mm512_mullo_epi32(s[i][0], c0));
        is[i][1] = _mm512_add_epi32(is[i][1], _mm512_mullo_epi32(s[i][1], c1));
        ms[i][0] = _mm512_add_epi32(ms[i][0], _mm512_mullo_epi32(bs, n0));
        ms[i][1] = _mm512_add_epi32(ms[i][1], _mm512_mullo_epi32(bs, n1));
      }
    }
    #pragma GCC unroll 8
    for (std::size_t h = 0; h < 2; ++h) {
      const __m512 d = _mm512_load_ps(p.d + b * int8_nr + 16 * h);
      const __m512 dmin = _mm512_load_ps(p.dmin + b * int8_nr + 16 * h);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m512 da = _mm512_set1_ps(xs[i][b].d);
        if constexpr (T == dtype::q6_k) {
          f[i][h] =
              _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(_mm512_sub_epi32(is[i][h], ms[i][h])), f[i][h]);
        } else {
          f[i][h] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(is[i][h]), f[i][h]);
          f[i][h] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(ms[i][h]), f[i][h]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) {
    _mm512_storeu_ps(out + i * int8_nr, f[i][0]);
    _mm512_storeu_ps(out + i * int8_nr + 16, f[i][1]);
  }
}

template <dtype T>
inline void int8_panels(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0,
                        std::size_t r1, float* y, accumulate acc) {
  const std::size_t nsb = w.cols / qk_k;
  for (std::size_t p0 = r0; p0 < r1; p0 += int8_nr) {
    const std::size_t nc = std::min(int8_nr, r1 - p0);
    const int8_panel p = int8_pack<T>(w, p0, nc, nsb);
    x_tiles4(xq, m, nsb, [&]<std::size_t MR>(const kquant::block_q8_k* const* xs, std::size_t i0) {
      alignas(64) float out[MR * int8_nr];
      int8_tile<T, MR>(p, nsb, xs, out);
      store_tile(out, int8_nr, y + i0 * w.rows + p0, w.rows, MR, nc, acc);
    });
  }
}
#endif

#if EFIM_K_AVX512 || EFIM_K_AVX2
// acc + VPDPBUSD(u, a): per 32-bit lane, the sum of 4 products of unsigned bytes u and signed bytes a,
// in the EVEX encoding (AVX-512 VNNI; on the AVX2 path its registers are ymm0-15 as VEX's) or the VEX
// one (AVX-VNNI, "{vex}": the same instruction without AVX-512). As inline assembly: whether the CPU
// has it is known at run time only (int8_dot_for()), and the kernels that take it are templates whose
// target attributes could not follow the template argument. (%{ %} are braces in the output; {a|b}
// picks AT&T or Intel syntax, -masm=intel.)
template <int8_dot D>
[[gnu::always_inline]] inline __m256i dpbusd(__m256i acc, __m256i u, __m256i a) noexcept {
  if constexpr (D == int8_dot::vex)
    asm("%{vex%} vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+x"(acc) : "x"(u), "x"(a));
  else
    asm("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(u), "v"(a));
  return acc;
}

// acc + VPDPWSSD(p, s): per 32-bit lane, the sum of the products of its two 16-bit words in p and s,
// in either encoding as dpbusd; madd: VPMADDWD and VPADDD.
template <int8_dot D>
[[gnu::always_inline]] inline __m256i dpwssd(__m256i acc, __m256i p, __m256i s) noexcept {
  if constexpr (D == int8_dot::vex)
    asm("%{vex%} vpdpwssd {%2, %1, %0|%0, %1, %2}" : "+x"(acc) : "x"(p), "x"(s));
  else if constexpr (D == int8_dot::evex)
    asm("vpdpwssd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(p), "v"(s));
  else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  return acc;
}

// The f16 at `offset` of 8 rows (a block's scale, say), widened.
[[gnu::always_inline]] inline __m256 halves8(const std::byte* const* rows, std::size_t offset) noexcept {
  const auto at = [&](std::size_t r) {
    std::uint16_t h;
    std::memcpy(&h, rows[r] + offset, 2);
    return static_cast<int>(h);
  };
  const auto four = [&](std::size_t r) {
    return static_cast<long long>(static_cast<std::uint64_t>(at(r)) | static_cast<std::uint64_t>(at(r + 1)) << 16 |
                                  static_cast<std::uint64_t>(at(r + 2)) << 32 | static_cast<std::uint64_t>(at(r + 3)) << 48);
  };
  const __m128i v = _mm_set_epi64x(four(4), four(0));
  return _mm256_cvtph_ps(v);
}

// In 256-bit registers (decode on every path; prefill on the AVX2 path and AVX-512 CPUs without VNNI):
// VPMADDUBSW's pair sums of weights and activations (no pair reaches the 16-bit limit: the quants are
// at most 63, the activations at most 127 in magnitude), then scaled by 16-bit factors.

// 32 weights of super-block blk in the order of k: t = 0..7 covers k in [32 t, 32 t + 32). (Read
// through il8_runs{g, c}: quad 8 t + c / 4 of the 8 rows.)
template <dtype T, class Runs>
[[gnu::always_inline]] inline __m256i int8_weights256_at(Runs at, std::size_t t) noexcept {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (T == dtype::q6_k) {
    const std::size_t h = t / 4, run = t % 4;
    const __m256i lq = at(64 * h + 32 * (run % 2)), q = at(128 + 32 * h);
    const __m256i top = _mm256_set1_epi8(0x30);
    const __m256i low = run < 2 ? _mm256_and_si256(lq, low4) : _mm256_and_si256(_mm256_srli_epi16(lq, 4), low4);
    const __m256i high = run == 0   ? _mm256_slli_epi16(q, 4)
                         : run == 1 ? _mm256_slli_epi16(q, 2)
                         : run == 2 ? q
                                    : _mm256_srli_epi16(q, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, top));
  } else {
    const std::size_t qs = T == dtype::q4_k ? 16 : 48;
    const __m256i v = at(qs + 32 * (t / 2));
    __m256i q = t % 2 == 0 ? _mm256_and_si256(v, low4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (T == dtype::q5_k)
      q = _mm256_or_si256(q, to_bit4(at(16), static_cast<int>(t), _mm256_set1_epi8(0x10)));
    return q;
  }
}
template <dtype T>
[[gnu::always_inline]] inline __m256i int8_weights256(const std::byte* blk, std::size_t t) noexcept {
  return int8_weights256_at<T>(block_runs{blk}, t);
}

// Decode, every form: 8 weight rows at a time, as the types of 32-weight blocks go (matmul_q8_32.inl).
// Each row's super-block is unpacked in registers 32 weights at a time; per 32 weights and x row one
// VPMADDUBSW (pair sums, at most 2 * 63 * 128 in magnitude) and one VPDPWSSD by the run's 16-bit scales
// (or VPMADDWD + VPADDD), per super-block one VPMADDWD of the subtrahends against x's bsums; the 8 rows'
// lanes are then summed across in one transpose-and-add network, so that the float steps are one
// instruction for 8 outputs (int8_step's operations, in its order, on 8 lanes).

// The 16-bit scale of each pair sum of int8_weights256(blk, t) in scale[t], and in sub the factor of
// each of x's 16 bsums (q4_k, q5_k: the group's min; q6_k: 32 times the group's scale).
template <dtype T>
[[gnu::always_inline]] inline void kq_scales(const std::byte* blk, __m256i* scale, __m256i& sub) noexcept {
  if constexpr (T == dtype::q6_k) {
    // Run t holds groups 2t (its low 128 bits: 8 pair sums) and 2t + 1 (its high 128 bits).
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    sub = _mm256_slli_epi16(sc16, 5);
    const __m256i low = _mm256_permute2x128_si256(sc16, sc16, 0x00), high = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    #pragma GCC unroll 8
    for (std::size_t t = 0; t < 8; ++t) {
      const int a = static_cast<int>(2 * t % 8), b = a + 1;  // the words of groups 2t and 2t + 1
      const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>((2 * b + 1) << 8 | 2 * b)),
                                            _mm_set1_epi16(static_cast<short>((2 * a + 1) << 8 | 2 * a)));
      scale[t] = _mm256_shuffle_epi8(t < 4 ? low : high, pick);
    }
  } else {
    const __m128i sm = k_scale_bytes(blk);  // bytes 0-7: the 8 scales; 8-15: the 8 mins
    sub = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    const __m256i both = _mm256_broadcastsi128_si256(sm);
    #pragma GCC unroll 8
    for (std::size_t t = 0; t < 8; ++t)  // byte t, and a zero byte above it
      scale[t] = _mm256_shuffle_epi8(both, _mm256_set1_epi16(static_cast<short>(0x8000 | t)));
  }
}

// Lane r of the result: the sum of the 8 lanes of v[r] (VPHADDD twice, then the two halves).
[[gnu::always_inline]] inline __m256i sum_rows8(const __m256i* v) noexcept {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// out[i * 8 + r] for x rows xs[0 .. MR) and the 8 weight rows rows[0 .. 8), nsb super-blocks each.
template <dtype T, std::size_t MR, int8_dot D>
[[gnu::always_inline]] inline void kq_stream8(const std::byte* const* rows, std::size_t nsb,
                                              const kquant::block_q8_k* const* xs, float* out,
                                              prefetch_plan* pf) noexcept {
  constexpr std::size_t bytes = info(T).bytes;
  constexpr bool mins = T != dtype::q6_k;  // q4_k, q5_k: the mins' sums apart (their own float step)
  __m256 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (std::size_t b = 0; b < nsb; ++b) {
    prefetch_step<2>(pf);
    const std::size_t at = b * bytes;
    __m256i isum[MR][8], msum[MR][mins ? 8 : 1];
    #pragma GCC unroll 8
    for (std::size_t r = 0; r < 8; ++r) {
      const std::byte* blk = rows[r] + at;
      __m256i scale[8], sub;
      kq_scales<T>(blk, scale, sub);
      __m256i v[MR];
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) v[i] = _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (std::size_t t = 0; t < 8; ++t) {
        const __m256i w = int8_weights256<T>(blk, t);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          v[i] = dpwssd<D>(v[i], _mm256_maddubs_epi16(w, load(reinterpret_cast<const std::byte*>(xs[i][b].qs) + 32 * t)),
                           scale[t]);
      }
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m256i m = _mm256_madd_epi16(sub, load(reinterpret_cast<const std::byte*>(xs[i][b].bsums)));
        if constexpr (mins) {
          isum[i][r] = v[i];
          msum[i][r] = m;
        } else {
          isum[i][r] = _mm256_sub_epi32(v[i], m);
        }
      }
    }
    const __m256 d = halves8(rows, at + (T == dtype::q6_k ? 208 : 0));
    const __m256 dmin = mins ? halves8(rows, at + 2) : d;
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) {
      const __m256 da = _mm256_set1_ps(xs[i][b].d);
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(sum_rows8(isum[i])), acc[i]);
      if constexpr (mins)
        acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(sum_rows8(msum[i])), acc[i]);
    }
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
}

// Rows [r0, r1) of y = x w^T for m x rows rounded to blocks (nb per row), streamed 8 weight rows at a
// time: Kernel::run<MR>(rows, nb, xs, out, prefetch) multiplies 8 rows by MR x rows (kq_stream8,
// q32_stream8). Each block of 8 weight rows meets every 4 x rows in turn (read from memory once, then
// from L1), and the 8 rows after the next 8 go into L2 a few lines per block: 8 short rows read side by
// side are more streams than the hardware prefetchers follow well. (On Zen 4, two threads, 151,936 x
// 768, medians: q8_0 27.2 GB/s of weights against 21.8 prefetching the next 8 rows into L1, q4_0 24.5
// against 18.6; docs/benchmarks.md has the variants tried.)
template <typename Kernel, typename Block>
inline void stream_rows(const Block* xq, std::size_t m, const weight_view& w, std::size_t nb, std::size_t r0,
                        std::size_t r1, float* y, accumulate acc) {
  const std::size_t rb = row_bytes(w.type, w.cols);
  for (std::size_t r = r0; r < r1; r += 8) {
    const std::byte* rows[8];
    for (std::size_t j = 0; j < 8; ++j) rows[j] = w.data + std::min(r + j, r1 - 1) * rb;  // past r1: repeat
    prefetch_plan plan{reinterpret_cast<std::uintptr_t>(w.data + std::min(r + 16, r1) * rb),
                       reinterpret_cast<std::uintptr_t>(w.data + std::min(r + 24, r1) * rb), 0};
    plan.per_step = ((plan.end - plan.next) / 64 + nb) / nb;
    for (std::size_t i0 = 0; i0 < m; i0 += 4) {
      const std::size_t mr = std::min<std::size_t>(4, m - i0);
      const Block* xs[4];
      for (std::size_t i = 0; i < 4; ++i) xs[i] = xq + std::min(i0 + i, m - 1) * nb;
      prefetch_plan* const pf = i0 == 0 ? &plan : nullptr;
      alignas(32) float out[4 * 8];
      if (mr == 4)
        Kernel::template run<4>(rows, nb, xs, out, pf);
      else if (mr == 3)
        Kernel::template run<3>(rows, nb, xs, out, pf);
      else if (mr == 2)
        Kernel::template run<2>(rows, nb, xs, out, pf);
      else
        Kernel::template run<1>(rows, nb, xs, out, pf);
      store_tile(out, 8, y + i0 * w.rows + r, w.rows, mr, std::min<std::size_t>(8, r1 - r), acc);
    }
  }
}

template <dtype T, int8_dot D>
struct kq_kernel {
  template <std::size_t MR>
  static void run(const std::byte* const* rows, std::size_t nsb, const kquant::block_q8_k* const* xs, float* out,
                  prefetch_plan* pf) noexcept {
    kq_stream8<T, MR, D>(rows, nsb, xs, out, pf);
  }
};

template <dtype T, int8_dot D>
inline void kq_rows(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1,
                    float* y, accumulate acc) {
  stream_rows<kq_kernel<T, D>>(xq, m, w, w.cols / qk_k, r0, r1, y, acc);
}

// Many x rows without VNNI (prefill): as the VNNI panels, weight rows packed once per thread, here 8
// rows side by side per 256-bit register (a slice), the quants of 4 consecutive weights as 4 bytes; a
// tile of 4 x rows then costs one VPMADDUBSW per 4 weights of 8 rows and x row. Its 16-bit pair sums
// add up in 16 bits over as many quads as cannot overflow (int16_run), then one VPMADDWD by the group's
// scale (in both halves of each lane) adds the halves and scales them in one step.
inline constexpr std::size_t int8_slice_rows = 8;
inline constexpr std::size_t int8_slices = 4;  // slices per panel: a panel of 32 rows, reused by every x tile

// Quads whose pair sums add in 16 bits without overflow: each pair is at most 2 * qmax * 128 in
// magnitude (q4_k 3,840, q5_k 7,936, q6_k 16,128), so 8, 4 and 2 of them stay below 2^15.
template <dtype T>
inline constexpr std::size_t int16_run = T == dtype::q4_k ? 8 : T == dtype::q5_k ? 4 : 2;

struct int8_slice {
  std::uint8_t* q;   // [super-block][64 quads][8 rows][4]
  std::int32_t* sc;  // [super-block][group][8 rows]: the group's scale in both 16-bit halves
  std::int32_t* mn;  // [super-block][8 pairs][8 rows]: the subtrahend factors of bsums 2p and 2p + 1
  float* d;          // [super-block][8 rows]
  float* dmin;       // [super-block][8 rows]
};

// A 32-bit lane holding lo in its low 16 bits and hi in its high 16 bits (VPMADDWD's pair).
inline std::int32_t int16_pair(std::int16_t lo, std::int16_t hi) noexcept {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(static_cast<std::uint16_t>(lo)) |
                                   (static_cast<std::uint32_t>(static_cast<std::uint16_t>(hi)) << 16));
}

// Rows p0 .. p0 + nc of w (nc <= 32; past nc the last row repeats, not stored) packed into slices
// s[0 .. ceil(nc / 8)).
template <dtype T>
inline void int8_pack256(const weight_view& w, std::size_t p0, std::size_t nc, std::size_t nsb, int8_slice* s) {
  constexpr std::size_t G = q8_groups<T>, R = int8_slice_rows;
  const std::size_t slices = (nc + R - 1) / R;
  const std::size_t quant_bytes = nsb * qk_k * R, ints = nsb * G * R, pairs = nsb * 8 * R, floats = nsb * R;
  const std::size_t per_slice = quant_bytes / 4 + ints + pairs + 2 * floats;  // in 4-byte units
  float* base = panel_scratch(slices * per_slice);
  const std::size_t rb = row_bytes(T, w.cols);
  for (std::size_t k = 0; k < slices; ++k) {
    float* at = base + k * per_slice;
    int8_slice& p = s[k];
    p.q = reinterpret_cast<std::uint8_t*>(at);
    p.sc = reinterpret_cast<std::int32_t*>(at + quant_bytes / 4);
    p.mn = p.sc + ints;
    p.d = reinterpret_cast<float*>(p.mn + pairs);
    p.dmin = p.d + floats;
    // A whole group of interleaved rows (the slice's 8): its quads copied, each row's scales gathered.
    static_assert(R == 8);
    const bool grouped = k * R + R <= nc && il8_whole_group(w, p0 + k * R);
    for (std::size_t b = 0; grouped && b < nsb; ++b) {
      const std::byte* g = w.data + (p0 + k * R) * rb + 8 * b * info(T).bytes;
      #pragma GCC unroll 8
      for (std::size_t t = 0; t < 8; ++t)
        #pragma GCC unroll 8
        for (std::size_t c = 0; c < 32; c += 4)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.q + b * qk_k * R + (8 * t + c / 4) * 4 * R),
                              int8_weights256_at<T>(il8_runs{g, c}, t));
    }
    for (std::size_t r = 0; r < R; ++r) {
      const std::size_t row = p0 + std::min(k * R + r, nc - 1);
      for (std::size_t b = 0; b < nsb; ++b) {
        alignas(32) std::byte tmp[info(T).bytes];  // a block of interleaved rows, gathered
        const std::byte* blk = tmp;
        if (grouped) {
          il8_gather(il8_scale_layout(T), w.data + (p0 + k * R) * rb + 8 * b * info(T).bytes, tmp, r);
        } else {
          blk = block_as_stored<T>(w, rb, row, b, tmp);
          std::uint8_t* dst = p.q + b * qk_k * R + 4 * r;
          #pragma GCC unroll 8
          for (std::size_t t = 0; t < 8; ++t) {
            alignas(32) std::uint8_t quads[32];
            _mm256_store_si256(reinterpret_cast<__m256i*>(quads), int8_weights256<T>(blk, t));
            for (std::size_t l = 0; l < 8; ++l) std::memcpy(dst + (8 * t + l) * 4 * R, quads + 4 * l, 4);
          }
        }
        std::int16_t sc[G], mn[16];  // mn: the factor of each bsums entry (16 weights)
        if constexpr (T == dtype::q6_k) {
          for (std::size_t g = 0; g < 16; ++g) {
            sc[g] = static_cast<std::int8_t>(blk[192 + g]);
            mn[g] = static_cast<std::int16_t>(32 * sc[g]);
          }
          p.d[b * R + r] = f16_at(blk + 208);
          p.dmin[b * R + r] = 0;
        } else {
          alignas(16) std::uint8_t sm[16];  // the 8 scales, then the 8 mins
          _mm_store_si128(reinterpret_cast<__m128i*>(sm), k_scale_bytes(blk));
          for (std::size_t g = 0; g < 8; ++g) {
            sc[g] = sm[g];
            mn[2 * g] = mn[2 * g + 1] = sm[8 + g];
          }
          p.d[b * R + r] = f16_at(blk);
          p.dmin[b * R + r] = f16_at(blk + 2);
        }
        for (std::size_t g = 0; g < G; ++g) p.sc[(b * G + g) * R + r] = int16_pair(sc[g], sc[g]);
        for (std::size_t q = 0; q < 8; ++q) p.mn[(b * 8 + q) * R + r] = int16_pair(mn[2 * q], mn[2 * q + 1]);
      }
    }
  }
}

[[gnu::always_inline]] inline __m256i broadcast4(const void* p) noexcept {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}
#if EFIM_K_AVX512
// 32 bytes from a and 32 from b in one register; 4 bytes at p in every lane.
[[gnu::always_inline]] inline __m512i pair256(const std::byte* a, const std::byte* b) noexcept {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load(a)), load(b), 1);
}
[[gnu::always_inline]] inline __m512i broadcast4x16(const void* p) noexcept {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}
// 8 f16 at a and 8 at b, widened.
[[gnu::always_inline]] inline __m512 halves16(const std::byte* a, const std::byte* b) noexcept {
  return _mm512_cvtph_ps(
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
#endif

// out[i][j] (out[i * 8 + j], 32-byte aligned) for x rows xs[0 .. MR) against the slice's 8 rows. The
// sums in floats stay in `out` between super-blocks (16 registers hold the integer sums and operands).
// With VNNI (the AVX2 path of a CPU with AVX-VNNI or AVX-512 VNNI) each group's quads go through one
// VPDPBUSD each into 32-bit sums, then one VPMULLD by the group's scale (the high half of p.sc's lanes).
template <dtype T, std::size_t MR, int8_dot D>
inline void int8_tile256(const int8_slice& p, std::size_t nsb, const kquant::block_q8_k* const* xs,
                         float* out) noexcept {
  constexpr std::size_t G = q8_groups<T>, R = int8_slice_rows, quads = qk_k / G / 4, run = int16_run<T>;
  static_assert(quads % run == 0);
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + i * R, _mm256_setzero_ps());
  for (std::size_t b = 0; b < nsb; ++b) {
    const std::uint8_t* wq = p.q + b * qk_k * R;
    __m256i is[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) is[i] = _mm256_setzero_si256();
    for (std::size_t g = 0; g < G; ++g) {
      const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.sc + (b * G + g) * R));
      if constexpr (uses_vpdpbusd(D)) {
        __m256i s[MR];
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (std::size_t u = 0; u < quads; ++u) {
          const std::size_t quad = g * quads + u;
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + quad * 4 * R));
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) s[i] = dpbusd<D>(s[i], wv, broadcast4(xs[i][b].qs + 4 * quad));
        }
        const __m256i sc32 = _mm256_srai_epi32(sc, 16);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) is[i] = _mm256_add_epi32(is[i], _mm256_mullo_epi32(s[i], sc32));
        continue;
      }
      for (std::size_t u0 = 0; u0 < quads; u0 += run) {
        __m256i s[MR];
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (std::size_t u = u0; u < u0 + run; ++u) {
          const std::size_t quad = g * quads + u;
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + quad * 4 * R));
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i)
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(wv, broadcast4(xs[i][b].qs + 4 * quad)));
        }
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(s[i], sc));
      }
    }
    const __m256 d = _mm256_load_ps(p.d + b * R), dmin = _mm256_load_ps(p.dmin + b * R);
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) {
      __m256i ms = _mm256_setzero_si256();
      for (std::size_t q = 0; q < 8; ++q) {
        const __m256i mn = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.mn + (b * 8 + q) * R));
        ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn, broadcast4(xs[i][b].bsums + 2 * q)));
      }
      const __m256 da = _mm256_set1_ps(xs[i][b].d);
      __m256 f = _mm256_load_ps(out + i * R);
      if constexpr (T == dtype::q6_k) {
        f = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(_mm256_sub_epi32(is[i], ms)), f);
      } else {
        f = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(is[i]), f);
        f = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(ms), f);
      }
      _mm256_store_ps(out + i * R, f);
    }
  }
}

template <dtype T, int8_dot D>
inline void int8_panels256(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0,
                           std::size_t r1, float* y, accumulate acc) {
  constexpr std::size_t R = int8_slice_rows, panel = R * int8_slices;
  const std::size_t nsb = w.cols / qk_k;
  for (std::size_t p0 = r0; p0 < r1; p0 += panel) {
    const std::size_t nc = std::min(panel, r1 - p0), slices = (nc + R - 1) / R;
    int8_slice s[int8_slices];
    int8_pack256<T>(w, p0, nc, nsb, s);
    x_tiles4(xq, m, nsb, [&]<std::size_t MR>(const kquant::block_q8_k* const* xs, std::size_t i0) {
      for (std::size_t k = 0; k < slices; ++k) {
        alignas(32) float out[MR * R];
        int8_tile256<T, MR, D>(s[k], nsb, xs, out);
        store_tile(out, R, y + i0 * w.rows + p0 + k * R, w.rows, MR, std::min(R, nc - k * R), acc);
      }
    });
  }
}

// Decode on 8 rows interleaved (kernels/interleave.hpp; the types of 32-weight blocks in
// matmul_q8_32.inl, the k-quants below): each 256-bit load holds 4 quant bytes of every row, one row a
// lane, multiplied by 4 of x's bytes broadcast, so the rows' integer sums need no sum across lanes and
// their scales are a few loads for 8 rows. The same integers and float steps as the rows as stored.

// Bytes ahead of the block being read that each block prefetches into L2 (the matrix is read in
// order; on an Intel Xeon the hardware prefetchers alone kept a thread to about 8 GB/s; 4 and 16 KB
// were slower than 8 there).
inline constexpr std::size_t il8_prefetch_ahead = 8192;

// Prefetches the lines from `ahead` for a block of `bytes` into L2, up to `end`.
[[gnu::always_inline]] inline void il8_prefetch(std::uintptr_t& ahead, std::size_t bytes, std::uintptr_t end) noexcept {
  for (std::size_t o = 0; o < bytes && ahead < end; o += 64, ahead += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, 2);
}

// Groups of 8 rows a call of Kernel::run: 1, or 2 where the kernel takes two groups side by side (the
// next group starts where the first ends) and names in Kernel::single a kernel of one group for the
// range's last group when its count is odd.
template <typename Kernel>
constexpr std::size_t il8_groups() noexcept {
  if constexpr (requires { Kernel::groups; })
    return Kernel::groups;
  else
    return 1;
}

// Rows [r0, r1) (r0 a multiple of 8) of y = x w^T for w interleaved8 and m x rows rounded to blocks (nb
// a row): Kernel::run<MR>(group, nb, xs, out, end) multiplies il8_groups<Kernel>() groups of 8 rows by
// MR <= Kernel::tile x rows, prefetching up to `end` (the first x tile only: the others find the group
// in L1 or L2); the rows past the last whole group, stored as rows, go to Kernel::tail.
template <typename Kernel, typename Block>
inline void il8_rows(const Block* xq, std::size_t m, const weight_view& w, std::size_t nb, std::size_t r0,
                     std::size_t r1, float* y, accumulate acc) {
  constexpr std::size_t tile = Kernel::tile, span = 8 * il8_groups<Kernel>();
  const std::size_t rb = row_bytes(w.type, w.cols), whole = w.rows / 8 * 8;
  const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(w.data + whole * rb);
  std::size_t r = r0;
  for (; r + span <= std::min(r1, whole); r += span) {
    const std::byte* const g = w.data + r * rb;
    for (std::size_t i0 = 0; i0 < m; i0 += tile) {
      const std::size_t mr = std::min(tile, m - i0);
      const Block* xs[tile];
      for (std::size_t i = 0; i < tile; ++i) xs[i] = xq + std::min(i0 + i, m - 1) * nb;
      const std::uintptr_t pf_end = i0 == 0 ? end : 0;
      alignas(64) float out[tile * span];
      with_mr<tile>(mr, [&]<std::size_t MR>() { Kernel::template run<MR>(g, nb, xs, out, pf_end); });
      store_tile(out, span, y + i0 * w.rows + r, w.rows, mr, span, acc);
    }
  }
  if constexpr (span > 8)
    il8_rows<typename Kernel::single>(xq, m, w, nb, r, r1, y, acc);
  else if (r1 > whole)
    Kernel::tail(xq, m, w, std::max(r0, whole), r1, y, acc);
}

// A VPSHUFB of each 32-bit lane's bytes: byte k of the result is byte b_k of the same lane, or zero
// where b_k < 0.
constexpr int lane_pick_dword(int lane, int b0, int b1, int b2, int b3) noexcept {
  const auto at = [lane](int b) { return b < 0 ? 0x80u : static_cast<unsigned>(4 * lane + b); };
  return static_cast<int>(at(b0) | at(b1) << 8 | at(b2) << 16 | at(b3) << 24);
}
[[gnu::always_inline]] inline __m256i lane_pick(__m256i v, int b0, int b1, int b2, int b3) noexcept {
  const int l0 = lane_pick_dword(0, b0, b1, b2, b3), l1 = lane_pick_dword(1, b0, b1, b2, b3),
            l2 = lane_pick_dword(2, b0, b1, b2, b3), l3 = lane_pick_dword(3, b0, b1, b2, b3);
  return _mm256_shuffle_epi8(v, _mm256_setr_epi32(l0, l1, l2, l3, l0, l1, l2, l3));
}

// The k-quants: per super-block of the 8 rows, each scale group's quants through VPDPBUSD into 32-bit
// sums and one VPMULLD by the group's scale (without VNNI: VPMADDUBSW pair sums added in 16 bits over
// int16_run quads, then one VPMADDWD by the scale in both halves of the lane), the subtrahends as one
// VPMADDWD per two of x's bsums. Layout (interleave.hpp), per super-block of the 8 rows:
//   q4_k, q5_k: d [0, 16), dmin [16, 32), the 12 scale bytes as 3 dwords [32, 128), (q5_k: the fifth
//               bits [128, 384)), the nibbles (quad q: bytes 4 q .. 4 q + 3 of each row) from 128 (384);
//   q6_k:       the low nibbles [0, 1024), the top bits [1024, 1536), the 16 scales as 4 dwords
//               [1536, 1664), d [1664, 1680).
template <dtype T, std::size_t MR, int8_dot D>
[[gnu::always_inline]] inline void kq_il8(const std::byte* g, std::size_t nsb, const kquant::block_q8_k* const* xs,
                                          float* out, std::uintptr_t end) noexcept {
  constexpr std::size_t bytes = 8 * info(T).bytes;
  constexpr bool vnni = uses_vpdpbusd(D);
  const __m256i low4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  __m256 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(g) + il8_prefetch_ahead;
  for (std::size_t b = 0; b < nsb; ++b, g += bytes) {
    il8_prefetch(ahead, bytes, end);
    __m256i isum[MR], msum[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) isum[i] = msum[i] = _mm256_setzero_si256();
    if constexpr (T == dtype::q6_k) {
      // The fields (interleave.hpp): low nibbles, top bits, scales, d.
      constexpr std::size_t qh_at = il8_field_at(T, 1), sc_at = il8_field_at(T, 2), d_at = il8_field_at(T, 3);
      __m256i sc[4];  // byte j of a lane of sc[k]: the row's scale 4 k + j
      #pragma GCC unroll 4
      for (std::size_t k = 0; k < 4; ++k) sc[k] = load(g + sc_at + 32 * k);
      // msum: the quants are stored plus 32, so sum_g 32 sc[g] bsums[g] (two groups a VPMADDWD)
      #pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m256i pair = _mm256_srai_epi16(lane_pick(sc[p / 2], -1, 2 * p % 4, -1, 2 * p % 4 + 1), 3);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          msum[i] = _mm256_add_epi32(msum[i], _mm256_madd_epi16(pair, broadcast4(xs[i][b].bsums + 2 * p)));
      }
      // Each group's scale in each row's lane: 32 bits (VPMULLD), or in both 16-bit halves (VPMADDWD).
      __m256i scale[16];
      #pragma GCC unroll 16
      for (int grp = 0; grp < 16; ++grp)
        scale[grp] = vnni ? _mm256_srai_epi32(lane_pick(sc[grp / 4], -1, -1, -1, grp % 4), 24)
                          : _mm256_srai_epi16(lane_pick(sc[grp / 4], -1, grp % 4, -1, grp % 4), 8);
      // Weights 128 h + 32 s + 4 u .. + 3 (s = 0..3): nibble s / 2 of ql byte 64 h + 32 (s % 2) + 4 u,
      // bits 2 s, 2 s + 1 of qh byte 32 h + 4 u; group 8 h + 2 s + u / 4.
      #pragma GCC unroll 4
      for (std::size_t hh = 0; hh < 4; ++hh) {
        const std::size_t h = hh / 2, half = hh % 2;
        __m256i s32[4][MR];
        #pragma GCC unroll 8
        for (std::size_t s = 0; s < 4; ++s)
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) s32[s][i] = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (std::size_t u = 4 * half; u < 4 * half + 4; ++u) {
          const __m256i qa = load(g + 32 * (16 * h + u)), qb = load(g + 32 * (16 * h + 8 + u));
          const __m256i qh = load(g + qh_at + 32 * (8 * h + u));
          const __m256i wq[4] = {
              _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
              _mm256_or_si256(_mm256_and_si256(qb, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4), _mm256_and_si256(qh, top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), top))};
          #pragma GCC unroll 4
          for (std::size_t s = 0; s < 4; ++s)
            #pragma GCC unroll 8
            for (std::size_t i = 0; i < MR; ++i) {
              const __m256i a = broadcast4(xs[i][b].qs + 128 * h + 32 * s + 4 * u);
              if constexpr (vnni)
                s32[s][i] = dpbusd<D>(s32[s][i], wq[s], a);
              else
                s32[s][i] = _mm256_add_epi16(s32[s][i], _mm256_maddubs_epi16(wq[s], a));
            }
          if constexpr (!vnni) {
            if (u % 2 == 0) continue;  // int16_run<q6_k> = 2 quads, then scaled
            #pragma GCC unroll 4
            for (std::size_t s = 0; s < 4; ++s) {
              const __m256i f = scale[8 * h + 2 * s + half];
              #pragma GCC unroll 8
              for (std::size_t i = 0; i < MR; ++i) {
                isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(s32[s][i], f));
                s32[s][i] = _mm256_setzero_si256();
              }
            }
          }
        }
        if constexpr (vnni) {
          #pragma GCC unroll 4
          for (std::size_t s = 0; s < 4; ++s) {
            const __m256i f = scale[8 * h + 2 * s + half];
            #pragma GCC unroll 8
            for (std::size_t i = 0; i < MR; ++i) isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(s32[s][i], f));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + d_at)));
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[i][b].d)),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[i], msum[i])), acc[i]);
    } else {
      // The fields (interleave.hpp): d, dmin, scales, (q5_k: fifth bits,) nibbles.
      constexpr std::size_t dmin_at = il8_field_at(T, 1), sc_at = il8_field_at(T, 2), qh_at = il8_field_at(T, 3),
                            qs = il8_field_at(T, il8_layout(T).n - 1), run = int16_run<T>;
      // The 6-bit scales and mins of groups 0-3 and 4-7, a byte each (kquant::scale_min's layout: the
      // low 6 bits of dwords 0 and 1; the nibbles of dword 2 under the top 2 bits of dwords 0 and 1).
      const __m256i u0 = load(g + sc_at), u1 = load(g + sc_at + 32), u2 = load(g + sc_at + 64);
      const __m256i low6 = _mm256_set1_epi8(0x3f);
      const __m256i sc[2] = {_mm256_and_si256(u0, low6), _mm256_or_si256(_mm256_and_si256(u2, low4),
                                                                        _mm256_and_si256(_mm256_srli_epi16(u0, 2), top))};
      const __m256i mn[2] = {_mm256_and_si256(u1, low6),
                             _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u2, 4), low4),
                                             _mm256_and_si256(_mm256_srli_epi16(u1, 2), top))};
      // msum = sum_g mn[g] (bsums[2 g] + bsums[2 g + 1])
      #pragma GCC unroll 8
      for (int grp = 0; grp < 8; ++grp) {
        const __m256i pair = lane_pick(mn[grp / 4], grp % 4, -1, grp % 4, -1);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          msum[i] = _mm256_add_epi32(msum[i], _mm256_madd_epi16(pair, broadcast4(xs[i][b].bsums + 2 * grp)));
      }
      // Each group's scale in each row's lane: 32 bits (VPMULLD), or in both 16-bit halves (VPMADDWD).
      __m256i scale[8];
      #pragma GCC unroll 8
      for (int grp = 0; grp < 8; ++grp)
        scale[grp] = vnni ? lane_pick(sc[grp / 4], grp % 4, -1, -1, -1) : lane_pick(sc[grp / 4], grp % 4, -1, grp % 4, -1);
      // Weights 64 k + 4 q .. + 3 (low nibbles, group 2 k) and 64 k + 32 + 4 q .. (high, group 2 k + 1).
      // (Unrolled by 2, not 4: fully unrolled, a file with every kernel path compiled in 158 s with g++
      // -O3, 99 s so; by 2 q4_k decoded as fast on an Intel Xeon, rolled its VPMADDUBSW form lost a third.)
      // q4_k with VNNI and one x row: the sums of even and odd q run apart (added before scaling:
      // integers, the same sums), two chains of 4 dependent VPDPBUSD a group instead of one of 8. On a
      // Zen 4 core, one thread, a 131,072 x 768 matrix from memory: 1.04-1.08x built with -O3, 1.45x
      // with -O2 (where the one chain was slower); 2 x rows and q5_k (more work between the VPDPBUSD)
      // gained nothing at -O2, and keep one chain. (The AVX-VNNI form takes it too, unmeasured: that
      // Zen 4 has no AVX-VNNI.)
      constexpr std::size_t chains = vnni && T == dtype::q4_k && MR == 1 ? 2 : 1;
      #pragma GCC unroll 2
      for (int k = 0; k < 4; ++k) {
        const int lo_g = 2 * k, hi_g = 2 * k + 1;
        __m256i slo_c[chains][MR], shi_c[chains][MR];
        #pragma GCC unroll 2
        for (std::size_t c = 0; c < chains; ++c)
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) slo_c[c][i] = shi_c[c][i] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (std::size_t q = 0; q < 8; ++q) {
          __m256i* const slo = slo_c[q % chains];
          __m256i* const shi = shi_c[q % chains];
          const __m256i v = load(g + qs + 32 * (8 * static_cast<std::size_t>(k) + q));
          __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (T == dtype::q5_k) {  // bit g of qh byte l: the fifth bit of weight l of group g
            const __m256i qh = load(g + qh_at + 32 * q), bit4 = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, to_bit4(qh, lo_g, bit4));
            hi = _mm256_or_si256(hi, to_bit4(qh, hi_g, bit4));
          }
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) {
            const __m256i alo = broadcast4(xs[i][b].qs + 64 * k + 4 * q), ahi = broadcast4(xs[i][b].qs + 64 * k + 32 + 4 * q);
            if constexpr (vnni) {
              slo[i] = dpbusd<D>(slo[i], lo, alo);
              shi[i] = dpbusd<D>(shi[i], hi, ahi);
            } else {
              slo[i] = _mm256_add_epi16(slo[i], _mm256_maddubs_epi16(lo, alo));
              shi[i] = _mm256_add_epi16(shi[i], _mm256_maddubs_epi16(hi, ahi));
            }
          }
          if constexpr (!vnni) {
            if ((q + 1) % run != 0) continue;
            #pragma GCC unroll 8
            for (std::size_t i = 0; i < MR; ++i) {
              isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(slo[i], scale[lo_g]),
                                                                   _mm256_madd_epi16(shi[i], scale[hi_g])));
              slo[i] = shi[i] = _mm256_setzero_si256();
            }
          }
        }
        if constexpr (vnni) {
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) {
            __m256i lo = slo_c[0][i], hi = shi_c[0][i];
            #pragma GCC unroll 2
            for (std::size_t c = 1; c < chains; ++c) {
              lo = _mm256_add_epi32(lo, slo_c[c][i]);
              hi = _mm256_add_epi32(hi, shi_c[c][i]);
            }
            isum[i] = _mm256_add_epi32(
                isum[i], _mm256_add_epi32(_mm256_mullo_epi32(lo, scale[lo_g]), _mm256_mullo_epi32(hi, scale[hi_g])));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + dmin_at)));
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m256 da = _mm256_set1_ps(xs[i][b].d);
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[i]), acc[i]);
        acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[i]), acc[i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
}

template <dtype T, int8_dot D>
struct kq_il8_kernel {
  // x rows a call: q6_k's four runs of sums per x row fill the 16 registers of the AVX2 path sooner
  static constexpr std::size_t tile = T == dtype::q6_k ? 2 : 4;
  template <std::size_t MR>
  static void run(const std::byte* g, std::size_t nsb, const kquant::block_q8_k* const* xs, float* out,
                  std::uintptr_t end) noexcept {
    kq_il8<T, MR, D>(g, nsb, xs, out, end);
  }
  static void tail(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1,
                   float* y, accumulate acc) {
    kq_rows<T, D>(xq, m, w, r0, r1, y, acc);
  }
};

#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
// lane_pick in each 128-bit lane of a zmm register; to_bit4 on 512 bits.
[[gnu::always_inline]] inline __m512i lane_pick512(__m512i v, int b0, int b1, int b2, int b3) noexcept {
  return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi32(
                                    lane_pick_dword(0, b0, b1, b2, b3), lane_pick_dword(1, b0, b1, b2, b3),
                                    lane_pick_dword(2, b0, b1, b2, b3), lane_pick_dword(3, b0, b1, b2, b3))));
}
[[gnu::always_inline]] inline __m512i to_bit4_512(__m512i v, int from, __m512i mask) noexcept {
  const __m512i moved = from <= 4 ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(4 - from))
                                  : _mm512_srl_epi16(v, _mm_cvtsi32_si128(from - 4));
  return _mm512_and_si512(moved, mask);
}

// The k-quants with AVX-512 VNNI: two groups of 8 rows side by side (the second starts where the first
// ends), each 32-byte field of the first group in the low half of a zmm register and the second's in
// the high half (q32_il8x2), so that each step of kq_il8 (VNNI form) does 16 rows; the same integers and
// float steps per output in the same order, so the same bits.
template <dtype T, std::size_t MR>
EFIM_K_TARGET_VNNI inline void kq_il8x2(const std::byte* g, std::size_t nsb, const kquant::block_q8_k* const* xs,
                                        float* out, std::uintptr_t end) noexcept {
  constexpr std::size_t bytes = 8 * info(T).bytes;  // a super-block of 8 rows
  const std::byte* h = g + nsb * bytes;             // the second group
  const __m512i low4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(g) + il8_prefetch_ahead;
  std::uintptr_t ahead_h = reinterpret_cast<std::uintptr_t>(h) + il8_prefetch_ahead;
  for (std::size_t b = 0; b < nsb; ++b, g += bytes, h += bytes) {
    il8_prefetch(ahead, bytes, end);
    il8_prefetch(ahead_h, bytes, end);
    __m512i isum[MR], msum[MR];
    #pragma GCC unroll 8
    for (std::size_t i = 0; i < MR; ++i) isum[i] = msum[i] = _mm512_setzero_si512();
    if constexpr (T == dtype::q6_k) {
      constexpr std::size_t qh_at = il8_field_at(T, 1), sc_at = il8_field_at(T, 2), d_at = il8_field_at(T, 3);
      __m512i sc[4];
      #pragma GCC unroll 4
      for (std::size_t k = 0; k < 4; ++k) sc[k] = pair256(g + sc_at + 32 * k, h + sc_at + 32 * k);
      #pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i pair = _mm512_srai_epi16(lane_pick512(sc[p / 2], -1, 2 * p % 4, -1, 2 * p % 4 + 1), 3);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          msum[i] = _mm512_add_epi32(msum[i], _mm512_madd_epi16(pair, broadcast4x16(xs[i][b].bsums + 2 * p)));
      }
      __m512i scale[16];
      #pragma GCC unroll 16
      for (int grp = 0; grp < 16; ++grp)
        scale[grp] = _mm512_srai_epi32(lane_pick512(sc[grp / 4], -1, -1, -1, grp % 4), 24);
      #pragma GCC unroll 4
      for (std::size_t hh = 0; hh < 4; ++hh) {
        const std::size_t hf = hh / 2, half = hh % 2;
        // s = sp and sp + 2 (the low and high nibbles of one ql row) at a time: two runs of sums per x
        // row live, so that tiles of 4 x rows fit the 32 registers.
        #pragma GCC unroll 2
        for (std::size_t sp = 0; sp < 2; ++sp) {
          __m512i s32[2][MR];
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) s32[0][i] = s32[1][i] = _mm512_setzero_si512();
          #pragma GCC unroll 4
          for (std::size_t u = 4 * half; u < 4 * half + 4; ++u) {
            const std::size_t q_at = 32 * (16 * hf + 8 * sp + u), h_at = qh_at + 32 * (8 * hf + u);
            const __m512i q = pair256(g + q_at, h + q_at), qh = pair256(g + h_at, h + h_at);
            const __m512i lo_top = sp == 0 ? _mm512_slli_epi16(qh, 4) : _mm512_slli_epi16(qh, 2),
                          hi_top = sp == 0 ? qh : _mm512_srli_epi16(qh, 2);
            const __m512i wq[2] = {
                _mm512_or_si512(_mm512_and_si512(q, low4), _mm512_and_si512(lo_top, top)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), low4), _mm512_and_si512(hi_top, top))};
            #pragma GCC unroll 2
            for (std::size_t j = 0; j < 2; ++j)
              #pragma GCC unroll 8
              for (std::size_t i = 0; i < MR; ++i)
                s32[j][i] = _mm512_dpbusd_epi32(s32[j][i], wq[j],
                                                broadcast4x16(xs[i][b].qs + 128 * hf + 32 * (sp + 2 * j) + 4 * u));
          }
          #pragma GCC unroll 2
          for (std::size_t j = 0; j < 2; ++j)
            #pragma GCC unroll 8
            for (std::size_t i = 0; i < MR; ++i)
              isum[i] =
                  _mm512_add_epi32(isum[i], _mm512_mullo_epi32(s32[j][i], scale[8 * hf + 2 * (sp + 2 * j) + half]));
        }
      }
      const __m512 d = halves16(g + d_at, h + d_at);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[i][b].d)),
                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i], msum[i])), acc[i]);
    } else {
      constexpr std::size_t dmin_at = il8_field_at(T, 1), sc_at = il8_field_at(T, 2), qh_at = il8_field_at(T, 3),
                            qs = il8_field_at(T, il8_layout(T).n - 1);
      const __m512i low6 = _mm512_set1_epi8(0x3f);
      // The 6-bit scales and mins as kq_il8 takes them, for the 16 rows.
      const __m512i u0 = pair256(g + sc_at, h + sc_at), u1 = pair256(g + sc_at + 32, h + sc_at + 32),
                    u2 = pair256(g + sc_at + 64, h + sc_at + 64);
      const __m512i sc[2] = {
          _mm512_and_si512(u0, low6),
          _mm512_or_si512(_mm512_and_si512(u2, low4), _mm512_and_si512(_mm512_srli_epi16(u0, 2), top))};
      const __m512i mn[2] = {_mm512_and_si512(u1, low6),
                             _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(u2, 4), low4),
                                             _mm512_and_si512(_mm512_srli_epi16(u1, 2), top))};
      #pragma GCC unroll 8
      for (int grp = 0; grp < 8; ++grp) {
        const __m512i pair = lane_pick512(mn[grp / 4], grp % 4, -1, grp % 4, -1);
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          msum[i] = _mm512_add_epi32(msum[i], _mm512_madd_epi16(pair, broadcast4x16(xs[i][b].bsums + 2 * grp)));
      }
      __m512i scale[8];
      #pragma GCC unroll 8
      for (int grp = 0; grp < 8; ++grp) scale[grp] = lane_pick512(sc[grp / 4], grp % 4, -1, -1, -1);
      #pragma GCC unroll 2
      for (int k = 0; k < 4; ++k) {
        const int lo_g = 2 * k, hi_g = 2 * k + 1;
        __m512i slo[MR], shi[MR];
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i) slo[i] = shi[i] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (std::size_t q = 0; q < 8; ++q) {
          const std::size_t at = qs + 32 * (8 * static_cast<std::size_t>(k) + q);
          const __m512i v = pair256(g + at, h + at);
          __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (T == dtype::q5_k) {
            const __m512i qh = pair256(g + qh_at + 32 * q, h + qh_at + 32 * q), bit4 = _mm512_set1_epi8(0x10);
            lo = _mm512_or_si512(lo, to_bit4_512(qh, lo_g, bit4));
            hi = _mm512_or_si512(hi, to_bit4_512(qh, hi_g, bit4));
          }
          #pragma GCC unroll 8
          for (std::size_t i = 0; i < MR; ++i) {
            slo[i] = _mm512_dpbusd_epi32(slo[i], lo, broadcast4x16(xs[i][b].qs + 64 * k + 4 * q));
            shi[i] = _mm512_dpbusd_epi32(shi[i], hi, broadcast4x16(xs[i][b].qs + 64 * k + 32 + 4 * q));
          }
        }
        #pragma GCC unroll 8
        for (std::size_t i = 0; i < MR; ++i)
          isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(slo[i], scale[lo_g]),
                                                               _mm512_mullo_epi32(shi[i], scale[hi_g])));
      }
      const __m512 d = halves16(g, h), dmin = halves16(g + dmin_at, h + dmin_at);
      #pragma GCC unroll 8
      for (std::size_t i = 0; i < MR; ++i) {
        const __m512 da = _mm512_set1_ps(xs[i][b].d);
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[i]), acc[i]);
        acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(msum[i]), acc[i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (std::size_t i = 0; i < MR; ++i) _mm512_store_ps(out + 16 * i, acc[i]);
}

// x rows from which the two groups are faster (one thread, 2,048 x 768 from memory): 4 for each. On
// Zen 4 q4_k and q5_k ran 0.98-1.48x the one group at 1 and 2 rows (at the memory's speed in two runs
// of three) and q6_k 0.91-1.01x; on Zen 5 q4_k ran 0.74x and 0.91x there, q5_k 0.88x and 0.94x, and
// from 4 rows 1.23x and 0.98x (docs/benchmarks.md).
template <dtype T>
inline constexpr std::size_t kq_il8x2_rows = 4;

template <dtype T>
struct kq_il8x2_kernel {
  static constexpr std::size_t tile = 4, groups = 2;
  using single = kq_il8_kernel<T, int8_dot::evex>;
  template <std::size_t MR>
  static void run(const std::byte* g, std::size_t nsb, const kquant::block_q8_k* const* xs, float* out,
                  std::uintptr_t end) noexcept {
    kq_il8x2<T, MR>(g, nsb, xs, out, end);
  }
};
#endif

// Rows [r0, r1) (r0 a multiple of 8) of y for m x rows and w interleaved (il8_rows): on the AVX-512
// path with VNNI two groups at a time (kq_il8x2), else one.
template <dtype T, int8_dot D>
inline void kq_il8_rows(const kquant::block_q8_k* xq, std::size_t m, const weight_view& w, std::size_t r0,
                        std::size_t r1, float* y, accumulate acc) {
#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
  if constexpr (D == int8_dot::evex) {
    if (m >= kq_il8x2_rows<T>) return il8_rows<kq_il8x2_kernel<T>>(xq, m, w, w.cols / qk_k, r0, r1, y, acc);
  }
#endif
  il8_rows<kq_il8_kernel<T, D>>(xq, m, w, w.cols / qk_k, r0, r1, y, acc);
}

#endif

// x[0 .. 256 n) rounded to 8 bits into out[0 .. n): kquant::quantize's bytes (the AVX-512 path takes the
// largest magnitude and rounds 16 at a time: the same first maximum, the same products, the same
// round-to-nearest-even).
EFIM_K_ENTRY void quantize_q8_k(const float* x, std::size_t n, kquant::block_q8_k* out) noexcept {
#if EFIM_K_AVX512
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (std::size_t b = 0; b < n; ++b, x += qk_k) {
    __m512 m = _mm512_setzero_ps();
    for (std::size_t k = 0; k < qk_k; k += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + k)));
    const float amax = _mm512_reduce_max_ps(m);
    kquant::block_q8_k& o = out[b];
    if (!(amax > 0)) {  // all zero (or NaN: the scalar rounding decides)
      kquant::quantize(x, o);
      continue;
    }
    std::size_t first = 0;
    while (std::fabs(x[first]) != amax) ++first;
    const float iscale = -127.0f / x[first];
    const __m512 s = _mm512_set1_ps(iscale);
    const __m512i top = _mm512_set1_epi32(127);
    for (std::size_t g = 0; g < 16; ++g) {
      const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(s, _mm512_loadu_ps(x + 16 * g))), top);
      const __m128i bytes = _mm512_cvtepi32_epi8(q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.qs + 16 * g), bytes);
      // Summed as stored (where 1 / max overflows to infinity the lanes hold INT_MIN, kept to their low
      // byte as the scalar cast keeps nearest_int's): the scalar bsums, and no int overflow.
      o.bsums[g] = static_cast<std::int16_t>(_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bytes)));
    }
    o.d = 1 / iscale;
  }
#else
  for (std::size_t b = 0; b < n; ++b) kquant::quantize(x + b * qk_k, out[b]);
#endif
}

// y (m, rows) = [y +] x w^T for x rounded to 8 bits (xq: m rows of cols / 256 blocks) and T one of
// q4_k, q5_k, q6_k, on this path, in form d as matmul_q32_typed takes it (prefill: the AVX-512 path's
// VNNI panels for EVEX and amx, else the 256-bit VPMADDUBSW panels).
template <dtype T>
inline void matmul_int8_typed(thread_pool& pool, const kquant::block_q8_k* xq, const weight_view& w, float* y,
                              std::size_t m, accumulate acc, int8_dot d) {
  if (d == int8_dot::amx) d = int8_dot::evex;  // the k-quants' tiles are VNNI's (matmul_amx.inl)
#if EFIM_K_AVX512 || EFIM_K_AVX2
  const bool il = w.layout == weight_layout::interleaved8;
  if (m <= (il ? il8_stream_rows<T>(d) : int8_stream_rows)) {
    // (rows as stored: units of 16 rows; interleaved: groups of 8, il8_rows)
    const std::size_t per = il ? 8 : 16, units = (w.rows + per - 1) / per;
    const auto rows = [&]<int8_dot D>() {
      pool.parallel_for(
          units,
          [&](std::size_t b, std::size_t e) {
            if (il)
              kq_il8_rows<T, D>(xq, m, w, b * 8, std::min(e * 8, w.rows), y, acc);
            else
              kq_rows<T, D>(xq, m, w, b * 16, std::min(e * 16, w.rows), y, acc);
          },
          (units + pool.size() - 1) / pool.size());
    };
#if EFIM_K_AVX2
    if (d == int8_dot::vex) return rows.template operator()<int8_dot::vex>();
#endif
    if (d == int8_dot::evex) return rows.template operator()<int8_dot::evex>();
    return rows.template operator()<int8_dot::madd>();
  }
#endif
#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)
  if (d == int8_dot::evex) {
    const std::size_t units = (w.rows + int8_nr - 1) / int8_nr;
    pool.parallel_for(units, [&](std::size_t b, std::size_t e) {
      int8_panels<T>(xq, m, w, b * int8_nr, std::min(e * int8_nr, w.rows), y, acc);
    });
    return;
  }
#endif
#if EFIM_K_AVX512 || EFIM_K_AVX2
  const auto panels = [&]<int8_dot D>() {
    constexpr std::size_t panel = int8_slice_rows * int8_slices;
    const std::size_t units = (w.rows + panel - 1) / panel;
    pool.parallel_for(units, [&](std::size_t b, std::size_t e) {
      int8_panels256<T, D>(xq, m, w, b * panel, std::min(e * panel, w.rows), y, acc);
    });
  };
#if EFIM_K_AVX2
  if (d == int8_dot::vex) return panels.template operator()<int8_dot::vex>();
  if (d == int8_dot::evex) return panels.template operator()<int8_dot::evex>();
#endif
  return panels.template operator()<int8_dot::madd>();
#endif
  (void)d;
  pool.parallel_for((w.rows + 7) / 8, [&](std::size_t b, std::size_t e) {
    matmul_int8_reference<T>(xq, m, w, b * 8, std::min(e * 8, w.rows), y, acc);
  });
}

// Interleaved rows (interleave.hpp) as they are on the AVX2 and AVX-512 paths (decode streams them,
// the panels' packing copies their groups); on the others as stored, in a buffer of the calling
// thread's.
EFIM_K_ENTRY void matmul_int8(thread_pool& pool, const kquant::block_q8_k* xq, const weight_view& w, float* y,
                              std::size_t m, accumulate acc, int8_dot d) {
  if (w.layout == weight_layout::interleaved8 && !(EFIM_K_AVX512 || EFIM_K_AVX2))
    return matmul_int8(pool, xq, as_stored(pool, w), y, m, acc, d);
  switch (w.type) {
    case dtype::q4_k:
      return matmul_int8_typed<dtype::q4_k>(pool, xq, w, y, m, acc, d);
    case dtype::q5_k:
      return matmul_int8_typed<dtype::q5_k>(pool, xq, w, y, m, acc, d);
    case dtype::q6_k:
      return matmul_int8_typed<dtype::q6_k>(pool, xq, w, y, m, acc, d);
    default:
      return;  // matmul.hpp sends only these types here
  }
}
