// efim::engine alone: one infill request through an assembled pipeline.
#include <cstdio>
#include <efim/cache/block_hash.hpp>
#include <efim/cache/eviction.hpp>
#include <efim/engine/pipeline.hpp>
#include <efim/kernels/host.hpp>
#include <efim/model/gguf_model.hpp>
#include <efim/prompt/formats.hpp>
#include <efim/text/byte_tokenizer.hpp>
#include <efim/text/fragment.hpp>

int main() {
  using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                          efim::text::at_boundaries, efim::kernels::host>;
  efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
  efim::model::config cfg;
  cfg.vocab = tok.vocab_size();
  cfg.hidden = 64;
  cfg.layers = 2;
  const auto weights = efim::model::random_weights(cfg, 7);
  pipeline p(tok, weights, {.cache = {.block_size = 16, .blocks = 64}, .threads = 1});
  efim::engine::request r;
  r.prefix = "int main() {\n  return ";
  r.suffix = ";\n}\n";
  r.max_tokens = 4;
  r.ignore_eos = true;
  std::size_t generated = 0;
  p.submit(r, {{}, [&](efim::engine::completion&& c) { generated = c.tokens.size(); }});
  p.run();
  std::printf("engine: generated %zu tokens\n", generated);
  return generated == 4 ? 0 : 1;
}
