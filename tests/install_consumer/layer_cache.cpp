// efim::cache alone: the prefix-cache manager finds a computed prefix.
#include <cstdio>
#include <efim/cache/block_hash.hpp>
#include <efim/cache/eviction.hpp>
#include <efim/cache/manager.hpp>
#include <vector>

int main() {
  efim::cache::manager<efim::cache::xxh3_64_chain, efim::cache::fifo> m({.block_size = 4, .blocks = 16});
  const std::vector<efim::token_id> prompt{1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto s = m.admit(m.plan(prompt, prompt.size()));
  m.commit(s, prompt, prompt.size());
  m.release(s);
  const auto hit = m.plan(prompt, prompt.size()).hit_tokens;
  std::printf("cache: %zu of %zu tokens cached\n", hit, prompt.size());
  return hit == 8 ? 0 : 1;
}
