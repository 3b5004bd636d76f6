#pragma once
// What the model asks of a compute backend.
#include <concepts>
#include <string_view>

namespace efim::kernels {

// A backend is a tag type naming where tensors live and how ops run: it carries a context type
// (threads, streams) and the op set the transformer calls.
template <class B>
concept backend = requires {
  typename B::context;
  { B::name } -> std::convertible_to<std::string_view>;
};

}  // namespace efim::kernels
