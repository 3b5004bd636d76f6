#pragma once
// Clocks for eviction order. The clock is a template parameter so tests can drive time.
#include <chrono>

#include "efim/cache/concepts.hpp"

namespace efim::cache {

// Counts calls: a strict order of events, the same on every run.
struct logical_clock {
  tick now() noexcept { return ++last_; }

 private:
  tick last_ = 0;
};

// Nanoseconds of std::chrono::steady_clock.
struct steady_clock {
  tick now() const noexcept {
    return static_cast<tick>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
};

// Reads a time the owner sets (tests): the variable must outlive the clock.
class manual_clock {
 public:
  explicit manual_clock(const tick& time) noexcept : time_(&time) {}
  tick now() const noexcept { return *time_; }

 private:
  const tick* time_;
};

static_assert(tick_clock<logical_clock>);
static_assert(tick_clock<steady_clock>);
static_assert(tick_clock<manual_clock>);

}  // namespace efim::cache
