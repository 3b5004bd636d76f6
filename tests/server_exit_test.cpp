// The server layer at process exit: exit() runs the static destructors while the service's handler
// and engine threads go on (libFuzzer exits so, and so do a runtime's fatal paths and test harnesses):
// nothing those threads read may be among them.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/core/gguf.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/server/service.hpp"
#include "efim/text/bpe_tokenizer.hpp"
#include "efim/text/fragment.hpp"
#include "small_model.hpp"

namespace {

using bpe_pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                            efim::text::at_boundaries, efim::kernels::host, efim::text::bpe_tokenizer>;

// A byte-level BPE vocabulary made here: the 256 byte tokens, no merges, Qwen2's pre-tokenizer (its
// splitter reads the code points' class table) and Qwen2.5-Coder's FIM tokens: as many ids as the
// small model's byte-level vocabulary.
efim::text::bpe_tokenizer byte_level_bpe() {
  std::vector<std::string> tokens;
  std::vector<std::int64_t> types;
  for (const char32_t cp : efim::text::byte_level::to_code_point()) {  // all below U+0800: one or two bytes
    tokens.push_back(cp < 0x80 ? std::string(1, static_cast<char>(cp))
                               : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))});
    types.push_back(1);
  }
  for (auto& t : efim::prompt::qwen25_coder.special_tokens()) {
    tokens.push_back(std::move(t));
    types.push_back(3);
  }
  std::map<std::string, efim::gguf::value, std::less<>> meta;
  meta.emplace("tokenizer.ggml.model", efim::gguf::make_string("gpt2"));
  meta.emplace("tokenizer.ggml.pre", efim::gguf::make_string("qwen2"));
  meta.emplace("tokenizer.ggml.tokens", efim::gguf::make_strings(std::move(tokens)));
  meta.emplace("tokenizer.ggml.token_type", efim::gguf::make_i32s(std::move(types)));
  meta.emplace("tokenizer.ggml.merges", efim::gguf::make_strings({}));
  return efim::text::load_bpe_gguf(efim::gguf::parse(efim::gguf::serialize(meta, {})));
}

// Knows when the answer is complete, nothing else.
class answer_flag : public efim::server::response_channel {
 public:
  void respond(efim::server::http_response) override { set(); }
  void begin_stream(int, std::string) override {}
  void stream(std::string) override {}
  void end_stream() override { set(); }
  void on_disconnect(std::function<void()>) override {}
  bool done() {
    std::lock_guard lock(mutex_);
    return done_;
  }

 private:
  void set() {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  std::mutex mutex_;
  bool done_ = false;
};

}  // namespace

TEST_CASE("server: a process that exits while its service works exits clean", "[server][exit]") {
  // Under the sanitizers a read of freed memory makes the child's exit status nonzero; everywhere a
  // hang or a crash at exit does.
  const auto tok = byte_level_bpe();
  REQUIRE(tok.vocab_size() == efim_test::qwen_tokenizer().vocab_size());
  // Letters, digits, punctuation and spaces of several scripts: every class the pre-tokenizer asks.
  std::string doc;
  for (int i = 0; i < 50; ++i) doc += "def f\xC3\xA9(x_1):\n    return \xE4\xB8\xAD\xE6\x96\x87 + 42 # \xD0\xBF\xD1\x80\xD0\xB8\n";
  const std::string infill = efim::server::json{{"input_prefix", doc.substr(0, 200)},
                                                {"input_suffix", doc.substr(200, 100)},
                                                {"n_predict", 4}}
                                 .dump();
  const std::string tokenize = efim::server::json{{"content", doc}}.dump();
  for (const int ms : {0, 3, 15, 60}) {
    std::fflush(nullptr);  // the child's exit flushes its copy of the buffers
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(SIGABRT, SIG_DFL);
      alarm(60);
      // Never destroyed: the process exits while they work.
      auto* weights = new efim::model::weights(efim_test::small_weights());
      auto* p = new bpe_pipeline(tok, *weights, efim_test::small_options(512, true, 128));
      auto* svc = new efim::server::service<bpe_pipeline>(*p, {});
      for (int t = 0; t < 3; ++t)
        std::thread([svc, target = std::string(t == 0 ? "/infill" : "/tokenize"), body = t == 0 ? infill : tokenize] {
          for (;;) {
            auto ch = std::make_shared<answer_flag>();
            svc->handle({"POST", target, {}, body}, ch);
            while (!ch->done()) std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
        }).detach();
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      std::exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    INFO("exit after " << ms << " ms");
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
