#pragma once
// A pull reader of JSON text (RFC 8259), for documents too large to parse into a tree on a hot
// start-up path (a tokenizer.json holds 150,000 tokens and as many merges): the caller walks the
// document, strings come back as views into the text (or into a scratch buffer where they hold
// escapes), and what the caller does not want is skipped, still checked. Malformed text, invalid
// UTF-8 in a string and nesting deeper than 512 give efim::error with the byte offset.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "efim/core/error.hpp"
#include "efim/core/utf8.hpp"

namespace efim::json {

class reader {
 public:
  // `what` names the document in error messages.
  reader(std::string_view text, std::string what) : s_(text), what_(std::move(what)) {}

  [[noreturn]] void fail(std::string_view message) const {
    throw error(errc::invalid_argument,
                what_ + ": " + std::string(message) + " (at byte " + std::to_string(pos_) + ")");
  }

  // The next character after white space (0 at the end).
  char peek() {
    ws();
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  // Walks an object or an array: open('{') (or '['), then `while (more('}', first))` reads a member
  // (key, ':', value) or an element each time round.
  void open(char bracket) {
    expect(bracket);
    if (++depth_ > 512) fail("nested too deep");
  }
  bool more(char close, bool& first) {
    const char c = peek();
    if (c == close) {
      ++pos_;
      --depth_;
      return false;
    }
    if (!first) {
      if (c != ',') fail(std::string("expected ',' or '") + close + "'");
      ++pos_;
      if (peek() == close) fail("a trailing ','");
    }
    first = false;
    return true;
  }
  // A member's key and the ':' after it.
  std::string_view key(std::string& scratch) {
    const std::string_view k = string(scratch);
    expect(':');
    return k;
  }

  // A string value: a view into the text, or into `scratch` where it holds escapes.
  std::string_view string(std::string& scratch) {
    expect('"');
    const std::size_t begin = pos_;
    bool escaped = false;
    unsigned high = 0;  // any byte above 0x7F: only then is UTF-8 checked
    for (;; ++pos_) {
      if (pos_ >= s_.size()) fail("a string is not closed");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      high |= c;
      if (c == '"' || c < 0x20 || c == '\\') {
        if (c == '"') break;
        if (c < 0x20) fail("a control character in a string");
        escaped = true;
        ++pos_;  // the escaped character is never the closing quote
      }
    }
    const std::string_view raw = s_.substr(begin, pos_ - begin);
    ++pos_;
    if ((high & 0x80) != 0 && !utf8::is_valid(raw)) fail("a string is not valid UTF-8");
    if (!escaped) return raw;
    scratch.clear();
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] != '\\') {
        scratch += raw[i];
        continue;
      }
      if (++i >= raw.size()) fail("a string ends in an escape");
      switch (raw[i]) {
        case '"': scratch += '"'; break;
        case '\\': scratch += '\\'; break;
        case '/': scratch += '/'; break;
        case 'b': scratch += '\b'; break;
        case 'f': scratch += '\f'; break;
        case 'n': scratch += '\n'; break;
        case 'r': scratch += '\r'; break;
        case 't': scratch += '\t'; break;
        case 'u': {
          char32_t cp = hex4(raw, i + 1);
          i += 4;
          if (cp >= 0xD800 && cp < 0xDC00) {  // a high surrogate: its low one must follow
            if (i + 6 >= raw.size() || raw[i + 1] != '\\' || raw[i + 2] != 'u') fail("a lone surrogate");
            const char32_t low = hex4(raw, i + 3);
            if (low < 0xDC00 || low >= 0xE000) fail("a lone surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            i += 6;
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("a lone surrogate");
          }
          utf8::append(cp, scratch);
          break;
        }
        default:
          fail("an unknown escape in a string");
      }
    }
    return scratch;
  }

  // An integer value (no fraction or exponent), within int64.
  std::int64_t integer() {
    const std::size_t begin = (ws(), pos_);
    const std::string_view n = number();
    if (n.find_first_of(".eE") != std::string_view::npos) {
      pos_ = begin;
      fail("expected an integer");
    }
    const bool negative = n[0] == '-';
    std::uint64_t v = 0;
    for (std::size_t i = negative ? 1 : 0; i < n.size(); ++i) {
      const auto d = static_cast<std::uint64_t>(n[i] - '0');
      if (v > (std::uint64_t{1} << 62) / 10) {
        pos_ = begin;
        fail("an integer out of range");
      }
      v = v * 10 + d;
    }
    return negative ? -static_cast<std::int64_t>(v) : static_cast<std::int64_t>(v);
  }

  // true, false, or null (as false).
  bool boolean() {
    const char c = peek();
    if (c == 't') return literal("true"), true;
    if (c == 'f') return literal("false"), false;
    if (c == 'n') return literal("null"), false;
    fail("expected true or false");
  }

  // Skips one value, checking it; returns its text.
  std::string_view skip() {
    std::string scratch;
    const char c = peek();
    const std::size_t begin = pos_;
    switch (c) {
      case '{': {
        open('{');
        for (bool first = true; more('}', first);) {
          key(scratch);
          skip();
        }
        break;
      }
      case '[': {
        open('[');
        for (bool first = true; more(']', first);) skip();
        break;
      }
      case '"': string(scratch); break;
      case 't': literal("true"); break;
      case 'f': literal("false"); break;
      case 'n': literal("null"); break;
      default: number(); break;
    }
    return s_.substr(begin, pos_ - begin);
  }

  // The end of the document: nothing but white space is left.
  void finish() {
    if (peek() != '\0' || pos_ < s_.size()) fail("text after the document");
  }

 private:
  void ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }
  void literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) fail("an unknown literal");
    pos_ += word.size();
  }
  // A number's text: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  std::string_view number() {
    ws();
    const std::size_t begin = pos_;
    const auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == from) fail("expected a value");
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0')
      ++pos_;
    else
      digits();
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits();
    }
    return s_.substr(begin, pos_ - begin);
  }
  char32_t hex4(std::string_view raw, std::size_t at) const {
    if (at + 4 > raw.size()) fail("a short \\u escape");
    char32_t v = 0;
    for (std::size_t i = at; i < at + 4; ++i) {
      const char c = raw[i];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) fail("a bad \\u escape");
      v = v * 16 + static_cast<char32_t>(d);
    }
    return v;
  }
  std::string_view s_;
  std::string what_;
  std::size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace efim::json
