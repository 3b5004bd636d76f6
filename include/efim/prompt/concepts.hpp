#pragma once
// What the prompt layer asks of a FIM format policy.
#include <concepts>
#include <string_view>

#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/layout.hpp"

namespace efim::prompt {

// A format lays out an infill request as segments. `typed_at_end` says whether text typed after
// the anchor lands at the end of the prompt, so each keystroke only appends tokens.
template <class F>
concept fim_format = requires(const infill_request& r, const fim_token_set& s) {
  { F::name } -> std::convertible_to<std::string_view>;
  { F::typed_at_end } -> std::convertible_to<bool>;
  { F::layout(r, s) } -> std::same_as<prompt_layout>;
};

}  // namespace efim::prompt
