#pragma once
// FIM token sets: the sentinel strings each model family was trained with, by role.
#include <array>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace efim::prompt {

enum class fim_role { bos, prefix, suffix, middle, eos, pad, repo_name, file_sep };

inline constexpr std::array all_fim_roles{fim_role::bos, fim_role::prefix, fim_role::suffix,    fim_role::middle,
                                          fim_role::eos, fim_role::pad,    fim_role::repo_name, fim_role::file_sep};

inline constexpr std::string_view to_string(fim_role role) noexcept {
  switch (role) {
    case fim_role::bos:
      return "bos";
    case fim_role::prefix:
      return "prefix";
    case fim_role::suffix:
      return "suffix";
    case fim_role::middle:
      return "middle";
    case fim_role::eos:
      return "eos";
    case fim_role::pad:
      return "pad";
    case fim_role::repo_name:
      return "repo_name";
    case fim_role::file_sep:
      return "file_sep";
  }
  return "?";
}

// Empty strings mean the family has no token for that role.
struct fim_token_set {
  std::string_view family;
  std::string_view prefix, suffix, middle;  // the three FIM sentinels (required)
  std::string_view eos;                     // ends a completion
  std::string_view bos = {};                // emitted first when add_bos is set
  std::string_view pad = {}, repo_name = {}, file_sep = {};
  bool add_bos = false;

  [[nodiscard]] constexpr std::string_view text(fim_role role) const noexcept {
    switch (role) {
      case fim_role::bos:
        return bos;
      case fim_role::prefix:
        return prefix;
      case fim_role::suffix:
        return suffix;
      case fim_role::middle:
        return middle;
      case fim_role::eos:
        return eos;
      case fim_role::pad:
        return pad;
      case fim_role::repo_name:
        return repo_name;
      case fim_role::file_sep:
        return file_sep;
    }
    return {};
  }

  // The distinct non-empty sentinel strings, in role order: what a vocabulary must hold.
  [[nodiscard]] std::vector<std::string> special_tokens() const {
    std::vector<std::string> out;
    for (const fim_role role : all_fim_roles) {
      const std::string_view t = text(role);
      if (t.empty()) continue;
      bool seen = false;
      for (const auto& s : out) seen = seen || s == t;
      if (!seen) out.emplace_back(t);
    }
    return out;
  }
};

// Qwen2.5-Coder (base models).
inline constexpr fim_token_set qwen25_coder{.family = "qwen2.5-coder",
                                            .prefix = "<|fim_prefix|>",
                                            .suffix = "<|fim_suffix|>",
                                            .middle = "<|fim_middle|>",
                                            .eos = "<|endoftext|>",
                                            .pad = "<|fim_pad|>",
                                            .repo_name = "<|repo_name|>",
                                            .file_sep = "<|file_sep|>"};

// StarCoder and StarCoder2.
inline constexpr fim_token_set starcoder{.family = "starcoder",
                                         .prefix = "<fim_prefix>",
                                         .suffix = "<fim_suffix>",
                                         .middle = "<fim_middle>",
                                         .eos = "<|endoftext|>",
                                         .pad = "<fim_pad>",
                                         .repo_name = "<repo_name>",
                                         .file_sep = "<file_sep>"};

// DeepSeek-Coder: begin / hole / end play the prefix / suffix / middle roles.
inline constexpr fim_token_set deepseek_coder{.family = "deepseek-coder",
                                              .prefix =
                                                  "<\xEF\xBD\x9C"
                                                  "fim\xE2\x96\x81"
                                                  "begin\xEF\xBD\x9C>",
                                              .suffix =
                                                  "<\xEF\xBD\x9C"
                                                  "fim\xE2\x96\x81"
                                                  "hole\xEF\xBD\x9C>",
                                              .middle =
                                                  "<\xEF\xBD\x9C"
                                                  "fim\xE2\x96\x81"
                                                  "end\xEF\xBD\x9C>",
                                              .eos =
                                                  "<\xEF\xBD\x9C"
                                                  "end\xE2\x96\x81"
                                                  "of\xE2\x96\x81"
                                                  "sentence\xEF\xBD\x9C>",
                                              .bos =
                                                  "<\xEF\xBD\x9C"
                                                  "begin\xE2\x96\x81"
                                                  "of\xE2\x96\x81"
                                                  "sentence\xEF\xBD\x9C>",
                                              .add_bos = true};

// CodeLlama (SentencePiece: the sentinels carry the word-start mark U+2581).
inline constexpr fim_token_set codellama{.family = "codellama",
                                         .prefix = "\xE2\x96\x81<PRE>",
                                         .suffix = "\xE2\x96\x81<SUF>",
                                         .middle = "\xE2\x96\x81<MID>",
                                         .eos = "\xE2\x96\x81<EOT>",
                                         .bos = "<s>",
                                         .add_bos = true};

inline constexpr std::array<const fim_token_set*, 4> known_token_sets{&qwen25_coder, &starcoder, &deepseek_coder,
                                                                      &codellama};

// The token set of a family by name ("qwen2.5-coder", "starcoder", "deepseek-coder", "codellama").
inline const fim_token_set* find_token_set(std::string_view family) noexcept {
  for (const auto* set : known_token_sets)
    if (set->family == family) return set;
  return nullptr;
}

// The token set whose three FIM sentinels the tokenizer's vocabulary holds as special tokens
// (the first such, in known_token_sets order); nullptr if none.
template <class Tokenizer>
const fim_token_set* detect_token_set(const Tokenizer& tok) {
  for (const auto* set : known_token_sets)
    if (tok.special_id(set->prefix) && tok.special_id(set->suffix) && tok.special_id(set->middle)) return set;
  return nullptr;
}

}  // namespace efim::prompt
