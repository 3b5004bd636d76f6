#pragma once
// Stop rules on generated text: stop strings (the text stops before the first one), and a minimum
// indentation for each new line (llama.cpp's n_indent: a line that starts less indented than that
// ends the completion, cut where its text begins). Text that may be the start of a stop string is
// held back until it is known not to be one, so a client never sees part of a stop string.
#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace efim::engine {

struct stop_rules {
  std::vector<std::string> strings;  // empty strings are ignored
  std::size_t min_indent = 0;        // 0: no indentation rule
};

class text_gate {
 public:
  enum class verdict { go_on, stop_string, indent };

  text_gate() = default;
  explicit text_gate(stop_rules rules) : rules_(std::move(rules)) {
    std::erase_if(rules_.strings, [](const std::string& s) { return s.empty(); });
  }

  // Takes the next whole characters of generated text and appends to `out` what may be shown now.
  // After a verdict other than go_on, the text is final and later pushes release nothing.
  verdict push(std::string_view text, std::string& out) {
    if (stopped_) return verdict::go_on;
    const std::size_t scanned = held_.size();
    held_ += text;
    std::size_t cut = std::string::npos;
    verdict why = verdict::go_on;
    const std::string* word = nullptr;
    for (const auto& s : rules_.strings) {
      // A match may start in the held text, so search from where it could begin.
      const std::size_t from = scanned >= s.size() ? scanned - s.size() + 1 : 0;
      const std::size_t at = held_.find(s, from);
      if (at < cut) {
        cut = at;
        why = verdict::stop_string;
        word = &s;
      }
    }
    if (rules_.min_indent > 0) {
      const std::size_t at = indent_cut(scanned);
      if (at < cut) {
        cut = at;
        why = verdict::indent;
        word = nullptr;
      }
    }
    if (cut != std::string::npos) {
      if (word != nullptr) matched_ = *word;
      out.append(held_, 0, cut);
      held_.clear();
      stopped_ = true;
      return why;
    }
    const std::size_t keep = longest_partial_match();
    out.append(held_, 0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return verdict::go_on;
  }

  // The end of the text: what is still held back is not a stop string.
  void finish(std::string& out) {
    if (!stopped_) out += held_;
    held_.clear();
    stopped_ = true;
  }

  [[nodiscard]] bool stopped() const noexcept { return stopped_; }
  // The stop string that ended the text (empty if none did).
  [[nodiscard]] const std::string& matched() const noexcept { return matched_; }

 private:
  // The first position in held_[from:] where a line after the first starts with something other
  // than a space or a tab (its newline included, as llama.cpp counts it) while indented less than
  // min_indent.
  std::size_t indent_cut(std::size_t from) {
    for (std::size_t i = from; i < held_.size(); ++i) {
      const char c = held_[i];
      if (after_newline_ && (c == ' ' || c == '\t')) {
        ++indent_;
        continue;
      }
      if (after_newline_ && indent_ < rules_.min_indent) return i;
      after_newline_ = c == '\n';
      indent_ = 0;
    }
    return std::string::npos;
  }

  // Length of the longest end of held_ that is a proper start of a stop string.
  [[nodiscard]] std::size_t longest_partial_match() const {
    std::size_t best = 0;
    for (const auto& s : rules_.strings)
      for (std::size_t n = std::min(s.size() - 1, held_.size()); n > best; --n)
        if (std::string_view(held_).substr(held_.size() - n) == std::string_view(s).substr(0, n)) {
          best = n;
          break;
        }
    return best;
  }

  stop_rules rules_;
  std::string held_;
  std::string matched_;
  bool stopped_ = false;
  bool after_newline_ = false;  // at the start of a line after the first, within its indentation
  std::size_t indent_ = 0;
};

}  // namespace efim::engine
