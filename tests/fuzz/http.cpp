// libFuzzer target: the HTTP transport (Boost.Beast, examples/http/server.hpp) over loopback, in front
// of the fuzzed service. The input is sent as it is on a new connection, then a well-formed request
// that asks the server to close (the input's own requests answered first, or the input refused); the
// server answers in HTTP/1.1 and closes within 10 s (1 s of idle time allowed for an input that leaves
// a request unfinished), its first answer never a 5xx (nothing a client sends is the server's fault);
// and a well-formed request on a new connection is answered 200 (every 32 inputs). (The writing side
// is not closed first: the server takes a client that closes as gone, and cancels its request.)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "../../examples/http/server.hpp"
#include "serving.hpp"

namespace {

std::uint16_t port() {
  static const std::uint16_t p = [] {
    efim_examples::http::server_options o;
    o.port = 0;
    o.idle_timeout = std::chrono::seconds(1);
    auto* http = new efim_examples::http::server(
        o, [](efim::server::http_request r, std::shared_ptr<efim::server::response_channel> ch) {
          efim_fuzz::server().svc.handle(std::move(r), std::move(ch));
        });
    std::thread([http] { http->run(); }).detach();
    return http->endpoint().port();
  }();
  return p;
}

// Sends `bytes` and reads what comes back until the server closes (a fault after 10 s).
std::string exchange(std::string_view bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) efim_fuzz::fault("socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port());
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) efim_fuzz::fault("cannot connect to the server");
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server closed early (a request it refused): fine
    sent += static_cast<std::size_t>(n);
  }
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) efim_fuzz::fault("the server neither answered nor closed in 10 s");
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  close(fd);
  return got;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)port();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string got = exchange(std::string(efim_fuzz::text(data, size)) +
                                   "GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n");
  if (!got.empty() && !got.starts_with("HTTP/1.1 "))
    efim_fuzz::fault("an answer that is not HTTP/1.1: " + got.substr(0, 80));
  if (got.starts_with("HTTP/1.1 5")) efim_fuzz::fault("a 5xx answer: " + got.substr(0, 200));
  static unsigned n = 0;
  if (++n % 32 == 0) {
    const std::string health = exchange("GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n");
    if (!health.starts_with("HTTP/1.1 200")) efim_fuzz::fault("/health after the input: " + health.substr(0, 80));
  }
  return 0;
}
