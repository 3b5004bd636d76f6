#pragma once
// An infill session: what changed between an editor's requests, relative to the session's anchor.
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/utf8.hpp"
#include "efim/prompt/layout.hpp"

namespace efim::prompt {

enum class change {
  first,           // the session had no anchor: this request becomes it
  append,          // text typed after the anchor prefix grew (or stayed): EFIM continues
  edit,            // text was deleted or changed inside the typed part: a shorter cached match
  reanchor,        // the typed part passed the re-anchoring threshold: this request becomes the anchor
  suffix_changed,  // the text after the cursor changed: new anchor
  cursor_moved,    // the prefix no longer starts with the anchor prefix (jump, or deletion into it): new anchor
};

inline constexpr std::string_view to_string(change c) noexcept {
  switch (c) {
    case change::first:
      return "first";
    case change::append:
      return "append";
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
constexpr bool starts_anchor(change c) noexcept { return c != change::append && c != change::edit; }

struct session_update {
  change kind = change::first;
  std::size_t typed_bytes = 0;  // length of the typed part after the update
  std::size_t kept_bytes = 0;   // bytes of the typed part shared with the previous request
};

struct session_options {
  std::size_t reanchor_bytes = 4096;  // a typed part longer than this starts a new anchor
};

class infill_session {
 public:
  explicit infill_session(session_options options = {}) : options_(options) {}

  // Classifies a request (the editor's full prefix and suffix) and moves the session to it.
  // Invalid UTF-8 throws errc::invalid_utf8 and leaves the session as it was.
  session_update update(std::string_view prefix, std::string_view suffix) {
    utf8::require_valid(prefix, "the prefix");
    utf8::require_valid(suffix, "the suffix");
    if (!anchored_) return set_anchor(change::first, prefix, suffix);
    if (suffix != suffix_) return set_anchor(change::suffix_changed, prefix, suffix);
    if (!prefix.starts_with(prefix_)) return set_anchor(change::cursor_moved, prefix, suffix);

    const std::string_view typed = prefix.substr(prefix_.size());
    if (typed.size() > options_.reanchor_bytes) return set_anchor(change::reanchor, prefix, suffix);

    if (typed.starts_with(typed_)) {
      // Text typed before this request becomes a fragment of its own.
      if (!typed_.empty() && typed.size() > typed_.size() && (cuts_.empty() || cuts_.back() != typed_.size()))
        cuts_.push_back(typed_.size());
      const std::size_t kept = typed_.size();
      typed_.assign(typed);
      return {change::append, typed_.size(), kept};
    }

    const std::size_t kept = utf8::common_prefix(typed_, typed);
    std::erase_if(cuts_, [&](std::size_t c) { return c > kept || c >= typed.size(); });
    if (kept > 0 && kept < typed.size() && (cuts_.empty() || cuts_.back() != kept)) cuts_.push_back(kept);
    typed_.assign(typed);
    return {change::edit, typed_.size(), kept};
  }

  // The request to lay out: the anchor's prefix and suffix, and the typed part as fragments.
  // Views into the session: valid until its next update.
  [[nodiscard]] infill_request request() const {
    infill_request r{prefix_, suffix_, {}};
    std::size_t begin = 0;
    const std::string_view typed = typed_;
    for (const std::size_t cut : cuts_) {
      r.typed.push_back(typed.substr(begin, cut - begin));
      begin = cut;
    }
    if (begin < typed.size()) r.typed.push_back(typed.substr(begin));
    return r;
  }

  [[nodiscard]] bool anchored() const noexcept { return anchored_; }
  [[nodiscard]] std::string_view anchor_prefix() const noexcept { return prefix_; }
  [[nodiscard]] std::string_view anchor_suffix() const noexcept { return suffix_; }
  [[nodiscard]] std::string_view typed() const noexcept { return typed_; }

 private:
  session_update set_anchor(change why, std::string_view prefix, std::string_view suffix) {
    prefix_.assign(prefix);
    suffix_.assign(suffix);
    typed_.clear();
    cuts_.clear();
    anchored_ = true;
    return {why, 0, 0};
  }

  session_options options_;
  bool anchored_ = false;
  std::string prefix_, suffix_, typed_;
  std::vector<std::size_t> cuts_;  // fragment ends inside typed_, ascending, never 0 or typed_.size()
};

}  // namespace efim::prompt
