// AMX tile products (int8_dot::amx) for the int8 prefill on the AVX-512 path, where the process may run
// them (amx_ready(): CPUID, XCR0 and Linux's permission for the tile data). The same integers as the
// VNNI forms, then the same float steps in the same order, so the same bits (docs/design.md).
//
// For the types of 32-weight blocks (q8_0, q4_0, q5_0, q5_1). One tile product multiplies 16 x rows
// (the A tile, read where x's blocks are: 16 rows a block's stride apart) by 16 weight rows (the B tile:
// one row per 4 consecutive weights, 4 bytes of each of the 16 weight rows side by side, as the VNNI
// panels are packed) over one block, into 16 x 16 integer sums (TDPBSSD for q8_0, whose quants are
// signed; TDPBSUD, signed activations by unsigned quants, for the others). The sums go to memory (the
// only way out of a tile) and the vector units scale them. A tile store reaches the caches only once
// it retires, so sums read at once would wait for it: the products run two blocks ahead of the
// scaling, into a ring of four sums (one block at a time ran at a third of the speed). Tiles are not
// renamed: tmm0 / tmm1 hold the sums of even and odd blocks, tmm2 / tmm3 their A, tmm4 / tmm5 their B.
// The tile instructions are inline assembly in both dialects, as VPDPBUSD: no compiler flag, chosen at
// run time; each worker loads the tile configuration before its rows and releases the tiles after. x
// rows past the last whole 16 go through the VNNI panels. (The k-quants stay on their VNNI panels: tile
// products per scale group, each group's sums times its scales by VPMULLD, measured a tie for q4_k and
// 0.75x for q6_k on an Emerald Rapids Xeon, the vector work after each tile product being the bound.)

#if EFIM_K_AVX512 && defined(EFIM_K_AVX2_PATH_DEFINED)

struct alignas(64) amx_tile_config {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Tiles for blocks of 32 weights: sums 16 x 64 bytes, A 16 x 32 bytes, B 8 x 64 bytes.
inline void amx_configure() noexcept {
  amx_tile_config c;
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    c.rows[t] = t >= 4 ? 8 : 16;
  }
  asm volatile("ldtilecfg %0" : : "m"(c));
}

inline void amx_release() noexcept { asm volatile("tilerelease" ::: "memory"); }

#define EFIM_AMX_ZERO(c) asm volatile("{tilezero %%tmm" #c "|tilezero tmm" #c "}" ::: "memory")
#define EFIM_AMX_LOAD(t, base, stride)                                                               \
  asm volatile("{tileloadd (%0,%1,1), %%tmm" #t "|tileloadd tmm" #t ", [%0+%1*1]}" : : "r"(base), \
               "r"(static_cast<std::size_t>(stride)) : "memory")
#define EFIM_AMX_STORE(t, base, stride)                                                               \
  asm volatile("{tilestored %%tmm" #t ", (%0,%1,1)|tilestored [%0+%1*1], tmm" #t "}" : : "r"(base), \
               "r"(static_cast<std::size_t>(stride)) : "memory")
#define EFIM_AMX_DOT(op, c, a, b) \
  asm volatile("{" op " %%tmm" #b ", %%tmm" #a ", %%tmm" #c "|" op " tmm" #c ", tmm" #a ", tmm" #b "}" ::: "memory")

// One block's tile product into sums (16 x 16 int32), on tile set 0 or 1: a, a_stride the A tile, b,
// b_stride the B tile.
template <bool SignedWeights, int Set>
[[gnu::always_inline]] inline void amx_block(const std::int8_t* a, std::size_t a_stride, const std::uint8_t* b,
                                             std::size_t b_stride, std::int32_t* sums) noexcept {
  if constexpr (Set == 0) {
    EFIM_AMX_ZERO(0);
    EFIM_AMX_LOAD(2, a, a_stride);
    EFIM_AMX_LOAD(4, b, b_stride);
    if constexpr (SignedWeights)
      EFIM_AMX_DOT("tdpbssd", 0, 2, 4);
    else
      EFIM_AMX_DOT("tdpbsud", 0, 2, 4);
    EFIM_AMX_STORE(0, sums, 64);
  } else {
    EFIM_AMX_ZERO(1);
    EFIM_AMX_LOAD(3, a, a_stride);
    EFIM_AMX_LOAD(5, b, b_stride);
    if constexpr (SignedWeights)
      EFIM_AMX_DOT("tdpbssd", 1, 3, 5);
    else
      EFIM_AMX_DOT("tdpbsud", 1, 3, 5);
    EFIM_AMX_STORE(1, sums, 64);
  }
}

#undef EFIM_AMX_ZERO
#undef EFIM_AMX_LOAD
#undef EFIM_AMX_STORE
#undef EFIM_AMX_DOT

// Runs product(k, sums) for blocks k = 0 .. n (tile set k % 2) two ahead of scale(k, sums), which reads
// them, in the order of k.
template <class Product, class Scale>
[[gnu::always_inline]] inline void amx_pipeline(std::size_t n, Product&& product, Scale&& scale) noexcept {
  alignas(64) std::int32_t sums[4][16 * 16];
  const auto run = [&]<int Set>(std::size_t k) {
    if (k < n) product.template operator()<Set>(k, sums[k % 4]);
  };
  run.template operator()<0>(0);
  run.template operator()<1>(1);
  for (std::size_t k = 0; k < n; k += 2) {
    run.template operator()<0>(k + 2);
    run.template operator()<1>(k + 3);
    scale(k, sums[k % 4]);
    if (k + 1 < n) scale(k + 1, sums[(k + 1) % 4]);
  }
}

// out[i * 16 + j] for x rows 0 .. 16 of x0 and a slice's 16 weight rows (q32_pack<.., 16>: per block
// 512 bytes, the B tile): q32_step's operations in its order, one x row a register.
template <dtype T>
inline void q32_amx_tile(const q32_slice& p, std::size_t nb, const kquant::block_q8_32* x0, float* out) noexcept {
  __m512 acc[16];
  #pragma GCC unroll 16
  for (std::size_t i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const std::size_t a_stride = nb * sizeof(kquant::block_q8_32);
  amx_pipeline(
      nb,
      [&]<int Set>(std::size_t b, std::int32_t* sums) {
        amx_block<T == dtype::q8_0, Set>(x0[b].qs, a_stride, p.q + 512 * b, 64, sums);
      },
      [&](std::size_t b, const std::int32_t* sums) {
        const __m512 db = _mm512_load_ps(p.d + 16 * b), mb = T == dtype::q5_1 ? _mm512_load_ps(p.mn + 16 * b) : db;
        #pragma GCC unroll 16
        for (std::size_t i = 0; i < 16; ++i) {
          const kquant::block_q8_32& a = x0[i * nb + b];
          __m512i dot = _mm512_load_si512(sums + 16 * i);
          // (q8_0: TDPBSSD's signed sum(q a) is sum(u a) - 128 sum(a) already)
          if constexpr (T != dtype::q8_0 && q32_bias<T> != 0)
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(q32_bias<T> * a.sum));
          const __m512 da = _mm512_set1_ps(a.d);
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(db, da), _mm512_cvtepi32_ps(dot), acc[i]);
          if constexpr (T == dtype::q5_1)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(mb, da), _mm512_set1_ps(static_cast<float>(a.sum)), acc[i]);
        }
      });
  #pragma GCC unroll 16
  for (std::size_t i = 0; i < 16; ++i) _mm512_store_ps(out + 16 * i, acc[i]);
}

// Rows [r0, r1) of y for x rows [0, m), on one thread: weight rows packed 16 at a time (q32_pack; q8_0's
// quants as stored, signed, the others' u), the whole tiles of 16 x rows on AMX, the rest on the VNNI
// panels.
template <dtype T>
inline void q32_amx_panels(const kquant::block_q8_32* xq, std::size_t m, const weight_view& w, std::size_t r0,
                           std::size_t r1, float* y, accumulate acc) {
  const std::size_t nb = w.cols / 32, whole = m - m % 16;
  if (whole == 0) return q32_panels<T, int8_dot::evex>(xq, m, w, r0, r1, y, acc);
  amx_configure();
  for (std::size_t p0 = r0; p0 < r1; p0 += 16) {
    const std::size_t nc = std::min<std::size_t>(16, r1 - p0);
    q32_slice p;
    q32_pack<T, T != dtype::q8_0, 16>(w, p0, nc, nb, &p);
    for (std::size_t i0 = 0; i0 < whole; i0 += 16) {
      alignas(64) float out[16 * 16];
      q32_amx_tile<T>(p, nb, xq + i0 * nb, out);
      store_tile(out, 16, y + i0 * w.rows + p0, w.rows, 16, nc, acc);
    }
  }
  amx_release();
  if (whole < m) q32_panels<T, int8_dot::evex>(xq + whole * nb, m - whole, w, r0, r1, y + whole * w.rows, acc);
}

#endif
