// Helpers of the server suite's exit test (server_test.cpp): threads that tokenize with a byte-level
// BPE vocabulary until the process exits. Compiled apart: efim's JSON reader and the server's json
// alias do not meet in one file.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "efim/core/gguf.hpp"
#include "efim/core/utf8.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/text/bpe_tokenizer.hpp"

namespace {
// A byte-level BPE vocabulary made here: the 256 byte tokens, no merges, Qwen2's pre-tokenizer and
// Qwen2.5-Coder's FIM tokens.
efim::text::bpe_tokenizer byte_level_bpe() {
  std::vector<std::string> tokens;
  std::vector<std::int64_t> types;
  for (const char32_t cp : efim::text::byte_level::to_code_point()) {
    efim::utf8::append(cp, tokens.emplace_back());
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

}  // namespace

namespace efim_test {

// Starts `threads` threads that encode `text` with that vocabulary (Qwen2's splitter reads the code
// points' class table; its NFC check asks ICU) over and over, never to stop.
void tokenize_forever(int threads, const std::string& text) {
  const auto* tok = new efim::text::bpe_tokenizer(byte_level_bpe());  // never destroyed: exit() ends them
  for (int t = 0; t < threads; ++t)
    std::thread([tok, text] {
      std::vector<efim::token_id> ids;
      for (;;) {
        ids.clear();
        tok->encode(text, ids);
      }
    }).detach();
}

}  // namespace efim_test
