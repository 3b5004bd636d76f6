#pragma once
// Prefill attention on tensor cores (paged_attention_mma): the causal attention of paged_attention
// (attention.cuh) for steps with many query rows, with the two products of each 16-key chunk on the
// tensor cores (WMMA, 16 x 16 x 16, f16 in, f32 accumulated) and the online softmax between them.
//
// A tile is up to Policy::rows (token, head) rows of one sequence that read one KV head (the host's
// tiles, planned with more rows: attention_plan.hpp); one thread block per tile, each warp taking 16
// of its rows through every key its rows can see:
//   S = Q K^T: the rows' queries (rounded to f16 once, in shared memory) against a chunk of 16 keys,
//     read in place from the f16 cache (K is (block, kv_head, dim, slot): a (dim, slot) page is the
//     product's second operand as stored, 16 dimensions at a time);
//   softmax: S scaled and masked (a row sees the keys up to its own position), each row's running
//     maximum and sum updated as in attention.cuh (two lanes a row), P = exp(S - max) rounded to f16;
//   O = O * factor + P V: the running output rows in shared memory (f32), rescaled per row, then P
//     times the chunk's values (V is (block, kv_head, slot, dim): a (slot, dim) page as stored) added
//     into them on the tensor cores, 16 dimensions at a time.
// The rounding of Q and P to f16 is the difference from the scalar kernel (which widens f16 K and V
// and keeps Q and P in f32): the results agree with the host kernel within that rounding. For f16
// caches whose block size and head size are multiples of 16 (head size up to 256); the transformer
// takes it for prefill steps with enough tiles to fill the GPU, the scalar kernel (with split-K) for
// the rest.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "efim/core/float16.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kv/layout.hpp"

namespace efim::kernels::device {

namespace policy {
struct attention_mma {
  static constexpr int warps = 4;
  static constexpr int threads = warps * 32;
  static constexpr int rows = 16 * warps;  // (token, head) rows per tile: 16 per warp
  static constexpr int max_head_dim = 256;
};
}  // namespace policy

// Whether paged_attention_mma takes caches of this layout (f16 elements are the caller's to check).
constexpr bool attention_mma_fits(const kv::paged_layout& l) noexcept {
  return l.block_size % 16 == 0 && l.block_size > 0 && l.head_dim % 16 == 0 && l.head_dim > 0 &&
         l.head_dim <= static_cast<std::size_t>(policy::attention_mma::max_head_dim);
}

namespace agent {

template <class Policy>
struct attention_mma {
  static constexpr int W = Policy::warps, R = Policy::rows;
  static constexpr int pad = 8;  // halves after each query row in shared memory (ld a multiple of 8)

  // Dynamic shared memory: the tile's queries in f16 (R rows of hd + pad), then per warp its output
  // rows in f32 (16 x hd), a chunk of values in f16 (16 x hd, for a sequence's last chunk), its scores
  // (16 x 16 f32), its P (16 x 16 f16) and its rows' factors (16 f32). Each part starts 32-byte aligned.
  static constexpr std::size_t q_at = 0;
  static constexpr std::size_t o_at(std::size_t hd) noexcept { return R * (hd + pad) * 2; }
  static constexpr std::size_t v_at(std::size_t hd) noexcept { return o_at(hd) + W * 16 * hd * 4; }
  static constexpr std::size_t s_at(std::size_t hd) noexcept { return v_at(hd) + W * 16 * hd * 2; }
  static constexpr std::size_t p_at(std::size_t hd) noexcept { return s_at(hd) + W * 16 * 16 * 4; }
  static constexpr std::size_t f_at(std::size_t hd) noexcept { return p_at(hd) + W * 16 * 16 * 2; }
  static constexpr std::size_t shared_bytes(std::size_t hd) noexcept { return f_at(hd) + W * 16 * 4; }

  // k_cache, v_cache: the f16 caches (efim::half's bits) as CUDA's __half.
  __device__ static void run(unsigned char* shared, const kv::paged_layout& l, const __half* k_cache,
                             const __half* v_cache, const float* q, float* out, const block_id* table,
                             const attention_tile& tile, position first_pos, std::size_t heads, float scale) {
    namespace wmma = nvcuda::wmma;
    const int rows = static_cast<int>(tile.tokens * tile.heads);
    const std::size_t hd = l.head_dim, bs = l.block_size, ldq = hd + pad;
    const std::size_t g = tile.first_head / (heads / l.kv_heads);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

    auto* q_sh = reinterpret_cast<__half*>(shared + q_at);                       // (R, ldq)
    float* o_sh = reinterpret_cast<float*>(shared + o_at(hd)) + warp * 16 * hd;  // (16, hd): this warp's
    __half* v_sh = reinterpret_cast<__half*>(shared + v_at(hd)) + warp * 16 * hd;    // (16, hd)
    float* s_sh = reinterpret_cast<float*>(shared + s_at(hd)) + warp * 256;      // (16, 16)
    __half* p_sh = reinterpret_cast<__half*>(shared + p_at(hd)) + warp * 256;        // (16, 16)
    float* f_sh = reinterpret_cast<float*>(shared + f_at(hd)) + warp * 16;       // (16)

    const auto row_index = [&](int r) {  // (token, head) of row r, as an index into q and out
      const std::size_t t = tile.first_token + static_cast<std::size_t>(r) / tile.heads;
      const std::size_t h = tile.first_head + static_cast<std::size_t>(r) % tile.heads;
      return t * heads + h;
    };
    for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(R) * hd; i += Policy::threads) {
      const int r = static_cast<int>(i / hd);
      const std::size_t d = i % hd;
      q_sh[static_cast<std::size_t>(r) * ldq + d] = __float2half_rn(r < rows ? q[row_index(r) * hd + d] : 0.0f);
    }
    for (std::size_t i = static_cast<std::size_t>(lane); i < 16 * hd; i += 32) o_sh[i] = 0.0f;
    __syncthreads();

    const int first_row = 16 * warp;
    if (first_row >= rows) return;  // a warp with no rows (the block's last sync is behind it)
    const int last_row = rows - 1 < first_row + 15 ? rows - 1 : first_row + 15;
    // Keys the warp's rows see: up to the position of its last row's token.
    const std::size_t keys = static_cast<std::size_t>(first_pos) + static_cast<std::size_t>(last_row) / tile.heads + 1;

    // Lane pair (2 i, 2 i + 1) keeps row first_row + i's running maximum and sum, and takes its scores
    // 8 j .. 8 j + 7 of each chunk (j = lane % 2).
    const int my_row = lane / 2, my_cols = 8 * (lane % 2);
    const int tile_row = first_row + my_row;
    const bool real = tile_row < rows;
    const std::size_t visible = real ? static_cast<std::size_t>(first_pos) + static_cast<std::size_t>(tile_row) / tile.heads + 1 : 0;
    float m = -INFINITY, sum = 0.0f;

    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    for (std::size_t first_key = 0; first_key < keys; first_key += 16) {
      const std::size_t page = first_key / bs, slot = first_key % bs;
      const std::size_t block = static_cast<std::size_t>(table[page]);
      const __half* k_page = k_cache + l.key_offset(block, g);  // (hd, bs)
      const __half* v_page = v_cache + l.offset(block, g, 0);   // (bs, hd)

      // S = Q K^T for 16 keys.
      wmma::fill_fragment(c, 0.0f);
      for (std::size_t d = 0; d < hd; d += 16) {
        wmma::load_matrix_sync(a, q_sh + static_cast<std::size_t>(first_row) * ldq + d, static_cast<unsigned>(ldq));
        wmma::load_matrix_sync(b, k_page + d * bs + slot, static_cast<unsigned>(bs));
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(s_sh, c, 16, wmma::mem_row_major);
      __syncwarp();

      // The online softmax of the chunk, two lanes a row.
      float s[8], top = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const std::size_t key = first_key + static_cast<std::size_t>(my_cols + j);
        s[j] = key < visible ? s_sh[my_row * 16 + my_cols + j] * scale : -INFINITY;
        top = fmaxf(top, s[j]);
      }
      top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, 1));
      const float next = fmaxf(m, top);
      const float factor = m == -INFINITY ? 0.0f : expf(m - next);
      float chunk = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // (the sum of the weights as P V takes them: rounded to f16)
        const __half p = __float2half_rn(s[j] == -INFINITY ? 0.0f : expf(s[j] - next));
        chunk += __half2float(p);
        p_sh[my_row * 16 + my_cols + j] = p;
      }
      chunk += __shfl_xor_sync(0xFFFFFFFFu, chunk, 1);
      if (next != -INFINITY) {
        sum = fmaf(sum, factor, chunk);
        m = next;
      }
      if (lane % 2 == 0) f_sh[my_row] = next == -INFINITY ? 1.0f : factor;  // (no key yet: O is 0 anyway)
      __syncwarp();

      // O = O * factor + P V, 16 dimensions at a time. In the last chunk of the warp's keys the slots
      // past them may hold anything (a page's unwritten or reused slots): P is 0 there, but 0 times an
      // infinity is not, so that chunk's values are copied with those slots zeroed.
      const __half* values = v_page + slot * hd;
      if (first_key + 16 > keys) {
        const std::size_t valid = keys - first_key;
        for (std::size_t i = static_cast<std::size_t>(lane); i < 16 * hd; i += 32)
          v_sh[i] = i / hd < valid ? values[i] : __float2half_rn(0.0f);
        values = v_sh;
      }
      for (std::size_t i = static_cast<std::size_t>(lane); i < 16 * hd; i += 32) o_sh[i] *= f_sh[i / hd];
      __syncwarp();
      wmma::load_matrix_sync(a, p_sh, 16);
      for (std::size_t d = 0; d < hd; d += 16) {
        wmma::load_matrix_sync(c, o_sh + d, static_cast<unsigned>(hd), wmma::mem_row_major);
        wmma::load_matrix_sync(b, values + d, static_cast<unsigned>(hd));
        wmma::mma_sync(c, a, b, c);
        wmma::store_matrix_sync(o_sh + d, c, static_cast<unsigned>(hd), wmma::mem_row_major);
      }
      __syncwarp();
    }

    // The warp's rows: O / sum (each lane pair shares its row's sum).
    for (int r = 0; r < 16; ++r) {
      const float total = __shfl_sync(0xFFFFFFFFu, sum, 2 * r);
      if (first_row + r >= rows) break;
      float* dst = out + row_index(first_row + r) * hd;
      for (std::size_t d = static_cast<std::size_t>(lane); d < hd; d += 32) dst[d] = o_sh[static_cast<std::size_t>(r) * hd + d] / total;
    }
  }
};

}  // namespace agent

namespace detail {

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    attention_mma_kernel(kv::paged_layout l, const half* k_cache, const half* v_cache, const float* q, float* out,
                         const block_id* tables, const attention_tile_ref* tiles, std::size_t heads, float scale) {
  extern __shared__ __align__(32) unsigned char shared_mma[];
  const attention_tile_ref t = tiles[blockIdx.x];
  agent::attention_mma<Policy>::run(shared_mma, l, reinterpret_cast<const __half*>(k_cache),
                                    reinterpret_cast<const __half*>(v_cache), q, out, tables + t.table, t.tile,
                                    t.first_pos, heads, scale);
}

}  // namespace detail

// Bytes of dynamic shared memory paged_attention_mma takes for heads of `head_dim` (above 48 KiB
// from a head size of 96: the launch opts in; 135 KiB at 256, more than some GPUs allow a block:
// the caller checks the device's opt-in limit).
template <class Policy = policy::attention_mma>
constexpr std::size_t attention_mma_shared_bytes(std::size_t head_dim) noexcept {
  return agent::attention_mma<Policy>::shared_bytes(head_dim);
}

// paged_attention with f16 caches on tensor cores: q, out (tokens, heads, head_dim) device rows; tables
// and tiles an attention_step's planned with Policy::rows rows per tile at most; the layout must fit
// (attention_mma_fits). No split-K: one block per tile walks every key its rows see.
template <class Policy = policy::attention_mma>
void paged_attention_mma(const kv::paged_layout& l, const half* k_cache, const half* v_cache, const float* q,
                         float* out, const block_id* tables, const attention_tile_ref* tiles, std::size_t n_tiles,
                         std::size_t heads, float scale, cudaStream_t stream = nullptr) {
  (void)query_group(heads, l.kv_heads);
  if (!attention_mma_fits(l))
    throw error(errc::invalid_argument, "device::paged_attention_mma: block size " + std::to_string(l.block_size) +
                                            " and head size " + std::to_string(l.head_dim) +
                                            " must be multiples of 16, the head size at most 256");
  if (n_tiles == 0) return;
  require(n_tiles <= 0x7FFFFFFFu, errc::invalid_argument, "device::paged_attention_mma: too many tiles");
  const std::size_t bytes = attention_mma_shared_bytes<Policy>(l.head_dim);
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(detail::attention_mma_kernel<Policy>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "paged_attention_mma: shared memory opt-in");
  detail::attention_mma_kernel<Policy><<<static_cast<unsigned>(n_tiles), Policy::threads, bytes, stream>>>(
      l, k_cache, v_cache, q, out, tables, tiles, heads, scale);
  check(cudaGetLastError(), "paged_attention_mma launch");
}

}  // namespace efim::kernels::device
