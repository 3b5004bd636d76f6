#pragma once
// y = x * w^T on the host: x (m, k) row-major, w (n, k) row-major (one output feature per row).
// Every output element is one canonical dot product, so a row's result does not depend on how
// many rows are in the batch nor on which thread computes it.
#include <algorithm>
#include <cstddef>

#include "efim/core/thread_pool.hpp"
#include "efim/kernels/simd.hpp"

namespace efim::kernels {

enum class accumulate : bool { no, yes };  // yes: y = y + x w^T (a residual add)

namespace detail {
#if defined(__AVX512F__)
inline constexpr std::size_t tile_rows = 4, tile_cols = 4;  // 16 zmm accumulators
#else
inline constexpr std::size_t tile_rows = 2, tile_cols = 2;  // fits 16 ymm/xmm registers
#endif

template <std::size_t MR, std::size_t NR>
inline void matmul_tile(const float* x, const float* w, float* y, std::size_t m0, std::size_t n0, std::size_t n,
                        std::size_t k, accumulate acc) noexcept {
  const float* xs[MR];
  const float* ws[NR];
  for (std::size_t i = 0; i < MR; ++i) xs[i] = x + (m0 + i) * k;
  for (std::size_t j = 0; j < NR; ++j) ws[j] = w + (n0 + j) * k;
  float out[MR * NR];
  dot_tile<MR, NR>(xs, ws, k, out);
  for (std::size_t i = 0; i < MR; ++i)
    for (std::size_t j = 0; j < NR; ++j) {
      float& dst = y[(m0 + i) * n + n0 + j];
      dst = acc == accumulate::yes ? dst + out[i * NR + j] : out[i * NR + j];
    }
}

// Rows [0, m) x columns [n_begin, n_end).
template <std::size_t NR>
inline void matmul_columns(const float* x, const float* w, float* y, std::size_t m, std::size_t n_begin,
                           std::size_t n_end, std::size_t n, std::size_t k, accumulate acc) noexcept {
  constexpr std::size_t MR = tile_rows;
  std::size_t i = 0;
  for (; i + MR <= m; i += MR)
    for (std::size_t j = n_begin; j < n_end; j += NR) matmul_tile<MR, NR>(x, w, y, i, j, n, k, acc);
  for (; i < m; ++i)
    for (std::size_t j = n_begin; j < n_end; j += NR) matmul_tile<1, NR>(x, w, y, i, j, n, k, acc);
}
}  // namespace detail

// y (m, n) = [y +] x (m, k) * w (n, k)^T, split by output columns over the pool.
inline void matmul(thread_pool& pool, const float* x, const float* w, float* y, std::size_t m, std::size_t n,
                   std::size_t k, accumulate acc = accumulate::no) {
  constexpr std::size_t NR = detail::tile_cols;
  const std::size_t full_cols = n - n % NR;
  const std::size_t col_tiles = full_cols / NR;
  // Enough columns per task that a task's weights are reused across all rows.
  pool.parallel_for(col_tiles, [&](std::size_t begin, std::size_t end) {
    detail::matmul_columns<NR>(x, w, y, m, begin * NR, end * NR, n, k, acc);
  });
  if (full_cols < n) detail::matmul_columns<1>(x, w, y, m, full_cols, n, n, k, acc);
}

}  // namespace efim::kernels
