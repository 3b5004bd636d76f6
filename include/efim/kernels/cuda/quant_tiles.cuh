#pragma once
// The product of block-quantized weights by a few x rows on tensor cores, the weights read once
// (quant_tiles): y (m, rows) = [y +] x (m, cols) * dequantize(w)^T [+ bias], for the row counts
// between the decode kernel's (quant_decode, up to 8) and a prefill's. The f16 slices that
// device::matmul multiplies there (quant_matmul.cuh) write every weight as f16 to memory and read it
// back through cuBLAS: for a Q4_K_M model, seven to eight times the bytes of its weights a step,
// whatever the row count. Here a thread block takes 16 weight rows a warp and x rows 16 a tile:
//   for each step of Policy::k_step columns, the block's x rows are rounded to f16 into shared memory,
//     and its weight rows dequantized into shared memory as f16 (each weight as dequantize_row gives
//     it, rounded once: the values of the f16 slices), a chunk at a time (quant_groups.hpp), whose
//     bytes each thread loaded into registers during the step before;
//   each warp multiplies its 16 weight rows by every 16-row tile of x on the tensor cores (WMMA,
//     16 x 16 x 16, f16 in, f32 accumulated across the steps in order);
//   y's elements are stored with the decode kernel's accumulate and bias (decode_store).
// The same roundings as the f16 slices (x and the weights to f16 once), the sums in another order: the
// results agree with the host within that rounding, not bit for bit with the slices. An element's sum
// does not depend on m or on where its rows fall in the grid. x may come rounded to f16 already (the
// same bits; each block then reads half the bytes of x, which every block reads whole). Which row
// counts device::matmul gives it is policy::quant_tiles::max_rows, decided by measurement
// (efim-cuda-bench times both at --batch).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "efim/core/dtype.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/cuda/quant_matmul.cuh"
#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

namespace policy {
struct quant_tiles {
  static constexpr int warps = 2;     // 16 weight rows each: a block's 32 (112 blocks for 3,584 rows)
  static constexpr int x_tiles = 4;   // 16 x rows each: a block's up to 64 (more x rows: more blocks)
  static constexpr int k_step = 128;  // columns staged in shared memory at a time (a multiple of 128)
  // x rows above decode_rows up to which device::matmul multiplies quantized weights here rather than
  // in f16 slices: none (on an H200 at 16 rows the tiles took 0.46x the slices' speed over a 7B
  // Q4_K_M step's products, ahead only on the FFN gate and up; docs/benchmarks.md).
  static constexpr std::size_t max_rows = 0;
};
}  // namespace policy

namespace detail {

// A block: weight rows blockIdx.x * 16 Policy::warps on, x rows blockIdx.y * 16 Policy::x_tiles on.
// Each thread takes S::chunks chunks of the block's weight rows a step (quant::tile_staging; a chunk:
// 8 weights, or 32 for q4_k and q5_k, from one to four loads), their bytes loaded a step ahead, during
// the products.
// x: f32 rows (rounded to f16 as they are staged), or rows rounded to f16 already (the same values).
template <class Policy, dtype T, class XT>
__global__ void __launch_bounds__(Policy::warps * 32)
    quant_tiles_kernel(const std::uint8_t* w, std::size_t rows, std::size_t row_bytes, std::size_t cols, const XT* x,
                       std::size_t m, float* y, bool acc, const float* bias) {
  namespace wmma = nvcuda::wmma;
  constexpr int W = Policy::warps, R = 16 * W, X = 16 * Policy::x_tiles, K = Policy::k_step, threads = 32 * W;
  constexpr int ld = K + 8;  // halves a row in shared memory (a multiple of 8, rows 16 bytes apart)
  using S = quant::tile_staging<T, K, R, threads>;
  const int tid = static_cast<int>(threadIdx.x);
  __shared__ __align__(32) __half x_sh[X * ld];
  __shared__ __align__(32) __half w_sh[R * ld];
  __shared__ __align__(32) float out_sh[W][16 * 16];

  const int warp = tid / 32, lane = tid % 32;
  const std::size_t r0 = static_cast<std::size_t>(blockIdx.x) * R, x0 = static_cast<std::size_t>(blockIdx.y) * X;
  const int x_rows = m - x0 < static_cast<std::size_t>(X) ? static_cast<int>(m - x0) : X;
  const int tiles = (x_rows + 15) / 16;  // x tiles with rows (the rest are neither staged nor multiplied)

  quant::chunk_bytes bytes[S::chunks];
  const auto load = [&](std::size_t k0) {
#pragma unroll
    for (int j = 0; j < S::chunks; ++j)
      if (S::live(r0, rows, k0, cols, tid, j))
        bytes[j] = quant::load_chunk<T>(w + (r0 + S::row(tid, j)) * row_bytes, S::in_row(k0, tid, j));
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[Policy::x_tiles];
#pragma unroll
  for (int t = 0; t < Policy::x_tiles; ++t) wmma::fill_fragment(c[t], 0.0f);
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;  // (k, weight row): w_sh's rows

  load(0);
  for (std::size_t k0 = 0; k0 < cols; k0 += K) {
    const int kn = cols - k0 < static_cast<std::size_t>(K) ? static_cast<int>(cols - k0) : K;  // a multiple of 32
    // The x rows' columns k0 .. k0 + K as f16, 16 bytes of x a load; past x_rows or kn, zeros.
    if constexpr (std::is_same_v<XT, __half>) {
      for (int i = tid; i < 16 * tiles * (K / 8); i += threads) {
        const int r = i / (K / 8), c8 = 8 * (i % (K / 8));
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < x_rows && c8 < kn) v = *reinterpret_cast<const uint4*>(x + (x0 + r) * cols + k0 + c8);
        *reinterpret_cast<uint4*>(x_sh + r * ld + c8) = v;
      }
    } else {
      static_assert(std::is_same_v<XT, float>, "x rows in f32 or f16");
      for (int i = tid; i < 16 * tiles * (K / 4); i += threads) {
        const int r = i / (K / 4), c4 = 4 * (i % (K / 4));
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < x_rows && c4 < kn) v = *reinterpret_cast<const float4*>(x + (x0 + r) * cols + k0 + c4);
        auto* const dst = reinterpret_cast<__half2*>(x_sh + r * ld + c4);
        dst[0] = __floats2half2_rn(v.x, v.y);
        dst[1] = __floats2half2_rn(v.z, v.w);
      }
    }
    // The weight rows' chunks decoded (each weight as dequantize_row gives it) and rounded to f16;
    // past rows or kn, zeros.
#pragma unroll
    for (int j = 0; j < S::chunks; ++j) {
      __half* const row = w_sh + S::row(tid, j) * ld;
      if (S::live(r0, rows, k0, cols, tid, j)) {
        float v[S::span];
        std::size_t first[quant::chunk_groups<T>];
        quant::decode_loaded<T>(bytes[j], S::in_row(k0, tid, j), v, first);
#pragma unroll
        for (int g = 0; g < quant::chunk_groups<T>; ++g) store_f16x8(v + 8 * g, row + (first[g] - k0));
      } else {
#pragma unroll
        for (int g = 0; g < quant::chunk_groups<T>; ++g)
          *reinterpret_cast<uint4*>(row + S::span * S::chunk(tid, j) + 8 * g) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncthreads();
    if (k0 + K < cols) load(k0 + K);  // the next step's bytes, in flight during the products
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      if (16 * kk >= kn) break;  // (a last step of fewer columns)
      wmma::load_matrix_sync(b, w_sh + 16 * warp * ld + 16 * kk, ld);
#pragma unroll
      for (int t = 0; t < Policy::x_tiles; ++t) {
        if (t >= tiles) break;
        wmma::load_matrix_sync(a, x_sh + 16 * t * ld + 16 * kk, ld);
        wmma::mma_sync(c[t], a, b, c[t]);
      }
    }
    __syncthreads();  // (the next step overwrites both tiles)
  }

  // Tile t's sums (x rows 16 t.., the warp's 16 weight rows) through shared memory into y.
  float* const o = out_sh[warp];
#pragma unroll
  for (int t = 0; t < Policy::x_tiles; ++t) {
    if (t >= tiles) break;
    wmma::store_matrix_sync(o, c[t], 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {  // (16 consecutive weight rows of one x row: 64 bytes of y)
      const std::size_t xi = x0 + 16 * t + e / 16, r = r0 + 16 * warp + e % 16;
      if (xi < m && r < rows) decode_store(y + xi * rows + r, o[e], acc, bias, r);
    }
    __syncwarp();
  }
}

template <class Policy, class X>
void launch_quant_tiles(dtype type, const void* w, std::size_t rows, std::size_t cols, const X* x, std::size_t m,
                        float* y, cudaStream_t stream, accumulate acc, const float* bias) {
  require(quant::kept_quantized(type), errc::invalid_argument,
          "device::quant_tiles: weights in " + std::string(to_string(type)) + " (a block-quantized type)");
  require(cols % 32 == 0, errc::invalid_argument, "device::quant_tiles: a row must be whole blocks of 32");
  require(reinterpret_cast<std::uintptr_t>(x) % 16 == 0 && reinterpret_cast<std::uintptr_t>(w) % 16 == 0,
          errc::invalid_argument, "device::quant_tiles: x and w must be 16-byte aligned");
  if (m == 0 || rows == 0) return;
  constexpr std::size_t block_rows = 16 * Policy::warps, block_x = 16 * Policy::x_tiles;
  const std::size_t gx = (rows + block_rows - 1) / block_rows, gy = (m + block_x - 1) / block_x;
  require(gx <= 0x7FFFFFFFu && gy <= 65535u, errc::invalid_argument, "device::quant_tiles: too many rows for the grid");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  const std::size_t rb = row_bytes(type, cols);
  const auto* wb = static_cast<const std::uint8_t*>(w);
  quant::visit_kept(type, [&](auto t) {
    detail::quant_tiles_kernel<Policy, decltype(t)::value, X>
        <<<grid, Policy::warps * 32, 0, stream>>>(wb, rows, rb, cols, x, m, y, acc == accumulate::yes, bias);
  });
  check(cudaGetLastError(), "quant_tiles launch");
}

}  // namespace detail

// y (m, rows) = [y +] x (m, cols) * dequantize(w)^T [+ bias (rows)] on tensor cores, the weights read
// once (above). w: a quantized type (quant::kept_quantized), rows of row_bytes(type, cols) bytes from a
// 16-byte aligned address; x 16-byte aligned; cols a multiple of 32. No workspace.
template <class Policy = policy::quant_tiles>
void quant_tiles(dtype type, const void* w, std::size_t rows, std::size_t cols, const float* x, std::size_t m, float* y,
                 cudaStream_t stream, accumulate acc = accumulate::no, const float* bias = nullptr) {
  detail::launch_quant_tiles<Policy>(type, w, rows, cols, x, m, y, stream, acc, bias);
}

// The same with x rounded to f16 already (the same bits as from the f32 rows it was rounded from; half
// the bytes each block reads of x, and no rounding in the kernel): x16 16-byte aligned.
template <class Policy = policy::quant_tiles>
void quant_tiles(dtype type, const void* w, std::size_t rows, std::size_t cols, const __half* x16, std::size_t m,
                 float* y, cudaStream_t stream, accumulate acc = accumulate::no, const float* bias = nullptr) {
  detail::launch_quant_tiles<Policy>(type, w, rows, cols, x16, m, y, stream, acc, bias);
}

}  // namespace efim::kernels::device
