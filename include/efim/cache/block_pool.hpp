#pragma once
// A fixed pool of KV block ids with reference counts. Blocks hold no KV here: the pool is the
// bookkeeping, the KV storage lives elsewhere and is addressed by the same ids.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::cache {

class block_pool {
 public:
  explicit block_pool(std::size_t blocks) : refs_(blocks, 0) {
    require(blocks > 0, errc::invalid_argument, "block_pool: the pool needs at least one block");
    require(blocks < no_block, errc::invalid_argument, "block_pool: too many blocks");
    free_.reserve(blocks);
    for (std::size_t b = blocks; b-- > 0;) free_.push_back(static_cast<block_id>(b));  // hand out 0 first
  }

  // Takes a free block with one reference, if any is free.
  std::optional<block_id> allocate() {
    if (free_.empty()) return std::nullopt;
    const block_id b = free_.back();
    free_.pop_back();
    refs_[b] = 1;
    return b;
  }

  // Adds a reference to a block (free or not: a cached block leaves the evictable set this way).
  void retain(block_id b) { ++refs_.at(b); }

  // Drops a reference; true when none is left. The block is not freed: see free().
  bool release(block_id b) {
    auto& r = refs_.at(b);
    require(r > 0, errc::invalid_argument, "block_pool: block " + std::to_string(b) + " released too often");
    return --r == 0;
  }

  // Returns an unreferenced block to the free list.
  void free(block_id b) {
    require(refs_.at(b) == 0, errc::invalid_argument,
            "block_pool: block " + std::to_string(b) + " is still referenced");
    free_.push_back(b);
  }

  [[nodiscard]] std::uint32_t ref_count(block_id b) const { return refs_.at(b); }
  [[nodiscard]] std::size_t capacity() const noexcept { return refs_.size(); }
  [[nodiscard]] std::size_t free_count() const noexcept { return free_.size(); }

 private:
  std::vector<std::uint32_t> refs_;
  std::vector<block_id> free_;  // a stack: the block freed last is reused first
};

}  // namespace efim::cache
