#pragma once
// What the cache layer asks of block hashers, clocks and eviction policies.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "efim/core/types.hpp"

namespace efim::cache {

// Everything besides the tokens that decides whether cached KV may be reused: blocks of different
// models, adapters or tenants (salts) never share a key.
struct extra_keys {
  std::uint64_t model = 0;
  std::uint64_t adapter = 0;
  std::string salt;
};

template <class H>
concept block_hasher = requires(const typename H::hash_type& h, std::span<const token_id> tokens, const extra_keys& k) {
  requires std::regular<typename H::hash_type>;
  { H::root(k) } -> std::same_as<typename H::hash_type>;
  { H::chain(h, tokens) } -> std::same_as<typename H::hash_type>;
  { H::bucket(h) } -> std::convertible_to<std::size_t>;
};

using tick = std::uint64_t;

template <class C>
concept tick_clock = requires(C& c) {
  { c.now() } -> std::same_as<tick>;
};

// What an eviction policy may know of a cached block.
struct block_stats {
  tick cached_at = 0;       // when its KV entered the cache index
  tick last_used = 0;       // when a sequence last used it (admitted or released)
  std::uint64_t uses = 0;   // sequences that have used it, the one that computed it included
  std::uint32_t depth = 0;  // its index in its chain: deeper blocks are only reachable through shallower ones
};

// An eviction policy holds the evictable blocks (cached, used by no sequence) and picks victims.
template <class E>
concept eviction_policy = std::movable<E> && requires(E& e, const E& ce, block_id b, const block_stats& s) {
  e.insert(b, s);                                        // b became evictable
  e.erase(b);                                            // b is in use again (it was evictable)
  { e.pop() } -> std::same_as<std::optional<block_id>>;  // removes and returns the victim, if any
  { ce.size() } -> std::convertible_to<std::size_t>;
};

}  // namespace efim::cache
