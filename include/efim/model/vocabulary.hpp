#pragma once
// The tokenizer half of a model file: tokenizer.ggml.* metadata from a Hugging Face tokenizer.json or
// from another GGUF file, padded to the model's vocabulary, with the special token ids GGUF readers
// look for (end of text, padding, and the FIM sentinels llama.cpp's /infill uses).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/text/bpe_tokenizer.hpp"

namespace efim::model {

namespace detail {
// The token strings of tokenizer metadata that has them (vocabulary_metadata's).
template <class Metadata>
auto& tokens_of(Metadata& m) {
  return std::get<std::vector<std::string>>(std::get<gguf::array_value>(m.at("tokenizer.ggml.tokens").v).items);
}
}  // namespace detail

// The number of tokens tokenizer metadata from vocabulary_metadata holds.
inline std::size_t vocabulary_size(const metadata& m) { return detail::tokens_of(m).size(); }

// Tokenizer metadata from `path` (a .gguf file: its tokenizer.* keys; otherwise a tokenizer.json),
// padded with unused "[PAD<id>]" tokens to `vocab` tokens when that is more. `vocab` = 0 keeps the
// tokenizer's size, but for the Qwen2.5-Coder vocabulary, padded to the 151,936 rows its models have.
inline metadata vocabulary_metadata(const std::string& path, std::size_t vocab = 0) {
  metadata out;
  if (text::is_gguf_path(path)) {
    const auto f = gguf::read(path);
    for (const auto& [key, value] : f.metadata)
      if (key.starts_with("tokenizer.")) out.emplace(key, value);
    require(out.contains("tokenizer.ggml.tokens"), errc::invalid_argument, "'" + path + "' has no tokenizer");
  } else {
    out = text::gguf_vocabulary(text::read_tokenizer_json(path));
  }
  // Loading it checks every key's type and the token and type counts.
  const auto tok = text::load_bpe_gguf(gguf::parse(gguf::serialize(out, {})));
  const auto* fim = prompt::detect_token_set(tok);
  if (vocab == 0 && fim && fim->family == prompt::qwen25_coder.family) vocab = 151936;

  auto& tokens = detail::tokens_of(out);
  std::vector<std::int64_t>* types = nullptr;
  if (const auto it = out.find("tokenizer.ggml.token_type"); it != out.end())
    types = &std::get<std::vector<std::int64_t>>(std::get<gguf::array_value>(it->second.v).items);
  while (tokens.size() < vocab) {
    tokens.push_back("[PAD" + std::to_string(tokens.size()) + "]");
    if (types) types->push_back(5);  // unused
  }
  // Special ids, where the file does not name them already.
  if (fim) {
    const auto id = [&](std::string_view role_text, std::string_view key) {
      if (role_text.empty()) return;
      if (const auto t = tok.special_id(role_text))
        out.try_emplace(std::string("tokenizer.ggml.") + std::string(key),
                        gguf::make_u32(static_cast<std::uint32_t>(*t)));
    };
    id(fim->eos, "eos_token_id");
    id(fim->bos, "bos_token_id");
    id(fim->pad, "padding_token_id");
    id(fim->prefix, "fim_pre_token_id");
    id(fim->suffix, "fim_suf_token_id");
    id(fim->middle, "fim_mid_token_id");
    id(fim->pad, "fim_pad_token_id");
    id(fim->repo_name, "fim_rep_token_id");
    id(fim->file_sep, "fim_sep_token_id");
    out.try_emplace("tokenizer.ggml.add_bos_token", gguf::value{gguf::value_type::boolean, fim->add_bos});
  }
  return out;
}

}  // namespace efim::model
