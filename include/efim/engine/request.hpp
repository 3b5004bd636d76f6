#pragma once
// What a client asks for and what it gets back.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/types.hpp"
#include "efim/prompt/session.hpp"

namespace efim::engine {

struct sampling_params {
  float temperature = 0.0f;  // 0: greedy
  std::size_t top_k = 0;     // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  std::uint64_t seed = 0;    // the same seed gives the same tokens, whatever else is in the batch
};

struct request {
  std::string prefix;           // text before the cursor
  std::string suffix;           // text after the cursor
  std::string session;          // editor session: requests of one session reuse its anchor (empty: stateless)
  std::string tenant;           // cache salt: requests of different tenants never share cached KV
  std::size_t max_tokens = 16;  // 0: compute the prompt only (warms the cache)
  bool ignore_eos = false;      // generate max_tokens tokens whatever the model says
  sampling_params sampling;
};

using request_id = std::uint64_t;
using clock = std::chrono::steady_clock;

enum class finish_reason { eos, length, cancelled, error };

inline constexpr std::string_view to_string(finish_reason r) noexcept {
  switch (r) {
    case finish_reason::eos:
      return "eos";
    case finish_reason::length:
      return "length";
    case finish_reason::cancelled:
      return "cancelled";
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
  finish_reason reason = finish_reason::length;
  prompt::change session_change = prompt::change::first;
  std::size_t prompt_tokens = 0;
  std::size_t cached_tokens = 0;  // prompt tokens whose KV came from the cache
  clock::time_point submitted{}, first_token{}, finished{};
  std::exception_ptr error;  // why the request failed (finish_reason::error)

  [[nodiscard]] double latency_ms() const noexcept {
    return std::chrono::duration<double, std::milli>(finished - submitted).count();
  }
  // Time to the first generated token (to the end of the prompt when none was generated).
  [[nodiscard]] double ttft_ms() const noexcept {
    const auto first = tokens.empty() ? finished : first_token;
    return std::chrono::duration<double, std::milli>(first - submitted).count();
  }
};

struct token_event {
  request_id id = 0;
  token_id token = 0;
  std::string_view text;  // whole UTF-8 characters completed by this token (may be empty)
};

// Where a request's output goes; both are called on the thread that runs the pipeline. They may
// submit or cancel requests. If on_token throws, its request ends there with finish_reason::error
// and the exception in completion::error (the other requests go on); on_done must not throw.
struct stream {
  std::function<void(const token_event&)> on_token;
  std::function<void(completion&&)> on_done;
};

}  // namespace efim::engine
