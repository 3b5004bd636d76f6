#pragma once
// Command-line handling shared by the example programs that take subcommands.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "efim/core/error.hpp"

namespace efim_examples {

// Prints "program: message" and exits: 2 for bad use, 1 for bad input.
[[noreturn]] inline void fail(std::string_view program, const std::string& message, int code = 2) {
  std::cerr << program << ": " << message << "\n";
  std::exit(code);
}

inline double number(std::string_view program, std::string_view flag, const std::string& text) {
  try {
    std::size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  fail(program, std::string(flag) + " needs a number, not '" + text + "'");
}

inline std::size_t count(std::string_view program, std::string_view flag, const std::string& text) {
  const double v = number(program, flag, text);
  if (!(v >= 0 && v <= 9007199254740992.0 && v == static_cast<double>(static_cast<std::uint64_t>(v))))
    fail(program, std::string(flag) + " needs a whole number, not '" + text + "'");
  return static_cast<std::size_t>(v);
}

// Walks the options of a program that takes `--flag value` pairs: --help or -h prints the usage and
// exits 0; a flag named in `switches` takes no value and goes to on_switch(flag); any other needs a
// value and goes to on_value(flag, value), which refuses the flags it does not know.
template <class OnSwitch, class OnValue>
void for_each_flag(int argc, char** argv, std::string_view program, const char* usage,
                   std::initializer_list<std::string_view> switches, OnSwitch&& on_switch, OnValue&& on_value) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << usage;
      std::exit(0);
    }
    if (std::find(switches.begin(), switches.end(), flag) != switches.end()) {
      on_switch(flag);
      continue;
    }
    if (i + 1 >= argc) fail(program, "unknown option or missing value: " + flag + " (see --help)");
    on_value(flag, std::string(argv[++i]));
  }
}

// Runs `command(name)` for `program COMMAND [args]`: no arguments or --help anywhere prints the usage,
// an efim::error (bad input) exits with 1 and its message.
template <class Command>
int run_command(int argc, char** argv, std::string_view program, const char* usage, Command&& command) {
  if (argc < 2) {
    std::cout << usage;
    return 2;
  }
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::cout << usage;
      return 0;
    }
  try {
    return command(std::string_view(argv[1]));
  } catch (const efim::error& e) {
    fail(program, e.what(), 1);
  } catch (const std::exception& e) {  // out of memory, say: still a message, not an abort
    fail(program, e.what(), 1);
  }
}

}  // namespace efim_examples
