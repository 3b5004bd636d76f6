#pragma once
// Fragmentation policies: which parts of a run of text are tokenized on their own.
#include <span>
#include <string>
#include <string_view>

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

static_assert(fragmenter<whole>);
static_assert(fragmenter<at_boundaries>);

}  // namespace efim::text
