#pragma once
// Pre-tokenizers: the steps that cut normalized text into the words BPE runs on, as Hugging Face
// tokenizers defines them (Split with a regex, Digits, ByteLevel's own regex), and the presets that
// GGUF files name in `tokenizer.ggml.pre`. The patterns of the presets run as hand-written
// splitters (the `splitters` below), which the tests check against the Oniguruma regex they stand
// for; any other pattern runs on Oniguruma.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/text/unicode.hpp"

namespace efim::text {

// What a split does with the matches of its pattern (Hugging Face's SplitDelimiterBehavior).
enum class split_behavior { isolated, removed, merged_with_previous, merged_with_next, contiguous };

// The regex of GPT-2's byte-level pre-tokenizer (Hugging Face ByteLevel with use_regex).
inline constexpr std::string_view gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view qwen2_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view llama3_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view deepseek_cjk_pattern =
    "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+";

// Hand-written splitters, each finding what one pattern finds: the first match at or after byte
// `at` of valid UTF-8 `s`, as [b, e) (never empty), or false. They ask the code point classes
// Oniguruma has (char_classes), so that they agree with the regex on every character.
namespace splitters {

using find_fn = bool (*)(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e);

// The end of the run of characters from byte i whose classes meet `any` (or, with `none`, meet
// nothing of it).
template <bool None = false>
inline std::size_t run_end(std::string_view s, std::size_t i, std::uint8_t mask) noexcept {
  while (i < s.size()) {
    const character c = character_at(s, i);
    if (((c.cls & mask) != 0) == None) break;
    i += c.len;
  }
  return i;
}
inline constexpr std::uint8_t cc_word = cc_letter | cc_number | cc_space;  // [^\s\p{L}\p{N}] is none of these
inline bool is_other(const character& c) noexcept { return (c.cls & cc_word) == 0; }

// \s+(?!\S)|\s+ from a white-space character at i: the run, less its last character where a
// non-space follows and the run has two or more characters.
inline std::size_t space_run_end(std::string_view s, std::size_t i) noexcept {
  std::size_t last = i, count = 0;
  while (i < s.size()) {
    const character c = character_at(s, i);
    if ((c.cls & cc_space) == 0) break;
    last = i;
    i += c.len;
    ++count;
  }
  return i == s.size() || count < 2 ? i : last;
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
inline std::size_t gpt2_end(std::string_view s, std::size_t i) noexcept {
  const std::size_t n = s.size();
  if (s[i] == '\'' && i + 1 < n) {
    const char b = s[i + 1];
    if (b == 's' || b == 't' || b == 'm' || b == 'd') return i + 2;
    if (i + 2 < n && (((b == 'r' || b == 'v') && s[i + 2] == 'e') || (b == 'l' && s[i + 2] == 'l'))) return i + 3;
  }
  character c = character_at(s, i);
  std::size_t j = i;
  if (c.cp == ' ' && i + 1 < n) {  // a space joins the run of letters, digits or others after it
    const character d = character_at(s, i + 1);
    if ((d.cls & cc_space) == 0) {
      c = d;
      j = i + 1;
    }
  }
  if (c.cls & cc_letter) return run_end(s, j, cc_letter);
  if (c.cls & cc_number) return run_end(s, j, cc_number);
  if (is_other(c)) return run_end<true>(s, j, cc_word);
  return space_run_end(s, i);
}

// Lower case for the contractions of (?i:'s|'t|'re|'ve|'m|'ll|'d): ASCII, and U+017F (long s),
// whose case folding is s.
inline char32_t fold(char32_t c) noexcept {
  if (c >= 'A' && c <= 'Z') return c + 32;
  return c == 0x17F ? U's' : c;
}

// Qwen2 (MaxDigits 1) and Llama 3 (MaxDigits 3):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,MaxDigits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+
template <int MaxDigits>
inline std::size_t llama_end(std::string_view s, std::size_t i) noexcept {
  const std::size_t n = s.size();
  const character c = character_at(s, i);
  if (c.cp == '\'' && i + 1 < n) {
    const character d = character_at(s, i + 1);
    const char32_t f = fold(d.cp);
    const std::size_t after = i + 1 + d.len;
    if (f == 's' || f == 't' || f == 'm' || f == 'd') return after;
    if ((f == 'r' || f == 'v' || f == 'l') && after < n) {
      const char32_t g = fold(character_at(s, after).cp);
      if ((f == 'l' && g == 'l') || (f != 'l' && g == 'e')) return after + character_at(s, after).len;
    }
  }
  if (c.cls & cc_letter) return run_end(s, i, cc_letter);
  if ((c.cls & cc_number) == 0 && c.cp != '\r' && c.cp != '\n' && i + c.len < n) {
    const character d = character_at(s, i + c.len);  // one character of anything else leads letters
    if (d.cls & cc_letter) return run_end(s, i + c.len, cc_letter);
  }
  if (c.cls & cc_number) {
    std::size_t j = i + c.len;
    for (int k = 1; k < MaxDigits && j < n; ++k) {
      const character d = character_at(s, j);
      if ((d.cls & cc_number) == 0) break;
      j += d.len;
    }
    return j;
  }
  std::size_t j = i;
  bool other = is_other(c);
  if (c.cp == ' ' && i + 1 < n && is_other(character_at(s, i + 1))) {
    j = i + 1;
    other = true;
  }
  if (other) {
    j = run_end<true>(s, j, cc_word);
    while (j < n && (s[j] == '\r' || s[j] == '\n')) ++j;
    return j;
  }
  // White space: up to its last line break (\s*[\r\n]+), else \s+(?!\S)|\s+.
  std::size_t end = i, line_break = std::string_view::npos;
  while (end < n) {
    const character d = character_at(s, end);
    if ((d.cls & cc_space) == 0) break;
    if (d.cp == '\r' || d.cp == '\n') line_break = end;
    end += d.len;
  }
  return line_break != std::string_view::npos ? line_break + 1 : space_run_end(s, i);
}

// A pattern some alternative of which matches at every character: each match starts where the last
// ended.
template <std::size_t (*End)(std::string_view, std::size_t) noexcept>
inline bool contiguous(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) {
  if (at >= s.size()) return false;
  b = at;
  e = End(s, at);
  return true;
}

// The first character at or after `at` that starts a match of `Start`, and the match's end.
template <class Start>
inline bool first(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e, Start start) {
  for (std::size_t i = at; i < s.size();) {
    const character c = character_at(s, i);
    if (const std::size_t end = start(s, i, c); end != 0) {
      b = i;
      e = end;
      return true;
    }
    i += c.len;
  }
  return false;
}

// \p{N} and \p{N}+
template <bool Run>
inline bool numbers(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) {
  return first(s, at, b, e, [](std::string_view t, std::size_t i, const character& c) -> std::size_t {
    if ((c.cls & cc_number) == 0) return 0;
    return Run ? run_end(t, i, cc_number) : i + c.len;
  });
}
// [\r\n]
inline bool line_break(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) {
  for (std::size_t i = at; i < s.size(); ++i)
    if (s[i] == '\r' || s[i] == '\n') {
      b = i;
      e = i + 1;
      return true;
    }
  return false;
}
// \s?\p{L}+ (Class cc_letter) and \s?\p{P}+ (cc_punct)
template <std::uint8_t Class>
inline bool spaced_run(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) {
  return first(s, at, b, e, [](std::string_view t, std::size_t i, const character& c) -> std::size_t {
    if (c.cls & Class) return run_end(t, i, Class);
    if ((c.cls & cc_space) && i + c.len < t.size() && (character_at(t, i + c.len).cls & Class))
      return run_end(t, i + c.len, Class);
    return 0;
  });
}
// [\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+
inline bool cjk_run(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) {
  const auto in = [](char32_t cp) { return (cp >= 0x800 && cp <= 0x9FA5) || (cp >= 0xAC00 && cp <= 0xD7FF); };
  return first(s, at, b, e, [&](std::string_view t, std::size_t i, const character& c) -> std::size_t {
    if (!in(c.cp)) return 0;
    while (i < t.size()) {
      const character d = character_at(t, i);
      if (!in(d.cp)) break;
      i += d.len;
    }
    return i;
  });
}

// The splitter written for `pattern`, or null.
inline find_fn for_pattern(std::string_view pattern) noexcept {
  struct entry {
    std::string_view pattern;
    find_fn find;
  };
  static const entry table[] = {
      {gpt2_pattern, contiguous<gpt2_end>},
      {qwen2_pattern, contiguous<llama_end<1>>},
      {llama3_pattern, contiguous<llama_end<3>>},
      {R"(\p{N})", numbers<false>},
      {R"(\p{N}+)", numbers<true>},
      {R"([\r\n])", line_break},
      {R"(\s?\p{L}+)", spaced_run<cc_letter>},
      {R"(\s?\p{P}+)", spaced_run<cc_punct>},
      {deepseek_cjk_pattern, cjk_run},
  };
  for (const auto& t : table)
    if (t.pattern == pattern) return t.find;
  return nullptr;
}

}  // namespace splitters

// One split: its pattern, and how it is searched (a hand-written splitter where one is written for
// the pattern, else the compiled regex).
struct split_step {
  std::string pattern;
  splitters::find_fn native = nullptr;
  std::shared_ptr<const regex> compiled;
  split_behavior behavior = split_behavior::isolated;
  bool invert = false;

  bool find(std::string_view s, std::size_t at, std::size_t& b, std::size_t& e) const {
    return native != nullptr ? native(s, at, b, e) : compiled->search(s, at, b, e);
  }
};

class pre_tokenizer {
 public:
  pre_tokenizer() = default;

  // Appends a split by `pattern` (Oniguruma syntax), which runs as a hand-written splitter where
  // one is written for the pattern.
  pre_tokenizer& split(std::string_view pattern, split_behavior behavior = split_behavior::isolated,
                       bool invert = false) {
    split_step step{std::string(pattern), splitters::for_pattern(pattern), nullptr, behavior, invert};
    if (step.native == nullptr) step.compiled = std::make_shared<const regex>(pattern);
    steps_.push_back(std::move(step));
    return *this;
  }

  // The same splits, each run on the Oniguruma regex (the oracle the hand-written splitters are
  // tested against).
  [[nodiscard]] pre_tokenizer on_regex() const {
    pre_tokenizer out = *this;
    for (auto& step : out.steps_) {
      if (step.compiled == nullptr) step.compiled = std::make_shared<const regex>(step.pattern);
      step.native = nullptr;
    }
    return out;
  }

  // Whether every split runs as a hand-written splitter.
  [[nodiscard]] bool native() const noexcept {
    for (const auto& step : steps_)
      if (step.native == nullptr) return false;
    return true;
  }

  // The preset for a `tokenizer.ggml.pre` name.
  static pre_tokenizer preset(std::string_view name) {
    for (const auto& p : presets())
      if (p.name == name || (p.name == "gpt-2" && (name == "gpt2" || name == "default")) ||
          (p.name == "llama-bpe" && name == "llama3")) {
        pre_tokenizer out;
        for (const auto pattern : p.patterns) out.split(pattern);
        return out;
      }
    throw error(errc::invalid_argument, "pre-tokenizer '" + std::string(name) +
                                            "' is not known (known: gpt-2, qwen2, llama-bpe, starcoder, "
                                            "deepseek-coder)");
  }

  // The presets GGUF files name: each a sequence of isolating splits. (Never destroyed: a thread that
  // still tokenizes while the process exits reads it.)
  struct named_preset {
    std::string_view name;
    std::vector<std::string_view> patterns;
  };
  static const std::vector<named_preset>& presets() {
    static const auto& table = *new const std::vector<named_preset>{
        {"gpt-2", {gpt2_pattern}},
        {"qwen2", {qwen2_pattern}},
        {"llama-bpe", {llama3_pattern}},
        {"starcoder", {R"(\p{N})", gpt2_pattern}},
        {"deepseek-coder", {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", deepseek_cjk_pattern, R"(\p{N})"}},
    };
    return table;
  }

  // Calls f(word) for each word of `text`, in order.
  template <class F>
  void for_each_word(std::string_view text, F&& f) const {
    if (text.empty()) return;
    if (steps_.empty()) {
      f(text);
      return;
    }
    apply(0, text, f);
  }

  [[nodiscard]] bool empty() const noexcept { return steps_.empty(); }

 private:
  template <class F>
  void apply(std::size_t step, std::string_view text, F& f) const {
    if (step == steps_.size()) {
      f(text);
      return;
    }
    const split_step& s = steps_[step];
    const auto emit = [&](std::size_t b, std::size_t e) {
      if (e > b) apply(step + 1, text.substr(b, e - b), f);
    };
    std::size_t prev = 0, b = 0, e = 0;
    if (s.behavior == split_behavior::isolated) {  // every piece on its own, matched or not
      for (std::size_t at = 0; at < text.size() && s.find(text, at, b, e); at = e) {
        emit(prev, b);
        emit(b, e);
        prev = e;
      }
      emit(prev, text.size());
      return;
    }
    // Pieces as (begin, end, is_match).
    std::vector<std::pair<std::pair<std::size_t, std::size_t>, bool>> pieces;
    for (std::size_t at = 0; at < text.size() && s.find(text, at, b, e); at = e) {
      if (b > prev) pieces.push_back({{prev, b}, s.invert});
      pieces.push_back({{b, e}, !s.invert});
      prev = e;
    }
    if (prev < text.size()) pieces.push_back({{prev, text.size()}, s.invert});

    switch (s.behavior) {
      case split_behavior::isolated:
        break;
      case split_behavior::removed:
        for (const auto& [range, m] : pieces)
          if (!m) emit(range.first, range.second);
        break;
      case split_behavior::merged_with_previous: {
        // A delimiter joins the piece before it (a second delimiter in a row stands alone).
        std::size_t start = 0;
        for (const auto& [range, m] : pieces)
          if (m) {
            emit(start, range.second);
            start = range.second;
          }
        emit(start, text.size());
        break;
      }
      case split_behavior::merged_with_next: {
        // A delimiter joins the piece after it, unless that is a delimiter too.
        std::size_t start = std::string_view::npos;
        for (std::size_t i = 0; i < pieces.size(); ++i) {
          const auto& [range, m] = pieces[i];
          if (m && i + 1 < pieces.size() && !pieces[i + 1].second) {
            start = range.first;
            continue;
          }
          emit(start != std::string_view::npos ? start : range.first, range.second);
          start = std::string_view::npos;
        }
        break;
      }
      case split_behavior::contiguous: {
        // Consecutive delimiters form one piece.
        std::size_t i = 0;
        while (i < pieces.size()) {
          std::size_t j = i + 1;
          if (pieces[i].second)
            while (j < pieces.size() && pieces[j].second) ++j;
          emit(pieces[i].first.first, pieces[j - 1].first.second);
          i = j;
        }
        break;
      }
    }
  }

  std::vector<split_step> steps_;
};

}  // namespace efim::text
