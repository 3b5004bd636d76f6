#pragma once
// The kind of decode tiles each of a model's weight types reads fastest on this machine
// (kernels/decode_tuning.hpp), timed once per type and process on the model's own matrices of that
// type, read in the order a decode step reads them. The pipeline runs it when it starts on the host
// backend, as do efim-cli and efim-model-bench (which prints it).
#include <algorithm>
#include <cstddef>
#include <mutex>
#include <vector>

#include "efim/core/thread_pool.hpp"
#include "efim/kernels/decode_tuning.hpp"
#include "efim/kernels/interleave.hpp"
#include "efim/kernels/matmul.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

struct decode_tuning_options {
  // A type whose matrices hold fewer bytes in all is not timed: a small model's matrices stay in the
  // caches, where a timing says nothing of a decode that reads them from memory.
  std::size_t min_bytes = std::size_t{16} << 20;
  // A pass reads the type's matrices in decode order up to this many bytes, or cache_multiple times
  // the last-level cache where that is more (so that a large model is timed from memory, as its decode reads it, and
  // a model that fits in the cache from the cache, as its decode reads it too).
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t cache_multiple = 2;  // of the last-level cache (kernels::last_level_cache_bytes; 0: none)
  int rounds = 3;
  // Whether the model reads its f16 and bf16 matrices from interleaved copies (model::transformer's
  // default layout), which the decode tiles do not read: those matrices are then not timed.
  bool floats_interleaved = kernels::interleave_floats_by_default();
};

// For each type of w's matrices that takes either kind of decode tiles with these products (f32; f16
// and bf16 where not interleaved, o.floats_interleaved; q8_0 with exact products only: its int8
// products have kernels of their own), not measured yet in this process, where no kind is forced
// (kernels::active_decode_tiles() is automatic): times both kinds over its matrices and records the
// choice (kernels::tune_decode_tiles). Returns the timings made (none on a path without the choice).
inline std::vector<kernels::decode_tiles_timing> tune_decode_tiles(thread_pool& pool, const weights& w,
                                                                   kernels::products products,
                                                                   const decode_tuning_options& o = {}) {
  std::vector<kernels::decode_tiles_timing> made;
  const std::lock_guard<std::recursive_mutex> lock(kernels::detail::decode_tuning_mutex());
  if (kernels::active_decode_tiles() != kernels::decode_tiles::automatic) return made;
  const std::vector<const matrix*> order = decode_matrices(w);  // as a decode step reads them
  const std::size_t budget = std::max(o.max_bytes, o.cache_multiple * kernels::last_level_cache_bytes());
  for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0}) {
    if (t == dtype::q8_0 && products == kernels::products::int8) continue;
    if (kernels::measured_decode_tiles(t) != kernels::decode_tiles::automatic) continue;
    std::vector<kernels::weight_view> pass;
    std::size_t total = 0, taken = 0;
    for (const matrix* m : order) {
      if (m->data == nullptr || m->type != t || !kernels::decode_tiles_apply(*m)) continue;
      if (kernels::interleaved_by_model(t, m->rows, m->cols, false, o.floats_interleaved)) continue;
      const std::size_t rb = row_bytes(t, m->cols);
      total += m->rows * rb;
      if (taken >= budget) continue;
      const std::size_t fit = (budget - taken) / rb;  // (a row at least of the first matrix)
      if (fit == 0 && !pass.empty()) {
        taken = budget;
        continue;
      }
      kernels::weight_view part = *m;
      part.rows = std::min(m->rows, std::max<std::size_t>(fit, 1));
      taken += part.rows * rb;
      pass.push_back(part);
    }
    if (pass.empty() || total < o.min_bytes) continue;
    if (auto timing = kernels::tune_decode_tiles(pool, pass, o.rounds)) made.push_back(*timing);
  }
  return made;
}

}  // namespace efim::model
