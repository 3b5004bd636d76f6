// efim-server: an infill server that editors (llama.cpp's /infill: llama.vim, llama.vscode) and
// OpenAI clients (/v1/completions with `suffix`) use unchanged, with server-side EFIM sessions:
// requests are matched to editor sessions by their content, and laid out so that what was typed
// since a session's anchor is appended to a cached prompt.
#include <sys/resource.h>

#include <algorithm>
#include <boost/asio/signal_set.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "arguments.hpp"
#include "default_model.hpp"
#include "efim/efim.hpp"
#include "efim/server/service.hpp"
#include "efim/server/upstream.hpp"
#if EFIM_WITH_REDIS
#include "efim/cache/redis_tier.hpp"
#endif
#include "http/server.hpp"
#include "http/upstream_client.hpp"

namespace {

const char* const usage = R"(usage: efim-server [options]

Serves infill completions over HTTP: llama.cpp's POST /infill (llama.vim, llama.vscode), OpenAI's
POST /v1/completions with `suffix` and GET /v1/models, POST /tokenize, POST /detokenize, GET /health
and GET /metrics (Prometheus). Requests are matched to editor sessions by content (or by an
X-Session-Id header / "session_id" field) and laid out EFIM's way, so each keystroke computes only
the text typed since the session's anchor. Prints the address it listens on; ready when /health
answers 200. SIGINT or SIGTERM: requests in flight finish (or are cancelled after --grace), then it exits.

model
  --model FILE             a GGUF model file (weights and tokenizer; its FIM tokens are detected)
  --alias NAME             the model's name in responses (default: the file name, or efim-default)
  --no-mmap                read the file into memory instead of mapping it (its size in RAM; decode
                           then does not depend on the state of the page cache: see the README)
without --model, the embedded default model: a random-weight Qwen2-architecture model made in memory
  --tokenizer PATH         its vocabulary: a tokenizer.json or .gguf with FIM tokens (default: the
                           Qwen2.5-Coder tokenizer.json that .ci/setup fetches)
  --seed S                 its weights (42)
upstream: an engine elsewhere computes, efim keeps the sessions, layouts and healing
  --upstream URL           http://HOST:PORT of llama.cpp's llama-server, or of a server of OpenAI's
                           /v1/completions that takes prompts of token ids (vLLM, SGLang): prompts go
                           there as token ids, so its prefix cache holds each session's. Its
                           tokenizer: --tokenizer FILE (tokenizer.json or .gguf), or --model FILE.gguf
                           (read for its vocabulary only), checked against the upstream's at start-up
                           (default: the Qwen2.5-Coder tokenizer.json). --ctx caps its context.
  --upstream-api API       llama (/completion: each session kept on one of its slots) or openai
                           (/v1/completions) (llama)
  --upstream-timeout-ms N  longest wait for the upstream's answer, and for each of its tokens (60000)
  --upstream-prompt-budget N
                           prompt tokens the upstream computes at once: later requests wait in efim and
                           go oldest first (llama-server computes waiting prompts in slot order); give
                           llama-server's -b (llama: 2048, its default; openai: 0, no limit)
http
  --host ADDR              address to listen on (127.0.0.1)
  --port N                 port (8012, llama.vim's default; 0 picks a free one)
  --api-key KEY            require "Authorization: Bearer KEY" (repeatable, or comma-separated); each
                           key is a tenant of its own: tenants never share cached KV or sessions
  --api-key-file FILE      keys, one per line
  --max-body-mib N         largest request body (16)
  --max-connections N      open connections at most (1024)
  --timeout S              seconds to read a request, or idle between two (60)
  --http-threads N         threads that parse requests and answer the light endpoints (2)
  --grace S                seconds requests in flight may take to finish at shutdown (10)
  --quiet                  no line per request on stderr
engine
  --ctx N                  tokens of context per request (the model's, at most 32768)
  --parallel N             requests computed at once (16)
  --queue N                requests waiting beyond those; more are answered 503 (256)
  --threads N              compute threads (0: all cores)
  --batch-tokens N         tokens computed per engine step (512)
  --cache-tokens N         KV cache size in tokens (65536) ...
  --cache-mib N            ... or in MiB
  --block-size N           tokens per KV block (16)
  --kv TYPE                KV cache elements: f16 or f32 (f16)
  --products P             int8: quantized weights (q8_0, q4_0, q5_0, q5_1 and the k-quants)
                           multiply activations rounded to 8 bits, as llama.cpp does (prefill
                           1.4-2x as fast as exact, decode 0.85-2x; logits within about 1% of
                           the exact ones, and q8_0 / q4_0 files' equal to llama.cpp's); or
                           exact: f32 activations times the exactly dequantized weights. f32, f16
                           and bf16 weights multiply exactly either way (int8)
  --eviction NAME          cache eviction: lru, fifo, lfu (lru)
  --kv-store URL           redis://HOST[:PORT][/DB]: a KV tier shared by replicas, in Redis or Valkey
                           (run it with maxmemory and allkeys-lru): blocks missing here are read from
                           it (verified: model, tenant, tokens, shape), blocks computed here are
                           written to it behind the requests. A store that is down or slow only
                           costs the time below, and the blocks are computed.
  --kv-store-budget-ms N   longest wait for the store per request (50)
  --format NAME            prompt layout: efim, psm, spm (efim)
  --n-predict N            tokens per /infill request that names none (128)
  --max-predict N          the most tokens one request may ask for (4096)
  --reanchor-bytes N       typed text after which a session starts a new anchor (4096)
  --heal                   token healing: the last tokens before the cursor are generated again so a
                           word cut by the cursor can end in one token (at most 2; a request's
                           "heal_tokens" overrides it)
  --heal-tokens K          the same with at most K tokens (0: off, the default)
  --max-sessions N         editor sessions kept (4096)
  --prepare WHERE          where requests are tokenized, matched to their session and laid out: caller
                           (the HTTP handler thread that received them) or engine (the engine thread,
                           between steps: stalls every other request; for comparison) (caller)
)";

constexpr std::string_view program = "efim-server";

struct options {
  std::string model_path, alias, tokenizer;
  std::uint64_t seed = 42;
  efim_examples::http::server_options http;
  std::vector<std::string> api_keys;
  std::chrono::seconds grace{10};
  bool quiet = false;
  efim::gguf::residency residency = efim::gguf::residency::map;
  std::size_t ctx = 0;  // 0: the model's
  std::size_t parallel = 16, queue = 256, threads = 0, batch_tokens = 512;
  std::size_t cache_tokens = 65536, cache_mib = 0;
  efim::engine::preparation prepare = efim::engine::preparation::caller;
  std::size_t block_size = 16;
  efim::dtype kv = efim::dtype::f16;
  efim::kernels::products products = efim::kernels::products::int8;
  std::string eviction = "lru", format = "efim";
  std::size_t n_predict = 128, max_predict = 4096, reanchor_bytes = 4096, max_sessions = 4096;
  std::size_t heal_tokens = 0;
  std::string upstream;  // empty: compute here
  efim::server::upstream_api upstream_api = efim::server::upstream_api::llama;
  std::chrono::milliseconds upstream_timeout{60000};
  std::optional<std::size_t> upstream_prompt_budget;  // unset: by the API
  std::string kv_store;                               // empty: none
  std::chrono::milliseconds kv_store_budget{50};
};

[[noreturn]] void fail(const std::string& message, int code = 2) { efim_examples::fail(program, message, code); }

std::size_t count(std::string_view flag, const std::string& v, std::size_t min = 0, std::size_t max = SIZE_MAX) {
  const std::size_t n = efim_examples::count(program, flag, v);
  if (n < min || n > max)
    fail(std::string(flag) + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], not " + v);
  return n;
}

void add_keys(std::vector<std::string>& keys, std::string_view text, char separator) {
  std::string key;
  std::istringstream in{std::string(text)};
  while (std::getline(in, key, separator)) {
    while (!key.empty() && (key.back() == '\r' || key.back() == ' ')) key.pop_back();
    if (!key.empty()) keys.push_back(key);
  }
}

options parse(int argc, char** argv) {
  options o;
  efim_examples::for_each_flag(
      argc, argv, program, usage, {"--quiet", "--heal", "--no-mmap"},
      [&](const std::string& flag) {
        if (flag == "--quiet")
          o.quiet = true;
        else if (flag == "--no-mmap")
          o.residency = efim::gguf::residency::read;
        else
          o.heal_tokens = efim::text::default_heal_tokens;
      },
      [&](const std::string& flag, const std::string& v) {
        if (flag == "--model") {
          o.model_path = v;
        } else if (flag == "--alias") {
          o.alias = v;
        } else if (flag == "--tokenizer") {
          o.tokenizer = v;
        } else if (flag == "--seed") {
          o.seed = count(flag, v);
        } else if (flag == "--host") {
          o.http.host = v;
        } else if (flag == "--port") {
          o.http.port = static_cast<std::uint16_t>(count(flag, v, 0, 65535));
        } else if (flag == "--api-key") {
          add_keys(o.api_keys, v, ',');
        } else if (flag == "--api-key-file") {
          std::ifstream in(v);
          if (!in) fail("cannot read --api-key-file " + v, 1);
          std::stringstream text;
          text << in.rdbuf();
          add_keys(o.api_keys, text.str(), '\n');
        } else if (flag == "--max-body-mib") {
          o.http.max_body_bytes = count(flag, v, 1, 4096) << 20;
        } else if (flag == "--max-connections") {
          o.http.max_connections = count(flag, v, 1, 1 << 20);
        } else if (flag == "--timeout") {
          o.http.idle_timeout = std::chrono::seconds(count(flag, v, 1, 86400));
        } else if (flag == "--http-threads") {
          o.http.handler_threads = count(flag, v, 1, 256);
        } else if (flag == "--grace") {
          o.grace = std::chrono::seconds(count(flag, v, 0, 3600));
        } else if (flag == "--ctx") {
          o.ctx = count(flag, v, 16, 1u << 30);
        } else if (flag == "--parallel") {
          o.parallel = count(flag, v, 1, 4096);
        } else if (flag == "--queue") {
          o.queue = count(flag, v, 0, 1 << 20);
        } else if (flag == "--threads") {
          o.threads = count(flag, v, 0, 4096);
        } else if (flag == "--batch-tokens") {
          o.batch_tokens = count(flag, v, 1, 1 << 20);
        } else if (flag == "--cache-tokens") {
          o.cache_tokens = count(flag, v, 1, std::size_t{1} << 32);
          o.cache_mib = 0;
        } else if (flag == "--cache-mib") {
          o.cache_mib = count(flag, v, 1, std::size_t{1} << 24);
        } else if (flag == "--block-size") {
          o.block_size = count(flag, v, 1, 4096);
        } else if (flag == "--kv") {
          try {
            o.kv = efim::parse_dtype(v);
          } catch (const efim::error& e) {
            fail(flag + ": " + e.what());
          }
          if (o.kv != efim::dtype::f16 && o.kv != efim::dtype::f32) fail("--kv must be f16 or f32, not " + v);
        } else if (flag == "--products") {
          try {
            o.products = efim::kernels::parse_products(v);
          } catch (const efim::error& e) {
            fail(std::string("--products: ") + e.what());
          }
        } else if (flag == "--kv-store") {
#if EFIM_WITH_REDIS
          try {
            (void)efim::cache::parse_redis_url(v);
          } catch (const std::exception& e) {
            fail(std::string("--kv-store: ") + e.what());
          }
          o.kv_store = v;
#else
          fail("--kv-store: this efim-server was built without hiredis (libhiredis-dev)");
#endif
        } else if (flag == "--kv-store-budget-ms") {
          o.kv_store_budget = std::chrono::milliseconds(count(flag, v, 1, 60000));
        } else if (flag == "--eviction") {
          if (v != "lru" && v != "fifo" && v != "lfu") fail("--eviction must be lru, fifo or lfu, not " + v);
          o.eviction = v;
        } else if (flag == "--format") {
          if (v != "efim" && v != "psm" && v != "spm") fail("--format must be efim, psm or spm, not " + v);
          o.format = v;
        } else if (flag == "--n-predict") {
          o.n_predict = count(flag, v, 0, 1 << 20);
        } else if (flag == "--max-predict") {
          o.max_predict = count(flag, v, 1, 1 << 20);
        } else if (flag == "--reanchor-bytes") {
          o.reanchor_bytes = count(flag, v, 1);
        } else if (flag == "--heal-tokens") {
          o.heal_tokens = count(flag, v, 0, 16);
        } else if (flag == "--prepare") {
          if (v != "caller" && v != "engine") fail("--prepare must be caller or engine, not " + v);
          o.prepare = v == "engine" ? efim::engine::preparation::engine : efim::engine::preparation::caller;
        } else if (flag == "--upstream") {
          try {
            (void)efim_examples::http::parse_url(v);
          } catch (const std::exception& e) {
            fail(std::string("--upstream: ") + e.what());
          }
          o.upstream = v;
        } else if (flag == "--upstream-api") {
          if (v != "llama" && v != "openai") fail("--upstream-api must be llama or openai, not " + v);
          o.upstream_api = v == "llama" ? efim::server::upstream_api::llama : efim::server::upstream_api::openai;
        } else if (flag == "--upstream-timeout-ms") {
          o.upstream_timeout = std::chrono::milliseconds(count(flag, v, 1, 3600000));
        } else if (flag == "--upstream-prompt-budget") {
          o.upstream_prompt_budget = count(flag, v, 0, 1 << 24);
        } else if (flag == "--max-sessions") {
          o.max_sessions = count(flag, v, 1, 1 << 24);
        } else {
          fail("unknown option " + flag + " (see --help)");
        }
      });
  return o;
}

template <class Format>
using server_pipeline =
    efim::engine::pipeline<Format, efim::cache::xxh3_128_chain, efim::cache::named_eviction, efim::text::at_boundaries,
                           efim::kernels::host, efim::text::bpe_tokenizer>;

// One line per request on stderr: time, endpoint, status, session, change, tokens, milliseconds.
void print_log(const efim::server::request_log& l) {
  static std::mutex mutex;
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &utc);
  std::ostringstream line;
  line << when << " " << l.method << " " << l.path << " " << l.status;
  if (!l.finish.empty())
    line << " session=" << (l.session.empty() ? "-" : l.session) << " change=" << l.change
         << " prompt=" << l.prompt_tokens << " cached=" << l.cached_tokens
         << " computed=" << l.prompt_tokens - l.cached_tokens << " generated=" << l.generated_tokens
         << " finish=" << l.finish;
  char ms[32];
  std::snprintf(ms, sizeof ms, "%.1f", l.ms);
  line << " ms=" << ms;
  if (!l.error.empty()) line << " error=\"" << l.error << "\"";
  std::lock_guard lock(mutex);
  std::cerr << line.str() << "\n" << std::flush;
}

efim::server::service_options service_options(const options& o, const std::string& model_name) {
  efim::server::service_options so;
  so.model_name = model_name;
  so.limits.default_infill_tokens = o.n_predict;
  so.limits.max_new_tokens = o.max_predict;
  so.max_in_flight = o.parallel + o.queue;
  so.api_keys = o.api_keys;
  so.prepare = o.prepare;
  return so;
}

template <class Pipeline>
int run_service(const options& o, Pipeline& p, const efim::server::service_options& so, const std::string& banner,
                std::optional<efim_examples::http::server>& http);

#if EFIM_WITH_REDIS
// The shared KV store's own counters, for /metrics.
void kv_store_metrics(const efim::cache::redis_tier& store, efim::server::metrics_registry& m) {
  const auto s = store.stats();
  m.describe("efim_kv_store_fetches_total", "counter", "Lookups sent to the shared KV store (one per request).");
  m.set("efim_kv_store_fetches_total", {}, static_cast<double>(s.fetches));
  m.describe("efim_kv_store_fetch_seconds_total", "counter", "Time spent waiting for the shared KV store.");
  m.set("efim_kv_store_fetch_seconds_total", {}, static_cast<double>(s.fetch_us) / 1e6);
  m.describe("efim_kv_store_values_total", "counter",
             "Values of the shared KV store: asked for, found, written, dropped (queue full or store failing).");
  m.set("efim_kv_store_values_total", {{"kind", "asked"}}, static_cast<double>(s.keys));
  m.set("efim_kv_store_values_total", {{"kind", "found"}}, static_cast<double>(s.found));
  m.set("efim_kv_store_values_total", {{"kind", "written"}}, static_cast<double>(s.written));
  m.set("efim_kv_store_values_total", {{"kind", "dropped"}}, static_cast<double>(s.dropped));
  m.describe("efim_kv_store_bytes_total", "counter", "Bytes read from and written to the shared KV store.");
  m.set("efim_kv_store_bytes_total", {{"direction", "read"}}, static_cast<double>(s.read_bytes));
  m.set("efim_kv_store_bytes_total", {{"direction", "written"}}, static_cast<double>(s.written_bytes));
  m.describe("efim_kv_store_errors_total", "counter",
             "Failures of the shared KV store (connections, commands, timeouts), and lookups skipped while it is "
             "left alone after one.");
  m.set("efim_kv_store_errors_total", {{"kind", "error"}}, static_cast<double>(s.errors - s.timeouts));
  m.set("efim_kv_store_errors_total", {{"kind", "timeout"}}, static_cast<double>(s.timeouts));
  m.set("efim_kv_store_errors_total", {{"kind", "skipped"}}, static_cast<double>(s.skipped));
}
#endif

template <class Format>
int serve(const options& o, efim::text::bpe_tokenizer tok, const efim::prompt::fim_token_set& fim,
          const efim::model::weights& w, const std::string& model_name) {
  const auto& cfg = w.cfg;
  efim::engine::pipeline_options po;
  po.fim = fim;
  const std::size_t kv_token_bytes = cfg.layers * cfg.kv_dim() * 2 * (o.kv == efim::dtype::f16 ? 2 : 4);
  const std::size_t cache_tokens = o.cache_mib > 0 ? (o.cache_mib << 20) / kv_token_bytes : o.cache_tokens;
  po.cache = {o.block_size, std::max<std::size_t>(1, cache_tokens / o.block_size), true};
  po.schedule = {o.batch_tokens, o.parallel};
  po.session.reanchor_bytes = o.reanchor_bytes;
  po.sessions.max_sessions = o.max_sessions;
  po.kv_type = o.kv;
  po.products = o.products;
  po.threads = o.threads;
  po.heal_tokens = o.heal_tokens;
  auto so = service_options(o, model_name);
#if EFIM_WITH_REDIS
  // Declared before the pipeline, which uses it until it is gone.
  std::optional<efim::cache::redis_tier> store;
  if (!o.kv_store.empty()) {
    auto ro = efim::cache::parse_redis_url(o.kv_store);
    ro.budget = o.kv_store_budget;
    store.emplace(ro);
    po.remote = efim::cache::remote_tier_ref(*store);
    so.more_metrics = [&store](efim::server::metrics_registry& m) { kv_store_metrics(*store, m); };
  }
#endif

  // Declared before the pipeline, so that it goes after it: requests that ended hold their
  // connection until the pipeline lets them go.
  std::optional<efim_examples::http::server> http;
  server_pipeline<Format> p(std::move(tok), w, po, efim::cache::named_eviction(o.eviction));
  std::ostringstream banner;
  banner << program << ": model " << model_name << " (" << efim::model::to_string(cfg.arch) << ", " << cfg.layers
         << " layers, hidden " << cfg.hidden << ", " << efim::to_string(w.type()) << "), tokenizer "
         << p.tokenizer().description() << ", " << fim.family << " FIM tokens; format " << Format::name << "; context "
         << cfg.max_context << "; KV cache " << po.cache.blocks * po.cache.block_size << " tokens ("
         << efim::to_string(o.kv) << ", " << (po.cache.blocks * po.cache.block_size * kv_token_bytes >> 20) << " MiB), "
         << o.eviction << " eviction; " << o.parallel << " parallel"
         << (o.api_keys.empty() ? "" : "; API keys required")
         << (efim::kernels::int8_products(w.type())
                 ? (o.products == efim::kernels::products::int8 ? "; int8 products" : "; exact products")
                 : "")
         << (o.kv_store.empty() ? "" : "; shared KV store " + o.kv_store);
  for (const auto& t : p.decode_tuning())  // (the pipeline timed both kinds of one-row decode tiles)
    banner << "; " << efim::to_string(t.type) << " decode tiles: " << efim::kernels::decode_tiles_name(t.chosen) << " ("
           << std::fixed << std::setprecision(2) << t.streams_over_prefetched() << "x streams over prefetched, timed)";
  return run_service(o, p, so, banner.str(), http);
}

// efim-server in front of another engine: sessions, layouts, tokens and healing here, the compute there.
template <class Format>
int serve_upstream(const options& o, efim::text::bpe_tokenizer tok, const efim::prompt::fim_token_set& fim,
                   const std::string& alias) {
  efim_examples::http::upstream_client client(efim_examples::http::parse_url(o.upstream));
  const auto info = efim::server::read_upstream(client, o.upstream_api, tok, fim, o.upstream_timeout);
  efim::server::upstream_options uo;
  uo.api = o.upstream_api;
  uo.model = info.model;
  uo.prepare.fim = fim;
  uo.prepare.session.reanchor_bytes = o.reanchor_bytes;
  uo.prepare.sessions.max_sessions = o.max_sessions;
  uo.prepare.heal_tokens = o.heal_tokens;
  uo.context =
      info.context == 0 ? (o.ctx == 0 ? 4096 : o.ctx) : (o.ctx == 0 ? info.context : std::min(o.ctx, info.context));
  uo.slots = o.upstream_api == efim::server::upstream_api::llama ? info.slots : 0;
  uo.timeout = o.upstream_timeout;
  uo.prompt_budget = o.upstream_prompt_budget.value_or(uo.api == efim::server::upstream_api::llama ? 2048 : 0);
  uo.vocab = info.vocab;
  const std::string model_name = !alias.empty() ? alias : info.model.empty() ? "efim-upstream" : info.model;

  using pipeline = efim::server::upstream_pipeline<Format, efim::text::at_boundaries, efim::text::bpe_tokenizer,
                                                   efim::text::heal_trailing, efim_examples::http::upstream_client>;
  std::optional<efim_examples::http::server> http;
  pipeline p(std::move(tok), client, uo);
  std::ostringstream banner;
  banner << program << ": upstream " << o.upstream << " (" << info.description << "), tokenizer "
         << p.tokenizer().description() << ", " << fim.family << " FIM tokens; format " << Format::name << "; context "
         << uo.context << (uo.slots ? "; sessions kept on the upstream's slots" : "")
         << (uo.prompt_budget ? "; prompt budget " + std::to_string(uo.prompt_budget) + " tokens" : "")
         << (o.api_keys.empty() ? "" : "; API keys required");
  return run_service(o, p, service_options(o, model_name), banner.str(), http);
}

// The service over `p` behind HTTP until SIGINT or SIGTERM.
template <class Pipeline>
int run_service(const options& o, Pipeline& p, const efim::server::service_options& so, const std::string& banner,
                std::optional<efim_examples::http::server>& http) {
  efim::server::service<Pipeline> svc(p, so);
  if (!o.quiet) svc.set_logger(print_log);
  http.emplace(o.http, [&svc](efim::server::http_request r, std::shared_ptr<efim::server::response_channel> ch) {
    svc.handle(std::move(r), std::move(ch));
  });
  std::cerr << banner << "\n";
  const auto at = http->endpoint();
  std::cout << program << ": listening on http://" << at.address().to_string() << ":" << at.port() << std::endl;

  boost::asio::signal_set signals(http->io(), SIGINT, SIGTERM);
  std::thread stopper;
  std::function<void(const boost::system::error_code&, int)> on_signal = [&](const boost::system::error_code& ec,
                                                                             int sig) {
    if (ec) return;
    if (stopper.joinable()) std::_Exit(128 + sig);  // a second signal: at once
    std::cerr << program << ": signal " << sig << ": finishing " << svc.in_flight() << " requests, then exiting\n";
    stopper = std::thread([&] {
      svc.drain(o.grace);
      http->stop();
      boost::asio::post(http->io(), [&] { signals.cancel(); });
    });
    signals.async_wait(on_signal);
  };
  signals.async_wait(on_signal);
  try {
    http->run();
  } catch (...) {
    svc.drain(std::chrono::milliseconds(0));
    if (stopper.joinable()) stopper.join();
    throw;
  }
  if (stopper.joinable()) stopper.join();
  std::cerr << program << ": stopped\n";
  return 0;
}

// Open files: the soft limit raised to the hard one, and room kept for the model, the listening
// socket and the rest; more connections than that are refused with 503 rather than failing to accept.
std::size_t connections_allowed(std::size_t wanted) {
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0) return wanted;
  if (files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
    getrlimit(RLIMIT_NOFILE, &files);
  }
  const auto usable = files.rlim_cur > 128 ? static_cast<std::size_t>(files.rlim_cur) - 64 : 64;
  if (wanted > usable)
    std::cerr << program << ": at most " << usable << " connections (open files limited to " << files.rlim_cur << ")\n";
  return std::min(wanted, usable);
}

int run_upstream(const options& o) {
  efim::text::bpe_tokenizer tok = [&] {
    if (!o.model_path.empty()) return efim::text::load_bpe(o.model_path);  // the vocabulary only
    const std::string path = o.tokenizer.empty() ? EFIM_DEFAULT_TOKENIZER : o.tokenizer;
    efim::require(std::filesystem::exists(path), efim::errc::io,
                  "no tokenizer " + path + " (run .ci/setup to fetch it, or give --tokenizer or --model)");
    return efim::text::load_bpe(path);
  }();
  const auto* fim = efim::prompt::detect_token_set(tok);
  efim::require(fim != nullptr, efim::errc::invalid_argument, "the tokenizer has no FIM tokens of a known family");
  if (o.format == "psm") return serve_upstream<efim::prompt::psm>(o, std::move(tok), *fim, o.alias);
  if (o.format == "spm") return serve_upstream<efim::prompt::spm>(o, std::move(tok), *fim, o.alias);
  return serve_upstream<efim::prompt::efim_format>(o, std::move(tok), *fim, o.alias);
}

int run(options o) {
  o.http.max_connections = connections_allowed(o.http.max_connections);
  if (!o.upstream.empty() && !o.kv_store.empty())
    fail("--kv-store: with --upstream the KV is the upstream's; give one or the other");
  if (!o.upstream.empty()) return run_upstream(o);
  std::string model_name = o.alias;
  std::optional<efim::model::model_file> file;
  if (!o.model_path.empty()) {
    file.emplace(efim::model::open_model(o.model_path, o.residency));
    if (model_name.empty()) model_name = std::filesystem::path(o.model_path).filename().string();
  } else {
    const std::string tokenizer = o.tokenizer.empty() ? EFIM_DEFAULT_TOKENIZER : o.tokenizer;
    efim::require(std::filesystem::exists(tokenizer), efim::errc::io,
                  "no tokenizer " + tokenizer + " for the embedded model (run .ci/setup to fetch it, or give --model)");
    file.emplace(efim::model::open_model(efim_examples::random_model_file(
        efim_examples::default_model_config(), tokenizer, 0, o.seed, efim::dtype::f16, o.threads)));
    if (model_name.empty()) model_name = "efim-default";
  }
  auto w = file->bind();
  auto tok = efim::text::load_bpe_gguf(file->meta);
  const auto* fim = efim::prompt::detect_token_set(tok);
  efim::require(fim != nullptr, efim::errc::invalid_argument,
                "the model's tokenizer has no FIM tokens of a known family");
  w.cfg.max_context = std::min(w.cfg.max_context, o.ctx == 0 ? std::size_t{32768} : o.ctx);
  if (o.format == "psm") return serve<efim::prompt::psm>(o, std::move(tok), *fim, w, model_name);
  if (o.format == "spm") return serve<efim::prompt::spm>(o, std::move(tok), *fim, w, model_name);
  return serve<efim::prompt::efim_format>(o, std::move(tok), *fim, w, model_name);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {  // efim::error (bad model, tokenizer), an address in use, ...
    fail(e.what(), 1);
  }
}
