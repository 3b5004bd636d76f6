// Uses the installed library's CUDA backend: one infill request through a pipeline on the GPU.
#include <cstdio>
#include <efim/cuda.cuh>  // before the pipeline: the CUDA decoder
#include <efim/version.hpp>

#include "small_pipeline.hpp"

int main() {
  if (!efim::device::available()) {
    std::printf("efim %s (CUDA): built against efim::cuda; no CUDA device here, so nothing ran\n",
                EFIM_VERSION_STRING);
    return 0;
  }
  const auto weights = small_weights();
  small_pipeline<efim::kernels::cuda> p(small_tokenizer(), weights, {.cache = {.block_size = 16, .blocks = 64}});
  const std::size_t generated = generate_four(p);
  std::printf("efim %s (CUDA on %s): generated %zu tokens\n", EFIM_VERSION_STRING,
              efim::device::device_name().c_str(), generated);
  return generated == 4 ? 0 : 1;
}
