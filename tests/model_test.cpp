// kv/, kernels/ and model/: the host backend against plain references.
#include <unistd.h>
#include <algorithm>
#include <bit>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "decode_tiles_guard.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/core/kquants.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/cuda/attention_mma.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/cuda/quant_int8.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kernels/isa.hpp"
#include "efim/kv/host_storage.hpp"
#include "efim/model/decode_tuning.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/model/reference.hpp"
#include "efim/model/transformer.hpp"
#include "support.hpp"

using namespace efim;

namespace {
std::vector<float> random_vector(rng& r, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal());
  return v;
}

using efim_test::max_relative_error;

model::config small_config(std::size_t hidden = 64) {
  model::config c;
  c.vocab = 50;
  c.hidden = hidden;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 96;
  c.max_context = 256;
  return c;
}

std::vector<token_id> random_tokens(rng& r, std::size_t n, std::size_t vocab) {
  std::vector<token_id> t(n);
  for (auto& x : t) x = static_cast<token_id>(r.below(vocab));
  return t;
}

// Runs a sequence through the transformer in the given chunks; returns the logits of every chunk's last token.
std::vector<std::vector<float>> run_chunks(model::transformer<kernels::host>& m, kernels::host::context& ctx,
                                           kv::host_storage& kv, const std::vector<token_id>& tokens,
                                           const std::vector<block_id>& table, const std::vector<std::size_t>& chunks,
                                           std::size_t start = 0) {
  std::vector<std::vector<float>> out;
  std::vector<float> logits;
  std::size_t pos = start;
  for (const std::size_t n : chunks) {
    const model::batch_item item{std::span(tokens).subspan(pos, n), static_cast<position>(pos), table, true};
    m.forward(ctx, kv, std::span(&item, 1), logits);
    out.push_back(logits);
    pos += n;
  }
  return out;
}

// A weight matrix in `type` (random normal values through the reference quantizer) and its rows
// dequantized by the reference.
struct typed_weights {
  std::vector<std::byte> bytes;
  std::vector<float> dequantized;
  kernels::weight_view view;
};

typed_weights make_weights(rng& r, dtype type, std::size_t rows, std::size_t cols) {
  typed_weights w;
  const std::size_t rb = row_bytes(type, cols);
  w.bytes.resize(rows * rb);
  w.dequantized.resize(rows * cols);
  for (std::size_t j = 0; j < rows; ++j) {
    auto row = random_vector(r, cols);
    quantize_row(type, row.data(), w.bytes.data() + j * rb, cols);
    dequantize_row(type, w.bytes.data() + j * rb, w.dequantized.data() + j * cols, cols);
  }
  w.view = {type, rows, cols, w.bytes.data()};
  return w;
}

// Elements of y (m, rows) that differ in any bit from detail::dot of the x row and the dequantized
// weight row: the kernel's contract.
std::size_t non_canonical(const std::vector<float>& x, const typed_weights& w, const std::vector<float>& y,
                          std::size_t m) {
  const std::size_t rows = w.view.rows, cols = w.view.cols;
  std::size_t differ = 0;
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < rows; ++j) {
      const float want = kernels::detail::dot(x.data() + i * cols, w.dequantized.data() + j * cols, cols);
      differ += std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(y[i * rows + j]);
    }
  return differ;
}

std::vector<float> reference_row(const std::vector<float>& all, std::size_t row, std::size_t vocab) {
  return {all.begin() + static_cast<std::ptrdiff_t>(row * vocab),
          all.begin() + static_cast<std::ptrdiff_t>((row + 1) * vocab)};
}
}  // namespace

TEST_CASE("matmul equals the plain triple loop, and a row never depends on the batch", "[kernels][matmul]") {
  thread_pool pool(2);
  rng r(1);
  struct shape {
    std::size_t m, n, k;
  };
  for (const auto [m, n, k] :
       {shape{1, 1, 1}, shape{5, 7, 33}, shape{9, 64, 64}, shape{17, 50, 96}, shape{3, 130, 17}}) {
    const auto x = random_vector(r, m * k), w = random_vector(r, n * k);
    std::vector<float> y(m * n), want(y.size());
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::size_t t = 0; t < k; ++t) s += static_cast<double>(x[i * k + t]) * w[j * k + t];
        want[i * n + j] = static_cast<float>(s);
      }
    kernels::matmul(pool, x.data(), w.data(), y.data(), m, n, k);
    CHECK(max_relative_error(y, want) < 1e-5f);
    // Each row alone gives the same bits as in the batch.
    for (std::size_t i = 0; i < m; ++i) {
      std::vector<float> row(n);
      kernels::matmul(pool, x.data() + i * k, w.data(), row.data(), 1, n, k);
      CHECK(std::equal(row.begin(), row.end(), y.begin() + static_cast<std::ptrdiff_t>(i * n)));
    }
    // Accumulating adds onto what is there.
    auto acc = y;
    kernels::matmul(pool, x.data(), w.data(), acc.data(), m, n, k, kernels::accumulate::yes);
    for (std::size_t i = 0; i < y.size(); ++i) CHECK(acc[i] == y[i] + y[i]);
  }
}

// Shapes for each element type: columns not a multiple of 16 where the type allows, rows not a
// multiple of any tile, the 768 columns of the real models, rows a multiple of 2 KiB long (their own
// decode tile) and rows long enough to go in column ranges.
std::vector<std::pair<std::size_t, std::size_t>> typed_shapes(dtype t) {
  if (info(t).block == 256) return {{1, 256}, {7, 512}, {33, 768}, {19, 1024}, {5, 2304}};
  if (info(t).block == 32) return {{1, 32}, {7, 64}, {33, 96}, {50, 160}, {19, 768}, {9, 1024}, {5, 2080}};
  return {{1, 1}, {7, 17}, {33, 100}, {50, 64}, {19, 768}, {17, 1024}, {5, 2065}};
}

TEST_CASE("typed matmul: every element is the canonical dot of the dequantized row, bit for bit", "[kernels][matmul]") {
  thread_pool one(1), two(2), three(3);
  rng r(11);
  for (const dtype t : all_dtypes)
    for (const auto& [rows, cols] : typed_shapes(t)) {
      const auto w = make_weights(r, t, rows, cols);
      for (const std::size_t m : {1, 2, 3, 4, 5, 7, 8, 9, 17, 48, 49, 64, 65}) {  // (both sides of stream_rows_bound)
        INFO(to_string(t) << " m " << m << " rows " << rows << " cols " << cols);
        const auto x = random_vector(r, m * cols);
        for (thread_pool* pool : {&one, &two, &three}) {
          INFO("threads " << pool->size());
          std::vector<float> y(m * rows, std::nanf(""));
          kernels::matmul(*pool, x.data(), w.view, y.data(), m);
          CHECK(non_canonical(x, w, y, m) == 0);
        }
      }
    }
}

// Random bytes for weights of type t, finite only (NaN payloads are not part of the contract): the top
// exponent bit of each element (f32, f16, bf16) or f16 scale of a block (d; m of q5_1, dmin of q4_k and
// q5_k), bit 6 of its last byte, cleared; any other pattern may occur.
namespace {
void random_finite_bits(rng& r, dtype t, std::vector<std::byte>& bytes) {
  for (auto& b : bytes) b = static_cast<std::byte>(r.below(256));
  const std::size_t stride = t == dtype::f32 ? 4 : info(t).block > 1 ? info(t).bytes : 2;
  std::vector<std::size_t> last{1};
  if (t == dtype::f32) last = {3};
  if (t == dtype::q4_k || t == dtype::q5_k || t == dtype::q5_1) last = {1, 3};
  if (t == dtype::q6_k) last = {209};
  for (std::size_t e = 0; e < bytes.size(); e += stride)
    for (const std::size_t l : last) bytes[e + l] &= std::byte{0xbf};
}
}  // namespace

TEST_CASE("typed matmul is canonical on raw bit patterns: subnormal and negative scales, signed zeros",
          "[kernels][matmul]") {
  thread_pool pool(2);
  rng r(14);
  for (const dtype t : all_dtypes)
    for (const std::size_t m : {1, 3, 12}) {
      INFO(to_string(t) << " m " << m);
      const std::size_t rows = 21, cols = info(t).block > 1 ? 2 * info(t).block : 144;
      typed_weights w;
      w.bytes.resize(rows * row_bytes(t, cols));
      random_finite_bits(r, t, w.bytes);
      w.dequantized.resize(rows * cols);
      for (std::size_t j = 0; j < rows; ++j)
        dequantize_row(t, w.bytes.data() + j * row_bytes(t, cols), w.dequantized.data() + j * cols, cols);
      w.view = {t, rows, cols, w.bytes.data()};
      auto x = random_vector(r, m * cols);
      for (std::size_t e = 0; e < x.size(); e += 5) x[e] = e % 2 ? -0.0f : 0.0f;
      std::vector<float> y(m * rows);
      kernels::matmul(pool, x.data(), w.view, y.data(), m);
      CHECK(non_canonical(x, w, y, m) == 0);
    }
}

// The CUDA backend's quantized products read weights eight at a time (kernels/cuda/quant_groups.hpp,
// host and device code): every group of every type it keeps quantized decodes to dequantize_row's
// bits, for quantized floats and for raw bit patterns (finite scales, as above); and the decode
// product's split over a warp's lanes, emulated here with the device's order of sums, covers every
// weight once (a double-precision dot, within the f32 rounding of any order).
TEST_CASE("CUDA quantized and dense groups decode as dequantize_row, and a warp's lanes cover the row",
          "[kernels][cuda]") {
  rng r(21);
  const dtype decoded[] = {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k,
                           dtype::q5_k, dtype::q6_k, dtype::f16,  dtype::bf16, dtype::f32};
  for (const dtype t : decoded) {
    REQUIRE(kernels::quant::register_decoded_type(t));
    // (dense rows of 65 chunks: lane 0 takes three, the others two)
    const std::size_t block = info(t).block, cols = block == 32 ? 96 : block == 1 ? 520 : 768;
    const std::size_t rows = 6, rb = row_bytes(t, cols);
    for (const bool raw : {false, true}) {
      INFO(to_string(t) << (raw ? " raw bits" : " quantized floats"));
      typed_weights w = make_weights(r, t, rows, cols);
      if (raw) {
        random_finite_bits(r, t, w.bytes);
        for (std::size_t j = 0; j < rows; ++j)
          dequantize_row(t, w.bytes.data() + j * rb, w.dequantized.data() + j * cols, cols);
      }
      std::size_t mismatched = 0;
      for (std::size_t j = 0; j < rows; ++j) {
        const auto* row = reinterpret_cast<const std::uint8_t*>(w.bytes.data() + j * rb);
        for (std::size_t g = 0; g < cols / 8; ++g) {
          float got[8];
          kernels::quant::decode8(t, row, g, got);
          if (std::memcmp(got, w.dequantized.data() + j * cols + 8 * g, sizeof got) != 0) ++mismatched;
        }
      }
      CHECK(mismatched == 0);

      // The decode product's chunks (q4_k and q5_k: 32 weights from one 16-byte read) give the same
      // values, and cover every group of a row once.
      std::size_t chunk_mismatched = 0, miscovered = 0;
      kernels::quant::visit_decoded(t, [&](auto type) {
        constexpr dtype T = decltype(type)::value;
        constexpr int C = kernels::quant::chunk_groups<T>;
        for (std::size_t j = 0; j < rows; ++j) {
          const auto* row = reinterpret_cast<const std::uint8_t*>(w.bytes.data() + j * rb);
          std::vector<int> covered(cols / 8, 0);
          for (std::size_t c = 0; c < cols / (8 * C); ++c) {
            float got[8 * C];
            std::size_t first[C];
            kernels::quant::decode_chunk<T>(row, c, got, first);
            for (int g = 0; g < C; ++g) {
              if (first[g] % 8 != 0 || first[g] >= cols) {
                ++miscovered;
                continue;
              }
              ++covered[first[g] / 8];
              if (std::memcmp(got + 8 * g, w.dequantized.data() + j * cols + first[g], 8 * sizeof(float)) != 0)
                ++chunk_mismatched;
            }
          }
          miscovered += static_cast<std::size_t>(std::count_if(covered.begin(), covered.end(), [](int n) { return n != 1; }));
        }
      });
      CHECK(chunk_mismatched == 0);
      CHECK(miscovered == 0);

      // The decode product of each row with m x rows, lane by lane and then summed as a warp sums.
      for (const int m : {1, 3, 8}) {
        const auto x = random_vector(r, static_cast<std::size_t>(m) * cols);
        std::size_t outside = 0;
        for (std::size_t j = 0; j < rows; ++j) {
          const auto* row = reinterpret_cast<const std::uint8_t*>(w.bytes.data() + j * rb);
          float sums[8];
          kernels::quant::warp_dots(t, row, cols, x.data(), m, sums);
          for (int i = 0; i < m; ++i) {
            const float got = sums[i];
            double exact = 0.0, magnitude = 0.0;
            for (std::size_t k = 0; k < cols; ++k) {
              const double p = static_cast<double>(w.dequantized[j * cols + k]) * x[i * cols + k];
              exact += p;
              magnitude += std::fabs(p);
            }
            if (!(std::fabs(got - exact) <= static_cast<double>(cols) * 0x1p-24 * magnitude)) ++outside;
          }
        }
        INFO("m " << m);
        CHECK(outside == 0);
      }
    }
  }
}

// The device's way of reading 4-byte words from an address 2 bytes past a 4-byte boundary (a 2-byte
// load, 4-byte loads, a 2-byte load, stitched) gives the bytes there, little-endian, for 4, 5 and 8
// words (q4_0's nibbles, q5_0's fifth bits and nibbles, q8_0's quants).
TEST_CASE("CUDA split word loads give the bytes they stitch", "[kernels][cuda]") {
  rng r(13);
  std::vector<std::uint8_t> bytes(64);
  for (auto& b : bytes) b = static_cast<std::uint8_t>(r.next());
  const auto check = [&](auto n) {
    constexpr int N = decltype(n)::value;
    for (std::size_t at = 0; at + 4 * N <= bytes.size(); at += 2) {
      std::uint32_t got[N], want[N];
      kernels::quant::detail::load_words_split(bytes.data() + at, got);
      std::memcpy(want, bytes.data() + at, sizeof want);
      CHECK(std::memcmp(got, want, sizeof want) == 0);
    }
  };
  check(std::integral_constant<int, 4>{});
  check(std::integral_constant<int, 5>{});
  check(std::integral_constant<int, 8>{});
}

// The k-quants' scales and mins of a pair of sub-blocks at once (no branch on the pair) are
// scale_min's, for random scale bytes, every pair.
TEST_CASE("CUDA q4_k / q5_k scales of a pair of sub-blocks equal scale_min's", "[kernels][cuda]") {
  rng r(9);
  std::size_t wrong = 0;
  for (int n = 0; n < 20000; ++n) {
    const std::uint32_t w[3] = {static_cast<std::uint32_t>(r.next()), static_cast<std::uint32_t>(r.next()),
                                static_cast<std::uint32_t>(r.next())};
    for (int pair = 0; pair < 4; ++pair) {
      std::uint32_t sc, m, sc0, m0, sc1, m1;
      kernels::quant::detail::scale_min_pair(w, pair, sc, m);
      kernels::quant::detail::scale_min(w, 2 * pair, sc0, m0);
      kernels::quant::detail::scale_min(w, 2 * pair + 1, sc1, m1);
      if (sc != (sc0 | sc1 << 8) || m != (m0 | m1 << 8)) ++wrong;
    }
  }
  CHECK(wrong == 0);
}

namespace {
// The chunks the 32 lanes of a warp read at each step of the decode walk (for_lane_chunks) over a row
// of `chunks` chunks of type T (`bytes` zero bytes of row), after checking that it reads each once.
template <dtype T>
std::vector<std::vector<std::size_t>> walk_steps(std::size_t chunks, std::size_t bytes) {
  const std::vector<std::uint8_t> row(bytes, 0);
  std::vector<int> seen(chunks, 0);
  std::vector<std::vector<std::size_t>> at_step;
  for (int lane = 0; lane < 32; ++lane) {
    std::size_t step = 0;
    kernels::quant::for_lane_chunks<T>(row.data(), chunks, lane, 32, [&](const auto&, std::size_t c) {
      REQUIRE(c < chunks);
      ++seen[c];
      if (at_step.size() <= step) at_step.resize(step + 1);
      at_step[step++].push_back(c);
    });
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<std::ptrdiff_t>(chunks));
  return at_step;
}

// Steps whose lanes read blocks (of `per_block` chunks) of both parities.
std::size_t mixed_steps(const std::vector<std::vector<std::size_t>>& steps, std::size_t per_block) {
  std::size_t mixed = 0;
  for (const auto& lanes : steps)
    mixed += std::any_of(lanes.begin(), lanes.end(),
                         [&](std::size_t c) { return c / per_block % 2 != lanes.front() / per_block % 2; });
  return mixed;
}
}  // namespace

// The decode products' walk over a row (for_lane_chunks, 32 lanes): every chunk once; for the types whose
// blocks alternate between 4- and 2-byte aligned starts (q6_k's 210 bytes, q8_0's 34), the chunks a warp
// reads together (step s of every lane) lie in blocks of one parity in every step of a whole run of 64
// chunks, and in all but one of a shorter last run.
TEST_CASE("CUDA decode walk: every chunk once, and a warp's reads of one alignment", "[kernels][cuda]") {
  for (const std::size_t blocks : {1, 3, 8, 9, 16, 22, 74}) {
    INFO(blocks << " q6_k super-blocks a row");
    const auto steps = walk_steps<dtype::q6_k>(blocks * 8, blocks * 210);  // (32 weights a chunk)
    CHECK(mixed_steps(steps, 8) <= (blocks % 8 == 0 ? 0u : 1u));
  }
  for (const std::size_t blocks : {1, 28, 64, 65, 100, 128, 152}) {
    INFO(blocks << " q8_0 blocks a row");
    const auto steps = walk_steps<dtype::q8_0>(blocks, blocks * 34);  // (a block a chunk)
    CHECK(mixed_steps(steps, 1) <= (blocks % 64 == 0 ? 0u : 1u));
  }
  // The other types walk in order.
  CHECK(kernels::quant::walk_chunk<dtype::q4_k>(37, 64) == 37);
  CHECK(kernels::quant::walk_chunk<dtype::q5_1>(37, 64) == 37);
  // The products over such rows (the walk permuted) still agree with the exact dot products.
  rng r(5);
  for (const dtype t : {dtype::q6_k, dtype::q4_k, dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1}) {
    const std::size_t cols = 256 * 9, rows = 3;
    typed_weights w = make_weights(r, t, rows, cols);
    const auto x = random_vector(r, 2 * cols);
    for (std::size_t j = 0; j < rows; ++j) {
      const auto* row = reinterpret_cast<const std::uint8_t*>(w.bytes.data() + j * row_bytes(t, cols));
      float sums[8];
      kernels::quant::warp_dots(t, row, cols, x.data(), 2, sums);
      for (int i = 0; i < 2; ++i) {
        double exact = 0.0, magnitude = 0.0;
        for (std::size_t k = 0; k < cols; ++k) {
          const double p = static_cast<double>(w.dequantized[j * cols + k]) * x[i * cols + k];
          exact += p;
          magnitude += std::fabs(p);
        }
        CHECK(std::fabs(sums[i] - exact) <= static_cast<double>(cols) * 0x1p-24 * magnitude);
      }
    }
  }
}

// One decode launch over several matrices (q, k and v: kernels::quant::decode_parts): block b's warps
// take rows of part part_of(b), and over the launch's blocks every row of every part has exactly one
// warp (parts of uneven and zero sizes, blocks of 4 warps as the decode kernels' and of 1).
TEST_CASE("CUDA decode launch over several matrices: every row of every part has one warp", "[kernels][cuda]") {
  const std::vector<std::vector<std::size_t>> shapes{{896, 128, 128}, {257, 31, 66}, {3},
                                                     {0, 5, 7},       {9, 0, 4},     {4, 4, 0}};
  for (const int warps : {4, 1})
    for (const auto& rows : shapes) {
      INFO(warps << " warps a block, " << rows.size() << " parts, first of " << rows[0] << " rows");
      kernels::quant::decode_parts parts;
      for (const std::size_t n : rows) parts.add(nullptr, n, nullptr, nullptr, warps);
      std::size_t total = 0;
      for (const std::size_t n : rows) total += (n + warps - 1) / warps;
      CHECK(parts.blocks() == total);  // (no block beyond what the parts need)
      std::vector<std::vector<int>> covered(rows.size());
      for (std::size_t k = 0; k < rows.size(); ++k) covered[k].assign(rows[k], 0);
      std::size_t idle = 0;
      for (unsigned b = 0; b < parts.blocks(); ++b) {
        const int part = parts.part_of(b);
        REQUIRE(part >= 0);
        REQUIRE(part < parts.count);
        REQUIRE(kernels::quant::decode_parts::pick(parts.rows, part) == rows[part]);  // (the kernels' choice)
        for (int warp = 0; warp < warps; ++warp) {
          const auto w = static_cast<unsigned>(warp);
          const std::size_t row = warps == 4 ? parts.row_of<4>(b, part, w) : parts.row_of<1>(b, part, w);
          if (row < rows[part])
            ++covered[part][row];
          else
            ++idle;
        }
      }
      std::size_t wrong = 0;
      for (const auto& c : covered)
        wrong += static_cast<std::size_t>(std::count_if(c.begin(), c.end(), [](int n) { return n != 1; }));
      CHECK(wrong == 0);
      CHECK(idle < rows.size() * static_cast<std::size_t>(warps));  // (only each part's last block idles)
    }
  const float outs[3] = {};
  for (int k = 0; k < 3; ++k) CHECK(kernels::quant::decode_parts::pick({outs, outs + 1, outs + 2}, k) == outs + k);
  kernels::quant::decode_parts full;
  for (int k = 0; k < kernels::quant::decode_parts::max; ++k) full.add(nullptr, 1, nullptr, nullptr, 4);
  CHECK_THROWS_AS(full.add(nullptr, 1, nullptr, nullptr, 4), error);
  kernels::quant::decode_parts mixed;
  mixed.add(nullptr, 8, nullptr, nullptr, 4);
  CHECK_THROWS_AS(mixed.add(nullptr, 8, nullptr, nullptr, 2), error);
}

namespace {

// Every step of a matrix as the tensor-core tiles stage it (quant::tile_staging with K columns, Rows
// rows and Threads threads a block): each cell of a block's rows x K columns written once, with the
// weight dequantize_row gives (bit for bit) where the cell is one of the matrix, else zero.
template <dtype T, int K, int Rows, int Threads>
void check_tile_staging(const std::vector<std::byte>& w, std::size_t rows, std::size_t cols) {
  using S = kernels::quant::tile_staging<T, K, Rows, Threads>;
  constexpr int groups = kernels::quant::chunk_groups<T>;
  const std::size_t rb = row_bytes(T, cols);
  std::vector<float> want(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) dequantize_row(T, w.data() + r * rb, want.data() + r * cols, cols);
  std::size_t wrong_count = 0, wrong_value = 0;
  for (std::size_t r0 = 0; r0 < rows; r0 += Rows)
    for (std::size_t k0 = 0; k0 < cols; k0 += K) {
      std::vector<float> tile(Rows * K, std::numeric_limits<float>::quiet_NaN());
      std::vector<int> written(Rows * K, 0);
      for (int t = 0; t < Threads; ++t)
        for (int j = 0; j < S::chunks; ++j) {
          const auto row = static_cast<std::size_t>(S::row(t, j));
          REQUIRE(row < static_cast<std::size_t>(Rows));
          float v[S::span];
          std::size_t at[groups];
          if (S::live(r0, rows, k0, cols, t, j)) {
            const std::size_t c = S::in_row(k0, t, j);
            kernels::quant::decode_loaded<T>(
                kernels::quant::load_chunk<T>(reinterpret_cast<const std::uint8_t*>(w.data() + (r0 + row) * rb), c), c,
                v, at);
            for (int g = 0; g < groups; ++g) at[g] -= k0;
          } else {
            std::fill(std::begin(v), std::end(v), 0.0f);
            for (int g = 0; g < groups; ++g) at[g] = static_cast<std::size_t>(S::span * S::chunk(t, j) + 8 * g);
          }
          for (int g = 0; g < groups; ++g)
            for (std::size_t i = 0; i < 8; ++i) {
              REQUIRE(at[g] + i < static_cast<std::size_t>(K));
              tile[row * K + at[g] + i] = v[8 * g + i];
              ++written[row * K + at[g] + i];
            }
        }
      for (std::size_t row = 0; row < static_cast<std::size_t>(Rows); ++row)
        for (std::size_t col = 0; col < static_cast<std::size_t>(K); ++col) {
          wrong_count += written[row * K + col] != 1;
          const bool inside = r0 + row < rows && k0 + col < cols;
          const float expect = inside ? want[(r0 + row) * cols + k0 + col] : 0.0f;
          wrong_value += std::memcmp(&expect, &tile[row * K + col], sizeof expect) != 0;
        }
    }
  CHECK(wrong_count == 0);
  CHECK(wrong_value == 0);
}

// The magnitude of the offset a quantized weight's value carries apart from its quant (q5_1's m, the
// k-quants' dmin * min of its sub-block; 0 for the others): the int8 products multiply it separately.
double weight_offset(dtype t, const std::byte* row, std::size_t k) {
  const auto f16 = [&](std::size_t at) {
    std::uint16_t h;
    std::memcpy(&h, row + at, sizeof h);
    return std::fabs(static_cast<double>(f16_to_f32(h)));
  };
  if (t == dtype::q5_1) return f16(k / 32 * 24 + 2);
  if (t != dtype::q4_k && t != dtype::q5_k) return 0.0;
  const std::size_t at = k / 256 * (t == dtype::q4_k ? 144 : 176);
  std::uint8_t scales[12], sc, mn;
  std::memcpy(scales, row + at + 4, sizeof scales);
  kquant::scale_min(scales, k % 256 / 32, sc, mn);
  return f16(at + 2) * mn;
}

}  // namespace

TEST_CASE("CUDA tensor-core tiles: a step stages every weight of its block once, as dequantize_row",
          "[kernels][cuda]") {
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    // rows past one block; for the types of 32-weight blocks, last steps of 32, 64 and 96 columns
    std::vector<std::size_t> widths{256, 512};
    if (info(type).block == 32) widths.insert(widths.end(), {160, 192, 96});
    for (const std::size_t cols : widths) {
      INFO(to_string(type) << " x " << cols << " columns");
      const std::size_t rows = 70;
      rng r(cols + rows);
      const typed_weights w = make_weights(r, type, rows, cols);
      kernels::quant::visit_kept(type, [&](auto t) {
        constexpr dtype T = decltype(t)::value;
        check_tile_staging<T, 128, 32, 64>(w.bytes, rows, cols);  // policy::quant_tiles's
        check_tile_staging<T, 128, 64, 128>(w.bytes, rows, cols);
        check_tile_staging<T, 256, 32, 64>(w.bytes, rows, cols);
      });
    }
  }
}

// The staged tensor-core attention (attention_mma.cuh, mma_attention::staged), emulated: 32 lanes of
// each warp run the kernel's own index and softmax arithmetic (attention_mma.hpp), with ldmatrix and
// mma.sync emulated as the PTX ISA defines them (what a lane's address and registers mean), from K and
// V staged as the kernel stages them; the queries and probabilities rounded to f16 as on the device.
namespace staged_attention {
using lane_regs = std::array<std::array<float, 8>, 32>;  // a fragment's elements, lane by lane

// ldmatrix.x4 (.trans or not) of halves (f16 bits) at the addresses the lanes give: register j of lane
// L is matrix j's row L / 4, columns 2 (L % 4), + 1 (the transpose: rows 2 (L % 4), + 1, column L / 4);
// matrix j's row r is at the address lane 8 j + r gives.
lane_regs ldsm_x4(const std::vector<std::uint16_t>& smem, const std::array<std::size_t, 32>& address, bool trans) {
  lane_regs r{};
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const std::size_t at = trans ? address[static_cast<std::size_t>(8 * j + 2 * (lane % 4) + h)] + lane / 4
                                     : address[static_cast<std::size_t>(8 * j + lane / 4)] + 2 * (lane % 4) + h;
        r[static_cast<std::size_t>(lane)][static_cast<std::size_t>(2 * j + h)] = f16_to_f32(smem.at(at));
      }
  return r;
}

// c += a b by the fragments' documented coordinates (every element of A and B placed exactly once).
void mma_16816(std::array<std::array<float, 4>, 32>& c, const lane_regs& a, const lane_regs& b, int b_first) {
  float am[16][16], bm[16][8];
  int seen_a[16][16] = {}, seen_b[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      am[kernels::mma::a_row(lane, i)][kernels::mma::a_col(lane, i)] =
          a[static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)];
      ++seen_a[kernels::mma::a_row(lane, i)][kernels::mma::a_col(lane, i)];
    }
    for (int i = 0; i < 4; ++i) {  // (registers b_first, b_first + 1 of the ldmatrix)
      bm[kernels::mma::b_row(lane, i)][kernels::mma::b_col(lane)] =
          b[static_cast<std::size_t>(lane)][static_cast<std::size_t>(4 * b_first + i)];
      ++seen_b[kernels::mma::b_row(lane, i)][kernels::mma::b_col(lane)];
    }
  }
  bool once = true;
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) once = once && seen_a[r][k] == 1 && (r >= 8 || seen_b[k][r] == 1);
  REQUIRE(once);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      float d = 0.0f;
      for (int k = 0; k < 16; ++k) d += am[kernels::mma::c_row(lane, i)][k] * bm[k][kernels::mma::c_col(lane, i)];
      c[static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)] += d;
    }
}

// The largest |got - want| over max(|want|, 1), infinite where got is not finite.
float worst_error(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  float worst = 0.0f;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(std::abs(want[i]), 1.0f));
  }
  return worst;
}

// One block (a tile) of the kernel with heads of up to 16 NB dimensions and chunks of KC keys.
template <int NB, int KC>
void run_tile(const kv::paged_layout& l, const std::vector<half>& k_cache, const std::vector<half>& v_cache,
              const std::vector<float>& q, std::vector<float>& out, const block_id* table,
              const kernels::attention_tile& tile, position first_pos, std::size_t heads, float scale,
              std::size_t range_first, std::size_t per_split, float* slot) {
  constexpr int W = 4, R = 64, NS = KC / 8, NO = 2 * NB, RS = 8;
  const int rows = static_cast<int>(tile.tokens * tile.heads);
  const std::size_t hd = l.head_dim, bs = l.block_size, th = tile.heads;
  const int nk = static_cast<int>(hd / 16);
  const kernels::mma::stage_shape sh{R, hd, KC};
  const std::size_t g = tile.first_head / (heads / l.kv_heads);
  std::vector<std::uint16_t> smem(sh.bytes() / 2, 0x7E00);  // (NaN until written)
  const auto row_index = [&](int r) {
    return (tile.first_token + static_cast<std::size_t>(r) / th) * heads + tile.first_head +
           static_cast<std::size_t>(r) % th;
  };
  for (int r = 0; r < R; ++r)
    for (std::size_t d = 0; d < hd; ++d)
      smem[static_cast<std::size_t>(r) * sh.ldq() + d] = f32_to_f16(r < rows ? q[row_index(r) * hd + d] : 0.0f);
  const auto in_range = [&](std::size_t keys) { return kernels::mma::range_end(keys, range_first, per_split); };
  const std::size_t keys =
      in_range(kernels::mma::visible_keys(rows - 1, rows, th, static_cast<std::size_t>(first_pos)));
  const auto stage = [&](std::size_t first_key, int buf) {
    for (std::size_t p = 0; p < hd * KC / 8; ++p) {
      const auto at = kernels::mma::k_piece(p, KC);
      const std::size_t key = first_key + at.col;
      for (std::size_t e = 0; e < 8; ++e)
        smem[sh.k_at(buf) / 2 + at.row * sh.ldk() + at.col + e] =
            key < keys ? k_cache[l.key_offset(table[key / bs], g) + at.row * bs + key % bs + e].bits : 0;
    }
    for (std::size_t p = 0; p < KC * hd / 8; ++p) {
      const auto at = kernels::mma::v_piece(p, hd);
      const std::size_t key = first_key + at.row;
      for (std::size_t e = 0; e < 8; ++e)
        smem[sh.v_at(buf) / 2 + at.row * sh.ldv() + at.col + e] =
            key < keys ? v_cache[l.offset(table[key / bs], g, key % bs) + at.col + e].bits : 0;
    }
  };
  const std::size_t chunks = keys > range_first ? (keys - range_first + KC - 1) / KC : 0;
  for (int warp = 0; warp < W; ++warp) {
    const int first_row = 16 * warp;
    if (first_row >= rows) continue;
    const std::size_t warp_keys = in_range(
        kernels::mma::visible_keys(std::min(rows - 1, first_row + 15), rows, th, static_cast<std::size_t>(first_pos)));
    float o[32][NO][4] = {}, m[32][2], sum[32][2] = {};
    std::size_t visible[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      m[lane][0] = m[lane][1] = -INFINITY;
      for (int h = 0; h < 2; ++h)
        visible[lane][h] = in_range(
            kernels::mma::visible_keys(first_row + lane / 4 + 8 * h, rows, th, static_cast<std::size_t>(first_pos)));
    }
    const auto addresses = [&](std::size_t base, std::size_t ld) {
      std::array<std::size_t, 32> a{};
      for (int lane = 0; lane < 32; ++lane)
        a[static_cast<std::size_t>(lane)] = base + static_cast<std::size_t>(kernels::mma::ldsm_row(lane)) * ld +
                                            static_cast<std::size_t>(kernels::mma::ldsm_col(lane));
      return a;
    };
    for (std::size_t c = 0; c < chunks && range_first + c * KC < warp_keys; ++c) {
      const int buf = static_cast<int>(c % 2);
      const std::size_t first_key = range_first + c * KC;
      stage(first_key, buf);
      std::array<std::array<float, 4>, 32> s_acc[NS] = {};
      for (int kk = 0; kk < nk; ++kk) {
        const auto a =
            ldsm_x4(smem, addresses(static_cast<std::size_t>(first_row) * sh.ldq() + 16 * kk, sh.ldq()), false);
        for (int n = 0; n < NS / 2; ++n) {
          const auto b = ldsm_x4(smem, addresses(sh.k_at(buf) / 2 + 16 * kk * sh.ldk() + 16 * n, sh.ldk()), true);
          mma_16816(s_acc[2 * n], a, b, 0);
          mma_16816(s_acc[2 * n + 1], a, b, 1);
        }
      }
      float s[32][NS][4];
      float top[32][2];
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < NS; ++j)
          for (int e = 0; e < 4; ++e)
            s[lane][j][e] = s_acc[j][static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)];
        kernels::mma::mask_scale(s[lane], lane, first_key, visible[lane], scale * 1.4426950408889634f, top[lane]);
      }
      for (int lane = 0; lane < 32; ++lane) {  // (the shuffles: the four lanes of a row)
        float t[2];
        for (int h = 0; h < 2; ++h) {
          t[h] = -INFINITY;
          for (int x = 0; x < 4; ++x) t[h] = std::max(t[h], top[4 * (lane / 4) + x][h]);
        }
        kernels::mma::softmax_step(s[lane], o[lane], m[lane], sum[lane], t);
      }
      for (int kk = 0; kk < KC / 16; ++kk) {
        lane_regs a{};
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h)
              a[static_cast<std::size_t>(lane)][static_cast<std::size_t>(2 * r + h)] =
                  kernels::mma::round_f16(s[lane][kernels::mma::p_block(kk, r)][kernels::mma::p_elem(r, h)]);
        for (int n = 0; n < nk; ++n) {
          const auto b = ldsm_x4(smem, addresses(sh.v_at(buf) / 2 + 16 * kk * sh.ldv() + 16 * n, sh.ldv()), true);
          for (int half_n = 0; half_n < 2; ++half_n) {
            std::array<std::array<float, 4>, 32> acc{};
            for (int lane = 0; lane < 32; ++lane)
              for (int e = 0; e < 4; ++e)
                acc[static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)] = o[lane][2 * n + half_n][e];
            mma_16816(acc, a, b, half_n);
            for (int lane = 0; lane < 32; ++lane)
              for (int e = 0; e < 4; ++e)
                o[lane][2 * n + half_n][e] = acc[static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)];
          }
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        float total = 0.0f;
        for (int x = 0; x < 4; ++x) total += sum[4 * (lane / 4) + x][h];
        const int r = first_row + lane / 4 + 8 * h;
        if (r >= rows) continue;
        if (slot != nullptr) {  // (a range of a split tile: its maximum, sum and weighted sums)
          REQUIRE(r < RS);
          slot[r] = m[lane][h] * 0.6931471805599453f;
          slot[RS + r] = total;
        }
        for (int j = 0; j < 2 * nk; ++j)
          for (int e = 0; e < 2; ++e) {
            const std::size_t d = static_cast<std::size_t>(8 * j + 2 * (lane % 4) + e);
            if (slot != nullptr)
              slot[2 * RS + static_cast<std::size_t>(r) * hd + d] = o[lane][j][2 * h + e];
            else
              out[row_index(r) * hd + d] = o[lane][j][2 * h + e] / total;
          }
      }
  }
}

// The kernel over a step: tiles of up to 64 rows, one range each (split_pages 0); or, as for a decode
// step, tiles of up to 8 rows, each cut into ranges of split_pages pages whose slots are merged as
// agent::merge_ranges merges them.
std::vector<float> attention(const kv::paged_layout& l, const std::vector<half>& k, const std::vector<half>& v,
                             const std::vector<float>& q, std::span<const kernels::token_slot> tokens,
                             std::size_t heads, float scale, std::size_t split_pages = 0) {
  constexpr std::size_t RS = 8;
  const std::size_t hd = l.head_dim;
  kernels::attention_step step;
  step.plan(tokens, l.block_size, heads, l.kv_heads, split_pages == 0 ? 64 : RS);
  std::vector<float> out(q.size(), NAN);
  for (const auto& t : step.tiles) {
    const block_id* table = step.tables.data() + t.table;
    const std::size_t keys = static_cast<std::size_t>(t.first_pos) + t.tile.tokens;
    const std::size_t per_split = split_pages == 0 ? keys : split_pages * l.block_size;
    const std::size_t splits = (keys + per_split - 1) / per_split;
    std::vector<float> slots(splits * RS * (hd + 2), NAN);
    for (std::size_t sp = 0; sp < splits; ++sp) {
      float* slot = split_pages == 0 ? nullptr : slots.data() + sp * RS * (hd + 2);
      const auto run = [&](auto nb, auto kc) {
        run_tile<decltype(nb)::value, decltype(kc)::value>(l, k, v, q, out, table, t.tile, t.first_pos, heads, scale,
                                                           sp * per_split, per_split, slot);
      };
      if (hd <= 64)
        run(std::integral_constant<int, 4>{}, std::integral_constant<int, 64>{});
      else if (hd <= 128)
        run(std::integral_constant<int, 8>{}, std::integral_constant<int, 64>{});
      else
        run(std::integral_constant<int, 16>{}, std::integral_constant<int, 32>{});
    }
    if (split_pages == 0) continue;
    for (std::size_t r = 0; r < static_cast<std::size_t>(t.tile.tokens) * t.tile.heads; ++r) {
      float top = -INFINITY;
      for (std::size_t sp = 0; sp < splits; ++sp) top = std::max(top, slots[sp * RS * (hd + 2) + r]);
      std::vector<float> value(hd, 0.0f);
      float total = 0.0f;
      for (std::size_t sp = 0; sp < splits; ++sp) {
        const float* slot = slots.data() + sp * RS * (hd + 2);
        const float f = std::exp(slot[r] - top);
        total += slot[RS + r] * f;
        for (std::size_t d = 0; d < hd; ++d) value[d] += slot[2 * RS + r * hd + d] * f;
      }
      const std::size_t row = (t.tile.first_token + r / t.tile.heads) * heads + t.tile.first_head + r % t.tile.heads;
      for (std::size_t d = 0; d < hd; ++d) out[row * hd + d] = value[d] / total;
    }
  }
  return out;
}
}  // namespace staged_attention

TEST_CASE("CUDA staged tensor-core attention, emulated: the host's attention within f16 rounding", "[kernels][cuda]") {
  struct shape {
    std::size_t kv_heads, block_size, head_dim, heads;
  };
  rng r(33);
  float worst = 0.0f;
  for (const shape sh :
       {shape{2, 16, 64, 14}, shape{1, 32, 128, 7}, shape{2, 48, 16, 4}, shape{1, 64, 80, 16}, shape{1, 16, 256, 2}}) {
    const kv::paged_layout l{24, sh.kv_heads, sh.block_size, sh.head_dim};
    INFO("block " << sh.block_size << ", head_dim " << sh.head_dim << ", heads " << sh.heads << "/" << sh.kv_heads);
    std::vector<half> k(l.elements()), v(l.elements());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = half{f32_to_f16(static_cast<float>(r.uniform()) * 2.0f - 1.0f)};
      v[i] = half{f32_to_f16(static_cast<float>(r.uniform()) * 2.0f - 1.0f)};
    }
    for (const std::size_t fresh : {1, 2, 19, 70}) {
      INFO(fresh << " new tokens per sequence");
      // Sequences of 1, 33 and 150 keys (their last `fresh`), each with its own table of random pages.
      std::vector<std::vector<block_id>> tables;
      std::vector<kernels::token_slot> tokens;
      for (const std::size_t n : {1, 33, 150}) {
        std::vector<block_id> t;
        for (std::size_t b = 0; b < (n + l.block_size - 1) / l.block_size; ++b)
          t.push_back(static_cast<block_id>(r.below(l.blocks)));
        tables.push_back(std::move(t));
      }
      std::size_t s = 0;
      for (const std::size_t n : {1, 33, 150}) {
        for (std::size_t p = n - std::min(fresh, n); p < n; ++p)
          tokens.push_back({tables[s], static_cast<position>(p)});
        ++s;
      }
      std::vector<float> q(tokens.size() * sh.heads * l.head_dim);
      for (auto& x : q) x = static_cast<float>(r.uniform()) * 4.0f - 2.0f;
      const float scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
      std::vector<float> host(q.size());
      thread_pool pool(2);
      kernels::paged_attention<half>(pool, l, k.data(), v.data(), q.data(), host.data(), tokens, sh.heads, scale);
      // One range a tile of 64 rows (prefill); ranges of 1 and 3 pages a tile of 8 rows (decode's
      // split-K), merged. The device test's bound (the queries and probabilities rounded to f16).
      for (const std::size_t split_pages : {0, 1, 3}) {
        INFO("ranges of " << split_pages << " pages (0: one a tile)");
        const auto emulated = staged_attention::attention(l, k, v, q, tokens, sh.heads, scale, split_pages);
        const float error = staged_attention::worst_error(emulated, host);
        worst = std::max(worst, error);
        CHECK(error < 1e-3f);
      }
    }
  }
  CHECK(worst > 0.0f);  // (the f16 roundings are there: the emulation is not the host's arithmetic)
}

// The slots of a sequence's last page past its keys may hold infinities or NaNs: the staged kernel
// stages zeros there for V, and masks the scores, so none reaches a row.
TEST_CASE("CUDA staged tensor-core attention, emulated: nothing past a sequence's keys reaches a row",
          "[kernels][cuda]") {
  const kv::paged_layout l{8, 1, 16, 64};
  const std::size_t heads = 4, length = 37;
  rng r(77);
  std::vector<half> k(l.elements()), v(l.elements());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = half{f32_to_f16(static_cast<float>(r.uniform()) * 2.0f - 1.0f)};
    v[i] = half{f32_to_f16(static_cast<float>(r.uniform()) * 2.0f - 1.0f)};
  }
  const std::vector<block_id> table{0, 1, 2};
  for (std::size_t slot = length % 16; slot < 16; ++slot)
    for (std::size_t d = 0; d < l.head_dim; ++d) {
      const float junk = slot % 2 == 0 ? INFINITY : NAN;
      k[l.key_offset(2, 0) + d * l.block_size + slot] = half{f32_to_f16(junk)};
      v[l.offset(2, 0, slot) + d] = half{f32_to_f16(junk)};
    }
  std::vector<kernels::token_slot> tokens;
  for (std::size_t p = 0; p < length; ++p) tokens.push_back({table, static_cast<position>(p)});
  std::vector<float> q(tokens.size() * heads * l.head_dim);
  for (auto& x : q) x = static_cast<float>(r.uniform()) * 4.0f - 2.0f;
  std::vector<float> host(q.size());
  thread_pool pool(2);
  kernels::paged_attention<half>(pool, l, k.data(), v.data(), q.data(), host.data(), tokens, heads, 0.125f);
  const auto emulated = staged_attention::attention(l, k, v, q, tokens, heads, 0.125f);
  CHECK(std::all_of(emulated.begin(), emulated.end(), [](float x) { return std::isfinite(x); }));
  CHECK(staged_attention::worst_error(emulated, host) < 1e-3f);
}

// The CUDA backend's int8 decode product (kernels/cuda/quant_int8.hpp, host and device code), emulated
// with the device's split over lanes and order of sums: the activations rounded as the host's int8
// products round them, the same integers, so the result is the host's int8 product (kernels::matmul,
// products::int8) within the f32 rounding of both orders of float steps; and a row's result does not
// depend on how many x rows share the product.
TEST_CASE("CUDA int8 decode product, emulated: the host's int8 products within f32 rounding", "[kernels][cuda]") {
  thread_pool pool(2);
  rng r(33);
  const dtype kept[] = {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k};
  for (const dtype t : kept)
    for (const std::size_t cols : info(t).block == 32 ? std::vector<std::size_t>{96, 1056} : std::vector<std::size_t>{768, 9216})
      for (const bool raw : {false, true}) {
        INFO(to_string(t) << " cols " << cols << (raw ? " raw bits" : " quantized floats"));
        const std::size_t rows = 5, rb = row_bytes(t, cols);
        typed_weights w = make_weights(r, t, rows, cols);
        if (raw) random_finite_bits(r, t, w.bytes);
        const std::size_t m = 8;
        const auto x = random_vector(r, m * cols);
        const kernels::quant::x8_host xq = kernels::quant::make_x8(t, x.data(), m, cols);
        std::vector<float> host(m * rows);
        kernels::matmul(pool, x.data(), kernels::weight_view{t, rows, cols, w.bytes.data()}, host.data(), m,
                        kernels::accumulate::no, kernels::products::int8);
        // Float steps a lane takes (two per chunk at most) and the host (two per block at most).
        const std::size_t chunk = kernels::quant::x8_span(t) == 256 && t != dtype::q6_k ? 32 : 8;
        const double steps = 2.0 * (cols / chunk / 32 + 1) + 2.0 * (cols / info(t).block) + 8;
        std::size_t outside = 0, batch_dependent = 0;
        for (std::size_t j = 0; j < rows; ++j) {
          const auto* row = reinterpret_cast<const std::uint8_t*>(w.bytes.data() + j * rb);
          float got[8];
          kernels::quant::warp_idots(t, row, xq.view(), static_cast<int>(m), got);
          std::vector<float> dq(cols);
          dequantize_row(t, w.bytes.data() + j * rb, dq.data(), cols);
          for (std::size_t i = 0; i < m; ++i) {
            // Each step's product is at most (|weight| + its offset, twice) times the rounded activation.
            double magnitude = 0;
            for (std::size_t k = 0; k < cols; ++k) {
              const double a = std::fabs(static_cast<double>(xq.d[(i * cols + k) / kernels::quant::x8_span(t)]) *
                                         xq.q[i * cols + k]);
              magnitude += (std::fabs(static_cast<double>(dq[k])) + 2 * weight_offset(t, w.bytes.data() + j * rb, k)) * a;
            }
            if (!(std::fabs(static_cast<double>(got[i]) - host[i * rows + j]) <= steps * 0x1p-24 * magnitude)) ++outside;
            // The same row alone: the same bits.
            const kernels::quant::x8_rows one{xq.q.data() + i * cols, xq.d.data() + i * (cols / kernels::quant::x8_span(t)),
                                              xq.sums.data() + i * (cols / 16), cols};
            float alone[8];
            kernels::quant::warp_idots(t, row, one, 1, alone);
            if (std::memcmp(&alone[0], &got[i], sizeof(float)) != 0) ++batch_dependent;
          }
        }
        CHECK(outside == 0);
        CHECK(batch_dependent == 0);
      }
}

TEST_CASE("typed matmul matches a double-precision triple loop, and accumulates", "[kernels][matmul]") {
  thread_pool pool(2);
  rng r(12);
  for (const dtype t : all_dtypes)
    for (const auto& [rows, cols] : typed_shapes(t))
      for (const std::size_t m : {1, 5, 17}) {
        INFO(to_string(t) << " m " << m << " rows " << rows << " cols " << cols);
        const auto w = make_weights(r, t, rows, cols);
        const auto x = random_vector(r, m * cols);
        std::vector<float> want(m * rows), magnitude(m * rows);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < rows; ++j) {
            double s = 0, a = 0;
            for (std::size_t k = 0; k < cols; ++k) {
              const double p = static_cast<double>(x[i * cols + k]) * w.dequantized[j * cols + k];
              s += p;
              a += std::abs(p);
            }
            want[i * rows + j] = static_cast<float>(s);
            magnitude[i * rows + j] = static_cast<float>(a);
          }
        std::vector<float> y(m * rows);
        kernels::matmul(pool, x.data(), w.view, y.data(), m);
        // An f32 sum over 16 lanes of up to 2,304 products errs by at most about (2304 / 16 + 4) * 2^-24
        // of the sum of their magnitudes (under 1e-5), whatever cancels.
        std::size_t off = 0;
        for (std::size_t e = 0; e < y.size(); ++e) off += std::abs(y[e] - want[e]) > 1e-5f * magnitude[e];
        CHECK(off == 0);
        // accumulate::yes adds the same products onto what is there: y0 + (x w^T), rounded once more.
        const auto y0 = random_vector(r, m * rows);
        auto sum = y0;
        kernels::matmul(pool, x.data(), w.view, sum.data(), m, kernels::accumulate::yes);
        std::size_t differ = 0;
        for (std::size_t e = 0; e < sum.size(); ++e) differ += sum[e] != y0[e] + y[e];
        CHECK(differ == 0);
      }
}

TEST_CASE("activations rounded to 8 bits: every path gives kquant::quantize's bytes", "[kernels][int8]") {
  rng r(16);
  std::vector<float> x(256 * 8);
  for (auto& v : x) v = static_cast<float>(r.normal());
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // block 1: all zero
  x[512 + 7] = -4.0f;                                 // block 2: the first of two largest magnitudes is negative
  x[512 + 9] = 4.0f;
  for (std::size_t k = 0; k < 256; ++k) x[768 + k] = static_cast<float>(k % 64) - 31.5f;  // block 3: ties to even
  x[768 + 255] = 127.0f;
  for (std::size_t k = 0; k < 256; ++k) x[1024 + k] = 1e-40f * static_cast<float>(k);  // block 4: subnormal
  std::vector<kquant::block_q8_k> want(8), got(8);
  for (std::size_t b = 0; b < 8; ++b) kquant::quantize(x.data() + 256 * b, want[b]);
  const auto same = [&] {
    std::size_t differ = 0;
    for (std::size_t b = 0; b < 8; ++b)
      differ += std::bit_cast<std::uint32_t>(want[b].d) != std::bit_cast<std::uint32_t>(got[b].d) ||
                std::memcmp(want[b].qs, got[b].qs, 256) != 0 || std::memcmp(want[b].bsums, got[b].bsums, 32) != 0;
    return differ;
  };
  CHECK(want[2].d == 4.0f / 127.0f);  // d = max / -127 with max = -4
  kernels::detail::isa_generic::quantize_q8_k(x.data(), 8, got.data());
  CHECK(same() == 0);
#if EFIM_KERNELS_DISPATCHED
  if (kernels::detected_isa() >= kernels::isa::avx2) {
    got.assign(8, {});
    kernels::detail::isa_avx2::quantize_q8_k(x.data(), 8, got.data());
    CHECK(same() == 0);
  }
  got.assign(8, {});
  if (kernels::detected_isa() == kernels::isa::avx512) {
    kernels::detail::isa_avx512::quantize_q8_k(x.data(), 8, got.data());
    CHECK(same() == 0);
  }
#endif
}

TEST_CASE("activations rounded to 8 bits per 32: llama.cpp's q8_0 rounding, the same bytes on every path",
          "[kernels][int8]") {
  rng r(17);
  std::vector<float> x(32 * 10);
  for (auto& v : x) v = static_cast<float>(r.normal());
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);  // block 1: all zero
  for (std::size_t k = 0; k < 32; ++k) x[64 + k] = static_cast<float>(k) - 15.5f;  // block 2: halves, to even
  x[64 + 31] = 127.0f;
  for (std::size_t k = 0; k < 32; ++k) x[96 + k] = 1e-40f * static_cast<float>(k);  // block 3: subnormal
  x[128 + 3] = std::nanf("");                                                         // block 4: a NaN
  x[160 + 5] = std::numeric_limits<float>::infinity();                                // block 5: an infinity
  x[192 + 1] = -70000.0f;  // block 6: a large negative value (70000 is past f16's range, 70000 / 127 is not)
  std::vector<kquant::block_q8_32> want(10), got(10);
  for (std::size_t b = 0; b < 10; ++b) kquant::quantize(x.data() + 32 * b, want[b]);
  // What llama.cpp's x86 quantize_row_q8_0 gives, written out for block 2: d = f16(127 / 127) = 1 and
  // x * 1 rounded to even: -15.5 -> -16, -14.5 -> -14, ..., 14.5 -> 14.
  CHECK(want[2].d == 1.0f);
  for (std::size_t k = 0; k < 31; ++k)
    CHECK(want[2].qs[k] == static_cast<int>(std::nearbyint(static_cast<float>(k) - 15.5f)));
  CHECK(want[2].qs[0] == -16);
  CHECK(want[2].qs[1] == -14);
  CHECK(want[1].d == 0.0f);
  CHECK(want[1].sum == 0);
  // A block of ordinary values: d is amax / 127 rounded to f16, the quants x * (127 / amax) rounded.
  {
    float amax = 0;
    for (std::size_t k = 0; k < 32; ++k) amax = std::max(amax, std::abs(x[k]));
    CHECK(want[0].d == f16_to_f32(f32_to_f16(amax / 127.0f)));
    int sum = 0;
    for (std::size_t k = 0; k < 32; ++k) {
      CHECK(want[0].qs[k] == static_cast<int>(std::nearbyint(x[k] * (127.0f / amax))));
      sum += want[0].qs[k];
    }
    CHECK(want[0].sum == sum);
  }
  CHECK(want[4].qs[3] == 0);  // NaN rounds to 0
  CHECK(want[5].qs[5] == 0);  // amax infinite: 127 / amax = 0, and inf * 0 is NaN
  const auto same = [&] {
    std::size_t differ = 0;
    for (std::size_t b = 0; b < 10; ++b)
      differ += std::bit_cast<std::uint32_t>(want[b].d) != std::bit_cast<std::uint32_t>(got[b].d) ||
                want[b].sum != got[b].sum || std::memcmp(want[b].qs, got[b].qs, 32) != 0;
    return differ;
  };
  kernels::detail::isa_generic::quantize_q8_32(x.data(), 10, got.data());
  CHECK(same() == 0);
#if EFIM_KERNELS_DISPATCHED
  if (kernels::detected_isa() >= kernels::isa::avx2) {
    got.assign(10, {});
    kernels::detail::isa_avx2::quantize_q8_32(x.data(), 10, got.data());
    CHECK(same() == 0);
  }
  if (kernels::detected_isa() == kernels::isa::avx512) {
    got.assign(10, {});
    kernels::detail::isa_avx512::quantize_q8_32(x.data(), 10, got.data());
    CHECK(same() == 0);
  }
#endif
}

namespace {

// Calls f(path, form) for each SIMD path this CPU runs and each form of the integer products that
// path takes here (the dispatch takes only the best one).
template <class F>
void for_each_int8_form(F&& f) {
  for (const kernels::isa path : {kernels::isa::avx2, kernels::isa::avx512}) {
    if (kernels::detected_isa() < path) continue;
    for (const kernels::int8_dot d :
         {kernels::int8_dot::madd, kernels::int8_dot::evex, kernels::int8_dot::vex, kernels::int8_dot::amx}) {
      const bool taken = path == kernels::isa::avx512 ? d != kernels::int8_dot::vex : d != kernels::int8_dot::amx;
      if (kernels::runs(d) && taken) f(path, d);
    }
  }
}

// y = the int8 product of x (xq: rounded per 256, for the k-quants; xq32: per 32, for the others) and
// w on `path` in form d, called on that path directly.
void int8_on(kernels::isa path, kernels::int8_dot d, thread_pool& pool, const std::vector<kquant::block_q8_k>& xq,
             const std::vector<kquant::block_q8_32>& xq32, const kernels::weight_view& w, float* y, std::size_t m) {
#if EFIM_KERNELS_DISPATCHED
  namespace kd = kernels::detail;
  const bool per32 = kernels::int8_products_32(w.type);
  if (path == kernels::isa::avx512 && per32)
    kd::isa_avx512::matmul_int8_32(pool, xq32.data(), w, y, m, kernels::accumulate::no, d);
  else if (path == kernels::isa::avx512)
    kd::isa_avx512::matmul_int8(pool, xq.data(), w, y, m, kernels::accumulate::no, d);
  else if (per32)
    kd::isa_avx2::matmul_int8_32(pool, xq32.data(), w, y, m, kernels::accumulate::no, d);
  else
    kd::isa_avx2::matmul_int8(pool, xq.data(), w, y, m, kernels::accumulate::no, d);
#else
  (void)path, (void)d, (void)pool, (void)xq, (void)xq32, (void)w, (void)y, (void)m;
#endif
}

}  // namespace

TEST_CASE("int8 products: the same bits on every path, batch and thread count, within the rounding of x",
          "[kernels][matmul][int8]") {
  thread_pool one(1), two(2), three(3);
  rng r(15);
  const kernels::isa before = kernels::active_isa();
  for (const dtype t : {dtype::q4_k, dtype::q5_k, dtype::q6_k, dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1})
    for (const auto& [rows, cols] : typed_shapes(t)) {
      const auto w = make_weights(r, t, rows, cols);
      // q8_0, q4_0 and the k-quants also with their rows interleaved (interleave.hpp): every product below on them
      // gives the bits it gives on the rows as stored (decode streams them, the rest puts them back).
      std::vector<std::byte> il_bytes(kernels::interleavable(t) ? w.bytes.size() : 0);
      kernels::weight_view il{};
      if (kernels::interleavable(t)) {
        kernels::interleave8(w.view, il_bytes.data());
        il = {t, rows, cols, il_bytes.data(), kernels::weight_layout::interleaved8};
        std::vector<std::byte> back(il_bytes.size());
        kernels::deinterleave8(il, back.data(), &two);
        CHECK(back == w.bytes);
        CHECK((rows < 8 || il_bytes != w.bytes));
      }
      // x is rounded per 256 for the k-quants (d = max / -127: |x - d q| <= |d| / 2), per 32 for the
      // others (d = amax / 127 rounded to f16, q = x * 127 / amax rounded: |x - d q| <= 0.57 |d|).
      const std::size_t per = kernels::int8_products_32(t) ? 32 : 256;
      const double error = per == 32 ? 0.57 : 0.5;
      // Float steps per output (one per block, q5_1 two): each rounds the partial sum once.
      const double steps = static_cast<double>(cols / per * (t == dtype::q5_1 ? 2 : 1));
      // Both sides of every streaming bound (int8_stream_rows; il8_stream_rows per type and form; q32_il8x2_rows)
      // and every tile of x rows (1 to 8: q32_il8x2's tiles of 8 leave 2, 3 and 6 at 10, 11 and 14); AMX: 37 = 2
      // tiles + 5, 24 and 25 the bound of interleaved rows (amx_il8_stream_rows).
      for (const std::size_t m :
           {1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 16, 17, 24, 25, 32, 33, 37, 48, 49, 64, 65, 96, 97, 256, 257}) {
        INFO(to_string(t) << " m " << m << " rows " << rows << " cols " << cols);
        auto x = random_vector(r, m * cols);
        if (m == 3) {  // an all-zero block
          const auto at = x.begin() + static_cast<std::ptrdiff_t>(cols);
          std::fill(at, at + static_cast<std::ptrdiff_t>(per), 0.0f);
        }
        // What the activations are rounded to, and the sum over the dequantized weights in double:
        // the integer sums are exact, so only the float steps per block (a few roundings of the
        // partial sums) stand between the two.
        std::vector<kquant::block_q8_k> xq(per == 256 ? m * cols / 256 : 0);
        for (std::size_t b = 0; b < xq.size(); ++b) kquant::quantize(x.data() + 256 * b, xq[b]);
        std::vector<kquant::block_q8_32> xq32(per == 32 ? m * cols / 32 : 0);
        for (std::size_t b = 0; b < xq32.size(); ++b) kquant::quantize(x.data() + 32 * b, xq32[b]);
        const auto rounded = [&](std::size_t at, double& d) -> double {  // x[at] as rounded: d * q
          if (per == 32) {
            d = xq32[at / 32].d;
            return d * xq32[at / 32].qs[at % 32];
          }
          d = xq[at / 256].d;
          return d * xq[at / 256].qs[at % 256];
        };
        std::size_t off_rounded = 0, off_exact = 0;
        std::vector<float> want(m * rows);
        std::vector<double> magnitude(m * rows), bound(m * rows);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < rows; ++j) {
            double s = 0, a = 0, e = 0;
            for (std::size_t k = 0; k < cols; ++k) {
              double d = 0;
              const double wk = w.dequantized[j * cols + k];
              const double p = wk * rounded(i * cols + k, d);
              s += p;
              a += std::abs(p);
              e += std::abs(wk) * std::abs(d) * error;
            }
            want[i * rows + j] = static_cast<float>(s);
            magnitude[i * rows + j] = a;
            bound[i * rows + j] = e;
          }
        std::vector<float> first;
        for (const kernels::isa path : {kernels::isa::generic, kernels::isa::avx2, kernels::isa::avx512}) {
          if (kernels::select_isa(path) != path) continue;
          for (thread_pool* pool : {&one, &two, &three}) {
            INFO("path " << kernels::isa_name(path) << " threads " << pool->size());
            std::vector<float> y(m * rows, std::nanf(""));
            kernels::matmul(*pool, x.data(), w.view, y.data(), m, kernels::accumulate::no, kernels::products::int8);
            if (first.empty()) {
              first = y;
              for (std::size_t e = 0; e < y.size(); ++e)
                off_rounded += std::abs(y[e] - want[e]) > std::max(1e-6, 1.2e-7 * (steps + 2)) * magnitude[e] + 1e-30;
              std::vector<float> exact(m * rows);
              kernels::matmul(*pool, x.data(), w.view, exact.data(), m);
              for (std::size_t e = 0; e < y.size(); ++e)
                off_exact += std::abs(y[e] - exact[e]) > bound[e] + 1e-5 * magnitude[e] + 1e-30;
              // A row alone gives the bits it gets in the batch.
              std::vector<float> alone(rows);
              kernels::matmul(*pool, x.data() + (m - 1) * cols, w.view, alone.data(), 1, kernels::accumulate::no,
                              kernels::products::int8);
              CHECK(std::memcmp(alone.data(), y.data() + (m - 1) * rows, rows * sizeof(float)) == 0);
              // accumulate::yes adds the same sums onto what is there.
              const auto y0 = random_vector(r, m * rows);
              auto sum = y0;
              kernels::matmul(*pool, x.data(), w.view, sum.data(), m, kernels::accumulate::yes,
                              kernels::products::int8);
              std::size_t differ = 0;
              for (std::size_t e = 0; e < sum.size(); ++e) differ += sum[e] != y0[e] + y[e];
              CHECK(differ == 0);
            } else {
              CHECK(std::memcmp(first.data(), y.data(), y.size() * sizeof(float)) == 0);
            }
            if (il.data != nullptr) {
              std::vector<float> yi(m * rows, std::nanf(""));
              kernels::matmul(*pool, x.data(), il, yi.data(), m, kernels::accumulate::no, kernels::products::int8);
              CHECK(std::memcmp(first.data(), yi.data(), yi.size() * sizeof(float)) == 0);
              std::vector<float> exact(m * rows), exact_il(m * rows);
              kernels::matmul(*pool, x.data(), w.view, exact.data(), m);
              kernels::matmul(*pool, x.data(), il, exact_il.data(), m);
              CHECK(std::memcmp(exact.data(), exact_il.data(), exact.size() * sizeof(float)) == 0);
            }
          }
        }
        // Every form of the products each path takes on this CPU, not only the dispatch's: VPMADDUBSW
        // as an AVX2-only CPU runs it (and an AVX-512 CPU without VNNI, Skylake-SP, inside the AVX-512
        // path), VPDPBUSD as EVEX and, where the CPU has AVX-VNNI, as VEX.
        const std::size_t outputs = m * rows;  // (Clang 14 captures no structured binding)
        for_each_int8_form([&](kernels::isa path, kernels::int8_dot d) {
          INFO("path " << kernels::isa_name(path) << " form " << kernels::int8_dot_name(d));
          std::vector<float> y(outputs, std::nanf(""));
          int8_on(path, d, two, xq, xq32, w.view, y.data(), m);
          CHECK(std::memcmp(first.data(), y.data(), y.size() * sizeof(float)) == 0);
          if (il.data != nullptr) {
            std::vector<float> yi(outputs, std::nanf(""));
            int8_on(path, d, two, xq, xq32, il, yi.data(), m);
            CHECK(std::memcmp(first.data(), yi.data(), yi.size() * sizeof(float)) == 0);
          }
        });
        CHECK(off_rounded == 0);
        CHECK(off_exact == 0);
      }
    }
  kernels::select_isa(before);
  // Other types multiply exactly whatever is asked.
  const auto w = make_weights(r, dtype::f16, 9, 512);
  const auto x = random_vector(r, 3 * 512);
  std::vector<float> y(3 * 9);
  kernels::matmul(two, x.data(), w.view, y.data(), 3, kernels::accumulate::no, kernels::products::int8);
  CHECK(non_canonical(x, w, y, 3) == 0);
}

TEST_CASE("int8 products at the integer limits: the largest quants, scales and activations",
          "[kernels][matmul][int8]") {
  // Every quant and 6-bit scale and min at its largest (q6_k: quants 63 as stored, scales -128), and x
  // constant, so every activation rounds to -127: the AVX2 kernels' 16-bit sums of pairs are then as
  // large as they get (q4_k 8 x 3,810, q5_k 4 x 7,874, q6_k 2 x 16,002) and must not wrap.
  thread_pool two(2);
  const kernels::isa before = kernels::active_isa();
  // The types of 32-weight blocks: every quant at its largest (q4_0 15, q5_0 / q5_1 31) and q8_0's at
  // -128, whose products with -127 make the AVX2 kernels' pairs 2 x 16,256 = 32,512.
  for (const dtype t : {dtype::q4_k, dtype::q5_k, dtype::q6_k, dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1}) {
    const std::size_t rows = 41, cols = 512, rb = row_bytes(t, cols);
    std::vector<std::byte> bytes(rows * rb, t == dtype::q8_0 ? std::byte{0x80} : std::byte{0xff});
    const float xv = t == dtype::q8_0 ? -0.5f : 0.5f;
    for (std::size_t b = 0; b < rows * cols / info(t).block; ++b) {
      std::byte* blk = bytes.data() + b * info(t).bytes;
      const std::uint16_t one = f32_to_f16(1.0f);
      if (info(t).block == 32) {
        std::memcpy(blk, &one, 2);
        if (t == dtype::q5_1) std::memcpy(blk + 2, &one, 2);
      } else if (t == dtype::q6_k) {
        std::memset(blk + 192, 0x80, 16);
        std::memcpy(blk + 208, &one, 2);
      } else {
        std::memcpy(blk, &one, 2);
        std::memcpy(blk + 2, &one, 2);
      }
    }
    const kernels::weight_view w{t, rows, cols, bytes.data()};
    // Every output in double over the dequantized weights and the rounded activations (all rows and x
    // rows are alike): the reference's up to the float steps per super-block, as no integer wrapped.
    const bool per32 = info(t).block == 32;
    std::vector<kquant::block_q8_k> xq(per32 ? 0 : cols / 256);
    std::vector<kquant::block_q8_32> xq32(per32 ? cols / 32 : 0);
    const std::vector<float> x_row(cols, xv);
    for (std::size_t b = 0; b < xq.size(); ++b) kquant::quantize(x_row.data() + 256 * b, xq[b]);
    for (std::size_t b = 0; b < xq32.size(); ++b) kquant::quantize(x_row.data() + 32 * b, xq32[b]);
    CHECK((per32 ? xq32[0].qs[0] : xq[0].qs[0]) == (per32 && xv > 0 ? 127 : -127));
    std::vector<float> row(cols);
    dequantize_row(t, bytes.data(), row.data(), cols);
    double expect = 0;
    for (std::size_t k = 0; k < cols; ++k)
      expect += per32 ? static_cast<double>(row[k]) * xq32[k / 32].d * xq32[k / 32].qs[k % 32]
                      : static_cast<double>(row[k]) * xq[k / 256].d * xq[k / 256].qs[k % 256];
    for (const std::size_t m : {1, 5, 17, 40}) {
      INFO(to_string(t) << " m " << m);
      const std::vector<float> x(m * cols, xv);
      std::vector<float> want(m * rows);
      kernels::select_isa(kernels::isa::generic);
      kernels::matmul(two, x.data(), w, want.data(), m, kernels::accumulate::no, kernels::products::int8);
      CHECK(std::abs(want[0] - expect) <= 1e-6 * std::abs(expect));
      for (const kernels::isa path : {kernels::isa::avx2, kernels::isa::avx512}) {
        if (kernels::select_isa(path) != path) continue;
        INFO("path " << kernels::isa_name(path));
        std::vector<float> y(m * rows, std::nanf(""));
        kernels::matmul(two, x.data(), w, y.data(), m, kernels::accumulate::no, kernels::products::int8);
        CHECK(std::memcmp(want.data(), y.data(), y.size() * sizeof(float)) == 0);
      }
      // Every form of the products each path takes on this CPU (as above).
      std::vector<kquant::block_q8_32> xs32(m * xq32.size());
      for (std::size_t i = 0; i < xs32.size(); ++i) xs32[i] = xq32[i % xq32.size()];
      std::vector<kquant::block_q8_k> xs(m * xq.size());
      for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = xq[i % xq.size()];
      for_each_int8_form([&](kernels::isa path, kernels::int8_dot d) {
        INFO("path " << kernels::isa_name(path) << " form " << kernels::int8_dot_name(d));
        std::vector<float> y(m * rows, std::nanf(""));
        int8_on(path, d, two, xs, xs32, w, y.data(), m);
        CHECK(std::memcmp(want.data(), y.data(), y.size() * sizeof(float)) == 0);
        if (kernels::interleavable(t)) {  // the 16-bit pair sums of interleaved q4_0 and k-quants too
          std::vector<std::byte> il(bytes.size());
          kernels::interleave8(w, il.data());
          std::fill(y.begin(), y.end(), std::nanf(""));
          int8_on(path, d, two, xs, xs32, {t, rows, cols, il.data(), kernels::weight_layout::interleaved8}, y.data(), m);
          CHECK(std::memcmp(want.data(), y.data(), y.size() * sizeof(float)) == 0);
        }
      });
    }
  }
  kernels::select_isa(before);
}

TEST_CASE("typed matmul refuses rows that are not whole blocks", "[kernels][matmul]") {
  thread_pool pool(1);
  std::vector<std::byte> bytes(64);
  std::vector<float> x(48), y(1);
  CHECK_THROWS_AS(kernels::matmul(pool, x.data(), kernels::weight_view{dtype::q8_0, 1, 48, bytes.data()}, y.data(), 1),
                  efim::error);
  // Interleaved rows exist for q8_0, q4_0 and the k-quants only.
  std::vector<std::byte> q5(22 * 8), out(q5.size());
  const kernels::weight_view q5_rows{dtype::q5_0, 8, 32, q5.data()};
  CHECK_THROWS_AS(kernels::interleave8(q5_rows, out.data()), efim::error);
  std::vector<float> x32(32), y8(8);
  for (const auto p : {kernels::products::exact, kernels::products::int8})
    CHECK_THROWS_AS(kernels::matmul(pool, x32.data(), {dtype::q5_0, 8, 32, q5.data(), kernels::weight_layout::interleaved8},
                                    y8.data(), 1, kernels::accumulate::no, p),
                    efim::error);
}

TEST_CASE("rmsnorm, rope and swiglu match their definitions", "[kernels]") {
  rng r(2);
  const std::size_t n = 40;
  const auto x = random_vector(r, 2 * n), g = random_vector(r, n);
  std::vector<float> y(2 * n);
  kernels::rmsnorm(x.data(), g.data(), y.data(), 2, n, 1e-5f);
  for (std::size_t row = 0; row < 2; ++row) {
    double ss = 0;
    for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[row * n + i]) * x[row * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (std::size_t i = 0; i < n; ++i) CHECK(y[row * n + i] == Approx(x[row * n + i] * inv * g[i]).epsilon(1e-5));
  }

  // RoPE rotates each pair by pos * theta^(-2i/d); the two layouts pair different elements.
  const std::size_t d = 8;
  const std::vector<position> pos{0, 3};
  std::vector<float> cs(2 * d / 2), sn(2 * d / 2);
  kernels::rope_table(pos, d, 10000.0, cs.data(), sn.data());
  for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox}) {
    auto v = random_vector(r, 2 * d);
    const auto orig = v;
    kernels::rope(v.data(), 2, 1, d, cs.data(), sn.data(), style);
    for (std::size_t i = 0; i < d / 2; ++i) {
      const std::size_t a = style == kernels::rope_style::adjacent ? 2 * i : i;
      const std::size_t b = style == kernels::rope_style::adjacent ? 2 * i + 1 : i + d / 2;
      CHECK(v[a] == orig[a]);  // position 0 is not rotated
      const double angle = 3.0 * std::pow(10000.0, -2.0 * i / d);
      CHECK(v[d + a] == Approx(orig[d + a] * std::cos(angle) - orig[d + b] * std::sin(angle)).margin(1e-6));
      CHECK(v[d + b] == Approx(orig[d + a] * std::sin(angle) + orig[d + b] * std::cos(angle)).margin(1e-6));
    }
  }

  const std::vector<float> gate{-2.0f, 0.0f, 3.0f}, up{1.0f, 5.0f, -1.0f};
  std::vector<float> h(3);
  kernels::swiglu(gate.data(), up.data(), h.data(), 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(h[i] == Approx(gate[i] / (1 + std::exp(-gate[i])) * up[i]));
}

TEST_CASE("exp16 matches std::exp over the softmax range", "[kernels]") {
  double worst = 0;
  for (float x0 = -90.0f; x0 < 1.0f; x0 += 0.37f) {
    float v[16];
    for (int i = 0; i < 16; ++i) v[i] = x0 + 0.0231f * static_cast<float>(i);
    float e[16];
    std::copy(v, v + 16, e);
    kernels::detail::exp16(e);
    for (int i = 0; i < 16; ++i) {
      if (v[i] < -87.3f) continue;  // clamped
      const double want = std::exp(static_cast<double>(v[i]));
      worst = std::max(worst, std::abs(e[i] - want) / want);
    }
  }
  CHECK(worst < 3e-7);
  float zero[16] = {};
  kernels::detail::exp16(zero);
  CHECK(zero[0] == 1.0f);
}

TEST_CASE("sampling: greedy, top-k, top-p and seeded draws", "[kernels][sampling]") {
  const std::vector<float> logits{1.0f, 3.0f, 3.0f, 0.5f, 2.0f};
  CHECK(kernels::argmax(logits) == 1);  // lowest id among ties
  std::vector<std::pair<float, token_id>> scratch;
  CHECK(kernels::sample(logits, 0.0f, 0, 1.0f, 0.99, scratch) == 1);
  CHECK(kernels::sample(logits, 1.0f, 1, 1.0f, 0.99, scratch) == 1);   // top-1 is greedy
  CHECK(kernels::sample(logits, 1.0f, 0, 0.01f, 0.99, scratch) == 1);  // tiny nucleus keeps the top token
  for (const double u : {0.0, 0.3, 0.6, 0.9999}) {
    const token_id t = kernels::sample(logits, 1.0f, 3, 1.0f, u, scratch);
    CHECK((t == 1 || t == 2 || t == 4));  // top-3
  }
  // Frequencies follow softmax(logits / T).
  rng r(5);
  std::vector<int> counts(logits.size());
  const int draws = 40000;
  for (int i = 0; i < draws; ++i)
    ++counts[static_cast<std::size_t>(kernels::sample(logits, 0.7f, 0, 1.0f, r.uniform(), scratch))];
  double z = 0;
  for (const float l : logits) z += std::exp(l / 0.7);
  for (std::size_t i = 0; i < logits.size(); ++i)
    CHECK(counts[i] / static_cast<double>(draws) == Approx(std::exp(logits[i] / 0.7) / z).margin(0.01));
}

TEST_CASE("paged attention equals dense attention for random block tables", "[kernels][attention]") {
  thread_pool pool(2);
  rng r(3);
  // (heads, KV heads, block size, head size): grouped, one KV head per query head, groups larger than a
  // tile of 8 rows, and head sizes of no whole vector, of 4 vectors (the models'), and of 8 and a half;
  // tiles of 1 to 8 rows and blocks of 1 to 32 slots, which the AVX2 path splits differently.
  for (const auto& [heads, kv_heads, block_size, d] :
       {std::tuple<std::size_t, std::size_t, std::size_t, std::size_t>{4, 2, 1, 12},
        {4, 2, 3, 12},
        {4, 2, 16, 12},
        {3, 3, 16, 12},
        {12, 1, 16, 12},
        {24, 2, 5, 12},
        {12, 2, 16, 64},
        {8, 8, 16, 64},
        {4, 1, 7, 136},
        {4, 2, 8, 12},      // blocks of one 8-slot vector (AVX2)
        {5, 1, 24, 20},     // tiles of 5 rows; blocks of 16 + 8 slots
        {6, 2, 32, 40}}) {  // groups of 3 rows; two 16-slot steps per block
    const std::size_t len = 37;
    const std::size_t blocks_needed = (len + block_size - 1) / block_size;
    const kv::paged_layout layout{blocks_needed + 5, kv_heads, block_size, d};
    // Dense K/V (position, kv_head, dim) and queries for every position.
    const auto k = random_vector(r, len * kv_heads * d), v = random_vector(r, len * kv_heads * d);
    const auto q = random_vector(r, len * heads * d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    std::vector<float> want(len * heads * d, 0.0f);
    for (std::size_t t = 0; t < len; ++t)
      for (std::size_t h = 0; h < heads; ++h) {
        const std::size_t g = h / (heads / kv_heads);
        std::vector<double> p(t + 1);
        double top = -1e30, z = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          double s = 0;
          for (std::size_t i = 0; i < d; ++i)
            s += static_cast<double>(q[(t * heads + h) * d + i]) * k[(j * kv_heads + g) * d + i];
          p[j] = s * scale;
          top = std::max(top, p[j]);
        }
        for (auto& x : p) z += x = std::exp(x - top);
        for (std::size_t j = 0; j <= t; ++j)
          for (std::size_t i = 0; i < d; ++i)
            want[(t * heads + h) * d + i] += static_cast<float>(p[j] / z * v[(j * kv_heads + g) * d + i]);
      }

    const std::size_t n_heads = heads, head_dim = d;  // (clang before 16: no lambda captures a binding)
    const auto run = [&]<class E>(const std::vector<block_id>& table, E) {
      std::vector<E> kc(layout.elements()), vc(layout.elements());
      std::vector<float> out(len * n_heads * head_dim);
      std::vector<kernels::token_slot> slots(len);
      for (std::size_t t = 0; t < len; ++t) slots[t] = {table, static_cast<position>(t)};
      kernels::kv_write(layout, kc.data(), vc.data(), k.data(), v.data(), slots);
      kernels::paged_attention(pool, layout, kc.data(), vc.data(), q.data(), out.data(), slots, n_heads, scale);
      return out;
    };
    std::vector<block_id> identity(layout.blocks);
    std::iota(identity.begin(), identity.end(), block_id{0});
    const auto in_order = run(identity, 0.0f);
    const auto in_order_f16 = run(identity, half{});
    CHECK(max_relative_error(in_order, want) < 1e-5f);
    CHECK(max_relative_error(in_order_f16, want) < 3e-3f);  // K and V rounded to 11 significant bits
    for (int trial = 0; trial < 3; ++trial) {
      auto shuffled = identity;
      for (std::size_t i = shuffled.size(); i > 1; --i) std::swap(shuffled[i - 1], shuffled[r.below(i)]);
      CHECK(run(shuffled, 0.0f) == in_order);  // bit-identical wherever the blocks lie
      CHECK(run(shuffled, half{}) == in_order_f16);
    }
    // The AVX2 and AVX-512 paths (where the CPU has them) give the active path's bits.
    const kernels::isa before = kernels::active_isa();
    for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2})
      if (before != kernels::isa::generic && kernels::select_isa(path) == path) {
        INFO("path " << kernels::isa_name(path) << " against " << kernels::isa_name(before));
        CHECK(run(identity, 0.0f) == in_order);
        CHECK(run(identity, half{}) == in_order_f16);
      }
    kernels::select_isa(before);
  }
}

TEST_CASE("paged attention refuses head counts that do not group over the KV heads", "[kernels][attention]") {
  thread_pool pool(1);
  const std::size_t d = 4;
  for (const auto& [heads, kv_heads] : {std::pair<std::size_t, std::size_t>{6, 4}, {3, 4}, {4, 0}}) {
    const kv::paged_layout layout{2, kv_heads, 4, d};
    std::vector<float> kc(layout.elements(), 0.1f), vc(layout.elements(), 0.1f);
    const std::vector<block_id> table{0};
    const std::vector<kernels::token_slot> slots{{table, 0}};
    std::vector<float> q(heads * d, 1.0f), out(heads * d, 0.0f);
    CHECK_THROWS_WITH(
        kernels::paged_attention(pool, layout, kc.data(), vc.data(), q.data(), out.data(), slots, heads, 0.5f),
        Catch::Contains("do not split into groups"));
  }
}

TEST_CASE("transformer equals the reference decoder", "[model]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(4);
  for (const auto hidden : {64u, 48u}) {
    for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox}) {
      auto cfg = small_config(hidden);
      cfg.rope = style;
      const auto w = model::random_weights(cfg, 11);
      model::transformer<kernels::host> m(w);
      kv::host_storage kv(cfg.layers, m.kv_layout(8, 8));
      const auto tokens = random_tokens(r, 40, cfg.vocab);
      const std::vector<block_id> table{5, 1, 7, 0, 2};
      const auto want = model::reference_forward(w, tokens);
      std::vector<std::size_t> ones(40, 1);  // token by token: logits at every position
      const auto got = run_chunks(m, ctx, kv, tokens, table, ones);
      for (std::size_t t = 0; t < tokens.size(); ++t)
        CHECK(max_relative_error(got[t], reference_row(want, t, cfg.vocab)) < 1e-4f);
      // Logits are not degenerate: a spread of values, not one-hot.
      const auto [lo, hi] = std::minmax_element(got.back().begin(), got.back().end());
      CHECK(*hi - *lo > 1.0f);
      CHECK(*hi - *lo < 50.0f);
    }
  }
}

TEST_CASE("chunked prefill equals one-shot prefill", "[model]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(5);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 12);
  model::transformer<kernels::host> m(w);
  const auto tokens = random_tokens(r, 61, cfg.vocab);
  const std::vector<block_id> table{3, 0, 6, 1, 4, 2, 5, 7};
  kv::host_storage kv_a(cfg.layers, m.kv_layout(8, 8)), kv_b(cfg.layers, m.kv_layout(8, 8));
  const auto one_shot = run_chunks(m, ctx, kv_a, tokens, table, {61});
  const auto chunked = run_chunks(m, ctx, kv_b, tokens, table, {7, 1, 16, 20, 17});
  CHECK(max_relative_error(chunked.back(), one_shot.back()) < 1e-5f);
  CHECK(chunked.back() == one_shot.back());  // the same operations in the same order: the same bits
}

TEST_CASE("logits after a cache hit equal logits recomputed from scratch", "[model][cache]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(6);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 13);
  model::transformer<kernels::host> m(w);
  kv::host_storage kv(cfg.layers, m.kv_layout(16, 4));
  // First request: 20 tokens in blocks 9, 3, 12, 0, 5.
  auto tokens = random_tokens(r, 20, cfg.vocab);
  run_chunks(m, ctx, kv, tokens, {9, 3, 12, 0, 5}, {20});
  // Second request shares the first 16 tokens (4 full blocks), then differs.
  auto second = std::vector<token_id>(tokens.begin(), tokens.begin() + 16);
  const auto tail = random_tokens(r, 11, cfg.vocab);
  second.insert(second.end(), tail.begin(), tail.end());
  const std::vector<block_id> hit_table{9, 3, 12, 0, 7, 8, 10};
  const auto reused = run_chunks(m, ctx, kv, second, hit_table, {11}, 16);

  kv::host_storage fresh(cfg.layers, m.kv_layout(16, 4));
  const auto scratch = run_chunks(m, ctx, fresh, second, {1, 2, 4, 6, 11, 13, 14}, {27});
  CHECK(reused.back() == scratch.back());
  const auto want = model::reference_forward(w, second);
  CHECK(max_relative_error(reused.back(), reference_row(want, 26, cfg.vocab)) < 1e-4f);
}

TEST_CASE("a batch of several sequences equals each sequence alone, on any thread count", "[model]") {
  rng r(7);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 14);
  const auto a = random_tokens(r, 23, cfg.vocab), b = random_tokens(r, 9, cfg.vocab);
  const std::vector<block_id> ta{0, 1, 2}, tb{3, 4};

  thread_pool one(1), two(2);
  kernels::host::context c1{one}, c2{two};
  model::transformer<kernels::host> m(w);
  kv::host_storage kv_alone(cfg.layers, m.kv_layout(8, 8)), kv_batch(cfg.layers, m.kv_layout(8, 8));
  const auto alone_a = run_chunks(m, c1, kv_alone, a, ta, {23});
  const auto alone_b = run_chunks(m, c1, kv_alone, b, tb, {9});
  const model::batch_item items[] = {{a, 0, ta, true}, {b, 0, tb, true}};
  std::vector<float> logits;
  m.forward(c2, kv_batch, items, logits);
  REQUIRE(logits.size() == 2 * cfg.vocab);
  CHECK(std::equal(alone_a.back().begin(), alone_a.back().end(), logits.begin()));
  CHECK(std::equal(alone_b.back().begin(), alone_b.back().end(),
                   logits.begin() + static_cast<std::ptrdiff_t>(cfg.vocab)));
}

TEST_CASE("model input errors are reported, not crashed on", "[model]") {
  thread_pool pool(1);
  kernels::host::context ctx{pool};
  auto cfg = small_config();
  const auto w = model::random_weights(cfg, 15);
  model::transformer<kernels::host> m(w);
  kv::host_storage kv(cfg.layers, m.kv_layout(4, 4));
  std::vector<float> logits;
  const std::vector<token_id> bad{1, 2, 50};
  const std::vector<block_id> table{0};
  const model::batch_item unknown{bad, 0, table, true};
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&unknown, 1), logits), efim::error);
  const std::vector<token_id> five{1, 2, 3, 4, 5};
  const model::batch_item uncovered{five, 0, table, true};  // 5 tokens, one block of 4
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&uncovered, 1), logits), efim::error);
  const model::batch_item past_context{five, 254, table, true};
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&past_context, 1), logits), efim::error);
  kv::host_storage wrong(cfg.layers + 1, m.kv_layout(4, 4));
  const model::batch_item fine{std::span(five).first(3), 0, table, true};
  CHECK_THROWS_AS(m.forward(ctx, wrong, std::span(&fine, 1), logits), efim::error);
  cfg.heads = 3;  // 64 is not a multiple of 3
  CHECK_THROWS_AS(model::random_weights(cfg, 1), efim::error);
  CHECK_THROWS_AS(kv::host_storage(1, kv::paged_layout{0, 1, 1, 1}), efim::error);
}

// ---- architectures, weight types, KV types, model files --------------------------------------------

namespace {
// A small model of each architecture; hidden and FFN are whole q8_0/q4_0 blocks.
// Small enough to run every combination; wide enough for whole blocks of `weights` (super-blocks of
// 256 for the k-quants).
model::config arch_config(model::architecture a, std::size_t vocab = 300, dtype weights = dtype::f32) {
  auto c = model::for_architecture(a);
  c.vocab = vocab;
  c.hidden = info(weights).block == 256 ? 256 : 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = info(weights).block == 256 ? 256 : 96;
  c.max_context = 512;
  c.rope_theta = a == model::architecture::llama ? 10000.0 : 1e6;
  c.norm_eps = a == model::architecture::starcoder2 ? 1e-5f : 1e-6f;
  return c;
}

constexpr model::architecture all_architectures[] = {model::architecture::llama, model::architecture::qwen2,
                                                     model::architecture::starcoder2};

std::string describe(const model::config& c, dtype weights, dtype kv) {
  return std::string(model::to_string(c.arch)) + " weights " + std::string(to_string(weights)) + " kv " +
         std::string(to_string(kv));
}

// The probability of the most likely token.
float top_probability(const std::vector<float>& logits) {
  const float top = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (const float l : logits) z += std::exp(static_cast<double>(l - top));
  return static_cast<float>(1.0 / z);
}
}  // namespace

TEST_CASE("every architecture, weight type and KV type equals the reference decoder", "[model][arch]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(40);
  for (const auto arch : all_architectures)
    for (const dtype wt : all_dtypes)
      for (const dtype kvt : {dtype::f32, dtype::f16}) {
        INFO(describe(arch_config(arch), wt, kvt));
        const auto cfg = arch_config(arch, 300, wt);
        const auto w = model::random_weights(cfg, 41, {wt, arch == model::architecture::qwen2});
        CHECK(w.type() == wt);
        model::transformer<kernels::host> m(w);
        kv::host_storage kv(cfg.layers, m.kv_layout(8, 8), kvt);
        const auto tokens = random_tokens(r, 30, cfg.vocab);
        const std::vector<block_id> table{5, 1, 7, 0};
        const auto want = model::reference_forward(w, tokens, kvt);
        // Prefill 11, then token by token: logits at positions 10..29.
        std::vector<std::size_t> chunks{11};
        chunks.resize(20, 1);
        const auto got = run_chunks(m, ctx, kv, tokens, table, chunks);
        // With K/V stored in f16 both paths round them, and a last-bit difference before rounding can
        // become one f16 step (5e-4) after it, so f16 KV gets a wider bound than f32 KV.
        const float bound = kvt == dtype::f32 ? 1e-4f : 1e-3f;
        for (std::size_t i = 0; i < got.size(); ++i)
          CHECK(max_relative_error(got[i], reference_row(want, 10 + i, cfg.vocab)) < bound);
        // Not degenerate: the most likely token is neither certain nor lost in a flat distribution.
        const float p = top_probability(got.back());
        CHECK(p > 2.0f / static_cast<float>(cfg.vocab));
        CHECK(p < 0.99f);
      }
}

namespace {
// One shot on one thread against chunks on two threads in a batch with another sequence, and a cache
// hit against the same tokens computed from scratch: the same bits. Returns the one-shot logits.
std::vector<float> check_cached_chunked_batched(model::architecture arch, dtype wt, dtype kvt, rng& r,
                                                kernels::products products,
                                                kernels::weight_layout layout = kernels::weight_layout::interleaved8) {
  thread_pool one(1), two(2);
  kernels::host::context c1{one}, c2{two};
  const auto cfg = arch_config(arch, 300, wt);
  const auto w = model::random_weights(cfg, 43, {wt});
  model::transformer<kernels::host> m(w, products, layout);
  const auto tokens = random_tokens(r, 45, cfg.vocab);
  const auto other = random_tokens(r, 13, cfg.vocab);
  // One shot, in one order of blocks, on one thread.
  kv::host_storage kv_a(cfg.layers, m.kv_layout(16, 4), kvt);
  const auto one_shot = run_chunks(m, c1, kv_a, tokens, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {45});
  // Chunked, blocks elsewhere, two threads, in a batch with another sequence.
  kv::host_storage kv_b(cfg.layers, m.kv_layout(16, 4), kvt);
  const std::vector<block_id> table{15, 3, 9, 12, 0, 7, 1, 14, 2, 8, 4, 6}, other_table{5, 10, 11, 13};
  run_chunks(m, c2, kv_b, tokens, table, {16, 5, 3}, 0);  // positions 0..23
  const std::span<const token_id> rest = std::span(tokens).subspan(24);
  const model::batch_item items[] = {{other, 0, other_table, true}, {rest, 24, table, true}};
  std::vector<float> logits;
  m.forward(c2, kv_b, items, logits);
  CHECK(std::equal(one_shot.back().begin(), one_shot.back().end(),
                   logits.begin() + static_cast<std::ptrdiff_t>(cfg.vocab)));
  // A cache hit: the first 20 positions (5 blocks) reused by a sequence that goes on differently.
  auto second = std::vector<token_id>(tokens.begin(), tokens.begin() + 20);
  second.insert(second.end(), other.begin(), other.end());
  const std::vector<block_id> hit_table{15, 3, 9, 12, 0, 5, 10, 11, 13};
  const auto reused = run_chunks(m, c2, kv_b, second, hit_table, {13}, 20);
  kv::host_storage fresh(cfg.layers, m.kv_layout(16, 4), kvt);
  const auto scratch = run_chunks(m, c1, fresh, second, {0, 1, 2, 3, 4, 5, 6, 7, 8}, {33});
  CHECK(reused.back() == scratch.back());
  return one_shot.back();
}
}  // namespace

TEST_CASE("cached, chunked and batched computation give the same bits for every architecture and type",
          "[model][arch][cache]") {
  rng r(42);
  for (const auto arch : all_architectures)
    for (const dtype wt : all_dtypes)
      for (const dtype kvt : {dtype::f32, dtype::f16}) {
        INFO(describe(arch_config(arch), wt, kvt));
        check_cached_chunked_batched(arch, wt, kvt, r, kernels::products::exact);
      }
}

TEST_CASE("f16 and bf16 matrices interleaved give the model the bits of the rows as stored",
          "[model][arch][cache][interleave]") {
  // The AVX-512 path reads f16 and bf16 matrices with 8 rows interleaved where the model makes them
  // (kernels::interleave_floats_by_default: not on AMD CPUs); forced on here, on any CPU whose path reads
  // them, and off, the logits of every step, chunk and batch agree to the bit.
  if (!kernels::reads_interleaved_floats(kernels::active_isa())) {
    WARN("the active path (" << kernels::isa_name(kernels::active_isa()) << ") puts interleaved rows back in order");
    return;
  }
  const int before = kernels::select_interleave_floats(1);
  for (const dtype wt : {dtype::f16, dtype::bf16}) {
    const auto w = model::random_weights(arch_config(model::architecture::qwen2, 300, wt), 43, {wt});
    CHECK(model::transformer<kernels::host>(w).interleaved_matrices() == 7 * 2 + 1);  // each layer's 7, the output
    CHECK(model::transformer<kernels::host>(w, kernels::products::exact, kernels::weight_layout::rows)
              .interleaved_matrices() == 0);
    kernels::select_interleave_floats(0);
    CHECK(model::transformer<kernels::host>(w).interleaved_matrices() == 0);
    kernels::select_interleave_floats(1);
    for (const dtype kvt : {dtype::f32, dtype::f16}) {
      INFO(describe(arch_config(model::architecture::qwen2), wt, kvt));
      rng r1(46), r2(46);
      const auto interleaved =
          check_cached_chunked_batched(model::architecture::qwen2, wt, kvt, r1, kernels::products::exact);
      kernels::select_interleave_floats(0);
      const auto rows = check_cached_chunked_batched(model::architecture::qwen2, wt, kvt, r2, kernels::products::exact,
                                                     kernels::weight_layout::interleaved8);
      kernels::select_interleave_floats(1);
      CHECK(interleaved == rows);
    }
  }
  kernels::select_interleave_floats(before);
}

TEST_CASE("int8 products: cached, chunked and batched computation give the same bits, near the exact logits",
          "[model][arch][cache][int8]") {
  for (const auto arch : all_architectures)
    for (const dtype wt : {dtype::q4_k, dtype::q5_k, dtype::q6_k, dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1}) {
      INFO(describe(arch_config(arch), wt, dtype::f16));
      rng r1(45), r2(45), r3(45);
      const auto int8 = check_cached_chunked_batched(arch, wt, dtype::f16, r1, kernels::products::int8);
      const auto exact = check_cached_chunked_batched(arch, wt, dtype::f16, r2, kernels::products::exact);
      // q8_0, q4_0 and the k-quants read interleaved by default (decode streams them, prefill packs their blocks): the
      // same bits as the rows as stored (one architecture: the products are the same for all).
      if (kernels::interleavable(wt) && arch == model::architecture::qwen2)
        CHECK(int8 == check_cached_chunked_batched(arch, wt, dtype::f16, r3, kernels::products::int8,
                                                   kernels::weight_layout::rows));
      // Activations rounded to 8 bits per 256 (per 32) move the logits by about a percent, not more.
      const float err = max_relative_error(int8, exact);
      CHECK(err > 0);
      CHECK(err < 0.05f);
    }
}

TEST_CASE("every instruction-set path with FMA gives the same logits, bit for bit", "[model][arch][isa]") {
  // AVX-512 and AVX2 (and the generic path where the compiler flags have FMA) fuse every multiply-add
  // and sum in one order, so a whole model's logits agree to the bit: prefill, chunks and decode steps.
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  const kernels::isa before = kernels::active_isa();
  std::vector<kernels::isa> paths;
  for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2, kernels::isa::generic})
    if (kernels::select_isa(path) == path) paths.push_back(path);
#if !(defined(__FMA__) || defined(__ARM_FEATURE_FMA))
  std::erase(paths, kernels::isa::generic);  // products and sums rounded apart: bits of its own
#endif
  rng r(7);
  for (const auto arch : all_architectures)
    for (const dtype wt : all_dtypes)
      for (const dtype kvt : {dtype::f32, dtype::f16}) {
        INFO(describe(arch_config(arch), wt, kvt));
        const auto cfg = arch_config(arch, 300, wt);
        const auto w = model::random_weights(cfg, 44, {wt});
        model::transformer<kernels::host> m(w);
        const auto tokens = random_tokens(r, 40, cfg.vocab);
        std::vector<std::vector<std::vector<float>>> runs;
        for (const kernels::isa path : paths) {
          kernels::select_isa(path);
          kv::host_storage kv(cfg.layers, m.kv_layout(3, 16), kvt);
          runs.push_back(run_chunks(m, ctx, kv, tokens, {2, 0, 1}, {29, 9, 1, 1}));
        }
        for (std::size_t i = 1; i < runs.size(); ++i) {
          INFO(kernels::isa_name(paths[i]) << " against " << kernels::isa_name(paths[0]));
          CHECK(runs[i] == runs[0]);
        }
      }
  kernels::select_isa(before);
  // What this CPU and build have to compare: AVX-512 and AVX2 on an AVX-512 CPU, AVX2 on an AVX2 one
  // (Zen 3, say), and the generic path where the flags have FMA.
  const kernels::isa cpu = kernels::detected_isa();
  std::size_t expected = cpu == kernels::isa::avx512 ? 2 : cpu == kernels::isa::avx2 ? 1 : 0;
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  ++expected;
#endif
  CHECK(paths.size() >= std::max<std::size_t>(expected, 1));
}

TEST_CASE("greedy completions are reproducible and match the reference path", "[model][arch]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(44);
  for (const auto arch : all_architectures)
    for (const dtype wt : {dtype::f16, dtype::q8_0}) {
      INFO(describe(arch_config(arch), wt, dtype::f32));
      const auto cfg = arch_config(arch);
      const auto w = model::random_weights(cfg, 45, {wt});
      model::transformer<kernels::host> m(w);
      const auto prompt = random_tokens(r, 17, cfg.vocab);
      const std::vector<block_id> table{0, 1, 2, 3, 4, 5, 6, 7};
      const auto generate = [&] {
        kv::host_storage kv(cfg.layers, m.kv_layout(8, 8));
        std::vector<token_id> seq = prompt;
        std::vector<float> logits;
        model::batch_item item{seq, 0, table, true};
        for (int i = 0; i < 24; ++i) {
          m.forward(ctx, kv, std::span(&item, 1), logits);
          const token_id next = kernels::argmax(logits);
          const auto start = static_cast<std::size_t>(item.start) + item.tokens.size();
          seq.push_back(next);
          item = {std::span(seq).subspan(start), static_cast<position>(start), table, true};
        }
        return std::vector<token_id>(seq.begin() + 17, seq.end());
      };
      const auto first = generate();
      CHECK(generate() == first);
      // The reference decoder, token by token, picks the same tokens (its logits differ only in rounding,
      // and a random model's top two logits are rarely within 1e-4 of each other).
      model::reference_model ref(w);
      auto logits = ref.forward(prompt);
      std::vector<token_id> want;
      for (int i = 0; i < 24; ++i) {
        const token_id next = kernels::argmax(std::span(logits).subspan(logits.size() - cfg.vocab));
        want.push_back(next);
        logits = ref.forward(std::span(&want.back(), 1));
      }
      CHECK(first == want);
      // Not stuck on one token.
      CHECK(std::set<token_id>(first.begin(), first.end()).size() > 3);
    }
}

TEST_CASE("a model file written and read back computes the same logits", "[model][gguf]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(46);
  const auto dir = std::filesystem::temp_directory_path() / ("efim_model_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const auto arch : all_architectures) {
    auto cfg = arch_config(arch);
    if (arch == model::architecture::llama) cfg.rope_scale = 4.0;  // DeepSeek-Coder's linear RoPE scaling
    const model::random_spec spec{dtype::q8_0, arch != model::architecture::llama};
    const auto path = (dir / (std::string(model::to_string(arch)) + ".gguf")).string();
    model::write_file(path, model::random_model(cfg, 47, spec));
    const auto file = model::open_model(path);
    CHECK(model::open_model(path, gguf::residency::read).fingerprint == file.fingerprint);
    const auto read = file.cfg();
    CHECK(read.arch == cfg.arch);
    CHECK(read.vocab == cfg.vocab);
    CHECK(read.hidden == cfg.hidden);
    CHECK(read.layers == cfg.layers);
    CHECK(read.heads == cfg.heads);
    CHECK(read.kv_heads == cfg.kv_heads);
    CHECK(read.ffn == cfg.ffn);
    CHECK(read.max_context == cfg.max_context);
    CHECK(read.rope_theta == cfg.rope_theta);
    CHECK(read.rope_scale == cfg.rope_scale);
    CHECK(read.norm_eps == cfg.norm_eps);
    CHECK(read.rope == cfg.rope);
    CHECK(read.norm == cfg.norm);
    CHECK(read.mlp == cfg.mlp);
    const auto from_file = file.bind();
    const auto in_memory = model::random_weights(cfg, 47, spec);
    CHECK(from_file.fingerprint == in_memory.fingerprint);
    CHECK(from_file.tied() == spec.tied);
    CHECK(from_file.fingerprint != model::random_weights(cfg, 48, spec).fingerprint);
    const auto tokens = random_tokens(r, 20, cfg.vocab);
    const auto logits = [&](const model::weights& w) {
      model::transformer<kernels::host> m(w);
      kv::host_storage kv(cfg.layers, m.kv_layout(4, 8));
      return run_chunks(m, ctx, kv, tokens, {0, 1, 2, 3}, {20}).back();
    };
    CHECK(logits(from_file) == logits(in_memory));
  }
  std::filesystem::remove_all(dir);
}

namespace {
// GGUF bytes of a tiny llama model whose tensors `edit` may change (rename, reshape, retype) first.
template <class Edit>
std::vector<std::byte> edited_model(Edit edit, model::metadata meta = {}) {
  const auto cfg = arch_config(model::architecture::llama, 40);
  const auto good = model::random_model(cfg, 1);
  const auto f = gguf::parse(good);
  if (meta.empty()) meta = model::config_metadata(cfg);
  std::vector<gguf::tensor_data> tensors;
  for (const auto& t : f.tensors)
    tensors.push_back({t.name, t.shape, t.type,
                       std::span(good).subspan(static_cast<std::size_t>(f.data_offset + t.offset), t.bytes)});
  edit(tensors);
  return gguf::serialize(meta, tensors);
}

gguf::tensor_data& named(std::vector<gguf::tensor_data>& ts, std::string_view name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  FAIL("no tensor " << name);
  return ts.front();
}
}  // namespace

TEST_CASE("a model file with a wrong tensor shape, type, name or offset gives a clear error", "[model][gguf]") {
  const auto bind = [](std::vector<std::byte> bytes) { return model::open_model(std::move(bytes)).bind(); };
  CHECK_NOTHROW(bind(edited_model([](auto&) {})));
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) {
                      named(ts, "blk.1.attn_q.weight").shape = {32, 128};
                    })),
                    Catch::Contains("'blk.1.attn_q.weight' has shape [32, 128], expected [64, 64]"));
  CHECK_THROWS_WITH(
      bind(edited_model([](auto& ts) { std::erase_if(ts, [](auto& t) { return t.name == "blk.0.ffn_up.weight"; }); })),
      Catch::Contains("'blk.0.ffn_up.weight' is missing"));
  // A norm bias of an RMSNorm model (llama.cpp refuses it too), and a tensor named twice.
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) {
                      auto extra = named(ts, "output_norm.weight");
                      extra.name = "output_norm.bias";
                      ts.push_back(extra);
                    })),
                    Catch::Contains("'output_norm.bias' is not part of the llama architecture"));
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) { ts.push_back(named(ts, "output_norm.weight")); })),
                    Catch::Contains("'output_norm.weight' appears twice"));
  // A tensor this decoder would not use (Llama 3's RoPE frequency factors) must not be ignored silently.
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) {
                      auto extra = named(ts, "output_norm.weight");
                      extra.name = "rope_freqs.weight";
                      extra.shape = {16};
                      extra.data = extra.data.first(64);
                      ts.push_back(extra);
                    })),
                    Catch::Contains("'rope_freqs.weight' is not part of the llama architecture"));
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) { named(ts, "output.weight").type = 16; })),  // IQ2_XXS
                    Catch::Contains("'output.weight' has ggml type 16, which is not supported"));
  // The same bytes said to be f16 of twice the rows: the shape no longer fits the model.
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) {
                      auto& t = named(ts, "blk.0.attn_k.weight");
                      t.type = 1;
                      t.shape = {64, 64};
                    })),
                    Catch::Contains("'blk.0.attn_k.weight' has shape [64, 64], expected [64, 32]"));
  auto bytes = edited_model([](auto&) {});
  const auto f = gguf::parse(bytes);
  // Truncated inside the tensor data.
  CHECK_THROWS_WITH(bind(std::vector<std::byte>(bytes.begin(), bytes.end() - 100)), Catch::Contains("past the end"));
  // A tensor offset moved past the end, or off its alignment.
  {
    auto moved = bytes;
    const char entry[] = "\x0d\0\0\0\0\0\0\0output.weight";  // the name's length, then the name
    const auto at = std::search(moved.begin(), moved.end(), reinterpret_cast<const std::byte*>(entry),
                                reinterpret_cast<const std::byte*>(entry) + sizeof entry - 1);
    REQUIRE(at != moved.end());
    const auto offset_at = static_cast<std::size_t>(at - moved.begin()) + sizeof entry - 1 + 4 + 2 * 8 + 4;
    std::uint64_t offset = 0;
    std::memcpy(&offset, moved.data() + offset_at, 8);
    CHECK(offset == f.tensors.back().offset);
    for (const std::uint64_t bad : {offset + 1, std::uint64_t{1} << 40}) {
      auto copy = moved;
      std::memcpy(copy.data() + offset_at, &bad, 8);
      CHECK_THROWS_WITH(bind(copy), Catch::Contains("output.weight"));
    }
  }
  // Metadata: an unknown architecture, a missing key, an unsupported RoPE scaling, a vector stored quantized.
  auto meta = model::config_metadata(arch_config(model::architecture::llama, 40));
  auto other = meta;
  other["general.architecture"] = gguf::make_string("gpt2");
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("'gpt2' is not supported"));
  other = meta;
  other.erase("llama.block_count");
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("llama.block_count"));
  // A scaling factor without a type is linear scaling, as llama.cpp reads it; "none" ignores the factor.
  other = meta;
  other["llama.rope.scaling.factor"] = gguf::make_f32(4.0f);
  CHECK(model::read_config(gguf::parse(edited_model([](auto&) {}, other))).rope_scale == 4.0);
  other["llama.rope.scaling.type"] = gguf::make_string("none");
  CHECK(model::read_config(gguf::parse(edited_model([](auto&) {}, other))).rope_scale == 1.0);
  other = meta;
  other["llama.rope.scaling.type"] = gguf::make_string("yarn");
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("RoPE scaling 'yarn' is not supported"));
  // Dimensions whose products would overflow, and values that are not finite.
  other = meta;
  other["llama.attention.head_count"] = gguf::value{gguf::value_type::u64, std::uint64_t{824632147971}};
  other["llama.attention.head_count_kv"] = gguf::value{gguf::value_type::u64, std::uint64_t{824632147971}};
  other["llama.attention.key_length"] = gguf::make_u32(22369664);
  CHECK_THROWS_AS(bind(edited_model([](auto&) {}, other)), efim::error);
  other = meta;
  other["llama.attention.head_count"] = gguf::make_u32(1u << 30);
  other["llama.attention.key_length"] = gguf::make_u32(1u << 30);
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("implausibly large"));
  other = meta;
  other["llama.attention.layer_norm_rms_epsilon"] = gguf::value{gguf::value_type::f64, 1e300};
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("finite"));
  other = meta;
  other["llama.rope.freq_base"] = gguf::make_f32(std::numeric_limits<float>::quiet_NaN());
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("finite"));
  auto huge = arch_config(model::architecture::llama, 40);
  huge.max_context = std::size_t{1} << 32;
  CHECK_THROWS_WITH(model::config_metadata(huge), Catch::Contains("implausibly large"));
  other = meta;
  other["llama.block_count"] = gguf::make_u32(3);
  CHECK_THROWS_WITH(bind(edited_model([](auto&) {}, other)), Catch::Contains("'blk.2.attn_norm.weight' is missing"));
  CHECK_THROWS_WITH(bind(edited_model([](auto& ts) {
                      auto& t = named(ts, "blk.0.attn_norm.weight");
                      t.type = 8;  // q8_0
                      t.data = t.data.first(68);
                    })),
                    Catch::Contains("vector tensor 'blk.0.attn_norm.weight' is q8_0"));
}

// The CUDA backend keeps every matrix as the file stores it (the k-quants of llama.cpp's mixes and
// their fallback types included): device memory for the weights is at most the file's size (the file
// adds its header and vocabulary), where dequantizing to f16 took about 3.5x for Q4_K_M.
TEST_CASE("the CUDA backend's weights take at most the quantized file's size", "[model][gguf][cuda]") {
  for (const auto mix : model::all_quant_mixes)
    for (const std::size_t width : {256, 64}) {  // k-quants; their fallbacks (q5_0, q5_1, q8_0)
      INFO(model::to_string(mix) << ", hidden " << width);
      auto cfg = arch_config(model::architecture::qwen2, 300, width == 256 ? dtype::q4_k : dtype::f32);
      cfg.layers = 4;
      const auto bytes = model::random_model(cfg, 52, {dtype::f32, false, mix});
      const std::size_t file = bytes.size();
      const auto w = model::open_model(bytes).bind();
      std::size_t stored = 0, as_f16 = 0;
      for (const auto& l : w.layers)
        for (const model::matrix* m : model::layer_matrices(l)) {
          INFO(to_string(m->type));
          CHECK(kernels::quant::kept_quantized(m->type));
          stored += model::device_matrix_bytes(*m);
          as_f16 += m->rows * m->cols * 2;
        }
      CHECK(kernels::quant::kept_quantized(w.output.type));
      CHECK(model::device_weight_bytes(w) <= file);
      // The matrices in decode order: each layer's seven, then the output matrix.
      const std::vector<const model::matrix*> order = model::decode_matrices(w);
      REQUIRE(order.size() == w.layers.size() * 7 + 1);
      CHECK(order.front() == &w.layers.front().wq);
      CHECK(order[6] == &w.layers.front().w_down);
      CHECK(order[7] == &w.layers[1].wq);
      CHECK(order.back() == &w.output);
      CHECK(static_cast<double>(stored) < 0.6 * static_cast<double>(as_f16));
    }
}

TEST_CASE("fuzzing k-quant files: corrupt scales and truncated super-blocks give an error or a model that runs",
          "[model][gguf][fuzz]") {
  thread_pool pool(1);
  kernels::host::context ctx{pool};
  const std::vector<token_id> tokens{1, 2, 3, 39};
  const std::vector<block_id> table{0, 1};
  rng r(50);
  for (const auto mix : model::all_quant_mixes)
    for (const std::size_t width : {256, 64}) {  // k-quants; their fallbacks (q5_0, q5_1, q8_0)
      INFO(model::to_string(mix) << ", hidden " << width);
      auto cfg = arch_config(model::architecture::qwen2, 300, width == 256 ? dtype::q4_k : dtype::f32);
      cfg.layers = 4;  // layers 2 and 3 get q6_k's more bits in the k_m mixes
      const auto bytes = model::random_model(cfg, 51, {dtype::f32, false, mix});
      const auto f = gguf::parse(bytes);
      std::size_t ran = 0, refused = 0;
      for (int trial = 0; trial < 100; ++trial) {
        auto copy = bytes;
        const auto& t = f.tensors[r.below(f.tensors.size())];
        const std::size_t start = static_cast<std::size_t>(f.data_offset + t.offset);
        if (trial % 5 == 0) {
          copy.resize(start + r.below(static_cast<std::size_t>(t.bytes)));  // inside a tensor's blocks
        } else {
          // Bytes of one block, mostly its f16 scales and sub-block scales (the first 16 bytes of a q4_k
          // or q5_k block, the last 18 of a q6_k block).
          const std::size_t block = info(*dtype_of_ggml(t.type)).bytes, blocks = t.bytes / block;
          const std::size_t at = start + r.below(blocks) * block;
          for (int i = 0, flips = 1 + static_cast<int>(r.below(8)); i < flips; ++i) {
            const std::size_t in = t.type == 14 ? block - 1 - r.below(18) : r.below(std::min<std::size_t>(16, block));
            copy[at + (r.below(4) == 0 ? r.below(block) : in)] = static_cast<std::byte>(r.below(256));
          }
        }
        try {
          const auto w = model::open_model(std::move(copy)).bind();
          model::transformer<kernels::host> m(w);
          kv::host_storage kv(w.cfg.layers, m.kv_layout(2, 4));
          const model::batch_item item{tokens, 0, table, true};
          std::vector<float> logits;
          m.forward(ctx, kv, std::span(&item, 1), logits);
          CHECK(logits.size() == cfg.vocab);
          ++ran;
        } catch (const efim::error& e) {
          CHECK(std::string(e.what()).find("gguf") != std::string::npos);  // a truncation: the file is short
          ++refused;
        }
      }
      CHECK(ran > 0);
      CHECK(refused > 0);
    }
  // A k-quant type on rows that are not a whole number of super-blocks: refused by name.
  CHECK_THROWS_WITH(model::open_model(edited_model([](auto& ts) {
                      auto& t = named(ts, "blk.0.attn_q.weight");
                      t.type = 12;
                      t.data = t.data.first(9 * 144);  // the bytes 64 x 64 would take if 64 divided
                    })).bind(),
                    Catch::Contains("blk.0.attn_q.weight"));
}

TEST_CASE("fuzzing model files: every corruption gives an error or a model that runs", "[model][gguf][fuzz]") {
  thread_pool pool(1);
  kernels::host::context ctx{pool};
  const auto bytes = edited_model([](auto&) {});
  const auto f = gguf::parse(bytes);
  rng r(49);
  std::size_t ran = 0, refused = 0;
  const std::vector<token_id> tokens{1, 2, 3, 39};
  const std::vector<block_id> table{0, 1};
  for (int trial = 0; trial < 3000; ++trial) {
    auto copy = bytes;
    if (trial % 10 == 0) {
      copy.resize(r.below(copy.size()));
    } else {
      const int flips = 1 + static_cast<int>(r.below(4));
      for (int i = 0; i < flips; ++i) {
        // Mostly the metadata and tensor directory, sometimes the tensor data.
        const std::size_t at =
            r.below(4) == 0 ? r.below(copy.size()) : r.below(static_cast<std::size_t>(f.data_offset));
        copy[at] = static_cast<std::byte>(r.below(256));
      }
    }
    try {
      const auto w = model::open_model(std::move(copy)).bind();
      model::transformer<kernels::host> m(w);
      kv::host_storage kv(w.cfg.layers, m.kv_layout(2, 4));
      const model::batch_item item{std::span(tokens).first(std::min<std::size_t>(4, w.cfg.vocab)), 0, table, true};
      std::vector<float> logits;
      m.forward(ctx, kv, std::span(&item, 1), logits);
      ++ran;
    } catch (const efim::error&) {
      ++refused;
    }
  }
  CHECK(ran > 0);
  CHECK(refused > 0);
}

TEST_CASE("a model's decode tiles: each type with the choice timed once, over its matrices in decode order",
          "[model][matmul]") {
  const efim_test::decode_tiles_guard guard;
  model::config c;
  c.vocab = 300;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 256;
  c.max_context = 64;
  thread_pool pool(2);
  // (f16 and bf16 rows as stored: where the model interleaves them, below, they are not timed.)
  const model::decode_tuning_options anything{
      .min_bytes = 0, .max_bytes = std::size_t{1} << 30, .rounds = 1, .floats_interleaved = false};
  CHECK(model::decode_tuning_options{}.floats_interleaved == kernels::interleave_floats_by_default());
  const bool apply = kernels::decode_tiles_apply(kernels::weight_view{dtype::f16, 1, 32, nullptr});
  SECTION("f16: every matrix, the output last") {
    const auto w = model::random_weights(c, 3, {.type = dtype::f16});
    // Under min_bytes nothing is timed (a small model's matrices stay in the caches).
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, {.floats_interleaved = false}).empty());
    // Nor where the model reads its f16 matrices from interleaved copies, which the tiles do not read.
    auto interleaved = anything;
    interleaved.floats_interleaved = true;
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, interleaved).empty());
    CHECK(kernels::measured_decode_tiles(dtype::f16) == kernels::decode_tiles::automatic);
    const auto timed = model::tune_decode_tiles(pool, w, kernels::products::exact, anything);
    // Per layer q (64 x 64), k and v (32 x 64), o (64 x 64), gate, up (256 x 64), down (64 x 256).
    const std::size_t layer = ((64 + 32 + 32 + 64 + 256 + 256) * 64 + 64 * 256) * 2, output = 300 * 64 * 2;
    if (!apply) {
      CHECK(timed.empty());
    } else {
      REQUIRE(timed.size() == 1);
      CHECK(timed[0].type == dtype::f16);
      CHECK(timed[0].matrices == 2 * 7 + 1);
      CHECK(timed[0].bytes == 2 * layer + output);
      CHECK(kernels::measured_decode_tiles(dtype::f16) == timed[0].chosen);
      // Once per type and process.
      CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, anything).empty());
      efim_test::decode_tiles_guard::forget();
      // max_bytes bounds a pass (here without the last-level cache's floor): the first layer, and 1000
      // bytes (7 rows) of the second's q.
      const auto part = model::tune_decode_tiles(
          pool, w, kernels::products::exact,
          {.min_bytes = 0, .max_bytes = layer + 1000, .cache_multiple = 0, .floats_interleaved = false});
      REQUIRE(part.size() == 1);
      CHECK(part[0].matrices == 8);
      CHECK(part[0].bytes == layer + 7 * 64 * 2);
      efim_test::decode_tiles_guard::forget();
      // With the floor (twice the last-level cache, where the C library knows it), all of this model.
      if (kernels::last_level_cache_bytes() > 0) {
        const auto floor = model::tune_decode_tiles(pool, w, kernels::products::exact,
                                                    {.min_bytes = 0, .max_bytes = 1000, .floats_interleaved = false});
        REQUIRE(floor.size() == 1);
        CHECK(floor[0].bytes == 2 * layer + output);
      }
    }
    efim_test::decode_tiles_guard::forget();
    // A kind forced (EFIM_DECODE_TILES, select_decode_tiles): nothing to time.
    kernels::select_decode_tiles(kernels::decode_tiles::streams);
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, anything).empty());
    kernels::select_decode_tiles(kernels::decode_tiles::automatic);
  }
  SECTION("q8_0: timed for exact products, not for int8 ones (kernels of their own)") {
    const auto w = model::random_weights(c, 3, {.type = dtype::q8_0});
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::int8, anything).empty());
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, anything).size() == (apply ? 1u : 0u));
  }
  SECTION("q4_0: no type with the choice") {
    const auto w = model::random_weights(c, 3, {.type = dtype::q4_0});
    CHECK(model::tune_decode_tiles(pool, w, kernels::products::exact, anything).empty());
  }
}
