// libFuzzer target: encode and decode with three real vocabularies (the first byte picks one: Qwen2.5-
// Coder's tokenizer.json, which normalizes to NFC; StarCoder's and DeepSeek-Coder's GGUF files; the
// second picks plain text or text whose added tokens' text stands for them). Text that is not UTF-8
// gives efim::error (errc::invalid_utf8); any other gives ids in the vocabulary whose bytes are the
// text (its NFC form where the tokenizer normalizes, less the bytes it has no token for).
#include <cstdint>
#include <vector>

#include "common.hpp"
#include "efim/core/error.hpp"
#include "efim/core/utf8.hpp"

namespace {
const std::vector<efim::text::bpe_tokenizer>& tokenizers() {
  static const std::vector<efim::text::bpe_tokenizer> all = [] {
    std::vector<efim::text::bpe_tokenizer> v;
    const auto json = std::filesystem::path(EFIM_TOKENIZER_CACHE) / "qwen2.5-coder" / "tokenizer.json";
    v.push_back(efim::text::load_bpe(
        std::filesystem::exists(json) ? json.string() : efim_fuzz::vocab_path("ggml-vocab-qwen2.5-coder.gguf")));
    v.push_back(efim::text::load_bpe(efim_fuzz::vocab_path("ggml-vocab-starcoder.gguf")));
    v.push_back(efim::text::load_bpe(efim_fuzz::vocab_path("ggml-vocab-deepseek-coder.gguf")));
    return v;
  }();
  return all;
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace efim;
  if (size < 2) return 0;
  const auto& tok = tokenizers()[data[0] % 3];
  const bool special = (data[1] & 1) != 0;
  const std::string_view s = efim_fuzz::text(data + 2, size - 2);
  std::vector<token_id> ids;
  try {
    special ? tok.encode_special(s, ids) : tok.encode(s, ids);
  } catch (const efim::error& e) {
    efim_fuzz::check(e.code() == errc::invalid_utf8 && !utf8::is_valid(s), "valid text refused");
    return 0;
  }
  efim_fuzz::check(utf8::is_valid(s), "text that is not UTF-8 was tokenized");
  std::string back;
  for (const token_id id : ids) {
    efim_fuzz::check(id >= 0 && static_cast<std::size_t>(id) < tok.vocab_size(), "an id outside the vocabulary");
    back += tok.token_bytes(id);
  }
  const std::string want = efim_fuzz::expected_text(tok, s);
  efim_fuzz::check(back == want || (tok.normalizes() && text::nfc(back) == want), "the ids do not spell the text");
  return 0;
}
