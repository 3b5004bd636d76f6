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
  std::size_t threads = 0;                   // compute threads, the driving thread included (0: all cores)
  // How the host backend's matrix products multiply (kernels::products: int8 rounds activations to 8
  // bits for k-quant weights, as llama.cpp does); another backend takes exact only.
  kernels::products products = kernels::products::exact;
};

template <prompt::fim_format F, cache::block_hasher H, cache::eviction_policy E, text::fragmenter G, kernels::backend B,
          text::tokenizer T = text::byte_tokenizer, cache::tick_clock C = cache::logical_clock,
          text::healing_policy Heal = text::heal_trailing>
class pipeline {
 public:
  using format = F;
  using cache_type = cache::manager<H, E, C>;
  using tokenizer_type = T;

  // `weights` must outlive the pipeline; the tokenizer's ids must fit the model's vocabulary.
  pipeline(T tokenizer, const model::weights& weights, pipeline_options options = {}, E eviction = {})
      : options_(options),
        tok_(std::move(tokenizer)),
        pool_(options_.threads),
        ctx_{pool_},
        model_(make_model(weights, options_.products)),
        cache_(options_.cache, std::move(eviction)),
        kv_(weights.cfg.layers, model_.kv_layout(options_.cache.blocks, options_.cache.block_size), options_.kv_type),
        scheduler_(options_.schedule),
        sessions_(options_.sessions),
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

  // Queues a request. Bad input (invalid UTF-8, a prompt or generation too long for the model or
  // the cache, bad sampling parameters) throws efim::error and changes nothing. A request that has
  // its session's key, or continues the text of its session's request in flight, ends that one
  // (finish_reason::superseded).
  request_id submit(const request& r, stream out) {
    require(r.sampling.temperature >= 0.0f && r.sampling.top_p > 0.0f && r.sampling.top_p <= 1.0f,
            errc::invalid_argument, "request: temperature must be >= 0 and top_p in (0, 1]");
    require(r.max_generate_time.count() >= 0, errc::invalid_argument, "request: max_generate_time must be >= 0");

    // Lay out against a copy of the session, so a rejected request leaves it as it was.
    std::string key;
    std::optional<session_entry> session;
    prompt::session_update update;
    std::vector<token_id> tokens;
    std::size_t cursor_begin = 0, cursor_end = 0;  // the ids of the text before the cursor (healing)
    const auto encode_piece = [&](std::string_view piece, std::vector<token_id>& o) { memo_.encode(tok_, piece, o); };
    if (!r.infill) {
      utf8::require_valid(r.prefix, "the prompt");
      if (bos_) tokens.push_back(*bos_);
      cursor_begin = tokens.size();
      encode_piece(r.prefix, tokens);
      cursor_end = tokens.size();
      require(!tokens.empty(), errc::invalid_argument, "request: the prompt is empty");
    } else {
      std::vector<prompt::context_file> extra;
      for (const auto& f : r.extra) extra.push_back({f.name, f.text});
      prompt::infill_request layout_input{r.prefix, r.suffix, {}, {}, extra};
      key = session_key(r);
      if (!key.empty()) {
        const auto* existing = sessions_.find(key);
        session = existing != nullptr
                      ? *existing
                      : session_entry{prompt::infill_session(options_.session), {}, r.tenant, r.session.empty(), 0};
        update = session->session.update(r.prefix, r.suffix, extra, r.max_tokens == 0);
        layout_input = session->session.request();
      } else {
        utf8::require_valid(r.prefix, "the prefix");
        utf8::require_valid(r.suffix, "the suffix");
        for (const auto& f : r.extra) {
          utf8::require_valid(f.name, "a context file's name");
          utf8::require_valid(f.text, "a context file's text");
        }
      }
      const auto layout = F::layout(layout_input, options_.fim);
      std::vector<std::size_t> ends;
      prompt::encode(layout, tok_, options_.fim, fragmenter_, tokens, encode_piece, &ends);
      // Where typed text goes at the end, only that is healed: the anchor's prefix before <SUF> stays
      // as it is, so the session's next request finds it in the cache.
      const std::size_t cursor = prompt::cursor_segment(layout);
      if (cursor < ends.size() && (!F::typed_at_end || cursor + 1 == ends.size())) {
        cursor_begin = cursor == 0 ? 0 : ends[cursor - 1];
        cursor_end = ends[cursor];
      }
    }

    // Token healing: the last tokens before the cursor that a longer token could replace go, and the
    // first generated tokens must give their text back (at least one prompt token stays).
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
    const std::size_t bs = cache_.block_size();
    require((reserve + bs - 1) / bs <= cache_.capacity(), errc::out_of_blocks,
            "request: " + std::to_string(reserve) + " tokens need more KV blocks than the cache has (" +
                std::to_string(cache_.capacity()) + " blocks of " + std::to_string(bs) + " tokens)");

    const request_id id = ++last_id_;
    request_id superseded = 0;
    std::uint64_t version = 0;
    if (session) {
      // A request that continues the text of the session's request in flight replaces it; one found
      // only by likeness (a jump, a suffix edit) may come from another client, and leaves it be.
      const bool continues = !r.session.empty() || !prompt::starts_anchor(update.kind);
      const request_id older = std::exchange(session->data, id);
      if (continues) superseded = older;
      version = session->session.version();
      sessions_.store(key, std::move(*session));
    }
    completion result;
    result.id = id;
    result.session = key;
    result.session_change = update.kind;
    result.reused_tokens = update.reused_tokens;
    result.prompt_tokens = tokens.size();
    result.healed_tokens = cut.tokens;
    result.submitted = clock::now();
    cache::extra_keys keys;
    keys.model = model_key_;
    keys.salt = r.tenant;
    sequence_type s{
        id,
        std::move(tokens),
        result.prompt_tokens,
        reserve,
        0,
        std::move(keys),
        r.reuse_cache,
        {},
        false,
        payload{max_tokens, limited, r.ignore_eos, r.sampling, r.max_generate_time, rng(r.sampling.seed),
                text::detokenizer<T>(tok_), text_gate(r.stop), std::move(out), std::move(result), key, version,
                text::heal_constraint(std::move(cut.text))}};
    scheduler_.enqueue(std::move(s));
    // Last, as its callback may submit again.
    if (superseded != 0) end(superseded, finish_reason::superseded);
    return id;
  }

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
          // The request's own failure (its callback, or its text): it ends, the batch goes on.
          if (!s.done) {
            s.payload.result.error = std::current_exception();
            finish(s, finish_reason::error);
          }
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

  // Forgets an editor session (its cached KV stays until evicted).
  void end_session(const std::string& session, const std::string& tenant = {}) {
    sessions_.erase(scoped_key(tenant, session));
  }

  [[nodiscard]] const cache_type& cache() const noexcept { return cache_; }
  [[nodiscard]] const T& tokenizer() const noexcept { return tok_; }
  [[nodiscard]] const model::config& model_config() const noexcept { return model_.cfg(); }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t sessions() const noexcept { return sessions_.size(); }
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
    completion result;
    std::string session;              // its session's key (empty: none)
    std::uint64_t session_version{};  // the session's version it was laid out from
    text::heal_constraint heal;       // token healing: the removed text the next tokens must give back
  };
  using scheduler_type = scheduler<cache_type, payload>;
  using sequence_type = typename scheduler_type::sequence_type;
  using session_entry = typename prompt::session_table<request_id>::entry;

  // Keys a client gives live in their tenant's space; keys of sessions found by content start with '#'.
  static std::string scoped_key(const std::string& tenant, const std::string& session) {
    return "=" + std::to_string(tenant.size()) + ":" + tenant + session;
  }

  std::string session_key(const request& r) {
    if (!r.session.empty()) return scoped_key(r.tenant, r.session);
    if (!r.match_session) return {};
    return sessions_.match(r.tenant, r.prefix, r.suffix);
  }

  static constexpr bool heals = !std::is_same_v<Heal, text::no_healing>;

  // The prefix index token healing reads, built on first use.
  const text::prefix_index& heal_index() {
    if (!heal_index_) heal_index_.emplace(tok_);
    return *heal_index_;
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
    // The callback may cancel this or another request.
    if (s.payload.out.on_token) s.payload.out.on_token({s.id, t, shown_, s.prompt_tokens});
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
    if (!s.payload.session.empty()) close_session_request(s);
    if (!s.blocks.table.empty()) cache_.release(s.blocks);
    s.done = true;
    if (s.payload.out.on_done) s.payload.out.on_done(std::move(c));
  }

  // The session no longer waits for this request; what it generated is kept for the next request
  // when the format puts typed text at the end (so generated ids extend the prompt whose KV holds them).
  void close_session_request(const sequence_type& s) {
    auto* entry = sessions_.find(s.payload.session);
    if (entry == nullptr) return;
    if (entry->data == s.id) entry->data = 0;
    const auto& c = s.payload.result;
    const bool seen = c.reason == finish_reason::eos || c.reason == finish_reason::length ||
                      c.reason == finish_reason::stop || c.reason == finish_reason::indent ||
                      c.reason == finish_reason::time_limit;
    if constexpr (!F::typed_at_end) return;
    // (After healing, the generated ids follow a prompt without the removed tokens: not the session's.)
    if (!seen || c.tokens.empty() || c.healed_tokens > 0) return;
    std::vector<token_id> ids;
    std::string bytes;
    std::vector<std::size_t> ends;
    for (const token_id t : c.tokens) {
      if (tok_.is_special(t)) break;  // its text would not tokenize to it
      ids.push_back(t);
      bytes += tok_.token_bytes(t);
      ends.push_back(bytes.size());
    }
    entry->session.record_generation(s.payload.session_version, std::move(ids), std::move(bytes), std::move(ends));
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
  G fragmenter_;
  thread_pool pool_;
  typename B::context ctx_;
  model::transformer<B> model_;
  cache_type cache_;
  typename B::storage kv_;
  scheduler_type scheduler_;
  prompt::session_table<request_id> sessions_;  // with the request in flight of each session (0: none)
  text::token_memo memo_;
  std::optional<token_id> bos_, eos_;
  std::uint64_t model_key_ = 0;
  request_id last_id_ = 0;
  std::vector<model::batch_item> items_;
  std::vector<float> logits_;
  std::vector<std::pair<float, token_id>> scratch_;
  Heal healer_;
  std::optional<text::prefix_index> heal_index_;
  std::vector<token_id> allowed_;  // a healing step's allowed tokens
  std::vector<float> gathered_;    // their logits
  std::string piece_;  // the text of the token being emitted
  std::string shown_;  // what of it the stop rules let through (token_event::text views it)
};

}  // namespace efim::engine
