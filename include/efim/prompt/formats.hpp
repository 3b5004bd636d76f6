#pragma once
// Format policies: prefix-suffix-middle, suffix-prefix-middle, and EFIM.
#include <string_view>

#include "efim/prompt/concepts.hpp"

namespace efim::prompt {

namespace detail {
inline prompt_layout start(const fim_token_set& set) {
  prompt_layout l;
  if (set.add_bos && !set.bos.empty()) l.add_special(fim_role::bos);
  return l;
}
}  // namespace detail

// <PRE> prefix typed <SUF> suffix <MID>: typing changes the text before the suffix, so the
// suffix's KV is recomputed on every keystroke.
struct psm {
  static constexpr std::string_view name = "psm";
  static constexpr bool typed_at_end = false;
  static prompt_layout layout(const infill_request& r, const fim_token_set& set) {
    prompt_layout l = detail::start(set);
    l.add_special(fim_role::prefix);
    l.add_text({r.prefix}, r.typed);
    l.add_special(fim_role::suffix);
    l.add_text({r.suffix});
    l.add_special(fim_role::middle);
    return l;
  }
};

// <PRE> <SUF> suffix <MID> prefix typed (the SPM variant used by StarCoder and CodeLlama).
struct spm {
  static constexpr std::string_view name = "spm";
  static constexpr bool typed_at_end = true;
  static prompt_layout layout(const infill_request& r, const fim_token_set& set) {
    prompt_layout l = detail::start(set);
    l.add_special(fim_role::prefix);
    l.add_special(fim_role::suffix);
    l.add_text({r.suffix});
    l.add_special(fim_role::middle);
    l.add_text({r.prefix}, r.typed);
    return l;
  }
};

// <PRE> prefix <SUF> suffix <MID> typed: the session's first prompt stays fixed and what was typed
// since is appended, so every earlier token stays a cached prefix.
struct efim {
  static constexpr std::string_view name = "efim";
  static constexpr bool typed_at_end = true;
  static prompt_layout layout(const infill_request& r, const fim_token_set& set) {
    prompt_layout l = detail::start(set);
    l.add_special(fim_role::prefix);
    l.add_text({r.prefix});
    l.add_special(fim_role::suffix);
    l.add_text({r.suffix});
    l.add_special(fim_role::middle);
    l.add_text({}, r.typed);
    return l;
  }
};

static_assert(fim_format<psm>);
static_assert(fim_format<spm>);
static_assert(fim_format<efim>);

}  // namespace efim::prompt
