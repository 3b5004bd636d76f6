// The typed matrix product's bits on every instruction-set path the CPU runs (kernels::select_isa):
// compiled into test_model, and on its own with -march=x86-64-v3 and plain x86-64, whose generic paths
// differ (see tests/CMakeLists.txt).
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "decode_tiles_guard.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/decode_tuning.hpp"
#include "efim/kernels/isa.hpp"
#include "efim/kernels/matmul.hpp"

using namespace efim;

// The contract fixes every rounding, so every path with FMA instructions (AVX-512, AVX2 + FMA, the
// generic path of a build whose flags have FMA) gives one set of bits; the generic path of a build
// without FMA rounds each product separately and gives other, also fixed, bits. The inputs involve no
// rounding a compiler could fuse away, so they are the same everywhere.
namespace {

// FNV-1a over the bits of the products of random weights of every type and batches of 1 to 17 rows.
std::uint64_t matmul_hash(std::initializer_list<dtype> types,
                          kernels::products products = kernels::products::exact) {
  thread_pool pool(2);
  rng r(13);
  const auto value = [&] { return static_cast<float>(r.uniform() * 2.0 - 1.0); };
  std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a over the outputs' bits
  for (const dtype t : types) {
    const std::size_t rows = 37, cols = info(t).block == 256 ? 512 : info(t).block == 32 ? 96 : 100;
    const std::size_t rb = row_bytes(t, cols);
    std::vector<std::byte> bytes(rows * rb);
    for (std::size_t j = 0; j < rows; ++j) {
      std::byte* row = bytes.data() + j * rb;
      for (std::size_t e = 0; e < cols; ++e) {
        const float v = value();
        if (t == dtype::f32) std::memcpy(row + 4 * e, &v, 4);
        if (t == dtype::f16 || t == dtype::bf16) {
          const std::uint16_t h = t == dtype::f16 ? f32_to_f16(v) : f32_to_bf16(v);
          std::memcpy(row + 2 * e, &h, 2);
        }
      }
      // Raw blocks: each f16 scale (d, the offset m of q5_1, dmin of q4_k and q5_k) random in
      // [2^-10, 2^-9), random quants (and 6- or 8-bit sub-block scales).
      const auto scale = [&] { return f32_to_f16(0x1p-10f * (1.0f + 0.5f * (value() + 1.0f))); };
      if (info(t).block == 32)
        for (std::size_t b = 0; b < cols / 32; ++b) {
          std::byte* blk = row + b * info(t).bytes;
          const std::uint16_t d = scale();
          std::memcpy(blk, &d, 2);
          for (std::size_t q = 2; q < info(t).bytes; ++q) blk[q] = static_cast<std::byte>(r.below(256));
          if (t == dtype::q5_1) {
            const std::uint16_t m = scale();
            std::memcpy(blk + 2, &m, 2);
          }
        }
      if (info(t).block == 256)
        for (std::size_t b = 0; b < cols / 256; ++b) {
          std::byte* blk = row + b * info(t).bytes;
          for (std::size_t q = 0; q < info(t).bytes; ++q) blk[q] = static_cast<std::byte>(r.below(256));
          for (const std::size_t at : t == dtype::q6_k ? std::vector<std::size_t>{208} : std::vector<std::size_t>{0, 2}) {
            const std::uint16_t d = scale();
            std::memcpy(blk + at, &d, 2);
          }
        }
    }
    const kernels::weight_view w{t, rows, cols, bytes.data()};
    for (const std::size_t m : {1, 3, 8, 17}) {
      std::vector<float> x(m * cols), y(m * rows);
      for (auto& v : x) v = value();
      kernels::matmul(pool, x.data(), w, y.data(), m, kernels::accumulate::no, products);
      for (const float v : y)
        for (int shift = 0; shift < 32; shift += 8) {
          hash ^= (std::bit_cast<std::uint32_t>(v) >> shift) & 0xffu;
          hash *= 0x100000001b3ull;
        }
    }
  }
  return hash;
}

// f32, f16, bf16, q8_0 and q4_0; then q5_0, q5_1 and the k-quants.
constexpr std::uint64_t fused_bits = 0x4fe871bbbc6d1882ull;    // every multiply-add fused
[[maybe_unused]] constexpr std::uint64_t unfused_bits = 0x0d7c75be7d314343ull;  // products and sums rounded apart
constexpr std::uint64_t fused_bits_k = 0x8bf3f64c38d92eeaull;
[[maybe_unused]] constexpr std::uint64_t unfused_bits_k = 0x06bcf2748149c479ull;  // (unused where FMA is on)
// int8 products: integer sums and std::fma steps, one set of bits whatever the path or the flags.
constexpr std::uint64_t int8_bits = 0xce0f4c040b360715ull;
constexpr std::uint64_t int8_bits_32 = 0x80a17d6fbfd5ada7ull;  // q8_0, q4_0, q5_0, q5_1

}  // namespace

TEST_CASE("typed matmul gives the same bits on every instruction-set path", "[kernels][matmul]") {
  const kernels::isa before = kernels::active_isa();
  const kernels::decode_tiles tiles_before = kernels::active_decode_tiles();
  for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2, kernels::isa::generic}) {
    if (kernels::select_isa(path) != path) continue;  // the CPU lacks it
    // The AVX-512 path with each kind of decode tiles, whatever the CPU's vendor would choose.
    for (const kernels::decode_tiles tiles : {kernels::decode_tiles::streams, kernels::decode_tiles::prefetched}) {
      if (path != kernels::isa::avx512 && tiles != kernels::decode_tiles::streams) continue;
      kernels::select_decode_tiles(tiles);
      INFO("path " << kernels::isa_name(path) << ", decode tiles " << kernels::decode_tiles_name(tiles));
      const std::uint64_t hash = matmul_hash({dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0});
      const std::uint64_t hash_k = matmul_hash({dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k});
      UNSCOPED_INFO(std::hex << "hashes 0x" << hash << ", 0x" << hash_k);
#if defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA)
      CHECK(hash == fused_bits);
      CHECK(hash_k == fused_bits_k);
#else
      CHECK(hash == (path == kernels::isa::generic ? unfused_bits : fused_bits));
      CHECK(hash_k == (path == kernels::isa::generic ? unfused_bits_k : fused_bits_k));
#endif
    }
  }
  kernels::select_decode_tiles(tiles_before);
  kernels::select_isa(before);
}

TEST_CASE("int8 products give the same bits on every instruction-set path, whatever the flags", "[kernels][matmul]") {
  const kernels::isa before = kernels::active_isa();
  for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2, kernels::isa::generic}) {
    if (kernels::select_isa(path) != path) continue;  // the CPU lacks it
    INFO("path " << kernels::isa_name(path));
    const std::uint64_t hash = matmul_hash({dtype::q4_k, dtype::q5_k, dtype::q6_k}, kernels::products::int8);
    const std::uint64_t hash_32 =
        matmul_hash({dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1}, kernels::products::int8);
    UNSCOPED_INFO(std::hex << "hashes 0x" << hash << ", 0x" << hash_32);
    CHECK(hash == int8_bits);
    CHECK(hash_32 == int8_bits_32);
  }
  kernels::select_isa(before);
}

TEST_CASE("f16 and bf16 rows interleaved give the bits of the rows as stored, on every path, batch and thread count",
          "[kernels][matmul]") {
  const efim_test::decode_tiles_guard guard;
  thread_pool one(1), two(2), three(3);
  rng r(16);
  // Whole groups and rows past them (50 = 6 x 8 + 2), one group alone, rows longer than the panels' range;
  // x rows on both sides of the tiles of 3, 2 and 1 and of stream_rows_bound (64).
  const std::pair<std::size_t, std::size_t> shapes[] = {{8, 16}, {50, 64}, {19, 768}, {17, 2048}};
  for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2, kernels::isa::generic}) {
    if (kernels::select_isa(path) != path) continue;  // the CPU lacks it
    for (const dtype t : {dtype::f16, dtype::bf16})
      for (const auto& [rows, cols] : shapes) {
        std::vector<std::byte> bytes(rows * row_bytes(t, cols)), il(bytes.size());
        for (std::size_t e = 0; e < rows * cols; ++e) {
          const float v = static_cast<float>(r.uniform() * 2.0 - 1.0);
          const std::uint16_t h = t == dtype::f16 ? f32_to_f16(v) : f32_to_bf16(v);
          std::memcpy(bytes.data() + 2 * e, &h, 2);
        }
        const kernels::weight_view w{t, rows, cols, bytes.data()};
        kernels::interleave8(w, il.data(), &two);
        const kernels::weight_view wi{t, rows, cols, il.data(), kernels::weight_layout::interleaved8};
        CHECK((cols == 16 || il != bytes));  // (16 columns: one chunk a row, the same order)
        std::vector<std::byte> back(il.size());
        kernels::deinterleave8(wi, back.data());
        CHECK(back == bytes);
        for (const std::size_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 63, 64, 65, 130})
          for (thread_pool* pool : {&one, &two, &three}) {
            INFO("path " << kernels::isa_name(path) << ", " << to_string(t) << " " << rows << " x " << cols << ", m "
                         << m << ", threads " << pool->size());
            std::vector<float> x(m * cols);
            for (auto& v : x) v = static_cast<float>(r.uniform() * 2.0 - 1.0);
            std::vector<float> want(m * rows), got(m * rows, std::nanf(""));
            kernels::matmul(*pool, x.data(), w, want.data(), m);
            kernels::matmul(*pool, x.data(), wi, got.data(), m);
            CHECK(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
            // Accumulating into y as well.
            std::vector<float> more = want;
            kernels::matmul(*pool, x.data(), w, want.data(), m, kernels::accumulate::yes);
            kernels::matmul(*pool, x.data(), wi, more.data(), m, kernels::accumulate::yes);
            CHECK(std::memcmp(want.data(), more.data(), want.size() * sizeof(float)) == 0);
          }
      }
  }
  // Rows not a multiple of 16 long do not interleave.
  std::vector<std::byte> odd(8 * 32 * 4), out(odd.size());
  CHECK_THROWS(kernels::interleave8(kernels::weight_view{dtype::f16, 8, 24, odd.data()}, out.data()));
  CHECK_THROWS(kernels::interleave8(kernels::weight_view{dtype::f32, 8, 32, odd.data()}, out.data()));
}

TEST_CASE("decode tiles: both kinds timed over matrices, the vendor's kept unless the other is faster",
          "[kernels][matmul]") {
  const efim_test::decode_tiles_guard guard;
  thread_pool pool(2);
  const std::size_t rows = 1024, cols = 768;
  std::vector<std::byte> bytes(rows * row_bytes(dtype::f16, cols));
  rng r(5);
  for (std::size_t i = 0; i < rows * cols; ++i) {
    const std::uint16_t h = f32_to_f16(static_cast<float>(r.uniform() - 0.5));
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  }
  const kernels::weight_view w{dtype::f16, rows, cols, bytes.data()};
  for (const kernels::isa path : {kernels::isa::avx512, kernels::isa::avx2, kernels::isa::generic}) {
    if (kernels::select_isa(path) != path) continue;
    INFO("path " << kernels::isa_name(path));
    efim_test::decode_tiles_guard::forget();
    const auto timed = kernels::tune_decode_tiles(pool, w, rows, 2);
    if (path != kernels::isa::avx512 || !EFIM_KERNELS_DISPATCHED) {
      // One kind only on these paths: nothing timed, nothing recorded.
      CHECK_FALSE(timed);
      CHECK(kernels::measured_decode_tiles(dtype::f16) == kernels::decode_tiles::automatic);
      continue;
    }
    REQUIRE(timed);
    CHECK(timed->type == dtype::f16);
    CHECK(timed->matrices == 1);
    CHECK(timed->bytes == rows * cols * 2);
    CHECK(timed->streams_s > 0);
    CHECK(timed->prefetched_s > 0);
    CHECK(std::isfinite(timed->streams_over_prefetched()));
    const kernels::decode_tiles vendor = kernels::vendor_decode_tiles();
    const bool streams_vendor = vendor == kernels::decode_tiles::streams;
    const double vendor_s = streams_vendor ? timed->streams_s : timed->prefetched_s;
    const double other_s = streams_vendor ? timed->prefetched_s : timed->streams_s;
    const kernels::decode_tiles other =
        streams_vendor ? kernels::decode_tiles::prefetched : kernels::decode_tiles::streams;
    CHECK(timed->chosen == (other_s * kernels::decode_tiles_margin < vendor_s ? other : vendor));
    // Recorded for f16 alone, and taken where no kind is forced; the choice in force before is back.
    CHECK(kernels::measured_decode_tiles(dtype::f16) == timed->chosen);
    CHECK(kernels::decode_tiles_for(dtype::f16) == timed->chosen);
    CHECK(kernels::measured_decode_tiles(dtype::f32) == kernels::decode_tiles::automatic);
    CHECK(kernels::measured_decode_tiles(dtype::q4_0) == kernels::decode_tiles::automatic);
    CHECK(kernels::active_decode_tiles() == kernels::decode_tiles::automatic);
    const kernels::decode_tiles not_chosen = timed->chosen == kernels::decode_tiles::streams
                                                 ? kernels::decode_tiles::prefetched
                                                 : kernels::decode_tiles::streams;
    kernels::select_decode_tiles(not_chosen);
    CHECK(kernels::decode_tiles_for(dtype::f16) == not_chosen);  // a forced kind wins over the measurement
    kernels::select_decode_tiles(kernels::decode_tiles::automatic);
    // At most the matrix's rows; several matrices read in turn, their bytes added.
    const auto all = kernels::tune_decode_tiles(pool, w, 10 * rows, 1);
    REQUIRE(all);
    CHECK(all->bytes == rows * cols * 2);
    const kernels::weight_view two[] = {w, kernels::weight_view{dtype::f16, 8, cols, bytes.data()}};
    const auto both = kernels::tune_decode_tiles(pool, two, 1);
    REQUIRE(both);
    CHECK(both->matrices == 2);
    CHECK(both->bytes == (rows + 8) * cols * 2);
    // Types with one kind only, interleaved rows, matrices of two types: nothing timed.
    CHECK_FALSE(kernels::tune_decode_tiles(pool, kernels::weight_view{dtype::q4_0, 8, 32, bytes.data()}, 8));
    CHECK_FALSE(kernels::tune_decode_tiles(
        pool, kernels::weight_view{dtype::q8_0, 8, 32, bytes.data(), kernels::weight_layout::interleaved8}, 8));
    const kernels::weight_view mixed[] = {w, kernels::weight_view{dtype::f32, 8, 32, bytes.data()}};
    CHECK_FALSE(kernels::tune_decode_tiles(pool, mixed, 1));
  }
}
