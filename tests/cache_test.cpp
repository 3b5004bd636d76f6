#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <numeric>
#include <optional>
#include <range/v3/view/chunk.hpp>
#include <range/v3/view/iota.hpp>
#include <set>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/block_pool.hpp"
#include "efim/cache/clock.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/manager.hpp"
#include "efim/cache/xxhash.hpp"
#include "efim/core/error.hpp"
#include "efim/core/random.hpp"

using namespace efim;
using cache::extra_keys;

namespace {
std::vector<token_id> iota_tokens(std::size_t n, token_id first = 0) {
  std::vector<token_id> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

template <class Manager>
typename Manager::sequence admit_and_compute(Manager& m, const std::vector<token_id>& tokens, std::size_t reserve = 0,
                                             const extra_keys& keys = {}) {
  const auto plan = m.plan(tokens, std::max(reserve, tokens.size()), keys);
  REQUIRE(plan.fits);
  auto s = m.admit(plan);
  m.commit(s, tokens, tokens.size());
  return s;
}

// A user-defined policy: evicts the most recently released block first (MRU).
struct mru {
  void insert(block_id b, const cache::block_stats& s) { order_[{s.last_used, b}] = b; }
  void erase(block_id b) {
    std::erase_if(order_, [&](const auto& kv) { return kv.second == b; });
  }
  std::optional<block_id> pop() {
    if (order_.empty()) return std::nullopt;
    const auto it = std::prev(order_.end());
    const block_id b = it->second;
    order_.erase(it);
    return b;
  }
  std::size_t size() const { return order_.size(); }
  std::map<std::pair<cache::tick, block_id>, block_id> order_;
};
static_assert(cache::eviction_policy<mru>);

// Hashers a user might write badly: a block's key from its own tokens alone (the parent and the extra
// keys ignored), and one key for every block. The manager must never give a wrong hit with either.
struct parent_ignoring_hash {
  using hash_type = std::uint64_t;
  static hash_type root(const extra_keys&) noexcept { return 0; }
  static hash_type chain(const hash_type&, std::span<const token_id> tokens) noexcept {
    return XXH3_64bits(tokens.data(), tokens.size_bytes());
  }
  static std::size_t bucket(const hash_type& h) noexcept { return static_cast<std::size_t>(h); }
};
struct constant_hash {
  using hash_type = std::uint64_t;
  static hash_type root(const extra_keys&) noexcept { return 1; }
  static hash_type chain(const hash_type&, std::span<const token_id>) noexcept { return 1; }
  static std::size_t bucket(const hash_type& h) noexcept { return static_cast<std::size_t>(h); }
};
static_assert(cache::block_hasher<parent_ignoring_hash> && cache::block_hasher<constant_hash>);

std::vector<token_id> concat(std::initializer_list<std::vector<token_id>> parts) {
  std::vector<token_id> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}
}  // namespace

TEMPLATE_TEST_CASE("block hashes chain the parent and the extra keys", "[cache][hash]", cache::xxh3_64_chain,
                   cache::xxh3_128_chain) {
  using H = TestType;
  const auto tokens = iota_tokens(16);
  const auto root = H::root({});
  CHECK(H::root({}) == root);
  CHECK(H::root({1, 0, ""}) != root);
  CHECK(H::root({0, 1, ""}) != root);
  CHECK(H::root({0, 0, "tenant-a"}) != H::root({0, 0, "tenant-b"}));
  CHECK(H::root({0, 0, "ab"}) != H::root({0, 0, "a"}));
  const auto h1 = H::chain(root, tokens);
  CHECK(H::chain(root, tokens) == h1);
  CHECK(H::chain(H::chain(root, tokens), tokens) != h1);  // same tokens, other parent
  auto other = tokens;
  other[15] = 99;
  CHECK(H::chain(root, other) != h1);
  // Chunking a token stream into blocks and chaining gives a distinct key per prefix.
  const auto stream = iota_tokens(64);
  std::set<typename H::hash_type> keys;
  auto parent = root;
  for (const auto block : stream | ranges::views::chunk(16)) {
    parent = H::chain(parent, std::span<const token_id>(&*block.begin(), 16));
    keys.insert(parent);
  }
  CHECK(keys.size() == 4);
}

TEST_CASE("block pool counts references", "[cache][pool]") {
  cache::block_pool pool(3);
  CHECK(pool.capacity() == 3);
  const auto a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
  REQUIRE((a && b && c));
  CHECK(*a == 0);
  CHECK_FALSE(pool.allocate().has_value());
  pool.retain(*a);
  CHECK(pool.ref_count(*a) == 2);
  CHECK_FALSE(pool.release(*a));
  CHECK_THROWS_AS(pool.free(*a), efim::error);  // still referenced
  CHECK(pool.release(*a));
  pool.free(*a);
  CHECK(pool.free_count() == 1);
  CHECK_THROWS_AS(pool.release(*a), efim::error);  // released too often
  CHECK_THROWS_AS(cache::block_pool(0), efim::error);
}

TEST_CASE("eviction policies order victims as named", "[cache][eviction]") {
  // Block 1: cached first, used last. Block 2: cached second, used most. Block 3: cached last.
  const cache::block_stats s1{1, 30, 1, 0}, s2{2, 10, 5, 0}, s3{3, 20, 2, 0};
  const auto order = [&](auto policy) {
    policy.insert(1, s1);
    policy.insert(2, s2);
    policy.insert(3, s3);
    std::vector<block_id> out;
    while (const auto b = policy.pop()) out.push_back(*b);
    return out;
  };
  CHECK(order(cache::lru{}) == std::vector<block_id>{2, 3, 1});
  CHECK(order(cache::fifo{}) == std::vector<block_id>{1, 2, 3});
  CHECK(order(cache::lfu{}) == std::vector<block_id>{1, 3, 2});
  // Chosen by name at run time: the same orders.
  for (const std::string name : {"lru", "fifo", "lfu"}) {
    const cache::named_eviction e(name);
    CHECK(e.name() == name);
    CHECK(order(e) == (name == "lru"    ? order(cache::lru{})
                       : name == "fifo" ? order(cache::fifo{})
                                        : order(cache::lfu{})));
  }
  CHECK(cache::named_eviction().name() == "lru");
  CHECK_THROWS_AS(cache::named_eviction("random"), efim::error);
  // Among equal times the deeper block goes first.
  cache::lru l;
  l.insert(7, {0, 5, 1, 0});
  l.insert(8, {0, 5, 1, 1});
  CHECK(l.pop() == block_id{8});
  l.erase(7);
  CHECK(l.size() == 0);
  CHECK_FALSE(l.pop().has_value());
}

TEST_CASE("manager finds the longest cached prefix in whole blocks", "[cache][manager]") {
  cache::manager<cache::xxh3_128_chain, cache::lru> m({4, 64, true});
  const auto first = iota_tokens(10);
  auto s1 = admit_and_compute(m, first);
  CHECK(s1.hit_tokens == 0);
  CHECK(s1.table.size() == 3);
  CHECK(m.cached_blocks() == 2);  // tokens 0-3 and 4-7; 8-9 is not a full block

  auto longer = iota_tokens(14);
  auto plan = m.plan(longer, 14);
  CHECK(plan.hit_tokens == 8);
  CHECK(plan.hits == std::vector<block_id>{s1.table[0], s1.table[1]});
  CHECK(plan.new_blocks == 2);

  // A prompt that diverges in the second block only reuses the first.
  auto diverging = iota_tokens(14);
  diverging[5] = 1000;
  CHECK(m.plan(diverging, 14).hit_tokens == 4);

  // At least one token is always left to compute.
  CHECK(m.plan(iota_tokens(8), 8).hit_tokens == 4);
  CHECK(m.plan(iota_tokens(9), 9).hit_tokens == 8);

  // Hits are shared: two live sequences hold the same blocks.
  auto s2 = m.admit(plan);
  CHECK(m.ref_count(s1.table[0]) == 2);
  m.release(s1);
  CHECK(m.ref_count(s2.table[0]) == 1);
  CHECK(m.stats().query_tokens == 24);
  CHECK(m.stats().hit_tokens == 8);
  CHECK(m.stats().hit_rate() == Approx(8.0 / 24.0));
  m.release(s2);
  CHECK(m.free_blocks() + m.evictable_blocks() == 64);
}

TEST_CASE("manager: plan changes nothing, a stale plan is refused", "[cache][manager]") {
  cache::manager<cache::xxh3_64_chain, cache::lru> m({4, 4, true});
  const auto tokens = iota_tokens(12);
  const auto plan = m.plan(tokens, 12);
  CHECK(m.free_blocks() == 4);
  CHECK(m.stats().lookups == 0);
  auto s = m.admit(plan);
  CHECK(m.free_blocks() == 1);
  const auto big = m.plan(iota_tokens(8, 100), 8);
  CHECK_FALSE(big.fits);  // needs 2, 1 free and nothing evictable
  CHECK_THROWS_AS(m.admit(big), efim::error);
  CHECK(m.free_blocks() == 1);
  const auto small = m.plan(iota_tokens(2, 100), 2);
  m.commit(s, tokens, 12);
  CHECK_THROWS_AS(m.admit(small), efim::error);  // made before the commit
}

TEST_CASE("manager: bad sizes get clear errors", "[cache][manager]") {
  using M = cache::manager<cache::xxh3_64_chain, cache::lru>;
  CHECK_THROWS_AS(M({0, 16, true}), efim::error);
  CHECK_THROWS_AS(M({16, 0, true}), efim::error);
  M m({4, 2, true});
  try {
    (void)m.plan(iota_tokens(9), 9);  // needs 3 blocks, the cache has 2
    FAIL("expected an error");
  } catch (const efim::error& e) {
    CHECK(e.code() == errc::out_of_blocks);
  }
  CHECK_THROWS_AS((void)m.plan({}, 4), efim::error);
  auto s = admit_and_compute(m, iota_tokens(4));
  CHECK_THROWS_AS(m.commit(s, iota_tokens(4), 5), efim::error);
}

TEST_CASE("manager evicts least recently used blocks, tail first, never referenced ones", "[cache][manager]") {
  cache::tick now = 0;
  cache::manager<cache::xxh3_128_chain, cache::lru, cache::manual_clock> m({4, 6, true}, {}, cache::manual_clock(now));
  now = 1;
  auto a = admit_and_compute(m, iota_tokens(9, 0));    // 3 blocks, 2 cached
  auto b = admit_and_compute(m, iota_tokens(9, 100));  // 3 blocks, 2 cached
  now = 10;
  m.release(a);
  now = 20;
  m.release(b);
  CHECK(m.evictable_blocks() == 4);
  CHECK(m.free_blocks() == 2);
  // Needs 4 blocks: 2 free, then A's two (released earlier), deeper one first.
  auto c = admit_and_compute(m, iota_tokens(16, 200));
  CHECK(m.stats().evicted_blocks == 2);
  CHECK(m.plan(iota_tokens(9, 0), 9).hit_tokens == 0);    // A is gone
  CHECK(m.plan(iota_tokens(9, 100), 9).hit_tokens == 8);  // B stays
  // Every block is now held by C or cached for B; nothing more can be taken.
  CHECK_FALSE(m.plan(iota_tokens(12, 300), 12).fits);
  m.release(c);
}

TEST_CASE("manager with FIFO and LFU keeps the blocks they favour", "[cache][manager]") {
  SECTION("fifo evicts the oldest cached even if it was just reused") {
    cache::tick now = 0;
    cache::manager<cache::xxh3_64_chain, cache::fifo, cache::manual_clock> m({4, 4, true}, {},
                                                                             cache::manual_clock(now));
    now = 1;
    auto a = admit_and_compute(m, iota_tokens(5, 0));
    m.release(a);
    now = 2;
    auto b = admit_and_compute(m, iota_tokens(5, 100));
    m.release(b);
    now = 3;
    auto again = admit_and_compute(m, iota_tokens(5, 0));  // reuses A's block
    CHECK(again.hit_tokens == 4);
    m.release(again);
    now = 4;
    auto c = admit_and_compute(m, iota_tokens(9, 500));  // 3 blocks: 2 free + 1 evicted
    m.release(c);
    CHECK(m.plan(iota_tokens(5, 0), 5).hit_tokens == 0);    // cached first: evicted
    CHECK(m.plan(iota_tokens(5, 100), 5).hit_tokens == 4);  // an LRU policy would have evicted this one
  }
  SECTION("lfu keeps the block used most") {
    cache::tick now = 0;
    cache::manager<cache::xxh3_64_chain, cache::lfu, cache::manual_clock> m({4, 4, true}, {}, cache::manual_clock(now));
    now = 1;
    for (int i = 0; i < 3; ++i) {
      auto a = admit_and_compute(m, iota_tokens(5, 0));
      m.release(a);
    }
    now = 2;
    auto b = admit_and_compute(m, iota_tokens(5, 100));
    m.release(b);
    now = 3;
    auto c = admit_and_compute(m, iota_tokens(9, 500));  // needs 3 of the 4 blocks
    m.release(c);
    CHECK(m.plan(iota_tokens(5, 0), 5).hit_tokens == 4);    // used 3 times: kept
    CHECK(m.plan(iota_tokens(5, 100), 5).hit_tokens == 0);  // used once: evicted
  }
}

TEST_CASE("manager takes a user-defined eviction policy", "[cache][manager][policy]") {
  cache::tick now = 0;
  cache::manager<cache::xxh3_64_chain, mru, cache::manual_clock> m({4, 4, true}, {}, cache::manual_clock(now));
  now = 1;
  auto a = admit_and_compute(m, iota_tokens(5, 0));
  now = 2;
  m.release(a);
  now = 3;
  auto b = admit_and_compute(m, iota_tokens(5, 100));
  now = 4;
  m.release(b);
  now = 5;
  auto c = admit_and_compute(m, iota_tokens(9, 500));  // 3 blocks: 2 free + 1 evicted
  CHECK(m.stats().evicted_blocks == 1);
  CHECK(m.plan(iota_tokens(5, 0), 5).hit_tokens == 4);    // released first: kept by MRU
  CHECK(m.plan(iota_tokens(5, 100), 5).hit_tokens == 0);  // released last: evicted
  m.release(c);
}

TEST_CASE("tenants with different salts never share a block", "[cache][manager][tenant]") {
  cache::manager<cache::xxh3_128_chain, cache::lru> m({4, 32, true});
  const auto tokens = iota_tokens(20);
  auto a = admit_and_compute(m, tokens, 0, {7, 0, "tenant-a"});
  CHECK(m.plan(tokens, 20, {7, 0, "tenant-a"}).hit_tokens == 16);
  CHECK(m.plan(tokens, 20, {7, 0, "tenant-b"}).hit_tokens == 0);
  CHECK(m.plan(tokens, 20, {8, 0, "tenant-a"}).hit_tokens == 0);  // another model
  auto b = admit_and_compute(m, tokens, 0, {7, 0, "tenant-b"});
  for (const block_id x : a.table)
    for (const block_id y : b.table) CHECK(x != y);
  m.release(a);
  m.release(b);
}

TEST_CASE("a hasher that ignores the parent and the extra keys never gives a wrong hit", "[cache][manager][hash]") {
  cache::manager<parent_ignoring_hash, cache::lru> m({4, 32, true});
  const auto w = iota_tokens(4, 0), z = iota_tokens(4, 10), q = iota_tokens(4, 20), one = iota_tokens(1, 30);
  auto a = admit_and_compute(m, concat({w, z, q, one}), 0, {7, 0, "tenant-a"});
  CHECK(m.cached_blocks() == 3);
  // The same prefix under the same keys: every block.
  CHECK(m.plan(concat({w, z, q, one}), 13, {7, 0, "tenant-a"}).hit_tokens == 12);
  // z's key is in the index (it ignores the parent), but z's KV was computed after w: no hit.
  CHECK(m.plan(concat({z, q, one}), 9, {7, 0, "tenant-a"}).hit_tokens == 0);
  CHECK(m.plan(concat({w, q, one}), 9, {7, 0, "tenant-a"}).hit_tokens == 4);
  // The hasher ignores the extra keys: another tenant, model or adapter still finds nothing.
  CHECK(m.plan(concat({w, z, one}), 9, {7, 0, "tenant-b"}).hit_tokens == 0);
  CHECK(m.plan(concat({w, z, one}), 9, {8, 0, "tenant-a"}).hit_tokens == 0);
  CHECK(m.plan(concat({w, z, one}), 9, {7, 1, "tenant-a"}).hit_tokens == 0);
  // A sequence whose blocks collide with indexed ones of another prefix computes and keeps its own;
  // the index keeps the first, and each prefix finds only its own.
  auto b = admit_and_compute(m, concat({z, w, one}), 0, {7, 0, "tenant-a"});
  CHECK(b.hit_tokens == 0);
  for (const block_id x : a.table)
    for (const block_id y : b.table) CHECK(x != y);
  CHECK(m.plan(concat({z, w, one}), 9, {7, 0, "tenant-a"}).hit_tokens == 0);
  CHECK(m.plan(concat({w, z, one}), 9, {7, 0, "tenant-a"}).hit_tokens == 8);
  m.release(a);
  m.release(b);
  // Once the first prefix's blocks are gone, the second's can be indexed and found.
  cache::manager<parent_ignoring_hash, cache::lru> fresh({4, 32, true});
  auto c = admit_and_compute(fresh, concat({z, w, one}), 0, {7, 0, "tenant-a"});
  CHECK(fresh.plan(concat({z, w, one}), 9, {7, 0, "tenant-a"}).hit_tokens == 8);
  fresh.release(c);
}

TEST_CASE("reuse off: no hits, nothing indexed", "[cache][manager]") {
  cache::manager<cache::xxh3_128_chain, cache::lru> m({4, 16, false});
  auto a = admit_and_compute(m, iota_tokens(12));
  m.release(a);
  CHECK(m.cached_blocks() == 0);
  CHECK(m.plan(iota_tokens(12), 12).hit_tokens == 0);
  CHECK(m.free_blocks() == 16);
}

TEMPLATE_TEST_CASE("random workload: referenced blocks are never reused, a hit's KV is always its prefix's",
                   "[cache][manager]", cache::xxh3_64_chain, cache::xxh3_128_chain, parent_ignoring_hash,
                   constant_hash) {
  // Shadow KV: what each block's KV was computed from (the extra keys and every token up to the
  // block's end). Computing a block writes it; a hit must read back exactly the prompt's.
  using manager = cache::manager<TestType, cache::lru>;
  constexpr std::size_t bs = 4, blocks = 40;
  manager m({bs, blocks, true});
  struct kv_source {
    std::string salt;
    std::vector<token_id> prefix;
    bool operator==(const kv_source&) const = default;
  };
  std::vector<kv_source> shadow(blocks);
  struct live {
    std::vector<token_id> tokens;
    typename manager::sequence seq;
  };
  std::vector<live> running;
  rng r(2024);
  for (int op = 0; op < 3000; ++op) {
    if (!running.empty() && (r.below(3) == 0 || running.size() > 5)) {
      const std::size_t i = r.below(running.size());
      m.release(running[i].seq);
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    // Prompts share prefixes drawn from a few stems and blocks of a few values, under two salts, so
    // hits, evictions, and blocks equal to another prefix's all happen.
    std::vector<token_id> tokens;
    const token_id stem = static_cast<token_id>(r.below(4));
    const std::size_t len = 1 + r.below(30);
    for (std::size_t i = 0; i < len; ++i)
      tokens.push_back(i < len / 2 ? stem * 100 + static_cast<token_id>(i % 8) : static_cast<token_id>(r.below(3)));
    const std::string salt = r.below(4) == 0 ? "tenant-b" : "";
    const auto source = [&](std::size_t end) {
      return kv_source{salt, std::vector<token_id>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(end))};
    };
    const auto plan = m.plan(tokens, tokens.size(), {0, 0, salt});
    if (!plan.fits) continue;
    auto seq = m.admit(plan);
    for (std::size_t b = 0; b < plan.hits.size(); ++b) REQUIRE(shadow[seq.table[b]] == source((b + 1) * bs));
    // No block of this sequence that it must compute is held by a running sequence.
    for (std::size_t b = plan.hits.size(); b < seq.table.size(); ++b)
      for (const auto& other : running)
        REQUIRE(std::find(other.seq.table.begin(), other.seq.table.end(), seq.table[b]) == other.seq.table.end());
    for (std::size_t b = plan.hits.size(); b < seq.table.size(); ++b)
      shadow[seq.table[b]] = source(std::min(tokens.size(), (b + 1) * bs));
    m.commit(seq, tokens, tokens.size());
    running.push_back({tokens, std::move(seq)});
  }
  if constexpr (!std::is_same_v<TestType, constant_hash>) CHECK(m.stats().hit_tokens > 0);
  CHECK(m.stats().evicted_blocks > 0);
  for (auto& l : running) m.release(l.seq);
  CHECK(m.free_blocks() + m.evictable_blocks() == blocks);
}

// ---- the shared KV tier's keys and values (cache/remote.hpp) ----

#include "efim/cache/remote.hpp"
#include "efim/kv/host_storage.hpp"

namespace {

struct remote_block_case {
  efim::cache::block_shape shape{.layers = 2, .kv_heads = 1, .head_dim = 4, .block_size = 4, .type = efim::dtype::f32};
  efim::cache::extra_keys keys{.model = 0x1234, .adapter = 0, .salt = "tenant-a"};
  std::vector<efim::token_id> tokens{11, 22, 33, 44};
  efim::cache::hash128 root = efim::cache::remote_root(keys, shape);
  efim::cache::hash128 parent = efim::cache::remote_chain(root, std::vector<efim::token_id>{1, 2, 3, 4});
  std::vector<std::byte> kv = [&] {
    std::vector<std::byte> b(shape.bytes());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(i * 7 + 3);
    return b;
  }();

  [[nodiscard]] efim::cache::block_identity identity() const { return {root, parent, shape, tokens}; }
};

}  // namespace

TEST_CASE("remote tier: a block's value reads back as it was written", "[cache][remote]") {
  const remote_block_case c;
  const std::string value = efim::cache::write_block(c.identity(), c.kv);
  const auto r = efim::cache::read_block(value, c.identity());
  REQUIRE(r.why == efim::cache::refusal::none);
  CHECK(std::ranges::equal(r.kv, c.kv));
  // The no-op tier finds nothing and takes anything.
  efim::cache::no_remote_tier none;
  const std::vector<std::string> keys{"a", "b"};
  CHECK(none.fetch(keys) == std::vector<std::optional<std::string>>(2));
  none.store("a", value);
}

TEST_CASE("remote tier: keys differ for every model, adapter, tenant and KV shape", "[cache][remote]") {
  using efim::cache::remote_root;
  const remote_block_case c;
  std::set<std::string> roots;
  const auto add = [&](const efim::cache::extra_keys& k, const efim::cache::block_shape& s) {
    const std::string key = efim::cache::remote_key("p:", remote_root(k, s));
    CHECK(key.size() == 2 + 32);
    CHECK(key.find_first_not_of("0123456789abcdef", 2) == std::string::npos);
    roots.insert(key);
  };
  add(c.keys, c.shape);
  auto k = c.keys;
  k.model = 0x1235;
  add(k, c.shape);
  k = c.keys;
  k.adapter = 1;
  add(k, c.shape);
  k = c.keys;
  k.salt = "tenant-b";
  add(k, c.shape);
  k = c.keys;
  k.salt.clear();
  add(k, c.shape);
  for (int field = 0; field < 5; ++field) {
    auto s = c.shape;
    if (field == 0) s.layers = 3;
    if (field == 1) s.kv_heads = 2;
    if (field == 2) s.head_dim = 8;
    if (field == 3) s.block_size = 8;
    if (field == 4) s.type = efim::dtype::f16;
    add(c.keys, s);
  }
  CHECK(roots.size() == 10);
  // A chain key depends on the parent and on every token.
  const auto a = efim::cache::remote_chain(c.root, c.tokens);
  CHECK(a != efim::cache::remote_chain(c.parent, c.tokens));
  CHECK(a != efim::cache::remote_chain(c.root, std::vector<efim::token_id>{11, 22, 33, 45}));
  CHECK(a == efim::cache::remote_chain(c.root, std::vector<efim::token_id>{11, 22, 33, 44}));
}

TEST_CASE("remote tier: a value of another model, tenant, prefix, shape or tokens is refused", "[cache][remote]") {
  using efim::cache::refusal;
  const remote_block_case c;
  const std::string value = efim::cache::write_block(c.identity(), c.kv);
  auto want = c.identity();
  SECTION("other model or tenant") {
    auto k = c.keys;
    k.salt = "tenant-b";
    want.root = efim::cache::remote_root(k, c.shape);
    CHECK(efim::cache::read_block(value, want).why == refusal::other_root);
  }
  SECTION("other prefix") {
    want.parent = c.root;
    CHECK(efim::cache::read_block(value, want).why == refusal::other_parent);
  }
  SECTION("other shape") {
    want.shape.type = efim::dtype::f16;
    CHECK(efim::cache::read_block(value, want).why == refusal::other_shape);
    want.shape = c.shape;
    want.shape.head_dim = 2;
    CHECK(efim::cache::read_block(value, want).why == refusal::other_shape);
  }
  SECTION("other tokens") {
    const std::vector<efim::token_id> other{11, 22, 34, 44};
    want.tokens = other;
    CHECK(efim::cache::read_block(value, want).why == refusal::other_tokens);
  }
  SECTION("cut short anywhere, or longer") {
    for (std::size_t n = 0; n < value.size(); ++n) {
      INFO("first " << n << " bytes");
      CHECK(efim::cache::read_block(std::string_view(value).substr(0, n), want).why != refusal::none);
    }
    CHECK(efim::cache::read_block(value + "x", want).why == refusal::malformed);
  }
  SECTION("any byte changed") {
    for (std::size_t i = 0; i < value.size(); ++i)
      for (const unsigned char bit : {0x01, 0x80}) {
        std::string bad = value;
        bad[i] = static_cast<char>(bad[i] ^ bit);
        INFO("byte " << i << " ^ " << int(bit));
        CHECK(efim::cache::read_block(bad, want).why != refusal::none);
      }
  }
  SECTION("random bytes") {
    efim::rng rng(5);
    for (int i = 0; i < 2000; ++i) {
      std::string junk(rng.below(600), '\0');
      for (auto& ch : junk) ch = static_cast<char>(rng.next());
      if (i % 2 == 0 && junk.size() >= 8) junk.replace(0, 8, "EFIMKV01");
      CHECK(efim::cache::read_block(junk, want).why != refusal::none);
    }
  }
}

TEST_CASE("remote tier: a block's KV leaves one storage and enters another block of another", "[cache][remote]") {
  const efim::kv::paged_layout layout{.blocks = 5, .kv_heads = 2, .block_size = 4, .head_dim = 3};
  for (const auto type : {efim::dtype::f32, efim::dtype::f16}) {
    efim::kv::host_storage a(3, layout, type), b(3, layout, type);
    const efim::cache::block_shape shape{3, 2, 3, 4, type};
    REQUIRE(a.block_bytes() == shape.bytes());
    // Distinct values in every K and V array of `a`.
    for (std::size_t layer = 0; layer < 3; ++layer)
      for (std::size_t i = 0; i < layout.elements(); ++i) {
        const float k = static_cast<float>(layer * 1000 + i), v = -k - 0.5f;
        if (type == efim::dtype::f32) {
          a.keys<float>(layer)[i] = k;
          a.values<float>(layer)[i] = v;
        } else {
          a.keys<efim::half>(layer)[i] = efim::half{static_cast<std::uint16_t>(layer * 1000 + i)};
          a.values<efim::half>(layer)[i] = efim::half{static_cast<std::uint16_t>(40000 + layer * 1000 + i)};
        }
      }
    std::vector<std::byte> bytes(a.block_bytes());
    a.export_block(3, bytes);
    b.import_block(1, bytes);
    const std::size_t stride = layout.block_stride() * efim::info(type).bytes;
    for (std::size_t layer = 0; layer < 3; ++layer)
      for (const bool key : {true, false}) {
        const auto bytes_of = [&](const efim::kv::host_storage& s) -> const std::byte* {
          if (type == efim::dtype::f32)
            return reinterpret_cast<const std::byte*>(key ? s.keys<float>(layer) : s.values<float>(layer));
          return reinterpret_cast<const std::byte*>(key ? s.keys<efim::half>(layer) : s.values<efim::half>(layer));
        };
        const std::byte* from = bytes_of(a);
        const std::byte* to = bytes_of(b);
        CHECK(std::memcmp(from + 3 * stride, to + 1 * stride, stride) == 0);
        const std::vector<std::byte> zero(stride);
        CHECK(std::memcmp(to, zero.data(), stride) == 0);  // block 0 untouched
      }
    std::vector<std::byte> short_bytes(bytes.size() - 1);
    CHECK_THROWS_AS(a.export_block(3, short_bytes), efim::error);
    CHECK_THROWS_AS(b.import_block(5, bytes), efim::error);
  }
}
