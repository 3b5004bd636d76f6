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

  // A session's request in flight, as the session table keeps it.
  struct in_flight {
    request_id id = 0;
    std::shared_ptr<std::atomic<bool>> superseded;  // the request's flag: set when a newer one replaces it
    friend bool operator==(const in_flight&, const in_flight&) = default;
  };

  // A request made ready to run by prepare(): checked, laid out, tokenized, and entered in its
  // session. Only enqueue() takes it.
  class prepared {
   public:
    prepared(prepared&&) noexcept = default;
    prepared& operator=(prepared&&) noexcept = default;
    [[nodiscard]] request_id id() const noexcept { return result_.id; }
    [[nodiscard]] std::size_t prompt_tokens() const noexcept { return result_.prompt_tokens; }

   private:
    friend class pipeline;
    prepared() = default;
    completion result_;  // what the completion starts from
    std::vector<token_id> tokens_;
    std::size_t max_tokens_ = 0;
    bool limited_ = false;  // max_tokens was cut to what the context has room for
    std::size_t reserve_ = 0;
    bool ignore_eos_ = false;
    bool reuse_cache_ = true;
    sampling_params sampling_;
    std::chrono::milliseconds max_generate_time_{};
    stop_rules stop_;
    std::string heal_text_;  // the text token healing removed
    std::string tenant_;
    std::uint64_t session_version_ = 0;
    std::shared_ptr<std::atomic<bool>> superseded_;  // a newer request of its session replaced it
    request_id supersedes_ = 0;                       // the older request it replaces (0: none)
    const pipeline* owner_ = nullptr;
  };

  // `weights` must outlive the pipeline; the tokenizer's ids must fit the model's vocabulary.
  pipeline(T tokenizer, const model::weights& weights, pipeline_options options = {}, E eviction = {})
      : options_(std::move(options)),
        tok_(std::move(tokenizer)),
        pool_(make_pool(options_.threads)),
        ctx_(make_context(pool_)),
        model_(make_model(weights, options_.products)),
        cache_(options_.cache, std::move(eviction)),
        kv_(weights.cfg.layers, model_.kv_layout(options_.cache.blocks, options_.cache.block_size), options_.kv_type),
        scheduler_(options_.schedule),
        sessions_(options_.sessions, options_.session),
        memo_(options_.memo) {
    require(tok_.vocab_size() <= weights.cfg.vocab, errc::invalid_argument,
            "pipeline: the tokenizer has " + std::to_string(tok_.vocab_size()) + " tokens but the model only " +
                std::to_string(weights.cfg.vocab));
    for (const auto role : {prompt::fim_role::prefix, prompt::fim_role::suffix, prompt::fim_role::middle})
      (void)prompt::special_id(tok_, options_.fim, role);  // fails now, not on the first request
    if (options_.fim.add_bos && !options_.fim.bos.empty())
      bos_ = prompt::special_id(tok_, options_.fim, prompt::fim_role::bos);
    eos_ = options_.fim.eos.empty() ? std::nullopt : tok_.special_id(options_.fim.eos);
    if (heals && options_.heal_tokens > 0) (void)heal_index();  // built now rather than in the first request
    // KV computed with int8 products is another model's: never shared with exact products' KV.
    model_key_ = weights.fingerprint ^ (options_.products == kernels::products::int8 ? 0x9e3779b97f4a7c15ull : 0);
  }

  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  // Checks a request, finds its session, lays it out and tokenizes it: everything before it can run.
  // Bad input (invalid UTF-8, a prompt or generation too long for the model or the cache, bad
  // sampling parameters) throws efim::error and changes nothing. May be called from any thread, also
  // while another thread drives the pipeline: so a server prepares requests on its handler threads
  // and the thread that runs steps only queues them. Each request is cut into pieces by a copy of
  // the pipeline's fragmenter, so its ids do not depend on other requests.
  prepared prepare(const request& r) {
    require(r.sampling.temperature >= 0.0f && r.sampling.top_p > 0.0f && r.sampling.top_p <= 1.0f,
            errc::invalid_argument, "request: temperature must be >= 0 and top_p in (0, 1]");
    require(r.max_generate_time.count() >= 0, errc::invalid_argument, "request: max_generate_time must be >= 0");
    prepared p;
    p.owner_ = this;
    p.result_.submitted = clock::now();
    p.result_.id = last_id_.fetch_add(1) + 1;
    p.max_tokens_ = r.max_tokens;
    p.ignore_eos_ = r.ignore_eos;
    p.reuse_cache_ = r.reuse_cache;
    p.sampling_ = r.sampling;
    p.max_generate_time_ = r.max_generate_time;
    p.stop_ = r.stop;
    p.tenant_ = r.tenant;
    p.superseded_ = std::make_shared<std::atomic<bool>>(false);
    if (!r.infill) {
      utf8::require_valid(r.prefix, "the prompt");
      if (bos_) p.tokens_.push_back(*bos_);
      const std::size_t cursor_begin = p.tokens_.size();
      encode_piece(r.prefix, p.tokens_);
      require(p.tokens_.size() > cursor_begin, errc::invalid_argument, "request: the prompt is empty");
      fit(r, p, cursor_begin, p.tokens_.size());
      return p;
    }
    std::vector<prompt::context_file> extra;
    for (const auto& f : r.extra) extra.push_back({f.name, f.text});
    const prompt::session_query query{.tenant = r.tenant,
                                      .key = r.session,
                                      .match = r.match_session,
                                      .prefix = r.prefix,
                                      .suffix = r.suffix,
                                      .extra = extra,
                                      .renew = r.max_tokens == 0};
    const auto turn = sessions_.apply(query, in_flight{p.id(), p.superseded_},
                                      [&](const prompt::infill_request& input) { lay_out(input, r, p); });
    p.result_.session = turn.key;
    p.result_.session_change = turn.update.kind;
    p.result_.reused_tokens = turn.update.reused_tokens;
    p.session_version_ = turn.version;
    if (turn.superseded) {
      turn.superseded->superseded->store(true);  // ends it when it is queued, if it is not yet
      p.supersedes_ = turn.superseded->id;
    }
    return p;
  }

  // Queues a prepared request on the thread that drives the pipeline; its tokens and completion go to
  // `out`. If it replaces an older request of its session, that one ends (finish_reason::superseded);
  // if a newer one replaced it before it got here, it ends so at once.
  request_id enqueue(prepared&& p, stream out) {
    require(p.owner_ == this && p.superseded_ != nullptr, errc::invalid_argument,
            "pipeline: enqueue() takes a request this pipeline prepared, once");
    const request_id id = p.id();
    const bool replaced = p.superseded_->load();
    cache::extra_keys keys;
    keys.model = model_key_;
    keys.salt = std::move(p.tenant_);
    const std::size_t prompt_tokens = p.tokens_.size();
    scheduler_.enqueue(sequence_type{
        .id = id,
        .tokens = std::move(p.tokens_),
        .prompt_tokens = prompt_tokens,
        .reserve = p.reserve_,
        .computed = 0,
        .keys = std::move(keys),
        .lookup = p.reuse_cache_,
        .blocks = {},
        .done = false,
        .payload = payload{.max_tokens = p.max_tokens_,
                           .limited = p.limited_,
                           .ignore_eos = p.ignore_eos_,
                           .sampling = p.sampling_,
                           .max_generate_time = p.max_generate_time_,
                           .random = rng(p.sampling_.seed),
                           .detok = text::detokenizer<T>(tok_),
                           .gate = text_gate(p.stop_),
                           .out = std::move(out),
                           .result = std::move(p.result_),
                           .session_version = p.session_version_,
                           .heal = text::heal_constraint(std::move(p.heal_text_)),
                           .superseded = std::move(p.superseded_)}});
    // Last, as their callbacks may submit again.
    if (replaced) end(id, finish_reason::superseded);
    if (p.supersedes_ != 0) end(p.supersedes_, finish_reason::superseded);
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
      auto& c = s.payload.result;
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
      if (s.computed == s.prompt_tokens) s.payload.result.prompt_done = now;
      if (items_[i].want_logits) {
        try {
          emit(s, sample(s, std::span(logits_).subspan(logits_row * vocab, tok_.vocab_size())));
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
  void end_session(const std::string& session, const std::string& tenant = {}) { sessions_.end(tenant, session); }

  // Where what a user callback threw ends up when its request cannot carry it (see
  // pipeline_options::on_callback_error); async_runner reports the callbacks it calls itself here.
  // Any thread; never throws.
  void callback_failed(request_id id, std::exception_ptr e) noexcept {
    callback_failures_.fetch_add(1);
    if (options_.on_callback_error) try {
        options_.on_callback_error(id, std::move(e));
      } catch (...) {  // the handler's own failure has nowhere left to go
      }
  }

  // Exceptions user callbacks threw that no completion could carry.
  [[nodiscard]] std::uint64_t callback_failures() const noexcept { return callback_failures_.load(); }

  [[nodiscard]] const cache_type& cache() const noexcept { return cache_; }
  [[nodiscard]] const T& tokenizer() const noexcept { return tok_; }
  [[nodiscard]] const model::config& model_config() const noexcept { return model_.cfg(); }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t sessions() const { return sessions_.size(); }
  [[nodiscard]] std::size_t running() const noexcept { return scheduler_.running().size(); }
  [[nodiscard]] std::size_t waiting() const noexcept { return scheduler_.waiting().size(); }
  [[nodiscard]] const text::token_memo& memo() const noexcept { return memo_; }

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
    bool limited = false;  // max_tokens was cut to what the context has room for
    bool ignore_eos = false;
    sampling_params sampling;
    std::chrono::milliseconds max_generate_time{};
    rng random{0};
    text::detokenizer<T> detok;
    text_gate gate;
    stream out;
    completion result;                // result.session: its session's key (empty: none)
    std::uint64_t session_version{};  // the session's version it was laid out from
    text::heal_constraint heal;       // token healing: the removed text the next tokens must give back
    std::shared_ptr<std::atomic<bool>> superseded;
  };
  using scheduler_type = scheduler<cache_type, payload>;
  using sequence_type = typename scheduler_type::sequence_type;

  static constexpr bool heals = !std::is_same_v<Heal, text::no_healing>;

  // The prefix index token healing reads, built once on first use (from any thread).
  const text::prefix_index& heal_index() {
    std::call_once(heal_index_built_, [&] { heal_index_.emplace(tok_); });
    return *heal_index_;
  }

  void encode_piece(std::string_view piece, std::vector<token_id>& out) { memo_.encode(tok_, piece, out); }

  // An infill request's ids from its layout input (the session's view of it), then fit(): the check
  // the session table runs before it stores the session (what throws here refuses the request).
  void lay_out(const prompt::infill_request& input, const request& r, prepared& p) {
    p.tokens_.clear();
    const auto layout = F::layout(input, options_.fim);
    std::vector<std::size_t> ends;
    G fragmenter = fragmenter_;
    prompt::encode(layout, tok_, options_.fim, fragmenter, p.tokens_,
                   [&](std::string_view piece, std::vector<token_id>& o) { encode_piece(piece, o); }, &ends);
    // Where typed text goes at the end, only that is healed: the anchor's prefix before <SUF> stays
    // as it is, so the session's next request finds it in the cache.
    std::size_t cursor_begin = 0, cursor_end = 0;  // the ids of the text before the cursor
    const std::size_t cursor = prompt::cursor_segment(layout);
    if (cursor < ends.size() && (!F::typed_at_end || cursor + 1 == ends.size())) {
      cursor_begin = cursor == 0 ? 0 : ends[cursor - 1];
      cursor_end = ends[cursor];
    }
    fit(r, p, cursor_begin, cursor_end);
  }

  // Token healing (the last tokens before the cursor that a longer token could replace go, and the
  // first generated tokens must give their text back; at least one prompt token stays), then the
  // limits of the context and the cache.
  void fit(const request& r, prepared& p, std::size_t cursor_begin, std::size_t cursor_end) {
    auto& tokens = p.tokens_;
    text::heal_cut cut;
    const std::size_t heal_most = std::min(r.heal_tokens.value_or(options_.heal_tokens), tokens.size() - 1);
    if (heals && heal_most > 0 && r.max_tokens > 0 && cursor_end > cursor_begin) {
      cut = healer_.cut(heal_index(), std::span(tokens).subspan(cursor_begin, cursor_end - cursor_begin), heal_most);
      require(cut.tokens <= heal_most && cut.tokens <= cursor_end - cursor_begin, errc::invalid_argument,
              "pipeline: the healing policy removed more tokens than it may");
      cut.text.clear();  // what the removed tokens say, whatever the policy wrote
      for (std::size_t i = cursor_end - cut.tokens; i < cursor_end; ++i) {
        require(heal_index().healable(tokens[i]), errc::invalid_argument,
                "pipeline: the healing policy removed a special token");
        cut.text += heal_index().bytes(tokens[i]);
      }
      tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(cursor_end - cut.tokens),
                   tokens.begin() + static_cast<std::ptrdiff_t>(cursor_end));
    }
    const std::size_t heal_steps = cut.text.size();  // at most one healing step per removed byte

    const std::size_t context = model_.cfg().max_context;
    std::size_t max_tokens = r.max_tokens;
    const std::size_t fixed = tokens.size() + heal_steps;  // the prompt and the healing steps
    const bool limited = r.fit_context && fixed < context && max_tokens > context - fixed;
    if (limited) max_tokens = context - fixed;
    require(fixed <= context && max_tokens <= context - fixed, errc::too_long,
            "request: " + std::to_string(tokens.size()) + " prompt tokens + " + std::to_string(max_tokens) +
                " new tokens exceed the model context of " + std::to_string(context));
    const std::size_t reserve = fixed + max_tokens;
    const std::size_t bs = options_.cache.block_size, blocks = options_.cache.blocks;
    require((reserve + bs - 1) / bs <= blocks, errc::out_of_blocks,
            "request: " + std::to_string(reserve) + " tokens need more KV blocks than the cache has (" +
                std::to_string(blocks) + " blocks of " + std::to_string(bs) + " tokens)");
    p.max_tokens_ = max_tokens;
    p.limited_ = limited;
    p.reserve_ = reserve;
    p.heal_text_ = std::move(cut.text);
    p.result_.prompt_tokens = tokens.size();
    p.result_.healed_tokens = cut.tokens;
  }

  token_id sample(sequence_type& s, std::span<const float> logits) {
    const auto& p = s.payload.sampling;
    if (s.payload.heal.active()) {  // only tokens that agree with the removed text; never EOS
      if (p.temperature <= 0.0f) {
        const token_id best = s.payload.heal.argmax(heal_index(), logits);
        if (best >= 0) return best;
      } else {
        s.payload.heal.allowed(heal_index(), allowed_);
        if (!allowed_.empty())
          return kernels::sample_among(logits, allowed_, p.temperature, p.top_k, p.top_p, s.payload.random.uniform(),
                                       gathered_, scratch_);
      }
      // No token continues the rest (impossible where every byte is a token, as in byte-level BPE):
      // healing ends, and generation goes on unconstrained.
      s.payload.heal = {};
    }
    if (p.temperature <= 0.0f) return kernels::argmax(logits);
    return kernels::sample(logits, p.temperature, p.top_k, p.top_p, s.payload.random.uniform(), scratch_);
  }

  void emit(sequence_type& s, token_id t) {
    auto& c = s.payload.result;
    if (eos_ && t == *eos_ && !s.payload.ignore_eos) return finish(s, finish_reason::eos);
    const auto now = clock::now();
    if (c.tokens.empty()) c.first_token = now;
    c.tokens.push_back(t);
    s.tokens.push_back(t);
    piece_.clear();
    if (s.payload.heal.active()) {  // the client has the removed text: only what follows it goes on
      const std::string_view bytes = tok_.token_bytes(t);
      const std::size_t given_back = s.payload.heal.take(heal_index(), t);
      if (given_back == bytes.size()) {
        ++c.healing_steps;
        return;  // nothing new for the client, and not counted in max_tokens
      }
      s.payload.detok.push_bytes(bytes.substr(given_back), piece_);
    } else {
      s.payload.detok.push(t, piece_);
    }
    shown_.clear();
    const auto verdict = s.payload.gate.push(piece_, shown_);
    c.text += shown_;
    // The callback may cancel this or another request; what it throws ends this one.
    if (s.payload.out.on_token) try {
        s.payload.out.on_token({s.id, t, shown_, s.prompt_tokens});
      } catch (...) {
        return fail(s, std::current_exception());
      }
    if (s.done) return;
    if (verdict == text_gate::verdict::stop_string) {
      c.stop_word = s.payload.gate.matched();
      return finish(s, finish_reason::stop);
    }
    if (verdict == text_gate::verdict::indent) return finish(s, finish_reason::indent);
    if (c.tokens.size() - c.healing_steps >= s.payload.max_tokens) {
      c.truncated = s.payload.limited;
      return finish(s, finish_reason::length);
    }
    // Past the time limit, the line being written is finished (as llama.cpp's t_max_predict_ms).
    if (s.payload.max_generate_time.count() > 0 && piece_.find('\n') != std::string::npos &&
        std::chrono::duration_cast<std::chrono::milliseconds>(now - c.first_token) >= s.payload.max_generate_time)
      finish(s, finish_reason::time_limit);
  }

  // A request's own failure: it ends with the error (completion::error); once it has ended, the error
  // has nowhere to go but callback_failed().
  void fail(sequence_type& s, std::exception_ptr e) {
    if (s.done) return callback_failed(s.id, std::move(e));
    s.payload.result.error = std::move(e);
    finish(s, finish_reason::error);
  }

  void finish(sequence_type& s, finish_reason why) {
    if (s.done) return;
    auto& c = s.payload.result;
    c.tail.clear();
    if (!s.payload.gate.stopped()) {
      piece_.clear();
      s.payload.detok.flush(piece_);
      (void)s.payload.gate.push(piece_, c.tail);
      s.payload.gate.finish(c.tail);
    }
    c.text += c.tail;
    c.reason = why;
    c.finished = clock::now();
    if (!c.session.empty()) close_session_request(s);
    if (!s.blocks.table.empty()) cache_.release(s.blocks);
    s.done = true;
    if (s.payload.out.on_done) try {
        s.payload.out.on_done(std::move(c));
      } catch (...) {  // the request is over: nothing is left to end
        callback_failed(s.id, std::current_exception());
      }
  }

  // The session no longer waits for this request. What it generated is kept for the next request
  // when the format puts typed text at the end (so generated ids extend the prompt whose KV holds
  // them) and the text was seen whole; after healing, the generated ids follow a prompt without the
  // removed tokens, which is not the session's.
  void close_session_request(const sequence_type& s) {
    const auto& c = s.payload.result;
    const bool seen = c.reason == finish_reason::eos || c.reason == finish_reason::length ||
                      c.reason == finish_reason::stop || c.reason == finish_reason::indent ||
                      c.reason == finish_reason::time_limit;
    std::optional<prompt::generation_record> generated;
    if (F::typed_at_end && seen && !c.tokens.empty() && c.healed_tokens == 0)
      generated = prompt::generation_of(tok_, s.payload.session_version, c.tokens);
    sessions_.finish(c.session, in_flight{s.id, s.payload.superseded}, std::move(generated));
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
  T tok_;
  G fragmenter_;  // copied for each request
  std::unique_ptr<thread_pool> pool_;
  typename B::context ctx_;
  model::transformer<B> model_;
  cache_type cache_;
  typename B::storage kv_;
  scheduler_type scheduler_;
  prompt::session_table<in_flight> sessions_;  // with the request in flight of each session
  text::token_memo memo_;                      // shared by preparing threads
  std::optional<token_id> bos_, eos_;
  std::uint64_t model_key_ = 0;
  std::atomic<request_id> last_id_{0};
  std::atomic<std::uint64_t> callback_failures_{0};
  std::vector<model::batch_item> items_;
  std::vector<float> logits_;
  std::vector<std::pair<float, token_id>> scratch_;
  Heal healer_;
  std::once_flag heal_index_built_;
  std::optional<text::prefix_index> heal_index_;
  std::vector<token_id> allowed_;  // a healing step's allowed tokens
  std::vector<float> gathered_;    // their logits
  std::string piece_;  // the text of the token being emitted
  std::string shown_;  // what of it the stop rules let through (token_event::text views it)
};

}  // namespace efim::engine
