#pragma once
// A shared KV tier below the local cache: blocks of KV kept in a store that every replica reads
// (cache::redis_tier in efim/cache/redis_tier.hpp, or a user's), so a session moved to another
// replica, or a replica restarted empty, finds the blocks another one computed.
//
// What this header holds needs no store:
// - remote_tier, the concept a store models: fetch a chain of keys in one round trip, store a block
//   behind the request (never on its path);
// - no_remote_tier, the default: nothing stored, nothing found;
// - the keys: a chain of 128-bit XXH3 digests of their own (not the local cache's hasher, which a
//   user may pick weaker), rooted in everything that decides whether KV may be reused: the model
//   (its fingerprint, with the products mode), the adapter, the tenant's salt, and the KV's shape
//   and element type;
// - the values: a header that repeats what the key was made of (root, parent key, the block's token
//   ids, the shape) and a checksum of the KV bytes. read_block() uses a value only when every field
//   is what the reader expects: a value of another model, tenant, shape or prefix, or one cut short
//   or changed in the store, is refused (the block is then computed), never used.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/concepts.hpp"
#include "efim/cache/xxhash.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::cache {

template <class R>
concept remote_tier = requires(R& r, std::span<const std::string> keys, std::string key, std::string value) {
  // The values of `keys` (nullopt: not there, or the store did not answer in time), one per key.
  { r.fetch(keys) } -> std::same_as<std::vector<std::optional<std::string>>>;
  // Stores a value behind the caller: queued, and dropped if the queue is full; never blocks. A key
  // already stored may be skipped (a block's value never changes).
  r.store(std::move(key), std::move(value));
  // The same for a value that replaces what the key held (a session's state): never skipped.
  r.put(std::move(key), std::move(value));
};

// The default: no store.
struct no_remote_tier {
  static constexpr bool enabled = false;
  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys) const {
    return std::vector<std::optional<std::string>>(keys.size());
  }
  void store(std::string, std::string) const noexcept {}
  void put(std::string, std::string) const noexcept {}
};
static_assert(remote_tier<no_remote_tier>);

// A remote tier behind one type (not owned: it must outlive its users), so that one pipeline type
// serves with a store or without: the engine calls it a few times per request, never per token.
class remote_tier_ref {
 public:
  remote_tier_ref() = default;  // none
  template <remote_tier R>
    requires(!std::same_as<R, remote_tier_ref>)
  explicit remote_tier_ref(R& tier)
      : tier_(&tier),
        fetch_([](void* t, std::span<const std::string> keys) { return static_cast<R*>(t)->fetch(keys); }),
        store_([](void* t, std::string k, std::string v) { static_cast<R*>(t)->store(std::move(k), std::move(v)); }),
        put_([](void* t, std::string k, std::string v) { static_cast<R*>(t)->put(std::move(k), std::move(v)); }) {}

  explicit operator bool() const noexcept { return tier_ != nullptr; }
  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys) const {
    return tier_ ? fetch_(tier_, keys) : std::vector<std::optional<std::string>>(keys.size());
  }
  void store(std::string key, std::string value) const {
    if (tier_) store_(tier_, std::move(key), std::move(value));
  }
  void put(std::string key, std::string value) const {
    if (tier_) put_(tier_, std::move(key), std::move(value));
  }

 private:
  void* tier_ = nullptr;
  std::vector<std::optional<std::string>> (*fetch_)(void*, std::span<const std::string>) = nullptr;
  void (*store_)(void*, std::string, std::string) = nullptr;
  void (*put_)(void*, std::string, std::string) = nullptr;
};
static_assert(remote_tier<remote_tier_ref>);

// The shape of a block's KV: what a block's bytes mean.
struct block_shape {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t block_size = 0;  // tokens
  dtype type = dtype::f32;

  // Bytes of one block's K and V over all layers.
  [[nodiscard]] std::size_t bytes() const noexcept {
    return std::size_t{2} * layers * kv_heads * head_dim * block_size * info(type).bytes;
  }
  friend bool operator==(const block_shape&, const block_shape&) = default;
};

// The remote chain's start: the extra keys and the shape.
inline hash128 remote_root(const extra_keys& keys, const block_shape& shape) noexcept {
  detail::xxh3_stream<true> s;
  static constexpr std::string_view tag = "efim.remote.v1";
  s.add(tag.data(), tag.size());
  s.add_keys(keys);
  s.add_value(shape.layers);
  s.add_value(shape.kv_heads);
  s.add_value(shape.head_dim);
  s.add_value(shape.block_size);
  const auto type = static_cast<std::uint32_t>(shape.type);
  s.add_value(type);
  const XXH128_hash_t h = XXH3_128bits_digest(&s.state);
  return {h.low64, h.high64};
}

// The key of the block of `tokens` that follows the block keyed `parent` (or the root).
inline hash128 remote_chain(const hash128& parent, std::span<const token_id> tokens) noexcept {
  return xxh3_128_chain::chain(parent, tokens);
}

// The store's key for a block: `prefix` and 32 hex digits.
inline std::string remote_key(std::string_view prefix, const hash128& h) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string k(prefix);
  for (const std::uint64_t part : {h.high, h.low})
    for (int shift = 60; shift >= 0; shift -= 4) k += digits[(part >> shift) & 15];
  return k;
}

// ---- values ----

namespace detail {
inline constexpr std::array<char, 8> remote_magic{'E', 'F', 'I', 'M', 'K', 'V', '0', '1'};

template <class T>
void put(std::string& out, const T& v) {
  const auto* p = reinterpret_cast<const char*>(&v);
  out.append(p, sizeof v);
}
template <class T>
bool get(std::string_view& in, T& v) {
  if (in.size() < sizeof v) return false;
  std::memcpy(&v, in.data(), sizeof v);
  in.remove_prefix(sizeof v);
  return true;
}
}  // namespace detail

// What a block's value says of itself (its header), and what a reader expects of it.
struct block_identity {
  hash128 root;    // remote_root() of the model, adapter, salt and shape
  hash128 parent;  // the key of the block before it (the root for a first block)
  block_shape shape;
  std::span<const token_id> tokens;  // the block's tokens (shape.block_size of them)
};

// A block's value: the header, then its KV bytes (shape.bytes() of them), in host byte order (a
// store is shared by replicas of one build on one kind of machine; another order fails the checks).
inline std::string write_block(const block_identity& id, std::span<const std::byte> kv) {
  require(kv.size() == id.shape.bytes() && id.tokens.size() == id.shape.block_size, errc::invalid_argument,
          "remote: a block's value needs its shape's bytes and block_size tokens");
  std::string out;
  out.reserve(128 + id.tokens.size_bytes() + kv.size());
  out.append(detail::remote_magic.data(), detail::remote_magic.size());
  for (const hash128& h : {id.root, id.parent}) {
    detail::put(out, h.low);
    detail::put(out, h.high);
  }
  detail::put(out, id.shape.layers);
  detail::put(out, id.shape.kv_heads);
  detail::put(out, id.shape.head_dim);
  detail::put(out, id.shape.block_size);
  detail::put(out, static_cast<std::uint32_t>(id.shape.type));
  for (const token_id t : id.tokens) detail::put(out, t);
  const std::uint64_t size = kv.size(), sum = XXH3_64bits(kv.data(), kv.size());
  detail::put(out, size);
  detail::put(out, sum);
  out.append(reinterpret_cast<const char*>(kv.data()), kv.size());
  return out;
}

// Why a value was refused (for counters and logs).
enum class refusal { none, malformed, other_root, other_parent, other_shape, other_tokens, corrupted };

inline std::string_view to_string(refusal r) noexcept {
  switch (r) {
    case refusal::none:
      return "none";
    case refusal::malformed:
      return "malformed";
    case refusal::other_root:
      return "other model, adapter or tenant";
    case refusal::other_parent:
      return "other prefix";
    case refusal::other_shape:
      return "other KV shape";
    case refusal::other_tokens:
      return "other tokens";
    case refusal::corrupted:
      return "corrupted";
  }
  return "?";
}

// The KV bytes of `value` if it is the block `expected` describes, else why not. The bytes are a
// view into `value`.
struct read_result {
  std::span<const std::byte> kv;
  refusal why = refusal::malformed;
};

inline read_result read_block(std::string_view value, const block_identity& expected) noexcept {
  read_result r;
  if (value.size() < detail::remote_magic.size() ||
      !std::equal(detail::remote_magic.begin(), detail::remote_magic.end(), value.begin()))
    return r;
  value.remove_prefix(detail::remote_magic.size());
  hash128 root, parent;
  block_shape shape;
  std::uint32_t type = 0;
  if (!detail::get(value, root.low) || !detail::get(value, root.high) || !detail::get(value, parent.low) ||
      !detail::get(value, parent.high) || !detail::get(value, shape.layers) || !detail::get(value, shape.kv_heads) ||
      !detail::get(value, shape.head_dim) || !detail::get(value, shape.block_size) || !detail::get(value, type))
    return r;
  shape.type = static_cast<dtype>(type);
  if (root != expected.root) return {{}, refusal::other_root};
  if (type != static_cast<std::uint32_t>(expected.shape.type) || shape != expected.shape)
    return {{}, refusal::other_shape};
  if (parent != expected.parent) return {{}, refusal::other_parent};
  if (expected.tokens.size() != shape.block_size) return {{}, refusal::other_tokens};
  for (const token_id want : expected.tokens) {
    token_id t = 0;
    if (!detail::get(value, t)) return r;
    if (t != want) return {{}, refusal::other_tokens};
  }
  std::uint64_t size = 0, sum = 0;
  if (!detail::get(value, size) || !detail::get(value, sum)) return r;
  if (size != shape.bytes() || value.size() != size) return r;
  const auto* bytes = reinterpret_cast<const std::byte*>(value.data());
  if (XXH3_64bits(bytes, value.size()) != sum) return {{}, refusal::corrupted};
  return {std::span(bytes, value.size()), refusal::none};
}

}  // namespace efim::cache
