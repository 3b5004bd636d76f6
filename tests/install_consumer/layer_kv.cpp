// efim::kv alone: a paged KV store on the host.
#include <cstdio>
#include <efim/kv/host_storage.hpp>

int main() {
  const efim::kv::paged_layout layout{.blocks = 4, .kv_heads = 2, .block_size = 16, .head_dim = 8};
  efim::kv::host_storage kv(2, layout, efim::dtype::f16);
  std::printf("kv: %zu layers of %zu elements\n", kv.layers(), layout.elements());
  return kv.layers() == 2 ? 0 : 1;
}
