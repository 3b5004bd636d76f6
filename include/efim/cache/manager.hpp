#pragma once
// The prefix-cache manager: finds the longest cached prefix of a prompt in whole blocks, allocates
// blocks for the rest, indexes blocks once their KV is computed, and takes them back on release.
//
// Mutations go through plan() (no side effect) then admit(), so a request that does not fit
// changes nothing.
//
// A hit never rests on the hasher alone (a user-supplied policy): the index only finds candidates by
// key, and a candidate block is a hit when its own tokens equal the prompt's, the block before it is
// the one the lookup has just verified (each indexed block records the identity of the block whose KV
// it was computed after: a number never reused), and, for a first block, the extra keys (model,
// adapter, salt) it was computed under equal the prompt's byte for byte. So a hasher that ignores the
// parent or the extra keys, or one whose keys collide, loses hits but never serves KV computed after
// another prefix.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "efim/cache/block_pool.hpp"
#include "efim/cache/clock.hpp"
#include "efim/cache/concepts.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::cache {

struct manager_options {
  std::size_t block_size = 16;  // tokens per block
  std::size_t blocks = 1024;    // blocks in the pool
  bool reuse = true;            // false: no lookups and nothing indexed (every prompt computed in full)
};

struct cache_stats {
  std::uint64_t lookups = 0;         // sequences admitted
  std::uint64_t query_tokens = 0;    // prompt tokens looked up
  std::uint64_t hit_tokens = 0;      // prompt tokens served from cache
  std::uint64_t indexed_blocks = 0;  // blocks entered into the index
  std::uint64_t evicted_blocks = 0;  // cached blocks taken for new KV

  [[nodiscard]] double hit_rate() const noexcept {
    return query_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(query_tokens);
  }
};

// Where a block's KV sits in the chain of prefixes: a number given to a block when it is indexed and
// never given again (0: before the first block), so that a block can name the one it follows.
using chain_node = std::uint64_t;

// The blocks a sequence holds. Block i covers positions [i * block_size, (i + 1) * block_size).
template <class Hash>
struct sequence_blocks {
  std::vector<block_id> table;
  std::vector<Hash> hashes;        // keys of the leading blocks already cached (hits, then commits)
  std::vector<chain_node> nodes;   // their places in the chain (parallel to hashes)
  Hash root{};                     // the chain's start, from the extra keys
  std::string root_keys;           // the extra keys, byte for byte (verified on a first block's hit)
  std::size_t hit_tokens = 0;
};

// What admit() will do; made by plan() without changing anything.
template <class Hash>
struct admission {
  std::vector<block_id> hits;  // cached blocks of the prompt's prefix, in order
  std::vector<Hash> hit_hashes;
  std::vector<chain_node> hit_nodes;
  Hash root{};
  std::string root_keys;
  std::size_t hit_tokens = 0;
  std::size_t query_tokens = 0;
  std::size_t new_blocks = 0;  // blocks to take from the free list or by eviction
  bool fits = false;           // whether that many can be had now
  std::uint64_t version = 0;   // the manager state the plan was made against
};

template <block_hasher H, eviction_policy E, tick_clock C = logical_clock>
class manager {
 public:
  using hash_type = typename H::hash_type;
  using sequence = sequence_blocks<hash_type>;
  using plan_type = admission<hash_type>;

  explicit manager(manager_options options, E eviction = {}, C clock = {})
      : options_(options),
        pool_(checked_blocks(options)),
        entries_(options.blocks),
        block_tokens_(options.blocks * options.block_size),
        eviction_(std::move(eviction)),
        clock_(std::move(clock)) {}

  // Looks up the longest cached prefix of `prompt` (at most prompt.size() - 1 tokens, so at least
  // one token is computed; none when `lookup` is false) and counts the blocks a sequence of
  // `reserve_tokens` needs besides. Throws errc::out_of_blocks if even an empty cache could not hold it.
  [[nodiscard]] plan_type plan(std::span<const token_id> prompt, std::size_t reserve_tokens,
                               const extra_keys& keys = {}, bool lookup = true) const {
    require(!prompt.empty(), errc::invalid_argument, "cache: the prompt is empty");
    reserve_tokens = std::max(reserve_tokens, prompt.size());
    const std::size_t bs = options_.block_size;
    const std::size_t total = (reserve_tokens + bs - 1) / bs;
    require(total <= pool_.capacity(), errc::out_of_blocks,
            "cache: a sequence of " + std::to_string(reserve_tokens) + " tokens needs " + std::to_string(total) +
                " blocks of " + std::to_string(bs) + " tokens, but the cache has " + std::to_string(pool_.capacity()));

    plan_type p;
    p.root = H::root(keys);
    p.root_keys = identity(keys);
    p.query_tokens = prompt.size();
    p.version = version_;
    std::size_t idle_hits = 0;
    if (options_.reuse && lookup) {
      hash_type parent = p.root;
      chain_node parent_node = 0;
      for (std::size_t i = 0; (i + 1) * bs < prompt.size(); ++i) {
        const auto tokens = prompt.subspan(i * bs, bs);
        const hash_type h = H::chain(parent, tokens);
        const auto it = index_.find(h);
        if (it == index_.end() || !follows(it->second, tokens, parent_node, p.root_keys)) break;
        p.hits.push_back(it->second);
        p.hit_hashes.push_back(h);
        p.hit_nodes.push_back(entries_[it->second].node);
        if (pool_.ref_count(it->second) == 0) ++idle_hits;
        parent = h;
        parent_node = entries_[it->second].node;
      }
    }
    p.hit_tokens = p.hits.size() * bs;
    p.new_blocks = total - p.hits.size();
    p.fits = p.new_blocks <= pool_.free_count() + eviction_.size() - idle_hits;
    return p;
  }

  // Applies a plan made against the current state: the sequence holds the hit blocks and new ones.
  sequence admit(const plan_type& p) {
    require(p.version == version_, errc::invalid_argument, "cache: the admission plan is stale");
    require(p.fits, errc::out_of_blocks, "cache: not enough free or evictable blocks for this sequence");
    ++version_;
    const tick now = clock_.now();
    sequence s{{}, p.hit_hashes, p.hit_nodes, p.root, p.root_keys, p.hit_tokens};
    s.table.reserve(p.hits.size() + p.new_blocks);
    for (const block_id b : p.hits) {
      if (pool_.ref_count(b) == 0) eviction_.erase(b);
      pool_.retain(b);
      auto& st = entries_[b].stats;
      st.last_used = now;
      ++st.uses;
      s.table.push_back(b);
    }
    for (std::size_t i = 0; i < p.new_blocks; ++i) s.table.push_back(take_block());
    ++stats_.lookups;
    stats_.query_tokens += p.query_tokens;
    stats_.hit_tokens += p.hit_tokens;
    return s;
  }

  // Indexes the sequence's full blocks whose KV is computed (positions < computed).
  void commit(sequence& s, std::span<const token_id> tokens, std::size_t computed) {
    const std::size_t bs = options_.block_size;
    require(computed <= tokens.size() && tokens.size() <= s.table.size() * bs, errc::invalid_argument,
            "cache: commit past the sequence's tokens or blocks");
    if (!options_.reuse) return;
    ++version_;
    const tick now = clock_.now();
    for (std::size_t i = s.hashes.size(); (i + 1) * bs <= computed; ++i) {
      const auto block = tokens.subspan(i * bs, bs);
      const hash_type h = H::chain(i == 0 ? s.root : s.hashes[i - 1], block);
      const chain_node parent = i == 0 ? 0 : s.nodes[i - 1];
      const block_id b = s.table[i];
      const auto [it, inserted] = index_.emplace(h, b);
      chain_node node = 0;
      if (inserted) {
        auto& e = entries_[b];
        e.indexed = true;
        e.hash = h;
        e.node = node = ++last_node_;
        e.parent = parent;
        e.root_keys = i == 0 ? s.root_keys : std::string();
        e.stats = {now, now, 1, static_cast<std::uint32_t>(i)};
        std::ranges::copy(block, block_tokens_.begin() + static_cast<std::ptrdiff_t>(b * bs));
        ++stats_.indexed_blocks;
      } else if (follows(it->second, block, parent, s.root_keys)) {
        node = entries_[it->second].node;  // another sequence computed the same block first: its copy stays indexed
      } else {
        node = ++last_node_;  // the key is another prefix's (a weak hasher): this block stays out of the index
      }
      s.hashes.push_back(h);
      s.nodes.push_back(node);
    }
  }

  // Drops the sequence's references; cached blocks become evictable (tail first), others free.
  void release(sequence& s) {
    ++version_;
    const tick now = clock_.now();
    for (auto it = s.table.rbegin(); it != s.table.rend(); ++it) {
      const block_id b = *it;
      if (!pool_.release(b)) continue;
      auto& e = entries_[b];
      if (e.indexed) {
        e.stats.last_used = now;
        eviction_.insert(b, e.stats);
      } else {
        pool_.free(b);
      }
    }
    s = sequence{};
  }

  [[nodiscard]] const cache_stats& stats() const noexcept { return stats_; }
  [[nodiscard]] const manager_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t block_size() const noexcept { return options_.block_size; }
  [[nodiscard]] std::size_t capacity() const noexcept { return pool_.capacity(); }
  [[nodiscard]] std::size_t free_blocks() const noexcept { return pool_.free_count(); }
  [[nodiscard]] std::size_t evictable_blocks() const noexcept { return eviction_.size(); }
  [[nodiscard]] std::size_t cached_blocks() const noexcept { return index_.size(); }
  [[nodiscard]] std::uint32_t ref_count(block_id b) const { return pool_.ref_count(b); }
  [[nodiscard]] bool is_cached(block_id b) const { return entries_.at(b).indexed; }

 private:
  struct entry {
    bool indexed = false;
    hash_type hash{};
    chain_node node = 0;    // this block's place in the chain (while indexed)
    chain_node parent = 0;  // the place of the block its KV was computed after (0: a first block)
    std::string root_keys;  // a first block's extra keys, byte for byte
    block_stats stats;
  };
  struct bucket_of {
    std::size_t operator()(const hash_type& h) const noexcept { return H::bucket(h); }
  };

  static std::size_t checked_blocks(const manager_options& o) {
    require(o.block_size > 0, errc::invalid_argument, "cache: block_size must be at least 1 token");
    require(o.blocks > 0, errc::invalid_argument, "cache: the cache needs at least one block");
    return o.blocks;
  }

  std::span<const token_id> stored_tokens(block_id b) const {
    return std::span(block_tokens_).subspan(b * options_.block_size, options_.block_size);
  }

  // Whether indexed block `b` holds the KV of `tokens` computed after the chain place `parent` (for
  // a first block: under the extra keys `root_keys`), whatever the hasher said.
  bool follows(block_id b, std::span<const token_id> tokens, chain_node parent, std::string_view root_keys) const {
    const entry& e = entries_[b];
    return e.parent == parent && (parent != 0 || e.root_keys == root_keys) &&
           std::ranges::equal(tokens, stored_tokens(b));
  }

  // The extra keys as bytes: equal bytes, equal keys.
  static std::string identity(const extra_keys& k) {
    std::string s(2 * sizeof(std::uint64_t), '\0');
    for (std::size_t i = 0; i < sizeof(std::uint64_t); ++i) {
      s[i] = static_cast<char>(k.model >> (8 * i));
      s[sizeof(std::uint64_t) + i] = static_cast<char>(k.adapter >> (8 * i));
    }
    return s += k.salt;
  }

  block_id take_block() {
    if (const auto b = pool_.allocate()) return *b;
    const auto victim = eviction_.pop();
    require(victim.has_value(), errc::out_of_blocks, "cache: no free or evictable block left");
    auto& e = entries_[*victim];
    index_.erase(e.hash);
    e.indexed = false;
    e.root_keys.clear();
    pool_.retain(*victim);
    ++stats_.evicted_blocks;
    return *victim;
  }

  manager_options options_;
  block_pool pool_;
  std::vector<entry> entries_;
  std::vector<token_id> block_tokens_;  // (block, slot): the tokens of each indexed block, to verify hits
  std::unordered_map<hash_type, block_id, bucket_of> index_;
  E eviction_;
  C clock_;
  cache_stats stats_;
  std::uint64_t version_ = 0;
  chain_node last_node_ = 0;
};

}  // namespace efim::cache
