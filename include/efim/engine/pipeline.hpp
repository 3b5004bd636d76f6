#pragma once
// The assembled pipeline: request -> session -> format -> tokens -> prefix cache -> scheduler ->
// model -> sampler -> detokenizer. One type, built from the policies:
//
//   using pipeline = efim::engine::pipeline<efim::prompt::efim, efim::cache::xxh3_128_chain,
//                                           efim::cache::lru, efim::text::at_boundaries,
//                                           efim::kernels::host>;
//
// A pipeline is driven by one thread: submit() requests, call step() until it returns false.
// engine::async_runner drives one from a thread of its own for concurrent clients.
#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/cache/clock.hpp"
#include "efim/cache/manager.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/utf8.hpp"
#include "efim/engine/request.hpp"
#include "efim/engine/scheduler.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/model/transformer.hpp"
#include "efim/prompt/concepts.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/session.hpp"
#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/detokenizer.hpp"

namespace efim::engine {

struct pipeline_options {
  prompt::fim_token_set fim = prompt::qwen25_coder;
  cache::manager_options cache{};
  scheduler_options schedule{};
  prompt::session_options session{};
  dtype kv_type = dtype::f32;       // KV cache elements: f32, or f16 for half the memory
  std::size_t threads = 0;          // compute threads, the driving thread included (0: all cores)
  std::size_t max_sessions = 4096;  // the least recently used session is dropped past this
};

template <prompt::fim_format F, cache::block_hasher H, cache::eviction_policy E, text::fragmenter G, kernels::backend B,
          text::tokenizer T = text::byte_tokenizer, cache::tick_clock C = cache::logical_clock>
class pipeline {
 public:
  using format = F;
  using cache_type = cache::manager<H, E, C>;
  using tokenizer_type = T;

  // `weights` must outlive the pipeline; the tokenizer's ids must fit the model's vocabulary.
  pipeline(T tokenizer, const model::weights& weights, pipeline_options options = {})
      : options_(options),
        tok_(std::move(tokenizer)),
        pool_(options_.threads),
        ctx_{pool_},
        model_(weights),
        cache_(options_.cache),
        kv_(weights.cfg.layers, model_.kv_layout(options_.cache.blocks, options_.cache.block_size), options_.kv_type),
        scheduler_(options_.schedule) {
    require(tok_.vocab_size() <= weights.cfg.vocab, errc::invalid_argument,
            "pipeline: the tokenizer has " + std::to_string(tok_.vocab_size()) + " tokens but the model only " +
                std::to_string(weights.cfg.vocab));
    for (const auto role : {prompt::fim_role::prefix, prompt::fim_role::suffix, prompt::fim_role::middle})
      (void)prompt::special_id(tok_, options_.fim, role);  // fails now, not on the first request
    if (options_.fim.add_bos && !options_.fim.bos.empty())
      (void)prompt::special_id(tok_, options_.fim, prompt::fim_role::bos);
    eos_ = options_.fim.eos.empty() ? std::nullopt : tok_.special_id(options_.fim.eos);
    model_key_ = weights.fingerprint;
  }

  // Queues a request. Bad input (invalid UTF-8, a prompt or generation too long for the model or
  // the cache, bad sampling parameters) throws efim::error and changes nothing.
  request_id submit(const request& r, stream out) {
    require(r.sampling.temperature >= 0.0f && r.sampling.top_p > 0.0f && r.sampling.top_p <= 1.0f,
            errc::invalid_argument, "request: temperature must be >= 0 and top_p in (0, 1]");

    // Lay out against a copy of the session, so a rejected request leaves it as it was.
    std::optional<prompt::infill_session> session;
    prompt::change change = prompt::change::first;
    prompt::infill_request layout_input;
    if (!r.session.empty()) {
      const auto it = sessions_.find(r.session);
      session = it != sessions_.end() ? it->second.session : prompt::infill_session(options_.session);
      change = session->update(r.prefix, r.suffix).kind;
      layout_input = session->request();
    } else {
      utf8::require_valid(r.prefix, "the prefix");
      utf8::require_valid(r.suffix, "the suffix");
      layout_input = {r.prefix, r.suffix, {}};
    }
    std::vector<token_id> tokens;
    prompt::encode(F::layout(layout_input, options_.fim), tok_, options_.fim, fragmenter_, tokens);

    const auto& cfg = model_.cfg();
    require(tokens.size() <= cfg.max_context && r.max_tokens <= cfg.max_context - tokens.size(), errc::too_long,
            "request: " + std::to_string(tokens.size()) + " prompt tokens + " + std::to_string(r.max_tokens) +
                " new tokens exceed the model context of " + std::to_string(cfg.max_context));
    const std::size_t reserve = tokens.size() + r.max_tokens;
    const std::size_t bs = cache_.block_size();
    require((reserve + bs - 1) / bs <= cache_.capacity(), errc::out_of_blocks,
            "request: " + std::to_string(reserve) + " tokens need more KV blocks than the cache has (" +
                std::to_string(cache_.capacity()) + " blocks of " + std::to_string(bs) + " tokens)");

    if (session) {
      sessions_.insert_or_assign(r.session, session_slot{std::move(*session), ++session_tick_});
      drop_old_sessions();
    }
    const request_id id = ++last_id_;
    completion result;
    result.id = id;
    result.session_change = change;
    result.prompt_tokens = tokens.size();
    result.submitted = clock::now();
    sequence_type s{id,
                    std::move(tokens),
                    result.prompt_tokens,
                    reserve,
                    0,
                    {model_key_, 0, r.tenant},
                    {},
                    false,
                    payload{r.max_tokens, r.ignore_eos, r.sampling, rng(r.sampling.seed), text::detokenizer<T>(tok_),
                            std::move(out), std::move(result)}};
    scheduler_.enqueue(std::move(s));
    return id;
  }

  // Runs one batch. Returns false when there is nothing left to do.
  bool step() {
    scheduler_.remove_done();  // sequences cancelled between steps
    auto slices = scheduler_.schedule(cache_);
    if (slices.empty()) return !scheduler_.idle();
    auto& running = scheduler_.running();
    items_.clear();
    for (const auto& sl : slices) {
      auto& s = running[sl.seq];
      s.payload.result.cached_tokens = s.blocks.hit_tokens;
      const bool last = sl.start + sl.count == s.tokens.size();
      items_.push_back({std::span(s.tokens).subspan(sl.start, sl.count), static_cast<position>(sl.start),
                        s.blocks.table, last && s.payload.max_tokens > 0});
    }
    model_.forward(ctx_, kv_, items_, logits_);

    const std::size_t vocab = model_.cfg().vocab;
    std::size_t row = 0;
    for (std::size_t i = 0; i < slices.size(); ++i) {
      auto& s = running[slices[i].seq];
      const std::size_t logits_row = items_[i].want_logits ? row++ : 0;
      if (s.done) continue;  // cancelled by a callback during this step
      s.computed += slices[i].count;
      cache_.commit(s.blocks, s.tokens, s.computed);
      if (items_[i].want_logits) {
        try {
          emit(s, sample(s, std::span(logits_).subspan(logits_row * vocab, tok_.vocab_size())));
        } catch (...) {
          // The request's own failure (its callback, or its text): it ends, the batch goes on.
          if (!s.done) {
            s.payload.result.error = std::current_exception();
            finish(s, finish_reason::error);
          }
        }
      } else if (s.payload.max_tokens == 0 && s.computed == s.prompt_tokens)
        finish(s, finish_reason::length);
    }
    scheduler_.remove_done();
    return !scheduler_.idle();
  }

  // Runs steps until every request is done.
  void run() {
    while (step()) {
    }
  }

  // Stops a request; its completion reports finish_reason::cancelled. False if it is not known.
  bool cancel(request_id id) {
    for (auto& s : scheduler_.running())
      if (s.id == id && !s.done) {
        finish(s, finish_reason::cancelled);  // removed at the next step
        return true;
      }
    auto& waiting = scheduler_.waiting();
    for (auto it = waiting.begin(); it != waiting.end(); ++it)
      if (it->id == id) {
        auto s = std::move(*it);
        waiting.erase(it);
        finish(s, finish_reason::cancelled);
        return true;
      }
    return false;
  }

  // Forgets an editor session (its cached KV stays until evicted).
  void end_session(const std::string& id) { sessions_.erase(id); }

  [[nodiscard]] const cache_type& cache() const noexcept { return cache_; }
  [[nodiscard]] const T& tokenizer() const noexcept { return tok_; }
  [[nodiscard]] const model::config& model_config() const noexcept { return model_.cfg(); }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t sessions() const noexcept { return sessions_.size(); }

 private:
  struct payload {
    std::size_t max_tokens = 0;
    bool ignore_eos = false;
    sampling_params sampling;
    rng random{0};
    text::detokenizer<T> detok;
    stream out;
    completion result;
  };
  using scheduler_type = scheduler<cache_type, payload>;
  using sequence_type = typename scheduler_type::sequence_type;

  struct session_slot {
    prompt::infill_session session;
    std::uint64_t used = 0;
  };

  token_id sample(sequence_type& s, std::span<const float> logits) {
    const auto& p = s.payload.sampling;
    if (p.temperature <= 0.0f) return kernels::argmax(logits);
    return kernels::sample(logits, p.temperature, p.top_k, p.top_p, s.payload.random.uniform(), scratch_);
  }

  void emit(sequence_type& s, token_id t) {
    auto& c = s.payload.result;
    if (eos_ && t == *eos_ && !s.payload.ignore_eos) return finish(s, finish_reason::eos);
    if (c.tokens.empty()) c.first_token = clock::now();
    c.tokens.push_back(t);
    s.tokens.push_back(t);
    piece_.clear();
    s.payload.detok.push(t, piece_);
    c.text += piece_;
    // The callback may cancel this or another request.
    if (s.payload.out.on_token) s.payload.out.on_token({s.id, t, piece_});
    if (!s.done && c.tokens.size() >= s.payload.max_tokens) finish(s, finish_reason::length);
  }

  void finish(sequence_type& s, finish_reason why) {
    if (s.done) return;
    auto& c = s.payload.result;
    c.tail.clear();
    s.payload.detok.flush(c.tail);
    c.text += c.tail;
    c.reason = why;
    c.finished = clock::now();
    if (!s.blocks.table.empty()) cache_.release(s.blocks);
    s.done = true;
    if (s.payload.out.on_done) s.payload.out.on_done(std::move(c));
  }

  void drop_old_sessions() {
    while (sessions_.size() > std::max<std::size_t>(options_.max_sessions, 1)) {
      auto oldest = sessions_.begin();
      for (auto it = sessions_.begin(); it != sessions_.end(); ++it)
        if (it->second.used < oldest->second.used) oldest = it;
      sessions_.erase(oldest);
    }
  }

  pipeline_options options_;
  T tok_;
  G fragmenter_;
  thread_pool pool_;
  typename B::context ctx_;
  model::transformer<B> model_;
  cache_type cache_;
  typename B::storage kv_;
  scheduler_type scheduler_;
  std::optional<token_id> eos_;
  std::uint64_t model_key_ = 0;
  request_id last_id_ = 0;
  std::unordered_map<std::string, session_slot> sessions_;
  std::uint64_t session_tick_ = 0;
  std::vector<model::batch_item> items_;
  std::vector<float> logits_;
  std::vector<std::pair<float, token_id>> scratch_;
  std::string piece_;  // the text of the token being emitted (token_event::text views it; finish() leaves it alone)
};

}  // namespace efim::engine
