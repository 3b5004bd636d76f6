// Token healing, measured on a real vocabulary: how often healing applies to code cut at random
// places, how much it removes for each limit k, and what a constrained step (the allowed set from the
// prefix index, then greedy or sampled choice among it) costs against an unconstrained one over the
// whole vocabulary, side by side in one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/random.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/text/bpe_tokenizer.hpp"
#include "efim/text/healing.hpp"

namespace fs = std::filesystem;
using namespace efim;

namespace {

const char* const usage = R"(usage: efim-healing-bench [options]

  --tokenizer PATH   tokenizer.json or GGUF vocabulary (default: the Qwen2.5-Coder tokenizer.json that
                     .ci/setup fetches)
  --corpus DIR       source files to cut (default: this repository's include/)
  --prompts N        random cuts (2000)
)";

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "efim-healing-bench: %s\n", why.c_str());
  std::exit(2);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) try {
  std::string tokenizer = EFIM_DEFAULT_TOKENIZER, corpus = EFIM_DEFAULT_CORPUS;
  std::size_t prompts = 2000;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (std::string_view(usage).find("  " + flag + " ") == std::string_view::npos)
      fail("unknown option " + flag + " (see --help)");
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--tokenizer") {
      tokenizer = v;
    } else if (flag == "--corpus") {
      corpus = v;
    } else if (flag == "--prompts") {
      prompts = std::strtoull(v.c_str(), nullptr, 10);
      if (prompts == 0) fail("--prompts needs a positive number");
    } else {
      fail("unknown option " + flag + " (see --help)");
    }
  }
  if (!fs::exists(tokenizer)) fail("no tokenizer at " + tokenizer + " (run .ci/setup, or give --tokenizer)");
  const auto tok = text::load_bpe(tokenizer);

  std::string code;
  for (const auto& e : fs::recursive_directory_iterator(corpus))
    if (e.is_regular_file()) {
      std::ifstream in(e.path(), std::ios::binary);
      code += std::string(std::istreambuf_iterator<char>(in), {});
    }
  if (code.size() < 10000) fail("the corpus is too small: " + corpus);

  double build_s = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const text::prefix_index index(tok);
    build_s = std::min(build_s, seconds_since(t0));
  }
  const text::prefix_index index(tok);
  std::printf("%s: %zu tokens; prefix index built in %.1f ms; %zu cuts of %s (%zu bytes)\n", tokenizer.c_str(),
              tok.vocab_size(), build_s * 1e3, prompts, corpus.c_str(), code.size());

  // The cuts: up to 2,000 bytes of code ending at a random character boundary, tokenized.
  rng r(1);
  std::vector<std::vector<token_id>> cuts;
  for (std::size_t i = 0; i < prompts; ++i) {
    std::size_t end = 1 + r.below(code.size() - 1);
    while (end < code.size() && (static_cast<unsigned char>(code[end]) & 0xC0) == 0x80) ++end;
    const std::size_t begin = end > 2000 ? end - 2000 : 0;
    auto& ids = cuts.emplace_back();
    tok.encode(std::string_view(code).substr(begin, end - begin), ids);
    if (ids.empty()) cuts.pop_back();
  }

  // What healing removes for each k, and how many constrained steps give it back (greedy, random logits).
  std::vector<float> logits(tok.vocab_size()), gathered;
  std::vector<token_id> allowed;
  std::vector<std::pair<float, token_id>> scratch;
  std::printf("\n%3s %8s %14s %14s %12s %14s\n", "k", "healed", "removed tokens", "removed bytes", "steps", "allowed (1st)");
  for (std::size_t k = 1; k <= 4; ++k) {
    std::size_t healed = 0, removed = 0, bytes = 0, steps = 0, first_allowed = 0;
    for (const auto& ids : cuts) {
      const auto cut = text::heal(index, ids, k);
      if (cut.tokens == 0) continue;
      ++healed;
      removed += cut.tokens;
      bytes += cut.text.size();
      text::heal_constraint c(cut.text);
      for (bool first = true; c.active(); first = false) {
        c.allowed(index, allowed);
        if (first) first_allowed += allowed.size();
        for (auto& l : logits) l = static_cast<float>(r.uniform());
        c.take(index, kernels::sample_among(logits, allowed, 0.0f, 0, 1.0f, 0.0, gathered, scratch));
        ++steps;
      }
    }
    const double h = static_cast<double>(std::max<std::size_t>(healed, 1));
    std::printf("%3zu %7.1f%% %14.2f %14.2f %12.2f %14.1f\n", k, 100.0 * static_cast<double>(healed) / cuts.size(),
                static_cast<double>(removed) / h, static_cast<double>(bytes) / h, static_cast<double>(steps) / h,
                static_cast<double>(first_allowed) / h);
  }

  // A step's choice, constrained (first healing step at k = 3) against unconstrained, greedy and sampled.
  std::vector<std::string> texts;
  for (const auto& ids : cuts) {
    const auto cut = text::heal(index, ids, 3);
    if (cut.tokens > 0) texts.push_back(cut.text);
  }
  for (auto& l : logits) l = static_cast<float>(r.normal() * 3.0);
  const auto time_it = [&](auto&& step) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      std::size_t sink = 0;
      for (const auto& t : texts) sink += static_cast<std::size_t>(step(t));
      best = std::min(best, seconds_since(t0));
      if (sink == 1) std::printf(" ");  // (keeps the work)
    }
    return best / static_cast<double>(texts.size()) * 1e6;
  };
  const double greedy = time_it([&](const std::string&) { return kernels::argmax(logits); });
  const double greedy_healing =
      time_it([&](const std::string& t) { return text::heal_constraint(t).argmax(index, logits); });
  const double sampled = time_it([&](const std::string&) {
    return kernels::sample(logits, 0.8f, 40, 0.95f, r.uniform(), scratch);
  });
  const double sampled_healing = time_it([&](const std::string& t) {
    text::heal_constraint(t).allowed(index, allowed);
    return kernels::sample_among(logits, allowed, 0.8f, 40, 0.95f, r.uniform(), gathered, scratch);
  });
  std::printf("\nstep over %zu logits, microseconds (%zu healed cuts, k = 3):\n", tok.vocab_size(), texts.size());
  std::printf("  greedy:            unconstrained %8.2f   healing %8.2f   ratio %.2f\n", greedy, greedy_healing,
              greedy_healing / greedy);
  std::printf("  sampled (T 0.8, top-k 40, top-p 0.95): unconstrained %8.2f   healing %8.2f   ratio %.2f\n", sampled,
              sampled_healing, sampled_healing / sampled);
  return 0;
} catch (const std::exception& e) {
  fail(e.what());
}
