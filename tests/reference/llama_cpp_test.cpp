// efim against llama.cpp on the same GGUF files: files written by llama.cpp's tools (gguf-py's writer,
// llama.cpp's quantizer) load here and give the logits llama.cpp gives, and files efim-model writes load
// in llama.cpp and give the logits efim gives. llama.cpp runs as a process (efim-llama-reference).
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "../support.hpp"
#include "../vocab.hpp"
#include "efim/efim.hpp"

namespace fs = std::filesystem;
using namespace efim;

namespace {
using efim_test::max_relative_error;

efim_test::run_result run(const std::string& cmd) { return efim_test::run_command(cmd); }

const fs::path vocab_dir = efim_test::vocab_dir();
const fs::path work = fs::path(EFIM_WORK_DIR);

// A model written by gguf-py, llama.cpp's GGUF writer, through tests/reference/make_model.py.
fs::path gguf_py_model(const std::string& name, const std::string& args) {
  const fs::path out = work / (name + ".gguf");
  const auto r = run(std::string(EFIM_PYTHON) + " " + EFIM_MAKE_MODEL + " " + args + " " + out.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  return out;
}

// The ids a reference command printed, separated by white space.
std::vector<token_id> ids_from(const std::string& output) {
  std::vector<token_id> ids;
  std::istringstream in(output);
  for (long v; in >> v;) ids.push_back(static_cast<token_id>(v));
  return ids;
}

std::string ids_text(const std::vector<token_id>& ids) {
  std::string s;
  for (const auto id : ids) {
    if (!s.empty()) s += ' ';
    s += std::to_string(id);
  }
  return s;
}

// llama.cpp's logits for every position of `ids` (f32 KV, one thread).
std::vector<std::vector<float>> llama_logits(const fs::path& model, const std::vector<token_id>& ids) {
  const auto r = run(std::string(EFIM_LLAMA_REFERENCE) + " logits " + model.string() + " --all --threads 1 --ids '" +
                     ids_text(ids) + "'");
  INFO(r.output.substr(0, 2000));
  REQUIRE(r.exit_code == 0);
  std::vector<std::vector<float>> rows;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    std::vector<float> row;
    for (float v; in >> v;) row.push_back(v);
    if (!row.empty()) rows.push_back(std::move(row));
  }
  return rows;
}

// efim's logits for every position, token by token through the paged transformer.
std::vector<std::vector<float>> efim_logits(const model::weights& w, const std::vector<token_id>& ids,
                                            kernels::products products = kernels::products::exact) {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  model::transformer<kernels::host> m(w, products);
  kv::host_storage kv(w.cfg.layers, m.kv_layout(8, 8));
  const std::vector<block_id> table{3, 1, 4, 0, 5, 2, 7, 6};
  std::vector<std::vector<float>> rows;
  std::vector<float> logits;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const model::batch_item item{std::span(ids).subspan(i, 1), static_cast<position>(i), table, true};
    m.forward(ctx, kv, std::span(&item, 1), logits);
    rows.push_back(logits);
  }
  return rows;
}

// The reference decoder's logits (tokens, vocab), one row per token.
std::vector<std::vector<float>> reference_rows(const model::weights& w, const std::vector<token_id>& tokens) {
  const auto all = model::reference_forward(w, tokens);
  std::vector<std::vector<float>> rows;
  for (auto it = all.begin(); it != all.end(); it += static_cast<std::ptrdiff_t>(w.cfg.vocab))
    rows.emplace_back(it, it + static_cast<std::ptrdiff_t>(w.cfg.vocab));
  return rows;
}

float worst(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  float e = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, max_relative_error(a[i], b[i]));
  return e;
}

const std::vector<token_id> tokens{17, 4242, 311, 9, 1000, 77, 2048, 5, 12345, 600, 31, 8000};

// ctest reports the test skipped when this message is printed (SKIP_REGULAR_EXPRESSION).
bool ready() {
  if (!efim_test::have_vocabs()) {
    WARN("llama_cpp: skipped: needs the vocabularies in " << vocab_dir.string()
                                                           << " (the shared data, or .ci/setup's copies)");
    return false;
  }
  fs::create_directories(work);
  return true;
}

struct arch_case {
  std::string arch, vocab;
  bool tied;
  float bound;  // llama.cpp's starcoder2 reads GELU from an f16 table: 1.6e-4 from the exact tanh form
};
const arch_case cases[] = {{"llama", "ggml-vocab-deepseek-coder.gguf", false, 1e-4f},
                           {"qwen2", "ggml-vocab-qwen2.5-coder.gguf", true, 1e-4f},
                           {"starcoder2", "ggml-vocab-starcoder.gguf", false, 1e-3f}};
const std::string shape = " --hidden 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 --context 512";
}  // namespace

TEST_CASE("models written by llama.cpp's gguf-py load here and compute what llama.cpp computes", "[llama_cpp]") {
  if (!ready()) return;
  for (const auto& c : cases) {
    INFO(c.arch);
    const auto path =
        gguf_py_model("gguf_py_" + c.arch, "--arch " + c.arch + shape + " --seed 3 --vocab " +
                                               (vocab_dir / c.vocab).string() + (c.tied ? " --tied" : ""));
    const auto file = model::open_model(path.string());
    const auto w = file.bind();
    CHECK(w.tied() == c.tied);
    const auto theirs = llama_logits(path, tokens);
    const auto ours = efim_logits(w, tokens);
    CHECK(worst(ours, theirs) < c.bound);
    // The reference decoder agrees with both.
    CHECK(worst(ours, reference_rows(w, tokens)) < 1e-4f);
    // Its tokenizer too: the file's vocabulary is the shared one, token for token.
    const auto tok = text::load_bpe_gguf(file.meta);
    const auto shared = text::load_bpe((vocab_dir / c.vocab).string());
    const std::string code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # \xC3\xA9t\xC3\xA9\n";
    std::vector<token_id> mine, theirs_ids;
    tok.encode(code, mine);
    shared.encode(code, theirs_ids);
    CHECK(tok.vocab_size() == shared.vocab_size());
    CHECK(mine == theirs_ids);
  }
}

TEST_CASE("quantized files from gguf-py and llama.cpp's quantizer load and run", "[llama_cpp]") {
  if (!ready()) return;
  for (const auto& c : cases) {
    INFO(c.arch);
    const std::string args = "--arch " + c.arch + shape + " --seed 4 --vocab " + (vocab_dir / c.vocab).string();
    const auto f32_path = gguf_py_model("q_" + c.arch + "_f32", args);
    for (const std::string type : {"f16", "bf16", "q8_0", "q4_0"}) {
      INFO(type);
      // Written by gguf-py's quantizers, and by llama.cpp's from the f32 file.
      const auto by_gguf_py = gguf_py_model("q_" + c.arch + "_" + type, args + " --type " + type);
      const fs::path by_llama = work / ("q_" + c.arch + "_" + type + "_llama.gguf");
      const auto q = run(std::string(EFIM_LLAMA_REFERENCE) + " quantize " + f32_path.string() + " " +
                         by_llama.string() + " " + type + " --threads 1");
      INFO(q.output.substr(0, 2000));
      REQUIRE(q.exit_code == 0);
      for (const auto& path : {by_gguf_py, by_llama}) {
        INFO(path.string());
        const auto w = model::open_model(path.string()).bind();
        const auto ours = efim_logits(w, tokens);
        // The same weights, dequantized, through the reference decoder: only the order of sums differs.
        CHECK(worst(ours, reference_rows(w, tokens)) < 1e-4f);
        // llama.cpp rounds activations to the weight type (q8_0 activations for q8_0 and q4_0 weights),
        // efim keeps them in f32: close, not equal.
        const auto llama = llama_logits(path, tokens);
        const float exact_off = worst(ours, llama);
        CHECK(exact_off < (type == "f16" || type == "bf16" ? 2e-2f : 6e-2f));
        // With int8 products efim rounds them as llama.cpp does (per 32, to even) and multiplies in
        // integers: llama.cpp's logits within float rounding (measured 1.1e-7 against 1e-2 exact), but
        // for starcoder2, whose GELU llama.cpp takes from an f16 table (measured 8e-3 to 1e-2 either way).
        if (type == "q8_0" || type == "q4_0") {
          const float int8_off = worst(efim_logits(w, tokens, kernels::products::int8), llama);
          INFO("against llama.cpp: exact products " << exact_off << ", int8 products " << int8_off);
          CHECK(int8_off < (c.arch == "starcoder2" ? 6e-2f : 1e-5f));
        }
      }
    }
  }
}

namespace {
// Rows that reach the quantizers' corners: Gaussian at several scales, uniform, sparse with outliers,
// all positive, all equal, all zero, a zero sub-block, tiny and huge values, a lone spike.
std::vector<float> hard_rows(std::size_t rows, std::size_t n) {
  efim::rng r(77);
  std::vector<float> x(rows * n);
  for (std::size_t row = 0; row < rows; ++row)
    for (std::size_t i = 0; i < n; ++i) {
      const float g = static_cast<float>(r.normal()), u = static_cast<float>(r.uniform() * 2 - 1);
      float v = 0;
      switch (row % 10) {
        case 0: v = g * 0.02f; break;
        case 1: v = u; break;
        case 2: v = r.uniform() > 0.9 ? g * 10 : 0.0f; break;
        case 3: v = std::abs(g) * 1e-3f; break;
        case 4: v = 1.0f; break;
        case 5: v = i < 300 ? 0.0f : g; break;
        case 6: v = g * 1e-20f; break;
        case 7: v = i % 97 == 0 ? 3e4f : g; break;
        case 8: v = 0.0f; break;
        default: v = -std::abs(g) * 50; break;
      }
      x[row * n + i] = v;
    }
  return x;
}

std::vector<char> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A model efim-model writes: `args` then --seed 6 and the output file.
fs::path efim_model(const std::string& name, const std::string& args) {
  const fs::path out = work / (name + ".gguf");
  const auto r = run(std::string(EFIM_MODEL_TOOL) + " make " + args + " --seed 6 " + out.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  return out;
}

// llama.cpp's quantizer on `in`.
fs::path llama_quantize(const fs::path& in, const std::string& type) {
  const fs::path out = in.parent_path() / (in.stem().string() + "_llama_" + type + ".gguf");
  const auto r = run(std::string(EFIM_LLAMA_REFERENCE) + " quantize " + in.string() + " " + out.string() + " " + type +
                     " --threads 2");
  INFO(r.output.substr(0, 2000));
  REQUIRE(r.exit_code == 0);
  return out;
}
}  // namespace

TEST_CASE("efim's quantizers write llama.cpp's bytes (q4_0, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k)", "[llama_cpp]") {
  if (!ready()) return;
  const std::size_t n = 1024, rows = 40;
  const auto x = hard_rows(rows, n);
  const fs::path in = work / "hard_rows.f32", out = work / "hard_rows.q";
  {
    std::ofstream f(in, std::ios::binary);
    f.write(reinterpret_cast<const char*>(x.data()), static_cast<std::streamsize>(x.size() * sizeof(float)));
  }
  for (const dtype t : {dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q8_0, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    INFO(to_string(t));
    const auto r = run(std::string(EFIM_LLAMA_REFERENCE) + " quantize-rows " + std::string(to_string(t)) + " " +
                       std::to_string(n) + " " + in.string() + " " + out.string());
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto theirs = file_bytes(out);
    const std::size_t rb = row_bytes(t, n);
    REQUIRE(theirs.size() == rows * rb);
    std::vector<std::byte> ours(rows * rb);
    for (std::size_t row = 0; row < rows; ++row) quantize_row(t, x.data() + row * n, ours.data() + row * rb, n);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < ours.size(); ++i) differ += static_cast<char>(ours[i]) != theirs[i];
    CHECK(differ == 0);
  }
}

TEST_CASE("q4_k_m, q5_k_m and q6_k: efim-model writes llama.cpp's types and bytes, and llama.cpp's files run",
          "[llama_cpp]") {
  if (!ready()) return;
  // 8 layers (use_more_bits picks layers 0, 2, 5, 7 of 8), rows of 256 and 512: k-quants throughout;
  // and the usual 64-wide model, where every k-quant falls back (q5_0, q5_1, q8_0).
  const std::string wide = " --hidden 256 --layers 8 --heads 4 --kv-heads 2 --ffn 512 --context 512";
  for (const auto& c : cases) {
    for (const std::string& dims : {wide, shape}) {
      INFO(c.arch << dims);
      const std::string args = "--arch " + c.arch + dims + (c.tied ? " --tied" : "") + " --tokenizer " +
                               (vocab_dir / c.vocab).string();
      const std::string tag = c.arch + (dims == wide ? "_wide" : "_narrow");
      const auto f32 = efim_model("mix_" + tag + "_f32", args + " --type f32");
      for (const std::string mix : {"q4_k_m", "q5_k_m", "q6_k"}) {
        INFO(mix);
        const auto theirs_path = llama_quantize(f32, mix);
        const auto ours_path = efim_model("mix_" + tag + "_" + mix, args + " --type " + mix);
        const auto theirs = model::open_model(theirs_path.string()), ours = model::open_model(ours_path.string());
        // Tensor by tensor: the same type and the same bytes.
        std::size_t compared = 0, k_quants = 0;
        for (const auto& t : ours.meta.tensors) {
          INFO(t.name);
          const auto it = std::find_if(theirs.meta.tensors.begin(), theirs.meta.tensors.end(),
                                       [&](const auto& u) { return u.name == t.name; });
          REQUIRE(it != theirs.meta.tensors.end());
          CHECK(it->type == t.type);
          REQUIRE(it->bytes == t.bytes);
          const auto* a = ours.bytes.data() + ours.meta.data_offset + t.offset;
          const auto* b = theirs.bytes.data() + theirs.meta.data_offset + it->offset;
          CHECK(std::memcmp(a, b, t.bytes) == 0);
          ++compared;
          k_quants += t.type >= 12 && t.type <= 14;
        }
        CHECK(compared == theirs.meta.tensors.size());
        CHECK((dims == wide) == (k_quants > 0));
        // llama.cpp's file runs: the same logits as the reference decoder on its dequantized weights,
        // llama.cpp's within what its q8_K activations cost, and the reference's greedy tokens.
        const auto w = theirs.bind();
        const auto mine = efim_logits(w, tokens), want = reference_rows(w, tokens);
        CHECK(worst(mine, want) < 1e-4f);
        const auto llama = llama_logits(theirs_path, tokens);
        const float exact_off = worst(mine, llama);
        CHECK(exact_off < 6e-2f);
        // With int8 products (activations rounded as llama.cpp rounds them) within the same bound, and
        // measured no nearer: the rest of llama.cpp's computation differs from efim's by as much (1-4%
        // here, exact or int8; where it comes from is not traced yet).
        if (dims == wide) {
          const float int8_off = worst(efim_logits(w, tokens, kernels::products::int8), llama);
          UNSCOPED_INFO("against llama.cpp: exact products " << exact_off << ", int8 products " << int8_off);
          CHECK(int8_off < 6e-2f);
        }
        // The greedy token at each position is the reference's wherever its top two are not within the
        // 1e-4 the logits may differ by.
        for (std::size_t i = 0; i < want.size(); ++i) {
          auto sorted = want[i];
          std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
          if (sorted[0] - sorted[1] > 2e-4f * std::abs(sorted[0]) + 1e-6f)
            CHECK(kernels::argmax(mine[i]) == kernels::argmax(want[i]));
        }
      }
    }
  }
}

TEST_CASE("models efim-model writes load in llama.cpp and give the logits efim gives", "[llama_cpp]") {
  if (!ready()) return;
  for (const auto& c : cases) {
    INFO(c.arch);
    const fs::path path = work / ("efim_" + c.arch + ".gguf");
    const auto r =
        run(std::string(EFIM_MODEL_TOOL) + " make --arch " + c.arch + shape + " --type f32 --seed 5" +
            (c.tied ? " --tied" : "") + " --tokenizer " + (vocab_dir / c.vocab).string() + " " + path.string());
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto w = model::open_model(path.string()).bind();
    CHECK(worst(efim_logits(w, tokens), llama_logits(path, tokens)) < c.bound);
    // Greedy continuations agree token for token.
    const auto theirs = run(std::string(EFIM_LLAMA_REFERENCE) + " generate " + path.string() +
                            " --threads 1 --n 16 --ids '" + ids_text(tokens) + "'");
    REQUIRE(theirs.exit_code == 0);
    const std::vector<token_id> want = ids_from(theirs.output);
    thread_pool pool(2);
    kernels::host::context ctx{pool};
    model::transformer<kernels::host> m(w);
    kv::host_storage kv(w.cfg.layers, m.kv_layout(8, 8));
    const std::vector<block_id> table{0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<token_id> seq = tokens, got;
    std::vector<float> logits;
    std::size_t start = 0;
    while (got.size() < 16) {
      const model::batch_item item{std::span(seq).subspan(start), static_cast<position>(start), table, true};
      m.forward(ctx, kv, std::span(&item, 1), logits);
      start = seq.size();
      got.push_back(kernels::argmax(logits));
      seq.push_back(got.back());
    }
    CHECK(got == want);
  }
}

TEST_CASE("user-defined tokens are found in plain text as llama.cpp finds them", "[llama_cpp]") {
  if (!ready()) return;
  // DeepSeek-Coder's added tokens 32000-32012 are single Latin-1 letters (GGUF type 4, user-defined),
  // as in Swedish, Vietnamese or a keyboard table; its FIM sentinels are user-defined in this file too,
  // and both programs keep them text (llama.cpp makes FIM tokens control tokens on loading). Left out:
  // "<|User|>"-style markers, which efim treats as control (looks_like_control) and llama.cpp finds,
  // and the "[PAD32022]" fillers, which Hugging Face's tokenizer does not have.
  const fs::path vocab = vocab_dir / "ggml-vocab-deepseek-coder.gguf";
  const std::string text =
      "\xC3\x85ngstr\xC3\xB6m \xC3\xBC"
      "ber fa\xC3\xA7"
      "ade na\xC3\xAFve: \xC3\xB7 \xC3\xB5 \xC3\xBD \xC3\x81 \xC3\x80 "
      "\xC3\xBF \xC3\xB8 \xC3\xBA \xC3\xBE \xC3\xBC \xC3\xB9 \xC3\xB6 \xC3\xBB\n"
      "G\xC3\xB6teborg, V\xC3\xA4ster\xC3\xA5s, Ti\xE1\xBA\xBFng Vi\xE1\xBB\x87t, ph\xE1\xBB\x9F\n"
      "\xC3\x80\xC3\x81\xC3\x82\xC3\x83 \xC3\xB9\xC3\xBA\xC3\xBB\xC3\xBC \xC3\xBF\xC3\xBD\xC3\xBE\xC3\xB8 "
      "\xC3\xB5\xC3\xB6\xC3\xB7\n"
      "def half(x):\n    return x\xC3\xB7"
      "2  # \xC3\xB6\xC3\xB6\xC3\xB6 <pad>\n"
      "<\xEF\xBD\x9C"
      "fim\xE2\x96\x81"
      "begin\xEF\xBD\x9C>int f() {<\xEF\xBD\x9C"
      "fim\xE2\x96\x81"
      "hole\xEF\xBD\x9C>}\n";
  const fs::path file = work / "user_defined_tokens.txt";
  {
    std::ofstream out(file, std::ios::binary);
    out << text;
  }
  const auto r = run(std::string(EFIM_LLAMA_REFERENCE) + " tokenize " + vocab.string() + " " + file.string());
  INFO(r.output.substr(0, 2000));
  REQUIRE(r.exit_code == 0);
  const std::vector<token_id> theirs = ids_from(r.output);
  const auto tok = text::load_bpe(vocab.string());
  std::vector<token_id> mine;
  tok.encode(text, mine);
  CHECK(mine == theirs);
  // The letters are found (each of the 13 at least once), the sentinels are not.
  for (token_id id = 32000; id <= 32012; ++id) {
    INFO(id);
    CHECK(std::count(mine.begin(), mine.end(), id) > 0);
  }
  for (token_id id = 32013; id <= 32021; ++id) {
    INFO(id);
    CHECK(std::count(mine.begin(), mine.end(), id) == (id == 32018 ? 1 : 0));  // 32018 is <pad>
  }
  // Decoding gives the text back: a user-defined token is text, not a special token to drop.
  CHECK_FALSE(tok.is_special(32000));
  CHECK(tok.decode(mine) == text);
}
