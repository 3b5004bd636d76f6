// The shared KV tier's worth: what a block costs to compute against what it costs to take from Redis,
// measured side by side in one run on the same engine. Replica A computes a prompt cold and writes its
// blocks to the store; replica B, with an empty cache of its own, serves the same prompt from the store
// (one MGET for the chain, each value verified, its KV copied into B's blocks) and computes only the
// last partial block. Per block:
//   compute: A's prompt time / the blocks A computed
//   store:   B's time from submitting the request to its first step (lookup, verification, import)
//            / the blocks B took from the store
// Shapes: the example programs' default model, and one shaped as Qwen2.5-Coder-1.5B (random weights,
// q8_0, f16 KV). redis-server is started on a free loopback port unless --redis names one.
//
//   efim-kv-store-bench [--shapes default,1.5b] [--tokens 512] [--threads 0] [--redis redis://HOST:PORT]
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/redis_tier.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/fragment.hpp"

namespace {

using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                        efim::text::at_boundaries, efim::kernels::host>;
using ms = std::chrono::duration<double, std::milli>;

struct shape {
  std::string name;
  efim::model::config cfg;
  efim::dtype weights;
};

shape named_shape(const std::string& name) {
  auto c = efim::model::for_architecture(efim::model::architecture::qwen2);
  c.vocab = 151936;
  c.max_context = 32768;
  if (name == "default") {  // the example programs' embedded model (examples/default_model.hpp)
    c.hidden = 128;
    c.layers = 4;
    c.heads = 4;
    c.kv_heads = 2;
    c.ffn = 384;
    return {name, c, efim::dtype::f16};
  }
  if (name == "1.5b") {  // Qwen2.5-Coder-1.5B: 28 layers of 1536, 12 heads, 2 KV heads, FFN 8960
    c.hidden = 1536;
    c.layers = 28;
    c.heads = 12;
    c.kv_heads = 2;
    c.ffn = 8960;
    return {name, c, efim::dtype::q8_0};
  }
  throw std::runtime_error("unknown shape " + name + " (default, 1.5b)");
}

// redis-server on a free loopback port, in memory only, for the run.
class redis_process {
 public:
  redis_process() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("no free port");
    close(fd);
    port_ = std::to_string(ntohs(a.sin_port));
    pid_ = fork();
    if (pid_ == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      if (null >= 0) dup2(null, STDOUT_FILENO);
      execl("/usr/bin/redis-server", "redis-server", "--port", port_.c_str(), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru", "--loglevel", "warning",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  ~redis_process() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  [[nodiscard]] std::string url() const { return "redis://127.0.0.1:" + port_; }

 private:
  std::string port_;
  pid_t pid_ = -1;
};

efim::engine::completion complete(pipeline& p, const efim::engine::request& r) {
  efim::engine::completion out;
  p.submit(r, {{}, [&](efim::engine::completion&& c) { out = std::move(c); }});
  p.run();
  if (out.error) std::rethrow_exception(out.error);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> shapes{"default", "1.5b"};
  std::size_t tokens = 512, threads = 0;
  std::string url;
  const char* const usage =
      "usage: efim-kv-store-bench [--shapes default,1.5b] [--tokens N] [--threads N] [--redis URL]\n"
      "A prompt's KV blocks computed by the host backend (A) against the same blocks fetched from a Redis\n"
      "KV tier and verified (B), per model shape. Without --redis it starts its own redis-server on\n"
      "loopback. --threads 0 (the default): one per hardware thread.\n";
  const auto count = [&](const std::string& flag, const std::string& v, bool zero) -> std::size_t {
    const bool digits = !v.empty() && v.size() <= 9 && v.find_first_not_of("0123456789") == std::string::npos;
    const std::size_t n = digits ? std::stoul(v) : 0;
    if (!digits || (!zero && n == 0)) {
      std::fprintf(stderr, "efim-kv-store-bench: %s needs a %s number, not '%s'\n", flag.c_str(),
                   zero ? "whole" : "positive", v.c_str());
      std::exit(2);
    }
    return n;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (flag != "--shapes" && flag != "--tokens" && flag != "--threads" && flag != "--redis") {
      std::fprintf(stderr, "efim-kv-store-bench: unknown option %s\n%s", flag.c_str(), usage);
      return 2;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "efim-kv-store-bench: %s needs a value\n%s", flag.c_str(), usage);
      return 2;
    }
    const std::string v = argv[++i];
    if (flag == "--shapes") {
      shapes.clear();
      std::stringstream ss(v);
      for (std::string s; std::getline(ss, s, ',');) {
        try {
          (void)named_shape(s);  // (names the shapes it knows)
        } catch (const std::exception& e) {
          std::fprintf(stderr, "efim-kv-store-bench: %s\n", e.what());
          return 2;
        }
        shapes.push_back(s);
      }
    } else if (flag == "--tokens") {
      tokens = count(flag, v, false);
    } else if (flag == "--threads") {
      threads = count(flag, v, true);
    } else {
      url = v;
    }
  }
  std::optional<redis_process> own;
  if (url.empty()) url = own.emplace().url();

  std::printf("prompt of %zu tokens, blocks of 16, f16 KV; store %s\n", tokens, url.c_str());
  std::printf("%-8s %10s %12s %14s %12s %14s %8s %9s\n", "shape", "KV/block", "A blocks", "compute ms/blk", "B blocks",
              "store ms/blk", "ratio", "same ids");
  for (const auto& name : shapes) {
    const shape s = named_shape(name);
    const auto file = efim::model::open_model(efim::model::random_model(s.cfg, 42, {s.weights}, {}, threads));
    const auto w = file.bind();
    auto tier_options = efim::cache::parse_redis_url(url);
    tier_options.budget = std::chrono::milliseconds(5000);
    efim::cache::redis_tier ta(tier_options), tb(tier_options);
    const auto options = [&](efim::cache::redis_tier& t) {
      efim::engine::pipeline_options o;
      o.cache.block_size = 16;
      o.cache.blocks = tokens / 16 + 8;
      o.schedule.max_batch_tokens = 512;
      o.kv_type = efim::dtype::f16;
      o.threads = threads;
      o.remote = efim::cache::remote_tier_ref(t);
      o.remote_prefix = "efim:bench:" + name + ":";
      return o;
    };
    const efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
    pipeline a(tok, w, options(ta)), b(tok, w, options(tb));
    efim::engine::request r;
    r.infill = false;
    for (std::size_t i = 0; r.prefix.size() < tokens; ++i) r.prefix += "    value_" + std::to_string(i) + " = f(x)\n";
    r.prefix.resize(tokens);
    r.max_tokens = 4;
    r.ignore_eos = true;
    const auto ca = complete(a, r);
    ta.flush();
    const auto cb = complete(b, r);
    const double a_blocks = static_cast<double>(ca.computed_prompt_tokens()) / 16;
    const double compute = ca.prompt_ms() / a_blocks;
    const double b_blocks = static_cast<double>(b.remote_stats().used_blocks);
    const double store = ms(cb.started - cb.submitted).count() / b_blocks;
    std::printf("%-8s %8zu KB %12.1f %14.3f %12.0f %14.3f %7.1fx %9s\n", name.c_str(),
                efim::cache::block_shape{static_cast<std::uint32_t>(s.cfg.layers),
                                         static_cast<std::uint32_t>(s.cfg.kv_heads),
                                         static_cast<std::uint32_t>(s.cfg.head_dim()), 16, efim::dtype::f16}
                        .bytes() >>
                    10,
                a_blocks, compute, b_blocks, store, compute / store, ca.tokens == cb.tokens ? "yes" : "NO");
  }
  return 0;
}
