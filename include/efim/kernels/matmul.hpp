#pragma once
// y = x * w^T on the host: x (m, k) f32 row-major, w (n, k) row-major in any efim::dtype (one output
// feature per row, as GGUF stores it). Every output element is one canonical dot product, detail::dot
// of the x row and the dequantized w row (dequantization is exact in f32), so a row's result does not
// depend on how many rows are in the batch, on the tile, on the path below, nor on the thread.
//
// The bodies are in impl/matmul.inl, one copy per instruction-set path (targets.hpp):
// - AVX-512: decode (m <= 8; f16 and bf16 up to 64 rows, f32 up to 48: stream_rows_bound) streams the
//   weights as stored, dequantized in registers, the next block of rows prefetched, in 4 x 4, 2 x 8 or
//   1 x 8 tiles, one run of rows per thread; prefill (more rows) dequantizes a panel of weight rows once
//   into a per-thread aligned f32 scratch reused by every 4-row tile of x through a 4 x 4 register tile,
//   long rows in column ranges. Both reduce 16 accumulators' lanes at once with a transpose-and-add
//   network that adds the same pairs in the same order as reduce_lanes. One decode row of every type
//   that unpacks no nibbles (f32, f16, bf16, q8_0) takes the AVX2 path's four streams on AMD CPUs
//   (decode_tiles: same bits, faster there). Block-quantized rows are read in groups of 32 (a block, or
//   an eighth of a k-quant super-block); k-quant decode goes a super-block at a time, its scales widened
//   once (and q5_k / q6_k quants staged as bytes).
// - AVX2 + FMA + F16C: the same structure with each 16-lane sum in two ymm registers (lanes 0-7 and
//   8-15); 2 x 2 decode tiles, one row alone in 1 x 1 tiles (1 x 4 for the nibble types); prefill in 4 x
//   3 tiles that run over lanes 0-7 and then 8-15 (12 sums in registers at a time), f16 weights read
//   where they are stored and widened in registers.
// - generic: each panel dequantized, then multiplied by dot_tile (GCC vectors).
// With products::int8 (impl/matmul_q8.inl): up to 12 x rows (rows interleaved: up to il8_stream_rows,
// 16-256 by type and form), 8 weight rows at a time are streamed, each super-block unpacked in 256-bit
// registers (VPMADDUBSW, then VPDPWSSD by the scales where the CPU has VNNI, else VPMADDWD), the 8 rows'
// sums added across in one network; for more x rows AVX-512 VNNI packs panels of 32 weight rows, AVX2
// (and AVX-512 without VNNI) panels of 8 rows side by side in 256-bit registers; generic is the
// one-output-at-a-time reference. All give the reference's bits. The types of 32-weight blocks
// (impl/matmul_q8_32.inl) stream 8 weight rows at a time for up to 12 x rows (interleaved: 64 on the
// AVX-512 path with VNNI, 24 with AMX, else 256) and pack panels for more: of 32 rows in 512-bit registers with
// AVX-512 VNNI, else of 8 rows in 256-bit registers with VPDPBUSD where the CPU has VNNI, else VPMADDUBSW.
// q8_0, q4_0 and the k-quants' matrices may have 8 rows interleaved (weight_layout::interleaved8,
// interleave.hpp): decode then reads them in order, a row's sums in a lane of their own; the same bits.
// So may f16 and bf16 ones: the AVX-512 path's decode reads them in order in 1 x 8, 2 x 8 and 3 x 8
// tiles, the next blocks prefetched a fixed distance ahead, and its prefill takes the panels' rows
// from them; the other paths put the rows back in order first (reads_interleaved_floats).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/kquants.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/interleave.hpp"
#include "efim/kernels/simd.hpp"
#include "efim/kernels/targets.hpp"

namespace efim::kernels {

// Whether matmul with products::int8 multiplies weights of type t in integers (else exactly): the
// k-quants against activations rounded per 256 (llama.cpp's q8_K), the types of 32-weight blocks
// against activations rounded per 32 (its q8_0 / q8_1).
constexpr bool int8_products_32(dtype t) noexcept {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q5_0 || t == dtype::q5_1;
}
constexpr bool int8_products(dtype t) noexcept {
  return t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k || int8_products_32(t);
}

// Whether path i's exact products read f16 and bf16 rows interleaved (interleave.hpp) where they are;
// the other paths put them back in order at every product (correct, and a pass over the matrix).
constexpr bool reads_interleaved_floats(isa i) noexcept { return i == isa::avx512; }

// Whether the host backend's models (model::transformer with weight_layout::interleaved8) interleave
// their f16 and bf16 matrices: where the active path reads them so, on CPUs other than AMD's. Which is
// faster depends on the memory system: on an Emerald Rapids Xeon the 8 rows interleaved, read as one
// stream with software prefetch, read 1.19x the rows as stored in a read loop; on a Zen 5 EPYC a decode
// step ran at 0.65-0.75x the rows as stored, with or without software prefetch at any distance tried
// (docs/benchmarks.md). EFIM_INTERLEAVE_FLOATS=1 or 0 (read once), or select_interleave_floats, takes
// one or the other on any CPU whose path reads them.
namespace detail {
inline std::atomic<int>& interleave_floats_choice() noexcept {  // -1: by vendor, 0: no, 1: yes
  static std::atomic<int> choice{[] {
    const char* v = std::getenv("EFIM_INTERLEAVE_FLOATS");
    const std::string_view want = v == nullptr ? std::string_view{} : std::string_view(v);
    return want == "1" ? 1 : want == "0" ? 0 : -1;
  }()};
  return choice;
}
}  // namespace detail
inline bool interleave_floats_by_default() noexcept {
  const int choice = detail::interleave_floats_choice().load(std::memory_order_relaxed);
  return reads_interleaved_floats(active_isa()) && (choice >= 0 ? choice == 1 : !amd_cpu());
}
// Sets the choice (1 or 0; -1: by vendor) for models made from now on; returns the one before.
inline int select_interleave_floats(int choice) noexcept {
  return detail::interleave_floats_choice().exchange(choice < 0 ? -1 : choice > 0 ? 1 : 0, std::memory_order_relaxed);
}

// y (m, rows) = [y +] x (m, cols) * dequantize(w)^T, split by output columns over the pool. Exact
// products: each y[i][j] equals detail::dot(x row i, dequantize_row(w row j), cols) bit for bit. int8
// products (int8_products(w.type)): x row i is rounded to 8 bits per 256 (kquant::quantize into a
// block_q8_k), and y[i][j] is detail::isa_generic::matmul_int8_reference's sum bit for bit (integer
// sums per super-block, then one float step each, in order); for the types of 32-weight blocks, per
// 32 (kquant::block_q8_32) and detail::isa_generic::matmul_q32_reference's sum (per block).
inline void matmul(thread_pool& pool, const float* x, const weight_view& w, float* y, std::size_t m,
                   accumulate acc = accumulate::no, products p = products::exact) {
  (void)row_bytes(w.type, w.cols);  // throws unless a row is a whole number of blocks
  require(w.layout == weight_layout::rows || interleavable(w.type, w.cols), errc::invalid_argument,
          "matmul: only q8_0, q4_0, q4_k, q5_k and q6_k matrices, and f16 and bf16 ones with rows a multiple of 16 "
          "long, have interleaved rows, not " +
              std::string(to_string(w.type)) + " with rows " + std::to_string(w.cols) + " long");
  if (m == 0 || w.rows == 0) return;
  // Interleaved rows (interleave.hpp): the int8 products stream them (decode), and each path's exact
  // products of f16 and bf16 take them (the AVX-512 path's stream them); the rest as stored.
  if (w.layout == weight_layout::interleaved8 && !(p == products::int8 && int8_products(w.type)) &&
      !interleavable_floats(w.type))
    return matmul(pool, x, detail::as_stored(pool, w), y, m, acc, p);
  if (p == products::int8 && int8_products_32(w.type)) {
    const std::size_t nb = w.cols / 32;
    thread_local std::vector<kquant::block_q8_32> buffer;  // the caller's: the workers see it through xq
    if (buffer.size() < m * nb) buffer.resize(m * nb);
    kquant::block_q8_32* const xq = buffer.data();
    pool.parallel_for(m * nb, [&](std::size_t b, std::size_t e) {
      EFIM_KERNELS_DISPATCH(quantize_q8_32(x + b * 32, e - b, xq + b));
    });
    EFIM_KERNELS_DISPATCH(matmul_int8_32(pool, xq, w, y, m, acc, int8_dot_for(active_isa())));
    return;
  }
  if (p == products::int8 && int8_products(w.type)) {
    const std::size_t nsb = w.cols / qk_k;
    thread_local std::vector<kquant::block_q8_k> buffer;  // the caller's: the workers see it through xq
    if (buffer.size() < m * nsb) buffer.resize(m * nsb);
    kquant::block_q8_k* const xq = buffer.data();
    pool.parallel_for(m * nsb, [&](std::size_t b, std::size_t e) {
      EFIM_KERNELS_DISPATCH(quantize_q8_k(x + b * qk_k, e - b, xq + b));
    });
    EFIM_KERNELS_DISPATCH(matmul_int8(pool, xq, w, y, m, acc, int8_dot_for(active_isa())));
    return;
  }
  EFIM_KERNELS_DISPATCH(matmul(pool, x, w, y, m, acc));
}

// y (m, n) = [y +] x (m, k) * w (n, k)^T for f32 weights.
inline void matmul(thread_pool& pool, const float* x, const float* w, float* y, std::size_t m, std::size_t n,
                   std::size_t k, accumulate acc = accumulate::no) {
  matmul(pool, x, weight_view{dtype::f32, n, k, reinterpret_cast<const std::byte*>(w)}, y, m, acc);
}

}  // namespace efim::kernels
