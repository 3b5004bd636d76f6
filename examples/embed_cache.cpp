// efim's prefix-cache manager over a runtime's own KV memory: efim::cache alone.
//
// The manager is bookkeeping only: block ids, reference counts, the index of computed blocks, eviction.
// The runtime owns the KV and addresses it by the block ids the manager hands out: position p of a
// sequence lives in block table[p / block_size], slot p % block_size. Here the "KV" of a position is a
// value that depends on its token and on every token before it (as real KV does), so a block reused
// after another prefix, or for another tenant, would show as a wrong value. Requests of a few tenants
// share long prefixes (a repository's files); the cache is small, so blocks are evicted all along.
//
//   embed-cache           prints hits and evictions; exits 1 if any reused KV differs from KV computed
//                         from scratch
#include <cstdint>
#include <cstdio>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/manager.hpp"
#include "efim/core/random.hpp"

namespace {
using efim::token_id;

// KV of position p: mixes the KV of p - 1 with the token (and a per-tenant start, as an adapter or a
// system prompt would change it).
std::uint64_t next_kv(std::uint64_t previous, token_id t) {
  std::uint64_t x = previous ^ (static_cast<std::uint64_t>(t) + 0x9e3779b97f4a7c15ull + (previous << 6));
  x ^= x >> 31;
  return x * 0xbf58476d1ce4e5b9ull;
}

// The runtime's KV memory: (block, slot) values, one buffer the runtime allocated.
class kv_memory {
 public:
  kv_memory(std::size_t blocks, std::size_t block_size) : block_size_(block_size), values_(blocks * block_size) {}
  std::uint64_t& at(std::span<const efim::block_id> table, std::size_t position) {
    return values_[table[position / block_size_] * block_size_ + position % block_size_];
  }

 private:
  std::size_t block_size_;
  std::vector<std::uint64_t> values_;
};
}  // namespace

int main() {
  constexpr std::size_t block_size = 16, blocks = 96;
  using manager = efim::cache::manager<efim::cache::xxh3_128_chain, efim::cache::lru>;
  manager cache({.block_size = block_size, .blocks = blocks});
  kv_memory kv(blocks, block_size);

  // Documents of a few tenants: a shared head (a file everyone has open) and tails of their own.
  efim::rng random(7);
  std::vector<token_id> head(200);
  for (auto& t : head) t = static_cast<token_id>(random.below(1000));
  const std::vector<std::string> tenants{"team-a", "team-b"};

  struct live {
    manager::sequence blocks;
  };
  std::deque<live> running;  // sequences still holding their blocks (as requests in flight would)
  std::size_t requests = 0, wrong = 0;
  for (int round = 0; round < 400; ++round) {
    // A prompt: part of the head, then a tail of its own.
    std::vector<token_id> prompt(head.begin(), head.begin() + static_cast<std::ptrdiff_t>(random.below(head.size())));
    for (std::size_t i = 1 + random.below(60); i > 0; --i) prompt.push_back(static_cast<token_id>(random.below(1000)));
    const std::string& tenant = tenants[random.below(tenants.size())];
    const efim::cache::extra_keys keys{.model = 1, .adapter = 0, .salt = tenant};
    const std::uint64_t start = tenant == "team-a" ? 1 : 2;

    // Plan (no side effect), make room by ending older sequences, admit.
    auto plan = cache.plan(prompt, prompt.size() + 8, keys);
    while (!plan.fits && !running.empty()) {
      cache.release(running.front().blocks);
      running.pop_front();
      plan = cache.plan(prompt, prompt.size() + 8, keys);
    }
    if (!plan.fits) continue;
    auto seq = cache.admit(plan);
    // Compute only the positions the cache does not hold, reading the KV before them from the blocks.
    for (std::size_t p = seq.hit_tokens; p < prompt.size(); ++p)
      kv.at(seq.table, p) = next_kv(p == 0 ? start : kv.at(seq.table, p - 1), prompt[p]);
    cache.commit(seq, prompt, prompt.size());
    // Every position, reused or computed, holds the KV of this very prefix.
    std::uint64_t expected = start;
    for (std::size_t p = 0; p < prompt.size(); ++p) {
      expected = next_kv(expected, prompt[p]);
      if (kv.at(seq.table, p) != expected) ++wrong;
    }
    ++requests;
    running.push_back({std::move(seq)});
    if (running.size() > 3) {
      cache.release(running.front().blocks);
      running.pop_front();
    }
  }
  for (auto& l : running) cache.release(l.blocks);
  const auto& stats = cache.stats();
  std::printf("%zu requests, %llu prompt tokens: %llu from the cache (hit rate %.3f), %llu blocks evicted, %zu "
              "positions with wrong KV\n",
              requests, static_cast<unsigned long long>(stats.query_tokens),
              static_cast<unsigned long long>(stats.hit_tokens), stats.hit_rate(),
              static_cast<unsigned long long>(stats.evicted_blocks), wrong);
  return wrong == 0 && stats.hit_tokens > 0 && stats.evicted_blocks > 0 ? 0 : 1;
}
