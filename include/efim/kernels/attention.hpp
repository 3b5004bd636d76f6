#pragma once
// Causal attention over paged KV, and the write of new K/V rows into their pages. The cache holds
// float or half (f16) elements; f16 elements are converted to f32 as they are loaded.
//
// A query at position p attends to positions 0..p of its own sequence. Every value a query's result
// depends on (its scores, their maximum, exponentials, sum, and the weighted sum of values) is
// computed in an order fixed by key positions alone, so the result is the same whatever batch,
// chunk or tile the query is computed in and wherever its blocks lie (impl/attention.inl, one copy
// per instruction-set path).
#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/targets.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kernels {

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

// q, out: (tokens, heads, head_dim). Query head h reads KV head h / (heads / kv_heads).
template <class E>
inline void paged_attention(thread_pool& pool, const kv::paged_layout& l, const E* k_cache, const E* v_cache,
                            const float* q, float* out, std::span<const token_slot> tokens, std::size_t heads,
                            float scale) {
  const std::size_t group = query_group(heads, l.kv_heads);
  std::vector<attention_tile> tiles;
  plan_attention(tokens, heads, l.kv_heads, detail::max_rows, tiles);

  pool.parallel_for(tiles.size(), [&](std::size_t begin, std::size_t end) {
    std::size_t longest = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const auto& tile = tiles[i];
      longest = std::max(longest, static_cast<std::size_t>(tokens[tile.first_token + tile.tokens - 1].pos) + 1);
    }
    const std::size_t blocks = (longest + l.block_size - 1) / l.block_size;
    const std::size_t stride = (blocks * l.block_size + detail::lanes - 1) / detail::lanes * detail::lanes;
    std::vector<float> scratch(detail::max_rows * stride);
    std::array<detail::attention_row, detail::max_rows> rows{};
    for (std::size_t i = begin; i < end; ++i) {
      const auto& tile = tiles[i];
      std::size_t n = 0;
      for (std::size_t t = tile.first_token; t < tile.first_token + tile.tokens; ++t)
        for (std::size_t h = tile.first_head; h < tile.first_head + tile.heads; ++h)
          rows[n++] = {q + (t * heads + h) * l.head_dim, out + (t * heads + h) * l.head_dim,
                       static_cast<std::size_t>(tokens[t].pos) + 1};
      EFIM_KERNELS_DISPATCH(attend_rows_n(n, std::make_index_sequence<detail::max_rows>{}, l, k_cache, v_cache,
                                          tokens[tile.first_token].table, tile.first_head / group, rows.data(), scale,
                                          scratch.data(), stride));
    }
  });
}

}  // namespace efim::kernels
