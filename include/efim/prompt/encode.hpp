#pragma once
// Turns a prompt layout into token ids with a tokenizer and a fragmentation policy.
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/layout.hpp"
#include "efim/text/concepts.hpp"

namespace efim::prompt {

// The id of a role's sentinel in a tokenizer's vocabulary; errc::unknown_token if it has none.
template <text::tokenizer T>
token_id special_id(const T& tok, const fim_token_set& set, fim_role role) {
  const std::string_view text = set.text(role);
  require(!text.empty(), errc::unknown_token,
          "the " + std::string(set.family) + " token set has no " + std::string(to_string(role)) + " token");
  const auto id = tok.special_id(text);
  require(id.has_value(), errc::unknown_token,
          "the tokenizer has no special token '" + std::string(text) + "' (" + std::string(to_string(role)) + " of " +
              std::string(set.family) + ")");
  return *id;
}

// One segment's ids, appended to `out` (text pieces through `sink`).
template <text::tokenizer T, text::fragmenter G, class Sink>
void encode_segment(const segment& s, const T& tok, const fim_token_set& set, G& fragmenter,
                    std::vector<token_id>& out, const Sink& sink) {
  if (s.type == segment::kind::special) {
    out.push_back(special_id(tok, set, s.role));
    return;
  }
  if (s.ids.empty()) {
    fragmenter.for_each_piece(s.fragments, sink);
    return;
  }
  const std::span<const std::string_view> fragments(s.fragments);
  std::size_t run = 0;
  for (std::size_t i = 0; i <= fragments.size(); ++i) {
    if (i < fragments.size() && s.ids[i].empty()) continue;
    if (i > run) fragmenter.for_each_piece(fragments.subspan(run, i - run), sink);
    if (i < fragments.size()) out.insert(out.end(), s.ids[i].begin(), s.ids[i].end());
    run = i + 1;
  }
}

// Appends the layout's ids to `out`: special segments by role, text through the fragmenter, whose
// pieces go to `encode_piece(piece, out)` (the tokenizer's encode, or a memo in front of it).
// Fragments with known ids are not tokenized; the fragments between them are runs of their own.
// `ends`, when given, receives the size of `out` after each segment.
template <text::tokenizer T, text::fragmenter G, class EncodePiece>
void encode(const prompt_layout& layout, const T& tok, const fim_token_set& set, G& fragmenter,
            std::vector<token_id>& out, EncodePiece&& encode_piece, std::vector<std::size_t>* ends = nullptr) {
  const auto sink = [&](std::string_view piece) { encode_piece(piece, out); };
  for (const segment& s : layout.segments) {
    encode_segment(s, tok, set, fragmenter, out, sink);
    if (ends != nullptr) ends->push_back(out.size());
  }
}

// The text segment at the cursor: the last segment when it is text (typed text in EFIM and SPM, a
// plain prompt), else the text after the prefix sentinel (PSM, or EFIM before anything was typed);
// layout.segments.size() when there is none.
inline std::size_t cursor_segment(const prompt_layout& layout) {
  const auto& seg = layout.segments;
  if (!seg.empty() && seg.back().type == segment::kind::text) return seg.size() - 1;
  for (std::size_t i = 1; i < seg.size(); ++i)
    if (seg[i].type == segment::kind::text && seg[i - 1].type == segment::kind::special &&
        seg[i - 1].role == fim_role::prefix)
      return i;
  return seg.size();
}
template <text::tokenizer T, text::fragmenter G>
void encode(const prompt_layout& layout, const T& tok, const fim_token_set& set, G& fragmenter,
            std::vector<token_id>& out) {
  encode(layout, tok, set, fragmenter, out,
         [&](std::string_view piece, std::vector<token_id>& o) { tok.encode(piece, o); });
}

}  // namespace efim::prompt
