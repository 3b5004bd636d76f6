#pragma once
// Counters, gauges and histograms in the Prometheus text exposition format (version 0.0.4).
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace efim::server {

using labels = std::vector<std::pair<std::string, std::string>>;

namespace detail {
// A label value with \, " and newline escaped, as the format asks.
inline std::string escape_label(std::string_view v) {
  std::string out;
  for (const char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

inline std::string render_labels(const labels& l, std::string_view extra_name = {}, std::string_view extra_value = {}) {
  if (l.empty() && extra_name.empty()) return {};
  std::string out = "{";
  for (const auto& [k, v] : l) {
    if (out.size() > 1) out += ',';
    out += k + "=\"" + escape_label(v) + "\"";
  }
  if (!extra_name.empty()) {
    if (out.size() > 1) out += ',';
    out += std::string(extra_name) + "=\"" + std::string(extra_value) + "\"";
  }
  return out + "}";
}

inline std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.15g", v);  // exact for counts; bucket bounds as written (0.005)
  return buf;
}
}  // namespace detail

// Every metric of a registry, by name; each holds series by label set. Thread-safe.
class metrics_registry {
 public:
  // Latency buckets in seconds, from a keystroke's few milliseconds to long generations.
  static constexpr std::array<double, 14> seconds_buckets{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                          1,     2.5,  5,     10,   30,  60,   120};

  void describe(const std::string& name, std::string type, std::string help) {
    std::lock_guard lock(mutex_);
    auto& m = metrics_[name];
    m.type = std::move(type);
    m.help = std::move(help);
  }

  void add(const std::string& name, const labels& l, double v = 1) {
    std::lock_guard lock(mutex_);
    metrics_[name].values[l] += v;
  }

  void set(const std::string& name, const labels& l, double v) {
    std::lock_guard lock(mutex_);
    metrics_[name].values[l] = v;
  }

  void observe(const std::string& name, const labels& l, double v) {
    std::lock_guard lock(mutex_);
    auto& h = metrics_[name].histograms[l];
    for (std::size_t i = 0; i < seconds_buckets.size(); ++i)
      if (v <= seconds_buckets[i]) ++h.buckets[i];
    ++h.count;
    h.sum += v;
  }

  // The value of a counter or gauge series (0 if it has none).
  [[nodiscard]] double value(const std::string& name, const labels& l = {}) const {
    std::lock_guard lock(mutex_);
    const auto m = metrics_.find(name);
    if (m == metrics_.end()) return 0;
    const auto v = m->second.values.find(l);
    return v == m->second.values.end() ? 0 : v->second;
  }

  // The sum of a counter over all its series.
  [[nodiscard]] double total(const std::string& name) const {
    std::lock_guard lock(mutex_);
    double sum = 0;
    if (const auto m = metrics_.find(name); m != metrics_.end())
      for (const auto& [l, v] : m->second.values) sum += v;
    return sum;
  }

  [[nodiscard]] std::string render() const {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& [name, m] : metrics_) {
      out += "# HELP " + name + " " + m.help + "\n# TYPE " + name + " " + m.type + "\n";
      for (const auto& [l, v] : m.values) out += name + detail::render_labels(l) + " " + detail::number(v) + "\n";
      for (const auto& [l, h] : m.histograms) {
        for (std::size_t i = 0; i < seconds_buckets.size(); ++i)
          out += name + "_bucket" + detail::render_labels(l, "le", detail::number(seconds_buckets[i])) + " " +
                 std::to_string(h.buckets[i]) + "\n";
        out += name + "_bucket" + detail::render_labels(l, "le", "+Inf") + " " + std::to_string(h.count) + "\n";
        out += name + "_sum" + detail::render_labels(l) + " " + detail::number(h.sum) + "\n";
        out += name + "_count" + detail::render_labels(l) + " " + std::to_string(h.count) + "\n";
      }
    }
    return out;
  }

 private:
  struct histogram {
    std::array<std::uint64_t, seconds_buckets.size()> buckets{};  // cumulative: observations <= each bound
    std::uint64_t count = 0;
    double sum = 0;
  };
  struct metric {
    std::string type = "counter", help;
    std::map<labels, double> values;
    std::map<labels, histogram> histograms;
  };

  mutable std::mutex mutex_;
  std::map<std::string, metric> metrics_;
};

}  // namespace efim::server
