#pragma once
// How a batch's attention is cut into tiles, shared by the host and CUDA backends: a tile is a run of
// consecutive positions of one sequence times a range of query heads that read the same KV head, at
// most `max_rows` (token, head) rows, so the rows of a tile share every load of K and V.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kernels {

struct attention_tile {
  std::uint32_t first_token, tokens;  // tokens first_token .. + tokens, consecutive positions
  std::uint32_t first_head, heads;    // query heads first_head .. + heads, one KV head
};

// Query heads per KV head; throws unless the heads split evenly (the message only on failure).
inline std::size_t query_group(std::size_t heads, std::size_t kv_heads) {
  if (kv_heads == 0 || heads < kv_heads || heads % kv_heads != 0)
    throw error(errc::invalid_argument, "paged_attention: " + std::to_string(heads) +
                                            " query heads do not split into groups over " +
                                            std::to_string(kv_heads) + " KV heads");
  return heads / kv_heads;
}

// The tiles of `tokens` (in batch order; a sequence's tokens consecutive), appended to `out`.
inline void plan_attention(std::span<const token_slot> tokens, std::size_t heads, std::size_t kv_heads,
                           std::size_t max_rows, std::vector<attention_tile>& out) {
  const std::size_t group = query_group(heads, kv_heads);
  require(max_rows > 0 && tokens.size() <= 0xFFFFFFFFu && heads <= 0xFFFFFFFFu, errc::invalid_argument,
          "plan_attention: too many tokens or heads");
  const std::size_t heads_per_tile = std::min(group, max_rows);
  const std::size_t tokens_per_tile = std::max<std::size_t>(1, max_rows / heads_per_tile);
  for (std::size_t t = 0; t < tokens.size();) {
    std::size_t n = 1;
    while (n < tokens_per_tile && t + n < tokens.size() && tokens[t + n].table.data() == tokens[t].table.data() &&
           tokens[t + n].pos == tokens[t].pos + static_cast<position>(n))
      ++n;
    for (std::size_t g = 0; g < kv_heads; ++g)
      for (std::size_t h = 0; h < group; h += heads_per_tile)
        out.push_back({static_cast<std::uint32_t>(t), static_cast<std::uint32_t>(n),
                       static_cast<std::uint32_t>(g * group + h),
                       static_cast<std::uint32_t>(std::min(heads_per_tile, group - h))});
    t += n;
  }
}

// A step's attention as a device backend uploads it: every sequence's block table once, one after
// another in `tables`; for each token the (block, slot) its K and V go to; the tiles, each with where
// its sequence's table starts in `tables` and the position of its first token.
struct attention_tile_ref {
  attention_tile tile;
  std::uint32_t table;
  position first_pos;
};

struct attention_step {
  std::vector<block_id> tables;
  std::vector<kv::slot_ref> slots;
  std::vector<attention_tile_ref> tiles;

  void plan(std::span<const token_slot> tokens, std::size_t block_size, std::size_t heads, std::size_t kv_heads,
            std::size_t max_rows) {
    tables.clear();
    slots.clear();
    tiles.clear();
    std::vector<std::uint32_t> table_of(tokens.size());
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      const auto& tok = tokens[t];
      require(tok.pos >= 0 && static_cast<std::size_t>(tok.pos) / block_size < tok.table.size(), errc::invalid_argument,
              "attention_step: a block table does not cover its token");
      if (t == 0 || tok.table.data() != tokens[t - 1].table.data()) {
        require(tables.size() + tok.table.size() <= 0xFFFFFFFFu, errc::invalid_argument,
                "attention_step: too many blocks in one step");
        table_of[t] = static_cast<std::uint32_t>(tables.size());
        tables.insert(tables.end(), tok.table.begin(), tok.table.end());
      } else {
        table_of[t] = table_of[t - 1];
      }
      slots.push_back(kv::locate(tok.table, block_size, static_cast<std::size_t>(tok.pos)));
    }
    std::vector<attention_tile> plain;
    plan_attention(tokens, heads, kv_heads, max_rows, plain);
    for (const auto& tile : plain) tiles.push_back({tile, table_of[tile.first_token], tokens[tile.first_token].pos});
  }
};

}  // namespace efim::kernels
