#pragma once
// Greedy sampling on the CUDA backend: the argmax of each row of logits, the lowest id among equal
// logits (as kernels::argmax on the host), one thread block per row.
#include <cuda_runtime.h>

#include <cstddef>
#include <cub/block/block_reduce.cuh>

#include "efim/core/types.hpp"
#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

namespace policy {
struct argmax {
  static constexpr int threads = 512;
};
}  // namespace policy

namespace agent {

// Each thread keeps the best of a strided pass; a block reduction keeps the larger logit, and the
// lower id of equal ones.
template <class Policy>
struct argmax {
  struct best {
    float value;
    token_id id;
  };
  struct more {
    __device__ best operator()(const best& a, const best& b) const {
      if (a.value > b.value || (a.value == b.value && a.id < b.id)) return a;
      return b;
    }
  };
  using reduce = cub::BlockReduce<best, Policy::threads>;
  using storage = typename reduce::TempStorage;

  __device__ static token_id run(storage& temp, const float* logits, std::size_t n) {
    best mine{-__int_as_float(0x7f800000), static_cast<token_id>(n)};  // -inf, an id past every real one
    for (std::size_t i = threadIdx.x; i < n; i += Policy::threads)
      mine = more{}(mine, best{logits[i], static_cast<token_id>(i)});
    return reduce(temp).Reduce(mine, more{}).id;
  }
};

}  // namespace agent

namespace detail {
template <class Policy>
__global__ void __launch_bounds__(Policy::threads) argmax_kernel(const float* logits, std::size_t n, token_id* out) {
  __shared__ typename agent::argmax<Policy>::storage temp;
  const token_id id = agent::argmax<Policy>::run(temp, logits + blockIdx.x * n, n);
  if (threadIdx.x == 0) out[blockIdx.x] = id < static_cast<token_id>(n) ? id : 0;  // (n: every logit NaN)
}
}  // namespace detail

// logits: (rows, n); out: rows ids.
template <class Policy = policy::argmax>
void argmax(const float* logits, std::size_t rows, std::size_t n, token_id* out, cudaStream_t stream = nullptr) {
  if (rows == 0 || n == 0) return;
  require(rows <= 0x7FFFFFFFu && n <= 0x7FFFFFFFu, errc::invalid_argument, "device::argmax: too many rows or logits");
  detail::argmax_kernel<Policy><<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(logits, n, out);
  check(cudaGetLastError(), "argmax launch");
}

}  // namespace efim::kernels::device
