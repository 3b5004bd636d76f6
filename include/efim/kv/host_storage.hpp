#pragma once
// KV tensors in host memory: per layer one K and one V array in the paged layout, in f32 or f16.
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/kv/layout.hpp"

namespace efim::kv {

// The dtype of a KV cache holding E.
template <class E>
constexpr dtype element_type() noexcept {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, half>, "KV elements are float or half");
  return std::is_same_v<E, float> ? dtype::f32 : dtype::f16;
}

// Checks a KV storage's shape: any layout validate() accepts, at least one layer, f32 or f16.
inline void validate_storage(std::size_t layers, const paged_layout& layout, dtype type) {
  validate(layout);
  require(layers > 0, errc::invalid_argument, "kv: at least one layer");
  require(type == dtype::f32 || type == dtype::f16, errc::invalid_argument,
          "kv: a KV cache holds f32 or f16, not " + std::string(to_string(type)));
}

class host_storage {
 public:
  host_storage(std::size_t layers, paged_layout layout, dtype type = dtype::f32)
      : layers_(layers), layout_(layout), type_(type) {
    validate_storage(layers, layout, type);
    data_.assign(bytes(layers, layout, type), std::byte{0});
  }

  // Bytes a storage of this shape holds.
  static constexpr std::size_t bytes(std::size_t layers, const paged_layout& layout, dtype type = dtype::f32) noexcept {
    return 2 * layers * layout.elements() * info(type).bytes;
  }

  [[nodiscard]] const paged_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::size_t layers() const noexcept { return layers_; }
  [[nodiscard]] dtype type() const noexcept { return type_; }

  // (block, kv_head, dim, slot) keys and (block, kv_head, slot, dim) values of a layer, as E.
  template <class E = float>
  E* keys(std::size_t layer) {
    return at<E>(2 * layer);
  }
  template <class E = float>
  E* values(std::size_t layer) {
    return at<E>(2 * layer + 1);
  }
  template <class E = float>
  const E* keys(std::size_t layer) const {
    return const_cast<host_storage*>(this)->at<E>(2 * layer);
  }
  template <class E = float>
  const E* values(std::size_t layer) const {
    return const_cast<host_storage*>(this)->at<E>(2 * layer + 1);
  }

  // Bytes of one block's K and V over all layers.
  [[nodiscard]] std::size_t block_bytes() const noexcept {
    return 2 * layers_ * layout_.block_stride() * info(type_).bytes;
  }

  // A block's K and V over all layers, as bytes (layer by layer, K then V): what a shared KV tier
  // stores (cache/remote.hpp), and what import_block() takes back into any block.
  void export_block(block_id b, std::span<std::byte> out) const {
    const std::size_t slice = layout_.block_stride() * info(type_).bytes;
    require(b < layout_.blocks && out.size() == 2 * layers_ * slice, errc::invalid_argument,
            "kv: export_block: no such block, or not a block's bytes");
    const std::size_t array = layout_.elements() * info(type_).bytes;
    for (std::size_t a = 0; a < 2 * layers_; ++a)
      std::memcpy(out.data() + a * slice, data_.data() + a * array + b * slice, slice);
  }
  void import_block(block_id b, std::span<const std::byte> in) {
    const std::size_t slice = layout_.block_stride() * info(type_).bytes;
    require(b < layout_.blocks && in.size() == 2 * layers_ * slice, errc::invalid_argument,
            "kv: import_block: no such block, or not a block's bytes");
    const std::size_t array = layout_.elements() * info(type_).bytes;
    for (std::size_t a = 0; a < 2 * layers_; ++a)
      std::memcpy(data_.data() + a * array + b * slice, in.data() + a * slice, slice);
  }

 private:
  template <class E>
  E* at(std::size_t array) {
    require(element_type<E>() == type_, errc::invalid_argument, "kv: the cache holds other elements");
    return reinterpret_cast<E*>(data_.data()) + array * layout_.elements();
  }

  std::size_t layers_;
  paged_layout layout_;
  dtype type_;
  std::vector<std::byte> data_;  // (layer, k|v, block, kv_head, slot|dim, dim|slot) as E
};

}  // namespace efim::kv
