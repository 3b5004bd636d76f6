// efim::text alone: a byte-level BPE tokenizer from a tokenizer.json (ICU for NFC, Oniguruma for the
// pre-tokenizer's regex).
#include <cstdio>
#include <efim/core/utf8.hpp>
#include <efim/text/bpe_tokenizer.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

int main() {
  nlohmann::json vocab = nlohmann::json::object();
  for (unsigned b = 0; b < 256; ++b) {
    std::string s;
    efim::utf8::append(efim::text::byte_level::to_code_point()[b], s);
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  nlohmann::json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b"}}};
  j["normalizer"] = {{"type", "NFC"}};
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}"}}}, {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}};
  const auto tok = efim::text::load_bpe_json(j.dump());
  std::vector<efim::token_id> ids;
  tok.encode("ab1", ids);
  std::printf("text: %zu ids\n", ids.size());
  return ids == std::vector<efim::token_id>{256, '1'} ? 0 : 1;
}
