#pragma once
// What the text layer asks of tokenizers and fragmentation policies.
#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "efim/core/types.hpp"

namespace efim::text {

// A tokenizer turns plain text into ids (special-token text is never parsed by encode), names the
// id of a special token's text, and gives the bytes a token stands for.
template <class T>
concept tokenizer = requires(const T& t, std::string_view s, std::vector<token_id>& out, token_id id) {
  { t.encode(s, out) } -> std::same_as<void>;
  { t.special_id(s) } -> std::same_as<std::optional<token_id>>;
  { t.token_bytes(id) } -> std::convertible_to<std::string_view>;
  { t.is_special(id) } -> std::same_as<bool>;
  { t.vocab_size() } -> std::convertible_to<std::size_t>;
};

namespace detail {
// Stands for any callable a fragmenter hands its pieces to.
struct piece_sink_archetype {
  void operator()(std::string_view) const;
};
}  // namespace detail

// A fragmentation policy cuts one run of text, given as the fragments it was built from (oldest
// first), into the pieces that are tokenized separately, and hands them to `sink` in order.
template <class G>
concept fragmenter = requires(G& g, std::span<const std::string_view> fragments, detail::piece_sink_archetype sink) {
  { g.for_each_piece(fragments, sink) } -> std::same_as<void>;
};

}  // namespace efim::text
