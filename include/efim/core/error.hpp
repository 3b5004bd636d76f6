#pragma once
// The one error type of the library: a code a program can branch on and a message a user can act on.
#include <stdexcept>
#include <string>
#include <string_view>

namespace efim {

enum class errc {
  invalid_argument,  // a parameter outside its documented range
  invalid_utf8,      // text that is not well-formed UTF-8
  unknown_token,     // a token id or special-token text the vocabulary does not have
  too_long,          // a prompt or generation longer than the model or cache allows
  out_of_blocks,     // the KV cache cannot hold a request even when empty
  io,                // a file could not be read or written
  unavailable,       // the engine has stopped and takes no more requests
  // The engine behind HTTP that computes for efim (server::upstream_pipeline):
  upstream,          // it failed: refused the connection, answered an error, sent what cannot be read
  upstream_busy,     // it said it is busy or not ready (its 503)
  upstream_timeout,  // it did not answer in time
};

inline std::string_view to_string(errc code) noexcept {
  switch (code) {
    case errc::invalid_argument:
      return "invalid argument";
    case errc::invalid_utf8:
      return "invalid UTF-8";
    case errc::unknown_token:
      return "unknown token";
    case errc::too_long:
      return "too long";
    case errc::out_of_blocks:
      return "out of KV blocks";
    case errc::io:
      return "I/O error";
    case errc::unavailable:
      return "unavailable";
    case errc::upstream:
      return "upstream failed";
    case errc::upstream_busy:
      return "upstream busy";
    case errc::upstream_timeout:
      return "upstream timed out";
  }
  return "error";
}

class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

// Throws unless `condition` holds; for checking user input at public entry points.
inline void require(bool condition, errc code, std::string_view message) {
  if (!condition) throw error(code, std::string(message));
}

}  // namespace efim
