#pragma once
// cache::redis_tier: the shared KV tier (cache::remote_tier) in Redis or Valkey, through hiredis
// (Debian's libhiredis-dev). Only programs that link hiredis include this header; the rest of the
// library knows the tier by its concept alone.
//
// - fetch(): one MGET for a whole chain of keys, on one connection kept open, bounded by a budget in
//   milliseconds (connecting included). A store that is down, refuses, answers garbage or takes
//   longer costs at most the budget and answers "not there" for every key; after an error the store
//   is left alone for `retry` (each fetch then answers at once), then tried again.
// - store() and put(): queued for a writer thread of its own with its own connection, which writes
//   what waits in pipelined SETs, in order; a queue over `queue_bytes` drops what comes (counted). A
//   key store()d is written once (remembered until the store is seen to fail, when it may have lost
//   what it held); put() always writes (a value that replaces the last).
// - A store that closes a connection while efim writes to it never raises SIGPIPE in the program:
//   hiredis writes with write(2), so the tier blocks SIGPIPE on its writer thread and, around a
//   fetch, on the caller's thread (a SIGPIPE the fetch caused is taken back before it returns).
// - The store is expected to evict by itself (maxmemory with allkeys-lru): efim never deletes.
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <cerrno>
#include <ctime>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "efim/cache/remote.hpp"
#include "efim/core/error.hpp"

namespace efim::cache {

struct redis_options {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::chrono::milliseconds budget{50};              // longest a fetch takes, connecting included
  std::chrono::milliseconds retry{1000};             // after an error, how long the store is left alone
  std::size_t queue_bytes = std::size_t{256} << 20;  // values waiting to be written, at most
  std::size_t remembered = std::size_t{1} << 20;     // keys remembered as written
};

// redis://HOST[:PORT][/DB] (port 6379, db 0 when left out).
inline redis_options parse_redis_url(std::string_view url, redis_options o = {}) {
  const auto bad = [&](const std::string& why) {
    return error(errc::invalid_argument, "kv store " + std::string(url) + ": " + why + " (redis://HOST[:PORT][/DB])");
  };
  constexpr std::string_view scheme = "redis://";
  if (!url.starts_with(scheme)) throw bad("not a redis:// address");
  std::string_view rest = url.substr(scheme.size());
  const auto number = [&](std::string_view s, int most, const char* what) {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string_view::npos)
      throw bad(std::string("bad ") + what);
    const int n = std::stoi(std::string(s));
    if (n > most) throw bad(std::string("bad ") + what);
    return n;
  };
  if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    o.db = number(rest.substr(slash + 1), 1 << 20, "database number");
    rest = rest.substr(0, slash);
  } else {
    o.db = 0;
  }
  o.port = 6379;
  if (const auto colon = rest.rfind(':'); colon != std::string_view::npos && rest.find(']') == std::string_view::npos) {
    o.port = number(rest.substr(colon + 1), 65535, "port");
    if (o.port == 0) throw bad("bad port");
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) throw bad("no host");
  o.host = std::string(rest);
  return o;
}

// What the tier did, for /metrics.
struct remote_stats {
  std::uint64_t fetches = 0;     // fetch() calls that asked the store
  std::uint64_t keys = 0;        // keys asked for
  std::uint64_t found = 0;       // values the store had
  std::uint64_t read_bytes = 0;  // bytes of those values
  std::uint64_t fetch_us = 0;    // time in fetches, microseconds
  std::uint64_t skipped = 0;     // fetch() calls answered at once while the store is left alone
  std::uint64_t errors = 0;      // connections or commands that failed (timeouts included)
  std::uint64_t timeouts = 0;    // of which: the budget ran out
  std::uint64_t written = 0;     // values written
  std::uint64_t written_bytes = 0;
  std::uint64_t dropped = 0;  // values not written: the queue was full, or the store failed
};

class redis_tier {
 public:
  explicit redis_tier(redis_options o) : o_(std::move(o)) {
    require(o_.budget.count() > 0 && o_.retry.count() >= 0, errc::invalid_argument,
            "kv store: the budget must be positive");
    writer_ = std::thread([this] {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &pipe, nullptr);  // a SIGPIPE of this thread's writes stays pending, unseen
      write_loop();
    });
  }

  redis_tier(const redis_tier&) = delete;
  redis_tier& operator=(const redis_tier&) = delete;

  ~redis_tier() {
    {
      std::lock_guard lock(queue_m_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    writer_.join();
  }

  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys) {
    std::vector<std::optional<std::string>> out(keys.size());
    if (keys.empty()) return out;
    std::lock_guard lock(read_m_);
    const auto start = clock::now();
    const auto found_before = stats_.found;
    const auto bytes_before = stats_.read_bytes;
    if (start < read_.resume_at) {
      ++stats_.skipped;
      return out;
    }
    const no_sigpipe guard;  // (a skipped fetch writes nothing: no signal mask to change)
    const auto deadline = start + o_.budget;
    bool ok = false, timed_out = false;
    // A connection kept from an earlier fetch may have been closed by a store that restarted since:
    // then one new connection, within the same budget.
    for (bool reused = read_.c != nullptr;; reused = false) {
      timed_out = false;
      if (!connect(read_, deadline, timed_out)) break;
      std::vector<const char*> argv{"MGET"};
      std::vector<std::size_t> lens{4};
      for (const auto& k : keys) {
        argv.push_back(k.data());
        lens.push_back(k.size());
      }
      ok = set_timeout(read_, deadline) &&
           redisAppendCommandArgv(read_.c.get(), static_cast<int>(argv.size()), argv.data(), lens.data()) == REDIS_OK;
      redisReply* raw = nullptr;
      ok = ok && redisGetReply(read_.c.get(), reinterpret_cast<void**>(&raw)) == REDIS_OK && raw != nullptr;
      const reply r(raw);
      ok = ok && r->type == REDIS_REPLY_ARRAY && r->elements == keys.size();
      if (ok) {
        for (std::size_t i = 0; i < keys.size(); ++i) {
          const redisReply* e = r->element[i];
          if (e->type == REDIS_REPLY_STRING) {
            out[i] = std::string(e->str, e->len);
            ++stats_.found;
            stats_.read_bytes += e->len;
          } else if (e->type != REDIS_REPLY_NIL) {
            ok = false;
          }
        }
      }
      if (ok) break;
      timed_out = read_.c->err == REDIS_ERR_IO && clock::now() >= deadline;
      if (!reused || !lost(*read_.c) || clock::now() >= deadline) break;
      read_.c.reset();
    }
    const auto spent = std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - start);
    ++stats_.fetches;
    stats_.keys += keys.size();
    stats_.fetch_us += static_cast<std::uint64_t>(spent.count());
    if (!ok) {  // nothing of a failed answer counts
      std::fill(out.begin(), out.end(), std::nullopt);
      stats_.found = found_before;
      stats_.read_bytes = bytes_before;
      failed(read_, timed_out);
    }
    return out;
  }

  void store(std::string key, std::string value) { queue(std::move(key), std::move(value), true); }
  void put(std::string key, std::string value) { queue(std::move(key), std::move(value), false); }

  // Waits until every value queued so far is written or dropped (tests, a clean shutdown).
  void flush() {
    std::unique_lock lock(queue_m_);
    queue_cv_.wait(lock, [&] { return (queue_.empty() && !writing_) || stopping_; });
  }

  [[nodiscard]] remote_stats stats() const {
    remote_stats s;
    {
      std::lock_guard lock(read_m_);
      s = stats_;
    }
    std::lock_guard lock(queue_m_);
    s.written = written_count_;
    s.written_bytes = written_bytes_;
    s.dropped = dropped_;
    s.errors += write_errors_;
    return s;
  }

  [[nodiscard]] const redis_options& options() const noexcept { return o_; }

 private:
  using clock = std::chrono::steady_clock;

  struct context_free {
    void operator()(redisContext* c) const noexcept { redisFree(c); }
  };
  struct reply_free {
    void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
  };
  using reply = std::unique_ptr<redisReply, reply_free>;

  // SIGPIPE blocked on this thread while it lives; one raised meanwhile (and not pending before) is
  // taken back before the mask is restored.
  class no_sigpipe {
   public:
    no_sigpipe() {
      sigemptyset(&pipe_);
      sigaddset(&pipe_, SIGPIPE);
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      was_pending_ = sigismember(&pending, SIGPIPE) == 1;
      blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
    }
    no_sigpipe(const no_sigpipe&) = delete;
    no_sigpipe& operator=(const no_sigpipe&) = delete;
    ~no_sigpipe() {
      if (!blocked_) return;
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
        const int saved = errno;
        const timespec none{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &none) == -1 && errno == EINTR) {
        }
        errno = saved;
      }
      pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }

   private:
    sigset_t pipe_{}, old_{};
    bool was_pending_ = false, blocked_ = false;
  };

  struct link {
    std::unique_ptr<redisContext, context_free> c;
    clock::time_point resume_at{};
  };

  static timeval to_timeval(clock::duration d) {
    const auto us = std::max<std::int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(d).count(), 1000);
    return timeval{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  }

  // Whether a command failed on the connection (closed by the store, reset), not by an answer.
  static bool lost(const redisContext& c) { return c.err == REDIS_ERR_EOF || c.err == REDIS_ERR_IO; }

  static bool set_timeout(link& l, clock::time_point deadline) {
    const auto left = deadline - clock::now();
    return left > clock::duration::zero() && redisSetTimeout(l.c.get(), to_timeval(left)) == REDIS_OK;
  }

  // An open connection on `l` (and the database selected), made before `deadline`.
  bool connect(link& l, clock::time_point deadline, bool& timed_out) {
    if (l.c) return true;
    const auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) {
      timed_out = true;
      return false;
    }
    l.c.reset(redisConnectWithTimeout(o_.host.c_str(), o_.port, to_timeval(left)));
    if (!l.c || l.c->err != 0) {
      timed_out = l.c && clock::now() >= deadline;
      l.c.reset();
      return false;
    }
    if (o_.db != 0) {
      if (!set_timeout(l, deadline)) {
        timed_out = true;
        l.c.reset();
        return false;
      }
      const reply r(static_cast<redisReply*>(redisCommand(l.c.get(), "SELECT %d", o_.db)));
      if (!r || r->type != REDIS_REPLY_STATUS) {
        l.c.reset();
        return false;
      }
    }
    return true;
  }

  // A value for the writer; `once`: skipped if the key was written (or queued) before.
  void queue(std::string key, std::string value, bool once) {
    const std::size_t bytes = key.size() + value.size();
    {
      std::lock_guard lock(queue_m_);
      if (once && written_.contains(key)) return;
      if (queued_bytes_ + bytes > o_.queue_bytes) {
        ++dropped_;
        return;
      }
      if (once) {
        if (written_.size() >= o_.remembered) written_.clear();
        written_.insert(key);
      }
      queued_bytes_ += bytes;
      queue_.emplace_back(std::move(key), std::move(value));
    }
    queue_cv_.notify_one();
  }

  // The connection is in an unknown state: closed, and the store left alone for a while.
  void failed(link& l, bool timed_out) {
    l.c.reset();
    l.resume_at = clock::now() + o_.retry;
    ++stats_.errors;
    if (timed_out) ++stats_.timeouts;
  }

  void write_loop() {
    link l;
    for (;;) {
      std::vector<std::pair<std::string, std::string>> batch;
      {
        std::unique_lock lock(queue_m_);
        writing_ = false;
        queue_cv_.notify_all();  // flush() waits for this
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        std::size_t bytes = 0;
        while (!queue_.empty() && (batch.empty() || bytes < (std::size_t{8} << 20))) {
          bytes += queue_.front().first.size() + queue_.front().second.size();
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        queued_bytes_ -= bytes;
        writing_ = true;
      }
      const bool ok = write(l, batch);
      std::lock_guard lock(queue_m_);
      if (ok) {
        written_count_ += batch.size();
        for (const auto& [k, v] : batch) written_bytes_ += v.size();
      } else {
        dropped_ += batch.size();
        written_.clear();  // the store may have lost what it held: write again what comes
      }
    }
  }

  // Writes a batch in one pipeline; false if any of it failed (the connection is then dropped, and
  // the store left alone for `retry`, its values dropped meanwhile).
  bool write(link& l, const std::vector<std::pair<std::string, std::string>>& batch) {
    if (clock::now() < l.resume_at) return false;
    const auto deadline = clock::now() + std::max<clock::duration>(o_.budget * 20, std::chrono::seconds(2));
    bool ok = false;
    // As in fetch(): a kept connection the store closed since is made again once (SET is idempotent).
    for (bool reused = l.c != nullptr;; reused = false) {
      bool timed_out = false;
      ok = connect(l, deadline, timed_out) && set_timeout(l, deadline);
      for (std::size_t i = 0; ok && i < batch.size(); ++i) {
        const char* argv[] = {"SET", batch[i].first.data(), batch[i].second.data()};
        const std::size_t lens[] = {3, batch[i].first.size(), batch[i].second.size()};
        ok = redisAppendCommandArgv(l.c.get(), 3, argv, lens) == REDIS_OK;
      }
      for (std::size_t i = 0; ok && i < batch.size(); ++i) {
        redisReply* raw = nullptr;
        ok = redisGetReply(l.c.get(), reinterpret_cast<void**>(&raw)) == REDIS_OK && raw != nullptr;
        const reply r(raw);
        ok = ok && r->type == REDIS_REPLY_STATUS;
      }
      if (ok || !reused || !l.c || !lost(*l.c) || clock::now() >= deadline) break;
      l.c.reset();
    }
    if (!ok) {
      l.c.reset();
      l.resume_at = clock::now() + o_.retry;
      std::lock_guard lock(queue_m_);
      ++write_errors_;
    }
    return ok;
  }

  redis_options o_;

  mutable std::mutex read_m_;
  link read_;
  remote_stats stats_;

  mutable std::mutex queue_m_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::string, std::string>> queue_;
  std::size_t queued_bytes_ = 0;
  std::unordered_set<std::string> written_;
  bool stopping_ = false;
  bool writing_ = false;
  std::uint64_t written_count_ = 0, written_bytes_ = 0, dropped_ = 0, write_errors_ = 0;
  std::thread writer_;
};

static_assert(remote_tier<redis_tier>);

}  // namespace efim::cache
