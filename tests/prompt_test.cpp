#include <catch2/catch.hpp>
#include <string>
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
  CHECK(render(prompt::efim::layout(r, q), q) == "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>x, y");
  // Families that start with BOS get it first.
  const auto& d = prompt::deepseek_coder;
  CHECK(render(prompt::psm::layout(r, d), d).starts_with(std::string(d.bos) + std::string(d.prefix)));
  // The typed fragments stay separate segments' pieces in EFIM.
  const auto efim_layout = prompt::efim::layout(r, q);
  REQUIRE(efim_layout.segments.size() == 6);
  CHECK(efim_layout.segments.back().fragments.size() == 2);
}

TEST_CASE("formats handle an empty prefix and suffix", "[prompt][format]") {
  const prompt::infill_request empty{"", "", {}};
  const auto& q = prompt::qwen25_coder;
  CHECK(render(prompt::psm::layout(empty, q), q) == "<|fim_prefix|><|fim_suffix|><|fim_middle|>");
  CHECK(prompt::efim::layout(empty, q).segments.size() == 3);
  const text::byte_tokenizer tok(q.special_tokens());
  text::at_boundaries frag;
  std::vector<token_id> ids;
  prompt::encode(prompt::efim::layout(empty, q), tok, q, frag, ids);
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
  CHECK(render(prompt::efim::layout(r, q), q) ==
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
      prompt::encode(prompt::efim::layout(r, q), tok, q, frag, ids);
    } else {
      text::at_boundaries frag;
      prompt::encode(prompt::efim::layout(r, q), tok, q, frag, ids);
    }
    CHECK(ids == std::vector<token_id>{*tok.special_id(q.prefix), 'a', *tok.special_id(q.suffix), 'b',
                                       *tok.special_id(q.middle), 'c', 'd', 900, 901, 'g'});
  }
  // A piece encoder sees every piece that is tokenized, and only those.
  std::vector<std::string> pieces;
  std::vector<token_id> ids;
  text::at_boundaries frag;
  prompt::encode(prompt::efim::layout(r, q), tok, q, frag, ids, [&](std::string_view piece, std::vector<token_id>& o) {
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

TEST_CASE("session table: requests find their session by content", "[prompt][session]") {
  prompt::session_table<int> t;
  const std::string doc_a = "def alpha(x):\n    return x + 1\n", doc_b = "class Beta:\n    pass\n";
  const auto store = [&](const std::string& key, std::string_view scope, std::string_view prefix,
                         std::string_view suffix) {
    auto* e = t.find(key);
    auto entry = e ? *e : prompt::session_table<int>::entry{prompt::infill_session{}, 0, std::string(scope), true, 0};
    const auto u = entry.session.update(prefix, suffix);
    t.store(key, std::move(entry));
    return u.kind;
  };
  const auto a = t.match("", doc_a.substr(0, 20), doc_a.substr(20));
  CHECK(store(a, "", doc_a.substr(0, 20), doc_a.substr(20)) == change::first);
  const auto b = t.match("", doc_b.substr(0, 12), doc_b.substr(12));
  CHECK(b != a);
  store(b, "", doc_b.substr(0, 12), doc_b.substr(12));
  // Typing at the cursor: the same session.
  CHECK(t.match("", doc_a.substr(0, 20) + "abc", doc_a.substr(20)) == a);
  CHECK(store(a, "", doc_a.substr(0, 20) + "abc", doc_a.substr(20)) == change::append);
  // Another scope (tenant) never finds it.
  CHECK(t.match("tenant-2", doc_a.substr(0, 20) + "abc", doc_a.substr(20)) != a);
  // A jump a few characters back in the same document: the most similar session.
  const std::string typed_doc = doc_a.substr(0, 20) + "abc" + doc_a.substr(20);
  CHECK(t.match("", typed_doc.substr(0, 15), typed_doc.substr(15)) == a);
  CHECK(store(a, "", typed_doc.substr(0, 15), typed_doc.substr(15)) == change::cursor_moved);
  // A small edit after the cursor: still that session, as a suffix change.
  const std::string edited = typed_doc.substr(15, 5) + "#" + typed_doc.substr(20);
  CHECK(t.match("", typed_doc.substr(0, 15), edited) == a);
  CHECK(store(a, "", typed_doc.substr(0, 15), edited) == change::suffix_changed);
  // A request too small to tell: no session.
  CHECK(t.match("", "x", "").empty());
  // Of two sessions whose anchors the prefix extends, the longer anchor wins.
  const std::string c = "#longer";
  store(c, "", typed_doc.substr(0, 25), edited);
  CHECK(t.match("", typed_doc.substr(0, 27), edited) == c);
  CHECK(t.match("", typed_doc.substr(0, 16), edited) == a);
}

TEST_CASE("session table: the least recently used session goes first, and the index follows", "[prompt][session]") {
  prompt::session_table_options o;
  o.max_sessions = 3;
  prompt::session_table<int> t(o);
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) {
    const std::string prefix = std::string(20, static_cast<char>('a' + i)), suffix = "\n";
    const auto key = t.match("", prefix, suffix);
    prompt::session_table<int>::entry e{prompt::infill_session{}, i, "", true, 0};
    e.session.update(prefix, suffix);
    t.store(key, std::move(e));
    keys.push_back(key);
    CHECK(t.size() == static_cast<std::size_t>(std::min(i + 1, 3)));
  }
  CHECK(t.find(keys[0]) == nullptr);
  CHECK(t.find(keys[1]) == nullptr);
  REQUIRE(t.find(keys[4]) != nullptr);
  CHECK(t.find(keys[4])->data == 4);
  // A dropped session is not found by content any more; a live one is.
  CHECK(t.match("", std::string(20, 'a') + "!", "\n") != keys[0]);
  CHECK(t.match("", std::string(20, 'e') + "!", "\n") == keys[4]);
  t.erase(keys[4]);
  CHECK(t.match("", std::string(20, 'e') + "!", "\n") != keys[4]);
  // A budget in bytes drops the oldest too, and the count follows every change.
  prompt::session_table_options small;
  small.max_bytes = 100;
  prompt::session_table<int> b(small);
  for (int i = 0; i < 4; ++i) {
    prompt::session_table<int>::entry e{prompt::infill_session{}, i, "", true, 0};
    e.session.update(std::string(40, static_cast<char>('a' + i)), "");
    b.store("k" + std::to_string(i), std::move(e));
  }
  CHECK(b.size() == 2);
  CHECK(b.bytes() == 84);
  CHECK(b.find("k3") != nullptr);
  b.erase("k3");
  CHECK(b.bytes() == 42);
}
