#pragma once
// The request and response bodies of the two APIs editors speak: llama.cpp's /infill and OpenAI's
// /v1/completions (with `suffix`). Parsing checks every field it reads and says which one is wrong;
// fields it does not know are ignored, as both servers do.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/utf8.hpp"
#include "efim/engine/request.hpp"

namespace efim::server {

using json = nlohmann::json;

// Which API an endpoint speaks: it decides the shape of error bodies.
enum class api_kind { llama, openai };

// A request the server will not serve, with the status and error type to answer with.
class api_error : public std::runtime_error {
 public:
  api_error(int status, std::string type, const std::string& message, std::string param = {})
      : std::runtime_error(message), status_(status), type_(std::move(type)), param_(std::move(param)) {}
  [[nodiscard]] int status() const noexcept { return status_; }
  [[nodiscard]] const std::string& type() const noexcept { return type_; }
  [[nodiscard]] const std::string& param() const noexcept { return param_; }

 private:
  int status_;
  std::string type_, param_;
};

inline api_error invalid_request(const std::string& message, std::string param = {}) {
  return {400, "invalid_request_error", message, std::move(param)};
}

// llama.cpp: {"error": {"code", "message", "type"}}; OpenAI: {"error": {"message", "type", "param", "code"}}.
inline std::string error_body(api_kind kind, const api_error& e) {
  json inner;
  if (kind == api_kind::llama) {
    inner = {{"code", e.status()}, {"message", e.what()}, {"type", e.type()}};
  } else {
    inner = {{"message", e.what()},
             {"type", e.type()},
             {"param", e.param().empty() ? json(nullptr) : json(e.param())},
             {"code", nullptr}};
  }
  return json{{"error", inner}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

inline constexpr std::size_t max_json_depth = 64;

// A request body: a JSON object, nested at most max_json_depth deep (hostile nesting is refused
// before it is built), with well-formed UTF-8 in every string.
inline json parse_body(std::string_view body) {
  json j;
  try {
    j = json::parse(body, [](int depth, json::parse_event_t, json&) {
      if (depth > static_cast<int>(max_json_depth))
        throw invalid_request("the request body is nested deeper than " + std::to_string(max_json_depth) + " levels");
      return true;
    });
  } catch (const json::exception& e) {
    throw invalid_request(std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw invalid_request("the request body must be a JSON object");
  return j;
}

// Typed access to the fields of a JSON object, with messages that name the field.
class fields {
 public:
  explicit fields(const json& j) : j_(j) {}

  [[nodiscard]] bool has(const char* name) const { return j_.contains(name) && !j_.at(name).is_null(); }

  [[nodiscard]] std::optional<std::string> string(const char* name) const {
    if (!has(name)) return std::nullopt;
    const auto& v = j_.at(name);
    if (!v.is_string()) throw invalid_request(quote(name) + " must be a string", name);
    return v.get<std::string>();
  }
  [[nodiscard]] std::optional<bool> boolean(const char* name) const {
    if (!has(name)) return std::nullopt;
    const auto& v = j_.at(name);
    if (!v.is_boolean()) throw invalid_request(quote(name) + " must be true or false", name);
    return v.get<bool>();
  }
  [[nodiscard]] std::optional<std::int64_t> integer(const char* name, std::int64_t min, std::int64_t max) const {
    if (!has(name)) return std::nullopt;
    const auto& v = j_.at(name);
    const auto out_of_range = [&] {
      return invalid_request(quote(name) + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]",
                             name);
    };
    std::int64_t x = 0;
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) throw out_of_range();
    if (v.is_number_integer())
      x = v.get<std::int64_t>();
    else if (v.is_number_float() && std::isfinite(v.get<double>()) && v.get<double>() == std::floor(v.get<double>()) &&
             std::abs(v.get<double>()) < 9.0e18)
      x = static_cast<std::int64_t>(v.get<double>());
    else
      throw invalid_request(quote(name) + " must be a whole number", name);
    if (x < min || x > max) throw out_of_range();
    return x;
  }
  [[nodiscard]] std::optional<double> number(const char* name, double min, double max) const {
    if (!has(name)) return std::nullopt;
    const auto& v = j_.at(name);
    if (!v.is_number()) throw invalid_request(quote(name) + " must be a number", name);
    const double x = v.get<double>();
    if (!(x >= min && x <= max))
      throw invalid_request(quote(name) + " must be in [" + trim(min) + ", " + trim(max) + "]", name);
    return x;
  }
  // A string or an array of strings (OpenAI's `stop` and `prompt` take both).
  [[nodiscard]] std::optional<std::vector<std::string>> strings(const char* name) const {
    if (!has(name)) return std::nullopt;
    const auto& v = j_.at(name);
    if (v.is_string()) return std::vector<std::string>{v.get<std::string>()};
    if (!v.is_array()) throw invalid_request(quote(name) + " must be a string or an array of strings", name);
    std::vector<std::string> out;
    for (const auto& s : v) {
      if (!s.is_string()) throw invalid_request(quote(name) + " must be a string or an array of strings", name);
      out.push_back(s.get<std::string>());
    }
    return out;
  }
  // Present with any value (a field that is accepted and not used).
  void accept(const char* name, bool (json::*is_kind)() const noexcept, const char* kind) const {
    if (has(name) && !(j_.at(name).*is_kind)()) throw invalid_request(quote(name) + " must be " + kind, name);
  }
  [[nodiscard]] const json& raw(const char* name) const { return j_.at(name); }

 private:
  static std::string quote(const char* name) { return std::string("\"") + name + "\""; }
  static std::string trim(double v) {
    std::string s = std::to_string(v);
    while (s.find('.') != std::string::npos && (s.back() == '0' || s.back() == '.')) {
      const bool dot = s.back() == '.';
      s.pop_back();
      if (dot) break;
    }
    return s;
  }
  const json& j_;
};

// Server-wide defaults and limits for generation requests.
struct generation_limits {
  std::size_t default_infill_tokens = 128;  // /infill without n_predict (or -1)
  std::size_t default_openai_tokens = 16;   // /v1/completions without max_tokens, as OpenAI
  std::size_t max_new_tokens = 4096;        // n_predict / max_tokens above this are cut to it
  float infill_temperature = 0.8f;          // /infill defaults, as llama.cpp's
  std::size_t infill_top_k = 40;
  float infill_top_p = 0.95f;
  std::size_t max_stop_strings = 16;
  std::size_t max_stop_bytes = 1024;  // each
  std::size_t max_context_files = 256;
};

// What a generation request asks for beyond the engine request.
struct generation_params {
  engine::request request;
  bool stream = false;
  bool include_usage = false;  // OpenAI stream_options.include_usage
  bool return_tokens = false;  // llama.cpp: generated ids in "tokens"
  std::optional<std::vector<std::string>> response_fields;
  std::int64_t n_predict = -1;  // as asked (for generation_settings)
  std::int64_t t_max_predict_ms = -1;
  std::string model;
  std::string user;
  std::string session_id;  // the client's own session key, if any
  std::string cache_salt;
};

namespace detail {
inline void read_stop(const fields& f, const char* name, const generation_limits& l, engine::request& r) {
  const auto stop = f.strings(name);
  if (!stop) return;
  if (stop->size() > l.max_stop_strings)
    throw invalid_request(
        "\"" + std::string(name) + "\" has more than " + std::to_string(l.max_stop_strings) + " strings", name);
  for (const auto& s : *stop)
    if (s.size() > l.max_stop_bytes)
      throw invalid_request("a stop string is longer than " + std::to_string(l.max_stop_bytes) + " bytes", name);
  r.stop.strings = *stop;
}

inline std::uint64_t random_seed() {
  static std::atomic<std::uint64_t> counter{0};
  const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return now * 0x9E3779B97F4A7C15ULL + (++counter << 17);
}

inline void read_seed(const fields& f, engine::request& r) {
  const auto seed =
      f.integer("seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
  // -1 (llama.cpp's default, 0xFFFFFFFF) or none: a different seed each time.
  r.sampling.seed = !seed || *seed == -1 || *seed == 0xFFFFFFFF ? random_seed() : static_cast<std::uint64_t>(*seed);
}

inline void read_common(const fields& f, generation_params& p) {
  p.stream = f.boolean("stream").value_or(false);
  p.request.reuse_cache = f.boolean("cache_prompt").value_or(true);
  p.model = f.string("model").value_or("");
  p.session_id = f.string("session_id").value_or("");
  p.cache_salt = f.string("cache_salt").value_or("");
  p.request.fit_context = true;  // generation stops where the context ends (llama.cpp's "truncated")
  p.request.ignore_eos = f.boolean("ignore_eos").value_or(false);
  // Token healing: at most this many tokens before the cursor regenerated (0: off; absent: the server's).
  if (const auto heal = f.integer("heal_tokens", 0, 16)) p.request.heal_tokens = static_cast<std::size_t>(*heal);
}

inline std::size_t new_tokens(std::int64_t asked, std::size_t fallback, const generation_limits& l) {
  const std::size_t n = asked < 0 ? fallback : static_cast<std::size_t>(asked);
  return n < l.max_new_tokens ? n : l.max_new_tokens;
}
}  // namespace detail

// llama.cpp's /infill body, as llama.vim and llama.vscode send it.
inline generation_params parse_infill(const json& body, const generation_limits& l) {
  const fields f(body);
  generation_params p;
  auto& r = p.request;
  if (!f.has("input_prefix")) throw invalid_request("\"input_prefix\" is required", "input_prefix");
  if (!f.has("input_suffix")) throw invalid_request("\"input_suffix\" is required", "input_suffix");
  r.prefix = *f.string("input_prefix");
  r.suffix = *f.string("input_suffix");
  // The current line up to the cursor (llama.vim's `prompt`) belongs to the prefix.
  if (const auto line = f.string("prompt")) r.prefix += *line;
  if (f.has("input_extra")) {
    const auto& extra = f.raw("input_extra");
    if (!extra.is_array())
      throw invalid_request("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}",
                            "input_extra");
    if (extra.size() > l.max_context_files)
      throw invalid_request("\"input_extra\" has more than " + std::to_string(l.max_context_files) + " chunks",
                            "input_extra");
    for (const auto& chunk : extra) {
      if (!chunk.is_object()) throw invalid_request("an \"input_extra\" chunk must be an object", "input_extra");
      const fields c(chunk);
      if (!c.has("text")) throw invalid_request("an \"input_extra\" chunk must have a \"text\" string", "input_extra");
      r.extra.push_back({c.string("filename").value_or("tmp"), *c.string("text")});
    }
  }
  detail::read_common(f, p);
  p.n_predict = f.integer("n_predict", -1, std::numeric_limits<std::int64_t>::max())
                    .value_or(f.integer("max_tokens", -1, std::numeric_limits<std::int64_t>::max()).value_or(-1));
  r.max_tokens = detail::new_tokens(p.n_predict, l.default_infill_tokens, l);
  r.sampling.temperature = static_cast<float>(f.number("temperature", 0, 1e6).value_or(l.infill_temperature));
  r.sampling.top_k =
      static_cast<std::size_t>(f.integer("top_k", 0, INT32_MAX).value_or(static_cast<std::int64_t>(l.infill_top_k)));
  r.sampling.top_p = static_cast<float>(f.number("top_p", 0, 1).value_or(l.infill_top_p));
  if (r.sampling.top_p <= 0) {  // nothing but the most likely token
    r.sampling.top_p = 1;
    r.sampling.top_k = 1;
  }
  detail::read_seed(f, r);
  detail::read_stop(f, "stop", l, r);
  r.stop.min_indent = static_cast<std::size_t>(f.integer("n_indent", 0, INT32_MAX).value_or(0));
  p.t_max_predict_ms = f.integer("t_max_predict_ms", std::numeric_limits<std::int64_t>::min(), INT64_MAX).value_or(-1);
  // Longer than a day is no limit worth keeping (and milliseconds would overflow as clock ticks).
  if (p.t_max_predict_ms > 0 && p.t_max_predict_ms <= 86'400'000)
    r.max_generate_time = std::chrono::milliseconds(p.t_max_predict_ms);
  // Accepted as llama.cpp accepts them; they change nothing here.
  f.accept("t_max_prompt_ms", &json::is_number, "a number");
  f.accept("id_slot", &json::is_number_integer, "a whole number");
  if (f.has("samplers") && !f.raw("samplers").is_array() && !f.raw("samplers").is_string())
    throw invalid_request("\"samplers\" must be an array of strings or a string", "samplers");
  p.return_tokens = f.boolean("return_tokens").value_or(false);
  if (f.has("response_fields")) p.response_fields = f.strings("response_fields");
  r.match_session = true;
  return p;
}

// OpenAI's /v1/completions body. With `suffix` it is an infill request (sessions and EFIM); without,
// a plain completion of `prompt`.
inline generation_params parse_completion(const json& body, const generation_limits& l) {
  const fields f(body);
  generation_params p;
  auto& r = p.request;
  const auto prompt = f.strings("prompt");
  if (!prompt) throw invalid_request("\"prompt\" is required", "prompt");
  if (prompt->size() != 1) throw invalid_request("\"prompt\" must be one string (batches are not served)", "prompt");
  r.prefix = prompt->front();
  if (const auto suffix = f.string("suffix")) {
    r.suffix = *suffix;
    r.match_session = true;
  } else {
    r.infill = false;
  }
  detail::read_common(f, p);
  p.n_predict = f.integer("max_tokens", -1, std::numeric_limits<std::int64_t>::max()).value_or(-1);
  r.max_tokens = detail::new_tokens(p.n_predict, l.default_openai_tokens, l);
  r.sampling.temperature = static_cast<float>(f.number("temperature", 0, 2).value_or(1.0));
  r.sampling.top_p = static_cast<float>(f.number("top_p", 0, 1).value_or(1.0));
  if (r.sampling.top_p <= 0) {
    r.sampling.top_p = 1;
    r.sampling.top_k = 1;
  }
  detail::read_seed(f, r);
  detail::read_stop(f, "stop", l, r);
  p.user = f.string("user").value_or("");
  if (f.integer("n", 1, 1).value_or(1) != 1 || f.integer("best_of", 1, 1).value_or(1) != 1)
    throw invalid_request("only one completion per request is served");
  if (f.boolean("echo").value_or(false)) throw invalid_request("\"echo\" is not supported", "echo");
  if (f.has("logprobs")) throw invalid_request("\"logprobs\" is not supported", "logprobs");
  if (f.has("stream_options")) {
    const auto& so = f.raw("stream_options");
    if (!so.is_object()) throw invalid_request("\"stream_options\" must be an object", "stream_options");
    p.include_usage = fields(so).boolean("include_usage").value_or(false);
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) (void)f.number(name, -2, 2);
  f.accept("logit_bias", &json::is_object, "an object");
  return p;
}

// What a response says about its request besides the completion.
struct response_context {
  std::string model;
  std::string format;   // the prompt format of the server
  std::string session;  // the session it was served in (the client's id or the one found by content)
  std::string id;       // OpenAI completion id
  std::int64_t created = 0;
};

inline std::string_view stop_type(engine::finish_reason r) noexcept {
  switch (r) {
    case engine::finish_reason::eos:
      return "eos";
    case engine::finish_reason::stop:
      return "word";
    case engine::finish_reason::length:
    case engine::finish_reason::indent:
    case engine::finish_reason::time_limit:
      return "limit";
    default:
      return "none";
  }
}

inline std::string_view openai_finish_reason(engine::finish_reason r) noexcept {
  return r == engine::finish_reason::eos || r == engine::finish_reason::stop || r == engine::finish_reason::indent
             ? "stop"
             : "length";
}

inline json timings(const engine::completion& c) {
  const double prompt_ms = c.prompt_ms(), predicted_ms = c.generation_ms();
  const auto prompt_n = static_cast<double>(c.computed_prompt_tokens());
  const auto predicted_n = static_cast<double>(c.generated_tokens());
  return {{"cache_n", c.cached_tokens},
          {"prompt_n", c.computed_prompt_tokens()},
          {"prompt_ms", prompt_ms},
          {"prompt_per_token_ms", prompt_n > 0 ? prompt_ms / prompt_n : 0.0},
          {"prompt_per_second", prompt_ms > 0 ? 1e3 * prompt_n / prompt_ms : 0.0},
          {"predicted_n", c.generated_tokens()},
          {"predicted_ms", predicted_ms},
          {"predicted_per_token_ms", predicted_n > 0 ? predicted_ms / predicted_n : 0.0},
          {"predicted_per_second", predicted_ms > 0 ? 1e3 * predicted_n / predicted_ms : 0.0}};
}

inline json efim_fields(const engine::completion& c, const response_context& ctx) {
  return {{"session", ctx.session},
          {"change", c.session.empty() ? std::string_view("none") : prompt::to_string(c.session_change)},
          {"format", ctx.format},
          {"prompt_tokens", c.prompt_tokens},
          {"cached_tokens", c.cached_tokens},
          {"reused_tokens", c.reused_tokens},
          {"healed_tokens", c.healed_tokens},
          {"healing_steps", c.healing_steps},
          {"finish", engine::to_string(c.reason)}};
}

// llama.cpp's response_fields: only the named fields, a nested one under its slash path as the key.
inline json select_fields(const json& full, const std::vector<std::string>& paths) {
  json out = json::object();
  for (const auto& path : paths) {
    const json* at = &full;
    std::size_t begin = 0;
    bool found = true;
    while (found) {
      const std::size_t end = path.find('/', begin);
      const std::string key = path.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
      if (!at->is_object() || !at->contains(key)) {
        found = false;
        break;
      }
      at = &at->at(key);
      if (end == std::string::npos) break;
      begin = end + 1;
    }
    if (found) out[path] = *at;
  }
  return out;
}

inline json infill_final(const engine::completion& c, const generation_params& p, const response_context& ctx) {
  const auto& r = p.request;
  json settings = {{"n_predict", p.n_predict},
                   {"temperature", r.sampling.temperature},
                   {"top_k", r.sampling.top_k},
                   {"top_p", r.sampling.top_p},
                   {"seed", r.sampling.seed},
                   {"stop", r.stop.strings},
                   {"n_indent", r.stop.min_indent},
                   {"t_max_predict_ms", p.t_max_predict_ms},
                   {"stream", p.stream},
                   {"cache_prompt", r.reuse_cache}};
  if (r.heal_tokens) settings["heal_tokens"] = *r.heal_tokens;
  json full = {{"index", 0},
               {"content", c.text},
               {"tokens", p.return_tokens ? json(c.tokens) : json::array()},
               {"id_slot", -1},
               {"stop", true},
               {"model", ctx.model},
               {"tokens_predicted", c.generated_tokens()},
               {"tokens_evaluated", c.prompt_tokens},
               {"generation_settings", settings},
               {"has_new_line", c.text.find('\n') != std::string::npos},
               {"truncated", c.truncated},
               {"stop_type", stop_type(c.reason)},
               {"stopping_word", c.stop_word},
               {"tokens_cached", c.cached_tokens},
               {"timings", timings(c)},
               {"efim", efim_fields(c, ctx)}};
  return p.response_fields ? select_fields(full, *p.response_fields) : full;
}

// One streamed piece of an /infill response.
inline json infill_partial(std::string_view text, token_id token, std::size_t predicted, std::size_t prompt_tokens,
                           bool return_tokens) {
  return {{"index", 0},
          {"content", text},
          {"tokens", return_tokens ? json::array({token}) : json::array()},
          {"stop", false},
          {"id_slot", -1},
          {"tokens_predicted", predicted},
          {"tokens_evaluated", prompt_tokens}};
}

inline json openai_usage(const engine::completion& c) {
  return {{"prompt_tokens", c.prompt_tokens},
          {"completion_tokens", c.generated_tokens()},
          {"total_tokens", c.prompt_tokens + c.generated_tokens()},
          {"prompt_tokens_details", {{"cached_tokens", c.cached_tokens}}}};
}

inline json openai_head(const response_context& ctx) {
  return {{"id", ctx.id},
          {"object", "text_completion"},
          {"created", ctx.created},
          {"model", ctx.model},
          {"system_fingerprint", "efim"}};
}

inline json openai_final(const engine::completion& c, const response_context& ctx) {
  json out = openai_head(ctx);
  out["choices"] = json::array(
      {{{"text", c.text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", openai_finish_reason(c.reason)}}});
  out["usage"] = openai_usage(c);
  out["timings"] = timings(c);
  out["efim"] = efim_fields(c, ctx);
  return out;
}

// One streamed piece of an OpenAI completion; `finish` is set on the last one.
inline json openai_chunk(std::string_view text, const response_context& ctx, std::optional<std::string_view> finish) {
  json out = openai_head(ctx);
  out["choices"] = json::array({{{"text", text},
                                 {"index", 0},
                                 {"logprobs", nullptr},
                                 {"finish_reason", finish ? json(*finish) : json(nullptr)}}});
  return out;
}

// Text for a JSON body: one line; bytes that are not UTF-8 (never in generated text) become U+FFFD.
inline std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A server-sent event.
inline std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace efim::server
