#pragma once
// CUDA graphs of repeated work: `work` (a function that enqueues kernels and copies on a stream, with
// no host synchronization and no allocation by cudaMalloc) is captured once per key and then replayed
// with one launch, where running it again would cost a launch per kernel. A key names everything the
// enqueued work depends on that is not read from device memory at run time: sizes, grid shapes,
// pointers. A step whose key was seen replays the graph captured then; a new key is captured (on the
// calling thread's stream, cudaStreamCaptureModeThreadLocal) into a slot of a small cache, the least
// recently used one's executable graph updated in place where CUDA allows (cudaGraphExecUpdate: same
// nodes, new parameters), else instantiated anew.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <utility>
#include <vector>

#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

template <class Key>
class graph_cache {
 public:
  explicit graph_cache(std::size_t capacity = 8) : capacity_(capacity < 1 ? 1 : capacity) {}
  graph_cache(const graph_cache&) = delete;
  graph_cache& operator=(const graph_cache&) = delete;
  graph_cache(graph_cache&& o) noexcept
      : capacity_(o.capacity_), slots_(std::exchange(o.slots_, {})), clock_(o.clock_), captures_(o.captures_),
        replays_(o.replays_), updates_(o.updates_) {}
  graph_cache& operator=(graph_cache&& o) noexcept {
    if (this != &o) {
      clear();
      capacity_ = o.capacity_;
      slots_ = std::exchange(o.slots_, {});
      clock_ = o.clock_, captures_ = o.captures_, replays_ = o.replays_, updates_ = o.updates_;
    }
    return *this;
  }
  ~graph_cache() { clear(); }

  // Enqueues work's operations on `stream`: a replay of the graph captured for `key`, or a capture now
  // (work runs once, on the host, inside it) then its launch. If work throws while capturing, the
  // capture is ended and dropped and the exception goes on.
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
    cudaGraph_t graph = capture(stream, work);
    slot* target = nullptr;
    if (slots_.size() < capacity_) {
      target = &slots_.emplace_back();
    } else {
      target = &slots_.front();
      for (slot& s : slots_)
        if (s.used < target->used) target = &s;
    }
    if (target->exec != nullptr) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(target->exec, graph, &info) == cudaSuccess) {
        ++updates_;
      } else {
        (void)cudaGetLastError();  // the update's error is not sticky; the slot is instantiated anew
        (void)cudaGraphExecDestroy(target->exec);
        target->exec = nullptr;
      }
    }
    if (target->exec == nullptr) {
      const cudaError_t made = cudaGraphInstantiate(&target->exec, graph, 0);
      (void)cudaGraphDestroy(graph);
      if (made != cudaSuccess) {
        target->exec = nullptr;
        target->key = Key{};
        target->used = 0;
        slots_.erase(slots_.begin() + (target - slots_.data()));
        check(made, "cudaGraphInstantiate");
      }
    } else {
      (void)cudaGraphDestroy(graph);
    }
    target->key = key;
    target->used = clock_;
    ++captures_;
    check(cudaGraphLaunch(target->exec, stream), "cudaGraphLaunch");
  }

  // Drops every graph (the next run of any key captures again): call it when a pointer the graphs
  // hold is no longer valid and the keys would not show it.
  void clear() noexcept {
    for (slot& s : slots_)
      if (s.exec != nullptr) (void)cudaGraphExecDestroy(s.exec);
    slots_.clear();
  }

  [[nodiscard]] std::size_t captures() const noexcept { return captures_; }
  [[nodiscard]] std::size_t replays() const noexcept { return replays_; }
  [[nodiscard]] std::size_t updates() const noexcept { return updates_; }
  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }

 private:
  struct slot {
    Key key{};
    cudaGraphExec_t exec = nullptr;
    std::uint64_t used = 0;
  };

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

  std::size_t capacity_;
  std::vector<slot> slots_;
  std::uint64_t clock_ = 0;
  std::size_t captures_ = 0, replays_ = 0, updates_ = 0;
};

}  // namespace efim::kernels::device
