#pragma once
// Block hashing policies: the key of a full block of tokens chains the key of the block before it,
// and the chain starts from a root made of the extra keys (model, adapter, tenant salt).
#include <compare>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "efim/cache/concepts.hpp"
#include "efim/cache/xxhash.hpp"
#include "efim/core/types.hpp"

namespace efim::cache {

namespace detail {
// XXH3 streaming state for 64- or 128-bit digests.
template <bool Wide>
struct xxh3_stream {
  XXH3_state_t state;
  xxh3_stream() noexcept {
    XXH3_INITSTATE(&state);
    if constexpr (Wide)
      XXH3_128bits_reset(&state);
    else
      XXH3_64bits_reset(&state);
  }
  void add(const void* data, std::size_t size) noexcept {
    if constexpr (Wide)
      XXH3_128bits_update(&state, data, size);
    else
      XXH3_64bits_update(&state, data, size);
  }
  template <class T>
  void add_value(const T& v) noexcept {
    add(&v, sizeof v);
  }
  void add_keys(const extra_keys& k) noexcept {
    static constexpr std::string_view tag = "efim.block.v1";
    add(tag.data(), tag.size());
    add_value(k.model);
    add_value(k.adapter);
    const std::uint64_t salt_size = k.salt.size();
    add_value(salt_size);
    add(k.salt.data(), k.salt.size());
  }
};
}  // namespace detail

// 64-bit keys: smallest index; a hit is still verified token by token.
struct xxh3_64_chain {
  using hash_type = std::uint64_t;

  static hash_type root(const extra_keys& keys) noexcept {
    detail::xxh3_stream<false> s;
    s.add_keys(keys);
    return XXH3_64bits_digest(&s.state);
  }
  static hash_type chain(const hash_type& parent, std::span<const token_id> tokens) noexcept {
    return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent);
  }
  static std::size_t bucket(const hash_type& h) noexcept { return static_cast<std::size_t>(h); }
};

struct hash128 {
  std::uint64_t low = 0, high = 0;
  friend constexpr bool operator==(const hash128&, const hash128&) = default;
  friend constexpr auto operator<=>(const hash128&, const hash128&) = default;
};

// 128-bit keys: collisions are out of reach even for caches of billions of blocks.
struct xxh3_128_chain {
  using hash_type = hash128;

  static hash_type root(const extra_keys& keys) noexcept {
    detail::xxh3_stream<true> s;
    s.add_keys(keys);
    const XXH128_hash_t h = XXH3_128bits_digest(&s.state);
    return {h.low64, h.high64};
  }
  static hash_type chain(const hash_type& parent, std::span<const token_id> tokens) noexcept {
    detail::xxh3_stream<true> s;
    s.add_value(parent.low);
    s.add_value(parent.high);
    s.add(tokens.data(), tokens.size_bytes());
    const XXH128_hash_t h = XXH3_128bits_digest(&s.state);
    return {h.low64, h.high64};
  }
  static std::size_t bucket(const hash_type& h) noexcept { return static_cast<std::size_t>(h.low); }
};

static_assert(block_hasher<xxh3_64_chain>);
static_assert(block_hasher<xxh3_128_chain>);

}  // namespace efim::cache
