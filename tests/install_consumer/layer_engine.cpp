// efim::engine alone: one infill request through an assembled pipeline.
#include <cstdio>
#include <efim/kernels/host.hpp>

#include "small_pipeline.hpp"

int main() {
  const auto weights = small_weights();
  small_pipeline<efim::kernels::host> p(small_tokenizer(), weights,
                                        {.cache = {.block_size = 16, .blocks = 64}, .threads = 1});
  const std::size_t generated = generate_four(p);
  std::printf("engine: generated %zu tokens\n", generated);
  return generated == 4 ? 0 : 1;
}
