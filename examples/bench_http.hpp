#pragma once
// efim-bench over HTTP: one infill request as an editor sends it, to any server that speaks
// llama.cpp's /infill or OpenAI's /v1/completions (efim-server, llama.cpp's llama-server), streamed
// so that the time to the first token is measured by the client; the prompt tokens the server
// computed and took from its cache are read from the response (llama.cpp's timings.prompt_n and
// timings.cache_n, or OpenAI's usage.prompt_tokens and prompt_tokens_details.cached_tokens).
#include <chrono>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "http/client.hpp"

namespace efim_examples {

enum class http_api { infill, openai };

struct http_sample {
  double latency_ms = 0, ttft_ms = 0;
  std::size_t prompt_tokens = 0, cached_tokens = 0;
};

// Sends one infill request (prefix before the cursor, suffix after it) asking for `tokens` tokens
// whatever the model says (EOS ignored, greedy); `reuse` false asks the server not to use its cache.
inline http_sample infill_over_http(http::client& c, http_api api, const std::string& prefix, const std::string& suffix,
                                    std::size_t tokens, bool reuse, const std::vector<efim::server::header>& headers) {
  using json = nlohmann::json;
  json body;
  if (api == http_api::infill)
    body = {{"input_prefix", prefix}, {"input_suffix", suffix}, {"n_predict", tokens}};
  else
    body = {
        {"prompt", prefix}, {"suffix", suffix}, {"max_tokens", tokens}, {"stream_options", {{"include_usage", true}}}};
  body["stream"] = true;
  body["temperature"] = 0;
  body["ignore_eos"] = true;
  body["cache_prompt"] = reuse;

  http_sample s;
  bool first = true, done = false;
  const auto start = std::chrono::steady_clock::now();
  const auto ms_since_start = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  http::sse_reader sse;
  const auto r =
      c.post(api == http_api::infill ? "/infill" : "/v1/completions",
             body.dump(-1, ' ', false, json::error_handler_t::replace), headers, [&](std::string_view bytes) {
               sse.feed(bytes, [&](std::string_view data) {
                 if (data == "[DONE]") return;
                 const json e = json::parse(data);
                 if (e.contains("error")) throw std::runtime_error("the server answered " + std::string(data));
                 const bool final =
                     api == http_api::infill ? e.value("stop", false) : e.contains("usage") && !e["usage"].is_null();
                 if (first && !final) {
                   s.ttft_ms = ms_since_start();
                   first = false;
                 }
                 if (!final) return;
                 if (api == http_api::infill) {
                   const auto& t = e.at("timings");
                   s.cached_tokens = t.at("cache_n").get<std::size_t>();
                   s.prompt_tokens = s.cached_tokens + t.at("prompt_n").get<std::size_t>();
                 } else {
                   const auto& u = e.at("usage");
                   s.prompt_tokens = u.at("prompt_tokens").get<std::size_t>();
                   s.cached_tokens = u.contains("prompt_tokens_details")
                                         ? u["prompt_tokens_details"].value("cached_tokens", std::size_t{0})
                                         : 0;
                 }
                 done = true;
               });
             });
  s.latency_ms = ms_since_start();
  if (r.status != 200) throw std::runtime_error("HTTP " + std::to_string(r.status) + ": " + r.body);
  if (!done) throw std::runtime_error("the response stream ended without timings or usage");
  if (first) s.ttft_ms = s.latency_ms;
  return s;
}

}  // namespace efim_examples
