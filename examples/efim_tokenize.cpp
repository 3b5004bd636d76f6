// efim-tokenize: prints the token ids of UTF-8 text read on stdin, separated by spaces.
//
//   efim-tokenize --tokenizer PATH [--special]
//
// PATH is a Hugging Face tokenizer.json or a .gguf file (its tokenizer.ggml.* metadata). With
// --special, special-token text in the input stands for those tokens.
#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "efim/efim.hpp"

namespace {
const char* const usage = R"(usage: efim-tokenize --tokenizer PATH [--special] < text

Reads UTF-8 text on stdin and prints its token ids, separated by spaces, on one line.
  --tokenizer PATH   a Hugging Face tokenizer.json, or a .gguf file with a tokenizer
  --special          special-token text in the input (such as <|fim_prefix|>) stands for the token
)";

[[noreturn]] void fail(const std::string& message, int code = 2) {
  std::cerr << "efim-tokenize: " << message << "\n";
  std::exit(code);
}
}  // namespace

int main(int argc, char** argv) {
  std::string path;
  bool special = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return 0;
    }
    if (a == "--special") {
      special = true;
    } else if (a == "--tokenizer") {
      if (i + 1 >= argc) fail("--tokenizer needs a path");
      path = argv[++i];
    } else {
      fail("unknown option " + std::string(a) + " (see --help)");
    }
  }
  if (path.empty()) fail("--tokenizer PATH is required (see --help)");
  try {
    const auto tok = efim::text::load_bpe(path);
    std::string input;
    char buf[1 << 16];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, stdin)) > 0;) input.append(buf, n);
    if (std::ferror(stdin)) fail("cannot read stdin", 1);
    std::vector<efim::token_id> ids;
    if (special)
      tok.encode_special(input, ids);
    else
      tok.encode(input, ids);
    std::string line;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i > 0) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
    return 0;
  } catch (const efim::error& e) {
    fail(e.what(), 1);
  }
}
