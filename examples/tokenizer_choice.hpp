#pragma once
// How the example programs pick their tokenizer: "byte" (the byte-level tokenizer with
// Qwen2.5-Coder's FIM tokens), a tokenizer.json or a .gguf file, or, when none is named, the
// Qwen2.5-Coder tokenizer.json that .ci/setup fetches (the byte-level one when it is not there).
#include <filesystem>
#include <iostream>
#include <string>

#include "efim/efim.hpp"

namespace efim_examples {

// The tokenizer a program uses: `path`, or when it is empty the default file, or "byte" (said on
// stderr) when that is missing.
inline std::string tokenizer_path(std::string path, const std::string& default_path, const char* program) {
  if (!path.empty()) return path;
  if (std::filesystem::exists(default_path)) return default_path;
  std::cerr << program << ": no " << default_path << " (run .ci/setup to fetch it); using the byte-level tokenizer\n";
  return "byte";
}

// Calls run(tokenizer, fim_token_set, description) with the tokenizer tokenizer_path picks and
// returns what it returns. A tokenizer without a known FIM token set is an efim::error.
template <class Run>
int with_tokenizer(std::string path, const std::string& default_path, const char* program, Run&& run) {
  path = tokenizer_path(std::move(path), default_path, program);
  if (path == "byte") {
    const efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
    return run(tok, efim::prompt::qwen25_coder, std::string("byte-level + qwen2.5-coder FIM tokens"));
  }
  const auto tok = efim::text::load_bpe(path);
  const auto* fim = efim::prompt::detect_token_set(tok);
  efim::require(fim != nullptr, efim::errc::invalid_argument,
                "tokenizer '" + path + "' has no FIM tokens of a known family");
  return run(tok, *fim, tok.description() + " (" + std::string(fim->family) + " FIM tokens)");
}

}  // namespace efim_examples
