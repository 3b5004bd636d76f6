// efim::prompt alone: a session and its EFIM layout, tokenized by the program's own tokenizer.
#include <cstdio>
#include <efim/prompt/encode.hpp>
#include <efim/prompt/formats.hpp>
#include <efim/prompt/session_table.hpp>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace {
struct letters {  // ids: bytes, and 1000 + the sentinel's role
  void encode(std::string_view s, std::vector<efim::token_id>& out) const {
    for (const unsigned char c : s) out.push_back(c);
  }
  std::optional<efim::token_id> special_id(std::string_view s) const {
    const auto& q = efim::prompt::qwen25_coder;
    if (s == q.prefix) return 1000;
    if (s == q.suffix) return 1001;
    if (s == q.middle) return 1002;
    return std::nullopt;
  }
  std::string_view token_bytes(efim::token_id) const { return {}; }
  bool is_special(efim::token_id id) const { return id >= 1000; }
  std::size_t vocab_size() const { return 1003; }
};
struct whole_fragments {
  template <class Sink>
  void for_each_piece(std::span<const std::string_view> fragments, Sink&& sink) {
    for (const auto f : fragments) sink(f);
  }
};
}  // namespace

int main() {
  efim::prompt::session_table<int> sessions;
  std::vector<efim::token_id> ids;
  for (const char* prefix : {"x = ", "x = 4"}) {
    ids.clear();
    sessions.apply({.tenant = "", .key = "doc", .match = false, .prefix = prefix, .suffix = "\n"}, 1,
                   [&](const efim::prompt::infill_request& r) {
                     whole_fragments g;
                     efim::prompt::encode(efim::prompt::efim_format::layout(r, efim::prompt::qwen25_coder), letters{},
                                          efim::prompt::qwen25_coder, g, ids);
                   });
  }
  // <PRE>x = <SUF>\n<MID>4: the typed "4" after the first request's prompt.
  const std::vector<efim::token_id> want{1000, 'x', ' ', '=', ' ', 1001, '\n', 1002, '4'};
  std::printf("prompt: %zu ids, EFIM layout %s\n", ids.size(), ids == want ? "as expected" : "WRONG");
  return ids == want ? 0 : 1;
}
