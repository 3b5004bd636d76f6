// Writes the fuzz targets' seed corpora with the project's own writers: GGUF files (gguf::serialize,
// random models of each architecture and weight type), tokenizer.json files (small ones of each
// pre-tokenizer and normalizer kind; a cut of the real Qwen2.5-Coder one where set-up fetched it),
// GGUF tokenizer metadata (text::gguf_vocabulary), text for the real vocabularies, request bodies
// as editors send them, and raw HTTP requests.
//   efim-fuzz-seeds DIR     (DIR/<target>/seed-N for each target)
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "efim/core/gguf.hpp"
#include "efim/core/utf8.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/text/bpe_tokenizer.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
namespace gguf = efim::gguf;
namespace model = efim::model;
namespace text = efim::text;
namespace utf8 = efim::utf8;
using efim::dtype;

namespace {

fs::path root;

void put(const std::string& target, const std::string& bytes) {
  const fs::path dir = root / target;
  fs::create_directories(dir);
  std::size_t n = 0;
  while (fs::exists(dir / ("seed-" + std::to_string(n)))) ++n;
  std::ofstream(dir / ("seed-" + std::to_string(n)), std::ios::binary) << bytes;
}
void put(const std::string& target, const std::vector<std::byte>& bytes) {
  put(target, std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

// A small byte-level BPE tokenizer.json; `kind` varies its normalizer, pre-tokenizer and options.
std::string small_tokenizer(int kind) {
  json vocab = json::object();
  const auto& to_cp = text::byte_level::to_code_point();
  for (unsigned b = 0; b < 256; ++b) {
    if (kind == 3 && b == 0xF1) continue;  // a byte without a token (as StarCoder's 0xF1)
    std::string s;
    utf8::append(to_cp[b], s);
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab
      ["\xC4\xA0"
       "a"] = 258;  // " a"
  vocab["de"] = 259;
  vocab["def"] = 260;
  json j;
  j["version"] = "1.0";
  j["model"] = {{"type", "BPE"},
                {"vocab", vocab},
                {"merges", kind == 2 ? json{{"a", "b"}, {"ab", "c"}, {"\xC4\xA0", "a"}, {"d", "e"}, {"de", "f"}}
                                     : json{"a b", "ab c", "\xC4\xA0 a", "d e", "de f"}}};
  if (kind == 3) {
    j["model"]["unk_token"] = "<unk>";
    j["model"]["fuse_unk"] = true;
  }
  if (kind == 4) j["model"]["ignore_merges"] = true;
  j["added_tokens"] = {{{"id", 261}, {"content", "<|fim_prefix|>"}, {"special", true}, {"normalized", false}},
                       {{"id", 262}, {"content", "<|fim_suffix|>"}, {"special", true}},
                       {{"id", 263}, {"content", "<|fim_middle|>"}, {"special", true}},
                       {{"id", 264}, {"content", "<|endoftext|>"}, {"special", true}},
                       {{"id", 265}, {"content", "<extra>"}, {"special", false}, {"lstrip", true}},
                       {{"id", 266}, {"content", "<unk>"}, {"special", true}}};
  if (kind != 1)
    j["normalizer"] =
        kind == 4 ? json{{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}} : json{{"type", "NFC"}};
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", kind == 1}, {"use_regex", kind != 2}};
  const json qwen_split = {
      {"type", "Split"},
      {"pattern",
       {{"Regex",
         R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
      {"behavior", "Isolated"},
      {"invert", false}};
  if (kind == 0)
    j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {qwen_split, byte_level}}};
  else if (kind == 2)
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}};
  else
    j["pre_tokenizer"] = byte_level;
  j["decoder"] = {{"type", "ByteLevel"}};
  return j.dump();
}

// The real Qwen2.5-Coder tokenizer.json cut to its first `keep` tokens and the merges among them.
std::string cut_tokenizer(const std::string& path, std::size_t keep) {
  json j = json::parse(text::read_tokenizer_json(path));
  json vocab = json::object();
  for (const auto& [k, v] : j["model"]["vocab"].items())
    if (v.get<std::size_t>() < keep) vocab[k] = v;
  json merges = json::array();
  for (const auto& m : j["model"]["merges"]) {
    const std::string s =
        m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>();
    const auto sp = s.find(' ');
    const std::string l = s.substr(0, sp), r = s.substr(sp + 1);
    if (vocab.contains(l) && vocab.contains(r) && vocab.contains(l + r)) merges.push_back(m);
  }
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = merges;
  json added = json::array();
  std::size_t next = keep;
  for (auto t : j["added_tokens"]) {
    t["id"] = next++;
    added.push_back(t);
  }
  j["added_tokens"] = added;
  return j.dump();
}

const char* const texts[] = {
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "    total += compute_value(items[i])  # caf\xC3\xA9 \xC3\xBC"
    "ber \xE6\x95\xB0 \xE2\x9C\x93\n\t}\r\n",
    "e\xCC\x81 \xEF\xAC\x81 \xE2\x84\xAB A\xCC\x8A \xEA\xB0\x80\xE1\x86\xA8",  // combining, ligature, Hangul jamo
    "\xF1\x90\x80\x80 \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF",                      // U+50000, an emoji, U+10FFFF
    "<|fim_prefix|>int main() {<|fim_suffix|>}\n<|fim_middle|>  return 0;",
    "<\xEF\xBD\x9C"
    "fim\xE2\x96\x81"
    "begin\xEF\xBD\x9C>x = 1<\xEF\xBD\x9C"
    "fim\xE2\x96\x81"
    "hole\xEF\xBD\x9C>",
    "<fim_prefix>a<fim_suffix>b<fim_middle>   \n\n\n   1234567890 '''s 're ' ",
    "ok\xC3\x28 \xED\xA0\x80 \xF8\x88\x80\x80\x80 \xC0\xAF",  // not UTF-8
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: efim-fuzz-seeds DIR\n";
    return 2;
  }
  root = argv[1];

  // GGUF: metadata of every value type, and models.
  std::map<std::string, gguf::value, std::less<>> meta;
  meta.emplace("general.architecture", gguf::make_string("llama"));
  meta.emplace("general.alignment", gguf::make_u32(32));
  meta.emplace("x.f32", gguf::make_f32(1.5f));
  meta.emplace("x.strings", gguf::make_strings({"a", "", "\xE6\x95\xB0"}));
  meta.emplace("x.ints", gguf::make_i32s({1, -2, 3}));
  put("gguf", gguf::serialize(meta, {}));
  const std::vector<float> vals{1, 2, 3, 4, 5, 6};
  const std::vector<gguf::tensor_data> tensors{{"a", {2, 3}, 0, std::as_bytes(std::span(vals))},
                                               {"b", {6}, 0, std::as_bytes(std::span(vals))}};
  put("gguf", gguf::serialize(meta, tensors));
  put("gguf", gguf::serialize(meta, tensors, 64));

  for (const auto arch : {model::architecture::llama, model::architecture::qwen2, model::architecture::starcoder2})
    for (const auto type : {dtype::f32, dtype::f16, dtype::q8_0, dtype::q4_k}) {
      auto c = model::for_architecture(arch);
      const bool k = type == dtype::q4_k;
      c.vocab = 64;
      c.hidden = k ? 256 : 32;
      c.layers = 2;
      c.heads = 4;
      c.kv_heads = 2;
      c.ffn = k ? 256 : 64;
      c.max_context = 64;
      const auto bytes = model::random_model(c, 5, {type, arch == model::architecture::qwen2});
      put("model", bytes);
      if (type == dtype::f32) put("gguf", bytes);
    }

  // Tokenizers.
  for (int kind = 0; kind < 5; ++kind) {
    const std::string j = small_tokenizer(kind);
    put("tokenizer_json", j);
    try {  // (GGUF names a preset pre-tokenizer; the others have none)
      put("tokenizer_gguf", gguf::serialize(text::gguf_vocabulary(j), {}));
    } catch (const efim::error&) {
    }
  }
  const fs::path qwen = fs::path(EFIM_TOKENIZER_CACHE) / "qwen2.5-coder" / "tokenizer.json";
  if (fs::exists(qwen)) {
    const std::string cut = cut_tokenizer(qwen.string(), 600);
    put("tokenizer_json", cut);
    put("tokenizer_gguf", gguf::serialize(text::gguf_vocabulary(cut), {}));
  } else {
    std::cerr << "efim-fuzz-seeds: no " << qwen << " (.ci/setup fetches it): no cut of the real tokenizer.json\n";
  }

  // Text for the three vocabularies (first byte: which; second: plain or special).
  for (const char* t : texts)
    for (char which = 0; which < 3; ++which)
      for (char special = 0; special < 2; ++special) put("encode", std::string{which, special} + t);

  // Request bodies (first byte: the route, as handlers.cpp numbers them).
  const std::string prefix = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n";
  const json infill = {{"input_prefix", prefix},
                       {"input_suffix", "\n\nprint(fibonacci(10))\n"},
                       {"input_extra", {{{"filename", "a.py"}, {"text", "import os\n"}}}},
                       {"prompt", "        ret"},
                       {"n_predict", 4},
                       {"stream", false},
                       {"cache_prompt", true},
                       {"t_max_prompt_ms", 500},
                       {"t_max_predict_ms", 1000},
                       {"samplers", {"top_k", "top_p", "infill"}},
                       {"id_slot", -1},
                       {"response_fields", {"content", "timings/prompt_n", "tokens_cached"}}};
  const std::vector<std::pair<char, json>> bodies{
      {0, infill},
      {0, {{"input_prefix", "a"}, {"input_suffix", "b"}, {"stream", true}, {"n_predict", 3}, {"stop", {"\n"}}}},
      {1, {{"prompt", "def f(x):"}, {"suffix", "\n"}, {"max_tokens", 4}, {"temperature", 0}, {"stream", true}}},
      {2, {{"prompt", "x = "}, {"max_tokens", 2}, {"logprobs", 1}, {"seed", 3}}},
      {3, {{"content", "def f(x): return \xE6\x95\xB0"}, {"with_pieces", true}, {"add_special", false}}},
      {3,
       {{"content",
         "<\xEF\xBD\x9C"
         "fim\xE2\x96\x81"
         "begin\xEF\xBD\x9C>x"},
        {"parse_special", true}}},
      {4, {{"tokens", {1, 2, 3, 32000}}}},
      {5, json::object()},
      {7, json::object()}};
  for (const auto& [route, body] : bodies) put("handlers", std::string(1, route) + body.dump());

  // Raw HTTP.
  const std::string b = infill.dump();
  put("http", "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  put("http", "POST /infill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                  std::to_string(b.size()) + "\r\n\r\n" + b);
  put("http", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n" +
                  std::string("1c\r\nmpt\": \"a\", \"max_tokens\": 2}\r\n0\r\n\r\n"));
  put("http",
      "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  put("http",
      "POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nAuthorization: Bearer k\r\nContent-Length: "
      "17\r\n\r\n{\"content\":\"ab\"}");
  return 0;
}
