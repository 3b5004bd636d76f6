#pragma once
// Weight matrices with 8 rows interleaved (weight_layout::interleaved8), for the int8 decode product
// of q8_0 and q4_0 weights: the same bytes as the file's, permuted within each group of 8 rows so that
// one 256-bit load holds 4 quant bytes of each of the 8 rows, each row in a 32-bit lane of its own. A
// decode step then reads the matrix in order and sums each row in its lane (VPDPBUSD against 4 of x's
// bytes broadcast), with no sum across lanes per block as the rows as stored need; the 8 rows' scales
// are one 16-byte load. (On an Intel Xeon the rows as stored held the q4_0 decode product to about
// 19 GMAC/s a thread in cache; docs/benchmarks.md.)
//
// Group g (rows 8 g .. 8 g + 7) keeps the bytes of its 8 rows, 8 * row_bytes from 8 g * row_bytes, in
// blocks: block b of the 8 rows (8 * block bytes) holds their 8 scales (f16, row order), then quant
// byte c of row r at 16 + 32 * (c / 4) + 4 * r + c % 4 (q8_0: 32 quants; q4_0: its 16 bytes of nibbles,
// byte c holding weights c and c + 16). Rows past the last whole group stay as stored, where they were.
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "efim/core/aligned.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/common.hpp"

namespace efim::kernels {

// The types weight_layout::interleaved8 holds.
constexpr bool interleavable(dtype t) noexcept { return t == dtype::q8_0 || t == dtype::q4_0; }

namespace detail {

// Where a block of 8 interleaved rows keeps row r's scale, and the 4 quant bytes of row r from its
// quant byte c (c a multiple of 4).
constexpr std::size_t il8_scale_at(std::size_t r) noexcept { return 2 * r; }
constexpr std::size_t il8_quants_at(std::size_t c, std::size_t r) noexcept { return 16 + 8 * c + 4 * r; }

// Moves each byte of the whole groups of w (rows as stored when `to_interleaved`, else interleaved)
// to its place in the other order, writing out (w.rows * row_bytes bytes); groups [g0, g1).
inline void permute8(const weight_view& w, std::byte* out, bool to_interleaved, std::size_t g0, std::size_t g1) {
  const std::size_t bytes = info(w.type).bytes, quants = bytes - 2, nb = w.cols / 32, rb = row_bytes(w.type, w.cols);
  for (std::size_t g = g0; g < g1; ++g) {
    const std::byte* const src = w.data + 8 * g * rb;
    std::byte* const dst = out + 8 * g * rb;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t at = 8 * b * bytes;  // the interleaved block's offset in the group
      for (std::size_t r = 0; r < 8; ++r) {
        const std::size_t stored = r * rb + b * bytes;  // the block as stored
        const auto move = [&](std::size_t from_stored, std::size_t to_interleaved_at, std::size_t n) {
          if (to_interleaved)
            std::memcpy(dst + to_interleaved_at, src + from_stored, n);
          else
            std::memcpy(dst + from_stored, src + to_interleaved_at, n);
        };
        move(stored, at + il8_scale_at(r), 2);
        for (std::size_t c = 0; c < quants; c += 4) move(stored + 2 + c, at + il8_quants_at(c, r), 4);
      }
    }
  }
}

inline void permute(thread_pool* pool, const weight_view& w, std::byte* out, bool to_interleaved) {
  require(interleavable(w.type), errc::invalid_argument,
          "only q8_0 and q4_0 matrices interleave their rows, not " + std::string(to_string(w.type)));
  const std::size_t rb = row_bytes(w.type, w.cols), groups = w.rows / 8;
  const auto run = [&](std::size_t g0, std::size_t g1) { permute8(w, out, to_interleaved, g0, g1); };
  if (pool != nullptr)
    pool->parallel_for(groups, run);
  else
    run(0, groups);
  if (w.rows % 8 != 0) std::memcpy(out + 8 * groups * rb, w.data + 8 * groups * rb, (w.rows % 8) * rb);
}

// w as stored: w itself, or (interleaved8) its rows put back in order in a buffer of the calling
// thread's, valid until its next call on this thread. For the products that do not read interleaved
// rows (exact products; int8 products on the generic and AArch64 paths): a pass over the matrix per
// call, correct anywhere.
inline weight_view as_stored(thread_pool& pool, const weight_view& w) {
  if (w.layout == weight_layout::rows) return w;
  thread_local aligned_vector<std::byte> buffer;
  const std::size_t n = w.rows * row_bytes(w.type, w.cols);
  if (buffer.size() < n) buffer.resize(n);
  permute(&pool, w, buffer.data(), false);
  return {w.type, w.rows, w.cols, buffer.data(), weight_layout::rows};
}

}  // namespace detail

// w's bytes (rows as stored) interleaved into out (w.rows * row_bytes(w.type, w.cols) bytes, not
// overlapping w's): the matrix out holds is {w.type, w.rows, w.cols, out, weight_layout::interleaved8}.
// Groups of rows are spread over `pool` where one is given.
inline void interleave8(const weight_view& w, std::byte* out, thread_pool* pool = nullptr) {
  require(w.layout == weight_layout::rows, errc::invalid_argument, "interleave8: the matrix is interleaved already");
  detail::permute(pool, w, out, true);
}

// The inverse: w's bytes (interleaved8) back in the order of the rows.
inline void deinterleave8(const weight_view& w, std::byte* out, thread_pool* pool = nullptr) {
  require(w.layout == weight_layout::interleaved8, errc::invalid_argument, "deinterleave8: the matrix is not interleaved");
  detail::permute(pool, w, out, false);
}

// A matrix interleaved into memory of its own (cache-line aligned), for a model to hold beside the
// file's bytes: view() is the interleaved matrix.
class interleaved_matrix {
 public:
  interleaved_matrix() = default;
  explicit interleaved_matrix(const weight_view& w, thread_pool* pool = nullptr)
      : bytes_(w.rows * row_bytes(w.type, w.cols)), view_{w.type, w.rows, w.cols, nullptr, weight_layout::interleaved8} {
    interleave8(w, bytes_.data(), pool);
    view_.data = bytes_.data();
  }
  interleaved_matrix(interleaved_matrix&&) noexcept = default;
  interleaved_matrix& operator=(interleaved_matrix&&) noexcept = default;
  interleaved_matrix(const interleaved_matrix&) = delete;
  interleaved_matrix& operator=(const interleaved_matrix&) = delete;

  [[nodiscard]] const weight_view& view() const noexcept { return view_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_.size(); }

 private:
  aligned_vector<std::byte> bytes_;
  weight_view view_;
};

}  // namespace efim::kernels
