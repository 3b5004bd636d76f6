// Uses the installed library: one infill request through an assembled pipeline.
#include <cstdio>
#include <efim/efim.hpp>

int main() {
  using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                          efim::text::at_boundaries, efim::kernels::host>;
  efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
  efim::model::config cfg;
  cfg.vocab = tok.vocab_size();
  cfg.hidden = 64;
  cfg.layers = 2;
  const auto weights = efim::model::random_weights(cfg, 7);
  pipeline p(tok, weights, {.cache = {.block_size = 16, .blocks = 64}});
  efim::engine::request r;
  r.prefix = "int main() {\n  return ";
  r.suffix = ";\n}\n";
  r.max_tokens = 4;
  std::size_t generated = 0;
  p.submit(r, {{}, [&](efim::engine::completion&& c) { generated = c.tokens.size(); }});
  p.run();
  std::printf("efim %s: generated %zu tokens\n", EFIM_VERSION_STRING, generated);
  return generated == 4 ? 0 : 1;
}
