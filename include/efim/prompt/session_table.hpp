#pragma once
// The sessions of a server: found by a key the client gives, or, since editors send none, by the
// content of the request (the same suffix and a prefix extending a session's anchor prefix; or,
// after a jump or an edit of the suffix, the session whose document is most like the request's).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/prompt/session.hpp"

namespace efim::prompt {

struct session_table_options {
  std::size_t max_sessions = 4096;     // the least recently used session is dropped past this
  std::size_t max_bytes = 256u << 20;  // ... or past this much text kept in all of them
  std::size_t min_match_bytes = 16;    // requests with less prefix + suffix are not matched by content
  double min_similarity = 0.5;         // shared text / longer document, to follow a jump or a suffix edit
  std::size_t similarity_scan = 64;    // most recent sessions of the scope compared for similarity
};

// `Data` is what the owner keeps beside each session.
template <class Data>
class session_table {
 public:
  struct entry {
    infill_session session;
    Data data{};
    std::string scope;        // sessions are only matched within their scope (a tenant)
    bool by_content = false;  // found by content (no key given)
    std::uint64_t used = 0;
    std::size_t bytes = 0;  // the text it keeps
  };

  explicit session_table(session_table_options options = {}) : options_(options) {
    require(options.max_sessions > 0, errc::invalid_argument, "session table: max_sessions must be positive");
  }

  // The key of the session a request without a session key belongs to: a session of `scope` whose
  // anchor suffix is `suffix` and whose anchor prefix `prefix` extends (the longest such), else
  // the most similar recent one if similar enough, else a new key. Empty when the request is too
  // small to be matched (it is then served without a session).
  [[nodiscard]] std::string match(std::string_view scope, std::string_view prefix, std::string_view suffix) {
    if (prefix.size() + suffix.size() < options_.min_match_bytes) return {};
    const entry* best = nullptr;
    const std::string* best_key = nullptr;
    const auto [first, last] = by_suffix_.equal_range(suffix_key(scope, suffix));
    for (auto it = first; it != last; ++it) {
      const entry& e = entries_.at(it->second);
      const auto anchor = e.session.anchor_prefix();
      if (e.scope != scope || e.session.anchor_suffix() != suffix || !prefix.starts_with(anchor)) continue;
      if (best == nullptr || anchor.size() > best->session.anchor_prefix().size() ||
          (anchor.size() == best->session.anchor_prefix().size() && e.used > best->used)) {
        best = &e;
        best_key = &it->second;
      }
    }
    if (best_key != nullptr) return *best_key;

    // A jump or a suffix edit: the most similar of the scope's recent sessions.
    std::vector<std::pair<std::uint64_t, const std::string*>> recent;
    for (const auto& [key, e] : entries_)
      if (e.by_content && e.scope == scope) recent.emplace_back(e.used, &key);
    const std::size_t n = std::min(recent.size(), options_.similarity_scan);
    std::partial_sort(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(n), recent.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    double best_score = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double score = similarity(entries_.at(*recent[i].second).session, prefix, suffix);
      if (score > best_score) {
        best_score = score;
        best_key = recent[i].second;
      }
    }
    if (best_key != nullptr && best_score >= options_.min_similarity) return *best_key;
    return "#" + std::to_string(++last_key_);
  }

  [[nodiscard]] entry* find(const std::string& key) {
    const auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : &it->second;
  }

  // Inserts or replaces the session under `key`, marks it most recently used, and drops the least
  // recently used others past the limit.
  entry& store(const std::string& key, entry e) {
    e.used = ++tick_;
    e.bytes = text_bytes(e.session) + key.size();
    if (const auto it = entries_.find(key); it != entries_.end()) {
      unindex(it->first, it->second);
      bytes_ -= it->second.bytes;
    }
    auto& stored = entries_.insert_or_assign(key, std::move(e)).first->second;
    bytes_ += stored.bytes;
    if (stored.by_content) by_suffix_.emplace(suffix_key(stored.scope, stored.session.anchor_suffix()), key);
    while (entries_.size() > options_.max_sessions || (bytes_ > options_.max_bytes && entries_.size() > 1)) {
      auto oldest = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->first != key && (oldest == entries_.end() || it->second.used < oldest->second.used)) oldest = it;
      erase(oldest->first);
    }
    return entries_.at(key);
  }

  void erase(const std::string& key) {
    const auto it = entries_.find(key);
    if (it == entries_.end()) return;
    unindex(it->first, it->second);
    bytes_ -= it->second.bytes;
    entries_.erase(it);
  }

  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

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
  static std::size_t text_bytes(const infill_session& s) {
    std::size_t n = s.anchor_prefix().size() + s.anchor_suffix().size() + s.typed().size();
    for (const auto& f : s.extra()) n += f.name.size() + f.text.size();
    return n;
  }

  static std::size_t suffix_key(std::string_view scope, std::string_view suffix) {
    const std::size_t h = std::hash<std::string_view>{}(suffix);
    return h ^ (std::hash<std::string_view>{}(scope) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  }

  void unindex(const std::string& key, const entry& e) {
    if (!e.by_content) return;
    const auto [first, last] = by_suffix_.equal_range(suffix_key(e.scope, e.session.anchor_suffix()));
    for (auto it = first; it != last; ++it)
      if (it->second == key) {
        by_suffix_.erase(it);
        return;
      }
  }

  session_table_options options_;
  std::unordered_map<std::string, entry> entries_;
  std::unordered_multimap<std::size_t, std::string> by_suffix_;  // anchor suffix (and scope) -> content-matched keys
  std::uint64_t tick_ = 0;
  std::uint64_t last_key_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace efim::prompt
