#pragma once
// UTF-8 helpers: validation, character boundaries, encoding.
#include <cstddef>
#include <string>
#include <string_view>

#include "efim/core/error.hpp"

namespace efim::utf8 {

// Length of the sequence a lead byte starts (1-4), or 0 for a byte that cannot start one.
constexpr std::size_t sequence_length(unsigned char lead) noexcept {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;  // continuation byte or overlong 2-byte lead
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

constexpr bool is_continuation(unsigned char byte) noexcept { return (byte & 0xC0) == 0x80; }

// Length of the well-formed sequence at s[pos], or 0 if none starts there
// (bad lead, bad or missing continuation, overlong form, surrogate, > U+10FFFF).
constexpr std::size_t valid_sequence_at(std::string_view s, std::size_t pos) noexcept {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  const std::size_t n = sequence_length(b0);
  if (n == 0 || pos + n > s.size()) return 0;
  for (std::size_t i = 1; i < n; ++i)
    if (!is_continuation(static_cast<unsigned char>(s[pos + i]))) return 0;
  if (n >= 3) {
    const auto b1 = static_cast<unsigned char>(s[pos + 1]);
    if (b0 == 0xE0 && b1 < 0xA0) return 0;   // overlong
    if (b0 == 0xED && b1 >= 0xA0) return 0;  // UTF-16 surrogate
    if (b0 == 0xF0 && b1 < 0x90) return 0;   // overlong
    if (b0 == 0xF4 && b1 >= 0x90) return 0;  // above U+10FFFF
  }
  return n;
}

// Offset of the first byte that is not part of a well-formed sequence, or npos.
constexpr std::size_t find_invalid(std::string_view s) noexcept {
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t n = valid_sequence_at(s, pos);
    if (n == 0) return pos;
    pos += n;
  }
  return std::string_view::npos;
}

constexpr bool is_valid(std::string_view s) noexcept { return find_invalid(s) == std::string_view::npos; }

// Throws errc::invalid_utf8 naming `what` and the offending byte offset.
inline void require_valid(std::string_view s, std::string_view what) {
  const std::size_t bad = find_invalid(s);
  if (bad != std::string_view::npos)
    throw error(errc::invalid_utf8,
                std::string(what) + " is not valid UTF-8 (first bad byte at offset " + std::to_string(bad) + ")");
}

// Largest character boundary <= pos in valid UTF-8 text.
constexpr std::size_t floor_boundary(std::string_view s, std::size_t pos) noexcept {
  if (pos >= s.size()) return s.size();
  while (pos > 0 && is_continuation(static_cast<unsigned char>(s[pos]))) --pos;
  return pos;
}

// Length, on a character boundary, of the longest common prefix of two valid UTF-8 strings.
constexpr std::size_t common_prefix(std::string_view a, std::string_view b) noexcept {
  std::size_t n = 0;
  const std::size_t limit = a.size() < b.size() ? a.size() : b.size();
  while (n < limit && a[n] == b[n]) ++n;
  if (n == limit) return n;  // the shorter string is whole characters
  return floor_boundary(a, n);
}

// Appends the UTF-8 encoding of code point `cp` (below 0x110000) to `out`.
inline void append(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace efim::utf8
