#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/random.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/prompt/session.hpp"
#include "efim/prompt/session_table.hpp"
#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/fragment.hpp"

using namespace efim;
using prompt::change;

namespace {
// Renders a layout with the token set's sentinel strings, to compare with the expected prompt.
std::string render(const prompt::prompt_layout& l, const prompt::fim_token_set& set) {
  std::string out;
  for (const auto& s : l.segments) {
    if (s.type == prompt::segment::kind::special)
      out += set.text(s.role);
    else
      for (const auto f : s.fragments) out += f;
  }
  return out;
}

std::vector<std::string> fragments_of(const prompt::infill_session& s) {
  std::vector<std::string> out;
  for (const auto f : s.request().typed) out.emplace_back(f);
  return out;
}
}  // namespace

TEST_CASE("token sets hold each family's sentinels", "[prompt]") {
  CHECK(prompt::qwen25_coder.prefix == "<|fim_prefix|>");
  CHECK(prompt::starcoder.middle == "<fim_middle>");
  CHECK(prompt::deepseek_coder.suffix ==
        "<\xEF\xBD\x9C"
        "fim\xE2\x96\x81"
        "hole\xEF\xBD\x9C>");
  CHECK(prompt::codellama.prefix == "\xE2\x96\x81<PRE>");
  CHECK(prompt::find_token_set("starcoder") == &prompt::starcoder);
  CHECK(prompt::find_token_set("nope") == nullptr);
  const auto specials = prompt::qwen25_coder.special_tokens();
  CHECK(specials.size() == 7);
  CHECK(specials.front() == "<|fim_prefix|>");
  for (const auto* set : prompt::known_token_sets) {
    CHECK_FALSE(set->prefix.empty());
    CHECK_FALSE(set->suffix.empty());
    CHECK_FALSE(set->middle.empty());
    CHECK_FALSE(set->eos.empty());
  }
}

TEST_CASE("formats lay out prefix, suffix and typed text", "[prompt][format]") {
  const prompt::infill_request r{"def f(", "):\n", {"x", ", y"}};
  const auto& q = prompt::qwen25_coder;
  CHECK(render(prompt::psm::layout(r, q), q) == "<|fim_prefix|>def f(x, y<|fim_suffix|>):\n<|fim_middle|>");
  CHECK(render(prompt::spm::layout(r, q), q) == "<|fim_prefix|><|fim_suffix|>):\n<|fim_middle|>def f(x, y");
  CHECK(render(prompt::efim_format::layout(r, q), q) == "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>x, y");
  // Families that start with BOS get it first.
  const auto& d = prompt::deepseek_coder;
  CHECK(render(prompt::psm::layout(r, d), d).starts_with(std::string(d.bos) + std::string(d.prefix)));
  // The typed fragments stay separate segments' pieces in EFIM.
  const auto efim_layout = prompt::efim_format::layout(r, q);
  REQUIRE(efim_layout.segments.size() == 6);
  CHECK(efim_layout.segments.back().fragments.size() == 2);
}

TEST_CASE("formats handle an empty prefix and suffix", "[prompt][format]") {
  const prompt::infill_request empty{"", "", {}};
  const auto& q = prompt::qwen25_coder;
  CHECK(render(prompt::psm::layout(empty, q), q) == "<|fim_prefix|><|fim_suffix|><|fim_middle|>");
  CHECK(prompt::efim_format::layout(empty, q).segments.size() == 3);
  const text::byte_tokenizer tok(q.special_tokens());
  text::at_boundaries frag;
  std::vector<token_id> ids;
  prompt::encode(prompt::efim_format::layout(empty, q), tok, q, frag, ids);
  CHECK(ids.size() == 3);
}

TEST_CASE("encode maps sentinels to ids and fails clearly when the vocabulary lacks one", "[prompt][encode]") {
  const auto& q = prompt::qwen25_coder;
  const text::byte_tokenizer tok(q.special_tokens());
  text::whole frag;
  std::vector<token_id> ids;
  prompt::encode(prompt::psm::layout({"a", "b", {}}, q), tok, q, frag, ids);
  CHECK(ids == std::vector<token_id>{*tok.special_id(q.prefix), 'a', *tok.special_id(q.suffix), 'b',
                                     *tok.special_id(q.middle)});
  const text::byte_tokenizer starcoder_tok(prompt::starcoder.special_tokens());
  try {
    prompt::encode(prompt::psm::layout({"a", "b", {}}, q), starcoder_tok, q, frag, ids);
    FAIL("expected an error");
  } catch (const efim::error& e) {
    CHECK(e.code() == errc::unknown_token);
    CHECK(std::string(e.what()).find("<|fim_prefix|>") != std::string::npos);
  }
}

TEST_CASE("session: the first request is the anchor", "[prompt][session]") {
  prompt::infill_session s;
  const auto u = s.update("int x = ", ";\n");
  CHECK(u.kind == change::first);
  CHECK(s.anchor_prefix() == "int x = ");
  CHECK(s.typed().empty());
  CHECK(s.request().typed.empty());
}

TEST_CASE("session: typed text appended after the anchor prefix continues EFIM", "[prompt][session]") {
  prompt::infill_session s;
  s.update("int x = ", ";\n");
  auto u = s.update("int x = fo", ";\n");
  CHECK(u.kind == change::append);
  CHECK(u.typed_bytes == 2);
  CHECK(u.kept_bytes == 0);
  u = s.update("int x = foo(", ";\n");
  CHECK(u.kind == change::append);
  CHECK(u.kept_bytes == 2);
  CHECK(s.typed() == "foo(");
  // Each request's new text is its own fragment, so earlier ids never change.
  CHECK(fragments_of(s) == std::vector<std::string>{"fo", "o("});
  // The same request again is an append of nothing.
  u = s.update("int x = foo(", ";\n");
  CHECK(u.kind == change::append);
  CHECK(fragments_of(s) == std::vector<std::string>{"fo", "o("});
}

TEST_CASE("session: deleting inside the typed part keeps the shorter match", "[prompt][session]") {
  prompt::infill_session s;
  s.update("x = ", "\n");
  s.update("x = ab", "\n");
  s.update("x = abcd", "\n");
  s.update("x = abcdef", "\n");
  REQUIRE(fragments_of(s) == std::vector<std::string>{"ab", "cd", "ef"});
  auto u = s.update("x = abc", "\n");  // backspace x3
  CHECK(u.kind == change::edit);
  CHECK(u.kept_bytes == 3);
  CHECK(s.typed() == "abc");
  CHECK(fragments_of(s) == std::vector<std::string>{"ab", "c"});
  u = s.update("x = abcXY", "\n");  // typing goes on from there
  CHECK(u.kind == change::append);
  CHECK(fragments_of(s) == std::vector<std::string>{"ab", "c", "XY"});
  u = s.update("x = aQ", "\n");  // a change, not only a deletion
  CHECK(u.kind == change::edit);
  CHECK(u.kept_bytes == 1);
  CHECK(fragments_of(s) == std::vector<std::string>{"a", "Q"});
  // Deleting everything typed goes back to the anchor itself.
  u = s.update("x = ", "\n");
  CHECK(u.kind == change::edit);
  CHECK(s.request().typed.empty());
}

TEST_CASE("session: an edit never splits a character", "[prompt][session]") {
  prompt::infill_session s;
  s.update("s = ", "");
  s.update("s = \"caf\xC3\xA9", "");                 // café
  const auto u = s.update("s = \"caf\xC3\xA8", "");  // cafè: same lead byte C3
  CHECK(u.kind == change::edit);
  CHECK(u.kept_bytes == 4);  // '"caf'
}

TEST_CASE("session: a typed part past the threshold re-anchors", "[prompt][session]") {
  prompt::infill_session s(prompt::session_options{8});
  s.update("p", "s");
  CHECK(s.update("p12345678", "s").kind == change::append);
  const auto u = s.update("p123456789", "s");
  CHECK(u.kind == change::reanchor);
  CHECK(prompt::starts_anchor(u.kind));
  CHECK(s.anchor_prefix() == "p123456789");
  CHECK(s.typed().empty());
  CHECK(s.update("p123456789x", "s").kind == change::append);
}

TEST_CASE("session: a changed suffix or a cursor jump starts a new anchor", "[prompt][session]") {
  prompt::infill_session s;
  s.update("a = 1\nb = ", "\nc = 3\n");
  s.update("a = 1\nb = 2", "\nc = 3\n");
  auto u = s.update("a = 1\nb = 2", "\nc = 4\n");  // edit after the cursor
  CHECK(u.kind == change::suffix_changed);
  CHECK(s.anchor_suffix() == "\nc = 4\n");
  CHECK(s.typed().empty());
  u = s.update("a = ", "1\nb = 2\nc = 4\n");  // cursor jumped up in the same text
  CHECK(u.kind == change::cursor_moved);
  u = s.update("a", " = 1\nb = 2\nc = 5\n");  // moved and edited after the cursor
  CHECK(u.kind == change::suffix_changed);
  u = s.update("a = 1\nb", " = 2\nc = 5\n");  // jumped down
  CHECK(u.kind == change::cursor_moved);
  // Same suffix, but the prefix no longer extends the anchor (deleted into it).
  s.update("def f():\n    ", "\n");
  u = s.update("def f():\n", "\n");
  CHECK(u.kind == change::cursor_moved);
  CHECK(s.anchor_prefix() == "def f():\n");
}

TEST_CASE("session: invalid UTF-8 is rejected and the session is unchanged", "[prompt][session]") {
  prompt::infill_session s;
  s.update("ok ", "");
  s.update("ok go", "");
  CHECK_THROWS_AS(s.update("ok go\xFF", ""), efim::error);
  CHECK_THROWS_AS(s.update("ok go", "\xC3"), efim::error);
  CHECK(s.typed() == "go");
  CHECK(s.update("ok go!", "").kind == change::append);
}

TEST_CASE("session: empty prefix and suffix are a valid anchor", "[prompt][session]") {
  prompt::infill_session s;
  CHECK(s.update("", "").kind == change::first);
  CHECK(s.update("x", "").kind == change::append);
  CHECK(s.typed() == "x");
}

TEST_CASE("session: random editing keeps the anchor + typed fragments equal to the editor's text",
          "[prompt][session][fuzz]") {
  // An editor over a small document: typing, deleting, moving the cursor, editing after it.
  rng r(9);
  const std::string alphabet[] = {"a", "b", " ", "\n", "(", "\xC3\xA9", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80"};
  prompt::infill_session s(prompt::session_options{64});
  std::string text = "def f():\n    return 1\n";
  std::size_t cursor = 10;
  for (int step = 0; step < 20000; ++step) {
    const auto op = r.below(10);
    if (op < 6) {  // type a character
      const auto& c = alphabet[r.below(std::size(alphabet))];
      text.insert(cursor, c);
      cursor += c.size();
    } else if (op < 8 && cursor > 0) {  // backspace one character
      const std::size_t start = utf8::floor_boundary(text, cursor - 1);
      text.erase(start, cursor - start);
      cursor = start;
    } else if (op == 8) {  // move the cursor
      cursor = utf8::floor_boundary(text, r.below(text.size() + 1));
    } else {  // edit after the cursor
      text.insert(utf8::floor_boundary(text, cursor + r.below(text.size() - cursor + 1)), "x");
    }
    const std::string prefix = text.substr(0, cursor), suffix = text.substr(cursor);
    const auto u = s.update(prefix, suffix);
    const auto req = s.request();
    std::string rebuilt(req.prefix);
    for (const auto f : req.typed) {
      REQUIRE_FALSE(f.empty());
      REQUIRE(utf8::is_valid(f));
      rebuilt += f;
    }
    REQUIRE(rebuilt == prefix);
    REQUIRE(req.suffix == suffix);
    REQUIRE(u.typed_bytes == s.typed().size());
    REQUIRE(u.typed_bytes <= 64);
    REQUIRE(u.kept_bytes <= u.typed_bytes);
    if (prompt::starts_anchor(u.kind)) REQUIRE(req.typed.empty());
  }
}

TEST_CASE("context files are laid out before the infill, repository-style where the family has the tokens",
          "[prompt][format]") {
  prompt::infill_request r{"def f(", "):\n", {"x"}};
  r.extra = {{"util.py", "def g(): pass\n"}, {"main.py", "import util\n"}};
  const auto& q = prompt::qwen25_coder;
  CHECK(render(prompt::efim_format::layout(r, q), q) ==
        "<|repo_name|>myproject\n<|file_sep|>util.py\ndef g(): pass\n<|file_sep|>main.py\nimport util\n"
        "<|file_sep|>filename\n<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>x");
  CHECK(render(prompt::psm::layout(r, q), q).starts_with("<|repo_name|>myproject\n<|file_sep|>util.py\n"));
  // Without file separator tokens: a plain-text marker per file, after BOS.
  const auto& c = prompt::codellama;
  CHECK(render(prompt::spm::layout(r, c), c) ==
        std::string(c.bos) + "\n\n--- snippet ---\n\ndef g(): pass\n\n\n--- snippet ---\n\nimport util\n" +
            std::string(c.prefix) + std::string(c.suffix) + "):\n" + std::string(c.middle) + "def f(x");
}

TEST_CASE("encode takes known ids for a fragment instead of tokenizing it", "[prompt][encode]") {
  const auto& q = prompt::qwen25_coder;
  const text::byte_tokenizer tok(q.special_tokens());
  const std::vector<token_id> known{900, 901};
  prompt::infill_request r{"a", "b", {"cd", "ef", "g"}};
  r.typed_ids = {{}, known, {}};
  for (const bool whole : {false, true}) {
    std::vector<token_id> ids;
    if (whole) {
      text::whole frag;
      prompt::encode(prompt::efim_format::layout(r, q), tok, q, frag, ids);
    } else {
      text::at_boundaries frag;
      prompt::encode(prompt::efim_format::layout(r, q), tok, q, frag, ids);
    }
    CHECK(ids == std::vector<token_id>{*tok.special_id(q.prefix), 'a', *tok.special_id(q.suffix), 'b',
                                       *tok.special_id(q.middle), 'c', 'd', 900, 901, 'g'});
  }
  // A piece encoder sees every piece that is tokenized, and only those.
  std::vector<std::string> pieces;
  std::vector<token_id> ids;
  text::at_boundaries frag;
  prompt::encode(prompt::efim_format::layout(r, q), tok, q, frag, ids,
                 [&](std::string_view piece, std::vector<token_id>& o) {
                   pieces.emplace_back(piece);
                   tok.encode(piece, o);
                 });
  CHECK(pieces == std::vector<std::string>{"a", "b", "cd", "g"});
}

namespace {
// Records `text` as generated after the session's current state, one token per `piece`.
void record(prompt::infill_session& s, const std::vector<std::string>& pieces, token_id first_id = 1000) {
  std::vector<token_id> ids;
  std::string bytes;
  std::vector<std::size_t> ends;
  for (const auto& p : pieces) {
    ids.push_back(first_id++);
    bytes += p;
    ends.push_back(bytes.size());
  }
  s.record_generation(s.version(), ids, bytes, ends);
}

std::vector<std::vector<token_id>> ids_of(const prompt::infill_session& s) {
  std::vector<std::vector<token_id>> out;
  const auto r = s.request();
  for (std::size_t i = 0; i < r.typed.size(); ++i)
    out.emplace_back(i < r.typed_ids.size() ? std::vector<token_id>(r.typed_ids[i].begin(), r.typed_ids[i].end())
                                            : std::vector<token_id>{});
  return out;
}
}  // namespace

TEST_CASE("session: text the model generated, then typed (accepted), keeps the generated ids", "[prompt][session]") {
  prompt::infill_session s;
  s.update("x = ", "\n");
  s.update("x = fo", "\n");
  record(s, {"o(", "a", ", b", ")"});
  // The whole suggestion accepted, then more typed: the generated tokens are one known fragment.
  auto u = s.update("x = foo(a, b); y", "\n");
  CHECK(u.kind == change::accepted);
  CHECK(u.reused_tokens == 4);
  CHECK(fragments_of(s) == std::vector<std::string>{"fo", "o(a, b)", "; y"});
  CHECK(ids_of(s) == std::vector<std::vector<token_id>>{{}, {1000, 1001, 1002, 1003}, {}});
  // Typing on keeps it; deleting into it drops it.
  u = s.update("x = foo(a, b); yz", "\n");
  CHECK(u.kind == change::append);
  CHECK(ids_of(s)[1] == std::vector<token_id>{1000, 1001, 1002, 1003});
  u = s.update("x = foo(a", "\n");
  CHECK(u.kind == change::edit);
  CHECK(ids_of(s) == std::vector<std::vector<token_id>>{{}, {}});
  CHECK(fragments_of(s) == std::vector<std::string>{"fo", "o(a"});
}

TEST_CASE("session: a partly accepted suggestion reuses its whole tokens only", "[prompt][session]") {
  prompt::infill_session s;
  s.update("s = ", "\n");
  record(s, {"\"h", "\xC3\xA9", "llo\"", ";"});  // "é" is one token
  // Up to the middle of a token: the tokens before it.
  auto u = s.update("s = \"h\xC3\xA9ll", "\n");
  CHECK(u.kind == change::accepted);
  CHECK(u.reused_tokens == 2);
  CHECK(fragments_of(s) == std::vector<std::string>{"\"h\xC3\xA9", "ll"});
  // Text that differs from the first generated token: a plain append.
  prompt::infill_session t;
  t.update("s = ", "\n");
  record(t, {"abc"});
  CHECK(t.update("s = abd", "\n").kind == change::append);
  // A generation recorded against an older state is ignored.
  prompt::infill_session v;
  v.update("s = ", "\n");
  const auto old = v.version();
  v.update("s = q", "\n");
  v.record_generation(old, {7}, "r", {1});
  CHECK(v.update("s = qr", "\n").kind == change::append);
}

TEST_CASE("session: context files are kept until the anchor is renewed", "[prompt][session]") {
  prompt::infill_session s;
  const std::vector<prompt::context_file> a{{"a.py", "A"}}, b{{"b.py", "B"}};
  s.update("x = ", "\n", a);
  CHECK(s.update("x = 1", "\n", b).kind == change::append);
  REQUIRE(s.request().extra.size() == 1);
  CHECK(s.request().extra[0].name == "a.py");
  // A prefill-only request renews the anchor with its files.
  CHECK(s.update("x = 1", "\n", b, true).kind == change::reanchor);
  CHECK(s.request().extra[0].name == "b.py");
  CHECK(s.typed().empty());
  CHECK(s.anchor_prefix() == "x = 1");
  CHECK_THROWS_AS(s.update("x = 1", "\n", std::vector<prompt::context_file>{{"\xFF", ""}}), efim::error);
  CHECK(s.request().extra[0].name == "b.py");
}

namespace {
using table = prompt::session_table<int>;

// A request of `scope` found by its content.
prompt::session_query by_content(std::string_view scope, std::string_view prefix, std::string_view suffix) {
  return {.tenant = scope, .key = {}, .match = true, .prefix = prefix, .suffix = suffix};
}
}  // namespace

TEST_CASE("session table: requests find their session by content", "[prompt][session]") {
  table t;
  const std::string doc_a = "def alpha(x):\n    return x + 1\n", doc_b = "class Beta:\n    pass\n";
  const auto apply = [&](std::string_view scope, std::string_view prefix, std::string_view suffix) {
    return t.apply(by_content(scope, prefix, suffix));
  };
  const auto a = apply("", doc_a.substr(0, 20), doc_a.substr(20));
  CHECK(a.update.kind == change::first);
  CHECK(a.key.starts_with("#"));
  const auto b = apply("", doc_b.substr(0, 12), doc_b.substr(12));
  CHECK(b.key != a.key);
  // Typing at the cursor: the same session.
  CHECK(t.match("", doc_a.substr(0, 20) + "abc", doc_a.substr(20)) == a.key);
  const auto typed = apply("", doc_a.substr(0, 20) + "abc", doc_a.substr(20));
  CHECK(typed.key == a.key);
  CHECK(typed.update.kind == change::append);
  CHECK(typed.request().typed == std::vector<std::string_view>{"abc"});
  // Another scope (tenant) never finds it.
  CHECK(t.match("tenant-2", doc_a.substr(0, 20) + "abc", doc_a.substr(20)).empty());
  CHECK(apply("tenant-2", doc_a.substr(0, 20) + "abc", doc_a.substr(20)).update.kind == change::first);
  // A jump a few characters back in the same document: the most similar session.
  const std::string typed_doc = doc_a.substr(0, 20) + "abc" + doc_a.substr(20);
  CHECK(t.match("", typed_doc.substr(0, 15), typed_doc.substr(15)) == a.key);
  const auto jump = apply("", typed_doc.substr(0, 15), typed_doc.substr(15));
  CHECK(jump.key == a.key);
  CHECK(jump.update.kind == change::cursor_moved);
  // A small edit after the cursor: still that session, as a suffix change.
  const std::string edited = typed_doc.substr(15, 5) + "#" + typed_doc.substr(20);
  CHECK(t.match("", typed_doc.substr(0, 15), edited) == a.key);
  CHECK(apply("", typed_doc.substr(0, 15), edited).update.kind == change::suffix_changed);
  // A request too small to tell: no session, and nothing stored.
  const std::size_t kept = t.size();
  CHECK(t.match("", "x", "").empty());
  const auto small = apply("", "x", "");
  CHECK(small.key.empty());
  CHECK(small.request().prefix == "x");
  CHECK(t.size() == kept);
  // A keyed session is never found by content.
  const auto keyed =
      t.apply({.tenant = "", .key = "k", .match = false, .prefix = typed_doc.substr(0, 25), .suffix = edited});
  CHECK(keyed.key != a.key);
  CHECK(t.match("", typed_doc.substr(0, 27), edited) == a.key);
  // Of two sessions whose anchors the prefix extends, the longer anchor wins.
  table nested({.min_similarity = 2.0});  // no match by likeness
  const auto longer = nested.apply(by_content("", typed_doc.substr(0, 25), edited));
  const auto shorter = nested.apply(by_content("", typed_doc.substr(0, 15), edited));
  CHECK(longer.key != shorter.key);
  CHECK(nested.match("", typed_doc.substr(0, 27), edited) == longer.key);
  CHECK(nested.match("", typed_doc.substr(0, 16), edited) == shorter.key);
}

TEST_CASE("session table: the least recently used session goes first, and the index follows", "[prompt][session]") {
  prompt::session_table_options o;
  o.max_sessions = 3;
  table t(o);
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) {
    const std::string prefix = std::string(20, static_cast<char>('a' + i)), suffix = "\n";
    keys.push_back(t.apply(by_content("", prefix, suffix), i).key);
    CHECK(t.size() == static_cast<std::size_t>(std::min(i + 1, 3)));
    CHECK(t.indexed() == t.size());
  }
  CHECK_FALSE(t.find(keys[0]));
  CHECK_FALSE(t.find(keys[1]));
  REQUIRE(t.find(keys[4]));
  CHECK(t.find(keys[4])->data == 4);
  // A dropped session is not found by content any more; a live one is.
  CHECK(t.match("", std::string(20, 'a') + "!", "\n").empty());
  CHECK(t.match("", std::string(20, 'e') + "!", "\n") == keys[4]);
  t.erase(keys[4]);
  CHECK(t.match("", std::string(20, 'e') + "!", "\n").empty());
  CHECK(t.indexed() == 2);
  // A budget in bytes drops the oldest too, and the count follows every change.
  prompt::session_table_options small;
  small.max_bytes = 100;
  table b(small);
  for (int i = 0; i < 4; ++i)
    b.apply({.tenant = "",
             .key = "k" + std::to_string(i),
             .match = false,
             .prefix = std::string(40, static_cast<char>('a' + i)),
             .suffix = ""},
            i);
  CHECK(b.size() == 2);
  CHECK(b.bytes() == 2 * (40 + 5));  // the text and the table's key ("=0:k3")
  b.end("", "k3");
  CHECK(b.size() == 1);
  CHECK(b.bytes() == 45);
}

TEST_CASE("session table: a refused request changes nothing; stored sessions never change in place",
          "[prompt][session]") {
  table t;
  const prompt::session_query first{
      .tenant = "t", .key = "doc", .match = false, .prefix = "int f() {\n  return ", .suffix = ";\n}\n"};
  const auto turn = t.apply(first, 1);
  const auto before = t.find(turn.key);
  REQUIRE(before);
  // The check refuses (a prompt too long, say): the session is as it was, its data too.
  auto next = first;
  next.prefix = "int f() {\n  return 4";
  CHECK_THROWS_WITH(t.apply(next, 2, [](const prompt::infill_request&) { throw std::runtime_error("too long"); }),
                    "too long");
  const auto after = t.find(turn.key);
  REQUIRE(after);
  CHECK(after->session == before->session);
  CHECK(after->data == 1);
  CHECK(after->session->typed().empty());
  // Invalid UTF-8 the same.
  next.prefix = "int f() {\n  return \xFF";
  CHECK_THROWS_AS(t.apply(next, 2), efim::error);
  CHECK(t.find(turn.key)->session == before->session);
  // A turn keeps the session it laid out, whatever comes after.
  next.prefix = "int f() {\n  return 4";
  const auto typed = t.apply(next, 2);
  next.prefix = "int g";
  (void)t.apply(next, 3);
  CHECK(typed.request().typed == std::vector<std::string_view>{"4"});
  CHECK(typed.session->anchor_prefix() == "int f() {\n  return ");
  CHECK(turn.session->typed().empty());
}

TEST_CASE("session table: the content index holds exactly the sessions found by content", "[prompt][session]") {
  // Anchors that move (jumps, suffix edits, re-anchors), sessions dropped by the limits and erased:
  // every content-matched session is indexed once, and nothing else is.
  prompt::session_table_options o;
  o.max_sessions = 6;
  table t(o, {.reanchor_bytes = 8});
  rng r(5);
  std::vector<std::string> keys;
  for (int i = 0; i < 400; ++i) {
    const std::string doc = "document " + std::to_string(r.below(8)) + " " + std::string(20, 'x');
    const std::size_t cursor = 10 + r.below(doc.size() - 10);
    std::string prefix = doc.substr(0, cursor) + std::string(r.below(12), 'y');
    std::string suffix = doc.substr(cursor) + (r.below(4) == 0 ? "#" : "");
    const auto turn = r.below(5) == 0 ? t.apply({.tenant = "",
                                                 .key = "k" + std::to_string(r.below(3)),
                                                 .match = false,
                                                 .prefix = prefix,
                                                 .suffix = suffix})
                                      : t.apply(by_content(r.below(3) == 0 ? "other" : "", prefix, suffix));
    keys.push_back(turn.key);
    if (r.below(10) == 0) t.erase(keys[r.below(keys.size())]);
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    std::size_t by_content_sessions = 0;
    for (const auto& k : keys)
      if (const auto e = t.find(k); e && e->by_content) ++by_content_sessions;
    REQUIRE(t.indexed() == by_content_sessions);
  }
}

TEST_CASE("session table: superseding, finishing, and what the previous request generated", "[prompt][session]") {
  table t;
  const std::string prefix = "def add(a, b):\n    return ", suffix = "\n\nprint(add(1, 2))\n";
  const auto first = t.apply(by_content("", prefix, suffix), 1);
  CHECK_FALSE(first.superseded);
  // Typing on while request 1 is in flight: it is replaced.
  const auto second = t.apply(by_content("", prefix + "a", suffix), 2);
  REQUIRE(second.superseded);
  CHECK(*second.superseded == 1);
  // A jump found only by likeness may be another client's: it leaves request 2 be.
  const auto jump = t.apply(by_content("", prefix.substr(0, 20), prefix.substr(20) + "a" + suffix), 3);
  CHECK(jump.key == first.key);
  CHECK(jump.update.kind == change::cursor_moved);
  CHECK_FALSE(jump.superseded);
  // A request that ended is replaced by none; finishing another request changes nothing.
  t.finish(jump.key, 2);
  CHECK(t.find(jump.key)->data == 3);
  t.finish(jump.key, 3, prompt::generation_record{jump.version, {7, 8}, "a + b", {4, 5}});
  CHECK(t.find(jump.key)->data == 0);
  // The next request types what request 3 generated: its ids are taken (change::accepted).
  const auto accepted = t.apply(by_content("", prefix.substr(0, 20) + "a + b", prefix.substr(20) + "a" + suffix), 4);
  CHECK_FALSE(accepted.superseded);
  CHECK(accepted.update.kind == change::accepted);
  CHECK(accepted.update.reused_tokens == 2);
  const auto laid_out = accepted.request();
  REQUIRE(laid_out.typed_ids.size() == 1);
  CHECK(std::vector<token_id>(laid_out.typed_ids[0].begin(), laid_out.typed_ids[0].end()) ==
        std::vector<token_id>{7, 8});
  // A record for a version the session has moved past is ignored.
  t.finish(accepted.key, 4, prompt::generation_record{accepted.version - 1, {9}, "!", {1}});
  CHECK(t.apply(by_content("", prefix.substr(0, 20) + "a + b!", prefix.substr(20) + "a" + suffix), 5).update.kind ==
        change::append);
  // A keyed request always replaces its session's request in flight.
  const prompt::session_query keyed{.tenant = "", .key = "k", .match = false, .prefix = "x = ", .suffix = "\n"};
  (void)t.apply(keyed, 6);
  auto moved = keyed;
  moved.prefix = "y = ";
  const auto again = t.apply(moved, 7);
  REQUIRE(again.superseded);
  CHECK(*again.superseded == 6);
}

TEST_CASE("session table: concurrent requests of one session each land once, in some order", "[prompt][session]") {
  // Four threads type into one keyed session and four into sessions of their own; the checks take
  // long enough for transactions to overlap and start again. No update is lost: every stored turn
  // has a version of its own, one after another.
  table t;
  constexpr int threads = 8, rounds = 150;
  std::vector<std::vector<std::uint64_t>> versions(threads);
  std::atomic<int> checks{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w)
    workers.emplace_back([&, w] {
      const std::string key = w < 4 ? "shared" : "own" + std::to_string(w);
      for (int i = 0; i < rounds; ++i) {
        const std::string prefix = "x = " + std::string(static_cast<std::size_t>(i % 7), 'a');
        const auto turn = t.apply({.tenant = "", .key = key, .match = false, .prefix = prefix, .suffix = "\n"},
                                  w * rounds + i + 1, [&](const prompt::infill_request& r) {
                                    ++checks;
                                    volatile std::size_t spin = 0;
                                    for (std::size_t k = 0; k < 2000 + r.prefix.size(); ++k) spin = spin + k;
                                  });
        versions[static_cast<std::size_t>(w)].push_back(turn.version);
      }
    });
  for (auto& w : workers) w.join();
  std::vector<std::uint64_t> shared;
  for (int w = 0; w < 4; ++w) shared.insert(shared.end(), versions[w].begin(), versions[w].end());
  std::sort(shared.begin(), shared.end());
  CHECK(std::adjacent_find(shared.begin(), shared.end()) == shared.end());  // no two turns from one state
  CHECK(shared.back() == shared.size());                                    // none lost
  for (int w = 4; w < threads; ++w) CHECK(versions[w].back() == static_cast<std::uint64_t>(rounds));
  CHECK(checks.load() >= threads * rounds);
  CHECK(t.size() == 5);
}

// ---- a session saved and taken up elsewhere (a replica after another) ----

namespace {
// Whether a session's request is whole: its fragments valid UTF-8, and every known id list spelling
// exactly its fragment's text.
bool spelled_right(const prompt::infill_session& s, const text::byte_tokenizer& tok) {
  const auto r = s.request();
  for (std::size_t i = 0; i < r.typed.size(); ++i) {
    if (!utf8::is_valid(r.typed[i])) return false;
    if (i >= r.typed_ids.size() || r.typed_ids[i].empty()) continue;
    std::string bytes;
    for (const token_id t : r.typed_ids[i]) bytes += tok.token_bytes(t);
    if (bytes != r.typed[i]) return false;
  }
  return true;
}

bool same_request(const prompt::infill_session& a, const prompt::infill_session& b) {
  const auto x = a.request(), y = b.request();
  if (x.prefix != y.prefix || x.suffix != y.suffix || x.typed.size() != y.typed.size() ||
      x.typed_ids.size() != y.typed_ids.size() || x.extra.size() != y.extra.size())
    return false;
  for (std::size_t i = 0; i < x.typed.size(); ++i)
    if (x.typed[i] != y.typed[i]) return false;
  for (std::size_t i = 0; i < x.typed_ids.size(); ++i)
    if (!std::ranges::equal(x.typed_ids[i], y.typed_ids[i])) return false;
  for (std::size_t i = 0; i < x.extra.size(); ++i)
    if (x.extra[i].name != y.extra[i].name || x.extra[i].text != y.extra[i].text) return false;
  return a.version() == b.version();
}
}  // namespace

TEST_CASE("session: saved and loaded at any point, it lays out every next request as the original",
          "[prompt][session][fuzz]") {
  const text::byte_tokenizer tok(prompt::qwen25_coder.special_tokens());
  rng r(17);
  const std::string alphabet[] = {"a", "b", " ", "\n", "(", "\xC3\xA9", "\xE4\xB8\xAD"};
  prompt::infill_session s(prompt::session_options{48});
  std::string text = "def f():\n    return 1\n";
  std::size_t cursor = 10;
  const std::vector<prompt::context_file> extra{{"util.py", "def g(): pass\n"}};
  for (int step = 0; step < 4000; ++step) {
    const auto op = r.below(12);
    if (op < 6) {
      const auto& c = alphabet[r.below(std::size(alphabet))];
      text.insert(cursor, c);
      cursor += c.size();
    } else if (op < 8 && cursor > 0) {
      const std::size_t start = utf8::floor_boundary(text, cursor - 1);
      text.erase(start, cursor - start);
      cursor = start;
    } else if (op == 8) {
      cursor = utf8::floor_boundary(text, r.below(text.size() + 1));
    } else if (op == 9) {
      text.insert(utf8::floor_boundary(text, cursor + r.below(text.size() - cursor + 1)), "x");
    } else {  // the model suggests "ret" (one byte token each) and the editor accepts it
      std::vector<token_id> ids;
      std::string bytes;
      std::vector<std::size_t> ends;
      for (const char c : std::string("ret")) {
        ids.push_back(static_cast<unsigned char>(c));
        bytes += c;
        ends.push_back(bytes.size());
      }
      s.record_generation(s.version(), ids, bytes, ends);
      text.insert(cursor, "ret");
      cursor += 3;
    }
    const auto moved = prompt::infill_session::load(s.save(), tok, prompt::session_options{48});
    REQUIRE(moved.has_value());
    REQUIRE(same_request(s, *moved));
    auto t = *moved;
    const std::string prefix = text.substr(0, cursor), suffix = text.substr(cursor);
    const auto u = s.update(prefix, suffix, extra);
    const auto v = t.update(prefix, suffix, extra);
    REQUIRE(u.kind == v.kind);
    REQUIRE(u.typed_bytes == v.typed_bytes);
    REQUIRE(u.kept_bytes == v.kept_bytes);
    REQUIRE(u.reused_tokens == v.reused_tokens);
    REQUIRE(same_request(s, t));
    REQUIRE(spelled_right(s, tok));
  }
  CHECK_FALSE(prompt::infill_session::load(prompt::infill_session{}.save(), tok) == std::nullopt);
}

TEST_CASE("session: a saved session cut, changed or made up is refused, or loads whole", "[prompt][session][fuzz]") {
  const text::byte_tokenizer tok(prompt::qwen25_coder.special_tokens());
  prompt::infill_session s;
  s.update("def f(x):\n    ", "\n", std::vector<prompt::context_file>{{"a.py", "x = 1\n"}});
  s.update("def f(x):\n    re", "\n");
  record(s, {"t", "u", "rn"}, 't');  // ids 't', 'u', 'v': 'v' does not spell "rn"
  s.update("def f(x):\n    retu", "\n");
  std::vector<token_id> ids{'r', 'n', ' '};
  s.record_generation(s.version(), ids, "rn ", {1, 2, 3});
  s.update("def f(x):\n    return x", "\n");
  const std::string saved = s.save();
  const auto whole = prompt::infill_session::load(saved, tok);
  REQUIRE(whole.has_value());
  CHECK(same_request(s, *whole));
  for (std::size_t n = 0; n < saved.size(); ++n) {
    INFO("first " << n << " bytes");
    CHECK_FALSE(prompt::infill_session::load(std::string_view(saved).substr(0, n), tok).has_value());
  }
  CHECK_FALSE(prompt::infill_session::load(saved + "x", tok).has_value());
  for (std::size_t i = 0; i < saved.size(); ++i)
    for (const unsigned char bit : {0x01, 0x40, 0x80}) {
      std::string bad = saved;
      bad[i] = static_cast<char>(bad[i] ^ bit);
      const auto got = prompt::infill_session::load(bad, tok);
      INFO("byte " << i << " ^ " << int(bit));
      if (got) CHECK(spelled_right(*got, tok));
    }
  rng r(3);
  for (int i = 0; i < 3000; ++i) {
    std::string junk = i % 2 ? saved.substr(0, r.below(saved.size())) : std::string("EFIMSS01");
    for (std::size_t k = 0, n = r.below(64); k < n; ++k) junk += static_cast<char>(r.next());
    const auto got = prompt::infill_session::load(junk, tok);
    if (got) CHECK(spelled_right(*got, tok));
  }
  // Ids outside the vocabulary are refused, even where their text would not matter.
  std::string out_of_range = saved;
  const token_id huge = 1 << 30;
  const auto at = out_of_range.rfind(std::string(reinterpret_cast<const char*>(&ids[0]), sizeof(token_id)));
  REQUIRE(at != std::string::npos);
  out_of_range.replace(at, sizeof huge, reinterpret_cast<const char*>(&huge), sizeof huge);
  CHECK_FALSE(prompt::infill_session::load(out_of_range, tok).has_value());
}
