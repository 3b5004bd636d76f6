#pragma once
// The host backend: f32 tensors in host memory, ops on a thread pool. It is a real backend and
// the reference every other backend is tested against.
#include <string_view>

#include "efim/core/thread_pool.hpp"
#include "efim/kernels/attention.hpp"
#include "efim/kernels/concepts.hpp"
#include "efim/kernels/matmul.hpp"
#include "efim/kernels/rmsnorm.hpp"
#include "efim/kernels/rope.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/kernels/swiglu.hpp"
#include "efim/kv/host_storage.hpp"

namespace efim::kernels {

struct host {
  static constexpr std::string_view name = "host";
  using storage = kv::host_storage;
  struct context {
    thread_pool& pool;
  };
};

static_assert(backend<host>);

}  // namespace efim::kernels
