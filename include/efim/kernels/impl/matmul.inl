// dequantize_row, with f16 and bf16 widened 16 at a time (the same values).
inline void widen_row(dtype t, const std::byte* src, float* dst, std::size_t n) {
  if (t != dtype::f16 && t != dtype::bf16) return dequantize_row(t, src, dst, n);
  std::size_t k = 0;
  for (; k + lanes <= n; k += lanes) {
    vfloat v;
    if (t == dtype::f16)
      widen_f16(v, src + 2 * k);
    else
      widen_bf16(v, src + 2 * k);
    std::memcpy(dst + k, &v, sizeof v);
  }
  dequantize_row(t, src + 2 * k, dst + k, n - k);
}

// Portable path: rows [r0, r1) of w, panel by panel, dequantized (widen_row), then dot_tile.
inline void matmul_rows_portable(const float* x, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1,
                                 float* y, accumulate acc) {
#if EFIM_K_AVX512
  constexpr std::size_t MR = 4, NR = 4;  // 16 zmm accumulators
#else
  constexpr std::size_t MR = 2, NR = 2;  // fits 16 ymm/xmm registers
#endif
  const std::size_t n = w.cols, ldy = w.rows, rb = row_bytes(w.type, n);
  const std::size_t step = panel_height(r1 - r0, n, NR);
  for (std::size_t p0 = r0; p0 < r1; p0 += step) {
    const std::size_t nc = std::min(step, r1 - p0);
    const float* panel = nullptr;
    if (w.type == dtype::f32) {
      panel = reinterpret_cast<const float*>(w.data) + p0 * n;
    } else {
      float* scratch = panel_scratch(nc * n);
      for (std::size_t r = 0; r < nc; ++r) widen_row(w.type, w.data + (p0 + r) * rb, scratch + r * n, n);
      panel = scratch;
    }
    for (std::size_t i0 = 0; i0 < m; i0 += MR) {
      const float* xs[MR];
      for (std::size_t i = 0; i < MR; ++i) xs[i] = x + std::min(i0 + i, m - 1) * n;  // past m: repeat, not stored
      for (std::size_t j0 = 0; j0 < nc; j0 += NR) {
        const float* ws[NR];
        for (std::size_t j = 0; j < NR; ++j) ws[j] = panel + std::min(j0 + j, nc - 1) * n;
        float out[MR * NR];
        dot_tile<MR, NR>(xs, ws, n, out);
        store_tile(out, NR, y + i0 * ldy + p0 + j0, ldy, std::min(MR, m - i0), std::min(NR, nc - j0), acc);
      }
    }
  }
}

#if EFIM_K_AVX512 || EFIM_K_AVX2
// One weight, for the tail past the last full vector (f32, f16 and bf16 only).
template <dtype T>
inline float weight_at(const std::byte* row, std::size_t k) noexcept {
  if constexpr (T == dtype::f32) {
    float v;
    std::memcpy(&v, row + 4 * k, sizeof v);
    return v;
  } else {
    std::uint16_t h;
    std::memcpy(&h, row + 2 * k, sizeof h);
    return T == dtype::f16 ? f16_to_f32(h) : bf16_to_f32(h);
  }
}

// Types the tiles read 32 weights at a time: a q8_0, q4_0, q5_0 or q5_1 block, or an eighth of a
// k-quant super-block (group b of a row is sub-block b % 8 of super-block b / 8).
template <dtype T>
inline constexpr bool grouped = info(T).block >= 32;

// Types whose groups unpack nibbles and bits: their decode is bound by unpacking rather than by
// memory, so several weight rows share each x vector in decode tiles.
template <dtype T>
inline constexpr bool unpacked = grouped<T> && T != dtype::q8_0;

// An f16 value stored at p, widened (exact).
[[gnu::always_inline]] inline float f16_at(const std::byte* p) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

// q4_k and q5_k: sub-block j's scale d * sc and min dmin * m (exact products, as dequantize_row).
[[gnu::always_inline]] inline void k_scale_min(const std::byte* blk, std::size_t j, float& ds, float& mm) noexcept {
  std::uint8_t sc, m;
  kquant::scale_min(reinterpret_cast<const std::uint8_t*>(blk + 4), j, sc, m);
  ds = f16_at(blk) * static_cast<float>(sc);
  mm = f16_at(blk + 2) * static_cast<float>(m);
}

// q6_k: the scale d * sc of 16-weight sub-block s of a super-block (an exact product).
[[gnu::always_inline]] inline float q6_scale(const std::byte* blk, std::size_t s) noexcept {
  return f16_at(blk + 208) * static_cast<float>(static_cast<std::int8_t>(blk[192 + s]));
}

// Decode tiles take the k-quants a super-block at a time: each weight row's super-block is first
// "staged" (its scales widened to floats once, and for q5_k and q6_k its quants built as whole bytes),
// then its 8 groups of 32 go through the FMAs. Every value is the one dequantize_row gives.

// q4_k and q5_k: the 6-bit scales of groups 0-7 in bytes 0-7 and their mins in bytes 8-15, taken out
// of the 12 bytes 32 bits at a time (kquant::scale_min's layout: groups 0-3 in the low 6 bits of bytes
// 0-7, groups 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7), in
// vector registers: dwords u0, u1, u2 at blk + 4 give [u0 & 63s, nibbles of u2 | top bits of u0, u1 &
// 63s, high nibbles of u2 | top bits of u1].
[[gnu::always_inline]] inline __m128i k_scale_bytes(const std::byte* blk) noexcept {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));  // and 4 bytes of quants
  const __m128i low6 = _mm_and_si128(v, _mm_set1_epi8(0x3f));
  const __m128i nibbles =
      _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0xaa), _mm_setr_epi32(0, 4, 0, 0)), _mm_set1_epi8(15));
  const __m128i top2 = _mm_and_si128(_mm_srli_epi32(v, 2), _mm_set1_epi8(0x30));  // bits 6-7 to 4-5
  return _mm_unpacklo_epi32(low6, _mm_or_si128(nibbles, top2));
}

// q4_k and q5_k: a[g] = d * sc and a[8 + g] = dmin * m of group g (the exact products k_scale_min
// gives).
[[gnu::always_inline]] inline void k_scales_mins(const std::byte* blk, float* a) noexcept {
  const __m128i v = k_scale_bytes(blk);
  _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
  _mm256_storeu_ps(a + 8, _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)))));
}

// Bits `from` and `from` + 1 (or just `from`) of each byte moved to bits 4 and 5, masked by `mask`.
[[gnu::always_inline]] inline __m256i to_bit4(__m256i v, int from, __m256i mask) noexcept {
  const __m256i moved = from <= 4 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - from))
                                  : _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - 4));
  return _mm256_and_si256(moved, mask);
}

// 32 bytes at p; v stored at p (32-byte aligned). (Helpers, not lambdas: GCC does not give lambdas
// the target of the path being compiled.)
[[gnu::always_inline]] inline __m256i load(const std::byte* p) noexcept {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
[[gnu::always_inline]] inline void store(std::byte* p, __m256i v) noexcept {
  _mm256_store_si256(reinterpret_cast<__m256i*>(p), v);
}

// Where the int8 packs (matmul_q8.inl) read a super-block's quants 32 bytes at a time: at(off) is the
// 32 bytes of one row from byte `off` of its block as stored (block_runs); or, rows interleaved
// (interleave.hpp, quant fields in chunks of 4 bytes), bytes off + c .. off + c + 4 of each of the
// group's 8 rows in turn (il8_runs), which the same byte-wise unpacking turns into 4 weights of each
// of the 8 rows: a quad of the packs' layout.
struct block_runs {
  const std::byte* blk;
  [[gnu::always_inline]] __m256i operator()(std::size_t off) const noexcept { return load(blk + off); }
};
struct il8_runs {
  const std::byte* g;  // the 8 rows' interleaved block
  std::size_t c;       // a multiple of 4, under 32
  [[gnu::always_inline]] __m256i operator()(std::size_t off) const noexcept { return load(g + 8 * off + 8 * c); }
};

// A q5_k or q6_k super-block staged: q[0..255] its quants as bytes (q5_k: 0..31 unsigned; q6_k:
// -32..31 signed), a[0..15] its scales (q5_k: as k_scales_mins; q6_k: a[s] = d * sc of 16-weight
// sub-block s, the exact products q6_scale gives).
template <dtype T>
[[gnu::always_inline]] inline void stage_k(const std::byte* blk, std::byte* q, float* a) noexcept {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (T == dtype::q5_k) {
    k_scales_mins(blk, a);
    // Group g: the nibbles of qs[32 (g / 2) ..] (low for even g), bit g of qh[0..31] as the fifth bit.
    const __m256i qh = load(blk + 16), bit4 = _mm256_set1_epi8(16);
#pragma GCC unroll 4
    for (std::size_t p = 0; p < 4; ++p) {
      const __m256i qs = load(blk + 48 + 32 * p);
      const int g = 2 * static_cast<int>(p);
      store(q + 64 * p, _mm256_or_si256(_mm256_and_si256(qs, low4), to_bit4(qh, g, bit4)));
      store(q + 64 * p + 32,
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), low4), to_bit4(qh, g + 1, bit4)));
    }
  } else {
    static_assert(T == dtype::q6_k);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m256 d = _mm256_set1_ps(f16_at(blk + 208));
    _mm256_storeu_ps(a, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(a + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
    // Half h, run r of 32 (kquant::q6_quant): the low 4 bits from ql[64 h + 32 (r % 2) ..] (low nibbles
    // for r < 2), bits 4 and 5 from bits 2r, 2r + 1 of qh[32 h ..]; then minus 32.
    const __m256i top = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
#pragma GCC unroll 2
    for (std::size_t h = 0; h < 2; ++h) {
      const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32), qh = load(blk + 128 + 32 * h);
      const __m256i run[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
#pragma GCC unroll 4
      for (std::size_t r = 0; r < 4; ++r)
        store(q + 128 * h + 32 * r,
              _mm256_sub_epi8(_mm256_or_si256(run[r], to_bit4(qh, 2 * static_cast<int>(r), top)), offset));
    }
  }
}

// Memory to prefetch a few lines per step of a tile's k loop: in decode, the next block of weight rows,
// whose short rows (432 bytes for q4_0 at 768 columns) the hardware prefetchers do not follow well.
struct prefetch_plan {
  std::uintptr_t next = 0, end = 0;
  std::size_t per_step = 0;
  bool into_l2 = false;  // PREFETCHT1 whatever the caller's locality (a block too large for L1)
};

// A block of rows to prefetch larger than this goes into L2, not L1: into L1 it would evict the block
// being read (the decode tiles' next 16 rows of 768 f16 columns are 24 KiB, of 32-48 KiB of L1; of
// 768 f32 columns 48 KiB). Emerald Rapids, 2 threads, 1 x 151,936 x 768, runs in turn: f16 20.0 ->
// 22.8 GB/s of weights (eight each), bf16 19.6 -> 21.7, f32 22.2 -> 24.8 (four); q8_0's exact decode
// (13 KiB blocks) lost 9% into L2 and stays in L1.
inline constexpr std::size_t l1_prefetch_bytes = 16 * 1024;

// Locality as __builtin_prefetch's: 3 into L1 (PREFETCHT0), 2 into L2 (PREFETCHT1).
template <int Locality = 3>
[[gnu::always_inline]] inline void prefetch_step(prefetch_plan* p) noexcept {
  if (p == nullptr) return;
  for (std::size_t q = 0; q < p->per_step && p->next < p->end; ++q, p->next += 64)
    if (Locality == 2 || p->into_l2)
      __builtin_prefetch(reinterpret_cast<const void*>(p->next), 0, 2);
    else
      __builtin_prefetch(reinterpret_cast<const void*>(p->next), 0, Locality);
}

#endif

#if EFIM_K_AVX512

// 16 weights of a row from element k, f32, f16 or bf16, widened exactly to f32 in a register.
template <dtype T>
[[gnu::always_inline]] inline void load16(__m512& v, const std::byte* row, std::size_t k) noexcept {
  if constexpr (T == dtype::f32) {
    v = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (T == dtype::f16) {
    v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
  } else {
    static_assert(T == dtype::bf16);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
    v = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
}

// 16 bytes at p as 16 int32 lanes.
[[gnu::always_inline]] inline __m512i bytes16(const std::byte* p) noexcept {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lanes >> shift, & mask.
[[gnu::always_inline]] inline __m512i field(__m512i v, int shift, int mask) noexcept {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
}

// The 32 weights of group b of a row of a grouped type (lo = elements 0..15, hi = 16..31), each the
// value dequantize_row gives: float(quant) * scale (exact), or scale * quant - min and quant * d + m
// (an exact product, then one rounding, fused here).
template <dtype T>
[[gnu::always_inline]] inline void load_block(__m512& lo, __m512& hi, const std::byte* row, std::size_t b) noexcept {
  if constexpr (T == dtype::q5_0 || T == dtype::q5_1) {
    const std::byte* blk = row + b * info(T).bytes;
    const std::size_t at = T == dtype::q5_0 ? 2 : 4;  // qh, then the 16 bytes of nibbles
    std::uint32_t qh;
    std::memcpy(&qh, blk + at, sizeof qh);
    const __m512i q = bytes16(blk + at + 4), bits = _mm512_set1_epi32(static_cast<int>(qh));
    const __m512i e = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i fifth_lo = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, e), one), 4);
    const __m512i fifth_hi =
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, _mm512_add_epi32(e, _mm512_set1_epi32(16))), one), 4);
    __m512i ql = _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(15)), fifth_lo);
    __m512i qu = _mm512_or_si512(_mm512_srli_epi32(q, 4), fifth_hi);
    const __m512 d = _mm512_set1_ps(f16_at(blk));
    if constexpr (T == dtype::q5_0) {
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ql, _mm512_set1_epi32(16))), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qu, _mm512_set1_epi32(16))), d);
    } else {
      const __m512 m = _mm512_set1_ps(f16_at(blk + 2));
      lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d, m);
      hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qu), d, m);
    }
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {
    const std::byte* blk = row + b / 8 * info(T).bytes;
    const std::size_t j = b % 8;
    float ds, mm;
    k_scale_min(blk, j, ds, mm);
    const std::byte* qs = blk + (T == dtype::q4_k ? 16 : 48) + 32 * (j / 2);
    const int shift = 4 * static_cast<int>(j % 2);
    const __m512 s = _mm512_set1_ps(ds), m = _mm512_set1_ps(mm);
    if constexpr (T == dtype::q4_k) {
      // A table of the 16 values scale * q - min; vpermps reads only an index's low 4 bits.
      const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_fmsub_ps(s, levels, m);
      const __m128i shift_by = _mm_cvtsi32_si128(shift);
      lo = _mm512_permutexvar_ps(_mm512_srl_epi32(bytes16(qs), shift_by), table);
      hi = _mm512_permutexvar_ps(_mm512_srl_epi32(bytes16(qs + 16), shift_by), table);
    } else {
      __m512i ql = field(bytes16(qs), shift, 15), qu = field(bytes16(qs + 16), shift, 15);
      ql = _mm512_or_si512(ql, _mm512_slli_epi32(field(bytes16(blk + 16), static_cast<int>(j), 1), 4));
      qu = _mm512_or_si512(qu, _mm512_slli_epi32(field(bytes16(blk + 32), static_cast<int>(j), 1), 4));
      lo = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(ql), m);
      hi = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(qu), m);
    }
  } else if constexpr (T == dtype::q6_k) {
    const std::byte* blk = row + b / 8 * info(T).bytes;
    const std::size_t g = b % 8, h = g / 4, r = g % 4;
    const std::byte* low = blk + 64 * h + 32 * (r % 2);  // ql: the low 4 bits
    const std::byte* high = blk + 128 + 32 * h;          // qh: the high 2 bits
    const int ls = 4 * static_cast<int>(r / 2), hs = 2 * static_cast<int>(r);
    const __m512i off = _mm512_set1_epi32(32);
    const __m512i ql = _mm512_sub_epi32(
        _mm512_or_si512(field(bytes16(low), ls, 15), _mm512_slli_epi32(field(bytes16(high), hs, 3), 4)), off);
    const __m512i qu = _mm512_sub_epi32(
        _mm512_or_si512(field(bytes16(low + 16), ls, 15), _mm512_slli_epi32(field(bytes16(high + 16), hs, 3), 4)), off);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(ql), _mm512_set1_ps(q6_scale(blk, 2 * g)));
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qu), _mm512_set1_ps(q6_scale(blk, 2 * g + 1)));
  } else {
    const std::byte* blk = row + b * info(T).bytes;
    std::uint16_t bits;
    std::memcpy(&bits, blk, sizeof bits);
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    if constexpr (T == dtype::q8_0) {
      const __m128i qs_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs_hi)), d);
    } else {
      static_assert(T == dtype::q4_0);
      // A table of the 16 values (q - 8) * d; vpermps reads only an index's low 4 bits, so the low
      // nibble needs no mask.
      const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
      const __m512 table = _mm512_mul_ps(levels, d);
      const __m512i q = _mm512_cvtepu8_epi32(qs);
      lo = _mm512_permutexvar_ps(q, table);
      hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    }
  }
}

// Group g of a staged q5_k or q6_k super-block (stage_k): the values load_block gives.
template <dtype T>
[[gnu::always_inline]] inline void load_staged(__m512& lo, __m512& hi, const std::byte* q, const float* a,
                                               std::size_t g) noexcept {
  const __m128i q0 = _mm_load_si128(reinterpret_cast<const __m128i*>(q + 32 * g));
  const __m128i q1 = _mm_load_si128(reinterpret_cast<const __m128i*>(q + 32 * g + 16));
  if constexpr (T == dtype::q5_k) {
    const __m512 s = _mm512_set1_ps(a[g]), m = _mm512_set1_ps(a[8 + g]);
    lo = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), m);
    hi = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), m);
  } else {
    static_assert(T == dtype::q6_k);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_set1_ps(a[2 * g]));
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_set1_ps(a[2 * g + 1]));
  }
}

// out[n] = reduce_lanes(acc[n], tail[n]) for n < N, all 16 at once. Slot s of the network ends in
// lane 4 (s % 4) + s / 4, so output n is fed to slot 4 (n % 4) + n / 4 and lands in lane n. Each step
// adds the same pairs as reduce_lanes: a[i] + a[i + 8], then t8[i] + t8[i + 4], then
// (t4[0] + t4[2]) + (t4[1] + t4[3]), then the tail.
template <std::size_t N>
[[gnu::always_inline]] inline void reduce16(const __m512 (&acc)[N], const float* tail, float* out) noexcept {
  static_assert(N <= 16);
  __m512 a[16];
  for (std::size_t s = 0; s < 16; ++s) {
    const std::size_t n = 4 * (s % 4) + s / 4;
    a[s] = n < N ? acc[n] : _mm512_setzero_ps();
  }
  __m512 b[8], c[4];
  for (std::size_t p = 0; p < 8; ++p)  // [t8 of a[2p] | t8 of a[2p + 1]]
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
  for (std::size_t r = 0; r < 4; ++r)  // quad q = t4 of a[4r + q]
    c[r] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], 0xdd));
  // Per quad: [t4[0] + t4[2], t4[1] + t4[3]] of two neighbours, interleaved.
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xee));
  _mm512_storeu_ps(out, _mm512_add_ps(e, _mm512_loadu_ps(tail)));
}

// Pins a loaded vector to a register: without it GCC may fold the load into every FMA that uses the
// value, and a 4 x 4 tile then issues 32 loads per 16 FMAs, twice what the load ports sustain.
[[gnu::always_inline]] inline void in_register(__m512& v) noexcept { __asm__("" : "+v"(v)); }

// The 32 x values of each tile row from element k, pinned to registers when weight rows share them.
template <std::size_t MR, std::size_t NR>
[[gnu::always_inline]] inline void load_x(const float* const (&x)[MR], std::size_t k, __m512 (&xl)[MR],
                                          __m512 (&xh)[MR]) noexcept {
#pragma GCC unroll 16
  for (std::size_t i = 0; i < MR; ++i) {
    xl[i] = _mm512_loadu_ps(x[i] + k);
    xh[i] = _mm512_loadu_ps(x[i] + k + 16);
    if constexpr (NR > 1) {
      in_register(xl[i]);
      in_register(xh[i]);
    }
  }
}

// Group g of a q4_k weight row j (its quants q0, q1 as lanes; a: its row's k_scales_mins) into the
// sums: the weights through a table of the group's 16 values (vpermps reads an index's low 4 bits).
template <std::size_t MR, std::size_t NR>
[[gnu::always_inline]] inline void q4k_group(__m512 (&acc)[MR * NR], std::size_t j, const float* a, std::size_t g,
                                             __m512i q0, __m512i q1, const __m512 (&xl)[MR],
                                             const __m512 (&xh)[MR]) noexcept {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(a[g]), levels, _mm512_set1_ps(a[8 + g]));
  const __m512 lo = _mm512_permutexvar_ps(q0, table), hi = _mm512_permutexvar_ps(q1, table);
#pragma GCC unroll 16
  for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xl[i], lo, acc[i * NR + j]);
#pragma GCC unroll 16
  for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xh[i], hi, acc[i * NR + j]);
}

// out[i * NR + j] = dot(x[i], dequantized w[j]) over n elements, in the canonical order, with the
// weights read as stored.
template <dtype T, std::size_t MR, std::size_t NR>
[[gnu::always_inline]] inline void tile(const float* const (&x)[MR], const std::byte* const (&w)[NR], std::size_t n,
                                        float* out, prefetch_plan* pf) noexcept {
  static_assert(MR * NR <= 16);
  __m512 acc[MR * NR];
#pragma GCC unroll 16
  for (std::size_t t = 0; t < MR * NR; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) float tail[16] = {};
  if constexpr (T == dtype::q4_k) {
    // Super-block by super-block, each row's scales widened once (k_scales_mins); then pairs of groups,
    // which share their quant bytes (low and high nibbles), each through a table of its 16 values.
    // With few x rows the pair's bytes are widened once for both groups; otherwise the x vectors of two
    // groups would not fit in the registers beside the sums, and each group widens them again.
    constexpr bool share = MR * 4 + MR * NR + 6 <= 32;
    alignas(64) float a[NR][16];
    for (std::size_t sb = 0; sb < n / 256; ++sb) {
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) k_scales_mins(w[j] + sb * info(T).bytes, a[j]);
      for (std::size_t p = 0; p < 4; ++p) {
        prefetch_step(pf);
        prefetch_step(pf);
        const std::size_t at = 256 * sb + 64 * p;
        const std::byte* qs[NR];
#pragma GCC unroll 16
        for (std::size_t j = 0; j < NR; ++j) qs[j] = w[j] + sb * info(T).bytes + 16 + 32 * p;
        if constexpr (share) {
          __m512 xl0[MR], xh0[MR], xl1[MR], xh1[MR];
          load_x<MR, NR>(x, at, xl0, xh0);
          load_x<MR, NR>(x, at + 32, xl1, xh1);
#pragma GCC unroll 16
          for (std::size_t j = 0; j < NR; ++j) {
            const __m512i q0 = bytes16(qs[j]), q1 = bytes16(qs[j] + 16);  // vpermps reads the low 4 bits
            q4k_group<MR, NR>(acc, j, a[j], 2 * p, q0, q1, xl0, xh0);
            q4k_group<MR, NR>(acc, j, a[j], 2 * p + 1, _mm512_srli_epi32(q0, 4), _mm512_srli_epi32(q1, 4), xl1, xh1);
          }
        } else {
#pragma GCC unroll 2
          for (std::size_t half = 0; half < 2; ++half) {
            __m512 xl[MR], xh[MR];
            load_x<MR, NR>(x, at + 32 * half, xl, xh);
#pragma GCC unroll 16
            for (std::size_t j = 0; j < NR; ++j) {
              const __m512i q0 = bytes16(qs[j]), q1 = bytes16(qs[j] + 16);
              if (half == 0)
                q4k_group<MR, NR>(acc, j, a[j], 2 * p, q0, q1, xl, xh);
              else
                q4k_group<MR, NR>(acc, j, a[j], 2 * p + 1, _mm512_srli_epi32(q0, 4), _mm512_srli_epi32(q1, 4), xl, xh);
            }
          }
        }
      }
    }
  } else if constexpr (T == dtype::q5_k || T == dtype::q6_k) {
    // Super-block by super-block: each row's super-block staged (stage_k), then its 8 groups.
    alignas(64) std::byte q[NR][256];
    alignas(64) float a[NR][16];
    for (std::size_t sb = 0; sb < n / 256; ++sb) {
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) stage_k<T>(w[j] + sb * info(T).bytes, q[j], a[j]);
      for (std::size_t g = 0; g < 8; ++g) {
        prefetch_step(pf);
        __m512 xl[MR], xh[MR];
        load_x<MR, NR>(x, 256 * sb + 32 * g, xl, xh);
#pragma GCC unroll 16
        for (std::size_t j = 0; j < NR; ++j) {
          __m512 lo, hi;
          load_staged<T>(lo, hi, q[j], a[j], g);
#pragma GCC unroll 16
          for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xl[i], lo, acc[i * NR + j]);
#pragma GCC unroll 16
          for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xh[i], hi, acc[i * NR + j]);
        }
      }
    }
  } else if constexpr (grouped<T>) {
    for (std::size_t blk = 0; blk < n / 32; ++blk) {
      prefetch_step(pf);
      __m512 xl[MR], xh[MR];
#pragma GCC unroll 16
      for (std::size_t i = 0; i < MR; ++i) {
        xl[i] = _mm512_loadu_ps(x[i] + 32 * blk);
        xh[i] = _mm512_loadu_ps(x[i] + 32 * blk + 16);
        if constexpr (NR > 1) {
          in_register(xl[i]);
          in_register(xh[i]);
        }
      }
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) {
        __m512 lo, hi;
        load_block<T>(lo, hi, w[j], blk);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xl[i], lo, acc[i * NR + j]);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xh[i], hi, acc[i * NR + j]);
      }
    }
  } else {
    const std::size_t full = n - n % lanes;
    for (std::size_t k = 0; k < full; k += lanes) {
      prefetch_step(pf);
      __m512 xv[MR];
#pragma GCC unroll 16
      for (std::size_t i = 0; i < MR; ++i) {
        xv[i] = _mm512_loadu_ps(x[i] + k);
        if constexpr (NR > 1) in_register(xv[i]);
      }
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) {
        __m512 wv;
        load16<T>(wv, w[j], k);
        if constexpr (MR > 1) in_register(wv);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_fmadd_ps(xv[i], wv, acc[i * NR + j]);
      }
    }
    for (std::size_t i = 0; i < MR; ++i)
      for (std::size_t j = 0; j < NR; ++j)
        for (std::size_t k = full; k < n; ++k) tail[i * NR + j] = fma(x[i][k], weight_at<T>(w[j], k), tail[i * NR + j]);
  }
  reduce16(acc, tail, out);
}

// The prefill tile: 4 rows of x by 4 f32 weight rows, whole vectors k in [k_begin, k_end). The 16
// lane sums start from zero or, From_state, from `state` (256 floats, 64-byte aligned); To_state they
// go back there, else the tail past k_end is added and they are reduced into out[4 i + j]. Written
// out with named sums: with arrays of vectors, GCC 12 stores the sums or the x vectors to the stack
// at every step in these variants.
template <bool From_state, bool To_state>
[[gnu::noinline]] void panel_tile(const float* const (&x)[4], const float* const (&w)[4], std::size_t n,
                                  std::size_t k_begin, std::size_t k_end, float* state, float* out) noexcept {
  __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33;
  if constexpr (From_state) {
    c00 = _mm512_load_ps(state + 0 * lanes), c01 = _mm512_load_ps(state + 1 * lanes);
    c02 = _mm512_load_ps(state + 2 * lanes), c03 = _mm512_load_ps(state + 3 * lanes);
    c10 = _mm512_load_ps(state + 4 * lanes), c11 = _mm512_load_ps(state + 5 * lanes);
    c12 = _mm512_load_ps(state + 6 * lanes), c13 = _mm512_load_ps(state + 7 * lanes);
    c20 = _mm512_load_ps(state + 8 * lanes), c21 = _mm512_load_ps(state + 9 * lanes);
    c22 = _mm512_load_ps(state + 10 * lanes), c23 = _mm512_load_ps(state + 11 * lanes);
    c30 = _mm512_load_ps(state + 12 * lanes), c31 = _mm512_load_ps(state + 13 * lanes);
    c32 = _mm512_load_ps(state + 14 * lanes), c33 = _mm512_load_ps(state + 15 * lanes);
  } else {
    c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = _mm512_setzero_ps();
    c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = _mm512_setzero_ps();
  }
  for (std::size_t k = k_begin; k < k_end; k += lanes) {
    __m512 x0 = _mm512_loadu_ps(x[0] + k), x1 = _mm512_loadu_ps(x[1] + k);
    __m512 x2 = _mm512_loadu_ps(x[2] + k), x3 = _mm512_loadu_ps(x[3] + k);
    in_register(x0), in_register(x1), in_register(x2), in_register(x3);
    __m512 w0 = _mm512_loadu_ps(w[0] + k);
    in_register(w0);
    c00 = _mm512_fmadd_ps(x0, w0, c00), c10 = _mm512_fmadd_ps(x1, w0, c10);
    c20 = _mm512_fmadd_ps(x2, w0, c20), c30 = _mm512_fmadd_ps(x3, w0, c30);
    __m512 w1 = _mm512_loadu_ps(w[1] + k);
    in_register(w1);
    c01 = _mm512_fmadd_ps(x0, w1, c01), c11 = _mm512_fmadd_ps(x1, w1, c11);
    c21 = _mm512_fmadd_ps(x2, w1, c21), c31 = _mm512_fmadd_ps(x3, w1, c31);
    __m512 w2 = _mm512_loadu_ps(w[2] + k);
    in_register(w2);
    c02 = _mm512_fmadd_ps(x0, w2, c02), c12 = _mm512_fmadd_ps(x1, w2, c12);
    c22 = _mm512_fmadd_ps(x2, w2, c22), c32 = _mm512_fmadd_ps(x3, w2, c32);
    __m512 w3 = _mm512_loadu_ps(w[3] + k);
    in_register(w3);
    c03 = _mm512_fmadd_ps(x0, w3, c03), c13 = _mm512_fmadd_ps(x1, w3, c13);
    c23 = _mm512_fmadd_ps(x2, w3, c23), c33 = _mm512_fmadd_ps(x3, w3, c33);
  }
  const __m512 acc[16] = {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33};
  if constexpr (To_state) {
    for (std::size_t t = 0; t < 16; ++t) _mm512_store_ps(state + lanes * t, acc[t]);
  } else {
    alignas(64) float tail[16] = {};
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t j = 0; j < 4; ++j)
        for (std::size_t k = k_end; k < n; ++k) tail[i * 4 + j] = fma(x[i][k], w[j][k], tail[i * 4 + j]);
    reduce16(acc, tail, out);
  }
}

// A weight row of n elements dequantized into out, with the same conversions the tiles use.
template <dtype T>
inline void unpack_row(const std::byte* row, std::size_t n, float* out) noexcept {
  if constexpr (grouped<T>) {
    for (std::size_t blk = 0; blk < n / 32; ++blk) {
      __m512 lo, hi;
      load_block<T>(lo, hi, row, blk);
      _mm512_storeu_ps(out + 32 * blk, lo);
      _mm512_storeu_ps(out + 32 * blk + 16, hi);
    }
  } else {
    const std::size_t full = n - n % lanes;
    for (std::size_t k = 0; k < full; k += lanes) {
      __m512 v;
      load16<T>(v, row, k);
      _mm512_storeu_ps(out + k, v);
    }
    for (std::size_t k = full; k < n; ++k) out[k] = weight_at<T>(row, k);
  }
}

// Weight rows per prefill tile (a task takes whole tiles).
inline constexpr std::size_t panel_nr = 4;

#elif EFIM_K_AVX2
// AVX2 + FMA + F16C. A canonical 16-lane sum lives in two ymm registers: lo (lanes 0-7: k = 16s + 0..7)
// and hi (lanes 8-15: k = 16s + 8..15); reduce8x2 adds the same pairs in the same order as reduce_lanes,
// so the bits equal the AVX-512 path's.

// Pins a vector to a register (see the AVX-512 path's in_register).
[[gnu::always_inline]] inline void in_register(__m256& v) noexcept { __asm__("" : "+x"(v)); }

// 8 weights of a row from element k, f32, f16 or bf16, widened exactly to f32.
template <dtype T>
[[gnu::always_inline]] inline __m256 load8(const std::byte* row, std::size_t k) noexcept {
  if constexpr (T == dtype::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (T == dtype::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
  } else {
    static_assert(T == dtype::bf16);
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

// 8 bytes at p as 8 int32 lanes.
[[gnu::always_inline]] inline __m256i bytes8(const std::byte* p) noexcept {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Lanes >> shift, & mask.
[[gnu::always_inline]] inline __m256i field(__m256i v, int shift, int mask) noexcept {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}

// The 32 weights of group b of a row of a grouped type, v[h] = elements 8h .. 8h + 7, each the value
// dequantize_row gives (see the AVX-512 path's load_block).
template <dtype T>
[[gnu::always_inline]] inline void load_block(__m256 (&v)[4], const std::byte* row, std::size_t b) noexcept {
  if constexpr (T == dtype::q5_0 || T == dtype::q5_1) {
    const std::byte* blk = row + b * info(T).bytes;
    const std::size_t at = T == dtype::q5_0 ? 2 : 4;
    std::uint32_t qh;
    std::memcpy(&qh, blk + at, sizeof qh);
    const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh)), one = _mm256_set1_epi32(1);
    const __m256 d = _mm256_set1_ps(f16_at(blk));
#pragma GCC unroll 4
    for (std::size_t h = 0; h < 4; ++h) {
      const __m256i e = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i fifth = _mm256_slli_epi32(
          _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(e, _mm256_set1_epi32(8 * static_cast<int>(h)))), one),
          4);
      const __m256i q = _mm256_or_si256(field(bytes8(blk + at + 4 + 8 * (h % 2)), 4 * static_cast<int>(h / 2), 15), fifth);
      if constexpr (T == dtype::q5_0)
        v[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))), d);
      else
        v[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, _mm256_set1_ps(f16_at(blk + 2)));
    }
  } else if constexpr (T == dtype::q4_k || T == dtype::q5_k) {
    const std::byte* blk = row + b / 8 * info(T).bytes;
    const std::size_t j = b % 8;
    float ds, mm;
    k_scale_min(blk, j, ds, mm);
    const std::byte* qs = blk + (T == dtype::q4_k ? 16 : 48) + 32 * (j / 2);
    const __m256 s = _mm256_set1_ps(ds), m = _mm256_set1_ps(mm);
#pragma GCC unroll 4
    for (std::size_t h = 0; h < 4; ++h) {
      __m256i q = field(bytes8(qs + 8 * h), 4 * static_cast<int>(j % 2), 15);
      if constexpr (T == dtype::q5_k)
        q = _mm256_or_si256(q, _mm256_slli_epi32(field(bytes8(blk + 16 + 8 * h), static_cast<int>(j), 1), 4));
      v[h] = _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(q), m);
    }
  } else if constexpr (T == dtype::q6_k) {
    const std::byte* blk = row + b / 8 * info(T).bytes;
    const std::size_t g = b % 8, half = g / 4, r = g % 4;
    const std::byte* low = blk + 64 * half + 32 * (r % 2);
    const std::byte* high = blk + 128 + 32 * half;
    const float s[2] = {q6_scale(blk, 2 * g), q6_scale(blk, 2 * g + 1)};
#pragma GCC unroll 4
    for (std::size_t h = 0; h < 4; ++h) {
      const __m256i q = _mm256_sub_epi32(
          _mm256_or_si256(field(bytes8(low + 8 * h), 4 * static_cast<int>(r / 2), 15),
                          _mm256_slli_epi32(field(bytes8(high + 8 * h), 2 * static_cast<int>(r), 3), 4)),
          _mm256_set1_epi32(32));
      v[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s[h / 2]));
    }
  } else {
    const std::byte* blk = row + b * info(T).bytes;
    std::uint16_t bits;
    std::memcpy(&bits, blk, sizeof bits);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits)));
    if constexpr (T == dtype::q8_0) {
#pragma GCC unroll 4
      for (std::size_t h = 0; h < 4; ++h) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * h));
        v[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
      }
    } else {
      static_assert(T == dtype::q4_0);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m128i low = _mm_set1_epi8(15);
      const __m128i q[2] = {_mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low)};  // 0-15, 16-31
      const __m256i eight = _mm256_set1_epi32(8);
#pragma GCC unroll 4
      for (std::size_t h = 0; h < 4; ++h) {
        const __m128i bytes = h % 2 == 0 ? q[h / 2] : _mm_unpackhi_epi64(q[h / 2], q[h / 2]);
        const __m256i level = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight);
        v[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(level), d);
      }
    }
  }
}

// Group g of a staged q5_k or q6_k super-block (stage_k), v[h] = elements 8h .. 8h + 7: the values
// load_block gives.
template <dtype T>
[[gnu::always_inline]] inline void load_staged(__m256 (&v)[4], const std::byte* q, const float* a,
                                               std::size_t g) noexcept {
#pragma GCC unroll 4
  for (std::size_t h = 0; h < 4; ++h) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 32 * g + 8 * h));
    if constexpr (T == dtype::q5_k)
      v[h] = _mm256_fmsub_ps(_mm256_set1_ps(a[g]), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                             _mm256_set1_ps(a[8 + g]));
    else
      v[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_set1_ps(a[2 * g + h / 2]));
  }
}

// reduce_lanes of the 16 lanes (lo, hi) plus the tail.
[[gnu::always_inline]] inline float reduce8x2(__m256 lo, __m256 hi, float tail) noexcept {
  const __m256 t8 = _mm256_add_ps(lo, hi);                                                 // a[i] + a[i + 8]
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));  // t8[i] + t8[i + 4]
  const __m128 u = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));  // t4[0] + t4[2], t4[1] + t4[3]
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u))) + tail;
}

// out[t] = reduce8x2(lo[t], hi[t], tail[t]) for t < 4, the vectors 8 floats apart from lo and hi
// (32-byte aligned), all four at once: the same additions of the same pairs.
[[gnu::always_inline]] inline void reduce8x2_4(const float* lo, const float* hi, const float* tail,
                                               float* out) noexcept {
  __m256 t8[4];
  for (std::size_t t = 0; t < 4; ++t) t8[t] = _mm256_add_ps(_mm256_load_ps(lo + 8 * t), _mm256_load_ps(hi + 8 * t));
  // [t4 of sum 0 | t4 of sum 1] and [t4 of 2 | t4 of 3]: t8[i] + t8[i + 4].
  const __m256 p =
      _mm256_add_ps(_mm256_permute2f128_ps(t8[0], t8[1], 0x20), _mm256_permute2f128_ps(t8[0], t8[1], 0x31));
  const __m256 q =
      _mm256_add_ps(_mm256_permute2f128_ps(t8[2], t8[3], 0x20), _mm256_permute2f128_ps(t8[2], t8[3], 0x31));
  // Per half: [t4[0] + t4[2], t4[1] + t4[3]] of sums 0 and 2 (low half), 1 and 3 (high half).
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(p, q, 0x44), _mm256_shuffle_ps(p, q, 0xee));
  const __m256 f = _mm256_hadd_ps(u, u);  // low half [s0, s2, ..], high half [s1, s3, ..]
  const __m128 lo_half = _mm256_castps256_ps128(f), hi_half = _mm256_extractf128_ps(f, 1);
  const __m128 sums = _mm_unpacklo_ps(lo_half, hi_half);  // s0, s1, s2, s3
  _mm_storeu_ps(out, _mm_add_ps(sums, _mm_loadu_ps(tail)));
}

// One step of a canonical sum (lo, hi): 8 weights v times x from element k (lanes 8 (k / 8 % 2) ..).
[[gnu::always_inline]] inline void fma8(__m256& lo, __m256& hi, const float* x, std::size_t k, __m256 v) noexcept {
  __m256& sum = k / 8 % 2 == 0 ? lo : hi;
  sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), v, sum);
}

// Decode: out[i * NR + j] = dot(x[i], dequantized w[j]) over n elements with the weights read as stored.
template <dtype T, std::size_t MR, std::size_t NR>
[[gnu::always_inline]] inline void tile(const float* const (&x)[MR], const std::byte* const (&w)[NR], std::size_t n,
                                        float* out, prefetch_plan* pf) noexcept {
  __m256 lo[MR * NR], hi[MR * NR];
#pragma GCC unroll 16
  for (std::size_t t = 0; t < MR * NR; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
  float tail[MR * NR] = {};
  if constexpr (T == dtype::q4_k) {
    // Super-block by super-block, each row's scales widened once (k_scales_mins); then pairs of groups,
    // which share their quant bytes (low and high nibbles): widened once, then group 2p, then 2p + 1.
    alignas(32) float a[NR][16];
    const __m256i low4 = _mm256_set1_epi32(15);
    for (std::size_t sb = 0; sb < n / 256; ++sb) {
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) k_scales_mins(w[j] + sb * info(T).bytes, a[j]);
      for (std::size_t p = 0; p < 4; ++p) {
        prefetch_step(pf);
        prefetch_step(pf);
#pragma GCC unroll 16
        for (std::size_t j = 0; j < NR; ++j) {
          const std::byte* qs = w[j] + sb * info(T).bytes + 16 + 32 * p;
          __m256i q[4];
#pragma GCC unroll 4
          for (std::size_t h = 0; h < 4; ++h) q[h] = bytes8(qs + 8 * h);
#pragma GCC unroll 2
          for (std::size_t half = 0; half < 2; ++half) {
            const std::size_t g = 2 * p + half;
            const __m256 s = _mm256_set1_ps(a[j][g]), m = _mm256_set1_ps(a[j][8 + g]);
#pragma GCC unroll 4
            for (std::size_t h = 0; h < 4; ++h) {
              const __m256i level = half == 0 ? _mm256_and_si256(q[h], low4) : _mm256_srli_epi32(q[h], 4);
              const __m256 v = _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(level), m);
#pragma GCC unroll 16
              for (std::size_t i = 0; i < MR; ++i)
                fma8(lo[i * NR + j], hi[i * NR + j], x[i], 256 * sb + 32 * g + 8 * h, v);
            }
          }
        }
      }
    }
  } else if constexpr (T == dtype::q5_k || T == dtype::q6_k) {
    // Super-block by super-block: each row's super-block staged (stage_k), then its 8 groups.
    alignas(32) std::byte q[NR][256];
    alignas(32) float a[NR][16];
    for (std::size_t sb = 0; sb < n / 256; ++sb) {
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) stage_k<T>(w[j] + sb * info(T).bytes, q[j], a[j]);
      for (std::size_t g = 0; g < 8; ++g) {
        prefetch_step(pf);
#pragma GCC unroll 16
        for (std::size_t j = 0; j < NR; ++j) {
          __m256 v[4];
          load_staged<T>(v, q[j], a[j], g);
#pragma GCC unroll 16
          for (std::size_t i = 0; i < MR; ++i)
#pragma GCC unroll 4
            for (std::size_t h = 0; h < 4; ++h)
              fma8(lo[i * NR + j], hi[i * NR + j], x[i], 256 * sb + 32 * g + 8 * h, v[h]);
        }
      }
    }
  } else if constexpr (grouped<T>) {
    for (std::size_t blk = 0; blk < n / 32; ++blk) {
      prefetch_step(pf);
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) {
        __m256 v[4];
        load_block<T>(v, w[j], blk);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < MR; ++i) {
          const float* xb = x[i] + 32 * blk;
          lo[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v[0], lo[i * NR + j]);
          hi[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], hi[i * NR + j]);
          lo[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], lo[i * NR + j]);
          hi[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], hi[i * NR + j]);
        }
      }
    }
  } else {
    const std::size_t full = n - n % lanes;
    for (std::size_t k = 0; k < full; k += lanes) {
      prefetch_step(pf);
#pragma GCC unroll 16
      for (std::size_t j = 0; j < NR; ++j) {
        const __m256 wl = load8<T>(w[j], k), wh = load8<T>(w[j], k + 8);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < MR; ++i) {
          lo[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), wl, lo[i * NR + j]);
          hi[i * NR + j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k + 8), wh, hi[i * NR + j]);
        }
      }
    }
    for (std::size_t i = 0; i < MR; ++i)
      for (std::size_t j = 0; j < NR; ++j)
        for (std::size_t k = full; k < n; ++k) tail[i * NR + j] = fma(x[i][k], weight_at<T>(w[j], k), tail[i * NR + j]);
  }
#pragma GCC unroll 16
  for (std::size_t t = 0; t < MR * NR; ++t) out[t] = reduce8x2(lo[t], hi[t], tail[t]);
}

// 8 weights of a prefill tile's row: f32 from the aligned panel, or f16 read where it is stored.
[[gnu::always_inline]] inline __m256 panel_load(const float* p) noexcept { return _mm256_load_ps(p); }
[[gnu::always_inline]] inline __m256 panel_load(const half* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Half of a prefill tile's lane sums: lanes `off` .. `off` + 7 (off = 0 or 8) of the 4 x 3 canonical
// 16-lane sums of x rows by weight rows, over whole 16-lane steps k in [k_begin, k_end), starting from
// zero or, From_state, from the 12 vectors at `st` (x row major), where they go back. One half at a
// time keeps 12 sums, 3 weight vectors and an x vector in the 16 ymm registers: 7 loads per 12 FMAs,
// where both halves at once (2 x 3 sums) take 5 loads per 6.
template <bool From_state, class W>
[[gnu::always_inline]] inline void panel_half(const float* const (&x)[4], const W* const (&w)[3], std::size_t off,
                                              std::size_t k_begin, std::size_t k_end, float* st) noexcept {
  __m256 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;  // digit 1: x row, digit 2: w row
  if constexpr (From_state) {
    c00 = _mm256_load_ps(st + 0), c01 = _mm256_load_ps(st + 8), c02 = _mm256_load_ps(st + 16);
    c10 = _mm256_load_ps(st + 24), c11 = _mm256_load_ps(st + 32), c12 = _mm256_load_ps(st + 40);
    c20 = _mm256_load_ps(st + 48), c21 = _mm256_load_ps(st + 56), c22 = _mm256_load_ps(st + 64);
    c30 = _mm256_load_ps(st + 72), c31 = _mm256_load_ps(st + 80), c32 = _mm256_load_ps(st + 88);
  } else {
    c00 = c01 = c02 = c10 = c11 = c12 = c20 = c21 = c22 = c30 = c31 = c32 = _mm256_setzero_ps();
  }
  const float *x0 = x[0] + off, *x1 = x[1] + off, *x2 = x[2] + off, *x3 = x[3] + off;
  const W *w0 = w[0] + off, *w1 = w[1] + off, *w2 = w[2] + off;
  for (std::size_t k = k_begin; k < k_end; k += lanes) {
    __m256 v0 = panel_load(w0 + k), v1 = panel_load(w1 + k), v2 = panel_load(w2 + k);
    in_register(v0), in_register(v1), in_register(v2);
    __m256 a = _mm256_loadu_ps(x0 + k);
    in_register(a);
    c00 = _mm256_fmadd_ps(a, v0, c00), c01 = _mm256_fmadd_ps(a, v1, c01), c02 = _mm256_fmadd_ps(a, v2, c02);
    a = _mm256_loadu_ps(x1 + k);
    in_register(a);
    c10 = _mm256_fmadd_ps(a, v0, c10), c11 = _mm256_fmadd_ps(a, v1, c11), c12 = _mm256_fmadd_ps(a, v2, c12);
    a = _mm256_loadu_ps(x2 + k);
    in_register(a);
    c20 = _mm256_fmadd_ps(a, v0, c20), c21 = _mm256_fmadd_ps(a, v1, c21), c22 = _mm256_fmadd_ps(a, v2, c22);
    a = _mm256_loadu_ps(x3 + k);
    in_register(a);
    c30 = _mm256_fmadd_ps(a, v0, c30), c31 = _mm256_fmadd_ps(a, v1, c31), c32 = _mm256_fmadd_ps(a, v2, c32);
  }
  _mm256_store_ps(st + 0, c00), _mm256_store_ps(st + 8, c01), _mm256_store_ps(st + 16, c02);
  _mm256_store_ps(st + 24, c10), _mm256_store_ps(st + 32, c11), _mm256_store_ps(st + 40, c12);
  _mm256_store_ps(st + 48, c20), _mm256_store_ps(st + 56, c21), _mm256_store_ps(st + 64, c22);
  _mm256_store_ps(st + 72, c30), _mm256_store_ps(st + 80, c31), _mm256_store_ps(st + 88, c32);
}

// The weight rows [0, nc) of a panel (row stride ld) by 4 rows of x, in tiles of 3 weight rows, over
// k in [k_begin, k_end): tile t's 24 lane-sum vectors (lanes 0-7 of its 12 sums, then lanes 8-15) in
// state + 192 t, 32-byte aligned. Out of line, one call for the strip.
template <bool From_state, class W>
[[gnu::noinline]] void panel_strip(const float* const (&x)[4], const W* panel, std::size_t ld, std::size_t nc,
                                   std::size_t k_begin, std::size_t k_end, float* state) noexcept {
  for (std::size_t j0 = 0; j0 < nc; j0 += 3, state += 192) {
    const W* const w[3] = {panel + j0 * ld, panel + std::min(j0 + 1, nc - 1) * ld,
                           panel + std::min(j0 + 2, nc - 1) * ld};  // past nc: repeat
    panel_half<From_state>(x, w, 0, k_begin, k_end, state);
    panel_half<From_state>(x, w, 8, k_begin, k_end, state + 96);
  }
}

// A weight row of n elements dequantized into out, with the same conversions the tiles use.
template <dtype T>
inline void unpack_row(const std::byte* row, std::size_t n, float* out) noexcept {
  if constexpr (grouped<T>) {
    for (std::size_t blk = 0; blk < n / 32; ++blk) {
      __m256 v[4];
      load_block<T>(v, row, blk);
#pragma GCC unroll 4
      for (std::size_t h = 0; h < 4; ++h) _mm256_storeu_ps(out + 32 * blk + 8 * h, v[h]);
    }
  } else {
    const std::size_t full = n - n % 8;
    for (std::size_t k = 0; k < full; k += 8) _mm256_storeu_ps(out + k, load8<T>(row, k));
    for (std::size_t k = full; k < n; ++k) out[k] = weight_at<T>(row, k);
  }
}

// Weight rows per prefill tile (a task takes whole tiles).
inline constexpr std::size_t panel_nr = 3;

#endif

#if EFIM_K_AVX512 || EFIM_K_AVX2
// A decode tile out of line: inlined into the loops around it, GCC 12 keeps the x vectors and the
// row pointers on the stack and reloads them at every step.
template <dtype T, std::size_t MR, std::size_t NR>
[[gnu::noinline]] void stream_tile(const float* const (&x)[MR], const std::byte* const (&w)[NR], std::size_t n,
                                   float* out, prefetch_plan* pf) noexcept {
  if (pf == nullptr) return tile<T, MR, NR>(x, w, n, out, nullptr);  // a loop without the prefetch test
  tile<T, MR, NR>(x, w, n, out, pf);
}

// Decode: rows [i0, i0 + MR) of x against weight rows [j0, j0 + nj), nj <= 16, read as stored;
// `pf` (or null) spreads the prefetches of [pf_begin, pf_end) over the k loop.
template <dtype T, std::size_t MR, std::size_t NR>
inline void stream_block(const float* x, std::size_t i0, const weight_view& w, std::size_t rb, std::size_t j0,
                         std::size_t nj, float* y, accumulate acc, const std::byte* pf_begin,
                         const std::byte* pf_end) noexcept {
  const std::size_t n = w.cols;
  const float* xs[MR];
  for (std::size_t i = 0; i < MR; ++i) xs[i] = x + (i0 + i) * n;
  constexpr std::size_t tiles = 16 / NR, step = grouped<T> ? 32 : lanes;
  prefetch_plan plan{reinterpret_cast<std::uintptr_t>(pf_begin), reinterpret_cast<std::uintptr_t>(pf_end), 0,
                     static_cast<std::size_t>(pf_end - pf_begin) > l1_prefetch_bytes};
  const std::size_t lines = (plan.end - plan.next + 63) / 64, steps = std::max<std::size_t>(1, n / step * tiles);
  plan.per_step = (lines + steps - 1) / steps;
  for (std::size_t jt = 0; jt < nj; jt += NR) {
    const std::byte* ws[NR];
    for (std::size_t j = 0; j < NR; ++j) ws[j] = w.data + (j0 + std::min(jt + j, nj - 1)) * rb;  // past nj: repeat
    alignas(64) float out[16];
    stream_tile<T, MR, NR>(xs, ws, n, out, lines ? &plan : nullptr);
    store_tile(out, NR, y + i0 * w.rows + j0 + jt, w.rows, MR, std::min(NR, nj - jt), acc);
  }
}

#endif

#if EFIM_K_AVX512
// Whether stream_rows hands m x rows to the AVX2 path's tiles (see there).
template <dtype T>
inline bool avx2_tiles(std::size_t m) noexcept {
#if defined(EFIM_K_AVX2_PATH_DEFINED)
  return !unpacked<T> && decode_streams(T) && m == 1;
#else
  (void)m;
  return false;
#endif
}

// Decode (m <= 8): weight rows [r0, r1) in blocks of 16, each block read from memory once (the next
// one prefetched meanwhile) and reused from cache by the 4-, 2- and 1-row tiles of x that cover m
// (4 x 4, 2 x 8 or 1 x 8 tiles: 16 or 8 accumulators, one reduction network).
template <dtype T>
inline void stream_rows(const float* x, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1, float* y,
                        accumulate acc) noexcept {
#if defined(EFIM_K_AVX2_PATH_DEFINED)
  // One row of every type that unpacks no nibbles streams faster through the AVX2 path's four streams
  // (isa_avx2::four_streams) on Zen 4 (f16 1.1-1.3x, f32 1.3-1.4x, bf16 1.6-2.5x, q8_0 1.1-1.3x), whose
  // lane sums and reduction give the same bits; 2 to 8 rows of f16 do not (the f16 model's decode of 4
  // and 8 sequences 1.19x and 1.35x faster through these tiles, which convert each weight once for
  // every four rows, where the AVX2 path's 2 x 2 tiles do for every two). (A generic path compiled for
  // AVX-512 comes before the AVX2 one and keeps its own tiles.) Where decode_streams(T) says (the kind
  // tune_decode_tiles measured faster for T, else AMD CPUs; EFIM_DECODE_TILES overrides): on Intel cores
  // the AVX2 path's one-row stream (no software prefetch; before four_streams, not measured there
  // since) read half of what these 8-row tiles with the next block prefetched read (Emerald Rapids, 2
  // threads, 151,936 x 768: f16 14.3 -> 23.5 GB/s of weights, bf16 13.7 -> 21.5, f32 18.4 -> 22.1).
  if (avx2_tiles<T>(m)) return isa_avx2::stream_rows<T>(x, m, w, r0, r1, y, acc);
#endif
  const std::size_t rb = row_bytes(w.type, w.cols);
  for (std::size_t j0 = r0; j0 < r1; j0 += 16) {
    const std::size_t nj = std::min<std::size_t>(16, r1 - j0);
    const std::byte* pf_begin = w.data + std::min(j0 + 16, r1) * rb;
    const std::byte* pf_end = w.data + std::min(j0 + 32, r1) * rb;
    for (std::size_t i0 = 0; i0 < m;) {
      if (m - i0 >= 4) {
        stream_block<T, 4, 4>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);
        i0 += 4;
      } else if (m - i0 >= 2) {
        stream_block<T, 2, 8>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);
        i0 += 2;
      } else {
        // 8 row streams at a time: 16 were 1.5x slower for f16 on Zen 4 (double-pumped conversions and
        // twice the streams for its prefetchers), and rows a multiple of 2 KiB apart put 16 streams into
        // at most 2 of L1's 12-way sets.
        stream_block<T, 1, 8>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);
        i0 += 1;
      }
      pf_begin = pf_end;  // the first tile of x prefetched it all
    }
  }
}

// Whether stream_rows reads one x row through the AVX2 path's four streams (isa_avx2::four_streams).
template <dtype T>
inline bool four_stream_rows(std::size_t m) noexcept {
  return m == 1 && avx2_tiles<T>(m);
}

// Decode on f16 or bf16 rows interleaved (interleave.hpp): a group's 8 rows, 16 elements of each a
// step (256 bytes: the run's groups are one sequential stream), against MR x rows: MR * 8 canonical lane
// sums, reduced as the stream tiles' are (the same bits). Where `end` is not 0, each step prefetches the
// 4 lines il8_float_l2_ahead bytes ahead into L2 and il8_float_l1_ahead ahead into L1, short of `end`
// (the run's end): in a read loop on an Emerald Rapids Xeon the hardware prefetchers alone read 0.7x
// of that. On a Zen 5 EPYC this one stream a thread reads 0.65-0.75x the rows as stored whatever the
// prefetch (none, 2-16 KiB ahead), so the models keep f16 and bf16 as stored there (matmul.hpp:
// interleave_floats_by_default; docs/benchmarks.md).
inline constexpr std::size_t il8_float_l2_ahead = 4096, il8_float_l1_ahead = 512;

template <dtype T, std::size_t MR>
[[gnu::noinline]] void il8_float_tile(const float* const (&x)[MR], const std::byte* g, std::size_t n, float* out,
                                      std::uintptr_t end) noexcept {
  __m512 acc[MR * 8];
#pragma GCC unroll 24
  for (std::size_t t = 0; t < MR * 8; ++t) acc[t] = _mm512_setzero_ps();
  for (std::size_t b = 0; b < n / 16; ++b) {
    const std::byte* const blk = g + 256 * b;
    if (end != 0) {
      const std::uintptr_t l2 = reinterpret_cast<std::uintptr_t>(blk) + il8_float_l2_ahead;
      const std::uintptr_t l1 = reinterpret_cast<std::uintptr_t>(blk) + il8_float_l1_ahead;
#pragma GCC unroll 4
      for (std::uintptr_t q = 0; q < 256; q += 64) {
        if (l2 + q < end) __builtin_prefetch(reinterpret_cast<const void*>(l2 + q), 0, 2);
        if (l1 + q < end) __builtin_prefetch(reinterpret_cast<const void*>(l1 + q), 0, 3);
      }
    }
    __m512 xv[MR];
#pragma GCC unroll 4
    for (std::size_t i = 0; i < MR; ++i) {
      xv[i] = _mm512_loadu_ps(x[i] + 16 * b);
      in_register(xv[i]);
    }
#pragma GCC unroll 8
    for (std::size_t r = 0; r < 8; ++r) {
      __m512 wv;
      load16<T>(wv, blk + 32 * r, 0);
      if constexpr (MR > 1) in_register(wv);
#pragma GCC unroll 4
      for (std::size_t i = 0; i < MR; ++i) acc[i * 8 + r] = _mm512_fmadd_ps(xv[i], wv, acc[i * 8 + r]);
    }
  }
  alignas(64) const float tail[16] = {};
  if constexpr (MR <= 2) {
    reduce16(acc, tail, out);
  } else {
    static_assert(MR == 3);
    __m512 lo[16], hi[8];
    for (std::size_t t = 0; t < 16; ++t) lo[t] = acc[t];
    for (std::size_t t = 0; t < 8; ++t) hi[t] = acc[16 + t];
    reduce16(lo, tail, out);
    reduce16(hi, tail, out + 16);
  }
}

// Decode (m <= stream_rows_bound) on f16 or bf16 rows interleaved: groups [g0, g1) of 8 rows, each read
// from memory once by the first tile of x rows (3 x 8, 2 x 8 or 1 x 8), the others reading it from L1.
template <dtype T>
inline void il8_float_rows(const float* x, std::size_t m, const weight_view& w, std::size_t g0, std::size_t g1,
                           float* y, accumulate acc) noexcept {
  const std::size_t n = w.cols, gb = 8 * row_bytes(w.type, n);
  const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(w.data + g1 * gb);
  for (std::size_t g = g0; g < g1; ++g) {
    const std::byte* const gp = w.data + g * gb;
    for (std::size_t i0 = 0; i0 < m;) {
      const std::size_t mr = m - i0 >= 3 ? 3 : m - i0;
      const std::uintptr_t pf = i0 == 0 ? end : 0;
      alignas(64) float out[32];
      if (mr == 3) {
        const float* const xs[3] = {x + i0 * n, x + (i0 + 1) * n, x + (i0 + 2) * n};
        il8_float_tile<T, 3>(xs, gp, n, out, pf);
      } else if (mr == 2) {
        const float* const xs[2] = {x + i0 * n, x + (i0 + 1) * n};
        il8_float_tile<T, 2>(xs, gp, n, out, pf);
      } else {
        const float* const xs[1] = {x + i0 * n};
        il8_float_tile<T, 1>(xs, gp, n, out, pf);
      }
      store_tile(out, 8, y + i0 * w.rows + 8 * g, w.rows, mr, 8, acc);
      i0 += mr;
    }
  }
}

// Row `row` of w (rows as stored or f16 / bf16 interleaved) dequantized into out (w.cols floats).
template <dtype T>
inline void unpack_row_of(const weight_view& w, std::size_t rb, std::size_t row, float* out) noexcept {
  if constexpr (interleavable_floats(T)) {
    if (w.layout == weight_layout::interleaved8 && row < w.rows / 8 * 8) {
      const std::byte* const at = w.data + row / 8 * 8 * rb + 32 * (row % 8);  // element k at 16 k further
      for (std::size_t k = 0; k < w.cols; k += lanes) {
        __m512 v;
        load16<T>(v, at + 16 * k, 0);
        _mm512_storeu_ps(out + k, v);
      }
      return;
    }
  }
  unpack_row<T>(w.data + row * rb, w.cols, out);
}

// Prefill (m > 8): weight rows [r0, r1) panel by panel. Each panel is dequantized (or copied) once
// into 64-byte aligned scratch (a load that splits a cache line costs twice) and every 4-row tile of
// x runs over it: the x tile stays in L1, the panel in L2. x is read where it is (copying it aligned
// costs more than its split loads). Rows longer than 1536 go in ranges of 1024 columns, so that the x
// tile's range and a weight tile's still fit in L1 together; the lane sums wait in `state` between.
template <dtype T>
inline void panel_rows(const float* x, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1, float* y,
                       accumulate acc) {
  constexpr std::size_t MR = 4, NR = 4, tile_floats = MR * NR * lanes;
  const std::size_t n = w.cols, ldy = w.rows, rb = row_bytes(w.type, n), ld = scratch_stride(n);
  const std::size_t full = n - n % lanes, range = n <= 1536 ? std::max<std::size_t>(full, 1) : 1024;
  const std::size_t ranges = std::max<std::size_t>(1, (full + range - 1) / range);
  const std::size_t step = detail::panel_height(r1 - r0, std::min(n, range), NR);
  float* const state = panel_scratch(step / NR * tile_floats + step * ld);
  float* const panel = state + step / NR * tile_floats;
  for (std::size_t p0 = r0; p0 < r1; p0 += step) {
    const std::size_t nc = std::min(step, r1 - p0);
    for (std::size_t r = 0; r < nc; ++r) unpack_row_of<T>(w, rb, p0 + r, panel + r * ld);
    for (std::size_t i0 = 0; i0 < m; i0 += MR) {
      const float* xs[MR];
      for (std::size_t i = 0; i < MR; ++i) xs[i] = x + std::min(i0 + i, m - 1) * n;  // past m: repeat, not stored
      for (std::size_t r = 0; r < ranges; ++r) {
        const std::size_t k0 = r * range, k1 = r + 1 == ranges ? full : k0 + range;
        for (std::size_t j0 = 0; j0 < nc; j0 += NR) {
          const float* ws[NR];
          for (std::size_t j = 0; j < NR; ++j) ws[j] = panel + std::min(j0 + j, nc - 1) * ld;  // past nc: repeat
          float* const st = state + j0 / NR * tile_floats;
          alignas(64) float out[16];
          if (ranges == 1) {
            panel_tile<false, false>(xs, ws, n, k0, k1, st, out);
          } else if (r == 0) {
            panel_tile<false, true>(xs, ws, n, k0, k1, st, out);
            continue;
          } else if (r + 1 < ranges) {
            panel_tile<true, true>(xs, ws, n, k0, k1, st, out);
            continue;
          } else {
            panel_tile<true, false>(xs, ws, n, k0, k1, st, out);
          }
          float* const dst = y + i0 * ldy + p0 + j0;
          if (i0 + MR <= m && j0 + NR <= nc) {
            for (std::size_t i = 0; i < MR; ++i) {
              __m128 v = _mm_load_ps(out + i * NR);
              if (acc == accumulate::yes) v = _mm_add_ps(_mm_loadu_ps(dst + i * ldy), v);
              _mm_storeu_ps(dst + i * ldy, v);
            }
          } else {
            store_tile(out, NR, dst, ldy, std::min(MR, m - i0), std::min(NR, nc - j0), acc);
          }
        }
      }
    }
  }
}

#elif EFIM_K_AVX2
// Whether stream_rows reads one x row in four streams (four_streams).
template <dtype T>
inline bool four_stream_rows(std::size_t m) noexcept {
  return !unpacked<T> && m == 1;
}

// One x row against weight rows [r0, r1) of a type that unpacks no nibbles, with no software prefetch:
// the rows in four sequential streams, a quarter of them each, read side by side by 1 x 4 tiles (rows
// r0 + i, r0 + q + i, r0 + 2q + i and r0 + 3q + i), the rows past the last whole quarter one at a time.
// Each stream goes on where its last row ended, so the hardware prefetchers can follow all four as
// they follow one; the four rows' canonical sums are independent chains, where one row's chain waits on
// each step of 16 weights (4 cycles for 32 bytes of f16) and, behind it, the loads after a stall. Same
// bits: a row's sum does not depend on its tile. Zen 4, 2 threads, the f16 model's decode alternating
// with one stream in one process: +6.7% tokens/s (paired median of 16 rounds, every round ahead) with
// two streams, +17% with four, four over two +2.5%, eight (1 x 8 tiles: the 16 sums fill the registers)
// -5% against four; q8_0's exact decode +21% with four. Rows side by side in one stream (row j and j + 1,
// 1 x 2 and 1 x 4 tiles) read 0.58x and 0.55x of one row at a time (the prefetchers seem to lose
// them; no hardware counters in the VM measured to show it).
template <dtype T>
inline void four_streams(const float* x, const weight_view& w, std::size_t r0, std::size_t r1, float* y,
                         accumulate acc) noexcept {
  const std::size_t rb = row_bytes(w.type, w.cols), q = (r1 - r0) / 4;
  const float* const xs[1] = {x};
  alignas(64) float out[16];
  for (std::size_t i = 0; i < q; ++i) {
    const std::byte* const ws[4] = {w.data + (r0 + i) * rb, w.data + (r0 + q + i) * rb,
                                    w.data + (r0 + 2 * q + i) * rb, w.data + (r0 + 3 * q + i) * rb};
    stream_tile<T, 1, 4>(xs, ws, w.cols, out, nullptr);
    for (std::size_t s = 0; s < 4; ++s) store_tile(out + s, 1, y + r0 + s * q + i, 0, 1, 1, acc);
  }
  for (std::size_t r = r0 + 4 * q; r < r1; ++r) {
    const std::byte* const ws[1] = {w.data + r * rb};
    stream_tile<T, 1, 1>(xs, ws, w.cols, out, nullptr);
    store_tile(out, 1, y + r, 0, 1, 1, acc);
  }
}

// Decode (m <= 8): weight rows [r0, r1) in blocks of 16, each read from memory once (the next block
// prefetched meanwhile) and reused from cache by the 2 x 2 and 1-row tiles of x that cover m; one x row
// of a type that unpacks no nibbles in four streams (four_streams).
template <dtype T>
inline void stream_rows(const float* x, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1, float* y,
                        accumulate acc) noexcept {
  if (four_stream_rows<T>(m)) return four_streams<T>(x, w, r0, r1, y, acc);
  const std::size_t rb = row_bytes(w.type, w.cols);
  for (std::size_t j0 = r0; j0 < r1; j0 += 16) {
    const std::size_t nj = std::min<std::size_t>(16, r1 - j0);
    const std::byte* pf_begin = w.data + std::min(j0 + 16, r1) * rb;
    const std::byte* pf_end = w.data + std::min(j0 + 32, r1) * rb;
    for (std::size_t i0 = 0; i0 < m;) {
      if (m - i0 >= 2) {
        stream_block<T, 2, 2>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);
        i0 += 2;
      } else if constexpr (unpacked<T>) {
        stream_block<T, 1, 4>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);  // unpacking-bound: 4 rows share x
        i0 += 1;
      } else {
        stream_block<T, 1, 1>(x, i0, w, rb, j0, nj, y, acc, pf_begin, pf_end);  // the last of an odd m
        i0 += 1;
      }
      pf_begin = pf_end;  // the first tile of x prefetched it all
    }
  }
}

// Prefill (m > 8): weight rows [r0, r1) panel by panel, as the AVX-512 path does (aligned scratch,
// rows past 1536 columns in ranges of 1024), with 4 x 3 tiles. f16 rows are read where they are, widened
// in registers (half the bytes through the caches, no unpacking), the panel only bounding what the
// tiles of x go over while it is in L2.
template <dtype T>
inline void panel_rows(const float* x, std::size_t m, const weight_view& w, std::size_t r0, std::size_t r1, float* y,
                       accumulate acc) {
  using W = std::conditional_t<T == dtype::f16, half, float>;
  constexpr bool direct = T == dtype::f16;
  constexpr std::size_t MR = 4, NR = panel_nr, tile_floats = 2 * MR * NR * 8;
  const std::size_t n = w.cols, ldy = w.rows, rb = row_bytes(w.type, n);
  const std::size_t ld = direct ? rb / sizeof(W) : scratch_stride(n);
  const std::size_t full = n - n % lanes, range = n <= 1536 ? std::max<std::size_t>(full, 1) : 1024;
  const std::size_t ranges = std::max<std::size_t>(1, (full + range - 1) / range);
  const std::size_t step = detail::panel_height(r1 - r0, std::min(n, range), NR);
  float* const state = panel_scratch(step / NR * tile_floats + (direct ? 0 : step * ld));
  for (std::size_t p0 = r0; p0 < r1; p0 += step) {
    const std::size_t nc = std::min(step, r1 - p0);
    const W* panel = nullptr;
    if constexpr (direct) {
      panel = reinterpret_cast<const W*>(w.data + p0 * rb);
    } else {
      float* const scratch = state + step / NR * tile_floats;
      for (std::size_t r = 0; r < nc; ++r) unpack_row<T>(w.data + (p0 + r) * rb, n, scratch + r * ld);
      panel = scratch;
    }
    for (std::size_t i0 = 0; i0 < m; i0 += MR) {
      const float* xs[MR];
      for (std::size_t i = 0; i < MR; ++i) xs[i] = x + std::min(i0 + i, m - 1) * n;  // past m: repeat, not stored
      for (std::size_t r = 0; r < ranges; ++r) {
        const std::size_t k0 = r * range, k1 = r + 1 == ranges ? full : k0 + range;
        if (r == 0)
          panel_strip<false>(xs, panel, ld, nc, k0, k1, state);
        else
          panel_strip<true>(xs, panel, ld, nc, k0, k1, state);
      }
      // Each sum: its two halves and the tail past `full`, in reduce_lanes' order.
      for (std::size_t j0 = 0; j0 < nc; j0 += NR) {
        const float* const st = state + j0 / NR * tile_floats;
        alignas(16) float tail[MR * NR] = {}, out[MR * NR];
        for (std::size_t t = 0; t < MR * NR && full < n; ++t) {
          const W* const wr = panel + std::min(j0 + t % NR, nc - 1) * ld;
          for (std::size_t k = full; k < n; ++k) tail[t] = fma(xs[t / NR][k], to_f32(wr[k]), tail[t]);
        }
        for (std::size_t t = 0; t < MR * NR; t += 4) reduce8x2_4(st + 8 * t, st + 96 + 8 * t, tail + t, out + t);
        float* const dst = y + i0 * ldy + p0 + j0;
        if (i0 + MR <= m && j0 + NR <= nc) {
          // One float at a time: the copies GCC makes of store_tile's rows read 8 bytes across two of
          // reduce8x2_4's 16-byte stores, which the store buffer cannot forward (10% of prefill's time).
#pragma GCC unroll 12
          for (std::size_t t = 0; t < MR * NR; ++t) {
            float* const d = dst + t / NR * ldy + t % NR;
            __m128 v = _mm_load_ss(out + t);
            if (acc == accumulate::yes) v = _mm_add_ss(_mm_load_ss(d), v);
            _mm_store_ss(d, v);
          }
        } else {
          store_tile(out, NR, dst, ldy, std::min(MR, m - i0), std::min(NR, nc - j0), acc);
        }
      }
    }
  }
}

#endif

#if EFIM_K_AVX512 || EFIM_K_AVX2
// x rows up to which matmul streams the weights (stream_rows: each block of 16 rows read once and met by
// every tile of x in turn), above which it packs panels (panel_rows). The streams convert or unpack a
// block for every tile of x, the panels once for all of them; on the AVX-512 path the 4 x 4 stream tiles
// still outrun the panels for f16 and bf16 up to 64 rows and f32 up to 48 (Zen 4, 2 threads,
// 2,048 x 768 and 4,096 x 4,096: 1.01-1.18x at those counts, 1.1-1.5x at 16), the types that unpack
// their blocks only up to 8 (at 16: 0.91-1.21x); the AVX2 path's 2 x 2 stream tiles lose from 9 rows
// up (0.5-0.8x at 16).
template <dtype T>
constexpr std::size_t stream_rows_bound() noexcept {
#if EFIM_K_AVX512
  if constexpr (T == dtype::f16 || T == dtype::bf16) return 64;
  if constexpr (T == dtype::f32) return 48;
#endif
  return 8;
}

template <dtype T>
inline void matmul_typed(thread_pool& pool, const float* x, const weight_view& w, float* y, std::size_t m,
                         accumulate acc) {
  if (m <= stream_rows_bound<T>()) {
#if EFIM_K_AVX512
    if constexpr (interleavable_floats(T)) {
      if (w.layout == weight_layout::interleaved8) {  // one run of groups per thread; rows past them as stored
        const std::size_t groups = w.rows / 8, units = groups + (w.rows % 8 != 0 ? 1 : 0);
        pool.parallel_for(
            units,
            [&](std::size_t b, std::size_t e) {
              if (b < std::min(e, groups)) il8_float_rows<T>(x, m, w, b, std::min(e, groups), y, acc);
              if (e > groups) stream_rows<T>(x, m, w, 8 * groups, w.rows, y, acc);
            },
            (units + pool.size() - 1) / pool.size());
        return;
      }
    }
#endif
    // One run of 16-row blocks per thread, equal in bytes: each run starts cold (its first block is
    // not prefetched), and a decode step's matrices take only tens of microseconds. But one x row
    // through the AVX2 path's streams (no software prefetch, so no cold start) goes in four runs per
    // thread (the pool's most), claimed in turn, so that a thread the machine's other load slows leaves
    // the other less to wait for at the end of each matrix: Zen 4, 2 threads, the f16 model's decode with
    // one and four runs per thread alternating in one process, four gave 3.1% more tokens/s on average
    // (paired medians of ten runs, -0.4% to +6.3%; with four_streams since, one run per thread lost 4%,
    // two were within 1.5%). (The int8 decode, whose runs start cold, lost 2.5% with four on q4_0.)
    const std::size_t units = (w.rows + 15) / 16, runs = (four_stream_rows<T>(m) ? 4 : 1) * pool.size();
    pool.parallel_for(
        units, [&](std::size_t b, std::size_t e) { stream_rows<T>(x, m, w, b * 16, std::min(e * 16, w.rows), y, acc); },
        (units + runs - 1) / runs);
    return;
  }
  // At least 16 tiles' rows a task where there are enough for every thread (each task reads all of x),
  // and a small matrix in one equal share per thread (128 rows: 22 and 21 tiles, not 16, 16 and 11).
  const std::size_t units = (w.rows + panel_nr - 1) / panel_nr;
  pool.parallel_for(
      units,
      [&](std::size_t b, std::size_t e) {
        panel_rows<T>(x, m, w, b * panel_nr, std::min(e * panel_nr, w.rows), y, acc);
      },
      std::min<std::size_t>(16, (units + pool.size() - 1) / pool.size()));
}

#endif

// y (m, rows) = [y +] x (m, cols) * dequantize(w)^T on this path (see matmul.hpp).
EFIM_K_ENTRY void matmul(thread_pool& pool, const float* x, const weight_view& w, float* y, std::size_t m,
                         accumulate acc) {
  // Interleaved rows (interleave.hpp): the AVX-512 path reads f16 and bf16 ones, the rest go as stored.
#if EFIM_K_AVX512
  if (w.layout == weight_layout::interleaved8 && !interleavable_floats(w.type))
    return matmul(pool, x, as_stored(pool, w), y, m, acc);
#else
  if (w.layout == weight_layout::interleaved8) return matmul(pool, x, as_stored(pool, w), y, m, acc);
#endif
#if EFIM_K_AVX512 || EFIM_K_AVX2
  switch (w.type) {
    case dtype::f32:
      return matmul_typed<dtype::f32>(pool, x, w, y, m, acc);
    case dtype::f16:
      return matmul_typed<dtype::f16>(pool, x, w, y, m, acc);
    case dtype::bf16:
      return matmul_typed<dtype::bf16>(pool, x, w, y, m, acc);
    case dtype::q8_0:
      return matmul_typed<dtype::q8_0>(pool, x, w, y, m, acc);
    case dtype::q4_0:
      return matmul_typed<dtype::q4_0>(pool, x, w, y, m, acc);
    case dtype::q5_0:
      return matmul_typed<dtype::q5_0>(pool, x, w, y, m, acc);
    case dtype::q5_1:
      return matmul_typed<dtype::q5_1>(pool, x, w, y, m, acc);
    case dtype::q4_k:
      return matmul_typed<dtype::q4_k>(pool, x, w, y, m, acc);
    case dtype::q5_k:
      return matmul_typed<dtype::q5_k>(pool, x, w, y, m, acc);
    case dtype::q6_k:
      return matmul_typed<dtype::q6_k>(pool, x, w, y, m, acc);
  }
#endif
  pool.parallel_for((w.rows + 3) / 4, [&](std::size_t b, std::size_t e) {
    matmul_rows_portable(x, m, w, b * 4, std::min(e * 4, w.rows), y, acc);
  });
}
