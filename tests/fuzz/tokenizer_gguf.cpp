// libFuzzer target: the GGUF tokenizer loader (tokenizer.ggml.* metadata). Any bytes give efim::error
// or a tokenizer whose ids for code and Unicode are in its vocabulary.
#include <cstdint>
#include <vector>

#include "common.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace efim;
  try {
    const auto tok = text::load_bpe_gguf(gguf::parse(efim_fuzz::bytes(data, size)));
    std::vector<token_id> ids;
    tok.encode_special("<|fim_prefix|>def f(x):\n    return x + 1  # caf\xC3\xA9 \xE6\x95\xB0\n", ids);
    for (const token_id id : ids) {
      efim_fuzz::check(id >= 0 && static_cast<std::size_t>(id) < tok.vocab_size(), "an id outside the vocabulary");
      (void)tok.token_bytes(id);
    }
  } catch (const efim::error&) {
  }
  return 0;
}
