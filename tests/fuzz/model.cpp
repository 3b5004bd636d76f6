// libFuzzer target: a model file loaded and run. Any bytes give efim::error or weights that a forward
// pass of a few tokens runs on (KV of two 4-token blocks), with logits for the model's vocabulary.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.hpp"
#include "efim/core/error.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kv/host_storage.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/model/transformer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace efim;
  static thread_pool pool(1);
  static kernels::host::context ctx{pool};
  try {
    const auto file = model::open_model(
        std::vector<std::byte>(efim_fuzz::bytes(data, size).begin(), efim_fuzz::bytes(data, size).end()));
    const auto w = file.bind();
    model::transformer<kernels::host> m(w);
    kv::host_storage kv(w.cfg.layers, m.kv_layout(2, 4));
    std::vector<token_id> tokens;
    for (token_id t : {1, 2, 3, 39}) tokens.push_back(static_cast<token_id>(static_cast<std::size_t>(t) % w.cfg.vocab));
    const std::vector<block_id> table{0, 1};
    const model::batch_item item{tokens, 0, table, true};
    std::vector<float> logits;
    m.forward(ctx, kv, std::span(&item, 1), logits);
    efim_fuzz::check(logits.size() == w.cfg.vocab, "the logits are not one row of the vocabulary");
  } catch (const efim::error&) {
  }
  return 0;
}
