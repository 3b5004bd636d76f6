#pragma once
// Server-sent events (text/event-stream), read as their bytes arrive.
#include <cstddef>
#include <string>
#include <string_view>

#include "efim/core/error.hpp"

namespace efim::server {

// Server-sent events, read as they arrive: each event's data (its "data:" lines joined by newlines).
class sse_reader {
 public:
  template <class F>
  void feed(std::string_view bytes, F&& on_data) {
    buffer_ += bytes;
    std::size_t start = 0;
    for (;;) {
      const std::size_t nl = buffer_.find('\n', start);
      if (nl == std::string::npos) break;
      std::string_view line(buffer_.data() + start, nl - start);
      start = nl + 1;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) {  // the end of an event
        if (has_data_) on_data(std::string_view(data_));
        data_.clear();
        has_data_ = false;
      } else if (line.starts_with("data:")) {
        line.remove_prefix(5);
        if (line.starts_with(' ')) line.remove_prefix(1);
        if (has_data_) data_ += '\n';
        data_ += line;
        has_data_ = true;
      }  // comments (":"), "event:", "id:", "retry:" say nothing efim reads
    }
    buffer_.erase(0, start);
    require(buffer_.size() <= max_line, errc::upstream, "a server-sent event line longer than 16 MiB");
  }

 private:
  static constexpr std::size_t max_line = 16u << 20;
  std::string buffer_, data_;
  bool has_data_ = false;
};

}  // namespace efim::server
