#pragma once
// The embedded default model of the example programs: a random-weight Qwen2-architecture model made
// in memory by the same maker as `efim-model make`, with the tokenizer's vocabulary in its metadata
// (Qwen's padded to the 151,936 embedding rows its models have).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "efim/efim.hpp"
#include "efim/model/vocabulary.hpp"

namespace efim_examples {

// Its shape: small enough to answer an editor at keystroke speed on a laptop core.
inline efim::model::config default_model_config() {
  auto c = efim::model::for_architecture(efim::model::architecture::qwen2);
  c.hidden = 128;
  c.layers = 4;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 384;
  c.max_context = 32768;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6f;
  return c;
}

// The GGUF bytes of a random-weight model of shape `cfg` whose vocabulary is the tokenizer file at
// `tokenizer` (a tokenizer.json or .gguf), or `vocab` tokens of nothing when it is empty.
inline std::vector<std::byte> random_model_file(efim::model::config cfg, const std::string& tokenizer,
                                                std::size_t vocab, std::uint64_t seed, efim::dtype weights,
                                                std::size_t threads) {
  efim::model::metadata meta;
  if (!tokenizer.empty()) {
    meta = efim::model::vocabulary_metadata(tokenizer);
    cfg.vocab = efim::model::vocabulary_size(meta);
  } else {
    cfg.vocab = vocab;
  }
  return efim::model::random_model(cfg, seed, {weights}, meta, threads);
}

}  // namespace efim_examples
