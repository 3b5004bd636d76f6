#pragma once
// Row-wise and element-wise ops of the CUDA backend, each in CUB's layers: a tuning policy (plain
// constexpr data), an agent (what one thread block does), a thin __global__ kernel, a host dispatch
// that picks the launch shape, and the user-facing function. The contracts are the host kernels'
// (rmsnorm.hpp, layernorm.hpp, swiglu.hpp, gelu.hpp, rope.hpp; the embedding lookup is the
// transformer's dequantize_row of a token's row); pointers are device memory, each call is ordered on
// `stream` and allocates nothing.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "efim/core/dtype.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

namespace policy {
struct rmsnorm {
  static constexpr int threads = 256;  // one block per row
  // Rows of whole groups of 8 values up to this many (16-byte aligned) take a thread per group, its
  // values in registers (agent::rmsnorm_wide): one memory latency, not one per pass.
  static constexpr std::size_t wide_cols = 8192;
};
struct layernorm {
  static constexpr int threads = 256;  // one block per row
};
struct embedding {
  static constexpr int threads = 256;  // one block per token
};
struct elementwise {
  static constexpr int threads = 256;
  static constexpr int max_blocks = 65535;  // then a grid-stride loop
};
}  // namespace policy

namespace agent {

// One row: the sum of squares in a strided pass, a block reduction, then the scaled row. Each
// thread writes only what it read, so y may alias x. A thread takes its values `unroll` at a time,
// all of them loaded before the first is used (one memory latency for them, where y's stores, which
// may alias x, kept the compiler from loading the next value before the last store): the same values
// in the same order, the same bits.
template <class Policy>
struct rmsnorm {
  static constexpr int unroll = 4;
  using reduce = cub::BlockReduce<float, Policy::threads>;
  struct storage {
    typename reduce::TempStorage reduce;
    float scale;
  };
  __device__ static void run(storage& temp, const float* x, const float* weight, float* y, std::size_t n,
                             float eps) {
    constexpr std::size_t step = Policy::threads;
    float sum = 0.0f;
    std::size_t i = threadIdx.x;
    for (; i + (unroll - 1) * step < n; i += unroll * step) {
      float v[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) v[u] = x[i + u * step];
#pragma unroll
      for (int u = 0; u < unroll; ++u) sum = fmaf(v[u], v[u], sum);
    }
    for (; i < n; i += step) sum = fmaf(x[i], x[i], sum);
    const float total = reduce(temp.reduce).Sum(sum);
    if (threadIdx.x == 0) temp.scale = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
    __syncthreads();
    const float scale = temp.scale;
    i = threadIdx.x;
    for (; i + (unroll - 1) * step < n; i += unroll * step) {
      float v[unroll], w[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) v[u] = x[i + u * step], w[u] = weight[i + u * step];
#pragma unroll
      for (int u = 0; u < unroll; ++u) y[i + u * step] = v[u] * scale * w[u];
    }
    for (; i < n; i += step) y[i] = x[i] * scale * weight[i];
  }
};

// One row of n values, n a multiple of 8 up to 32 * 8 * 32 (rmsnorm_wide_threads(n) threads: a warp
// per 256 values): thread t loads values 8t .. 8t + 7 and their weights (16-byte loads) before anything
// else, the sum of squares is the threads' sums (8 in order) added across each warp (xor shuffles) and
// then over the warps in order, and the scaled values are stored from the registers they were read
// into (y may alias x) and left in v for the caller (a thread past n has none: false).
struct rmsnorm_wide {
  struct storage {
    float warp_sums[32];
  };
  __device__ static bool run(storage& temp, const float* x, const float* weight, float* y, unsigned n, float eps,
                             float (&v)[8]) {
    const unsigned t = threadIdx.x, at = 8 * t;
    const bool mine = at < n;
    float w[8] = {};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    if (mine) {
      const float4* xs = reinterpret_cast<const float4*>(x + at);
      const float4* ws = reinterpret_cast<const float4*>(weight + at);
      const float4 x0 = xs[0], x1 = xs[1], w0 = ws[0], w1 = ws[1];
      v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
      w[0] = w0.x, w[1] = w0.y, w[2] = w0.z, w[3] = w0.w, w[4] = w1.x, w[5] = w1.y, w[6] = w1.z, w[7] = w1.w;
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum = fmaf(v[i], v[i], sum);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    if (t % 32 == 0) temp.warp_sums[t / 32] = sum;
    __syncthreads();
    float total = 0.0f;
    for (unsigned k = 0; k < blockDim.x / 32; ++k) total += temp.warp_sums[k];
    const float scale = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
    if (!mine) return false;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * scale * w[i];
    float4* ys = reinterpret_cast<float4*>(y + at);
    ys[0] = make_float4(v[0], v[1], v[2], v[3]);
    ys[1] = make_float4(v[4], v[5], v[6], v[7]);
    return true;
  }
};

// One row: the mean, then the sum of squared deviations (two block reductions), then the scaled,
// shifted row. As in rmsnorm, y may alias x.
template <class Policy>
struct layernorm {
  using reduce = cub::BlockReduce<float, Policy::threads>;
  struct storage {
    typename reduce::TempStorage reduce;
    float mean, scale;
  };
  __device__ static void run(storage& temp, const float* x, const float* weight, const float* bias, float* y,
                             std::size_t n, float eps) {
    float sum = 0.0f;
    for (std::size_t i = threadIdx.x; i < n; i += Policy::threads) sum += x[i];
    const float total = reduce(temp.reduce).Sum(sum);
    if (threadIdx.x == 0) temp.mean = total / static_cast<float>(n);
    __syncthreads();
    const float mean = temp.mean;
    float squares = 0.0f;
    for (std::size_t i = threadIdx.x; i < n; i += Policy::threads) squares = fmaf(x[i] - mean, x[i] - mean, squares);
    const float all = reduce(temp.reduce).Sum(squares);
    if (threadIdx.x == 0) temp.scale = 1.0f / sqrtf(all / static_cast<float>(n) + eps);
    __syncthreads();
    const float scale = temp.scale;
    for (std::size_t i = threadIdx.x; i < n; i += Policy::threads) y[i] = fmaf((x[i] - mean) * scale, weight[i], bias[i]);
  }
};

}  // namespace agent

namespace detail {

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    rmsnorm_kernel(const float* x, const float* weight, float* y, std::size_t n, float eps) {
  __shared__ typename agent::rmsnorm<Policy>::storage temp;
  const std::size_t row = blockIdx.x;
  agent::rmsnorm<Policy>::run(temp, x + row * n, weight, y + row * n, n, eps);
}

__global__ void __launch_bounds__(1024)
    rmsnorm_wide_kernel(const float* x, const float* weight, float* y, unsigned n, float eps) {
  __shared__ agent::rmsnorm_wide::storage temp;
  const std::size_t row = blockIdx.x;
  float v[8];
  agent::rmsnorm_wide::run(temp, x + row * n, weight, y + row * n, n, eps, v);
}

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    layernorm_kernel(const float* x, const float* weight, const float* bias, float* y, std::size_t n, float eps) {
  __shared__ typename agent::layernorm<Policy>::storage temp;
  const std::size_t row = blockIdx.x;
  agent::layernorm<Policy>::run(temp, x + row * n, weight, bias, y + row * n, n, eps);
}

template <class Policy>
__global__ void __launch_bounds__(Policy::threads) gelu_kernel(const float* x, float* out, std::size_t n) {
  constexpr float sqrt_2_over_pi = 0.7978845608028654f, cubic = 0.044715f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const float v = x[i];
    out[i] = 0.5f * v * (1.0f + tanhf(sqrt_2_over_pi * fmaf(cubic * v, v * v, v)));
  }
}

// Row ids[t] of a (rows, n) table of f32, f16 or bf16 elements, as f32, into row t of out.
template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    embedding_kernel(dtype type, const void* table, std::size_t n, const token_id* ids, float* out) {
  const std::size_t t = blockIdx.x, row = static_cast<std::size_t>(ids[t]);
  for (std::size_t i = threadIdx.x; i < n; i += Policy::threads) {
    float v;
    if (type == dtype::f32) {
      v = static_cast<const float*>(table)[row * n + i];
    } else {
      const std::uint16_t h = static_cast<const std::uint16_t*>(table)[row * n + i];
      v = type == dtype::f16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
    out[t * n + i] = v;
  }
}

// The same for a table kept block-quantized: a token's row eight weights at a time, as dequantize_row
// gives them.
template <class Policy, dtype T>
__global__ void __launch_bounds__(Policy::threads)
    embedding_quant_kernel(const std::uint8_t* table, std::size_t n, std::size_t bytes, const token_id* ids, float* out) {
  const std::size_t t = blockIdx.x, row = static_cast<std::size_t>(ids[t]);
  for (std::size_t g = threadIdx.x; g < n / 8; g += Policy::threads) {
    float v[8];
    quant::decode8<T>(table + row * bytes, g, v);
    for (int k = 0; k < 8; ++k) out[t * n + 8 * g + k] = v[k];
  }
}

// SwiGLU of one gate and up value, as the host kernel computes it (0 below -88): every SwiGLU on the
// device is this, so fused and apart give the same bits.
__device__ inline float swiglu_one(float g, float u) { return g < -88.0f ? 0.0f : g / (1.0f + expf(-g)) * u; }

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    swiglu_kernel(const float* gate, const float* up, float* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads)
    out[i] = swiglu_one(gate[i], up[i]);
}

// The dimensions of rotary pair i of a head (rope_style) and the pair rotated by angle (c, s): the
// one rotation every RoPE kernel here applies, so that all give the same bits.
__device__ inline void rope_dims(rope_style style, std::size_t i, std::size_t pairs, std::size_t& a, std::size_t& b) {
  a = style == rope_style::adjacent ? 2 * i : i;
  b = style == rope_style::adjacent ? 2 * i + 1 : i + pairs;
}
__device__ inline void rope_rotate(float x0, float x1, float c, float s, float& y0, float& y1) {
  y0 = fmaf(x0, c, -(x1 * s));
  y1 = fmaf(x0, s, x1 * c);
}

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    rope_kernel(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
                const float* sin_t, rope_style style) {
  const std::size_t pairs = head_dim / 2, total = tokens * heads * pairs;
  for (std::size_t k = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; k < total;
       k += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const std::size_t i = k % pairs, th = k / pairs, t = th / heads;
    float* v = x + th * head_dim;
    std::size_t a, b;
    rope_dims(style, i, pairs, a, b);
    rope_rotate(v[a], v[b], cos_t[t * pairs + i], sin_t[t * pairs + i], v[a], v[b]);
  }
}

// y[r][j] += bias[j] for a (rows, n) y.
template <class Policy>
__global__ void __launch_bounds__(Policy::threads) add_bias_kernel(float* y, const float* bias, std::size_t total,
                                                                   std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads)
    y[i] += bias[i % n];
}

// Blocks for a grid-stride loop over n items.
template <class Policy>
inline unsigned grid_for(std::size_t n) noexcept {
  const std::size_t blocks = (n + Policy::threads - 1) / Policy::threads;
  return static_cast<unsigned>(blocks < Policy::max_blocks ? blocks : Policy::max_blocks);
}

}  // namespace detail

// Whether rmsnorm takes rows of n values through agent::rmsnorm_wide (whole groups of 8, at most the
// policy's wide_cols, every row 16-byte aligned), and with how many threads: a warp per 256 values.
template <class Policy = policy::rmsnorm>
inline bool rmsnorm_is_wide(const float* x, const float* weight, const float* y, std::size_t n) noexcept {
  static_assert(Policy::wide_cols <= 8 * 1024, "a thread per 8 values, at most 1024 threads");
  const auto aligned = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return n % 8 == 0 && n <= Policy::wide_cols && aligned(x) && aligned(weight) && aligned(y);
}
inline unsigned rmsnorm_wide_threads(std::size_t n) noexcept { return static_cast<unsigned>((n + 255) / 256 * 32); }

// Dispatch: the launch shape for the policy, then a check that the launch was taken.
template <class Policy = policy::rmsnorm>
void dispatch_rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n, float eps,
                      cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  require(rows <= 0x7FFFFFFFu, errc::invalid_argument, "device::rmsnorm: more than 2^31 - 1 rows");
  if (rmsnorm_is_wide<Policy>(x, weight, y, n)) {
    detail::rmsnorm_wide_kernel<<<static_cast<unsigned>(rows), rmsnorm_wide_threads(n), 0, stream>>>(
        x, weight, y, static_cast<unsigned>(n), eps);
  } else {
    detail::rmsnorm_kernel<Policy><<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(x, weight, y, n, eps);
  }
  check(cudaGetLastError(), "rmsnorm launch");
}
template <class Policy = policy::layernorm>
void dispatch_layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows,
                        std::size_t n, float eps, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  require(rows <= 0x7FFFFFFFu, errc::invalid_argument, "device::layernorm: more than 2^31 - 1 rows");
  detail::layernorm_kernel<Policy>
      <<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(x, weight, bias, y, n, eps);
  check(cudaGetLastError(), "layernorm launch");
}
template <class Policy = policy::elementwise>
void dispatch_gelu(const float* x, float* out, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  detail::gelu_kernel<Policy><<<detail::grid_for<Policy>(n), Policy::threads, 0, stream>>>(x, out, n);
  check(cudaGetLastError(), "gelu launch");
}
template <class Policy = policy::embedding>
void dispatch_embedding(dtype type, const void* table, std::size_t n, const token_id* ids, std::size_t tokens,
                        float* out, cudaStream_t stream) {
  const bool quantized = quant::kept_quantized(type);
  require(type == dtype::f32 || type == dtype::f16 || type == dtype::bf16 || quantized, errc::invalid_argument,
          "device::embedding: the table must be f32, f16, bf16 or a type the device keeps quantized");
  if (tokens == 0 || n == 0) return;
  require(tokens <= 0x7FFFFFFFu, errc::invalid_argument, "device::embedding: more than 2^31 - 1 tokens");
  if (quantized) {
    const std::size_t bytes = row_bytes(type, n);  // (throws unless a row is whole blocks)
    quant::visit_kept(type, [&](auto t) {
      detail::embedding_quant_kernel<Policy, decltype(t)::value><<<static_cast<unsigned>(tokens), Policy::threads, 0, stream>>>(
          static_cast<const std::uint8_t*>(table), n, bytes, ids, out);
    });
    check(cudaGetLastError(), "embedding launch");
    return;
  }
  detail::embedding_kernel<Policy><<<static_cast<unsigned>(tokens), Policy::threads, 0, stream>>>(type, table, n, ids, out);
  check(cudaGetLastError(), "embedding launch");
}
template <class Policy = policy::elementwise>
void dispatch_swiglu(const float* gate, const float* up, float* out, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  detail::swiglu_kernel<Policy><<<detail::grid_for<Policy>(n), Policy::threads, 0, stream>>>(gate, up, out, n);
  check(cudaGetLastError(), "swiglu launch");
}
template <class Policy = policy::elementwise>
void dispatch_rope(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
                   const float* sin_t, rope_style style, cudaStream_t stream) {
  const std::size_t total = tokens * heads * (head_dim / 2);
  if (total == 0) return;
  detail::rope_kernel<Policy>
      <<<detail::grid_for<Policy>(total), Policy::threads, 0, stream>>>(x, tokens, heads, head_dim, cos_t, sin_t, style);
  check(cudaGetLastError(), "rope launch");
}

template <class Policy = policy::elementwise>
void dispatch_add_bias(float* y, const float* bias, std::size_t rows, std::size_t n, cudaStream_t stream) {
  const std::size_t total = rows * n;
  if (total == 0) return;
  detail::add_bias_kernel<Policy><<<detail::grid_for<Policy>(total), Policy::threads, 0, stream>>>(y, bias, total, n);
  check(cudaGetLastError(), "add_bias launch");
}

// The user-facing functions, with the host kernels' arguments plus a stream.
inline void rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n, float eps,
                    cudaStream_t stream = nullptr) {
  dispatch_rmsnorm<>(x, weight, y, rows, n, eps, stream);
}
inline void layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows,
                      std::size_t n, float eps, cudaStream_t stream = nullptr) {
  dispatch_layernorm<>(x, weight, bias, y, rows, n, eps, stream);
}
inline void gelu(const float* x, float* out, std::size_t n, cudaStream_t stream = nullptr) {
  dispatch_gelu<>(x, out, n, stream);
}
// ids (device memory) must lie in the table; the caller checked them on the host.
inline void embedding(dtype type, const void* table, std::size_t n, const token_id* ids, std::size_t tokens, float* out,
                      cudaStream_t stream = nullptr) {
  dispatch_embedding<>(type, table, n, ids, tokens, out, stream);
}
inline void swiglu(const float* gate, const float* up, float* out, std::size_t n, cudaStream_t stream = nullptr) {
  dispatch_swiglu<>(gate, up, out, n, stream);
}
inline void rope(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
                 const float* sin_t, rope_style style, cudaStream_t stream = nullptr) {
  dispatch_rope<>(x, tokens, heads, head_dim, cos_t, sin_t, style, stream);
}

// y (rows, n) += bias (n) on every row.
inline void add_bias(float* y, const float* bias, std::size_t rows, std::size_t n, cudaStream_t stream = nullptr) {
  dispatch_add_bias<>(y, bias, rows, n, stream);
}

}  // namespace efim::kernels::device
