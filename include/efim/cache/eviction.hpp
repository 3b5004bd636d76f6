#pragma once
// Eviction policies: least recently used, first in first out, least frequently used.
#include <cstddef>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "efim/cache/concepts.hpp"

namespace efim::cache {

namespace detail {
// Deeper blocks go first among equals: evicting a chain's head would strand its tail.
constexpr std::uint32_t depth_rank(const block_stats& s) noexcept {
  return std::numeric_limits<std::uint32_t>::max() - s.depth;
}

// Evicts the block with the smallest key; `KeyOf` maps block stats to an ordered key.
template <class KeyOf>
class ordered_eviction {
 public:
  using key_type = decltype(KeyOf{}(block_stats{}));

  void insert(block_id b, const block_stats& s) {
    const key_type k = KeyOf{}(s);
    if (const auto it = keys_.find(b); it != keys_.end()) {
      order_.erase({it->second, b});
      it->second = k;
    } else {
      keys_.emplace(b, k);
    }
    order_.insert({k, b});
  }

  void erase(block_id b) {
    const auto it = keys_.find(b);
    if (it == keys_.end()) return;
    order_.erase({it->second, b});
    keys_.erase(it);
  }

  std::optional<block_id> pop() {
    if (order_.empty()) return std::nullopt;
    const block_id b = order_.begin()->second;
    order_.erase(order_.begin());
    keys_.erase(b);
    return b;
  }

  [[nodiscard]] std::size_t size() const noexcept { return order_.size(); }

 private:
  std::set<std::pair<key_type, block_id>> order_;
  std::unordered_map<block_id, key_type> keys_;
};

struct lru_key {
  auto operator()(const block_stats& s) const noexcept { return std::pair{s.last_used, depth_rank(s)}; }
};
struct fifo_key {
  auto operator()(const block_stats& s) const noexcept { return std::pair{s.cached_at, depth_rank(s)}; }
};
struct lfu_key {
  auto operator()(const block_stats& s) const noexcept { return std::tuple{s.uses, s.last_used, depth_rank(s)}; }
};
}  // namespace detail

// Least recently used first.
struct lru : detail::ordered_eviction<detail::lru_key> {};
// Oldest cached first, however often it was reused.
struct fifo : detail::ordered_eviction<detail::fifo_key> {};
// Fewest uses first; least recently used among equals.
struct lfu : detail::ordered_eviction<detail::lfu_key> {};

static_assert(eviction_policy<lru>);
static_assert(eviction_policy<fifo>);
static_assert(eviction_policy<lfu>);

}  // namespace efim::cache
