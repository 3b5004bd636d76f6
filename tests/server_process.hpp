#pragma once
// Programs run as processes for the tests. efim-server: started on an ephemeral port, found by the
// address it prints, stopped by a signal; its stderr (one line per request) goes to a file the tests
// can read.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace efim_test {

// A loopback TCP port free now (for a program the test starts).
inline std::string free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  if (!ok) throw std::runtime_error("no free loopback port");
  return std::to_string(ntohs(a.sin_port));
}

// A program run in the background: stdout on a pipe the caller may read, stderr to a log file.
class process {
 public:
  process(std::vector<std::string> args, std::string log_path) : log_path_(std::move(log_path)) {
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      const int err = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (err >= 0) dup2(err, STDERR_FILENO);
      close(out[0]);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
  }

  process(const process&) = delete;
  process& operator=(const process&) = delete;
  ~process() {
    if (pid_ > 0) stop(SIGKILL);
    if (out_ >= 0) close(out_);
  }

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] int stdout_fd() const noexcept { return out_; }

  // Whether it is still running.
  [[nodiscard]] bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
    pid_ = 0;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return false;
  }

  // Sends `sig` and waits (at most `timeout`) for the process to end; its exit code, -1 if it had to
  // be killed or died of a signal.
  int stop(int sig = SIGTERM, std::chrono::seconds timeout = std::chrono::seconds(60)) {
    if (pid_ <= 0) return exit_code_;
    kill(pid_, sig);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        pid_ = 0;
        return exit_code_ = -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = 0;
    return exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // What it wrote on stderr so far.
  [[nodiscard]] std::string log() const {
    std::ifstream in(log_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::string log_path_;
  pid_t pid_ = -1;
  int out_ = -1;
  int exit_code_ = -1;
};

class server_process {
 public:
  // Runs `program args... --port 0` and waits until it prints the address it listens on.
  server_process(const std::string& program, std::vector<std::string> args, std::string log_path)
      : p_(with_port(program, std::move(args)), std::move(log_path)) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
    while (line.find('\n') == std::string::npos) {
      pollfd p{p_.stdout_fd(), POLLIN, 0};
      if (std::chrono::steady_clock::now() > deadline || poll(&p, 1, 1000) < 0) break;
      if (p.revents == 0) continue;
      char buf[256];
      const ssize_t n = read(p_.stdout_fd(), buf, sizeof buf);
      if (n <= 0) break;
      line.append(buf, static_cast<std::size_t>(n));
    }
    const std::string marker = "listening on ";
    const auto at = line.find(marker);
    if (at == std::string::npos) {
      p_.stop(SIGKILL);
      throw std::runtime_error("efim-server did not start: " + line + log());
    }
    url_ = line.substr(at + marker.size(), line.find('\n', at) - at - marker.size());
    port_ = url_.substr(url_.rfind(':') + 1);
  }

  [[nodiscard]] const std::string& url() const noexcept { return url_; }
  [[nodiscard]] const std::string& port() const noexcept { return port_; }
  [[nodiscard]] pid_t pid() const noexcept { return p_.pid(); }
  int stop(int sig = SIGTERM, std::chrono::seconds timeout = std::chrono::seconds(60)) { return p_.stop(sig, timeout); }
  [[nodiscard]] std::string log() const { return p_.log(); }

 private:
  static std::vector<std::string> with_port(const std::string& program, std::vector<std::string> args) {
    args.insert(args.begin(), program);
    args.push_back("--port");
    args.push_back("0");
    return args;
  }

  process p_;
  std::string url_, port_;
};

}  // namespace efim_test
