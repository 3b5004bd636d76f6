#pragma once
// KV tensors in host memory: per layer one K and one V array in the paged layout.
#include <cstddef>
#include <vector>

#include "efim/kv/layout.hpp"

namespace efim::kv {

class host_storage {
 public:
  host_storage(std::size_t layers, paged_layout layout) : layers_(layers), layout_(layout) {
    validate(layout);
    require(layers > 0, errc::invalid_argument, "kv: at least one layer");
    data_.assign(2 * layers * layout.elements(), 0.0f);
  }

  // Bytes a storage of this shape holds.
  static constexpr std::size_t bytes(std::size_t layers, const paged_layout& layout) noexcept {
    return 2 * layers * layout.elements() * sizeof(float);
  }

  [[nodiscard]] const paged_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::size_t layers() const noexcept { return layers_; }

  float* keys(std::size_t layer) noexcept { return data_.data() + (2 * layer) * layout_.elements(); }
  float* values(std::size_t layer) noexcept { return data_.data() + (2 * layer + 1) * layout_.elements(); }
  const float* keys(std::size_t layer) const noexcept { return data_.data() + (2 * layer) * layout_.elements(); }
  const float* values(std::size_t layer) const noexcept { return data_.data() + (2 * layer + 1) * layout_.elements(); }

 private:
  std::size_t layers_;
  paged_layout layout_;
  std::vector<float> data_;  // (layer, k|v, block, kv_head, slot, dim)
};

}  // namespace efim::kv
