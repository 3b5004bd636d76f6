#pragma once
// The Llama-family decoder (llama, qwen2, starcoder2) over paged KV. One forward pass computes a batch of
// chunks from several sequences: their rows share the matrix products; each token attends to its own
// sequence through that sequence's block table. Weights are read in the type they are stored in.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "efim/core/aligned.hpp"
#include "efim/core/config.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/kernels/gelu.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kernels/interleave.hpp"
#include "efim/kernels/layernorm.hpp"
#include "efim/model/batch.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

template <>
class transformer<kernels::host> {
 public:
  using storage = kernels::host::storage;

  // `products`: how the matrix products multiply (kernels::products; int8 changes the logits within
  // the rounding of the activations to 8 bits, and the KV they leave). With `layout` interleaved8 (the
  // default), matrices are read from copies of them with 8 rows interleaved (kernels/interleave.hpp),
  // made here: with int8 products the q8_0, q4_0, q4_k, q5_k and q6_k ones (decode in fewer
  // instructions: on an Intel Xeon 1.1-1.8x the speed of the rows as stored), and where
  // kernels::interleave_floats_by_default() (the AVX-512 path, not on AMD CPUs) the f16 and bf16 ones
  // (decode in one sequential read). The same bits, at the cost of those matrices' bytes in memory of
  // the process's own beside the file's (which are then not read again).
  explicit transformer(const weights& w, kernels::products products = kernels::products::exact,
                       kernels::weight_layout layout = kernels::weight_layout::interleaved8)
      : w_(&w), products_(products) {
    validate(w.cfg);
    if (layout == kernels::weight_layout::interleaved8)
      interleave(w, products == kernels::products::int8, kernels::interleave_floats_by_default());
  }

  [[nodiscard]] const config& cfg() const noexcept { return w_->cfg; }
  // How many of the model's matrices it reads from interleaved copies of its own (the constructor).
  [[nodiscard]] std::size_t interleaved_matrices() const noexcept {
    return interleaved_ == nullptr ? 0 : interleaved_->held.size();
  }
  [[nodiscard]] kernels::products products() const noexcept { return products_; }

  // The KV layout this model needs for `blocks` blocks of `block_size` tokens.
  [[nodiscard]] kv::paged_layout kv_layout(std::size_t blocks, std::size_t block_size) const noexcept {
    return {blocks, cfg().kv_heads, block_size, cfg().head_dim()};
  }

  // Bytes of scratch a batch of `tokens` rows needs, logits included (the transformer holds it).
  [[nodiscard]] std::size_t workspace_bytes(std::size_t tokens) const noexcept {
    const config& c = cfg();
    const std::size_t per_token = 3 * c.hidden + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.ffn + c.head_dim();
    return (tokens * per_token + tokens * c.vocab) * sizeof(float);
  }

  // Computes the batch: writes each token's K/V into `kv` and returns one row of logits
  // (vocab floats) per item that wants them, in item order.
  void forward(kernels::host::context& ctx, storage& kv, std::span<const batch_item> items,
               std::vector<float>& logits) {
    const config& c = cfg();
    const auto [n, n_logits] = check_batch(c, kv.layers(), kv.layout(), items);
    resize(n);
    logits.resize(n_logits * c.vocab);
    if (n == 0) return;

    // Embeddings, slots and rotary angles for every row.
    const std::size_t embd_row = row_bytes(w_->token_embd.type, c.hidden);
    std::size_t row = 0;
    for (const auto& it : items)
      for (std::size_t i = 0; i < it.tokens.size(); ++i, ++row) {
        dequantize_row(w_->token_embd.type, w_->token_embd.data + static_cast<std::size_t>(it.tokens[i]) * embd_row,
                       x_.data() + row * c.hidden, c.hidden);
        positions_[row] = it.start + static_cast<position>(i);
        slots_[row] = {it.table, positions_[row]};
      }
    const std::size_t hd = c.head_dim();
    kernels::rope_table(positions_, hd, c.rope_theta, cos_.data(), sin_.data(), c.rope_scale);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

    for (std::size_t l = 0; l < c.layers; ++l) {
      const layer_weights& lw = w_->layers[l];
      norm(x_.data(), lw.attn_norm, lw.attn_norm_b, xb_.data(), n);
      linear(ctx, xb_.data(), lw.wq, lw.bq, q_.data(), n);
      linear(ctx, xb_.data(), lw.wk, lw.bk, k_.data(), n);
      linear(ctx, xb_.data(), lw.wv, lw.bv, v_.data(), n);
      kernels::rope(q_.data(), n, c.heads, hd, cos_.data(), sin_.data(), c.rope);
      kernels::rope(k_.data(), n, c.kv_heads, hd, cos_.data(), sin_.data(), c.rope);
      if (kv.type() == dtype::f16)
        attend<half>(ctx, kv, l, scale);
      else
        attend<float>(ctx, kv, l, scale);
      residual(ctx, att_.data(), lw.wo, lw.bo, n);

      norm(x_.data(), lw.ffn_norm, lw.ffn_norm_b, xb_.data(), n);
      if (c.mlp == mlp_kind::swiglu) {
        linear(ctx, xb_.data(), lw.w_gate, {}, gate_.data(), n);
        linear(ctx, xb_.data(), lw.w_up, lw.b_up, up_.data(), n);
        elementwise(ctx, n * c.ffn, [&](std::size_t i, std::size_t k) {
          kernels::swiglu(gate_.data() + i, up_.data() + i, gate_.data() + i, k);
        });
      } else {
        linear(ctx, xb_.data(), lw.w_up, lw.b_up, gate_.data(), n);
        elementwise(ctx, n * c.ffn,
                    [&](std::size_t i, std::size_t k) { kernels::gelu(gate_.data() + i, gate_.data() + i, k); });
      }
      residual(ctx, gate_.data(), lw.w_down, lw.b_down, n);
    }

    // Final norm and output projection for the last row of each item that wants logits.
    std::size_t out_row = 0;
    row = 0;
    for (const auto& it : items) {
      row += it.tokens.size();
      if (!it.want_logits || it.tokens.empty()) continue;
      norm(x_.data() + (row - 1) * c.hidden, w_->output_norm, w_->output_norm_b, xb_.data() + out_row * c.hidden, 1);
      ++out_row;
    }
    if (n_logits > 0) linear(ctx, xb_.data(), w_->output, w_->output_b, logits.data(), n_logits);
  }

 private:
  void norm(const float* x, vector weight, vector bias, float* y, std::size_t rows) const {
    const config& c = cfg();
    if (c.norm == norm_kind::rms)
      kernels::rmsnorm(x, weight.data(), y, rows, c.hidden, c.norm_eps);
    else
      kernels::layernorm(x, weight.data(), bias.data(), y, rows, c.hidden, c.norm_eps);
  }

  // y (rows, w.rows) = x w^T + bias.
  void linear(kernels::host::context& ctx, const float* x, const matrix& w, vector bias, float* y,
              std::size_t rows) const {
    kernels::matmul(ctx.pool, x, w, y, rows, kernels::accumulate::no, products_);
    if (!bias.empty()) add_bias(y, bias, rows);
  }

  // x += h w^T + bias, the residual stream.
  void residual(kernels::host::context& ctx, const float* h, const matrix& w, vector bias, std::size_t rows) {
    if (bias.empty()) {
      kernels::matmul(ctx.pool, h, w, x_.data(), rows, kernels::accumulate::yes, products_);
      return;
    }
    kernels::matmul(ctx.pool, h, w, branch_.data(), rows, kernels::accumulate::no, products_);
    add_bias(branch_.data(), bias, rows);
    for (std::size_t i = 0; i < rows * w.rows; ++i) x_[i] += branch_[i];
  }

  // fn(i, k) on elements [i, i + k) of n, in pieces over the pool: an element-wise kernel gives each
  // element the same value whatever piece it is in.
  template <class F>
  static void elementwise(kernels::host::context& ctx, std::size_t n, F&& fn) {
    constexpr std::size_t piece = 4096;
    ctx.pool.parallel_for((n + piece - 1) / piece, [&](std::size_t b, std::size_t e) {
      fn(b * piece, std::min(e * piece, n) - b * piece);
    });
  }

  static void add_bias(float* y, vector bias, std::size_t rows) noexcept {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < bias.size(); ++j) y[r * bias.size() + j] += bias[j];
  }

  template <class E>
  void attend(kernels::host::context& ctx, storage& kv, std::size_t layer, float scale) {
    kernels::kv_write(kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), k_.data(), v_.data(), slots_);
    kernels::paged_attention(ctx.pool, kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), q_.data(), att_.data(),
                             slots_, cfg().heads, scale);
  }

  void resize(std::size_t n) {
    const config& c = cfg();
    x_.resize(n * c.hidden);
    xb_.resize(n * c.hidden);
    branch_.resize(n * c.hidden);
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

  // The interleaved copies: w_ then points at `w`, a copy of the weights whose interleavable matrices
  // are views of `held` (on the heap, so that a moved transformer's w_ stays valid; shared by copies).
  struct interleaved {
    weights w;
    std::vector<kernels::interleaved_matrix> held;
  };

  void interleave(const weights& w, bool quantized, bool floats) {
    auto own = std::make_shared<interleaved>();
    own->w = w;
    std::vector<matrix*> all = decode_matrices(own->w);
    std::erase_if(all, [&](const matrix* m) {
      return m->data == nullptr || !kernels::interleaved_by_model(m->type, m->rows, m->cols, quantized, floats);
    });
    if (all.empty()) return;
    own->held.reserve(all.size());  // (a view's bytes move with its matrix anyway)
    for (matrix* m : all) {
      own->held.emplace_back(*m);
      *m = own->held.back().view();
    }
    interleaved_ = std::move(own);
    w_ = &interleaved_->w;
  }

  const weights* w_;
  std::shared_ptr<const interleaved> interleaved_;
  kernels::products products_;
  // Cache-line aligned: the matrix products read these rows with vector loads.
  aligned_vector<float> x_, xb_, branch_;  // (tokens, hidden): residual stream, normed input, a biased branch
  aligned_vector<float> q_, att_;          // (tokens, heads, head_dim)
  aligned_vector<float> k_, v_;            // (tokens, kv_heads, head_dim)
  aligned_vector<float> gate_, up_;        // (tokens, ffn)
  std::vector<float> cos_, sin_;           // (tokens, head_dim / 2)
  std::vector<position> positions_;
  std::vector<kernels::token_slot> slots_;
};

}  // namespace efim::model
