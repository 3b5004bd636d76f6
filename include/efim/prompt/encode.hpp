#pragma once
// Turns a prompt layout into token ids with a tokenizer and a fragmentation policy.
#include <string>
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

template <text::tokenizer T, text::fragmenter G>
void encode(const prompt_layout& layout, const T& tok, const fim_token_set& set, G& fragmenter,
            std::vector<token_id>& out) {
  for (const segment& s : layout.segments) {
    if (s.type == segment::kind::special)
      out.push_back(special_id(tok, set, s.role));
    else
      fragmenter.for_each_piece(s.fragments, [&](std::string_view piece) { tok.encode(piece, out); });
  }
}

}  // namespace efim::prompt
