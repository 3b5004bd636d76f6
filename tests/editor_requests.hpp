#pragma once
// The request bodies editors send, field for field as their sources build them, for the server
// suites: llama.vim's llama#fim and its context warm-up (autoload/llama.vim), llama.vscode's
// completion request (src/llama-server.ts).
#include <nlohmann/json.hpp>
#include <string>

namespace efim_test {

// llama.vim's FIM request: the lines above the cursor, the current line up to it ("prompt"), the rest.
inline nlohmann::json llama_vim_body(const std::string& prefix, const std::string& middle, const std::string& suffix,
                                     int n_predict = 128) {
  return {{"id_slot", 0},
          {"input_prefix", prefix},
          {"input_suffix", suffix},
          {"input_extra",
           nlohmann::json::array({{{"text", "import math\n"}, {"time", 1764000000.25}, {"filename", "m.py"}}})},
          {"prompt", middle},
          {"n_predict", n_predict},
          {"stop", nlohmann::json::array()},
          {"n_indent", 4},
          {"top_k", 40},
          {"top_p", 0.90},
          {"samplers", {"top_k", "top_p", "infill"}},
          {"stream", false},
          {"cache_prompt", true},
          {"t_max_prompt_ms", 500},
          {"t_max_predict_ms", 250},
          {"response_fields",
           {"content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
            "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
            "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"}}};
}

// llama.vim's ring-buffer update: the context files alone, computed into the cache.
inline nlohmann::json llama_vim_warmup_body(const nlohmann::json& input_extra) {
  return {{"id_slot", 0},          {"input_prefix", ""},   {"input_suffix", ""},         {"input_extra", input_extra},
          {"prompt", ""},          {"n_predict", 0},       {"temperature", 0.0},         {"samplers", nlohmann::json::array()},
          {"stream", false},       {"cache_prompt", true}, {"t_max_prompt_ms", 1},       {"t_max_predict_ms", 1},
          {"response_fields", {""}}};
}

// llama.vscode's FIM request (createRequestPayload, not a warm-up).
inline nlohmann::json llama_vscode_body(const std::string& prefix, const std::string& middle, const std::string& suffix) {
  return {{"input_prefix", prefix},
          {"input_suffix", suffix},
          {"input_extra", nlohmann::json::array({{{"text", "x = 1\n"}, {"time", 5}, {"filename", "b.py"}}})},
          {"prompt", middle},
          {"n_predict", 8},
          {"top_k", 40},
          {"top_p", 0.99},
          {"stream", false},
          {"samplers", {"top_k", "top_p", "infill"}},
          {"cache_prompt", true},
          {"n_indent", 4},
          {"t_max_prompt_ms", 500},
          {"t_max_predict_ms", 2500},
          {"lora", nlohmann::json::array({{{"id", 0}, {"scale", 0.5}}})}};
}

}  // namespace efim_test
