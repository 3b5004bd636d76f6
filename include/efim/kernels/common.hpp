#pragma once
// What the host kernels' instruction-set paths share: the types of their arguments and the helpers
// that do no floating-point arithmetic a path could round differently.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::kernels {

enum class accumulate : bool { no, yes };  // yes: y = y + x w^T (a residual add)

// How a matrix product multiplies (matmul.hpp):
//   exact: f32 activations times the exactly dequantized weights, the canonical f32 dot product;
//   int8:  for quantized weights, the activations rounded to 8 bits (per 256 for q4_k, q5_k and q6_k,
//          llama.cpp's q8_K; per 32 for q8_0, q4_0, q5_0 and q5_1, its q8_0 / q8_1) and multiplied in
//          integers, as llama.cpp's CPU backend does: several times the arithmetic rate, results within
//          llama.cpp's rounding of the exact ones, still the same bits on every path and batch size.
//          f32, f16 and bf16 weights multiply exactly either way.
enum class products : bool { exact, int8 };

// "exact" or "int8" (a command line's word); anything else is an error.
inline products parse_products(std::string_view name) {
  if (name == "exact") return products::exact;
  if (name == "int8") return products::int8;
  throw error(errc::invalid_argument, "products must be exact or int8, not '" + std::string(name) + "'");
}

// How a weight matrix's bytes are ordered (interleave.hpp):
//   rows:         as a GGUF file stores it, row after row;
//   interleaved8: q8_0, q4_0, q4_k, q5_k and q6_k: the same bytes permuted within each group of 8
//                 rows, block by block each field (scales, quants) of the 8 rows in turn, so that an
//                 int8 decode product reads the matrix in order and sums each row in a lane of its own;
//                 the rows past the last whole group stay as stored.
enum class weight_layout : std::uint8_t { rows, interleaved8 };

// A weight matrix: `rows` output features of `cols` elements, each row a whole number of `type`
// blocks, in row_bytes(type, cols) * rows bytes ordered as `layout` says.
struct weight_view {
  dtype type = dtype::f32;
  std::size_t rows = 0, cols = 0;
  const std::byte* data = nullptr;
  weight_layout layout = weight_layout::rows;
};

enum class rope_style {
  adjacent,  // rotates pairs (2i, 2i+1): GGUF "llama" layout
  neox,      // rotates pairs (i, i + d/2): GGUF "qwen2", "starcoder2" layout
};

// Where a token of a batch keeps its KV: its sequence's block table and its position.
struct token_slot {
  std::span<const block_id> table;
  position pos = 0;
};

namespace detail {

// The canonical dot product's lane count: lane l sums the products at k = l, l + 16, l + 32, ...
inline constexpr std::size_t lanes = 16;

// A per-thread f32 buffer for dequantized weight panels, 64-byte aligned. It only grows, and the
// pool's threads are persistent, so after the first call of a shape no matmul allocates.
inline float* panel_scratch(std::size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats + 16) buffer.resize(floats + 16);
  const auto misaligned = reinterpret_cast<std::uintptr_t>(buffer.data()) % 64;
  return buffer.data() + (misaligned ? (64 - misaligned) / sizeof(float) : 0);
}

// Writes the valid rows x cols corner of a tile (out[i * nr + j]) to y.
inline void store_tile(const float* out, std::size_t nr, float* y, std::size_t ldy, std::size_t rows, std::size_t cols,
                       accumulate acc) noexcept {
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) {
      float& dst = y[i * ldy + j];
      dst = acc == accumulate::yes ? dst + out[i * nr + j] : out[i * nr + j];
    }
}

// Rows of a panel per thread at a time: as many as keep the f32 panel within about 192 KiB (half of
// L2 on current cores, the rest for x), a multiple of nr, and dividing `rows` into equal panels.
inline std::size_t panel_height(std::size_t rows, std::size_t cols, std::size_t nr) noexcept {
  const std::size_t most = std::max(nr, (std::size_t{192} << 10) / (std::max<std::size_t>(cols, 1) * 4) / nr * nr);
  const std::size_t panels = (rows + most - 1) / most;
  const std::size_t even = (rows + panels - 1) / panels;
  return (even + nr - 1) / nr * nr;
}

// Floats between rows in the aligned scratch: whole 64-byte lines, and not a multiple of 4 KiB, whose
// rows would all fall in the same L1 sets.
inline std::size_t scratch_stride(std::size_t n) noexcept {
  const std::size_t ld = (n + 15) / 16 * 16;
  return ld % 1024 == 0 ? ld + 16 : ld;
}

inline float to_f32(float x) noexcept { return x; }
inline float to_f32(half x) noexcept { return f16_to_f32(x.bits); }
inline void store(float x, float& out) noexcept { out = x; }
inline void store(float x, half& out) noexcept { out.bits = f32_to_f16(x); }

inline constexpr std::size_t max_rows = 8;  // query heads computed together against the same keys

// One query head of one token: its query, where its output goes, and how many keys it sees.
struct attention_row {
  const float* q;
  float* out;
  std::size_t keys;
};

}  // namespace detail
}  // namespace efim::kernels
