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
//
// A second kernel (mma_attention::staged, attention_mma.hpp) does the same on mma.sync: the block's
// threads stage each chunk of 32 or 64 keys' K and V in shared memory with 16-byte asynchronous copies
// (cp.async, two buffers: the next chunk loads while this one is multiplied), each warp reads its
// operands from there with ldmatrix, and keeps its scores, probabilities and output rows in registers
// (mma.sync's fragment layouts are documented, WMMA's are not), rescaling them there. Its results agree
// with the host kernel within the same f16 roundings.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "efim/core/float16.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/cuda/attention.cuh"
#include "efim/kernels/cuda/attention_mma.hpp"
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

// Which tensor-core kernel paged_attention_mma runs: WMMA with the output rows in shared memory, or
// mma.sync over K and V staged in shared memory, the output rows in registers.
enum class mma_attention { wmma, staged };

// Whether paged_attention_mma takes caches of this layout (f16 elements are the caller's to check).
constexpr bool attention_mma_fits(const kv::paged_layout& l) noexcept {
  return l.block_size % 16 == 0 && l.block_size > 0 && l.head_dim % 16 == 0 && l.head_dim > 0 &&
         l.head_dim <= static_cast<std::size_t>(policy::attention_mma::max_head_dim);
}

namespace detail {

// The instructions of the staged kernel (PTX ISA 7.0+, sm_80+).
__device__ inline unsigned shared_address(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ inline void ldsm_x4(unsigned (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
__device__ inline void ldsm_x4_trans(unsigned (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
// d += a b (16 x 16 f16 by 16 x 8 f16, f32 accumulators).
__device__ inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes from global to shared memory, asynchronously; zeros where !valid (nothing is read then).
__device__ inline void copy16_async(__half* dst, const __half* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ inline void copies_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ inline void copies_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
__device__ inline unsigned pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

}  // namespace detail

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

// The staged kernel (attention_mma.hpp): the block's warps take 16 rows each; NB the most 16-dimension
// steps of a head (hd <= 16 NB), KC keys a chunk.
template <class Policy, int NB, int KC>
struct attention_staged {
  static constexpr int W = Policy::warps, R = Policy::rows, NS = KC / 8, NO = 2 * NB, chunk = KC;
  static_assert(R == 16 * W && KC % 16 == 0);
  static constexpr mma::stage_shape shape(std::size_t hd) noexcept { return {R, hd, KC}; }

  // Block (tile, range blockIdx.y) of keys_per_split keys each (a multiple of 16); with more than one
  // range (partial not null: tiles of up to policy::attention::rows rows) it writes its range's maxima,
  // sums and weighted sums as the scalar kernels do, and the tile's last block merges them.
  __device__ static void run(unsigned char* shared, const kv::paged_layout& l, const __half* k_cache,
                             const __half* v_cache, const float* q, float* out, const block_id* table,
                             const attention_tile& tile, position first_pos, std::size_t heads, float scale,
                             std::size_t keys_per_split, float* partial, unsigned* counters) {
    const int rows = static_cast<int>(tile.tokens * tile.heads);
    if (rows > R) __trap();  // (tiles are planned with Policy::rows rows at most)
    const std::size_t hd = l.head_dim, bs = l.block_size, th = tile.heads;
    const int nk = static_cast<int>(hd / 16);
    const mma::stage_shape sh = shape(hd);
    const std::size_t g = tile.first_head / (heads / l.kv_heads);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    auto* q_sh = reinterpret_cast<__half*>(shared);

    const auto row_index = [&](int r) {  // (token, head) of row r, as an index into q and out
      return (tile.first_token + static_cast<std::size_t>(r) / th) * heads + tile.first_head +
             static_cast<std::size_t>(r) % th;
    };
    // The block's range of keys: from range_first to the last its rows see (none past the range); a
    // chunk's staging: pieces past them are zeros.
    const std::size_t range_first = blockIdx.y * keys_per_split;
    const std::size_t keys = mma::range_end(mma::visible_keys(rows - 1, rows, th, static_cast<std::size_t>(first_pos)),
                                            range_first, keys_per_split);
    const auto stage = [&](std::size_t first_key, int buf) {
      auto* ks = reinterpret_cast<__half*>(shared + sh.k_at(buf));
      auto* vs = reinterpret_cast<__half*>(shared + sh.v_at(buf));
      for (std::size_t p = threadIdx.x; p < hd * KC / 8; p += Policy::threads) {
        const mma::piece at = mma::k_piece(p, KC);
        const std::size_t key = first_key + at.col;
        const bool valid = key < keys;
        const __half* src = valid ? k_cache + l.key_offset(table[key / bs], g) + at.row * bs + key % bs : k_cache;
        detail::copy16_async(ks + at.row * sh.ldk() + at.col, src, valid);
      }
      for (std::size_t p = threadIdx.x; p < KC * hd / 8; p += Policy::threads) {
        const mma::piece at = mma::v_piece(p, hd);
        const std::size_t key = first_key + at.row;
        const bool valid = key < keys;
        const __half* src = valid ? v_cache + l.offset(table[key / bs], g, key % bs) + at.col : v_cache;
        detail::copy16_async(vs + at.row * sh.ldv() + at.col, src, valid);
      }
      detail::copies_commit();
    };
    const std::size_t chunks = keys > range_first ? (keys - range_first + KC - 1) / KC : 0;
    if (chunks > 0) stage(range_first, 0);
    // The queries in f16, zeros past the rows up to the last warp that has any (a decode tile's few
    // rows: the first warp's 16 alone).
    const std::size_t q_rows = (static_cast<std::size_t>(rows) + 15) / 16 * 16;
    for (std::size_t i = threadIdx.x; i < q_rows * hd; i += Policy::threads) {
      const int r = static_cast<int>(i / hd);
      const std::size_t d = i % hd;
      q_sh[static_cast<std::size_t>(r) * sh.ldq() + d] = __float2half_rn(r < rows ? q[row_index(r) * hd + d] : 0.0f);
    }

    const int first_row = 16 * warp;
    const std::size_t warp_keys =  // (0 for a warp past the tile's rows)
        first_row < rows ? mma::range_end(mma::visible_keys(rows - 1 < first_row + 15 ? rows - 1 : first_row + 15, rows,
                                                            th, static_cast<std::size_t>(first_pos)),
                                          range_first, keys_per_split)
                         : 0;
    const std::size_t visible[2] = {
        mma::range_end(mma::visible_keys(first_row + lane / 4, rows, th, static_cast<std::size_t>(first_pos)),
                       range_first, keys_per_split),
        mma::range_end(mma::visible_keys(first_row + lane / 4 + 8, rows, th, static_cast<std::size_t>(first_pos)),
                       range_first, keys_per_split)};
    const float scale2 = scale * 1.4426950408889634f;
    float o[NO][4] = {}, m[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
    const __half* q_warp =
        q_sh + static_cast<std::size_t>(first_row + mma::ldsm_row(lane)) * sh.ldq() + mma::ldsm_col(lane);

    for (std::size_t c = 0; c < chunks; ++c) {
      const int buf = static_cast<int>(c % 2);
      const std::size_t first_key = range_first + c * KC;
      if (c + 1 < chunks) {
        stage(first_key + KC, 1 - buf);
        detail::copies_wait<1>();
      } else {
        detail::copies_wait<0>();
      }
      __syncthreads();
      if (first_key < warp_keys) {  // (the same for the whole warp)
        const auto* ks = reinterpret_cast<const __half*>(shared + sh.k_at(buf)) +
                         static_cast<std::size_t>(mma::ldsm_row(lane)) * sh.ldk() + mma::ldsm_col(lane);
        const auto* vs = reinterpret_cast<const __half*>(shared + sh.v_at(buf)) +
                         static_cast<std::size_t>(mma::ldsm_row(lane)) * sh.ldv() + mma::ldsm_col(lane);
        // S = Q K^T over the chunk.
        float s[NS][4] = {};
#pragma unroll
        for (int kk = 0; kk < NB; ++kk) {
          if (kk >= nk) break;
          unsigned a[4];
          detail::ldsm_x4(a, q_warp + 16 * kk);
#pragma unroll
          for (int n = 0; n < NS / 2; ++n) {
            unsigned b[4];
            detail::ldsm_x4_trans(b, ks + static_cast<std::size_t>(16 * kk) * sh.ldk() + 16 * n);
            detail::mma_16816(s[2 * n], a, b[0], b[1]);
            detail::mma_16816(s[2 * n + 1], a, b[2], b[3]);
          }
        }
        // The online softmax: the rows' maxima over their four lanes.
        float top[2];
        mma::mask_scale(s, lane, first_key, visible, scale2, top);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 1));
          top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 2));
        }
        mma::softmax_step(s, o, m, sum, top);
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < KC / 16; ++kk) {
          unsigned a[4];
#pragma unroll
          for (int r = 0; r < 4; ++r)
            a[r] = detail::pack_half2(s[mma::p_block(kk, r)][mma::p_elem(r, 0)],
                                      s[mma::p_block(kk, r)][mma::p_elem(r, 1)]);
#pragma unroll
          for (int n = 0; n < NB; ++n) {
            if (n >= nk) break;
            unsigned b[4];
            detail::ldsm_x4_trans(b, vs + static_cast<std::size_t>(16 * kk) * sh.ldv() + 16 * n);
            detail::mma_16816(o[2 * n], a, b[0], b[1]);
            detail::mma_16816(o[2 * n + 1], a, b[2], b[3]);
          }
        }
      }
      __syncthreads();  // (before the next chunk's copies overwrite this buffer)
    }

    // Rows g and g + 8: O over the sum of the row's four lanes; or, for a range of a split tile, the
    // row's maximum (in natural units), sum and weighted sums into the range's slot, then the merge.
    constexpr int RS = policy::attention::rows;     // (the slots' rows: the scalar kernels' tiles)
    if (partial != nullptr && rows > RS) __trap();  // (a split step's tiles are the scalar kernels')
    float* slot = partial == nullptr
                      ? nullptr
                      : partial + (static_cast<std::size_t>(blockIdx.x) * gridDim.y + blockIdx.y) * RS * (hd + 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xFFFFFFFFu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xFFFFFFFFu, sum[h], 2);
      const int r = first_row + lane / 4 + 8 * h;
      if (r >= rows) continue;
      float* dst = slot != nullptr ? slot + 2 * RS + static_cast<std::size_t>(r) * hd : out + row_index(r) * hd;
      const float div = slot != nullptr ? 1.0f : sum[h];
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        if (j >= 2 * nk) break;
        *reinterpret_cast<float2*>(dst + 8 * j + 2 * (lane % 4)) =
            make_float2(o[j][2 * h] / div, o[j][2 * h + 1] / div);
      }
      if (slot != nullptr && lane % 4 == 0) {
        slot[r] = m[h] * 0.6931471805599453f;  // (2^m = e^(m ln 2); -inf stays -inf)
        slot[RS + r] = sum[h];
      }
    }
    if (slot != nullptr) merge_if_last<RS, Policy::threads>(partial, counters, out, tile, heads, rows, hd);
  }
};

}  // namespace agent

namespace detail {

// One block per (tile, range of keys), Agent (attention_mma: one range; or attention_staged) running it.
template <class Agent, int Threads>
__global__ void __launch_bounds__(Threads)
    attention_mma_kernel(kv::paged_layout l, const half* k_cache, const half* v_cache, const float* q, float* out,
                         const block_id* tables, const attention_tile_ref* tiles, std::size_t heads, float scale,
                         std::size_t keys_per_split, float* partial, unsigned* counters) {
  extern __shared__ __align__(32) unsigned char shared_mma[];
  const attention_tile_ref t = tiles[blockIdx.x];
  const auto* k = reinterpret_cast<const __half*>(k_cache);
  const auto* v = reinterpret_cast<const __half*>(v_cache);
  if constexpr (requires { Agent::NS; }) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // (cp.async and ldmatrix's operands for mma.m16n8k16: sm_80 and up; the callers check)
#else
    Agent::run(shared_mma, l, k, v, q, out, tables + t.table, t.tile, t.first_pos, heads, scale, keys_per_split,
               partial, counters);
#endif
  } else
    Agent::run(shared_mma, l, k, v, q, out, tables + t.table, t.tile, t.first_pos, heads, scale);
}

// The staged kernel for heads of up to 64, 128 and 256 dimensions: chunks of 64 keys, then 32 at 256
// (the output rows take 128 registers a lane there).
template <class Policy, class F>
constexpr decltype(auto) with_staged(std::size_t head_dim, F&& f) {
  if (head_dim <= 64) return f.template operator()<agent::attention_staged<Policy, 4, 64>>();
  if (head_dim <= 128) return f.template operator()<agent::attention_staged<Policy, 8, 64>>();
  return f.template operator()<agent::attention_staged<Policy, 16, 32>>();
}

template <class Agent, int Threads>
void launch_attention_mma(std::size_t bytes, dim3 grid, const kv::paged_layout& l, const half* k_cache,
                          const half* v_cache, const float* q, float* out, const block_id* tables,
                          const attention_tile_ref* tiles, std::size_t heads, float scale, std::size_t keys_per_split,
                          float* partial, unsigned* counters, cudaStream_t stream) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(attention_mma_kernel<Agent, Threads>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "paged_attention_mma: shared memory opt-in");
  attention_mma_kernel<Agent, Threads><<<grid, Threads, bytes, stream>>>(
      l, k_cache, v_cache, q, out, tables, tiles, heads, scale, keys_per_split, partial, counters);
  check(cudaGetLastError(), "paged_attention_mma launch");
}

}  // namespace detail

// Bytes of dynamic shared memory paged_attention_mma takes for heads of `head_dim` (WMMA: above 48 KiB
// from a head size of 96, 135 KiB at 256; staged: 45 KiB at 64, 87 KiB at 128, 106 KiB at 256; the
// launch opts in above 48 KiB; more than some GPUs allow a block: the caller checks the device's
// opt-in limit).
template <class Policy = policy::attention_mma>
constexpr std::size_t attention_mma_shared_bytes(std::size_t head_dim,
                                                 mma_attention kind = mma_attention::wmma) noexcept {
  if (kind == mma_attention::wmma) return agent::attention_mma<Policy>::shared_bytes(head_dim);
  return detail::with_staged<Policy>(head_dim, [&]<class Agent>() { return Agent::shape(head_dim).bytes(); });
}

// Keys a chunk of the staged kernel for heads of `head_dim` (plan_attention_split_staged's `chunk`).
constexpr std::size_t staged_chunk_keys(std::size_t head_dim) noexcept {
  return detail::with_staged<policy::attention_mma>(head_dim, [&]<class Agent>() { return std::size_t{Agent::chunk}; });
}

// paged_attention with f16 caches on tensor cores: q, out (tokens, heads, head_dim) device rows; tables
// and tiles an attention_step's planned with Policy::rows rows per tile at most; the layout must fit
// (attention_mma_fits); out 8-byte aligned. By default one block per tile walks every key its rows see.
// The staged kernel needs a device of compute capability 8.0 or above (elsewhere it traps); it
// takes a decode step's cut too (`split`, from plan_attention_split_staged, tiles of up to
// policy::attention::rows rows): with more than one range, `workspace` (attention_workspace_bytes) and
// `counters` (as paged_attention's: the ranges merged in the same launch, by agent::merge_ranges).
template <class Policy = policy::attention_mma>
void paged_attention_mma(const kv::paged_layout& l, const half* k_cache, const half* v_cache, const float* q,
                         float* out, const block_id* tables, const attention_tile_ref* tiles, std::size_t n_tiles,
                         std::size_t heads, float scale, cudaStream_t stream = nullptr,
                         mma_attention kind = mma_attention::wmma, attention_split split = {},
                         void* workspace = nullptr, unsigned* counters = nullptr) {
  (void)query_group(heads, l.kv_heads);
  if (!attention_mma_fits(l))
    throw error(errc::invalid_argument, "device::paged_attention_mma: block size " + std::to_string(l.block_size) +
                                            " and head size " + std::to_string(l.head_dim) +
                                            " must be multiples of 16, the head size at most 256");
  if (n_tiles == 0) return;
  require(n_tiles <= 0x7FFFFFFFu, errc::invalid_argument, "device::paged_attention_mma: too many tiles");
  require(split.splits >= 1 && split.splits <= 65535, errc::invalid_argument,
          "device::paged_attention_mma: key ranges per tile out of 1..65535");
  require(
      split.splits == 1 ||
          (kind == mma_attention::staged && workspace != nullptr && counters != nullptr && split.pages > 0),
      errc::invalid_argument,
      "device::paged_attention_mma: split-K is the staged kernel's, with pages per range, a workspace and counters");
  const std::size_t bytes = attention_mma_shared_bytes<Policy>(l.head_dim, kind);
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(split.splits));
  if (kind == mma_attention::wmma) {
    detail::launch_attention_mma<agent::attention_mma<Policy>, Policy::threads>(
        bytes, grid, l, k_cache, v_cache, q, out, tables, tiles, heads, scale, 0, nullptr, nullptr, stream);
    return;
  }
  const std::size_t keys_per_split = split.splits == 1 ? ~std::size_t{0} / 2 : split.pages * l.block_size;
  float* partial = split.splits == 1 ? nullptr : static_cast<float*>(workspace);
  detail::with_staged<Policy>(l.head_dim, [&]<class Agent>() {
    detail::launch_attention_mma<Agent, Policy::threads>(bytes, grid, l, k_cache, v_cache, q, out, tables, tiles, heads,
                                                         scale, keys_per_split, partial, counters, stream);
  });
}

}  // namespace efim::kernels::device
