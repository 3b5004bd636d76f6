#pragma once
// A small blocking HTTP/1.1 client on Boost.Beast, for efim-bench's replay over HTTP and the tests:
// one kept-alive connection per client, bodies whole or streamed as they arrive.
#include <utility>  // before Asio 1.74, whose awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "efim/server/http.hpp"
#include "efim/server/sse.hpp"

namespace efim_examples::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;

// http://HOST[:PORT][/PATH]
struct url {
  std::string host, port = "80", path;
};

inline url parse_url(std::string_view text) {
  constexpr std::string_view scheme = "http://";
  if (!text.starts_with(scheme)) throw std::invalid_argument("not an http:// URL: " + std::string(text));
  text.remove_prefix(scheme.size());
  url u;
  const std::size_t slash = text.find('/');
  std::string_view authority = text.substr(0, slash);
  u.path = slash == std::string_view::npos ? "" : std::string(text.substr(slash));
  while (!u.path.empty() && u.path.back() == '/') u.path.pop_back();
  const std::size_t colon = authority.rfind(':');
  const std::size_t bracket = authority.rfind(']');  // [IPv6]:port
  if (colon != std::string_view::npos && (bracket == std::string_view::npos || colon > bracket)) {
    u.port = std::string(authority.substr(colon + 1));
    authority = authority.substr(0, colon);
  }
  if (authority.starts_with('[') && authority.ends_with(']')) authority = authority.substr(1, authority.size() - 2);
  u.host = std::string(authority);
  if (u.host.empty()) throw std::invalid_argument("no host in URL " + std::string(text));
  return u;
}

struct response {
  int status = 0;
  std::string content_type;
  std::string body;
};

class client {
 public:
  explicit client(url u, std::chrono::seconds timeout = std::chrono::seconds(600))
      : url_(std::move(u)), timeout_(timeout) {}

  // Sends a request on the kept-alive connection (a fresh one if the server closed it) and reads
  // the response; `on_data` sees the body's bytes as they arrive. Throws on network errors.
  response request(std::string_view method, std::string_view path, std::string body,
                   const std::vector<efim::server::header>& headers = {},
                   const std::function<void(std::string_view)>& on_data = {}) {
    for (int attempt = 0;; ++attempt) {
      const bool reused = stream_.has_value();
      try {
        if (!stream_) connect();
        return exchange(method, path, body, headers, on_data);
      } catch (const beast::system_error&) {
        stream_.reset();
        // A kept-alive connection the server had closed: once more on a new one.
        if (!reused || attempt > 0 || started_reading_) throw;
      }
    }
  }

  response get(std::string_view path) { return request("GET", path, {}); }
  response post(std::string_view path, std::string body, const std::vector<efim::server::header>& headers = {},
                const std::function<void(std::string_view)>& on_data = {}) {
    return request("POST", path, std::move(body), headers, on_data);
  }

  void close() { stream_.reset(); }

 private:
  void connect() {
    tcp::resolver resolver(io_);
    stream_.emplace(io_);
    stream_->expires_after(timeout_);
    stream_->connect(resolver.resolve(url_.host, url_.port));
    stream_->socket().set_option(tcp::no_delay(true));
    buffer_.clear();
  }

  response exchange(std::string_view method, std::string_view path, std::string& body,
                    const std::vector<efim::server::header>& headers,
                    const std::function<void(std::string_view)>& on_data) {
    started_reading_ = false;
    beast::http::request<beast::http::string_body> req(beast::http::string_to_verb(method),
                                                       url_.path + std::string(path), 11);
    const bool v6 = url_.host.find(':') != std::string::npos;
    req.set(beast::http::field::host,
            (v6 ? "[" + url_.host + "]" : url_.host) + (url_.port == "80" ? "" : ":" + url_.port));
    req.set(beast::http::field::user_agent, "efim");
    if (!body.empty() || method == "POST") req.set(beast::http::field::content_type, "application/json");
    for (const auto& h : headers) req.set(h.name, h.value);
    req.body() = body;
    req.prepare_payload();
    stream_->expires_after(timeout_);
    beast::http::write(*stream_, req);

    beast::http::response_parser<beast::http::string_body> parser;
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    beast::http::read_header(*stream_, buffer_, parser);
    started_reading_ = true;
    std::size_t seen = 0;
    while (!parser.is_done()) {
      stream_->expires_after(timeout_);
      beast::http::read_some(*stream_, buffer_, parser);
      const auto& b = parser.get().body();
      if (on_data && b.size() > seen) on_data(std::string_view(b).substr(seen));
      seen = b.size();
    }
    auto res = parser.release();
    response out{static_cast<int>(res.result_int()), std::string(res[beast::http::field::content_type]),
                 std::move(res.body())};
    if (!res.keep_alive()) stream_.reset();
    return out;
  }

  url url_;
  std::chrono::seconds timeout_;
  asio::io_context io_;
  std::optional<beast::tcp_stream> stream_;
  beast::flat_buffer buffer_;
  bool started_reading_ = false;
};

// Splits a server-sent event stream into the data of each event as bytes arrive.
using sse_reader = efim::server::sse_reader;

}  // namespace efim_examples::http
