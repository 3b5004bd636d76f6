// The CUDA side of the CUDA backend's tests: upload, run the op on a stream, download, synchronize.
#include "efim/cuda.cuh"  // (first: pipeline.hpp then has the CUDA decoder)
#include "cuda_ops.hpp"
#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/text/fragment.hpp"

#include <algorithm>

namespace efim::test_cuda {

namespace {
using kernels::device::buffer;
using kernels::device::check;

template <class T>
buffer<T> upload(const std::vector<T>& v, cudaStream_t stream) {
  buffer<T> b(v.size());
  b.upload(v.data(), v.size(), stream);
  return b;
}
template <class T>
std::vector<T> download(const buffer<T>& b, std::size_t n, cudaStream_t stream) {
  std::vector<T> out(n);
  b.download(out.data(), n, stream);
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return out;
}
struct stream {
  cudaStream_t s = nullptr;
  stream() { check(cudaStreamCreate(&s), "cudaStreamCreate"); }
  ~stream() { (void)cudaStreamDestroy(s); }
};
}  // namespace

bool available() { return kernels::device::available(); }
std::string device_name() { return kernels::device::device_name(); }

std::vector<float> rmsnorm(const std::vector<float>& x, const std::vector<float>& weight, std::size_t rows,
                           std::size_t n, float eps) {
  stream st;
  auto dx = upload(x, st.s), dw = upload(weight, st.s);
  buffer<float> dy(rows * n);
  kernels::device::rmsnorm(dx.data(), dw.data(), dy.data(), rows, n, eps, st.s);
  return download(dy, rows * n, st.s);
}

std::vector<float> layernorm(const std::vector<float>& x, const std::vector<float>& weight,
                             const std::vector<float>& bias, std::size_t rows, std::size_t n, float eps) {
  stream st;
  auto dx = upload(x, st.s), dw = upload(weight, st.s), db = upload(bias, st.s);
  buffer<float> dy(rows * n);
  kernels::device::layernorm(dx.data(), dw.data(), db.data(), dy.data(), rows, n, eps, st.s);
  return download(dy, rows * n, st.s);
}

std::vector<float> gelu(const std::vector<float>& x) {
  stream st;
  auto dx = upload(x, st.s);
  buffer<float> out(x.size());
  kernels::device::gelu(dx.data(), out.data(), x.size(), st.s);
  return download(out, x.size(), st.s);
}

std::vector<float> embedding(dtype type, const std::vector<std::byte>& table, std::size_t n,
                             const std::vector<token_id>& ids) {
  stream st;
  auto dt = upload(table, st.s);
  auto di = upload(ids, st.s);
  buffer<float> out(ids.size() * n);
  kernels::device::embedding(type, dt.data(), n, di.data(), ids.size(), out.data(), st.s);
  return download(out, ids.size() * n, st.s);
}

std::vector<float> swiglu(const std::vector<float>& gate, const std::vector<float>& up) {
  stream st;
  auto dg = upload(gate, st.s), du = upload(up, st.s);
  buffer<float> out(gate.size());
  kernels::device::swiglu(dg.data(), du.data(), out.data(), gate.size(), st.s);
  return download(out, gate.size(), st.s);
}

std::vector<float> rope(const std::vector<float>& x, std::size_t tokens, std::size_t heads, std::size_t head_dim,
                        const std::vector<float>& cos_t, const std::vector<float>& sin_t, kernels::rope_style style) {
  stream st;
  auto dx = upload(x, st.s), dc = upload(cos_t, st.s), ds = upload(sin_t, st.s);
  kernels::device::rope(dx.data(), tokens, heads, head_dim, dc.data(), ds.data(), style, st.s);
  return download(dx, x.size(), st.s);
}

template <class E>
void kv_write(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache, const std::vector<float>& k,
              const std::vector<float>& v, const std::vector<kv::slot_ref>& slots) {
  stream st;
  auto dkc = upload(k_cache, st.s), dvc = upload(v_cache, st.s);
  auto dk = upload(k, st.s), dv = upload(v, st.s);
  auto ds = upload(slots, st.s);
  kernels::device::kv_write<E>(l, dkc.data(), dvc.data(), dk.data(), dv.data(), ds.data(), slots.size(), st.s);
  k_cache = download(dkc, k_cache.size(), st.s);
  v_cache = download(dvc, v_cache.size(), st.s);
}
template <class E>
void rope_kv_write(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache, std::vector<float>& q,
                   const std::vector<float>& k, const std::vector<float>& v, const std::vector<kv::slot_ref>& slots,
                   std::size_t heads, const std::vector<float>& cos_t, const std::vector<float>& sin_t,
                   kernels::rope_style style, bool fused) {
  stream st;
  auto dkc = upload(k_cache, st.s), dvc = upload(v_cache, st.s);
  auto dq = upload(q, st.s), dk = upload(k, st.s), dv = upload(v, st.s);
  auto ds = upload(slots, st.s);
  auto dc = upload(cos_t, st.s), dsn = upload(sin_t, st.s);
  const std::size_t tokens = slots.size();
  if (fused) {
    kernels::device::rope_kv_write<E>(l, dkc.data(), dvc.data(), dq.data(), dk.data(), dv.data(), ds.data(), tokens,
                                      heads, dc.data(), dsn.data(), style, st.s);
  } else {
    kernels::device::rope(dq.data(), tokens, heads, l.head_dim, dc.data(), dsn.data(), style, st.s);
    kernels::device::rope(dk.data(), tokens, l.kv_heads, l.head_dim, dc.data(), dsn.data(), style, st.s);
    kernels::device::kv_write<E>(l, dkc.data(), dvc.data(), dk.data(), dv.data(), ds.data(), tokens, st.s);
  }
  q = download(dq, q.size(), st.s);
  k_cache = download(dkc, k_cache.size(), st.s);
  v_cache = download(dvc, v_cache.size(), st.s);
}
template void rope_kv_write<float>(const kv::paged_layout&, std::vector<float>&, std::vector<float>&,
                                   std::vector<float>&, const std::vector<float>&, const std::vector<float>&,
                                   const std::vector<kv::slot_ref>&, std::size_t, const std::vector<float>&,
                                   const std::vector<float>&, kernels::rope_style, bool);
template void rope_kv_write<half>(const kv::paged_layout&, std::vector<half>&, std::vector<half>&, std::vector<float>&,
                                  const std::vector<float>&, const std::vector<float>&, const std::vector<kv::slot_ref>&,
                                  std::size_t, const std::vector<float>&, const std::vector<float>&, kernels::rope_style,
                                  bool);

template void kv_write<float>(const kv::paged_layout&, std::vector<float>&, std::vector<float>&,
                              const std::vector<float>&, const std::vector<float>&, const std::vector<kv::slot_ref>&);
template void kv_write<half>(const kv::paged_layout&, std::vector<half>&, std::vector<half>&, const std::vector<float>&,
                             const std::vector<float>&, const std::vector<kv::slot_ref>&);

template <class E>
void block_copy(const kv::paged_layout& l, std::vector<E>& k_cache, std::vector<E>& v_cache,
                const std::vector<block_id>& from, const std::vector<block_id>& to) {
  stream st;
  auto dkc = upload(k_cache, st.s), dvc = upload(v_cache, st.s);
  auto df = upload(from, st.s), dt = upload(to, st.s);
  kernels::device::block_copy<E>(l, dkc.data(), dvc.data(), df.data(), dt.data(), from.size(), st.s);
  k_cache = download(dkc, k_cache.size(), st.s);
  v_cache = download(dvc, v_cache.size(), st.s);
}
template void block_copy<float>(const kv::paged_layout&, std::vector<float>&, std::vector<float>&,
                                const std::vector<block_id>&, const std::vector<block_id>&);
template void block_copy<half>(const kv::paged_layout&, std::vector<half>&, std::vector<half>&,
                               const std::vector<block_id>&, const std::vector<block_id>&);

template <class E>
std::vector<float> paged_attention(const kv::paged_layout& l, const std::vector<E>& k_cache,
                                   const std::vector<E>& v_cache, const std::vector<float>& q,
                                   const std::vector<kernels::token_slot>& tokens, std::size_t heads, float scale,
                                   std::size_t target_blocks, std::size_t& splits, bool folded, decode_kernel kernel) {
  namespace kd = kernels::device;
  kernels::attention_step step;
  step.plan(tokens, l.block_size, heads, l.kv_heads, kd::policy::attention::rows);
  const std::size_t longest = kd::longest_tile(step.tiles);
  const auto split = kernel == decode_kernel::rows
                         ? kd::plan_attention_split_rows(step.tiles.size(), longest, l.block_size, target_blocks,
                                                         kd::widest_tile(step.tiles))
                     : kernel == decode_kernel::staged
                         ? kd::plan_attention_split_staged(step.tiles.size(), longest, l.block_size, target_blocks,
                                                           kd::staged_chunk_keys(l.head_dim))
                         : kd::plan_attention_split(step.tiles.size(), longest, l.block_size, target_blocks);
  splits = split.splits;
  if (kernel != decode_kernel::staged &&
      kd::attention_kernel_for(l, split) !=
          (kernel == decode_kernel::rows ? kd::attention_kernel::rows : kd::attention_kernel::pages))
    throw error(errc::invalid_argument, "paged_attention: the launch would not run the kernel asked for");
  if (kernel == decode_kernel::staged && (!std::is_same_v<E, half> || !kd::attention_mma_fits(l) || !folded))
    throw error(errc::invalid_argument, "paged_attention: the staged kernel takes f16 caches it fits, merged folded");
  stream st;
  auto dk = upload(k_cache, st.s), dv = upload(v_cache, st.s);
  auto dq = upload(q, st.s);
  auto dtables = upload(step.tables, st.s);
  auto dtiles = upload(step.tiles, st.s);
  buffer<float> out(q.size());
  buffer<std::byte> workspace(kd::attention_workspace_bytes(step.tiles.size(), split, l.head_dim));
  if (!folded) {
    kd::paged_attention<E>(l, dk.data(), dv.data(), dq.data(), out.data(), dtables.data(), dtiles.data(),
                           step.tiles.size(), heads, scale, st.s, split, workspace.data());
    return download(out, q.size(), st.s);
  }
  auto counters = upload(std::vector<unsigned>(step.tiles.size(), 0u), st.s);
  for (int run = 0; run < 2; ++run) {
    // (NaN rows before each run: the second run's merge must write every row itself)
    check(cudaMemsetAsync(out.data(), 0xFF, out.size() * sizeof(float), st.s), "cudaMemsetAsync");
    if constexpr (std::is_same_v<E, half>) {
      if (kernel == decode_kernel::staged) {
        kd::paged_attention_mma(l, dk.data(), dv.data(), dq.data(), out.data(), dtables.data(), dtiles.data(),
                                step.tiles.size(), heads, scale, st.s, kd::mma_attention::staged, split,
                                workspace.data(), counters.data());
        continue;
      }
    }
    kd::paged_attention<E>(l, dk.data(), dv.data(), dq.data(), out.data(), dtables.data(), dtiles.data(),
                           step.tiles.size(), heads, scale, st.s, split, workspace.data(), counters.data());
  }
  const auto left = download(counters, step.tiles.size(), st.s);
  if (std::any_of(left.begin(), left.end(), [](unsigned c) { return c != 0; }))
    throw error(errc::invalid_argument, "paged_attention: a tile's counter not back to 0 after the folded merge");
  return download(out, q.size(), st.s);
}
template std::vector<float> paged_attention<float>(const kv::paged_layout&, const std::vector<float>&,
                                                   const std::vector<float>&, const std::vector<float>&,
                                                   const std::vector<kernels::token_slot>&, std::size_t, float,
                                                   std::size_t, std::size_t&, bool, decode_kernel);
template std::vector<float> paged_attention<half>(const kv::paged_layout&, const std::vector<half>&,
                                                  const std::vector<half>&, const std::vector<float>&,
                                                  const std::vector<kernels::token_slot>&, std::size_t, float,
                                                  std::size_t, std::size_t&, bool, decode_kernel);

bool attention_mma_fits(const kv::paged_layout& l) { return kernels::device::attention_mma_fits(l); }

std::vector<float> paged_attention_mma(const kv::paged_layout& l, const std::vector<half>& k_cache,
                                       const std::vector<half>& v_cache, const std::vector<float>& q,
                                       const std::vector<kernels::token_slot>& tokens, std::size_t heads, float scale,
                                       bool staged) {
  namespace kd = kernels::device;
  kernels::attention_step step;
  step.plan(tokens, l.block_size, heads, l.kv_heads, kd::policy::attention_mma::rows);
  stream st;
  auto dk = upload(k_cache, st.s), dv = upload(v_cache, st.s);
  auto dq = upload(q, st.s);
  auto dtables = upload(step.tables, st.s);
  auto dtiles = upload(step.tiles, st.s);
  buffer<float> out(q.size());
  kd::paged_attention_mma(l, dk.data(), dv.data(), dq.data(), out.data(), dtables.data(), dtiles.data(),
                          step.tiles.size(), heads, scale, st.s,
                          staged ? kd::mma_attention::staged : kd::mma_attention::wmma);
  return download(out, q.size(), st.s);
}

// The split plan: not split where the tiles fill the target or the context is one page per warp;
// else ranges of whole pages, at least one per warp, covering the longest tile.
namespace kd = kernels::device;
// The CUDA context makes its own stream and takes no thread pool, so a CUDA pipeline starts no host
// worker threads.
static_assert(efim::kernels::backend<efim::kernels::cuda> && !efim::kernels::context_takes_pool<efim::kernels::cuda>);
static_assert(kd::plan_attention_split(300, 4096, 16, 264).splits == 1);
static_assert(kd::plan_attention_split(2, 64, 16, 264).splits == 1);  // 4 pages: one per warp already
static_assert(kd::plan_attention_split(2, 1024, 16, 264).splits == 16 &&
              kd::plan_attention_split(2, 1024, 16, 264).pages == 4);
static_assert(kd::plan_attention_split(2, 1025, 16, 264).splits == 17 &&
              kd::plan_attention_split(2, 1025, 16, 264).pages == 4);
static_assert(kd::plan_attention_split(4, 100000, 16, 264).splits == 66 &&
              kd::plan_attention_split(4, 100000, 16, 264).splits * kd::plan_attention_split(4, 100000, 16, 264).pages >=
                  6250);
static_assert(kd::plan_attention_split(1, 0, 16, 264).splits == 1);
// The rows kernel's cut: ranges of at least 32 keys (two pages of 16, one of 64), so 64 keys are two.
static_assert(kd::plan_attention_split_rows(4, 60, 16, 264).splits == 2 &&
              kd::plan_attention_split_rows(4, 60, 16, 264).pages == 2);
static_assert(kd::plan_attention_split_rows(4, 60, 64, 264).splits == 1);
static_assert(kd::plan_attention_split_rows(300, 4096, 16, 264).splits == 1);
static_assert(kd::plan_attention_split_rows(2, 1024, 16, 264).splits == 32 &&
              kd::plan_attention_split_rows(2, 1024, 16, 264).pages == 2);
static_assert(kd::plan_attention_split_rows(4, 100000, 16, 264).splits == 66);
static_assert(kd::plan_attention_split_rows(2, 33, 8, 264).splits == 2 &&
              kd::plan_attention_split_rows(2, 33, 8, 264).pages == 3);  // 5 pages of 8: ranges of 3 and 2
static_assert(kd::plan_attention_split_rows(1, 0, 16, 264).splits == 1);
// Tiles of one row: a chunk for each of the 4 warps sharing it, 128 keys a range (8 pages of 16).
static_assert(kd::plan_attention_split_rows(4, 1024, 16, 264, 1).splits == 8 &&
              kd::plan_attention_split_rows(4, 1024, 16, 264, 1).pages == 8);
static_assert(kd::plan_attention_split_rows(4, 1024, 16, 264, 2).pages == 4);
static_assert(kd::plan_attention_split_rows(4, 1024, 16, 264, 7).pages == 2);
// The rows kernel where it can take the layout, else the pages kernel on the same cut.
static_assert(kd::attention_kernel_for({40, 4, 16, 128}, kd::plan_attention_split_rows(4, 60, 16, 264)) ==
              kd::attention_kernel::rows);
static_assert(kd::attention_kernel_for({40, 4, 16, 128}, kd::plan_attention_split(4, 60, 16, 264)) ==
              kd::attention_kernel::pages);
static_assert(kd::attention_kernel_for({std::size_t{1} << 29, 4, 16, 128},
                                       kd::plan_attention_split_rows(4, 60, 16, 264)) ==
              kd::attention_kernel::pages);  // 2^35 value rows

std::vector<float> matmul(dtype type, const std::vector<std::byte>& w, std::size_t rows, std::size_t cols,
                          const std::vector<float>& x, std::size_t m, std::vector<float> y, bool accumulate,
                          kernels::products products, const std::vector<float>& bias) {
  stream st;
  kernels::device::blas blas(st.s);
  auto dw = upload(w, st.s);
  auto dx = upload(x, st.s);
  auto dy = upload(y, st.s);
  auto db = upload(bias, st.s);
  const kernels::device::matrix mat{type, rows, cols, dw.data()};
  buffer<std::byte> workspace(kernels::device::matmul_workspace(mat, m));
  kernels::device::matmul(blas, dx.data(), mat, dy.data(), m, workspace.data(), st.s,
                          accumulate ? kernels::accumulate::yes : kernels::accumulate::no, products,
                          bias.empty() ? nullptr : db.data());
  return download(dy, y.size(), st.s);
}

std::vector<float> quant_tiles(dtype type, const std::vector<std::byte>& w, std::size_t rows, std::size_t cols,
                               const std::vector<float>& x, std::size_t m, std::vector<float> y, bool accumulate,
                               const std::vector<float>& bias, bool x_f16) {
  stream st;
  auto dw = upload(w, st.s);
  auto dx = upload(x, st.s);
  std::vector<half> x16(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) x16[i].bits = f32_to_f16(x[i]);
  auto dx16 = upload(x16, st.s);
  auto dy = upload(y, st.s);
  auto db = upload(bias, st.s);
  const auto acc = accumulate ? kernels::accumulate::yes : kernels::accumulate::no;
  const float* const b = bias.empty() ? nullptr : db.data();
  if (x_f16)
    kernels::device::quant_tiles(type, dw.data(), rows, cols, reinterpret_cast<const __half*>(dx16.data()), m,
                                 dy.data(), st.s, acc, b);
  else
    kernels::device::quant_tiles(type, dw.data(), rows, cols, dx.data(), m, dy.data(), st.s, acc, b);
  return download(dy, y.size(), st.s);
}

std::vector<std::vector<float>> matmul_parts(const std::vector<dtype>& types,
                                             const std::vector<std::vector<std::byte>>& ws,
                                             const std::vector<std::size_t>& rows, std::size_t cols,
                                             const std::vector<float>& x, std::size_t m,
                                             const std::vector<std::vector<float>>& biases, kernels::products products,
                                             bool one_launch) {
  stream st;
  kernels::device::blas blas(st.s);
  auto dx = upload(x, st.s);
  std::vector<buffer<std::byte>> dw;
  std::vector<buffer<float>> dy, db;
  std::vector<kernels::device::matrix> mats;
  std::size_t workspace_bytes = 0;
  for (std::size_t k = 0; k < ws.size(); ++k) {
    dw.push_back(upload(ws[k], st.s));
    dy.emplace_back(m * rows[k]);
    db.push_back(upload(biases[k], st.s));
    mats.push_back({types[k], rows[k], cols, dw.back().data()});
  }
  std::vector<kernels::device::product_part> parts;
  for (std::size_t k = 0; k < ws.size(); ++k) {
    parts.push_back({&mats[k], dy[k].data(), biases[k].empty() ? nullptr : db[k].data()});
    workspace_bytes = std::max(workspace_bytes, kernels::device::matmul_workspace(mats[k], m));
  }
  buffer<std::byte> workspace(workspace_bytes);
  if (one_launch) {
    kernels::device::matmul_parts(dx.data(), parts, m, workspace.data(), st.s, products);  // (throws where it cannot)
  } else {
    for (const auto& part : parts)
      kernels::device::matmul(blas, dx.data(), *part.w, part.y, m, workspace.data(), st.s, kernels::accumulate::no,
                              products, part.bias);
  }
  std::vector<std::vector<float>> out;
  for (std::size_t k = 0; k < ws.size(); ++k) out.push_back(download(dy[k], m * rows[k], st.s));
  return out;
}

std::vector<float> ffn_gate_up(dtype type, const std::vector<std::byte>& gate, const std::vector<std::byte>& up,
                               std::size_t rows, std::size_t cols, const std::vector<float>& x, std::size_t m,
                               const std::vector<float>& bias, kernels::products products, bool fused) {
  stream st;
  kernels::device::blas blas(st.s);
  auto dg = upload(gate, st.s), du = upload(up, st.s);
  auto dx = upload(x, st.s);
  auto db = upload(bias, st.s);
  const float* b = bias.empty() ? nullptr : db.data();
  buffer<float> out(m * rows), up_out(m * rows);
  const kernels::device::matrix g{type, rows, cols, dg.data()}, u{type, rows, cols, du.data()};
  buffer<std::byte> workspace(kernels::device::matmul_workspace(g, m));
  if (fused) {
    kernels::device::quant_decode_swiglu(type, dg.data(), du.data(), rows, cols, dx.data(), m, out.data(), st.s, b,
                                         products, workspace.data());
  } else {
    kernels::device::matmul(blas, dx.data(), g, out.data(), m, workspace.data(), st.s, kernels::accumulate::no,
                            products);
    kernels::device::matmul(blas, dx.data(), u, up_out.data(), m, workspace.data(), st.s, kernels::accumulate::no,
                            products, b);
    kernels::device::swiglu(out.data(), up_out.data(), out.data(), m * rows, st.s);
  }
  return download(out, m * rows, st.s);
}

namespace {
// The planar arrays of a device workspace, downloaded.
kernels::quant::x8_host download_x8(dtype t, const buffer<std::byte>& workspace, const kernels::quant::x8_rows& v,
                                    std::size_t m, std::size_t cols, cudaStream_t s) {
  const auto bytes = download(workspace, workspace.size(), s);
  const auto* base = reinterpret_cast<const std::byte*>(workspace.data());
  kernels::quant::x8_host out;
  out.cols = cols;
  const std::size_t scales = m * (cols / kernels::quant::x8_span(t)), sums = m * (cols / 16);
  out.q.resize(m * cols);
  out.d.resize(scales);
  out.sums.assign(sums, 0);
  std::memcpy(out.q.data(), bytes.data() + (reinterpret_cast<const std::byte*>(v.q) - base), m * cols);
  std::memcpy(out.d.data(), bytes.data() + (reinterpret_cast<const std::byte*>(v.d) - base), scales * sizeof(float));
  if (kernels::quant::x8_span(t) == 256)
    std::memcpy(out.sums.data(), bytes.data() + (reinterpret_cast<const std::byte*>(v.sums) - base),
                sums * sizeof(std::int32_t));
  return out;
}
}  // namespace

kernels::quant::x8_host quantize_x8(dtype t, const std::vector<float>& x, std::size_t m, std::size_t cols) {
  stream st;
  auto dx = upload(x, st.s);
  buffer<std::byte> workspace(kernels::quant::x8_bytes(m, cols));
  const kernels::quant::x8_rows v = kernels::device::quantize_x8(t, dx.data(), m, cols, workspace.data(), st.s);
  return download_x8(t, workspace, v, m, cols, st.s);
}

kernels::quant::x8_host rmsnorm_x8(dtype t, const std::vector<float>& x, const std::vector<float>& weight,
                                   std::size_t rows, std::size_t n, float eps, bool fused, bool in_place,
                                   std::vector<float>& y) {
  stream st;
  auto dx = upload(x, st.s), dw = upload(weight, st.s);
  buffer<float> other(in_place ? 0 : rows * n);
  float* const dy = in_place ? dx.data() : other.data();
  buffer<std::byte> workspace(kernels::quant::x8_bytes(rows, n));
  kernels::quant::x8_rows v;
  if (fused) {
    v = kernels::device::rmsnorm_x8(t, dx.data(), dw.data(), dy, rows, n, eps, workspace.data(), st.s);
  } else {
    kernels::device::rmsnorm(dx.data(), dw.data(), dy, rows, n, eps, st.s);
    v = kernels::device::quantize_x8(t, dy, rows, n, workspace.data(), st.s);
  }
  y = download(in_place ? dx : other, rows * n, st.s);
  return download_x8(t, workspace, v, rows, n, st.s);
}

std::vector<token_id> argmax(const std::vector<float>& logits, std::size_t rows, std::size_t n) {
  stream st;
  auto dl = upload(logits, st.s);
  buffer<token_id> out(rows);
  kernels::device::argmax(dl.data(), rows, n, out.data(), st.s);
  return download(out, rows, st.s);
}

std::vector<token_id> sample(const std::vector<float>& logits, std::size_t rows, std::size_t n,
                             const std::vector<kernels::sample_params>& params) {
  stream st;
  auto dl = upload(logits, st.s);
  auto dp = upload(params, st.s);
  const std::size_t bytes = kernels::device::sample_workspace(rows, n);
  buffer<std::byte> workspace(bytes);
  buffer<token_id> out(rows);
  kernels::device::sample(dl.data(), rows, n, dp.data(), out.data(), workspace.data(), bytes, st.s);
  return download(out, rows, st.s);
}

std::vector<std::vector<float>> forward(const model::weights& w, dtype kv_type, std::size_t blocks,
                                        std::size_t block_size,
                                        const std::vector<std::vector<model::batch_item>>& passes,
                                        const forward_options& options) {
  using decoder = model::transformer<kernels::cuda>;
  kernels::cuda::context ctx;
  decoder m(w, options.products);
  m.set_graphs(options.graphs);
  if (options.tensor_cores_always) m.set_tensor_core_attention(decoder::tensor_cores::always);
  if (options.decode_attention == decode_kernel::rows) m.set_scalar_attention(kernels::device::attention_kernel::rows);
  if (options.decode_attention == decode_kernel::staged)
    m.set_scalar_attention(kernels::device::attention_kernel::staged);
  if (options.staged_attention) m.set_mma_attention(kernels::device::mma_attention::staged);
  kv::device_storage kv(w.cfg.layers, m.kv_layout(blocks, block_size), kv_type);
  std::vector<std::vector<float>> out;
  for (const auto& items : passes) m.forward(ctx, kv, items, out.emplace_back());
  if (options.stats != nullptr) *options.stats = {m.graph_direct(), m.graph_captures(), m.graph_replays(), 0};
  return out;
}

void graph_cache_steps(std::size_t capacity, const std::vector<std::size_t>& sizes,
                       std::vector<std::vector<float>>& graphed, std::vector<std::vector<float>>& eager,
                       graph_stats& stats) {
  stream st;
  const std::size_t most = *std::max_element(sizes.begin(), sizes.end());
  std::vector<float> x(most), b(most);
  for (std::size_t i = 0; i < most; ++i) x[i] = 0.01f * static_cast<float>(i % 97) - 0.4f, b[i] = 0.003f * static_cast<float>(i % 13);
  auto dx = upload(x, st.s), db = upload(b, st.s);
  buffer<float> dy(most);
  kernels::device::graph_cache<std::size_t> cache(capacity);
  for (const bool graphs : {true, false})
    for (const std::size_t n : sizes) {
      dy.upload(x.data(), n, st.s);
      const auto work = [&] {
        kernels::device::add_bias(dy.data(), db.data(), 1, n, st.s);
        kernels::device::swiglu(dy.data(), dx.data(), dy.data(), n, st.s);
      };
      if (graphs)
        cache.run(n, st.s, work);
      else
        work();
      (graphs ? graphed : eager).push_back(download(dy, n, st.s));
    }
  stats = {cache.direct(), cache.captures(), cache.replays(), cache.updates()};
}

std::vector<engine::completion> complete_each(const model::weights& w, const engine::pipeline_options& options,
                                              const std::vector<engine::request>& requests) {
  using pipeline = engine::pipeline<prompt::efim_format, cache::xxh3_128_chain, cache::lru, text::at_boundaries,
                                    kernels::cuda>;
  pipeline p(text::byte_tokenizer(prompt::qwen25_coder.special_tokens()), w, options);
  std::vector<engine::completion> out;
  for (const auto& r : requests) {
    auto& done = out.emplace_back();
    p.submit(r, {{}, [&](engine::completion&& c) { done = std::move(c); }});
    p.run();
  }
  return out;
}

}  // namespace efim::test_cuda
