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
#include <future>
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
#include "efim/cache/remote.hpp"
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
#include "efim/kernels/isa.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/model/batch.hpp"
#include "efim/model/weights.hpp"
#if !defined(__CUDACC__)
// The host backend's decoder. nvcc does not compile the host kernels' instruction-set paths: a CUDA
// translation unit includes efim/cuda.cuh (the CUDA backend's decoder) before this header instead.
#include "efim/model/decode_tuning.hpp"
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
  // How the matrix products multiply quantized weights (kernels::products: int8 rounds activations to
  // 8 bits, as llama.cpp does; efim-server and efim-cli default to it): on the host every product, on
  // the CUDA backend the decode steps' (up to 8 rows). A backend without the option takes exact only.
  kernels::products products = kernels::products::exact;
  // On the host backend, time both kinds of one-row decode tiles over the model's matrices of each type
  // that has the choice, once per type and process, and keep the vendor's kind unless the other is more
  // than 3% faster (model/decode_tuning.hpp; the same bits either way). It reads up to 256 MiB of the
  // matrices, or twice the last-level cache where that is more, seven times (tens to hundreds of
  // milliseconds; the first pass pages in a mapped file's part) and selects kinds process-wide while it
  // runs. A type whose matrices hold fewer bytes than tune_decode_min_bytes is not timed.
  bool tune_decode_tiles = true;
  std::size_t tune_decode_min_bytes = std::size_t{16} << 20;
  // Called with what a stream's on_done threw (or its on_token, once its request had ended already):
  // the request is over, so nothing else can carry it. Called on the thread that ran the callback (the
  // engine's, or one that submitted to an async_runner), so possibly on several at once; what it throws
  // is dropped. Unset: only counted (pipeline::callback_failures()).
  std::function<void(request_id, std::exception_ptr)> on_callback_error;
  // A shared KV tier (cache/remote.hpp; not owned, it must outlive the pipeline): full blocks of a
  // prompt the local cache misses are looked for there, off the engine thread, before the request is
  // admitted, and used only when their values verify; full blocks computed here are stored there
  // behind the request. Sessions are kept there too (preparer_options::remote), so a replica lays out
  // a session's next request as the one that served it before. Empty: none. Needs a backend whose KV
  // storage exports blocks (the host's).
  cache::remote_tier_ref remote;
  std::string remote_prefix = "efim:kv:";  // the store's keys begin so
};

// What a pipeline did with its shared KV tier.
struct remote_use {
  std::uint64_t lookups = 0;         // requests whose missing blocks were asked for
  std::uint64_t asked_blocks = 0;    // blocks asked for
  std::uint64_t found_blocks = 0;    // of which the store had, verified
  std::uint64_t refused_blocks = 0;  // values refused (another model, tenant, prefix, shape; damaged)
  std::uint64_t used_blocks = 0;     // blocks whose KV came from the store (not computed)
  std::uint64_t stored_blocks = 0;   // blocks handed to the store
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
                               .heal_tokens = options_.heal_tokens,
                               .remote = options_.remote},
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
    shape_ = remote_shape();
    require(!options_.remote || exports_blocks, errc::invalid_argument,
            "pipeline: a shared KV tier needs a backend whose KV storage exports blocks (the host backend's)");
#if !defined(__CUDACC__)
    if constexpr (uses_pool)
      if (options_.tune_decode_tiles)
        decode_tuning_ =
            model::tune_decode_tiles(*pool_, weights, options_.products, {.min_bytes = options_.tune_decode_min_bytes});
#endif
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
    queue(sequence_type{.id = id,
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
                                           .superseded = std::move(superseded),
                                           .shared = {}}});
    // Last, as their callbacks may submit again.
    if (replaced) end(id, finish_reason::superseded);
    if (supersedes != 0) end(supersedes, finish_reason::superseded);
    return id;
  }

  // Queues a request: prepare() then enqueue(), on the thread that drives the pipeline.
  request_id submit(const request& r, stream out) { return enqueue(prepare(r), std::move(out)); }

  // Runs one batch. Returns false when there is nothing left to do.
  bool step() {
    if (!fetching_.empty()) take_fetched();
    scheduler_.remove_done();  // sequences cancelled between steps
    auto slices = scheduler_.schedule(cache_, [this](sequence_type& s) { import_remote(s); });
    if (slices.empty()) {
      if (fetching_.empty()) return !scheduler_.idle();
      (void)fetching_.front().values.wait_for(std::chrono::milliseconds(1));  // nothing to compute meanwhile
      return true;
    }
    auto& running = scheduler_.running();
    items_.clear();
    const auto start = clock::now();
    for (const auto& sl : slices) {
      auto& s = running[sl.seq];
      auto& c = s.payload.gen.result();
      if (c.started == clock::time_point{}) {
        c.started = start;
        c.cached_tokens = s.blocks.hit_tokens + s.payload.shared.tokens;  // from this cache or the shared tier
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
      if (options_.remote) store_remote(s);
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
  [[nodiscard]] std::size_t waiting() const noexcept { return scheduler_.waiting().size() + fetching_.size(); }
  [[nodiscard]] const remote_use& remote_stats() const noexcept { return remote_use_; }
  // The decode tiles timed when the pipeline started (options().tune_decode_tiles; empty where none was).
  [[nodiscard]] const std::vector<kernels::decode_tiles_timing>& decode_tuning() const noexcept {
    return decode_tuning_;
  }
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

  // A sequence's blocks in the shared KV tier: their keys there (from `root`, extended as it goes),
  // the verified values of blocks [first, ...) until it is admitted, and the blocks not to store again.
  struct shared_blocks {
    cache::hash128 root{};
    std::vector<cache::hash128> chain;
    std::vector<std::string> values;
    std::size_t first = 0;
    std::size_t tokens = 0;  // prompt tokens whose KV came from the store
    std::size_t stored = 0;
  };

  struct payload {
    std::size_t max_tokens = 0;
    sampling_params sampling;
    rng random{0};
    generation<T> gen;                // its tokens' way to the client, and its completion
    std::uint64_t session_version{};  // the session's version it was laid out from
    std::shared_ptr<std::atomic<bool>> superseded;
    shared_blocks shared;
  };
  using scheduler_type = scheduler<cache_type, payload>;
  using sequence_type = typename scheduler_type::sequence_type;

  // A request whose missing blocks are being asked of the shared KV tier.
  struct fetching {
    sequence_type seq;
    std::future<std::vector<std::optional<std::string>>> values;  // of blocks [seq.payload.shared.first, ...)
  };

  static constexpr bool exports_blocks =
      requires(typename B::storage & st, block_id b, std::span<std::byte> out, std::span<const std::byte> in) {
    st.export_block(b, out);
    st.import_block(b, in);
  };

  // ---- the shared KV tier ----

  cache::block_shape remote_shape() const {
    const auto& c = model_.cfg();
    return {static_cast<std::uint32_t>(c.layers), static_cast<std::uint32_t>(c.kv_heads),
            static_cast<std::uint32_t>(c.head_dim()), static_cast<std::uint32_t>(options_.cache.block_size),
            options_.kv_type};
  }

  // The keys of its first `blocks` blocks.
  void extend_chain(sequence_type& s, std::size_t blocks) const {
    auto& p = s.payload.shared;
    const std::size_t bs = options_.cache.block_size;
    for (std::size_t i = p.chain.size(); i < blocks; ++i)
      p.chain.push_back(cache::remote_chain(i == 0 ? p.root : p.chain[i - 1], std::span(s.tokens).subspan(i * bs, bs)));
  }

  // To the scheduler; first, where the shared KV tier may have full blocks of its prompt that the
  // local cache does not, they are asked for on a thread of their own (take_fetched() then queues it).
  void queue(sequence_type&& s) {
    if (options_.remote && options_.cache.reuse) {
      s.payload.shared.root = cache::remote_root(s.keys, shape_);
      const std::size_t full = s.lookup ? (s.prompt_tokens - 1) / options_.cache.block_size : 0;
      std::size_t local = full;
      if (full > 0) try {
          local = cache_.plan(s.tokens, s.reserve, s.keys, true).hits.size();
        } catch (const error&) {  // it can never fit: the scheduler says so
        }
      if (local < full) {
        extend_chain(s, full);
        std::vector<std::string> keys;
        for (std::size_t i = local; i < full; ++i)
          keys.push_back(cache::remote_key(options_.remote_prefix, s.payload.shared.chain[i]));
        ++remote_use_.lookups;
        remote_use_.asked_blocks += keys.size();
        s.payload.shared.first = local;
        auto values = std::async(std::launch::async,
                                 [tier = options_.remote, keys = std::move(keys)] { return tier.fetch(keys); });
        fetching_.push_back({std::move(s), std::move(values)});
        return;
      }
    }
    scheduler_.enqueue(std::move(s));
  }

  // Queues the requests whose blocks came back: each keeps the values that verify, in order, up to
  // the first that is missing or refused.
  void take_fetched() {
    const std::size_t bs = options_.cache.block_size;
    for (auto it = fetching_.begin(); it != fetching_.end();) {
      if (it->values.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        ++it;
        continue;
      }
      std::vector<std::optional<std::string>> values;
      try {
        values = it->values.get();
      } catch (...) {  // the store's own failure: nothing found
      }
      auto s = std::move(it->seq);
      it = fetching_.erase(it);
      if (s.done) continue;  // cancelled meanwhile
      auto& p = s.payload.shared;
      for (std::size_t k = 0; k < values.size() && values[k]; ++k) {
        const std::size_t i = p.first + k;
        const cache::block_identity want{p.root, i == 0 ? p.root : p.chain[i - 1], shape_,
                                         std::span(s.tokens).subspan(i * bs, bs)};
        if (cache::read_block(*values[k], want).why != cache::refusal::none) {
          ++remote_use_.refused_blocks;
          break;
        }
        p.values.push_back(std::move(*values[k]));
      }
      remote_use_.found_blocks += p.values.size();
      scheduler_.enqueue(std::move(s));
    }
  }

  // At admission: the blocks from the store that the local cache still lacks become its KV.
  void import_remote(sequence_type& s) {
    auto& p = s.payload.shared;
    const std::size_t bs = options_.cache.block_size;
    if constexpr (exports_blocks) {
      const std::size_t have = s.computed / bs, end = p.first + p.values.size();
      if (!p.values.empty() && p.first <= have && end > have) {  // continues what is cached here
        for (std::size_t i = have; i < end; ++i) {
          const std::string& v = p.values[i - p.first];
          kv_.import_block(s.blocks.table[i], std::as_bytes(std::span(v)).last(shape_.bytes()));
        }
        p.tokens = (end - have) * bs;
        remote_use_.used_blocks += end - have;
        s.computed = end * bs;
        cache_.commit(s.blocks, s.tokens, s.computed);
      }
    }
    p.values.clear();
    p.values.shrink_to_fit();
    p.stored = s.computed / bs;  // cached here, or had from the store: not stored again
  }

  // Behind the request: its full blocks computed since the last call go to the store.
  void store_remote(sequence_type& s) {
    if constexpr (exports_blocks) {
      auto& p = s.payload.shared;
      const std::size_t bs = options_.cache.block_size, full = s.computed / bs;
      if (full <= p.stored || !options_.cache.reuse) return;
      extend_chain(s, full);
      block_bytes_.resize(shape_.bytes());
      for (std::size_t i = p.stored; i < full; ++i) {
        kv_.export_block(s.blocks.table[i], block_bytes_);
        const cache::block_identity id{p.root, i == 0 ? p.root : p.chain[i - 1], shape_,
                                       std::span(s.tokens).subspan(i * bs, bs)};
        options_.remote.store(cache::remote_key(options_.remote_prefix, p.chain[i]),
                              cache::write_block(id, block_bytes_));
        ++remote_use_.stored_blocks;
      }
      p.stored = full;
    }
  }

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
    for (auto& f : fetching_)
      if (f.seq.id == id && !f.seq.done) {
        finish(f.seq, why);  // dropped when its fetch returns
        return true;
      }
    return false;
  }

  pipeline_options options_;
  preparer_type prep_;
  std::unique_ptr<thread_pool> pool_;
  std::vector<kernels::decode_tiles_timing> decode_tuning_;
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
  cache::block_shape shape_;       // a block's KV, for the shared tier
  std::vector<fetching> fetching_;
  remote_use remote_use_;
  std::vector<std::byte> block_bytes_;
};

}  // namespace efim::engine
