// The example programs, run as a user runs them: real processes, real files, real arguments.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "efim/efim.hpp"
#include "support.hpp"
#include "vocab.hpp"

namespace fs = std::filesystem;

namespace {
using efim_test::run_result;

run_result run_program(const std::string& program, const std::string& args) {
  return efim_test::run_command(program + " " + args);
}

run_result run(const std::string& args) { return run_program(EFIM_BENCH_PATH, args); }

// `program args` fails with a message saying `says`, and an exit code of 2 (bad use) or, where
// `bad_input` is allowed, 1 (bad input): never a crash.
void check_fails(const std::string& program, const std::string& args, const std::string& says, bool bad_input = false) {
  const auto r = run_program(program, args);
  INFO(program << " " << args << "\n" << r.output);
  CHECK((r.exit_code == 2 || (bad_input && r.exit_code == 1)));
  CHECK(r.output.find(says) != std::string::npos);
}

// A scratch directory removed at the end of the test.
struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& name) : path(fs::temp_directory_path() / ("efim-test-" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

// Writes a Python-looking file of about `bytes` bytes.
void write_source(const fs::path& p, std::size_t bytes, int seed) {
  std::ofstream f(p);
  std::size_t written = 0;
  for (int i = 0; written < bytes; ++i) {
    const std::string line = "def f_" + std::to_string(seed) + "_" + std::to_string(i) + "(x):\n    return x * " +
                             std::to_string(i + seed) + "\n\n";
    f << line;
    written += line.size();
  }
}

const std::string tiny_model = " --hidden 16 --layers 1 --heads 2 --kv-heads 1 --ffn 32 --quiet";
}  // namespace

TEST_CASE("efim-bench writes the documented JSON on a small workload", "[examples][bench]") {
  temp_dir dir("bench-json");
  for (int i = 0; i < 3; ++i) {
    std::string name = "m";  // (not "m" + ...: GCC 12 -Wrestrict false positive)
    name += std::to_string(i);
    write_source(dir.path / (name + ".py"), 900 + 100 * static_cast<std::size_t>(i), i);
  }
  write_source(dir.path / "too_long.py", 5000, 9);
  std::ofstream(dir.path / "notes.md") << "not a source file";
  const auto json_path = dir.path / "out.json";
  const auto r =
      run("--corpus " + dir.path.string() + " --tokenizer byte --users 2 --documents 3 --rounds 3 --output-tokens 4" +
          " --min-doc-tokens 500 --max-doc-tokens 2000 --schemes psm-nocache,psm,efim,spm --json " +
          json_path.string() + tiny_model);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("efim/psm") != std::string::npos);

  std::ifstream in(json_path);
  const auto j = nlohmann::json::parse(in);
  CHECK(j["workload"]["users"] == 2);
  CHECK(j["workload"]["rounds"] == 3);
  CHECK(j["workload"]["output_tokens"] == 4);
  REQUIRE(j["workload"]["documents"].size() == 3);
  CHECK(j["workload"]["documents"][0]["path"] == "m0.py");
  CHECK(j["model"]["hidden"] == 16);
  std::size_t prompt_tokens = 0;
  for (const char* name : {"psm-nocache", "psm", "efim", "spm"}) {
    INFO(name);
    const auto& s = j["schemes"][name];
    for (const char* key : {"requests", "mean_latency_ms", "p50_latency_ms", "p99_latency_ms", "mean_ttft_ms",
                            "requests_per_s", "prompt_tokens", "computed_prompt_tokens", "cache_hit_rate"})
      CHECK(s.contains(key));
    CHECK(s["requests"] == 9);
    CHECK(s["computed_prompt_tokens"].get<std::size_t>() <= s["prompt_tokens"].get<std::size_t>());
    CHECK(s["mean_latency_ms"].get<double>() >= s["mean_ttft_ms"].get<double>());
    CHECK(s["p99_latency_ms"].get<double>() >= s["p50_latency_ms"].get<double>());
    prompt_tokens = s["prompt_tokens"];
  }
  // PSM and EFIM prompts hold the same text, so the same number of byte-level tokens.
  CHECK(j["schemes"]["psm"]["prompt_tokens"] == prompt_tokens);
  CHECK(j["schemes"]["psm-nocache"]["cache_hit_rate"] == 0.0);
  CHECK(j["schemes"]["psm-nocache"]["computed_prompt_tokens"] == j["schemes"]["psm-nocache"]["prompt_tokens"]);
  CHECK(j["schemes"]["efim"]["cache_hit_rate"].get<double>() > j["schemes"]["psm"]["cache_hit_rate"].get<double>());
  CHECK(j.contains("ratios_efim_over_psm"));
}

TEST_CASE("efim-bench cuts a file longer than the longest document into runs of whole lines", "[examples][bench]") {
  temp_dir dir("bench-long");
  write_source(dir.path / "long.py", 5000, 1);
  const auto r = run("--corpus " + dir.path.string() + " --tokenizer byte --users 1 --documents 5 --rounds 1" +
                     " --output-tokens 1 --min-doc-tokens 500 --max-doc-tokens 2000 --schemes efim --json /dev/stdout" +
                     tiny_model);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto j =
      nlohmann::json::parse(r.output.substr(r.output.find('{'), r.output.rfind('}') - r.output.find('{') + 1));
  // Whole lines only (the file's lines are at most 32 bytes, one token per byte), each run as long as
  // fits in 2,000 tokens, the last one kept because it has at least 500.
  std::ifstream in(dir.path / "long.py");
  std::vector<std::pair<std::string, std::size_t>> want;  // (path, tokens)
  std::string line;
  std::size_t first = 1, lines = 0, bytes = 0;
  while (std::getline(in, line)) {
    if (bytes + line.size() + 1 > 2000) {
      want.emplace_back("long.py (lines " + std::to_string(first) + "-" + std::to_string(first + lines - 1) + ")",
                        bytes);
      first += lines;
      lines = bytes = 0;
    }
    bytes += line.size() + 1;
    ++lines;
  }
  REQUIRE(bytes >= 500);
  want.emplace_back("long.py (lines " + std::to_string(first) + "-" + std::to_string(first + lines - 1) + ")", bytes);
  REQUIRE(want.size() == 3);
  REQUIRE(j["workload"]["documents"].size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CHECK(j["workload"]["documents"][i]["path"] == want[i].first);
    CHECK(j["workload"]["documents"][i]["tokens"] == want[i].second);
  }
  CHECK(want[0].second > 2000 - 32);
}

TEST_CASE("efim-bench's default workload reaches the EFIM cache targets", "[examples][bench]") {
  // Hit rates depend on tokens only, so a tiny model shows them for the default workload.
  const auto r = run("--schemes psm,efim --json /dev/stdout" + tiny_model);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto j =
      nlohmann::json::parse(r.output.substr(r.output.find('{'), r.output.rfind('}') - r.output.find('{') + 1));
  CHECK(j["workload"]["users"] == 16);
  CHECK(j["workload"]["documents"].size() == 16);
  CHECK(j["schemes"]["efim"]["cache_hit_rate"].get<double>() >= 0.70);
  CHECK(j["schemes"]["psm"]["cache_hit_rate"].get<double>() <= 0.35);
  CHECK(j["schemes"]["efim"]["computed_prompt_tokens"].get<double>() <=
        0.5 * j["schemes"]["psm"]["computed_prompt_tokens"].get<double>());
}

TEST_CASE("efim-bench rejects bad arguments with a clear message", "[examples][bench]") {
  temp_dir dir("bench-args");
  const auto expect_failure = [](const std::string& args, const std::string& says) {
    check_fails(EFIM_BENCH_PATH, args, says);
  };
  expect_failure("--users 0", "--users needs a whole number >= 1");
  expect_failure("--users many", "not 'many'");
  expect_failure("--tokenizer " + (dir.path / "none.json").string(), "cannot open");
  if (const auto gpt2 = efim_test::vocab_dir() / "ggml-vocab-gpt-2.gguf"; fs::exists(gpt2))
    expect_failure("--tokenizer " + gpt2.string(), "no FIM tokens");
  expect_failure("--rounds -3", "--rounds needs");
  expect_failure("--bogus 1", "unknown option --bogus");
  expect_failure("--users", "missing value");
  expect_failure("--schemes psm,xyz", "unknown scheme 'xyz'");
  expect_failure("--corpus " + (dir.path / "missing").string(), "is not a readable directory");
  expect_failure("--corpus " + dir.path.string(), "has no source file");
  expect_failure("--min-doc-tokens 10 --max-doc-tokens 5", "larger than");
  expect_failure(tiny_model + " --heads 3", "multiple of heads");
  const auto help = run("--help");
  CHECK(help.exit_code == 0);
  CHECK(help.output.find("usage: efim-bench") != std::string::npos);
}

TEST_CASE("efim-tokenize prints the reference ids for real tokenizers", "[examples][tokenize][shared]") {
  const fs::path vocab = efim_test::vocab_dir();
  const fs::path json = fs::path(EFIM_TOKENIZER_CACHE) / "qwen2.5-coder" / "tokenizer.json";
  if (!efim_test::have_vocabs()) {
    WARN("skipped: no vocabularies at " << vocab.string() << " (the shared data, or .ci/setup's copies)");
    return;
  }
  temp_dir dir("tokenize");
  std::vector<std::pair<fs::path, fs::path>> runs{
      // (tokenizer, the vocabulary whose vectors apply)
      {vocab / "ggml-vocab-qwen2.5-coder.gguf", vocab / "ggml-vocab-qwen2.5-coder.gguf"},
      {vocab / "ggml-vocab-starcoder.gguf", vocab / "ggml-vocab-starcoder.gguf"},
      {vocab / "ggml-vocab-deepseek-coder.gguf", vocab / "ggml-vocab-deepseek-coder.gguf"}};
  if (fs::exists(json))
    runs.emplace_back(json, vocab / "ggml-vocab-qwen2.5-coder.gguf");
  else
    WARN("the tokenizer.json run is skipped: " << json.string() << " is missing (fetched by .ci/setup)");
  for (const auto& [tokenizer, vectors] : runs) {
    std::ifstream inp(vectors.string() + ".inp", std::ios::binary), out(vectors.string() + ".out");
    std::stringstream all;
    all << inp.rdbuf();
    const std::string text = all.str(), separator = "\n__ggml_vocab_test__\n";
    std::string want;
    std::size_t index = 0;
    for (std::size_t pos = 0; pos < text.size() && std::getline(out, want); ++index) {
      const std::size_t end = text.find(separator, pos);
      REQUIRE(end != std::string::npos);
      const std::string input = text.substr(pos, end - pos);
      pos = end + separator.size();
      if (index % 5 != 0 && input.find_first_of("\xC3\xE4\xF0") == std::string::npos) continue;  // a sample
      const auto in_file = dir.path / "in.txt";
      std::ofstream(in_file, std::ios::binary) << input;
      const auto r = run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + tokenizer.string() + " < " + in_file.string());
      INFO(tokenizer.filename().string() << ": '" << input << "'");
      REQUIRE(r.exit_code == 0);
      // The reference lines have a leading space; efim-tokenize prints none.
      const auto trim = [](std::string s) {
        while (!s.empty() && (s.front() == ' ')) s.erase(0, 1);
        while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
        return s;
      };
      CHECK(trim(r.output) == trim(want));
    }
  }
}

TEST_CASE("efim-tokenize: special tokens when asked, and clear errors", "[examples][tokenize][shared]") {
  const fs::path gguf = efim_test::vocab_dir() / "ggml-vocab-starcoder.gguf";
  if (!fs::exists(gguf)) {
    WARN("skipped: no " << gguf.string() << " (the shared data, or .ci/setup's copies)");
    return;
  }
  temp_dir dir("tokenize-errors");
  const auto write = [&](const std::string& name, const std::string& content) {
    std::ofstream(dir.path / name, std::ios::binary) << content;
    return (dir.path / name).string();
  };
  const auto in = write("fim.txt", "<fim_prefix>x");
  const auto special = run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + gguf.string() + " --special < " + in);
  const auto plain = run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + gguf.string() + " < " + in);
  REQUIRE(special.exit_code == 0);
  REQUIRE(plain.exit_code == 0);
  CHECK(special.output.rfind("1 ", 0) == 0);  // <fim_prefix> is id 1 in StarCoder's vocabulary
  CHECK(plain.output.size() > special.output.size());

  const auto bad_utf8 =
      run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + gguf.string() + " < " + write("bad.txt", "ok \xFF"));
  CHECK(bad_utf8.exit_code == 1);
  CHECK(bad_utf8.output.find("not valid UTF-8") != std::string::npos);
  const auto bad_json = run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + write("t.json", "{\"model\": ") + " < " + in);
  CHECK(bad_json.exit_code == 1);
  CHECK(bad_json.output.find("tokenizer.json") != std::string::npos);
  const auto truncated = write("cut.gguf", std::string("GGUF\3\0\0\0", 8));
  const auto bad_gguf = run_program(EFIM_TOKENIZE_PATH, "--tokenizer " + truncated + " < " + in);
  CHECK(bad_gguf.exit_code == 1);
  CHECK(bad_gguf.output.find("gguf: file ends inside") != std::string::npos);
  CHECK(run_program(EFIM_TOKENIZE_PATH, "--tokenizer /nonexistent.json < " + in).exit_code == 1);
  CHECK(run_program(EFIM_TOKENIZE_PATH, "< " + in).exit_code == 2);
  CHECK(run_program(EFIM_TOKENIZE_PATH, "--bogus < " + in).exit_code == 2);
}

namespace {
template <class T>
std::vector<T> read_binary(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() % sizeof(T) == 0);
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}
}  // namespace

TEST_CASE("efim-fragment writes FIM samples that put the document back together", "[examples][fragment]") {
  temp_dir dir("fragment");
  fs::create_directories(dir.path / "corpus");
  std::map<std::string, std::string> docs{
      {"a.py", "def add(a, b):\n    return a + b\n"},
      {"b.cpp", "int main() {\n  // caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80\n  return 0;\n}\n"},
      {"c.txt", "plain text, a little longer, with   spaces and\ttabs.\n"}};
  for (const auto& [name, text] : docs) std::ofstream(dir.path / "corpus" / name, std::ios::binary) << text;
  const auto out = (dir.path / "s").string(), jsonl = (dir.path / "s.jsonl").string();
  const std::string common = "--corpus " + (dir.path / "corpus").string() + " --tokenizer byte --samples-per-doc 30 ";
  const auto r = run_program(EFIM_FRAGMENT_PATH, common + "--seed 5 --out " + out + " --jsonl " + jsonl);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("samples: 90") != std::string::npos);

  const auto ids = read_binary<std::uint32_t>(out + ".bin");
  const auto idx = read_binary<std::uint64_t>(out + ".idx");
  REQUIRE(idx.size() == 1 + 90 + 1);
  CHECK(idx[0] == 90);
  CHECK(idx[1] == 0);
  CHECK(idx.back() == ids.size());

  const efim::text::byte_tokenizer tok(efim::prompt::qwen25_coder.special_tokens());
  const auto sp = [&](efim::prompt::fim_role role) { return std::string(efim::prompt::qwen25_coder.text(role)); };
  std::ifstream lines(jsonl);
  std::string line;
  std::map<std::string, std::size_t> layouts;
  for (std::size_t i = 0; std::getline(lines, line); ++i) {
    const auto j = nlohmann::json::parse(line);
    INFO(line);
    const auto sample = j["ids"].get<std::vector<std::uint32_t>>();
    REQUIRE(i + 2 < idx.size());
    CHECK(std::vector<std::uint32_t>(ids.begin() + static_cast<std::ptrdiff_t>(idx[i + 1]),
                                     ids.begin() + static_cast<std::ptrdiff_t>(idx[i + 2])) == sample);
    std::string decoded;
    for (const auto id : sample) decoded += tok.token_bytes(static_cast<efim::token_id>(id));
    const std::string& doc = docs.at(j["document"].get<std::string>());
    const std::size_t x = j["hole"][0], y = j["hole"][1];
    REQUIRE(x <= y);
    REQUIRE(y <= doc.size());
    const std::string prefix = doc.substr(0, x), middle = doc.substr(x, y - x), suffix = doc.substr(y);
    const std::string layout = j["layout"];
    ++layouts[layout];
    using efim::prompt::fim_role;
    if (layout == "spm")
      CHECK(decoded == sp(fim_role::prefix) + sp(fim_role::suffix) + suffix + sp(fim_role::middle) + prefix + middle +
                           sp(fim_role::eos));
    else  // psm, and efim with the typed part of the middle after <MID>
      CHECK(decoded == sp(fim_role::prefix) + prefix + sp(fim_role::suffix) + suffix + sp(fim_role::middle) + middle +
                           sp(fim_role::eos));
    CHECK(j["typed"].get<std::size_t>() <= middle.size());
  }
  CHECK(layouts["psm"] > 0);
  CHECK(layouts["spm"] > 0);
  CHECK(layouts["efim"] > layouts["psm"]);  // rates 1 : 1 : 2

  // Deterministic for a seed; another seed cuts other holes; layout rates are obeyed.
  REQUIRE(run_program(EFIM_FRAGMENT_PATH, common + "--seed 5 --out " + out + "2").exit_code == 0);
  CHECK(read_binary<std::uint32_t>(out + "2.bin") == ids);
  REQUIRE(run_program(EFIM_FRAGMENT_PATH, common + "--seed 6 --out " + out + "3").exit_code == 0);
  CHECK(read_binary<std::uint32_t>(out + "3.bin") != ids);
  const auto only = run_program(EFIM_FRAGMENT_PATH, common + "--psm 0 --spm 0 --efim 1 --out " + out + "4");
  CHECK(only.output.find("layout efim: 90") != std::string::npos);
}

TEST_CASE("efim-fragment: fragment tokenization with a real tokenizer, and bad input", "[examples][fragment]") {
  temp_dir dir("fragment-bpe");
  const fs::path gguf = efim_test::vocab_dir() / "ggml-vocab-qwen2.5-coder.gguf";
  {
    std::ofstream in(dir.path / "docs.jsonl");
    for (int i = 0; i < 20; ++i)
      in << nlohmann::json{{"text", "def function_number_" + std::to_string(i) + "(argument):\n    return argument * " +
                                        std::to_string(i * 7) + "\n"}}
                .dump()
         << "\n";
  }
  const std::string input = "--input " + (dir.path / "docs.jsonl").string() + " --samples-per-doc 5 --seed 3 ";
  if (fs::exists(gguf)) {
    const std::string bpe = input + "--tokenizer " + gguf.string() + " --out " + (dir.path / "bpe").string();
    REQUIRE(run_program(EFIM_FRAGMENT_PATH, bpe + "0 --fragment-rate 0").exit_code == 0);
    REQUIRE(run_program(EFIM_FRAGMENT_PATH, bpe + "1 --fragment-rate 1").exit_code == 0);
    // Same holes and layouts (the same seed), but fragments tokenized alone take more tokens.
    const auto whole = read_binary<std::uint32_t>(dir.path / "bpe0.bin");
    const auto cut = read_binary<std::uint32_t>(dir.path / "bpe1.bin");
    CHECK(cut.size() > whole.size());
    const auto tok = efim::text::load_bpe(gguf.string());
    const auto text_of = [&](const std::vector<std::uint32_t>& v) {
      std::vector<efim::token_id> ids(v.begin(), v.end());
      return tok.decode(ids);
    };
    CHECK(text_of(cut) == text_of(whole));
  } else {
    WARN("the real-tokenizer part is skipped: no " << gguf.string());
  }

  const auto expect_failure = [](const std::string& args, const std::string& says) {
    check_fails(EFIM_FRAGMENT_PATH, args, says);
  };
  {
    std::ofstream bad(dir.path / "bad.jsonl");
    bad << "{\"text\": \"ok\"}\n{\"text\": oops}\n";
    std::ofstream(dir.path / "nofield.jsonl") << "{\"body\": \"x\"}\n";
    std::ofstream(dir.path / "notutf8.jsonl") << "{\"text\": \"\\udc80\"}\n";
  }
  const std::string out = " --tokenizer byte --out " + (dir.path / "x").string();
  expect_failure("--input " + (dir.path / "bad.jsonl").string() + out, "bad.jsonl:2: not JSON");
  expect_failure("--input " + (dir.path / "nofield.jsonl").string() + out, "nofield.jsonl:1: no string field 'text'");
  expect_failure("--input " + (dir.path / "notutf8.jsonl").string() + out, "notutf8.jsonl:1:");
  expect_failure("--input " + (dir.path / "missing.jsonl").string() + out, "cannot open");
  expect_failure("--input " + (dir.path / "docs.jsonl").string(), "--out PREFIX is required");
  expect_failure("--input a --corpus b" + out, "give one of --corpus DIR and --input FILE");
  expect_failure("--input " + (dir.path / "docs.jsonl").string() + out + " --fragment-rate 2", "--fragment-rate needs");
  expect_failure("--input " + (dir.path / "docs.jsonl").string() + out + " --psm 0 --spm 0 --efim 0", "all zero");
}

namespace {
run_result model_tool(const std::string& args) { return run_program(EFIM_MODEL_PATH, args); }
run_result cli(const std::string& args) { return run_program(EFIM_CLI_PATH, args); }

std::vector<efim::token_id> parse_ids(const std::string& text) {
  std::vector<efim::token_id> ids;
  std::istringstream in(text);
  for (long v; in >> v;) ids.push_back(static_cast<efim::token_id>(v));
  return ids;
}
}  // namespace

TEST_CASE("efim-model makes deterministic models of each architecture that load and describe themselves",
          "[examples][model]") {
  temp_dir dir("model-make");
  const fs::path vocab = efim_test::vocab_dir() / "ggml-vocab-starcoder.gguf";
  const bool have_vocab = fs::exists(vocab);
  if (!have_vocab) WARN("the vocabulary part is skipped: no " << vocab.string());
  for (const std::string arch : {"llama", "qwen2", "starcoder2"}) {
    const std::string shape =
        " --arch " + arch + " --hidden 64 --layers 2 --heads 4 --kv-heads 2 --ffn 96 --context 256";
    const std::string tokenizer =
        arch == "starcoder2" && have_vocab ? " --tokenizer " + vocab.string() : " --tokenizer none --vocab 300";
    const auto a = (dir.path / (arch + "-a.gguf")).string(), b = (dir.path / (arch + "-b.gguf")).string(),
               c = (dir.path / (arch + "-c.gguf")).string();
    for (const auto& [out, seed] : {std::pair{a, "7"}, {b, "7"}, {c, "8"}}) {
      const auto r = model_tool("make" + shape + tokenizer + " --type q8_0 --seed " + seed + " --threads 2 " + out);
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
    }
    CHECK(read_binary<char>(a) == read_binary<char>(b));
    CHECK(read_binary<char>(a) != read_binary<char>(c));
    const auto info = model_tool("info --json " + a);
    INFO(info.output);
    REQUIRE(info.exit_code == 0);
    const auto j = nlohmann::json::parse(info.output);
    CHECK(j["config"]["architecture"] == arch);
    CHECK(j["config"]["hidden"] == 64);
    CHECK(j["config"]["layers"] == 2);
    CHECK(j["config"]["context"] == 256);
    CHECK(j["tensors"]["q8_0"]["tensors"].get<int>() > 0);
    CHECK(j["metadata"]["general.architecture"] == arch);
    const auto w = efim::model::open_model(a).bind();
    CHECK(w.cfg.arch == efim::model::parse_architecture(arch));
    CHECK(w.type() == efim::dtype::q8_0);
    if (arch == "starcoder2" && have_vocab) {
      CHECK(w.cfg.vocab == 49152);
      CHECK(j["metadata"]["tokenizer.ggml.fim_pre_token_id"] == "1");
      CHECK(model_tool("info " + a).output.find("starcoder2") != std::string::npos);
    }
  }
  const auto expect_failure = [](const std::string& args, const std::string& says) {
    check_fails(EFIM_MODEL_PATH, args, says, true);
  };
  if (const auto deepseek = efim_test::vocab_dir() / "ggml-vocab-deepseek-coder.gguf";
      fs::exists(deepseek)) {
    // Only the Qwen2.5-Coder vocabulary is padded to its models' 151,936 rows, whatever the architecture.
    const auto path = (dir.path / "qwen2-deepseek.gguf").string();
    REQUIRE(model_tool("make --arch qwen2 --hidden 64 --layers 1 --heads 4 --kv-heads 2 --ffn 96 --tokenizer " +
                       deepseek.string() + " " + path)
                .exit_code == 0);
    CHECK(efim::model::open_model(path).cfg().vocab == 32256);
  }
  const auto out = (dir.path / "x.gguf").string();
  expect_failure("make --arch gpt2 --tokenizer none --vocab 10 " + out, "'gpt2' is not supported");
  expect_failure("make --type q3_k --tokenizer none --vocab 10 " + out, "unknown tensor type 'q3_k'");
  // A k-quant on rows that are not a whole number of its super-blocks of 256.
  expect_failure("make --type q4_k --hidden 64 --heads 4 --ffn 128 --tokenizer none --vocab 10 " + out,
                 "not a whole number of q4_k blocks of 256");
  expect_failure("make --hidden 48 --heads 4 --ffn 64 --type q8_0 --tokenizer none --vocab 10 " + out,
                 "not a whole number of q8_0 blocks");
  expect_failure("make --tokenizer none " + out, "--vocab N is needed");
  expect_failure("make --hidden x " + out, "--hidden needs a number");
  expect_failure("make --bogus 1 " + out, "unknown option --bogus");
  expect_failure("make --threads 1e12 --tokenizer none --vocab 10 " + out, "at most 4096");
  expect_failure("make --seed -1 --tokenizer none --vocab 10 " + out, "--seed needs a whole number");
  expect_failure("make --norm-eps 1e300 --tokenizer none --vocab 10 " + out, "--norm-eps must be in (0, 1)");
  expect_failure("make --rope-base inf --tokenizer none --vocab 10 " + out, "finite");
  expect_failure("make --context 4294967296 --tokenizer none --vocab 10 " + out, "implausibly large");
  expect_failure("make --arch qwen2 --hidden 64 --heads 4 --head-dim 32 --tokenizer none --vocab 10 " + out,
                 "heads x head size = hidden");
  {
    // A tokenizer file whose token list is a number, not strings.
    const auto bad = (dir.path / "badtok.gguf").string();
    efim::model::write_file(bad, efim::gguf::serialize({{"tokenizer.ggml.tokens", efim::gguf::make_u32(5)},
                                                        {"tokenizer.ggml.model", efim::gguf::make_string("gpt2")}},
                                                       {}));
    expect_failure("make --tokenizer " + bad + " " + out, "not an array");
  }
  expect_failure("info " + (dir.path / "missing.gguf").string(), "cannot open");
  std::ofstream(dir.path / "junk.gguf") << "GGUF but not really";
  expect_failure("info " + (dir.path / "junk.gguf").string(), "gguf:");
  CHECK(!fs::exists(out));
  CHECK(model_tool("--help").output.find("usage: efim-model") != std::string::npos);
}

TEST_CASE("efim-cli completes a prompt as the reference decoder does", "[examples][cli]") {
  temp_dir dir("cli");
  const fs::path vocab = efim_test::vocab_dir() / "ggml-vocab-qwen2.5-coder.gguf";
  if (!fs::exists(vocab)) {
    WARN("skipped: no " << vocab.string());
    return;
  }
  const auto path = (dir.path / "qwen.gguf").string();
  REQUIRE(
      model_tool("make --arch qwen2 --hidden 64 --layers 2 --heads 4 --kv-heads 2 --ffn 96 --type f16 --tokenizer " +
                 vocab.string() + " " + path)
          .exit_code == 0);
  const std::string prompt = "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n<|fim_middle|>";
  const auto r = cli("complete --model " + path + " --prompt '" + prompt + "' --n-predict 12 --ids --ignore-eos");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto got = parse_ids(r.output);
  REQUIRE(got.size() == 12);

  // The same greedy tokens from the reference decoder, with the special tokens parsed.
  const auto file = efim::model::open_model(path);
  const auto w = file.bind();
  const auto tok = efim::text::load_bpe_gguf(file.meta);
  std::vector<efim::token_id> ids;
  tok.encode_special(prompt, ids);
  CHECK(ids.front() == *tok.special_id("<|fim_prefix|>"));
  efim::model::reference_model ref(w);
  auto logits = ref.forward(ids);
  std::vector<efim::token_id> want;
  while (want.size() < 12) {
    want.push_back(efim::kernels::argmax(std::span(logits).last(w.cfg.vocab).first(tok.vocab_size())));
    logits = ref.forward(std::span(&want.back(), 1));
  }
  CHECK(got == want);

  // Text output is the decoded ids; sampling is reproducible for a seed.
  const auto text = cli("complete --model " + path + " --prompt '" + prompt + "' --n-predict 12 --ignore-eos");
  CHECK(text.output == tok.decode(want));
  const auto sample = [&](const std::string& seed) {
    return cli("complete --model " + path +
               " --prompt 'x = ' --n-predict 10 --ids --ignore-eos --temperature 0.8 "
               "--top-k 50 --seed " +
               seed)
        .output;
  };
  CHECK(sample("3") == sample("3"));
  CHECK(sample("3") != sample("4"));

  const auto expect_failure = [](const std::string& args, const std::string& says) {
    check_fails(EFIM_CLI_PATH, args, says, true);
  };
  expect_failure("complete --prompt x", "--model FILE is required");
  expect_failure("complete --model " + path, "--prompt TEXT or --prompt-file FILE is required");
  expect_failure("complete --model " + (dir.path / "none.gguf").string() + " --prompt x", "cannot open");
  expect_failure("complete --model " + path + " --prompt x --n-predict 100000", "exceed the model context");
  expect_failure("complete --model " + path + " --prompt x --temperature -1", "--temperature must be");
  std::ofstream(dir.path / "bad.txt") << "ok \xFF";
  expect_failure("complete --model " + path + " --prompt-file " + (dir.path / "bad.txt").string(), "UTF-8");
  expect_failure("complete --model " + path + " --prompt-file " + (dir.path / "none.txt").string(), "cannot open");
  expect_failure("generate", "unknown command");

  // efim-bench runs on the same file, with its tokenizer.
  temp_dir corpus("cli-corpus");
  write_source(corpus.path / "a.py", 1500, 1);
  const auto bench = run("--model " + path + " --corpus " + corpus.path.string() +
                         " --users 1 --rounds 2 --output-tokens 2 --min-doc-tokens 100 --quiet");
  INFO(bench.output);
  CHECK(bench.exit_code == 0);
  CHECK(bench.output.find("efim/psm") != std::string::npos);
}
