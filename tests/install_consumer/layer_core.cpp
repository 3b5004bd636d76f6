// efim::core alone: errors, UTF-8, the thread pool.
#include <atomic>
#include <cstdio>
#include <efim/core/error.hpp>
#include <efim/core/thread_pool.hpp>
#include <efim/core/utf8.hpp>

int main() {
  efim::thread_pool pool(2);
  std::atomic<std::size_t> sum{0};
  pool.parallel_for(100, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) sum += i;
  });
  bool refused = false;
  try {
    efim::utf8::require_valid("\xFF", "text");
  } catch (const efim::error& e) {
    refused = e.code() == efim::errc::invalid_utf8;
  }
  std::printf("core: sum %zu, invalid UTF-8 refused: %d\n", sum.load(), refused);
  return sum == 4950 && refused ? 0 : 1;
}
