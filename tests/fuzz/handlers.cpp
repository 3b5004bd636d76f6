// libFuzzer target: the server's handlers, with a real BPE vocabulary and a model that generates. The
// first byte picks an endpoint (and method; some no route has); the rest is the body. Every request
// gets exactly one answer, within a minute; never a 500 (the client's input is never the server's
// fault); a JSON endpoint's answer is JSON; the server keeps answering.
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "serving.hpp"

namespace {

class channel : public efim::server::response_channel {
 public:
  void respond(efim::server::http_response r) override {
    std::lock_guard lock(m_);
    ++answers_;
    status_ = r.status;
    json_ = r.content_type == "application/json";
    body_ = std::move(r.body);
    done_ = true;
    cv_.notify_all();
  }
  void begin_stream(int status, std::string) override {
    std::lock_guard lock(m_);
    ++answers_;
    status_ = status;
  }
  void stream(std::string) override {}
  void end_stream() override {
    std::lock_guard lock(m_);
    done_ = true;
    cv_.notify_all();
  }
  void on_disconnect(std::function<void()>) override {}

  // The status, once answered.
  int wait() {
    std::unique_lock lock(m_);
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return done_; })) efim_fuzz::fault("no answer in 60 s");
    if (answers_ != 1) efim_fuzz::fault("answered " + std::to_string(answers_) + " times");
    if (json_ && !nlohmann::json::accept(body_)) efim_fuzz::fault("an answer that is not JSON: " + body_);
    return status_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int answers_ = 0, status_ = 0;
  bool json_ = false, done_ = false;
  std::string body_;
};

struct route {
  const char* method;
  const char* target;
};
constexpr route routes[] = {{"POST", "/infill"},     {"POST", "/v1/completions"}, {"POST", "/completions"},
                            {"POST", "/tokenize"},   {"POST", "/detokenize"},     {"GET", "/health"},
                            {"GET", "/v1/models"},   {"GET", "/metrics"},         {"GET", "/infill"},
                            {"POST", "/health"},     {"POST", "/nowhere"},        {"DELETE", "/v1/completions"},
                            {"POST", "/infill?x=1"}, {"POST", "/v1/completions/"}};

int ask(const char* method, const char* target, std::string body) {
  auto ch = std::make_shared<channel>();
  efim_fuzz::server().svc.handle({method, target, {}, std::move(body)}, ch);
  return ch->wait();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)efim_fuzz::server();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const route& r = routes[data[0] % std::size(routes)];
  const int status = ask(r.method, r.target, std::string(efim_fuzz::text(data + 1, size - 1)));
  if (status >= 500) efim_fuzz::fault(std::string(r.target) + " answered " + std::to_string(status));
  static unsigned n = 0;
  if (++n % 64 == 0 && ask("GET", "/health", "") != 200) efim_fuzz::fault("the server stopped answering /health");
  return 0;
}
