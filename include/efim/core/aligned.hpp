#pragma once
// A standard allocator whose blocks start on a cache line (64 bytes): activations whose rows are a
// multiple of 16 floats then have every row aligned, and the kernels' vector loads never split a line.
#include <cstddef>
#include <new>
#include <vector>

namespace efim {

template <class T, std::size_t Align = 64>
struct aligned_allocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = aligned_allocator<U, Align>;
  };

  aligned_allocator() noexcept = default;
  template <class U>
  aligned_allocator(const aligned_allocator<U, Align>&) noexcept {}  // NOLINT: converting, as allocators are

  [[nodiscard]] T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{Align}));
  }
  // The unsized aligned delete: the sized one needs -fsized-deallocation with Clang before 19.
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{Align}); }

  friend bool operator==(const aligned_allocator&, const aligned_allocator&) noexcept { return true; }
};

template <class T>
using aligned_vector = std::vector<T, aligned_allocator<T>>;

}  // namespace efim
