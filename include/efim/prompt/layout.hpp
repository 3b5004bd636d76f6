#pragma once
// A prompt as typed segments: special tokens by role, and runs of text made of fragments.
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "efim/prompt/fim_tokens.hpp"

namespace efim::prompt {

// What a format lays out: the text before the cursor and after it, and the text typed since the
// session's anchor as fragments (one per earlier request, oldest first; empty when stateless).
// The views must outlive the layout made from them.
struct infill_request {
  std::string_view prefix;
  std::string_view suffix;
  std::vector<std::string_view> typed;
};

struct segment {
  enum class kind : std::uint8_t { special, text };
  kind type = kind::text;
  fim_role role = fim_role::prefix;         // for special segments
  std::vector<std::string_view> fragments;  // for text segments: one run, tokenized per the fragmenter
};

struct prompt_layout {
  std::vector<segment> segments;

  void add_special(fim_role role) { segments.push_back({segment::kind::special, role, {}}); }

  // Appends one run of text; empty fragments are dropped, and so is a run with none left.
  void add_text(std::initializer_list<std::string_view> head, const std::vector<std::string_view>& tail = {}) {
    segment s{segment::kind::text, fim_role::prefix, {}};
    for (const auto f : head)
      if (!f.empty()) s.fragments.push_back(f);
    for (const auto f : tail)
      if (!f.empty()) s.fragments.push_back(f);
    if (!s.fragments.empty()) segments.push_back(std::move(s));
  }
};

}  // namespace efim::prompt
