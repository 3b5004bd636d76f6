#pragma once
// Fragmentation policies: which parts of a run of text are tokenized on their own.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/random.hpp"
#include "efim/core/utf8.hpp"
#include "efim/text/concepts.hpp"

namespace efim::text {

// The run is tokenized as one string, as a plain tokenizer would see the whole text.
// Appending text may change the ids at the end of what came before.
struct whole {
  template <class Sink>
  void for_each_piece(std::span<const std::string_view> fragments, Sink&& sink) {
    if (fragments.size() == 1) {
      sink(fragments.front());
      return;
    }
    buffer_.clear();
    for (const auto f : fragments) buffer_ += f;
    sink(std::string_view(buffer_));
  }

 private:
  std::string buffer_;
};

// Each fragment (a stable piece, such as the text typed before an earlier request) is tokenized
// on its own, so the ids of earlier fragments never change when text is appended.
struct at_boundaries {
  template <class Sink>
  void for_each_piece(std::span<const std::string_view> fragments, Sink&& sink) {
    for (const auto f : fragments) sink(f);
  }
};

// Fragment tokenization for training data (the EFIM paper): with probability `probability` a run
// is cut at 1 to `max_cuts` distinct random character boundaries, and each fragment is tokenized on
// its own, so that a model learns to continue text that ends inside a token. Deterministic for a
// seed: the same runs in the same order are cut the same way.
template <class Rng = rng>
class random_split {
 public:
  random_split(std::uint64_t seed, double probability, std::size_t max_cuts)
      : rng_(seed), probability_(probability), max_cuts_(max_cuts) {
    require(probability >= 0.0 && probability <= 1.0, errc::invalid_argument,
            "random_split: the probability must be in [0, 1]");
    require(max_cuts > 0 || probability == 0.0, errc::invalid_argument, "random_split: max_cuts must be at least 1");
  }

  template <class Sink>
  void for_each_piece(std::span<const std::string_view> fragments, Sink&& sink) {
    std::string_view text;
    if (fragments.size() == 1) {
      text = fragments.front();
    } else {
      buffer_.clear();
      for (const auto f : fragments) buffer_ += f;
      text = buffer_;
    }
    // Character boundaries strictly inside the run.
    boundaries_.clear();
    for (std::size_t i = 1; i < text.size(); ++i)
      if (!utf8::is_continuation(static_cast<unsigned char>(text[i]))) boundaries_.push_back(i);
    if (boundaries_.empty() || !(rng_.uniform() < probability_)) {
      if (!text.empty()) sink(text);
      return;
    }
    const std::size_t cuts = 1 + static_cast<std::size_t>(rng_.below(std::min(max_cuts_, boundaries_.size())));
    // A partial Fisher-Yates shuffle picks `cuts` distinct boundaries.
    for (std::size_t i = 0; i < cuts; ++i)
      std::swap(boundaries_[i], boundaries_[i + static_cast<std::size_t>(rng_.below(boundaries_.size() - i))]);
    std::sort(boundaries_.begin(), boundaries_.begin() + static_cast<std::ptrdiff_t>(cuts));
    std::size_t start = 0;
    for (std::size_t i = 0; i < cuts; ++i) {
      sink(text.substr(start, boundaries_[i] - start));
      start = boundaries_[i];
    }
    sink(text.substr(start));
  }

 private:
  Rng rng_;
  double probability_;
  std::size_t max_cuts_;
  std::string buffer_;
  std::vector<std::size_t> boundaries_;
};

static_assert(fragmenter<whole>);
static_assert(fragmenter<at_boundaries>);
static_assert(fragmenter<random_split<>>);

}  // namespace efim::text
