#pragma once
// An engine behind HTTP that computes for efim: llama.cpp's llama-server (/completion), or any server
// of OpenAI's /v1/completions that takes a prompt of token ids (vLLM, SGLang, llama-server). efim keeps
// the editor sessions, lays each prompt out (EFIM, PSM, SPM), tokenizes it and heals its end; the
// upstream gets the prompt as token ids, so its prefix cache sees exactly the ids of the session's
// earlier requests. (Text would be tokenized again there, and the typed end of an EFIM prompt, cut
// mid-word, would tokenize differently from the ids the cache holds: the cached prefix would break
// a few tokens before the end, or anywhere the upstream's pre-tokenizer joins differently.)
//
// upstream_pipeline is a runnable pipeline (engine::async_runner drives it, server::service serves
// it): its requests are prepared as engine::pipeline's are (engine::request_preparer), and its
// generated tokens go the same way to the client (engine::generation: healing, detokenizer, stop
// rules, limits). The HTTP client is a policy, upstream_transport (the library names no HTTP
// library): its events arrive on its own threads and are handed to the engine thread.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/utf8.hpp"
#include "efim/engine/preparation.hpp"
#include "efim/engine/request.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/server/api.hpp"
#include "efim/server/sse.hpp"
#include "efim/text/healing.hpp"

namespace efim::server {

// ---- the transport ----

// One HTTP exchange with the upstream.
struct upstream_call {
  std::string method = "POST";
  std::string path;  // "/completion"
  std::string body;  // JSON (empty for GET)
  // Longest wait for the connection, the response's head, and each piece of its body.
  std::chrono::milliseconds timeout{30000};
};

// What a transport reports of an exchange, from a thread of its own: the status once, the body in
// pieces as they arrive (a chunked body already de-chunked), then the end once: `error` empty when
// the body ended, else why the exchange failed (the connection refused or reset, `timed_out`).
struct upstream_handlers {
  std::function<void(int status)> on_status;
  std::function<void(std::string_view data)> on_body;
  std::function<void(const std::string& error, bool timed_out)> on_end;
};

// An HTTP client for the upstream: start() begins an exchange and returns its id at once; abort()
// closes it (its on_end may still come, or not). Both may be called from any thread.
template <class X>
concept upstream_transport = requires(X& x, upstream_call c, upstream_handlers h, std::uint64_t id) {
  { x.start(std::move(c), std::move(h)) } -> std::same_as<std::uint64_t>;
  x.abort(id);
};

struct upstream_reply {
  int status = 0;
  std::string body;
};

// The error a failed exchange or an error status stands for; the upstream's own message is kept.
inline error upstream_failure(int status, std::string_view body, const std::string& transport_error = {},
                              bool timed_out = false) {
  if (timed_out) return error(errc::upstream_timeout, "the upstream did not answer in time: " + transport_error);
  if (!transport_error.empty()) return error(errc::upstream, "the upstream failed: " + transport_error);
  std::string message;
  try {
    const json j = json::parse(body);
    if (j.is_object() && j.contains("error")) {
      const auto& e = j["error"];
      message = e.is_object() && e.contains("message") && e["message"].is_string() ? e["message"].get<std::string>()
                                                                                    : e.dump();
    } else if (j.is_object() && j.contains("detail")) {  // FastAPI's errors (vLLM)
      message = j["detail"].is_string() ? j["detail"].get<std::string>() : j["detail"].dump();
    }
  } catch (const json::exception&) {
  }
  if (message.empty()) message = std::string(body.substr(0, 200));
  const std::string what = "the upstream answered " + std::to_string(status) + (message.empty() ? "" : ": " + message);
  if (status == 503 || status == 429) return error(errc::upstream_busy, what);
  if (status == 504 || status == 408) return error(errc::upstream_timeout, what);
  return error(errc::upstream, what);
}

// One exchange, waited for: its status and whole body (a failed exchange throws efim::error).
template <upstream_transport X>
upstream_reply fetch(X& x, upstream_call call) {
  struct state {
    std::mutex m;
    upstream_reply reply;
    std::promise<std::pair<std::string, bool>> ended;
  };
  auto s = std::make_shared<state>();
  auto done = s->ended.get_future();
  (void)x.start(std::move(call), upstream_handlers{[s](int status) {
                                                     std::lock_guard lock(s->m);
                                                     s->reply.status = status;
                                                   },
                                                   [s](std::string_view data) {
                                                     std::lock_guard lock(s->m);
                                                     s->reply.body += data;
                                                   },
                                                   [s](const std::string& e, bool timed_out) {
                                                     s->ended.set_value({e, timed_out});
                                                   }});
  const auto [e, timed_out] = done.get();
  std::lock_guard lock(s->m);
  if (!e.empty()) throw upstream_failure(0, {}, e, timed_out);
  return s->reply;
}

// ---- the pipeline ----

enum class upstream_api {
  llama,   // llama.cpp's /completion: token ids in and out, slots, GBNF grammars
  openai,  // /v1/completions with a prompt of token ids
};

inline std::string_view to_string(upstream_api a) noexcept { return a == upstream_api::llama ? "llama" : "openai"; }

struct upstream_options {
  upstream_api api = upstream_api::llama;
  std::string model;  // the upstream's model name (OpenAI's "model" field)
  engine::preparer_options prepare{};
  std::size_t context = 4096;  // tokens of context per request at the upstream
  // llama-server's slots (its --parallel): each session is kept on one, the one that holds its
  // prefix; 0: none pinned (the upstream's prefix cache is global, as vLLM's and SGLang's are).
  std::size_t slots = 0;
  std::chrono::milliseconds timeout{30000};  // longest wait for the upstream's head and each event
  // Prompt tokens left for the upstream to compute, at most, of the requests sent (0: no limit).
  // llama-server computes the prompts waiting in a step slot by slot, in slot order, so without a
  // limit the sessions on low slots go first every time; with it, efim holds the rest and sends them
  // oldest first as what is left goes down (llama-server's progress reports), and the upstream
  // computes them in that order. Set it to the upstream's batch (its -b); engines that schedule
  // oldest first themselves (vLLM, SGLang) need none.
  std::size_t prompt_budget = 0;
  // The upstream model's vocabulary (upstream_info::vocab; 0: the tokenizer's). A model may have more
  // rows than its tokenizer has tokens (Qwen2.5: 151,665 tokens, 151,936 rows; llama.cpp names the
  // rest [PAD...] and gives them no text): ids between are generated tokens without text, counted
  // in max_tokens, never in a session's tokens.
  std::size_t vocab = 0;
  // What a completion callback threw that no answer can carry (see engine::pipeline_options).
  std::function<void(engine::request_id, std::exception_ptr)> on_callback_error;
};

// What the upstream says of itself, read at start-up (read_upstream()).
struct upstream_info {
  std::string model;         // its model's name (the id /v1/models gives)
  std::size_t vocab = 0;     // its vocabulary's size (0: it does not say)
  std::size_t context = 0;   // tokens of context per request (0: it does not say)
  std::size_t slots = 0;     // llama-server's slots (0: not llama-server)
  std::string description;   // for the log
};

// What the upstream says of itself (GET /v1/models; llama-server's GET /props), and a check that its
// vocabulary is the tokenizer's: a probe of code, Unicode and the FIM tokens tokenized there
// (POST /tokenize) must give the ids efim gives. Refuses (efim::error, errc::upstream) an upstream
// that cannot be reached, answers what efim cannot read, or tokenizes otherwise.
template <upstream_transport X, text::tokenizer T>
upstream_info read_upstream(X& x, upstream_api api, const T& tok, const prompt::fim_token_set& fim,
                            std::chrono::milliseconds timeout) {
  const auto get_json = [&](const std::string& method, const std::string& path, const std::string& body) {
    upstream_reply r;
    try {
      r = fetch(x, upstream_call{.method = method, .path = path, .body = body, .timeout = timeout});
    } catch (const error& e) {
      throw error(e.code(), method + " " + path + ": " + e.what());
    }
    if (r.status != 200) {
      const auto e = upstream_failure(r.status, r.body);
      throw error(e.code(), method + " " + path + ": " + e.what());
    }
    try {
      return json::parse(r.body);
    } catch (const json::exception& e) {
      throw error(errc::upstream, method + " " + path + ": the upstream's answer is not JSON: " + e.what());
    }
  };
  const auto size_at = [](const json& j, const char* key) -> std::size_t {
    return j.is_object() && j.contains(key) && j[key].is_number_unsigned() ? j[key].get<std::size_t>() : 0;
  };
  upstream_info info;
  const json models = get_json("GET", "/v1/models", {});
  if (models.contains("data") && models["data"].is_array() && !models["data"].empty()) {
    const json& m = models["data"][0];
    if (m.contains("id") && m["id"].is_string()) info.model = m["id"].get<std::string>();
    if (m.contains("meta")) info.vocab = size_at(m["meta"], "n_vocab");  // llama-server
    info.context = size_at(m, "max_model_len");                          // vLLM
  }
  if (api == upstream_api::llama) {
    const json props = get_json("GET", "/props", {});
    info.slots = size_at(props, "total_slots");
    if (props.contains("default_generation_settings"))
      info.context = size_at(props["default_generation_settings"], "n_ctx");
  }
  require(info.vocab == 0 || info.vocab >= tok.vocab_size(), errc::upstream,
          "the upstream's model has " + std::to_string(info.vocab) + " tokens, efim's tokenizer " +
              std::to_string(tok.vocab_size()) + ": not the same vocabulary");

  // The probe: each FIM token alone, then code with Unicode.
  const std::string code =
      "def fibonacci(n: int) -> int:\n    \"\"\"The n-th Fibonacci number.\"\"\"\n"
      "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # caf\u00e9 \u00fcber \u6570 \u2713\n\t}\r\n";
  constexpr std::array roles{prompt::fim_role::prefix, prompt::fim_role::suffix, prompt::fim_role::middle};
  std::vector<std::string> probes;
  for (const auto role : roles) probes.emplace_back(fim.text(role));
  probes.push_back(code);
  for (std::size_t i = 0; i < probes.size(); ++i) {
    const bool special = i < roles.size();
    std::vector<token_id> mine;
    if (special)
      mine.push_back(prompt::special_id(tok, fim, roles[i]));
    else
      tok.encode(probes[i], mine);
    const json body = {{"content", probes[i]},  // llama-server
                       {"prompt", probes[i]},   // vLLM
                       {"model", info.model},
                       {"add_special", false},
                       {"add_special_tokens", false},
                       {"parse_special", special}};
    const json answer = get_json("POST", "/tokenize", dump(body));
    std::vector<token_id> theirs;
    if (answer.contains("tokens") && answer["tokens"].is_array())
      for (const auto& t : answer["tokens"]) {
        const json& id = t.is_object() && t.contains("id") ? t["id"] : t;
        require(id.is_number_integer(), errc::upstream, "POST /tokenize: the upstream's answer has no token ids");
        theirs.push_back(static_cast<token_id>(id.get<std::int64_t>()));
      }
    if (theirs != mine) {
      const auto list = [](const std::vector<token_id>& v) {
        std::string s;
        for (std::size_t k = 0; k < v.size() && k < 12; ++k) s += (k ? " " : "") + std::to_string(v[k]);
        return s + (v.size() > 12 ? " ..." : "");
      };
      throw error(errc::upstream, "the upstream's vocabulary is not efim's tokenizer's: it tokenizes " +
                                      json(probes[i].substr(0, 40)).dump() + " as [" + list(theirs) + "], efim as [" +
                                      list(mine) + "] (give efim the upstream model's tokenizer)");
    }
  }
  info.description = std::string(to_string(api)) + " API, model " + (info.model.empty() ? "?" : info.model) +
                     (info.context ? ", context " + std::to_string(info.context) : "") +
                     (info.slots ? ", " + std::to_string(info.slots) + " slots" : "") + "; vocabulary checked";
  return info;
}

// The llama.cpp grammar (GBNF) of text that begins with `text`: token healing through the upstream.
inline std::string gbnf_starting_with(std::string_view text) {
  std::string g = "root ::= \"";
  for (const unsigned char c : text) {
    if (c == '"' || c == '\\') {
      g += '\\';
      g += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      static constexpr char hex[] = "0123456789ABCDEF";
      g += "\\x";
      g += hex[c >> 4];
      g += hex[c & 15];
    } else {
      g += static_cast<char>(c);  // UTF-8 passes as it is
    }
  }
  g += "\" .*";
  return g;
}

// A regular expression of text that begins with `text` (vLLM's structured outputs).
inline std::string regex_starting_with(std::string_view text) {
  std::string r;
  for (const char c : text) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) r += '\\';
    r += c;
  }
  return r + "[\\s\\S]*";
}

template <prompt::fim_format F, text::fragmenter G, text::tokenizer T, text::healing_policy Heal,
          upstream_transport X>
class upstream_pipeline {
 public:
  using format = F;
  using tokenizer_type = T;
  using preparer_type = engine::request_preparer<F, G, T, Heal>;
  using prepared = engine::prepared_request;
  using request_id = engine::request_id;
  using finish_reason = engine::finish_reason;

  // `transport` must outlive the pipeline. The tokenizer must be the upstream's (read_upstream()
  // compares them).
  upstream_pipeline(T tokenizer, X& transport, upstream_options options)
      : options_(std::move(options)),
        prep_(std::move(tokenizer), options_.prepare, engine::preparation_limits{.context = options_.context}),
        transport_(&transport), inbox_(std::make_shared<inbox>()), callback_errors_(options_.on_callback_error) {
    slot_users_.resize(options_.slots);
    (void)prep_.heal_index();  // read by healing and by fill_gap(): built now, not in a request
  }

  upstream_pipeline(const upstream_pipeline&) = delete;
  upstream_pipeline& operator=(const upstream_pipeline&) = delete;

  ~upstream_pipeline() {
    for (auto& [id, r] : live_)
      if (r.exchange != 0 && !r.ended) transport_->abort(r.exchange);
    std::lock_guard lock(inbox_->m);
    inbox_->closed = true;
    inbox_->wake = nullptr;
  }

  // As engine::pipeline::prepare(): any thread.
  prepared prepare(const engine::request& r) { return prep_.prepare(r); }

  // Starts a prepared request at the upstream (on the thread that drives the pipeline).
  request_id enqueue(prepared&& p, engine::stream out) {
    require(prep_.made(p) && p.superseded != nullptr, errc::invalid_argument,
            "upstream_pipeline: enqueue() takes a request this pipeline prepared, once");
    const request_id id = p.id();
    const bool replaced = p.superseded->load();
    const request_id supersedes = p.supersedes;
    upstream_call call{.method = "POST", .path = {}, .body = {}, .timeout = options_.timeout};
    const std::string session = p.result.session.empty() ? std::string() : p.tenant + '\n' + p.result.session;
    const int slot = options_.api == upstream_api::llama ? slot_for(session) : -1;
    const std::size_t computes = expected_compute(slot, session, p.tokens);
    if (options_.api == upstream_api::llama) {
      call.path = "/completion";
      call.body = llama_body(p, slot);
    } else {
      call.path = "/v1/completions";
      call.body = openai_body(p);
    }
    const auto it = live_.try_emplace(id, engine::generation<T>(prep_.tokenizer(), p, std::move(out)), p.session_version,
                                      std::move(p.superseded), session, p.max_tokens == 0)
                        .first;
    auto& r = it->second;
    r.gen.result().started = engine::clock::now();
    r.call = std::move(call);
    r.slot = slot;
    r.computes = computes;
    ++running_;
    if (replaced)
      end(id, finish_reason::superseded);
    else
      queue_.push_back(id);
    if (supersedes != 0) end(supersedes, finish_reason::superseded);
    release();
    return id;
  }

  request_id submit(const engine::request& r, engine::stream out) { return enqueue(prepare(r), std::move(out)); }

  // Hands what the upstream sent since the last call to the requests' streams. Returns true while
  // more has arrived meanwhile; false when the pipeline waits for the upstream (or has nothing).
  bool step() {
    std::vector<std::pair<request_id, event>> events;
    {
      std::lock_guard lock(inbox_->m);
      events.swap(inbox_->events);
    }
    for (auto& [id, e] : events) {
      const auto it = live_.find(id);
      if (it == live_.end() || it->second.gen.finished()) continue;  // it ended here already
      try {
        handle(id, it->second, e);
      } catch (...) {  // what the upstream sent cannot be read: this request fails, the rest go on
        fail(id, it->second, std::current_exception());
      }
    }
    sweep();
    std::lock_guard lock(inbox_->m);
    return !inbox_->events.empty();
  }

  // Waits for the upstream and runs steps until every request is done (without engine::async_runner).
  void run() {
    while (running_ > 0) {
      {
        std::unique_lock lock(inbox_->m);
        inbox_->arrived.wait(lock, [&] { return !inbox_->events.empty(); });
      }
      step();
    }
  }

  // async_runner calls this with how to wake its thread when events arrive.
  void set_wake(std::function<void()> wake) {
    std::lock_guard lock(inbox_->m);
    inbox_->wake = std::move(wake);
  }

  bool cancel(request_id id) { return end(id, finish_reason::cancelled); }

  void end_session(const std::string& session, const std::string& tenant = {}) { prep_.end_session(session, tenant); }

  void callback_failed(request_id id, std::exception_ptr e) noexcept { callback_errors_.report(id, std::move(e)); }

  [[nodiscard]] std::uint64_t callback_failures() const noexcept { return callback_errors_.count(); }
  [[nodiscard]] const T& tokenizer() const noexcept { return prep_.tokenizer(); }
  [[nodiscard]] const engine::preparer_options& preparation() const noexcept { return prep_.options(); }
  [[nodiscard]] const upstream_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t sessions() const { return prep_.sessions(); }
  [[nodiscard]] std::size_t running() const noexcept { return running_; }
  // Requests held in efim until the upstream's prompt budget allows them (upstream_options::prompt_budget).
  [[nodiscard]] std::size_t waiting() const noexcept { return queue_.size(); }
  [[nodiscard]] std::size_t context() const noexcept { return options_.context; }

 private:
  struct event {
    enum class kind_t { head, body, end } kind = kind_t::body;
    int status = 0;
    std::string data;  // body: the bytes; end: the transport's error (empty: the body ended)
    bool timed_out = false;
  };

  // Where the transport's threads leave events (shared with their handlers, which may outlive the
  // pipeline).
  struct inbox {
    std::mutex m;
    std::condition_variable arrived;
    std::vector<std::pair<request_id, event>> events;
    std::function<void()> wake;
    bool closed = false;

    void post(request_id id, event e) {
      std::lock_guard lock(m);
      if (closed) return;
      events.emplace_back(id, std::move(e));
      arrived.notify_one();
      if (wake) wake();
    }
  };

  struct live {
    live(engine::generation<T> g, std::uint64_t version, std::shared_ptr<std::atomic<bool>> flag, std::string key,
         bool prefill)
        : gen(std::move(g)), session_version(version), superseded(std::move(flag)), session(std::move(key)),
          prefill_only(prefill) {}
    engine::generation<T> gen;
    std::uint64_t session_version = 0;
    std::shared_ptr<std::atomic<bool>> superseded;
    std::string session;  // tenant and key (empty: none)
    bool prefill_only = false;
    upstream_call call;          // what goes to the upstream when the prompt budget lets it
    int slot = -1;               // llama-server's slot (-1: the upstream picks)
    std::size_t computes = 0;    // prompt tokens the upstream is expected to compute (not in its cache)
    bool prefilling = false;     // counted in the budget: sent, and its first token not yet back
    std::uint64_t exchange = 0;  // 0: not sent yet
    int status = 0;
    std::string error_body;  // a non-200 answer's body
    sse_reader sse;
    std::size_t decoded = 0;  // tokens the upstream has reported generating
    bool ended = false;       // the exchange is over
    std::optional<finish_reason> final_reason;  // OpenAI: the choice's finish_reason, before usage and [DONE]
    std::size_t known_tokens = SIZE_MAX;        // generated ids before the first the upstream did not name
    // Tokens without ids or text not yet passed on (padding rows, and the text of unnamed tokens
    // before them): they go with the next token that has an id.
    std::size_t pending = 0;
    std::string pending_text;
  };

  // ---- request bodies ----

  std::string llama_body(const prepared& p, int slot) const {
    json b = {{"prompt", p.tokens},
              {"n_predict", p.max_tokens == 0 ? 0 : static_cast<std::int64_t>(p.max_tokens + p.heal_text.size())},
              {"cache_prompt", true},
              {"stream", true},
              {"return_tokens", true},
              {"timings_per_token", true},  // its cache use in every event: efim may end the request first
              {"temperature", p.sampling.temperature},
              {"top_k", p.sampling.top_k},
              {"top_p", p.sampling.top_p},
              {"min_p", 0.0},
              {"seed", p.sampling.seed & 0xffffffffu},
              {"ignore_eos", p.ignore_eos},
              {"id_slot", slot}};
    if (options_.prompt_budget != 0) b["return_progress"] = true;  // what is left of its prompt, each step
    // The stop rules, the indentation rule and the time limit are efim's: it ends the request and
    // closes the exchange (the upstream then stops).
    if (!p.heal_text.empty()) b["grammar"] = gbnf_starting_with(p.heal_text);
    return dump(b);
  }

  std::string openai_body(const prepared& p) const {
    json b = {{"model", options_.model},
              {"prompt", p.tokens},
              {"max_tokens", p.max_tokens == 0 ? 1 : p.max_tokens + p.heal_text.size()},
              {"stream", true},
              // Usage in every chunk (vLLM): efim may end the request before the last.
              {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}},
              {"temperature", p.sampling.temperature},
              {"top_p", p.sampling.top_p},
              {"seed", p.sampling.seed & 0x7fffffffu},
              {"return_token_ids", true},   // vLLM: each chunk's token ids
              {"logprobs", 1},              // llama-server: each token's id, in its logprobs
              {"timings_per_token", true},  // llama-server: its cache use and token count in every chunk
              {"cache_prompt", true}};
    if (p.sampling.top_k > 0) b["top_k"] = p.sampling.top_k;
    if (p.ignore_eos) b["ignore_eos"] = true;
    if (!p.heal_text.empty()) {
      b["grammar"] = gbnf_starting_with(p.heal_text);                          // llama-server
      b["structured_outputs"] = {{"regex", regex_starting_with(p.heal_text)}};  // vLLM
    }
    return dump(b);
  }

  // The slot a session's requests go to: the one it had, else the one used longest ago among those
  // no request is using (a request sent to a busy slot waits there for it), else the one used longest
  // ago. -1: the upstream picks (no session, or no slots).
  int slot_for(const std::string& session) {
    if (session.empty() || slot_users_.empty()) return -1;
    ++tick_;
    const auto older = [&](std::size_t a, std::size_t b) {  // a is the better pick than b
      const auto& x = slot_users_[a];
      const auto& y = slot_users_[b];
      return (x.busy == 0) != (y.busy == 0) ? x.busy == 0 : x.used < y.used;
    };
    std::size_t pick = 0;
    for (std::size_t i = 0; i < slot_users_.size(); ++i) {
      if (slot_users_[i].session == session) {
        pick = i;
        break;
      }
      if (older(i, pick)) pick = i;
    }
    slot_users_[pick].session = session;
    slot_users_[pick].used = tick_;
    ++slot_users_[pick].busy;
    return static_cast<int>(pick);
  }

  // ---- the prompt budget ----

  // The prompt tokens of `tokens` the upstream will compute: those after the longest prefix it holds
  // from what efim sent before on `slot` (llama-server) or for `session` (a global prefix cache), at
  // least one; and `tokens` becomes what was sent there. Only with a budget.
  std::size_t expected_compute(int slot, const std::string& session, const std::vector<token_id>& tokens) {
    if (options_.prompt_budget == 0) return 0;
    std::vector<token_id>* held = nullptr;
    if (slot >= 0) {
      held = &slot_users_[static_cast<std::size_t>(slot)].sent;
    } else if (!session.empty()) {
      if (sent_.size() >= 65536 && !sent_.contains(session)) sent_.clear();  // bounded: an estimate only
      held = &sent_[session];
    }
    if (held == nullptr) return std::max<std::size_t>(tokens.size(), 1);
    const auto common = static_cast<std::size_t>(
        std::mismatch(tokens.begin(), tokens.end(), held->begin(), held->end()).first - tokens.begin());
    *held = tokens;
    return std::max<std::size_t>(tokens.size() - common, 1);
  }

  // Sends waiting requests, oldest first, while what is left of the prompts the upstream is computing
  // stays within the budget (one is always let through when none is computing, however long).
  // Without a budget, every request goes at once.
  void release() {
    while (!queue_.empty()) {
      const request_id id = queue_.front();
      const auto it = live_.find(id);
      if (it == live_.end() || it->second.gen.finished()) {  // cancelled or superseded while waiting
        queue_.pop_front();
        continue;
      }
      live& r = it->second;
      if (options_.prompt_budget != 0 && prefilling_ > 0 && prefill_tokens_ + r.computes > options_.prompt_budget)
        return;
      queue_.pop_front();
      send(id, r);
    }
  }

  void send(request_id id, live& r) {
    if (options_.prompt_budget != 0) {
      r.prefilling = true;
      ++prefilling_;
      prefill_tokens_ += r.computes;
    }
    // Events from the transport's threads wait in the inbox for step().
    std::weak_ptr<inbox> box = inbox_;
    auto post = [box, id](event e) {
      if (const auto b = box.lock()) b->post(id, std::move(e));
    };
    try {
      r.exchange = transport_->start(
          std::move(r.call),
          upstream_handlers{[post](int status) { post(event{event::kind_t::head, status, {}, false}); },
                            [post](std::string_view data) { post(event{event::kind_t::body, 0, std::string(data), false}); },
                            [post](const std::string& e, bool timed_out) {
                              post(event{event::kind_t::end, 0, e, timed_out});
                            }});
    } catch (...) {
      r.ended = true;
      fail(id, r, std::current_exception());
    }
  }

  // llama-server's word on a prompt it is computing (return_progress): {"total", "cache", "processed"},
  // processed counting the cached tokens. What is left of it is what it holds of the budget.
  void on_progress(live& r, const json& p) {
    const auto size = [&](const char* key) {
      require(p.is_object() && p.contains(key) && p[key].is_number_unsigned(), errc::upstream,
              std::string("the upstream's prompt_progress has no ") + key);
      return p[key].get<std::size_t>();
    };
    const std::size_t total = size("total"), processed = size("processed");
    if (!r.prefilling) return;
    const std::size_t left = total - std::min(total, processed), before = r.computes;
    prefill_tokens_ = prefill_tokens_ - before + left;
    r.computes = left;
    if (left < before) release();
  }

  // Its prompt is computed (or it ended): the budget it held goes to the requests waiting.
  void prompt_computed(live& r) {
    if (!r.prefilling) return;
    r.prefilling = false;
    --prefilling_;
    prefill_tokens_ -= r.computes;
    release();
  }

  // ---- what the upstream sends ----

  void handle(request_id id, live& r, event& e) {
    switch (e.kind) {
      case event::kind_t::head:
        r.status = e.status;
        return;
      case event::kind_t::body:
        if (r.status != 200) {
          if (r.error_body.size() < 65536) r.error_body += e.data;
          return;
        }
        r.sse.feed(e.data, [&](std::string_view data) {
          if (!r.gen.finished()) on_event(id, r, data);
        });
        return;
      case event::kind_t::end:
        r.ended = true;
        if (r.gen.finished()) return;
        if (!e.data.empty() || e.timed_out)
          return fail(id, r, std::make_exception_ptr(upstream_failure(0, {}, e.data, e.timed_out)));
        if (r.status != 200) return fail(id, r, std::make_exception_ptr(upstream_failure(r.status, r.error_body)));
        if (r.final_reason) return finish(id, r, *r.final_reason);  // no [DONE]
        return fail(id, r,
                    std::make_exception_ptr(error(errc::upstream, "the upstream's stream ended before its last event")));
    }
  }

  void on_event(request_id id, live& r, std::string_view data) {
    if (data == "[DONE]") {
      if (r.final_reason) finish(id, r, *r.final_reason);
      return;
    }
    const json j = json::parse(data);
    require(j.is_object(), errc::upstream, "the upstream sent an event that is not a JSON object");
    if (j.contains("error")) throw upstream_failure(500, data);
    if (options_.api == upstream_api::llama)
      on_llama_event(id, r, j);
    else
      on_openai_event(id, r, j);
  }

  // llama.cpp's /completion stream: one event per generated token whose text is complete
  // ({"content", "tokens": [id], "tokens_predicted"}), the last with "stop": true, "stop_type" and
  // "timings". A token that ends inside a UTF-8 character is sent with the next one's event, whose
  // "tokens" holds the later id only: the ids between are found from the bytes of "content".
  void on_llama_event(request_id id, live& r, const json& j) {
    if (const auto p = j.find("prompt_progress"); p != j.end()) return on_progress(r, *p);
    read_timings(r, j);
    const bool last = j.value("stop", false);
    if (!last) {  // the last event repeats no tokens when streaming
      std::vector<token_id> ids;
      if (const auto it = j.find("tokens"); it != j.end() && it->is_array())
        for (const auto& t : *it) ids.push_back(checked_id(t));
      const std::size_t decoded = j.contains("tokens_predicted") && j["tokens_predicted"].is_number_unsigned()
                                      ? j["tokens_predicted"].get<std::size_t>()
                                      : 0;
      (void)take_event(id, r, std::move(ids), decoded, j.value("content", std::string()));
      return;
    }
    const std::string why = j.value("stop_type", std::string());
    finish(id, r, why == "eos" ? finish_reason::eos : finish_reason::length);
  }

  // OpenAI's stream: {"choices": [{"text", "finish_reason", ids?}], "usage"?}. The ids: vLLM's
  // "token_ids" (return_token_ids), or llama-server's "logprobs": {"content": [{"id"}]}; llama-server's
  // "timings" say how many tokens it generated, so the ids it leaves out are found as with /completion.
  void on_openai_event(request_id id, live& r, const json& j) {
    read_timings(r, j);
    if (const auto u = j.find("usage"); u != j.end() && u->is_object()) {
      const auto d = u->find("prompt_tokens_details");
      if (d != u->end() && d->is_object() && d->contains("cached_tokens") && (*d)["cached_tokens"].is_number_unsigned())
        r.gen.result().cached_tokens = std::min(r.gen.result().prompt_tokens, (*d)["cached_tokens"].get<std::size_t>());
    }
    const auto choices = j.find("choices");
    if (choices == j.end() || !choices->is_array() || choices->empty()) return;  // usage alone
    const json& c = (*choices)[0];
    std::vector<token_id> ids;
    bool has_ids = false;
    if (const auto it = c.find("token_ids"); it != c.end() && it->is_array()) {
      has_ids = true;
      for (const auto& t : *it) ids.push_back(checked_id(t));
    } else if (const auto lp = c.find("logprobs"); lp != c.end() && lp->is_object() && lp->contains("content") &&
                                                   (*lp)["content"].is_array()) {
      has_ids = true;
      for (const auto& t : (*lp)["content"]) {
        require(t.is_object() && t.contains("id"), errc::upstream, "the upstream's logprobs name no token ids");
        ids.push_back(checked_id(t["id"]));
      }
    }
    const std::string text = c.contains("text") && c["text"].is_string() ? c["text"].get<std::string>() : "";
    require(has_ids || text.empty(), errc::upstream,
            "the upstream sent text without its token ids (vLLM: return_token_ids, 0.10.2 and later; llama-server: "
            "logprobs)");
    std::size_t decoded = 0;
    if (const auto t = j.find("timings"); t != j.end() && t->is_object() && t->contains("predicted_n") &&
                                          (*t)["predicted_n"].is_number_unsigned())
      decoded = (*t)["predicted_n"].get<std::size_t>();
    const bool final = c.contains("finish_reason") && c["finish_reason"].is_string();
    if (!ids.empty() || !text.empty())
      if (take_event(id, r, std::move(ids), final ? 0 : decoded, text)) return;
    if (final) {
      r.final_reason = c["finish_reason"].get<std::string>() == "stop" ? finish_reason::eos : finish_reason::length;
      if (r.prefill_only) r.final_reason = finish_reason::length;
    }
  }

  // What the upstream took from its cache, where the event says (llama.cpp's timings, in every event
  // with timings_per_token: efim may end the request before the last).
  static void read_timings(live& r, const json& j) {
    const auto t = j.find("timings");
    if (t == j.end() || !t->is_object()) return;
    auto& c = r.gen.result();
    if (t->contains("cache_n") && (*t)["cache_n"].is_number_unsigned())
      c.cached_tokens = std::min(c.prompt_tokens, (*t)["cache_n"].get<std::size_t>());
    else if (t->contains("prompt_n") && (*t)["prompt_n"].is_number_unsigned())
      c.cached_tokens = c.prompt_tokens - std::min(c.prompt_tokens, (*t)["prompt_n"].get<std::size_t>());
  }

  // One event's tokens to the client: `ids`, after the ones it left out where the upstream says it has
  // generated more (`decoded`; 0: it does not say), found from the event's `text`. True if the request
  // ended.
  bool take_event(request_id id, live& r, std::vector<token_id> ids, std::size_t decoded, std::string_view text) {
    named gap;
    if (decoded > r.decoded + ids.size()) {
      gap = fill_gap(text, ids, decoded - r.decoded - ids.size());
      ids = std::move(gap.ids);
    }
    r.decoded = std::max(decoded, r.decoded + ids.size() + gap.unnamed);
    r.pending += gap.unnamed;
    r.pending_text += gap.unnamed_text;
    for (const token_id t : ids) {
      if (padding(t)) {  // no text: it goes on with the next token that has some
        if (r.prefill_only) return take(id, r, t);
        if (r.gen.heal().active()) throw error(errc::upstream, "the upstream did not keep to the healing constraint");
        token_arrived(r);
        ++r.pending;
        continue;
      }
      const std::string before = std::exchange(r.pending_text, {});
      if (take(id, r, t, before, std::exchange(r.pending, 0))) return true;
    }
    return false;
  }

  // A generated token came back: the first one ends the prompt (its budget goes to the requests waiting).
  void token_arrived(live& r) {
    auto& c = r.gen.result();
    const auto now = engine::clock::now();
    if (c.prompt_done == engine::clock::time_point{}) c.prompt_done = now;
    if (c.first_token == engine::clock::time_point{}) c.first_token = now;
    prompt_computed(r);
  }

  // A row of the upstream's model that the tokenizer has no token for (upstream_options::vocab).
  bool padding(token_id t) const noexcept { return static_cast<std::size_t>(t) >= prep_.tokenizer().vocab_size(); }

  token_id checked_id(const json& t) const {
    const std::size_t rows = std::max(options_.vocab, prep_.tokenizer().vocab_size());
    require(t.is_number_integer() && t.get<std::int64_t>() >= 0 &&
                t.get<std::int64_t>() < static_cast<std::int64_t>(rows),
            errc::upstream, "the upstream sent token id " + t.dump() + ", which the vocabulary does not have");
    return static_cast<token_id>(t.get<std::int64_t>());
  }

  // What an event's text says of the tokens it has no ids for.
  struct named {
    std::vector<token_id> ids;
    std::string unnamed_text;  // the text of the tokens no ids could be found for (then ids = known)
    std::size_t unnamed = 0;
  };

  // The `missing` ids whose bytes, followed by those of `known`, make `content`. Where the text is
  // not their bytes (llama.cpp sends U+FFFD for bytes that are not UTF-8), their text goes on as it is.
  named fill_gap(std::string_view content, const std::vector<token_id>& known, std::size_t missing) {
    std::string tail;
    for (const token_id t : known)
      if (!padding(t)) tail += prep_.tokenizer().token_bytes(t);
    require(!known.empty() && content.ends_with(tail), errc::upstream,
            "the upstream's text does not end with its tokens' bytes (is its vocabulary the same?)");
    const std::string_view gap = content.substr(0, content.size() - tail.size());
    const auto& index = prep_.heal_index();
    named out;
    // Depth-first: `missing` tokens that spell the gap (almost always one or two byte tokens).
    const std::function<bool(std::string_view, std::size_t)> spell = [&](std::string_view rest, std::size_t n) {
      if (n == 0) return rest.empty();
      if (rest.size() < n) return false;
      std::vector<token_id> candidates;
      index.prefixes_of(rest, [&](token_id t) { candidates.push_back(t); });
      for (const token_id t : index.extending(rest))
        if (index.bytes(t).size() == rest.size()) candidates.push_back(t);
      for (const token_id t : candidates) {
        out.ids.push_back(t);
        if (spell(rest.substr(index.bytes(t).size()), n - 1)) return true;
        out.ids.pop_back();
      }
      return false;
    };
    if (!spell(gap, missing)) {
      out.ids.clear();
      out.unnamed_text = gap;
      out.unnamed = missing;
    }
    out.ids.insert(out.ids.end(), known.begin(), known.end());
    return out;
  }

  // One generated token to the client (after `unnamed` tokens whose ids are unknown and whose text is
  // `before`); true if the request ended.
  bool take(request_id id, live& r, token_id t, std::string_view before = {}, std::size_t unnamed = 0) {
    if (r.prefill_only) {  // max_tokens 0: the prompt only (the upstream may have generated one token)
      finish(id, r, finish_reason::length);
      return true;
    }
    token_arrived(r);
    auto& c = r.gen.result();
    const auto& index = prep_.heal_index();
    if (r.gen.heal().active() && !r.gen.heal().allows(index, t))
      throw error(errc::upstream, "the upstream did not keep to the healing constraint");
    if (unnamed > 0) r.known_tokens = std::min(r.known_tokens, c.tokens.size());  // ids after it are not recorded
    const auto why = r.gen.take(t, &index, prep_.eos(), before, unnamed);
    if (auto orphan = r.gen.orphan()) callback_failed(id, std::move(orphan));
    if (r.gen.finished()) return true;
    if (why) {
      finish(id, r, *why);
      return true;
    }
    return false;
  }

  void fail(request_id id, live& r, std::exception_ptr e) {
    if (r.gen.finished()) return callback_failed(id, std::move(e));
    r.gen.result().error = std::move(e);
    finish(id, r, finish_reason::error);
  }

  void finish(request_id id, live& r, finish_reason why) {
    if (r.gen.finished()) return;
    if (!r.ended && r.exchange != 0) transport_->abort(r.exchange);  // the upstream stops generating
    const bool waited = r.exchange == 0 && std::erase(queue_, id) > 0;  // ended while it waited in efim
    if (r.slot >= 0) --slot_users_[static_cast<std::size_t>(r.slot)].busy;
    r.ended = true;
    auto& c = r.gen.result();
    if (c.prompt_done == engine::clock::time_point{}) c.prompt_done = engine::clock::now();
    // Padding tokens at the end, with no token after them to go with: counted. (The text of unnamed
    // tokens before them, if any, is U+FFFD for bytes a token after them would have completed.)
    c.unnamed_tokens += std::exchange(r.pending, 0);
    r.gen.complete(why);
    prep_.close(r.gen.result(), r.session_version, r.superseded, r.known_tokens);
    --running_;
    if (auto e = r.gen.deliver()) callback_failed(id, std::move(e));
    prompt_computed(r);
    if (waited) release();  // it may have held back the ones behind it
  }

  bool end(request_id id, finish_reason why) {
    const auto it = live_.find(id);
    if (it == live_.end() || it->second.gen.finished()) return false;
    finish(id, it->second, why);
    return true;
  }

  // Forgets the requests that ended (not while their callbacks may still run).
  void sweep() { std::erase_if(live_, [](const auto& kv) { return kv.second.gen.finished(); }); }

  struct slot_user {
    std::string session;
    std::uint64_t used = 0;
    std::size_t busy = 0;  // requests on it that have not ended
    std::vector<token_id> sent;  // the last prompt sent to it (with a prompt budget)
  };

  upstream_options options_;
  preparer_type prep_;
  X* transport_;
  std::shared_ptr<inbox> inbox_;
  std::map<request_id, live> live_;  // stable references: callbacks may end other requests
  std::size_t running_ = 0;
  std::vector<slot_user> slot_users_;
  std::uint64_t tick_ = 0;
  std::deque<request_id> queue_;  // waiting for the prompt budget, oldest first
  std::size_t prefilling_ = 0;    // requests sent whose first token has not come back
  std::size_t prefill_tokens_ = 0;
  std::unordered_map<std::string, std::vector<token_id>> sent_;  // the last prompt sent per session (no slots)
  engine::callback_errors callback_errors_;
};

}  // namespace efim::server
