#pragma once
// KV tensors in device memory, in the host storage's layout (kv::paged_layout) and element types:
// per layer one K and one V array, f32 or f16. Block tables stay on the host with the cache manager;
// a step uploads the tables it needs (kernels::attention_step).
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "efim/core/device.cuh"
#include "efim/core/dtype.hpp"
#include "efim/kv/host_storage.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kv {

class device_storage {
 public:
  device_storage(std::size_t layers, paged_layout layout, dtype type = dtype::f32)
      : layers_(layers), layout_(layout), type_(type) {
    validate_storage(layers, layout, type);
    data_ = device::buffer<std::byte>(bytes(layers, layout, type));
    device::check(cudaMemset(data_.data(), 0, data_.size()), "cudaMemset");
  }

  static constexpr std::size_t bytes(std::size_t layers, const paged_layout& layout, dtype type = dtype::f32) noexcept {
    return host_storage::bytes(layers, layout, type);
  }

  [[nodiscard]] const paged_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::size_t layers() const noexcept { return layers_; }
  [[nodiscard]] dtype type() const noexcept { return type_; }

  // Device pointers to a layer's (block, kv_head, dim, slot) keys and (block, kv_head, slot, dim) values.
  template <class E = float>
  E* keys(std::size_t layer) const {
    return at<E>(2 * layer);
  }
  template <class E = float>
  E* values(std::size_t layer) const {
    return at<E>(2 * layer + 1);
  }

 private:
  template <class E>
  E* at(std::size_t array) const {
    require(element_type<E>() == type_, errc::invalid_argument, "kv: the cache holds other elements");
    require(array < 2 * layers_, errc::invalid_argument, "kv: no such layer");
    return reinterpret_cast<E*>(data_.data()) + array * layout_.elements();
  }

  std::size_t layers_;
  paged_layout layout_;
  dtype type_;
  device::buffer<std::byte> data_;
};

}  // namespace efim::kv
