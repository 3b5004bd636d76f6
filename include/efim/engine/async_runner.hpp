#pragma once
// Drives a pipeline from a thread of its own, so that many client threads can submit requests,
// stream their tokens, cancel them and wait for their completions while the pipeline batches them.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/engine/request.hpp"

namespace efim::engine {

template <class Pipeline>
class async_runner {
 public:
  // Names a submission before the pipeline has seen it, so that it can be cancelled at any time.
  using ticket = std::uint64_t;

  // `p` must outlive the runner, and only the runner may drive it while it runs.
  explicit async_runner(Pipeline& p) : p_(&p), loop_([this] { run(); }) {}

  async_runner(const async_runner&) = delete;
  async_runner& operator=(const async_runner&) = delete;

  // Cancels what is still running and joins the loop.
  ~async_runner() { stop(); }

  // Queues a request whose tokens and completion go to `out`, called on the runner's thread. A
  // request the pipeline refuses, or that the runner can no longer run, completes through
  // `out.on_done` with finish_reason::error and the reason in completion::error (on the calling
  // thread when the runner has stopped).
  ticket submit(request r, stream out) {
    std::unique_lock lock(mutex_);
    const ticket t = ++last_ticket_;
    if (stopping_) {
      lock.unlock();
      fail(out, std::make_exception_ptr(error(errc::unavailable, "async_runner: stopped")));
      return t;
    }
    inbox_.emplace_back(submission{t, std::move(r), std::move(out)});
    lock.unlock();
    wake_.notify_one();
    return t;
  }

  // Queues a request; the future holds its completion, the efim::error that rejected it, or what
  // `on_token` threw. `on_token` runs on the runner's thread.
  std::future<completion> submit(request r, std::function<void(const token_event&)> on_token = {}) {
    auto promise = std::make_shared<std::promise<completion>>();
    auto future = promise->get_future();
    submit(std::move(r), stream{std::move(on_token), [promise](completion&& c) {
                                  if (c.error)
                                    promise->set_exception(c.error);
                                  else
                                    promise->set_value(std::move(c));
                                }});
    return future;
  }

  // Cancels a submission before its next step: it completes with finish_reason::cancelled (nothing,
  // if it has completed already).
  void cancel(ticket t) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      inbox_.emplace_back(cancellation{t});
    }
    wake_.notify_one();
  }

  // Runs `f(pipeline)` on the runner's thread between two steps (to read its state); the future
  // holds what it returns or throws.
  template <class F>
  auto call(F f) -> std::future<std::invoke_result_t<F&, Pipeline&>> {
    using result = std::invoke_result_t<F&, Pipeline&>;
    auto task = std::make_shared<std::packaged_task<result(Pipeline&)>>(std::move(f));
    auto future = task->get_future();
    {
      std::lock_guard lock(mutex_);
      if (stopping_) {
        std::promise<result> failed;
        failed.set_exception(std::make_exception_ptr(error(errc::unavailable, "async_runner: stopped")));
        return failed.get_future();
      }
      inbox_.emplace_back(call_request{[task](Pipeline& p) { (*task)(p); }});
    }
    wake_.notify_one();
    return future;
  }

  // Whether the loop still takes requests (not stopped, and no step has failed).
  [[nodiscard]] bool running() const {
    std::lock_guard lock(mutex_);
    return !stopping_;
  }

  // What made a step fail and the loop stop (null if none did).
  [[nodiscard]] std::exception_ptr failure() const {
    std::lock_guard lock(mutex_);
    return failure_;
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
  struct submission {
    ticket t = 0;
    request r;
    stream out;
  };
  struct cancellation {
    ticket t = 0;
  };
  struct call_request {
    std::function<void(Pipeline&)> f;
  };
  using command = std::variant<submission, cancellation, call_request>;

  static void fail(stream& out, std::exception_ptr why) {
    completion c;
    c.reason = finish_reason::error;
    c.error = std::move(why);
    if (out.on_done) out.on_done(std::move(c));
  }

  void run() {
    bool busy = false;
    std::exception_ptr failure;
    std::vector<command> arrived;
    for (;;) {
      arrived.clear();
      bool stop = false;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return busy || stopping_ || !inbox_.empty(); });
        arrived.swap(inbox_);
        stop = stopping_;
      }
      if (stop) break;
      for (auto& a : arrived) std::visit([this](auto& c) { handle(c); }, a);
      arrived.clear();
      try {
        busy = p_->step();
      } catch (...) {
        // A failure of the whole batch (a request's own failure completes just that request): the
        // pipeline is in no state to go on, so every waiting client, and every client whose
        // request arrived during the failed step, gets the error.
        failure = std::current_exception();
        std::lock_guard lock(mutex_);
        stopping_ = true;
        failure_ = failure;
        arrived.swap(inbox_);
        break;
      }
    }
    const auto why = failure ? failure : std::make_exception_ptr(error(errc::unavailable, "async_runner: stopped"));
    for (auto& a : arrived) {
      if (auto* s = std::get_if<submission>(&a)) fail(s->out, why);
      if (auto* c = std::get_if<call_request>(&a)) c->f(*p_);  // reads state; the pipeline is still there
    }
    // Completes what is left: with the error when the loop failed, else as cancelled. Either way its
    // KV blocks go back, so the pipeline holds nothing that points into this runner.
    std::vector<request_id> unfinished;
    for (const auto& [t, id] : live_) unfinished.push_back(id);
    if (failure) {
      for (auto& [id, done] : done_) {
        stream out{{}, std::move(done)};
        fail(out, failure);
      }
      done_.clear();
    }
    for (const request_id id : unfinished) p_->cancel(id);
  }

  void handle(submission& s) {
    const ticket t = s.t;
    auto on_done = std::move(s.out.on_done);
    stream out{std::move(s.out.on_token), [this, t](completion&& c) {
                 live_.erase(t);
                 const auto it = done_.find(c.id);
                 if (it == done_.end()) return;
                 auto done = std::move(it->second);
                 done_.erase(it);
                 if (done) done(std::move(c));
               }};
    request_id id = 0;
    try {
      id = p_->submit(s.r, std::move(out));  // completes older requests (superseded), never this one
    } catch (...) {
      stream refused{{}, std::move(on_done)};
      fail(refused, std::current_exception());
      return;
    }
    done_.emplace(id, std::move(on_done));
    live_.emplace(t, id);
  }

  void handle(cancellation& c) {
    if (const auto it = live_.find(c.t); it != live_.end()) p_->cancel(it->second);
  }

  void handle(call_request& c) { c.f(*p_); }

  Pipeline* p_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<command> inbox_;
  bool stopping_ = false;
  std::exception_ptr failure_;
  ticket last_ticket_ = 0;
  // Touched by the loop thread only.
  std::unordered_map<ticket, request_id> live_;
  std::unordered_map<request_id, std::function<void(completion&&)>> done_;  // each live request's on_done
  std::thread loop_;                                                        // last: starts after everything it uses
};

}  // namespace efim::engine
