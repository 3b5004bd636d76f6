#pragma once
// Causal attention over paged KV on the CUDA backend, for prefill (with cached context) and decode in
// one kernel, in CUB's layers. The layout is the host's (kv::paged_layout): K is (block, kv_head,
// dim, slot), slot contiguous, so the 32 lanes of a warp read 32 slots of one dimension in one
// coalesced load and each lane scores its own key; V is (block, kv_head, slot, dim), dim contiguous,
// so the lanes read one value row together and each lane accumulates its own dimensions.
//
// The work is cut as on the host (attention_plan.hpp): one thread block per tile, up to
// Policy::rows (token, head) rows of one sequence that read the same KV head, so every K and V
// element loaded serves all of them (a decode step's grouped query heads; a prefill chunk's
// consecutive tokens). The block's warps take the sequence's pages in turn, each keeping a running
// maximum, sum and weighted sum of values per row (online softmax) in registers; the warps' partial
// results are merged in shared memory at the end. Scores and sums are in f32; f16 caches are
// widened as they are loaded. The order of the sums is not the host's, so results agree with the
// host kernel within f32 rounding, not bit for bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "efim/core/dtype.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kv/layout.hpp"

namespace efim::kernels::device {

namespace policy {
struct attention {
  static constexpr int warps = 4;
  static constexpr int threads = warps * 32;
  static constexpr int rows = 8;      // (token, head) rows per tile: the host's detail::max_rows
  static constexpr int lane_dims = 8;  // dimensions per lane: head_dim <= 256
};
}  // namespace policy

namespace detail {

__device__ inline float load(const float& x) { return x; }
__device__ inline float load(const half& x) { return __half2float(__ushort_as_half(x.bits)); }

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

}  // namespace detail

namespace agent {

template <class Policy, class E>
struct attention {
  static constexpr int R = Policy::rows, D = Policy::lane_dims, W = Policy::warps;

  // Dynamic shared memory: the rows' queries, then each warp's maxima, sums and weighted sums.
  static constexpr std::size_t shared_bytes(std::size_t rows, std::size_t head_dim) noexcept {
    return (rows * head_dim + W * rows * (head_dim + 2)) * sizeof(float);
  }

  __device__ static void run(float* shared, const kv::paged_layout& l, const E* k_cache, const E* v_cache,
                             const float* q, float* out, const block_id* table, const attention_tile& tile,
                             position first_pos, std::size_t heads, float scale) {
    const int rows = static_cast<int>(tile.tokens * tile.heads);
    const std::size_t hd = l.head_dim, bs = l.block_size;
    const std::size_t g = tile.first_head / (heads / l.kv_heads);
    float* q_sh = shared;                                   // (rows, hd)
    float* m_sh = q_sh + static_cast<std::size_t>(rows) * hd;  // (W, rows)
    float* l_sh = m_sh + W * rows;                          // (W, rows)
    float* acc_sh = l_sh + W * rows;                        // (W, rows, hd)
    const auto row_index = [&](int r) {  // (token, head) of row r, as an index into q and out
      const std::size_t t = tile.first_token + static_cast<std::size_t>(r) / tile.heads;
      const std::size_t h = tile.first_head + static_cast<std::size_t>(r) % tile.heads;
      return t * heads + h;
    };
    for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(rows) * hd; i += Policy::threads)
      q_sh[i] = q[row_index(static_cast<int>(i / hd)) * hd + i % hd];
    __syncthreads();

    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const std::size_t longest = static_cast<std::size_t>(first_pos) + tile.tokens;  // keys of the last row
    const std::size_t pages = (longest + bs - 1) / bs;
    float m[R], sum[R], acc[R][D];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m[r] = -INFINITY;
      sum[r] = 0.0f;
#pragma unroll
      for (int i = 0; i < D; ++i) acc[r][i] = 0.0f;
    }

    for (std::size_t page = static_cast<std::size_t>(warp); page < pages; page += W) {
      const std::size_t block = static_cast<std::size_t>(table[page]);
      const E* keys = k_cache + l.key_offset(block, g);
      const E* values = v_cache + l.offset(block, g, 0);
      for (std::size_t c = 0; c < bs && page * bs + c < longest; c += 32) {
        const std::size_t slot = c + static_cast<std::size_t>(lane), key = page * bs + slot;
        const bool present = slot < bs && key < longest;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.0f;
        if (present)
          for (std::size_t d = 0; d < hd; ++d) {
            const float k = detail::load(keys[d * bs + slot]);
#pragma unroll
            for (int r = 0; r < R; ++r)
              if (r < rows) s[r] = fmaf(q_sh[static_cast<std::size_t>(r) * hd + d], k, s[r]);
          }
        float p[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          p[r] = 0.0f;
          if (r >= rows) continue;  // (uniform across the warp: the shuffles below stay converged)
          const std::size_t visible = static_cast<std::size_t>(first_pos) + static_cast<std::size_t>(r) / tile.heads + 1;
          const float score = present && key < visible ? s[r] * scale : -INFINITY;
          const float top = detail::warp_max(score);
          if (top == -INFINITY) continue;  // no key of this chunk is visible to row r
          const float next = fmaxf(m[r], top);
          const float factor = m[r] == -INFINITY ? 0.0f : expf(m[r] - next);
          p[r] = score == -INFINITY ? 0.0f : expf(score - next);
          sum[r] = fmaf(sum[r], factor, detail::warp_sum(p[r]));
#pragma unroll
          for (int i = 0; i < D; ++i) acc[r][i] *= factor;
          m[r] = next;
        }
        const std::size_t left = longest - page * bs - c, n = left < 32 ? left : 32;
        const std::size_t valid = bs - c < n ? bs - c : n;
        for (std::size_t j = 0; j < valid; ++j) {
          float v[D];
#pragma unroll
          for (int i = 0; i < D; ++i) {
            const std::size_t d = static_cast<std::size_t>(lane + 32 * i);
            v[i] = d < hd ? detail::load(values[(c + j) * hd + d]) : 0.0f;
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r >= rows) continue;
            const float pj = __shfl_sync(0xFFFFFFFFu, p[r], static_cast<int>(j));
#pragma unroll
            for (int i = 0; i < D; ++i) acc[r][i] = fmaf(pj, v[i], acc[r][i]);
          }
        }
      }
    }

    // Each warp's partial rows into shared memory, then one pass merges them.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows) continue;
      if (lane == 0) {
        m_sh[warp * rows + r] = m[r];
        l_sh[warp * rows + r] = sum[r];
      }
#pragma unroll
      for (int i = 0; i < D; ++i) {
        const std::size_t d = static_cast<std::size_t>(lane + 32 * i);
        if (d < hd) acc_sh[(static_cast<std::size_t>(warp * rows + r)) * hd + d] = acc[r][i];
      }
    }
    __syncthreads();
    for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(rows) * hd; i += Policy::threads) {
      const int r = static_cast<int>(i / hd);
      const std::size_t d = i % hd;
      float top = -INFINITY;
      for (int w = 0; w < W; ++w) top = fmaxf(top, m_sh[w * rows + r]);
      float total = 0.0f, value = 0.0f;
      for (int w = 0; w < W; ++w) {
        const float mw = m_sh[w * rows + r];
        if (mw == -INFINITY) continue;  // a warp that saw no key of this row
        const float f = expf(mw - top);
        total = fmaf(l_sh[w * rows + r], f, total);
        value = fmaf(acc_sh[static_cast<std::size_t>(w * rows + r) * hd + d], f, value);
      }
      out[row_index(r) * hd + d] = value / total;
    }
  }
};

}  // namespace agent

namespace detail {

template <class Policy, class E>
__global__ void __launch_bounds__(Policy::threads)
    attention_kernel(kv::paged_layout l, const E* k_cache, const E* v_cache, const float* q, float* out,
                     const block_id* tables, const attention_tile_ref* tiles, std::size_t heads, float scale) {
  extern __shared__ float shared[];
  const attention_tile_ref t = tiles[blockIdx.x];
  agent::attention<Policy, E>::run(shared, l, k_cache, v_cache, q, out, tables + t.table, t.tile, t.first_pos, heads,
                                   scale);
}

}  // namespace detail

// Bytes of dynamic shared memory a launch needs for heads of `head_dim` (at most 48 KiB: no opt-in).
template <class Policy = policy::attention>
constexpr std::size_t attention_shared_bytes(std::size_t head_dim) noexcept {
  return agent::attention<Policy, float>::shared_bytes(Policy::rows, head_dim);
}

// q, out: (tokens, heads, head_dim) device rows; tables and tiles: an attention_step's, planned with
// Policy::rows rows per tile at most. Query head h reads KV head h / (heads / kv_heads). E is float or half.
template <class E, class Policy = policy::attention>
void paged_attention(const kv::paged_layout& l, const E* k_cache, const E* v_cache, const float* q, float* out,
                     const block_id* tables, const attention_tile_ref* tiles, std::size_t n_tiles, std::size_t heads,
                     float scale, cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, half>, "KV elements are float or half");
  static_assert(attention_shared_bytes<Policy>(32 * Policy::lane_dims) <= 48 * 1024, "the policy needs opt-in memory");
  (void)query_group(heads, l.kv_heads);
  if (l.head_dim > 32 * static_cast<std::size_t>(Policy::lane_dims))
    throw error(errc::invalid_argument, "device::paged_attention: head_dim " + std::to_string(l.head_dim) +
                                            " is above the policy's " + std::to_string(32 * Policy::lane_dims));
  if (n_tiles == 0) return;
  require(n_tiles <= 0x7FFFFFFFu, errc::invalid_argument, "device::paged_attention: too many tiles");
  detail::attention_kernel<Policy, E>
      <<<static_cast<unsigned>(n_tiles), Policy::threads, attention_shared_bytes<Policy>(l.head_dim), stream>>>(
          l, k_cache, v_cache, q, out, tables, tiles, heads, scale);
  check(cudaGetLastError(), "paged_attention launch");
}

}  // namespace efim::kernels::device
