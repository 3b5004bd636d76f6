// Uses the installed library through efim::efim and the umbrella header: one infill request.
#include <cstdio>
#include <efim/efim.hpp>

#include "small_pipeline.hpp"

int main() {
  const auto weights = small_weights();
  small_pipeline<efim::kernels::host> p(small_tokenizer(), weights, {.cache = {.block_size = 16, .blocks = 64}});
  const std::size_t generated = generate_four(p);
  std::printf("efim %s: generated %zu tokens\n", EFIM_VERSION_STRING, generated);
  return generated == 4 ? 0 : 1;
}
