#pragma once
// The CUDA backend's tag: tensors in device memory (KV in kv::device_storage), every op ordered on the
// context's stream, matrix products through the context's cuBLAS handle on that stream.
#include <cuda_runtime.h>

#include <string_view>

#include "efim/core/device.cuh"
#include "efim/kernels/concepts.hpp"
#include "efim/kernels/cuda/attention.cuh"
#include "efim/kernels/cuda/kv.cuh"
#include "efim/kernels/cuda/matmul.cuh"
#include "efim/kernels/cuda/ops.cuh"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kernels/cuda/sampling.cuh"
#include "efim/kv/device_storage.cuh"

namespace efim::kernels {

struct cuda {
  static constexpr std::string_view name = "cuda";
  using storage = kv::device_storage;

  // A stream of its own and a cuBLAS handle on it. It takes no thread pool, so a pipeline starts
  // none: the host side of a step (sampling, planning) runs on the thread that drives it.
  class context {
   public:
    context()
        : blas_(stream_.get()),
          multiprocessors_(efim::device::multiprocessors()),
          shared_memory_optin_(efim::device::shared_memory_optin()),
          compute_capability_(efim::device::compute_capability()) {}

    [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }
    [[nodiscard]] const device::blas& blas() const noexcept { return blas_; }
    void synchronize() const { stream_.synchronize(); }
    // The device's multiprocessors, read once (kernels size their grids to fill them).
    [[nodiscard]] std::size_t multiprocessors() const noexcept { return multiprocessors_; }
    // The most shared memory a thread block may opt in to on the device (kernels that need more than
    // 48 KiB check it before they are chosen).
    [[nodiscard]] std::size_t shared_memory_optin() const noexcept { return shared_memory_optin_; }
    // The device's compute capability, major * 10 + minor (kernels of newer instructions check it).
    [[nodiscard]] int compute_capability() const noexcept { return compute_capability_; }

   private:
    efim::device::stream stream_;
    device::blas blas_;
    std::size_t multiprocessors_, shared_memory_optin_;
    int compute_capability_;
  };
};

static_assert(backend<cuda>);

}  // namespace efim::kernels
