#pragma once
// Eviction policies: least recently used, first in first out, least frequently used.
#include <cstddef>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <variant>

#include "efim/cache/concepts.hpp"
#include "efim/core/error.hpp"

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

// One of the policies above, chosen at run time by name (a server flag), so that a program needs
// one pipeline type for all of them.
class named_eviction {
 public:
  named_eviction() = default;  // lru
  explicit named_eviction(std::string_view name) {
    if (name == "fifo")
      policy_.emplace<fifo>();
    else if (name == "lfu")
      policy_.emplace<lfu>();
    else
      require(name == "lru", errc::invalid_argument,
              "unknown eviction policy '" + std::string(name) + "' (lru, fifo, lfu)");
  }

  void insert(block_id b, const block_stats& s) {
    std::visit([&](auto& e) { e.insert(b, s); }, policy_);
  }
  void erase(block_id b) {
    std::visit([&](auto& e) { e.erase(b); }, policy_);
  }
  std::optional<block_id> pop() {
    return std::visit([](auto& e) { return e.pop(); }, policy_);
  }
  [[nodiscard]] std::size_t size() const {
    return std::visit([](const auto& e) { return e.size(); }, policy_);
  }
  [[nodiscard]] std::string_view name() const noexcept {
    static constexpr std::string_view names[] = {"lru", "fifo", "lfu"};
    return names[policy_.index()];
  }

 private:
  std::variant<lru, fifo, lfu> policy_;
};

static_assert(eviction_policy<lru>);
static_assert(eviction_policy<fifo>);
static_assert(eviction_policy<lfu>);
static_assert(eviction_policy<named_eviction>);

}  // namespace efim::cache
