#pragma once
// The assembled pipeline: request -> session -> format -> tokens -> prefix cache -> scheduler ->
// model -> sampler -> detokenizer. One type, built from the policies:
//
//   using pipeline = efim::engine::pipeline<efim::prompt::efim_format, efim::cache::xxh3_128_chain,
//                                           efim::cache::lru, efim::text::at_boundaries,
//                                           efim::kernels::host>;
//
// A pipeline is driven by one thread: submit() requests, call step() until it returns false. A
// request's preparation (checks, session, layout, tokens) may run on any thread: prepare() there,
// then enqueue() on the driving thread. engine::async_runner drives one from a thread of its own for
// concurrent clients, and prepares each request on the thread that submits it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
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
#include "efim/engine/preparation.hpp"
#include "efim/engine/request.hpp"
#include "efim/engine/scheduler.hpp"
#include "efim/engine/stop_rules.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/model/batch.hpp"
#include "efim/model/weights.hpp"
#if !defined(__CUDACC__)
// The host backend's decoder. nvcc does not compile the host kernels' instruction-set paths: a CUDA
// translation unit includes efim/cuda.cuh (the CUDA backend's decoder) before this header instead.
#include "efim/model/transformer.hpp"
#endif
#include "efim/prompt/concepts.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/session.hpp"
#include "efim/prompt/session_table.hpp"
#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/detokenizer.hpp"
#include "efim/text/healing.hpp"
#include "efim/text/token_memo.hpp"

namespace efim::engine {

struct pipeline_options {
  prompt::fim_token_set fim = prompt::qwen25_coder;
  cache::manager_options cache{};
  scheduler_options schedule{};
  prompt::session_options session{};
  prompt::session_table_options sessions{};  // how many sessions are kept; how keyless requests find theirs
  text::token_memo_options memo{};           // long pieces of text tokenized once across requests
  dtype kv_type = dtype::f32;                // KV cache elements: f32, or f16 for half the memory
  // Token healing (text/healing.hpp): at most this many tokens at the end of the text before the
  // cursor are removed and generated again under a constraint (0: off); a request may override it.
  std::size_t heal_tokens = 0;
  // The host backend's compute threads, the driving thread included (0: all cores); a backend whose
  // context takes no thread pool (CUDA) starts none.
  std::size_t threads = 0;
  // How the host backend's matrix products multiply (kernels::products: int8 rounds activations to 8
  // bits for k-quant weights, as llama.cpp does); another backend takes exact only.
  kernels::products products = kernels::products::exact;
  // Called with what a stream's on_done threw (or its on_token, once its request had ended already):
  // the request is over, so nothing else can carry it. Called on the thread that ran the callback (the
  // engine's, or one that submitted to an async_runner), so possibly on several at once; what it throws
  // is dropped. Unset: only counted (pipeline::callback_failures()).
  std::function<void(request_id, std::exception_ptr)> on_callback_error;
};

template <prompt::fim_format F, cache::block_hasher H, cache::eviction_policy E, text::fragmenter G, kernels::backend B,
          text::tokenizer T = text::byte_tokenizer, cache::tick_clock C = cache::logical_clock,
          text::healing_policy Heal = text::heal_trailing>
  requires std::copy_constructible<G>
class pipeline {
 public:
  using format = F;
  using cache_type = cache::manager<H, E, C>;
  using tokenizer_type = T;
  using preparer_type = request_preparer<F, G, T, Heal>;
  // A request made ready to run by prepare(); only enqueue() takes it.
  using prepared = prepared_request;

  // `weights` must outlive the pipeline; the tokenizer's ids must fit the model's vocabulary.
  pipeline(T tokenizer, const model::weights& weights, pipeline_options options = {}, E eviction = {})
      : options_(std::move(options)),
        prep_(std::move(tokenizer),
              preparer_options{.fim = options_.fim,
                               .session = options_.session,
                               .sessions = options_.sessions,
                               .memo = options_.memo,
                               .heal_tokens = options_.heal_tokens},
              preparation_limits{.context = weights.cfg.max_context,
                                 .block_size = options_.cache.block_size,
                                 .blocks = options_.cache.blocks}),
        pool_(make_pool(options_.threads)),
        ctx_(make_context(pool_)),
        model_(make_model(weights, options_.products)),
        cache_(options_.cache, std::move(eviction)),
        kv_(weights.cfg.layers, model_.kv_layout(options_.cache.blocks, options_.cache.block_size), options_.kv_type),
        scheduler_(options_.schedule),
        callback_errors_(options_.on_callback_error) {
    require(prep_.tokenizer().vocab_size() <= weights.cfg.vocab, errc::invalid_argument,
            "pipeline: the tokenizer has " + std::to_string(prep_.tokenizer().vocab_size()) +
                " tokens but the model only " + std::to_string(weights.cfg.vocab));
    // KV computed with int8 products is another model's: never shared with exact products' KV.
    model_key_ = weights.fingerprint ^ (options_.products == kernels::products::int8 ? 0x9e3779b97f4a7c15ull : 0);
  }

  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  // Checks a request, finds its session, lays it out and tokenizes it: everything before it can run
  // (request_preparer::prepare). Bad input throws efim::error and changes nothing. May be called from
  // any thread, also while another thread drives the pipeline: so a server prepares requests on its
  // handler threads and the thread that runs steps only queues them.
  prepared prepare(const request& r) { return prep_.prepare(r); }

  // Queues a prepared request on the thread that drives the pipeline; its tokens and completion go to
  // `out`. If it replaces an older request of its session, that one ends (finish_reason::superseded);
  // if a newer one replaced it before it got here, it ends so at once.
  request_id enqueue(prepared&& p, stream out) {
    require(prep_.made(p) && p.superseded != nullptr, errc::invalid_argument,
            "pipeline: enqueue() takes a request this pipeline prepared, once");
    const request_id id = p.id();
    const bool replaced = p.superseded->load();
    const request_id supersedes = p.supersedes;
    cache::extra_keys keys;
    keys.model = model_key_;
    keys.salt = std::move(p.tenant);
    const std::size_t prompt_tokens = p.tokens.size();
    const std::size_t reserve = p.reserve, max_tokens = p.max_tokens;
    const bool lookup = p.reuse_cache;
    const std::uint64_t version = p.session_version;
    const sampling_params sampling = p.sampling;
    auto superseded = std::move(p.superseded);
    std::vector<token_id> tokens = std::move(p.tokens);
    scheduler_.enqueue(sequence_type{.id = id,
                                     .tokens = std::move(tokens),
                                     .prompt_tokens = prompt_tokens,
                                     .reserve = reserve,
                                     .computed = 0,
                                     .keys = std::move(keys),
                                     .lookup = lookup,
                                     .blocks = {},
                                     .done = false,
                                     .payload = payload{.max_tokens = max_tokens,
                                                        .sampling = sampling,
                                                        .random = rng(sampling.seed),
                                                        .gen = generation<T>(prep_.tokenizer(), p, std::move(out)),
                                                        .session_version = version,
                                                        .superseded = std::move(superseded)}});
    // Last, as their callbacks may submit again.
    if (replaced) end(id, finish_reason::superseded);
    if (supersedes != 0) end(supersedes, finish_reason::superseded);
    return id;
  }

  // Queues a request: prepare() then enqueue(), on the thread that drives the pipeline.
  request_id submit(const request& r, stream out) { return enqueue(prepare(r), std::move(out)); }

  // Runs one batch. Returns false when there is nothing left to do.
  bool step() {
    scheduler_.remove_done();  // sequences cancelled between steps
    auto slices = scheduler_.schedule(cache_);
    if (slices.empty()) return !scheduler_.idle();
    auto& running = scheduler_.running();
    items_.clear();
    const auto start = clock::now();
    for (const auto& sl : slices) {
      auto& s = running[sl.seq];
      auto& c = s.payload.gen.result();
      if (c.started == clock::time_point{}) {
        c.started = start;
        c.cached_tokens = s.blocks.hit_tokens;
      }
      const bool last = sl.start + sl.count == s.tokens.size();
      items_.push_back({std::span(s.tokens).subspan(sl.start, sl.count), static_cast<position>(sl.start),
                        s.blocks.table, last && s.payload.max_tokens > 0});
    }
    model_.forward(ctx_, kv_, items_, logits_);

    const std::size_t vocab = model_.cfg().vocab;
    const auto now = clock::now();
    std::size_t row = 0;
    for (std::size_t i = 0; i < slices.size(); ++i) {
      auto& s = running[slices[i].seq];
      const std::size_t logits_row = items_[i].want_logits ? row++ : 0;
      if (s.done) continue;  // cancelled by a callback during this step
      s.computed += slices[i].count;
      cache_.commit(s.blocks, s.tokens, s.computed);
      if (s.computed == s.prompt_tokens) s.payload.gen.result().prompt_done = now;
      if (items_[i].want_logits) {
        try {
          emit(s, sample(s, std::span(logits_).subspan(logits_row * vocab, prep_.tokenizer().vocab_size())));
        } catch (...) {
          // The request's own failure (its text, say): it ends, the batch goes on.
          fail(s, std::current_exception());
        }
      } else if (s.payload.max_tokens == 0 && s.computed == s.prompt_tokens) {
        finish(s, finish_reason::length);
      }
    }
    scheduler_.remove_done();
    return !scheduler_.idle();
  }

  // Runs steps until every request is done.
  void run() {
    while (step()) {
    }
  }

  // Stops a request; its completion reports finish_reason::cancelled (its computed full blocks stay
  // cached). False if it is not known.
  bool cancel(request_id id) { return end(id, finish_reason::cancelled); }

  // Forgets an editor session (its cached KV stays until evicted). Any thread.
  void end_session(const std::string& session, const std::string& tenant = {}) { prep_.end_session(session, tenant); }

  // Where what a user callback threw ends up when its request cannot carry it (see
  // pipeline_options::on_callback_error); async_runner reports the callbacks it calls itself here.
  // Any thread; never throws.
  void callback_failed(request_id id, std::exception_ptr e) noexcept { callback_errors_.report(id, std::move(e)); }

  // Exceptions user callbacks threw that no completion could carry.
  [[nodiscard]] std::uint64_t callback_failures() const noexcept { return callback_errors_.count(); }

  [[nodiscard]] const cache_type& cache() const noexcept { return cache_; }
  [[nodiscard]] const T& tokenizer() const noexcept { return prep_.tokenizer(); }
  [[nodiscard]] const model::config& model_config() const noexcept { return model_.cfg(); }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] const preparer_options& preparation() const noexcept { return prep_.options(); }
  [[nodiscard]] std::size_t sessions() const { return prep_.sessions(); }
  [[nodiscard]] std::size_t running() const noexcept { return scheduler_.running().size(); }
  [[nodiscard]] std::size_t waiting() const noexcept { return scheduler_.waiting().size(); }
  [[nodiscard]] const text::token_memo& memo() const noexcept { return prep_.memo(); }

 private:
  static model::transformer<B> make_model(const model::weights& weights, kernels::products products) {
    if constexpr (std::is_constructible_v<model::transformer<B>, const model::weights&, kernels::products>) {
      return model::transformer<B>(weights, products);
    } else {
      require(products == kernels::products::exact, errc::invalid_argument,
              "pipeline: int8 products are a host backend option; this backend multiplies exactly");
      return model::transformer<B>(weights);
    }
  }

  // The host backend computes on a pool of threads; a backend whose context takes none gets none.
  static constexpr bool uses_pool = kernels::context_takes_pool<B>;
  static std::unique_ptr<thread_pool> make_pool(std::size_t threads) {
    if constexpr (uses_pool) return std::make_unique<thread_pool>(threads);
    return nullptr;
  }
  static typename B::context make_context(const std::unique_ptr<thread_pool>& pool) {
    if constexpr (uses_pool)
      return typename B::context{*pool};
    else
      return typename B::context{};
  }

  struct payload {
    std::size_t max_tokens = 0;
    sampling_params sampling;
    rng random{0};
    generation<T> gen;                // its tokens' way to the client, and its completion
    std::uint64_t session_version{};  // the session's version it was laid out from
    std::shared_ptr<std::atomic<bool>> superseded;
  };
  using scheduler_type = scheduler<cache_type, payload>;
  using sequence_type = typename scheduler_type::sequence_type;

  static constexpr bool heals = preparer_type::heals;

  token_id sample(sequence_type& s, std::span<const float> logits) {
    const auto& p = s.payload.sampling;
    auto& g = s.payload.gen;
    if (g.heal().active()) {  // only tokens that agree with the removed text; never EOS
      if (p.temperature <= 0.0f) {
        const token_id best = g.heal().argmax(prep_.heal_index(), logits);
        if (best >= 0) return best;
      } else {
        g.heal().allowed(prep_.heal_index(), allowed_);
        if (!allowed_.empty())
          return kernels::sample_among(logits, allowed_, p.temperature, p.top_k, p.top_p, s.payload.random.uniform(),
                                       gathered_, scratch_);
      }
      // No token continues the rest (impossible where every byte is a token, as in byte-level BPE):
      // healing ends, and generation goes on unconstrained.
      g.stop_healing();
    }
    if (p.temperature <= 0.0f) return kernels::argmax(logits);
    return kernels::sample(logits, p.temperature, p.top_k, p.top_p, s.payload.random.uniform(), scratch_);
  }

  void emit(sequence_type& s, token_id t) {
    auto& g = s.payload.gen;
    const std::size_t before = g.result().tokens.size();
    // The callback it calls may cancel this or another request.
    const auto why = g.take(t, heals ? &prep_.heal_index() : nullptr, prep_.eos());
    if (auto orphan = g.orphan()) callback_failed(s.id, std::move(orphan));
    if (s.done) return;
    if (g.result().tokens.size() > before) s.tokens.push_back(t);  // its KV comes next step
    if (why) finish(s, *why);
  }

  // A request's own failure: it ends with the error (completion::error); once it has ended, the error
  // has nowhere to go but callback_failed().
  void fail(sequence_type& s, std::exception_ptr e) {
    if (s.done) return callback_failed(s.id, std::move(e));
    s.payload.gen.result().error = std::move(e);
    finish(s, finish_reason::error);
  }

  void finish(sequence_type& s, finish_reason why) {
    if (s.done) return;
    auto& g = s.payload.gen;
    g.complete(why);
    prep_.close(g.result(), s.payload.session_version, s.payload.superseded);
    if (!s.blocks.table.empty()) cache_.release(s.blocks);
    s.done = true;
    if (auto e = g.deliver()) callback_failed(s.id, std::move(e));
  }

  bool end(request_id id, finish_reason why) {
    for (auto& s : scheduler_.running())
      if (s.id == id && !s.done) {
        finish(s, why);  // removed at the next step
        return true;
      }
    auto& waiting = scheduler_.waiting();
    for (auto it = waiting.begin(); it != waiting.end(); ++it)
      if (it->id == id) {
        auto s = std::move(*it);
        waiting.erase(it);
        finish(s, why);
        return true;
      }
    return false;
  }

  pipeline_options options_;
  preparer_type prep_;
  std::unique_ptr<thread_pool> pool_;
  typename B::context ctx_;
  model::transformer<B> model_;
  cache_type cache_;
  typename B::storage kv_;
  scheduler_type scheduler_;
  std::uint64_t model_key_ = 0;
  callback_errors callback_errors_;
  std::vector<model::batch_item> items_;
  std::vector<float> logits_;
  std::vector<std::pair<float, token_id>> scratch_;
  std::vector<token_id> allowed_;  // a healing step's allowed tokens
  std::vector<float> gathered_;    // their logits
};

}  // namespace efim::engine
