#pragma once
// Compact tables a tokenizer is built from: strings in one buffer, an index from a string to its
// id, the merge table of a BPE vocabulary, and a per-thread cache of recent words. Each is one or two flat arrays, so a vocabulary of
// 150,000 tokens loads without a heap string or a hash node per token.
#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/cache/xxhash.hpp"
#include "efim/core/error.hpp"
#include "efim/core/types.hpp"

namespace efim::text {

// Strings by index, all in one buffer. An index can be set out of order (a tokenizer.json lists
// its vocabulary as an object); indices never set read as "".
class string_table {
 public:
  void reserve(std::size_t count, std::size_t bytes) {
    spans_.reserve(count);
    data_.reserve(bytes);
  }
  void push_back(std::string_view s) {
    spans_.push_back(append(s));
  }
  void set(std::size_t index, std::string_view s) {
    if (index >= spans_.size()) spans_.resize(index + 1);
    spans_[index] = append(s);
  }
  // Appends the bytes `write(data)` adds to the buffer as the next string.
  template <class Write>
  void push_back_with(Write&& write) {
    const std::size_t begin = data_.size();
    write(data_);
    require(data_.size() <= std::numeric_limits<std::uint32_t>::max(), errc::invalid_argument,
            "string_table: more than 4 GiB of strings");
    spans_.push_back({static_cast<std::uint32_t>(begin), static_cast<std::uint32_t>(data_.size() - begin)});
  }
  [[nodiscard]] std::string_view operator[](std::size_t index) const noexcept {
    const span s = spans_[index];
    return {data_.data() + s.begin, s.size};
  }
  [[nodiscard]] std::size_t size() const noexcept { return spans_.size(); }
  [[nodiscard]] bool empty() const noexcept { return spans_.empty(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return data_.size(); }

 private:
  struct span {
    std::uint32_t begin = 0, size = 0;
  };
  span append(std::string_view s) {
    require(data_.size() + s.size() <= std::numeric_limits<std::uint32_t>::max(), errc::invalid_argument,
            "string_table: more than 4 GiB of strings");
    const span out{static_cast<std::uint32_t>(data_.size()), static_cast<std::uint32_t>(s.size())};
    data_.append(s);
    return out;
  }
  std::string data_;
  std::vector<span> spans_;
};

// Open addressing with linear probing over a power-of-two number of slots, at most half full.
inline std::size_t table_slots(std::size_t entries) {
  return std::bit_ceil(std::max<std::size_t>(16, entries * 2));
}

// From strings to ids, over a string_table the index does not own: insert keeps the first id of a
// string, find returns it or -1. Each slot keeps 32 bits of its string's hash, so that a probe reads
// the string only where those agree. Loaders that look up many strings hash and prefetch a batch
// before they find it (a vocabulary's index is larger than the caches).
class string_index {
 public:
  string_index() = default;
  explicit string_index(std::size_t entries) : slots_(table_slots(entries)), mask_(slots_.size() - 1) {}

  static std::uint64_t hash(std::string_view s) noexcept { return XXH3_64bits(s.data(), s.size()); }
  void prefetch(std::uint64_t h) const noexcept { __builtin_prefetch(slots_.data() + (h & mask_)); }

  // Adds table[id] for `id`, unless the string is there already (false).
  // `h` is hash(table[id]).
  bool insert(const string_table& table, token_id id, std::uint64_t h) {
    require(2 * (size_ + 1) <= slots_.size(), errc::invalid_argument, "string_index: more strings than it was made for");
    const std::string_view s = table[static_cast<std::size_t>(id)];
    const auto tag = static_cast<std::uint32_t>(h >> 32);
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].id1 == 0) {
        slots_[i] = {static_cast<std::uint32_t>(id) + 1, tag};
        ++size_;
        return true;
      }
      if (slots_[i].tag == tag && table[slots_[i].id1 - 1] == s) return false;
    }
  }
  [[nodiscard]] token_id find(const string_table& table, std::string_view s, std::uint64_t h) const noexcept {
    if (slots_.empty()) return -1;
    const auto tag = static_cast<std::uint32_t>(h >> 32);
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      const slot v = slots_[i];
      if (v.id1 == 0) return -1;
      if (v.tag == tag && table[v.id1 - 1] == s) return static_cast<token_id>(v.id1 - 1);
    }
  }
  [[nodiscard]] token_id find(const string_table& table, std::string_view s) const noexcept {
    return find(table, s, hash(s));
  }

 private:
  struct slot {
    std::uint32_t id1 = 0;  // id + 1, 0 for empty
    std::uint32_t tag = 0;  // the hash's upper half
  };
  std::vector<slot> slots_;
  std::size_t mask_ = 0, size_ = 0;
};

// The merges of a BPE vocabulary: (left id, right id) -> (rank, merged id).
class merge_table {
 public:
  struct merge {
    std::uint32_t rank;
    token_id id;
  };
  merge_table() = default;
  explicit merge_table(std::size_t entries) : slots_(table_slots(entries)), mask_(slots_.size() - 1) {
    shift_ = 64 - std::countr_zero(slots_.size());
  }

  void prefetch(token_id left, token_id right) const noexcept {
    __builtin_prefetch(slots_.data() + slot_of(key(left, right)));
  }

  // Adds a merge unless the pair has one already (the lower rank stays).
  void insert(token_id left, token_id right, merge m) {
    require(2 * (size_ + 1) <= slots_.size(), errc::invalid_argument, "merge_table: more merges than it was made for");
    const std::uint64_t k = key(left, right);
    for (std::size_t i = slot_of(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == empty) {
        slots_[i] = {k, m};
        ++size_;
        return;
      }
      if (slots_[i].key == k) return;
    }
  }
  [[nodiscard]] const merge* find(token_id left, token_id right) const noexcept {
    const std::uint64_t k = key(left, right);
    for (std::size_t i = slot_of(k);; i = (i + 1) & mask_) {
      const slot& s = slots_[i];
      if (s.key == k) return &s.value;
      if (s.key == empty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t empty = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::uint64_t key(token_id a, token_id b) noexcept {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  [[nodiscard]] std::size_t slot_of(std::uint64_t k) const noexcept {
    return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }
  struct slot {
    std::uint64_t key = empty;
    merge value{};
  };
  std::vector<slot> slots_{1};  // one empty slot: find on an empty table returns null
  std::size_t mask_ = 0, size_ = 0;
  int shift_ = 63;
};

// Recent words and their ids, one table per thread (no locks, nothing shared between threads):
// direct-mapped by the word's hash, each entry marked with the serial number of the tokenizer that
// wrote it, so that tokenizers never read each other's entries. Words of up to 23 bytes that make
// up to 7 tokens are kept.
class word_cache {
 public:
  static constexpr std::size_t slots = 4096, max_word = 23, max_ids = 7;

  // A serial number for a new tokenizer (never 0).
  static std::uint64_t next_serial() noexcept {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  // This thread's cache.
  static word_cache& mine() {
    thread_local const std::unique_ptr<word_cache> cache = std::make_unique<word_cache>();
    return *cache;
  }

  // Appends the ids kept for `word` (of at most max_word bytes) to `out`; false if there are none.
  bool find(std::uint64_t serial, std::string_view word, std::uint64_t h, std::vector<token_id>& out) const {
    const entry& e = entries_[h & (slots - 1)];
    if (e.serial != serial || e.hash != h || e.word_size != word.size() ||
        std::memcmp(e.word, word.data(), word.size()) != 0)
      return false;
    out.insert(out.end(), e.ids, e.ids + e.id_count);
    return true;
  }
  void store(std::uint64_t serial, std::string_view word, std::uint64_t h, std::span<const token_id> ids) {
    if (word.size() > max_word || ids.size() > max_ids) return;
    entry& e = entries_[h & (slots - 1)];
    e.serial = serial;
    e.hash = h;
    e.word_size = static_cast<std::uint8_t>(word.size());
    e.id_count = static_cast<std::uint8_t>(ids.size());
    std::memcpy(e.word, word.data(), word.size());
    std::copy(ids.begin(), ids.end(), e.ids);
  }

 private:
  struct entry {
    std::uint64_t serial = 0;  // 0: empty
    std::uint64_t hash = 0;
    std::uint8_t word_size = 0, id_count = 0;
    char word[max_word] = {};
    token_id ids[max_ids] = {};
  };
  std::array<entry, slots> entries_{};
};

}  // namespace efim::text
