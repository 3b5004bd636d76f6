#pragma once
// Pre-tokenizers: the steps that cut normalized text into the words BPE runs on, as Hugging Face
// tokenizers defines them (Split with a regex, Digits, ByteLevel's own regex), and the presets that
// GGUF files name in `tokenizer.ggml.pre`.
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

struct split_step {
  std::shared_ptr<const regex> pattern;
  split_behavior behavior = split_behavior::isolated;
  bool invert = false;
};

// The regex of GPT-2's byte-level pre-tokenizer (Hugging Face ByteLevel with use_regex).
inline constexpr std::string_view gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class pre_tokenizer {
 public:
  pre_tokenizer() = default;

  // Appends a split by `pattern` (Oniguruma syntax).
  pre_tokenizer& split(std::string_view pattern, split_behavior behavior = split_behavior::isolated,
                       bool invert = false) {
    steps_.push_back({std::make_shared<const regex>(pattern), behavior, invert});
    return *this;
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

  // The presets GGUF files name: each a sequence of isolating splits.
  struct named_preset {
    std::string_view name;
    std::vector<std::string_view> patterns;
  };
  static const std::vector<named_preset>& presets() {
    static const std::vector<named_preset> table{
        {"gpt-2", {gpt2_pattern}},
        {"qwen2",
         {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
        {"llama-bpe",
         {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
        {"starcoder", {R"(\p{N})", gpt2_pattern}},
        {"deepseek-coder",
         {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+", R"(\p{N})"}},
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
    const auto& s = *steps_[step].pattern;
    const auto behavior = steps_[step].behavior;
    const bool invert = steps_[step].invert;
    // Pieces as (begin, end, is_match).
    std::vector<std::pair<std::pair<std::size_t, std::size_t>, bool>> pieces;
    std::size_t prev = 0;
    s.for_each_match(text, [&](std::size_t b, std::size_t e) {
      if (b > prev) pieces.push_back({{prev, b}, invert});
      pieces.push_back({{b, e}, !invert});
      prev = e;
    });
    if (prev < text.size()) pieces.push_back({{prev, text.size()}, invert});

    const auto emit = [&](std::size_t b, std::size_t e) {
      if (e > b) apply(step + 1, text.substr(b, e - b), f);
    };
    switch (behavior) {
      case split_behavior::isolated:
        for (const auto& [range, m] : pieces) emit(range.first, range.second);
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
