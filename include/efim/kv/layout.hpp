#pragma once
// The paged KV layout: one shape + stride type does the index arithmetic for every backend.
#include <cstddef>
#include <span>

#include "efim/core/config.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::kv {

// K and V of one layer. V is (block, kv_head, slot, dim), dim contiguous; K is (block, kv_head, dim,
// slot), slot contiguous, so a query's scores against a block's keys are one vector per dimension.
struct paged_layout {
  std::size_t blocks = 0;
  std::size_t kv_heads = 0;
  std::size_t block_size = 0;
  std::size_t head_dim = 0;

  EFIM_HOST_DEVICE constexpr std::size_t slot_stride() const noexcept { return head_dim; }
  EFIM_HOST_DEVICE constexpr std::size_t head_stride() const noexcept { return block_size * head_dim; }
  EFIM_HOST_DEVICE constexpr std::size_t block_stride() const noexcept { return kv_heads * head_stride(); }
  EFIM_HOST_DEVICE constexpr std::size_t elements() const noexcept { return blocks * block_stride(); }

  // V[block][head][slot][0]
  EFIM_HOST_DEVICE constexpr std::size_t offset(std::size_t block, std::size_t head, std::size_t slot) const noexcept {
    return block * block_stride() + head * head_stride() + slot * slot_stride();
  }
  // K[block][head][dim][slot] is at key_offset(block, head) + dim * block_size + slot.
  EFIM_HOST_DEVICE constexpr std::size_t key_offset(std::size_t block, std::size_t head) const noexcept {
    return block * block_stride() + head * head_stride();
  }
};

inline void validate(const paged_layout& l) {
  require(l.blocks > 0 && l.kv_heads > 0 && l.block_size > 0 && l.head_dim > 0, errc::invalid_argument,
          "kv: every extent of the paged layout must be positive");
  constexpr std::size_t most = std::size_t{1} << 40;  // elements of one K or V array
  require(l.head_dim <= most / l.block_size && l.kv_heads <= most / (l.block_size * l.head_dim) &&
              l.blocks <= most / l.block_stride(),
          errc::invalid_argument, "kv: the paged layout is too large");
}

// Where the token at `pos` of a sequence lives, given its block table.
struct slot_ref {
  block_id block;
  std::size_t slot;
};

EFIM_HOST_DEVICE constexpr slot_ref locate(std::span<const block_id> table, std::size_t block_size,
                                           std::size_t pos) noexcept {
  return {table[pos / block_size], pos % block_size};
}

}  // namespace efim::kv
