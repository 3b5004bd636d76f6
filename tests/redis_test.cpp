// The shared KV tier in Redis (cache::redis_tier) against a real redis-server on loopback, started
// and stopped by the test: a chain of blocks read in one round trip, written once behind the caller,
// and a store that dies, stalls or comes back costing at most the budget and never an error.
#include <hiredis/hiredis.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "efim/cache/redis_tier.hpp"
#include "server_process.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

const std::string build_dir = EFIM_TEST_BINARY_DIR;
const std::string redis_server_path = "/usr/bin/redis-server";

void require_redis() {
  if (!fs::exists(redis_server_path)) {
    std::cout << "test_redis: skipped: no " << redis_server_path << " (.ci/setup installs redis-server)" << std::endl;
    std::exit(0);
  }
}

// redis-server on a port of its own, in memory only, evicting least recently used keys when full.
class redis_server {
 public:
  explicit redis_server(std::string port = efim_test::free_port()) : port_(std::move(port)) {
    proc_ = std::make_unique<efim_test::process>(
        std::vector<std::string>{redis_server_path, "--port", port_, "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"},
        build_dir + "/redis-" + port_ + ".log");
    for (int i = 0; i < 500; ++i) {
      REQUIRE(proc_->running());
      if (command("PING") == "PONG") return;
      std::this_thread::sleep_for(10ms);
    }
    FAIL("redis-server did not start: " << proc_->log());
  }

  // A command's answer as text (status, string, integer; "" on error or nil).
  std::string command(const std::string& cmd) const {
    const timeval tv{1, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", std::stoi(port_), tv);
    std::string out;
    if (c != nullptr && c->err == 0) {
      if (auto* r = static_cast<redisReply*>(redisCommand(c, cmd.c_str()))) {
        if (r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_STRING) out.assign(r->str, r->len);
        if (r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
        freeReplyObject(r);
      }
    }
    if (c != nullptr) redisFree(c);
    return out;
  }

  // How many times the store ran `cmd` (INFO commandstats).
  int calls(const std::string& cmd) const {
    const std::string info = command("INFO commandstats");
    const std::string key = "cmdstat_" + cmd + ":calls=";
    const auto at = info.find(key);
    return at == std::string::npos ? 0 : std::stoi(info.substr(at + key.size()));
  }

  [[nodiscard]] const std::string& port() const { return port_; }
  efim_test::process& proc() { return *proc_; }

 private:
  std::string port_;
  std::unique_ptr<efim_test::process> proc_;
};

efim::cache::redis_options options_for(const redis_server& r, std::chrono::milliseconds budget = 200ms) {
  auto o = efim::cache::parse_redis_url("redis://127.0.0.1:" + r.port());
  o.budget = budget;
  o.retry = 300ms;
  return o;
}

std::vector<std::string> keys_of(int n, const std::string& prefix = "efim:test:") {
  std::vector<std::string> k;
  for (int i = 0; i < n; ++i) k.push_back(prefix + std::to_string(i));
  return k;
}

std::string value_of(int i, std::size_t bytes = 4096) {
  std::string v(bytes, '\0');
  for (std::size_t j = 0; j < bytes; ++j) v[j] = static_cast<char>(i * 31 + j * 7);
  return v;
}

}  // namespace

TEST_CASE("redis:// addresses", "[redis]") {
  using efim::cache::parse_redis_url;
  auto o = parse_redis_url("redis://cache.internal:6380/3");
  CHECK(o.host == "cache.internal");
  CHECK(o.port == 6380);
  CHECK(o.db == 3);
  o = parse_redis_url("redis://10.0.0.7");
  CHECK(o.host == "10.0.0.7");
  CHECK(o.port == 6379);
  CHECK(o.db == 0);
  for (const char* bad : {"http://h:1", "redis://", "redis://h:", "redis://h:0", "redis://h:70000", "redis://h:x",
                          "redis://h/x", "redis://:80"})
    CHECK_THROWS_AS(parse_redis_url(bad), efim::error);
}

TEST_CASE("redis tier: blocks written behind the caller, once, and a chain read in one round trip", "[redis]") {
  require_redis();
  redis_server r;
  efim::cache::redis_tier tier(options_for(r));
  const auto keys = keys_of(24);
  for (int i = 0; i < 12; ++i) tier.store(keys[i], value_of(i));
  for (int i = 0; i < 12; ++i) tier.store(keys[i], value_of(i));  // already written: not again
  tier.flush();
  CHECK(r.calls("set") == 12);
  const int mget_before = r.calls("mget");
  const auto got = tier.fetch(keys);
  CHECK(r.calls("mget") == mget_before + 1);
  REQUIRE(got.size() == keys.size());
  for (int i = 0; i < 24; ++i) {
    INFO("key " << i);
    if (i < 12) {
      REQUIRE(got[i].has_value());
      CHECK(*got[i] == value_of(i));
    } else {
      CHECK_FALSE(got[i].has_value());
    }
  }
  const auto s = tier.stats();
  CHECK(s.fetches == 1);
  CHECK(s.keys == 24);
  CHECK(s.found == 12);
  CHECK(s.read_bytes == 12 * 4096);
  CHECK(s.written == 12);
  CHECK(s.errors == 0);
  CHECK(s.dropped == 0);
}

TEST_CASE("redis tier: a full write queue drops values, never blocks", "[redis]") {
  require_redis();
  redis_server r;
  auto o = options_for(r);
  o.queue_bytes = 64 << 10;  // 16 values of 4 KiB
  efim::cache::redis_tier tier(o);
  kill(r.proc().pid(), SIGSTOP);  // the writer blocks on the store; the queue fills
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) tier.store("efim:q:" + std::to_string(i), value_of(i));
  CHECK(std::chrono::steady_clock::now() - start < 1s);
  CHECK(tier.stats().dropped >= 150);
  kill(r.proc().pid(), SIGCONT);
  tier.flush();
  const auto s = tier.stats();
  CHECK(s.written + s.dropped == 200);
}

TEST_CASE("redis tier: a store that dies, stalls or comes back costs at most the budget", "[redis]") {
  require_redis();
  auto r = std::make_unique<redis_server>();
  const std::string port = r->port();
  efim::cache::redis_tier tier(options_for(*r, 100ms));
  const auto keys = keys_of(8, "efim:f:");
  for (int i = 0; i < 8; ++i) tier.store(keys[i], value_of(i));
  tier.flush();
  REQUIRE(tier.fetch(keys)[7].has_value());
  const auto timed = [&] {
    const auto start = std::chrono::steady_clock::now();
    const auto got = tier.fetch(keys);
    for (const auto& v : got) CHECK_FALSE(v.has_value());
    return std::chrono::steady_clock::now() - start;
  };

  SECTION("stalled: each fetch ends within the budget, then the store is left alone") {
    kill(r->proc().pid(), SIGSTOP);
    CHECK(timed() < 400ms);  // 100 ms budget, with room for a loaded machine
    CHECK(tier.stats().timeouts == 1);
    CHECK(timed() < 20ms);  // left alone: answered at once
    CHECK(tier.stats().skipped >= 1);
    kill(r->proc().pid(), SIGCONT);
    std::this_thread::sleep_for(400ms);  // past `retry`
    const auto got = tier.fetch(keys);
    CHECK(got[3] == value_of(3));
  }

  SECTION("killed: misses and counted errors; back on its port: reads and writes resume") {
    r->proc().stop(SIGKILL);
    CHECK(timed() < 400ms);
    CHECK(tier.stats().errors >= 1);
    tier.store("efim:f:lost", value_of(99));  // dropped or failed: never thrown
    tier.flush();
    r.reset();
    r = std::make_unique<redis_server>(port);  // empty
    std::this_thread::sleep_for(400ms);        // past `retry`
    const auto got = tier.fetch(keys);
    CHECK_FALSE(got[0].has_value());  // it lost what it held
    const auto errors = tier.stats().errors;
    // Written again, though written before: the tier forgets what it wrote when the store fails.
    for (int i = 0; i < 8; ++i) tier.store(keys[i], value_of(i));
    tier.flush();
    const auto again = tier.fetch(keys);
    for (int i = 0; i < 8; ++i) CHECK(again[i] == value_of(i));
    CHECK(tier.stats().errors == errors);
  }

  SECTION("answers that are not values: an error reply and a key of another type") {
    REQUIRE(r->command("DEL efim:f:0") == "1");
    REQUIRE(r->command("RPUSH efim:f:0 x") == "1");  // MGET answers nil for a list
    auto got = tier.fetch(keys);
    CHECK_FALSE(got[0].has_value());
    CHECK(got[1] == value_of(1));
    REQUIRE(r->command("CONFIG SET maxmemory 1") == "OK");
    tier.store("efim:f:new", value_of(8));  // OOM: the store refuses the write
    tier.flush();
    CHECK(tier.stats().dropped >= 1);
    REQUIRE(r->command("CONFIG SET maxmemory 64mb") == "OK");
  }
}
