#pragma once
// The embedded default tokenizer: one id per byte (0-255), then the special tokens it was given.
#include <array>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/text/concepts.hpp"

namespace efim::text {

class byte_tokenizer {
 public:
  static constexpr token_id byte_tokens = 256;

  // Special tokens get ids 256, 257, ... in the order given; they must be distinct and non-empty.
  explicit byte_tokenizer(std::vector<std::string> special_tokens = {}) : specials_(std::move(special_tokens)) {
    for (std::size_t i = 0; i < specials_.size(); ++i) {
      require(!specials_[i].empty(), errc::invalid_argument, "byte_tokenizer: a special token is empty");
      for (std::size_t j = 0; j < i; ++j)
        require(specials_[j] != specials_[i], errc::invalid_argument,
                "byte_tokenizer: special token '" + specials_[i] + "' is given twice");
    }
    for (std::size_t b = 0; b < bytes_.size(); ++b) bytes_[b] = static_cast<char>(b);
  }

  void encode(std::string_view s, std::vector<token_id>& out) const {
    out.reserve(out.size() + s.size());
    for (const char c : s) out.push_back(static_cast<token_id>(static_cast<unsigned char>(c)));
  }

  [[nodiscard]] std::optional<token_id> special_id(std::string_view s) const {
    for (std::size_t i = 0; i < specials_.size(); ++i)
      if (specials_[i] == s) return static_cast<token_id>(byte_tokens + static_cast<token_id>(i));
    return std::nullopt;
  }

  // The bytes of a byte token, or the text of a special token.
  [[nodiscard]] std::string_view token_bytes(token_id id) const {
    if (id < 0 || static_cast<std::size_t>(id) >= vocab_size())  // (the message only on failure: per token)
      throw error(errc::unknown_token, "byte_tokenizer: token id " + std::to_string(id) +
                                           " is outside the vocabulary of " + std::to_string(vocab_size()));
    if (id < byte_tokens) return {&bytes_[static_cast<std::size_t>(id)], 1};
    return specials_[static_cast<std::size_t>(id - byte_tokens)];
  }

  [[nodiscard]] bool is_special(token_id id) const noexcept {
    return id >= byte_tokens && static_cast<std::size_t>(id) < vocab_size();
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return byte_tokens + specials_.size(); }
  [[nodiscard]] std::span<const std::string> special_tokens() const noexcept { return specials_; }

 private:
  std::vector<std::string> specials_;
  std::array<char, byte_tokens> bytes_{};
};

static_assert(tokenizer<byte_tokenizer>);

}  // namespace efim::text
