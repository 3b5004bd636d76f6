#pragma once
// An infill session: what changed between an editor's requests, relative to the session's anchor.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/core/utf8.hpp"
#include "efim/prompt/layout.hpp"
#include "efim/text/concepts.hpp"

namespace efim::prompt {

enum class change {
  first,           // the session had no anchor: this request becomes it
  append,          // text typed after the anchor prefix grew (or stayed): EFIM continues
  accepted,        // an append that starts with text the model generated for the previous request
  edit,            // text was deleted or changed inside the typed part: a shorter cached match
  reanchor,        // the typed part passed the threshold, or a prefill-only request renewed the anchor
  suffix_changed,  // the text after the cursor changed: new anchor
  cursor_moved,    // the prefix no longer starts with the anchor prefix (jump, or deletion into it): new anchor
};

inline constexpr std::string_view to_string(change c) noexcept {
  switch (c) {
    case change::first:
      return "first";
    case change::append:
      return "append";
    case change::accepted:
      return "accepted";
    case change::edit:
      return "edit";
    case change::reanchor:
      return "reanchor";
    case change::suffix_changed:
      return "suffix_changed";
    case change::cursor_moved:
      return "cursor_moved";
  }
  return "?";
}

// Whether the request became the session's new anchor (its typed part is empty).
constexpr bool starts_anchor(change c) noexcept {
  return c != change::append && c != change::accepted && c != change::edit;
}

struct session_update {
  change kind = change::first;
  std::size_t typed_bytes = 0;    // length of the typed part after the update
  std::size_t kept_bytes = 0;     // bytes of the typed part shared with the previous request
  std::size_t reused_tokens = 0;  // generated tokens the new typed text starts with (change::accepted)
};

struct session_options {
  std::size_t reanchor_bytes = 4096;  // a typed part longer than this starts a new anchor
};

// What the model generated after one request of a session: the ids and the bytes each stands for
// (ends[i]: the end of token i in bytes), and the session's version() that request was laid out at.
struct generation_record {
  std::uint64_t version = 0;
  std::vector<token_id> ids;
  std::string bytes;
  std::vector<std::size_t> ends;
};

// What a session holds for a context file of its anchor.
struct owned_context_file {
  std::string name, text;
};

class infill_session {
 public:
  explicit infill_session(session_options options = {}) : options_(options) {}

  // Classifies a request (the editor's full prefix and suffix, and its extra context files) and
  // moves the session to it. The files are taken only when the anchor is (re)set: a request that
  // only changes them keeps the anchor. `renew` makes the request the new anchor whatever it is (a
  // prefill-only request warming the cache). Invalid UTF-8 throws errc::invalid_utf8 and leaves
  // the session as it was.
  session_update update(std::string_view prefix, std::string_view suffix, std::span<const context_file> extra = {},
                        bool renew = false) {
    utf8::require_valid(prefix, "the prefix");
    utf8::require_valid(suffix, "the suffix");
    for (const auto& f : extra) {
      utf8::require_valid(f.name, "a context file's name");
      utf8::require_valid(f.text, "a context file's text");
    }
    ++version_;
    if (!anchored_) return set_anchor(change::first, prefix, suffix, extra);
    if (renew) return set_anchor(change::reanchor, prefix, suffix, extra);
    if (suffix != suffix_) {
      // The same document with the cursor elsewhere is a move; anything else an edit after the cursor.
      const auto why = same_document(prefix, suffix) ? change::cursor_moved : change::suffix_changed;
      return set_anchor(why, prefix, suffix, extra);
    }
    if (!prefix.starts_with(prefix_)) return set_anchor(change::cursor_moved, prefix, suffix, extra);

    const std::string_view typed = prefix.substr(prefix_.size());
    if (typed.size() > options_.reanchor_bytes) return set_anchor(change::reanchor, prefix, suffix, extra);

    if (typed.starts_with(typed_)) {
      const std::size_t kept = typed_.size();
      if (typed.size() == kept) return {change::append, kept, kept, 0};  // the same request again
      // Text typed before this request becomes a fragment of its own.
      add_cut(kept);
      const std::size_t reused = take_generation(typed.substr(kept), kept);
      typed_.assign(typed);
      return {reused > 0 ? change::accepted : change::append, typed_.size(), kept, reused};
    }

    const std::size_t kept = utf8::common_prefix(typed_, typed);
    std::erase_if(cuts_, [&](std::size_t c) { return c > kept || c >= typed.size(); });
    std::erase_if(known_, [&](const known_fragment& k) { return k.end > kept; });
    add_cut(kept < typed.size() ? kept : 0);
    typed_.assign(typed);
    generation_ = {};
    return {change::edit, typed_.size(), kept, 0};
  }

  // Records what the model generated after the request laid out at `version` (this session's
  // version() then): the ids and the bytes each stands for. A next request whose new typed text
  // starts with whole tokens of it gets those ids for that text, so the KV computed while
  // generating them is reused. Ignored if the session changed since.
  void record_generation(generation_record g) {
    if (g.version != version_ || g.ids.empty() || g.ids.size() != g.ends.size() || g.ends.back() != g.bytes.size())
      return;
    generation_ = {typed_.size(), std::move(g.ids), std::move(g.bytes), std::move(g.ends)};
  }
  void record_generation(std::uint64_t version, std::vector<token_id> ids, std::string bytes,
                         std::vector<std::size_t> ends) {
    record_generation({version, std::move(ids), std::move(bytes), std::move(ends)});
  }

  // The request to lay out: the anchor's prefix, suffix and context files, and the typed part as
  // fragments. Views into the session: valid until its next update.
  [[nodiscard]] infill_request request() const {
    infill_request r{prefix_, suffix_, {}};
    for (const auto& f : extra_) r.extra.push_back({f.name, f.text});
    const std::string_view typed = typed_;
    std::size_t begin = 0;
    const auto add = [&](std::size_t end) {
      r.typed.push_back(typed.substr(begin, end - begin));
      std::span<const token_id> ids;
      for (const auto& k : known_)
        if (k.begin == begin && k.end == end) ids = k.ids;
      if (!ids.empty() && r.typed_ids.empty()) r.typed_ids.resize(r.typed.size() - 1);
      if (!ids.empty() || !r.typed_ids.empty()) r.typed_ids.push_back(ids);
      begin = end;
    };
    for (const std::size_t cut : cuts_) add(cut);
    if (begin < typed.size()) add(typed.size());
    return r;
  }

  // The session as bytes, to be taken up elsewhere by load() (a replica that serves the session's
  // next request after the one that served it is lost). Host byte order.
  [[nodiscard]] std::string save() const {
    std::string out(magic);
    put(out, std::uint64_t{anchored_});
    put(out, version_);
    for (const std::string* t : {&prefix_, &suffix_, &typed_}) put_text(out, *t);
    put(out, std::uint64_t{extra_.size()});
    for (const auto& f : extra_) {
      put_text(out, f.name);
      put_text(out, f.text);
    }
    put(out, std::uint64_t{cuts_.size()});
    for (const std::size_t c : cuts_) put(out, std::uint64_t{c});
    put(out, std::uint64_t{known_.size()});
    for (const auto& k : known_) {
      put(out, std::uint64_t{k.begin});
      put(out, std::uint64_t{k.end});
      put_ids(out, k.ids);
    }
    put(out, std::uint64_t{generation_.at});
    put_ids(out, generation_.ids);
    put_text(out, generation_.bytes);
    put(out, std::uint64_t{generation_.ends.size()});
    for (const std::size_t e : generation_.ends) put(out, std::uint64_t{e});
    return out;
  }

  // A session from what save() wrote, checked as a request would be and against `tok`: valid UTF-8,
  // fragments inside the typed text, and every token id the vocabulary's, spelling exactly the text
  // it stands for (so a session read from a shared store can never put other tokens into a prompt).
  // Nothing (nullopt) when any of it fails; a recorded generation that does not spell its bytes is
  // dropped alone.
  template <text::tokenizer T>
  static std::optional<infill_session> load(std::string_view in, const T& tok, session_options options = {}) {
    infill_session s(options);
    if (!in.starts_with(magic)) return std::nullopt;
    in.remove_prefix(magic.size());
    std::uint64_t anchored = 0, n = 0;
    if (!get(in, anchored) || anchored > 1 || !get(in, s.version_)) return std::nullopt;
    s.anchored_ = anchored == 1;
    for (std::string* t : {&s.prefix_, &s.suffix_, &s.typed_})
      if (!get_text(in, *t)) return std::nullopt;
    if (!get(in, n) || n > in.size()) return std::nullopt;
    for (std::uint64_t i = 0; i < n; ++i) {
      owned_context_file f;
      if (!get_text(in, f.name) || !get_text(in, f.text)) return std::nullopt;
      s.extra_.push_back(std::move(f));
    }
    if (!get(in, n) || n > in.size() / sizeof(std::uint64_t)) return std::nullopt;
    for (std::uint64_t i = 0, c = 0; i < n; ++i) {
      if (!get(in, c) || c == 0 || c >= s.typed_.size() || (!s.cuts_.empty() && c <= s.cuts_.back()))
        return std::nullopt;
      s.cuts_.push_back(static_cast<std::size_t>(c));
    }
    if (!get(in, n) || n > in.size()) return std::nullopt;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::uint64_t begin = 0, end = 0;
      known_fragment k;
      if (!get(in, begin) || !get(in, end) || begin >= end || end > s.typed_.size() || !get_ids(in, k.ids, tok) ||
          !spells(tok, k.ids, std::string_view(s.typed_).substr(begin, end - begin)))
        return std::nullopt;
      k.begin = static_cast<std::size_t>(begin);
      k.end = static_cast<std::size_t>(end);
      s.known_.push_back(std::move(k));
    }
    std::uint64_t at = 0;
    generation g;
    if (!get(in, at) || !get_ids(in, g.ids, tok) || !get_text(in, g.bytes) || !get(in, n) || n != g.ids.size())
      return std::nullopt;
    for (std::uint64_t i = 0, e = 0; i < n; ++i) {
      if (!get(in, e)) return std::nullopt;
      g.ends.push_back(static_cast<std::size_t>(e));
    }
    if (!in.empty()) return std::nullopt;
    for (const std::string* t : {&s.prefix_, &s.suffix_, &s.typed_})
      if (!utf8::is_valid(*t)) return std::nullopt;
    for (const auto& f : s.extra_)
      if (!utf8::is_valid(f.name) || !utf8::is_valid(f.text)) return std::nullopt;
    if (!s.anchored_ && (!s.prefix_.empty() || !s.suffix_.empty() || !s.typed_.empty() || !s.extra_.empty()))
      return std::nullopt;
    // The generation: each token's bytes end where its `ends` says, and they are `bytes`.
    bool spelled = at <= s.typed_.size() && !g.ids.empty() && g.ends.back() == g.bytes.size();
    for (std::size_t i = 0, from = 0; spelled && i < g.ids.size(); from = g.ends[i++]) {
      const std::string_view b = tok.token_bytes(g.ids[i]);
      spelled = g.ends[i] >= from && g.ends[i] - from == b.size() && g.bytes.compare(from, b.size(), b) == 0;
    }
    if (spelled) {
      g.at = static_cast<std::size_t>(at);
      s.generation_ = std::move(g);
    }
    return s;
  }

  [[nodiscard]] bool anchored() const noexcept { return anchored_; }
  [[nodiscard]] std::string_view anchor_prefix() const noexcept { return prefix_; }
  [[nodiscard]] std::string_view anchor_suffix() const noexcept { return suffix_; }
  [[nodiscard]] std::string_view typed() const noexcept { return typed_; }
  [[nodiscard]] std::span<const owned_context_file> extra() const noexcept { return extra_; }
  // Changes with every update.
  [[nodiscard]] std::uint64_t version() const noexcept { return version_; }

 private:
  struct known_fragment {
    std::size_t begin = 0, end = 0;  // a fragment of typed_
    std::vector<token_id> ids;
  };
  struct generation {
    std::size_t at = 0;  // the typed length it continued
    std::vector<token_id> ids;
    std::string bytes;
    std::vector<std::size_t> ends;  // ends[i]: end of token i in bytes
  };

  session_update set_anchor(change why, std::string_view prefix, std::string_view suffix,
                            std::span<const context_file> extra) {
    prefix_.assign(prefix);
    suffix_.assign(suffix);
    extra_.clear();
    for (const auto& f : extra) extra_.push_back({std::string(f.name), std::string(f.text)});
    typed_.clear();
    cuts_.clear();
    known_.clear();
    generation_ = {};
    anchored_ = true;
    return {why, 0, 0, 0};
  }

  // Whether prefix + suffix is the text of the session's last request (anchor prefix, typed, suffix).
  [[nodiscard]] bool same_document(std::string_view prefix, std::string_view suffix) const {
    if (prefix.size() + suffix.size() != prefix_.size() + typed_.size() + suffix_.size()) return false;
    const auto piece = [&](std::size_t at, std::size_t n) {  // bytes [at, at + n) of prefix + suffix
      return at >= prefix.size() ? suffix.substr(at - prefix.size(), n) : prefix.substr(at, n);
    };
    std::size_t at = 0;
    for (const std::string_view part : {std::string_view(prefix_), std::string_view(typed_), std::string_view(suffix_)})
      for (std::size_t done = 0; done < part.size();) {
        const auto p = piece(at, part.size() - done);
        if (part.substr(done, p.size()) != p) return false;
        done += p.size();
        at += p.size();
      }
    return true;
  }

  void add_cut(std::size_t at) {
    if (at > 0 && (cuts_.empty() || cuts_.back() < at)) cuts_.push_back(at);
  }

  // How many generated tokens `added` (typed after `at` bytes) starts with, as whole tokens ending
  // on a character boundary of it; those become a known fragment, cut off from what follows.
  std::size_t take_generation(std::string_view added, std::size_t at) {
    const generation g = std::exchange(generation_, {});
    if (g.ids.empty() || g.at != at) return 0;
    std::size_t tokens = 0;
    for (std::size_t i = 0; i < g.ids.size() && g.ends[i] <= added.size(); ++i) {
      if (added.compare(0, g.ends[i], g.bytes, 0, g.ends[i]) != 0) break;
      if (g.ends[i] == added.size() || !utf8::is_continuation(static_cast<unsigned char>(added[g.ends[i]])))
        tokens = i + 1;
    }
    if (tokens == 0) return 0;
    const std::size_t end = at + g.ends[tokens - 1];
    known_.push_back(
        {at, end, std::vector<token_id>(g.ids.begin(), g.ids.begin() + static_cast<std::ptrdiff_t>(tokens))});
    if (end < at + added.size()) add_cut(end);
    return tokens;
  }

  static constexpr std::string_view magic = "EFIMSS01";

  template <class V>
  static void put(std::string& out, const V& v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  static void put_text(std::string& out, std::string_view t) {
    put(out, std::uint64_t{t.size()});
    out += t;
  }
  static void put_ids(std::string& out, std::span<const token_id> ids) {
    put(out, std::uint64_t{ids.size()});
    for (const token_id t : ids) put(out, t);
  }
  template <class V>
  static bool get(std::string_view& in, V& v) {
    if (in.size() < sizeof v) return false;
    std::memcpy(&v, in.data(), sizeof v);
    in.remove_prefix(sizeof v);
    return true;
  }
  static bool get_text(std::string_view& in, std::string& t) {
    std::uint64_t n = 0;
    if (!get(in, n) || n > in.size()) return false;
    t.assign(in.substr(0, n));
    in.remove_prefix(n);
    return true;
  }
  template <class T>
  static bool get_ids(std::string_view& in, std::vector<token_id>& ids, const T& tok) {
    std::uint64_t n = 0;
    if (!get(in, n) || n > in.size() / sizeof(token_id)) return false;
    for (std::uint64_t i = 0; i < n; ++i) {
      token_id t = 0;
      if (!get(in, t) || t < 0 || static_cast<std::size_t>(t) >= tok.vocab_size()) return false;
      ids.push_back(t);
    }
    return true;
  }
  // Whether `ids`' bytes, one after the other, are `text`.
  template <class T>
  static bool spells(const T& tok, std::span<const token_id> ids, std::string_view text) {
    if (ids.empty()) return false;
    for (const token_id t : ids) {
      const std::string_view b = tok.token_bytes(t);
      if (!text.starts_with(b) || b.empty()) return false;
      text.remove_prefix(b.size());
    }
    return text.empty();
  }

  session_options options_;
  bool anchored_ = false;
  std::uint64_t version_ = 0;
  std::string prefix_, suffix_, typed_;
  std::vector<owned_context_file> extra_;
  std::vector<std::size_t> cuts_;      // fragment ends inside typed_, ascending, never 0 or typed_.size()
  std::vector<known_fragment> known_;  // fragments of typed_ whose ids are known (generated text)
  generation generation_;              // what the last request generated, if recorded
};

}  // namespace efim::prompt
