#pragma once
// Unicode services for the tokenizers, from ICU: NFC normalization, and Oniguruma regexes (the
// engine Hugging Face tokenizers run their split patterns on) over UTF-8.
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/utf8.h>
#include <unicode/utypes.h>
// Oniguruma would otherwise #define UChar, which is ICU's UTF-16 code unit type.
#ifndef ONIG_ESCAPE_UCHAR_COLLISION
#define ONIG_ESCAPE_UCHAR_COLLISION
#endif
#include <oniguruma.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "efim/core/error.hpp"

namespace efim::text {

namespace detail {
// ICU's NFC normalizer, looked up once. (ICU's own once-initialization of it is not visible to
// ThreadSanitizer in an uninstrumented libicu; a function-local static is.)
inline const icu::Normalizer2& nfc_normalizer() {
  static const icu::Normalizer2* const n = [] {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* p = icu::Normalizer2::getNFCInstance(status);
    require(U_SUCCESS(status) && p != nullptr, errc::invalid_argument,
            std::string("ICU: no NFC data: ") + u_errorName(status));
    return p;
  }();
  return *n;
}
}  // namespace detail

// Appends the NFC form of valid UTF-8 `s` to `out`. ASCII is already NFC and is copied as is.
inline void append_nfc(std::string_view s, std::string& out) {
  std::size_t ascii = 0;
  while (ascii < s.size() && static_cast<unsigned char>(s[ascii]) < 0x80) ++ascii;
  if (ascii == s.size()) {
    out += s;
    return;
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = &detail::nfc_normalizer();
  // Normalization can only change text from the first non-ASCII character's starter on; the ASCII
  // prefix before it (less the last character, which may take a combining mark) stays.
  const std::size_t keep = ascii == 0 ? 0 : ascii - 1;
  out += s.substr(0, keep);
  icu::StringByteSink<std::string> sink(&out);
  const std::string_view rest = s.substr(keep);
  nfc->normalizeUTF8(0, icu::StringPiece(rest.data(), static_cast<std::int32_t>(rest.size())), sink, nullptr, status);
  require(U_SUCCESS(status), errc::invalid_argument, std::string("ICU: NFC failed: ") + u_errorName(status));
}

// Whether valid UTF-8 `s` is in NFC already (ASCII always is).
inline bool is_nfc(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size() && static_cast<unsigned char>(s[i]) < 0x80) ++i;
  if (i == s.size()) return true;
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = &detail::nfc_normalizer();
  // From the character before the first non-ASCII one, which a combining mark would change.
  const std::string_view rest = s.substr(i - (i > 0 ? 1 : 0));
  const bool yes = nfc->isNormalizedUTF8(icu::StringPiece(rest.data(), static_cast<std::int32_t>(rest.size())), status);
  require(U_SUCCESS(status), errc::invalid_argument, std::string("ICU: NFC check failed: ") + u_errorName(status));
  return yes;
}

inline std::string nfc(std::string_view s) {
  std::string out;
  append_nfc(s, out);
  return out;
}

// What Hugging Face's added tokens test around a match (Rust regex classes, Unicode): \w, a word
// character (alphabetic, a mark, a decimal digit, connector punctuation, a join control), and \s,
// White_Space.
inline bool is_word_character(char32_t c) noexcept {
  const auto cp = static_cast<UChar32>(c);
  return u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) || u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL) ||
         (U_GET_GC_MASK(cp) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}
inline bool is_white_space(char32_t c) noexcept { return u_isUWhiteSpace(static_cast<UChar32>(c)); }

// The code point that ends at byte `end` of valid UTF-8 `s` (end > 0), and the one that starts at
// `begin` (begin < s.size()). Only the (at most 4) bytes of that character are looked at.
inline char32_t code_point_before(std::string_view s, std::size_t end) noexcept {
  const std::size_t back = end < 4 ? end : 4;
  const auto* p = reinterpret_cast<const std::uint8_t*>(s.data() + (end - back));
  auto i = static_cast<std::int32_t>(back);
  UChar32 c = 0;
  U8_PREV(p, 0, i, c);
  return static_cast<char32_t>(c);
}
inline char32_t code_point_at(std::string_view s, std::size_t begin) noexcept {
  const std::size_t ahead = s.size() - begin < 4 ? s.size() - begin : 4;
  const auto* p = reinterpret_cast<const std::uint8_t*>(s.data() + begin);
  std::int32_t i = 0;
  UChar32 c = 0;
  U8_NEXT(p, i, static_cast<std::int32_t>(ahead), c);
  return static_cast<char32_t>(c);
}

namespace detail {
inline void onig_init() {
  static std::once_flag init;
  std::call_once(init, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}
}  // namespace detail

// The classes of code points that the pre-tokenizers' patterns test, as Oniguruma (the regex
// engine of Hugging Face tokenizers) defines them: \p{L}, \p{N}, \p{P} and \s. A hand-written
// splitter that asks these matches what the regex matches, to the Unicode version.
enum char_class : std::uint8_t { cc_letter = 1, cc_number = 2, cc_punct = 4, cc_space = 8 };

// The class bits of every code point, one byte each (0x110000 of them), from Oniguruma's tables. The
// table is never freed: threads that still tokenize while the process exits (static destructors run
// while other threads go on) read it to the end.
inline const std::uint8_t* char_classes() {
  static const std::uint8_t* const table = [] {
    detail::onig_init();
    auto t = std::make_unique<std::uint8_t[]>(0x110000);
    const OnigEncoding enc = ONIG_ENCODING_UTF8;
    const auto mark = [&](int ctype, std::uint8_t bit) {
      OnigCodePoint sb_out = 0;
      const OnigCodePoint* ranges = nullptr;
      require(enc->get_ctype_code_range(static_cast<OnigCtype>(ctype), &sb_out, &ranges) == 0 && ranges != nullptr,
              errc::invalid_argument, "Oniguruma: no code point ranges for a character class");
      for (OnigCodePoint i = 0; i < ranges[0]; ++i)
        for (OnigCodePoint cp = ranges[1 + 2 * i]; cp <= ranges[2 + 2 * i] && cp < 0x110000; ++cp) t[cp] |= bit;
    };
    const auto property = [&](std::string_view name) {
      auto* p = reinterpret_cast<OnigUChar*>(const_cast<char*>(name.data()));
      const int ctype = ONIGENC_PROPERTY_NAME_TO_CTYPE(enc, p, p + name.size());
      require(ctype >= 0, errc::invalid_argument, "Oniguruma: no property " + std::string(name));
      return ctype;
    };
    mark(property("L"), cc_letter);
    mark(property("N"), cc_number);
    mark(property("P"), cc_punct);
    mark(ONIGENC_CTYPE_SPACE, cc_space);
    return t.release();
  }();
  return table;
}

// One character of UTF-8 text: its code point, class bits and length in bytes. Bytes that do not
// start a whole sequence read as one character of no class (callers validate text first).
struct character {
  char32_t cp;
  std::uint8_t cls;
  std::uint8_t len;
};
inline character character_at(std::string_view s, std::size_t i) noexcept {
  static const std::uint8_t* classes = char_classes();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  const unsigned b0 = p[0];
  if (b0 < 0x80) return {b0, classes[b0], 1};
  const std::size_t left = s.size() - i;
  char32_t cp = 0;
  std::uint8_t len = 0;
  if (b0 >= 0xC0 && b0 < 0xE0 && left >= 2) {
    cp = ((b0 & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    len = 2;
  } else if (b0 >= 0xE0 && b0 < 0xF0 && left >= 3) {
    cp = ((b0 & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    len = 3;
  } else if (b0 >= 0xF0 && left >= 4) {
    cp = ((b0 & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    len = 4;
  } else {
    return {b0, 0, 1};
  }
  return {cp, cp < 0x110000 ? classes[cp] : std::uint8_t{0}, len};
}

// A compiled Oniguruma pattern (Oniguruma syntax, UTF-8). Searching is thread-safe.
class regex {
 public:
  explicit regex(std::string_view pattern) : pattern_(pattern) {
    detail::onig_init();
    OnigErrorInfo info{};
    OnigRegex re = nullptr;
    const auto* p = reinterpret_cast<const OnigUChar*>(pattern_.data());
    const int r = onig_new(&re, p, p + pattern_.size(), ONIG_OPTION_CAPTURE_GROUP, ONIG_ENCODING_UTF8,
                           ONIG_SYNTAX_DEFAULT, &info);
    if (r != ONIG_NORMAL) {
      OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
      onig_error_code_to_str(message, r, &info);
      throw error(errc::invalid_argument,
                  "regex '" + pattern_ + "': " + std::string(reinterpret_cast<const char*>(message)));
    }
    re_.reset(re);
  }

  // The first non-empty match at or after byte `at` of `s`, as [b, e); false if there is none. An
  // empty match is stepped over by one character, as a split does.
  bool search(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) const {
    thread_local const std::unique_ptr<OnigRegion, region_free> region(onig_region_new());
    const auto* begin = reinterpret_cast<const OnigUChar*>(s.data());
    const auto* end = begin + s.size();
    while (at <= s.size()) {
      const int r = onig_search(re_.get(), begin, end, begin + at, end, region.get(), ONIG_OPTION_NONE);
      if (r == ONIG_MISMATCH) return false;
      if (r < 0) throw error(errc::invalid_argument, "regex '" + pattern_ + "': search failed");
      b = static_cast<std::size_t>(region->beg[0]);
      e = static_cast<std::size_t>(region->end[0]);
      if (e > b) return true;
      if (b >= s.size()) return false;
      std::size_t n = 1;
      while (b + n < s.size() && (static_cast<unsigned char>(s[b + n]) & 0xC0) == 0x80) ++n;
      at = b + n;
    }
    return false;
  }

  [[nodiscard]] const std::string& pattern() const noexcept { return pattern_; }

 private:
  struct regex_free {
    void operator()(OnigRegex r) const noexcept { onig_free(r); }
  };
  struct region_free {
    void operator()(OnigRegion* r) const noexcept { onig_region_free(r, 1); }
  };
  std::string pattern_;
  std::unique_ptr<std::remove_pointer_t<OnigRegex>, regex_free> re_;
};

}  // namespace efim::text
