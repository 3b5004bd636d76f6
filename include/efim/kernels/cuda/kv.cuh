#pragma once
// The CUDA backend's paged-KV ops over the host's layout vocabulary (kv::paged_layout): the write of
// new K/V rows into their pages, and block copies (copy-on-write). The caller uploads where each
// token goes, (block, slot) per token, once per step; pointers are device memory, each call is
// ordered on `stream` and allocates nothing.
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "efim/core/dtype.hpp"
#include "efim/core/types.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/ops.cuh"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kv/layout.hpp"

namespace efim::kernels::device {

namespace policy {
struct kv {
  static constexpr int threads = 256;
  static constexpr int max_blocks = 65535;  // then a grid-stride loop
};
}  // namespace policy

namespace detail {

// float as itself, half as efim's f16 bits (the host's rounding, bit for bit).
__device__ inline void store(float x, float& out) { out = x; }
__device__ inline void store(float x, half& out) { out.bits = f32_to_f16(x); }

template <class Policy, class E>
__global__ void __launch_bounds__(Policy::threads)
    kv_write_kernel(kv::paged_layout l, E* k_cache, E* v_cache, const float* k, const float* v,
                    const kv::slot_ref* slots, std::size_t tokens) {
  const std::size_t row = l.kv_heads * l.head_dim, total = tokens * row;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const std::size_t t = i / row, g = (i % row) / l.head_dim, d = i % l.head_dim;
    const kv::slot_ref at = slots[t];
    store(k[i], k_cache[l.key_offset(static_cast<std::size_t>(at.block), g) + d * l.block_size + at.slot]);
    store(v[i], v_cache[l.offset(static_cast<std::size_t>(at.block), g, at.slot) + d]);
  }
}

// RoPE on q (in place) and k, then k and v into their pages: one thread per rotary pair of a query
// head, or of a KV head (whose two K and two V elements it stores); the rotation and the stores are
// rope_kernel's and kv_write_kernel's, so the same bits as the three launches.
template <class Policy, class E>
__global__ void __launch_bounds__(Policy::threads)
    rope_kv_write_kernel(kv::paged_layout l, E* k_cache, E* v_cache, float* q, const float* k, const float* v,
                         const kv::slot_ref* slots, std::size_t tokens, std::size_t heads, const float* cos_t,
                         const float* sin_t, rope_style style) {
  const std::size_t hd = l.head_dim, pairs = hd / 2, per_token = (heads + l.kv_heads) * pairs;
  const std::size_t total = tokens * per_token;
  for (std::size_t n = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; n < total;
       n += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const std::size_t t = n / per_token, h = n % per_token / pairs, i = n % pairs;
    std::size_t a, b;
    rope_dims(style, i, pairs, a, b);
    const float c = cos_t[t * pairs + i], s = sin_t[t * pairs + i];
    if (h < heads) {
      float* x = q + (t * heads + h) * hd;
      rope_rotate(x[a], x[b], c, s, x[a], x[b]);
      continue;
    }
    const std::size_t g = h - heads, row = (t * l.kv_heads + g) * hd;
    float ka, kb;
    rope_rotate(k[row + a], k[row + b], c, s, ka, kb);
    const kv::slot_ref at = slots[t];
    E* keys = k_cache + l.key_offset(static_cast<std::size_t>(at.block), g) + at.slot;
    E* values = v_cache + l.offset(static_cast<std::size_t>(at.block), g, at.slot);
    store(ka, keys[a * l.block_size]);
    store(kb, keys[b * l.block_size]);
    store(v[row + a], values[a]);
    store(v[row + b], values[b]);
  }
}

template <class Policy, class E>
__global__ void __launch_bounds__(Policy::threads)
    block_copy_kernel(std::size_t block_elements, E* k_cache, E* v_cache, const block_id* from, const block_id* to,
                      std::size_t pairs) {
  const std::size_t total = pairs * block_elements;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    const std::size_t p = i / block_elements, e = i % block_elements;
    const std::size_t src = static_cast<std::size_t>(from[p]) * block_elements + e;
    const std::size_t dst = static_cast<std::size_t>(to[p]) * block_elements + e;
    k_cache[dst] = k_cache[src];
    v_cache[dst] = v_cache[src];
  }
}

template <class Policy>
inline unsigned kv_grid(std::size_t n) noexcept {
  const std::size_t blocks = (n + Policy::threads - 1) / Policy::threads;
  return static_cast<unsigned>(blocks < Policy::max_blocks ? blocks : Policy::max_blocks);
}

}  // namespace detail

// k, v: (tokens, kv_heads, head_dim) rows; slots: where token t goes. E is float or half.
template <class E, class Policy = policy::kv>
void kv_write(const kv::paged_layout& l, E* k_cache, E* v_cache, const float* k, const float* v,
              const kv::slot_ref* slots, std::size_t tokens, cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, half>, "KV elements are float or half");
  const std::size_t total = tokens * l.kv_heads * l.head_dim;
  if (total == 0) return;
  detail::kv_write_kernel<Policy, E>
      <<<detail::kv_grid<Policy>(total), Policy::threads, 0, stream>>>(l, k_cache, v_cache, k, v, slots, tokens);
  check(cudaGetLastError(), "kv_write launch");
}

// rope (kernels::device::rope) of q (tokens, heads, head_dim) in place and of k (tokens, kv_heads,
// head_dim), then kv_write of the rotated k and of v: one launch, the same bits as the three (k itself
// is left unrotated).
template <class E, class Policy = policy::kv>
void rope_kv_write(const kv::paged_layout& l, E* k_cache, E* v_cache, float* q, const float* k, const float* v,
                   const kv::slot_ref* slots, std::size_t tokens, std::size_t heads, const float* cos_t,
                   const float* sin_t, rope_style style, cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, half>, "KV elements are float or half");
  require(l.head_dim % 2 == 0, errc::invalid_argument, "device::rope_kv_write: an odd head size");
  const std::size_t total = tokens * (heads + l.kv_heads) * (l.head_dim / 2);
  if (total == 0) return;
  detail::rope_kv_write_kernel<Policy, E><<<detail::kv_grid<Policy>(total), Policy::threads, 0, stream>>>(
      l, k_cache, v_cache, q, k, v, slots, tokens, heads, cos_t, sin_t, style);
  check(cudaGetLastError(), "rope_kv_write launch");
}

// Copies block from[p] to block to[p] (K and V of one layer) for each of `pairs` pairs; no block is
// both a source and a destination in one call.
template <class E, class Policy = policy::kv>
void block_copy(const kv::paged_layout& l, E* k_cache, E* v_cache, const block_id* from, const block_id* to,
                std::size_t pairs, cudaStream_t stream = nullptr) {
  const std::size_t total = pairs * l.block_stride();
  if (total == 0) return;
  detail::block_copy_kernel<Policy, E><<<detail::kv_grid<Policy>(total), Policy::threads, 0, stream>>>(
      l.block_stride(), k_cache, v_cache, from, to, pairs);
  check(cudaGetLastError(), "block_copy launch");
}

}  // namespace efim::kernels::device
