#pragma once
// Puts back, when a test case ends however it ends, the instruction-set path, the kind of decode tiles
// in force (EFIM_DECODE_TILES, say) and the kinds measured per type, and starts the case with no kind
// forced and none measured.
#include "efim/core/dtype.hpp"
#include "efim/kernels/isa.hpp"

namespace efim_test {

class decode_tiles_guard {
 public:
  decode_tiles_guard() {
    for (std::size_t i = 0; i < 4; ++i) measured_[i] = efim::kernels::measured_decode_tiles(types[i]);
    forget();
    efim::kernels::select_decode_tiles(efim::kernels::decode_tiles::automatic);
  }
  decode_tiles_guard(const decode_tiles_guard&) = delete;
  decode_tiles_guard& operator=(const decode_tiles_guard&) = delete;
  ~decode_tiles_guard() {
    for (std::size_t i = 0; i < 4; ++i) efim::kernels::record_decode_tiles(types[i], measured_[i]);
    efim::kernels::select_decode_tiles(forced_);
    efim::kernels::select_isa(isa_);
  }
  static void forget() {
    for (const efim::dtype t : types) efim::kernels::record_decode_tiles(t, efim::kernels::decode_tiles::automatic);
  }

 private:
  static constexpr efim::dtype types[4] = {efim::dtype::f32, efim::dtype::f16, efim::dtype::bf16, efim::dtype::q8_0};
  efim::kernels::isa isa_ = efim::kernels::active_isa();
  efim::kernels::decode_tiles forced_ = efim::kernels::active_decode_tiles();
  efim::kernels::decode_tiles measured_[4]{};
};

}  // namespace efim_test
