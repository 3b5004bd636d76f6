#pragma once
// The CUDA backend's ops as plain host functions over host vectors (compiled by nvcc in
// cuda_ops.cu), so that the test bodies, compiled by g++, run them beside the host kernels.
#include <cstddef>
#include <string>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/quant_int8.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/kv/layout.hpp"
#include "efim/model/batch.hpp"
#include "efim/model/weights.hpp"

namespace efim::test_cuda {

bool available();
std::string device_name();
std::vector<float> rmsnorm(const std::vector<float>& x, const std::vector<float>& weight, std::size_t rows,
                           std::size_t n, float eps);
std::vector<float> layernorm(const std::vector<float>& x, const std::vector<float>& weight,
                             const std::vector<float>& bias, std::size_t rows, std::size_t n, float eps);
std::vector<float> gelu(const std::vector<float>& x);
std::vector<float> embedding(dtype type, const std::vector<std::byte>& table, std::size_t n,
                             const std::vector<token_id>& ids);
std::vector<float> swiglu(const std::vector<float>& gate, const std::vector<float>& up);
std::vector<float> rope(const std::vector<float>& x, std::size_t tokens, std::size_t heads, std::size_t head_dim,
                        const std::vector<float>& cos_t, const std::vector<float>& sin_t, kernels::rope_style style);

// RoPE of q and k then the K/V write, as three launches (fused false) or one (rope_kv_write): q comes
// back rotated, the caches written.
template <class E>
void rope_kv_write(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache, std::vector<float>& q,
                   const std::vector<float>& k, const std::vector<float>& v, const std::vector<kv::slot_ref>& slots,
                   std::size_t heads, const std::vector<float>& cos_t, const std::vector<float>& sin_t,
                   kernels::rope_style style, bool fused);

// The caches' K and V arrays of one layer go up, the op runs, and they come back.
template <class E>
void kv_write(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache, const std::vector<float>& k,
              const std::vector<float>& v, const std::vector<kv::slot_ref>& slots);
template <class E>
void block_copy(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache,
                const std::vector<block_id>& from, const std::vector<block_id>& to);
// q (tokens, heads, head_dim) against one layer's caches, planned and uploaded as a step would be,
// with each tile's pages cut for about `target_blocks` thread blocks (1: never split-K). `splits`
// reports the ranges per tile the plan chose. `folded`: the ranges merged in the attention launch (a
// counter per tile), launched twice over the same counters, the second run's rows returned (throws
// if a counter is not back to 0); else by the merge kernel. `kernel`: planned and run as
// kernels::device::attention_kernel's pages (a warp per page), rows (a warp per row) or staged (f16
// caches only; tensor cores, folded only).
enum class decode_kernel { pages, rows, staged };
template <class E>
std::vector<float> paged_attention(const kv::paged_layout& l, const std::vector<E>& k_cache,
                                   const std::vector<E>& v_cache, const std::vector<float>& q,
                                   const std::vector<kernels::token_slot>& tokens, std::size_t heads, float scale,
                                   std::size_t target_blocks, std::size_t& splits, bool folded = false,
                                   decode_kernel kernel = decode_kernel::pages);
// Whether paged_attention_mma takes caches of this layout; it (tensor cores: WMMA, or mma.sync over
// staged K and V where `staged`) over f16 caches, planned as a prefill step on them is.
bool attention_mma_fits(const kv::paged_layout& l);
std::vector<float> paged_attention_mma(const kv::paged_layout& l, const std::vector<half>& k_cache,
                                       const std::vector<half>& v_cache, const std::vector<float>& q,
                                       const std::vector<kernels::token_slot>& tokens, std::size_t heads, float scale,
                                       bool staged = false);
// y (m, rows) = [y +] x (m, cols) w^T [+ bias] (kernels::device::matmul), w a (rows, cols) matrix of any
// type the device multiplies; an empty bias adds none.
std::vector<float> matmul(dtype type, const std::vector<std::byte>& w, std::size_t rows, std::size_t cols,
                          const std::vector<float>& x, std::size_t m, std::vector<float> y, bool accumulate,
                          kernels::products products = kernels::products::exact,
                          const std::vector<float>& bias = {});
// The same product by kernels::device::quant_tiles (quantized w, on tensor cores, the weights dequantized
// in shared memory), whatever rows matmul would give it; x_f16: x rounded to f16 on the host first.
std::vector<float> quant_tiles(dtype type, const std::vector<std::byte>& w, std::size_t rows, std::size_t cols,
                               const std::vector<float>& x, std::size_t m, std::vector<float> y, bool accumulate,
                               const std::vector<float>& bias = {}, bool x_f16 = false);
// The products of x (m, cols) with several matrices of one width (q, k and v), matrix k of types[k],
// each with its bias (empty: none), in one launch (matmul_parts) or one matmul each: each matrix's y.
std::vector<std::vector<float>> matmul_parts(const std::vector<dtype>& types,
                                             const std::vector<std::vector<std::byte>>& ws,
                                             const std::vector<std::size_t>& rows, std::size_t cols,
                                             const std::vector<float>& x, std::size_t m,
                                             const std::vector<std::vector<float>>& biases, kernels::products products,
                                             bool one_launch);
// RMSNorm of x (rows, n) then its rounding to 8 bits for weights of type t, in one launch
// (rmsnorm_x8) or two (rmsnorm, quantize_x8), into another buffer or in place: the normed rows into
// y, the rounded ones returned.
kernels::quant::x8_host rmsnorm_x8(dtype t, const std::vector<float>& x, const std::vector<float>& weight,
                                   std::size_t rows, std::size_t n, float eps, bool fused, bool in_place,
                                   std::vector<float>& y);
// A decode step's SwiGLU FFN half: swiglu(x gate^T, x up^T [+ bias]) for two quantized (rows, cols)
// matrices of one type, in one launch (quant_decode_swiglu) or as two products and the SwiGLU kernel.
std::vector<float> ffn_gate_up(dtype type, const std::vector<std::byte>& gate, const std::vector<std::byte>& up,
                               std::size_t rows, std::size_t cols, const std::vector<float>& x, std::size_t m,
                               const std::vector<float>& bias, kernels::products products, bool fused);
// x (m, cols) rounded to 8 bits on the device for weights of type t (kernels::device::quantize_x8),
// downloaded into the arrays quant::make_x8 fills on the host (the sums for the k-quants only).
kernels::quant::x8_host quantize_x8(dtype t, const std::vector<float>& x, std::size_t m, std::size_t cols);
std::vector<token_id> argmax(const std::vector<float>& logits, std::size_t rows, std::size_t n);
std::vector<token_id> sample(const std::vector<float>& logits, std::size_t rows, std::size_t n,
                             const std::vector<kernels::sample_params>& params);

// Forward passes of transformer<kernels::cuda> over one device KV storage of `blocks` blocks of
// `block_size` tokens, in order: the logits of each pass.
// How the decoder runs: its products; decode steps as CUDA graphs or not (`stats`, if given, receives
// how many steps ran directly, were captured, were replayed); prefill attention on tensor cores
// whenever it fits (f16 KV), not only where its tiles fill the GPU; the decode steps' attention by
// `decode_attention` (kernels::device::attention_kernel); the tensor-core attention by the staged
// kernel (kernels::device::mma_attention::staged) instead of WMMA.
struct graph_stats {
  std::size_t direct = 0, captures = 0, replays = 0, updates = 0;
};
struct forward_options {
  kernels::products products = kernels::products::exact;
  bool graphs = true;
  bool tensor_cores_always = false;
  decode_kernel decode_attention = decode_kernel::pages;
  bool staged_attention = false;
  graph_stats* stats = nullptr;
};
std::vector<std::vector<float>> forward(const model::weights& w, dtype kv_type, std::size_t blocks,
                                        std::size_t block_size,
                                        const std::vector<std::vector<model::batch_item>>& passes,
                                        const forward_options& options = {});

// kernels::device::graph_cache of `capacity` graphs over steps of `sizes[i]` elements in turn (a
// bias added to y, then SwiGLU of y and x, on buffers sized for the largest), each step's key its
// size; `graphed` gets each step's y through the cache, `eager` the same ops launched directly.
void graph_cache_steps(std::size_t capacity, const std::vector<std::size_t>& sizes,
                       std::vector<std::vector<float>>& graphed, std::vector<std::vector<float>>& eager,
                       graph_stats& stats);

// engine::pipeline<efim, xxh3_128_chain, lru, at_boundaries, kernels::cuda> with the byte tokenizer
// and Qwen2.5-Coder's FIM tokens: each request submitted and run to completion in turn.
std::vector<engine::completion> complete_each(const model::weights& w, const engine::pipeline_options& options,
                                              const std::vector<engine::request>& requests);

}  // namespace efim::test_cuda
