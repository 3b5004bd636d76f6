#pragma once
// What the handlers see of HTTP, whatever library carries it: a request, a whole response, and a
// channel to answer on, possibly later and from another thread, possibly as a stream.
#include <algorithm>
#include <cctype>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace efim::server {

struct header {
  std::string name;
  std::string value;
};

// Case-insensitive ASCII comparison, as HTTP header names compare.
inline bool iequals(std::string_view a, std::string_view b) noexcept {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

struct http_request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query, as sent
  std::vector<header> headers;
  std::string body;

  // The value of the first header named `name` (any case); empty if there is none.
  [[nodiscard]] std::string_view header_value(std::string_view name) const noexcept {
    for (const auto& h : headers)
      if (iequals(h.name, name)) return h.value;
    return {};
  }
  // The path without the query.
  [[nodiscard]] std::string_view path() const noexcept {
    const std::string_view t = target;
    return t.substr(0, t.find('?'));
  }
};

struct http_response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<header> headers = {};
};

// Where a handler answers. Every call may come from any thread; an implementation orders them.
// A response is either one respond() or begin_stream(), any number of stream(), then end_stream().
class response_channel {
 public:
  virtual ~response_channel() = default;
  virtual void respond(http_response r) = 0;
  virtual void begin_stream(int status, std::string content_type) = 0;
  virtual void stream(std::string data) = 0;
  virtual void end_stream() = 0;
  // `f` runs once if the client goes away before the response has ended (at once if it has gone
  // already); the handler cancels its work there.
  virtual void on_disconnect(std::function<void()> f) = 0;
};

}  // namespace efim::server
