#pragma once
// The Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV.
// One forward pass computes a batch of chunks from several sequences: their rows share the matrix
// products; each token attends to its own sequence through that sequence's block table.
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "efim/core/config.hpp"
#include "efim/core/error.hpp"
#include "efim/kernels/host.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

// One sequence's part of a batch: `tokens` at positions start, start + 1, ... Its block table must
// cover every position up to the last one; KV of positions before `start` must already be there.
struct batch_item {
  std::span<const token_id> tokens;
  position start = 0;
  std::span<const block_id> table;
  bool want_logits = true;  // logits for the item's last token
};

template <kernels::backend B>
class transformer {
  static_assert(dependent_false<B>, "efim::model::transformer has no specialization for this backend");
};

template <>
class transformer<kernels::host> {
 public:
  using storage = kernels::host::storage;

  explicit transformer(const weights& w) : w_(&w) { validate(w.cfg); }

  [[nodiscard]] const config& cfg() const noexcept { return w_->cfg; }

  // The KV layout this model needs for `blocks` blocks of `block_size` tokens.
  [[nodiscard]] kv::paged_layout kv_layout(std::size_t blocks, std::size_t block_size) const noexcept {
    return {blocks, cfg().kv_heads, block_size, cfg().head_dim()};
  }

  // Bytes of scratch a batch of `tokens` rows needs, logits included (the transformer holds it).
  [[nodiscard]] std::size_t workspace_bytes(std::size_t tokens) const noexcept {
    const config& c = cfg();
    const std::size_t per_token = 2 * c.hidden + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.ffn + c.head_dim();
    return (tokens * per_token + tokens * c.vocab) * sizeof(float);
  }

  // Computes the batch: writes each token's K/V into `kv` and returns one row of logits
  // (vocab floats) per item that wants them, in item order.
  void forward(kernels::host::context& ctx, storage& kv, std::span<const batch_item> items,
               std::vector<float>& logits) {
    const config& c = cfg();
    require(kv.layers() == c.layers && kv.layout().kv_heads == c.kv_heads && kv.layout().head_dim == c.head_dim(),
            errc::invalid_argument, "model: the KV storage does not have this model's shape");
    std::size_t n = 0, n_logits = 0;
    for (const auto& it : items) {
      require(it.start >= 0 && static_cast<std::size_t>(it.start) + it.tokens.size() <= c.max_context, errc::too_long,
              "model: positions past the context of " + std::to_string(c.max_context));
      require(it.table.size() * kv.layout().block_size >= static_cast<std::size_t>(it.start) + it.tokens.size(),
              errc::invalid_argument, "model: a block table does not cover its tokens");
      for (const token_id t : it.tokens)
        require(t >= 0 && static_cast<std::size_t>(t) < c.vocab, errc::unknown_token,
                "model: token id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(c.vocab));
      n += it.tokens.size();
      n_logits += it.want_logits && !it.tokens.empty();
    }
    resize(n);
    logits.resize(n_logits * c.vocab);
    if (n == 0) return;

    // Embeddings, slots and rotary angles for every row.
    std::size_t row = 0;
    for (const auto& it : items)
      for (std::size_t i = 0; i < it.tokens.size(); ++i, ++row) {
        std::copy_n(w_->token_embd.begin() + static_cast<std::ptrdiff_t>(it.tokens[i] * c.hidden), c.hidden,
                    x_.begin() + static_cast<std::ptrdiff_t>(row * c.hidden));
        positions_[row] = it.start + static_cast<position>(i);
        slots_[row] = {it.table, positions_[row]};
      }
    const std::size_t hd = c.head_dim();
    kernels::rope_table(positions_, hd, c.rope_theta, cos_.data(), sin_.data());
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

    for (std::size_t l = 0; l < c.layers; ++l) {
      const layer_weights& lw = w_->layers[l];
      kernels::rmsnorm(x_.data(), lw.attn_norm.data(), xb_.data(), n, c.hidden, c.norm_eps);
      kernels::matmul(ctx.pool, xb_.data(), lw.wq.data(), q_.data(), n, c.q_dim(), c.hidden);
      kernels::matmul(ctx.pool, xb_.data(), lw.wk.data(), k_.data(), n, c.kv_dim(), c.hidden);
      kernels::matmul(ctx.pool, xb_.data(), lw.wv.data(), v_.data(), n, c.kv_dim(), c.hidden);
      kernels::rope(q_.data(), n, c.heads, hd, cos_.data(), sin_.data(), c.rope);
      kernels::rope(k_.data(), n, c.kv_heads, hd, cos_.data(), sin_.data(), c.rope);
      kernels::kv_write(kv.layout(), kv.keys(l), kv.values(l), k_.data(), v_.data(), slots_);
      kernels::paged_attention(ctx.pool, kv.layout(), kv.keys(l), kv.values(l), q_.data(), att_.data(), slots_, c.heads,
                               scale);
      kernels::matmul(ctx.pool, att_.data(), lw.wo.data(), x_.data(), n, c.hidden, c.q_dim(), kernels::accumulate::yes);

      kernels::rmsnorm(x_.data(), lw.ffn_norm.data(), xb_.data(), n, c.hidden, c.norm_eps);
      kernels::matmul(ctx.pool, xb_.data(), lw.w_gate.data(), gate_.data(), n, c.ffn, c.hidden);
      kernels::matmul(ctx.pool, xb_.data(), lw.w_up.data(), up_.data(), n, c.ffn, c.hidden);
      kernels::swiglu(gate_.data(), up_.data(), gate_.data(), n * c.ffn);
      kernels::matmul(ctx.pool, gate_.data(), lw.w_down.data(), x_.data(), n, c.hidden, c.ffn,
                      kernels::accumulate::yes);
    }

    // Final norm and output projection for the last row of each item that wants logits.
    std::size_t out_row = 0;
    row = 0;
    for (const auto& it : items) {
      row += it.tokens.size();
      if (!it.want_logits || it.tokens.empty()) continue;
      kernels::rmsnorm(x_.data() + (row - 1) * c.hidden, w_->output_norm.data(), xb_.data() + out_row * c.hidden, 1,
                       c.hidden, c.norm_eps);
      ++out_row;
    }
    if (n_logits > 0)
      kernels::matmul(ctx.pool, xb_.data(), w_->output.data(), logits.data(), n_logits, c.vocab, c.hidden);
  }

 private:
  void resize(std::size_t n) {
    const config& c = cfg();
    x_.resize(n * c.hidden);
    xb_.resize(n * c.hidden);
    q_.resize(n * c.q_dim());
    att_.resize(n * c.q_dim());
    k_.resize(n * c.kv_dim());
    v_.resize(n * c.kv_dim());
    gate_.resize(n * c.ffn);
    up_.resize(n * c.ffn);
    cos_.resize(n * c.head_dim() / 2);
    sin_.resize(n * c.head_dim() / 2);
    positions_.resize(n);
    slots_.resize(n);
  }

  const weights* w_;
  std::vector<float> x_, xb_;     // (tokens, hidden): residual stream, normed input
  std::vector<float> q_, att_;    // (tokens, heads, head_dim)
  std::vector<float> k_, v_;      // (tokens, kv_heads, head_dim)
  std::vector<float> gate_, up_;  // (tokens, ffn)
  std::vector<float> cos_, sin_;  // (tokens, head_dim / 2)
  std::vector<position> positions_;
  std::vector<kernels::token_slot> slots_;
};

}  // namespace efim::model
