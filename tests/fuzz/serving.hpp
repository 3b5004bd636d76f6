#pragma once
// The server the handler and transport targets fuzz: efim::server::service over a real pipeline with
// DeepSeek-Coder's vocabulary (32,256 tokens, its FIM tokens) and a small random model over it, at
// most 8 new tokens a request, so that each input is answered in milliseconds.
#include <cstdint>
#include <memory>

#include "common.hpp"
#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/server/service.hpp"
#include "efim/text/fragment.hpp"

namespace efim_fuzz {

using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                        efim::text::at_boundaries, efim::kernels::host, efim::text::bpe_tokenizer>;

struct serving {
  efim::text::bpe_tokenizer tok = efim::text::load_bpe(vocab_path("ggml-vocab-deepseek-coder.gguf"));
  efim::model::weights weights = efim::model::random_weights(config(tok), 3);
  pipeline p{tok, weights, options(tok)};
  efim::server::service<pipeline> svc{p, service_options()};

  static efim::model::config config(const efim::text::bpe_tokenizer& t) {
    efim::model::config c = efim::model::for_architecture(efim::model::architecture::llama);
    c.vocab = t.vocab_size();
    c.hidden = 32;
    c.layers = 1;
    c.heads = 2;
    c.kv_heads = 1;
    c.ffn = 64;
    c.max_context = 512;
    return c;
  }
  static efim::engine::pipeline_options options(const efim::text::bpe_tokenizer& t) {
    efim::engine::pipeline_options o;
    const auto* fim = efim::prompt::detect_token_set(t);
    if (fim == nullptr) fault("DeepSeek-Coder's FIM tokens are not detected");
    o.fim = *fim;
    o.cache.block_size = 16;
    o.cache.blocks = 128;
    o.threads = 1;
    return o;
  }
  static efim::server::service_options service_options() {
    efim::server::service_options o;
    o.model_name = "fuzz";
    o.limits.max_new_tokens = 8;
    o.limits.default_infill_tokens = 4;
    return o;
  }
};

// The one server of the run (its threads are left running at exit: libFuzzer exits from anywhere).
inline serving& server() {
  static serving* s = new serving;
  return *s;
}

}  // namespace efim_fuzz
