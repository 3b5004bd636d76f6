#pragma once
// HTTP/1.1 for efim::server's handlers, on Boost.Asio and Boost.Beast: one thread runs every socket
// (thousands of idle or streaming connections cost no thread each), a small pool runs the handlers,
// and a connection whose request is still being computed is watched, so that a client that hangs
// up cancels its work at once. Beast parses requests (with limits on header and body size);
// responses are written as whole bodies or as chunked streams (server-sent events).
#include <sys/socket.h>

#include <sys/types.h>

#include <array>
#include <atomic>
#include <utility>  // before Asio 1.74, whose awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efim/server/api.hpp"
#include "efim/server/http.hpp"

namespace efim_examples::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;

struct server_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 8012;  // llama.vim's default endpoint
  std::size_t max_body_bytes = 16u << 20;
  std::size_t max_header_bytes = 64u << 10;
  std::size_t max_connections = 1024;
  std::chrono::seconds idle_timeout{60};  // to read a request, or between two on a kept-alive connection
  std::size_t handler_threads = 2;
};

using handler = std::function<void(efim::server::http_request, std::shared_ptr<efim::server::response_channel>)>;

namespace detail {

inline std::string status_line(int status) {
  const auto reason = beast::http::obsolete_reason(static_cast<beast::http::status>(status));
  return "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason.data(), reason.size()) + "\r\n";
}

inline std::string error_json(int status, const std::string& message, const char* type) {
  return efim::server::dump({{"error", {{"code", status}, {"message", message}, {"type", type}}}});
}

// What every connection shares with the server.
struct shared_state {
  asio::io_context& io;
  asio::thread_pool& pool;
  const server_options& options;
  const handler& handle;
  std::atomic<std::size_t>& open;
  std::atomic<bool>& stopping;
};

// One connection: reads requests one after the other, hands each to the handler pool, and writes
// its answer. Everything here runs on the I/O thread; request_channel brings the handler's calls to it.
class connection : public std::enable_shared_from_this<connection> {
 public:
  connection(tcp::socket socket, shared_state s) : stream_(std::move(socket)), s_(s) {
    ++s_.open;
    // Streamed tokens are small writes: sent at once, not held for the client's (delayed) ACK.
    beast::error_code ignored;
    stream_.socket().set_option(tcp::no_delay(true), ignored);
  }
  ~connection() { --s_.open; }

  void start() { read_request(); }

  // An answer to a connection over the limit, then closed.
  void refuse(int status, std::string body) {
    keep_alive_ = false;
    state_ = state::processing;
    send_whole(++request_, {status, "application/json", std::move(body)});
  }

  // Closes a connection that waits for a request (the server is stopping).
  void close_if_idle() {
    if (state_ == state::reading) close();
  }

  // The handler's calls for request number `n`; those for a request that is over are dropped.
  void respond(std::uint64_t n, efim::server::http_response r) {
    if (current(n)) send_whole(n, std::move(r));
  }
  void begin_stream(std::uint64_t n, int status, const std::string& content_type) {
    if (!current(n)) return;
    // HTTP/1.0 has no chunked encoding: the body ends when the connection does.
    chunked_ = http11_;
    if (!chunked_) keep_alive_ = false;
    queue(status_line(status) + "Server: efim\r\nContent-Type: " + content_type + "\r\nCache-Control: no-cache\r\n" +
          (chunked_ ? "Transfer-Encoding: chunked\r\n" : "") + connection_header() + "\r\n");
  }
  void stream(std::uint64_t n, std::string data) {
    if (!current(n) || data.empty()) return;  // an empty chunk would end the body
    if (!chunked_) return queue(std::move(data));
    char size[32];
    std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    queue(size + data + "\r\n");
  }
  void end_stream(std::uint64_t n) {
    if (!current(n)) return;
    if (chunked_) queue("0\r\n\r\n");
    response_complete_ = true;
    write_next();
  }
  void on_disconnect(std::uint64_t n, std::function<void()> f) {
    if (n != request_) return;
    if (gone_)
      f();
    else if (state_ == state::processing && !response_complete_)
      on_gone_ = std::move(f);
  }

 private:
  enum class state { reading, processing, closing, closed };
  static constexpr std::chrono::seconds write_timeout{60};
  static constexpr std::chrono::seconds linger_time{2};
  static constexpr std::size_t linger_bytes = 1u << 20;

  [[nodiscard]] bool current(std::uint64_t n) const noexcept {
    return n == request_ && state_ == state::processing && !response_complete_;
  }

  void read_request() {
    state_ = state::reading;
    on_gone_ = nullptr;
    response_complete_ = false;
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(s_.options.max_header_bytes));
    parser_->body_limit(s_.options.max_body_bytes);
    stream_.expires_after(s_.options.idle_timeout);
    beast::http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return read_failed(ec);
    auto& req = parser_->get();
    if (const auto length = parser_->content_length(); length && *length > s_.options.max_body_bytes)
      return reject(413, "the request body is larger than " + std::to_string(s_.options.max_body_bytes) + " bytes");
    if (beast::iequals(req[beast::http::field::expect], "100-continue")) {
      auto interim = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      asio::async_write(stream_, asio::buffer(*interim),
                        [self = shared_from_this(), interim](beast::error_code e, std::size_t) {
                          if (e) return self->close();
                          self->read_body();
                        });
      return;
    }
    read_body();
  }

  void read_body() {
    beast::http::async_read(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_request(ec); });
  }

  void read_failed(beast::error_code ec) {
    if (ec == beast::http::error::end_of_stream || ec == asio::error::eof || ec == beast::error::timeout ||
        ec == asio::error::operation_aborted || ec == asio::error::connection_reset)
      return close();
    if (ec == beast::http::error::body_limit)
      return reject(413, "the request body is larger than " + std::to_string(s_.options.max_body_bytes) + " bytes");
    if (ec == beast::http::error::header_limit)
      return reject(431,
                    "the request headers are larger than " + std::to_string(s_.options.max_header_bytes) + " bytes");
    reject(400, "malformed HTTP request: " + ec.message());
  }

  // Answers a request that cannot be read, then closes the connection.
  void reject(int status, const std::string& message) {
    keep_alive_ = false;
    state_ = state::processing;
    send_whole(++request_, {status, "application/json", error_json(status, message, "invalid_request_error")});
  }

  void on_request(beast::error_code ec);  // below: it makes a request_channel

  // While the answer is being computed nothing should arrive; a readable socket that gives no
  // bytes (end of stream) or an error means the client has gone. (A client that shuts down its
  // sending side after its request counts as gone, as with llama.cpp's server.)
  void watch_for_hangup() {
    stream_.socket().async_wait(
        tcp::socket::wait_read, [self = shared_from_this(), n = request_](beast::error_code ec) {
          if (ec || n != self->request_ || self->state_ != state::processing || self->response_complete_) return;
          char byte;
          const ssize_t got = ::recv(self->stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
          if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return self->watch_for_hangup();
          if (got <= 0) return self->hang_up();
          // The bytes of a pipelined request: read after this answer (the watch ends here).
        });
  }

  void hang_up() {
    if (gone_) return;
    gone_ = true;
    if (auto f = std::exchange(on_gone_, nullptr)) f();
    close();
  }

  void send_whole(std::uint64_t n, efim::server::http_response r) {
    if (n != request_) return;
    std::string head = status_line(r.status) + "Server: efim\r\nContent-Type: " + r.content_type +
                       "\r\nContent-Length: " + std::to_string(r.body.size()) + "\r\n";
    for (const auto& h : r.headers) head += h.name + ": " + h.value + "\r\n";
    queue(head + connection_header() + "\r\n" + r.body);
    response_complete_ = true;
    write_next();
  }

  std::string connection_header() const { return keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n"; }

  void queue(std::string bytes) {
    if (state_ != state::processing) return;
    out_.push_back(std::move(bytes));
    write_next();
  }

  void write_next() {
    if (writing_ || state_ != state::processing) return;
    if (out_.empty()) {
      if (response_complete_) finish_response();
      return;
    }
    writing_ = true;
    writing_now_ = std::move(out_.front());  // stays put until the write completes, whatever close() does
    out_.pop_front();
    stream_.expires_after(write_timeout);  // a client that stops reading is a client that has gone
    asio::async_write(stream_, asio::buffer(writing_now_),
                      [self = shared_from_this()](beast::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (ec) return self->hang_up();
                        self->stream_.expires_never();
                        self->write_next();
                      });
  }

  void finish_response() {
    beast::error_code ignored;
    stream_.socket().cancel(ignored);  // the hang-up watch
    if (keep_alive_ && !s_.stopping) return read_request();
    linger();
  }

  // Closes after the answer without a reset: the client may still be sending (a body after a 413),
  // and closing with unread bytes would make the kernel send RST, losing the answer on its side.
  void linger() {
    state_ = state::closing;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(linger_time);
    drain_input(0);
  }

  void drain_input(std::size_t seen) {
    auto scratch = std::make_shared<std::array<char, 4096>>();
    stream_.async_read_some(asio::buffer(*scratch),
                            [self = shared_from_this(), scratch, seen](beast::error_code ec, std::size_t n) {
                              if (ec || seen + n > linger_bytes) return self->close();
                              self->drain_input(seen + n);
                            });
  }

  void close() {
    if (state_ == state::closed) return;
    state_ = state::closed;
    out_.clear();
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

  friend class request_channel;

  beast::tcp_stream stream_;
  shared_state s_;
  beast::flat_buffer buffer_;
  std::optional<beast::http::request_parser<beast::http::string_body>> parser_;
  state state_ = state::reading;
  std::uint64_t request_ = 0;  // the number of the request being answered
  bool http11_ = true;
  bool keep_alive_ = true;
  bool chunked_ = false;
  bool response_complete_ = false;
  bool writing_ = false;
  bool gone_ = false;
  std::function<void()> on_gone_;
  std::deque<std::string> out_;
  std::string writing_now_;
};

// The channel of one request: the handler's calls, from any thread, go to the I/O thread and to
// this request only. Until the answer has ended, it keeps the I/O loop running.
class request_channel : public efim::server::response_channel {
 public:
  request_channel(std::shared_ptr<connection> c, std::uint64_t n)
      : c_(std::move(c)), n_(n), work_(asio::make_work_guard(c_->s_.io)) {}

  void respond(efim::server::http_response r) override {
    post([n = n_, r = std::move(r)](connection& c) mutable { c.respond(n, std::move(r)); }, true);
  }
  void begin_stream(int status, std::string content_type) override {
    post([n = n_, status, ct = std::move(content_type)](connection& c) { c.begin_stream(n, status, ct); }, false);
  }
  void stream(std::string data) override {
    post([n = n_, data = std::move(data)](connection& c) mutable { c.stream(n, std::move(data)); }, false);
  }
  void end_stream() override {
    post([n = n_](connection& c) { c.end_stream(n); }, true);
  }
  void on_disconnect(std::function<void()> f) override {
    post([n = n_, f = std::move(f)](connection& c) mutable { c.on_disconnect(n, std::move(f)); }, false);
  }

 private:
  using work_guard = asio::executor_work_guard<asio::io_context::executor_type>;

  // `last`: the call that ends the answer takes the work guard along, and lets it go once done.
  template <class F>
  void post(F f, bool last) {
    std::optional<work_guard> work;
    if (last && work_) {
      work.emplace(std::move(*work_));
      work_.reset();
    }
    asio::post(c_->s_.io, [c = c_, f = std::move(f), work = std::move(work)]() mutable {
      f(*c);
      work.reset();
    });
  }

  std::shared_ptr<connection> c_;
  std::uint64_t n_;
  std::optional<work_guard> work_;
};

inline void connection::on_request(beast::error_code ec) {
  if (ec) return read_failed(ec);
  auto req = parser_->release();
  http11_ = req.version() >= 11;
  keep_alive_ = req.keep_alive() && !s_.stopping;
  efim::server::http_request r;
  r.method = std::string(req.method_string());
  r.target = std::string(req.target());
  for (const auto& f : req) r.headers.push_back({std::string(f.name_string()), std::string(f.value())});
  r.body = std::move(req.body());
  state_ = state::processing;
  stream_.expires_never();
  ++request_;
  watch_for_hangup();
  auto channel = std::make_shared<request_channel>(shared_from_this(), request_);
  asio::post(s_.pool, [h = &s_.handle, r = std::move(r), channel = std::move(channel)]() mutable {
    (*h)(std::move(r), std::move(channel));
  });
}

}  // namespace detail

class server {
 public:
  // Binds and listens (a std::exception such as boost::system::system_error if the address is
  // taken); port 0 picks a free one.
  server(server_options options, handler h)
      : options_(std::move(options)),
        handle_(std::move(h)),
        pool_(options_.handler_threads == 0 ? 1 : options_.handler_threads),
        acceptor_(io_),
        retry_(io_) {
    const tcp::endpoint at(asio::ip::make_address(options_.host), options_.port);
    acceptor_.open(at.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(at);
    acceptor_.listen(asio::socket_base::max_listen_connections);
  }

  [[nodiscard]] tcp::endpoint endpoint() const { return acceptor_.local_endpoint(); }
  [[nodiscard]] asio::io_context& io() noexcept { return io_; }
  [[nodiscard]] std::size_t open_connections() const noexcept { return open_.load(); }

  // Serves until stop(), every request has been answered and every connection has closed.
  void run() {
    accept();
    io_.run();
    pool_.join();
  }

  // From any thread: stops accepting and closes idle connections; those with a request in flight
  // close once they have answered. The port is released at once.
  void stop() {
    asio::post(io_, [this] {
      stopping_ = true;
      beast::error_code ignored;
      acceptor_.close(ignored);
      retry_.cancel();
      for (auto& weak : connections_)
        if (auto c = weak.lock()) c->close_if_idle();
      connections_.clear();
    });
  }

 private:
  void accept() {
    acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (stopping_) {
        beast::error_code ignored;
        socket.close(ignored);
        return;
      }
      if (ec) {
        // Out of file descriptors, say: the listening socket stays readable, so wait a little
        // (serving the connections that are open) rather than spin.
        retry_.expires_after(std::chrono::milliseconds(100));
        retry_.async_wait([this](beast::error_code e) {
          if (!e && !stopping_) accept();
        });
        return;
      }
      auto c = std::make_shared<detail::connection>(
          std::move(socket), detail::shared_state{io_, pool_, options_, handle_, open_, stopping_});
      if (open_ > options_.max_connections) {
        c->refuse(503, detail::error_json(
                           503, "too many connections (at most " + std::to_string(options_.max_connections) + ")",
                           "unavailable_error"));
      } else {
        std::erase_if(connections_, [](const auto& w) { return w.expired(); });
        connections_.push_back(c);
        c->start();
      }
      accept();
    });
  }

  server_options options_;
  handler handle_;
  // Before the I/O context: connections that its destructor destroys still count themselves out.
  std::atomic<std::size_t> open_{0};
  std::atomic<bool> stopping_{false};
  asio::io_context io_{1};
  asio::thread_pool pool_;
  tcp::acceptor acceptor_;
  asio::steady_timer retry_;
  std::vector<std::weak_ptr<detail::connection>> connections_;  // touched on the I/O thread only
};

}  // namespace efim_examples::http
