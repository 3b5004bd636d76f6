// Model benchmark: prefill and decode tokens/s of the host backend on GGUF models, measured side by side
// in one run with the plain f32 reference decoder (and with llama.cpp on the same files, when the
// llama.cpp reference program is built). efim's prefill logits are compared with the reference's and the
// difference printed (llama.cpp's correctness is the business of tests/reference/llama_cpp_test.cpp).
//
// Like llama-bench's pp512 / tg128: prefill is one batch of --prompt tokens from an empty cache; decode is
// --decode single-token steps from an empty cache; efim and llama.cpp time them after one untimed
// warm-up (a prompt batch and a decode step) in the same process.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../tests/support.hpp"
#include "efim/efim.hpp"
#include "efim/model/vocabulary.hpp"

namespace fs = std::filesystem;
using namespace efim;

namespace {
const char* const usage = R"(usage: efim-model-bench [options]

Times prefill (one batch of --prompt tokens) and decode (--decode single-token steps), both from an empty
cache, on each model: the host backend on --threads threads, the plain f32 reference decoder on one
thread, and llama.cpp on the same file: its prebuilt CPU libraries (efim-llama-reference) and, once
bench/build_llama_cpp.sh has built it, llama.cpp compiled here with GGML_NATIVE=ON (efim-llama-native).
The host backend and llama.cpp are timed after one untimed warm-up of each (as llama-bench does).
Prints the CPU and its vector extensions, the kernels' instruction-set path, the memory copy bandwidth
and the bandwidth of a read alone, tokens/s and ratios, and the weight bytes decode reads per second as a
share of both.
  --model FILE        a GGUF model (repeatable). Default: the Qwen2-shaped model of hidden 768, 12 layers,
                      12 heads / 2 KV heads, FFN 2048, vocabulary 151,936, in f16, q8_0, q4_0 and q4_k_m
                      (llama.cpp's Q4_K_M recipe), made with efim-model's maker into --dir (kept there)
  --dir DIR           where default models are made (bench-models)
  --prompt N          prefill tokens (512)
  --decode N          decode steps (128)
  --threads N         host backend threads (2)
  --reps N            timed repetitions, efim's and llama.cpp's in turn; the best is reported (3)
  --kv TYPE           KV cache of the host backend: f32 or f16 (f16, as llama-bench)
  --no-reference      skip the reference decoder (it takes about a minute per model)
  --no-llama          skip llama.cpp
  --llama-variants    also a row for each of llama.cpp's prebuilt CPU variants (libggml-cpu-*.so) this CPU
                      can run, each loaded alone ("llama" is the one llama.cpp picks); a variant whose
                      instructions the CPU lacks is named as not loadable
  --no-mmap           efim reads the files into memory instead of mapping them
  --no-int8           skip the row "int8": efim with int8 products (kernels::products::int8: activations
                      rounded to 8 bits for quantized weights, as llama.cpp does), timed in turn with the
                      others for quantized models, its x columns over efim's exact products, its ratios to
                      llama.cpp after them (--int8, the default, is still accepted)
  --rows, --int8-rows also a row "rows": the matrices as the file stores them, without the interleaved
                      copies the host backend makes by default (kernels/interleave.hpp): int8 products of a
                      quantized file, exact products of an f16 or bf16 file (where the host backend
                      interleaves them: the AVX-512 path off AMD CPUs, or EFIM_INTERLEAVE_FLOATS=1); timed
                      in turn with the others; x: the interleaved rows' gain
  --json FILE         write the results as JSON
)";

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "efim-model-bench: " << message << "\n";
  std::exit(2);
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<token_id> bench_tokens(std::size_t n, std::size_t vocab) {
  rng r(1234);
  std::vector<token_id> t(n);
  for (auto& x : t) x = static_cast<token_id>(r.below(std::min<std::size_t>(vocab, 150000)));
  return t;
}

using efim_test::max_relative_error;

struct timing {
  double prefill_tps = 0, decode_tps = 0;
};

// The host backend, once: prefill, then decode steps; `prefill_logits` gets the prefill's last row.
timing time_host(const model::weights& w, std::size_t threads, dtype kv_type, const std::vector<token_id>& prompt,
                 std::size_t decode, std::vector<float>& prefill_logits,
                 kernels::products products = kernels::products::exact,
                 kernels::weight_layout layout = kernels::weight_layout::interleaved8) {
  thread_pool pool(threads);
  kernels::host::context ctx{pool};
  model::transformer<kernels::host> m(w, products, layout);
  constexpr std::size_t block = 16;
  const std::size_t blocks = (std::max(prompt.size(), decode) + block - 1) / block;
  kv::host_storage kv(w.cfg.layers, m.kv_layout(blocks, block), kv_type);
  std::vector<block_id> table(blocks);
  for (std::size_t i = 0; i < blocks; ++i) table[i] = static_cast<block_id>(i);
  const auto steps = bench_tokens(decode, w.cfg.vocab);
  timing t;
  const model::batch_item all{prompt, 0, table, true};
  // The warm-up llama-bench (and the llama.cpp program here) makes before its timed runs: one prompt
  // batch and one decode step, so that threads, activations and caches are as a running server has them.
  std::vector<float> logits;
  m.forward(ctx, kv, std::span(&all, 1), logits);
  if (decode > 0) {
    const model::batch_item first{std::span(steps).first(1), 0, table, true};
    m.forward(ctx, kv, std::span(&first, 1), logits);
  }
  double t0 = now();
  m.forward(ctx, kv, std::span(&all, 1), prefill_logits);
  t.prefill_tps = static_cast<double>(prompt.size()) / (now() - t0);
  t0 = now();
  for (std::size_t i = 0; i < decode; ++i) {
    const model::batch_item one{std::span(steps).subspan(i, 1), static_cast<position>(i), table, true};
    m.forward(ctx, kv, std::span(&one, 1), logits);
  }
  t.decode_tps = static_cast<double>(decode) / (now() - t0);
  return t;
}

// The plain reference decoder, once: prefill, then decode steps with its dense cache.
timing time_reference(const model::weights& w, const std::vector<token_id>& prompt, std::size_t decode,
                      std::vector<float>& prefill_logits) {
  model::reference_model ref(w, dtype::f32);
  timing t;
  double t0 = now();
  const auto all = ref.forward(prompt);
  t.prefill_tps = static_cast<double>(prompt.size()) / (now() - t0);
  prefill_logits.assign(all.end() - static_cast<std::ptrdiff_t>(w.cfg.vocab), all.end());
  ref.reset();
  const auto steps = bench_tokens(decode, w.cfg.vocab);
  t0 = now();
  for (std::size_t i = 0; i < decode; ++i) (void)ref.forward(std::span(steps).subspan(i, 1));
  t.decode_tps = static_cast<double>(decode) / (now() - t0);
  return t;
}

// llama.cpp through a reference program (the prebuilt libraries, or those built here); nullopt when it is
// not there or fails.
// `lib_dir`, when given, is where the program loads llama.cpp's CPU backend variants from (one variant
// alone there: that one, or none where the CPU lacks its instructions).
std::optional<nlohmann::json> time_llama(const std::string& program, const std::string& path, std::size_t threads,
                                         std::size_t prompt, std::size_t decode, std::size_t reps,
                                         const std::string& lib_dir = "") {
  if (program.empty() || !fs::exists(program)) return std::nullopt;
  const std::string cmd = (lib_dir.empty() ? "" : "EFIM_LLAMA_LIB_DIR='" + lib_dir + "' ") + program + " bench " +
                          path + " --pp " + std::to_string(prompt) + " --tg " + std::to_string(decode) +
                          " --threads " + std::to_string(threads) + " --reps " + std::to_string(reps);
  const auto r = efim_test::run_command("(" + cmd + " 2>/dev/null)");  // its log on stderr is not wanted
  if (r.exit_code != 0) return std::nullopt;
  try {
    return nlohmann::json::parse(r.output.substr(r.output.find('{')));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Bytes of weights one decode step reads: every layer matrix and the output matrix (the embedding
// table is read one row a token).
double weight_bytes_per_token(const model::weights& w) {
  const auto bytes = [](const kernels::weight_view& m) {
    return m.data == nullptr ? 0.0 : static_cast<double>(m.rows * row_bytes(m.type, m.cols));
  };
  double total = 0;
  for (const auto* m : model::decode_matrices(w)) total += bytes(*m);
  return total;
}

// Memory bandwidth as STREAM's copy counts it (bytes read + bytes written per second): `threads` threads
// each copy their share of 2 x 512 MiB buffers, best of 5.
double copy_bandwidth(std::size_t threads) {
  const std::size_t n = std::size_t{512} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  thread_pool pool(threads);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
    pool.parallel_for(threads, [&](std::size_t begin, std::size_t end) {
      for (std::size_t t = begin; t < end; ++t) {
        const std::size_t lo = n / threads * t, hi = t + 1 == threads ? n : n / threads * (t + 1);
        std::memcpy(b.data() + lo, a.data() + lo, hi - lo);
      }
    });
    best = std::max(best, 2.0 * static_cast<double>(n) / (now() - t0));
    std::swap(a, b);
  }
  return best;
}

// Memory bandwidth for reading alone, which is what decode does with the weights: `threads` threads
// each scan their share of a 1 GiB buffer with glibc's memchr for a byte it does not hold (the C
// library's own vector loop, chosen for this CPU), best of 5. On some machines a read-only scan gets
// well under the copy's figure (an Intel Xeon VM: 58-61% of it in the same minute), so decode is
// shown against both.
double read_bandwidth(std::size_t threads) {
  const std::size_t n = std::size_t{1} << 30;
  std::vector<char> a(n, 1);
  thread_pool pool(threads);
  double best = 0;
  std::atomic<bool> found{false};
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
    pool.parallel_for(threads, [&](std::size_t begin, std::size_t end) {
      for (std::size_t t = begin; t < end; ++t) {
        const std::size_t lo = n / threads * t, hi = t + 1 == threads ? n : n / threads * (t + 1);
        if (std::memchr(a.data() + lo, 2, hi - lo) != nullptr) found = true;
      }
    });
    best = std::max(best, static_cast<double>(n) / (now() - t0));
  }
  if (found) throw std::logic_error("read_bandwidth: memchr found a byte the buffer does not hold");
  return best;
}

// The CPU's name and the vector extensions the kernels care about, from /proc/cpuinfo.
std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string name, flags;
  for (std::string line; std::getline(in, line);) {
    if (name.empty() && line.rfind("model name", 0) == 0) name = line.substr(line.find(':') + 2);
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = " " + line.substr(line.find(':') + 1) + " ";
  }
  std::string isa;
  for (const std::string f :
       {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd"})
    if (flags.find(" " + f + " ") != std::string::npos) {
      if (!isa.empty()) isa += ' ';
      isa += f;
    }
  if (name.empty()) name = "unknown CPU";
  name += " (";
  name += isa.empty() ? std::string("no vector extensions") : isa;
  name += ")";
  return name;
}

// The default models: made once into `dir` by the same maker as efim-model make.
std::vector<std::string> default_models(const fs::path& dir) {
  model::config c = model::for_architecture(model::architecture::qwen2);
  c.hidden = 768;
  c.layers = 12;
  c.heads = 12;
  c.kv_heads = 2;
  c.ffn = 2048;
  c.max_context = 32768;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6f;
  const std::string tokenizer = EFIM_DEFAULT_TOKENIZER;
  model::metadata vocab;
  if (fs::exists(tokenizer)) {
    vocab = model::vocabulary_metadata(tokenizer, 151936);
  } else {
    std::cerr << "efim-model-bench: no " << tokenizer << " (run .ci/setup); the models get no tokenizer, so "
              << "llama.cpp cannot load them\n";
  }
  c.vocab = 151936;
  fs::create_directories(dir);
  std::vector<std::string> paths;
  bool made = false;
  const model::random_spec specs[] = {
      {dtype::f16}, {dtype::q8_0}, {dtype::q4_0}, {dtype::q4_k, false, model::quant_mix::q4_k_m}};
  for (const auto& spec : specs) {
    const std::string format(spec.mix ? model::to_string(*spec.mix) : to_string(spec.type));
    const auto path = (dir / ("qwen2-768x12-" + format + ".gguf")).string();
    if (!fs::exists(path)) {
      std::cerr << "efim-model-bench: making " << path << "\n";
      model::write_file(path, model::random_model(c, 1, spec, vocab));
      made = true;
    }
    paths.push_back(path);
  }
  // The files' pages written back before anything is timed: in a run right after making them (1 GB),
  // the first model's decode tiles timing on a Zen 4 VM took 2.5x its usual time and turned its choice,
  // and no writeback should run under a timing.
  if (made) ::sync();
  return paths;
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models;
  std::string dir = "bench-models", json_path;
  std::size_t prompt_n = 512, decode_n = 128, threads = 2, reps = 3;
  dtype kv_type = dtype::f16;
  bool reference = true, llama = true, variants = false;
  gguf::residency residency = gguf::residency::map;
  bool int8 = true, int8_rows = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(a + " needs a value");
      return argv[++i];
    };
    const auto count = [&]() -> std::size_t {
      const std::string v = value();
      try {
        std::size_t used = 0;
        const auto n = std::stoul(v, &used);
        if (used == v.size() && n > 0 && v[0] != '-' && n <= (1u << 20)) return n;
      } catch (const std::exception&) {
      }
      fail(a + " needs a positive whole number, not '" + v + "'");
    };
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return 0;
    } else if (a == "--model") {
      models.push_back(value());
    } else if (a == "--dir") {
      dir = value();
    } else if (a == "--prompt") {
      prompt_n = count();
    } else if (a == "--decode") {
      decode_n = count();
    } else if (a == "--threads") {
      threads = count();
    } else if (a == "--reps") {
      reps = count();
    } else if (a == "--kv") {
      kv_type = parse_dtype(value());
    } else if (a == "--no-reference") {
      reference = false;
    } else if (a == "--no-llama") {
      llama = false;
    } else if (a == "--llama-variants") {
      variants = true;
    } else if (a == "--int8") {
      int8 = true;
    } else if (a == "--no-int8") {
      int8 = false;
    } else if (a == "--rows" || a == "--int8-rows") {
      int8_rows = true;
    } else if (a == "--no-mmap") {
      residency = gguf::residency::read;
    } else if (a == "--json") {
      json_path = value();
    } else {
      fail("unknown option " + a + " (see --help)");
    }
  }
  try {
    if (models.empty()) models = default_models(dir);
    const std::string cpu = cpu_description();
    const double bandwidth = copy_bandwidth(threads), read = read_bandwidth(threads);
    const std::string path(kernels::isa_name(kernels::active_isa())),
        int8_dot(kernels::int8_dot_name(kernels::int8_dot_for(kernels::active_isa())));
    std::printf(
        "cpu: %s, %zu threads\nkernels: the %s path (int8 products: %s); memory: %.1f GB/s copy bandwidth (read + "
        "write), %.1f GB/s read alone (memchr), %.0f%% of the copy\n",
        cpu.c_str(), threads, path.c_str(), int8_dot.c_str(), bandwidth / 1e9, read / 1e9, 100.0 * read / bandwidth);
    struct peer {
      std::string row, program, lib_dir;
    };
    std::vector<peer> peers = {{"llama", EFIM_LLAMA_REFERENCE, ""}, {"built", EFIM_LLAMA_NATIVE, ""}};
    // Each prebuilt CPU variant alone in a folder of its own, where the reference program loads it.
    const fs::path variant_root = fs::temp_directory_path() / ("efim-llama-variants-" + std::to_string(::getpid()));
    if (llama && variants && !std::string(EFIM_LLAMA_REFERENCE).empty() && fs::is_directory(EFIM_LLAMA_LIB_DIR)) {
      std::vector<fs::path> libs;
      for (const auto& e : fs::directory_iterator(EFIM_LLAMA_LIB_DIR)) {
        const std::string name = e.path().filename().string();
        if (name.starts_with("libggml-cpu-") && name.ends_with(".so")) libs.push_back(e.path());
      }
      std::sort(libs.begin(), libs.end());
      for (const auto& lib : libs) {
        const std::string name = lib.filename().string();
        const std::string variant = name.substr(12, name.size() - 15);
        const fs::path dir = variant_root / variant;
        fs::create_directories(dir);
        fs::create_symlink(lib, dir / name);
        peers.push_back({"cpu-" + variant, EFIM_LLAMA_REFERENCE, dir.string()});
      }
    }
    nlohmann::json results = nlohmann::json::array();
    std::printf("%-28s %-6s %12s %12s %12s %12s %9s %9s\n", "model", "path", "prefill t/s", "decode t/s", "prefill x",
                "decode x", "check", "");
    for (const auto& path : models) {
      const auto file = model::open_model(path, residency);
      const auto w = file.bind();
      const auto prompt = bench_tokens(prompt_n, w.cfg.vocab);
      const std::string name = fs::path(path).filename().string();
      // The one-row decode tiles of the model's types that have the choice, timed as the programs do
      // (model::tune_decode_tiles; exact products, so that q8_0's exact rows take it too).
      nlohmann::json tiles = nlohmann::json::array();
      {
        thread_pool tuning(threads);
        const double tune_start = now();
        // (With --rows the f16 and bf16 rows as stored are read too, so they are timed where interleaved.)
        model::decode_tuning_options tuning_options;
        if (int8_rows) tuning_options.floats_interleaved = false;
        std::vector<kernels::decode_tiles_timing> timed =
            model::tune_decode_tiles(tuning, w, kernels::products::exact, tuning_options);
        const double tune_s = now() - tune_start;
        std::vector<dtype> types;
        for (const auto* m : model::decode_matrices(w))
          if (m->data != nullptr && std::find(types.begin(), types.end(), m->type) == types.end())
            types.push_back(m->type);
        for (const dtype t : types) {
          if (!kernels::decode_tiles_apply(kernels::weight_view{t, 1, 32, nullptr})) continue;
          const kernels::decode_tiles kind = kernels::decode_tiles_for(t);
          const auto it = std::find_if(timed.begin(), timed.end(), [&](const auto& x) { return x.type == t; });
          nlohmann::json j = {{"type", std::string(to_string(t))}, {"tiles", kernels::decode_tiles_name(kind)}};
          if (it != timed.end()) {
            j["streams_over_prefetched"] = it->streams_over_prefetched();
            j["timed_matrices"] = it->matrices;
            j["timed_bytes"] = it->bytes;
            j["seconds_timing_all_types"] = tune_s;
            std::printf(
                "decode tiles, %s: the %s (timed on %zu matrices, %.0f MB a pass: the streams %.2fx the "
                "prefetched; %.0f ms timing)\n",
                std::string(to_string(t)).c_str(), kernels::decode_tiles_name(kind), it->matrices,
                static_cast<double>(it->bytes) / 1e6, it->streams_over_prefetched(), 1e3 * tune_s);
          } else {
            const char* why = kernels::active_decode_tiles() != kernels::decode_tiles::automatic ? "EFIM_DECODE_TILES"
                              : kernels::measured_decode_tiles(t) != kernels::decode_tiles::automatic
                                  ? "timed for an earlier model"
                              : tuning_options.floats_interleaved && kernels::interleavable_floats(t)
                                  ? "by vendor, not timed: the model reads its matrices interleaved"
                                  : "by vendor: too few bytes to time";
            std::printf("decode tiles, %s: the %s (%s)\n", std::string(to_string(t)).c_str(),
                        kernels::decode_tiles_name(kind), why);
          }
          tiles.push_back(std::move(j));
        }
      }
      std::vector<float> host_logits, ref_logits;
      // efim and llama.cpp take turns, one repetition each, so that both see the same machine (the
      // speed of a shared virtual machine drifts by 10-20% over minutes); the best of each is kept.
      timing host, host8, rows8, rows_exact;
      std::vector<float> int8_logits;
      const bool time8 = int8 && kernels::int8_products(w.type());
      const bool time_rows_exact =
          int8_rows && kernels::interleavable_floats(w.type()) && kernels::interleave_floats_by_default();
      std::vector<std::optional<nlohmann::json>> llama_best(peers.size());
      for (std::size_t rep = 0; rep < reps; ++rep) {
        std::vector<float> logits;
        const timing t = time_host(w, threads, kv_type, prompt, decode_n, logits);
        if (rep == 0) host_logits = std::move(logits);
        host.prefill_tps = std::max(host.prefill_tps, t.prefill_tps);
        host.decode_tps = std::max(host.decode_tps, t.decode_tps);
        if (time8) {
          const timing t8 = time_host(w, threads, kv_type, prompt, decode_n, logits, kernels::products::int8);
          if (rep == 0) int8_logits = std::move(logits);
          host8.prefill_tps = std::max(host8.prefill_tps, t8.prefill_tps);
          host8.decode_tps = std::max(host8.decode_tps, t8.decode_tps);
        }
        if (time_rows_exact) {
          const timing tr = time_host(w, threads, kv_type, prompt, decode_n, logits, kernels::products::exact,
                                      kernels::weight_layout::rows);
          rows_exact.prefill_tps = std::max(rows_exact.prefill_tps, tr.prefill_tps);
          rows_exact.decode_tps = std::max(rows_exact.decode_tps, tr.decode_tps);
        }
        if (time8 && int8_rows) {
          const timing tr = time_host(w, threads, kv_type, prompt, decode_n, logits, kernels::products::int8,
                                      kernels::weight_layout::rows);
          rows8.prefill_tps = std::max(rows8.prefill_tps, tr.prefill_tps);
          rows8.decode_tps = std::max(rows8.decode_tps, tr.decode_tps);
        }
        if (!llama) continue;
        for (std::size_t p = 0; p < peers.size(); ++p) {
          const auto l = time_llama(peers[p].program, path, threads, prompt_n, decode_n, 1, peers[p].lib_dir);
          if (!l) continue;
          // A variant's row only where that variant is the one that ran (its file named in the version).
          if (p > 1 && l->value("llama_cpp", std::string()).find("libggml-cpu-" + peers[p].row.substr(4) + ".so") ==
                           std::string::npos)
            continue;
          if (!llama_best[p]) {
            llama_best[p] = *l;
          } else {
            for (const char* key : {"pp_best", "tg_best"})
              (*llama_best[p])[key] = std::max((*llama_best[p])[key].get<double>(), l->at(key).get<double>());
          }
        }
      }
      const double decode_bytes = weight_bytes_per_token(w);
      nlohmann::json r = {{"model", path},
                          {"architecture", std::string(model::to_string(w.cfg.arch))},
                          {"weights", std::string(to_string(w.type()))},
                          {"kv", std::string(to_string(kv_type))},
                          {"threads", threads},
                          {"prompt", prompt_n},
                          {"decode", decode_n},
                          {"cpu", cpu},
                          {"kernels", path},
                          {"int8_dot", int8_dot},
                          {"copy_bandwidth_bytes_per_s", bandwidth},
                          {"read_bandwidth_bytes_per_s", read},
                          {"decode_weight_bytes_per_token", decode_bytes},
                          {"decode_tiles", tiles},
                          {"efim",
                           {{"prefill_tokens_per_s", host.prefill_tps},
                            {"decode_tokens_per_s", host.decode_tps},
                            {"decode_fraction_of_copy_bandwidth", host.decode_tps * decode_bytes / bandwidth},
                            {"decode_fraction_of_read_bandwidth", host.decode_tps * decode_bytes / read}}}};
      std::printf(
          "%-28s %-6s %12.1f %12.2f %25s decode reads %.1f GB/s of weights, %.0f%% of the copy bandwidth, %.0f%% of "
          "the read\n",
          name.c_str(), "efim", host.prefill_tps, host.decode_tps, "", host.decode_tps * decode_bytes / 1e9,
          100.0 * host.decode_tps * decode_bytes / bandwidth, 100.0 * host.decode_tps * decode_bytes / read);
      if (time8) {
        const float err = max_relative_error(int8_logits, host_logits);
        r["efim_int8"] = {{"prefill_tokens_per_s", host8.prefill_tps},
                          {"decode_tokens_per_s", host8.decode_tps},
                          {"prefill_logits_max_relative_error_against_exact", err},
                          {"decode_fraction_of_copy_bandwidth", host8.decode_tps * decode_bytes / bandwidth},
                          {"decode_fraction_of_read_bandwidth", host8.decode_tps * decode_bytes / read}};
        std::printf(
            "%-28s %-6s %12.1f %12.2f %11.2fx %11.2fx %9.1e; decode reads %.0f%% of the copy bandwidth, %.0f%% of the "
            "read\n",
            "", "int8", host8.prefill_tps, host8.decode_tps, host8.prefill_tps / host.prefill_tps,
            host8.decode_tps / host.decode_tps, static_cast<double>(err), 100.0 * host8.decode_tps * decode_bytes / bandwidth,
            100.0 * host8.decode_tps * decode_bytes / read);
      }
      if (time_rows_exact) {
        r["efim_rows_as_stored"] = {
            {"prefill_tokens_per_s", rows_exact.prefill_tps},
            {"decode_tokens_per_s", rows_exact.decode_tps},
            {"decode_fraction_of_copy_bandwidth", rows_exact.decode_tps * decode_bytes / bandwidth}};
        std::printf("%-28s %-6s %12.1f %12.2f %11.2fx %11.2fx %9s  decode reads %.0f%% of the copy bandwidth\n", "",
                    "rows", rows_exact.prefill_tps, rows_exact.decode_tps, host.prefill_tps / rows_exact.prefill_tps,
                    host.decode_tps / rows_exact.decode_tps, "",
                    100.0 * rows_exact.decode_tps * decode_bytes / bandwidth);
      }
      if (time8 && int8_rows) {
        r["efim_int8_rows_as_stored"] = {{"prefill_tokens_per_s", rows8.prefill_tps},
                                         {"decode_tokens_per_s", rows8.decode_tps},
                                         {"decode_fraction_of_read_bandwidth", rows8.decode_tps * decode_bytes / read}};
        std::printf("%-28s %-6s %12.1f %12.2f %11.2fx %11.2fx %9s  decode reads %.0f%% of the read\n", "", "rows",
                    rows8.prefill_tps, rows8.decode_tps, host8.prefill_tps / rows8.prefill_tps,
                    host8.decode_tps / rows8.decode_tps, "", 100.0 * rows8.decode_tps * decode_bytes / read);
      }
      if (reference) {
        const timing ref = time_reference(w, prompt, decode_n, ref_logits);
        const float err = max_relative_error(host_logits, ref_logits);
        r["reference"] = {{"prefill_tokens_per_s", ref.prefill_tps},
                          {"decode_tokens_per_s", ref.decode_tps},
                          {"efim_vs_reference_max_relative_error", err}};
        r["efim_over_reference"] = {{"prefill", host.prefill_tps / ref.prefill_tps},
                                    {"decode", host.decode_tps / ref.decode_tps}};
        std::printf("%-28s %-6s %12.1f %12.2f %11.1fx %11.1fx %9.1e\n", "", "ref", ref.prefill_tps, ref.decode_tps,
                    host.prefill_tps / ref.prefill_tps, host.decode_tps / ref.decode_tps, static_cast<double>(err));
      }
      if (llama) {
        for (std::size_t p = 0; p < peers.size(); ++p) {
          // A variant's row: its name in the model column, "llama" in the path column.
          const std::string first = p > 1 ? "  variant " + peers[p].row.substr(4) : "";
          const char* row = p > 1 ? "llama" : peers[p].row.c_str();
          const std::string key = p == 0 ? "llama_cpp" : p == 1 ? "llama_cpp_native" : "llama_cpp_" + peers[p].row;
          if (const auto& l = llama_best[p]) {
            const double pp = l->at("pp_best").get<double>(), tg = l->at("tg_best").get<double>();
            r[key] = *l;
            r[key]["reps"] = reps;
            r["efim_over_" + key] = {{"prefill", host.prefill_tps / pp}, {"decode", host.decode_tps / tg}};
            // The programs' default for quantized weights (int8) over this row too.
            char int8_text[64] = "";
            if (time8) {
              r["efim_int8_over_" + key] = {{"prefill", host8.prefill_tps / pp}, {"decode", host8.decode_tps / tg}};
              std::snprintf(int8_text, sizeof int8_text, "   int8 %.2fx / %.2fx", host8.prefill_tps / pp,
                            host8.decode_tps / tg);
            }
            std::printf("%-28s %-6s %12.1f %12.2f %11.2fx %11.2fx%s\n", first.c_str(), row, pp, tg,
                        host.prefill_tps / pp, host.decode_tps / tg, int8_text);
          } else if (p == 0) {
            std::printf("%-28s %-6s (not available: build efim-llama-reference after .ci/setup)\n", "", row);
          } else if (p > 1) {
            std::printf("%-28s %-6s (not loadable: this CPU lacks its instructions)\n", first.c_str(), row);
          } else {
            std::printf("%-28s %-6s (not available: bench/build_llama_cpp.sh, then cmake again)\n", "", row);
          }
        }
      }
      results.push_back(r);
      std::fflush(stdout);
    }
    std::printf(
        "(x: efim's tokens/s over that row's; check: efim's prefill logits against the reference's; llama:\n"
        " llama.cpp's prebuilt CPU libraries; built: llama.cpp built here by bench/build_llama_cpp.sh;\n"
        " int8: efim with int8 products (the programs' default for quantized weights), x over efim's exact\n"
        " products, check against their logits; on llama.cpp's rows, int8's tokens/s over theirs; rows\n"
        " (--int8-rows): int8 on the matrices as stored, x: int8's tokens/s over its)\n");
    if (!results.empty())
      for (const char* key : {"llama_cpp", "llama_cpp_native"})
        if (results.back().contains(key))
          std::printf("%s: %s\n", key, results.back()[key].value("llama_cpp", std::string("?")).c_str());
    fs::remove_all(variant_root);
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << results.dump(2) << "\n";
      if (!f) fail("cannot write " + json_path);
    }
    return 0;
  } catch (const std::exception& e) {
    fail(e.what());
  }
}
