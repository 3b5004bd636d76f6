#pragma once
// Token healing: a prompt that ends inside a word (`retu` as `ret` + `u`, where the model was trained
// on `return`) is continued badly by a model that never saw that split. Healing backs up over the
// prompt's last tokens whose text could start a longer token, and constrains the first generated
// tokens to reproduce the removed text: each constrained step allows only the tokens whose text is a
// prefix of what remains to reproduce, or starts with all of it (so `return` may come back in one
// token). Special tokens are never allowed in a constrained step.
//
// prefix_index holds every token's bytes in byte order, built once per tokenizer: the tokens that
// start with a string are one contiguous run of it (two binary searches), the tokens a string starts
// with are found by looking up each of its prefixes; neither depends on the vocabulary's size beyond
// a logarithm.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/types.hpp"
#include "efim/text/concepts.hpp"

namespace efim::text {

// The limit on removed tokens to use when healing is on: on code cut at random places with the
// Qwen2.5-Coder vocabulary, 93.7% of cuts heal; k = 1 removes 1.00 tokens on average, k = 2 1.12,
// k = 3 1.13 and k = 4 1.14 (efim-healing-bench, docs/benchmarks.md): 2 takes nearly all there is.
inline constexpr std::size_t default_heal_tokens = 2;

class prefix_index {
 public:
  template <tokenizer T>
  explicit prefix_index(const T& tok) : vocab_(tok.vocab_size()) {
    require(vocab_ < 0x7FFFFFFFu, errc::invalid_argument, "prefix_index: too many tokens");
    offsets_.reserve(vocab_ + 1);
    offsets_.push_back(0);
    for (std::size_t i = 0; i < vocab_; ++i) {
      const auto id = static_cast<token_id>(i);
      const std::string_view b = tok.token_bytes(id);
      bytes_.append(b);
      offsets_.push_back(bytes_.size());
      if (!tok.is_special(id) && !b.empty()) sorted_.push_back(id);
    }
    flags_.assign(vocab_, 0);
    for (const token_id t : sorted_) flags_[static_cast<std::size_t>(t)] = healable_flag;
    std::sort(sorted_.begin(), sorted_.end(), [&](token_id a, token_id b) {
      const auto x = bytes(a), y = bytes(b);
      return x < y || (x == y && a < b);
    });
    // A token extends to a longer one when the next in byte order starts with it (every token that
    // starts with it follows it directly; equal strings are skipped over).
    for (std::size_t i = 0; i < sorted_.size(); ++i) {
      const auto b = bytes(sorted_[i]);
      std::size_t j = i + 1;
      while (j < sorted_.size() && bytes(sorted_[j]) == b) ++j;
      if (j < sorted_.size() && bytes(sorted_[j]).starts_with(b))
        flags_[static_cast<std::size_t>(sorted_[i])] |= extendable_flag;
    }
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_; }

  // The bytes of any token (special ones included).
  [[nodiscard]] std::string_view bytes(token_id t) const noexcept {
    const auto i = static_cast<std::size_t>(t);
    return std::string_view(bytes_).substr(offsets_[i], offsets_[i + 1] - offsets_[i]);
  }

  // Whether t is a token healing may produce (not special, not empty).
  [[nodiscard]] bool healable(token_id t) const noexcept { return flag(t, healable_flag); }

  // Whether some token's bytes start with t's bytes and are longer.
  [[nodiscard]] bool extendable(token_id t) const noexcept { return flag(t, extendable_flag); }

  // The tokens (not special) whose bytes start with s, in byte order (s itself first where it is one).
  [[nodiscard]] std::span<const token_id> extending(std::string_view s) const {
    const auto lo = std::lower_bound(sorted_.begin(), sorted_.end(), s,
                                     [&](token_id a, std::string_view v) { return bytes(a) < v; });
    const auto hi = std::partition_point(lo, sorted_.end(), [&](token_id a) { return bytes(a).starts_with(s); });
    return {lo, hi};
  }

  // Calls fn(id) for each token (not special) whose bytes are a proper, non-empty prefix of s, shortest
  // first: one lookup per prefix length.
  template <class F>
  void prefixes_of(std::string_view s, F&& fn) const {
    for (std::size_t n = 1; n < s.size(); ++n) {
      const std::string_view p = s.substr(0, n);
      auto it = std::lower_bound(sorted_.begin(), sorted_.end(), p,
                                 [&](token_id a, std::string_view v) { return bytes(a) < v; });
      for (; it != sorted_.end() && bytes(*it) == p; ++it) fn(*it);
    }
  }

 private:
  static constexpr std::uint8_t healable_flag = 1, extendable_flag = 2;
  [[nodiscard]] bool flag(token_id t, std::uint8_t f) const noexcept {
    return t >= 0 && static_cast<std::size_t>(t) < vocab_ && (flags_[static_cast<std::size_t>(t)] & f) != 0;
  }

  std::size_t vocab_;
  std::string bytes_;                  // every token's bytes, in id order
  std::vector<std::size_t> offsets_;   // token i is bytes_[offsets_[i], offsets_[i + 1])
  std::vector<token_id> sorted_;       // the tokens healing may produce, by bytes (then id)
  std::vector<std::uint8_t> flags_;     // per id: healable_flag, extendable_flag
};

// What healing removes from the end of a run of text tokens: how many tokens and their text.
struct heal_cut {
  std::size_t tokens = 0;
  std::string text;
};

// The cut for the text tokens `ids` that end the prompt's text at the cursor, removing at most
// `most` tokens: nothing unless some token extends the last one; else the longest run of last tokens
// (up to `most`) whose text some longer token starts with. Special tokens are never removed.
inline heal_cut heal(const prefix_index& index, std::span<const token_id> ids, std::size_t most) {
  heal_cut cut;
  if (ids.empty() || most == 0 || !index.healable(ids.back()) || !index.extendable(ids.back())) return cut;
  std::string text;
  for (std::size_t j = 1; j <= std::min(most, ids.size()); ++j) {
    const token_id t = ids[ids.size() - j];
    if (!index.healable(t)) break;
    text.insert(0, index.bytes(t));
    const auto run = index.extending(text);
    const bool longer = !run.empty() && (run.size() > 1 || index.bytes(run.front()).size() > text.size());
    if (longer) cut = {j, text};
  }
  return cut;
}

// A healing policy decides the cut: given the prefix index, the text tokens at the cursor and the
// most tokens it may remove, what to remove. The pipeline takes one as a template parameter; the
// request's heal_tokens (or the pipeline's) still bounds it, and 0 turns healing off.
template <class P>
concept healing_policy =
    std::default_initializable<P> &&
    requires(const P& p, const prefix_index& index, std::span<const token_id> ids, std::size_t most) {
      { p.cut(index, ids, most) } -> std::same_as<heal_cut>;
    };

// Never heals, whatever a request asks (the pipeline then never builds the prefix index).
struct no_healing {
  heal_cut cut(const prefix_index&, std::span<const token_id>, std::size_t) const { return {}; }
};

// heal(): the longest run of last tokens some longer token starts with.
struct heal_trailing {
  heal_cut cut(const prefix_index& index, std::span<const token_id> ids, std::size_t most) const {
    return heal(index, ids, most);
  }
};

static_assert(healing_policy<no_healing> && healing_policy<heal_trailing>);

// The constraint of the healing steps: the text still to reproduce. A token is allowed while it is
// active when its bytes are a prefix of that text or start with all of it; taking one consumes it.
class heal_constraint {
 public:
  heal_constraint() = default;
  explicit heal_constraint(std::string text) : remaining_(std::move(text)) {}

  [[nodiscard]] bool active() const noexcept { return !remaining_.empty(); }
  [[nodiscard]] std::string_view remaining() const noexcept { return remaining_; }

  [[nodiscard]] bool allows(const prefix_index& index, token_id t) const noexcept {
    if (!active()) return true;
    if (!index.healable(t)) return false;
    const std::string_view b = index.bytes(t);
    return b.size() < remaining_.size() ? std::string_view(remaining_).starts_with(b) : b.starts_with(remaining_);
  }

  // Calls fn(id) for each allowed token (nothing when inactive: then every token is), in no order.
  template <class F>
  void for_each_allowed(const prefix_index& index, F&& fn) const {
    if (!active()) return;
    for (const token_id t : index.extending(remaining_)) fn(t);
    index.prefixes_of(remaining_, fn);
  }

  // The allowed tokens, in id order (empty when inactive: then every token is).
  void allowed(const prefix_index& index, std::vector<token_id>& out) const {
    out.clear();
    for_each_allowed(index, [&](token_id t) { out.push_back(t); });
    std::sort(out.begin(), out.end());
  }

  // The allowed token of the largest logit, the lowest id among equal ones (greedy healing, without
  // sorting the allowed set); -1 when inactive.
  [[nodiscard]] token_id argmax(const prefix_index& index, std::span<const float> logits) const {
    token_id best = -1;
    float top = 0.0f;
    for_each_allowed(index, [&](token_id t) {
      const float v = logits[static_cast<std::size_t>(t)];
      if (best < 0 || v > top || (v == top && t < best)) best = t, top = v;
    });
    return best;
  }

  // Takes an allowed token t: returns how many of its bytes were removed text (the client has them);
  // the rest is new text.
  std::size_t take(const prefix_index& index, token_id t) {
    require(allows(index, t), errc::invalid_argument, "heal_constraint: the token contradicts the removed text");
    const std::size_t n = std::min(index.bytes(t).size(), remaining_.size());
    remaining_.erase(0, n);
    return n;
  }

 private:
  std::string remaining_;
};

}  // namespace efim::text
