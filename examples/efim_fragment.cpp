// efim-fragment: turns a corpus into fill-in-the-middle training samples, as token ids.
//
// For each document a random hole (the middle) is cut out at character boundaries; the sample is
// laid out as PSM, SPM or EFIM (by the given rates) and ends with the middle and end-of-sequence.
// In the EFIM layout the middle is split at a random character into the part already typed (after
// <MID>) and the rest, tokenized separately, as a server sees them. Each run of text is
// fragment-tokenized (cut at random characters, each fragment tokenized alone) at the given rate.
// Everything is deterministic for a seed.
//
// Output: PREFIX.bin (all samples' ids, uint32 little-endian, one after another), PREFIX.idx
// (uint64 little-endian: the number of samples, then n + 1 offsets into PREFIX.bin in tokens), and
// with --jsonl FILE one JSON object per sample.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "efim/efim.hpp"
#include "arguments.hpp"
#include "tokenizer_choice.hpp"

namespace fs = std::filesystem;

namespace {

const char* const usage = R"(usage: efim-fragment (--corpus DIR | --input FILE.jsonl) --out PREFIX [options]

Turns a corpus into FIM training samples (token ids).
input
  --corpus DIR            source files under DIR (recursive, in path order)
  --input FILE            JSON lines, one document per line
  --field NAME            the text field of each JSON line (text)
output
  --out PREFIX            writes PREFIX.bin (uint32 ids) and PREFIX.idx (uint64: count, then offsets)
  --jsonl FILE            also one JSON object per sample (document, layout, hole, ids)
samples
  --tokenizer PATH|byte   tokenizer.json or .gguf with FIM tokens, or byte-level with Qwen2.5-Coder FIM
                          tokens (default: the tokenizer.json .ci/setup fetches, else byte-level)
  --samples-per-doc N     samples cut from each document (1)
  --psm R --spm R --efim R   relative rates of the layouts (1 1 2)
  --fragment-rate P       probability that a run of text is fragment-tokenized (0.5)
  --max-cuts N            most cuts in a fragmented run (3)
  --seed S                (1)
)";

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "efim-fragment: " << message << "\n";
  std::exit(2);
}

struct options {
  std::string corpus, input, field = "text", out, jsonl, tokenizer;
  std::size_t samples_per_doc = 1, max_cuts = 3;
  double psm = 1, spm = 1, efim = 2, fragment_rate = 0.5;
  std::uint64_t seed = 1;
};

double parse_number(const std::string& flag, const std::string& v, double lo, double hi) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || !(x >= lo && x <= hi))
    fail(flag + " needs a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], not '" + v + "'");
  return x;
}

options parse(int argc, char** argv) {
  options o;
  efim_examples::for_each_flag(
      argc, argv, "efim-fragment", usage, {}, [](const std::string&) {},
      [&](const std::string& flag, const std::string& v) {
        if (flag == "--corpus")
          o.corpus = v;
        else if (flag == "--input")
          o.input = v;
        else if (flag == "--field")
          o.field = v;
        else if (flag == "--out")
          o.out = v;
        else if (flag == "--jsonl")
          o.jsonl = v;
        else if (flag == "--tokenizer")
          o.tokenizer = v;
        else if (flag == "--samples-per-doc")
          o.samples_per_doc = static_cast<std::size_t>(parse_number(flag, v, 1, 1e6));
        else if (flag == "--max-cuts")
          o.max_cuts = static_cast<std::size_t>(parse_number(flag, v, 1, 1e6));
        else if (flag == "--psm")
          o.psm = parse_number(flag, v, 0, 1e9);
        else if (flag == "--spm")
          o.spm = parse_number(flag, v, 0, 1e9);
        else if (flag == "--efim")
          o.efim = parse_number(flag, v, 0, 1e9);
        else if (flag == "--fragment-rate")
          o.fragment_rate = parse_number(flag, v, 0, 1);
        else if (flag == "--seed")
          o.seed = static_cast<std::uint64_t>(parse_number(flag, v, 0, 9e15));
        else
          fail("unknown option " + flag + " (see --help)");
      });
  if (o.corpus.empty() == o.input.empty()) fail("give one of --corpus DIR and --input FILE (see --help)");
  if (o.out.empty()) fail("--out PREFIX is required (see --help)");
  if (o.psm + o.spm + o.efim <= 0) fail("the layout rates --psm, --spm and --efim are all zero");
  return o;
}

struct document {
  std::string name;
  std::string text;
};

std::vector<document> read_documents(const options& o) {
  std::vector<document> docs;
  if (!o.corpus.empty()) {
    std::error_code ec;
    if (!fs::is_directory(o.corpus, ec)) fail("corpus '" + o.corpus + "' is not a readable directory");
    std::vector<fs::path> files;
    for (auto it = fs::recursive_directory_iterator(o.corpus, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_directory() && it->path().filename().string().starts_with(".")) {
        it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file()) files.push_back(it->path());
    }
    if (ec) fail("cannot list corpus '" + o.corpus + "': " + ec.message());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      std::string text = ss.str();
      const std::string name = fs::relative(f, o.corpus).string();
      if (!efim::utf8::is_valid(text)) {
        std::cerr << "efim-fragment: skipping " << name << ": not UTF-8 text\n";
        continue;
      }
      docs.push_back({name, std::move(text)});
    }
  } else {
    std::ifstream in(o.input, std::ios::binary);
    if (!in) fail("cannot open '" + o.input + "'");
    std::string line;
    for (std::size_t n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      const std::string where = o.input + ":" + std::to_string(n);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail(where + ": not JSON: " + e.what());
      }
      if (!j.is_object() || !j.contains(o.field) || !j[o.field].is_string())
        fail(where + ": no string field '" + o.field + "'");
      auto text = j[o.field].get<std::string>();
      if (!efim::utf8::is_valid(text)) fail(where + ": the text is not valid UTF-8");
      docs.push_back({where, std::move(text)});
    }
  }
  if (docs.empty()) fail("the corpus has no document");
  return docs;
}

// Character boundaries of `s`, both ends included.
std::vector<std::size_t> boundaries(std::string_view s) {
  std::vector<std::size_t> b;
  for (std::size_t i = 0; i < s.size(); ++i)
    if (!efim::utf8::is_continuation(static_cast<unsigned char>(s[i]))) b.push_back(i);
  b.push_back(s.size());
  return b;
}

struct totals {
  std::size_t samples = 0, tokens = 0;
  std::map<std::string, std::size_t> layouts;
};

template <class Tokenizer>
int run(const options& o, const Tokenizer& tok, const efim::prompt::fim_token_set& set, const std::string& name) {
  const auto docs = read_documents(o);
  (void)efim::prompt::special_id(tok, set, efim::prompt::fim_role::eos);  // samples end with it
  std::ofstream bin(o.out + ".bin", std::ios::binary);
  if (!bin) fail("cannot write " + o.out + ".bin");
  std::ofstream jsonl;
  if (!o.jsonl.empty()) {
    jsonl.open(o.jsonl, std::ios::binary);
    if (!jsonl) fail("cannot write " + o.jsonl);
  }
  efim::rng r(o.seed);
  efim::text::random_split<> fragmenter(o.seed ^ 0x9E3779B97F4A7C15ull, o.fragment_rate, o.max_cuts);
  std::vector<std::uint64_t> offsets{0};
  std::vector<efim::token_id> ids;
  std::vector<std::uint32_t> words;
  totals t;
  const bool tty = isatty(STDERR_FILENO);
  const double total_rate = o.psm + o.spm + o.efim;
  for (std::size_t d = 0; d < docs.size(); ++d) {
    const std::string& text = docs[d].text;
    const auto b = boundaries(text);
    for (std::size_t k = 0; k < o.samples_per_doc; ++k) {
      // The hole: two character boundaries, in order (the middle may be empty).
      std::size_t x = b[r.below(b.size())], y = b[r.below(b.size())];
      if (x > y) std::swap(x, y);
      const std::string_view prefix = std::string_view(text).substr(0, x);
      const std::string_view middle = std::string_view(text).substr(x, y - x);
      const std::string_view suffix = std::string_view(text).substr(y);
      const double pick = r.uniform() * total_rate;
      const std::string layout = pick < o.psm ? "psm" : pick < o.psm + o.spm ? "spm" : "efim";
      efim::prompt::prompt_layout l;
      std::string_view typed, rest = middle;
      if (layout == "efim") {
        const auto mb = boundaries(middle);
        const std::size_t cut = mb[r.below(mb.size())];
        typed = middle.substr(0, cut);
        rest = middle.substr(cut);
        l = efim::prompt::efim_format::layout({prefix, suffix, {typed}}, set);
      } else if (layout == "spm") {
        l = efim::prompt::spm::layout({prefix, suffix, {}}, set);
      } else {
        l = efim::prompt::psm::layout({prefix, suffix, {}}, set);
      }
      l.add_text({rest});
      l.add_special(efim::prompt::fim_role::eos);
      ids.clear();
      efim::prompt::encode(l, tok, set, fragmenter, ids);
      words.assign(ids.begin(), ids.end());
      bin.write(reinterpret_cast<const char*>(words.data()),
                static_cast<std::streamsize>(words.size() * sizeof(std::uint32_t)));
      offsets.push_back(offsets.back() + words.size());
      ++t.samples;
      t.tokens += words.size();
      ++t.layouts[layout];
      if (jsonl.is_open()) {
        nlohmann::json j = {
            {"document", docs[d].name}, {"layout", layout}, {"hole", {x, y}}, {"typed", typed.size()}, {"ids", ids}};
        jsonl << j.dump() << "\n";
      }
    }
    if (tty && (d + 1 == docs.size() || d % 16 == 0)) {
      const std::size_t width = 40, filled = width * (d + 1) / docs.size();
      std::cerr << "\r[" << std::string(filled, '#') << std::string(width - filled, ' ') << "] " << (d + 1) << "/"
                << docs.size() << " documents" << std::flush;
    }
  }
  if (tty) std::cerr << "\n";
  std::ofstream idx(o.out + ".idx", std::ios::binary);
  const std::uint64_t count = t.samples;
  idx.write(reinterpret_cast<const char*>(&count), sizeof count);
  idx.write(reinterpret_cast<const char*>(offsets.data()),
            static_cast<std::streamsize>(offsets.size() * sizeof(std::uint64_t)));
  if (!bin.flush() || !idx.flush() || (jsonl.is_open() && !jsonl.flush())) fail("cannot write the output files");
  std::printf("tokenizer: %s\n", name.c_str());
  std::printf("documents: %zu\nsamples: %zu\ntokens: %zu\n", docs.size(), t.samples, t.tokens);
  for (const auto& [layout, n] : t.layouts) std::printf("layout %s: %zu\n", layout.c_str(), n);
  std::printf("wrote %s.bin and %s.idx%s%s\n", o.out.c_str(), o.out.c_str(), o.jsonl.empty() ? "" : " and ",
              o.jsonl.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return efim_examples::with_tokenizer(
        o.tokenizer, EFIM_DEFAULT_TOKENIZER, "efim-fragment",
        [&](const auto& tok, const auto& set, const std::string& name) { return run(o, tok, set, name); });
  } catch (const efim::error& e) {
    fail(e.what());
  }
}
