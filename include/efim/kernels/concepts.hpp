#pragma once
// What the model and the pipeline ask of a compute backend.
#include <concepts>
#include <cstddef>
#include <string_view>

#include "efim/core/dtype.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kernels {

// Whether a backend's context runs its ops on a thread pool it is given (the host's does; another
// makes its own resources, such as a CUDA stream).
template <class B>
concept context_takes_pool = requires(thread_pool& pool) { std::type_identity_t<typename B::context>{pool}; };

// A backend is a tag type naming where tensors live and how ops run: a name, a context (made from a
// thread pool, or from nothing), and the storage of the paged KV cache, made from the layer count, one
// layer's layout and the element type. The transformer for the backend (model::transformer<B>) holds
// the op set.
template <class B>
concept backend = requires {
  typename B::context;
  typename B::storage;
  { B::name } -> std::convertible_to<std::string_view>;
} && (context_takes_pool<B> || std::default_initializable<typename B::context>) &&
                  std::constructible_from<typename B::storage, std::size_t, kv::paged_layout, dtype>;

}  // namespace efim::kernels
