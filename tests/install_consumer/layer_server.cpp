// efim::server alone: the HTTP handlers over a pipeline, answering /health through a channel of the
// program's own (the service knows no HTTP library).
#include <cstdio>
#include <efim/cache/block_hash.hpp>
#include <efim/cache/eviction.hpp>
#include <efim/engine/pipeline.hpp>
#include <efim/kernels/host.hpp>
#include <efim/model/gguf_model.hpp>
#include <efim/prompt/formats.hpp>
#include <efim/server/service.hpp>
#include <efim/text/byte_tokenizer.hpp>
#include <efim/text/fragment.hpp>
#include <future>
#include <memory>

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
  using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                          efim::text::at_boundaries, efim::kernels::host>;
  efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
  efim::model::config cfg;
  cfg.vocab = tok.vocab_size();
  cfg.hidden = 64;
  cfg.layers = 2;
  const auto weights = efim::model::random_weights(cfg, 7);
  pipeline p(tok, weights, {.threads = 1});
  efim::server::service<pipeline> svc(p, {});
  auto ch = std::make_shared<answer>();
  auto status = ch->status();
  svc.handle({"GET", "/health", {}, ""}, ch);
  const int s = status.get();
  std::printf("server: /health answered %d\n", s);
  return s == 200 ? 0 : 1;
}
