#pragma once
// What a client asks for and what it gets back.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/types.hpp"
#include "efim/engine/stop_rules.hpp"
#include "efim/prompt/session.hpp"

namespace efim::engine {

struct sampling_params {
  float temperature = 0.0f;  // 0: greedy
  std::size_t top_k = 0;     // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  std::uint64_t seed = 0;    // the same seed gives the same tokens, whatever else is in the batch
};

// A file of extra context, laid out before the infill (see prompt::context_file).
struct context_file {
  std::string name;
  std::string text;
};

struct request {
  std::string prefix;               // text before the cursor (the whole prompt when `infill` is false)
  std::string suffix;               // text after the cursor
  std::string session;              // editor session: requests of one session reuse its anchor
  bool match_session = false;       // without a session key: find the session by the request's content
  std::string tenant;               // cache salt: requests of different tenants never share cached KV or sessions
  std::vector<context_file> extra;  // context files (taken when the session's anchor is set)
  bool infill = true;               // false: a plain completion of `prefix` (no FIM layout, no session)
  std::size_t max_tokens = 16;      // 0: compute the prompt only (warms the cache; renews a session's anchor)
  bool fit_context = false;         // generate at most what the context has room for, instead of refusing
  bool ignore_eos = false;          // generate max_tokens tokens whatever the model says
  bool reuse_cache = true;          // false: compute the whole prompt, whatever the cache holds
  // Token healing (text/healing.hpp): at most this many tokens at the end of the text before the
  // cursor are removed and regenerated under a constraint; unset: the pipeline's heal_tokens; 0: off.
  std::optional<std::size_t> heal_tokens;
  sampling_params sampling;
  stop_rules stop;  // stop strings, minimum indentation of new lines
  // > 0: once this long has passed since the first token, generation ends with the next token that
  // ends a line (llama.cpp's t_max_predict_ms: the suggestion's last line is whole).
  std::chrono::milliseconds max_generate_time{};
};

using request_id = std::uint64_t;
using clock = std::chrono::steady_clock;

enum class finish_reason {
  eos,         // the model ended the text
  length,      // max_tokens (or the context, with fit_context) reached
  stop,        // a stop string
  indent,      // a new line indented less than the minimum
  time_limit,  // max_generate_time passed, and a line ended
  cancelled,   // cancel()
  superseded,  // a newer request of the same session arrived
  error,       // the request's own failure (completion::error)
};

inline constexpr std::string_view to_string(finish_reason r) noexcept {
  switch (r) {
    case finish_reason::eos:
      return "eos";
    case finish_reason::length:
      return "length";
    case finish_reason::stop:
      return "stop";
    case finish_reason::indent:
      return "indent";
    case finish_reason::time_limit:
      return "time_limit";
    case finish_reason::cancelled:
      return "cancelled";
    case finish_reason::superseded:
      return "superseded";
    case finish_reason::error:
      return "error";
  }
  return "?";
}

struct completion {
  request_id id = 0;
  std::string text;
  std::string tail;  // the end of text no token event carried (held-back bytes of a cut UTF-8 character, as U+FFFD)
  std::vector<token_id> tokens;  // generated ids (an end-of-sequence token is not included)
  // Generated tokens whose ids are not in `tokens`: an engine elsewhere gave only their text, or
  // they are rows of its model the tokenizer has no token for (upstream_options::vocab).
  std::size_t unnamed_tokens = 0;
  finish_reason reason = finish_reason::length;
  std::string session;  // the session it was laid out in (empty: none)
  prompt::change session_change = prompt::change::first;
  std::size_t reused_tokens = 0;  // generated ids of the previous request it reused (change::accepted)
  std::size_t prompt_tokens = 0;
  std::size_t cached_tokens = 0;  // prompt tokens whose KV came from the cache
  std::size_t healed_tokens = 0;  // prompt tokens token healing removed (their text regenerated, not sent)
  std::size_t healing_steps = 0;  // generated tokens that only gave back removed text (not counted in max_tokens)
  bool truncated = false;         // generation stopped because the context was full (fit_context)
  std::string stop_word;          // the stop string that ended it (finish_reason::stop)
  // Submitted; first scheduled; prompt computed; first token; done.
  clock::time_point submitted{}, started{}, prompt_done{}, first_token{}, finished{};
  std::exception_ptr error;  // why the request failed (finish_reason::error)

  [[nodiscard]] std::size_t computed_prompt_tokens() const noexcept { return prompt_tokens - cached_tokens; }
  // Every token generated (the end-of-sequence token aside).
  [[nodiscard]] std::size_t generated_tokens() const noexcept { return tokens.size() + unnamed_tokens; }
  // Time spent computing the prompt (from its first scheduled step).
  [[nodiscard]] double prompt_ms() const noexcept {
    return started == clock::time_point{} ? 0.0
                                          : std::chrono::duration<double, std::milli>(prompt_done - started).count();
  }
  // Time spent generating (after the prompt).
  [[nodiscard]] double generation_ms() const noexcept {
    return prompt_done == clock::time_point{}
               ? 0.0
               : std::chrono::duration<double, std::milli>(finished - prompt_done).count();
  }

  [[nodiscard]] double latency_ms() const noexcept {
    return std::chrono::duration<double, std::milli>(finished - submitted).count();
  }
  // Time to the first generated token (to the end of the prompt when none was generated).
  [[nodiscard]] double ttft_ms() const noexcept {
    const auto first = generated_tokens() == 0 ? finished : first_token;
    return std::chrono::duration<double, std::milli>(first - submitted).count();
  }
};

struct token_event {
  request_id id = 0;
  token_id token = 0;
  std::string_view
      text;  // whole UTF-8 characters completed by this token and let through by the stop rules (may be empty)
  std::size_t prompt_tokens = 0;  // of its request
};

// Where a request's output goes; both are called on the thread that runs the pipeline. They may
// submit or cancel requests. What they throw never reaches the engine: if on_token throws, its
// request ends there with finish_reason::error and the exception in completion::error (the other
// requests go on); if on_done throws, the request is over already, and the exception goes to
// pipeline_options::on_callback_error (and is counted in pipeline::callback_failures()).
struct stream {
  std::function<void(const token_event&)> on_token;
  std::function<void(completion&&)> on_done;
};

}  // namespace efim::engine
