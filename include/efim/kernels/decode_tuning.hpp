#pragma once
// Which kind of decode tiles (isa.hpp: decode_tiles) reads a one-row product fastest on this machine,
// found by timing both on the caller's own weights. The two kinds give the same bits, so the choice
// changes only the speed: which is faster depends on the memory system (how many lines a core keeps
// in flight, what its prefetchers follow), not on anything a program can read from CPUID.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <limits>
#include <optional>
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

// Times one-row products (exact) over the first `rows` rows of w with each kind in turn: one pass
// untimed first (it faults in a mapped file's pages and leaves the caches as a decode would), then
// `rounds` passes of each kind, alternating, the best of each counting. Records the faster kind for
// w.type (record_decode_tiles), which decode_tiles::automatic then takes in this process. nullopt,
// with nothing recorded, where the choice does not apply (decode_tiles_apply). Both kinds' passes
// select the kind process-wide: run it before, not while, other threads multiply.
inline std::optional<decode_tiles_timing> tune_decode_tiles(thread_pool& pool, const weight_view& w, std::size_t rows,
                                                            int rounds = 3) {
  rows = std::min(rows, w.rows);
  if (!decode_tiles_apply(w) || rows == 0 || w.cols == 0) return std::nullopt;
  weight_view part = w;
  part.rows = rows;
  std::vector<float> x(w.cols), y(rows);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 7) - 3) / 8.0f;
  const decode_tiles before = active_decode_tiles();
  const auto pass = [&](decode_tiles kind) {
    select_decode_tiles(kind);
    const auto start = std::chrono::steady_clock::now();
    matmul(pool, x.data(), part, y.data(), 1);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  constexpr double never = std::numeric_limits<double>::infinity();
  decode_tiles_timing t{.type = w.type,
                        .rows = rows,
                        .cols = w.cols,
                        .bytes = rows * row_bytes(w.type, w.cols),
                        .streams_s = never,
                        .prefetched_s = never};
  try {
    pass(decode_tiles::streams);
    for (int r = 0; r < std::max(rounds, 1); ++r) {
      // The order turns from round to round (prefetched first, then streams first, ...), so that each
      // kind follows the other as often and neither always reads what the other left in the caches.
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
  t.faster = t.prefetched_s < t.streams_s ? decode_tiles::prefetched : decode_tiles::streams;
  record_decode_tiles(w.type, t.faster);
  return t;
}

}  // namespace efim::kernels
