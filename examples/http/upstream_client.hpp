#pragma once
// efim-server's HTTP client for the engine it sends prompts to (efim::server::upstream_transport), on
// Boost.Asio and Boost.Beast: one thread runs every exchange; each exchange is a connection of its
// own, its body handed over as it arrives (server-sent events token by token), and closed at once
// when efim ends the request (the upstream then stops generating).
#include <atomic>
#include <utility>  // before Asio 1.74, whose awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "efim/server/upstream.hpp"
#include "client.hpp"

namespace efim_examples::http {

class upstream_client {
 public:
  // Resolves the upstream's address now (a name that does not resolve fails here).
  explicit upstream_client(url u) : url_(std::move(u)), work_(asio::make_work_guard(io_)) {
    tcp::resolver resolver(io_);
    endpoints_ = resolver.resolve(url_.host, url_.port);
    const bool v6 = url_.host.find(':') != std::string::npos;
    host_ = (v6 ? "[" + url_.host + "]" : url_.host) + (url_.port == "80" ? "" : ":" + url_.port);
    thread_ = std::thread([this] { io_.run(); });
  }

  upstream_client(const upstream_client&) = delete;
  upstream_client& operator=(const upstream_client&) = delete;

  ~upstream_client() {
    work_.reset();
    asio::post(io_, [this] {
      for (auto& [id, x] : live_)
        if (const auto e = x.lock()) e->close();
    });
    io_.stop();
    thread_.join();
  }

  [[nodiscard]] const url& address() const noexcept { return url_; }

  std::uint64_t start(efim::server::upstream_call call, efim::server::upstream_handlers handlers) {
    const std::uint64_t id = ++last_id_;
    auto x = std::make_shared<exchange>(io_, std::move(handlers), call.timeout);
    auto& req = x->req;
    req.method(beast::http::string_to_verb(call.method));
    req.target(url_.path + call.path);
    req.version(11);
    req.set(beast::http::field::host, host_);
    req.set(beast::http::field::user_agent, "efim");
    req.set(beast::http::field::connection, "close");
    if (call.method != "GET") req.set(beast::http::field::content_type, "application/json");
    req.body() = std::move(call.body);
    req.prepare_payload();
    asio::post(io_, [this, id, x] {
      live_[id] = x;
      x->on_end_extra = [this, id] { live_.erase(id); };
      x->run(endpoints_);
    });
    return id;
  }

  void abort(std::uint64_t id) {
    asio::post(io_, [this, id] {
      if (const auto it = live_.find(id); it != live_.end())
        if (const auto x = it->second.lock()) x->close();
    });
  }

 private:
  struct exchange : std::enable_shared_from_this<exchange> {
    exchange(asio::io_context& io, efim::server::upstream_handlers h, std::chrono::milliseconds t)
        : stream(io), handlers(std::move(h)), timeout(t) {
      parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    }

    void run(const tcp::resolver::results_type& endpoints) {
      stream.expires_after(timeout);
      stream.async_connect(endpoints, [self = this->shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
        if (ec) return self->end(ec);
        beast::error_code ignored;  // (a throw here would escape the I/O thread)
        self->stream.socket().set_option(tcp::no_delay(true), ignored);
        self->stream.expires_after(self->timeout);
        beast::http::async_write(self->stream, self->req, [self](beast::error_code ec, std::size_t) {
          if (ec) return self->end(ec);
          self->stream.expires_after(self->timeout);
          beast::http::async_read_header(self->stream, self->buffer, self->parser,
                                         [self](beast::error_code ec, std::size_t) {
                                           if (ec) return self->end(ec);
                                           if (self->handlers.on_status)
                                             self->handlers.on_status(static_cast<int>(self->parser.get().result_int()));
                                           self->read_body();
                                         });
        });
      });
    }

    void read_body() {
      if (parser.is_done()) return end({});
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof chunk;
      stream.expires_after(timeout);
      beast::http::async_read_some(stream, buffer, parser, [self = this->shared_from_this()](beast::error_code ec,
                                                                                              std::size_t) {
        if (ec == beast::http::error::need_buffer) ec = {};
        const std::size_t got = sizeof self->chunk - self->parser.get().body().size;
        if (got > 0 && !self->ended && self->handlers.on_body) self->handlers.on_body(std::string_view(self->chunk, got));
        if (ec) return self->end(ec);
        self->read_body();
      });
    }

    void close() {
      if (ended) return;
      aborted = true;
      beast::error_code ignored;
      stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
      stream.close();
    }

    void end(beast::error_code ec) {
      if (ended) return;
      ended = true;
      std::string error;
      if (aborted)
        error = "closed by efim";
      else if (ec)
        error = ec == beast::error::timeout ? "no answer within " + std::to_string(timeout.count()) + " ms"
                                            : ec.message();
      if (handlers.on_end) handlers.on_end(error, !aborted && ec == beast::error::timeout);
      if (on_end_extra) on_end_extra();
    }

    beast::tcp_stream stream;
    beast::flat_buffer buffer;
    beast::http::request<beast::http::string_body> req;
    beast::http::response_parser<beast::http::buffer_body> parser;
    efim::server::upstream_handlers handlers;
    std::chrono::milliseconds timeout;
    std::function<void()> on_end_extra;
    char chunk[16384];
    bool ended = false, aborted = false;
  };

  url url_;
  std::string host_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::resolver::results_type endpoints_;
  std::unordered_map<std::uint64_t, std::weak_ptr<exchange>> live_;  // the I/O thread's only
  std::atomic<std::uint64_t> last_id_{0};
  std::thread thread_;
};

}  // namespace efim_examples::http
