// efim-server as a process, over real HTTP on loopback: every endpoint, streaming, the request bodies
// editors send, bad input of every kind, clients that hang up, 64 sessions typing at once, the
// keystroke budget of EFIM sessions, API keys and a graceful stop.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "editor_requests.hpp"
#include "http/client.hpp"
#include "server_process.hpp"
#include "support.hpp"
#include "vocab.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using efim_examples::http::client;
using efim_examples::http::parse_url;

namespace {

const std::string build_dir = EFIM_TEST_BINARY_DIR;

// The server most tests share: the embedded default model (random weights, the real Qwen2.5-Coder
// vocabulary), 64 requests at once.
efim_test::server_process& shared_server() {
  static efim_test::server_process s(EFIM_SERVER_PATH,
                                     {"--threads", "2", "--parallel", "64", "--n-predict", "8", "--ctx", "8192",
                                      "--max-body-mib", "1", "--cache-tokens", "262144"},
                                     build_dir + "/efim-server-shared.log");
  return s;
}

client connect(const efim_test::server_process& s) { return client(parse_url(s.url())); }

json post_json(client& c, const std::string& path, const json& body, int want_status = 200,
               const std::vector<efim::server::header>& headers = {}) {
  const auto r = c.post(path, body.dump(), headers);
  INFO(path << " -> " << r.status << " " << r.body);
  REQUIRE(r.status == want_status);
  return json::parse(r.body);
}

// Reads a counter or gauge series from the Prometheus text of /metrics (0 if absent).
double metric(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(series + " ")) return std::stod(line.substr(series.size() + 1));
  return 0;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A raw TCP connection to the server, for what an HTTP client library would not send.
class raw_socket {
 public:
  explicit raw_socket(const std::string& port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(port)));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    timeval tv{30, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~raw_socket() { close(); }
  void send(const std::string& bytes) { REQUIRE(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) >= 0); }
  // Reads until the server closes the connection (or `until` appears).
  std::string read(const std::string& until = {}) {
    std::string out;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
      if (!until.empty() && out.find(until) != std::string::npos) break;
    }
    return out;
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

std::string post_request(const std::string& path, const std::string& body) {
  return "POST " + path +
         " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

// Waits until /metrics says `series` reached `at_least` (at most `seconds`); its last value.
double wait_for_metric(client& c, const std::string& series, double at_least, int seconds = 20) {
  double v = 0;
  for (int i = 0; i < seconds * 100; ++i) {
    v = metric(c.get("/metrics").body, series);
    if (v >= at_least) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return v;
}

const std::string code_prefix = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n";
const std::string code_suffix = "\n\nif __name__ == \"__main__\":\n    print(fibonacci(10))\n";

}  // namespace

TEST_CASE("efim-server answers every endpoint over HTTP", "[http]") {
  auto& s = shared_server();
  auto c = connect(s);
  CHECK(c.get("/health").status == 200);
  CHECK(json::parse(c.get("/health").body) == json{{"status", "ok"}});
  const auto models = json::parse(c.get("/v1/models").body);
  CHECK(models["data"][0]["id"] == "efim-default");
  CHECK(models["data"][0]["meta"]["n_vocab"] == 151936);

  // The real Qwen2.5-Coder vocabulary: special-token text is parsed unless told otherwise.
  const auto t = post_json(c, "/tokenize", {{"content", "<|fim_prefix|>def f():"}});
  CHECK(t["tokens"][0] == 151659);
  CHECK(post_json(c, "/tokenize", {{"content", "<|fim_prefix|>"}, {"parse_special", false}})["tokens"].size() > 1);
  CHECK(post_json(c, "/detokenize", {{"tokens", t["tokens"]}})["content"] == "<|fim_prefix|>def f():");

  const auto infill = post_json(c, "/infill",
                                {{"input_prefix", code_prefix},
                                 {"input_suffix", code_suffix},
                                 {"n_predict", 5},
                                 {"temperature", 0},
                                 {"ignore_eos", true}});
  CHECK(infill["timings"]["predicted_n"] == 5);
  CHECK(infill["stop_type"] == "limit");
  const auto oai = post_json(c, "/v1/completions",
                             {{"model", "efim-default"},
                              {"prompt", code_prefix},
                              {"suffix", code_suffix},
                              {"max_tokens", 3},
                              {"temperature", 0}});
  CHECK(oai["object"] == "text_completion");
  CHECK(oai["usage"]["prompt_tokens"].get<int>() > 10);

  const auto m = c.get("/metrics");
  CHECK(m.status == 200);
  CHECK(m.content_type.starts_with("text/plain; version=0.0.4"));
  CHECK(metric(m.body, "efim_kv_blocks{state=\"free\"}") > 0);
  CHECK(metric(m.body, "efim_generated_tokens_total") >= 8);
  // One line per request on stderr, with the session and its change.
  CHECK(s.log().find("POST /infill 200 session=") != std::string::npos);
}

TEST_CASE("efim-server: llama.vim's exact bodies over HTTP", "[http][infill]") {
  auto& s = shared_server();
  auto c = connect(s);
  // As autoload/llama.vim's llama#fim sends it (json_encode of its dict).
  const json body = efim_test::llama_vim_body(code_prefix, "    ret", code_suffix);
  const auto r = c.post("/infill", body.dump());
  REQUIRE(r.status == 200);
  CHECK(r.body.find("\"content\":\"") != std::string::npos);
  CHECK(r.body.find('\n') == std::string::npos);
  const auto b = json::parse(r.body);
  CHECK(b.size() == 11);
  CHECK(b.contains("timings/predicted_per_second"));
  CHECK(b["timings/predicted_ms"].get<double>() >= 0);
  // The ring buffer's warm-up request.
  const json warm = efim_test::llama_vim_warmup_body(body["input_extra"]);
  CHECK(post_json(c, "/infill", warm) == json::object());
}

TEST_CASE("efim-server streams /infill and /v1/completions as server-sent events", "[http][stream]") {
  auto& s = shared_server();
  auto c = connect(s);
  for (const bool openai : {false, true}) {
    json body =
        openai ? json{{"prompt", code_prefix}, {"suffix", code_suffix}, {"max_tokens", 6},
                      {"temperature", 0},      {"stream", true},        {"stream_options", {{"include_usage", true}}}}
               : json{{"input_prefix", code_prefix},
                      {"input_suffix", code_suffix},
                      {"n_predict", 6},
                      {"temperature", 0},
                      {"stream", true},
                      {"ignore_eos", true}};
    std::vector<std::string> events;
    efim_examples::http::sse_reader sse;
    const auto r = c.post(openai ? "/v1/completions" : "/infill", body.dump(), {}, [&](std::string_view bytes) {
      sse.feed(bytes, [&](std::string_view e) { events.emplace_back(e); });
    });
    CHECK(r.status == 200);
    CHECK(r.content_type == "text/event-stream");
    REQUIRE(events.size() >= 2);
    std::string text;
    if (openai) {
      CHECK(events.back() == "[DONE]");
      for (std::size_t i = 0; i + 2 < events.size(); ++i) text += json::parse(events[i])["choices"][0]["text"];
      CHECK(json::parse(events[events.size() - 2])["usage"]["completion_tokens"] == 6);
    } else {
      for (const auto& e : events) text += json::parse(e)["content"].get<std::string>();
      CHECK(json::parse(events.back())["stop"] == true);
    }
    body["stream"] = false;
    const auto whole = post_json(c, openai ? "/v1/completions" : "/infill", body);
    // (As a string: GCC 13 finds no operator== for a string and a json value in C++20.)
    CHECK(text == (openai ? whole["choices"][0]["text"] : whole["content"]).get<std::string>());
  }
}

TEST_CASE("efim-server: bad input gets the right status, and the server keeps serving", "[http][errors]") {
  auto& s = shared_server();
  auto c = connect(s);
  CHECK(c.post("/infill", "{not json").status == 400);
  CHECK(c.post("/infill", R"({"input_prefix": 3, "input_suffix": ""})").status == 400);
  CHECK(c.post("/infill", "{\"input_prefix\": \"\xC3\x28\", \"input_suffix\": \"\"}").status == 400);
  CHECK(c.post("/infill", R"({"input_prefix": "", "input_suffix": "", "n_predict": 1, "no_such_field": [1]})").status ==
        200);
  CHECK(c.post("/v1/completions", R"({"prompt": ["a", "b"]})").status == 400);
  CHECK(c.get("/nope").status == 404);
  // A prompt over the context (8192 tokens).
  const auto over =
      c.post("/infill", json{{"input_prefix", std::string(100000, 'x') + "y"}, {"input_suffix", ""}}.dump());
  CHECK(over.status == 400);
  CHECK(json::parse(over.body)["error"]["type"] == "exceed_context_size_error");
  // A body over the limit (1 MiB): 413, answered before it is read.
  {
    raw_socket raw(s.port());
    raw.send("POST /infill HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n");
    CHECK(raw.read().starts_with("HTTP/1.1 413"));
  }
  // A client still sending a body over the limit gets the 413, not a reset.
  {
    raw_socket raw(s.port());
    raw.send("POST /infill HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n" + std::string(1 << 20, 'x'));
    CHECK(raw.read().starts_with("HTTP/1.1 413"));
  }
  // HTTP/1.0: a stream without chunked encoding, ended by closing the connection.
  {
    raw_socket raw(s.port());
    const std::string body = json{
        {"input_prefix", code_prefix},
        {"input_suffix", code_suffix},
        {"n_predict", 3},
        {"stream", true},
        {"ignore_eos", true}}.dump();
    raw.send("POST /infill HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
             std::to_string(body.size()) + "\r\n\r\n" + body);
    const auto answer = raw.read();
    CHECK(answer.find("Transfer-Encoding") == std::string::npos);
    CHECK(answer.find("Connection: close") != std::string::npos);
    CHECK(answer.find("\"stop\":true") != std::string::npos);
  }
  // Not HTTP at all.
  {
    raw_socket raw(s.port());
    raw.send("HELLO THERE\r\n\r\n");
    CHECK(raw.read().starts_with("HTTP/1.1 400"));
  }
  // A chunked body, and two requests on one connection.
  {
    raw_socket raw(s.port());
    raw.send(
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"con\r\n"
        "d\r\ntent\": \"abc\"}\r\n0\r\n\r\n" +
        post_request("/detokenize", R"({"tokens": [13683]})"));
    const auto both = raw.read("\"content\":\"abc\"");
    CHECK(both.find("{\"tokens\":[13683]}") != std::string::npos);
    CHECK(both.find("{\"content\":\"abc\"}") != std::string::npos);
  }
  CHECK(c.get("/health").status == 200);
}

TEST_CASE("efim-server with StarCoder's vocabulary: text with a character whose byte it lacks is served",
          "[http][errors]") {
  // StarCoder's vocabulary has no token for 0xF1, the lead byte of U+40000-U+7FFFF. The client's
  // text is valid: /tokenize and /infill answer 200 (once, a 500 from /tokenize, the tokenizer's
  // error taken for the server's).
  const std::string vocab = (efim_test::vocab_dir() / "ggml-vocab-starcoder.gguf").string();
  if (!std::filesystem::exists(vocab)) {
    WARN("skipped: no " << vocab << " (the shared data, or .ci/setup's copies)");
    return;
  }
  efim_test::server_process s(EFIM_SERVER_PATH, {"--threads", "2", "--tokenizer", vocab, "--n-predict", "4"},
                              build_dir + "/efim-server-starcoder.log");
  auto c = connect(s);
  const std::string u50000 = R"("\uD900\uDC00")";  // U+50000 as JSON writes it
  const auto t = c.post("/tokenize", R"({"content": )" + u50000 + "}");
  INFO(t.body);
  CHECK(t.status == 200);
  CHECK_FALSE(json::parse(t.body)["tokens"].empty());
  const auto i = c.post("/infill", R"({"input_prefix": "x = '", "input_suffix": )" + u50000 + R"(, "n_predict": 2})");
  INFO(i.body);
  CHECK(i.status == 200);
  CHECK(s.stop() == 0);
}

TEST_CASE("efim-server: a client that hangs up is cancelled at once, streaming or not", "[http][cancel]") {
  auto& s = shared_server();
  auto c = connect(s);
  const std::string cancelled = "efim_requests_finished_total{finish=\"cancelled\"}";
  const double before = metric(c.get("/metrics").body, cancelled);
  const json body = {{"input_prefix", code_prefix},
                     {"input_suffix", code_suffix},
                     {"n_predict", 4000},
                     {"ignore_eos", true},
                     {"temperature", 0}};
  {  // Streaming: read the first event, then hang up.
    auto stream_body = body;
    stream_body["stream"] = true;
    raw_socket raw(s.port());
    raw.send(post_request("/infill", stream_body.dump()));
    CHECK(raw.read("data: ").find("200 OK") != std::string::npos);
  }
  {  // Not streaming: hang up while it computes.
    raw_socket raw(s.port());
    raw.send(post_request("/infill", body.dump()));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  // 4000 tokens would take many seconds; both end now.
  const auto start = std::chrono::steady_clock::now();
  CHECK(wait_for_metric(c, cancelled, before + 2) == before + 2);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(wait_for_metric(c, "efim_requests_in_flight", 0) == 0);
}

TEST_CASE("efim-server: 64 editor sessions typing at once", "[http][concurrency]") {
  auto& s = shared_server();
  constexpr int sessions = 64, keystrokes = 6;
  std::atomic<int> ok{0}, appends{0}, failures{0};
  std::vector<std::thread> editors;
  for (int e = 0; e < sessions; ++e)
    editors.emplace_back([&, e] {
      try {
        auto c = connect(s);
        std::string prefix = "# editor " + std::to_string(e) + "\n" + code_prefix;
        for (int k = 0; k < keystrokes; ++k) {
          prefix += static_cast<char>('a' + (e + k) % 26);
          const auto r =
              c.post("/infill",
                     json{{"input_prefix", prefix}, {"input_suffix", code_suffix}, {"n_predict", 2}, {"temperature", 0}}
                         .dump());
          if (r.status != 200) {
            ++failures;
            continue;
          }
          ++ok;
          if (json::parse(r.body)["efim"]["change"] == "append") ++appends;
        }
      } catch (const std::exception&) {
        ++failures;
      }
    });
  for (auto& t : editors) t.join();
  CHECK(failures == 0);
  CHECK(ok == sessions * keystrokes);
  CHECK(appends == sessions * (keystrokes - 1));  // each editor found its own session every time
}

TEST_CASE("efim-server: keystrokes at a fixed cursor compute only what was typed (1,500 + 1,500 tokens)",
          "[http][keystroke]") {
  auto& s = shared_server();
  auto c = connect(s);
  // A real source file: the cursor after its first 1,500 tokens, the suffix the next 1,500.
  const std::string doc = read_file(fs::path(EFIM_SOURCE_DIR) / "tests" / "model_test.cpp");
  const auto pieces =
      post_json(c, "/tokenize", {{"content", doc}, {"with_pieces", true}, {"parse_special", false}})["tokens"];
  REQUIRE(pieces.size() > 3200);
  std::vector<std::size_t> ends;  // byte end of each token
  std::size_t at = 0;
  for (const auto& p : pieces)
    ends.push_back(at += p["piece"].is_string() ? p["piece"].get<std::string>().size() : p["piece"].size());
  const std::string prefix = doc.substr(0, ends[1499]), suffix = doc.substr(ends[1499], ends[2999] - ends[1499]);
  const std::string typed = "    // typed again: " + doc.substr(ends[100], 60);
  const auto before = c.get("/metrics").body;
  std::size_t cached = 0, computed = 0, last_prompt = 0;
  std::size_t pos = 0;
  for (int k = 0; pos <= typed.size(); ++k) {
    const auto b = post_json(c, "/infill",
                             {{"input_prefix", prefix + typed.substr(0, pos)},
                              {"input_suffix", suffix},
                              {"n_predict", 2},
                              {"temperature", 0}});
    const std::size_t prompt = b["tokens_evaluated"], prompt_n = b["timings"]["prompt_n"];
    cached += b["tokens_cached"].get<std::size_t>();
    computed += prompt_n;
    if (k == 0) {
      CHECK(prompt >= 3000);
    } else {
      INFO("keystroke " << k << ": prompt " << prompt << ", computed " << prompt_n);
      CHECK(b["efim"]["change"] == "append");
      CHECK(prompt_n <= prompt - last_prompt + 16);  // the typed tokens and at most one block
    }
    last_prompt = prompt;
    pos += 1 + k % 3;  // one to three characters per request, as an editor sends them
  }
  const auto after = c.get("/metrics").body;
  const auto delta = [&](const std::string& series) { return metric(after, series) - metric(before, series); };
  CHECK(delta("efim_prompt_tokens_cached_total") == static_cast<double>(cached));
  CHECK(delta("efim_prompt_tokens_total") == static_cast<double>(cached + computed));
}

TEST_CASE("efim-server: API keys, and a graceful stop that answers what is in flight", "[http][lifecycle]") {
  efim_test::server_process s(EFIM_SERVER_PATH, {"--threads", "2", "--api-key", "key-1,key-2", "--grace", "600"},
                              build_dir + "/efim-server-keys.log");
  auto c = connect(s);
  const json body = {{"input_prefix", code_prefix}, {"input_suffix", code_suffix}, {"n_predict", 2}};
  CHECK(c.post("/infill", body.dump()).status == 401);
  CHECK(c.post("/infill", body.dump(), {{"Authorization", "Bearer key-3"}}).status == 401);
  CHECK(c.get("/health").status == 200);
  CHECK(c.post("/infill", body.dump(), {{"Authorization", "Bearer key-1"}}).status == 200);
  // Each key is a tenant: the same prompt is cached for key-1, not for key-2.
  CHECK(post_json(c, "/infill", body, 200, {{"Authorization", "Bearer key-1"}})["tokens_cached"].get<int>() > 0);
  CHECK(post_json(c, "/infill", body, 200, {{"Authorization", "Bearer key-2"}})["tokens_cached"] == 0);

  // A long request in flight (it has streamed its first token) when SIGTERM arrives is answered in
  // full within the grace (minutes: the sanitizer builds run this too); then the process exits 0.
  std::atomic<int> status{0};
  std::atomic<bool> generating{false};
  std::vector<std::string> events;
  std::thread slow([&] {
    auto c2 = connect(s);
    auto long_body = body;
    long_body["n_predict"] = 64;
    long_body["ignore_eos"] = true;
    long_body["stream"] = true;
    efim_examples::http::sse_reader sse;
    const auto r = c2.post("/infill", long_body.dump(), {{"Authorization", "Bearer key-2"}},
                           [&](std::string_view bytes) {
                             generating = true;
                             sse.feed(bytes, [&](std::string_view e) { events.emplace_back(e); });
                           });
    status = r.status;
  });
  for (int i = 0; i < 60000 && !generating; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(generating);
  const std::string port = s.port();
  CHECK(s.stop(SIGTERM) == 0);
  slow.join();
  CHECK(status == 200);
  REQUIRE(!events.empty());
  CHECK(json::parse(events.back())["timings"]["predicted_n"] == 64);
  CHECK(json::parse(events.back())["efim"]["finish"] == "length");  // not cancelled
  // The port is free again.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int yes = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(port)));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  close(fd);
}

TEST_CASE("efim-bench --url replays the in-process workload over HTTP: the same prompts, the same cache hits",
          "[http][bench]") {
  INFO("this build left efim-bench out (EFIM_HTTP_TEST_BENCH=OFF)");
  REQUIRE_FALSE(std::string_view(EFIM_BENCH_PATH).empty());
  // Sessions never re-anchor in efim-bench's in-process run; the servers are told the same.
  const std::vector<std::string> flags{"--threads", "2", "--reanchor-bytes", "1000000", "--cache-tokens", "131072"};
  auto efim_flags = flags, psm_flags = flags;
  psm_flags.insert(psm_flags.end(), {"--format", "psm"});
  efim_test::server_process efim(EFIM_SERVER_PATH, efim_flags, build_dir + "/efim-server-bench-efim.log");
  efim_test::server_process psm(EFIM_SERVER_PATH, psm_flags, build_dir + "/efim-server-bench-psm.log");
  const std::string workload = " --users 3 --documents 3 --rounds 3 --output-tokens 4 --quiet --schemes psm,efim";
  const std::string http_json = build_dir + "/bench-http.json", openai_json = build_dir + "/bench-openai.json",
                    local_json = build_dir + "/bench-local.json";
  for (const bool openai : {false, true}) {
    const auto over_http = efim_test::run_command(std::string(EFIM_BENCH_PATH) + workload +
                                                  " --url efim=" + efim.url() + " --url psm=" + psm.url() + " --json " +
                                                  (openai ? openai_json + " --api openai" : http_json));
    INFO(over_http.output);
    REQUIRE(over_http.exit_code == 0);
    CHECK(over_http.output.find("efim/psm: mean latency") != std::string::npos);
  }
  const auto local =
      efim_test::run_command(std::string(EFIM_BENCH_PATH) + workload + " --threads 2 --json " + local_json);
  INFO(local.output);
  REQUIRE(local.exit_code == 0);
  const auto h = json::parse(read_file(http_json)), o = json::parse(read_file(openai_json)),
             l = json::parse(read_file(local_json));
  CHECK(h["engine"]["api"] == "infill");
  CHECK(o["engine"]["api"] == "openai");
  CHECK(h["engine"]["servers"][0]["model"] == "efim-default");
  CHECK(h["workload"]["documents"] == l["workload"]["documents"]);
  for (const char* scheme : {"efim", "psm"}) {
    INFO(scheme);
    CHECK(h["schemes"][scheme]["requests"] == 9);
    CHECK(h["schemes"][scheme]["prompt_tokens"] == l["schemes"][scheme]["prompt_tokens"]);
    CHECK(h["schemes"][scheme]["computed_prompt_tokens"] == l["schemes"][scheme]["computed_prompt_tokens"]);
    // The same requests again through the OpenAI API: the same prompts, now served from the cache.
    CHECK(o["schemes"][scheme]["prompt_tokens"] == l["schemes"][scheme]["prompt_tokens"]);
    CHECK(o["schemes"][scheme]["cache_hit_rate"].get<double>() > 0.95);
  }
  // Keystrokes: each computes what it added and at most a block more.
  const auto keys =
      efim_test::run_command(std::string(EFIM_BENCH_PATH) + " --users 1 --documents 1 --keystroke " +
                             "--keystroke-chars 40 --quiet --url efim=" + efim.url() + " --json " + http_json);
  INFO(keys.output);
  REQUIRE(keys.exit_code == 0);
  const auto k = json::parse(read_file(http_json))["schemes"]["efim"]["keystrokes"];
  CHECK(k["requests"].get<int>() >= 20);
  CHECK(k["max_computed_beyond_typed"].get<double>() < 16);
  // A server that is not there: a clear failure, not a hang.
  const auto gone = efim_test::run_command(std::string(EFIM_BENCH_PATH) +
                                           " --users 1 --documents 1 --rounds 1 --quiet " + "--url http://127.0.0.1:1");
  CHECK(gone.exit_code == 2);
  CHECK(gone.output.find("failed") != std::string::npos);
}
