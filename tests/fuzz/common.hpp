#pragma once
// What the libFuzzer targets share: the input as bytes, a fault report that stops the run (libFuzzer
// then saves the input), and the real vocabularies (tests/vocab.hpp: the shared data, or .ci/setup's
// copies in .cache/vocab).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "../vocab.hpp"
#include "efim/text/bpe_tokenizer.hpp"

namespace efim_fuzz {

inline std::span<const std::byte> bytes(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}
inline std::string_view text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A broken promise of the library: printed, then abort() (libFuzzer keeps the input that did it).
[[noreturn]] inline void fault(const std::string& what) {
  std::fprintf(stderr, "fuzz: fault: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}
inline void check(bool ok, const char* what) {
  if (!ok) fault(what);
}

// A vocabulary the target needs; a clear message and exit 2 where it is not there.
inline std::string vocab_path(const char* name) {
  const auto path = efim_test::vocab_dir() / name;
  if (!std::filesystem::exists(path)) {
    std::fprintf(stderr, "fuzz: no %s (the shared data, or run .ci/setup)\n", path.c_str());
    std::exit(2);
  }
  return path.string();
}

// The text an encoding must give back: `s`, normalized where the tokenizer normalizes, less the
// bytes it has no token for (left out, as Hugging Face leaves them out).
inline std::string expected_text(const efim::text::bpe_tokenizer& tok, std::string_view s) {
  const std::string norm = tok.normalizes() ? efim::text::nfc(s) : std::string(s);
  std::string out;
  for (const char c : norm)
    if (tok.has_byte(static_cast<unsigned char>(c))) out += c;
  return out;
}

}  // namespace efim_fuzz
