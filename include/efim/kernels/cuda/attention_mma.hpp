#pragma once
// The arithmetic of the staged tensor-core attention (attention_mma.cuh, mma_attention::staged) that is
// not an instruction: where each lane's elements sit in the fragments of mma.sync.m16n8k16 and
// ldmatrix, how a chunk of keys is staged in shared memory, and each lane's step of the online
// softmax. Host and device code (EFIM_HOST_DEVICE), so that a host test runs a warp of 32 emulated
// lanes through the same functions (with ldmatrix and mma emulated as the PTX ISA defines them) and
// checks the whole kernel's index arithmetic against the host's attention.
//
// A warp takes 16 query rows of a tile through the keys they see, a chunk of KC keys at a time:
//   S = Q K^T: Q (16 rows x hd, f16 in shared memory) as mma's A operand, read by ldmatrix; the chunk's
//     K staged as (dim, key) rows, so ldmatrix.trans gives mma's B operand (k = dim, n = key) straight;
//     S in the accumulators: a lane holds rows g and g + 8 (g = lane / 4), columns 2 t, 2 t + 1
//     (t = lane % 4) of each 8-key block;
//   the online softmax in those registers (softmax_step), the rows' maxima shared by the four lanes of
//     a row (two shuffles), each lane's running sum of its own columns (summed over the four at the end);
//   O += P V: P (the accumulators of S rounded to f16) is mma's A operand as it lies in the registers
//     (p_block, p_elem), the chunk's V staged as (key, dim) rows, ldmatrix.trans giving B (k = key,
//     n = dim); O stays in the accumulators (rows g, g + 8; columns 2 t, 2 t + 1 of each 8-dim block).
#include <cmath>
#include <cstddef>

#include "efim/core/config.hpp"
#include "efim/core/float16.hpp"
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

// Before the loops below over register arrays: unrolled in the device pass (the arrays stay in
// registers), left to the compiler on the host.
#if defined(__CUDA_ARCH__)
#define EFIM_MMA_UNROLL _Pragma("unroll")
#else
#define EFIM_MMA_UNROLL
#endif

namespace efim::kernels::mma {

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"): A (16 x 16) is 8 halves a lane, element i in register i / 2; B (16 x 8) is 4,
// C and D (16 x 8, f32) 4.
EFIM_HOST_DEVICE constexpr int a_row(int lane, int i) noexcept { return lane / 4 + 8 * ((i / 2) % 2); }
EFIM_HOST_DEVICE constexpr int a_col(int lane, int i) noexcept { return 2 * (lane % 4) + i % 2 + 8 * (i / 4); }
EFIM_HOST_DEVICE constexpr int b_row(int lane, int i) noexcept { return 2 * (lane % 4) + i % 2 + 8 * (i / 2); }
EFIM_HOST_DEVICE constexpr int b_col(int lane) noexcept { return lane / 4; }
EFIM_HOST_DEVICE constexpr int c_row(int lane, int i) noexcept { return lane / 4 + 8 * (i / 2); }
EFIM_HOST_DEVICE constexpr int c_col(int lane, int i) noexcept { return 2 * (lane % 4) + i % 2; }

// ldmatrix.sync.aligned.m8n8.x4 over a 16 x 16 tile of halves: lane gives the address of row
// ldsm_row(lane), column ldsm_col(lane) of the tile, so that its four 8 x 8 matrices are (rows 0-7,
// cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15). Without .trans
// that is mma's A operand of a row-major tile; with .trans, of a tile stored (k, n), the B operands of
// n columns 0-7 (registers 0, 1) and 8-15 (registers 2, 3).
EFIM_HOST_DEVICE constexpr int ldsm_row(int lane) noexcept { return lane % 8 + 8 * ((lane / 8) % 2); }
EFIM_HOST_DEVICE constexpr int ldsm_col(int lane) noexcept { return 8 * (lane / 16); }

// P as mma's A operand for the keys 16 kk .. 16 kk + 15 of a chunk: register r (of 4) packs
// s[p_block(kk, r)][p_elem(r, 0)] (low half) and [p_elem(r, 1)] of the lane's score accumulators.
EFIM_HOST_DEVICE constexpr int p_block(int kk, int r) noexcept { return 2 * kk + r / 2; }
EFIM_HOST_DEVICE constexpr int p_elem(int r, int h) noexcept { return 2 * (r % 2) + h; }

// Shared memory of a block of `rows` query rows, heads of hd dimensions, chunks of kc keys (hd and kc
// multiples of 16): the queries in f16 (rows x (hd + 8)), then two buffers of a chunk's K ((hd, kc + 8)
// each) and two of its V ((kc, hd + 8) each). The 8 halves after each row make a row's stride an odd
// multiple of 16 bytes, so the 8 rows an ldmatrix reads fall in different banks.
struct stage_shape {
  std::size_t rows, hd, kc;
  EFIM_HOST_DEVICE constexpr std::size_t ldq() const noexcept { return hd + 8; }
  EFIM_HOST_DEVICE constexpr std::size_t ldk() const noexcept { return kc + 8; }
  EFIM_HOST_DEVICE constexpr std::size_t ldv() const noexcept { return hd + 8; }
  EFIM_HOST_DEVICE constexpr std::size_t k_at(int buf) const noexcept {
    return rows * ldq() * 2 + static_cast<std::size_t>(buf) * hd * ldk() * 2;
  }
  EFIM_HOST_DEVICE constexpr std::size_t v_at(int buf) const noexcept {
    return k_at(2) + static_cast<std::size_t>(buf) * kc * ldv() * 2;
  }
  EFIM_HOST_DEVICE constexpr std::size_t bytes() const noexcept { return v_at(2); }
};

// A chunk is staged in 16-byte pieces (8 halves). K: piece p is dimension p / (kc / 8), keys
// 8 (p % (kc / 8)) .. + 7 of the chunk (one page's consecutive slots: block sizes are multiples of 16);
// V: piece p is key p / (hd / 8), dimensions 8 (p % (hd / 8)) .. + 7. {row, column} in the stage.
struct piece {
  std::size_t row, col;
};
EFIM_HOST_DEVICE constexpr piece k_piece(std::size_t p, std::size_t kc) noexcept {
  return {p / (kc / 8), 8 * (p % (kc / 8))};
}
EFIM_HOST_DEVICE constexpr piece v_piece(std::size_t p, std::size_t hd) noexcept {
  return {p / (hd / 8), 8 * (p % (hd / 8))};
}

// Keys a tile's row r sees: up to its token's position (row r is token r / tile_heads of the tile's,
// first_pos the first token's position); 0 for a row past the tile's rows.
EFIM_HOST_DEVICE constexpr std::size_t visible_keys(int r, int rows, std::size_t tile_heads,
                                                    std::size_t first_pos) noexcept {
  return r < rows ? first_pos + static_cast<std::size_t>(r) / tile_heads + 1 : 0;
}

// The end of a block's range of keys: `keys` (what its rows see) but none past the range's
// per_split keys from `first`.
EFIM_HOST_DEVICE constexpr std::size_t range_end(std::size_t keys, std::size_t first, std::size_t per_split) noexcept {
  return keys < first + per_split ? keys : first + per_split;
}

// x rounded to f16 (to nearest even), as P is for its product with V.
EFIM_HOST_DEVICE float round_f16(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __half2float(__float2half_rn(x));
#else
  return f16_to_f32(f32_to_f16(x));
#endif
}

// A lane's scores of a chunk (NS blocks of 8 keys from first_key): scaled to base 2 (scale2 = scale *
// log2 e), -inf where the key is past what the row sees (visible[0] for row g, [1] for row g + 8),
// whatever the product gave there (the stage's slots past a sequence's keys may be anything); top[h]
// the lane's largest of row h's.
template <int NS>
EFIM_HOST_DEVICE void mask_scale(float (&s)[NS][4], int lane, std::size_t first_key, const std::size_t (&visible)[2],
                                 float scale2, float (&top)[2]) noexcept {
  top[0] = top[1] = -INFINITY;
  EFIM_MMA_UNROLL
  for (int j = 0; j < NS; ++j) {
    EFIM_MMA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const std::size_t key = first_key + static_cast<std::size_t>(8 * j + c_col(lane, e));
      const float x = key < visible[e / 2] ? s[j][e] * scale2 : -INFINITY;
      s[j][e] = x;
      top[e / 2] = fmaxf(top[e / 2], x);
    }
  }
}

// The online softmax step of a chunk once top[h] is the row's largest score of the chunk (over the four
// lanes of the row): the running maxima m move to it, the running sums l and the output rows o are
// scaled by 2^(old - new maximum) (0 while a row has seen no key), and s becomes P = 2^(s - maximum)
// rounded to f16 (0 where masked), each lane summing its own: the weights P V takes, so a row's output
// is a weighted mean of its values (as the WMMA kernel's).
template <int NS, int NO>
EFIM_HOST_DEVICE void softmax_step(float (&s)[NS][4], float (&o)[NO][4], float (&m)[2], float (&l)[2],
                                   const float (&top)[2]) noexcept {
  float factor[2];
  EFIM_MMA_UNROLL
  for (int h = 0; h < 2; ++h) {
    const float next = fmaxf(m[h], top[h]);
    factor[h] = m[h] == -INFINITY ? 0.0f : exp2f(m[h] - next);
    l[h] *= factor[h];
    m[h] = next;
  }
  EFIM_MMA_UNROLL
  for (int j = 0; j < NS; ++j) {
    EFIM_MMA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const float p = s[j][e] == -INFINITY ? 0.0f : round_f16(exp2f(s[j][e] - m[e / 2]));
      s[j][e] = p;
      l[e / 2] += p;
    }
  }
  EFIM_MMA_UNROLL
  for (int j = 0; j < NO; ++j) {
    EFIM_MMA_UNROLL
    for (int e = 0; e < 4; ++e) o[j][e] *= factor[e / 2];
  }
}

}  // namespace efim::kernels::mma
