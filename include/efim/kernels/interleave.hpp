#pragma once
// Weight matrices with 8 rows interleaved (weight_layout::interleaved8): the same bytes as the file's,
// permuted within each group of 8 rows so that a decode step reads the 8 rows' bytes in one sequential
// stream, with no jumps between rows for the prefetchers to follow.
// - For the int8 decode products of q8_0, q4_0, q4_k, q5_k and q6_k weights: one 256-bit load holds 4
//   quant bytes of each of the 8 rows, each row in a 32-bit lane of its own. A decode step sums each
//   row in its lane (VPDPBUSD against 4 of x's bytes broadcast), with no sum across lanes per block as
//   the rows as stored need; the 8 rows' scales are one load. (On an Intel Xeon the rows as stored held
//   the q4_0 decode product to about 19 GMAC/s a thread in cache, the k-quants' to 73% of a read from
//   memory; docs/benchmarks.md.)
// - For the exact decode products of f16 and bf16 weights (rows a multiple of 16 long): 16 elements of
//   each of the 8 rows in turn (32 bytes a row, 256 a block), so that the 8 rows' canonical lane sums
//   (16 elements a step) advance together over one stream. (In a read loop on an Emerald Rapids Xeon the
//   8 rows as stored read 0.84x of this stream with software prefetch; on a Zen 5 EPYC a decode step
//   read the rows as stored 1.3-1.5x faster, so the models interleave f16 and bf16 off AMD CPUs only:
//   interleave_floats_by_default in matmul.hpp; docs/benchmarks.md.)
//
// Group g (rows 8 g .. 8 g + 7) keeps the bytes of its 8 rows, 8 * row_bytes from 8 g * row_bytes, in
// blocks (il8_block: a quantized type's block, 16 elements of f16 or bf16): block b of the 8 rows (8 *
// block bytes, at 8 * b * block bytes) holds each field of the type's block (il8_fields: its scales,
// quants, ...; the whole 32 bytes of f16 or bf16) in the order the block stores them, each the 8 rows' in
// turn a chunk at a time (f16 scales 2 bytes, quants 4, f16 and bf16 weights 32): byte c of a field of
// row r, the field at byte `at` of the block as stored, is at 8 * at + 8 * chunk * (c / chunk) + chunk *
// r + c % chunk. So q8_0 and q4_0: the 8 scales (16 bytes), then quant byte c of row r at 16 + 32 * (c /
// 4) + 4 * r + c % 4; f16 element k of row r at 256 * (k / 16) + 32 * r + 2 * (k % 16). Rows past the
// last whole group stay as stored, where they were.
#include <array>
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

// The types weight_layout::interleaved8 holds: quantized ones for the int8 products, f16 and bf16 for
// the exact ones.
constexpr bool interleavable_floats(dtype t) noexcept { return t == dtype::f16 || t == dtype::bf16; }
constexpr bool interleavable(dtype t) noexcept {
  return t == dtype::q8_0 || t == dtype::q4_0 || t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k ||
         interleavable_floats(t);
}
// Whether a matrix of t with rows `cols` long interleaves (f16 and bf16: rows a multiple of 16 long).
constexpr bool interleavable(dtype t, std::size_t cols) noexcept {
  return interleavable(t) && (!interleavable_floats(t) || cols % 16 == 0);
}
// Whether a model (model::transformer) reads a rows x cols matrix of t from an interleaved copy: where
// it interleaves quantized matrices (int8 products) or f16 and bf16 ones (`floats`), those of 8 rows
// or more that interleave.
constexpr bool interleaved_by_model(dtype t, std::size_t rows, std::size_t cols, bool quantized, bool floats) noexcept {
  return interleavable(t, cols) && rows >= 8 && (interleavable_floats(t) ? floats : quantized);
}

namespace detail {

// A field of a block as stored: its first byte, its length, and the bytes a row it is interleaved by.
struct il8_field {
  std::size_t at, bytes, chunk;
};
struct il8_fields {
  std::array<il8_field, 5> field;
  std::size_t n;
};

// The fields of t's block (kquants.hpp's block structs), in the order it stores them.
constexpr il8_fields il8_layout(dtype t) noexcept {
  switch (t) {
    case dtype::q8_0:
      return {{{{0, 2, 2}, {2, 32, 4}}}, 2};
    case dtype::q4_0:
      return {{{{0, 2, 2}, {2, 16, 4}}}, 2};
    case dtype::q4_k:  // d, dmin, 12 bytes of scales and mins, 128 of nibbles
      return {{{{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 4}}}, 4};
    case dtype::q5_k:  // d, dmin, scales and mins, 32 bytes of fifth bits, 128 of nibbles
      return {{{{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 32, 4}, {48, 128, 4}}}, 5};
    case dtype::q6_k:  // 128 bytes of low nibbles, 64 of top bits, 16 scales, d
      return {{{{0, 128, 4}, {128, 64, 4}, {192, 16, 4}, {208, 2, 2}}}, 4};
    case dtype::f16:  // 16 elements
    case dtype::bf16:
      return {{{{0, 32, 32}}}, 1};
    default:
      return {{}, 0};
  }
}

// The unit il8_layout describes: a quantized type's block, 16 elements of f16 or bf16.
struct il8_unit {
  std::size_t elements, bytes;
};
constexpr il8_unit il8_block(dtype t) noexcept {
  return interleavable_floats(t) ? il8_unit{16, 32} : il8_unit{info(t).block, info(t).bytes};
}

// Where a block of 8 interleaved rows starts field k of t's layout (the kernels read them there).
constexpr std::size_t il8_field_at(dtype t, std::size_t k) noexcept { return 8 * il8_layout(t).field[k].at; }

// Where a block of 8 interleaved rows keeps byte c of field f of row r (c a multiple of f.chunk).
constexpr std::size_t il8_at(const il8_field& f, std::size_t c, std::size_t r) noexcept {
  return 8 * f.at + 8 * c + f.chunk * r;  // 8 * f.chunk * (c / f.chunk) = 8 * c
}

// q8_0 and q4_0: row r's scale, and its 4 quant bytes from quant byte c (a multiple of 4).
constexpr std::size_t il8_scale_at(std::size_t r) noexcept { return 2 * r; }
constexpr std::size_t il8_quants_at(std::size_t c, std::size_t r) noexcept { return 16 + 8 * c + 4 * r; }

// Copies a chunk (2, 4 or 32 bytes: fixed-size copies, not calls).
[[gnu::always_inline]] inline void il8_copy(std::byte* to, const std::byte* from, std::size_t chunk) noexcept {
  if (chunk == 4)
    std::memcpy(to, from, 4);
  else if (chunk == 2)
    std::memcpy(to, from, 2);
  else
    std::memcpy(to, from, 32);
}

// Row r's block as stored into the 8 rows' interleaved block (scatter), or back out of it (gather).
inline void il8_scatter(const il8_fields& l, const std::byte* stored, std::byte* interleaved, std::size_t r) noexcept {
  for (std::size_t k = 0; k < l.n; ++k)
    for (std::size_t c = 0; c < l.field[k].bytes; c += l.field[k].chunk)
      il8_copy(interleaved + il8_at(l.field[k], c, r), stored + l.field[k].at + c, l.field[k].chunk);
}
inline void il8_gather(const il8_fields& l, const std::byte* interleaved, std::byte* stored, std::size_t r) noexcept {
  for (std::size_t k = 0; k < l.n; ++k)
    for (std::size_t c = 0; c < l.field[k].bytes; c += l.field[k].chunk)
      il8_copy(stored + l.field[k].at + c, interleaved + il8_at(l.field[k], c, r), l.field[k].chunk);
}

// The fields of a k-quant's block other than its quants (scales, mins, factors): what the int8 panels'
// packing still takes a row at a time from a whole group of interleaved rows (il8_whole_group), whose
// quants it takes 8 rows at a time. (q8_0 and q4_0 convert the group's 8 scales in one step.)
constexpr il8_fields il8_scale_layout(dtype t) noexcept {
  switch (t) {
    case dtype::q4_k:
    case dtype::q5_k:
      return {{{{0, 2, 2}, {2, 2, 2}, {4, 12, 4}}}, 3};
    case dtype::q6_k:
      return {{{{192, 16, 4}, {208, 2, 2}}}, 2};
    default:
      return {{}, 0};
  }
}

// Whether rows first .. first + 8 of w are a whole group of interleaved rows.
inline bool il8_whole_group(const weight_view& w, std::size_t first) noexcept {
  return w.layout == weight_layout::interleaved8 && first % 8 == 0 && first + 8 <= w.rows / 8 * 8;
}

// Block b of row r of w as stored: where it is (rows as stored, or a row past the last whole group),
// else gathered from its group into tmp (the type's block bytes).
template <dtype T>
[[gnu::always_inline]] inline const std::byte* block_as_stored(const weight_view& w, std::size_t rb, std::size_t r,
                                                               std::size_t b, std::byte* tmp) noexcept {
  constexpr std::size_t bytes = info(T).bytes;
  if (w.layout == weight_layout::rows || r >= w.rows / 8 * 8) return w.data + r * rb + b * bytes;
  constexpr il8_fields l = il8_layout(T);
  il8_gather(l, w.data + (r / 8 * 8) * rb + 8 * b * bytes, tmp, r % 8);
  return tmp;
}

// Moves each byte of the whole groups of w (rows as stored when `to_interleaved`, else interleaved)
// to its place in the other order, writing out (w.rows * row_bytes bytes); groups [g0, g1).
inline void permute8(const weight_view& w, std::byte* out, bool to_interleaved, std::size_t g0, std::size_t g1) {
  const il8_fields l = il8_layout(w.type);
  const std::size_t bytes = il8_block(w.type).bytes, nb = w.cols / il8_block(w.type).elements;
  const std::size_t rb = row_bytes(w.type, w.cols);
  for (std::size_t g = g0; g < g1; ++g) {
    const std::byte* const src = w.data + 8 * g * rb;
    std::byte* const dst = out + 8 * g * rb;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t at = 8 * b * bytes;  // the interleaved block's offset in the group
      for (std::size_t r = 0; r < 8; ++r) {
        const std::size_t stored = r * rb + b * bytes;  // the block as stored
        if (to_interleaved)
          il8_scatter(l, src + stored, dst + at, r);
        else
          il8_gather(l, src + at, dst + stored, r);
      }
    }
  }
}

inline void permute(thread_pool* pool, const weight_view& w, std::byte* out, bool to_interleaved) {
  require(interleavable(w.type, w.cols), errc::invalid_argument,
          "only q8_0, q4_0, q4_k, q5_k and q6_k matrices, and f16 and bf16 ones with rows a multiple of 16 long, "
          "interleave their rows, not " +
              std::string(to_string(w.type)) + " with rows " + std::to_string(w.cols) + " long");
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
// rows (exact products of quantized types, and of f16 and bf16 off the AVX-512 path; int8 products on
// the generic and AArch64 paths): a pass over the matrix per call, correct anywhere.
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
