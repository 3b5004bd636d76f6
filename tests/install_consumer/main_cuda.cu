// Uses the installed library's CUDA backend: one infill request through a pipeline on the GPU.
#include <cstdio>
#include <efim/cuda.cuh>  // before the pipeline: the CUDA decoder
#include <efim/cache/block_hash.hpp>
#include <efim/cache/eviction.hpp>
#include <efim/engine/pipeline.hpp>
#include <efim/model/gguf_model.hpp>
#include <efim/prompt/formats.hpp>
#include <efim/text/fragment.hpp>
#include <efim/version.hpp>

int main() {
  if (!efim::device::available()) {
    std::printf("efim %s (CUDA): built against efim::cuda; no CUDA device here, so nothing ran\n",
                EFIM_VERSION_STRING);
    return 0;
  }
  using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                          efim::text::at_boundaries, efim::kernels::cuda>;
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
  std::printf("efim %s (CUDA on %s): generated %zu tokens\n", EFIM_VERSION_STRING,
              efim::device::device_name().c_str(), generated);
  return generated == 4 ? 0 : 1;
}
