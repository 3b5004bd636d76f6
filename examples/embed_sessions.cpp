// efim's editor sessions and EFIM layout in front of a runtime's own engine: efim::prompt (and
// efim::cache for the prefix cache the engine would have), with the runtime's own tokenizer. No efim
// tokenizer, model or engine; nothing to link but xxHash's header.
//
// An editor sends one request per keystroke with the whole text before and after the cursor. The
// session table finds the request's session by its content, says what changed, and hands the layout
// input to a check that tokenizes it (and could refuse it: then the session stays as it was). The ids go
// to the engine, whose prefix cache finds every earlier token of the session: EFIM appends what was
// typed after the prompt of the session's first request, so only the new characters are computed. The
// same keystrokes laid out as <PRE>prefix<SUF>suffix<MID> (PSM) recompute the suffix each time.
//
//   embed-sessions        prints one line per keystroke and the totals; exits 1 if EFIM computed more
#include <cstddef>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/cache/block_hash.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/manager.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/prompt/session_table.hpp"

namespace {
using efim::token_id;

// The runtime's tokenizer (any type that models efim::text::tokenizer): one id per byte, then the FIM
// sentinels of Qwen2.5-Coder's token set.
class byte_ids {
 public:
  void encode(std::string_view text, std::vector<token_id>& out) const {
    for (const unsigned char c : text) out.push_back(c);
  }
  [[nodiscard]] std::optional<token_id> special_id(std::string_view text) const {
    for (std::size_t i = 0; i < specials_.size(); ++i)
      if (specials_[i] == text) return static_cast<token_id>(256 + i);
    return std::nullopt;
  }
  [[nodiscard]] std::string_view token_bytes(token_id id) const {
    static const std::string bytes = [] {
      std::string b(256, '\0');
      for (int i = 0; i < 256; ++i) b[static_cast<std::size_t>(i)] = static_cast<char>(i);
      return b;
    }();
    return id < 256 ? std::string_view(bytes).substr(static_cast<std::size_t>(id), 1) : std::string_view();
  }
  [[nodiscard]] bool is_special(token_id id) const { return id >= 256; }
  [[nodiscard]] std::size_t vocab_size() const { return 256 + specials_.size(); }

 private:
  std::vector<std::string> specials_ = efim::prompt::qwen25_coder.special_tokens();
};

// Each fragment (the text typed before each earlier request) tokenized on its own, so the ids of earlier
// keystrokes never change (efim::text::at_boundaries does the same).
struct each_fragment {
  template <class Sink>
  void for_each_piece(std::span<const std::string_view> fragments, Sink&& sink) {
    for (const auto f : fragments) sink(f);
  }
};

// The runtime's engine, reduced to its prefix cache (the KV itself would live in the engine's memory,
// addressed by the block ids): how many of a prompt's tokens it must compute.
class engine {
 public:
  std::size_t run(std::span<const token_id> prompt) {
    auto seq = cache_.admit(cache_.plan(prompt, prompt.size()));
    const std::size_t computed = prompt.size() - seq.hit_tokens;
    cache_.commit(seq, prompt, prompt.size());  // the KV of every full block is written now
    cache_.release(seq);
    return computed;
  }

 private:
  efim::cache::manager<efim::cache::xxh3_128_chain, efim::cache::lru> cache_{{.block_size = 16, .blocks = 512}};
};

template <class Format>
std::vector<token_id> lay_out(const efim::prompt::infill_request& r) {
  static const byte_ids tokenizer;
  std::vector<token_id> ids;
  each_fragment fragments;
  efim::prompt::encode(Format::layout(r, efim::prompt::qwen25_coder), tokenizer, efim::prompt::qwen25_coder,
                       fragments, ids);
  return ids;
}
}  // namespace

int main() {
  const std::string before =
      "def mean(values):\n    \"\"\"The arithmetic mean of a non-empty list.\"\"\"\n    total = sum(values)\n";
  const std::string after = "\n\n\nif __name__ == \"__main__\":\n    print(mean([1, 2, 3]))\n";
  const std::string typed = "    return total / len(values)";

  efim::prompt::session_table<int> sessions;
  engine efim_engine, psm_engine;
  std::size_t efim_computed = 0, psm_computed = 0, prompt_tokens = 0;
  std::printf("%-4s %-40s %-10s %8s %9s %9s\n", "#", "text before the cursor ends with", "change", "prompt",
              "computed", "psm");
  for (std::size_t n = 0; n <= typed.size(); ++n) {
    const std::string prefix = before + typed.substr(0, n);
    std::vector<token_id> ids;
    // One transaction: match the session, classify, lay out and tokenize, then store.
    const auto turn = sessions.apply({.tenant = "", .key = {}, .match = true, .prefix = prefix, .suffix = after},
                                     static_cast<int>(n + 1), [&](const efim::prompt::infill_request& r) {
                                       ids = lay_out<efim::prompt::efim_format>(r);
                                     });
    const std::size_t computed = efim_engine.run(ids);
    const std::size_t psm = psm_engine.run(lay_out<efim::prompt::psm>({prefix, after, {}}));
    sessions.finish(turn.key, static_cast<int>(n + 1));  // the request is done
    efim_computed += computed;
    psm_computed += psm;
    prompt_tokens += ids.size();
    const std::string tail = prefix.substr(prefix.size() - std::min<std::size_t>(prefix.size(), 12));
    std::string shown;
    for (const char c : tail) shown += c == '\n' ? std::string("\\n") : std::string(1, c);
    std::printf("%-4zu %-40s %-10s %8zu %9zu %9zu\n", n, shown.c_str(),
                std::string(efim::prompt::to_string(turn.update.kind)).c_str(), ids.size(), computed, psm);
  }
  std::printf("\n%zu keystrokes, %zu prompt tokens: EFIM computed %zu, PSM %zu (%.1fx fewer)\n", typed.size() + 1,
              prompt_tokens, efim_computed, psm_computed,
              static_cast<double>(psm_computed) / static_cast<double>(efim_computed));
  return efim_computed < psm_computed ? 0 : 1;
}
