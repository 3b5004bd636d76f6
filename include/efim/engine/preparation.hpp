#pragma once
// Everything a request goes through before any compute, and what its generated tokens go through
// after, whatever computes them: efim's own kernels (engine::pipeline), or an engine behind HTTP
// (server::upstream_pipeline).
//
//   request_preparer: checks a request, finds its editor session, lays it out, tokenizes it, heals
//                     the end of the text before the cursor, fits it to the model's context (and the
//                     KV cache); the result is a prepared_request. Any thread.
//   generation:       one request's generated tokens -> healing -> detokenizer -> stop rules ->
//                     limits -> its stream; and its completion.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "efim/cache/remote.hpp"
#include "efim/cache/xxhash.hpp"
#include "efim/core/error.hpp"
#include "efim/core/utf8.hpp"
#include "efim/engine/request.hpp"
#include "efim/engine/stop_rules.hpp"
#include "efim/prompt/concepts.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/session.hpp"
#include "efim/prompt/session_table.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/detokenizer.hpp"
#include "efim/text/healing.hpp"
#include "efim/text/token_memo.hpp"

namespace efim::engine {

// What bounds a prepared request: the model's context and, where the engine keeps one, its KV cache
// (blocks 0: none to fit).
struct preparation_limits {
  std::size_t context = 0;
  std::size_t block_size = 0;
  std::size_t blocks = 0;
};

struct preparer_options {
  prompt::fim_token_set fim = prompt::qwen25_coder;
  prompt::session_options session{};
  prompt::session_table_options sessions{};  // how many sessions are kept; how keyless requests find theirs
  text::token_memo_options memo{};           // long pieces of text tokenized once across requests
  // Token healing (text/healing.hpp): at most this many tokens at the end of the text before the
  // cursor are removed and generated again under a constraint (0: off); a request may override it.
  std::size_t heal_tokens = 0;
  // A store replicas share (cache/remote.hpp; not owned): sessions are saved there as requests leave
  // them, and a request that finds no session here takes up the one saved there, so that it is laid
  // out as on the replica that served the session before. Empty: none.
  cache::remote_tier_ref remote;
  std::string remote_prefix = "efim:session:";  // the store's keys of sessions begin so
};

// A session's request in flight, as the session table keeps it.
struct in_flight {
  request_id id = 0;
  std::shared_ptr<std::atomic<bool>> superseded;  // the request's flag: set when a newer one replaces it
  friend bool operator==(const in_flight&, const in_flight&) = default;
};

template <prompt::fim_format F, text::fragmenter G, text::tokenizer T, text::healing_policy Heal>
class request_preparer;

// A request made ready to run: checked, laid out, tokenized, and entered in its session. An engine
// reads it and runs it; `origin()` names the preparer that made it.
struct prepared_request {
  completion result;  // what the completion starts from (id, session, change, prompt and healed tokens)
  std::vector<token_id> tokens;
  std::size_t max_tokens = 0;
  bool limited = false;   // max_tokens was cut to what the context has room for
  std::size_t reserve = 0;  // tokens of KV the request may need: prompt, healing steps and generation
  bool ignore_eos = false;
  bool reuse_cache = true;
  sampling_params sampling;
  std::chrono::milliseconds max_generate_time{};
  stop_rules stop;
  std::string heal_text;  // the text token healing removed (the first generated tokens give it back)
  std::string tenant;
  std::uint64_t session_version = 0;
  std::shared_ptr<std::atomic<bool>> superseded;  // a newer request of its session replaced it
  request_id supersedes = 0;                       // the older request it replaces (0: none)

  [[nodiscard]] request_id id() const noexcept { return result.id; }
  [[nodiscard]] std::size_t prompt_tokens() const noexcept { return result.prompt_tokens; }
  [[nodiscard]] const void* origin() const noexcept { return origin_; }

 private:
  template <prompt::fim_format F, text::fragmenter G, text::tokenizer T, text::healing_policy Heal>
  friend class request_preparer;
  const void* origin_ = nullptr;
};

// Prepares requests for an engine: the session table, the format's layout, the tokenizer (with the
// fragmenter's pieces and a memo of long pieces), token healing and the limits. prepare() may run on
// any number of threads at once, also while another thread runs the engine.
template <prompt::fim_format F, text::fragmenter G, text::tokenizer T, text::healing_policy Heal>
class request_preparer {
  static_assert(std::copy_constructible<G>, "request_preparer: each request gets a copy of the fragmenter");

 public:
  using format = F;
  using tokenizer_type = T;
  static constexpr bool heals = !std::is_same_v<Heal, text::no_healing>;

  request_preparer(T tokenizer, preparer_options options, preparation_limits limits)
      : options_(std::move(options)), limits_(limits), tok_(std::move(tokenizer)),
        sessions_(options_.sessions, options_.session), memo_(options_.memo) {
    require(limits_.context > 0, errc::invalid_argument, "request_preparer: the context holds no token");
    for (const auto role : {prompt::fim_role::prefix, prompt::fim_role::suffix, prompt::fim_role::middle})
      (void)prompt::special_id(tok_, options_.fim, role);  // fails now, not on the first request
    if (options_.fim.add_bos && !options_.fim.bos.empty())
      bos_ = prompt::special_id(tok_, options_.fim, prompt::fim_role::bos);
    eos_ = options_.fim.eos.empty() ? std::nullopt : tok_.special_id(options_.fim.eos);
    if (heals && options_.heal_tokens > 0) (void)heal_index();  // built now rather than in the first request
    if (options_.remote) sessions_.set_store(shared_sessions());
  }

  request_preparer(const request_preparer&) = delete;
  request_preparer& operator=(const request_preparer&) = delete;

  // Checks a request, finds its session, lays it out and tokenizes it. Bad input (invalid UTF-8, a
  // prompt or generation too long for the model or the cache, bad sampling parameters) throws
  // efim::error and changes nothing. Each request is cut into pieces by a copy of the fragmenter, so
  // its ids do not depend on other requests.
  prepared_request prepare(const request& r) {
    require(r.sampling.temperature >= 0.0f && r.sampling.top_p > 0.0f && r.sampling.top_p <= 1.0f,
            errc::invalid_argument, "request: temperature must be >= 0 and top_p in (0, 1]");
    require(r.max_generate_time.count() >= 0, errc::invalid_argument, "request: max_generate_time must be >= 0");
    prepared_request p;
    p.origin_ = this;
    p.result.submitted = clock::now();
    p.result.id = last_id_.fetch_add(1) + 1;
    p.max_tokens = r.max_tokens;
    p.ignore_eos = r.ignore_eos;
    p.reuse_cache = r.reuse_cache;
    p.sampling = r.sampling;
    p.max_generate_time = r.max_generate_time;
    p.stop = r.stop;
    p.tenant = r.tenant;
    p.superseded = std::make_shared<std::atomic<bool>>(false);
    if (!r.infill) {
      utf8::require_valid(r.prefix, "the prompt");
      if (bos_) p.tokens.push_back(*bos_);
      const std::size_t cursor_begin = p.tokens.size();
      memo_.encode(tok_, r.prefix, p.tokens);
      require(p.tokens.size() > cursor_begin, errc::invalid_argument, "request: the prompt is empty");
      fit(r, p, cursor_begin, p.tokens.size());
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
    const auto turn = sessions_.apply(query, in_flight{p.id(), p.superseded},
                                      [&](const prompt::infill_request& input) { lay_out(input, r, p); });
    p.result.session = turn.key;
    p.result.session_change = turn.update.kind;
    p.result.reused_tokens = turn.update.reused_tokens;
    p.session_version = turn.version;
    if (turn.superseded) {
      turn.superseded->superseded->store(true);  // ends it when it is queued, if it is not yet
      p.supersedes = turn.superseded->id;
    }
    return p;
  }

  // Whether this preparer made `p`.
  [[nodiscard]] bool made(const prepared_request& p) const noexcept { return p.origin() == this; }

  // A request of a session has ended: the session no longer waits for it. What it generated is kept
  // for the next request when the format puts typed text at the end (so generated ids extend the
  // prompt whose KV holds them) and the text was seen whole; after healing, the generated ids follow
  // a prompt without the removed tokens, which is not the session's. Only the first `known_tokens`
  // generated ids are recorded (an engine elsewhere may not have named the rest). Any thread.
  void close(const completion& c, std::uint64_t session_version, const std::shared_ptr<std::atomic<bool>>& superseded,
             std::size_t known_tokens = SIZE_MAX) {
    if (c.session.empty()) return;
    const bool seen = c.reason == finish_reason::eos || c.reason == finish_reason::length ||
                      c.reason == finish_reason::stop || c.reason == finish_reason::indent ||
                      c.reason == finish_reason::time_limit;
    std::optional<prompt::generation_record> generated;
    const std::size_t known = std::min(known_tokens, c.tokens.size());
    if (F::typed_at_end && seen && known > 0 && c.healed_tokens == 0)
      generated = prompt::generation_of(tok_, session_version, std::span(c.tokens).first(known));
    sessions_.finish(c.session, in_flight{c.id, superseded}, std::move(generated));
  }

  // Forgets an editor session. Any thread.
  void end_session(const std::string& session, const std::string& tenant = {}) { sessions_.end(tenant, session); }

  // The prefix index token healing reads, built once on first use (from any thread).
  const text::prefix_index& heal_index() {
    std::call_once(heal_index_built_, [&] { heal_index_.emplace(tok_); });
    return *heal_index_;
  }

  [[nodiscard]] const T& tokenizer() const noexcept { return tok_; }
  [[nodiscard]] const preparer_options& options() const noexcept { return options_; }
  [[nodiscard]] const preparation_limits& limits() const noexcept { return limits_; }
  [[nodiscard]] std::optional<token_id> eos() const noexcept { return eos_; }
  [[nodiscard]] std::size_t sessions() const { return sessions_.size(); }
  [[nodiscard]] const text::token_memo& memo() const noexcept { return memo_; }

 private:
  // An infill request's ids from its layout input (the session's view of it), then fit(): the check
  // the session table runs before it stores the session (what throws here refuses the request).
  void lay_out(const prompt::infill_request& input, const request& r, prepared_request& p) {
    p.tokens.clear();
    const auto layout = F::layout(input, options_.fim);
    std::vector<std::size_t> ends;
    G fragmenter = fragmenter_;
    prompt::encode(layout, tok_, options_.fim, fragmenter, p.tokens,
                   [&](std::string_view piece, std::vector<token_id>& o) { memo_.encode(tok_, piece, o); }, &ends);
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
  void fit(const request& r, prepared_request& p, std::size_t cursor_begin, std::size_t cursor_end) {
    auto& tokens = p.tokens;
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

    const std::size_t context = limits_.context;
    std::size_t max_tokens = r.max_tokens;
    const std::size_t fixed = tokens.size() + heal_steps;  // the prompt and the healing steps
    const bool limited = r.fit_context && fixed < context && max_tokens > context - fixed;
    if (limited) max_tokens = context - fixed;
    require(fixed <= context && max_tokens <= context - fixed, errc::too_long,
            "request: " + std::to_string(tokens.size()) + " prompt tokens + " + std::to_string(max_tokens) +
                " new tokens exceed the model context of " + std::to_string(context));
    const std::size_t reserve = fixed + max_tokens;
    if (limits_.blocks > 0) {
      const std::size_t bs = limits_.block_size, blocks = limits_.blocks;
      require((reserve + bs - 1) / bs <= blocks, errc::out_of_blocks,
              "request: " + std::to_string(reserve) + " tokens need more KV blocks than the cache has (" +
                  std::to_string(blocks) + " blocks of " + std::to_string(bs) + " tokens)");
    }
    p.max_tokens = max_tokens;
    p.limited = limited;
    p.reserve = reserve;
    p.heal_text = std::move(cut.text);
    p.result.prompt_tokens = tokens.size();
    p.result.healed_tokens = cut.tokens;
  }

  // The session table's store in the shared tier: a session's name hashed to a key; a value that does
  // not load (another build's, damaged, of other ids) is no session.
  prompt::session_store shared_sessions() {
    const auto key = [this](const std::string& name) {
      const XXH128_hash_t h = XXH3_128bits(name.data(), name.size());
      return cache::remote_key(options_.remote_prefix, cache::hash128{h.low64, h.high64});
    };
    return {[this, key](const std::string& name) -> std::shared_ptr<prompt::infill_session> {
              const std::string k = key(name);
              const auto values = options_.remote.fetch(std::span(&k, 1));
              if (values.empty() || !values[0]) return nullptr;
              auto s = prompt::infill_session::load(*values[0], tok_, options_.session);
              return s ? std::make_shared<prompt::infill_session>(std::move(*s)) : nullptr;
            },
            [this, key](const std::string& name, const prompt::infill_session& s) {
              options_.remote.put(key(name), s.save());
            }};
  }

  preparer_options options_;
  preparation_limits limits_;
  T tok_;
  G fragmenter_;  // copied for each request
  prompt::session_table<in_flight> sessions_;  // with the request in flight of each session
  text::token_memo memo_;                      // shared by preparing threads
  std::optional<token_id> bos_, eos_;
  std::atomic<request_id> last_id_{0};
  Heal healer_;
  std::once_flag heal_index_built_;
  std::optional<text::prefix_index> heal_index_;
};

// Where what a user callback threw goes when no completion can carry it: counted, and handed to the
// handler (see pipeline_options::on_callback_error). Any thread; never throws.
class callback_errors {
 public:
  explicit callback_errors(std::function<void(request_id, std::exception_ptr)> handler = {})
      : handler_(std::move(handler)) {}

  void report(request_id id, std::exception_ptr e) noexcept {
    count_.fetch_add(1);
    if (handler_) try {
        handler_(id, std::move(e));
      } catch (...) {  // the handler's own failure has nowhere left to go
      }
  }

  [[nodiscard]] std::uint64_t count() const noexcept { return count_.load(); }

 private:
  std::function<void(request_id, std::exception_ptr)> handler_;
  std::atomic<std::uint64_t> count_{0};
};

// One request's generated tokens, from its first to its completion: token healing gives back the
// removed text first (the client never sees it again), the detokenizer makes whole UTF-8
// characters, the stop rules decide what may be shown, and the limits (max_tokens, the time limit)
// end it. Whatever computed the tokens.
template <text::tokenizer T>
class generation {
 public:
  // Takes what the prepared request says of its generation (not its prompt ids).
  generation(const T& tok, prepared_request& p, stream out)
      : tok_(&tok), max_tokens_(p.max_tokens), limited_(p.limited), ignore_eos_(p.ignore_eos),
        max_generate_time_(p.max_generate_time), detok_(tok), gate_(std::move(p.stop)), out_(std::move(out)),
        result_(std::move(p.result)), prompt_tokens_(result_.prompt_tokens), heal_(std::move(p.heal_text)) {}

  [[nodiscard]] bool finished() const noexcept { return finished_; }
  [[nodiscard]] const completion& result() const noexcept { return result_; }
  [[nodiscard]] completion& result() noexcept { return result_; }
  [[nodiscard]] const text::heal_constraint& heal() const noexcept { return heal_; }
  // Healing gives up (no token continues the removed text): generation goes on unconstrained.
  void stop_healing() noexcept { heal_ = {}; }

  // Takes the next generated token and calls on_token. Returns how the generation ends, if this
  // token ends it: then the caller completes it (complete()). finish_reason::error: on_token threw
  // (completion::error holds it). On_token may end this request itself (finished() is then true,
  // and nothing is returned); what it throws then is left in orphan().
  // `unnamed` tokens whose ids are not known came before t (an engine elsewhere gave only their
  // text, `before`: shown before t's, counted in max_tokens, never in completion::tokens).
  std::optional<finish_reason> take(token_id t, const text::prefix_index* heal_index, std::optional<token_id> eos,
                                    std::string_view before = {}, std::size_t unnamed = 0) {
    require(unnamed == 0 || !heal_.active(), errc::invalid_argument,
            "generation: tokens without ids while the removed text is given back");
    piece_.assign(before);
    result_.unnamed_tokens += unnamed;
    const bool ends = eos && t == *eos && !ignore_eos_;
    if (ends && piece_.empty()) return finish_reason::eos;
    auto& c = result_;
    const auto now = clock::now();
    if (c.first_token == clock::time_point{}) c.first_token = now;
    if (!ends) c.tokens.push_back(t);
    if (ends) {
      // Only the text before it is shown.
    } else if (heal_.active()) {  // the client has the removed text: only what follows it goes on
      const std::string_view bytes = tok_->token_bytes(t);
      const std::size_t given_back = heal_.take(*heal_index, t);
      if (given_back == bytes.size()) {
        ++c.healing_steps;
        return std::nullopt;  // nothing new for the client, and not counted in max_tokens
      }
      detok_.push_bytes(bytes.substr(given_back), piece_);
    } else {
      detok_.push(t, piece_);
    }
    shown_.clear();
    const auto verdict = gate_.push(piece_, shown_);
    c.text += shown_;
    // The callback may cancel this or another request; what it throws ends this one.
    if (out_.on_token) try {
        out_.on_token({c.id, t, shown_, prompt_tokens_});
      } catch (...) {
        if (finished_) {
          orphan_ = std::current_exception();
          return std::nullopt;
        }
        c.error = std::current_exception();
        return finish_reason::error;
      }
    if (finished_) return std::nullopt;
    if (verdict == text_gate::verdict::stop_string) {
      c.stop_word = gate_.matched();
      return finish_reason::stop;
    }
    if (verdict == text_gate::verdict::indent) return finish_reason::indent;
    if (ends) return finish_reason::eos;
    if (c.generated_tokens() - c.healing_steps >= max_tokens_) {
      c.truncated = limited_;
      return finish_reason::length;
    }
    // Past the time limit, the line being written is finished (as llama.cpp's t_max_predict_ms).
    if (max_generate_time_.count() > 0 && piece_.find('\n') != std::string::npos &&
        std::chrono::duration_cast<std::chrono::milliseconds>(now - c.first_token) >= max_generate_time_)
      return finish_reason::time_limit;
    return std::nullopt;
  }

  // What on_token threw after its request had ended (null: nothing); taken once.
  std::exception_ptr orphan() noexcept { return std::exchange(orphan_, nullptr); }

  // Ends the generation: what the detokenizer and the stop rules held back goes to completion::tail
  // (and text). False if it had ended already.
  bool complete(finish_reason why) {
    if (finished_) return false;
    auto& c = result_;
    c.tail.clear();
    if (!gate_.stopped()) {
      piece_.clear();
      detok_.flush(piece_);
      (void)gate_.push(piece_, c.tail);
      gate_.finish(c.tail);
    }
    c.text += c.tail;
    c.reason = why;
    c.finished = clock::now();
    finished_ = true;
    return true;
  }

  // Hands the completion to on_done (once, after complete()); what on_done throws is returned.
  std::exception_ptr deliver() noexcept {
    if (!out_.on_done) return nullptr;
    auto done = std::move(out_.on_done);
    out_.on_done = nullptr;
    try {
      done(std::move(result_));
    } catch (...) {  // the request is over: nothing is left to end
      return std::current_exception();
    }
    return nullptr;
  }

 private:
  const T* tok_;
  std::size_t max_tokens_;
  bool limited_;
  bool ignore_eos_;
  std::chrono::milliseconds max_generate_time_;
  text::detokenizer<T> detok_;
  text_gate gate_;
  stream out_;
  completion result_;
  std::size_t prompt_tokens_;
  text::heal_constraint heal_;
  bool finished_ = false;
  std::exception_ptr orphan_;
  std::string piece_;  // the text of the token being taken
  std::string shown_;  // what of it the stop rules let through (token_event::text views it)
};
}  // namespace efim::engine
