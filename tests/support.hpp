#pragma once
// Helpers the test and benchmark programs share: running a program as a process, and comparing logits.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <stdexcept>
#include <string>

namespace efim_test {

struct run_result {
  int exit_code;       // -1 when the program could not be started or did not exit normally
  std::string output;  // stdout and stderr
};

// Runs `command` through the shell, stderr merged into the output.
inline run_result run_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "cannot run " + command};
  std::string out;
  char buf[1 << 16];
  for (std::size_t n; (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// max |got - want| over max |want| (the plain difference when `want` is all zeros).
inline float max_relative_error(std::span<const float> got, std::span<const float> want) {
  if (got.size() != want.size()) throw std::invalid_argument("max_relative_error: sizes differ");
  float scale = 0.0f, err = 0.0f;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  return scale == 0.0f ? err : err / scale;
}

}  // namespace efim_test
