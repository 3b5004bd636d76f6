#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/core/json_reader.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/utf8.hpp"
#include "vocab.hpp"

using namespace efim;

TEST_CASE("utf8 validation accepts well-formed text and finds the first bad byte", "[core][utf8]") {
  CHECK(utf8::is_valid(""));
  CHECK(utf8::is_valid("plain ascii"));
  CHECK(utf8::is_valid("caf\xC3\xA9 \xE4\xB8\xAD \xF0\x9F\x98\x80"));  // é, 中, 😀
  CHECK(utf8::find_invalid("ab\x80") == 2);                            // lone continuation
  CHECK(utf8::find_invalid("\xC0\xAF") == 0);                          // overlong '/'
  CHECK(utf8::find_invalid("\xE0\x80\xAF") == 0);                      // overlong 3-byte
  CHECK(utf8::find_invalid("x\xED\xA0\x80") == 1);                     // UTF-16 surrogate
  CHECK(utf8::find_invalid("\xF4\x90\x80\x80") == 0);                  // above U+10FFFF
  CHECK(utf8::find_invalid("ok\xE4\xB8") == 2);                        // truncated at the end
  CHECK(utf8::find_invalid("\xFF") == 0);
  CHECK_THROWS_AS(utf8::require_valid("a\xFF", "the prefix"), efim::error);
  try {
    utf8::require_valid("a\xFF", "the prefix");
  } catch (const efim::error& e) {
    CHECK(e.code() == errc::invalid_utf8);
    CHECK(std::string(e.what()).find("offset 1") != std::string::npos);
  }
}

namespace {
// The definition, code point by code point: an independent reference for validation.
bool reference_valid(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    std::size_t n;
    std::uint32_t cp;
    if (b < 0x80) {
      n = 1;
      cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2;
      cp = b & 0x1Fu;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3;
      cp = b & 0x0Fu;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4;
      cp = b & 0x07u;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3Fu);
    }
    const std::uint32_t min_for_length[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_for_length[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}
}  // namespace

TEST_CASE("utf8 validation agrees with the definition on random bytes", "[core][utf8][fuzz]") {
  rng r(77);
  // Bytes drawn to hit every class: ASCII, continuations, each lead range, invalid leads.
  const unsigned char pool[] = {0x00, 0x41, 0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF,
                                0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x8F, 0x90, 0xB0};
  for (int i = 0; i < 200000; ++i) {
    std::string s(r.below(7), '\0');
    for (auto& c : s) c = static_cast<char>(pool[r.below(sizeof pool)]);
    INFO("case " << i);
    REQUIRE(utf8::is_valid(s) == reference_valid(s));
  }
}

TEST_CASE("utf8 common prefix stops on a character boundary", "[core][utf8]") {
  // "é" is C3 A9 and "è" is C3 A8: they share a lead byte but no character.
  CHECK(utf8::common_prefix("ab\xC3\xA9", "ab\xC3\xA8") == 2);
  CHECK(utf8::common_prefix("abc", "abd") == 2);
  CHECK(utf8::common_prefix("abc", "abc") == 3);
  CHECK(utf8::common_prefix("ab", "abc") == 2);
  CHECK(utf8::common_prefix("", "abc") == 0);
  CHECK(utf8::floor_boundary("a\xE4\xB8\xAD", 2) == 1);
  CHECK(utf8::floor_boundary("a\xE4\xB8\xAD", 4) == 4);
}

TEST_CASE("thread pool covers every index once, on several threads", "[core][threads]") {
  thread_pool pool(2);
  REQUIRE(pool.size() == 2);
  for (const std::size_t n : {0u, 1u, 2u, 7u, 1000u}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) hits[i].fetch_add(1);
    });
    for (std::size_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
  }
  // Many small jobs in a row: the pool must not lose a wake-up.
  std::atomic<std::size_t> total{0};
  for (int round = 0; round < 2000; ++round)
    pool.parallel_for(8, [&](std::size_t b, std::size_t e) { total.fetch_add(e - b); });
  CHECK(total.load() == 16000);
}

TEST_CASE("thread pool rethrows the first exception and stays usable", "[core][threads]") {
  thread_pool pool(2);
  CHECK_THROWS_AS(pool.parallel_for(100,
                                    [](std::size_t b, std::size_t) {
                                      if (b > 0) throw std::runtime_error("boom");
                                    }),
                  std::runtime_error);
  std::atomic<std::size_t> n{0};
  pool.parallel_for(10, [&](std::size_t b, std::size_t e) { n.fetch_add(e - b); });
  CHECK(n.load() == 10);
}

TEST_CASE("a thread pool that cannot start its threads throws and leaves nothing running", "[core][threads]") {
  // In a child process, cap the address space a little above what is mapped now, so that thread
  // stacks run out after a few threads; the pool must throw efim::error, not terminate.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::signal(SIGABRT, SIG_DFL);  // std::terminate must end the child, not the test framework's handler
    alarm(60);                      // and so must a hang
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages <= 0) _exit(3);
    const rlim_t now = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
    const rlimit cap{now + (64u << 20), now + (64u << 20)};
    if (setrlimit(RLIMIT_AS, &cap) != 0) _exit(4);
    try {
      thread_pool pool(4096);  // 8 MiB of stack each
      _exit(1);
    } catch (const efim::error& e) {
      _exit(std::string_view(e.what()).find("worker threads") != std::string_view::npos ? 0 : 2);
    } catch (...) {
      _exit(5);
    }
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("rng is deterministic and in range", "[core][random]") {
  rng a(123), b(123), c(124);
  std::vector<std::uint64_t> xa, xb, xc;
  for (int i = 0; i < 100; ++i) {
    xa.push_back(a.next());
    xb.push_back(b.next());
    xc.push_back(c.next());
  }
  CHECK(xa == xb);
  CHECK(xa != xc);
  std::set<std::uint64_t> seen;
  for (int i = 0; i < 10000; ++i) {
    const auto v = a.below(7);
    REQUIRE(v < 7);
    seen.insert(v);
    const double u = a.uniform();
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
  }
  CHECK(seen.size() == 7);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; ++i) {
    const double x = a.normal();
    sum += x;
    sq += x * x;
  }
  CHECK(sum / 20000 == Approx(0.0).margin(0.05));
  CHECK(sq / 20000 == Approx(1.0).margin(0.05));
}

namespace {
std::vector<std::byte> small_gguf() {
  std::map<std::string, gguf::value, std::less<>> meta;
  meta.emplace("general.architecture", gguf::make_string("llama"));
  meta.emplace("general.alignment", gguf::make_u32(64));
  meta.emplace("llama.rope.freq_base", gguf::make_f32(10000.0f));
  meta.emplace("tokenizer.ggml.tokens", gguf::make_strings({"a", "b", "ab", "\xE4\xB8\xAD"}));
  meta.emplace("tokenizer.ggml.token_type", gguf::make_i32s({1, 1, 1, 3}));
  meta.emplace("flags", gguf::value{gguf::value_type::boolean, true});
  std::vector<float> w(2 * 32, 0.5f);
  std::vector<std::byte> q(34, std::byte{7});
  const std::vector<gguf::tensor_data> tensors{
      {"w", {32, 2}, 0, std::as_bytes(std::span(w))},
      {"q", {32}, 8, q},
  };
  return gguf::serialize(meta, tensors, 64);
}
}  // namespace

TEST_CASE("gguf: a written file reads back the same", "[core][gguf]") {
  const auto bytes = small_gguf();
  const auto f = gguf::parse(bytes);
  CHECK(f.version == 3);
  CHECK(f.alignment == 64);
  CHECK(f.string("general.architecture") == "llama");
  CHECK(std::get<double>(f.at("llama.rope.freq_base").v) == 10000.0);
  CHECK(f.array<std::string>("tokenizer.ggml.tokens") == std::vector<std::string>{"a", "b", "ab", "\xE4\xB8\xAD"});
  CHECK(f.array<std::int64_t>("tokenizer.ggml.token_type") == std::vector<std::int64_t>{1, 1, 1, 3});
  CHECK(std::get<bool>(f.at("flags").v));
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].name == "w");
  CHECK(f.tensors[0].shape == std::vector<std::uint64_t>{32, 2});
  CHECK(f.tensors[0].bytes == 2 * 32 * 4);
  CHECK(f.tensors[1].offset == 256);  // 256 bytes of f32, already aligned to 64
  CHECK(f.tensors[1].bytes == 34);
  CHECK(f.data_offset % 64 == 0);
  float first = 0;
  std::memcpy(&first, bytes.data() + f.data_offset + f.tensors[0].offset, sizeof first);
  CHECK(first == 0.5f);
  CHECK(static_cast<int>(bytes[f.data_offset + f.tensors[1].offset]) == 7);
  CHECK_THROWS_WITH(f.string("missing.key"), Catch::Contains("missing.key"));
  CHECK_THROWS_WITH(f.array<double>("tokenizer.ggml.tokens"), Catch::Contains("not an array of the expected type"));
}

TEST_CASE("gguf: every truncation and random corruption gives an error or a checked file", "[core][gguf][fuzz]") {
  const auto bytes = small_gguf();
  const auto whole = gguf::parse(bytes);
  const std::size_t data_end = whole.data_offset + whole.tensors[1].offset + whole.tensors[1].bytes;
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    const std::span<const std::byte> cut(bytes.data(), n);
    if (n < data_end) {
      INFO("truncated to " << n << " bytes");
      CHECK_THROWS_AS(gguf::parse(cut), efim::error);
    }
  }
  rng r(11);
  std::size_t parsed = 0, refused = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    auto copy = bytes;
    const int flips = 1 + static_cast<int>(r.below(4));
    for (int i = 0; i < flips; ++i) {
      // Mostly the header (where lengths and counts live), sometimes anywhere.
      const std::size_t at = r.below(4) == 0 ? r.below(copy.size()) : r.below(std::min<std::size_t>(copy.size(), 400));
      copy[at] = static_cast<std::byte>(r.below(256));
    }
    try {
      const auto f = gguf::parse(copy);
      for (const auto& t : f.tensors) REQUIRE(f.data_offset + t.offset + t.bytes <= copy.size());
      ++parsed;
    } catch (const efim::error&) {
      ++refused;
    }
  }
  CHECK(parsed > 0);
  CHECK(refused > 0);
}

TEST_CASE("gguf: hostile counts and lengths are refused before anything is allocated", "[core][gguf]") {
  const auto header = [](std::uint64_t tensors, std::uint64_t kvs) {
    std::vector<std::byte> b;
    const auto put = [&](auto v) {
      const auto* p = reinterpret_cast<const std::byte*>(&v);
      b.insert(b.end(), p, p + sizeof v);
    };
    put(gguf::magic);
    put(std::uint32_t{3});
    put(tensors);
    put(kvs);
    return std::pair{b, put};
  };
  {
    auto [b, put] = header(0, 1);
    CHECK_THROWS_WITH(gguf::parse(b), Catch::Contains("metadata count"));
  }
  {
    auto [b, put] = header(std::uint64_t{1} << 60, 0);
    CHECK_THROWS_WITH(gguf::parse(b), Catch::Contains("tensor count"));
  }
  {
    std::vector<std::byte> b = gguf::serialize({{"k", gguf::make_string("v")}}, {});
    // The string value's length field, made huge.
    const std::size_t len_at = 4 + 4 + 8 + 8 + 8 + 1 + 4;
    const std::uint64_t huge = std::uint64_t{1} << 62;
    std::memcpy(b.data() + len_at, &huge, sizeof huge);
    CHECK_THROWS_WITH(gguf::parse(b), Catch::Contains("file ends inside"));
  }
  {
    std::vector<std::byte> b = gguf::serialize({{"k", gguf::make_strings({"x", "y"})}}, {});
    const std::size_t count_at = 4 + 4 + 8 + 8 + 8 + 1 + 4 + 4;
    const std::uint64_t huge = std::uint64_t{1} << 61;
    std::memcpy(b.data() + count_at, &huge, sizeof huge);
    CHECK_THROWS_WITH(gguf::parse(b), Catch::Contains("array count"));
  }
  CHECK_THROWS_WITH(gguf::parse(std::as_bytes(std::span("GGML\3\0\0\0", 8))), Catch::Contains("bad magic"));
  CHECK_THROWS_WITH(gguf::read("/nonexistent/file.gguf"), Catch::Contains("cannot open"));
}

TEST_CASE("gguf::file_bytes reads a file into memory or maps it: the same bytes, read-only", "[core][gguf]") {
  const auto dir = std::filesystem::temp_directory_path() / ("efim_core_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto path = (dir / "bytes.bin").string();
  std::vector<std::byte> content(3 * 4096 + 123);  // not a whole number of pages
  rng r(7);
  for (auto& b : content) b = static_cast<std::byte>(r.next() & 0xff);
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(std::fwrite(content.data(), 1, content.size(), f) == content.size());
    std::fclose(f);
  }
  for (const auto how : {gguf::residency::read, gguf::residency::map}) {
    const gguf::file_bytes held(path, how);
    const auto bytes = held.bytes();
    REQUIRE(bytes.size() == content.size());
    CHECK(std::memcmp(bytes.data(), content.data(), content.size()) == 0);
    // Read-only either way: a write in a child process faults.
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(SIGSEGV, SIG_DFL);
      std::signal(SIGBUS, SIG_DFL);
      const_cast<volatile std::byte&>(bytes[100]) = std::byte{1};
      _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));
  }
  {
    std::FILE* f = std::fopen((dir / "empty.bin").string().c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fclose(f);
  }
  for (const auto how : {gguf::residency::read, gguf::residency::map}) {
    CHECK(gguf::file_bytes((dir / "empty.bin").string(), how).bytes().empty());
    CHECK_THROWS_WITH(gguf::file_bytes(dir.string(), how), Catch::Contains("not a regular file"));
    CHECK_THROWS_WITH(gguf::file_bytes((dir / "missing.bin").string(), how), Catch::Contains("cannot open"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("gguf: the real vocabulary files read", "[core][gguf][shared]") {
  const std::filesystem::path dir = efim_test::vocab_dir();
  if (!efim_test::have_vocabs()) {
    WARN("skipped: no vocabularies at " << dir.string() << " (the shared data, or .ci/setup's copies)");
    return;
  }
  const auto f = gguf::read((dir / "ggml-vocab-qwen2.5-coder.gguf").string());
  CHECK(f.string("tokenizer.ggml.model") == "gpt2");
  CHECK(f.string("tokenizer.ggml.pre") == "qwen2");
  CHECK(f.array<std::string>("tokenizer.ggml.tokens").size() == 151936);  // padded past the 151,665 in use
  CHECK(f.array<std::string>("tokenizer.ggml.merges").size() > 150000);
  const auto s = gguf::read((dir / "ggml-vocab-starcoder.gguf").string());
  CHECK(s.array<std::string>("tokenizer.ggml.tokens").size() == 49152);
}

namespace {
// Whether the pull reader takes `s` as one JSON document (skipped whole, nothing after it).
bool reader_accepts(std::string_view s) {
  try {
    json::reader r(s, "test");
    r.skip();
    r.finish();
    return true;
  } catch (const efim::error&) {
    return false;
  }
}
}  // namespace

TEST_CASE("json reader: takes exactly the documents a full JSON parser takes", "[core][json][fuzz]") {
  const std::string seed =
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "\u00e9\t": 1, "\ud83d\ude00": 2, "x\"y": 3},)"
      R"( "merges": ["a b", ["c", "d"]], "dropout": null, "f": -0.5e+3, "g": [true, false, 10, 0.25, -0, 1E2]},)"
      "\n \"added_tokens\": [{\"id\": 7, \"content\": \"<|x|>\", \"special\": true}], \"t\": \"\xC3\xA9\xE4\xB8\xAD\"}";
  REQUIRE(reader_accepts(seed));
  REQUIRE(nlohmann::json::accept(seed));
  // Mutations: characters of JSON's grammar, escapes, bytes that are not UTF-8, control characters.
  const std::vector<std::string> pieces = {"{", "}", "[", "]", "\"", ",", ":", "\\", "\\u", "\\ud800", "\\udc00",
                                           "0", "1", "-", "+", ".", "e", "E", "00", "true", "nul", "x", " ",
                                           "\n", "\t", "\x01", "\xC3", "\xA9", "\xFF", "\xE4\xB8\xAD", "/", "u0041"};
  rng r(77);
  std::size_t accepted = 0, refused = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string s = seed;
    for (int edits = 1 + static_cast<int>(r.below(3)); edits > 0; --edits) {
      const std::size_t at = r.below(s.size() + 1);
      switch (r.below(3)) {
        case 0:
          s.insert(at, pieces[r.below(pieces.size())]);
          break;
        case 1:
          if (at < s.size()) s.erase(at, 1 + r.below(3));
          break;
        default:
          s.resize(at);
          break;
      }
    }
    INFO(s);
    const bool want = nlohmann::json::accept(s);
    REQUIRE(reader_accepts(s) == want);
    (want ? accepted : refused) += 1;
  }
  CHECK(accepted > 1000);
  CHECK(refused > 1000);
}

TEST_CASE("json reader: strings, integers, members and errors", "[core][json]") {
  // Strings decode as a full parser decodes them, escapes and surrogate pairs included.
  rng r(5);
  const std::vector<std::string> parts = {"a", "\\n", "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\r", "\\t", "\\u0041",
                                          "\\u00e9", "\\u4e2d", "\\ud83d\\ude00", "\xC3\xA9", " ", "\xF0\x9F\x98\x80"};
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text = "\"";
    for (std::size_t n = r.below(8); n > 0; --n) text += parts[r.below(parts.size())];
    text += "\"";
    std::string scratch;
    json::reader reader(text, "test");
    INFO(text);
    REQUIRE(reader.string(scratch) == nlohmann::json::parse(text).get<std::string>());
  }
  std::string scratch;
  json::reader obj(R"( {"n": -42, "big": 9007199254740993, "b": true, "z": null, "list": [1, [2]], "s": "v"} )", "doc");
  obj.open('{');
  std::map<std::string, std::string> seen;
  for (bool first = true; obj.more('}', first);) {
    const std::string k(obj.key(scratch));
    if (k == "n") CHECK(obj.integer() == -42);
    else if (k == "big") CHECK(obj.integer() == 9007199254740993);
    else if (k == "b") CHECK(obj.boolean());
    else if (k == "z") CHECK_FALSE(obj.boolean());
    else seen[k] = std::string(obj.skip());
  }
  obj.finish();
  CHECK(seen == std::map<std::string, std::string>{{"list", "[1, [2]]"}, {"s", "\"v\""}});

  const auto error_of = [](std::string_view text, auto&& read) -> std::string {
    try {
      json::reader reader(text, "doc");
      read(reader);
    } catch (const efim::error& e) {
      return e.what();
    }
    return "";
  };
  CHECK_THAT(error_of("1.5", [](auto& rd) { rd.integer(); }), Catch::Contains("expected an integer"));
  CHECK_THAT(error_of("99999999999999999999", [](auto& rd) { rd.integer(); }), Catch::Contains("out of range"));
  CHECK_THAT(error_of("\"\\ud800\"", [](auto& rd) { std::string s; rd.string(s); }), Catch::Contains("lone surrogate"));
  CHECK_THAT(error_of("\"a\xFF\"", [](auto& rd) { std::string s; rd.string(s); }), Catch::Contains("not valid UTF-8"));
  CHECK_THAT(error_of("[1,]", [](auto& rd) { rd.skip(); }), Catch::Contains("trailing ','"));
  CHECK_THAT(error_of("{} x", [](auto& rd) { rd.skip(); rd.finish(); }), Catch::Contains("text after the document"));
  CHECK_THAT(error_of("{\"a\" 1}", [](auto& rd) { rd.skip(); }), Catch::Contains("doc: expected ':' (at byte 5)"));
  // Deep nesting is an error, not a stack overflow.
  CHECK_THAT(error_of(std::string(100000, '['), [](auto& rd) { rd.skip(); }), Catch::Contains("nested too deep"));
}
