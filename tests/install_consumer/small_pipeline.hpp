#pragma once
// What the consumer programs that run a pipeline share: the byte-level tokenizer with Qwen2.5-Coder's
// FIM tokens, a small random-weight model, one infill request. The backend's header comes first
// (efim/kernels/host.hpp, or efim/cuda.cuh for the CUDA one).
#include <cstddef>
#include <efim/cache/block_hash.hpp>
#include <efim/cache/eviction.hpp>
#include <efim/engine/pipeline.hpp>
#include <efim/model/gguf_model.hpp>
#include <efim/prompt/formats.hpp>
#include <efim/text/byte_tokenizer.hpp>
#include <efim/text/fragment.hpp>

template <class Backend>
using small_pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain,
                                              efim::cache::lru, efim::text::at_boundaries, Backend>;

inline efim::text::byte_tokenizer small_tokenizer() {
  return efim::text::byte_tokenizer(efim::prompt::qwen25_coder.special_tokens());
}

inline efim::model::weights small_weights() {
  efim::model::config cfg;
  cfg.vocab = small_tokenizer().vocab_size();
  cfg.hidden = 64;
  cfg.layers = 2;
  return efim::model::random_weights(cfg, 7);
}

// Runs one infill request for 4 tokens; how many it generated.
template <class Pipeline>
std::size_t generate_four(Pipeline& p) {
  efim::engine::request r;
  r.prefix = "int main() {\n  return ";
  r.suffix = ";\n}\n";
  r.max_tokens = 4;
  r.ignore_eos = true;
  std::size_t generated = 0;
  p.submit(r, {{}, [&](efim::engine::completion&& c) { generated = c.tokens.size(); }});
  p.run();
  return generated;
}
