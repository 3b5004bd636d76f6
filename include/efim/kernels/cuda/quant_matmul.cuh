#pragma once
// Matrix products with block-quantized weights kept as the file stores them (q8_0, q4_0, q5_0, q5_1,
// q4_k, q5_k, q6_k: quant_groups.hpp), y (m, n) = [y +] x (m, k) * dequantize(w)^T:
//   decode (m <= policy::quant_matmul::decode_rows): one warp per weight row; each lane decodes its
//     chunks of weights in registers (quant::lane_dots: the bytes of four chunks loaded before the first
//     is decoded) and multiplies them into the m x rows' sums, which the warp then adds (five
//     __shfl_xor_sync rounds). A result is quant::lane_dots over the 32 lanes summed as quant::warp_sum
//     sums them: the host tests emulate it, and test_cuda checks the device against that emulation bit
//     for bit.
//   the same kernel multiplies dense f16, bf16 and f32 weights at decode (quant::dense_decodes: rows
//     of whole chunks of 8 values): no conversion of x to 16 bits, no separate bias launch, and each
//     weight read once as stored (16-byte loads), the products in f32 as the host's.
//   with products::int8, the decode product rounds the x rows to 8 bits first (quantize_x8: the
//     host's int8 rounding, byte for byte) and multiplies them by DP4A (quant::lane_idots,
//     quant_int8.hpp), the warp adding its lanes' sums as above; the host tests emulate it too.
//   prefill (more rows): a slice of weight rows at a time dequantized to f16 in the workspace (each
//     weight as dequantize_row gives it, rounded once to f16: what the f16 upload of these types
//     gave), then cuBLAS multiplies the x rows (converted to f16 once) by it into y's columns.
// The slice is what bounds the workspace (policy::quant_matmul::slice_bytes), not the matrix: a
// 152k-row output matrix needs no f16 copy of itself.
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "efim/core/dtype.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/ops.cuh"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/cuda/quant_int8.hpp"
#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

namespace policy {
struct quant_matmul {
  static constexpr int warps = 4;                        // weight rows per block of the decode kernel
  static constexpr std::size_t decode_rows = quant::decode_rows;  // x rows up to which the decode kernel runs
  static constexpr std::size_t slice_bytes = 32u << 20;  // f16 weights dequantized at a time (prefill)
  static constexpr int threads = 256;                    // dequantizing threads per block
  static constexpr int max_blocks = 65535;
};
}  // namespace policy

using quant::decode_parts;

namespace detail {

// y's element, then the bias where there is one: the same two roundings as the product, then add_bias.
__device__ inline void decode_store(float* out, float v, bool acc, const float* bias, std::size_t r) {
  float o = acc ? *out + v : v;
  if (bias != nullptr) o += bias[r];
  *out = o;
}

// The warp's row of a decode launch over parts (decode_parts): which part (each block works in one,
// so the choice is the block's: uniform registers), and the row within it; false past the part's rows.
// (Parts: whether the launch may have more than one; with one, the part is 0 as a constant, and the
// kernel takes the registers of a plain product: the choice of part costs up to a quarter more.)
template <class Policy, bool Parts>
__device__ inline bool decode_row(const decode_parts& parts, int& part, std::size_t& row) {
  static_assert(Policy::warps * 32 <= 1024, "a block of whole warps");
  part = Parts ? parts.part_of(blockIdx.x) : 0;
  row = parts.row_of<Policy::warps>(blockIdx.x, part, threadIdx.x / 32);  // (parts.warps == it: the launch checks)
  return row < decode_parts::pick(parts.rows, part);
}

// The warp's sums (one per x row, lane 0's complete) stored into row r of y of its part.
template <int M>
__device__ inline void decode_store_rows(const decode_parts& parts, int part, std::size_t r, const float (&sums)[M],
                                         int m, int lane, bool acc) {
  const std::size_t rows = decode_parts::pick(parts.rows, part);
  float* const y = decode_parts::pick(parts.y, part);
  const float* const bias = decode_parts::pick(parts.bias, part);
#pragma unroll
  for (int i = 0; i < M; ++i) {
    if (i >= m) break;
    float v = sums[i];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if (lane == 0) decode_store(y + static_cast<std::size_t>(i) * rows + r, v, acc, bias, r);
  }
}

// One warp per weight row of the parts, in turn (a launch for one matrix is one part).
template <class Policy, dtype T, int M, bool Parts>
__global__ void __launch_bounds__(Policy::warps * 32)
    quant_decode_kernel(decode_parts parts, std::size_t row_bytes, std::size_t cols, const float* x, int m, bool acc) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int part;
  std::size_t r;
  if (!decode_row<Policy, Parts>(parts, part, r)) return;  // a whole warp at once
  float sums[M] = {};
  quant::lane_dots<T, M>(decode_parts::pick(parts.w, part) + r * row_bytes, cols, x, m, lane, 32, sums);
  decode_store_rows<M>(parts, part, r, sums, m, lane, acc);
}

// The int8 decode product: as quant_decode_kernel, each lane's sums from quant::lane_idots.
template <class Policy, dtype T, int M, bool Parts>
__global__ void __launch_bounds__(Policy::warps * 32)
    quant_decode_int8_kernel(decode_parts parts, std::size_t row_bytes, quant::x8_rows x, int m, bool acc) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int part;
  std::size_t r;
  if (!decode_row<Policy, Parts>(parts, part, r)) return;  // a whole warp at once
  float sums[M] = {};
  quant::lane_idots<T, M>(decode_parts::pick(parts.w, part) + r * row_bytes, x, m, lane, 32, sums);
  decode_store_rows<M>(parts, part, r, sums, m, lane, acc);
}

// The int8 decode product of parts of two types (quant::int8_pair) at one x row: parts before
// parts.second of type T0 (rows of rb0 bytes), the rest of type T1 (rb1); each warp's row as
// quant_decode_int8_kernel takes it for its part's type alone (the same sums, the same store).
template <class Policy, dtype T0, dtype T1>
__global__ void __launch_bounds__(Policy::warps * 32)
    quant_decode_int8_pair_kernel(decode_parts parts, std::size_t rb0, std::size_t rb1, quant::x8_rows x, bool acc) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int part;
  std::size_t r;
  if (!decode_row<Policy, true>(parts, part, r)) return;  // a whole warp at once
  float sums[1] = {};
  if (part < parts.second)  // (the block's part: uniform)
    quant::lane_idots<T0, 1>(decode_parts::pick(parts.w, part) + r * rb0, x, 1, lane, 32, sums);
  else
    quant::lane_idots<T1, 1>(decode_parts::pick(parts.w, part) + r * rb1, x, 1, lane, 32, sums);
  decode_store_rows<1>(parts, part, r, sums, 1, lane, acc);
}

// The FFN's decode products and SwiGLU in one launch: each warp takes row r of w_gate, then row r of
// w_up (each exactly as quant_decode_kernel or quant_decode_int8_kernel takes a row, one after the
// other: the same registers, the same sums), and stores swiglu_one(gate, up [+ bias_up[r]]): the bits
// of the two products, add_bias and swiglu apart.
template <class Policy, dtype T, int M, bool Int8>
__global__ void __launch_bounds__(Policy::warps * 32)
    quant_decode_swiglu_kernel(const std::uint8_t* gate, const std::uint8_t* up, std::size_t rows,
                               std::size_t row_bytes, std::size_t cols, const float* x, quant::x8_rows xq, int m,
                               float* out, const float* bias_up) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::size_t r = static_cast<std::size_t>(blockIdx.x) * Policy::warps + threadIdx.x / 32;
  if (r >= rows) return;  // a whole warp at once
  float g[M] = {}, u[M] = {};
  if constexpr (Int8) {
    quant::lane_idots<T, M>(gate + r * row_bytes, xq, m, lane, 32, g);
    quant::lane_idots<T, M>(up + r * row_bytes, xq, m, lane, 32, u);
  } else {
    quant::lane_dots<T, M>(gate + r * row_bytes, cols, x, m, lane, 32, g);
    quant::lane_dots<T, M>(up + r * row_bytes, cols, x, m, lane, 32, u);
  }
#pragma unroll
  for (int i = 0; i < M; ++i) {
    if (i >= m) break;
    float gv = g[i], uv = u[i];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) gv += __shfl_xor_sync(0xFFFFFFFFu, gv, off);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) uv += __shfl_xor_sync(0xFFFFFFFFu, uv, off);
    if (lane == 0) {
      if (bias_up != nullptr) uv += bias_up[r];
      out[static_cast<std::size_t>(i) * rows + r] = swiglu_one(gv, uv);
    }
  }
}

// The steps of kquant::quantize's rounding per 32 (block_q8_32), each the host's operation with one
// rounding: a value's magnitude for the block's largest (NaN left out, as the host's `ax > amax` leaves
// it), the quant of v given id = 127 / largest (0 for a zero block), and the block's scale (through the
// same f16 conversion).
__device__ inline float x8_32_magnitude(float v) { return v == v ? fabsf(v) : 0.0f; }
__device__ inline float x8_32_inverse(float amax) { return amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f; }
__device__ inline int x8_32_quant(float v, float id) {
  const float t = __fmul_rn(v, id);
  return __float2int_rn(t == t ? fminf(127.0f, fmaxf(-127.0f, t)) : 0.0f);
}
__device__ inline float x8_32_scale(float amax) { return f16_to_f32(f32_to_f16(__fdiv_rn(amax, 127.0f))); }

// One block of 32 values (x, a warp's lanes each reading its own) rounded as kquant::quantize
// (block_q8_32) rounds it, into q[0..31] and *d.
__device__ inline void round_x8_32(const float* x, std::int8_t* q, float* d, int lane) {
  const float v = x[lane];
  float amax = x8_32_magnitude(v);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  q[lane] = static_cast<std::int8_t>(x8_32_quant(v, x8_32_inverse(amax)));
  if (lane == 0) *d = x8_32_scale(amax);
}

// One super-block of 256 values (lane l holding values 8 l .. 8 l + 7 in v) rounded as
// kquant::quantize(block_q8_k) rounds it (finite x), into q[0..255], *d and sums[0..15] (each 16
// quants' sum): the value of largest magnitude is the first of them (the lowest index on a tie), as
// the host's scan finds it.
__device__ inline void round_x8_256_held(const float (&v)[8], std::int8_t* q, float* d, std::int32_t* sums, int lane) {
  float amax = 0.0f, max = 0.0f;
  int at = 8 * lane;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j], at = 8 * lane + j;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float a = __shfl_xor_sync(0xFFFFFFFFu, amax, off), mx = __shfl_xor_sync(0xFFFFFFFFu, max, off);
    const int i = __shfl_xor_sync(0xFFFFFFFFu, at, off);
    if (a > amax || (a == amax && i < at)) amax = a, max = mx, at = i;
  }
  std::uint32_t packed[2] = {0, 0};
  int sum = 0;
  if (amax != 0.0f) {
    const float iscale = __fdiv_rn(-127.0f, max);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = min(127, __float2int_rn(__fmul_rn(iscale, v[j])));
      sum += n;
      packed[j / 4] |= (static_cast<std::uint32_t>(n) & 0xFFu) << (8 * (j % 4));
    }
    if (lane == 0) *d = __frcp_rn(iscale);
  } else if (lane == 0) {
    *d = 0.0f;
  }
  *reinterpret_cast<uint2*>(q + 8 * lane) = make_uint2(packed[0], packed[1]);
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  if (lane % 2 == 0) sums[lane / 2] = sum;
}

// The same from x (16-byte aligned; lane l reads values 8 l .. 8 l + 7).
__device__ inline void round_x8_256(const float* x, std::int8_t* q, float* d, std::int32_t* sums, int lane) {
  const float4* src = reinterpret_cast<const float4*>(x + 8 * lane);
  const float4 lo = src[0], hi = src[1];
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  round_x8_256_held(v, q, d, sums, lane);
}

// Blocks of 32 values held 8 a lane (lanes 4k .. 4k + 3 hold block k of the warp's 256: values 8 lane
// .. 8 lane + 7) rounded as round_x8_32 rounds them (the same scale and quants: the largest magnitude is
// the same whatever the order it is found in), into q[8 lane ..] and d[lane / 4]; `mine`: whether the
// lane holds values (lanes past a row's end do not store; their groups of 4 hold none either).
__device__ inline void round_x8_32_by8(const float (&v)[8], std::int8_t* q, float* d, int lane, bool mine) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, x8_32_magnitude(v[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  if (!mine) return;
  const float id = x8_32_inverse(amax);
  std::uint32_t packed[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    packed[j / 4] |= (static_cast<std::uint32_t>(x8_32_quant(v[j], id)) & 0xFFu) << (8 * (j % 4));
  *reinterpret_cast<uint2*>(q + 8 * lane) = make_uint2(packed[0], packed[1]);
  if (lane % 4 == 0) d[lane / 4] = x8_32_scale(amax);
}

// x rounded per 32 (round_x8_32): a warp per block.
template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    quantize_x8_32_kernel(const float* x, std::size_t blocks, std::int8_t* q, float* d) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * (Policy::threads / 32);
  for (std::size_t b = (blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x) / 32; b < blocks;
       b += warps)
    round_x8_32(x + 32 * b, q + 32 * b, d + b, lane);
}

// x rounded per 256 (round_x8_256): a warp per super-block.
template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    quantize_x8_256_kernel(const float* x, std::size_t blocks, std::int8_t* q, float* d, std::int32_t* sums) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * (Policy::threads / 32);
  for (std::size_t b = (blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x) / 32; b < blocks;
       b += warps)
    round_x8_256(x + 256 * b, q + 256 * b, d + b, sums + 16 * b, lane);
}

// RMSNorm of one row (agent::rmsnorm: y written, the same bits), then the row's y rounded to 8 bits
// per `span` (32 or 256) by the block's warps in turn: rmsnorm and quantize_x8 in one launch.
template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    rmsnorm_x8_kernel(const float* x, const float* weight, float* y, std::size_t n, float eps, std::size_t span,
                      std::int8_t* q, float* d, std::int32_t* sums) {
  __shared__ typename agent::rmsnorm<Policy>::storage temp;
  const std::size_t row = blockIdx.x;
  float* yr = y + row * n;
  agent::rmsnorm<Policy>::run(temp, x + row * n, weight, yr, n, eps);
  __syncthreads();  // (the row's y, written by every thread, read back by the warps below)
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::size_t blocks = n / span;
  for (std::size_t b = static_cast<std::size_t>(warp); b < blocks; b += Policy::threads / 32) {
    const std::size_t at = row * n + span * b;  // (the row's quants start at row * n, its scales at row * blocks)
    if (span == 256)
      round_x8_256(y + at, q + at, d + row * blocks + b, sums + at / 16, lane);
    else
      round_x8_32(y + at, q + at, d + row * blocks + b, lane);
  }
}

// rmsnorm_x8_kernel for rows that rmsnorm takes wide (agent::rmsnorm_wide: the same bits), each warp
// rounding the normed values its lanes hold in registers: its 256 values as one super-block, or as 8
// blocks of 32 (a row's last warp may hold fewer: whole blocks of 32, as n is).
__global__ void __launch_bounds__(1024)
    rmsnorm_wide_x8_kernel(const float* x, const float* weight, float* y, unsigned n, float eps, unsigned span,
                           std::int8_t* q, float* d, std::int32_t* sums) {
  __shared__ agent::rmsnorm_wide::storage temp;
  const std::size_t row = blockIdx.x;
  float v[8];
  const bool mine = agent::rmsnorm_wide::run(temp, x + row * n, weight, y + row * n, n, eps, v);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::size_t warp = threadIdx.x / 32, at = row * n + 256 * warp;  // the warp's first value
  if (span == 256) {
    if (256 * warp < n) round_x8_256_held(v, q + at, d + at / 256, sums + at / 16, lane);  // (n: whole super-blocks)
  } else {
    round_x8_32_by8(v, q + at, d + at / 32, lane, mine);
  }
}

// Eight values rounded to f16 into out, 16-byte aligned, in one store.
__device__ inline void store_f16x8(const float* v, __half* out) {
  __half2 h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __halves2half2(__float2half_rn(v[2 * k]), __float2half_rn(v[2 * k + 1]));
  *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(h);
}

// Rows first .. first + count of w as f16, row-major (count, cols), into out: one thread per group.
template <class Policy, dtype T>
__global__ void __launch_bounds__(Policy::threads)
    quant_to_f16_kernel(const std::uint8_t* w, std::size_t row_bytes, std::size_t cols, std::size_t first,
                        std::size_t count, __half* out) {
  const std::size_t groups = cols / 8, total = count * groups;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const std::size_t r = i / groups, g = i % groups;
    float v[8];
    quant::decode8<T>(w + (first + r) * row_bytes, g, v);
    store_f16x8(v, out + r * cols + 8 * g);
  }
}

// launch(std::bool_constant<Parts>{}) for the decode kernels' instance that serves these parts: one
// part as a plain product, several (one x row only: their instances for more rows would double the
// decode kernels' compile time for launches that matter most at one sequence) choosing theirs.
template <class F>
void by_parts(const decode_parts& parts, std::size_t m, F&& launch) {
  if (parts.count == 1) {
    launch(std::false_type{});
    return;
  }
  require(m == 1, errc::invalid_argument, "device::quant_decode: several matrices in one launch take one x row");
  launch(std::true_type{});
}

// What the decode kernels require of m x rows (`what` names the product).
template <class Policy>
void require_decode_rows(std::size_t m, const char* what) {
  static_assert(Policy::decode_rows <= 8, "the decode kernel is instantiated for up to 8 x rows");
  require(m >= 1 && m <= Policy::decode_rows, errc::invalid_argument, std::string(what) + ": 1 to 8 x rows");
}

// What both decode products require of a launch over parts with m x rows.
template <class Policy>
void require_decode_launch(const decode_parts& parts, std::size_t m, const char* what) {
  require_decode_rows<Policy>(m, what);
  require(parts.count >= 1, errc::invalid_argument, std::string(what) + ": no matrix");
  require(parts.warps == Policy::warps, errc::invalid_argument, std::string(what) + ": parts of other blocks");
}

// f(std::integral_constant<int, M>{}) for the decode kernels' instance that serves m x rows: M = 1, 2,
// 4 or 8, the least of them >= m.
template <class F>
void by_decode_rows(std::size_t m, F&& f) {
  if (m == 1)
    f(std::integral_constant<int, 1>{});
  else if (m == 2)
    f(std::integral_constant<int, 2>{});
  else if (m <= 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

// launch(type_c, rows_c, parts_c) (integral constants: T, M, Parts) for the decode kernel instance that
// serves a launch of m x rows over these parts of type `type`, among the types `visit` covers
// (quant::visit_decoded or visit_kept, as a callable): by_parts, then by_decode_rows.
template <class Visit, class F>
void by_decode_instance(dtype type, const decode_parts& parts, std::size_t m, Visit&& visit, F&& launch) {
  by_parts(parts, m, [&](auto parts_c) {
    constexpr bool Parts = decltype(parts_c)::value;
    visit(type, [&](auto type_c) {
      by_decode_rows(m, [&](auto rows_c) {
        constexpr int M = decltype(rows_c)::value;
        if constexpr (!Parts || M == 1) launch(type_c, rows_c, parts_c);  // (several parts: one x row)
      });
    });
  });
}

}  // namespace detail

// Weight rows dequantized per prefill slice for a matrix of `cols` inputs: a multiple of 256 where the
// matrix takes more than one (each slice's output columns then start 1 KiB aligned and are a whole
// number of cuBLAS's tiles wide, as its vectorized kernels want).
template <class Policy = policy::quant_matmul>
std::size_t quant_slice_rows(std::size_t rows, std::size_t cols) noexcept {
  const std::size_t fit = Policy::slice_bytes / (cols * 2);
  return fit >= rows ? rows : std::max<std::size_t>(256, fit / 256 * 256);
}

// Workspace bytes a product of m x rows with quantized weights (rows, cols) needs: for decode, the x
// rows rounded to 8 bits (used by the int8 products only); for prefill, the x rows in f16 and one
// slice of f16 weights.
template <class Policy = policy::quant_matmul>
std::size_t quant_matmul_workspace(std::size_t rows, std::size_t cols, std::size_t m) noexcept {
  if (m <= Policy::decode_rows) return quant::x8_bytes(m, cols);
  return m * cols * 2 + quant_slice_rows<Policy>(rows, cols) * cols * 2;
}

namespace detail {
// The decode kernels' check of a matrix: a type they decode, rows of whole blocks (quantized) or of
// whole chunks of 8 (dense).
inline void require_decodable(dtype type, std::size_t cols, const char* what) {
  require(quant::kept_quantized(type) ? cols % 32 == 0 : quant::dense_decodes(type, cols), errc::invalid_argument,
          std::string(what) + ": weights in " + std::string(to_string(type)) +
              " (a row must be whole blocks of 32 of a quantized type, or of 8 f16, bf16 or f32 values)");
}
}  // namespace detail

// The decode product of several matrices of one type and width in one launch (decode_parts: q, k and
// v), each part's y as quant_decode gives it, bit for bit.
template <class Policy = policy::quant_matmul>
void quant_decode_parts(dtype type, const decode_parts& parts, std::size_t cols, const float* x, std::size_t m,
                        cudaStream_t stream, accumulate acc = accumulate::no) {
  detail::require_decode_launch<Policy>(parts, m, "device::quant_decode");
  detail::require_decodable(type, cols, "device::quant_decode");
  const auto blocks = static_cast<unsigned>(parts.blocks());
  if (blocks == 0) return;
  const std::size_t rb = row_bytes(type, cols);
  const int xm = static_cast<int>(m);
  const bool add = acc == accumulate::yes;
  const auto visit = [](dtype t, auto&& f) { quant::visit_decoded(t, f); };
  detail::by_decode_instance(type, parts, m, visit, [&](auto type_c, auto rows_c, auto parts_c) {
    detail::quant_decode_kernel<Policy, decltype(type_c)::value, decltype(rows_c)::value, decltype(parts_c)::value>
        <<<blocks, Policy::warps * 32, 0, stream>>>(parts, rb, cols, x, xm, add);
  });
  check(cudaGetLastError(), "quant_decode launch");
}

// The decode product: y (m, rows) = [y +] x (m, cols) * dequantize(w)^T [+ bias (rows)] for m <=
// Policy::decode_rows, w quantized or dense (f16, bf16, f32: quant::dense_decodes). w: rows of
// row_bytes(type, cols) bytes from a 16-byte aligned address; x 16-byte aligned.
template <class Policy = policy::quant_matmul>
void quant_decode(dtype type, const void* w, std::size_t rows, std::size_t cols, const float* x, std::size_t m,
                  float* y, cudaStream_t stream, accumulate acc = accumulate::no, const float* bias = nullptr) {
  decode_parts parts;
  parts.add(w, rows, y, bias, Policy::warps);
  quant_decode_parts<Policy>(type, parts, cols, x, m, stream, acc);
}

// x (m, cols) rounded to 8 bits for weights of type t (quant::x8_span(t) values a scale), into the
// planar arrays of `workspace` (quant::x8_bytes(m, cols) bytes, 16-byte aligned); the view of them.
template <class Policy = policy::quant_matmul>
quant::x8_rows quantize_x8(dtype t, const float* x, std::size_t m, std::size_t cols, void* workspace,
                           cudaStream_t stream) {
  require(cols % 32 == 0 && cols % quant::x8_span(t) == 0, errc::invalid_argument,
          "device::quantize_x8: a row must be whole blocks of the weights' activation scale");
  auto* const base = static_cast<std::byte*>(workspace);
  auto* const q = reinterpret_cast<std::int8_t*>(base);
  auto* const d = reinterpret_cast<float*>(base + quant::x8_scales_at(m, cols));
  auto* const sums = reinterpret_cast<std::int32_t*>(base + quant::x8_sums_at(m, cols));
  const std::size_t span = quant::x8_span(t), blocks = m * cols / span;
  const unsigned grid = detail::grid_for<Policy>(blocks * 32);
  if (span == 256)
    detail::quantize_x8_256_kernel<Policy><<<grid, Policy::threads, 0, stream>>>(x, blocks, q, d, sums);
  else
    detail::quantize_x8_32_kernel<Policy><<<grid, Policy::threads, 0, stream>>>(x, blocks, q, d);
  check(cudaGetLastError(), "quantize_x8 launch");
  return {q, d, sums, cols};
}

// y (rows, n) = RMSNorm(x) (kernels::device::rmsnorm: the same bits; y may be x), and y rounded to 8
// bits for weights of type t as quantize_x8 rounds it, into `workspace` (quant::x8_bytes(rows, n)
// bytes): one launch, a block per row. y 16-byte aligned. The view of the rounded rows.
template <class Policy = policy::rmsnorm>
quant::x8_rows rmsnorm_x8(dtype t, const float* x, const float* weight, float* y, std::size_t rows, std::size_t n,
                          float eps, void* workspace, cudaStream_t stream) {
  static_assert(Policy::threads % 32 == 0, "rmsnorm_x8 rounds with whole warps");
  const std::size_t span = quant::x8_span(t);
  require(n % span == 0, errc::invalid_argument, "device::rmsnorm_x8: a row must be whole blocks of the span");
  require(rows <= 0x7FFFFFFFu, errc::invalid_argument, "device::rmsnorm_x8: more than 2^31 - 1 rows");
  auto* const base = static_cast<std::byte*>(workspace);
  auto* const q = reinterpret_cast<std::int8_t*>(base);
  auto* const d = reinterpret_cast<float*>(base + quant::x8_scales_at(rows, n));
  auto* const sums = reinterpret_cast<std::int32_t*>(base + quant::x8_sums_at(rows, n));
  if (rows == 0 || n == 0) return {q, d, sums, n};
  if (rmsnorm_is_wide<Policy>(x, weight, y, n))
    detail::rmsnorm_wide_x8_kernel<<<static_cast<unsigned>(rows), rmsnorm_wide_threads(n), 0, stream>>>(
        x, weight, y, static_cast<unsigned>(n), eps, static_cast<unsigned>(span), q, d, sums);
  else
    detail::rmsnorm_x8_kernel<Policy>
        <<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(x, weight, y, n, eps, span, q, d, sums);
  check(cudaGetLastError(), "rmsnorm_x8 launch");
  return {q, d, sums, n};
}

// quant_decode_int8 of several matrices of one quantized type and width in one launch (decode_parts),
// each part's y as quant_decode_int8 gives it, bit for bit.
template <class Policy = policy::quant_matmul>
void quant_decode_int8_parts(dtype type, const decode_parts& parts, std::size_t cols, const float* x, std::size_t m,
                             void* workspace, cudaStream_t stream, accumulate acc = accumulate::no,
                             const quant::x8_rows* rounded = nullptr) {
  detail::require_decode_launch<Policy>(parts, m, "device::quant_decode_int8");
  require(rounded == nullptr || rounded->cols == cols, errc::invalid_argument,
          "device::quant_decode_int8: rounded rows of another width");
  const quant::x8_rows xq = rounded != nullptr ? *rounded : quantize_x8<Policy>(type, x, m, cols, workspace, stream);
  const auto blocks = static_cast<unsigned>(parts.blocks());
  if (blocks == 0) return;
  const std::size_t rb = row_bytes(type, cols);
  const int xm = static_cast<int>(m);
  const bool add = acc == accumulate::yes;
  const auto visit = [](dtype t, auto&& f) { quant::visit_kept(t, f); };
  detail::by_decode_instance(type, parts, m, visit, [&](auto type_c, auto rows_c, auto parts_c) {
    detail::quant_decode_int8_kernel<Policy, decltype(type_c)::value, decltype(rows_c)::value, decltype(parts_c)::value>
        <<<blocks, Policy::warps * 32, 0, stream>>>(parts, rb, xq, xm, add);
  });
  check(cudaGetLastError(), "quant_decode_int8 launch");
}

// quant_decode_int8_parts over parts of two types at one x row (quant::int8_pair(t0, t1); parts from
// parts.second on of t1), one launch: each part's products the bits of quant_decode_int8 of it alone.
// `rounded`: the x row rounded to 8 bits for their span (the same for both types).
template <class Policy = policy::quant_matmul>
void quant_decode_int8_pair(dtype t0, dtype t1, const decode_parts& parts, std::size_t cols,
                            const quant::x8_rows& rounded, cudaStream_t stream, accumulate acc = accumulate::no) {
  detail::require_decode_launch<Policy>(parts, 1, "device::quant_decode_int8_pair");
  require(quant::int8_pair(t0, t1) && parts.second > 0 && parts.second < parts.count, errc::invalid_argument,
          "device::quant_decode_int8_pair: parts of a base type, then of its type of more bits");
  require(rounded.cols == cols && cols % quant::x8_span(t0) == 0 && cols % quant::x8_span(t1) == 0,
          errc::invalid_argument, "device::quant_decode_int8_pair: rows of whole blocks, rounded to their span");
  const auto blocks = static_cast<unsigned>(parts.blocks());
  if (blocks == 0) return;
  const bool add = acc == accumulate::yes;
  const auto launch = [&](auto a, auto b) {
    detail::quant_decode_int8_pair_kernel<Policy, decltype(a)::value, decltype(b)::value>
        <<<blocks, Policy::warps * 32, 0, stream>>>(parts, row_bytes(t0, cols), row_bytes(t1, cols), rounded, add);
  };
  using q4 = std::integral_constant<dtype, dtype::q4_k>;
  using q5 = std::integral_constant<dtype, dtype::q5_k>;
  using q6 = std::integral_constant<dtype, dtype::q6_k>;
  using q50 = std::integral_constant<dtype, dtype::q5_0>;
  using q51 = std::integral_constant<dtype, dtype::q5_1>;
  using q80 = std::integral_constant<dtype, dtype::q8_0>;
  if (t0 == dtype::q4_k)
    launch(q4{}, q6{});
  else if (t0 == dtype::q5_k)
    launch(q5{}, q6{});
  else if (t0 == dtype::q5_0)
    launch(q50{}, q80{});
  else
    launch(q51{}, q80{});
  check(cudaGetLastError(), "quant_decode_int8_pair launch");
}

// The int8 decode product: y (m, rows) = [y +] x (m, cols) * w^T [+ bias] with x rounded to 8 bits
// (quantize_x8, into `workspace`: quant::x8_bytes(m, cols) bytes) and multiplied in integers, for m
// <= Policy::decode_rows. `rounded`: x already rounded for weights of this type's span (quantize_x8
// of the same rows), which is then used instead (x and workspace unread).
template <class Policy = policy::quant_matmul>
void quant_decode_int8(dtype type, const void* w, std::size_t rows, std::size_t cols, const float* x, std::size_t m,
                       float* y, void* workspace, cudaStream_t stream, accumulate acc = accumulate::no,
                       const float* bias = nullptr, const quant::x8_rows* rounded = nullptr) {
  decode_parts parts;
  parts.add(w, rows, y, bias, Policy::warps);
  quant_decode_int8_parts<Policy>(type, parts, cols, x, m, workspace, stream, acc, rounded);
}

// The FFN of a decode step in one launch: out (m, rows) = swiglu(x w_gate^T, x w_up^T [+ bias_up]) for
// two matrices of one type and shape (quantized, or dense as quant_decode takes them), m <=
// Policy::decode_rows; products::int8 (quantized weights only) rounds x to 8 bits first (into
// `workspace`, quant::x8_bytes(m, cols) bytes, unless `rounded` holds it already). The same bits as
// quant_decode (or quant_decode_int8) of each, add_bias and swiglu.
template <class Policy = policy::quant_matmul>
void quant_decode_swiglu(dtype type, const void* gate, const void* up, std::size_t rows, std::size_t cols,
                         const float* x, std::size_t m, float* out, cudaStream_t stream, const float* bias_up = nullptr,
                         products p = products::exact, void* workspace = nullptr,
                         const quant::x8_rows* rounded = nullptr) {
  detail::require_decode_rows<Policy>(m, "device::quant_decode_swiglu");
  detail::require_decodable(type, cols, "device::quant_decode_swiglu");
  require(rows <= 0x7FFFFFFFull * Policy::warps, errc::invalid_argument,
          "device::quant_decode_swiglu: too many rows for the grid");
  const bool int8 = p == products::int8 && quant::kept_quantized(type);
  require(!int8 || rounded != nullptr || workspace != nullptr, errc::invalid_argument,
          "device::quant_decode_swiglu: int8 products need a workspace or rounded rows");
  require(rounded == nullptr || rounded->cols == cols, errc::invalid_argument,
          "device::quant_decode_swiglu: rounded rows of another width");
  const quant::x8_rows xq = !int8 ? quant::x8_rows{}
                            : rounded != nullptr ? *rounded
                                                 : quantize_x8<Policy>(type, x, m, cols, workspace, stream);
  const std::size_t rb = row_bytes(type, cols);
  const auto* gb = static_cast<const std::uint8_t*>(gate);
  const auto* ub = static_cast<const std::uint8_t*>(up);
  const unsigned blocks = static_cast<unsigned>((rows + Policy::warps - 1) / Policy::warps);
  const int xm = static_cast<int>(m);
  const auto launch = [&](auto t, auto int8_c) {
    detail::by_decode_rows(m, [&](auto rows_c) {
      detail::quant_decode_swiglu_kernel<Policy, decltype(t)::value, decltype(rows_c)::value, decltype(int8_c)::value>
          <<<blocks, Policy::warps * 32, 0, stream>>>(gb, ub, rows, rb, cols, x, xq, xm, out, bias_up);
    });
  };
  if (int8)
    quant::visit_kept(type, [&](auto t) { launch(t, std::true_type{}); });
  else
    quant::visit_decoded(type, [&](auto t) { launch(t, std::false_type{}); });
  check(cudaGetLastError(), "quant_decode_swiglu launch");
}

// Rows first .. first + count of quantized w as f16 (count, cols) into out (16-byte aligned).
template <class Policy = policy::quant_matmul>
void quant_to_f16(dtype type, const void* w, std::size_t cols, std::size_t first, std::size_t count, void* out,
                  cudaStream_t stream) {
  if (count == 0) return;
  const std::size_t rb = row_bytes(type, cols);
  const auto* wb = static_cast<const std::uint8_t*>(w);
  const unsigned grid = detail::grid_for<Policy>(count * (cols / 8));
  quant::visit_kept(type, [&](auto t) {
    detail::quant_to_f16_kernel<Policy, decltype(t)::value>
        <<<grid, Policy::threads, 0, stream>>>(wb, rb, cols, first, count, static_cast<__half*>(out));
  });
  check(cudaGetLastError(), "quant_to_f16 launch");
}

}  // namespace efim::kernels::device
