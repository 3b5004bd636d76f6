#pragma once
// Continuous batching with chunked prefill: each step takes one token of every decoding sequence,
// then prompt chunks of the sequences still in prefill, then admits waiting sequences while the
// step's token budget and the KV cache allow.
#include <algorithm>
#include <cstddef>
#include <deque>
#include <vector>

#include "efim/cache/concepts.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/engine/request.hpp"

namespace efim::engine {

struct scheduler_options {
  std::size_t max_batch_tokens = 256;  // tokens computed per step (decode tokens always fit)
  std::size_t max_running = 64;        // sequences holding KV blocks at once
};

// A sequence through its life; `Payload` is what the pipeline keeps beside it.
template <class CacheSequence, class Payload>
struct sequence {
  request_id id = 0;
  std::vector<token_id> tokens;  // prompt, then generated tokens
  std::size_t prompt_tokens = 0;
  std::size_t reserve = 0;   // prompt + max new tokens: the blocks it is admitted with
  std::size_t computed = 0;  // tokens whose KV is written
  cache::extra_keys keys;
  bool lookup = true;  // false: its prompt is computed in full, whatever the cache holds
  CacheSequence blocks;
  bool done = false;
  Payload payload;
};

// Which tokens of which running sequence a step computes: tokens [start, start + count).
struct slice {
  std::size_t seq = 0;  // index into running()
  std::size_t start = 0;
  std::size_t count = 0;
};

template <class Cache, class Payload>
class scheduler {
 public:
  using sequence_type = sequence<typename Cache::sequence, Payload>;

  explicit scheduler(scheduler_options options) : options_(options) {
    require(options.max_batch_tokens > 0 && options.max_running > 0, errc::invalid_argument,
            "scheduler: max_batch_tokens and max_running must be positive");
  }

  void enqueue(sequence_type&& s) { waiting_.push_back(std::move(s)); }

  // Picks this step's work, admitting waiting sequences into `cache` (oldest first; a sequence
  // that does not fit now waits, and so do those behind it). `on_admit` sees each sequence as it is
  // admitted, and may find more of its prompt's KV elsewhere (raising `computed`).
  std::vector<slice> schedule(Cache& cache) {
    return schedule(cache, [](sequence_type&) {});
  }
  template <class OnAdmit>
  std::vector<slice> schedule(Cache& cache, OnAdmit&& on_admit) {
    std::vector<slice> out;
    std::size_t budget = options_.max_batch_tokens;
    // Decoding sequences: one token each, whatever the budget.
    for (std::size_t i = 0; i < running_.size(); ++i) {
      const auto& s = running_[i];
      if (!s.done && s.computed >= s.prompt_tokens && s.computed < s.tokens.size()) {
        out.push_back({i, s.computed, 1});
        budget -= std::min<std::size_t>(budget, 1);
      }
    }
    // Sequences in prefill, oldest first.
    for (std::size_t i = 0; i < running_.size() && budget > 0; ++i) {
      const auto& s = running_[i];
      if (s.done || s.computed >= s.prompt_tokens) continue;
      const std::size_t n = std::min(budget, s.prompt_tokens - s.computed);
      out.push_back({i, s.computed, n});
      budget -= n;
    }
    // Admissions.
    while (budget > 0 && !waiting_.empty() && running_.size() < options_.max_running) {
      auto& s = waiting_.front();
      const auto plan = cache.plan(s.tokens, s.reserve, s.keys, s.lookup);
      if (!plan.fits) break;
      s.blocks = cache.admit(plan);
      s.computed = plan.hit_tokens;
      running_.push_back(std::move(s));
      waiting_.pop_front();
      auto& r = running_.back();
      on_admit(r);
      const std::size_t n = std::min(budget, r.prompt_tokens - r.computed);
      out.push_back({running_.size() - 1, r.computed, n});
      budget -= n;
    }
    return out;
  }

  // Drops finished sequences (after their blocks were released).
  void remove_done() {
    std::erase_if(running_, [](const sequence_type& s) { return s.done; });
  }

  [[nodiscard]] std::vector<sequence_type>& running() noexcept { return running_; }
  [[nodiscard]] std::deque<sequence_type>& waiting() noexcept { return waiting_; }
  [[nodiscard]] const std::vector<sequence_type>& running() const noexcept { return running_; }
  [[nodiscard]] const std::deque<sequence_type>& waiting() const noexcept { return waiting_; }
  [[nodiscard]] bool idle() const noexcept { return running_.empty() && waiting_.empty(); }
  [[nodiscard]] const scheduler_options& options() const noexcept { return options_; }

 private:
  scheduler_options options_;
  std::deque<sequence_type> waiting_;
  std::vector<sequence_type> running_;
};

}  // namespace efim::engine
