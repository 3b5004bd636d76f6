#pragma once
// The real GGUF vocabularies the suites read (GPT-2, StarCoder, DeepSeek-Coder, Qwen2.5-Coder), each
// with its reference vectors (X.gguf.inp: test strings; X.gguf.out: Hugging Face's ids for them):
// from the shared data beside the checkout where it is there, else from .cache/vocab, where .ci/setup
// puts llama.cpp's copies (the models/ folder of the release it fetches as a git bundle; Qwen2's
// vectors serve Qwen2.5-Coder, whose regular vocabulary is Qwen2's) and where the Qwen2.5-Coder file
// is written here, on first use, from the tokenizer.json set-up fetches (as the shared one was made:
// its tokenizer metadata, padded to the 151,936 rows of its models). A clone alone runs these tests.
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "efim/core/gguf.hpp"
#include "efim/model/vocabulary.hpp"

namespace efim_test {

inline constexpr const char* vocab_names[] = {"ggml-vocab-gpt-2.gguf", "ggml-vocab-starcoder.gguf",
                                              "ggml-vocab-deepseek-coder.gguf", "ggml-vocab-qwen2.5-coder.gguf"};

// Where the vocabularies are; a folder without them (a test then says it is skipped, and why) when
// neither the shared data nor set-up's copies are there.
inline std::filesystem::path vocab_dir() {
  namespace fs = std::filesystem;
  const fs::path shared = fs::path(EFIM_SHARED_DATA) / "vocab";
  if (fs::is_directory(shared)) return shared;
  const fs::path cache = EFIM_VOCAB_CACHE;
  const fs::path qwen = cache / "ggml-vocab-qwen2.5-coder.gguf";
  const fs::path json = fs::path(EFIM_TOKENIZER_CACHE) / "qwen2.5-coder" / "tokenizer.json";
  if (fs::is_directory(cache) && !fs::exists(qwen) && fs::exists(json)) {
    // Written beside it and renamed: suites running at once never read half a file.
    const fs::path part = cache / ("ggml-vocab-qwen2.5-coder.gguf.part" + std::to_string(getpid()));
    efim::model::write_file(part.string(), efim::gguf::serialize(efim::model::vocabulary_metadata(json.string()), {}));
    std::error_code ec;
    fs::rename(part, qwen, ec);
    if (ec) fs::remove(part, ec);
  }
  return cache;
}

// Whether every vocabulary and its vectors are there.
inline bool have_vocabs() {
  const auto dir = vocab_dir();
  for (const char* name : vocab_names) {
    const auto path = dir / name;
    if (!std::filesystem::exists(path) || !std::filesystem::exists(path.string() + ".inp") ||
        !std::filesystem::exists(path.string() + ".out"))
      return false;
  }
  return true;
}

}  // namespace efim_test
