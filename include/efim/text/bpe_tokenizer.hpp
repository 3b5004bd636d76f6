#pragma once
// Byte-level BPE tokenizers (GPT-2 style: Qwen2.5-Coder, StarCoder/StarCoder2, DeepSeek-Coder,
// Llama 3), loaded from a Hugging Face tokenizer.json or from the tokenizer.ggml.* metadata of a
// GGUF file, with Hugging Face's semantics: normalize (NFC where asked), pre-tokenize (split
// regexes), map bytes to the byte-level alphabet, merge by rank (lowest rank, then leftmost, first).
// Added tokens are found in the text first, as Hugging Face's AddedVocabulary finds them: `encode`
// finds the user-defined ones (not special), `encode_special` every added token.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/core/json_reader.hpp"
#include "efim/core/types.hpp"
#include "efim/core/utf8.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/pre_tokenizer.hpp"
#include "efim/text/tables.hpp"
#include "efim/text/unicode.hpp"

namespace efim::text {

// What a token is, as GGUF's token_type says (tokenizer.json: added tokens are `control` when
// marked special, `user_defined` otherwise; either way an added token written like a sentinel is
// `control`, see looks_like_control).
enum class token_kind : std::uint8_t { normal, control, user_defined, unused };

// How an added token is found in text, as Hugging Face's AddedToken says. GGUF keeps none of it:
// there all are false, and the token is matched in the text as given, as llama.cpp does.
struct added_token_options {
  bool lstrip = false;       // the match takes the white space before it
  bool rstrip = false;       // and the white space after it
  bool single_word = false;  // no match where a word character touches it
  bool normalized = false;   // matched in the normalized text (NFC), not in the text as given
};

// Added-token text written like a sentinel: <|...|>, or DeepSeek's <｜...｜>. Files mark FIM
// sentinels and chat markers "not special" (DeepSeek-Coder's <｜fim▁begin｜>, user-defined in its
// GGUF), and llama.cpp makes them control tokens all the same; so does efim, so that `encode` never
// turns text from a user into a sentinel.
inline bool looks_like_control(std::string_view t) noexcept {
  constexpr std::string_view open_wide = "<\xEF\xBD\x9C", close_wide = "\xEF\xBD\x9C>";
  return (t.size() >= 4 && t.starts_with("<|") && t.ends_with("|>")) ||
         (t.size() >= 8 && t.starts_with(open_wide) && t.ends_with(close_wide));
}

// Everything a byte-level BPE tokenizer is built from.
struct bpe_config {
  string_table tokens;            // by id: normal tokens in byte-level form, added tokens as text
  std::vector<token_kind> kinds;  // by id (empty: all normal)
  std::vector<std::pair<token_id, added_token_options>> added_options;  // added tokens not all false
  string_table merges;  // by rank, two entries each: the left token, then the right one (byte-level)
  pre_tokenizer pre;
  bool nfc = false;               // normalize to NFC first
  bool ignore_merges = false;     // a word that is a whole token is that token (Llama 3)
  bool add_prefix_space = false;  // ByteLevel's add_prefix_space
  bool word_cache = true;         // keep recent words' ids (per thread); off, every word is merged
  // A byte the vocabulary has no token for (StarCoder's has none for 0xF1, say) is left out of its
  // word before merging, as Hugging Face's BPE leaves out a character it lacks; with an unknown token
  // (tokenizer.json's model.unk_token) that token stands in its place, one per byte or, with
  // fuse_unknown, one per run of such bytes. Valid text is never refused for a gap.
  token_id unknown = -1;
  bool fuse_unknown = false;
  std::string description;
};

namespace byte_level {

// GPT-2's map from bytes to printable code points: printable Latin-1 bytes stand for themselves,
// the others take 256, 257, ... in byte order.
inline const std::array<char32_t, 256>& to_code_point() {
  static const auto table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

// Appends the bytes a byte-level token string stands for to `out`; false (and `out` as it was) if
// the string is not in the alphabet. The alphabet's code points are below 324: one or two bytes of
// UTF-8 each.
inline bool decode_into(std::string_view s, std::string& out) {
  static const auto from = [] {
    std::array<std::int16_t, 324> t{};
    t.fill(-1);
    const auto& to = to_code_point();
    for (unsigned b = 0; b < 256; ++b) t[to[b]] = static_cast<std::int16_t>(b);
    return t;
  }();
  const std::size_t size = out.size();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t pos = 0; pos < s.size();) {
    unsigned cp = p[pos];
    if (cp >= 0x80) {
      if (cp < 0xC2 || cp > 0xC5 || pos + 1 >= s.size() || (p[pos + 1] & 0xC0) != 0x80) {
        out.resize(size);
        return false;
      }
      cp = ((cp & 0x1Fu) << 6) | (p[pos + 1] & 0x3Fu);
      pos += 2;
    } else {
      ++pos;
    }
    if (cp >= from.size() || from[cp] < 0) {
      out.resize(size);
      return false;
    }
    out += static_cast<char>(from[cp]);
  }
  return true;
}

}  // namespace byte_level

class bpe_tokenizer {
 public:
  explicit bpe_tokenizer(bpe_config c)
      : pre_(std::move(c.pre)),
        nfc_(c.nfc),
        ignore_merges_(c.ignore_merges),
        add_prefix_space_(c.add_prefix_space),
        description_(std::move(c.description)),
        serial_(c.word_cache ? word_cache::next_serial() : 0),
        unknown_(c.unknown),
        fuse_unknown_(c.fuse_unknown) {
    const std::size_t n = c.tokens.size();
    require(n > 0 && n < (std::size_t{1} << 31), errc::invalid_argument,
            "bpe_tokenizer: the vocabulary is empty or too large");
    require(unknown_ < static_cast<token_id>(n), errc::invalid_argument,
            "bpe_tokenizer: the unknown token " + std::to_string(unknown_) + " is not in the vocabulary");
    require(c.kinds.empty() || c.kinds.size() == n, errc::invalid_argument,
            "bpe_tokenizer: " + std::to_string(c.kinds.size()) + " token kinds for " + std::to_string(n) + " tokens");
    kinds_ = c.kinds.empty() ? std::vector<token_kind>(n, token_kind::normal) : std::move(c.kinds);
    // Normal tokens as the bytes they stand for, indexed by those bytes (a normal token outside the
    // byte-level alphabet keeps its text and is never found: no merge of bytes can make it).
    bytes_.reserve(n, c.tokens.bytes());
    index_ = string_index(n);
    byte_id_.fill(-1);
    std::vector<token_id> indexed;  // the normal tokens in the alphabet
    indexed.reserve(n);
    for (std::size_t id = 0; id < n; ++id) {
      const auto tid = static_cast<token_id>(id);
      const std::string_view text = c.tokens[id];
      if (kinds_[id] == token_kind::normal) {
        bool decoded = false;
        bytes_.push_back_with([&](std::string& out) {
          decoded = byte_level::decode_into(text, out);
          if (!decoded) out += text;
        });
        if (!decoded) continue;
        indexed.push_back(tid);
        const std::string_view b = bytes_[id];
        if (b.size() == 1 && byte_id_[static_cast<unsigned char>(b[0])] < 0)
          byte_id_[static_cast<unsigned char>(b[0])] = tid;
      } else {
        bytes_.push_back(text);
        if (kinds_[id] != token_kind::unused && !text.empty()) specials_.try_emplace(std::string(text), tid);
      }
    }
    // Indexed in id order (the first of equal strings stays), a slot prefetched a batch ahead.
    constexpr std::size_t ahead = 16;
    std::array<std::uint64_t, ahead> hashes{};  // of indexed[i], ... indexed[i + ahead - 1], by i % ahead
    const auto hash_of = [&](std::size_t i) { return string_index::hash(bytes_[static_cast<std::size_t>(indexed[i])]); };
    for (std::size_t i = 0; i < std::min(ahead, indexed.size()); ++i) hashes[i] = hash_of(i);
    for (std::size_t i = 0; i < indexed.size(); ++i) {
      const std::uint64_t h = hashes[i % ahead];
      if (i + ahead < indexed.size()) {
        hashes[i % ahead] = hash_of(i + ahead);
        index_.prefetch(hashes[i % ahead]);
      }
      index_.insert(bytes_, indexed[i], h);
    }
    std::unordered_map<token_id, added_token_options> options;
    for (const auto& [tid, o] : c.added_options) {
      require(tid >= 0 && static_cast<std::size_t>(tid) < n, errc::invalid_argument,
              "bpe_tokenizer: options for token " + std::to_string(tid) + ", outside the vocabulary");
      options[tid] = o;
    }
    for (const auto& [text, tid] : specials_) {
      const auto it = options.find(tid);
      const added_token_options o = it == options.end() ? added_token_options{} : it->second;
      // Text that is not UTF-8 (a hostile file) never matches: a match must start on a character.
      if (!utf8::is_valid(text)) continue;
      // A normalized token is looked for in normalized text, as its normalized form.
      const std::string pattern = o.normalized && nfc_ ? nfc(text) : text;
      if (pattern.empty()) continue;
      const added_token entry{pattern, tid, o};
      (o.normalized ? all_.normalized : all_.raw).add(entry);
      if (kinds_[static_cast<std::size_t>(tid)] == token_kind::user_defined)
        (o.normalized ? user_.normalized : user_.raw).add(entry);
    }
    // Each merge's sides and result, by their bytes.
    require(c.merges.size() % 2 == 0, errc::invalid_argument, "bpe_tokenizer: a merge without its right side");
    merges_ = merge_table(c.merges.size() / 2);
    // In batches: decode and hash the strings of a batch of merges and prefetch their index slots,
    // find them, prefetch the merge table's slots, insert (the tables are larger than the caches).
    const auto missing = [&](std::size_t rank) {
      return error(errc::invalid_argument, "bpe_tokenizer: merge " + std::to_string(rank) + " ('" +
                                               std::string(c.merges[2 * rank]) + "' '" +
                                               std::string(c.merges[2 * rank + 1]) +
                                               "') names a token the vocabulary lacks");
    };
    constexpr std::size_t batch = 32;
    struct pending {
      std::size_t begin, split, end;  // in buf: the left side's bytes, then the right side's
      std::uint64_t hl, hr, hm;
      token_id l, r, m;
    };
    std::array<pending, batch> p{};
    std::string buf;
    const std::size_t count = c.merges.size() / 2;
    for (std::size_t base = 0; base < count; base += batch) {
      const std::size_t k = std::min(batch, count - base);
      buf.clear();
      for (std::size_t j = 0; j < k; ++j) {
        auto& q = p[j];
        q.begin = buf.size();
        const bool left = byte_level::decode_into(c.merges[2 * (base + j)], buf);
        q.split = buf.size();
        if (!left || !byte_level::decode_into(c.merges[2 * (base + j) + 1], buf)) throw missing(base + j);
        q.end = buf.size();
      }
      const std::string_view all = buf;
      for (std::size_t j = 0; j < k; ++j) {
        auto& q = p[j];
        q.hl = string_index::hash(all.substr(q.begin, q.split - q.begin));
        q.hr = string_index::hash(all.substr(q.split, q.end - q.split));
        q.hm = string_index::hash(all.substr(q.begin, q.end - q.begin));
        index_.prefetch(q.hl);
        index_.prefetch(q.hr);
        index_.prefetch(q.hm);
      }
      for (std::size_t j = 0; j < k; ++j) {
        auto& q = p[j];
        q.l = index_.find(bytes_, all.substr(q.begin, q.split - q.begin), q.hl);
        q.r = index_.find(bytes_, all.substr(q.split, q.end - q.split), q.hr);
        q.m = index_.find(bytes_, all.substr(q.begin, q.end - q.begin), q.hm);
        if (q.l < 0 || q.r < 0 || q.m < 0) throw missing(base + j);
        merges_.prefetch(q.l, q.r);
      }
      for (std::size_t j = 0; j < k; ++j)
        merges_.insert(p[j].l, p[j].r, {static_cast<std::uint32_t>(base + j), p[j].m});
    }
  }

  // Plain text: user-defined added tokens (not special) are found in it as Hugging Face finds them;
  // control tokens' text (sentinels, EOS) is tokenized as text.
  void encode(std::string_view s, std::vector<token_id>& out) const {
    utf8::require_valid(s, "the text");
    encode_added(s, user_, out);
  }

  // Text in which every added token's text stands for that token (control tokens included).
  void encode_special(std::string_view s, std::vector<token_id>& out) const {
    utf8::require_valid(s, "the text");
    encode_added(s, all_, out);
  }

  [[nodiscard]] std::optional<token_id> special_id(std::string_view s) const {
    const auto it = specials_.find(s);
    if (it == specials_.end()) return std::nullopt;
    return it->second;
  }

  [[nodiscard]] std::string_view token_bytes(token_id id) const {
    if (id < 0 || static_cast<std::size_t>(id) >= bytes_.size())  // (a message only on failure: a hot path)
      throw error(errc::unknown_token, "bpe_tokenizer: token id " + std::to_string(id) +
                                           " is outside the vocabulary of " + std::to_string(bytes_.size()));
    return bytes_[static_cast<std::size_t>(id)];
  }

  // Control and unused tokens: a detokenizer leaves them out of text. A user-defined token is text
  // (DeepSeek-Coder's õ is one), as `encode` finds it.
  [[nodiscard]] bool is_special(token_id id) const noexcept {
    if (id < 0 || static_cast<std::size_t>(id) >= kinds_.size()) return false;
    const token_kind k = kinds_[static_cast<std::size_t>(id)];
    return k == token_kind::control || k == token_kind::unused;
  }
  [[nodiscard]] std::size_t vocab_size() const noexcept { return bytes_.size(); }
  // Whether text is normalized to NFC before it is tokenized (outside the added tokens found in it).
  [[nodiscard]] bool normalizes() const noexcept { return nfc_; }
  // Whether byte `b` has a token of its own; a byte without one is left out of the text it is in (or
  // becomes the unknown token, where the tokenizer has one), as Hugging Face's tokenizers do.
  [[nodiscard]] bool has_byte(unsigned char b) const noexcept { return byte_id_[b] >= 0; }

  // Whether recent words' ids are kept (in a cache per thread; on unless the config said otherwise).
  // Off, every word is merged again. Set it before the tokenizer is shared between threads.
  void use_word_cache(bool on) noexcept { serial_ = on ? word_cache::next_serial() : 0; }
  [[nodiscard]] bool uses_word_cache() const noexcept { return serial_ != 0; }
  [[nodiscard]] const std::string& description() const noexcept { return description_; }

  // The text of a sequence of ids (special tokens included as their text).
  [[nodiscard]] std::string decode(std::span<const token_id> ids) const {
    std::string out;
    for (const token_id id : ids) out += token_bytes(id);
    return out;
  }

 private:
  // Hashing for string keys that accepts string_view lookups.
  struct string_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using string_map = std::unordered_map<std::string, token_id, string_hash, std::equal_to<>>;

  struct added_token {
    std::string text;
    token_id id;
    added_token_options options;
  };
  // Added tokens by first byte, longest first: the leftmost match, and at it the longest
  // (Aho-Corasick's leftmost-longest, as Hugging Face builds its matchers).
  struct added_set {
    std::array<std::vector<added_token>, 256> by_first_byte;
    bool empty = true;

    void add(const added_token& t) {
      auto& v = by_first_byte[static_cast<unsigned char>(t.text[0])];
      v.insert(std::upper_bound(v.begin(), v.end(), t,
                                [](const auto& a, const auto& b) { return a.text.size() > b.text.size(); }),
               t);
      empty = false;
    }
    [[nodiscard]] const added_token* longest_at(std::string_view s, std::size_t pos) const noexcept {
      for (const auto& t : by_first_byte[static_cast<unsigned char>(s[pos])])
        if (s.compare(pos, t.text.size(), t.text) == 0) return &t;
      return nullptr;
    }
  };
  // The tokens matched in the text as given, and those matched in its normalized pieces.
  struct added_sets {
    added_set raw, normalized;
  };

  // Hugging Face's AddedVocabulary::find_matches over `s`: the text between matches goes to
  // text(piece), each match to token(id). Matches do not overlap, and a match dropped for
  // single_word is passed over, not searched again one character on. lstrip takes the white space
  // before a match (not past the previous match's end), rstrip the white space after it.
  template <class Text, class Token>
  static void split_added(std::string_view s, const added_set& set, Text&& text, Token&& token) {
    if (set.empty) {
      if (!s.empty()) text(s);
      return;
    }
    std::size_t done = 0, pos = 0;
    while (pos < s.size()) {
      const added_token* t = set.longest_at(s, pos);
      if (t == nullptr) {
        ++pos;  // a token starts with a lead byte, which no character has inside it
        continue;
      }
      std::size_t start = pos, stop = pos + t->text.size();
      pos = stop;
      if (t->options.single_word && ((start > 0 && is_word_character(code_point_before(s, start))) ||
                                     (stop < s.size() && is_word_character(code_point_at(s, stop)))))
        continue;
      if (t->options.lstrip)
        while (start > done) {
          const char32_t c = code_point_before(s, start);
          if (!is_white_space(c)) break;
          start -= U8_LENGTH(static_cast<UChar32>(c));
        }
      if (t->options.rstrip) {
        while (stop < s.size()) {
          const char32_t c = code_point_at(s, stop);
          if (!is_white_space(c)) break;
          stop += U8_LENGTH(static_cast<UChar32>(c));
        }
        pos = stop;
      }
      if (done < start) text(s.substr(done, start - done));
      token(t->id);
      done = stop;
    }
    if (done < s.size()) text(s.substr(done));
  }

  // Added tokens found in the text as given; the pieces between normalized (NFC where the tokenizer
  // asks) and searched for the normalized added tokens; what is left pre-tokenized and merged.
  void encode_added(std::string_view s, const added_sets& sets, std::vector<token_id>& out) const {
    const auto push = [&](token_id id) { out.push_back(id); };
    split_added(
        s, sets.raw,
        [&](std::string_view piece) {
          std::string normalized;
          const bool copy = nfc_ && !is_nfc(piece);
          if (copy) append_nfc(piece, normalized);
          split_added(
              copy ? std::string_view(normalized) : piece, sets.normalized,
              [&](std::string_view text) { encode_text(text, out); }, push);
        },
        push);
  }

  // Normalized text with no added tokens: pre-tokenized (after ByteLevel's prefix space, where
  // asked), each word merged.
  void encode_text(std::string_view text, std::vector<token_id>& out) const {
    std::string prefixed;
    if (add_prefix_space_ && text.front() != ' ') {
      prefixed = " ";
      prefixed += text;
      text = prefixed;
    }
    if (serial_ == 0) {
      pre_.for_each_word(text, [&](std::string_view word) { encode_word(word, out); });
      return;
    }
    word_cache& cache = word_cache::mine();
    pre_.for_each_word(text, [&](std::string_view word) {
      if (word.size() == 1 || word.size() > word_cache::max_word) {
        encode_word(word, out);
        return;
      }
      const std::uint64_t h = string_index::hash(word);
      if (cache.find(serial_, word, h, out)) return;
      const std::size_t before = out.size();
      encode_word(word, out);
      cache.store(serial_, word, h, std::span<const token_id>(out).subspan(before));
    });
  }

  // The symbols a word's merging starts from, one per byte, passed to add(id): the byte's token; for
  // a byte the vocabulary lacks, the unknown token (fused over a run) or nothing.
  template <class Add>
  void for_each_symbol(std::string_view word, Add&& add) const {
    bool after_unknown = false;
    for (const char ch : word) {
      const token_id id = byte_id_[static_cast<unsigned char>(ch)];
      if (id >= 0) {
        add(id);
        after_unknown = false;
      } else if (unknown_ >= 0 && !(fuse_unknown_ && after_unknown)) {
        add(unknown_);
        after_unknown = true;
      }
    }
  }

  // One word merged: the pair of lowest rank first, the leftmost of equal ones, until no pair has a
  // merge. Words of up to 64 bytes keep each pair's rank in an array and look up only the pairs a
  // merge makes; longer ones take a heap.
  static constexpr std::size_t short_word = 64;
  void encode_word(std::string_view word, std::vector<token_id>& out) const {
    if (ignore_merges_)
      if (const token_id id = index_.find(bytes_, word); id >= 0) {
        out.push_back(id);
        return;
      }
    if (word.size() > short_word) {
      encode_long_word(word, out);
      return;
    }
    constexpr std::uint32_t none = ~std::uint32_t{0};
    std::array<token_id, short_word> ids;
    std::array<std::uint32_t, short_word> ranks;  // ranks[i]: of the merge of ids[i] and ids[i + 1]
    std::array<token_id, short_word> merged;      // and what it makes
    std::size_t n = 0;
    for_each_symbol(word, [&](token_id id) { ids[n++] = id; });
    const auto look = [&](std::size_t i) {
      const merge_table::merge* m = merges_.find(ids[i], ids[i + 1]);
      ranks[i] = m != nullptr ? m->rank : none;
      merged[i] = m != nullptr ? m->id : -1;
    };
    for (std::size_t i = 0; i + 1 < n; ++i) look(i);
    while (n > 1) {
      std::size_t best = 0;
      for (std::size_t i = 1; i + 1 < n; ++i)
        if (ranks[i] < ranks[best]) best = i;
      if (ranks[best] == none) break;
      ids[best] = merged[best];
      std::copy(ids.begin() + static_cast<std::ptrdiff_t>(best + 2), ids.begin() + static_cast<std::ptrdiff_t>(n),
                ids.begin() + static_cast<std::ptrdiff_t>(best + 1));
      std::copy(ranks.begin() + static_cast<std::ptrdiff_t>(best + 1),
                ranks.begin() + static_cast<std::ptrdiff_t>(n - 1), ranks.begin() + static_cast<std::ptrdiff_t>(best));
      std::copy(merged.begin() + static_cast<std::ptrdiff_t>(best + 1),
                merged.begin() + static_cast<std::ptrdiff_t>(n - 1), merged.begin() + static_cast<std::ptrdiff_t>(best));
      --n;
      if (best + 1 < n) look(best);
      if (best > 0) look(best - 1);
    }
    out.insert(out.end(), ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
  }

  void encode_long_word(std::string_view word, std::vector<token_id>& out) const {
    struct symbol {
      token_id id;
      int prev, next;
    };
    std::vector<symbol> syms;
    syms.reserve(word.size());
    for_each_symbol(word, [&](token_id id) {
      const int i = static_cast<int>(syms.size());
      syms.push_back({id, i - 1, i + 1});
    });
    if (!syms.empty()) syms.back().next = -1;
    // Candidate merges: lowest rank first, then leftmost.
    using candidate = std::pair<std::uint64_t, int>;  // (rank << 32 | position, position)
    std::priority_queue<candidate, std::vector<candidate>, std::greater<>> heap;
    const auto consider = [&](int left) {
      if (left < 0 || syms[static_cast<std::size_t>(left)].next < 0) return;
      const auto& l = syms[static_cast<std::size_t>(left)];
      const merge_table::merge* m = merges_.find(l.id, syms[static_cast<std::size_t>(l.next)].id);
      if (m != nullptr) heap.push({(static_cast<std::uint64_t>(m->rank) << 32) | static_cast<std::uint32_t>(left), left});
    };
    for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) consider(i);
    while (!heap.empty()) {
      const auto [key, left] = heap.top();
      heap.pop();
      auto& l = syms[static_cast<std::size_t>(left)];
      if (l.id < 0 || l.next < 0) continue;  // merged into its left neighbour, or last
      auto& r = syms[static_cast<std::size_t>(l.next)];
      const merge_table::merge* m = merges_.find(l.id, r.id);
      if (m == nullptr || m->rank != static_cast<std::uint32_t>(key >> 32)) continue;  // stale
      l.id = m->id;
      r.id = -1;
      l.next = r.next;
      if (l.next >= 0) syms[static_cast<std::size_t>(l.next)].prev = left;
      consider(l.prev);
      consider(left);
    }
    for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next)
      out.push_back(syms[static_cast<std::size_t>(i)].id);
  }

  pre_tokenizer pre_;
  bool nfc_, ignore_merges_, add_prefix_space_;
  std::string description_;
  std::uint64_t serial_;  // this tokenizer's entries in the word cache (0: no cache)
  std::vector<token_kind> kinds_;
  string_table bytes_;     // by id: the bytes a token stands for
  string_index index_;     // the bytes of a normal token -> its id
  string_map specials_;    // added-token text -> id (control and user-defined)
  added_sets user_, all_;  // what encode finds (user-defined), what encode_special finds (all)
  std::array<token_id, 256> byte_id_{};
  merge_table merges_;
  token_id unknown_ = -1;
  bool fuse_unknown_ = false;
};

static_assert(tokenizer<bpe_tokenizer>);

// Adds a merge written as one string, "left right" (a token's byte-level form holds no space), to
// a table of merges.
inline void add_merge(std::string_view m, string_table& merges) {
  const auto space = m.find(' ', 1);
  if (space == std::string_view::npos)
    throw error(errc::invalid_argument, "tokenizer: merge '" + std::string(m) + "' has no space");
  merges.push_back(m.substr(0, space));
  merges.push_back(m.substr(space + 1));
}

// From the tokenizer.ggml.* metadata of a GGUF file (tokenizer.ggml.model must be "gpt2").
inline bpe_tokenizer load_bpe_gguf(const gguf::file& f) {
  const std::string_view model = f.string("tokenizer.ggml.model");
  require(model == "gpt2", errc::invalid_argument,
          "tokenizer: GGUF tokenizer model '" + std::string(model) + "' is not byte-level BPE ('gpt2')");
  bpe_config c;
  {
    const auto& tokens = f.array<std::string>("tokenizer.ggml.tokens");
    std::size_t bytes = 0;
    for (const auto& t : tokens) bytes += t.size();
    c.tokens.reserve(tokens.size(), bytes);
    for (const auto& t : tokens) c.tokens.push_back(t);
  }
  if (f.find("tokenizer.ggml.token_type")) {
    const auto& types = f.array<std::int64_t>("tokenizer.ggml.token_type");
    require(types.size() == c.tokens.size(), errc::invalid_argument,
            "tokenizer: " + std::to_string(types.size()) + " token types for " + std::to_string(c.tokens.size()) +
                " tokens");
    c.kinds.reserve(types.size());
    for (std::size_t id = 0; id < types.size(); ++id) {
      const auto t = types[id];
      const std::string_view text = c.tokens[id];
      token_kind k = t == 3   ? token_kind::control
                     : t == 5 ? token_kind::unused
                              : token_kind::normal;  // 1 normal, 2 unknown, 6 byte
      // User-defined: found in plain text, unless written like a sentinel (looks_like_control), or
      // the "[PAD<id>]" filler a converter writes for ids the tokenizer does not have.
      if (t == 4)
        k = looks_like_control(text)                    ? token_kind::control
            : text == "[PAD" + std::to_string(id) + "]" ? token_kind::unused
                                                        : token_kind::user_defined;
      c.kinds.push_back(k);
    }
  }
  if (f.find("tokenizer.ggml.merges")) {
    const auto& merges = f.array<std::string>("tokenizer.ggml.merges");
    std::size_t bytes = 0;
    for (const auto& m : merges) bytes += m.size();
    c.merges.reserve(2 * merges.size(), bytes);
    for (const auto& m : merges) add_merge(m, c.merges);
  }
  const std::string pre = f.find("tokenizer.ggml.pre") ? std::string(f.string("tokenizer.ggml.pre")) : "default";
  c.pre = pre_tokenizer::preset(pre);
  c.nfc = pre == "qwen2";
  c.ignore_merges = pre == "llama-bpe";
  c.description = "GGUF byte-level BPE, pre-tokenizer " + pre + ", " + std::to_string(c.tokens.size()) + " tokens";
  return bpe_tokenizer(std::move(c));
}

namespace detail {

// Escapes a literal for an Oniguruma pattern.
inline std::string regex_escape(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(ch) != std::string_view::npos) out += '\\';
    out += ch;
  }
  return out;
}

inline split_behavior parse_behavior(const nlohmann::json& j) {
  const std::string b = j.value("behavior", "Isolated");
  if (b == "Isolated") return split_behavior::isolated;
  if (b == "Removed") return split_behavior::removed;
  if (b == "MergedWithPrevious") return split_behavior::merged_with_previous;
  if (b == "MergedWithNext") return split_behavior::merged_with_next;
  if (b == "Contiguous") return split_behavior::contiguous;
  throw error(errc::invalid_argument, "tokenizer.json: unknown split behavior '" + b + "'");
}

// One split of a tokenizer.json pre-tokenizer.
struct split_spec {
  std::string pattern;
  split_behavior behavior = split_behavior::isolated;
  bool invert = false;
};

// The splits a tokenizer.json pre-tokenizer makes, in order, and ByteLevel's add_prefix_space.
inline void read_pre_tokenizer(const nlohmann::json& j, std::vector<split_spec>& splits, bool& add_prefix_space) {
  if (j.is_null()) return;
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& p : j.at("pretokenizers")) read_pre_tokenizer(p, splits, add_prefix_space);
  } else if (type == "Split") {
    const auto& pattern = j.at("pattern");
    splits.push_back({pattern.contains("Regex") ? pattern.at("Regex").get<std::string>()
                                                : regex_escape(pattern.at("String").get<std::string>()),
                      parse_behavior(j), j.value("invert", false)});
  } else if (type == "ByteLevel") {
    if (j.value("use_regex", true)) splits.push_back({std::string(gpt2_pattern)});
    add_prefix_space = j.value("add_prefix_space", false);
  } else if (type == "Digits") {
    splits.push_back({j.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)"});
  } else {
    throw error(errc::invalid_argument, "tokenizer.json: pre-tokenizer '" + type + "' is not supported");
  }
}

inline void add_normalizer(const nlohmann::json& j, bpe_config& c) {
  if (j.is_null()) return;
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& n : j.at("normalizers")) add_normalizer(n, c);
  } else if (type == "NFC") {
    c.nfc = true;
  } else {
    throw error(errc::invalid_argument, "tokenizer.json: normalizer '" + type + "' is not supported");
  }
}

// A token id as tokenizer.json gives it: a whole number in [0, 2^24). A float is refused, not
// converted (nlohmann's get<integer>() casts: out of range is undefined behaviour, 3.7 becomes 3).
inline std::size_t json_token_id(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const auto id = v.get<std::uint64_t>();
    if (id < (std::uint64_t{1} << 24)) return static_cast<std::size_t>(id);
    throw error(errc::invalid_argument, "tokenizer.json: token id " + std::to_string(id) + " is too large");
  }
  throw error(errc::invalid_argument,
              "tokenizer.json: token id " + v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                  (v.is_number_integer() ? " is negative" : " is not a whole number"));
}

}  // namespace detail

// From the text of a Hugging Face tokenizer.json (model type BPE, byte-level).
inline bpe_tokenizer load_bpe_json(std::string_view json_text) {
  // The vocabulary and the merges are read as they stream past (views into the text, one buffer for
  // all tokens); the small parts (added tokens, normalizer, pre-tokenizer) are parsed into trees.
  json::reader r(json_text, "tokenizer.json");
  bpe_config c;
  const auto place = [&](std::int64_t id, std::string_view text, token_kind kind) {
    if (id < 0 || id >= (std::int64_t{1} << 24))
      throw error(errc::invalid_argument, "tokenizer.json: token id " + std::to_string(id) + " is too large");
    const auto at = static_cast<std::size_t>(id);
    if (at >= c.kinds.size()) c.kinds.resize(at + 1, token_kind::unused);
    c.tokens.set(at, text);
    c.kinds[at] = kind;
  };
  std::string scratch, side;
  std::string_view added, normalizer, pre;
  bool have_model = false, have_vocab = false, have_merges = false;
  std::string type = "BPE";
  std::string unk_token;
  bool byte_fallback = false;
  r.open('{');
  for (bool first = true; r.more('}', first);) {
    const std::string k(r.key(scratch));
    if (k == "added_tokens") {
      added = r.skip();
    } else if (k == "normalizer") {
      normalizer = r.skip();
    } else if (k == "pre_tokenizer") {
      pre = r.skip();
    } else if (k == "model") {
      have_model = true;
      r.open('{');
      for (bool first_in_model = true; r.more('}', first_in_model);) {
        const std::string mk(r.key(scratch));
        if (mk == "type") {
          type = r.string(scratch);
        } else if (mk == "byte_fallback") {
          byte_fallback = r.boolean();
        } else if (mk == "ignore_merges") {
          c.ignore_merges = r.boolean();
        } else if (mk == "unk_token") {
          if (r.peek() == 'n')
            r.skip();  // null
          else
            unk_token = r.string(scratch);
        } else if (mk == "fuse_unk") {
          c.fuse_unknown = r.boolean();
        } else if (mk == "vocab") {
          have_vocab = true;
          r.open('{');
          for (bool first_token = true; r.more('}', first_token);) {
            const std::string_view text = r.key(scratch);
            place(r.integer(), text, token_kind::normal);
          }
        } else if (mk == "merges") {
          have_merges = true;
          r.open('[');
          for (bool first_merge = true; r.more(']', first_merge);) {
            if (r.peek() == '"') {
              add_merge(r.string(scratch), c.merges);
              continue;
            }
            r.open('[');  // ["left", "right"]
            bool first_side = true;
            for (int i = 0; i < 2; ++i) {
              if (!r.more(']', first_side)) r.fail("a merge without two sides");
              c.merges.push_back(r.string(side));
            }
            if (r.more(']', first_side)) r.fail("a merge with more than two sides");
          }
        } else {
          r.skip();
        }
      }
    } else {
      r.skip();
    }
  }
  r.finish();
  if (!have_model || !have_vocab || !have_merges)
    throw error(errc::invalid_argument, std::string("tokenizer.json: no ") +
                                            (!have_model ? "model" : !have_vocab ? "model.vocab" : "model.merges"));
  if (type != "BPE") throw error(errc::invalid_argument, "tokenizer.json: model type '" + type + "' is not BPE");
  require(!byte_fallback, errc::invalid_argument, "tokenizer.json: byte_fallback BPE is not byte-level BPE");
  try {
    if (!added.empty())
      for (const auto& a : nlohmann::json::parse(added)) {
        const auto id = static_cast<std::int64_t>(detail::json_token_id(a.at("id")));
        const std::string text = a.at("content").get<std::string>();
        const bool special = a.value("special", false);
        // Hugging Face's defaults: a special token is not normalized, any other is.
        const added_token_options o{a.value("lstrip", false), a.value("rstrip", false), a.value("single_word", false),
                                    a.value("normalized", !special)};
        const bool control = special || looks_like_control(text);
        place(id, text, control ? token_kind::control : token_kind::user_defined);
        if (o.lstrip || o.rstrip || o.single_word || o.normalized)
          c.added_options.emplace_back(static_cast<token_id>(id), o);
      }
    if (!normalizer.empty()) detail::add_normalizer(nlohmann::json::parse(normalizer), c);
    if (!pre.empty()) {
      std::vector<detail::split_spec> splits;
      detail::read_pre_tokenizer(nlohmann::json::parse(pre), splits, c.add_prefix_space);
      for (const auto& sp : splits) c.pre.split(sp.pattern, sp.behavior, sp.invert);
    }
  } catch (const nlohmann::json::exception& e) {
    throw error(errc::invalid_argument, std::string("tokenizer.json: ") + e.what());
  }
  // The unknown token by its text, as Hugging Face looks it up (one the vocabulary lacks is none).
  if (!unk_token.empty())
    for (std::size_t id = 0; id < c.tokens.size(); ++id)
      if (c.tokens[id] == unk_token) {
        c.unknown = static_cast<token_id>(id);
        break;
      }
  c.description = "tokenizer.json byte-level BPE, " + std::to_string(c.tokens.size()) + " tokens";
  return bpe_tokenizer(std::move(c));
}

// The tokenizer.ggml.* metadata of a GGUF vocabulary for a Hugging Face tokenizer.json, as GGUF
// converters write it: byte-level token strings by id (ids the file leaves out become unused
// "[PAD<id>]" tokens), token types (1 normal, 3 control, 4 other added token, 5 unused),
// merges as "left right", and the pre-tokenizer preset whose splits the file's pre-tokenizer makes.
inline std::map<std::string, gguf::value, std::less<>> gguf_vocabulary(std::string_view json_text) {
  try {
    const auto j = nlohmann::json::parse(json_text);
    const auto& model = j.at("model");
    require(model.value("type", std::string("BPE")) == "BPE" && !model.value("byte_fallback", false),
            errc::invalid_argument, "tokenizer.json: not a byte-level BPE tokenizer");
    std::vector<std::string> tokens;
    std::vector<std::int64_t> types;
    const auto place = [&](std::size_t id, std::string text, std::int64_t type) {
      require(id < (std::size_t{1} << 24), errc::invalid_argument,
              "tokenizer.json: token id " + std::to_string(id) + " is too large");
      while (tokens.size() <= id) {
        tokens.push_back("[PAD" + std::to_string(tokens.size()) + "]");
        types.push_back(5);
      }
      tokens[id] = std::move(text);
      types[id] = type;
    };
    for (const auto& [text, id] : model.at("vocab").items()) place(detail::json_token_id(id), text, 1);
    // An added token is a control token if the file says it is special or it is written like one
    // (looks_like_control).
    if (j.contains("added_tokens"))
      for (const auto& a : j.at("added_tokens")) {
        std::string text = a.at("content").get<std::string>();
        const bool control = a.value("special", false) || looks_like_control(text);
        place(detail::json_token_id(a.at("id")), std::move(text), control ? 3 : 4);
      }
    std::vector<std::string> merges;
    for (const auto& m : model.at("merges"))
      merges.push_back(m.is_string() ? m.get<std::string>()
                                     : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());

    std::vector<detail::split_spec> splits;
    bool prefix_space = false;
    if (j.contains("pre_tokenizer")) detail::read_pre_tokenizer(j.at("pre_tokenizer"), splits, prefix_space);
    std::vector<std::string> patterns;
    for (const auto& sp : splits) {
      require(sp.behavior == split_behavior::isolated && !sp.invert && !prefix_space, errc::invalid_argument,
              "tokenizer.json: its pre-tokenizer is none of the GGUF presets (a split that does not isolate its "
              "matches, or add_prefix_space)");
      patterns.push_back(sp.pattern);
    }
    bpe_config normalizer;
    if (j.contains("normalizer")) detail::add_normalizer(j.at("normalizer"), normalizer);
    std::string pre;
    for (const auto& p : pre_tokenizer::presets())
      if (std::equal(patterns.begin(), patterns.end(), p.patterns.begin(), p.patterns.end())) pre = std::string(p.name);
    require(!pre.empty(), errc::invalid_argument,
            "tokenizer.json: its pre-tokenizer is none of the GGUF presets (gpt-2, qwen2, llama-bpe, starcoder, "
            "deepseek-coder)");
    require(normalizer.nfc == (pre == "qwen2") && model.value("ignore_merges", false) == (pre == "llama-bpe"),
            errc::invalid_argument,
            "tokenizer.json: its normalizer or ignore_merges differs from what the GGUF preset '" + pre + "' implies");
    std::map<std::string, gguf::value, std::less<>> out;
    out["tokenizer.ggml.model"] = gguf::make_string("gpt2");
    out["tokenizer.ggml.pre"] = gguf::make_string(pre);
    out["tokenizer.ggml.tokens"] = gguf::make_strings(std::move(tokens));
    out["tokenizer.ggml.token_type"] = gguf::make_i32s(std::move(types));
    out["tokenizer.ggml.merges"] = gguf::make_strings(std::move(merges));
    return out;
  } catch (const nlohmann::json::exception& e) {
    throw error(errc::invalid_argument, std::string("tokenizer.json: ") + e.what());
  }
}

// Whether a tokenizer path names a GGUF file (else it is a tokenizer.json).
inline bool is_gguf_path(std::string_view path) noexcept { return path.ends_with(".gguf"); }

// The text of a tokenizer.json file.
inline std::string read_tokenizer_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  require(in.good(), errc::invalid_argument, "tokenizer: cannot open '" + path + "'");
  const std::streamoff size = in.tellg();
  require(size >= 0, errc::invalid_argument, "tokenizer: cannot read '" + path + "'");
  std::string text(static_cast<std::size_t>(size), '\0');
  in.seekg(0);
  in.read(text.data(), size);
  require(in.gcount() == size, errc::invalid_argument, "tokenizer: cannot read '" + path + "'");
  return text;
}

// From a file: a .gguf file's metadata, or a tokenizer.json.
inline bpe_tokenizer load_bpe(const std::string& path) {
  if (is_gguf_path(path)) return load_bpe_gguf(gguf::read(path));
  const std::string json = read_tokenizer_json(path);
  try {
    return load_bpe_json(json);
  } catch (const error& e) {
    throw error(e.code(), std::string(e.what()) + " ('" + path + "')");
  }
}

}  // namespace efim::text
