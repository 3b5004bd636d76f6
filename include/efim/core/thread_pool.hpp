#pragma once
// A fixed pool of worker threads for data-parallel loops; the calling thread takes part.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"

namespace efim {

class thread_pool {
 public:
  // `threads` counts the caller too; 0 means one per hardware thread.
  explicit thread_pool(std::size_t threads = 0) {
    if (threads == 0) threads = std::max<std::size_t>(1, std::thread::hardware_concurrency());
    require(threads <= 4096, errc::invalid_argument,
            "thread_pool: " + std::to_string(threads) + " threads asked for; at most 4096");
    workers_.reserve(threads - 1);
    try {
      for (std::size_t i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { work(); });
    } catch (const std::exception& e) {
      const std::size_t started = workers_.size();
      stop();
      throw error(errc::invalid_argument, "thread_pool: started " + std::to_string(started) + " of " +
                                              std::to_string(threads - 1) + " worker threads: " + e.what());
    }
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() { stop(); }

  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }

  // Calls fn(begin, end) on disjoint ranges that cover [0, n), each at least `grain` long
  // (but the last), and returns when all calls are done. The first exception thrown is rethrown.
  // Not reentrant: fn must not call parallel_for on the same pool.
  template <class F>
  void parallel_for(std::size_t n, F&& fn, std::size_t grain = 1) {
    if (n == 0) return;
    grain = std::max<std::size_t>(grain, 1);
    const std::size_t max_chunks = (n + grain - 1) / grain;
    const std::size_t chunks = std::min(max_chunks, size() * 4);
    if (chunks <= 1 || workers_.empty()) {
      fn(std::size_t{0}, n);
      return;
    }
    const std::size_t chunk_len = (n + chunks - 1) / chunks;
    auto body = [&](std::size_t chunk) {
      const std::size_t begin = chunk * chunk_len;
      const std::size_t end = std::min(n, begin + chunk_len);
      if (begin < end) fn(begin, end);
    };
    job_ = job{&body, [](void* b, std::size_t c) { (*static_cast<decltype(body)*>(b))(c); }, chunks};
    next_.store(0, std::memory_order_relaxed);
    busy_workers_.store(workers_.size(), std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_chunks();
    if (!spin_until([this] { return busy_workers_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return busy_workers_.load(std::memory_order_acquire) == 0; });
    }
    std::lock_guard lock(mutex_);
    if (failure_) {
      auto failure = std::exchange(failure_, nullptr);
      std::rethrow_exception(failure);
    }
  }

 private:
  struct job {
    void* body = nullptr;
    void (*call)(void*, std::size_t) = nullptr;
    std::size_t chunks = 0;
  };

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  void run_chunks() {
    for (;;) {
      const std::size_t chunk = next_.fetch_add(1, std::memory_order_relaxed);
      if (chunk >= job_.chunks) return;
      try {
        job_.call(job_.body, chunk);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!failure_) failure_ = std::current_exception();
      }
    }
  }

  // Spins a little while before a thread blocks: the steps of a decode come microseconds apart, and
  // waking a sleeping thread takes longer than the work of a small matrix product.
  template <class Ready>
  static bool spin_until(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    for (std::size_t i = 1;; ++i) {
      if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return false;
    }
  }

  void work() {
    std::size_t seen = 0;
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_.load(std::memory_order_acquire) != seen; });
      }
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      run_chunks();
      if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);  // orders the notification after the caller's check of the count
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<std::size_t> generation_{0};
  std::atomic<std::size_t> busy_workers_{0};
  bool stopping_ = false;
  job job_;
  std::atomic<std::size_t> next_{0};
  std::exception_ptr failure_;
};

}  // namespace efim
