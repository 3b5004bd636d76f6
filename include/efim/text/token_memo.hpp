#pragma once
// A memo of recently tokenized pieces of text: an editor's requests repeat the same long pieces
// (the anchor's prefix and suffix, the context files) on every keystroke, so a server tokenizes
// each once. Pieces are verified byte for byte, so a hash collision cannot return another piece's ids.
// Thread-safe: requests are tokenized on the threads that prepare them.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "efim/core/types.hpp"
#include "efim/text/concepts.hpp"

namespace efim::text {

struct token_memo_options {
  std::size_t min_bytes = 256;        // shorter pieces are tokenized every time (cheaper than a lookup)
  std::size_t max_bytes = 64u << 20;  // text and ids kept, in bytes; least recently used go first
};

class token_memo {
 public:
  explicit token_memo(token_memo_options options = {}) : options_(options) {}

  // Appends the ids of `piece` to `out`: from the memo, or from `tok` (then remembered). Any thread:
  // the tokenizer runs without the memo's lock, so threads tokenize their own pieces at once.
  template <tokenizer T>
  void encode(const T& tok, std::string_view piece, std::vector<token_id>& out) {
    if (piece.size() < options_.min_bytes || piece.size() > options_.max_bytes / 2) {
      tok.encode(piece, out);
      return;
    }
    const std::size_t h = std::hash<std::string_view>{}(piece);
    {
      std::lock_guard lock(mutex_);
      if (const auto it = find(h, piece); it != order_.end()) {
        order_.splice(order_.begin(), order_, it);
        out.insert(out.end(), it->ids.begin(), it->ids.end());
        ++hits_;
        return;
      }
    }
    const std::size_t start = out.size();
    tok.encode(piece, out);
    std::lock_guard lock(mutex_);
    if (find(h, piece) != order_.end()) return;  // another thread remembered it meanwhile
    order_.push_front(
        {h, std::string(piece), std::vector<token_id>(out.begin() + static_cast<std::ptrdiff_t>(start), out.end())});
    index_.emplace(h, order_.begin());
    bytes_ += cost(order_.front());
    while (bytes_ > options_.max_bytes && !order_.empty()) drop_oldest();
  }

  [[nodiscard]] std::size_t hits() const {
    std::lock_guard lock(mutex_);
    return hits_;
  }
  [[nodiscard]] std::size_t entries() const {
    std::lock_guard lock(mutex_);
    return order_.size();
  }
  [[nodiscard]] std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    return bytes_;
  }

 private:
  struct item {
    std::size_t hash = 0;
    std::string text;
    std::vector<token_id> ids;
  };

  std::list<item>::iterator find(std::size_t h, std::string_view piece) {
    const auto [first, last] = index_.equal_range(h);
    for (auto it = first; it != last; ++it)
      if (it->second->text == piece) return it->second;
    return order_.end();
  }

  static std::size_t cost(const item& i) noexcept { return i.text.size() + i.ids.size() * sizeof(token_id); }

  void drop_oldest() {
    const auto last = std::prev(order_.end());
    const auto [first, end] = index_.equal_range(last->hash);
    for (auto it = first; it != end; ++it)
      if (it->second == last) {
        index_.erase(it);
        break;
      }
    bytes_ -= cost(*last);
    order_.erase(last);
  }

  token_memo_options options_;
  mutable std::mutex mutex_;
  std::list<item> order_;  // most recently used first
  std::unordered_multimap<std::size_t, std::list<item>::iterator> index_;
  std::size_t bytes_ = 0;
  std::size_t hits_ = 0;
};

}  // namespace efim::text
