#pragma once
// The kind of decode tiles each of a model's weight types reads fastest on this machine
// (kernels/decode_tuning.hpp), timed once per type and process on the model's own largest matrix of
// that type. The pipeline runs it when it starts on the host backend; so do efim-model-bench and
// efim-cli, which print it.
#include <cstddef>
#include <vector>

#include "efim/core/thread_pool.hpp"
#include "efim/kernels/decode_tuning.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

struct decode_tuning_options {
  // A type whose largest matrix is smaller is not timed: a small model's matrices stay in the caches,
  // where a timing says nothing of a decode that reads them from memory.
  std::size_t min_bytes = std::size_t{16} << 20;
  // The rows timed: at most this many bytes of the matrix (a 7B model's output matrix holds 1 GiB).
  std::size_t max_bytes = std::size_t{256} << 20;
  int rounds = 3;
};

// For each type of w's matrices that takes either kind of decode tiles with these products (f32, f16,
// bf16; q8_0 with exact products only: its int8 products have kernels of their own), not measured
// yet in this process, where no kind is forced (kernels::active_decode_tiles() is automatic): times
// both kinds on the type's largest matrix and records the faster (kernels::tune_decode_tiles).
// Returns the timings made (none on a path without the choice).
inline std::vector<kernels::decode_tiles_timing> tune_decode_tiles(thread_pool& pool, const weights& w,
                                                                   kernels::products products,
                                                                   const decode_tuning_options& o = {}) {
  std::vector<kernels::decode_tiles_timing> made;
  if (kernels::active_decode_tiles() != kernels::decode_tiles::automatic) return made;
  std::vector<const matrix*> all{&w.output};  // (the embedding is looked up, not multiplied, unless tied)
  for (const layer_weights& l : w.layers)
    for (const matrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) all.push_back(m);
  const auto bytes = [](const matrix& m) { return m.data == nullptr ? std::size_t{0} : device_matrix_bytes(m); };
  for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0}) {
    if (t == dtype::q8_0 && products == kernels::products::int8) continue;
    if (kernels::measured_decode_tiles(t) != kernels::decode_tiles::automatic) continue;
    const matrix* largest = nullptr;
    for (const matrix* m : all)
      if (m->type == t && kernels::decode_tiles_apply(*m) && bytes(*m) > 0 &&
          (largest == nullptr || bytes(*m) > bytes(*largest)))
        largest = m;
    if (largest == nullptr || bytes(*largest) < o.min_bytes) continue;
    const std::size_t rb = row_bytes(t, largest->cols);
    const std::size_t rows = std::max<std::size_t>(1, std::min(largest->rows, o.max_bytes / rb));
    if (auto timing = kernels::tune_decode_tiles(pool, *largest, rows, o.rounds)) made.push_back(*timing);
  }
  return made;
}

}  // namespace efim::model
