// Included by targets.hpp once per instruction-set path, inside that path's namespace: causal
// attention over paged KV for the rows of one tile (see attention.hpp).
//
// A query at position p attends to positions 0..p of its own sequence. Every value a query's result
// depends on (its scores, their maximum, exponentials, sum, and the weighted sum of values) is
// computed in an order fixed by key positions alone, so the result is the same whatever batch,
// chunk or tile the query is computed in and wherever its blocks lie.

// 16 elements as floats.
inline void load_lanes(const float* p, vfloat& out) noexcept { std::memcpy(&out, p, sizeof out); }
inline void load_lanes(const half* p, vfloat& out) noexcept { widen_f16(out, reinterpret_cast<const std::byte*>(p)); }

#if EFIM_K_AVX2 && !EFIM_K_AVX512
// AVX2: 8 slots or dimensions per vector. Each score and each output element is a chain of multiply-
// adds in the order the generic code uses, lane by lane, so the bits are the same.
inline __m256 load8_lanes(const float* p) noexcept { return _mm256_loadu_ps(p); }
inline __m256 load8_lanes(const half* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Scores of G <= 4 rows against 16 slots from `slot` (two vectors each), in registers: 8 sums, 2 keys.
template <std::size_t G, class E>
[[gnu::always_inline]] inline void scores16(const attention_row* rows, const E* keys, std::size_t block_size,
                                            std::size_t head_dim, std::size_t slot, float* const* scores) noexcept {
  __m256 lo[G], hi[G];
  for (std::size_t r = 0; r < G; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (std::size_t d = 0; d < head_dim; ++d) {
    const __m256 k0 = load8_lanes(keys + d * block_size + slot), k1 = load8_lanes(keys + d * block_size + slot + 8);
    for (std::size_t r = 0; r < G; ++r) {
      const __m256 q = _mm256_broadcast_ss(rows[r].q + d);
      lo[r] = _mm256_fmadd_ps(q, k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(q, k1, hi[r]);
    }
  }
  for (std::size_t r = 0; r < G; ++r) {
    _mm256_storeu_ps(scores[r] + slot, lo[r]);
    _mm256_storeu_ps(scores[r] + slot + 8, hi[r]);
  }
}

template <std::size_t R, class E>
inline void block_scores(const attention_row* rows, const E* keys, std::size_t block_size, std::size_t head_dim,
                         float* const* scores) noexcept {
  constexpr std::size_t G = R <= 4 ? R : (R + 1) / 2;  // rows at a time
  std::size_t slot = 0;
  for (; slot + 16 <= block_size; slot += 16) {
    scores16<G>(rows, keys, block_size, head_dim, slot, scores);
    if constexpr (R > G) scores16<R - G>(rows + G, keys, block_size, head_dim, slot, scores + G);
  }
  for (; slot + 8 <= block_size; slot += 8) {
    __m256 acc[R];
    for (std::size_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (std::size_t d = 0; d < head_dim; ++d) {
      const __m256 k = load8_lanes(keys + d * block_size + slot);
      for (std::size_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(rows[r].q + d), k, acc[r]);
    }
    for (std::size_t r = 0; r < R; ++r) _mm256_storeu_ps(scores[r] + slot, acc[r]);
  }
  for (; slot < block_size; ++slot)
    for (std::size_t r = 0; r < R; ++r) {
      float s = 0.0f;
      for (std::size_t d = 0; d < head_dim; ++d) s = fma(rows[r].q[d], to_f32(keys[d * block_size + slot]), s);
      scores[r][slot] = s;
    }
}

// Key j's value row (dimensions [d0, d0 + 8 C) at v) into the G x C sums; Causal: only for the rows
// that attend to j.
template <bool Causal, std::size_t G, std::size_t C, class E>
[[gnu::always_inline]] inline void weighted_slot(__m256 (&acc)[G][C], const E* v, const attention_row* rows,
                                                 float* const* scores, std::size_t j) noexcept {
  __m256 vv[C];
#pragma GCC unroll 16
  for (std::size_t c = 0; c < C; ++c) vv[c] = load8_lanes(v + c * 8);
#pragma GCC unroll 16
  for (std::size_t r = 0; r < G; ++r) {
    if (Causal && j >= rows[r].keys) continue;
    const __m256 p = _mm256_broadcast_ss(scores[r] + j);
#pragma GCC unroll 16
    for (std::size_t c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(p, vv[c], acc[r][c]);
  }
}

// Dimensions [d0, d0 + 8 C) of the weighted sum for G rows, keys walked block by block: first the keys
// every row attends to, with no test, then the few past the shortest row's causal end. Every loop is
// unrolled so that the G x C sums stay in registers.
template <std::size_t G, std::size_t C, class E>
[[gnu::always_inline]] inline void weighted_chunk(const kv::paged_layout& l, const E* v_cache,
                                                  std::span<const block_id> table, std::size_t kv_head,
                                                  const attention_row* rows, float* const* scores, const float* inv_sum,
                                                  std::size_t d0) noexcept {
  std::size_t most = 0, least = rows[0].keys;
  for (std::size_t r = 0; r < G; ++r) most = std::max(most, rows[r].keys), least = std::min(least, rows[r].keys);
  __m256 acc[G][C];
#pragma GCC unroll 16
  for (std::size_t r = 0; r < G; ++r)
#pragma GCC unroll 16
    for (std::size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const std::size_t bs = l.block_size;
  for (std::size_t b = 0, j0 = 0; j0 < most; ++b, j0 += bs) {
    const E* v = v_cache + l.offset(table[b], kv_head, 0) + d0;
    const std::size_t end = std::min(bs, most - j0), common = least > j0 ? std::min(end, least - j0) : 0;
    std::size_t slot = 0;
    for (; slot < common; ++slot, v += l.head_dim) weighted_slot<false>(acc, v, rows, scores, j0 + slot);
    for (; slot < end; ++slot, v += l.head_dim) weighted_slot<true>(acc, v, rows, scores, j0 + slot);
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < G; ++r)
#pragma GCC unroll 16
    for (std::size_t c = 0; c < C; ++c)
      _mm256_storeu_ps(rows[r].out + d0 + c * 8, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv_sum[r])));
}

template <std::size_t G, std::size_t C, class E>
inline void weighted_rows(const kv::paged_layout& l, const E* v_cache, std::span<const block_id> table,
                          std::size_t kv_head, const attention_row* rows, float* const* scores, const float* inv_sum,
                          std::size_t full) noexcept {
  std::size_t d0 = 0;
  for (; d0 + C * 8 <= full; d0 += C * 8) weighted_chunk<G, C>(l, v_cache, table, kv_head, rows, scores, inv_sum, d0);
  for (; d0 < full; d0 += 8) weighted_chunk<G, 1>(l, v_cache, table, kv_head, rows, scores, inv_sum, d0);
}

template <std::size_t R, class E>
inline std::size_t weighted_sum(const kv::paged_layout& l, const E* v_cache, std::span<const block_id> table,
                                std::size_t kv_head, const attention_row* rows, float* const (&scores)[R],
                                const float (&inv_sum)[R], std::size_t) noexcept {
  constexpr std::size_t G = R <= 4 ? R : (R + 1) / 2;  // rows at a time
  constexpr std::size_t C = G <= 2 ? 4 : 2;            // vectors of dimensions at a time: G * C <= 8 sums
  const std::size_t full = l.head_dim - l.head_dim % 8;
  weighted_rows<G, C>(l, v_cache, table, kv_head, rows, scores, inv_sum, full);
  if constexpr (R > G) weighted_rows<R - G, C>(l, v_cache, table, kv_head, rows + G, scores + G, inv_sum + G, full);
  return full;
}
#else
// scores[r][slot] = q_r . K[slot] for the block's slots: each score a sum over dimensions in order.
template <std::size_t R, class E>
inline void block_scores(const attention_row* rows, const E* keys, std::size_t block_size, std::size_t head_dim,
                         float* const* scores) noexcept {
  std::size_t slot = 0;
  for (; slot + lanes <= block_size; slot += lanes) {
    vfloat acc[R];
    for (std::size_t r = 0; r < R; ++r) acc[r] = vfloat{};
    for (std::size_t d = 0; d < head_dim; ++d) {
      vfloat k;
      load_lanes(keys + d * block_size + slot, k);
      for (std::size_t r = 0; r < R; ++r) {
        const vfloat q = vfloat{} + rows[r].q[d];
        fma_into(acc[r], q, k);
      }
    }
    for (std::size_t r = 0; r < R; ++r) std::memcpy(scores[r] + slot, &acc[r], sizeof(vfloat));
  }
  for (; slot < block_size; ++slot)
    for (std::size_t r = 0; r < R; ++r) {
      float s = 0.0f;
      for (std::size_t d = 0; d < head_dim; ++d) s = fma(rows[r].q[d], to_f32(keys[d * block_size + slot]), s);
      scores[r][slot] = s;
    }
}

// rows[r].out[i] = (sum over keys j in order of scores[r][j] * v_j[i]) * inv_sum[r] for the dimensions i
// below the returned count (whole vectors; attend_rows does the rest one by one).
template <std::size_t R, class E>
inline std::size_t weighted_sum(const kv::paged_layout& l, const E* v_cache, std::span<const block_id> table,
                                std::size_t kv_head, const attention_row* rows, float* const (&scores)[R],
                                const float (&inv_sum)[R], std::size_t most) noexcept {
  const std::size_t bs = l.block_size, d = l.head_dim;
  constexpr std::size_t C = R <= 6 ? 4 : 2;  // vectors of dimensions at a time: R * C sums in registers
  const std::size_t full = d - d % lanes;
  for (std::size_t d0 = 0; d0 < full; d0 += C * lanes) {
    const std::size_t c_n = std::min(C, (full - d0) / lanes);
    vfloat acc[R][C];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) acc[r][c] = vfloat{};
    for (std::size_t j = 0; j < most; ++j) {
      const auto at = kv::locate(table, bs, j);
      const E* v = v_cache + l.offset(at.block, kv_head, at.slot) + d0;
      vfloat vv[C] = {};
      for (std::size_t c = 0; c < C; ++c)
        if (c < c_n) load_lanes(v + c * lanes, vv[c]);
      for (std::size_t r = 0; r < R; ++r) {
        if (j >= rows[r].keys) continue;
        const vfloat p = vfloat{} + scores[r][j];
        for (std::size_t c = 0; c < C; ++c)
          if (c < c_n) fma_into(acc[r][c], p, vv[c]);
      }
    }
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < c_n; ++c) {
        const vfloat out = acc[r][c] * inv_sum[r];
        std::memcpy(rows[r].out + d0 + c * lanes, &out, sizeof out);
      }
  }
  return full;
}

#endif

// The largest of scale * s[k] over k < n (a maximum: the same in any order).
inline float scaled_max(const float* s, std::size_t n, float scale) noexcept {
  alignas(64) float tops[lanes];
  std::size_t k = 0;
#if EFIM_K_AVX2 && !EFIM_K_AVX512
  // In ymm registers: a ?: on 16-lane GCC vectors goes one lane at a time here, through the stack.
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 top0 = _mm256_set1_ps(-INFINITY), top1 = top0;
  for (; k + lanes <= n; k += lanes) {
    top0 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + k), sc), top0);  // v > top ? v : top
    top1 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + k + 8), sc), top1);
  }
  _mm256_store_ps(tops, top0);
  _mm256_store_ps(tops + 8, top1);
#else
  vfloat top = vfloat{} - INFINITY;
  for (; k + lanes <= n; k += lanes) {
    vfloat v;
    std::memcpy(&v, s + k, sizeof v);
    v = v * scale;
    top = v > top ? v : top;
  }
  std::memcpy(tops, &top, sizeof top);
#endif
  float most = -INFINITY;
  for (const float t : tops) most = std::max(most, t);
  for (; k < n; ++k) most = std::max(most, s[k] * scale);
  return most;
}

// One row's scores s[0, n) -> e^(scale s - the largest), zeros past n up to a whole vector; returns 1 /
// their sum (reduce_lanes of 16 lane sums), everything lane by lane in key order.
inline float softmax_row(float* s, std::size_t n, float scale) noexcept {
  const std::size_t padded = (n + lanes - 1) / lanes * lanes;
  const float top = scaled_max(s, n, scale);
#if EFIM_K_AVX2 && !EFIM_K_AVX512
  // In ymm registers (2x the 16-lane GCC vectors' speed here): the same operations.
  const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-top);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
  for (std::size_t j = 0; j < padded; j += lanes) {
    __m256 e0 = exp8(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), sc, shift));
    __m256 e1 = exp8(_mm256_fmadd_ps(_mm256_loadu_ps(s + j + 8), sc, shift));
    _mm256_storeu_ps(s + j, e0);
    _mm256_storeu_ps(s + j + 8, e1);
    if (j + lanes > n) {  // past the causal end
      for (std::size_t i = n; i < j + lanes; ++i) s[i] = 0.0f;
      e0 = _mm256_loadu_ps(s + j), e1 = _mm256_loadu_ps(s + j + 8);
    }
    sum0 = _mm256_add_ps(sum0, e0), sum1 = _mm256_add_ps(sum1, e1);
  }
  return 1.0f / reduce8x2(sum0, sum1, 0.0f);
#else
  const vfloat scales = vfloat{} + scale, shift = vfloat{} - top;
  vfloat sum{};
  for (std::size_t j = 0; j < padded; j += lanes) {
    vfloat v, t = shift;
    std::memcpy(&v, s + j, sizeof v);
    fma_into(t, v, scales);  // fma(s, scale, -top), lane by lane
    std::memcpy(s + j, &t, sizeof t);
    exp16(s + j);
    for (std::size_t i = std::max(j, n); i < j + lanes; ++i) s[i] = 0.0f;  // past the causal end
    vfloat e;
    std::memcpy(&e, s + j, sizeof e);
    sum = sum + e;
  }
  float lanes_sum[lanes];
  std::memcpy(lanes_sum, &sum, sizeof lanes_sum);
  return 1.0f / reduce_lanes(lanes_sum, 0.0f);
#endif
}

// Rows of the same sequence and KV head: scores, softmax, and the weighted sum of values.
// `scratch` holds R rows of `stride` floats, stride >= every row's keys rounded up to blocks and lanes.
template <std::size_t R, class E>
inline void attend_rows(const kv::paged_layout& l, const E* k_cache, const E* v_cache, std::span<const block_id> table,
                        std::size_t kv_head, const attention_row* rows, float scale, float* scratch,
                        std::size_t stride) noexcept {
  const std::size_t bs = l.block_size, d = l.head_dim;
  std::size_t most = 0;
  for (std::size_t r = 0; r < R; ++r) most = std::max(most, rows[r].keys);
  float* scores[R];
  for (std::size_t r = 0; r < R; ++r) scores[r] = scratch + r * stride;

  for (std::size_t b = 0; b * bs < most; ++b) {
    float* at[R];
    for (std::size_t r = 0; r < R; ++r) at[r] = scores[r] + b * bs;
    block_scores<R>(rows, k_cache + l.key_offset(table[b], kv_head), bs, d, at);
  }

  float inv_sum[R];
  for (std::size_t r = 0; r < R; ++r) inv_sum[r] = softmax_row(scores[r], rows[r].keys, scale);

  // The weighted sum of values, keys in order for every output element, held in registers a few
  // vectors of dimensions at a time, each value row read (and widened) once for all the rows.
  const std::size_t full = weighted_sum<R>(l, v_cache, table, kv_head, rows, scores, inv_sum, most);
  for (std::size_t i = full; i < d; ++i)  // dimensions past the last whole vector
    for (std::size_t r = 0; r < R; ++r) {
      float o = 0.0f;
      for (std::size_t j = 0; j < rows[r].keys; ++j) {
        const auto at = kv::locate(table, bs, j);
        o = fma(scores[r][j], to_f32(v_cache[l.offset(at.block, kv_head, at.slot) + i]), o);
      }
      rows[r].out[i] = o * inv_sum[r];
    }
}

template <class E, std::size_t... R>
EFIM_K_ENTRY void attend_rows_n(std::size_t n, std::index_sequence<R...>, const kv::paged_layout& l, const E* k_cache,
                                const E* v_cache, std::span<const block_id> table, std::size_t kv_head,
                                const attention_row* rows, float scale, float* scratch, std::size_t stride) noexcept {
  ((n == R + 1 ? attend_rows<R + 1>(l, k_cache, v_cache, table, kv_head, rows, scale, scratch, stride) : void()), ...);
}
