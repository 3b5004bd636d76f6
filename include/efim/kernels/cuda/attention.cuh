#pragma once
// Causal attention over paged KV on the CUDA backend, for prefill (with cached context) and decode in
// one kernel, in CUB's layers. The layout is the host's (kv::paged_layout): K is (block, kv_head,
// dim, slot), slot contiguous, so the 32 lanes of a warp read 32 slots of one dimension in one
// coalesced load and each lane scores its own key; V is (block, kv_head, slot, dim), dim contiguous,
// so the lanes read one value row together and each lane accumulates its own dimensions.
//
// The work is cut as on the host (attention_plan.hpp): up to Policy::rows (token, head) rows of one
// sequence that read the same KV head form a tile, so every K and V element loaded serves all of them
// (a decode step's grouped query heads; a prefill chunk's consecutive tokens). A tile's pages are cut
// into `splits` ranges (split-K, as flash-decoding does), one thread block per (tile, range): a decode
// step has few tiles, and one block per tile would leave most of the GPU idle while it walks the whole
// context. The block's warps take the range's pages in turn, each keeping a running maximum, sum and
// weighted sum of values per row (online softmax) in registers; the warps' partial results are merged
// in shared memory. With one range the block writes the rows; with more, each block writes its
// (maximum, sum, weighted sums) into a caller-owned workspace and a second kernel merges the ranges,
// or (given a counter per tile) the last of a tile's blocks to finish merges them in the same launch.
// Scores and sums are in f32; f16 caches are widened as they are loaded. The order of the sums is not
// the host's, so results agree with the host kernel within f32 rounding, not bit for bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
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
// The rows kernel (agent::attention_rows): the same tiles of up to `rows` rows (attention_plan's).
struct attention_rows {
  static constexpr int warps = 4;
  static constexpr int threads = warps * 32;
  static constexpr int rows = attention::rows;
  static constexpr int chunk = 32;          // keys a warp scores at once, a key a lane
  static constexpr int max_head_dim = 256;  // 8 dimensions a lane
};
}  // namespace policy

// Which kernel takes a decode step's attention: `pages` (agent::attention: a block's warps take its
// range's pages in turn, each through all of the tile's rows) or `rows` (agent::attention_rows: its
// warps take the tile's rows, each through all of the range's keys), both launched by paged_attention;
// or `staged` (attention_mma.cuh's agent::attention_staged, f16 caches only, launched by
// paged_attention_mma with the same tiles and cut: the range's keys staged in shared memory by all of a
// block's threads, the products on tensor cores). paged_attention itself runs the pages kernel for a
// `staged` plan.
enum class attention_kernel : std::uint8_t { pages, rows, staged };

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

// Rows' online-softmax state at its start: no key seen (maximum -inf, sums 0).
template <int N, int D>
__device__ inline void reset_rows(float (&m)[N], float (&sum)[N], float (&acc)[N][D]) {
#pragma unroll
  for (int r = 0; r < N; ++r) {
    m[r] = -INFINITY;
    sum[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < D; ++i) acc[r][i] = 0.0f;
  }
}

// One chunk of keys through a row's online softmax, the warp's lanes holding a key's score each (-inf
// where the row does not see it): the row's running maximum m, sum and weighted sums acc (the lane's
// D dimensions) rescaled to the chunk's new maximum; returns the lane's key's weight (0 where the
// chunk holds no key the row sees). Every lane of the warp calls it.
template <int D>
__device__ inline float online_softmax_step(float score, float& m, float& sum, float (&acc)[D]) {
  const float top = warp_max(score);
  if (top == -INFINITY) return 0.0f;  // (the same for every lane)
  const float next = fmaxf(m, top);
  const float factor = m == -INFINITY ? 0.0f : expf(m - next);
  const float p = score == -INFINITY ? 0.0f : expf(score - next);
  sum = fmaf(sum, factor, warp_sum(p));
#pragma unroll
  for (int i = 0; i < D; ++i) acc[i] *= factor;
  m = next;
  return p;
}

}  // namespace detail

namespace agent {

// Row r's dimension d of a tile from its `splits` ranges' partial results (slots of R * (hd + 2)
// floats from `first`: maxima, sums, weighted sums), each range's sums rescaled to the largest maximum;
// a range with no key visible to the row has maximum -inf, so its factor is 0. Read past L1 (__ldcg):
// with the merge folded into the attention kernel, other blocks wrote the slots during this launch.
template <int R>
__device__ inline float merge_ranges(const float* first, std::size_t splits, std::size_t r, std::size_t d,
                                     std::size_t hd) {
  const std::size_t stride = R * (hd + 2);
  float top = -INFINITY;
#pragma unroll 8
  for (std::size_t s = 0; s < splits; ++s) top = fmaxf(top, __ldcg(first + s * stride + r));
  float total = 0.0f, value = 0.0f;
#pragma unroll 4
  for (std::size_t s = 0; s < splits; ++s) {
    const float* slot = first + s * stride;
    const float f = expf(__ldcg(slot + r) - top);
    total = fmaf(__ldcg(slot + R + r), f, total);
    value = fmaf(__ldcg(slot + 2 * R + r * hd + d), f, value);
  }
  return value / total;
}

// (token, head) row r of a tile as an index into q and out (rows of head_dim values).
__device__ inline std::size_t tile_row(const attention_tile& tile, std::size_t heads, unsigned r) {
  const std::size_t t = tile.first_token + r / tile.heads, h = tile.first_head + r % tile.heads;
  return t * heads + h;
}

// The merge folded into the attention launch: after this block wrote its range's slot of `partial`,
// the tile's last block to finish (its counter, counted by every block after its slot is written and
// fenced) merges all ranges as the merge kernel does, then leaves the counter at 0 for the next
// launch. Every thread of the block calls it.
template <int R, int Threads>
__device__ inline void merge_if_last(const float* partial, unsigned* counters, float* out, const attention_tile& tile,
                                     std::size_t heads, int rows, std::size_t hd) {
  __shared__ unsigned is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // (after the barrier: the block's writes, as grid-wide synchronizations fence)
    is_last = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1 ? 1u : 0u;
  }
  __syncthreads();
  if (is_last == 0) return;
  __threadfence();
  const float* first = partial + static_cast<std::size_t>(blockIdx.x) * gridDim.y * R * (hd + 2);
  for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(rows) * hd; i += Threads) {
    const std::size_t r = i / hd, d = i % hd;
    out[tile_row(tile, heads, static_cast<unsigned>(r)) * hd + d] = merge_ranges<R>(first, gridDim.y, r, d, hd);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

template <class Policy, class E>
struct attention {
  static constexpr int R = Policy::rows, D = Policy::lane_dims, W = Policy::warps;

  // Dynamic shared memory: the rows' queries, then each warp's maxima, sums and weighted sums.
  static constexpr std::size_t shared_bytes(std::size_t rows, std::size_t head_dim) noexcept {
    return (rows * head_dim + W * rows * (head_dim + 2)) * sizeof(float);
  }

  __device__ static void run(float* shared, const kv::paged_layout& l, const E* k_cache, const E* v_cache,
                             const float* q, float* out, const block_id* table, const attention_tile& tile,
                             position first_pos, std::size_t heads, float scale, std::size_t pages_per_split,
                             float* partial, unsigned* counters) {
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
    const std::size_t all_pages = (longest + bs - 1) / bs;
    const std::size_t first_page = static_cast<std::size_t>(blockIdx.y) * pages_per_split;
    const std::size_t pages = first_page + pages_per_split < all_pages ? first_page + pages_per_split : all_pages;
    float m[R], sum[R], acc[R][D];
    detail::reset_rows(m, sum, acc);

    for (std::size_t page = first_page + static_cast<std::size_t>(warp); page < pages; page += W) {
      const std::size_t block = static_cast<std::size_t>(table[page]);
      const E* keys = k_cache + l.key_offset(block, g);
      const E* values = v_cache + l.offset(block, g, 0);
      for (std::size_t c = 0; c < bs && page * bs + c < longest; c += 32) {
        const std::size_t slot = c + static_cast<std::size_t>(lane), key = page * bs + slot;
        const bool present = slot < bs && key < longest;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.0f;
        if (present) {
#pragma unroll 8
          for (std::size_t d = 0; d < hd; ++d) {
            const float k = detail::load(keys[d * bs + slot]);
#pragma unroll
            for (int r = 0; r < R; ++r)
              if (r < rows) s[r] = fmaf(q_sh[static_cast<std::size_t>(r) * hd + d], k, s[r]);
          }
        }
        float p[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          p[r] = 0.0f;
          if (r >= rows) continue;  // (uniform across the warp: the shuffles below stay converged)
          const std::size_t visible = static_cast<std::size_t>(first_pos) + static_cast<std::size_t>(r) / tile.heads + 1;
          p[r] = detail::online_softmax_step(present && key < visible ? s[r] * scale : -INFINITY, m[r], sum[r], acc[r]);
        }
        const std::size_t left = longest - page * bs - c, n = left < 32 ? left : 32;
        const std::size_t valid = bs - c < n ? bs - c : n;
#pragma unroll 4
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

    // Each warp's partial rows into shared memory, then one pass merges them: into the output rows, or
    // with split-K into this range's slot of the workspace (a row that saw no key: maximum -inf, sums 0).
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
      if (partial == nullptr) {
        out[row_index(r) * hd + d] = value / total;
        continue;
      }
      float* slot = partial + (static_cast<std::size_t>(blockIdx.x) * gridDim.y + blockIdx.y) * R * (hd + 2);
      if (d == 0) {
        slot[r] = top;
        slot[R + r] = total;
      }
      slot[2 * R + static_cast<std::size_t>(r) * hd + d] = value;
    }
    if (partial != nullptr && counters != nullptr)
      merge_if_last<R, Policy::threads>(partial, counters, out, tile, heads, rows, hd);
  }
};

// The rows kernel (paged_attention with attention_kernel::rows): the same tiles and page ranges, cut
// the other way inside a block. A warp takes rows of the tile, not pages: warp w holds rows w,
// w + warps, ... (two of a tile's eight) through every key of the block's range, 32 keys at a time, a
// key a lane. A lane scores its key against the warp's rows (K read down its slot, the queries read
// four dimensions at a time from shared memory, where they are zero past head_dim); the warp's online
// softmax step then runs per row as in attention; and the chunk's values are read a row at a time by
// the whole warp, each lane holding D consecutive dimensions (one 4-, 8- or 16-byte load a row). A
// warp's rows are its own: no merge across warps, and no 64-bit division in the loops. Where a tile
// has fewer rows than half the warps (one or two: a decode step without grouped query heads), the
// warps sharing a row take its key chunks in turn and are merged in shared memory.
template <class Policy, class E, int D>
struct attention_rows {
  static constexpr int R = Policy::rows, W = Policy::warps, RW = (R + W - 1) / W;
  static_assert(Policy::chunk == 32, "a key a lane");
  static_assert(D == 2 || D == 4 || D == 8, "dimensions per lane: 2, 4 or 8");

  __host__ __device__ static constexpr std::size_t padded(std::size_t head_dim) noexcept {
    return (head_dim + 3) / 4 * 4;
  }
  // Dynamic shared memory: the rows' queries (R rows of padded(hd) floats), then, for warps sharing a
  // row, each warp's maximum, sum and weighted sums (W + W + W * hd floats).
  static constexpr std::size_t shared_bytes(std::size_t head_dim) noexcept {
    return (R * padded(head_dim) + 2 * W + W * head_dim) * sizeof(float);
  }

  // D consecutive elements of a value row from p (`valid` of them in the row), widened: one load
  // where they are whole and aligned (`aligned`: head_dim is a multiple of D), else one at a time.
  __device__ static void load_lane(const E* p, int valid, bool aligned, float (&v)[D]) {
    if (aligned && valid >= D) {
      if constexpr (std::is_same_v<E, half>) {
        std::uint32_t u[D / 2];
        if constexpr (D == 2) {
          u[0] = *reinterpret_cast<const std::uint32_t*>(p);
        } else if constexpr (D == 4) {
          const uint2 w = *reinterpret_cast<const uint2*>(p);
          u[0] = w.x, u[1] = w.y;
        } else {
          const uint4 w = *reinterpret_cast<const uint4*>(p);
          u[0] = w.x, u[1] = w.y, u[2] = w.z, u[3] = w.w;
        }
#pragma unroll
        for (int i = 0; i < D / 2; ++i) {  // (the lower half of a word first)
          v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[i] & 0xFFFFu)));
          v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[i] >> 16)));
        }
      } else if constexpr (D == 2) {
        const float2 f = *reinterpret_cast<const float2*>(p);
        v[0] = f.x, v[1] = f.y;
      } else {
#pragma unroll
        for (int i = 0; i < D; i += 4) {
          const float4 f = *reinterpret_cast<const float4*>(p + i);
          v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
        }
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < D; ++i) v[i] = i < valid ? detail::load(p[i]) : 0.0f;
  }

  __device__ static void run(float* shared, const kv::paged_layout& l, const E* k_cache, const E* v_cache,
                             const float* q, float* out, const block_id* table, const attention_tile& tile,
                             position first_pos, std::size_t heads, float scale, std::size_t pages_per_split,
                             float* partial, unsigned* counters) {
    const int rows = static_cast<int>(tile.tokens * tile.heads);
    const unsigned hd = static_cast<unsigned>(l.head_dim), hd4 = static_cast<unsigned>(padded(l.head_dim));
    const unsigned bs = static_cast<unsigned>(l.block_size);
    const std::size_t g = tile.first_head / (heads / l.kv_heads);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    // Warps per row: 4 for a tile of one row, 2 for two, else 1 (a row to a warp, RW rows at most).
    const int share = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    const int phase = warp % share, groups = W / share;
    const auto row_of = [&](int rr) { return warp / share + rr * groups; };
    float* q_sh = shared;                                    // (R, hd4)
    float* m_sh = q_sh + static_cast<std::size_t>(R) * hd4;  // (W)
    float* l_sh = m_sh + W;                                  // (W)
    float* acc_sh = l_sh + W;                                // (W, hd)

    // The rows' queries, each by the first warp holding it, zero past hd.
#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
      const int r = row_of(rr);
      if (r >= rows || phase != 0) continue;
      const float* from = q + tile_row(tile, heads, static_cast<unsigned>(r)) * hd;
      for (unsigned d = static_cast<unsigned>(lane); d < hd4; d += 32)
        q_sh[static_cast<unsigned>(r) * hd4 + d] = d < hd ? from[d] : 0.0f;
    }
    __syncthreads();

    // The block's keys: those of its range of pages that the tile's last row sees.
    const std::size_t longest = static_cast<std::size_t>(first_pos) + tile.tokens;
    const std::size_t all_pages = (longest + bs - 1) / bs;
    const std::size_t first_page = static_cast<std::size_t>(blockIdx.y) * pages_per_split;
    const std::size_t end_page = first_page + pages_per_split < all_pages ? first_page + pages_per_split : all_pages;
    const std::size_t end_key = end_page * bs < longest ? end_page * bs : longest;
    const bool aligned = hd % D == 0;
    const int lane_dims = static_cast<int>(hd) - lane * D;  // of this lane's D dimensions, those in a row
    const unsigned hd_main = hd & ~3u;

    float m[RW], sum[RW], acc[RW][D];
    detail::reset_rows(m, sum, acc);

    for (std::size_t base = first_page * bs + static_cast<std::size_t>(phase) * 32; base < end_key;
         base += static_cast<std::size_t>(share) * 32) {
      const std::size_t key = base + static_cast<std::size_t>(lane);
      const bool present = key < end_key;
      std::uint32_t v_row = 0;  // this lane's key's value row: (block, kv_head, slot) as one index
      float s[RW];
#pragma unroll
      for (int rr = 0; rr < RW; ++rr) s[rr] = 0.0f;
      if (present) {
        const std::size_t page = key / bs, slot = key - page * bs;
        const std::size_t block = static_cast<std::size_t>(table[page]);
        v_row = static_cast<std::uint32_t>((block * l.kv_heads + g) * bs + slot);
        const E* kp = k_cache + l.key_offset(block, g) + slot;
#pragma unroll 4
        for (unsigned d = 0; d < hd_main; d += 4) {
          const float k0 = detail::load(kp[static_cast<std::size_t>(d) * bs]);
          const float k1 = detail::load(kp[static_cast<std::size_t>(d + 1) * bs]);
          const float k2 = detail::load(kp[static_cast<std::size_t>(d + 2) * bs]);
          const float k3 = detail::load(kp[static_cast<std::size_t>(d + 3) * bs]);
#pragma unroll
          for (int rr = 0; rr < RW; ++rr) {
            if (row_of(rr) >= rows) continue;
            const float4 qv = *reinterpret_cast<const float4*>(q_sh + static_cast<unsigned>(row_of(rr)) * hd4 + d);
            s[rr] = fmaf(qv.x, k0, s[rr]);
            s[rr] = fmaf(qv.y, k1, s[rr]);
            s[rr] = fmaf(qv.z, k2, s[rr]);
            s[rr] = fmaf(qv.w, k3, s[rr]);
          }
        }
        for (unsigned d = hd_main; d < hd; ++d) {
          const float k = detail::load(kp[static_cast<std::size_t>(d) * bs]);
#pragma unroll
          for (int rr = 0; rr < RW; ++rr)
            if (row_of(rr) < rows) s[rr] = fmaf(q_sh[static_cast<unsigned>(row_of(rr)) * hd4 + d], k, s[rr]);
        }
      }
      float p[RW];
#pragma unroll
      for (int rr = 0; rr < RW; ++rr) {
        p[rr] = 0.0f;
        const int r = row_of(rr);
        if (r >= rows) continue;  // (uniform across the warp: the shuffles below stay converged)
        const std::size_t visible = static_cast<std::size_t>(first_pos) + static_cast<unsigned>(r) / tile.heads + 1;
        p[rr] =
            detail::online_softmax_step(present && key < visible ? s[rr] * scale : -INFINITY, m[rr], sum[rr], acc[rr]);
      }
      const unsigned n = end_key - base < 32 ? static_cast<unsigned>(end_key - base) : 32u;
#pragma unroll 4
      for (unsigned j = 0; j < n; ++j) {
        const std::uint32_t vr = __shfl_sync(0xFFFFFFFFu, v_row, static_cast<int>(j));
        float v[D];
        if (lane_dims > 0) {
          load_lane(v_cache + static_cast<std::size_t>(vr) * hd + static_cast<unsigned>(lane * D), lane_dims, aligned,
                    v);
        } else {
#pragma unroll
          for (int i = 0; i < D; ++i) v[i] = 0.0f;
        }
#pragma unroll
        for (int rr = 0; rr < RW; ++rr) {
          if (row_of(rr) >= rows) continue;
          const float pj = __shfl_sync(0xFFFFFFFFu, p[rr], static_cast<int>(j));
#pragma unroll
          for (int i = 0; i < D; ++i) acc[rr][i] = fmaf(pj, v[i], acc[rr][i]);
        }
      }
    }

    // Warps sharing a row (a tile of one or two rows: each warp holds at most one): their parts into
    // shared memory, merged by the first of them (its phase 0) as attention merges its warps.
    if (share > 1) {  // (uniform across the block)
      const int r = row_of(0);
      if (r < rows) {
        if (lane == 0) {
          m_sh[warp] = m[0];
          l_sh[warp] = sum[0];
        }
#pragma unroll
        for (int i = 0; i < D; ++i)
          if (i < lane_dims) acc_sh[static_cast<unsigned>(warp) * hd + static_cast<unsigned>(lane * D + i)] = acc[0][i];
      }
      __syncthreads();
      if (phase == 0 && r < rows) {
        float top = -INFINITY;
        for (int w = warp; w < warp + share; ++w) top = fmaxf(top, m_sh[w]);
        float total = 0.0f, value[D];
#pragma unroll
        for (int i = 0; i < D; ++i) value[i] = 0.0f;
        for (int w = warp; w < warp + share; ++w) {
          const float mw = m_sh[w];
          if (mw == -INFINITY) continue;  // a warp that saw no key of this row
          const float f = expf(mw - top);
          total = fmaf(l_sh[w], f, total);
#pragma unroll
          for (int i = 0; i < D; ++i)
            if (i < lane_dims)
              value[i] = fmaf(acc_sh[static_cast<unsigned>(w) * hd + static_cast<unsigned>(lane * D + i)], f, value[i]);
        }
        m[0] = top;
        sum[0] = total;
#pragma unroll
        for (int i = 0; i < D; ++i) acc[0][i] = value[i];
      }
    }

    // The rows out (one range), or into this range's slot of the workspace (a row that saw no key:
    // maximum -inf, sums 0), by the warps that hold them.
    if (phase == 0) {
      float* slot = partial == nullptr
                        ? nullptr
                        : partial + (static_cast<std::size_t>(blockIdx.x) * gridDim.y + blockIdx.y) * R * (hd + 2);
#pragma unroll
      for (int rr = 0; rr < RW; ++rr) {
        const int r = row_of(rr);
        if (r >= rows) continue;
        if (slot == nullptr) {
          float* to = out + tile_row(tile, heads, static_cast<unsigned>(r)) * hd;
#pragma unroll
          for (int i = 0; i < D; ++i)
            if (i < lane_dims) to[lane * D + i] = acc[rr][i] / sum[rr];
          continue;
        }
        if (lane == 0) {
          slot[r] = m[rr];
          slot[R + r] = sum[rr];
        }
#pragma unroll
        for (int i = 0; i < D; ++i)
          if (i < lane_dims)
            slot[2 * R + static_cast<std::size_t>(r) * hd + static_cast<unsigned>(lane * D + i)] = acc[rr][i];
      }
    }
    if (partial != nullptr && counters != nullptr)
      merge_if_last<R, Policy::threads>(partial, counters, out, tile, heads, rows, hd);
  }
};

// One tile's rows from its ranges' partial results, one (row, dimension) per thread (the grid's y
// covers a tile's rows): each range's sums rescaled to the largest maximum. A range with no key
// visible to the row has maximum -inf, so its factor is 0.
template <class Policy>
struct attention_merge {
  static constexpr int R = Policy::rows;
  __device__ static void run(const float* partial, std::size_t splits, float* out, const attention_tile& tile,
                             std::size_t heads, std::size_t hd) {
    const std::size_t rows = static_cast<std::size_t>(tile.tokens) * tile.heads;
    const std::size_t i = static_cast<std::size_t>(blockIdx.y) * Policy::threads + threadIdx.x;
    if (i >= rows * hd) return;
    const std::size_t r = i / hd, d = i % hd;
    const float* first = partial + static_cast<std::size_t>(blockIdx.x) * splits * R * (hd + 2);
    const std::size_t t = tile.first_token + r / tile.heads, h = tile.first_head + r % tile.heads;
    out[(t * heads + h) * hd + d] = merge_ranges<R>(first, splits, r, d, hd);
  }
};

}  // namespace agent

namespace detail {

// A block per (tile, page range) of the scalar kernels, Agent (agent::attention or attention_rows) of
// Threads threads.
template <class Agent, int Threads, class E>
__global__ void __launch_bounds__(Threads)
    attention_kernel(kv::paged_layout l, const E* k_cache, const E* v_cache, const float* q, float* out,
                     const block_id* tables, const attention_tile_ref* tiles, std::size_t heads, float scale,
                     std::size_t pages_per_split, float* partial, unsigned* counters) {
  extern __shared__ float shared[];
  const attention_tile_ref t = tiles[blockIdx.x];
  Agent::run(shared, l, k_cache, v_cache, q, out, tables + t.table, t.tile, t.first_pos, heads, scale, pages_per_split,
             partial, counters);
}

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    attention_merge_kernel(const float* partial, std::size_t splits, float* out, const attention_tile_ref* tiles,
                           std::size_t heads, std::size_t head_dim) {
  agent::attention_merge<Policy>::run(partial, splits, out, tiles[blockIdx.x].tile, heads, head_dim);
}

}  // namespace detail

// Bytes of dynamic shared memory a launch needs for heads of `head_dim` (at most 48 KiB: no opt-in).
template <class Policy = policy::attention>
constexpr std::size_t attention_shared_bytes(std::size_t head_dim) noexcept {
  return agent::attention<Policy, float>::shared_bytes(Policy::rows, head_dim);
}

// How a step's tiles are cut into page ranges: `splits` ranges of `pages` pages each (the last tile's
// range may run past its sequence: such a block finds no key and the merge skips it).
struct attention_split {
  std::size_t splits = 1, pages = 0;
  attention_kernel kernel = attention_kernel::pages;  // (the plan's; either kernel runs any cut)
};

// Cuts the pages of the longest tile (`longest` keys) so that the step has about `target_blocks`
// thread blocks (a few per multiprocessor), each range at least one page per warp where the context
// allows; a step with enough tiles (a prefill batch) is not split.
template <class Policy = policy::attention>
constexpr attention_split plan_attention_split(std::size_t n_tiles, std::size_t longest, std::size_t block_size,
                                               std::size_t target_blocks) noexcept {
  const std::size_t pages = block_size == 0 ? 0 : (longest + block_size - 1) / block_size;
  if (n_tiles == 0 || pages == 0 || 2 * n_tiles >= target_blocks) return {1, pages};
  const std::size_t per_warp = (pages + Policy::warps - 1) / Policy::warps;  // ranges of one page per warp
  const std::size_t wanted = (target_blocks + n_tiles - 1) / n_tiles;
  const std::size_t splits = wanted < per_warp ? wanted : per_warp;
  const std::size_t per_split = (pages + splits - 1) / splits;
  return {(pages + per_split - 1) / per_split, per_split};
}

namespace detail {
// Ranges of about `keys` keys each, rounded up to whole pages: at most ceil(pages / pages of `keys`)
// a tile (so a range may hold fewer keys: 5 pages in ranges of 3 and 2 where `keys` takes 4), and never
// more than ceil(target_blocks / n_tiles); a step with enough tiles is not split.
constexpr attention_split split_by_keys(std::size_t n_tiles, std::size_t longest, std::size_t block_size,
                                        std::size_t target_blocks, std::size_t keys,
                                        device::attention_kernel kernel) noexcept {
  const std::size_t pages = block_size == 0 ? 0 : (longest + block_size - 1) / block_size;
  if (n_tiles == 0 || pages == 0 || 2 * n_tiles >= target_blocks) return {1, pages, kernel};
  const std::size_t chunk_pages = (keys + block_size - 1) / block_size;
  const std::size_t most = (pages + chunk_pages - 1) / chunk_pages;
  const std::size_t wanted = (target_blocks + n_tiles - 1) / n_tiles;
  const std::size_t splits = wanted < most ? wanted : most;
  const std::size_t per_split = (pages + splits - 1) / splits;
  return {(pages + per_split - 1) / per_split, per_split, kernel};
}
}  // namespace detail

// The same for the rows kernel, whose warps each walk all of a range's keys: ranges of about one
// chunk of keys for each warp holding a row (Policy::chunk times the warps that share a row: 4 for
// tiles of one row, 2 for two, else 1; `tile_rows`: the step's most rows a tile), rounded up to whole
// pages, where the context allows, so that a short context is still cut (64 keys in pages of 16 and
// tiles of 7 rows: two ranges of 32, where attention's warps take a page each in one range), never more
// than ceil(target_blocks / n_tiles) ranges a tile.
template <class Policy = policy::attention_rows>
constexpr attention_split plan_attention_split_rows(std::size_t n_tiles, std::size_t longest, std::size_t block_size,
                                                    std::size_t target_blocks,
                                                    std::size_t tile_rows = Policy::rows) noexcept {
  const std::size_t share = tile_rows <= 1 ? 4 : tile_rows == 2 ? 2 : 1;  // (agent::attention_rows's)
  return detail::split_by_keys(n_tiles, longest, block_size, target_blocks,
                               static_cast<std::size_t>(Policy::chunk) * share, attention_kernel::rows);
}

// The same for the staged kernel (agent::attention_staged), whose block stages `chunk` keys at a time
// (64, or 32 for heads above 128 dimensions): ranges of about a chunk or more, as split_by_keys cuts.
constexpr attention_split plan_attention_split_staged(std::size_t n_tiles, std::size_t longest, std::size_t block_size,
                                                      std::size_t target_blocks, std::size_t chunk) noexcept {
  return detail::split_by_keys(n_tiles, longest, block_size, target_blocks, chunk, attention_kernel::staged);
}

// The most rows of the step's tiles (plan_attention_split_rows's `tile_rows`).
inline std::size_t widest_tile(std::span<const attention_tile_ref> tiles) noexcept {
  std::size_t rows = 0;
  for (const auto& t : tiles) rows = std::max(rows, static_cast<std::size_t>(t.tile.tokens) * t.tile.heads);
  return rows;
}

// The kernel paged_attention runs for caches of layout l cut as `split`: split.kernel, but the pages
// kernel where the rows kernel cannot take the layout (heads above its 256 dimensions, a layer of more
// than 2^32 value rows) or the policy's tiles are not its tiles.
template <class Policy = policy::attention>
constexpr attention_kernel attention_kernel_for(const kv::paged_layout& l, const attention_split& split) noexcept {
  using rows_policy = policy::attention_rows;
  if (Policy::rows == rows_policy::rows && split.kernel == attention_kernel::rows && l.block_size > 0 &&
      l.head_dim <= static_cast<std::size_t>(rows_policy::max_head_dim) &&
      l.blocks * l.kv_heads <= 0xFFFFFFFFu / l.block_size)
    return attention_kernel::rows;
  return attention_kernel::pages;
}

// The longest tile's keys (its last row's position + 1): plan_attention_split's `longest`.
inline std::size_t longest_tile(std::span<const attention_tile_ref> tiles) noexcept {
  std::size_t longest = 0;
  for (const auto& t : tiles)
    longest = std::max(longest, static_cast<std::size_t>(t.first_pos) + t.tile.tokens);
  return longest;
}

// Bytes of workspace paged_attention needs for `n_tiles` tiles cut as `split` (0 where not split).
template <class Policy = policy::attention>
constexpr std::size_t attention_workspace_bytes(std::size_t n_tiles, const attention_split& split,
                                                std::size_t head_dim) noexcept {
  return split.splits <= 1 ? 0 : n_tiles * split.splits * Policy::rows * (head_dim + 2) * sizeof(float);
}

// The most bytes attention_workspace_bytes can ask for `n_tiles` tiles planned by plan_attention_split
// for `target_blocks`, at any context length (it never cuts a tile into more ranges than
// ceil(target_blocks / n_tiles)): a workspace this size needs no growing as a sequence's context does.
template <class Policy = policy::attention>
constexpr std::size_t attention_workspace_bound(std::size_t n_tiles, std::size_t target_blocks,
                                                std::size_t head_dim) noexcept {
  if (n_tiles == 0 || 2 * n_tiles >= target_blocks) return 0;
  return attention_workspace_bytes<Policy>(n_tiles, {(target_blocks + n_tiles - 1) / n_tiles, 0}, head_dim);
}

// q, out: (tokens, heads, head_dim) device rows; tables and tiles: an attention_step's, planned with
// Policy::rows rows per tile at most. Query head h reads KV head h / (heads / kv_heads). E is float or half.
// `split` (plan_attention_split) cuts each tile's pages into ranges; with more than one range,
// `workspace` holds attention_workspace_bytes(n_tiles, split, head_dim) bytes of device memory, and
// the ranges are merged by a second kernel, or, given `counters` (n_tiles unsigned integers, zero;
// each launch leaves them zero), by the last block of each tile to finish, in the same launch and with
// the same arithmetic (agent::merge_ranges): the same bits. `split.kernel` picks the scalar kernel
// (attention_kernel): `rows` (plan_attention_split_rows) runs agent::attention_rows where
// attention_kernel_for says it can, else the pages kernel runs the same cut.
template <class E, class Policy = policy::attention>
void paged_attention(const kv::paged_layout& l, const E* k_cache, const E* v_cache, const float* q, float* out,
                     const block_id* tables, const attention_tile_ref* tiles, std::size_t n_tiles, std::size_t heads,
                     float scale, cudaStream_t stream = nullptr, attention_split split = {}, void* workspace = nullptr,
                     unsigned* counters = nullptr) {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, half>, "KV elements are float or half");
  static_assert(attention_shared_bytes<Policy>(32 * Policy::lane_dims) <= 48 * 1024, "the policy needs opt-in memory");
  static_assert(agent::attention_rows<policy::attention_rows, float, 8>::shared_bytes(
                    policy::attention_rows::max_head_dim) <= 48 * 1024,
                "the rows policy needs opt-in memory");
  (void)query_group(heads, l.kv_heads);
  if (l.head_dim > 32 * static_cast<std::size_t>(Policy::lane_dims))
    throw error(errc::invalid_argument, "device::paged_attention: head_dim " + std::to_string(l.head_dim) +
                                            " is above the policy's " + std::to_string(32 * Policy::lane_dims));
  if (n_tiles == 0) return;
  require(n_tiles <= 0x7FFFFFFFu, errc::invalid_argument, "device::paged_attention: too many tiles");
  require(split.splits >= 1 && split.splits <= 65535, errc::invalid_argument,
          "device::paged_attention: page ranges per tile out of 1..65535");
  require(split.splits == 1 || (workspace != nullptr && split.pages > 0), errc::invalid_argument,
          "device::paged_attention: split-K needs pages per range and a workspace");
  const std::size_t per_split = split.splits == 1 ? ~std::size_t{0} / 2 : split.pages;
  float* partial = split.splits == 1 ? nullptr : static_cast<float*>(workspace);
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(split.splits));
  bool launched = false;
  if constexpr (Policy::rows == policy::attention_rows::rows) {
    using rows_policy = policy::attention_rows;
    if (attention_kernel_for<Policy>(l, split) == attention_kernel::rows) {
      const auto launch = [&](auto d) {
        constexpr int D = decltype(d)::value;
        using agent_t = agent::attention_rows<rows_policy, E, D>;
        detail::attention_kernel<agent_t, rows_policy::threads, E>
            <<<grid, rows_policy::threads, agent_t::shared_bytes(l.head_dim), stream>>>(
                l, k_cache, v_cache, q, out, tables, tiles, heads, scale, per_split, partial, counters);
      };
      if (l.head_dim <= 64)
        launch(std::integral_constant<int, 2>{});
      else if (l.head_dim <= 128)
        launch(std::integral_constant<int, 4>{});
      else
        launch(std::integral_constant<int, 8>{});
      launched = true;
    }
  }
  if (!launched)
    detail::attention_kernel<agent::attention<Policy, E>, Policy::threads, E>
        <<<grid, Policy::threads, attention_shared_bytes<Policy>(l.head_dim), stream>>>(
            l, k_cache, v_cache, q, out, tables, tiles, heads, scale, per_split, partial, counters);
  check(cudaGetLastError(), "paged_attention launch");
  if (partial == nullptr || counters != nullptr) return;
  const dim3 merge_grid(static_cast<unsigned>(n_tiles),
                        static_cast<unsigned>((Policy::rows * l.head_dim + Policy::threads - 1) / Policy::threads));
  detail::attention_merge_kernel<Policy>
      <<<merge_grid, Policy::threads, 0, stream>>>(partial, split.splits, out, tiles, heads, l.head_dim);
  check(cudaGetLastError(), "paged_attention merge launch");
}

}  // namespace efim::kernels::device
