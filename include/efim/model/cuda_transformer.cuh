#pragma once
// The Llama-family decoder on the CUDA backend: the host transformer's computation (transformer.hpp)
// with every tensor in device memory and every op on the context's stream. Per step the host plans
// and uploads only what the step needs: token ids, rotary angles (rope_table, in double on the host
// as the host backend computes them), the block tables of the step's sequences, where each token's
// K/V go, and the attention tiles (kernels::attention_step). Logits of the rows that want them come
// back to host memory, where the pipeline samples them, and the call returns once they are there.
//
// Scratch lives in device buffers that grow to the largest batch seen and are then reused: after the
// first step of a size, a step allocates nothing. A decode step (up to graph_rows tokens) runs as a
// CUDA graph once its shape has been seen: the host still plans and uploads, then one launch replays
// the step's ~10 kernels a layer, which read everything that changes (ids, angles, tables, slots,
// tiles) from those buffers.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <vector>

#include "efim/core/device.cuh"
#include "efim/core/dtype.hpp"
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/cuda/backend.cuh"
#include "efim/kernels/cuda/attention_mma.cuh"
#include "efim/kernels/cuda/graph.cuh"
#include "efim/kernels/rope_table.hpp"
#include "efim/model/batch.hpp"
#include "efim/model/device_weights.cuh"
#include "efim/model/weights.hpp"

namespace efim::model {

template <>
class transformer<kernels::cuda> {
 public:
  using storage = kv::device_storage;
  using attention_policy = kernels::device::policy::attention;

  // Uploads the weights (once; `w` may be released afterwards). `products`: how quantized weights
  // multiply a decode step's rows (kernels::device::matmul): exactly in f32, or in integers against
  // the rows rounded to 8 bits as the host's int8 products round them.
  explicit transformer(const weights& w, kernels::products products = kernels::products::exact)
      : w_(w), products_(products) {
    validate(w.cfg);
  }

  [[nodiscard]] const config& cfg() const noexcept { return w_.cfg; }
  [[nodiscard]] kernels::products products() const noexcept { return products_; }

  // Steps of up to graph_rows tokens (decode steps) run as CUDA graphs, one per step shape
  // (kernels::device::graph_cache: the tokens, the attention plan's tiles and split, the KV storage,
  // the context, the rows that want logits), launched directly the first time a shape is seen,
  // captured the second, replayed after; the same kernels with the same arguments, so the same bits as
  // launching them one by one (set_graphs(false)).
  static constexpr std::size_t graph_rows = 8;
  void set_graphs(bool on) noexcept { use_graphs_ = on; }
  [[nodiscard]] bool graphs() const noexcept { return use_graphs_; }

  // Which prefill steps (more than graph_rows tokens) with f16 KV take their attention on tensor
  // cores, where the layout and the device's shared memory allow (kernels::device::paged_attention_mma:
  // queries and probabilities rounded to f16): none, those whose tiles of 64 rows are at least half
  // full and fill the GPU (the default: the others keep the scalar kernel and its split-K), or all.
  enum class tensor_cores { never, when_filled, always };
  void set_tensor_core_attention(tensor_cores t) noexcept { tensor_cores_ = t; }
  [[nodiscard]] tensor_cores tensor_core_attention() const noexcept { return tensor_cores_; }
  // Which tensor-core kernel those steps take: kernels::device::mma_attention::wmma (the default) or
  // ::staged (mma.sync over K and V staged in shared memory, the output rows in registers; on devices
  // of compute capability 8.0 and up, WMMA elsewhere). Both agree with the host kernel within the f16
  // rounding of queries and probabilities.
  void set_mma_attention(kernels::device::mma_attention k) noexcept { mma_attention_ = k; }
  [[nodiscard]] kernels::device::mma_attention mma_attention() const noexcept { return mma_attention_; }
  // Which attention kernel takes the steps not on tensor cores above (decode steps, small prefill
  // steps, f32 KV): kernels::device::attention_kernel::pages (a block's warps take pages in turn, each
  // through the tile's rows), ::rows (each warp takes rows through the range's keys), or ::staged
  // (f16 KV whose layout paged_attention_mma takes, on compute capability 8.0 and up, else pages: the
  // range's keys staged in shared memory by the block, the products on tensor cores), each with its own
  // split-K plan. pages and rows agree with the host kernel within f32 rounding, staged within the f16
  // rounding of the queries and probabilities; not with each other bit for bit.
  void set_scalar_attention(kernels::device::attention_kernel k) noexcept { scalar_attention_ = k; }
  [[nodiscard]] kernels::device::attention_kernel scalar_attention() const noexcept { return scalar_attention_; }
  // Steps so far of up to graph_rows tokens: launched directly (a shape's first step), captured,
  // replayed; with graphs off, none.
  [[nodiscard]] std::size_t graph_direct() const noexcept { return graphs_.direct(); }
  [[nodiscard]] std::size_t graph_captures() const noexcept { return graphs_.captures(); }
  [[nodiscard]] std::size_t graph_replays() const noexcept { return graphs_.replays(); }
  [[nodiscard]] const device_weights& uploaded() const noexcept { return w_; }

  [[nodiscard]] kv::paged_layout kv_layout(std::size_t blocks, std::size_t block_size) const noexcept {
    return {blocks, cfg().kv_heads, block_size, cfg().head_dim()};
  }

  // Computes the batch on the device: writes each token's K/V into `kv` and returns one row of
  // logits (vocab floats, in host memory) per item that wants them, in item order.
  void forward(kernels::cuda::context& ctx, storage& kv, std::span<const batch_item> items,
               std::vector<float>& logits) {
    const config& c = cfg();
    const auto size = check_batch(c, kv.layers(), kv.layout(), items);
    const std::size_t n = size.tokens, n_logits = size.logits;
    logits.resize(n_logits * c.vocab);
    if (n == 0) return;
    const cudaStream_t s = ctx.stream();

    // The step's host side: ids, positions, slots, angles, the attention plan.
    ids_.clear();
    positions_.clear();
    slots_.clear();
    for (const auto& it : items)
      for (std::size_t i = 0; i < it.tokens.size(); ++i) {
        ids_.push_back(it.tokens[i]);
        positions_.push_back(it.start + static_cast<position>(i));
        slots_.push_back({it.table, positions_.back()});
      }
    const std::size_t hd = c.head_dim();
    cos_.resize(n * hd / 2);
    sin_.resize(n * hd / 2);
    kernels::rope_table(positions_, hd, c.rope_theta, cos_.data(), sin_.data(), c.rope_scale);
    // Attention: on tensor cores for a prefill step of f16 KV (kernels/cuda/attention_mma.cuh) where
    // its tiles of 64 rows are at least half full (a batch of decode rows, one token per sequence,
    // fills a tile with one query group) and fill the GPU (half a block per multiprocessor at least);
    // else the scalar kernel's tiles of 8 rows, with split-K where they alone would not fill it
    // (decode): about two blocks per multiprocessor.
    const std::size_t target_blocks = 2 * ctx.multiprocessors();
    mma_ = false;
    // Whether a tensor-core kernel takes this KV: f16, a layout it fits, the shared memory it needs, and
    // for the staged kernel a device of compute capability 8.0 or above.
    using kernels::device::mma_attention;
    const auto tensor_cores_take = [&](mma_attention k) {
      return kv.type() == dtype::f16 && (k == mma_attention::wmma || ctx.compute_capability() >= 80) &&
             kernels::device::attention_mma_fits(kv.layout()) &&
             kernels::device::attention_mma_shared_bytes(hd, k) <= ctx.shared_memory_optin();
    };
    mma_kind_ = tensor_cores_take(mma_attention_) ? mma_attention_ : mma_attention::wmma;
    if (tensor_cores_ != tensor_cores::never && n > graph_rows && tensor_cores_take(mma_kind_)) {
      constexpr std::size_t rows = kernels::device::policy::attention_mma::rows;
      step_.plan(slots_, kv.layout().block_size, c.heads, c.kv_heads, rows);
      const std::size_t tiles = step_.tiles.size();
      mma_ = tensor_cores_ == tensor_cores::always ||
             (4 * tiles >= target_blocks && 2 * n * c.heads >= tiles * rows);
    }
    if (!mma_) step_.plan(slots_, kv.layout().block_size, c.heads, c.kv_heads, attention_policy::rows);
    const std::size_t longest = kernels::device::longest_tile(step_.tiles), bs = kv.layout().block_size;
    using kernels::device::attention_kernel;
    // (The staged kernel where asked for and it takes the KV, else the pages kernel.)
    const bool staged = scalar_attention_ == attention_kernel::staged && tensor_cores_take(mma_attention::staged);
    split_ = mma_ ? kernels::device::attention_split{}
             : scalar_attention_ == attention_kernel::rows
                 ? kernels::device::plan_attention_split_rows(step_.tiles.size(), longest, bs, target_blocks,
                                                              kernels::device::widest_tile(step_.tiles))
             : staged ? kernels::device::plan_attention_split_staged(step_.tiles.size(), longest, bs, target_blocks,
                                                                     kernels::device::staged_chunk_keys(hd))
                      : kernels::device::plan_attention_split(step_.tiles.size(), longest, bs, target_blocks);
    // (Sized for the most ranges any context can be cut into: a sequence's decode steps then never
    // reallocate it, which would end their graphs.)
    grow(attention_ws_, kernels::device::attention_workspace_bound(step_.tiles.size(), target_blocks, hd));
    if (split_.splits > 1 && attention_counters_.size() < step_.tiles.size()) {  // (zero; each launch leaves them so)
      grow(attention_counters_, step_.tiles.size());
      device::check(cudaMemsetAsync(attention_counters_.data(), 0, attention_counters_.size() * sizeof(unsigned), s),
                    "cudaMemsetAsync");
    }

    reserve(n);
    // Block tables as long as the context can make them: a sequence's growing table then never
    // reallocates the buffer (which would end the step graphs holding its address).
    grow(d_tables_, items.size() * ((c.max_context + kv.layout().block_size - 1) / kv.layout().block_size));
    put(d_ids_, ids_, s);
    put(d_cos_, cos_, s);
    put(d_sin_, sin_, s);
    put(d_tables_, step_.tables, s);
    put(d_slots_, step_.slots, s);
    put(d_tiles_, step_.tiles, s);

    // The step's device work. A step of up to graph_rows tokens (decode) runs as a CUDA graph once its
    // shape has been seen (one launch instead of ~10 per layer).
    const auto work = [&] {
      kernels::device::embedding(w_.token_embd.type, w_.token_embd.data, c.hidden, d_ids_.data(), n, x_.data(), s);
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      for (std::size_t l = 0; l < c.layers; ++l) {
        const device_layer_weights& lw = w_.layers[l];
        norm(x_.data(), lw.attn_norm, lw.attn_norm_b, xb_.data(), n, s, &lw.wq);
        linear_parts(ctx, {{&lw.wq, q_.data(), lw.bq}, {&lw.wk, k_.data(), lw.bk}, {&lw.wv, v_.data(), lw.bv}}, n);
        if (kv.type() == dtype::f16)
          attend<half>(kv, l, scale, s);
        else
          attend<float>(kv, l, scale, s);
        residual(ctx, att_.data(), lw.wo, lw.bo, n);

        norm(x_.data(), lw.ffn_norm, lw.ffn_norm_b, xb_.data(), n, s,
             c.mlp == mlp_kind::swiglu ? &lw.w_gate : &lw.w_up);
        if (c.mlp == mlp_kind::swiglu && n == 1 && kernels::device::decodes_in_registers(lw.w_gate, n) &&
            lw.w_gate.type == lw.w_up.type) {
          // (one sequence's decode step: its FFN products and SwiGLU in one launch, the same bits; with
          // more rows the fused kernel holds both products' sums, up to 183 registers against 96 apart)
          kernels::device::quant_decode_swiglu(lw.w_gate.type, lw.w_gate.data, lw.w_up.data, c.ffn, c.hidden,
                                               xb_.data(), n, gate_.data(), s, lw.b_up, products_, convert_.data(),
                                               rounded_xb(lw.w_gate, n, s));
        } else if (c.mlp == mlp_kind::swiglu) {
          linear(ctx, xb_.data(), lw.w_gate, nullptr, gate_.data(), n);
          linear(ctx, xb_.data(), lw.w_up, lw.b_up, up_.data(), n);
          kernels::device::swiglu(gate_.data(), up_.data(), gate_.data(), n * c.ffn, s);
        } else {
          linear(ctx, xb_.data(), lw.w_up, lw.b_up, gate_.data(), n);
          kernels::device::gelu(gate_.data(), gate_.data(), n * c.ffn, s);
        }
        residual(ctx, gate_.data(), lw.w_down, lw.b_down, n);
      }

      // The last row of each item that wants logits, normed, through the output matrix.
      x8_fresh_ = {};  // (xb_ is written below; its norm resets this too)
      for (std::size_t i = 0; i < logit_rows_.size(); ++i)
        device::check(cudaMemcpyAsync(xb_.data() + i * c.hidden, x_.data() + logit_rows_[i] * c.hidden,
                                      c.hidden * sizeof(float), cudaMemcpyDeviceToDevice, s),
                      "cudaMemcpyAsync");
      if (n_logits > 0) {
        norm(xb_.data(), w_.output_norm, w_.output_norm_b, xb_.data(), n_logits, s, &w_.output);
        linear(ctx, xb_.data(), w_.output, w_.output_b, logits_.data(), n_logits);
      }
    };
    logit_rows_.clear();
    std::size_t row = 0;
    for (const auto& it : items) {
      row += it.tokens.size();
      if (it.want_logits && !it.tokens.empty()) logit_rows_.push_back(static_cast<std::uint32_t>(row - 1));
    }
    if (use_graphs_ && n <= graph_rows) {
      step_key key;
      key.tokens = n;
      key.tiles = step_.tiles.size();
      key.splits = split_.splits;
      key.pages = split_.splits > 1 ? split_.pages : 0;  // (read only where a tile is cut)
      key.attention = split_.kernel;
      key.generation = generation_;
      key.kv = kv.type() == dtype::f16 ? static_cast<const void*>(kv.keys<half>(0)) : kv.keys<float>(0);
      key.kv_type = kv.type();
      key.kv_layers = kv.layers();
      key.kv_blocks = kv.layout().blocks;
      key.block_size = kv.layout().block_size;
      key.blas = ctx.blas().get();  // (cuBLAS's nodes hold the handle's workspace)
      key.logits = logit_rows_.size();
      std::copy(logit_rows_.begin(), logit_rows_.end(), key.logit_rows.begin());
      graphs_.run(key, s, work);
    } else {
      work();
    }
    if (n_logits > 0) logits_.download(logits.data(), n_logits * c.vocab, s);
    ctx.synchronize();
  }

 private:
  // `first`: the first matrix whose product reads y: with int8 products, an RMSNorm into xb_ for a few
  // rows rounds them to 8 bits for it in the same launch (rmsnorm_x8; what rounded_xb then returns).
  void norm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows, cudaStream_t s,
            const kernels::device::matrix* first = nullptr) {
    const config& c = cfg();
    if (y == xb_.data()) x8_fresh_ = {};  // xb_ changes: its 8-bit copies are stale
    if (first != nullptr && y == xb_.data() && c.norm == norm_kind::rms && rounds_x8(*first, rows)) {
      const std::size_t i = x8_slot(first->type);
      x8_[i] = kernels::device::rmsnorm_x8(first->type, x, weight, y, rows, c.hidden, c.norm_eps, x8_ws_[i].data(), s);
      x8_fresh_[i] = true;
      return;
    }
    if (c.norm == norm_kind::rms)
      kernels::device::rmsnorm(x, weight, y, rows, c.hidden, c.norm_eps, s);
    else
      kernels::device::layernorm(x, weight, bias, y, rows, c.hidden, c.norm_eps, s);
  }

  // y (rows, w.rows) = x w^T + bias.
  void linear(const kernels::cuda::context& ctx, const float* x, const kernels::device::matrix& w, const float* bias,
              float* y, std::size_t rows) {
    kernels::device::matmul(ctx.blas(), x, w, y, rows, convert_.data(), ctx.stream(), kernels::accumulate::no,
                            products_, bias, x == xb_.data() ? rounded_xb(w, rows, ctx.stream()) : nullptr);
  }

  // Each part's y = xb_ w^T + bias: in one launch where the matrices allow it (a one-sequence decode
  // step's q, k and v of one type, or with int8 products q and k of a mix's base type and v of its type
  // of more bits: kernels::device::one_launch), else one product each; the same bits.
  void linear_parts(const kernels::cuda::context& ctx, std::initializer_list<kernels::device::product_part> list,
                    std::size_t rows) {
    const std::span<const kernels::device::product_part> parts(list.begin(), list.size());
    if (kernels::device::one_launch(parts, rows, products_)) {
      kernels::device::matmul_parts(xb_.data(), parts, rows, convert_.data(), ctx.stream(), products_,
                                    rounded_xb(*parts[0].w, rows, ctx.stream()));
      return;
    }
    for (const auto& part : parts) linear(ctx, xb_.data(), *part.w, part.bias, part.y, rows);
  }

  // x += h w^T + bias, the residual stream.
  void residual(const kernels::cuda::context& ctx, const float* h, const kernels::device::matrix& w, const float* bias,
                std::size_t rows) {
    kernels::device::matmul(ctx.blas(), h, w, x_.data(), rows, convert_.data(), ctx.stream(),
                            kernels::accumulate::yes, products_, bias);
  }

  // Whether w's product of `rows` x rows rounds them to 8 bits (an int8 decode product).
  [[nodiscard]] bool rounds_x8(const kernels::device::matrix& w, std::size_t rows) const noexcept {
    return products_ == kernels::products::int8 && rows <= kernels::device::policy::quant_matmul::decode_rows &&
           kernels::quant::kept_quantized(w.type);
  }

  // Which of x8_ holds xb_ rounded for weights of type t: per 32 values (0) or per 256 (1).
  static std::size_t x8_slot(dtype t) noexcept { return kernels::quant::x8_span(t) == 256 ? 1 : 0; }

  // With int8 products, the normed rows (xb_) rounded to 8 bits once for all the decode products that
  // read them (q, k and v; gate and up; the output), per activation span (32 or 256 values a scale):
  // the bytes each product would round them to itself. nullptr where w's product rounds nothing.
  const kernels::quant::x8_rows* rounded_xb(const kernels::device::matrix& w, std::size_t rows, cudaStream_t s) {
    if (!rounds_x8(w, rows)) return nullptr;
    const std::size_t i = x8_slot(w.type);
    if (!x8_fresh_[i]) {
      x8_[i] = kernels::device::quantize_x8(w.type, xb_.data(), rows, w.cols, x8_ws_[i].data(), s);
      x8_fresh_[i] = true;
    }
    return &x8_[i];
  }

  // RoPE on q and k and the new K/V into their pages (one launch), then attention.
  template <class E>
  void attend(storage& kv, std::size_t layer, float scale, cudaStream_t s) {
    kernels::device::rope_kv_write<E>(kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), q_.data(), k_.data(),
                                      v_.data(), d_slots_.data(), slots_.size(), cfg().heads, d_cos_.data(),
                                      d_sin_.data(), cfg().rope, s);
    if constexpr (std::is_same_v<E, half>) {
      if (mma_) {
        kernels::device::paged_attention_mma(kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), q_.data(),
                                             att_.data(), d_tables_.data(), d_tiles_.data(), step_.tiles.size(),
                                             cfg().heads, scale, s, mma_kind_);
        return;
      }
      if (split_.kernel == kernels::device::attention_kernel::staged) {  // (a decode step's, split-K)
        kernels::device::paged_attention_mma(kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), q_.data(),
                                             att_.data(), d_tables_.data(), d_tiles_.data(), step_.tiles.size(),
                                             cfg().heads, scale, s, kernels::device::mma_attention::staged, split_,
                                             attention_ws_.data(), attention_counters_.data());
        return;
      }
    }
    kernels::device::paged_attention<E>(kv.layout(), kv.keys<E>(layer), kv.values<E>(layer), q_.data(), att_.data(),
                                        d_tables_.data(), d_tiles_.data(), step_.tiles.size(), cfg().heads, scale, s,
                                        split_, attention_ws_.data(), attention_counters_.data());
  }

  // Scratch for n rows (grown, never shrunk: a step of a size seen before allocates nothing).
  void reserve(std::size_t n) {
    const config& c = cfg();
    grow(x_, n * c.hidden);
    grow(xb_, n * c.hidden);
    grow(q_, n * c.q_dim());
    grow(att_, n * c.q_dim());
    grow(k_, n * c.kv_dim());
    grow(v_, n * c.kv_dim());
    grow(gate_, n * c.ffn);
    grow(up_, n * c.ffn);
    grow(logits_, n * c.vocab);
    grow(convert_, w_.workspace(n));
    for (auto& ws : x8_ws_)
      grow(ws, kernels::quant::x8_bytes(std::min(n, kernels::device::policy::quant_matmul::decode_rows), c.hidden));
  }
  // A buffer reallocated moves: the graphs captured before hold its old address (generation_ keys them).
  template <class T>
  void grow(device::buffer<T>& b, std::size_t count) {
    if (b.size() >= count) return;
    b = device::buffer<T>(count + count / 4);
    ++generation_;
  }
  template <class T>
  void put(device::buffer<T>& b, const std::vector<T>& v, cudaStream_t s) {
    grow(b, v.size());
    if (!v.empty()) b.upload(v.data(), v.size(), s);
  }

  // What a step run as a graph depends on besides device memory's contents.
  struct step_key {
    std::size_t tokens = 0, tiles = 0, splits = 0, pages = 0, generation = 0;
    kernels::device::attention_kernel attention = kernels::device::attention_kernel::pages;
    const void* kv = nullptr;
    dtype kv_type = dtype::f32;
    std::size_t kv_layers = 0, kv_blocks = 0, block_size = 0, logits = 0;
    const void* blas = nullptr;
    std::array<std::uint32_t, graph_rows> logit_rows{};
    bool operator==(const step_key&) const = default;
  };

  device_weights w_;
  kernels::products products_;
  bool use_graphs_ = true;
  tensor_cores tensor_cores_ = tensor_cores::when_filled;
  kernels::device::attention_kernel scalar_attention_ = kernels::device::attention_kernel::pages;
  kernels::device::mma_attention mma_attention_ = kernels::device::mma_attention::wmma;
  kernels::device::mma_attention mma_kind_ = kernels::device::mma_attention::wmma;  // this step's
  bool mma_ = false;  // this step's attention on tensor cores
  std::size_t generation_ = 0;
  kernels::device::graph_cache<step_key> graphs_;
  std::vector<std::uint32_t> logit_rows_;
  // xb_ rounded to 8 bits per 32 [0] and per 256 [1] values (rounded_xb), and whether that is current.
  std::array<device::buffer<std::byte>, 2> x8_ws_;
  std::array<kernels::quant::x8_rows, 2> x8_{};
  std::array<bool, 2> x8_fresh_{};
  device::buffer<float> x_, xb_, q_, att_, k_, v_, gate_, up_, logits_, d_cos_, d_sin_;
  device::buffer<std::byte> convert_, attention_ws_;
  device::buffer<unsigned> attention_counters_;  // a tile's blocks that finished (the folded split-K merge)
  device::buffer<token_id> d_ids_;
  device::buffer<block_id> d_tables_;
  device::buffer<kv::slot_ref> d_slots_;
  device::buffer<kernels::attention_tile_ref> d_tiles_;
  // The step's host side (uploads read from these: they must live until the step's copies are done).
  std::vector<token_id> ids_;
  std::vector<position> positions_;
  std::vector<kernels::token_slot> slots_;
  std::vector<float> cos_, sin_;
  kernels::attention_step step_;
  kernels::device::attention_split split_;
};

}  // namespace efim::model
