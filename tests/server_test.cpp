// The server layer: request bodies as editors send them, responses as they read them, errors in each
// API's shape, metrics, and a bounded fuzz of the JSON handlers. The HTTP transport and the program
// are tested over real sockets in examples_server_test.cpp.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "editor_requests.hpp"
#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/core/random.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/server/service.hpp"
#include "efim/text/fragment.hpp"
#include "small_model.hpp"

using namespace efim;
using server::json;

namespace {
using efim_test::efim_pipeline;

// The answer a transport would send: one response, or a stream of chunks.
class recorded_channel : public server::response_channel {
 public:
  void respond(server::http_response r) override {
    std::lock_guard lock(mutex_);
    ++answers_;
    status_ = r.status;
    content_type_ = r.content_type;
    body_ = std::move(r.body);
    done_ = true;
    cv_.notify_all();
  }
  void begin_stream(int status, std::string content_type) override {
    std::lock_guard lock(mutex_);
    ++answers_;
    status_ = status;
    content_type_ = std::move(content_type);
  }
  void stream(std::string data) override {
    std::lock_guard lock(mutex_);
    chunks_.push_back(std::move(data));
    cv_.notify_all();
  }
  void end_stream() override {
    std::lock_guard lock(mutex_);
    done_ = true;
    cv_.notify_all();
  }
  void on_disconnect(std::function<void()> f) override {
    std::lock_guard lock(mutex_);
    on_disconnect_ = std::move(f);
  }
  // The client goes away.
  void disconnect() {
    std::function<void()> f;
    {
      std::lock_guard lock(mutex_);
      f = on_disconnect_;
    }
    if (f) f();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    REQUIRE(cv_.wait_for(lock, std::chrono::seconds(60), [&] { return done_; }));
  }
  int status() {
    wait();
    return status_;
  }
  json body() {
    wait();
    return json::parse(body_);
  }
  std::string raw() {
    wait();
    return body_;
  }
  std::string content_type() {
    wait();
    return content_type_;
  }
  // The data of each server-sent event.
  std::vector<std::string> events() {
    wait();
    std::vector<std::string> out;
    std::string all;
    for (const auto& c : chunks_) all += c;
    for (std::size_t pos = 0; pos < all.size();) {
      const std::size_t end = all.find("\n\n", pos);
      REQUIRE(end != std::string::npos);
      const std::string event = all.substr(pos, end - pos);
      REQUIRE(event.starts_with("data: "));
      out.push_back(event.substr(6));
      pos = end + 2;
    }
    return out;
  }
  int answers() {
    std::lock_guard lock(mutex_);
    return answers_;
  }
  bool done() {
    std::lock_guard lock(mutex_);
    return done_;
  }
  // Waits for the first streamed chunk (a token, for a streaming request).
  void wait_for_chunk() {
    std::unique_lock lock(mutex_);
    REQUIRE(cv_.wait_for(lock, std::chrono::seconds(60), [&] { return !chunks_.empty() || done_; }));
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int answers_ = 0, status_ = 0;
  std::string content_type_, body_;
  std::vector<std::string> chunks_;
  bool done_ = false;
  std::function<void()> on_disconnect_;
};

struct fixture {
  model::weights weights = efim_test::small_weights();
  efim_pipeline pipeline{efim_test::qwen_tokenizer(), weights, efim_test::small_options(512, true, 128)};
  std::unique_ptr<server::service<efim_pipeline>> svc;

  explicit fixture(server::service_options o = {}) {
    o.model_name = "test-model";
    svc = std::make_unique<server::service<efim_pipeline>>(pipeline, o);
  }

  std::shared_ptr<recorded_channel> send(std::string method, std::string target, std::string body,
                                         std::vector<server::header> headers = {}) {
    auto ch = std::make_shared<recorded_channel>();
    svc->handle({std::move(method), std::move(target), std::move(headers), std::move(body)}, ch);
    return ch;
  }
  std::shared_ptr<recorded_channel> post(std::string target, const json& body,
                                         std::vector<server::header> headers = {}) {
    return send("POST", std::move(target), body.dump(), std::move(headers));
  }
  // A long streaming /infill request, once its first token has come.
  std::shared_ptr<recorded_channel> long_stream();
};

const std::string prefix_text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n";
const std::string suffix_text = "\n\nprint(fibonacci(10))\n";

std::shared_ptr<recorded_channel> fixture::long_stream() {
  auto ch = post("/infill", {{"input_prefix", prefix_text},
                             {"input_suffix", suffix_text},
                             {"n_predict", 800},
                             {"ignore_eos", true},
                             {"stream", true}});
  ch->wait_for_chunk();
  return ch;
}

json llama_vim_body(const std::string& prefix, const std::string& middle, const std::string& suffix) {
  return efim_test::llama_vim_body(prefix, middle, suffix, 16);
}
}  // namespace

namespace efim_test {
void tokenize_forever(int threads, const std::string& text);  // server_exit_test.cpp
}

TEST_CASE("server: llama.vim's /infill body gets exactly the fields it asks for", "[server][infill]") {
  fixture f;
  auto ch = f.post("/infill", llama_vim_body(prefix_text, "    ret", suffix_text));
  REQUIRE(ch->status() == 200);
  const auto b = ch->body();
  const std::set<std::string> want{"content",
                                   "timings/prompt_n",
                                   "timings/prompt_ms",
                                   "timings/prompt_per_token_ms",
                                   "timings/prompt_per_second",
                                   "timings/predicted_n",
                                   "timings/predicted_ms",
                                   "timings/predicted_per_token_ms",
                                   "timings/predicted_per_second",
                                   "truncated",
                                   "tokens_cached"};
  std::set<std::string> got;
  for (const auto& [k, v] : b.items()) got.insert(k);
  CHECK(got == want);
  CHECK(b["content"].is_string());
  CHECK(b["timings/predicted_n"].get<int>() <= 16);
  CHECK(b["tokens_cached"] == 0);
  // llama.vim checks the raw text for `"content":"` before it decodes it, and reads one line.
  CHECK(ch->raw().find("\"content\":\"") != std::string::npos);
  CHECK(ch->raw().find('\n') == std::string::npos);

  // The next keystroke reuses the prompt: only the new text and the last partial block are computed.
  auto next = f.post("/infill", llama_vim_body(prefix_text, "    retu", suffix_text));
  const auto n = next->body();
  CHECK(n["tokens_cached"].get<std::size_t>() > 0);
  CHECK(n["timings/prompt_n"].get<std::size_t>() <= 1 + 16);
}

TEST_CASE("server: llama.vim's context warm-up (n_predict 0, response_fields [\"\"]) answers {}", "[server][infill]") {
  fixture f;
  const json warm =
      efim_test::llama_vim_warmup_body(json::array({{{"text", "x = 1\n"}, {"time", 1.0}, {"filename", "a.py"}}}));
  auto ch = f.post("/infill", warm);
  CHECK(ch->status() == 200);
  CHECK(ch->body() == json::object());
  // A request with the same context files then finds them cached.
  auto b = f.post("/infill", {{"input_prefix", ""},
                              {"input_suffix", ""},
                              {"input_extra", warm["input_extra"]},
                              {"n_predict", 1},
                              {"temperature", 0}})
               ->body();
  CHECK(b["tokens_cached"].get<int>() > 0);
}

TEST_CASE("server: llama.vscode's /infill body and the fields it reads", "[server][infill]") {
  fixture f;
  const json body = efim_test::llama_vscode_body(prefix_text, "    ", suffix_text);
  const auto b = f.post("/infill", body)->body();
  CHECK(b["content"].is_string());
  CHECK(b["tokens_cached"].is_number_unsigned());
  CHECK(b["truncated"] == false);
  for (const char* k :
       {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"})
    CHECK(b["timings"][k].is_number());
  CHECK(b["stop_type"].is_string());
  CHECK(b["tokens_evaluated"].get<std::size_t>() ==
        b["timings"]["prompt_n"].get<std::size_t>() + b["tokens_cached"].get<std::size_t>());
  CHECK(b["efim"]["format"] == "efim");
  CHECK(b["efim"]["change"] == "first");
  CHECK(b["generation_settings"]["n_indent"] == 4);
}

TEST_CASE("server: /infill streams server-sent events whose text adds up to the completion", "[server][stream]") {
  fixture f;
  json body = {{"input_prefix", prefix_text},
               {"input_suffix", suffix_text},
               {"n_predict", 12},
               {"temperature", 0},
               {"stream", true},
               {"return_tokens", true}};
  auto ch = f.post("/infill", body);
  CHECK(ch->status() == 200);
  CHECK(ch->content_type() == "text/event-stream");
  const auto events = ch->events();
  REQUIRE(events.size() >= 2);
  std::string text;
  std::size_t tokens = 0;
  for (std::size_t i = 0; i + 1 < events.size(); ++i) {
    const auto e = json::parse(events[i]);
    CHECK(e["stop"] == false);
    text += e["content"].get<std::string>();
    tokens += e["tokens"].size();
  }
  const auto last = json::parse(events.back());
  CHECK(last["stop"] == true);
  text += last["content"].get<std::string>();
  CHECK(tokens == 12);
  // The same request without streaming gives the same text.
  body["stream"] = false;
  CHECK(f.post("/infill", body)->body()["content"] == text);
}

TEST_CASE("server: OpenAI /v1/completions with suffix, streaming and not, with usage", "[server][openai]") {
  fixture f;
  json body = {{"model", "test-model"}, {"prompt", prefix_text}, {"suffix", suffix_text},
               {"max_tokens", 6},       {"temperature", 0},      {"user", "someone"}};
  const auto b = f.post("/v1/completions", body)->body();
  CHECK(b["object"] == "text_completion");
  CHECK(b["model"] == "test-model");
  REQUIRE(b["choices"].size() == 1);
  CHECK(b["choices"][0]["finish_reason"] == "length");
  CHECK(b["usage"]["completion_tokens"] == 6);
  CHECK(b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0);
  const std::string text = b["choices"][0]["text"];

  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto ch = f.post("/v1/completions", body);
  const auto events = ch->events();
  REQUIRE(events.size() >= 3);
  CHECK(events.back() == "[DONE]");
  std::string streamed;
  for (std::size_t i = 0; i + 2 < events.size(); ++i) {
    const auto e = json::parse(events[i]);
    streamed += e["choices"][0]["text"].get<std::string>();
    CHECK(e["id"] == json::parse(events[0])["id"]);
  }
  CHECK(json::parse(events[events.size() - 3])["choices"][0]["finish_reason"] == "length");
  const auto usage = json::parse(events[events.size() - 2]);
  CHECK(usage["choices"].empty());
  CHECK(usage["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>() > 0);  // the same prompt again
  CHECK(streamed == text);

  // Without suffix: a plain completion of the prompt.
  const auto plain = f.post("/v1/completions", {{"prompt", "x = "}, {"max_tokens", 2}})->body();
  CHECK(plain["usage"]["prompt_tokens"] == 4);
  CHECK(plain["efim"]["format"] == "plain");
}

TEST_CASE("server: heal_tokens is a request field (0 to 16), echoed in the settings; healing is reported",
          "[server][infill][healing]") {
  fixture f;
  json body = efim_test::llama_vscode_body(prefix_text, "    ", suffix_text);
  body["heal_tokens"] = 2;
  const auto b = f.post("/infill", body)->body();
  CHECK(b["generation_settings"]["heal_tokens"] == 2);
  CHECK(b["efim"]["healed_tokens"] == 0);  // the byte-level vocabulary: no token extends another
  CHECK(b["efim"]["healing_steps"] == 0);
  body["heal_tokens"] = 17;
  CHECK(f.send("POST", "/infill", body.dump())->status() == 400);
  body["heal_tokens"] = "two";
  CHECK(f.send("POST", "/infill", body.dump())->status() == 400);
}

TEST_CASE("server: bad requests get a clear 4xx in the endpoint's error shape and lose nothing", "[server][errors]") {
  fixture f;
  const auto llama_error = [](recorded_channel& ch, int status) {
    CHECK(ch.status() == status);
    const auto b = ch.body();
    CHECK(b["error"]["code"] == status);
    CHECK(b["error"]["message"].is_string());
    CHECK(b["error"]["type"].is_string());
    return b["error"]["message"].get<std::string>();
  };
  CHECK(llama_error(*f.send("POST", "/infill", "{\"input_prefix\": "), 400).find("not valid JSON") !=
        std::string::npos);
  CHECK(llama_error(*f.send("POST", "/infill", "[1, 2]"), 400).find("JSON object") != std::string::npos);
  CHECK(llama_error(*f.post("/infill", {{"input_suffix", ""}}), 400).find("input_prefix") != std::string::npos);
  CHECK(llama_error(*f.post("/infill", {{"input_prefix", 1}, {"input_suffix", ""}}), 400).find("string") !=
        std::string::npos);
  CHECK(llama_error(*f.post("/infill", {{"input_prefix", ""}, {"input_suffix", ""}, {"temperature", "hot"}}), 400)
            .find("temperature") != std::string::npos);
  CHECK(llama_error(*f.post("/infill", {{"input_prefix", ""}, {"input_suffix", ""}, {"n_predict", -5}}), 400)
            .find("n_predict") != std::string::npos);
  CHECK(llama_error(*f.post("/infill", {{"input_prefix", ""}, {"input_suffix", ""}, {"input_extra", "x"}}), 400)
            .find("input_extra") != std::string::npos);
  CHECK(llama_error(*f.send("POST", "/infill", std::string(100, '[') + std::string(100, ']')), 400).find("nested") !=
        std::string::npos);
  // Invalid UTF-8 in a string, raw or as an unpaired surrogate escape.
  CHECK(llama_error(*f.send("POST", "/infill", "{\"input_prefix\": \"\xFF\", \"input_suffix\": \"\"}"), 400)
            .find("not valid JSON") != std::string::npos);
  CHECK(llama_error(*f.send("POST", "/infill", R"({"input_prefix": "\ud800", "input_suffix": ""})"), 400)
            .find("not valid JSON") != std::string::npos);
  // A prompt over the context: llama.cpp's exceed_context_size_error.
  auto over = f.post("/infill", {{"input_prefix", std::string(2000, 'x')}, {"input_suffix", ""}});
  CHECK(llama_error(*over, 400).find("context") != std::string::npos);
  CHECK(over->body()["error"]["type"] == "exceed_context_size_error");
  llama_error(*f.send("GET", "/nowhere", ""), 404);
  llama_error(*f.send("GET", "/infill", ""), 405);
  // Unknown fields are ignored.
  CHECK(f.post("/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}, {"n_predict", 1}, {"frobnicate", {1, 2}}})
            ->status() == 200);

  // OpenAI's shape on /v1/.
  auto o = f.post("/v1/completions", {{"prompt", "x"}, {"n", 2}});
  CHECK(o->status() == 400);
  const auto ob = o->body();
  CHECK(ob["error"]["type"] == "invalid_request_error");
  CHECK(ob["error"].contains("param"));
  CHECK(ob["error"]["code"].is_null());
  CHECK(f.post("/v1/completions", {{"suffix", "x"}})->body()["error"]["param"] == "prompt");
  CHECK(f.post("/v1/completions", {{"prompt", "x"}, {"temperature", 3}})->status() == 400);

  // Still serving.
  CHECK(f.post("/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}, {"n_predict", 1}})->status() == 200);
}

TEST_CASE("server: /tokenize, /detokenize, /health, /v1/models", "[server]") {
  fixture f;
  // The byte-level tokenizer has no special-token parsing: the text stays text (the BPE one is
  // tested over HTTP with the real vocabulary).
  CHECK(f.post("/tokenize", {{"content", "ab<|fim_prefix|>"}})->body()["tokens"].size() == 16);
  const auto pre = static_cast<int>(*f.pipeline.tokenizer().special_id("<|fim_prefix|>"));
  const auto pieces = f.post("/tokenize", {{"content", "a\xC3\xA9"}, {"with_pieces", true}})->body()["tokens"];
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[0]["piece"] == "a");
  CHECK(pieces[1]["piece"] == json::array({0xC3}));  // half a character: its bytes
  CHECK(f.post("/detokenize", {{"tokens", {'a', 0xC3, 0xA9, pre}}})->body()["content"] == "a\xC3\xA9<|fim_prefix|>");
  CHECK(f.post("/detokenize", {{"tokens", {1, 999999}}})->status() == 400);
  CHECK(f.post("/detokenize", {{"tokens", "abc"}})->status() == 400);
  CHECK(f.send("GET", "/health", "")->body() == json{{"status", "ok"}});
  const auto m = f.send("GET", "/v1/models", "")->body();
  CHECK(m["data"][0]["id"] == "test-model");
  CHECK(m["data"][0]["meta"]["format"] == "efim");
}

TEST_CASE("server: an efim::error is a 4xx when the client's input caused it, a 5xx when the server failed",
          "[server][errors]") {
  fixture f;
  const auto status = [&](errc code) { return f.svc->to_api_error(efim::error(code, "x")).status(); };
  CHECK(status(errc::invalid_argument) == 400);
  CHECK(status(errc::invalid_utf8) == 400);
  CHECK(status(errc::unknown_token) == 400);
  CHECK(status(errc::too_long) == 400);
  CHECK(status(errc::out_of_blocks) == 400);
  CHECK(f.svc->to_api_error(efim::error(errc::too_long, "x")).type() == "exceed_context_size_error");
  CHECK(status(errc::io) == 500);
  CHECK(status(errc::unavailable) == 503);
  CHECK(status(errc::upstream) == 502);
  CHECK(status(errc::upstream_busy) == 503);
  CHECK(status(errc::upstream_timeout) == 504);
}

TEST_CASE("server: /metrics counts agree with what the responses said", "[server][metrics]") {
  fixture f;
  std::size_t cached = 0, computed = 0, generated = 0;
  std::string prefix = prefix_text;
  for (const std::string typed : {"    ", "ret", "urn", " n"}) {
    prefix += typed;
    const auto b =
        f.post("/infill",
               {{"input_prefix", prefix}, {"input_suffix", suffix_text}, {"n_predict", 3}, {"temperature", 0}})
            ->body();
    cached += b["tokens_cached"].get<std::size_t>();
    computed += b["timings"]["prompt_n"].get<std::size_t>();
    generated += b["timings"]["predicted_n"].get<std::size_t>();
  }
  f.post("/infill", {{"input_prefix", 5}});  // an error, counted apart
  auto ch = f.send("GET", "/metrics", "");
  CHECK(ch->status() == 200);
  CHECK(ch->content_type().starts_with("text/plain; version=0.0.4"));
  const std::string text = ch->raw();
  const auto& m = f.svc->metrics();
  CHECK(m.total("efim_prompt_tokens_cached_total") == static_cast<double>(cached));
  CHECK(m.total("efim_prompt_tokens_total") == static_cast<double>(cached + computed));
  CHECK(m.total("efim_generated_tokens_total") == static_cast<double>(generated));
  CHECK(m.value("efim_requests_total", {{"endpoint", "/infill"}, {"status", "200"}, {"change", "append"}}) == 3);
  CHECK(m.value("efim_requests_total", {{"endpoint", "/infill"}, {"status", "200"}, {"change", "first"}}) == 1);
  CHECK(m.value("efim_requests_total", {{"endpoint", "/infill"}, {"status", "400"}, {"change", "none"}}) == 1);
  CHECK(text.find("efim_prompt_tokens_cached_total " + std::to_string(cached) + "\n") != std::string::npos);
  CHECK(text.find("efim_kv_blocks{state=\"free\"}") != std::string::npos);
  CHECK(text.find("efim_request_duration_seconds_bucket{endpoint=\"/infill\",le=\"+Inf\"} 4\n") != std::string::npos);
  CHECK(text.find("efim_time_to_first_token_seconds_count{endpoint=\"/infill\"} 4\n") != std::string::npos);
  CHECK(text.find("# TYPE efim_request_duration_seconds histogram\n") != std::string::npos);
  // Random paths share one label.
  f.send("GET", "/a/b/c", "");
  CHECK(m.value("efim_requests_total", {{"endpoint", "other"}, {"status", "404"}, {"change", "none"}}) == 1);
}

TEST_CASE("server: a client that goes away cancels its request; its blocks stay cached", "[server]") {
  fixture f;
  auto ch = f.post("/infill", {{"input_prefix", prefix_text},
                               {"input_suffix", suffix_text},
                               {"n_predict", 900},
                               {"stream", true},
                               {"temperature", 0},
                               {"ignore_eos", true}});
  // Wait for the first tokens, then hang up.
  for (int i = 0; i < 6000 && ch->answers() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(ch->answers() == 1);
  ch->disconnect();
  const auto last = json::parse(ch->events().back());
  CHECK(last["efim"]["finish"] == "cancelled");
  CHECK(last["stop_type"] == "none");
  CHECK(last["timings"]["predicted_n"].get<int>() < 900);
  CHECK(f.svc->in_flight() == 0);
  const auto again =
      f.post("/infill", {{"input_prefix", prefix_text}, {"input_suffix", suffix_text}, {"n_predict", 1}})->body();
  CHECK(again["tokens_cached"].get<int>() > 0);
}

TEST_CASE("server: limits answer 503 and 401, tenants never share cache or sessions", "[server][limits]") {
  server::service_options o;
  o.max_in_flight = 1;
  o.api_keys = {"key-a", "key-b"};
  fixture f(o);
  const std::vector<server::header> a{{"Authorization", "Bearer key-a"}}, b{{"X-Api-Key", "key-b"}};
  const json body = {{"input_prefix", prefix_text}, {"input_suffix", suffix_text}, {"n_predict", 2}};
  CHECK(f.post("/infill", body)->status() == 401);
  CHECK(f.post("/infill", body, {{"Authorization", "Bearer nope"}})->status() == 401);
  CHECK(f.send("GET", "/health", "")->status() == 200);  // public
  CHECK(f.send("GET", "/metrics", "")->status() == 401);
  CHECK(f.post("/infill", body, a)->status() == 200);
  CHECK(f.post("/infill", body, a)->body()["tokens_cached"].get<int>() > 0);
  CHECK(f.post("/infill", body, b)->body()["tokens_cached"] == 0);  // another key: another tenant
  auto salted = body;
  salted["cache_salt"] = "s1";
  CHECK(f.post("/infill", salted, a)->body()["tokens_cached"] == 0);
  // One request in flight at most: the second is refused while the first runs.
  auto slow = body;
  slow["n_predict"] = 600;
  slow["stream"] = true;
  slow["ignore_eos"] = true;
  auto first = f.post("/infill", slow, a);
  for (int i = 0; i < 6000 && first->answers() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto second = f.post("/infill", body, a);
  CHECK(second->status() == 503);
  CHECK(second->body()["error"]["type"] == "unavailable_error");
  first->disconnect();
  first->wait();
}

TEST_CASE("server: a newer request of the same session supersedes the older one", "[server][session]") {
  fixture f;
  json body = {{"input_prefix", prefix_text},
               {"input_suffix", suffix_text},
               {"n_predict", 600},
               {"stream", true},
               {"ignore_eos", true}};
  auto older = f.post("/infill", body, {{"X-Session-Id", "editor-7"}});
  for (int i = 0; i < 6000 && older->answers() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  body["input_prefix"] = prefix_text + "  ";
  body["n_predict"] = 2;
  body["stream"] = false;
  auto newer = f.post("/infill", body, {{"X-Session-Id", "editor-7"}});
  CHECK(newer->body()["efim"]["change"] == "append");
  CHECK(newer->body()["efim"]["session"] == "editor-7");
  CHECK(json::parse(older->events().back())["efim"]["finish"] == "superseded");
}

TEST_CASE("server: draining lets what is in flight finish within the grace and refuses new work", "[server]") {
  fixture f;
  auto ch = f.post("/infill", {{"input_prefix", prefix_text}, {"input_suffix", suffix_text}, {"n_predict", 24}});
  f.svc->drain(std::chrono::seconds(60));
  REQUIRE(ch->status() == 200);
  CHECK(ch->body()["efim"]["finish"] != "cancelled");  // it had the time to finish
  CHECK(f.post("/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}})->status() == 503);
  CHECK(f.send("GET", "/health", "")->status() == 503);
  CHECK(f.send("GET", "/metrics", "")->status() == 200);
}

TEST_CASE("server: past the grace, draining cancels what runs, and answers it", "[server]") {
  fixture f;
  auto ch = f.long_stream();
  f.svc->drain(std::chrono::milliseconds(0));
  REQUIRE(ch->status() == 200);
  const auto events = ch->events();
  REQUIRE(!events.empty());
  CHECK(json::parse(events.back())["efim"]["finish"] == "cancelled");
}

TEST_CASE("server: drain from two threads at once (a signal and an error path)", "[server]") {
  for (int round = 0; round < 10; ++round) {
    fixture f;
    auto ch = f.long_stream();
    std::thread graceful([&] { f.svc->drain(std::chrono::milliseconds(50)); });
    std::thread at_once([&] { f.svc->drain(std::chrono::milliseconds(0)); });
    graceful.join();
    at_once.join();
    CHECK(ch->status() == 200);
    CHECK(f.post("/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}})->status() == 503);
  }
}

TEST_CASE("server: fuzzed bodies on every endpoint get exactly one answer, never a crash", "[server][fuzz]") {
  fixture f;
  const std::vector<std::pair<std::string, json>> seeds{
      {"/infill", llama_vim_body(prefix_text, "  x", suffix_text)},
      {"/v1/completions", {{"prompt", "a"}, {"suffix", "b"}, {"max_tokens", 2}, {"stop", {"\n"}}, {"stream", true}}},
      {"/tokenize", {{"content", "abc"}, {"with_pieces", true}}},
      {"/detokenize", {{"tokens", {1, 2, 3}}}}};
  rng r(77);
  const std::vector<std::string> junk{"null", "true", "-1",          "1e308", "\"\"",
                                      "[]",   "{}",   "\"\\u0000\"", "[[[[",  "9999999999999999999999"};
  std::vector<std::shared_ptr<recorded_channel>> answered;
  std::map<int, int> statuses;
  for (int i = 0; i < 1500; ++i) {
    const auto& [target, seed] = seeds[r.below(seeds.size())];
    std::string body = seed.dump();
    // Mutate: overwrite, insert or delete bytes; or replace a value with junk.
    for (std::size_t n = 1 + r.below(4); n > 0 && !body.empty(); --n) {
      const std::size_t at = r.below(body.size());
      switch (r.below(4)) {
        case 0:
          body[at] = static_cast<char>(r.below(256));
          break;
        case 1:
          body.insert(at, 1, "{}[]\",:\\0123456789aeflnrstu"[r.below(28)]);
          break;
        case 2:
          body.erase(at, 1 + r.below(8));
          break;
        default: {
          json j = json::parse(seed.dump());
          const auto key = std::next(j.begin(), static_cast<std::ptrdiff_t>(r.below(j.size()))).key();
          j[key] = json::parse(junk[r.below(junk.size())], nullptr, false);
          body = j.dump(-1, ' ', false, json::error_handler_t::replace);
        }
      }
    }
    auto ch = f.send("POST", target, body);
    answered.push_back(ch);
    if (answered.size() == 32) {
      for (auto& c : answered) {
        const int s = c->status();
        REQUIRE((s == 200 || s == 400));
        REQUIRE(c->answers() == 1);
        ++statuses[s];
      }
      answered.clear();
    }
  }
  for (auto& c : answered) c->wait();
  // Both kinds are well represented: the mutations reach the engine as well as the parser.
  CHECK(statuses[200] > 100);
  CHECK(statuses[400] > 300);
  CHECK(f.post("/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}, {"n_predict", 1}})->status() == 200);
}

TEST_CASE("server: when the engine fails, requests get the error, then 503, and /health says so", "[server]") {
  // A real pipeline whose step fails once it has been told to.
  struct faulty_pipeline : efim_pipeline {
    using efim_pipeline::efim_pipeline;
    std::atomic<bool> fail{false};
    bool step() {
      if (fail) throw std::runtime_error("injected engine failure");
      return efim_pipeline::step();
    }
  };
  const auto w = efim_test::small_weights();
  faulty_pipeline p(efim_test::qwen_tokenizer(), w, efim_test::small_options(512, true, 128));
  server::service<faulty_pipeline> svc(p, {});
  const auto send = [&](std::string method, std::string target, std::string body) {
    auto ch = std::make_shared<recorded_channel>();
    svc.handle({std::move(method), std::move(target), {}, std::move(body)}, ch);
    return ch;
  };
  const json body = {{"input_prefix", prefix_text}, {"input_suffix", suffix_text}, {"n_predict", 2}};
  CHECK(send("POST", "/infill", body.dump())->status() == 200);
  p.fail = true;
  auto failed = send("POST", "/infill", body.dump());
  CHECK(failed->status() == 500);
  CHECK(failed->body()["error"]["message"] == "injected engine failure");
  auto later = send("POST", "/infill", body.dump());
  CHECK(later->status() == 503);
  CHECK(later->body()["error"]["message"].get<std::string>().find("injected engine failure") != std::string::npos);
  auto health = send("GET", "/health", "");
  CHECK(health->status() == 503);
  CHECK(send("GET", "/metrics", "")->status() == 200);  // the counters, without the engine's gauges
}

TEST_CASE("server: a process that exits while its service works exits clean", "[server][exit]") {
  // exit() runs the static destructors while the handler and engine threads go on (libFuzzer exits so,
  // and so do a runtime's fatal paths and test harnesses): nothing those threads read may be among
  // them. Children of this process exit while a service answers and a BPE tokenizer encodes; under
  // the sanitizers a read of freed memory (or a race) makes the exit status nonzero, everywhere a
  // hang or a crash at exit does.
  // Letters, digits, punctuation and spaces of several scripts: every class the pre-tokenizer asks.
  std::string doc;
  for (int i = 0; i < 50; ++i)
    doc += "def f\xC3\xA9(x_1):\n    return \xE4\xB8\xAD\xE6\x96\x87 + 42 # \xD0\xBF\xD1\x80\xD0\xB8\n";
  for (const int ms : {0, 3, 15, 60}) {
    std::fflush(nullptr);  // the child's exit flushes its copy of the buffers
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(SIGABRT, SIG_DFL);
      alarm(60);
      auto* f = new fixture;  // never destroyed: the process exits while it works
      efim_test::tokenize_forever(2, doc);
      const std::string infill = llama_vim_body(doc.substr(0, 200), "", doc.substr(200, 100)).dump();
      const std::string tokenize = json{{"content", doc}}.dump();
      for (const char* target : {"/infill", "/tokenize"})
        std::thread([f, target, body = std::string_view(target) == "/infill" ? infill : tokenize] {
          for (;;) {
            auto ch = f->send("POST", target, body);
            while (!ch->done()) std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
        }).detach();
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      std::exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    INFO("exit after " << ms << " ms");
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
