// efim-server in front of llama.cpp's llama-server (efim-server --upstream): both real processes on
// loopback, a random-weight model that efim-model writes and llama-server loads, the real Qwen2.5-Coder
// vocabulary. Sessions, layouts and tokens in efim, the compute in llama-server: the same greedy text
// as llama-server's own on the same ids, keystrokes that llama-server computes from its cache, and
// every way the upstream can fail answered with a clear error while efim-server keeps serving.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "http/client.hpp"
#include "server_process.hpp"
#include "vocab.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using efim_examples::http::client;
using efim_examples::http::parse_url;

namespace {

using efim_test::free_port;

const std::string build_dir = EFIM_TEST_BINARY_DIR;
const std::string llama_server_path = std::string(EFIM_SOURCE_DIR) + "/.cache/llama.cpp/native/bin/llama-server";
const std::string tokenizer_path = std::string(EFIM_TOKENIZER_CACHE) + "/qwen2.5-coder/tokenizer.json";

// Where a needed program or file is missing, the whole suite says it is skipped (ctest reports it so).
void require_tools() {
  for (const auto& [path, how] : {std::pair{llama_server_path, "bench/build_llama_cpp.sh --server builds it"},
                                  std::pair{tokenizer_path, ".ci/setup fetches it"}})
    if (!fs::exists(path)) {
      std::cout << "test_upstream: skipped: no " << path << " (" << how << ")" << std::endl;
      std::exit(0);
    }
}

// A small random-weight Qwen2 model with the real vocabulary, written once.
const std::string& model_file() {
  static const std::string path = [] {
    const std::string out = build_dir + "/upstream-model.gguf";
    const std::string cmd = std::string(EFIM_MODEL_PATH) +
                            " make --arch qwen2 --hidden 256 --layers 2 --heads 4 --kv-heads 2 --ffn 512 "
                            "--context 8192 --type f16 --seed 7 --tokenizer " +
                            tokenizer_path + " " + out + " > " + build_dir + "/upstream-model.log 2>&1";
    REQUIRE(std::system(cmd.c_str()) == 0);
    return out;
  }();
  return path;
}

// llama-server on a port of its own, ready when /health answers 200.
class llama_server {
 public:
  explicit llama_server(std::string port = free_port(), const std::vector<std::string>& extra = {})
      : port_(std::move(port)) {
    std::vector<std::string> args{llama_server_path, "-m",     model_file(), "--host", "127.0.0.1",  "--port",
                                  port_,             "-np",    "2",          "-t",     "2",          "--no-webui",
                                  "--no-warmup",     "-c",     "8192"};
    args.insert(args.end(), extra.begin(), extra.end());  // a later -c wins
    proc_ = std::make_unique<efim_test::process>(args, build_dir + "/upstream-llama-server-" + port_ + ".log");
    client c(parse_url(url()), std::chrono::seconds(5));
    for (int i = 0; i < 1200; ++i) {
      REQUIRE(proc_->running());
      try {
        if (c.get("/health").status == 200) return;
      } catch (const std::exception&) {
        c.close();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL("llama-server did not start: " << proc_->log());
  }

  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + port_; }
  [[nodiscard]] const std::string& port() const { return port_; }
  efim_test::process& proc() { return *proc_; }

 private:
  std::string port_;
  std::unique_ptr<efim_test::process> proc_;
};

llama_server& shared_llama() {
  static llama_server s;
  return s;
}

efim_test::server_process& shared_efim() {
  static efim_test::server_process s(EFIM_SERVER_PATH,
                                     {"--upstream", shared_llama().url(), "--tokenizer", tokenizer_path,
                                      "--upstream-timeout-ms", "60000", "--n-predict", "16"},
                                     build_dir + "/upstream-efim-server.log");
  return s;
}

// The same, speaking OpenAI's /v1/completions to llama-server (ids from its logprobs).
efim_test::server_process& shared_efim_openai() {
  static efim_test::server_process s(EFIM_SERVER_PATH,
                                     {"--upstream", shared_llama().url(), "--upstream-api", "openai", "--tokenizer",
                                      tokenizer_path, "--upstream-timeout-ms", "60000", "--n-predict", "16"},
                                     build_dir + "/upstream-efim-server-openai.log");
  return s;
}

json post_json(client& c, const std::string& path, const json& body, int want = 200) {
  const auto r = c.post(path, body.dump());
  INFO(path << " -> " << r.status << " " << r.body);
  REQUIRE(r.status == want);
  return json::parse(r.body);
}

// An /infill answer with return_tokens, streamed or not (as the body asks): its text, the ids of its
// tokens, and the final object (the answer, or the stream's last event).
struct infill_answer {
  std::string text;
  std::vector<int> tokens;
  json final;
};
infill_answer post_infill(client& c, const json& body) {
  infill_answer a;
  if (!body.value("stream", false)) {
    a.final = post_json(c, "/infill", body);
    a.text = a.final["content"];
    a.tokens = a.final["tokens"].get<std::vector<int>>();
    return a;
  }
  efim_examples::http::sse_reader sse;
  const auto r = c.post("/infill", body.dump(), {}, [&](std::string_view bytes) {
    sse.feed(bytes, [&](std::string_view data) {
      const json ev = json::parse(data);
      a.text += ev.value("content", "");
      if (ev.value("stop", false))
        a.final = ev;  // (its tokens: all of them again)
      else
        for (const auto& t : ev["tokens"]) a.tokens.push_back(t.get<int>());
    });
  });
  REQUIRE(r.status == 200);
  return a;
}

// Code of about `lines` lines, different for each seed.
std::string code(int seed, int lines) {
  std::string s;
  for (int i = 0; i < lines; ++i)
    s += "    total_" + std::to_string(seed) + " += compute_value(" + std::to_string(i * 7 + seed) + ", items[" +
         std::to_string(i) + "])\n";
  return s;
}

}  // namespace

TEST_CASE("efim-server checks the upstream's vocabulary and says what it serves", "[upstream]") {
  require_tools();
  auto& efim = shared_efim();
  CHECK(efim.log().find("vocabulary checked") != std::string::npos);
  client c(parse_url(efim.url()));
  CHECK(c.get("/health").status == 200);
  const json models = json::parse(c.get("/v1/models").body);
  CHECK(models["data"][0]["meta"]["n_ctx"] == 4096);  // llama-server's context per slot
  CHECK(models["data"][0]["meta"]["format"] == "efim");

  // A vocabulary that is not the upstream's: refused at start, with the reason.
  const std::string other = (efim_test::vocab_dir() / "ggml-vocab-starcoder.gguf").string();
  if (fs::exists(other)) {
    efim_test::process wrong({EFIM_SERVER_PATH, "--upstream", shared_llama().url(), "--tokenizer", other, "--port", "0"},
                             build_dir + "/upstream-efim-wrong-vocab.log");
    const int code = wrong.stop(0, std::chrono::seconds(60));  // signal 0: waits for it to exit by itself
    INFO(wrong.log());
    CHECK(code == 1);
    CHECK(wrong.log().find("vocabulary") != std::string::npos);
  }
}

TEST_CASE("greedy text through efim-server equals llama-server's own on the same ids", "[upstream]") {
  require_tools();
  const bool openai = GENERATE(false, true);  // efim-server speaks llama.cpp's /completion, or OpenAI's API
  INFO("--upstream-api " << (openai ? "openai" : "llama"));
  client e(parse_url(openai ? shared_efim_openai().url() : shared_efim().url()));
  client l(parse_url(shared_llama().url()));
  const std::string prefix = "def total(items):\n" + code(1, 6) + "    return tot";
  const std::string suffix = "\n\nprint(total([1, 2, 3]))\n";
  // The first request of a session is laid out as <PRE>prefix<SUF>suffix<MID>.
  const json ids = post_json(e, "/tokenize",
                             {{"content", "<|fim_prefix|>" + prefix + "<|fim_suffix|>" + suffix + "<|fim_middle|>"},
                              {"parse_special", true}})["tokens"];
  const json direct = post_json(l, "/completion",
                                {{"prompt", ids},
                                 {"n_predict", 24},
                                 {"temperature", 0},
                                 {"top_k", 0},
                                 {"min_p", 0},
                                 {"cache_prompt", false},
                                 {"return_tokens", true}});
  for (const bool stream : {false, true}) {
    const json body = {{"input_prefix", prefix}, {"input_suffix", suffix}, {"n_predict", 24},
                       {"temperature", 0},       {"stream", stream},       {"return_tokens", true},
                       {"session_id", std::string(openai ? "openai-" : "") + (stream ? "greedy-stream" : "greedy")}};
    auto [text, tokens, final] = post_infill(e, body);
    INFO("stream " << stream << ": efim " << json(text).dump() << ", llama-server " << direct["content"].dump());
    CHECK(text == direct["content"].get<std::string>());
    auto theirs = direct["tokens"].get<std::vector<int>>();
    if (direct["stop_type"] == "eos" && !theirs.empty()) theirs.pop_back();  // llama.cpp lists the end token
    CHECK(tokens == theirs);
    CHECK(final["tokens_evaluated"] == ids.size());
  }
}

// Qwen2.5's model has 151,936 rows and its tokenizer 151,665 tokens: llama.cpp names the rest [PAD...]
// and gives them no text. A model may generate them (a random one does, now and then): efim counts
// them as generated tokens without text. Here llama-server biases one such row and the token "x" by
// +100 (its --logit-bias), so the sampled text is x's among padding; efim's answer must be
// llama-server's own for the same ids and seed: the same text, the named ids, every token counted.
TEST_CASE("tokens of the model's padding rows come through as tokens without text", "[upstream]") {
  require_tools();
  constexpr int pad = 151914, x = 87;
  llama_server biased(free_port(), {"-l", std::to_string(pad) + "+100", "-l", std::to_string(x) + "+100"});
  const bool openai = GENERATE(false, true);
  INFO("--upstream-api " << (openai ? "openai" : "llama"));
  efim_test::server_process efim(EFIM_SERVER_PATH,
                                 {"--upstream", biased.url(), "--upstream-api", openai ? "openai" : "llama",
                                  "--tokenizer", tokenizer_path, "--upstream-timeout-ms", "60000"},
                                 build_dir + "/upstream-efim-padding.log");
  client e(parse_url(efim.url()));
  client l(parse_url(biased.url()));
  const std::string prefix = "def f(x):\n    return ", suffix = "\n";
  const json ids = post_json(e, "/tokenize",
                             {{"content", "<|fim_prefix|>" + prefix + "<|fim_suffix|>" + suffix + "<|fim_middle|>"},
                              {"parse_special", true}})["tokens"];
  const json sampling = {{"n_predict", 32}, {"temperature", 1.0}, {"top_k", 40}, {"top_p", 0.95}, {"seed", 5}};
  json direct_body = sampling;
  direct_body.update({{"prompt", ids}, {"min_p", 0}, {"cache_prompt", false}, {"return_tokens", true}});
  const json direct = post_json(l, "/completion", direct_body);
  const auto theirs = direct["tokens"].get<std::vector<int>>();
  REQUIRE(theirs.size() == 32);
  const auto pads = std::count(theirs.begin(), theirs.end(), pad);
  INFO("llama-server: " << direct["tokens"].dump());
  REQUIRE(pads > 0);  // both kinds sampled, or the test shows nothing
  REQUIRE(pads < 32);
  std::vector<int> named;
  std::copy_if(theirs.begin(), theirs.end(), std::back_inserter(named), [](int t) { return t != pad; });
  CHECK(direct["content"] == std::string(named.size(), 'x'));

  for (const bool stream : {false, true}) {
    INFO("stream " << stream);
    json body = sampling;
    body.update({{"input_prefix", prefix}, {"input_suffix", suffix}, {"stream", stream}, {"return_tokens", true},
                 {"session_id", "padding-" + std::to_string(stream)}});
    auto [text, tokens, final] = post_infill(e, body);
    CHECK(text == direct["content"].get<std::string>());
    CHECK(tokens == named);
    CHECK(final["tokens_predicted"] == 32);
    CHECK(final["timings"]["predicted_n"] == 32);
    CHECK(final["stop_type"] == "limit");
  }
  // A completion of padding alone: no text, its tokens counted, its first token timed.
  int seed = 0;
  for (int s = 1; s <= 40 && seed == 0; ++s) {
    json two = direct_body;
    two.update({{"n_predict", 2}, {"seed", s}});
    if (post_json(l, "/completion", two)["tokens"] == json{pad, pad}) seed = s;
  }
  REQUIRE(seed != 0);
  json only = sampling;
  only.update({{"input_prefix", prefix}, {"input_suffix", suffix}, {"n_predict", 2}, {"seed", seed}});
  const json empty = post_json(e, "/infill", only);
  CHECK(empty["content"] == "");
  CHECK(empty["tokens_predicted"] == 2);
  const std::string metrics = e.get("/metrics").body;
  const auto at = metrics.find("efim_time_to_first_token_seconds_sum");
  REQUIRE(at != std::string::npos);
  const double ttft_sum = std::stod(metrics.substr(metrics.find(' ', metrics.find('}', at)) + 1));
  CHECK(ttft_sum >= 0);
  CHECK(ttft_sum < 600);

  // The OpenAI API counts them too, the last ones included.
  for (const int seed : {1, 2, 3, 4, 5, 6}) {
    const json oa = post_json(e, "/v1/completions", {{"prompt", prefix}, {"max_tokens", 32}, {"temperature", 1.0},
                                                     {"seed", seed}});
    CHECK(oa["usage"]["completion_tokens"] == 32);
  }
  // The sessions go on after them: a keystroke (appended), and the suggestion's first x's accepted
  // (the ids before its first padding token reused, the rest tokenized).
  for (const auto& [typed, session, change] : {std::tuple{"y", "padding-0", "append"}, {"xxx", "padding-1", "accepted"}}) {
    json next = sampling;
    next.update({{"input_prefix", prefix + typed}, {"input_suffix", suffix}, {"session_id", session}});
    const json r = post_json(e, "/infill", next);
    CHECK(r["efim"]["change"] == change);
    CHECK(r["efim"]["reused_tokens"] == (std::string(change) == "accepted" ? 1 : 0));
    CHECK(r["tokens_predicted"] == 32);
  }
}

TEST_CASE("keystrokes through efim-server: llama-server computes only what was typed", "[upstream]") {
  require_tools();
  const bool openai = GENERATE(false, true);
  INFO("--upstream-api " << (openai ? "openai" : "llama"));
  client e(parse_url(openai ? shared_efim_openai().url() : shared_efim().url()));
  const std::string prefix = "def run(items):\n" + code(2, 40);
  const std::string suffix = "\n" + code(3, 40) + "\nrun([])\n";
  const std::string typed = "    result = compute_value(";
  std::size_t most = 0;
  for (std::size_t i = 0; i <= typed.size(); i += 3) {
    const json r = post_json(e, "/infill",
                             {{"input_prefix", prefix + typed.substr(0, i)},
                              {"input_suffix", suffix},
                              {"n_predict", 4},
                              {"temperature", 0},
                              {"session_id", openai ? "openai-keys" : "keys"}});
    const std::size_t computed = r["timings"]["prompt_n"].get<std::size_t>();
    INFO("keystroke " << i << ": prompt " << r["tokens_evaluated"] << ", computed " << computed);
    CHECK(r["tokens_evaluated"].get<std::size_t>() > 900);
    if (i > 0) most = std::max(most, computed);
    if (i > 0) CHECK(computed <= 3 + 16);  // the typed characters' tokens, and the few after the cut
  }
  CHECK(most > 0);
}

TEST_CASE("token healing through the upstream's grammar: the client gets what follows the removed text",
          "[upstream]") {
  require_tools();
  client e(parse_url(shared_efim().url()));
  const std::string prefix = "def mean(values):\n" + code(5, 8);
  const std::string suffix = "\n\nprint(mean([1.0, 2.0]))\n";
  // Typed text cut mid-word is healed: its last tokens go, and the upstream must give them back first.
  const std::string typed = "    return sum(val";
  const auto healed = [&](client& c) {
    post_json(c, "/infill", {{"input_prefix", prefix}, {"input_suffix", suffix}, {"n_predict", 2}, {"session_id", "heal"}});
    return post_json(c, "/infill",
                     {{"input_prefix", prefix + typed},
                      {"input_suffix", suffix},
                      {"n_predict", 8},
                      {"temperature", 0},
                      {"heal_tokens", 2},
                      {"return_tokens", true},
                      {"session_id", "heal"}});
  };
  const json r = healed(e);
  INFO(r.dump());
  REQUIRE(r["efim"]["healed_tokens"].get<int>() > 0);
  // Everything the upstream generated, detokenized: the removed text, then the client's text.
  const std::string all = post_json(e, "/detokenize", {{"tokens", r["tokens"]}})["content"];
  const std::string content = r["content"];
  REQUIRE(all.size() > content.size());
  CHECK(all.ends_with(content));
  const std::string removed = all.substr(0, all.size() - content.size());
  CHECK(typed.ends_with(removed));

  // efim-server computing in-process on the same model file heals the same tokens and, greedy, gives
  // the same text: the grammar at the upstream constrains as efim's own healing does.
  efim_test::server_process local(EFIM_SERVER_PATH, {"--model", model_file(), "--threads", "2", "--kv", "f32"},
                                  build_dir + "/upstream-efim-local.log");
  client l(parse_url(local.url()));
  const json mine = healed(l);
  INFO("in-process: " << mine.dump());
  CHECK(mine["efim"]["healed_tokens"] == r["efim"]["healed_tokens"]);
  CHECK(mine["efim"]["healing_steps"] == r["efim"]["healing_steps"]);
  CHECK(mine["tokens"] == r["tokens"]);
  CHECK(mine["content"] == r["content"]);
}

TEST_CASE("a client that hangs up ends its request at the upstream", "[upstream]") {
  require_tools();
  client e(parse_url(shared_efim().url()));
  client l(parse_url(shared_llama().url()));
  const auto processing = [&] {
    int n = 0;
    for (const auto& slot : json::parse(l.get("/slots").body)) n += slot.value("is_processing", false) ? 1 : 0;
    return n;
  };
  const auto wait_idle = [&] {
    int left = processing();
    for (int i = 0; i < 200 && left > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      left = processing();
    }
    return left;
  };
  REQUIRE(wait_idle() == 0);  // requests efim ended may still be noticed ending there
  {
    client gone(parse_url(shared_efim().url()));
    try {
      gone.post("/infill",
                json{{"input_prefix", "def f():\n"}, {"input_suffix", ""}, {"n_predict", 4000}, {"ignore_eos", true},
                     {"stream", true}}
                    .dump(),
                {}, [&](std::string_view) { throw std::runtime_error("hang up"); });  // at the first bytes
    } catch (const std::runtime_error&) {
    }
    CHECK(processing() == 1);
  }  // the connection closes here
  CHECK(wait_idle() == 0);
  // llama-server says where it stopped: far before the 4,000 tokens asked for.
  const std::string log = shared_llama().proc().log();
  const std::string marker = "stop processing: n_tokens = ";
  const auto at = log.rfind(marker);
  REQUIRE(at != std::string::npos);
  const int tokens = std::stoi(log.substr(at + marker.size()));
  INFO(log.substr(at, 80));
  CHECK(tokens < 2000);
  CHECK(post_json(e, "/infill", {{"input_prefix", "x = "}, {"input_suffix", ""}, {"n_predict", 2}}).contains("content"));
}

TEST_CASE("bad input is refused before it reaches the upstream", "[upstream]") {
  require_tools();
  client e(parse_url(shared_efim().url()));
  CHECK(e.post("/infill", "{not json").status == 400);
  CHECK(e.post("/infill", json{{"input_prefix", "a"}, {"input_suffix", "b"}, {"n_predict", -5}}.dump()).status == 400);
  CHECK(e.post("/infill", std::string("{\"input_prefix\": \"\xff\", \"input_suffix\": \"\"}")).status == 400);
  // Longer than the upstream's context.
  CHECK(e.post("/infill", json{{"input_prefix", code(4, 600)}, {"input_suffix", ""}, {"n_predict", 4}}.dump()).status ==
        400);
}

TEST_CASE("an upstream that dies or stalls gets a clear error, and efim-server keeps serving", "[upstream]") {
  require_tools();
  auto up = std::make_unique<llama_server>();
  const std::string port = up->port();
  efim_test::server_process efim(EFIM_SERVER_PATH,
                                 {"--upstream", up->url(), "--tokenizer", tokenizer_path, "--upstream-timeout-ms", "3000"},
                                 build_dir + "/upstream-efim-failures.log");
  client e(parse_url(efim.url()));
  const json body = {{"input_prefix", "def f(x):\n    return "}, {"input_suffix", "\n"}, {"n_predict", 8}};
  CHECK(post_json(e, "/infill", body).contains("content"));

  SECTION("killed in the middle of a stream") {
    json streaming = body;
    streaming["stream"] = true;
    streaming["n_predict"] = 4000;
    streaming["ignore_eos"] = true;  // long enough to be cut
    std::string seen;
    bool killed = false;
    const auto r = e.post("/infill", streaming.dump(), {}, [&](std::string_view bytes) {
      seen += bytes;
      if (!killed) {
        killed = true;
        up->proc().stop(SIGKILL);
      }
    });
    CHECK(r.status == 200);
    INFO(seen.substr(seen.size() > 600 ? seen.size() - 600 : 0));
    CHECK(seen.find("\"error\"") != std::string::npos);
    // The server is up; the dead upstream is answered 502 at once.
    CHECK(e.get("/health").status == 200);
    const auto dead = e.post("/infill", body.dump());
    CHECK(dead.status == 502);
    CHECK(dead.body.find("upstream") != std::string::npos);
    // The upstream comes back on its port: served again.
    up.reset();
    up = std::make_unique<llama_server>(port);
    CHECK(post_json(e, "/infill", body).contains("content"));
  }

  SECTION("stalled: answered 504 after the timeout") {
    kill(up->proc().pid(), SIGSTOP);
    const auto start = std::chrono::steady_clock::now();
    const auto r = e.post("/v1/completions", json{{"prompt", "x = "}, {"suffix", "\n"}, {"max_tokens", 4}}.dump());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    kill(up->proc().pid(), SIGCONT);
    INFO(r.body);
    CHECK(r.status == 504);
    CHECK(json::parse(r.body)["error"]["message"].get<std::string>().find("upstream") != std::string::npos);
    CHECK(s < 20);
    CHECK(post_json(e, "/infill", body).contains("content"));
  }
  CHECK(efim.stop() == 0);
}

TEST_CASE("a prompt budget: efim sends waiting prompts oldest first, not in llama-server's slot order", "[upstream]") {
  require_tools();
  // llama-server computing 16 prompt tokens a step: a prompt of 7,000 tokens takes seconds.
  llama_server slow(free_port(), {"-b", "16", "-ub", "16", "-c", "32768"});
  const bool budget = GENERATE(true, false);
  INFO("--upstream-prompt-budget " << (budget ? "32" : "0"));
  efim_test::server_process efim(EFIM_SERVER_PATH,
                                 {"--upstream", slow.url(), "--tokenizer", tokenizer_path, "--upstream-prompt-budget",
                                  budget ? "32" : "0"},
                                 build_dir + "/upstream-efim-budget.log");
  const auto infill = [&](const std::string& session, const std::string& prefix, int n) {
    return json{{"input_prefix", prefix}, {"input_suffix", "\n"}, {"n_predict", n}, {"ignore_eos", true},
                {"temperature", 0},       {"session_id", session}};
  };
  client e(parse_url(efim.url()));
  client l(parse_url(slow.url()));
  // "short" takes slot 0, "long" slot 1 (each session is kept on the slot it had).
  post_json(e, "/infill", infill("short", "x = ", 1));
  post_json(e, "/infill", infill("long", "y = ", 1));
  const auto processing = [&] {
    int n = 0;
    for (const auto& slot : json::parse(l.get("/slots").body)) n += slot.value("is_processing", false) ? 1 : 0;
    return n;
  };
  const auto waiting = [&] {
    const std::string m = e.get("/metrics").body;
    const std::string key = "\nefim_requests_waiting ";
    const auto at = m.find(key);
    REQUIRE(at != std::string::npos);
    return std::stoi(m.substr(at + key.size()));
  };
  using clock = std::chrono::steady_clock;
  std::atomic<clock::rep> long_done{0}, short_done{0};  // written by the requests' threads
  std::thread long_request([&] {
    client c(parse_url(efim.url()));
    const auto r = c.post("/infill", infill("long", "def run(items):\n" + code(5, 400), 1).dump());
    long_done = clock::now().time_since_epoch().count();
    CHECK(r.status == 200);
  });
  int seen = 0;
  for (int i = 0; i < 400 && seen == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = processing();
  }
  REQUIRE(seen == 1);  // the long prompt is being computed
  std::thread short_request([&] {
    client c(parse_url(efim.url()));
    const auto r = c.post("/infill", infill("short", "x = 1\nprint(x)\n", 8).dump());
    short_done = clock::now().time_since_epoch().count();
    CHECK(r.status == 200);
  });
  // With the budget the short request waits in efim; without, it is at llama-server at once.
  for (int i = 0; i < 400 && (budget ? waiting() == 0 : short_done == 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // A third request whose client gives up while it waits.
  int most_waiting = 0, most_processing = 0, waiting_after_hangup = -1;
  {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(efim.port())));
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    const std::string body = infill("gone", "z = ", 4).dump();
    const std::string request = "POST /infill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    most_waiting = waiting();
    most_processing = processing();
    close(fd);  // hangs up
  }
  for (int i = 0; i < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    waiting_after_hangup = waiting();
    most_processing = std::max(most_processing, processing());
    if (waiting_after_hangup < most_waiting) break;
  }
  const bool long_still_running = processing() > 0 && long_done == 0;
  long_request.join();
  short_request.join();
  CHECK(post_json(e, "/infill", infill("after", "w = ", 2)).contains("content"));
  if (budget) {
    // The short request and the one given up waited in efim while the long prompt was computed; the
    // given-up one left the queue without reaching llama-server; the short one went after the long.
    REQUIRE(long_still_running);  // else the check below proves nothing: slow llama-server down more
    CHECK(most_waiting == 2);
    CHECK(waiting_after_hangup == 1);
    CHECK(most_processing == 1);
    CHECK(short_done > long_done);
  } else {
    // Without the budget, llama-server takes slot 0's prompt first: the later request ends first.
    CHECK(most_waiting == 0);
    CHECK(short_done < long_done);
  }
  CHECK(efim.stop() == 0);
}
