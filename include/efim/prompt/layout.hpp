#pragma once
// A prompt as typed segments: special tokens by role, and runs of text made of fragments.
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

#include "efim/core/types.hpp"
#include "efim/prompt/fim_tokens.hpp"

namespace efim::prompt {

// A file of extra context laid out before the infill (llama.cpp's `input_extra` chunks).
struct context_file {
  std::string_view name;
  std::string_view text;
};

// What a format lays out: the text before the cursor and after it, the text typed since the
// session's anchor as fragments (one per earlier request, oldest first; empty when stateless), and
// extra context files. `typed_ids` is empty or parallel to `typed`: a fragment with ids is not
// tokenized but stands for those ids (text the model generated, whose KV is cached).
// The views must outlive the layout made from them.
struct infill_request {
  std::string_view prefix;
  std::string_view suffix;
  std::vector<std::string_view> typed;
  std::vector<std::span<const token_id>> typed_ids = {};
  std::vector<context_file> extra = {};
};

struct segment {
  enum class kind : std::uint8_t { special, text };
  kind type = kind::text;
  fim_role role = fim_role::prefix;                 // for special segments
  std::vector<std::string_view> fragments;          // for text segments: one run, tokenized per the fragmenter
  std::vector<std::span<const token_id>> ids = {};  // empty, or parallel to fragments: known ids
};

struct prompt_layout {
  std::vector<segment> segments;

  void add_special(fim_role role) { segments.push_back({segment::kind::special, role, {}}); }

  // Appends one run of text; empty fragments are dropped, and so is a run with none left.
  // `tail_ids` is empty or parallel to `tail`.
  void add_text(std::initializer_list<std::string_view> head, const std::vector<std::string_view>& tail = {},
                const std::vector<std::span<const token_id>>& tail_ids = {}) {
    segment s{segment::kind::text, fim_role::prefix, {}};
    for (const auto f : head)
      if (!f.empty()) s.fragments.push_back(f);
    const std::size_t head_count = s.fragments.size();
    bool any_ids = false;
    for (std::size_t i = 0; i < tail.size(); ++i)
      if (!tail[i].empty()) {
        s.fragments.push_back(tail[i]);
        any_ids = any_ids || (i < tail_ids.size() && !tail_ids[i].empty());
      }
    if (any_ids) {
      s.ids.resize(head_count);
      for (std::size_t i = 0; i < tail.size(); ++i)
        if (!tail[i].empty()) s.ids.push_back(i < tail_ids.size() ? tail_ids[i] : std::span<const token_id>{});
    }
    if (!s.fragments.empty()) segments.push_back(std::move(s));
  }
};

}  // namespace efim::prompt
