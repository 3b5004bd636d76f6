#pragma once
// Format policies: prefix-suffix-middle, suffix-prefix-middle, and EFIM.
#include <string_view>

#include "efim/prompt/concepts.hpp"

namespace efim::prompt {

namespace detail {
// BOS when the family wants it, then the extra context files, if any, in the repository-level
// layout llama.cpp's /infill uses (Qwen2.5-Coder's): <repo_name>myproject\n, then <file_sep>NAME\n
// TEXT per file, then <file_sep>filename\n before the infill. A family without those tokens gets
// the files separated by a plain-text snippet marker. Each piece is tokenized on its own.
inline prompt_layout start(const infill_request& r, const fim_token_set& set) {
  static constexpr std::string_view repository = "myproject\n", newline = "\n", current_file = "filename\n",
                                    snippet = "\n\n--- snippet ---\n\n";
  prompt_layout l;
  if (set.add_bos && !set.bos.empty()) l.add_special(fim_role::bos);
  if (r.extra.empty()) return l;
  const bool files = !set.file_sep.empty();
  if (!set.repo_name.empty()) {
    l.add_special(fim_role::repo_name);
    l.add_text({repository});
  }
  for (const auto& f : r.extra) {
    if (files) {
      l.add_special(fim_role::file_sep);
      l.add_text({f.name, newline});
    } else {
      l.add_text({snippet});
    }
    l.add_text({f.text});
  }
  if (files) {
    l.add_special(fim_role::file_sep);
    l.add_text({current_file});
  }
  return l;
}
}  // namespace detail

// <PRE> prefix typed <SUF> suffix <MID>: typing changes the text before the suffix, so the
// suffix's KV is recomputed on every keystroke.
struct psm {
  static constexpr std::string_view name = "psm";
  static constexpr bool typed_at_end = false;
  static prompt_layout layout(const infill_request& r, const fim_token_set& set) {
    prompt_layout l = detail::start(r, set);
    l.add_special(fim_role::prefix);
    l.add_text({r.prefix}, r.typed, r.typed_ids);
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
    prompt_layout l = detail::start(r, set);
    l.add_special(fim_role::prefix);
    l.add_special(fim_role::suffix);
    l.add_text({r.suffix});
    l.add_special(fim_role::middle);
    l.add_text({r.prefix}, r.typed, r.typed_ids);
    return l;
  }
};

// <PRE> prefix <SUF> suffix <MID> typed: the session's first prompt stays fixed and what was typed
// since is appended, so every earlier token stays a cached prefix. (Not named `efim`: a type of that
// name inside namespace efim would hide the namespace from code in it and from users' using-directives.)
struct efim_format {
  static constexpr std::string_view name = "efim";
  static constexpr bool typed_at_end = true;
  static prompt_layout layout(const infill_request& r, const fim_token_set& set) {
    prompt_layout l = detail::start(r, set);
    l.add_special(fim_role::prefix);
    l.add_text({r.prefix});
    l.add_special(fim_role::suffix);
    l.add_text({r.suffix});
    l.add_special(fim_role::middle);
    l.add_text({}, r.typed, r.typed_ids);
    return l;
  }
};

static_assert(fim_format<psm>);
static_assert(fim_format<spm>);
static_assert(fim_format<efim_format>);

}  // namespace efim::prompt
