#pragma once
// Causal attention over paged KV, and the write of new K/V rows into their pages.
// A query at position p attends to positions 0..p of its own sequence, in order, so its result is
// the same whatever batch or chunk it is computed in and wherever its blocks lie.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

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

// k, v: (tokens, kv_heads, head_dim) rows for the batch's tokens; caches: the paged layout.
inline void kv_write(const kv::paged_layout& l, float* k_cache, float* v_cache, const float* k, const float* v,
                     std::span<const token_slot> tokens) noexcept {
  const std::size_t row = l.kv_heads * l.head_dim;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto at = kv::locate(tokens[t].table, l.block_size, static_cast<std::size_t>(tokens[t].pos));
    for (std::size_t g = 0; g < l.kv_heads; ++g) {
      const std::size_t off = l.offset(at.block, g, at.slot);
      std::copy_n(k + t * row + g * l.head_dim, l.head_dim, k_cache + off);
      std::copy_n(v + t * row + g * l.head_dim, l.head_dim, v_cache + off);
    }
  }
}

namespace detail {
// One query head against positions 0..pos: scores, softmax, weighted sum of values.
inline void attend_one(const kv::paged_layout& l, const float* k_cache, const float* v_cache, const float* q,
                       float* out, const token_slot& tok, std::size_t kv_head, float scale, float* scores) noexcept {
  const std::size_t n = static_cast<std::size_t>(tok.pos) + 1;
  const std::size_t d = l.head_dim;
  float max_score = -INFINITY;
  for (std::size_t j = 0; j < n; ++j) {
    const auto at = kv::locate(tok.table, l.block_size, j);
    scores[j] = dot(q, k_cache + l.offset(at.block, kv_head, at.slot), d) * scale;
    max_score = std::max(max_score, scores[j]);
  }
  float sum = 0.0f;
  for (std::size_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    sum += scores[j];
  }
  std::fill_n(out, d, 0.0f);
  for (std::size_t j = 0; j < n; ++j) {
    const auto at = kv::locate(tok.table, l.block_size, j);
    axpy(scores[j], v_cache + l.offset(at.block, kv_head, at.slot), out, d);
  }
  const float inv = 1.0f / sum;
  for (std::size_t i = 0; i < d; ++i) out[i] *= inv;
}
}  // namespace detail

// q, out: (tokens, heads, head_dim). Query head h reads KV head h / (heads / kv_heads).
inline void paged_attention(thread_pool& pool, const kv::paged_layout& l, const float* k_cache, const float* v_cache,
                            const float* q, float* out, std::span<const token_slot> tokens, std::size_t heads,
                            float scale) {
  const std::size_t group = heads / l.kv_heads;
  pool.parallel_for(tokens.size() * heads, [&](std::size_t begin, std::size_t end) {
    std::size_t longest = 0;
    for (std::size_t i = begin; i < end; ++i)
      longest = std::max(longest, static_cast<std::size_t>(tokens[i / heads].pos) + 1);
    std::vector<float> scores(longest);
    for (std::size_t i = begin; i < end; ++i) {
      const std::size_t t = i / heads, h = i % heads;
      detail::attend_one(l, k_cache, v_cache, q + i * l.head_dim, out + i * l.head_dim, tokens[t], h / group, scale,
                         scores.data());
    }
  });
}

}  // namespace efim::kernels
