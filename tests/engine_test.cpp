#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "decode_tiles_guard.hpp"
#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/core/random.hpp"
#include "efim/core/utf8.hpp"
#include "efim/engine/async_runner.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kv/host_storage.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/text/bpe_tokenizer.hpp"
#include "efim/text/fragment.hpp"
#include "efim/text/healing.hpp"
#include "small_model.hpp"
#include "vocab.hpp"

using namespace efim;

namespace {
using efim_test::efim_pipeline;
using efim_test::qwen_tokenizer;
using efim_test::small_config;
using efim_test::small_weights;
using psm_pipeline = engine::pipeline<prompt::psm, cache::xxh3_64_chain, cache::fifo, text::whole, kernels::host>;

engine::pipeline_options options(std::size_t blocks = 256, bool reuse = true) {
  return efim_test::small_options(blocks, reuse);
}

engine::request make_request(std::string prefix, std::string suffix, std::size_t max_tokens = 8,
                             std::string session = "") {
  engine::request r;
  r.prefix = std::move(prefix);
  r.suffix = std::move(suffix);
  r.max_tokens = max_tokens;
  r.session = std::move(session);
  return r;
}

// Submits and runs to completion.
template <class P>
engine::completion complete(P& p, const engine::request& r) {
  engine::completion out;
  bool done = false;
  p.submit(r, {{}, [&](engine::completion&& c) {
                 out = std::move(c);
                 done = true;
               }});
  p.run();
  REQUIRE(done);
  return out;
}

// A future's value, failing the test (not hanging it) if it takes more than a minute.
template <class T>
T within(std::future<T> f) {
  REQUIRE(f.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  return f.get();
}

// What kernels::backend asks of a backend: a name, a context made from a thread pool or from nothing,
// and a KV storage made from the layer count, a layout and the element type.
struct backend_without_storage {
  struct context {};
  [[maybe_unused]] static constexpr std::string_view name = "no storage";  // (clang: unused where the concept fails)
};
struct backend_with_odd_context {
  struct context {
    explicit context(std::string) {}
  };
  using storage = kv::host_storage;
  static constexpr std::string_view name = "odd context";
};
static_assert(kernels::backend<kernels::host> && kernels::context_takes_pool<kernels::host>);
static_assert(!kernels::backend<backend_without_storage> && !kernels::backend<backend_with_odd_context>);

// A real pipeline whose step() fails once on demand, after its work: a fault of the whole batch.
struct faulty_pipeline : efim_pipeline {
  using efim_pipeline::efim_pipeline;
  std::atomic<bool> fail_after_step{false};
  bool step() {
    const bool busy = efim_pipeline::step();
    if (fail_after_step.exchange(false)) throw std::runtime_error("injected step failure");
    return busy;
  }
};

const std::string code_prefix =
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n";
const std::string code_suffix = "\n\nif __name__ == \"__main__\":\n    print(fibonacci(10))\n";
}  // namespace

TEST_CASE("one infill request end to end", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  std::vector<token_id> streamed;
  std::string streamed_text;
  engine::completion out;
  p.submit(make_request(code_prefix, code_suffix, 12), {[&](const engine::token_event& e) {
                                                          streamed.push_back(e.token);
                                                          streamed_text += e.text;
                                                        },
                                                        [&](engine::completion&& c) { out = std::move(c); }});
  p.run();
  CHECK(out.tokens.size() == 12);
  CHECK(out.reason == engine::finish_reason::length);
  CHECK(streamed == out.tokens);
  CHECK(streamed_text + out.tail == out.text);
  CHECK(utf8::is_valid(out.text));
  CHECK(out.prompt_tokens == code_prefix.size() + code_suffix.size() + 3);
  CHECK(out.cached_tokens == 0);
  CHECK(out.latency_ms() >= out.ttft_ms());
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());

  // The same request on a fresh pipeline gives the same tokens.
  efim_pipeline again(qwen_tokenizer(), w, options());
  CHECK(complete(again, make_request(code_prefix, code_suffix, 12)).tokens == out.tokens);
}

TEST_CASE("EFIM session: typed text reuses the cached prompt and changes no result", "[engine][efim]") {
  const auto w = small_weights();
  efim_pipeline warm(qwen_tokenizer(), w, options());
  efim_pipeline cold(qwen_tokenizer(), w, options(256, false));  // the same requests, computed in full
  auto first = make_request(code_prefix, code_suffix, 4, "editor-1");
  const auto a = complete(warm, first);
  CHECK(a.session_change == prompt::change::first);
  CHECK(complete(cold, first).tokens == a.tokens);
  std::string prefix = code_prefix;
  for (const std::string typed : {"    ret", "urn fib", "onacci(n - 1)"}) {
    prefix += typed;
    const auto r = make_request(prefix, code_suffix, 4, "editor-1");
    const auto c = complete(warm, r);
    CHECK(c.session_change == prompt::change::append);
    // Everything before the new text is cached, up to the last full block.
    CHECK(c.cached_tokens == (c.prompt_tokens - typed.size()) / 16 * 16);
    const auto recomputed = complete(cold, r);
    CHECK(recomputed.cached_tokens == 0);
    CHECK(recomputed.prompt_tokens == c.prompt_tokens);
    CHECK(recomputed.tokens == c.tokens);
  }
  CHECK(warm.cache().stats().hit_rate() > 0.5);
}

TEST_CASE("PSM with the prefix cache reuses only the text before the suffix", "[engine][psm]") {
  const auto w = small_weights();
  psm_pipeline p(qwen_tokenizer(), w, options());
  complete(p, make_request(code_prefix, code_suffix, 4, "s"));
  const auto c = complete(p, make_request(code_prefix + "    return fib", code_suffix, 4, "s"));
  // <PRE> + prefix is cached in whole blocks; the suffix after the typed text is not.
  CHECK(c.cached_tokens == (1 + code_prefix.size()) / 16 * 16);
}

TEST_CASE("continuous batching: requests in flight together give what they give alone", "[engine][batching]") {
  const auto w = small_weights();
  const std::vector<engine::request> requests{
      make_request("int add(int a, int b) {\n  return ", ";\n}\n", 10),
      make_request(code_prefix, code_suffix, 6),
      make_request("", "", 5),
      make_request("fn main() {\n    let x = ", ";\n}\n", 9),
  };
  std::vector<std::vector<token_id>> alone;
  for (const auto& r : requests) {
    efim_pipeline p(qwen_tokenizer(), w, options());
    alone.push_back(complete(p, r).tokens);
  }
  efim_pipeline p(qwen_tokenizer(), w, options());
  std::map<engine::request_id, std::vector<token_id>> together;
  std::map<engine::request_id, std::size_t> index;
  std::size_t step = 0, steps_with_two_decoding = 0;
  std::map<std::size_t, std::size_t> tokens_per_step;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto id = p.submit(requests[i], {[&](const engine::token_event&) { ++tokens_per_step[step]; },
                                           [&](engine::completion&& c) { together[c.id] = c.tokens; }});
    index[id] = i;
  }
  while (p.step()) ++step;
  for (const auto& [id, tokens] : together) CHECK(tokens == alone[index[id]]);
  CHECK(together.size() == requests.size());
  for (const auto& [s, n] : tokens_per_step) steps_with_two_decoding += n >= 2;
  CHECK(steps_with_two_decoding > 0);  // sequences really were decoded in the same batch
}

TEST_CASE("seeded sampling is reproducible", "[engine][sampling]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  auto r = make_request(code_prefix, code_suffix, 16);
  r.sampling = {0.9f, 40, 0.95f, 1234};
  const auto a = complete(p, r);
  const auto b = complete(p, r);  // the second one hits the cache
  CHECK(b.cached_tokens > 0);
  CHECK(a.tokens == b.tokens);
  r.sampling.seed = 99;
  CHECK(complete(p, r).tokens != a.tokens);
}

TEST_CASE("generation stops at end-of-sequence unless told to ignore it", "[engine][eos]") {
  // Make <|endoftext|> the most likely token everywhere: a strong, always-positive feature 0 that
  // only the EOS output row reads.
  const auto tok = qwen_tokenizer();
  const auto eos = static_cast<std::size_t>(*tok.special_id(prompt::qwen25_coder.eos));
  const auto cfg = small_config();
  const std::size_t h = cfg.hidden;
  const auto w = efim_test::edited_weights([&](std::string_view name, float* v) {
    if (name == "token_embd.weight")
      for (std::size_t i = 0; i < cfg.vocab; ++i) v[i * h] = 100.0f;
    if (name == "output.weight") {
      std::fill_n(v, cfg.vocab * h, 0.0f);
      v[eos * h] = 1.0f;
    }
  });
  efim_pipeline p(tok, w, options());
  const auto stopped = complete(p, make_request("x = ", "\n", 8));
  CHECK(stopped.reason == engine::finish_reason::eos);
  CHECK(stopped.tokens.empty());
  CHECK(stopped.text.empty());
  auto r = make_request("x = ", "\n", 8);
  r.ignore_eos = true;
  const auto forced = complete(p, r);
  CHECK(forced.reason == engine::finish_reason::length);
  CHECK(forced.tokens == std::vector<token_id>(8, static_cast<token_id>(eos)));
  CHECK(forced.text.empty());  // special tokens are not rendered
}

TEST_CASE("max_tokens 0 computes the prompt only, and warms the cache", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  const auto warm = complete(p, make_request(code_prefix, code_suffix, 0));
  CHECK(warm.tokens.empty());
  CHECK(p.cache().cached_blocks() == warm.prompt_tokens / 16);
  CHECK(complete(p, make_request(code_prefix, code_suffix, 3)).cached_tokens == (warm.prompt_tokens - 1) / 16 * 16);
}

TEST_CASE("cancel releases a request's blocks", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  engine::completion out;
  const auto id =
      p.submit(make_request(code_prefix, code_suffix, 50), {{}, [&](engine::completion&& c) { out = std::move(c); }});
  const auto waiting = p.submit(make_request("a", "b", 5), {{}, [&](engine::completion&&) {}});
  p.step();
  CHECK(p.cancel(id));
  CHECK(p.cancel(waiting));
  CHECK_FALSE(p.cancel(id));
  CHECK_FALSE(p.cancel(12345));
  CHECK(out.reason == engine::finish_reason::cancelled);
  CHECK_FALSE(p.step());
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("bad input gets a clear error and changes nothing", "[engine][errors]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options(32));  // 512 tokens of KV; the model's context is 1024
  complete(p, make_request("ok ", "", 2, "s"));
  const auto expect_error = [&](const engine::request& r, errc code) {
    try {
      p.submit(r, {});
      FAIL("expected an error");
    } catch (const efim::error& e) {
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).size() > 10);
    }
  };
  expect_error(make_request("bad \xFF", "", 2, "s"), errc::invalid_utf8);
  expect_error(make_request("x", "\xC3", 2), errc::invalid_utf8);
  expect_error(make_request(std::string(2000, 'x'), "", 2), errc::too_long);  // over the 1024-token context
  expect_error(make_request("x", "", 1100), errc::too_long);
  expect_error(make_request(std::string(400, 'x'), "", 200, "s"), errc::out_of_blocks);  // 603 tokens > 512
  auto r = make_request("x", "");
  r.sampling.top_p = 0.0f;
  expect_error(r, errc::invalid_argument);
  r.sampling = {-1.0f, 0, 1.0f, 0};
  expect_error(r, errc::invalid_argument);
  CHECK_FALSE(p.step());  // nothing was queued
  // The session did not move: typing on from "ok " is still an append.
  CHECK(complete(p, make_request("ok go", "", 2, "s")).session_change == prompt::change::append);

  // Construction errors.
  auto zero_blocks = options();
  zero_blocks.cache.block_size = 0;
  CHECK_THROWS_AS(efim_pipeline(qwen_tokenizer(), w, zero_blocks), efim::error);
  CHECK_THROWS_AS(efim_pipeline(text::byte_tokenizer(prompt::starcoder.special_tokens()), w, options()), efim::error);
  CHECK_THROWS_AS(efim_pipeline(text::byte_tokenizer(
                                    {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "a", "b", "c", "d", "e"}),
                                w, options()),
                  efim::error);  // 264 tokens, the model has 263
}

TEST_CASE("a suffix change mid-session starts a new anchor", "[engine][efim]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  complete(p, make_request(code_prefix, code_suffix, 2, "s"));
  complete(p, make_request(code_prefix + "    x", code_suffix, 2, "s"));
  const auto c = complete(p, make_request(code_prefix + "    x", code_suffix + "# more\n", 2, "s"));
  CHECK(c.session_change == prompt::change::suffix_changed);
  CHECK(c.tokens.size() == 2);
  CHECK(c.cached_tokens == (1 + code_prefix.size()) / 16 * 16);  // <PRE> + the unchanged prefix
  p.end_session("s");
  CHECK(p.sessions() == 0);
}

TEST_CASE("tenants never share cached KV through the pipeline", "[engine][tenant]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  auto r = make_request(code_prefix, code_suffix, 2);
  r.tenant = "a";
  complete(p, r);
  CHECK(complete(p, r).cached_tokens > 0);
  r.tenant = "b";
  CHECK(complete(p, r).cached_tokens == 0);
}

TEST_CASE("async runner serves concurrent clients on real threads", "[engine][async]") {
  const auto w = small_weights();
  std::vector<std::vector<token_id>> want;
  for (int u = 0; u < 4; ++u) {
    efim_pipeline p(qwen_tokenizer(), w, options());
    want.push_back(complete(p, make_request("user " + std::to_string(u) + ": ", code_suffix, 6)).tokens);
  }
  efim_pipeline p(qwen_tokenizer(), w, options());
  std::vector<std::vector<token_id>> got(4);
  {
    engine::async_runner<efim_pipeline> runner(p);
    std::vector<std::thread> clients;
    for (int u = 0; u < 4; ++u)
      clients.emplace_back([&, u] {
        for (int round = 0; round < 3; ++round)
          got[static_cast<std::size_t>(u)] =
              runner.submit(make_request("user " + std::to_string(u) + ": ", code_suffix, 6)).get().tokens;
      });
    for (auto& c : clients) c.join();
    // Errors reach the client through its future.
    auto bad = runner.submit(make_request("\xFF", ""));
    CHECK_THROWS_AS(bad.get(), efim::error);
  }
  CHECK(got == want);
}

TEST_CASE("requests prepared on many threads at once equal requests prepared one by one", "[engine][async]") {
  // Eight editors type into sessions of their own (keyed, and found by content), each keystroke
  // prepared on its editor's thread while the engine thread runs steps: every request's change, prompt,
  // cached tokens and output equal those of the same keystrokes submitted in turn on one thread.
  const auto w = small_weights();
  constexpr int editors = 8, keystrokes = 6;
  const auto keystroke = [&](int e, int k) {
    auto r = make_request("# editor " + std::to_string(e) + "\n" + code_prefix + std::string(static_cast<std::size_t>(k), 'x'),
                          code_suffix, 3, e % 2 == 0 ? "ed" + std::to_string(e) : "");
    r.match_session = r.session.empty();
    return r;
  };
  std::vector<std::vector<engine::completion>> want(editors), got(editors);
  for (int e = 0; e < editors; ++e) {
    efim_pipeline serial(qwen_tokenizer(), w, options());
    for (int k = 0; k < keystrokes; ++k) want[e].push_back(complete(serial, keystroke(e, k)));
  }
  efim_pipeline p(qwen_tokenizer(), w, options());
  {
    engine::async_runner<efim_pipeline> runner(p);
    std::vector<std::thread> threads;
    std::atomic<int> late{0};  // (Catch's assertions are for the test's own thread)
    for (int e = 0; e < editors; ++e)
      threads.emplace_back([&, e] {
        for (int k = 0; k < keystrokes; ++k) {
          auto f = runner.submit(keystroke(e, k));
          if (f.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
            ++late;
            return;
          }
          got[e].push_back(f.get());
        }
      });
    for (auto& t : threads) t.join();
    REQUIRE(late == 0);
    CHECK(runner.stats().requests == editors * keystrokes);
    CHECK(runner.stats().prepare_ms == 0.0);  // none on the engine thread
  }
  for (int e = 0; e < editors; ++e)
    for (int k = 0; k < keystrokes; ++k) {
      INFO("editor " << e << ", keystroke " << k);
      CHECK(got[e][k].session_change == want[e][k].session_change);
      CHECK(got[e][k].prompt_tokens == want[e][k].prompt_tokens);
      CHECK(got[e][k].tokens == want[e][k].tokens);
    }
  CHECK(p.sessions() == editors);
}

TEST_CASE("enqueue() takes a request its own pipeline prepared, once", "[engine][errors]") {
  const auto w = small_weights();
  efim_pipeline a(qwen_tokenizer(), w, options()), b(qwen_tokenizer(), w, options());
  auto prepared = a.prepare(make_request("x = ", "\n", 2));
  CHECK_THROWS_WITH(b.enqueue(std::move(prepared), {}), Catch::Contains("prepared"));
  auto mine = a.prepare(make_request("x = ", "\n", 2));
  a.enqueue(std::move(mine), {});
  CHECK_THROWS_WITH(a.enqueue(std::move(mine), {}), Catch::Contains("once"));  // NOLINT(bugprone-use-after-move)
  a.run();
  CHECK_FALSE(b.step());
}

TEST_CASE("async runner: stopping cancels what runs and fails what waits", "[engine][async]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  std::future<engine::completion> running, queued;
  std::atomic<std::size_t> tokens_seen{0};
  {
    engine::async_runner<efim_pipeline> runner(p);
    // On its first token (on the runner's thread), the long request queues another one and asks the
    // runner to stop: the loop ends after this step, with one request admitted and one not.
    running = runner.submit(make_request(code_prefix, code_suffix, 500), [&](const engine::token_event&) {
      if (tokens_seen++ > 0) return;
      queued = runner.submit(make_request("x = ", "\n", 4));
      runner.stop();  // from the runner's thread: asks only
    });
    REQUIRE(running.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    CHECK_FALSE(runner.running());
  }
  const auto c = running.get();
  CHECK(c.reason == engine::finish_reason::cancelled);
  CHECK(c.tokens.size() == 1);
  REQUIRE(queued.valid());
  CHECK_THROWS_WITH(queued.get(), Catch::Contains("stopped"));
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("async runner: stop() from several threads at once joins once", "[engine][async]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  for (int round = 0; round < 20; ++round) {
    engine::async_runner<efim_pipeline> runner(p);
    // The request waits at its first token until a stop has begun, so it cannot finish its 200 tokens
    // first (it did once when the test thread lost the CPU on a loaded machine).
    auto pending = runner.submit(make_request(code_prefix, code_suffix, 200), [&](const engine::token_event&) {
      while (runner.running()) std::this_thread::yield();
    });
    std::vector<std::thread> stoppers;
    for (int i = 0; i < 4; ++i) stoppers.emplace_back([&] { runner.stop(); });
    for (auto& t : stoppers) t.join();
    CHECK_FALSE(runner.running());
    const std::string outcome = [&]() -> std::string {
      try {
        return std::string(engine::to_string(pending.get().reason));
      } catch (const efim::error& e) {  // stopped before the loop queued it
        return e.code() == errc::unavailable ? "stopped" : e.what();
      }
    }();
    CHECK((outcome == "cancelled" || outcome == "stopped"));
  }
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("random editor sessions: cached results equal recomputed ones for every kind of change", "[engine][efim]") {
  // Typing, backspacing into the typed part and past the anchor, jumps, edits after the cursor.
  const auto w = small_weights();
  auto opts = options();
  opts.session.reanchor_bytes = 40;
  efim_pipeline warm(qwen_tokenizer(), w, opts);
  auto cold_opts = opts;
  cold_opts.cache.reuse = false;
  efim_pipeline cold(qwen_tokenizer(), w, cold_opts);
  rng r(31);
  std::string text = code_prefix + code_suffix;
  std::size_t cursor = code_prefix.size();
  std::map<prompt::change, int> seen;
  for (int step = 0; step < 60; ++step) {
    const auto op = r.below(10);
    if (op < 6) {
      const std::string typed = std::string(1 + r.below(6), static_cast<char>('a' + r.below(26)));
      text.insert(cursor, typed);
      cursor += typed.size();
    } else if (op < 8) {
      const std::size_t n = std::min<std::size_t>(cursor, 1 + r.below(4));
      text.erase(cursor - n, n);
      cursor -= n;
    } else if (op == 8) {
      cursor = r.below(text.size() + 1);
    } else {
      text.insert(cursor + r.below(text.size() - cursor + 1), "#");
    }
    const auto req = make_request(text.substr(0, cursor), text.substr(cursor), 3, "doc");
    const auto a = complete(warm, req);
    const auto b = complete(cold, req);
    ++seen[a.session_change];
    REQUIRE(a.session_change == b.session_change);
    REQUIRE(a.prompt_tokens == b.prompt_tokens);
    REQUIRE(b.cached_tokens == 0);
    REQUIRE(a.tokens == b.tokens);
  }
  CHECK(seen[prompt::change::append] > 0);
  CHECK(seen[prompt::change::edit] > 0);
  CHECK(seen[prompt::change::suffix_changed] + seen[prompt::change::cursor_moved] > 0);
  CHECK(warm.cache().stats().hit_rate() > 0.5);
}

TEST_CASE("a callback may cancel another request in the middle of a step", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  engine::request_id other = 0;
  engine::completion a, b;
  p.submit(make_request("first ", "", 6),
           {[&](const engine::token_event&) { p.cancel(other); }, [&](engine::completion&& c) { a = std::move(c); }});
  other = p.submit(make_request("second ", "", 6), {{}, [&](engine::completion&& c) { b = std::move(c); }});
  p.run();
  CHECK(a.tokens.size() == 6);
  CHECK(b.reason == engine::finish_reason::cancelled);
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("a throwing callback ends its own request with an error; the others go on", "[engine][errors]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  const auto alone = complete(p, make_request("y = ", "\n", 8));
  for (const std::size_t throw_at : {1u, 3u}) {  // on a middle token and on the last one
    engine::completion failed, other;
    std::size_t seen = 0;
    p.submit(make_request("x = ", "\n", 3), {[&](const engine::token_event&) {
                                               if (++seen == throw_at) throw std::runtime_error("client gone");
                                             },
                                             [&](engine::completion&& c) { failed = std::move(c); }});
    p.submit(make_request("y = ", "\n", 8), {{}, [&](engine::completion&& c) { other = std::move(c); }});
    CHECK_NOTHROW(p.run());
    CHECK(failed.reason == engine::finish_reason::error);
    REQUIRE(failed.error);
    CHECK_THROWS_WITH(std::rethrow_exception(failed.error), "client gone");
    CHECK(failed.tokens.size() == throw_at);
    CHECK(other.reason == alone.reason);
    CHECK(other.tokens == alone.tokens);
    CHECK_FALSE(other.error);
    CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
  }
}

TEST_CASE("async runner: a throwing callback fails its own client only", "[engine][async]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  engine::async_runner<efim_pipeline> runner(p);
  auto failing = runner.submit(make_request("x = ", "\n", 4),
                               [](const engine::token_event&) { throw std::runtime_error("client callback failed"); });
  auto fine = runner.submit(make_request("y = ", "\n", 4));
  CHECK_THROWS_WITH(failing.get(), "client callback failed");
  CHECK(fine.get().tokens.size() == 4);
  CHECK(runner.submit(make_request("z = ", "\n", 2)).get().tokens.size() == 2);  // still serving
}

namespace {
// What throwing callbacks leave behind: the exceptions the pipeline could not hand to a completion.
struct callback_log {
  std::mutex mutex;
  std::vector<std::pair<engine::request_id, std::string>> failures;
  void install(engine::pipeline_options& o) {
    o.on_callback_error = [this](engine::request_id id, std::exception_ptr e) {
      std::string what;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      }
      std::lock_guard lock(mutex);
      failures.emplace_back(id, what);
    };
  }
  std::size_t size() {
    std::lock_guard lock(mutex);
    return failures.size();
  }
};

engine::stream throwing_done(std::function<void(engine::completion&)> seen = {}) {
  return {{}, [seen](engine::completion&& c) {
            if (seen) seen(c);
            throw std::runtime_error("on_done failed");
          }};
}
}  // namespace

TEST_CASE("on_done that throws: the request is over, the error is reported, the engine goes on", "[engine][errors]") {
  const auto w = small_weights();
  callback_log log;
  auto o = options();
  log.install(o);
  efim_pipeline p(qwen_tokenizer(), w, o);
  const auto alone = complete(p, make_request("y = ", "\n", 6));
  std::vector<engine::finish_reason> reasons;
  const auto note = [&](engine::completion& c) { reasons.push_back(c.reason); };

  // After a sampled token (the last one), next to a request that goes on.
  engine::completion other;
  const auto sampled = p.submit(make_request("x = ", "\n", 3), throwing_done(note));
  p.submit(make_request("y = ", "\n", 6), {{}, [&](engine::completion&& c) { other = std::move(c); }});
  CHECK_NOTHROW(p.run());
  CHECK(other.tokens == alone.tokens);
  REQUIRE(log.size() == 1);
  CHECK(log.failures[0] == std::make_pair(sampled, std::string("on_done failed")));

  // On a prefill-only request's finish (it used to stop the whole step).
  auto warm = make_request(code_prefix, code_suffix, 0, "warm");
  p.submit(warm, throwing_done(note));
  CHECK_NOTHROW(p.run());
  CHECK(log.size() == 2);

  // After a cancel.
  const auto cancelled = p.submit(make_request("z = ", "\n", 50), throwing_done(note));
  CHECK(p.step());
  CHECK_NOTHROW(p.cancel(cancelled));
  CHECK(log.size() == 3);

  // A superseded request's: the newer request runs, completes, and could have been cancelled.
  p.submit(make_request(code_prefix, code_suffix, 40, "ed"), throwing_done(note));
  CHECK(p.step());
  engine::completion newer;
  engine::request_id newer_id = 0;
  CHECK_NOTHROW(newer_id = p.submit(make_request(code_prefix + "  ", code_suffix, 3, "ed"),
                                    {{}, [&](engine::completion&& c) { newer = std::move(c); }}));
  CHECK(log.size() == 4);
  p.run();
  CHECK(newer.id == newer_id);
  CHECK(newer.reason == engine::finish_reason::length);
  CHECK_FALSE(newer.error);

  // An error completion's (its on_token threw first): the request ended with the error all the same.
  p.submit(make_request("w = ", "\n", 4),
           {[](const engine::token_event&) { throw std::runtime_error("on_token failed"); },
            [&](engine::completion&& c) {
              reasons.push_back(c.reason);
              throw std::runtime_error("on_done failed too");
            }});
  CHECK_NOTHROW(p.run());
  CHECK(log.size() == 5);
  CHECK(log.failures[4].second == "on_done failed too");

  CHECK(reasons == std::vector<engine::finish_reason>{engine::finish_reason::length, engine::finish_reason::length,
                                                      engine::finish_reason::cancelled,
                                                      engine::finish_reason::superseded, engine::finish_reason::error});
  CHECK(p.callback_failures() == 5);
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
  CHECK(complete(p, make_request("y = ", "\n", 6)).tokens == alone.tokens);
}

namespace {
// A client whose on_done records how its request ended and then throws; its first token is signalled.
struct throwing_client {
  std::promise<engine::finish_reason> reason;
  std::promise<void> first_token;
  std::atomic<bool> seen{false};

  engine::stream stream() {
    return {[this](const engine::token_event&) {
              if (!seen.exchange(true)) first_token.set_value();
            },
            [this](engine::completion&& c) {
              reason.set_value(c.reason);
              throw std::runtime_error("on_done failed");
            }};
  }
  void wait_for_first_token() { within(first_token.get_future()); }
  engine::finish_reason ended() { return within(reason.get_future()); }
};
}  // namespace

TEST_CASE("async runner: callbacks that throw on every path end their own request only", "[engine][async][errors]") {
  const auto w = small_weights();
  callback_log log;
  auto o = options();
  log.install(o);
  efim_pipeline p(qwen_tokenizer(), w, o);
  std::optional<engine::async_runner<efim_pipeline>> runner(std::in_place, p);
  const auto served = [&] { return within(runner->submit(make_request("ok = ", "\n", 3))).tokens.size() == 3; };

  // Finished after sampling.
  throwing_client a;
  runner->submit(make_request("a = ", "\n", 3), a.stream());
  CHECK(a.ended() == engine::finish_reason::length);
  CHECK(served());
  // Prefill only.
  throwing_client b;
  runner->submit(make_request(code_prefix, code_suffix, 0, "warm"), b.stream());
  CHECK(b.ended() == engine::finish_reason::length);
  CHECK(served());
  // Cancelled (it used to end the process: std::terminate on the runner's thread).
  throwing_client c;
  const auto t = runner->submit(make_request("c = ", "\n", 400), c.stream());
  c.wait_for_first_token();
  runner->cancel(t);
  CHECK(c.ended() == engine::finish_reason::cancelled);
  CHECK(served());
  // Superseded: the newer request is neither refused nor left uncancellable.
  throwing_client d;
  runner->submit(make_request(code_prefix, code_suffix, 400, "ed"), d.stream());
  d.wait_for_first_token();
  std::promise<engine::completion> newer;
  std::promise<void> newer_started;
  std::atomic<bool> newer_once{false};
  const auto newer_ticket = runner->submit(make_request(code_prefix + " ", code_suffix, 400, "ed"),
                                           {[&](const engine::token_event&) {
                                              if (!newer_once.exchange(true)) newer_started.set_value();
                                            },
                                            [&](engine::completion&& done) { newer.set_value(std::move(done)); }});
  CHECK(d.ended() == engine::finish_reason::superseded);
  within(newer_started.get_future());
  runner->cancel(newer_ticket);
  const auto newer_done = within(newer.get_future());
  CHECK(newer_done.reason == engine::finish_reason::cancelled);
  CHECK_FALSE(newer_done.error);
  CHECK(served());
  // Refused on the calling thread (invalid UTF-8): submit itself does not throw.
  throwing_client e;
  CHECK_NOTHROW(runner->submit(make_request("\xFF", ""), e.stream()));
  CHECK(e.ended() == engine::finish_reason::error);
  CHECK(served());
  CHECK(log.size() == 5);
  // Unfinished when the runner stops: cancelled on the runner's thread, which still ends cleanly.
  throwing_client f;
  runner->submit(make_request("f = ", "\n", 400), f.stream());
  f.wait_for_first_token();
  runner.reset();
  CHECK(f.ended() == engine::finish_reason::cancelled);
  CHECK(log.size() == 6);
  CHECK(p.callback_failures() == 6);
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("a callback may cancel its own request on the last token: one completion", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  int done_calls = 0;
  std::size_t seen = 0;
  engine::request_id id = 0;
  engine::completion out;
  id = p.submit(make_request("x = ", "\n", 3), {[&](const engine::token_event&) {
                                                  if (++seen == 3) CHECK(p.cancel(id));
                                                },
                                                [&](engine::completion&& c) {
                                                  ++done_calls;
                                                  out = c;  // a copy: the pipeline's record stays intact
                                                }});
  p.run();
  CHECK(done_calls == 1);
  CHECK(out.reason == engine::finish_reason::cancelled);
  CHECK(out.tokens.size() == 3);
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("a token event's text survives the callback cancelling another request", "[engine]") {
  const auto w = small_weights();
  // Cancelling a request flushes what its detokenizer held back; the event text must not see that.
  efim_pipeline p(qwen_tokenizer(), w, options());
  std::string streamed;
  engine::completion final;
  engine::request_id other = 0;
  p.submit(make_request("x = ", "\n", 6), {[&](const engine::token_event& ev) {
                                             const std::string before(ev.text);
                                             if (other != 0) {
                                               p.cancel(other);
                                               other = 0;
                                             }
                                             CHECK(ev.text == before);
                                             streamed += ev.text;
                                           },
                                           [&](engine::completion&& c) { final = std::move(c); }});
  other = p.submit(make_request("y = ", "\n", 50), {{}, [](engine::completion&&) {}});
  p.run();
  CHECK(streamed + final.tail == final.text);
}

TEST_CASE("a model vocabulary larger than the tokenizer's: only the tokenizer's ids are sampled",
          "[engine][sampling]") {
  model::config c = small_config();
  c.vocab = qwen_tokenizer().vocab_size() + 500;  // padded vocabularies are common in real checkpoints
  const auto w = model::random_weights(c, 5);
  efim_pipeline p(qwen_tokenizer(), w, options());
  for (const float temperature : {0.0f, 1.5f}) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      auto r = make_request("x = ", "\n", 24);
      r.ignore_eos = true;
      r.sampling.temperature = temperature;
      r.sampling.seed = seed;
      const auto out = complete(p, r);
      CHECK(out.tokens.size() == 24);
      for (const auto t : out.tokens) CHECK(static_cast<std::size_t>(t) < qwen_tokenizer().vocab_size());
    }
  }
}

TEST_CASE("a huge max_tokens is refused, not wrapped around", "[engine][errors]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  for (const std::size_t n : {std::numeric_limits<std::size_t>::max(), std::numeric_limits<std::size_t>::max() - 3}) {
    try {
      p.submit(make_request("x = ", "\n", n), {});
      FAIL("expected an error");
    } catch (const efim::error& e) {
      CHECK(e.code() == errc::too_long);
    }
  }
  CHECK_FALSE(p.step());
}

TEST_CASE("a FIM token set whose BOS token the tokenizer lacks is refused at construction", "[engine][errors]") {
  const auto& set = prompt::codellama;  // adds <s> first
  REQUIRE(set.add_bos);
  const text::byte_tokenizer without_bos(
      {std::string(set.prefix), std::string(set.suffix), std::string(set.middle), std::string(set.eos)});
  model::config c = small_config();
  c.vocab = without_bos.vocab_size();
  const auto w = model::random_weights(c, 1);
  auto o = options();
  o.fim = set;
  CHECK_THROWS_WITH(efim_pipeline(without_bos, w, o), Catch::Contains("<s>"));
  o.fim.add_bos = false;
  CHECK_NOTHROW(efim_pipeline(without_bos, w, o));
}

TEST_CASE("async runner: a request that arrives during a failing step gets the error too", "[engine][async]") {
  const auto w = small_weights();
  faulty_pipeline p(qwen_tokenizer(), w, options());
  auto runner = std::make_unique<engine::async_runner<faulty_pipeline>>(p);
  std::future<engine::completion> late;
  auto first = runner->submit(make_request("x = ", "\n", 4), [&](const engine::token_event&) {
    if (late.valid()) return;
    late = runner->submit(make_request("y = ", "\n", 4));  // queued while the loop is inside step()
    p.fail_after_step = true;
  });
  CHECK_THROWS_WITH(first.get(), "injected step failure");
  REQUIRE(late.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  CHECK_THROWS_WITH(late.get(), "injected step failure");
  CHECK_THROWS_AS(runner->submit(make_request("z = ", "\n", 4)).get(), efim::error);  // stopped
}

TEST_CASE("async runner: after a failed step the pipeline holds no blocks and no callbacks into the runner",
          "[engine][async]") {
  const auto w = small_weights();
  faulty_pipeline p(qwen_tokenizer(), w, options());
  {
    engine::async_runner<faulty_pipeline> runner(p);
    // The long request waits at its first token until the failing one is queued: without it, a test
    // thread kept off the CPU for a moment (a loaded machine) let it finish its 40 tokens first.
    std::atomic<bool> queued{false};
    auto other = runner.submit(make_request("long = ", "\n", 40), [&](const engine::token_event&) {
      while (!queued.load()) std::this_thread::yield();
    });
    auto failing =
        runner.submit(make_request("x = ", "\n", 4), [&](const engine::token_event&) { p.fail_after_step = true; });
    queued = true;
    CHECK_THROWS_WITH(failing.get(), "injected step failure");
    CHECK_THROWS_WITH(other.get(), "injected step failure");
  }
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
  // The owner drives the pipeline on: nothing is left to run, and nothing calls into the dead runner.
  CHECK_FALSE(p.step());
  CHECK(complete(p, make_request("z = ", "\n", 3)).tokens.size() == 3);
}

TEST_CASE("stop rules: a stop string is never shown, not even in part", "[engine][stop]") {
  engine::text_gate g({{"STOP", "</s>"}, 0});
  std::string out;
  CHECK(g.push("abc S", out) == engine::text_gate::verdict::go_on);
  CHECK(out == "abc ");  // "S" could start STOP
  CHECK(g.push("T", out) == engine::text_gate::verdict::go_on);
  CHECK(out == "abc ");
  CHECK(g.push("ep", out) == engine::text_gate::verdict::go_on);  // "STep" is not STOP
  CHECK(out == "abc STep");
  CHECK(g.push("x<", out) == engine::text_gate::verdict::go_on);
  CHECK(out == "abc STepx");
  CHECK(g.push("/s> tail STOP", out) == engine::text_gate::verdict::stop_string);
  CHECK(out == "abc STepx");
  CHECK(g.stopped());
  // The end of the text releases what was held back.
  engine::text_gate h({{"STOP"}, 0});
  out.clear();
  h.push("ST", out);
  CHECK(out.empty());
  h.finish(out);
  CHECK(out == "ST");
  // The earliest of several stop strings wins; an empty stop string is ignored.
  engine::text_gate k({{"", "b", "abc"}, 0});
  out.clear();
  CHECK(k.push("xabc", out) == engine::text_gate::verdict::stop_string);
  CHECK(out == "x");
}

TEST_CASE("stop rules: a new line indented less than the minimum ends the text, as llama.cpp's n_indent",
          "[engine][stop]") {
  const auto run = [](std::vector<std::string> pieces, std::size_t indent) {
    engine::text_gate g({{}, indent});
    std::string out;
    auto v = engine::text_gate::verdict::go_on;
    for (const auto& p : pieces)
      if ((v = g.push(p, out)) != engine::text_gate::verdict::go_on) break;
    if (v == engine::text_gate::verdict::go_on) g.finish(out);
    return std::pair{out, v};
  };
  using v = engine::text_gate::verdict;
  // The first line is never checked; later lines keep their newline and indentation when cut.
  CHECK(run({"x = 1\n", "    y = 2\n", "  z"}, 4) == std::pair{std::string("x = 1\n    y = 2\n  "), v::indent});
  CHECK(run({"x", "\n\ty\n\t\tz"}, 1) == std::pair{std::string("x\n\ty\n\t\tz"), v::go_on});
  // A blank line counts as a line with no indentation, as in llama.cpp.
  CHECK(run({"a\n\nb"}, 2) == std::pair{std::string("a\n"), v::indent});
  CHECK(run({"a\n", "  ", "  ", "b"}, 4) == std::pair{std::string("a\n    b"), v::go_on});
}

TEST_CASE("pipeline: a stop string ends the completion before it; streamed text + tail is the text", "[engine][stop]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  const auto free_run = complete(p, make_request(code_prefix, code_suffix, 24));
  REQUIRE(free_run.text.size() > 8);
  const std::string stop = free_run.text.substr(free_run.text.size() / 2, 3);
  auto r = make_request(code_prefix, code_suffix, 24);
  r.stop.strings = {stop};
  std::string streamed;
  engine::completion c;
  p.submit(r, {[&](const engine::token_event& e) { streamed += e.text; },
               [&](engine::completion&& done) { c = std::move(done); }});
  p.run();
  CHECK(c.reason == engine::finish_reason::stop);
  CHECK(c.stop_word == stop);
  CHECK(c.text == free_run.text.substr(0, free_run.text.find(stop)));
  CHECK(streamed + c.tail == c.text);
  CHECK(free_run.tokens.size() > c.tokens.size());
}

namespace {
// A model that only ever writes ASCII (every other output row reads minus a feature that every
// embedding carries), so that its text can be typed back byte for byte.
model::weights ascii_weights() {
  const auto cfg = small_config();
  const std::size_t h = cfg.hidden;
  return efim_test::edited_weights([&](std::string_view name, float* v) {
    if (name == "token_embd.weight")
      for (std::size_t i = 0; i < cfg.vocab; ++i) v[i * h] = 4.0f;
    if (name == "output.weight")
      for (std::size_t i = 128; i < cfg.vocab; ++i) {
        std::fill_n(v + i * h, h, 0.0f);
        v[i * h] = -100.0f;
      }
  });
}
}  // namespace

TEST_CASE("EFIM session: typing what the model generated reuses the KV computed while generating it",
          "[engine][efim]") {
  const auto w = ascii_weights();
  efim_pipeline warm(qwen_tokenizer(), w, options());
  efim_pipeline cold(qwen_tokenizer(), w, options(256, false));
  auto r = make_request(code_prefix, code_suffix, 20, "ed");
  complete(cold, r);
  const auto a = complete(warm, r);
  REQUIRE(a.tokens.size() == 20);
  REQUIRE(std::set<token_id>(a.tokens.begin(), a.tokens.end()).size() > 3);
  // The suggestion accepted (its first 18 tokens' text), then one more character typed.
  std::string accepted;
  for (std::size_t i = 0; i < 18; ++i) accepted += static_cast<char>(a.tokens[i]);  // byte tokenizer: id = byte
  r = make_request(code_prefix + accepted + "#", code_suffix, 4, "ed");
  const auto b = complete(warm, r);
  const auto recomputed = complete(cold, r);
  CHECK(b.session_change == prompt::change::accepted);
  CHECK(b.reused_tokens == 18);
  CHECK(recomputed.session_change == prompt::change::accepted);
  CHECK(b.prompt_tokens == a.prompt_tokens + 19);
  // Everything but the typed character and the last partial block came from the cache.
  CHECK(b.cached_tokens == (b.prompt_tokens - 1) / 16 * 16);
  CHECK(b.tokens == recomputed.tokens);
}

TEST_CASE("a newer request of a session supersedes the one in flight; its work stays cached", "[engine][session]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  engine::completion older, newer;
  p.submit(make_request(code_prefix, code_suffix, 40, "ed"),
           {{}, [&](engine::completion&& c) { older = std::move(c); }});
  CHECK(p.step());  // the older one's prompt is (partly) computed
  CHECK(p.step());
  p.submit(make_request(code_prefix + "    ", code_suffix, 3, "ed"),
           {{}, [&](engine::completion&& c) { newer = std::move(c); }});
  CHECK(older.reason == engine::finish_reason::superseded);
  p.run();
  CHECK(newer.reason == engine::finish_reason::length);
  CHECK(newer.session_change == prompt::change::append);
  CHECK(newer.cached_tokens >= 64);  // the blocks the older request computed
  // Other sessions are not touched.
  engine::completion x, y;
  p.submit(make_request(code_prefix, code_suffix, 6, "x"), {{}, [&](engine::completion&& c) { x = std::move(c); }});
  p.submit(make_request(code_prefix, code_suffix, 6, "y"), {{}, [&](engine::completion&& c) { y = std::move(c); }});
  p.run();
  CHECK(x.reason == engine::finish_reason::length);
  CHECK(y.reason == engine::finish_reason::length);
  CHECK(p.cache().free_blocks() + p.cache().evictable_blocks() == p.cache().capacity());
}

TEST_CASE("requests without a session key find their session by content", "[engine][session]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  auto r = make_request(code_prefix, code_suffix, 2);
  r.match_session = true;
  const auto a = complete(p, r);
  CHECK(a.session_change == prompt::change::first);
  CHECK_FALSE(a.session.empty());
  r.prefix += "    return";
  const auto b = complete(p, r);
  CHECK(b.session == a.session);
  CHECK(b.session_change == prompt::change::append);
  CHECK(b.cached_tokens == (b.prompt_tokens - 10) / 16 * 16);
  // Another tenant's identical request starts its own session.
  r.tenant = "other";
  const auto c = complete(p, r);
  CHECK(c.session != a.session);
  CHECK(c.cached_tokens == 0);
  // Without match_session, requests stay stateless.
  auto plain = make_request(code_prefix, code_suffix, 2);
  CHECK(complete(p, plain).session.empty());
}

TEST_CASE("a prefill-only request renews its session's anchor", "[engine][session]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  complete(p, make_request(code_prefix, code_suffix, 2, "s"));
  complete(p, make_request(code_prefix + "    x", code_suffix, 2, "s"));
  const auto warm = complete(p, make_request(code_prefix + "    x", code_suffix, 0, "s"));
  CHECK(warm.session_change == prompt::change::reanchor);
  const auto next = complete(p, make_request(code_prefix + "    xy", code_suffix, 2, "s"));
  CHECK(next.session_change == prompt::change::append);
  CHECK(next.prompt_tokens == warm.prompt_tokens + 1);
}

TEST_CASE("fit_context: generation stops where the context ends, and says so", "[engine]") {
  const auto w = small_weights();  // max_context 1024
  efim_pipeline p(qwen_tokenizer(), w, options());
  const std::string prefix(1000, 'x');
  auto r = make_request(prefix, "", 100);
  CHECK_THROWS_AS(p.submit(r, {}), efim::error);
  r.fit_context = true;
  const auto c = complete(p, r);
  CHECK(c.prompt_tokens + c.tokens.size() == 1024);
  CHECK(c.truncated);
  CHECK(c.reason == engine::finish_reason::length);
  r.prefix = std::string(1030, 'x');
  CHECK_THROWS_AS(p.submit(r, {}), efim::error);  // the prompt alone does not fit
}

TEST_CASE("reuse_cache false computes the whole prompt; a time limit ends generation at a line's end", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  auto r = make_request(code_prefix, code_suffix, 2);
  complete(p, r);
  CHECK(complete(p, r).cached_tokens > 0);
  r.reuse_cache = false;
  const auto full = complete(p, r);
  CHECK(full.cached_tokens == 0);
  CHECK(full.prompt_ms() > 0);
  r.reuse_cache = true;
  r.max_tokens = 500;
  r.sampling.temperature = 1.0f;
  // A seed whose text has a line end (seeded sampling: the timed run generates the same tokens).
  engine::completion free_run;
  for (r.sampling.seed = 1; r.sampling.seed < 40; ++r.sampling.seed) {
    free_run = complete(p, r);
    if (std::find(free_run.tokens.begin(), free_run.tokens.end(), token_id{'\n'}) != free_run.tokens.end()) break;
  }
  REQUIRE(std::find(free_run.tokens.begin(), free_run.tokens.end(), token_id{'\n'}) != free_run.tokens.end());
  r.max_generate_time = std::chrono::milliseconds(1);
  const auto timed = complete(p, r);
  // Past the limit, the line being written ends, and generation with it.
  CHECK(timed.reason == engine::finish_reason::time_limit);
  REQUIRE_FALSE(timed.tokens.empty());
  CHECK(timed.tokens.back() == '\n');
  CHECK(std::equal(timed.tokens.begin(), timed.tokens.end(), free_run.tokens.begin()));
  CHECK(timed.generation_ms() >= 1.0);
}

TEST_CASE("a plain completion continues its prompt without FIM tokens", "[engine]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  auto r = make_request("def f(x):", "", 4);
  r.infill = false;
  const auto c = complete(p, r);
  CHECK(c.prompt_tokens == 9);
  CHECK(c.tokens.size() == 4);
  r.prefix.clear();
  CHECK_THROWS_AS(p.submit(r, {}), efim::error);  // nothing to continue
}

TEST_CASE("async runner: a ticket cancels a request before or during its steps; calls read state between steps",
          "[engine][async]") {
  const auto w = small_weights();
  efim_pipeline p(qwen_tokenizer(), w, options());
  engine::async_runner<efim_pipeline> runner(p);
  std::promise<engine::completion> done;
  std::atomic<int> tokens{0};
  std::atomic<engine::async_runner<efim_pipeline>::ticket> t{0};
  t = runner.submit(make_request(code_prefix, code_suffix, 500),
                    {[&](const engine::token_event&) {
                       if (++tokens != 3) return;
                       while (t == 0) std::this_thread::yield();  // the ticket, once submit has returned it
                       runner.cancel(t);
                     },
                     [&](engine::completion&& c) { done.set_value(std::move(c)); }});
  const auto c = done.get_future().get();
  CHECK(c.reason == engine::finish_reason::cancelled);
  CHECK(c.tokens.size() <= 4);  // cancelled before the next step
  // Cancelled before the pipeline saw it.
  std::promise<engine::completion> early;
  const auto t2 = runner.submit(make_request(code_prefix, code_suffix, 500),
                                {{}, [&](engine::completion&& x) { early.set_value(std::move(x)); }});
  runner.cancel(t2);
  CHECK(early.get_future().get().reason == engine::finish_reason::cancelled);
  // A refused request completes with the error.
  std::promise<engine::completion> refused;
  runner.submit(make_request("\xFF", ""), {{}, [&](engine::completion&& x) { refused.set_value(std::move(x)); }});
  const auto r = refused.get_future().get();
  CHECK(r.reason == engine::finish_reason::error);
  CHECK_THROWS_AS(std::rethrow_exception(r.error), efim::error);
  auto free = runner.call([](efim_pipeline& pl) { return pl.cache().free_blocks() + pl.cache().evictable_blocks(); });
  CHECK(free.get() == p.cache().capacity());
}

namespace {

// Token healing through the whole pipeline, on a real BPE vocabulary and a random model over it.
template <class F>
void healing_through_pipeline(const text::bpe_tokenizer& tok, const model::weights& w, const std::string& code) {
  using pipeline = engine::pipeline<F, cache::xxh3_128_chain, cache::lru, text::at_boundaries, kernels::host,
                                    text::bpe_tokenizer>;
  auto o = efim_test::small_options(512);
  o.heal_tokens = 3;
  pipeline p(tok, w, o);
  const text::prefix_index index(tok);
  rng r(std::hash<std::string_view>{}(F::name));
  std::size_t healed = 0;
  for (int i = 0; i < 40; ++i) {
    const std::size_t from = r.below(code.size() - 600);
    std::size_t cut_at = from + 1 + r.below(300);
    while ((static_cast<unsigned char>(code[cut_at]) & 0xC0) == 0x80) ++cut_at;
    // Where typed text goes last (spm, efim), the session's anchor comes first (prefill only) and the
    // request types the rest: that text is healed. In psm the prefix itself is.
    std::size_t typed_from = from;
    const std::string session = F::typed_at_end ? "s" + std::to_string(i) : "";
    if constexpr (F::typed_at_end) {
      typed_from = cut_at - 1 - r.below(std::min<std::size_t>(cut_at - from - 1, 40) + 1);
      while (typed_from > from && (static_cast<unsigned char>(code[typed_from]) & 0xC0) == 0x80) --typed_from;
      if (typed_from > from) {
        engine::request anchor = make_request(code.substr(from, typed_from - from), code.substr(cut_at, 200), 0, session);
        p.submit(anchor, {});
        p.run();
      } else {
        typed_from = from;  // no anchor: the whole text is the anchor, and nothing typed is healed
      }
    }
    engine::request req = make_request(code.substr(from, cut_at - from), code.substr(cut_at, 200), 6, session);
    req.sampling.temperature = i % 2 == 0 ? 0.0f : 0.9f;
    req.sampling.seed = static_cast<std::uint64_t>(i);
    std::string streamed;
    engine::completion c;
    p.submit(req, {[&](const engine::token_event& e) { streamed += e.text; },
                   [&](engine::completion&& done) { c = std::move(done); }});
    p.run();
    INFO(F::name << " request " << i << ": '" << req.prefix << "'");
    REQUIRE(c.error == nullptr);
    // The removed text: the last healed tokens of the prefix tokenized alone (at_boundaries, first request).
    // The ids of the text at the cursor, fragment by fragment (at_boundaries): spm's last segment is the
    // anchor prefix and the typed text, efim's the typed text, psm's the prefix.
    std::vector<token_id> prefix_ids;
    if (F::name == std::string_view("spm") && typed_from > from)
      tok.encode(std::string_view(code).substr(from, typed_from - from), prefix_ids);
    tok.encode(std::string_view(code).substr(typed_from, cut_at - typed_from), prefix_ids);
    REQUIRE(c.healed_tokens <= 3);
    if (c.healed_tokens == 0) {
      // Healing stays away only when nothing extends the last token (or nothing was typed after the anchor).
      CHECK((!index.extendable(prefix_ids.back()) || (F::typed_at_end && typed_from == from)));
      continue;
    }
    ++healed;
    std::string removed;
    for (std::size_t j = prefix_ids.size() - c.healed_tokens; j < prefix_ids.size(); ++j)
      removed += tok.token_bytes(prefix_ids[j]);
    std::string generated;  // (special tokens, never generated while healing, show no text)
    for (const token_id t : c.tokens)
      if (!tok.is_special(t)) generated += tok.token_bytes(t);
    // The generated text gives the removed text back, then the client's text follows it; the client
    // never sees a byte twice.
    CHECK(generated.starts_with(removed));
    CHECK(streamed + c.tail == c.text);
    if (c.reason == engine::finish_reason::length) {
      CHECK(c.tokens.size() - c.healing_steps == 6);  // max_tokens counts what the client received
      // (Bytes that do not form UTF-8 characters reach the client as U+FFFD, as without healing.)
      text::detokenizer<text::bpe_tokenizer> detok(tok);
      std::string client;
      detok.push_bytes(std::string_view(generated).substr(removed.size()), client);
      detok.flush(client);
      CHECK(c.text == client);
    }
  }
  CHECK(healed > 10);
}

}  // namespace

namespace {
// Qwen2.5-Coder's vocabulary (from the shared data) and a small random model over it (hidden 32, ffn
// 64), for the token-healing cases; nothing, with a warning that the case was skipped, where the data
// is not there.
struct vocab_model {
  text::bpe_tokenizer tok;
  model::weights w;
};
std::optional<vocab_model> qwen_vocab_model(std::uint64_t seed) {
  const auto path = efim_test::vocab_dir() / "ggml-vocab-qwen2.5-coder.gguf";
  if (!std::filesystem::exists(path)) {
    WARN("skipped: needs " << path.string());
    return std::nullopt;
  }
  auto tok = text::load_bpe(path.string());
  auto cfg = small_config();
  cfg.vocab = tok.vocab_size();
  cfg.hidden = 32;
  cfg.ffn = 64;
  auto w = model::random_weights(cfg, seed);
  return vocab_model{std::move(tok), std::move(w)};
}
}  // namespace

TEST_CASE("token healing in the pipeline: psm, spm and efim give the removed text back, and only then the client's",
          "[engine][healing][shared]") {
  const auto qwen = qwen_vocab_model(9);
  if (!qwen) return;
  const auto& [tok, w] = *qwen;
  std::ifstream in(std::filesystem::path(__FILE__).parent_path() / "engine_test.cpp", std::ios::binary);
  const std::string code(std::istreambuf_iterator<char>(in), {});
  REQUIRE(code.size() > 5000);
  healing_through_pipeline<prompt::psm>(tok, w, code);
  healing_through_pipeline<prompt::spm>(tok, w, code);
  healing_through_pipeline<prompt::efim_format>(tok, w, code);
}

TEST_CASE("token healing keeps EFIM's cache reuse: per keystroke, typed tokens + one block + k computed",
          "[engine][healing][shared]") {
  const auto qwen = qwen_vocab_model(9);
  if (!qwen) return;
  const auto& [tok, w] = *qwen;
  using pipeline = engine::pipeline<prompt::efim_format, cache::xxh3_128_chain, cache::lru, text::at_boundaries,
                                    kernels::host, text::bpe_tokenizer>;
  for (const std::size_t k : {0, 1, 3}) {
    INFO("heal_tokens " << k);
    auto o = efim_test::small_options(512);
    o.heal_tokens = k;
    pipeline p(tok, w, o);
    const std::string prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    ";
    const std::string typed = "return fibonacci(n - 1) + fibonacci(n - 2)";
    for (std::size_t n = 0; n <= typed.size(); n += 3) {
      engine::request req = make_request(prefix + typed.substr(0, n), "\n\nprint(fibonacci(10))\n", 4, "s");
      engine::completion c;
      p.submit(req, {{}, [&](engine::completion&& done) { c = std::move(done); }});
      p.run();
      INFO("typed " << n << ": " << c.prompt_tokens << " prompt tokens, " << c.cached_tokens << " cached, "
                    << c.healed_tokens << " healed");
      std::vector<token_id> typed_ids;
      tok.encode(typed.substr(0, n), typed_ids);
      if (n > 0) CHECK(c.prompt_tokens - c.cached_tokens <= std::min<std::size_t>(typed_ids.size(), 3) + 16 + k);
      CHECK(c.healed_tokens <= k);
    }
  }
}

namespace {

// What holds for any fragmenter and any k, without knowing the cut: the client's text is what follows
// the removed text in the generated bytes, and the text before the cursor ends with the removed text.
template <class F, class G>
void healing_any_fragmenter(const text::bpe_tokenizer& tok, const model::weights& w, const std::string& code) {
  using pipeline = engine::pipeline<F, cache::xxh3_128_chain, cache::lru, G, kernels::host, text::bpe_tokenizer>;
  pipeline p(tok, w, efim_test::small_options(512));  // healing off by default: each request asks
  rng r(std::hash<std::string_view>{}(F::name) + 7);
  const std::vector<std::string> edges = {"r", " ", "    ", "\n", "\t\t", "x = \xE4\xB8\xAD", "\xF0\x9F\x98\x80"};
  for (std::size_t i = 0; i < 30 + edges.size(); ++i) {
    std::string before;
    if (i < edges.size()) {
      before = edges[i];
    } else {
      const std::size_t from = r.below(code.size() - 600);
      std::size_t to = from + 1 + r.below(200);
      while ((static_cast<unsigned char>(code[to]) & 0xC0) == 0x80) ++to;
      before = code.substr(from, to - from);
    }
    const std::string session = "k" + std::to_string(i);
    const std::string after = "\n}\n";
    if (F::typed_at_end) {  // an anchor first, so that the request has typed text to heal
      p.submit(make_request("", after, 0, session), {});
      p.run();
    }
    engine::request req = make_request(before, after, 5, session);
    req.heal_tokens = r.below(5);
    req.sampling.temperature = i % 2 == 0 ? 0.0f : 0.7f;
    req.sampling.seed = i;
    std::string streamed;
    engine::completion c;
    p.submit(req, {[&](const engine::token_event& e) { streamed += e.text; },
                   [&](engine::completion&& done) { c = std::move(done); }});
    p.run();
    INFO(F::name << ", request " << i << ", k " << *req.heal_tokens << ": '" << before << "'");
    REQUIRE(c.error == nullptr);
    CHECK(c.healed_tokens <= *req.heal_tokens);
    CHECK(streamed + c.tail == c.text);
    std::string generated;  // (special tokens, never generated while healing, show no text)
    for (const token_id t : c.tokens)
      if (!tok.is_special(t)) generated += tok.token_bytes(t);
    if (c.reason != engine::finish_reason::length || !utf8::is_valid(generated)) continue;
    CHECK(c.tokens.size() - c.healing_steps == 5);
    REQUIRE(generated.size() >= c.text.size());
    CHECK(generated.ends_with(c.text));
    const std::string removed = generated.substr(0, generated.size() - c.text.size());
    CHECK(before.ends_with(removed));
    CHECK(removed.empty() == (c.healed_tokens == 0));
  }
}

}  // namespace

TEST_CASE("token healing, any fragmenter and k, edge prompts: the client's text continues the prompt",
          "[engine][healing][shared]") {
  const auto qwen = qwen_vocab_model(4);
  if (!qwen) return;
  const auto& [tok, w] = *qwen;
  std::ifstream in(std::filesystem::path(__FILE__).parent_path() / "text_test.cpp", std::ios::binary);
  const std::string code(std::istreambuf_iterator<char>(in), {});
  healing_any_fragmenter<prompt::psm, text::whole>(tok, w, code);
  healing_any_fragmenter<prompt::psm, text::at_boundaries>(tok, w, code);
  healing_any_fragmenter<prompt::spm, text::whole>(tok, w, code);
  healing_any_fragmenter<prompt::efim_format, text::whole>(tok, w, code);
  healing_any_fragmenter<prompt::efim_format, text::at_boundaries>(tok, w, code);
}

TEST_CASE("token healing: a healed request served from the cache gives the tokens of a recompute",
          "[engine][healing][shared]") {
  const auto qwen = qwen_vocab_model(6);
  if (!qwen) return;
  const auto& [tok, w] = *qwen;
  using pipeline = engine::pipeline<prompt::psm, cache::xxh3_128_chain, cache::lru, text::at_boundaries,
                                    kernels::host, text::bpe_tokenizer>;
  auto o = efim_test::small_options(512);
  o.heal_tokens = 2;
  pipeline cached(tok, w, o);
  o.cache.reuse = false;
  pipeline fresh(tok, w, o);
  const std::string prefix = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pu";
  engine::request req = make_request(prefix, "\n\n    def pop(self):\n        return self.items.pop()\n", 8);
  const auto first = complete(cached, req);
  const auto again = complete(cached, req);
  const auto recomputed = complete(fresh, req);
  REQUIRE(first.healed_tokens > 0);
  CHECK(again.cached_tokens > 0);
  CHECK(again.tokens == first.tokens);
  CHECK(recomputed.cached_tokens == 0);
  CHECK(recomputed.tokens == first.tokens);
  CHECK(recomputed.text == first.text);
}

namespace {
// A user's healing policy: the last token at most, whatever k a request allows.
struct heal_last_token {
  text::heal_cut cut(const text::prefix_index& index, std::span<const token_id> ids, std::size_t most) const {
    return text::heal(index, ids, std::min<std::size_t>(most, 1));
  }
};
static_assert(text::healing_policy<heal_last_token>);
}  // namespace

TEST_CASE("token healing: the pipeline's healing policy is a type (no_healing, a user's own)", "[engine][healing][shared]") {
  const auto qwen = qwen_vocab_model(8);
  if (!qwen) return;
  const auto& [tok, w] = *qwen;

  using own = engine::pipeline<prompt::psm, cache::xxh3_128_chain, cache::lru, text::at_boundaries, kernels::host,
                               text::bpe_tokenizer, cache::logical_clock, heal_last_token>;
  using none = engine::pipeline<prompt::psm, cache::xxh3_128_chain, cache::lru, text::at_boundaries, kernels::host,
                                text::bpe_tokenizer, cache::logical_clock, text::no_healing>;
  auto o = efim_test::small_options(512);
  o.heal_tokens = 3;
  own mine(tok, w, o);
  none off(tok, w, o);
  std::size_t healed = 0;
  for (const char* prefix : {"    retu", "import nump", "def __ini", "for i in ran", "self.ite", "x = [1, 2, 3]\n"}) {
    INFO(prefix);
    const auto a = complete(mine, make_request(prefix, "\n", 3));
    const auto b = complete(off, make_request(prefix, "\n", 3));
    CHECK(a.healed_tokens <= 1);
    CHECK(b.healed_tokens == 0);
    healed += a.healed_tokens;
  }
  CHECK(healed > 0);
}

TEST_CASE("generation: tokens an engine elsewhere did not name are shown by their text and counted", "[engine]") {
  const text::byte_tokenizer tok(prompt::qwen25_coder.special_tokens());
  const text::prefix_index index(tok);
  const token_id eos = *tok.special_id("<|endoftext|>");
  const auto make = [&](std::size_t max_tokens, std::vector<std::string> stop, std::string heal,
                        std::vector<std::string>& shown, engine::completion& done) {
    engine::prepared_request p;
    p.result.id = 7;
    p.max_tokens = max_tokens;
    p.stop.strings = std::move(stop);
    p.heal_text = std::move(heal);
    return engine::generation<text::byte_tokenizer>(
        tok, p,
        engine::stream{[&](const engine::token_event& e) { shown.emplace_back(e.text); },
                       [&](engine::completion&& c) { done = std::move(c); }});
  };
  const std::string unnamed = "\xE5\xBB\xBA\xEF\xBF\xBD";  // what llama.cpp sends for a token of bytes it cannot show

  SECTION("shown before the next token, counted in max_tokens, not in the ids") {
    std::vector<std::string> shown;
    engine::completion done;
    auto g = make(3, {}, {}, shown, done);
    CHECK_FALSE(g.take('x', &index, eos, unnamed, 1));
    const auto why = g.take('y', &index, eos);  // 1 unnamed + x + y = 3
    REQUIRE(why == engine::finish_reason::length);
    CHECK(g.complete(*why));
    CHECK(g.deliver() == nullptr);
    CHECK(shown == std::vector<std::string>{unnamed + "x", "y"});
    CHECK(done.text == unnamed + "xy");
    CHECK(done.tokens == std::vector<token_id>{'x', 'y'});
  }
  SECTION("before the end of the text: shown, then the end") {
    std::vector<std::string> shown;
    engine::completion done;
    auto g = make(16, {}, {}, shown, done);
    CHECK(g.take(eos, &index, eos, unnamed, 1) == engine::finish_reason::eos);
    CHECK(g.result().text == unnamed);
    CHECK(g.result().tokens.empty());
  }
  SECTION("a stop string in their text stops there") {
    std::vector<std::string> shown;
    engine::completion done;
    auto g = make(16, {"\xEF\xBF\xBD"}, {}, shown, done);
    CHECK(g.take('x', &index, eos, unnamed, 1) == engine::finish_reason::stop);
    CHECK(g.result().text == "\xE5\xBB\xBA");
  }
  SECTION("refused while healing gives back removed text (the text cannot be checked against it)") {
    std::vector<std::string> shown;
    engine::completion done;
    auto g = make(16, {}, "ab", shown, done);
    CHECK_THROWS_AS(g.take('a', &index, eos, unnamed, 1), efim::error);
  }
}

TEST_CASE("pipeline: the host backend times its decode tiles when it starts, unless told not to", "[engine]") {
  const efim_test::decode_tiles_guard guard;
  const auto w = efim_test::small_weights();  // f32 matrices, well under the default 16 MiB
  const bool apply = kernels::decode_tiles_apply(kernels::weight_view{dtype::f32, 1, 32, nullptr});
  {
    efim_pipeline p(efim_test::qwen_tokenizer(), w, efim_test::small_options());
    CHECK(p.decode_tuning().empty());  // too few bytes to say anything of a decode from memory
  }
  auto o = efim_test::small_options();
  o.tune_decode_min_bytes = 0;
  o.tune_decode_tiles = false;
  {
    efim_pipeline p(efim_test::qwen_tokenizer(), w, o);
    CHECK(p.decode_tuning().empty());
    CHECK(kernels::measured_decode_tiles(dtype::f32) == kernels::decode_tiles::automatic);
  }
  o.tune_decode_tiles = true;
  efim_pipeline p(efim_test::qwen_tokenizer(), w, o);
  if (apply) {
    REQUIRE(p.decode_tuning().size() == 1);
    CHECK(p.decode_tuning()[0].type == dtype::f32);
    CHECK(p.decode_tuning()[0].matrices == 2 * 7 + 1);
    CHECK(kernels::measured_decode_tiles(dtype::f32) == p.decode_tuning()[0].chosen);
  } else {
    CHECK(p.decode_tuning().empty());  // not the AVX-512 path: one kind only
  }
}
