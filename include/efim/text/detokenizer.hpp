#pragma once
// Streaming detokenizer: turns generated ids into text that is always whole UTF-8 characters.
#include <string>
#include <string_view>

#include "efim/core/types.hpp"
#include "efim/core/utf8.hpp"
#include "efim/text/concepts.hpp"

namespace efim::text {

inline constexpr std::string_view replacement_character = "\xEF\xBF\xBD";  // U+FFFD

template <tokenizer T>
class detokenizer {
 public:
  explicit detokenizer(const T& tok, bool render_special = false) : tok_(&tok), render_special_(render_special) {}

  // Appends to `out` the characters `id` completes. Bytes that cannot become part of a
  // well-formed character are replaced by U+FFFD; a character split across tokens waits.
  void push(token_id id, std::string& out) {
    if (tok_->is_special(id)) {
      if (render_special_) {
        flush(out);
        out += tok_->token_bytes(id);
      }
      return;
    }
    pending_ += tok_->token_bytes(id);
    drain(out, false);
  }

  // Appends to `out` the characters raw token bytes complete (part of a token, as token healing
  // passes on only what follows the text it gave back).
  void push_bytes(std::string_view bytes, std::string& out) {
    pending_ += bytes;
    drain(out, false);
  }

  // Ends the stream: an unfinished character becomes U+FFFD.
  void flush(std::string& out) { drain(out, true); }

  [[nodiscard]] std::size_t pending_bytes() const noexcept { return pending_.size(); }

 private:
  void drain(std::string& out, bool at_end) {
    const std::string_view p = pending_;
    std::size_t pos = 0;
    while (pos < p.size()) {
      const std::size_t want = utf8::sequence_length(static_cast<unsigned char>(p[pos]));
      if (want != 0 && pos + want > p.size() && !at_end && continues_validly(p.substr(pos))) break;
      const std::size_t n = utf8::valid_sequence_at(p, pos);
      if (n == 0) {
        out += replacement_character;
        ++pos;
      } else {
        out += p.substr(pos, n);
        pos += n;
      }
    }
    pending_.erase(0, pos);
  }

  // Whether an incomplete sequence can still be completed by the bytes to come.
  static bool continues_validly(std::string_view partial) {
    for (std::size_t i = 1; i < partial.size(); ++i)
      if (!utf8::is_continuation(static_cast<unsigned char>(partial[i]))) return false;
    return true;
  }

  const T* tok_;
  bool render_special_;
  std::string pending_;
};

}  // namespace efim::text
