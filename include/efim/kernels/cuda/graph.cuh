#pragma once
// CUDA graphs of repeated work: `work` (a function that enqueues kernels and copies on a stream, with
// no host synchronization and no allocation by cudaMalloc) is captured per key and then replayed with
// one launch, where running it again would cost a launch per kernel. A key names everything the
// enqueued work depends on that is not read from device memory at run time: sizes, grid shapes,
// pointers. The first time a key is seen the work runs directly (a shape seen once is not worth a
// capture, and every kernel it launches is then loaded and every library call has run once outside a
// capture); the second time it is captured (on the calling thread's stream,
// cudaStreamCaptureModeThreadLocal) into a slot of a small cache, the least recently used slot's
// executable graph updated in place where CUDA allows (cudaGraphExecUpdate: the same nodes with new
// parameters), else instantiated anew; after that it is replayed. A key whose graph was evicted is
// captured again the next time it comes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

template <class Key>
class graph_cache {
 public:
  // `capacity` executable graphs at most (at least 1); keys seen once are remembered up to 4 times as many.
  explicit graph_cache(std::size_t capacity = 8) : capacity_(capacity < 1 ? 1 : capacity) {}
  graph_cache(const graph_cache&) = delete;
  graph_cache& operator=(const graph_cache&) = delete;
  graph_cache(graph_cache&& o) noexcept { *this = std::move(o); }
  graph_cache& operator=(graph_cache&& o) noexcept {
    if (this != &o) {
      clear();
      capacity_ = o.capacity_;
      slots_ = std::exchange(o.slots_, {});
      seen_ = std::exchange(o.seen_, {});
      clock_ = o.clock_, direct_ = o.direct_, captures_ = o.captures_, replays_ = o.replays_, updates_ = o.updates_;
    }
    return *this;
  }
  ~graph_cache() { clear(); }

  // Enqueues work's operations on `stream`: directly (a key seen for the first time), or as a graph
  // captured now (work runs once, on the host, inside the capture) and launched, or as a replay of the
  // graph captured for `key` before. If work throws while capturing, the capture is ended and dropped
  // and the exception goes on.
  template <class F>
  void run(const Key& key, cudaStream_t stream, F&& work) {
    ++clock_;
    for (slot& s : slots_)
      if (s.key == key) {
        s.used = clock_;
        ++replays_;
        check(cudaGraphLaunch(s.exec, stream), "cudaGraphLaunch");
        return;
      }
    const auto once = std::find(seen_.begin(), seen_.end(), key);
    if (once == seen_.end()) {
      remember(key);
      ++direct_;
      work();
      return;
    }
    seen_.erase(once);
    graph_owner graph{capture(stream, work)};
    if (slots_.size() < capacity_) slots_.emplace_back();
    slot* target = &slots_.front();
    for (slot& s : slots_)
      if (s.used < target->used) target = &s;
    if (target->exec != nullptr) remember(target->key);  // evicted: captured again when it comes back
    target->key = key;
    target->used = clock_;
    if (target->exec != nullptr) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(target->exec, graph.g, &info) == cudaSuccess) {
        ++updates_;
      } else {
        (void)cudaGetLastError();  // the update's error is not sticky; the slot is instantiated anew
        (void)cudaGraphExecDestroy(target->exec);
        target->exec = nullptr;
      }
    }
    if (target->exec == nullptr) {
      const cudaError_t made = cudaGraphInstantiate(&target->exec, graph.g, 0);
      if (made != cudaSuccess) {
        target->exec = nullptr;
        slots_.erase(slots_.begin() + (target - slots_.data()));
        check(made, "cudaGraphInstantiate");
      }
    }
    ++captures_;
    check(cudaGraphLaunch(target->exec, stream), "cudaGraphLaunch");
  }

  // Drops every graph and every key seen (the next runs of any key start over): call it when a pointer
  // the graphs hold is no longer valid and the keys would not show it.
  void clear() noexcept {
    for (slot& s : slots_)
      if (s.exec != nullptr) (void)cudaGraphExecDestroy(s.exec);
    slots_.clear();
    seen_.clear();
  }

  // Runs so far: directly (first sight of a key), captured, replayed; captures that updated a graph in place.
  [[nodiscard]] std::size_t direct() const noexcept { return direct_; }
  [[nodiscard]] std::size_t captures() const noexcept { return captures_; }
  [[nodiscard]] std::size_t replays() const noexcept { return replays_; }
  [[nodiscard]] std::size_t updates() const noexcept { return updates_; }
  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }

 private:
  struct slot {
    Key key{};
    cudaGraphExec_t exec = nullptr;
    std::uint64_t used = 0;  // 0: a slot just made, taken first
  };
  struct graph_owner {
    cudaGraph_t g = nullptr;
    explicit graph_owner(cudaGraph_t graph) noexcept : g(graph) {}
    graph_owner(const graph_owner&) = delete;
    graph_owner& operator=(const graph_owner&) = delete;
    ~graph_owner() {
      if (g != nullptr) (void)cudaGraphDestroy(g);
    }
  };

  void remember(const Key& key) {
    if (seen_.size() >= 4 * capacity_) seen_.erase(seen_.begin());
    seen_.push_back(key);
  }

  template <class F>
  static cudaGraph_t capture(cudaStream_t stream, F& work) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      work();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial != nullptr) (void)cudaGraphDestroy(partial);
      (void)cudaGetLastError();
      throw;
    }
    cudaGraph_t graph = nullptr;
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    return graph;
  }

  std::size_t capacity_ = 8;
  std::vector<slot> slots_;
  std::vector<Key> seen_;
  std::uint64_t clock_ = 0;
  std::size_t direct_ = 0, captures_ = 0, replays_ = 0, updates_ = 0;
};

}  // namespace efim::kernels::device
