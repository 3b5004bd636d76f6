// efim-bench: the EFIM paper's multi-round infilling workload, in-process on one engine and model, or over
// HTTP against servers that speak /infill or /v1/completions (with a keystroke replay besides).
//
// For each document of T tokens: H = half its characters, c = H / (R + 2); the prefix is doc[:c],
// the suffix doc[H:], and round r (0-based) has typed doc[c : c * (r + 2)]. U users run at once,
// each user's rounds in sequence, each request generating a fixed number of tokens (EOS ignored).
// Schemes: psm-nocache (PSM, no prefix cache), psm (PSM with it), efim (EFIM with it), spm.
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "arguments.hpp"
// The CUDA build of this file (efim_bench_cuda.cu) runs the in-process workload only: Boost.Asio does
// not compile under nvcc.
#if !defined(__CUDACC__)
#define EFIM_BENCH_HTTP 1
#include "bench_http.hpp"
#else
#define EFIM_BENCH_HTTP 0
#endif
#include "default_model.hpp"
#include "efim/efim.hpp"
#include "tokenizer_choice.hpp"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

#if EFIM_BENCH_HTTP
using efim_examples::http_api;
#else
enum class http_api { infill, openai };
#endif

struct options {
  std::string corpus = EFIM_DEFAULT_CORPUS;
  bool corpus_is_default = true;
  std::string tokenizer;  // empty: the embedded default
  std::size_t users = 16;
  std::size_t rounds = 5;
  std::size_t output_tokens = 16;
  std::size_t documents = 0;  // 0: one per user
  std::size_t min_doc_tokens = 2000;
  std::size_t max_doc_tokens = 4000;
  std::vector<std::string> schemes{"psm-nocache", "psm", "efim"};
  std::string json_path;
  std::size_t threads = 0;
  std::size_t block_size = 16;
  std::size_t cache_blocks = 8192;
  std::size_t batch_tokens = 512;
  efim::model::config model = efim_examples::default_model_config();
  std::string model_path;
  efim::dtype weight_type = efim::dtype::f16;
  efim::dtype kv_type = efim::dtype::f32;
  std::size_t heal_tokens = 0;
  std::vector<efim::engine::preparation> prepare{efim::engine::preparation::caller};
  std::uint64_t seed = 42;
  bool progress = true;
  // Over HTTP: (scheme name, server URL) pairs, the API they speak, the keystroke workload.
  std::vector<std::pair<std::string, std::string>> urls;
  http_api api = http_api::infill;
  std::string api_key;
  bool keystroke = false;
  std::size_t keystroke_prefix = 1500, keystroke_suffix = 1500, keystroke_chars = 240;
  double duration_s = 0;  // over HTTP: each user repeats its work until this many seconds have passed
  bool keep_going = false;    // over HTTP: a failed request is counted and the user goes on
  std::string samples_path;   // over HTTP: every request, one JSON line each
};

const char* const usage = R"(usage: efim-bench [options]

Runs the EFIM multi-round infilling workload in-process and compares prompt layouts on the same
engine and model; or replays it over HTTP against servers that speak llama.cpp's /infill or
OpenAI's /v1/completions (efim-server, llama.cpp's llama-server).

workload
  --corpus DIR            directory of source files (default: this repository's sources)
  --users U               users running at once (16)
  --rounds R              rounds per document (5)
  --output-tokens N       tokens generated per request, EOS ignored (16)
  --documents D           documents to use, spread over the users (default: one per user)
  --min-doc-tokens N      shortest document, in tokens (2000)
  --max-doc-tokens N      longest document, in tokens (4000); a longer file gives runs of whole lines
  --schemes LIST          comma-separated: psm-nocache,psm,efim,spm (psm-nocache,psm,efim)
engine
  --threads N             compute threads (0: all cores)
  --block-size N          tokens per KV block (16)
  --cache-blocks N        KV blocks in the cache (8192)
  --batch-tokens N        tokens computed per engine step (512)
  --heal-tokens K         token healing of the text before the cursor, at most K tokens (0: off)
  --prepare WHERE         where requests are prepared (tokenized, matched to their session, laid out):
                          caller (each user's thread, as efim-server does), engine (the engine thread,
                          between steps), or both (each scheme twice, the engine runs named NAME@engine)
                          (caller); the table of the engine thread's time says what it cost
model
  --model FILE            a GGUF model file (its weights and its tokenizer, which needs FIM tokens)
  --kv TYPE               KV cache elements: f32 or f16 (f32)
without --model, a random-weight Qwen2-architecture model made in memory, as efim-model make does:
  --tokenizer PATH|byte   a tokenizer.json or .gguf vocabulary with FIM tokens, or the byte-level one
                          (default: the Qwen2.5-Coder tokenizer.json that .ci/setup fetches, or the
                          byte-level tokenizer with Qwen2.5-Coder FIM tokens when it is not there)
  --hidden N --layers N --heads N --kv-heads N --ffn N --seed S   (128, 4, 4, 2, 384, 42)
  --type T                matrix type: f32, f16, bf16, q8_0, q4_0 (f16)
over HTTP (the same workload and documents; the server's model and layout)
  --url [NAME=]URL        a server (repeatable); NAME is the scheme it stands for in the table
                          (default: server); psm-nocache asks it not to use its cache
  --api infill|openai     the API to speak: POST /infill or POST /v1/completions with suffix (infill)
  --api-key KEY           sent as "Authorization: Bearer KEY"; {user} in KEY is replaced by the user's
                          number (0, 1, ...): a key per user, as a team's editors send them
  --keystroke             instead: typing at a fixed cursor, one to three characters per request, in
                          documents cut into a prefix and a suffix of the sizes below
  --keystroke-prefix N    tokens before the cursor (1500)
  --keystroke-suffix N    tokens after it (1500)
  --keystroke-chars N     characters typed per document (240)
  --duration S            each user repeats its documents until S seconds have passed (a soak test)
  --keep-going            a request that fails (refused, cut off) is counted, and its user goes on
                          with the next one on a new connection (default: the run stops)
output
  --json FILE             write the results as JSON
  --samples FILE          over HTTP: every request as one JSON line (scheme, user, start time in
                          seconds since the epoch, latency, prompt and cached tokens, or the error)
  --quiet                 no progress on stderr
)";

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "efim-bench: " << message << "\n";
  std::exit(2);
}

std::size_t parse_count(const std::string& flag, const std::string& value, std::size_t min = 1) {
  std::size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(value, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos != value.size() || value.empty() || value[0] == '-' || v < min)
    fail(flag + " needs a whole number >= " + std::to_string(min) + ", not '" + value + "'");
  return static_cast<std::size_t>(v);
}

options parse(int argc, char** argv) {
  options o;
  const auto on_switch = [&](const std::string& flag) {
    if (flag == "--quiet")
      o.progress = false;
    else if (flag == "--keep-going")
      o.keep_going = true;
    else
      o.keystroke = true;
  };
  efim_examples::for_each_flag(
      argc, argv, "efim-bench", usage, {"--quiet", "--keystroke", "--keep-going"}, on_switch,
      [&](const std::string& flag, const std::string& v) {
        if (flag == "--corpus") {
          o.corpus = v;
          o.corpus_is_default = false;
        } else if (flag == "--tokenizer") {
          o.tokenizer = v;
        } else if (flag == "--users") {
          o.users = parse_count(flag, v);
        } else if (flag == "--rounds") {
          o.rounds = parse_count(flag, v);
        } else if (flag == "--output-tokens") {
          o.output_tokens = parse_count(flag, v);
        } else if (flag == "--documents") {
          o.documents = parse_count(flag, v);
        } else if (flag == "--min-doc-tokens") {
          o.min_doc_tokens = parse_count(flag, v);
        } else if (flag == "--max-doc-tokens") {
          o.max_doc_tokens = parse_count(flag, v);
        } else if (flag == "--schemes") {
          o.schemes.clear();
          std::stringstream list(v);
          for (std::string s; std::getline(list, s, ',');) {
            if (s != "psm-nocache" && s != "psm" && s != "efim" && s != "spm")
              fail("unknown scheme '" + s + "' (psm-nocache, psm, efim, spm)");
            o.schemes.push_back(s);
          }
          if (o.schemes.empty()) fail("--schemes names no scheme");
        } else if (flag == "--url") {
          const std::size_t eq = v.find('=');
          const bool named = eq != std::string::npos && v.find("://") > eq;
          o.urls.emplace_back(named ? v.substr(0, eq) : "server", named ? v.substr(eq + 1) : v);
#if EFIM_BENCH_HTTP
          try {
            (void)efim_examples::http::parse_url(o.urls.back().second);
          } catch (const std::exception& e) {
            fail(std::string("--url: ") + e.what());
          }
#else
          fail("--url: this build runs the workload in-process only (efim-bench replays it over HTTP)");
#endif
        } else if (flag == "--api") {
          if (v != "infill" && v != "openai") fail("--api must be infill or openai, not '" + v + "'");
          o.api = v == "infill" ? http_api::infill : http_api::openai;
        } else if (flag == "--api-key") {
          o.api_key = v;
        } else if (flag == "--samples") {
          o.samples_path = v;
        } else if (flag == "--keystroke-prefix") {
          o.keystroke_prefix = parse_count(flag, v);
        } else if (flag == "--keystroke-suffix") {
          o.keystroke_suffix = parse_count(flag, v);
        } else if (flag == "--keystroke-chars") {
          o.keystroke_chars = parse_count(flag, v);
        } else if (flag == "--duration") {
          o.duration_s = static_cast<double>(parse_count(flag, v));
        } else if (flag == "--json") {
          o.json_path = v;
        } else if (flag == "--threads") {
          o.threads = parse_count(flag, v, 0);
        } else if (flag == "--block-size") {
          o.block_size = parse_count(flag, v);
        } else if (flag == "--cache-blocks") {
          o.cache_blocks = parse_count(flag, v);
        } else if (flag == "--batch-tokens") {
          o.batch_tokens = parse_count(flag, v);
        } else if (flag == "--hidden") {
          o.model.hidden = parse_count(flag, v);
        } else if (flag == "--layers") {
          o.model.layers = parse_count(flag, v);
        } else if (flag == "--heads") {
          o.model.heads = parse_count(flag, v);
        } else if (flag == "--kv-heads") {
          o.model.kv_heads = parse_count(flag, v);
        } else if (flag == "--ffn") {
          o.model.ffn = parse_count(flag, v);
        } else if (flag == "--seed") {
          o.seed = parse_count(flag, v, 0);
        } else if (flag == "--prepare") {
          if (v == "caller")
            o.prepare = {efim::engine::preparation::caller};
          else if (v == "engine")
            o.prepare = {efim::engine::preparation::engine};
          else if (v == "both")
            o.prepare = {efim::engine::preparation::caller, efim::engine::preparation::engine};
          else
            fail("--prepare must be caller, engine or both, not '" + v + "'");
        } else if (flag == "--heal-tokens") {
          o.heal_tokens = parse_count(flag, v, 0);
        } else if (flag == "--model") {
          o.model_path = v;
        } else if (flag == "--type" || flag == "--kv") {
          try {
            (flag == "--type" ? o.weight_type : o.kv_type) = efim::parse_dtype(v);
          } catch (const efim::error& e) {
            fail(flag + ": " + e.what());
          }
        } else {
          fail("unknown option " + flag + " (see --help)");
        }
      });
  if (o.keystroke) {
    if (o.urls.empty()) fail("--keystroke replays typing over HTTP: give --url");
    // Documents long enough for the prefix, the typed text and the suffix.
    const std::size_t need = o.keystroke_prefix + o.keystroke_suffix + o.keystroke_chars;
    o.min_doc_tokens = std::max(o.min_doc_tokens, need);
    o.max_doc_tokens = std::max(o.max_doc_tokens, need + 1000);
  }
  if (o.min_doc_tokens > o.max_doc_tokens) fail("--min-doc-tokens is larger than --max-doc-tokens");
  if (o.documents == 0) o.documents = o.users;
  return o;
}

struct document {
  std::string path;  // relative to the corpus
  std::string text;
  std::size_t tokens = 0;
};

bool is_source_file(const fs::path& p) {
  static const std::vector<std::string> endings{".hpp", ".cpp", ".h",  ".hh", ".cc", ".c",    ".cu",    ".cuh",
                                                ".py",  ".rs",  ".go", ".js", ".ts", ".java", ".cmake", ".sh"};
  const std::string name = p.filename().string();
  if (name == "CMakeLists.txt") return true;
  return std::find(endings.begin(), endings.end(), p.extension().string()) != endings.end();
}

// The end (a byte offset, after a newline) of the longest run of whole lines at the start of
// `text` (of `tokens` tokens) that stays within `max_tokens`; `ids` gets its tokens. 0 if not even
// one line fits.
template <class Tokenizer>
std::size_t fit_lines(std::string_view text, std::size_t tokens, std::size_t max_tokens, const Tokenizer& tok,
                      std::vector<efim::token_id>& ids) {
  // Start from the share of bytes that the token budget suggests, then drop lines until it fits.
  std::size_t end = tokens <= max_tokens
                        ? text.size()
                        : text.size() / tokens * max_tokens + text.size() % tokens * max_tokens / tokens;
  for (;;) {
    const std::size_t newline = end == 0 ? std::string_view::npos : text.rfind('\n', end - 1);
    end = newline == std::string_view::npos ? 0 : newline + 1;
    ids.clear();
    tok.encode(text.substr(0, end), ids);
    if (ids.size() <= max_tokens || end == 0) return end;
    --end;  // drop one more line
  }
}

// Source files of the corpus whose token count is in range, in path order; a longer file gives
// consecutive runs of whole lines, each as long as fits (so the corpus changes little as its files
// grow).
template <class Tokenizer>
std::vector<document> load_corpus(const options& o, const Tokenizer& tok) {
  std::error_code ec;
  if (!fs::is_directory(o.corpus, ec)) fail("corpus '" + o.corpus + "' is not a readable directory");
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(o.corpus, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (it->is_directory() && (name.starts_with(".") || name.starts_with("build"))) {
      it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file() && is_source_file(it->path())) files.push_back(it->path());
  }
  if (ec) fail("cannot list corpus '" + o.corpus + "': " + ec.message());
  std::sort(files.begin(), files.end());
  std::vector<document> docs;
  std::vector<efim::token_id> ids;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) continue;
    if (!efim::utf8::is_valid(text)) continue;
    ids.clear();
    tok.encode(text, ids);
    const std::string path = fs::relative(f, o.corpus).string();
    if (ids.size() <= o.max_doc_tokens) {
      if (ids.size() >= o.min_doc_tokens) docs.push_back({path, std::move(text), ids.size()});
    } else {
      std::string_view rest = text;
      std::size_t first_line = 1, tokens = ids.size();
      while (!rest.empty() && docs.size() < o.documents) {
        const std::size_t end = fit_lines(rest, tokens, o.max_doc_tokens, tok, ids);
        if (end == 0) break;  // a line longer than a document
        const auto lines =
            static_cast<std::size_t>(std::count(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(end), '\n'));
        if (ids.size() >= o.min_doc_tokens)
          docs.push_back(
              {path + " (lines " + std::to_string(first_line) + "-" + std::to_string(first_line + lines - 1) + ")",
               std::string(rest.substr(0, end)), ids.size()});
        first_line += lines;
        rest.remove_prefix(end);
        ids.clear();
        tok.encode(rest, ids);
        tokens = ids.size();
      }
    }
    if (docs.size() >= o.documents) break;
  }
  docs.resize(std::min(docs.size(), o.documents));
  if (docs.empty())
    fail("corpus '" + o.corpus + "' has no source file of " + std::to_string(o.min_doc_tokens) + "-" +
         std::to_string(o.max_doc_tokens) + " tokens");
  if (docs.size() < o.documents)
    std::cerr << "efim-bench: warning: only " << docs.size() << " of the " << o.documents
              << " documents asked for are in the corpus\n";
  return docs;
}

// Byte offset of the n-th character of valid UTF-8 text.
std::size_t char_offset(std::string_view s, std::size_t n) {
  std::size_t pos = 0;
  for (; n > 0 && pos < s.size(); --n) pos += efim::utf8::valid_sequence_at(s, pos);
  return pos;
}

std::size_t char_count(std::string_view s) {
  std::size_t n = 0;
  for (std::size_t pos = 0; pos < s.size(); ++n) pos += efim::utf8::valid_sequence_at(s, pos);
  return n;
}

// The rounds of one document: (full prefix, suffix) per round; the session's anchor is doc[:c].
struct round_request {
  std::string prefix, suffix;
};
std::vector<round_request> rounds_of(const document& d, std::size_t rounds) {
  const std::size_t half = char_count(d.text) / 2;
  const std::size_t c = half / (rounds + 2);
  const std::string suffix = d.text.substr(char_offset(d.text, half));
  std::vector<round_request> out;
  for (std::size_t r = 0; r < rounds; ++r) out.push_back({d.text.substr(0, char_offset(d.text, c * (r + 2))), suffix});
  return out;
}

struct sample {
  double latency_ms, ttft_ms;
  std::size_t prompt_tokens, cached_tokens;
  std::size_t typed_tokens = 0;  // keystroke workload: prompt tokens added since the session's previous request
  bool first = true;             // keystroke workload: a session's first request (the whole prompt is new)
  std::size_t healed_tokens = 0;  // prompt tokens token healing removed
  std::size_t user = 0;           // over HTTP: who sent it
  double start_s = 0;             // over HTTP: when it was sent, seconds since the epoch
};

// Over HTTP with --keep-going: a request that failed.
struct failed_request {
  std::size_t user = 0;
  double start_s = 0;
  std::string error;
};

struct scheme_result {
  std::string name;
  std::vector<sample> samples;
  double wall_s = 0;
  efim::cache::cache_stats cache;
  std::optional<efim::engine::runner_stats> engine_thread;  // in-process runs
  std::vector<failed_request> failed;                        // over HTTP, --keep-going
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(rank);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

json summarize(const scheme_result& r) {
  std::vector<double> latency, ttft;
  std::size_t prompt = 0, cached = 0, healed = 0;
  for (const auto& s : r.samples) {
    latency.push_back(s.latency_ms);
    ttft.push_back(s.ttft_ms);
    prompt += s.prompt_tokens;
    cached += s.cached_tokens;
    healed += s.healed_tokens;
  }
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (const double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  json j;
  j["requests"] = r.samples.size();
  j["failed_requests"] = r.failed.size();
  j["mean_latency_ms"] = mean(latency);
  j["p50_latency_ms"] = percentile(latency, 50);
  j["p99_latency_ms"] = percentile(latency, 99);
  j["mean_ttft_ms"] = mean(ttft);
  j["requests_per_s"] = r.wall_s > 0 ? static_cast<double>(r.samples.size()) / r.wall_s : 0.0;
  j["prompt_tokens"] = prompt;
  j["computed_prompt_tokens"] = prompt - cached;
  j["cache_hit_rate"] = prompt ? static_cast<double>(cached) / static_cast<double>(prompt) : 0.0;
  j["healed_tokens"] = healed;
  j["wall_s"] = r.wall_s;
  j["evicted_blocks"] = r.cache.evicted_blocks;
  if (const auto& e = r.engine_thread) {
    const double steps = static_cast<double>(std::max<std::uint64_t>(e->steps, 1));
    j["engine_thread"] = {{"steps", e->steps},
                          {"requests", e->requests},
                          {"step_ms", e->step_ms},
                          {"prepare_ms", e->prepare_ms},
                          {"enqueue_ms", e->enqueue_ms},
                          {"mean_step_ms", e->step_ms / steps},
                          {"mean_request_ms_per_step", (e->prepare_ms + e->enqueue_ms) / steps},
                          {"request_share", e->request_share()}};
  }
  // Keystrokes after a session's first request: what each computed against what it added.
  std::vector<double> computed, typed, over, keystroke_latency;
  for (const auto& x : r.samples)
    if (!x.first) {
      computed.push_back(static_cast<double>(x.prompt_tokens - x.cached_tokens));
      typed.push_back(static_cast<double>(x.typed_tokens));
      over.push_back(computed.back() - typed.back());
      keystroke_latency.push_back(x.latency_ms);
    }
  if (!computed.empty())
    j["keystrokes"] = {{"requests", computed.size()},
                       {"p50_latency_ms", percentile(keystroke_latency, 50)},
                       {"p99_latency_ms", percentile(keystroke_latency, 99)},
                       {"mean_computed_prompt_tokens", mean(computed)},
                       {"p50_computed_prompt_tokens", percentile(computed, 50)},
                       {"p99_computed_prompt_tokens", percentile(computed, 99)},
                       {"max_computed_prompt_tokens", percentile(computed, 100)},
                       {"mean_typed_tokens", mean(typed)},
                       {"max_computed_beyond_typed", percentile(over, 100)}};
  return j;
}

// The compute backend: the host's, or the CUDA one where efim_bench_cuda.cu compiles this file.
#ifndef EFIM_BENCH_BACKEND
#define EFIM_BENCH_BACKEND efim::kernels::host
#endif

template <class Format, class Tokenizer>
using bench_pipeline = efim::engine::pipeline<Format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                              efim::text::at_boundaries, EFIM_BENCH_BACKEND, Tokenizer>;

template <class Format, class Tokenizer>
scheme_result run_scheme(const std::string& name, bool reuse, const options& o, const Tokenizer& tok,
                         const efim::prompt::fim_token_set& fim, const efim::model::weights& w,
                         const std::vector<document>& docs, efim::engine::preparation prepare) {
  efim::engine::pipeline_options po;
  po.cache = {o.block_size, o.cache_blocks, reuse};
  po.schedule.max_batch_tokens = o.batch_tokens;
  po.schedule.max_running = std::max<std::size_t>(o.users, 1);
  po.threads = o.threads;
  po.session.reanchor_bytes = std::string::npos;  // the workload never re-anchors
  po.heal_tokens = o.heal_tokens;
  po.fim = fim;
  po.kv_type = o.kv_type;
  bench_pipeline<Format, Tokenizer> p(tok, w, po);

  std::vector<std::vector<round_request>> work;
  for (const auto& d : docs) work.push_back(rounds_of(d, o.rounds));
  const std::size_t total = work.size() * o.rounds;

  scheme_result result{name, {}, 0, {}, std::nullopt, {}};
  std::mutex mutex;
  std::atomic<std::size_t> done{0};
  std::optional<std::string> failure;
  const bool tty = isatty(STDERR_FILENO);
  const auto start = std::chrono::steady_clock::now();
  {
    efim::engine::async_runner<bench_pipeline<Format, Tokenizer>> runner(p, {.prepare = prepare});
    std::vector<std::thread> users;
    for (std::size_t u = 0; u < o.users; ++u)
      users.emplace_back([&, u] {
        for (std::size_t d = u; d < work.size(); d += o.users)
          for (const auto& round : work[d]) {
            efim::engine::request r;
            r.prefix = round.prefix;
            r.suffix = round.suffix;
            r.session = name + "/" + std::to_string(d);
            r.max_tokens = o.output_tokens;
            r.ignore_eos = true;
            try {
              // Timed by the client, from its submit (the wait for the engine's next step included),
              // as over HTTP.
              const auto sent = std::chrono::steady_clock::now();
              const auto c = runner.submit(std::move(r)).get();
              const auto ms = [&](auto t) { return std::chrono::duration<double, std::milli>(t - sent).count(); };
              const double latency = ms(std::chrono::steady_clock::now());
              const double ttft = c.tokens.empty() ? latency : ms(c.first_token);
              std::lock_guard lock(mutex);
              result.samples.push_back({latency, ttft, c.prompt_tokens, c.cached_tokens, 0, true, c.healed_tokens});
            } catch (const std::exception& e) {
              std::lock_guard lock(mutex);
              if (!failure) failure = e.what();
              return;
            }
            const std::size_t n = ++done;
            if (o.progress && (tty || n % 10 == 0 || n == total)) {
              std::lock_guard lock(mutex);
              std::cerr << (tty ? "\r" : "") << name << ": " << n << "/" << total << " requests" << (tty ? "" : "\n")
                        << std::flush;
            }
          }
      });
    for (auto& t : users) t.join();
    result.engine_thread = runner.stats();
  }
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.progress && tty) std::cerr << "\n";
  if (failure) fail(name + ": a request failed: " + *failure);
  result.cache = p.cache().stats();
  return result;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// Prints the table and the ratios, and writes the JSON.
void report(const options& o, json model, json engine, const std::vector<document>& docs,
            const std::vector<scheme_result>& results) {
  json out;
  out["model"] = std::move(model);
  json doc_list = json::array();
  for (const auto& d : docs) doc_list.push_back({{"path", d.path}, {"tokens", d.tokens}});
  out["workload"] = {{"kind", o.keystroke ? "keystroke" : "multi-round"},
                     {"users", o.users},
                     {"output_tokens", o.output_tokens},
                     {"corpus", o.corpus_is_default ? std::string("(repository sources)") : o.corpus},
                     {"documents", doc_list}};
  if (o.keystroke)
    out["workload"].update({{"prefix_tokens", o.keystroke_prefix},
                            {"suffix_tokens", o.keystroke_suffix},
                            {"typed_chars", o.keystroke_chars}});
  else
    out["workload"]["rounds"] = o.rounds;
  out["engine"] = std::move(engine);
  json schemes = json::object();
  for (const auto& r : results) schemes[r.name] = summarize(r);
  out["schemes"] = schemes;

  std::printf("%-12s %8s %10s %10s %10s %10s %8s %10s %10s %6s\n", "scheme", "requests", "mean_ms", "p50_ms", "p99_ms",
              "ttft_ms", "req/s", "prompt", "computed", "hit");
  for (const auto& [name, s] : schemes.items())
    std::printf("%-12s %8zu %10.1f %10.1f %10.1f %10.1f %8.2f %10zu %10zu %6.3f\n", name.c_str(),
                s["requests"].get<std::size_t>(), s["mean_latency_ms"].get<double>(), s["p50_latency_ms"].get<double>(),
                s["p99_latency_ms"].get<double>(), s["mean_ttft_ms"].get<double>(), s["requests_per_s"].get<double>(),
                s["prompt_tokens"].get<std::size_t>(), s["computed_prompt_tokens"].get<std::size_t>(),
                s["cache_hit_rate"].get<double>());
  for (const auto& [name, sc] : schemes.items())
    if (sc["failed_requests"].get<std::size_t>() > 0)
      std::printf("%s: %zu requests failed (--keep-going: counted, not timed)\n", name.c_str(),
                  sc["failed_requests"].get<std::size_t>());
  if (o.keystroke) {
    std::printf("\nkeystrokes after each session's first request:\n%-12s %8s %10s %10s %14s %14s %14s %12s %10s\n",
                "scheme", "requests", "p50_ms", "p99_ms", "computed_mean", "computed_p99", "computed_max", "typed_mean",
                "max_over");
    for (const auto& [name, sc] : schemes.items()) {
      if (!sc.contains("keystrokes")) continue;
      const auto& k = sc["keystrokes"];
      std::printf("%-12s %8zu %10.1f %10.1f %14.1f %14.1f %14.0f %12.2f %10.0f\n", name.c_str(),
                  k["requests"].get<std::size_t>(), k["p50_latency_ms"].get<double>(),
                  k["p99_latency_ms"].get<double>(), k["mean_computed_prompt_tokens"].get<double>(),
                  k["p99_computed_prompt_tokens"].get<double>(), k["max_computed_prompt_tokens"].get<double>(),
                  k["mean_typed_tokens"].get<double>(), k["max_computed_beyond_typed"].get<double>());
    }
  }
  bool engine_thread = false;
  for (const auto& [name, sc] : schemes.items()) engine_thread = engine_thread || sc.contains("engine_thread");
  if (engine_thread) {
    std::printf("\nthe engine thread (in-process), per step:\n%-16s %8s %9s %12s %15s %14s\n", "scheme", "steps",
                "requests", "compute_ms", "requests_ms", "request_share");
    for (const auto& [name, sc] : schemes.items()) {
      if (!sc.contains("engine_thread")) continue;
      const auto& e = sc["engine_thread"];
      std::printf("%-16s %8zu %9zu %12.3f %15.4f %13.3f%%\n", name.c_str(), e["steps"].get<std::size_t>(),
                  e["requests"].get<std::size_t>(), e["mean_step_ms"].get<double>(),
                  e["mean_request_ms_per_step"].get<double>(), 100.0 * e["request_share"].get<double>());
    }
    for (const auto& [name, sc] : schemes.items()) {
      const std::string there = name + "@engine";
      if (!sc.contains("engine_thread") || !schemes.contains(there)) continue;
      const auto& a = sc["engine_thread"];
      const auto& b = schemes[there]["engine_thread"];
      const double here_ms = a["mean_request_ms_per_step"].get<double>();
      std::printf("%s: preparing on the callers' threads cuts the engine thread's request time per step %sx "
                  "(%.4f -> %.4f ms), mean latency %sx\n",
                  name.c_str(), fixed(b["mean_request_ms_per_step"].get<double>() / std::max(here_ms, 1e-9), 1).c_str(),
                  b["mean_request_ms_per_step"].get<double>(), here_ms,
                  fixed(sc["mean_latency_ms"].get<double>() / std::max(schemes[there]["mean_latency_ms"].get<double>(), 1e-12), 3).c_str());
    }
  }
  if (schemes.contains("efim") && schemes.contains("psm")) {
    const auto& e = schemes["efim"];
    const auto& p = schemes["psm"];
    const auto ratio = [&](const char* key) { return e[key].get<double>() / std::max(p[key].get<double>(), 1e-12); };
    json ratios = {{"mean_latency", ratio("mean_latency_ms")},
                   {"p99_latency", ratio("p99_latency_ms")},
                   {"mean_ttft", ratio("mean_ttft_ms")},
                   {"requests_per_s", ratio("requests_per_s")},
                   {"computed_prompt_tokens", ratio("computed_prompt_tokens")}};
    out["ratios_efim_over_psm"] = ratios;
    std::printf("\nefim/psm: mean latency %sx, p99 latency %sx, ttft %sx, requests/s %sx, computed prompt tokens %sx\n",
                fixed(ratios["mean_latency"], 3).c_str(), fixed(ratios["p99_latency"], 3).c_str(),
                fixed(ratios["mean_ttft"], 3).c_str(), fixed(ratios["requests_per_s"], 2).c_str(),
                fixed(ratios["computed_prompt_tokens"], 3).c_str());
  }
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    f << out.dump(2) << "\n";
    if (!f) fail("cannot write " + o.json_path);
  }
}

// Runs the workload with one tokenizer and model; `fim` is the tokenizer's FIM token set.
template <class Tokenizer>
int run_bench(const options& o, const Tokenizer& tok, const efim::prompt::fim_token_set& fim,
              const std::string& tokenizer_name, const efim::model::weights& weights) {
  const auto& cfg = weights.cfg;
  const auto docs = load_corpus(o, tok);
  std::cerr << "efim-bench: tokenizer " << tokenizer_name << "; model " << efim::model::to_string(cfg.arch)
            << " hidden " << cfg.hidden << ", " << cfg.layers << " layers, " << cfg.heads << "/" << cfg.kv_heads
            << " heads, ffn " << cfg.ffn << ", " << efim::to_string(weights.type()) << " weights, "
            << efim::to_string(o.kv_type) << " KV; " << docs.size() << " documents, " << o.users << " users, "
            << o.rounds << " rounds; " << EFIM_BENCH_BACKEND::name << " backend\n";

  std::vector<scheme_result> results;
  for (const auto& s : o.schemes)
    for (const auto where : o.prepare) {
      const std::string name = where == efim::engine::preparation::engine && o.prepare.size() > 1 ? s + "@engine" : s;
      if (s == "psm-nocache")
        results.push_back(run_scheme<efim::prompt::psm>(name, false, o, tok, fim, weights, docs, where));
      if (s == "psm") results.push_back(run_scheme<efim::prompt::psm>(name, true, o, tok, fim, weights, docs, where));
      if (s == "efim")
        results.push_back(run_scheme<efim::prompt::efim_format>(name, true, o, tok, fim, weights, docs, where));
      if (s == "spm") results.push_back(run_scheme<efim::prompt::spm>(name, true, o, tok, fim, weights, docs, where));
    }

  json model = {{"architecture", std::string(efim::model::to_string(cfg.arch))},
                {"vocab", cfg.vocab},
                {"hidden", cfg.hidden},
                {"layers", cfg.layers},
                {"heads", cfg.heads},
                {"kv_heads", cfg.kv_heads},
                {"ffn", cfg.ffn},
                {"weights", std::string(efim::to_string(weights.type()))},
                {"file", o.model_path.empty() ? std::string("(random, made in memory)") : o.model_path},
                {"seed", o.seed},
                {"tokenizer", tokenizer_name}};
  json engine = {{"in_process", true},
                 {"backend", std::string(EFIM_BENCH_BACKEND::name)},
                 {"threads", o.threads == 0 ? std::thread::hardware_concurrency() : o.threads},
                 {"block_size", o.block_size},
                 {"cache_blocks", o.cache_blocks},
                 {"batch_tokens", o.batch_tokens},
                 {"kv", std::string(efim::to_string(o.kv_type))},
                 {"heal_tokens", o.heal_tokens},
                 {"prepare", o.prepare.size() > 1 ? "both"
                             : o.prepare[0] == efim::engine::preparation::engine ? "engine"
                                                                                 : "caller"}};
  report(o, std::move(model), std::move(engine), docs, results);
  return 0;
}

#if EFIM_BENCH_HTTP
// ---- over HTTP ----

// The user's API key ({user} in --api-key replaced by its number).
std::vector<efim::server::header> auth_headers(const options& o, std::size_t user = 0) {
  if (o.api_key.empty()) return {};
  std::string key = o.api_key;
  for (std::size_t at; (at = key.find("{user}")) != std::string::npos;) key.replace(at, 6, std::to_string(user));
  return {{"Authorization", "Bearer " + key}};
}

double epoch_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Runs `work(user, send)` on o.users threads, each with its own connection to `url`, and times it.
// send(prefix, suffix, annotate) is one request of the user: true and its sample recorded (once
// annotate(sample&) has added what the workload knows); or, with --keep-going, false for a request
// that failed (counted; the user's next request goes on a new connection).
template <class Work>
scheme_result run_users(const std::string& name, const std::string& url, const options& o, std::size_t total,
                        Work&& work) {
  scheme_result result{name, {}, 0, {}, std::nullopt, {}};
  std::mutex mutex;
  std::atomic<std::size_t> done{0};
  std::optional<std::string> failure;
  std::atomic<bool> failed{false};
  const bool tty = isatty(STDERR_FILENO);
  const auto progress = [&] {
    const std::size_t n = ++done;
    if (o.progress && (tty || n % 10 == 0 || n == total))
      std::cerr << (tty ? "\r" : "") << name << ": " << n << "/" << total << " requests" << (tty ? "" : "\n")
                << std::flush;
  };
  const bool reuse = name != "psm-nocache";
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  std::vector<std::thread> users;
  for (std::size_t u = 0; u < o.users; ++u)
    users.emplace_back([&, u] {
      try {
        efim_examples::http::client c(efim_examples::http::parse_url(url));
        const auto send = [&](const std::string& prefix, const std::string& suffix, const auto& annotate) {
          const double sent = epoch_s();
          try {
            const auto h =
                efim_examples::infill_over_http(c, o.api, prefix, suffix, o.output_tokens, reuse, auth_headers(o, u));
            sample s{h.latency_ms, h.ttft_ms, h.prompt_tokens, h.cached_tokens};
            s.user = u;
            s.start_s = sent;
            annotate(s);
            {
              std::lock_guard lock(mutex);
              result.samples.push_back(s);
            }
            progress();
            return true;
          } catch (const std::exception& e) {
            if (!o.keep_going) throw;
            c.close();
            {
              std::lock_guard lock(mutex);
              result.failed.push_back({u, sent, e.what()});
            }
            progress();
            return false;
          }
        };
        do work(u, send);
        while (elapsed() < o.duration_s && !failed);
      } catch (const std::exception& e) {
        failed = true;
        std::lock_guard lock(mutex);
        if (!failure) failure = e.what();
      }
    });
  for (auto& t : users) t.join();
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.progress && tty) std::cerr << "\n";
  if (failure) fail(name + ": a request to " + url + " failed: " + *failure);
  return result;
}

// The multi-round workload, each user's documents in turn, as in-process.
scheme_result run_rounds_http(const std::string& name, const std::string& url, const options& o,
                              const std::vector<document>& docs) {
  std::vector<std::vector<round_request>> work;
  for (const auto& d : docs) work.push_back(rounds_of(d, o.rounds));
  return run_users(name, url, o, work.size() * o.rounds, [&](std::size_t u, const auto& send) {
    for (std::size_t d = u; d < work.size(); d += o.users)
      for (const auto& round : work[d]) send(round.prefix, round.suffix, [](sample&) {});
  });
}

// Typing at a fixed cursor: the document's first keystroke_prefix tokens before it and the next
// keystroke_suffix tokens after it; the text after the cursor is typed anew, one to three characters
// per request.
template <class Tokenizer>
scheme_result run_keystrokes_http(const std::string& name, const std::string& url, const options& o,
                                  const std::vector<document>& docs, const Tokenizer& tok) {
  struct typing {
    std::string prefix, typed, suffix;
  };
  std::vector<typing> work;
  std::vector<efim::token_id> ids;
  for (const auto& d : docs) {
    ids.clear();
    tok.encode(d.text, ids);
    const auto offset = [&](std::size_t tokens) {
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < std::min(tokens, ids.size()); ++i) bytes += tok.token_bytes(ids[i]).size();
      return efim::utf8::floor_boundary(d.text, std::min(bytes, d.text.size()));
    };
    const std::size_t cursor = offset(o.keystroke_prefix);
    const std::size_t typed_end = cursor + char_offset(std::string_view(d.text).substr(cursor), o.keystroke_chars);
    const std::size_t suffix_tokens = o.keystroke_prefix + o.keystroke_suffix;
    const std::size_t end = std::max(typed_end, offset(suffix_tokens));
    work.push_back({d.text.substr(0, cursor), d.text.substr(cursor, typed_end - cursor),
                    d.text.substr(typed_end, end - typed_end)});
  }
  std::size_t total = 0;
  for (const auto& w : work) total += 1 + (w.typed.size() + 1) / 2;  // about: groups of 1-3 characters
  return run_users(name, url, o, total, [&](std::size_t u, const auto& send) {
    for (std::size_t d = u; d < work.size(); d += o.users) {
      const auto& w = work[d];
      std::size_t previous_prompt = 0, typed = 0;
      for (std::size_t k = 0;; ++k) {
        // After a failed request, what the next adds is counted from the last one answered.
        send(w.prefix + w.typed.substr(0, typed), w.suffix, [&](sample& s) {
          s.first = previous_prompt == 0;
          s.typed_tokens = s.prompt_tokens > previous_prompt ? s.prompt_tokens - previous_prompt : 0;
          previous_prompt = s.prompt_tokens;
        });
        if (typed == w.typed.size()) break;
        typed = std::min(w.typed.size(), typed + char_offset(std::string_view(w.typed).substr(typed), 1 + k % 3));
      }
    }
  });
}

// Each request of a run as one JSON line, in the order they were sent.
void write_samples(std::ostream& out, const scheme_result& r) {
  std::vector<json> lines;
  for (const auto& s : r.samples)
    lines.push_back({{"scheme", r.name},
                     {"user", s.user},
                     {"start_s", s.start_s},
                     {"latency_ms", s.latency_ms},
                     {"ttft_ms", s.ttft_ms},
                     {"prompt_tokens", s.prompt_tokens},
                     {"cached_tokens", s.cached_tokens},
                     {"computed_tokens", s.prompt_tokens - s.cached_tokens},
                     {"typed_tokens", s.typed_tokens},
                     {"first", s.first}});
  for (const auto& f : r.failed)
    lines.push_back({{"scheme", r.name}, {"user", f.user}, {"start_s", f.start_s}, {"error", f.error}});
  std::stable_sort(lines.begin(), lines.end(), [](const json& a, const json& b) {
    return a["start_s"].get<double>() < b["start_s"].get<double>();
  });
  for (const auto& l : lines) out << l.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
}

int bench_http(const options& o) {
  return efim_examples::with_tokenizer(
      o.tokenizer, EFIM_DEFAULT_TOKENIZER, "efim-bench", [&](const auto& tok, const auto&, const std::string& name) {
        const auto docs = load_corpus(o, tok);
        std::cerr << "efim-bench: over HTTP ("
                  << (o.api == efim_examples::http_api::infill ? "/infill" : "/v1/completions")
                  << "), documents measured with " << name << "; " << docs.size() << " documents, " << o.users
                  << " users, " << (o.keystroke ? "keystrokes" : std::to_string(o.rounds) + " rounds") << "\n";
        json servers = json::array();
        std::vector<scheme_result> results;
        std::ofstream samples;
        if (!o.samples_path.empty()) {
          samples.open(o.samples_path);
          if (!samples) fail("cannot write --samples " + o.samples_path);
        }
        for (const auto& [scheme, url] : o.urls) {
          std::string model = "?";
          try {
            efim_examples::http::client c(efim_examples::http::parse_url(url));
            const auto r = c.request("GET", "/v1/models", {}, auth_headers(o));
            if (r.status == 200) model = json::parse(r.body)["data"][0].value("id", "?");
          } catch (const std::exception&) {  // a server without /v1/models: its answers still count
          }
          servers.push_back({{"scheme", scheme}, {"url", url}, {"model", model}});
          results.push_back(o.keystroke ? run_keystrokes_http(scheme, url, o, docs, tok)
                                        : run_rounds_http(scheme, url, o, docs));
          if (samples.is_open()) write_samples(samples, results.back());
        }
        if (samples.is_open() && !samples.flush()) fail("cannot write --samples " + o.samples_path);
        json engine = {{"in_process", false},
                       {"api", o.api == efim_examples::http_api::infill ? "infill" : "openai"},
                       {"servers", servers}};
        report(o, {{"tokenizer", name}}, std::move(engine), docs, results);
        return 0;
      });
}

#endif  // EFIM_BENCH_HTTP

// The model file of --model, with its own tokenizer.
int bench_model_file(const options& o) {
  const auto file = efim::model::open_model(o.model_path);
  const auto weights = file.bind();
  const auto tok = efim::text::load_bpe_gguf(file.meta);
  const auto* fim = efim::prompt::detect_token_set(tok);
  efim::require(fim != nullptr, efim::errc::invalid_argument,
                "the tokenizer of '" + o.model_path + "' has no FIM tokens of a known family");
  return run_bench(o, tok, *fim, tok.description() + " from " + o.model_path, weights);
}

// A random-weight model made in memory the way efim-model make writes files, with the tokenizer's
// metadata when the tokenizer comes from a file (Qwen's padded to its 151,936 embedding rows).
int bench_random_model(const options& o) {
  const std::string tokenizer = efim_examples::tokenizer_path(o.tokenizer, EFIM_DEFAULT_TOKENIZER, "efim-bench");
  return efim_examples::with_tokenizer(
      tokenizer, EFIM_DEFAULT_TOKENIZER, "efim-bench", [&](const auto& tok, const auto& fim, const std::string& name) {
        const auto file = efim::model::open_model(
            efim_examples::random_model_file(o.model, tokenizer == "byte" ? std::string() : tokenizer, tok.vocab_size(),
                                             o.seed, o.weight_type, o.threads));
        return run_bench(o, tok, fim, name, file.bind());
      });
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
#if EFIM_BENCH_HTTP
    if (!o.urls.empty()) return bench_http(o);
#endif
    return o.model_path.empty() ? bench_random_model(o) : bench_model_file(o);
  } catch (const std::exception& e) {  // efim::error, or out of memory for an absurd model shape
    fail(e.what());
  }
}
