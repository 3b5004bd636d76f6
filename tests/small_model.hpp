#pragma once
// The small random-weight model the engine and server suites run on: 2 layers of 64, the byte-level
// tokenizer with Qwen2.5-Coder's FIM tokens, a pipeline of 16-token blocks.
#include <cstdint>
#include <string_view>
#include <utility>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/core/gguf.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/host.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/text/fragment.hpp"

namespace efim_test {

using efim_pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain, efim::cache::lru,
                                             efim::text::at_boundaries, efim::kernels::host>;

inline efim::text::byte_tokenizer qwen_tokenizer() {
  return efim::text::byte_tokenizer(efim::prompt::qwen25_coder.special_tokens());
}

inline efim::model::config small_config() {
  efim::model::config c;
  c.vocab = qwen_tokenizer().vocab_size();
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 128;
  c.max_context = 1024;
  return c;
}

inline efim::model::weights small_weights(std::uint64_t seed = 21) {
  return efim::model::random_weights(small_config(), seed);
}

inline efim::engine::pipeline_options small_options(std::size_t blocks = 256, bool reuse = true,
                                                    std::size_t batch_tokens = 64) {
  efim::engine::pipeline_options o;
  o.cache.block_size = 16;
  o.cache.blocks = blocks;
  o.cache.reuse = reuse;
  o.schedule.max_batch_tokens = batch_tokens;
  o.threads = 2;
  return o;
}

// The small model (f32, seed 21) after `edit(name, values)` changed some of its tensors in place.
template <class Edit>
efim::model::weights edited_weights(Edit&& edit) {
  const auto cfg = small_config();
  auto bytes = efim::model::random_model(cfg, 21);
  const auto f = efim::gguf::parse(bytes);
  for (const auto& t : f.tensors)
    edit(std::string_view(t.name), reinterpret_cast<float*>(bytes.data() + f.data_offset + t.offset));
  return efim::model::open_model(std::move(bytes)).bind(cfg);
}

}  // namespace efim_test
