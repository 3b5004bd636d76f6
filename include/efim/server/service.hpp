#pragma once
// The HTTP handlers of an infill server over one pipeline: llama.cpp's /infill, OpenAI's
// /v1/completions and /v1/models, /tokenize, /detokenize, /health and Prometheus /metrics. Requests
// are matched to editor sessions by content (or by the client's session key), batched by one
// engine thread, streamed as server-sent events, cancelled when their client goes away.
//
// The service knows no HTTP library: a transport turns bytes into http_request values and gives each
// a response_channel. handle() may be called from any number of threads at once.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/engine/async_runner.hpp"
#include "efim/engine/request.hpp"
#include "efim/model/config.hpp"
#include "efim/server/api.hpp"
#include "efim/server/http.hpp"
#include "efim/server/metrics.hpp"
#include "efim/text/detokenizer.hpp"

namespace efim::server {

struct service_options {
  std::string model_name = "efim";
  generation_limits limits{};
  std::size_t max_in_flight = 256;    // generation requests admitted at once (running and queued); more get 503
  std::vector<std::string> api_keys;  // empty: no authentication; else each key is a tenant of its own
  // Where generation requests are prepared (tokenized, matched to their session, laid out): on the
  // handler thread that received them (the default), or on the engine thread (for comparison only).
  engine::preparation prepare = engine::preparation::caller;
  // Called as /metrics is read (on the engine thread), to add what only the program knows (its
  // shared KV store's own counters, say); it describes and sets its metrics on the registry.
  std::function<void(metrics_registry&)> more_metrics;
};

// What the service says of each request it answered.
struct request_log {
  std::string method, path;
  int status = 0;
  std::string session;  // empty: none
  std::string change;   // the session change kind ("none" without a session)
  std::size_t prompt_tokens = 0, cached_tokens = 0, generated_tokens = 0;
  double ms = 0;
  std::string finish;  // how the generation ended; empty for other requests
  std::string error;   // the message of an error response
};

template <class Pipeline>
class service {
 public:
  using clock = std::chrono::steady_clock;

  // `p` must outlive the service; the service drives it from a thread of its own.
  service(Pipeline& p, service_options options)
      : p_(&p), options_(std::move(options)), started_(std::chrono::system_clock::now()),
        runner_(p, {.prepare = options_.prepare}) {
    describe_metrics();
  }

  service(const service&) = delete;
  service& operator=(const service&) = delete;

  void set_logger(std::function<void(const request_log&)> log) { log_ = std::move(log); }

  [[nodiscard]] metrics_registry& metrics() noexcept { return metrics_; }
  [[nodiscard]] std::size_t in_flight() const noexcept { return in_flight_.load(); }

  void handle(http_request req, std::shared_ptr<response_channel> ch) {
    const auto start = clock::now();
    const std::string path(req.path());
    const api_kind kind = path.starts_with("/v1/") ? api_kind::openai : api_kind::llama;
    try {
      const auto route = find_route(path);
      if (!route) throw api_error(404, "not_found_error", "no endpoint " + path);
      if (req.method != route->method)
        throw api_error(405, "invalid_request_error",
                        path + " answers " + std::string(route->method) + ", not " + req.method);
      if (route->needs_key) authenticate(req);
      (this->*route->handler)(req, ch, start);
    } catch (const api_error& e) {
      answer_error(req, *ch, kind, e, start);
    } catch (const efim::error& e) {  // the tokenizer's, say: the client's input, a 4xx
      answer_error(req, *ch, kind, to_api_error(e), start);
    } catch (const std::exception& e) {  // out of memory, say: a 500, and the server goes on
      answer_error(req, *ch, kind, api_error(500, "server_error", e.what()), start);
    }
  }

  // The answer to a request that failed with `x`: 400 for what the client sent (text, ids, a prompt
  // too long), 5xx where this server or the engine behind it failed.
  [[nodiscard]] api_error to_api_error(const efim::error& x) const {
    switch (x.code()) {
      case errc::invalid_argument:
      case errc::invalid_utf8:
      case errc::unknown_token:
        return {400, "invalid_request_error", x.what()};
      case errc::too_long:
      case errc::out_of_blocks:
        return {400, "exceed_context_size_error", x.what()};
      case errc::unavailable:
        return engine_stopped();
      case errc::upstream:  // the engine behind this server (server::upstream_pipeline)
        return {502, "server_error", x.what()};
      case errc::upstream_busy:
        return {503, "unavailable_error", x.what()};
      case errc::upstream_timeout:
        return {504, "server_error", x.what()};
      case errc::io:
        break;
    }
    return {500, "server_error", x.what()};
  }

  // Refuses new generation requests (503), lets those in flight finish for up to `grace`, then
  // cancels the rest; each of them is answered.
  void drain(std::chrono::milliseconds grace) {
    std::unique_lock lock(drain_mutex_);
    draining_ = true;
    drained_.wait_for(lock, grace, [&] { return in_flight_.load() == 0; });
    lock.unlock();
    runner_.stop();
  }

 private:
  struct route {
    std::string_view path, method;
    bool needs_key;
    void (service::*handler)(http_request&, const std::shared_ptr<response_channel>&, clock::time_point);
  };

  // A generation request from its admission to its answer (its callbacks run on the engine thread).
  struct call {
    api_kind kind = api_kind::llama;
    generation_params params;
    response_context context;
    std::shared_ptr<response_channel> channel;
    std::string method, path;
    clock::time_point start;
    bool streaming_started = false;
    std::size_t predicted = 0;
  };

  // (A constant table: nothing of it is destroyed at exit while handler threads still look in it.)
  static std::optional<route> find_route(std::string_view path) {
    static constexpr route routes[]{
        {"/health", "GET", false, &service::health},
        {"/v1/health", "GET", false, &service::health},
        {"/v1/models", "GET", false, &service::models},
        {"/models", "GET", false, &service::models},
        {"/metrics", "GET", true, &service::prometheus},
        {"/infill", "POST", true, &service::infill},
        {"/v1/completions", "POST", true, &service::completions},
        {"/completions", "POST", true, &service::completions},
        {"/tokenize", "POST", true, &service::tokenize},
        {"/detokenize", "POST", true, &service::detokenize},
    };
    for (const auto& r : routes)
      if (r.path == path) return r;
    return std::nullopt;
  }

  void describe_metrics() {
    metrics_.describe("efim_requests_total", "counter", "Requests answered, by endpoint, status and session change.");
    metrics_.describe("efim_requests_finished_total", "counter",
                      "Generation requests by how they ended (eos, length, stop, indent, time_limit, cancelled, "
                      "superseded, error).");
    metrics_.describe("efim_prompt_tokens_total", "counter", "Prompt tokens of generation requests.");
    metrics_.describe("efim_prompt_tokens_cached_total", "counter", "Prompt tokens whose KV came from the cache.");
    metrics_.describe("efim_generated_tokens_total", "counter", "Tokens generated.");
    metrics_.describe("efim_accepted_tokens_reused_total", "counter",
                      "Generated tokens reused as prompt after the client typed them (accepted suggestions).");
    metrics_.describe("efim_request_duration_seconds", "histogram", "Time from a request to its answer.");
    metrics_.describe("efim_time_to_first_token_seconds", "histogram",
                      "Time from a request to its first generated token.");
    metrics_.describe("efim_kv_blocks", "gauge", "KV cache blocks: used by requests, cached for reuse, free.");
    metrics_.describe("efim_kv_evicted_blocks_total", "counter", "Cached KV blocks evicted for new KV.");
    metrics_.describe("efim_requests_in_flight", "gauge", "Generation requests admitted and not yet answered.");
    metrics_.describe("efim_requests_waiting", "gauge", "Generation requests waiting for room in a batch.");
    metrics_.describe("efim_sessions", "gauge", "Editor sessions the server keeps.");
    metrics_.describe("efim_engine_busy_seconds_total", "counter",
                      "The engine thread's time: computing steps, and queuing requests (prepared on the handler "
                      "threads).");
    metrics_.describe("efim_callback_failures_total", "counter",
                      "Exceptions from a request's completion callback that no answer could carry.");
    if constexpr (requires(const Pipeline& p) { p.remote_stats(); })
      metrics_.describe("efim_kv_remote_blocks_total", "counter",
                        "KV blocks and the shared KV tier: asked for, found (verified), refused (another model, "
                        "tenant, prefix or shape, or damaged), used instead of computed, stored.");
  }

  // ---- endpoints ----

  void health(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    require_engine();
    answer(req, *ch, {200, "application/json", dump(json{{"status", "ok"}})}, start);
  }

  void models(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    json meta;
    if constexpr (requires { p_->model_config(); }) {
      const auto& cfg = p_->model_config();
      meta = {{"architecture", model::to_string(cfg.arch)},
              {"n_ctx", cfg.max_context},
              {"n_vocab", cfg.vocab},
              {"n_embd", cfg.hidden},
              {"n_layer", cfg.layers}};
    } else {  // an engine elsewhere computes (server::upstream_pipeline)
      meta = {{"n_ctx", p_->context()}, {"n_vocab", p_->tokenizer().vocab_size()}};
    }
    meta["format"] = Pipeline::format::name;
    meta["fim_tokens"] = p_->preparation().fim.family;
    const json model = {
        {"id", options_.model_name},
        {"object", "model"},
        {"created", std::chrono::duration_cast<std::chrono::seconds>(started_.time_since_epoch()).count()},
        {"owned_by", "efim"},
        {"meta", meta}};
    answer(req, *ch, {200, "application/json", dump(json{{"object", "list"}, {"data", json::array({model})}})}, start);
  }

  void prometheus(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    // The pipeline's state is read between two engine steps; the answer goes from there.
    auto done = std::make_shared<std::atomic<bool>>(false);
    auto body = [this, done, req, ch, start](const Pipeline* p) mutable {
      if (done->exchange(true)) return;
      try {
        read_gauges(p);
        answer(req, *ch, {200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render()}, start);
      } catch (const std::exception& e) {
        answer_error(req, *ch, api_kind::llama, api_error(500, "server_error", e.what()), start);
      }
    };
    auto read = runner_.call([body](Pipeline& p) mutable { body(&p); });
    if (read.wait_for(std::chrono::seconds(0)) == std::future_status::ready) try {
        read.get();
      } catch (const std::exception&) {
        body(nullptr);  // the engine has stopped: what the counters say
      }
  }

  // The gauges of the pipeline's state (null: the engine has stopped; only what the service knows).
  void read_gauges(const Pipeline* p) {
    if constexpr (requires { p->cache(); }) {
      if (p != nullptr) read_cache_gauges(*p);
    }
    if constexpr (requires { p->remote_stats(); }) {
      if (p != nullptr) {
        const auto& r = p->remote_stats();
        const auto set = [&](const char* kind, std::uint64_t n) {
          metrics_.set("efim_kv_remote_blocks_total", {{"kind", kind}}, static_cast<double>(n));
        };
        set("asked", r.asked_blocks);
        set("found", r.found_blocks);
        set("refused", r.refused_blocks);
        set("used", r.used_blocks);
        set("stored", r.stored_blocks);
      }
    }
    if (options_.more_metrics) options_.more_metrics(metrics_);
    if (p != nullptr) {
      metrics_.set("efim_requests_waiting", {}, static_cast<double>(p->waiting()));
      metrics_.set("efim_sessions", {}, static_cast<double>(p->sessions()));
    }
    metrics_.set("efim_requests_in_flight", {}, static_cast<double>(in_flight_.load()));
    const auto spent = runner_.stats();
    metrics_.set("efim_engine_busy_seconds_total", {{"work", "steps"}}, spent.step_ms / 1000.0);
    metrics_.set("efim_engine_busy_seconds_total", {{"work", "requests"}},
                 (spent.prepare_ms + spent.enqueue_ms) / 1000.0);
    metrics_.set("efim_callback_failures_total", {}, static_cast<double>(p_->callback_failures()));
  }

  void read_cache_gauges(const Pipeline& p) {
    const auto& cache = p.cache();
    const double free = static_cast<double>(cache.free_blocks());
    const double cached = static_cast<double>(cache.evictable_blocks());
    metrics_.set("efim_kv_blocks", {{"state", "free"}}, free);
    metrics_.set("efim_kv_blocks", {{"state", "cached"}}, cached);
    metrics_.set("efim_kv_blocks", {{"state", "used"}}, static_cast<double>(cache.capacity()) - free - cached);
    metrics_.set("efim_kv_evicted_blocks_total", {}, static_cast<double>(cache.stats().evicted_blocks));
  }

  void tokenize(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    const json body = parse_body(req.body);
    const fields f(body);
    if (!f.has("content")) throw invalid_request("\"content\" is required", "content");
    const std::string content = *f.string("content");
    const auto& tok = p_->tokenizer();
    const auto& fim = p_->preparation().fim;
    std::vector<token_id> ids;
    if (f.boolean("add_special").value_or(false) && fim.add_bos && !fim.bos.empty())
      if (const auto bos = tok.special_id(fim.bos)) ids.push_back(*bos);
    if constexpr (requires { tok.encode_special(content, ids); }) {
      if (f.boolean("parse_special").value_or(true))
        tok.encode_special(content, ids);
      else
        tok.encode(content, ids);
    } else {
      (void)f.boolean("parse_special");
      tok.encode(content, ids);
    }
    json tokens = json::array();
    if (f.boolean("with_pieces").value_or(false)) {
      for (const token_id id : ids) {
        const std::string_view piece = tok.token_bytes(id);
        json bytes = json::array();
        for (const unsigned char b : piece) bytes.push_back(b);
        tokens.push_back({{"id", id}, {"piece", utf8::is_valid(piece) ? json(piece) : bytes}});
      }
    } else {
      tokens = ids;
    }
    answer(req, *ch, {200, "application/json", dump(json{{"tokens", tokens}})}, start);
  }

  void detokenize(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    const json body = parse_body(req.body);
    const fields f(body);
    if (!f.has("tokens")) throw invalid_request("\"tokens\" is required", "tokens");
    const auto& list = f.raw("tokens");
    if (!list.is_array()) throw invalid_request("\"tokens\" must be an array of token ids", "tokens");
    const auto& tok = p_->tokenizer();
    text::detokenizer<typename Pipeline::tokenizer_type> detok(tok, true);
    std::string content;
    for (const auto& t : list) {
      if (!t.is_number_integer() || t.get<std::int64_t>() < 0 ||
          t.get<std::int64_t>() >= static_cast<std::int64_t>(tok.vocab_size()))
        throw api_error(
            400, "invalid_request_error",
            "unknown token id " + t.dump() + " (the vocabulary has " + std::to_string(tok.vocab_size()) + " tokens)",
            "tokens");
      detok.push(static_cast<token_id>(t.get<std::int64_t>()), content);
    }
    detok.flush(content);
    answer(req, *ch, {200, "application/json", dump(json{{"content", content}})}, start);
  }

  void infill(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    generate(api_kind::llama, req, ch, start);
  }

  void completions(http_request& req, const std::shared_ptr<response_channel>& ch, clock::time_point start) {
    generate(api_kind::openai, req, ch, start);
  }

  // ---- generation ----

  void generate(api_kind kind, http_request& req, const std::shared_ptr<response_channel>& ch,
                clock::time_point start) {
    require_engine();
    const json body = parse_body(req.body);
    auto c = std::make_shared<call>();
    c->kind = kind;
    c->params = kind == api_kind::llama ? parse_infill(body, options_.limits) : parse_completion(body, options_.limits);
    c->channel = ch;
    c->method = req.method;
    c->path = req.path();
    c->start = start;
    auto& p = c->params;
    auto& r = p.request;
    r.tenant = tenant(req, p.cache_salt);
    const std::string_view header_session = req.header_value("X-Session-Id");
    r.session = header_session.empty() ? p.session_id : std::string(header_session);
    auto& ctx = c->context;
    ctx.model = options_.model_name;
    ctx.format = r.infill ? std::string(Pipeline::format::name) : "plain";
    ctx.session = r.session;
    if (kind == api_kind::openai) ctx.id = completion_id();
    ctx.created =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();

    if (in_flight_.fetch_add(1) >= options_.max_in_flight) {
      release_slot();
      throw api_error(503, "unavailable_error",
                      "the server is busy: " + std::to_string(options_.max_in_flight) + " requests in flight");
    }
    engine::stream out;
    if (p.stream) out.on_token = [this, c](const engine::token_event& e) { on_token(*c, e); };
    out.on_done = [this, c](engine::completion&& done) { on_done(*c, std::move(done)); };
    const auto ticket = runner_.submit(r, std::move(out));
    ch->on_disconnect([this, ticket] { runner_.cancel(ticket); });
  }

  void on_token(call& c, const engine::token_event& e) {
    ++c.predicted;
    if (!c.streaming_started) {
      c.channel->begin_stream(200, "text/event-stream");
      c.streaming_started = true;
    }
    if (c.kind == api_kind::llama)
      c.channel->stream(sse(infill_partial(e.text, e.token, c.predicted, e.prompt_tokens, c.params.return_tokens)));
    else if (!e.text.empty())
      c.channel->stream(sse(openai_chunk(e.text, c.context, std::nullopt)));
  }

  void on_done(call& c, engine::completion&& done) {
    release_slot();  // before the answer: a client that sends its next request at once finds room
    if (done.error) {
      answer_generation_error(c, done);
    } else {
      if (c.context.session.empty()) c.context.session = done.session;
      count_generation(c, done);
      if (c.params.stream) {
        if (!c.streaming_started) c.channel->begin_stream(200, "text/event-stream");
        if (c.kind == api_kind::llama) {
          auto final = done;
          final.text = done.tail;  // the rest was streamed already (llama.cpp sends "" there)
          c.channel->stream(sse(infill_final(final, c.params, c.context)));
        } else {
          c.channel->stream(sse(openai_chunk(done.tail, c.context, openai_finish_reason(done.reason))));
          if (c.params.include_usage) {
            json usage = openai_head(c.context);
            usage["choices"] = json::array();
            usage["usage"] = openai_usage(done);
            c.channel->stream(sse(usage));
          }
          c.channel->stream("data: [DONE]\n\n");
        }
        c.channel->end_stream();
      } else {
        const json body =
            c.kind == api_kind::llama ? infill_final(done, c.params, c.context) : openai_final(done, c.context);
        c.channel->respond({200, "application/json", dump(body)});
      }
      log(c.method, c.path, 200, c.context.session, done, c.start, {});
    }
  }

  void answer_generation_error(call& c, const engine::completion& done) {
    api_error e(500, "server_error", "the request failed");
    try {
      std::rethrow_exception(done.error);
    } catch (const efim::error& x) {
      e = to_api_error(x);
    } catch (const std::exception& x) {
      e = api_error(500, "server_error", x.what());
    }
    if (c.streaming_started) {
      c.channel->stream(sse(json::parse(error_body(c.kind, e))));
      c.channel->end_stream();
    } else {
      c.channel->respond({e.status(), "application/json", error_body(c.kind, e)});
    }
    count(c.path, e.status(), "none");
    metrics_.add("efim_requests_finished_total", {{"finish", "error"}});
    log(c.method, c.path, e.status(), {}, done, c.start, e.what());
  }

  // 503 while shutting down, or once the engine has failed (and /health says so).
  [[nodiscard]] api_error engine_stopped() const {
    if (draining_) return {503, "unavailable_error", "the server is shutting down"};
    std::string why = "the engine has stopped";
    try {
      if (const auto failure = runner_.failure()) std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      why += ": " + std::string(e.what());
    }
    return {503, "unavailable_error", why};
  }

  void require_engine() const {
    if (draining_ || !runner_.running()) throw engine_stopped();
  }

  void count_generation(const call& c, const engine::completion& done) {
    const std::string change = done.session.empty() ? "none" : std::string(prompt::to_string(done.session_change));
    count(c.path, 200, change);
    metrics_.add("efim_requests_finished_total", {{"finish", std::string(engine::to_string(done.reason))}});
    metrics_.add("efim_prompt_tokens_total", {}, static_cast<double>(done.prompt_tokens));
    metrics_.add("efim_prompt_tokens_cached_total", {}, static_cast<double>(done.cached_tokens));
    metrics_.add("efim_generated_tokens_total", {}, static_cast<double>(done.generated_tokens()));
    metrics_.add("efim_accepted_tokens_reused_total", {}, static_cast<double>(done.reused_tokens));
    const labels endpoint{{"endpoint", c.path}};
    metrics_.observe("efim_request_duration_seconds", endpoint,
                     std::chrono::duration<double>(clock::now() - c.start).count());
    if (done.generated_tokens() > 0)
      metrics_.observe("efim_time_to_first_token_seconds", endpoint,
                       std::chrono::duration<double>(done.first_token - c.start).count());
  }

  // Counted by endpoint; paths that are none (any string a client sends) share one label.
  void count(const std::string& path, int status, const std::string& change) {
    const std::string endpoint = find_route(path) ? path : "other";
    metrics_.add("efim_requests_total",
                 {{"endpoint", endpoint}, {"status", std::to_string(status)}, {"change", change}});
  }

  void release_slot() {
    std::lock_guard lock(drain_mutex_);
    in_flight_.fetch_sub(1);
    drained_.notify_all();
  }

  // ---- answers, logs, identity ----

  void answer(const http_request& req, response_channel& ch, http_response r, clock::time_point start) {
    const int status = r.status;
    ch.respond(std::move(r));
    count(std::string(req.path()), status, "none");
    log(req.method, std::string(req.path()), status, {}, std::nullopt, start, {});
  }

  void answer_error(const http_request& req, response_channel& ch, api_kind kind, const api_error& e,
                    clock::time_point start) {
    ch.respond({e.status(), "application/json", error_body(kind, e)});
    count(std::string(req.path()), e.status(), "none");
    log(req.method, std::string(req.path()), e.status(), {}, std::nullopt, start, e.what());
  }

  void log(const std::string& method, const std::string& path, int status, const std::string& session,
           const std::optional<engine::completion>& done, clock::time_point start, const std::string& error) {
    if (!log_) return;
    request_log l;
    l.method = method;
    l.path = path;
    l.status = status;
    l.session = session;
    l.change = "none";
    if (done && !done->session.empty()) l.change = prompt::to_string(done->session_change);
    if (done && !done->error) {
      l.prompt_tokens = done->prompt_tokens;
      l.cached_tokens = done->cached_tokens;
      l.generated_tokens = done->generated_tokens();
      l.finish = engine::to_string(done->reason);
    }
    l.ms = std::chrono::duration<double, std::milli>(clock::now() - start).count();
    l.error = error;
    log_(l);
  }

  void authenticate(const http_request& req) const {
    if (options_.api_keys.empty()) return;
    if (key_index(req) < 0) throw api_error(401, "authentication_error", "Invalid API Key");
  }

  // The position of the request's key among the server's keys; -1 if it has none of them.
  int key_index(const http_request& req) const {
    std::string_view key = req.header_value("X-Api-Key");
    if (const auto auth = req.header_value("Authorization"); auth.size() > 7 && iequals(auth.substr(0, 7), "Bearer "))
      key = auth.substr(7);
    for (std::size_t i = 0; i < options_.api_keys.size(); ++i)
      if (equal_in_constant_time(key, options_.api_keys[i])) return static_cast<int>(i);
    return -1;
  }

  static bool equal_in_constant_time(std::string_view a, std::string_view b) noexcept {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (std::size_t i = 0; i < b.size(); ++i) diff |= static_cast<unsigned char>(b[i] ^ (i < a.size() ? a[i] : 0));
    return diff == 0;
  }

  // The cache salt of a request: its API key (each key a tenant of its own) and its cache_salt field.
  std::string tenant(const http_request& req, const std::string& salt) const {
    std::string t;
    if (!options_.api_keys.empty()) t = "key" + std::to_string(key_index(req));
    if (!salt.empty()) t += "/salt:" + salt;
    return t;
  }

  static std::string completion_id() {
    thread_local std::mt19937_64 random{std::random_device{}()};
    static constexpr char digits[] = "0123456789abcdef";
    std::string id = "cmpl-";
    for (int i = 0; i < 24; ++i) id += digits[random() % 16];
    return id;
  }

  Pipeline* p_;
  service_options options_;
  std::chrono::system_clock::time_point started_;
  metrics_registry metrics_;
  std::function<void(const request_log&)> log_;
  std::atomic<std::size_t> in_flight_{0};
  std::mutex drain_mutex_;
  std::condition_variable drained_;
  std::atomic<bool> draining_{false};
  engine::async_runner<Pipeline> runner_;  // last: its thread starts after everything it uses
};

}  // namespace efim::server
