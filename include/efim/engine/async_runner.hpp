#pragma once
// Drives a pipeline from a thread of its own, so that many client threads can submit requests
// and wait for their completions while the pipeline batches them.
#include <condition_variable>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/engine/request.hpp"

namespace efim::engine {

template <class Pipeline>
class async_runner {
 public:
  // `p` must outlive the runner, and only the runner may drive it while it runs.
  explicit async_runner(Pipeline& p) : p_(&p), loop_([this] { run(); }) {}

  async_runner(const async_runner&) = delete;
  async_runner& operator=(const async_runner&) = delete;

  // Cancels what is still running and joins the loop.
  ~async_runner() { stop(); }

  // Queues a request; the future holds its completion, or the efim::error that rejected it.
  // `on_token` runs on the runner's thread.
  std::future<completion> submit(request r, std::function<void(const token_event&)> on_token = {}) {
    std::promise<completion> promise;
    auto future = promise.get_future();
    {
      std::lock_guard lock(mutex_);
      if (stopping_) {
        promise.set_exception(std::make_exception_ptr(error(errc::invalid_argument, "async_runner: stopped")));
        return future;
      }
      inbox_.push_back({std::move(r), std::move(on_token), std::move(promise)});
    }
    wake_.notify_one();
    return future;
  }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    wake_.notify_one();
    if (loop_.joinable()) loop_.join();
  }

 private:
  struct pending {
    request r;
    std::function<void(const token_event&)> on_token;
    std::promise<completion> promise;
  };

  void run() {
    bool busy = false;
    for (;;) {
      std::vector<pending> arrived;
      bool stop = false;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return busy || stopping_ || !inbox_.empty(); });
        arrived.swap(inbox_);
        stop = stopping_;
      }
      if (stop) {
        for (auto& a : arrived)
          a.promise.set_exception(std::make_exception_ptr(error(errc::invalid_argument, "async_runner: stopped")));
        break;
      }
      for (auto& a : arrived) admit(std::move(a));
      try {
        busy = p_->step();
      } catch (...) {
        // The pipeline is in no state to go on: every waiting client gets the error.
        for (auto& [id, promise] : promises_) promise.set_exception(std::current_exception());
        promises_.clear();
        std::lock_guard lock(mutex_);
        stopping_ = true;
        break;
      }
    }
    std::vector<request_id> unfinished;
    for (const auto& [id, promise] : promises_) unfinished.push_back(id);
    for (const request_id id : unfinished) p_->cancel(id);  // completes them as cancelled
  }

  void admit(pending&& a) {
    try {
      stream out{std::move(a.on_token), [this](completion&& c) {
                   const auto it = promises_.find(c.id);
                   if (it == promises_.end()) return;
                   it->second.set_value(std::move(c));
                   promises_.erase(it);
                 }};
      const request_id id = p_->submit(a.r, std::move(out));
      promises_.emplace(id, std::move(a.promise));
    } catch (...) {
      a.promise.set_exception(std::current_exception());
    }
  }

  Pipeline* p_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<pending> inbox_;
  bool stopping_ = false;
  std::unordered_map<request_id, std::promise<completion>> promises_;  // touched by the loop thread only
  std::thread loop_;                                                   // last: starts after everything it uses
};

}  // namespace efim::engine
