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

  // Queues a request; the future holds its completion, the efim::error that rejected it, or what
  // `on_token` threw. `on_token` runs on the runner's thread.
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

  // Stops the loop (also after it stopped itself on an error) and joins it; call from the owner.
  void stop() {
    {
      std::lock_guard lock(mutex_);
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
    std::exception_ptr failure;
    std::vector<pending> arrived;
    for (;;) {
      arrived.clear();
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
        arrived.clear();
        break;
      }
      for (auto& a : arrived) admit(std::move(a));
      try {
        busy = p_->step();
      } catch (...) {
        // A failure of the whole batch (a request's own failure completes just that request): the
        // pipeline is in no state to go on, so every waiting client, and every client whose
        // request arrived during the failed step, gets the error.
        failure = std::current_exception();
        std::lock_guard lock(mutex_);
        stopping_ = true;
        arrived.clear();  // admitted already
        arrived.swap(inbox_);
        break;
      }
    }
    for (auto& a : arrived) a.promise.set_exception(failure);
    std::vector<request_id> unfinished;
    for (auto& [id, promise] : promises_) {
      unfinished.push_back(id);
      if (failure) promise.set_exception(failure);
    }
    if (failure) promises_.clear();
    // Completes what is left as cancelled (the clients see that unless they got the error) and
    // gives its KV blocks back, so the pipeline holds nothing that points into this runner.
    for (const request_id id : unfinished) p_->cancel(id);
  }

  void admit(pending&& a) {
    try {
      stream out{std::move(a.on_token), [this](completion&& c) {
                   const auto it = promises_.find(c.id);
                   if (it == promises_.end()) return;
                   if (c.error)
                     it->second.set_exception(c.error);
                   else
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
