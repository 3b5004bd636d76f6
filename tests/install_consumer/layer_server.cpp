// efim::server alone: the HTTP handlers over a pipeline, answering /health through a channel of the
// program's own (the service knows no HTTP library).
#include <cstdio>
#include <efim/kernels/host.hpp>
#include <efim/server/service.hpp>
#include <future>
#include <memory>

#include "small_pipeline.hpp"

namespace {
class answer : public efim::server::response_channel {
 public:
  void respond(efim::server::http_response r) override { status_.set_value(r.status); }
  void begin_stream(int status, std::string) override { status_.set_value(status); }
  void stream(std::string) override {}
  void end_stream() override {}
  void on_disconnect(std::function<void()>) override {}
  std::future<int> status() { return status_.get_future(); }

 private:
  std::promise<int> status_;
};
}  // namespace

int main() {
  const auto weights = small_weights();
  small_pipeline<efim::kernels::host> p(small_tokenizer(), weights, {.threads = 1});
  efim::server::service<small_pipeline<efim::kernels::host>> svc(p, {});
  auto ch = std::make_shared<answer>();
  auto status = ch->status();
  svc.handle({"GET", "/health", {}, ""}, ch);
  const int s = status.get();
  std::printf("server: /health answered %d\n", s);
  return s == 200 ? 0 : 1;
}
