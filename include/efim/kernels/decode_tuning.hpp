#pragma once
// Which kind of decode tiles (isa.hpp: decode_tiles) reads one-row products fastest on this machine,
// found by timing both on the caller's own weights. The two kinds give the same bits, so the choice
// changes only the speed: which is faster depends on the memory system (how many lines a core keeps
// in flight, what its prefetchers follow), not on anything a program can read from CPUID.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/isa.hpp"
#include "efim/kernels/matmul.hpp"

namespace efim::kernels {

// Whether a one-row product over w can take either kind now: the active path is AVX-512 (the only one
// with both), w's type has the choice and its rows are stored as rows.
inline bool decode_tiles_apply(const weight_view& w) noexcept {
  return EFIM_KERNELS_DISPATCHED && active_isa() == isa::avx512 && has_decode_tiles_choice(w.type) &&
         w.layout == weight_layout::rows;
}

// The kind the vendor suggests is kept unless the other reads faster by more than this factor (a
// shared machine's timings move by several percent from pass to pass).
inline constexpr double decode_tiles_margin = 1.03;

// The last-level cache's size as the C library reports it (0 where unknown; glibc reads CPUID, which a
// VM may fill in more generously than the cache a guest gets: 320 MiB in one where lscpu shows 32).
inline std::size_t last_level_cache_bytes() noexcept {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<std::size_t>(l3);
#endif
  return 0;
}

namespace detail {
// Held while a timing selects kinds process-wide, so that two timings (two pipelines starting on two
// threads) neither see nor restore each other's temporary choice.
inline std::recursive_mutex& decode_tuning_mutex() noexcept {
  static std::recursive_mutex m;
  return m;
}
}  // namespace detail

// Times one-row products (exact) over the matrices `ws` in order, as a decode step reads them, with
// each kind: one pass untimed first (it faults in a mapped file's pages and leaves the caches as a
// decode would), then `rounds` passes of each kind in an order that turns each round, the best pass of
// each counting. Records for their type (record_decode_tiles) the vendor's kind unless the other is
// faster by more than decode_tiles_margin; decode_tiles::automatic then takes it in this process.
// nullopt, with nothing recorded, where the choice does not apply to every matrix (decode_tiles_apply)
// or they are not all of one type. Each pass selects its kind process-wide (select_decode_tiles, put
// back after): a product that other threads run meanwhile takes that kind too (the same bits).
inline std::optional<decode_tiles_timing> tune_decode_tiles(thread_pool& pool, std::span<const weight_view> ws,
                                                            int rounds = 3) {
  if (ws.empty()) return std::nullopt;
  std::size_t cols = 0, rows = 0, bytes = 0;
  for (const weight_view& w : ws) {
    if (!decode_tiles_apply(w) || w.type != ws.front().type || w.rows == 0 || w.cols == 0) return std::nullopt;
    cols = std::max(cols, w.cols);
    rows = std::max(rows, w.rows);
    bytes += w.rows * row_bytes(w.type, w.cols);
  }
  std::vector<float> x(cols), y(rows);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 7) - 3) / 8.0f;
  const std::lock_guard<std::recursive_mutex> lock(detail::decode_tuning_mutex());
  const decode_tiles before = active_decode_tiles();
  const auto pass = [&](decode_tiles kind) {
    select_decode_tiles(kind);
    const auto start = std::chrono::steady_clock::now();
    for (const weight_view& w : ws) matmul(pool, x.data(), w, y.data(), 1);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  constexpr double never = std::numeric_limits<double>::infinity();
  decode_tiles_timing t{
      .type = ws.front().type, .matrices = ws.size(), .bytes = bytes, .streams_s = never, .prefetched_s = never};
  try {
    pass(decode_tiles::streams);
    for (int r = 0; r < std::max(rounds, 1); ++r) {
      // Prefetched first, then streams first, ...: each kind follows the other as often, so neither
      // always reads what the other left in the caches.
      const bool streams_first = r % 2 == 1;
      const double a = pass(streams_first ? decode_tiles::streams : decode_tiles::prefetched);
      const double b = pass(streams_first ? decode_tiles::prefetched : decode_tiles::streams);
      t.streams_s = std::min(t.streams_s, streams_first ? a : b);
      t.prefetched_s = std::min(t.prefetched_s, streams_first ? b : a);
    }
  } catch (...) {
    select_decode_tiles(before);
    throw;
  }
  select_decode_tiles(before);
  const decode_tiles vendor = vendor_decode_tiles();
  const double vendor_s = vendor == decode_tiles::streams ? t.streams_s : t.prefetched_s;
  const double other_s = vendor == decode_tiles::streams ? t.prefetched_s : t.streams_s;
  const decode_tiles other = vendor == decode_tiles::streams ? decode_tiles::prefetched : decode_tiles::streams;
  t.chosen = other_s * decode_tiles_margin < vendor_s ? other : vendor;
  record_decode_tiles(t.type, t.chosen);
  return t;
}

// The same over the first `rows` rows of one matrix.
inline std::optional<decode_tiles_timing> tune_decode_tiles(thread_pool& pool, const weight_view& w, std::size_t rows,
                                                            int rounds = 3) {
  weight_view part = w;
  part.rows = std::min(rows, w.rows);
  return tune_decode_tiles(pool, std::span(&part, 1), rounds);
}

}  // namespace efim::kernels
