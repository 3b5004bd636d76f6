#pragma once
// Causal attention over paged KV, and the write of new K/V rows into their pages. The cache holds
// float or half (f16) elements; f16 elements are converted to f32 as they are loaded.
//
// A query at position p attends to positions 0..p of its own sequence. Every value a query's result
// depends on (its scores, their maximum, exponentials, sum, and the weighted sum of values) is
// computed in an order fixed by key positions alone, so the result is the same whatever batch,
// chunk or tile the query is computed in and wherever its blocks lie.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/simd.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kernels {

// Where a token of a batch keeps its KV: its sequence's block table and its position.
struct token_slot {
  std::span<const block_id> table;
  position pos = 0;
};

namespace detail {

inline float to_f32(float x) noexcept { return x; }
inline float to_f32(half x) noexcept { return f16_to_f32(x.bits); }
inline void store(float x, float& out) noexcept { out = x; }
inline void store(float x, half& out) noexcept { out.bits = f32_to_f16(x); }

// 16 elements as floats.
inline void load_lanes(const float* p, vfloat& out) noexcept { std::memcpy(&out, p, sizeof out); }
inline void load_lanes(const half* p, vfloat& out) noexcept { widen_f16(out, reinterpret_cast<const std::byte*>(p)); }

}  // namespace detail

// k, v: (tokens, kv_heads, head_dim) rows for the batch's tokens, written into their pages.
template <class E>
inline void kv_write(const kv::paged_layout& l, E* k_cache, E* v_cache, const float* k, const float* v,
                     std::span<const token_slot> tokens) noexcept {
  const std::size_t row = l.kv_heads * l.head_dim;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto at = kv::locate(tokens[t].table, l.block_size, static_cast<std::size_t>(tokens[t].pos));
    for (std::size_t g = 0; g < l.kv_heads; ++g) {
      const float* src_k = k + t * row + g * l.head_dim;
      const float* src_v = v + t * row + g * l.head_dim;
      E* dst_k = k_cache + l.key_offset(at.block, g) + at.slot;
      E* dst_v = v_cache + l.offset(at.block, g, at.slot);
      for (std::size_t d = 0; d < l.head_dim; ++d) {
        detail::store(src_k[d], dst_k[d * l.block_size]);
        detail::store(src_v[d], dst_v[d]);
      }
    }
  }
}

namespace detail {

inline constexpr std::size_t max_rows = 8;  // query heads computed together against the same keys

// One query head of one token: its query, where its output goes, and how many keys it sees.
struct attention_row {
  const float* q;
  float* out;
  std::size_t keys;
};

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
  for (std::size_t r = 0; r < R; ++r) {
    float* s = scores[r];
    const std::size_t n = rows[r].keys;
    float top = -INFINITY;
    for (std::size_t j = 0; j < n; ++j) top = std::max(top, s[j] * scale);
    const std::size_t padded = (n + lanes - 1) / lanes * lanes;
    vfloat sum{};
    for (std::size_t j = 0; j < padded; j += lanes) {
      for (std::size_t i = j; i < j + lanes; ++i) s[i] = fma(s[i], scale, -top);
      exp16(s + j);
      for (std::size_t i = std::max(j, n); i < j + lanes; ++i) s[i] = 0.0f;  // past the causal end
      vfloat e;
      std::memcpy(&e, s + j, sizeof e);
      sum = sum + e;
    }
    float lanes_sum[lanes];
    std::memcpy(lanes_sum, &sum, sizeof lanes_sum);
    inv_sum[r] = 1.0f / reduce_lanes(lanes_sum, 0.0f);
  }

  // The weighted sum of values, keys in order for every output element, held in registers a few
  // vectors of dimensions at a time, each value row read (and widened) once for all the rows.
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
inline void attend_rows_n(std::size_t n, std::index_sequence<R...>, const kv::paged_layout& l, const E* k_cache,
                          const E* v_cache, std::span<const block_id> table, std::size_t kv_head,
                          const attention_row* rows, float scale, float* scratch, std::size_t stride) noexcept {
  ((n == R + 1 ? attend_rows<R + 1>(l, k_cache, v_cache, table, kv_head, rows, scale, scratch, stride) : void()), ...);
}

// Consecutive tokens of one sequence (positions first_pos, first_pos + 1, ...) and a range of query
// heads sharing one KV head: at most max_rows rows.
struct attention_tile {
  std::size_t first_token, tokens;
  std::size_t first_head, heads;
};

}  // namespace detail

// q, out: (tokens, heads, head_dim). Query head h reads KV head h / (heads / kv_heads).
template <class E>
inline void paged_attention(thread_pool& pool, const kv::paged_layout& l, const E* k_cache, const E* v_cache,
                            const float* q, float* out, std::span<const token_slot> tokens, std::size_t heads,
                            float scale) {
  using detail::max_rows;
  require(l.kv_heads > 0 && heads >= l.kv_heads && heads % l.kv_heads == 0, errc::invalid_argument,
          "paged_attention: " + std::to_string(heads) + " query heads do not split into groups over " +
              std::to_string(l.kv_heads) + " KV heads");
  const std::size_t group = heads / l.kv_heads;
  const std::size_t heads_per_tile = std::min(group, max_rows);
  const std::size_t tokens_per_tile = std::max<std::size_t>(1, max_rows / heads_per_tile);

  // Tiles: runs of consecutive positions of one sequence, times head ranges within a KV group.
  std::vector<detail::attention_tile> tiles;
  for (std::size_t t = 0; t < tokens.size();) {
    std::size_t n = 1;
    while (n < tokens_per_tile && t + n < tokens.size() && tokens[t + n].table.data() == tokens[t].table.data() &&
           tokens[t + n].pos == tokens[t].pos + static_cast<position>(n))
      ++n;
    for (std::size_t g = 0; g < l.kv_heads; ++g)
      for (std::size_t h = 0; h < group; h += heads_per_tile)
        tiles.push_back({t, n, g * group + h, std::min(heads_per_tile, group - h)});
    t += n;
  }

  pool.parallel_for(tiles.size(), [&](std::size_t begin, std::size_t end) {
    std::size_t longest = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const auto& tile = tiles[i];
      longest = std::max(longest, static_cast<std::size_t>(tokens[tile.first_token + tile.tokens - 1].pos) + 1);
    }
    const std::size_t blocks = (longest + l.block_size - 1) / l.block_size;
    const std::size_t stride = (blocks * l.block_size + detail::lanes - 1) / detail::lanes * detail::lanes;
    std::vector<float> scratch(max_rows * stride);
    std::array<detail::attention_row, max_rows> rows{};
    for (std::size_t i = begin; i < end; ++i) {
      const auto& tile = tiles[i];
      std::size_t n = 0;
      for (std::size_t t = tile.first_token; t < tile.first_token + tile.tokens; ++t)
        for (std::size_t h = tile.first_head; h < tile.first_head + tile.heads; ++h)
          rows[n++] = {q + (t * heads + h) * l.head_dim, out + (t * heads + h) * l.head_dim,
                       static_cast<std::size_t>(tokens[t].pos) + 1};
      detail::attend_rows_n(n, std::make_index_sequence<max_rows>{}, l, k_cache, v_cache,
                            tokens[tile.first_token].table, tile.first_head / group, rows.data(), scale, scratch.data(),
                            stride);
    }
  });
}

}  // namespace efim::kernels
