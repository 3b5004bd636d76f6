#pragma once
// The sessions of a server: found by a key the client gives, or, since editors send none, by the
// content of the request (the same suffix and a prefix extending a session's anchor prefix; or,
// after a jump or an edit of the suffix, the session whose document is most like the request's).
//
// One request is one transaction, apply(): it finds the session, classifies the change, moves a copy
// of the session to it, lets the caller check the layout (tokenize it, refuse it), and only then stores
// the copy. Stored sessions are never changed in place, so a caller may keep one while other threads
// go on. Every member may be called from any thread.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/prompt/layout.hpp"
#include "efim/prompt/session.hpp"
#include "efim/text/concepts.hpp"

namespace efim::prompt {

struct session_table_options {
  std::size_t max_sessions = 4096;     // the least recently used session is dropped past this
  std::size_t max_bytes = 256u << 20;  // ... or past this much text kept in all of them
  std::size_t min_match_bytes = 16;    // requests with less prefix + suffix are not matched by content
  double min_similarity = 0.5;         // shared text / longer document, to follow a jump or a suffix edit
  std::size_t similarity_scan = 64;    // most recent sessions of the scope compared for similarity
};

// A request as its session sees it. Views: read during the call only.
struct session_query {
  std::string_view tenant;  // sessions (and the keys clients give them) never cross tenants
  std::string_view key;     // the client's key for its session (empty: none)
  bool match = false;       // without a key: find the session by the request's content
  std::string_view prefix;  // the editor's whole text before the cursor
  std::string_view suffix;  // ... and after it
  std::span<const context_file> extra = {};  // context files (taken when the anchor is set)
  bool renew = false;  // the request becomes the anchor whatever it is (a prefill-only request warming the cache)
};

// What apply() did with one request.
template <class Data>
struct session_turn {
  std::string key;                 // the session's key in the table (empty: the request has no session)
  session_update update;           // how the request changed its session (change::first without one)
  std::uint64_t version = 0;       // the session's version() after it (a generation record names it)
  std::optional<Data> superseded;  // the session's request in flight that this one replaces
  std::shared_ptr<const infill_session> session;  // as the request left it; never changed in place

  // What to lay out: views into `session`.
  [[nodiscard]] infill_request request() const { return session->request(); }
};

// Where sessions are kept beyond one table (a store replicas share), under names the table gives:
// `load` is asked for a session a request finds no session for here, `save` is given each session as
// a request leaves it, and again with what that request generated. Both on the caller's thread.
struct session_store {
  std::function<std::shared_ptr<infill_session>(const std::string& name)> load;  // null: none
  std::function<void(const std::string& name, const infill_session&)> save;
};

// `Data` is what the owner keeps beside each session: its request in flight (Data{}: none).
template <std::regular Data>
class session_table {
 public:
  // A session as the table holds it.
  struct entry {
    std::shared_ptr<const infill_session> session;
    Data data{};
    std::string scope;        // sessions are only matched within their scope (a tenant)
    bool by_content = false;  // found by content (no key given)
    std::string stored_as;    // its name in the session store
  };

  explicit session_table(session_table_options options = {}, session_options session = {})
      : options_(options), session_options_(session) {
    require(options.max_sessions > 0, errc::invalid_argument, "session table: max_sessions must be positive");
  }

  session_table(const session_table&) = delete;
  session_table& operator=(const session_table&) = delete;

  // Sessions in a store beyond the table (before the first request).
  void set_store(session_store store) { store_ = std::move(store); }

  // One request's transaction. Finds its session: the client's key, else (with q.match) the session
  // its content belongs to, or a new one; none for a request too small to be matched, or that asks
  // for none (then the turn's session is one of its own, not stored). Moves a copy of the session to
  // the request (session::update), calls `check(request)` with what to lay out (it may tokenize, and
  // throw to refuse the request), and only then stores the copy with `in_flight` as its data. A
  // request that has its session's key, or continues the text of the session's request in flight
  // (append, accepted, edit), supersedes that request (turn.superseded); one found only by likeness
  // (a jump, an edit after the cursor) may be another client's, and leaves it be.
  //
  // Invalid UTF-8 (errc::invalid_utf8), or whatever `check` throws, leaves the table as it was.
  // `check` runs without the table's lock; if another request of the same session is stored
  // meanwhile, the transaction starts again from that one (so `check` may run more than once).
  template <class Check>
    requires std::invocable<Check&, const infill_request&>
  session_turn<Data> apply(const session_query& q, const Data& in_flight, Check&& check) {
    const bool keyed = !q.key.empty();
    for (;;) {
      session_turn<Data> turn;
      std::shared_ptr<const infill_session> current;
      std::optional<generation_record> generated;
      std::uint64_t stamp = 0;
      {
        std::lock_guard lock(mutex_);
        if (keyed) {
          turn.key = scoped_key(q.tenant, q.key);
        } else if (q.match && q.prefix.size() + q.suffix.size() >= options_.min_match_bytes) {
          turn.key = match_locked(q.tenant, q.prefix, q.suffix);
          if (turn.key.empty()) turn.key = "#" + std::to_string(++last_key_);
        }
        if (const auto it = slots_.find(turn.key); !turn.key.empty() && it != slots_.end()) {
          current = it->second.e.session;
          generated = it->second.generated;
          stamp = it->second.stamp;
        }
      }
      std::shared_ptr<infill_session> next;
      if (current) {
        next = std::make_shared<infill_session>(*current);
      } else if (!turn.key.empty() && store_.load) {  // kept elsewhere: used if this request continues it
        next = store_.load(store_name(q.tenant, keyed ? q.key : std::string_view(), q.suffix));
        if (next && (q.renew || starts_anchor(infill_session(*next).update(q.prefix, q.suffix, q.extra).kind)))
          next = nullptr;
      }
      if (!next) next = std::make_shared<infill_session>(session_options_);
      if (generated) next->record_generation(std::move(*generated));
      turn.update = next->update(q.prefix, q.suffix, q.extra, q.renew);
      turn.version = next->version();
      turn.session = std::move(next);
      check(std::as_const(turn).request());
      if (turn.key.empty()) return turn;

      std::string name = store_name(q.tenant, keyed ? q.key : std::string_view(), turn.session->anchor_suffix());
      {
        std::lock_guard lock(mutex_);
        const auto it = slots_.find(turn.key);
        if ((it == slots_.end() ? 0 : it->second.stamp) != stamp) continue;  // the session moved on: again
        const Data older = it == slots_.end() ? Data{} : it->second.e.data;
        if (older != Data{} && (keyed || !starts_anchor(turn.update.kind))) turn.superseded = older;
        store_locked(turn.key, entry{turn.session, in_flight, std::string(q.tenant), !keyed, name});
      }
      if (store_.save) store_.save(name, *turn.session);
      return turn;
    }
  }

  session_turn<Data> apply(const session_query& q, const Data& in_flight = {}) {
    return apply(q, in_flight, [](const infill_request&) {});
  }

  // The request `in_flight` of the session `key` has ended: the session waits for none (if that was
  // its request in flight). `generated`, if given, is what the request generated: a next request whose
  // new typed text starts with it is laid out with those ids (change::accepted). Ignored once the
  // session has moved on.
  void finish(const std::string& key, const Data& in_flight, std::optional<generation_record> generated = {}) {
    std::optional<infill_session> saved;
    std::string name;
    {
      std::lock_guard lock(mutex_);
      const auto it = slots_.find(key);
      if (it == slots_.end()) return;
      if (it->second.e.data == in_flight) it->second.e.data = Data{};
      if (!generated || generated->version != it->second.e.session->version()) return;
      it->second.generated = generated;
      if (store_.save) {
        saved.emplace(*it->second.e.session);
        name = it->second.e.stored_as;
      }
    }
    if (saved) {  // elsewhere with what it generated, so an accepted suggestion there reuses its ids
      saved->record_generation(std::move(*generated));
      store_.save(name, *saved);
    }
  }

  // Forgets the session the client of `tenant` keyed `key`.
  void end(std::string_view tenant, std::string_view key) { erase(scoped_key(tenant, key)); }

  // Forgets the session under the table's `key` (a turn's key).
  void erase(const std::string& key) {
    std::lock_guard lock(mutex_);
    erase_locked(key);
  }

  // The session under the table's `key`, if it is kept.
  [[nodiscard]] std::optional<entry> find(const std::string& key) const {
    std::lock_guard lock(mutex_);
    const auto it = slots_.find(key);
    if (it == slots_.end()) return std::nullopt;
    return it->second.e;
  }

  // The key of the session of `scope` a request without a key belongs to: the session whose anchor
  // suffix is `suffix` and whose anchor prefix `prefix` extends (the longest such), else the most
  // similar recent one if similar enough. Empty when none is (apply() then starts a new session) or
  // the request is too small to be matched.
  [[nodiscard]] std::string match(std::string_view scope, std::string_view prefix, std::string_view suffix) const {
    if (prefix.size() + suffix.size() < options_.min_match_bytes) return {};
    std::lock_guard lock(mutex_);
    return match_locked(scope, prefix, suffix);
  }

  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(mutex_);
    return slots_.size();
  }
  [[nodiscard]] std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    return bytes_;
  }
  // Sessions in the index of content-matched sessions (each of those is there once).
  [[nodiscard]] std::size_t indexed() const {
    std::lock_guard lock(mutex_);
    return by_suffix_.size();
  }

  // Shared text of a session's last request and a request, over the longer of the two documents:
  // the common start of the prefixes plus the common end of the suffixes.
  [[nodiscard]] static double similarity(const infill_session& s, std::string_view prefix, std::string_view suffix) {
    const auto anchor = s.anchor_prefix();
    const auto typed = s.typed();
    std::size_t shared =
        std::mismatch(anchor.begin(), anchor.end(), prefix.begin(), prefix.end()).first - anchor.begin();
    if (shared == anchor.size()) {
      const auto rest = prefix.substr(anchor.size());
      shared += std::mismatch(typed.begin(), typed.end(), rest.begin(), rest.end()).first - typed.begin();
    }
    const auto old_suffix = s.anchor_suffix();
    shared += std::mismatch(old_suffix.rbegin(), old_suffix.rend(), suffix.rbegin(), suffix.rend()).first -
              old_suffix.rbegin();
    const std::size_t longer =
        std::max(anchor.size() + typed.size() + old_suffix.size(), prefix.size() + suffix.size());
    return longer == 0 ? 0.0 : static_cast<double>(std::min(shared, longer)) / static_cast<double>(longer);
  }

 private:
  struct slot {
    entry e;
    std::uint64_t used = 0;                      // recency
    std::uint64_t stamp = 0;                     // new with every store: a transaction checks it did not move
    std::size_t bytes = 0;                       // the text it keeps
    std::optional<generation_record> generated;  // what its last request generated (finish())
  };

  // A session's name in the store: its tenant and the client's key, or, for one found by content,
  // its tenant and its anchor suffix (which a request continuing it has as its suffix).
  static std::string store_name(std::string_view tenant, std::string_view key, std::string_view suffix) {
    std::string n = key.empty() ? "suffix:" : "key:";
    n += std::to_string(tenant.size()) + ":";
    n += tenant;
    n += key.empty() ? suffix : key;
    return n;
  }

  // Keys clients give live in their tenant's space; keys of sessions found by content start with '#'.
  static std::string scoped_key(std::string_view tenant, std::string_view key) {
    std::string k = "=" + std::to_string(tenant.size()) + ":";
    k += tenant;
    k += key;
    return k;
  }

  std::string match_locked(std::string_view scope, std::string_view prefix, std::string_view suffix) const {
    const slot* best = nullptr;
    const std::string* best_key = nullptr;
    const auto [first, last] = by_suffix_.equal_range(suffix_key(scope, suffix));
    for (auto it = first; it != last; ++it) {
      const slot& s = slots_.at(it->second);
      const auto anchor = s.e.session->anchor_prefix();
      if (s.e.scope != scope || s.e.session->anchor_suffix() != suffix || !prefix.starts_with(anchor)) continue;
      if (best == nullptr || anchor.size() > best->e.session->anchor_prefix().size() ||
          (anchor.size() == best->e.session->anchor_prefix().size() && s.used > best->used)) {
        best = &s;
        best_key = &it->second;
      }
    }
    if (best_key != nullptr) return *best_key;

    // A jump or a suffix edit: the most similar of the scope's recent sessions.
    std::vector<std::pair<std::uint64_t, const std::string*>> recent;
    for (const auto& [key, s] : slots_)
      if (s.e.by_content && s.e.scope == scope) recent.emplace_back(s.used, &key);
    const std::size_t n = std::min(recent.size(), options_.similarity_scan);
    std::partial_sort(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(n), recent.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    double best_score = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double score = similarity(*slots_.at(*recent[i].second).e.session, prefix, suffix);
      if (score > best_score) {
        best_score = score;
        best_key = recent[i].second;
      }
    }
    if (best_key != nullptr && best_score >= options_.min_similarity) return *best_key;
    return {};
  }

  // Inserts or replaces the session under `key`, marks it most recently used, and drops the least
  // recently used others past the limits.
  void store_locked(const std::string& key, entry e) {
    erase_locked(key);
    slot s{std::move(e), ++tick_, ++tick_, 0, std::nullopt};
    s.bytes = text_bytes(*s.e.session) + key.size();
    bytes_ += s.bytes;
    if (s.e.by_content) by_suffix_.emplace(suffix_key(s.e.scope, s.e.session->anchor_suffix()), key);
    slots_.emplace(key, std::move(s));
    while (slots_.size() > options_.max_sessions || (bytes_ > options_.max_bytes && slots_.size() > 1)) {
      auto oldest = slots_.end();
      for (auto it = slots_.begin(); it != slots_.end(); ++it)
        if (it->first != key && (oldest == slots_.end() || it->second.used < oldest->second.used)) oldest = it;
      erase_locked(oldest->first);
    }
  }

  void erase_locked(const std::string& key) {
    const auto it = slots_.find(key);
    if (it == slots_.end()) return;
    const slot& s = it->second;
    if (s.e.by_content) {
      const auto [first, last] = by_suffix_.equal_range(suffix_key(s.e.scope, s.e.session->anchor_suffix()));
      for (auto i = first; i != last; ++i)
        if (i->second == key) {
          by_suffix_.erase(i);
          break;
        }
    }
    bytes_ -= s.bytes;
    slots_.erase(it);
  }

  static std::size_t text_bytes(const infill_session& s) {
    std::size_t n = s.anchor_prefix().size() + s.anchor_suffix().size() + s.typed().size();
    for (const auto& f : s.extra()) n += f.name.size() + f.text.size();
    return n;
  }

  static std::size_t suffix_key(std::string_view scope, std::string_view suffix) {
    const std::size_t h = std::hash<std::string_view>{}(suffix);
    return h ^ (std::hash<std::string_view>{}(scope) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  }

  session_table_options options_;
  session_options session_options_;
  session_store store_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, slot> slots_;
  std::unordered_multimap<std::size_t, std::string> by_suffix_;  // anchor suffix (and scope) -> content-matched keys
  std::uint64_t tick_ = 0;
  std::uint64_t last_key_ = 0;
  std::size_t bytes_ = 0;
};

// The record of what a request generated, for session_table::finish(): its ids up to the first
// special token (whose text would not tokenize to it) and the bytes each stands for.
template <text::tokenizer T>
generation_record generation_of(const T& tok, std::uint64_t version, std::span<const token_id> generated) {
  generation_record g{version, {}, {}, {}};
  for (const token_id t : generated) {
    if (tok.is_special(t)) break;
    g.ids.push_back(t);
    g.bytes += tok.token_bytes(t);
    g.ends.push_back(g.bytes.size());
  }
  return g;
}

}  // namespace efim::prompt
