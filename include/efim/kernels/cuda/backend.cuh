#pragma once
// The CUDA backend's tag: tensors in device memory, ops ordered on the context's stream.
#include <cuda_runtime.h>

#include <string_view>

#include "efim/kernels/concepts.hpp"
#include "efim/kernels/cuda/attention.cuh"
#include "efim/kernels/cuda/kv.cuh"
#include "efim/kernels/cuda/ops.cuh"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kernels/cuda/sampling.cuh"

namespace efim::kernels {

struct cuda {
  static constexpr std::string_view name = "cuda";
  struct context {
    cudaStream_t stream = nullptr;
  };
};

static_assert(backend<cuda>);

}  // namespace efim::kernels
