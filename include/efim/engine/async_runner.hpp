#pragma once
// Drives a pipeline from a thread of its own, so that many client threads can submit requests,
// stream their tokens, cancel them and wait for their completions while the pipeline batches them.
//
// A request is prepared (checked, matched to its session, laid out, tokenized) on the thread that
// submits it, so the engine thread only queues it between two steps: a client with a long prompt
// never stalls the decode of the others.
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/engine/request.hpp"

namespace efim::engine {

// Where requests are prepared.
enum class preparation {
  caller,  // on the thread that submits (the default)
  engine,  // on the engine thread, between steps (as a plain pipeline::submit() does; for comparison)
};

struct runner_options {
  preparation prepare = preparation::caller;
};

// What the engine thread has spent its time on.
struct runner_stats {
  std::uint64_t steps = 0;     // calls of pipeline::step()
  std::uint64_t requests = 0;  // requests the engine thread queued
  double step_ms = 0;          // in step()
  double prepare_ms = 0;       // preparing requests (preparation::engine only)
  double enqueue_ms = 0;       // queuing prepared requests

  // The share of the engine thread's busy time spent on requests rather than on steps.
  [[nodiscard]] double request_share() const noexcept {
    const double busy = step_ms + prepare_ms + enqueue_ms;
    return busy > 0 ? (prepare_ms + enqueue_ms) / busy : 0.0;
  }
};

// What the runner asks of the pipeline it drives (engine::pipeline is one).
template <class P>
concept runnable_pipeline =
    requires(P& p, const request& r, typename P::prepared&& prepared, stream out, request_id id, std::exception_ptr e) {
      { p.prepare(r) } -> std::same_as<typename P::prepared>;
      { prepared.id() } -> std::same_as<request_id>;
      { p.enqueue(std::move(prepared), std::move(out)) } -> std::same_as<request_id>;
      { p.step() } -> std::same_as<bool>;
      { p.cancel(id) } -> std::same_as<bool>;
      p.callback_failed(id, e);
    };

template <runnable_pipeline Pipeline>
class async_runner {
 public:
  // Names a submission before the pipeline has seen it, so that it can be cancelled at any time.
  using ticket = std::uint64_t;

  // `p` must outlive the runner, and only the runner may drive it while it runs.
  explicit async_runner(Pipeline& p, runner_options options = {})
      : p_(&p), options_(options), loop_([this] { run(); }) {
    // A pipeline whose work arrives from elsewhere (an upstream engine's answers) wakes the loop.
    if constexpr (wakes_runner) p.set_wake([this] {
        {
          std::lock_guard lock(mutex_);
          poked_ = true;
        }
        wake_.notify_one();
      });
  }

  async_runner(const async_runner&) = delete;
  async_runner& operator=(const async_runner&) = delete;

  // Cancels what is still running and joins the loop.
  ~async_runner() {
    stop();
    if constexpr (wakes_runner) p_->set_wake({});
  }

  // Prepares a request (on this thread, with preparation::caller) and queues it; its tokens and
  // completion go to `out`, called on the runner's thread. A request the pipeline refuses, or that
  // the runner can no longer run, completes through `out.on_done` with finish_reason::error and the
  // reason in completion::error (on the calling thread, when it was refused before it was queued).
  // What a callback throws ends its own request only (see stream); what on_done throws goes to
  // pipeline::callback_failed().
  ticket submit(request r, stream out) {
    std::unique_lock lock(mutex_);
    const ticket t = ++last_ticket_;
    if (stopping_) {
      lock.unlock();
      fail(out, stopped());
      return t;
    }
    lock.unlock();
    if (options_.prepare == preparation::engine) {
      push(raw_submission{t, std::move(r), std::move(out)}, out);
      return t;
    }
    std::optional<typename Pipeline::prepared> prepared;
    try {
      prepared.emplace(p_->prepare(r));
    } catch (...) {
      fail(out, std::current_exception());
      return t;
    }
    push(submission{t, std::move(*prepared), std::move(out)}, out);
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
        failed.set_exception(stopped());
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

  [[nodiscard]] runner_stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  // Stops the loop (also after it stopped itself on an error) and joins it. Any thread, any number
  // of them at once; from a callback on the runner's thread it only asks (the loop ends after the
  // step it is in).
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (std::this_thread::get_id() == loop_.get_id()) return;
    std::lock_guard join(join_mutex_);
    if (loop_.joinable()) loop_.join();
  }

 private:
  struct submission {
    ticket t = 0;
    typename Pipeline::prepared prepared;
    stream out;
  };
  struct raw_submission {
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
  using command = std::variant<submission, raw_submission, cancellation, call_request>;
  static constexpr bool wakes_runner = requires(Pipeline& p, std::function<void()> f) { p.set_wake(std::move(f)); };
  using ms = std::chrono::duration<double, std::milli>;

  static std::exception_ptr stopped() {
    return std::make_exception_ptr(error(errc::unavailable, "async_runner: stopped"));
  }

  // Queues a submission; if the runner stopped meanwhile, `out` (what is left of it) gets the error.
  template <class Submission>
  void push(Submission&& s, stream& out) {
    {
      std::unique_lock lock(mutex_);
      if (!stopping_) {
        inbox_.emplace_back(std::forward<Submission>(s));
        lock.unlock();
        wake_.notify_one();
        return;
      }
    }
    out = std::move(s.out);
    fail(out, stopped());
  }

  // Completes a request the pipeline never ran: on_done with the error.
  void fail(stream& out, std::exception_ptr why) noexcept {
    if (!out.on_done) return;
    try {
      completion c;
      c.reason = finish_reason::error;
      c.error = std::move(why);
      out.on_done(std::move(c));
    } catch (...) {
      p_->callback_failed(0, std::current_exception());
    }
  }

  void run() {
    bool busy = false;
    std::exception_ptr failure;
    std::vector<command> arrived;
    runner_stats spent;  // since the last time the totals were published
    for (;;) {
      arrived.clear();
      bool stop = false;
      {
        std::unique_lock lock(mutex_);
        add(stats_, spent);
        spent = {};
        wake_.wait(lock, [&] { return busy || stopping_ || poked_ || !inbox_.empty(); });
        poked_ = false;
        arrived.swap(inbox_);
        stop = stopping_;
      }
      if (stop) break;
      for (auto& a : arrived) std::visit([&](auto& c) { handle(c, spent); }, a);
      arrived.clear();
      try {
        const auto start = std::chrono::steady_clock::now();
        busy = p_->step();
        spent.step_ms += ms(std::chrono::steady_clock::now() - start).count();
        ++spent.steps;
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
    {
      std::lock_guard lock(mutex_);
      add(stats_, spent);
    }
    const auto why = failure ? failure : stopped();
    for (auto& a : arrived) {
      if (auto* s = std::get_if<submission>(&a)) fail(s->out, why);
      if (auto* s = std::get_if<raw_submission>(&a)) fail(s->out, why);
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

  static void add(runner_stats& total, const runner_stats& more) {
    total.steps += more.steps;
    total.requests += more.requests;
    total.step_ms += more.step_ms;
    total.prepare_ms += more.prepare_ms;
    total.enqueue_ms += more.enqueue_ms;
  }

  void handle(raw_submission& s, runner_stats& spent) {
    const auto start = std::chrono::steady_clock::now();
    std::optional<typename Pipeline::prepared> prepared;
    try {
      prepared.emplace(p_->prepare(s.r));
    } catch (...) {
      fail(s.out, std::current_exception());
    }
    spent.prepare_ms += ms(std::chrono::steady_clock::now() - start).count();
    if (prepared) enqueue(s.t, std::move(*prepared), s.out, spent);
  }

  void handle(submission& s, runner_stats& spent) { enqueue(s.t, std::move(s.prepared), s.out, spent); }

  void enqueue(ticket t, typename Pipeline::prepared&& prepared, stream& out, runner_stats& spent) {
    const auto start = std::chrono::steady_clock::now();
    const request_id id = prepared.id();
    // Known before the pipeline sees it: enqueue() may complete it at once (superseded already).
    done_.emplace(id, std::move(out.on_done));
    live_.emplace(t, id);
    stream wrapped{std::move(out.on_token), [this, t](completion&& c) {
                     live_.erase(t);
                     const auto it = done_.find(c.id);
                     if (it == done_.end()) return;
                     auto done = std::move(it->second);
                     done_.erase(it);
                     if (done) done(std::move(c));  // what it throws, the pipeline reports
                   }};
    try {
      p_->enqueue(std::move(prepared), std::move(wrapped));
    } catch (...) {  // out of memory, say: this request alone
      live_.erase(t);
      if (const auto it = done_.find(id); it != done_.end()) {
        stream refused{{}, std::move(it->second)};
        done_.erase(it);
        fail(refused, std::current_exception());
      }
    }
    ++spent.requests;
    spent.enqueue_ms += ms(std::chrono::steady_clock::now() - start).count();
  }

  void handle(cancellation& c, runner_stats&) {
    if (const auto it = live_.find(c.t); it != live_.end()) p_->cancel(it->second);
  }

  void handle(call_request& c, runner_stats&) { c.f(*p_); }

  Pipeline* p_;
  runner_options options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<command> inbox_;
  bool stopping_ = false;
  bool poked_ = false;  // the pipeline has work that arrived from elsewhere
  std::exception_ptr failure_;
  ticket last_ticket_ = 0;
  runner_stats stats_;
  std::mutex join_mutex_;  // two threads stopping at once: one joins
  // Touched by the loop thread only.
  std::unordered_map<ticket, request_id> live_;
  std::unordered_map<request_id, std::function<void(completion&&)>> done_;  // each live request's on_done
  std::thread loop_;                                                        // last: starts after everything it uses
};

}  // namespace efim::engine
