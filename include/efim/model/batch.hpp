#pragma once
// One forward pass's input, for every backend's transformer: chunks of several sequences, each with
// its positions and block table, checked against the model and the KV storage before any work.
#include <cstddef>
#include <span>
#include <string>

#include "efim/core/config.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/concepts.hpp"
#include "efim/kv/layout.hpp"
#include "efim/model/config.hpp"

namespace efim::model {

// One sequence's part of a batch: `tokens` at positions start, start + 1, ... Its block table must
// cover every position up to the last one; KV of positions before `start` must already be there.
struct batch_item {
  std::span<const token_id> tokens;
  position start = 0;
  std::span<const block_id> table;
  bool want_logits = true;  // logits for the item's last token
};

struct batch_size {
  std::size_t tokens = 0;  // rows of the pass
  std::size_t logits = 0;  // items that want logits (and have tokens)
};

// Checks a batch against the model's config and a KV storage of `layers` layers in `layout`; throws
// efim::error (too_long, invalid_argument, unknown_token) before any work is done.
inline batch_size check_batch(const config& c, std::size_t layers, const kv::paged_layout& layout,
                              std::span<const batch_item> items) {
  require(layers == c.layers && layout.kv_heads == c.kv_heads && layout.head_dim == c.head_dim(),
          errc::invalid_argument, "model: the KV storage does not have this model's shape");
  batch_size n;
  for (const auto& it : items) {
    if (it.start < 0 || static_cast<std::size_t>(it.start) + it.tokens.size() > c.max_context)
      throw error(errc::too_long, "model: positions past the context of " + std::to_string(c.max_context));
    if (it.table.size() * layout.block_size < static_cast<std::size_t>(it.start) + it.tokens.size())
      throw error(errc::invalid_argument, "model: a block table does not cover its tokens");
    for (const token_id t : it.tokens)
      if (t < 0 || static_cast<std::size_t>(t) >= c.vocab)  // (the message only on failure: per token)
        throw error(errc::unknown_token, "model: token id " + std::to_string(t) + " is outside the vocabulary of " +
                                             std::to_string(c.vocab));
    n.tokens += it.tokens.size();
    n.logits += it.want_logits && !it.tokens.empty();
  }
  return n;
}

// The decoder on backend B: transformer.hpp specializes it for kernels::host, cuda_transformer.cuh
// for kernels::cuda.
template <kernels::backend B>
class transformer {
  static_assert(dependent_false<B>, "efim::model::transformer has no specialization for this backend");
};

}  // namespace efim::model
